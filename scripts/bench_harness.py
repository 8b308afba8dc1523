"""The one harness the benchmark scripts share: process setup, clocks and timing loops, statistics, memory, machine
description and output.

Every ``scripts/bench_*.py`` (and ``gpu_acceptance.py`` / ``gpu_sync_check.py``) times, describes the machine and
writes its results through these functions, so that two scripts that report "median ms per step" or "peak memory"
measure them the same way. Standard library and torch only, so that a script runs where hf_mixedprec, transformers
or accelerate are missing (a function that needs one of them imports it when called, and says so). A script run as
``python scripts/X.py`` has this folder on ``sys.path``: ``import bench_harness`` works from any of them.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import logging
import os
import platform
import random
import statistics
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

T = TypeVar("T")


# -- process setup ---------------------------------------------------------------------------------------------
def seed_all(seed: int = 0) -> None:
    """Seed Python's and torch's generators (CPU and every CUDA device), so every variant starts from the same
    weights and data."""
    random.seed(seed)
    torch.manual_seed(seed)


def set_threads(threads: int | None, *, interop: int | None = None) -> None:
    """``torch.set_num_threads(threads)`` (``None``: leave torch's own) and, with ``interop``, the inter-op pool;
    the latter can be set only once per process, so a second call keeps the first setting."""
    if threads:
        torch.set_num_threads(threads)
    if interop is not None:
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(interop)


def pin_cpu(choice: int) -> int | None:
    """Pin this process to one CPU: ``-1`` the last one it may use, ``-2`` none (returns None), else that CPU.
    Two sides timed against each other then run on the same core (vCPUs of a VM need not be equally fast).
    Raises ValueError for a CPU this process may not use."""
    if choice == -2 or not hasattr(os, "sched_setaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    cpu = allowed[-1] if choice == -1 else choice
    if cpu not in allowed:
        raise ValueError(f"--cpu {cpu}: this process may use CPUs {allowed}")
    os.sched_setaffinity(0, {cpu})
    return cpu


def quiet(loggers: Iterable[str] = ("hf_mixedprec", "transformers")) -> None:
    """Only errors from these loggers, and no Python warnings: notes that repeat every round would drown the
    progress lines on stderr."""
    for name in loggers:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send everything printed inside the block (library banners and warnings, at the file-descriptor level) to
    stderr, so that stdout holds only the results: the table, or the JSON that callers parse."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def reset_accelerate() -> None:
    """Accelerate keeps process-wide state; every Trainer or Accelerator built after this starts from a clean one.
    Imports accelerate."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


# -- clocks and timing loops -----------------------------------------------------------------------------------
class Sample(NamedTuple):
    """One timed call: wall seconds (``perf_counter``) and this process's CPU seconds (``process_time``)."""

    wall: float
    cpu: float


def stamp() -> Sample:
    """Both clocks now (wall first)."""
    return Sample(time.perf_counter(), time.process_time())


def measure(fn: Callable[..., object], *args: Any) -> Sample:
    """Wall and process CPU seconds of one call ``fn(*args)``. CPU time leaves out what else ran on a shared or
    virtual machine; wall time includes it."""
    c0, w0 = time.process_time(), time.perf_counter()
    fn(*args)
    c1, w1 = time.process_time(), time.perf_counter()
    return Sample(w1 - w0, c1 - c0)


def cpu_seconds(fn: Callable[..., object], *args: Any) -> float:
    """Process CPU seconds of one call ``fn(*args)`` (one clock read either side: for microsecond-sized work)."""
    t0 = time.process_time()
    fn(*args)
    return time.process_time() - t0


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing on a CPU. Called on both sides of a timed region, so a
    step's time is its device time, not its launch time."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(
    step: Callable[[T], object],
    inputs: Sequence[T],
    *,
    warmup: int,
    steps: int,
    sync: Callable[[], object] | None = None,
) -> list[float]:
    """Call ``step`` on ``inputs`` in turn (cycling) ``warmup + steps`` times; the wall seconds of the last
    ``steps`` calls. ``sync`` runs before and after each call (outside and inside the clock respectively:
    queued work from before is not counted, the step's own is)."""
    times = []
    for i in range(warmup + steps):
        item = inputs[i % len(inputs)]
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        step(item)
        if sync is not None:
            sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def interleaved(fns: Mapping[str, Callable[[], object]], rounds: int, *, warmup: int = 1) -> dict[str, list[float]]:
    """Wall seconds of each callable over ``rounds`` rounds, each round calling every one in turn (after
    ``warmup`` untimed rounds): load on the machine then hits every callable alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def abba(i: int) -> bool:
    """Whether side A goes first in round ``i`` of an A B, B A, B A, A B, ... sequence: each side goes first as
    often as second, balanced against the parity of the round too."""
    return i % 4 in (0, 3)


def rotated(names: Sequence[T], r: int) -> list[T]:
    """``names`` rotated by ``r``: who goes first changes every round."""
    k = r % len(names)
    return [*names[k:], *names[:k]]


class StepClock:
    """Both clocks at every step boundary (call :meth:`tick` at each step's start); a step's time is the gap
    between consecutive ticks, so everything between two step starts counts."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def begin(self) -> None:
        """Training is about to start (a lone clock has nothing to do)."""

    def tick(self) -> None:
        """A step starts now."""
        now = stamp()
        self.wall.append(now.wall)
        self.cpu.append(now.cpu)

    def end(self) -> None:
        """Training has ended (a lone clock has nothing to do)."""

    def durations(self) -> tuple[list[float], list[float]]:
        """Wall and CPU seconds of every step between two ticks."""
        return _gaps(self.wall), _gaps(self.cpu)


def _gaps(stamps: list[float]) -> list[float]:
    """Differences between consecutive stamps."""
    return [b - a for a, b in itertools.pairwise(stamps)]


class Turns:
    """The turn shared by runs in lockstep (one thread each): one runs at a time, in a fixed cycle, so step k of
    every run happens back to back and load on a shared machine hits them alike."""

    def __init__(self, names: list[str]):
        self.names = names
        self.go = {n: threading.Event() for n in names}
        self.parked = {n: threading.Event() for n in names}
        self.done: set[str] = set()
        self.lock = threading.Lock()

    def hand_on(self, me: str) -> None:
        """Give the turn to the next run that has not finished (or keep it when all others have)."""
        with self.lock:
            i = self.names.index(me)
            for k in range(1, len(self.names) + 1):
                nxt = self.names[(i + k) % len(self.names)]
                if nxt not in self.done:
                    break
            if nxt != me:
                self.go[nxt].set()
                return
        self.go[me].set()

    def wait(self, me: str) -> None:
        """Block until ``me`` has the turn."""
        self.go[me].wait()
        self.go[me].clear()

    def finish(self, me: str) -> None:
        """``me`` is done: it leaves the cycle and hands its turn on."""
        with self.lock:
            self.done.add(me)
        if len(self.done) < len(self.names):
            self.hand_on(me)

    def abort(self) -> None:
        """A run failed: release everyone so that no thread waits forever."""
        with self.lock:
            self.done.update(self.names)
        for e in (*self.go.values(), *self.parked.values()):
            e.set()


class LockstepClock(StepClock):
    """A :class:`StepClock` for one run in lockstep: it times this run's steps only, from getting the turn to
    handing it on at the next tick (the other runs' turns are left out)."""

    def __init__(self, name: str, turns: Turns):
        super().__init__()
        self.name, self.turns = name, turns
        self._start: Sample | None = None

    def begin(self) -> None:
        """Park until the first turn (setup of the next run starts once this one is parked)."""
        self.turns.parked[self.name].set()
        self.turns.wait(self.name)

    def tick(self) -> None:
        """This run's step ends: record it, hand the turn on, and start the clock again when it comes back."""
        now = stamp()
        if self._start is not None:
            self.wall.append(now.wall - self._start.wall)
            self.cpu.append(now.cpu - self._start.cpu)
        self.turns.hand_on(self.name)
        self.turns.wait(self.name)
        self._start = stamp()

    def end(self) -> None:
        """This run is done: the others go on without it."""
        self.turns.finish(self.name)

    def durations(self) -> tuple[list[float], list[float]]:
        return self.wall, self.cpu


def run_in_lockstep(turns: Turns, jobs: Mapping[str, Callable[[], object]]) -> None:
    """Run every job (keyed by its name in ``turns``; each drives a :class:`LockstepClock`) in its own thread, in
    lockstep. Setup is serialised: a thread starts once the previous one is parked in :meth:`LockstepClock.begin`
    (process-wide state such as Accelerate's is shared). The first error of any thread stops the others and is
    raised here."""
    errors: list[BaseException] = []

    def run(job: Callable[[], object]) -> None:
        try:
            job()
        except BaseException as exc:  # re-raised in the main thread
            errors.append(exc)
            turns.abort()

    threads = {n: threading.Thread(target=run, args=(job,), daemon=True) for n, job in jobs.items()}
    for n, th in threads.items():
        th.start()
        turns.parked[n].wait()
    turns.go[turns.names[0]].set()
    for th in threads.values():
        th.join()
    if errors:
        raise errors[0]


# -- statistics -----------------------------------------------------------------------------------------------
def ms_summary(seconds: Sequence[float]) -> dict[str, float]:
    """Median, mean and standard deviation in milliseconds, and the count, of per-step seconds."""
    return {
        "median_ms": statistics.median(seconds) * 1e3,
        "mean_ms": statistics.fmean(seconds) * 1e3,
        "stdev_ms": (statistics.stdev(seconds) if len(seconds) > 1 else 0.0) * 1e3,
        "n": len(seconds),
    }


def paired_ratios(num: Iterable[float], den: Iterable[float], *, strict: bool = False) -> list[float]:
    """``num[i] / den[i]`` for steps measured back to back; ``strict``: the two must be as long."""
    return [a / b for a, b in zip(num, den, strict=strict)]


# -- memory ---------------------------------------------------------------------------------------------------
class Skip(Exception):
    """A benchmark row that cannot run here; the message says why (the row is reported as skipped, with it)."""


@contextlib.contextmanager
def row_outcome(row: dict[str, Any]) -> Iterator[None]:
    """Around one benchmark row: :class:`Skip` marks it skipped with the reason; any other exception marks it an
    error (its type and first line, the traceback on stderr) instead of ending the run: a real failure must show in
    the table."""
    try:
        yield
    except Skip as exc:
        row.update(status="skipped", reason=str(exc))
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        row.update(status="error", reason=f"{type(exc).__name__}: {first}"[:400])
        traceback.print_exc(file=sys.stderr)


def release_memory(device: torch.device) -> None:
    """Free what the last variant left (garbage, CUDA's cache, compiled graphs) and restart the peak-memory count,
    so the next variant's peak is its own."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    with contextlib.suppress(Exception):
        torch._dynamo.reset()


def cuda_peak_gib(device: torch.device) -> float | None:
    """Peak CUDA memory allocated by tensors since the last reset, in GiB; None on a CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


def rss_mib(key: str = "VmRSS") -> float:
    """This process's ``VmRSS`` (resident set) or ``VmHWM`` (its peak) from ``/proc/self/status``, in MiB."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def reset_peak_rss() -> None:
    """Restart the peak RSS (``VmHWM``) at the present RSS (``echo 5 > /proc/self/clear_refs``, Linux's
    ``proc(5)``); where that is not allowed, nothing changes (compare ``VmHWM`` with ``VmRSS`` to tell)."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")


class OpCounter(TorchDispatchMode):
    """Counts tensor operations while active: one per aten call (a foreach op counts once); ``views=False`` leaves
    out the views, which only describe memory: what is left launches a kernel each (what a GPU would launch)."""

    def __init__(self, *, views: bool = True) -> None:
        super().__init__()
        self.n = 0
        self.views = views

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.views or not func.is_view:
            self.n += 1
        return func(*args, **(kwargs or {}))


# -- machine --------------------------------------------------------------------------------------------------
def cpu_name() -> str:
    """The CPU model as ``lscpu`` names it (``/proc/cpuinfo``), else what ``platform`` knows."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def library_versions(names: Iterable[str]) -> dict[str, str | None]:
    """Each package's ``__version__`` (imports it), None where it is missing or broken."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = __import__(name).__version__
        except Exception:  # not installed, or a broken install: say so
            out[name] = None
    return out


def machine(device: torch.device | None = None, *, libraries: Iterable[str] = ()) -> dict[str, Any]:
    """What the figures were measured on: CPU, cores, torch threads, torch and CUDA versions, the device (a GPU's
    name, or ``cpu``; default: CUDA where there is one), a GPU's compute capability, and ``libraries``' versions."""
    dev = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = dev.type == "cuda"
    out: dict[str, Any] = {
        "cpu": cpu_name(),
        # AVX2 / AVX512 and whether BF16 is native: a CPU without it runs BF16 GEMMs several times slower than FP32
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_bf16": cpu_bf16_line(),
        "cores": os.cpu_count(),
        "allowed_cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "python": platform.python_version(),
    }
    if cuda:
        out["capability"] = ".".join(map(str, torch.cuda.get_device_capability(dev)))
    out.update(library_versions(libraries))
    return out


def cpu_bf16_line() -> str:
    """Whether this CPU computes BF16 natively, as ``hf-mixedprec detect`` says it (``native: ...`` / ``emulated:
    bf16 GEMM 10.5x slower than fp32 on this CPU (AVX2: no AVX512-BF16, no AMX)``)."""
    from hf_mixedprec.recipes.hardware import cpu_gemm_speed

    speed = cpu_gemm_speed("bf16")
    return f"{'native' if speed.native else 'emulated'}: {speed.describe()}"


def machine_line(m: Mapping[str, Any], *, allowed: bool = False) -> str:
    """``m`` (:func:`machine`) in one line for a table's heading; ``allowed``: the CPUs this process may use too."""
    cores = f"{m['cores']} cores" + (f" (allowed: {m['allowed_cpus']})" if allowed else "")
    capability = f" ({m['cpu_capability']}; BF16 {m['cpu_bf16']})" if m.get("cpu_capability") else ""
    return f"{m['cpu']}{capability}, {cores}, {m['torch_threads']} torch threads, torch {m['torch']}"


# -- output ---------------------------------------------------------------------------------------------------
def md_row(cells: Iterable[object]) -> str:
    """One markdown table row."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def md_table(header: Sequence[str], align: str, rows: Iterable[Iterable[object]]) -> str:
    """A markdown table; ``align`` has one letter per column: ``l`` (``---``) or ``r`` (``---:``)."""
    if len(align) != len(header):
        raise ValueError(f"align {align!r} has {len(align)} columns, the header {len(header)}")
    rule = md_row("---:" if a == "r" else "---" for a in align)
    return "\n".join([md_row(header), rule, *(md_row(r) for r in rows)])


def write_json(path: str | os.PathLike[str], doc: Any, *, indent: int = 2, default: Any = None) -> None:
    """Write ``doc`` as JSON to ``path`` (``--out``)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=indent, default=default)


def report(doc: Any, *, out: str | None, as_json: bool, render: Callable[[], str]) -> None:
    """The usual ending: write ``doc`` to ``out`` (``--out FILE``) if given; then print it as JSON (``--json``)
    or print ``render()`` (the heading and the table)."""
    if out:
        write_json(out, doc)
    if as_json:
        print(json.dumps(doc, indent=2))
        return
    print(render())
