"""Step time of a plain Hugging Face ``Trainer`` vs the same ``Trainer`` with hf_mixedprec's callbacks.

Both sides train the same model (same seed, same data, same batch) at the same precision, in one process:

- baseline: what a user without hf_mixedprec runs: ``TrainingArguments(bf16=True)`` (Trainer's BF16 autocast
  and its default ``max_grad_norm=1.0`` norm clipping), no extra callbacks;
- ours: ``recipe.training_args(...)`` + ``recipe.callbacks()``: the recipe's clipper (ZClip for ``cpu-bf16``)
  instead of Trainer's clipping, the health detectors, the scale-1 guard GradScaler that makes
  ``skip_step`` reactions exact, the ``mp/...`` metrics at logging steps.

FP16 recipes rehearsed on CPU: the baseline gets what ``Trainer(fp16=True)`` runs on a GPU (Accelerate's
native AMP, autocast(float16) and a default ``GradScaler``), switched on the same way the callback does, since
Accelerate ignores fp16 on CPU. FP8 recipes: the baseline model is converted to (emulated) FP8 and advances
delayed scaling after each step, so both sides pay for the FP8 layers and only the callbacks differ.

Interleaving (``--interleave``):

- ``step`` (default): both Trainers run at once, in lockstep: each runs in its own thread and they hand a
  turn back and forth at every ``on_step_begin``, so step k of one side and step k of the other run back to
  back and only one of them runs at any time. Load on a shared machine, CPU frequency and thermal drift then
  hit both sides alike, step by step; a repetition's ratio is the median of the per-step ratios.
- ``run``: whole runs alternate; drift within a run is not cancelled.

Which side goes first alternates A B, B A, B A, A B, ... The process is pinned to one CPU (``--cpu``; in
lockstep only one side runs at a time anyway): on a 2-vCPU virtual machine the two threads otherwise landed
on different vCPUs that were not equally fast.

``--control`` adds a row that pits the baseline against itself the same way: its ratio is what the
measurement reads when nothing differs, so it says how far from 1.0 a ratio must be to mean anything.

A step's time is the time between consecutive ``on_step_begin`` events (forward, backward, clipping,
optimizer, scheduler, every callback's ``on_step_end`` and logging, and loading the next batch), with the
other side's turn taken out in lockstep mode; the first ``--warmup`` steps of each repetition are discarded.
With ``--log-every 0`` (default) Trainer logs only at the last step, so the measured steps are non-logging
steps; ``--log-every 10`` measures with a log every 10 steps. Both the process CPU time and the wall time of
each step are recorded; the headline ratio is the CPU-time one, since on a shared or virtual machine wall
time also counts the moments the machine ran something else (time stolen from the virtual CPU).

Threads: one by default (``--threads``). What is measured, the per-step work hf_mixedprec adds, runs on one
thread; a 0.1M-parameter model gains nothing from more, and on a shared 2-core machine OpenMP's waits between
threads made steps up to 30x slower at random, on either side (ratios per round from 0.03 to 38).

    python scripts/bench_overhead.py                       # cpu-bf16, tiny Llama
    python scripts/bench_overhead.py --model tiny small --log-every 0 10 --steps 100 --repeats 16 --control
    python scripts/bench_overhead.py --json --out overhead.json
    python scripts/bench_overhead.py --hooks --recipe cpu-bf16 v100-fp16 h100-fp8-delayed --layers 2 8 16

``--hooks`` measures the hooks directly instead: a loop drives ``MixedPrecisionRuntime`` as the Trainer callback
does, and each hook (``begin_step``, ``before_optimizer_step``, ``after_optimizer_step``, and ``check`` +
``metrics`` on a logging step) is timed on its own (median microseconds of process CPU time) and its tensor
operations counted (a ``TorchDispatchMode``: one per aten call, a foreach op counting once), for a non-logging
step, a logging step and an FP8-sampled step, on Llamas of ``--layers`` blocks (7 Linears each).
"""

from __future__ import annotations

import hf_mixedprec  # first: it quiets known backend noise before transformers imports torchao

# isort: split

import argparse
import contextlib
import itertools
import json
import logging
import math
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import warnings
from typing import Any

import torch
import torch.utils._python_dispatch
from torch.utils.data import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_mixedprec._stdio import stdout_to_stderr
from hf_mixedprec.demo import builtin_text, byte_batches, tiny_llama
from hf_mixedprec.hardware import HardwareRefusal

MODELS = ("tiny", "small")


class Bytes(Dataset):
    """Fixed-length byte rows cut from the standard library's docstrings (as tests/test_integration.py)."""

    def __init__(self, n: int, seq_len: int, seed: int = 0):
        text = builtin_text()
        self.rows = [b[0] for b in byte_batches(text, seq_len=seq_len, batch_size=1, n_batches=n, seed=seed)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class StepTimer(TrainerCallback):
    """Wall and process CPU time between consecutive ``on_step_begin`` events: one full step, every callback
    included."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())

    @staticmethod
    def _diff(stamps: list[float]) -> list[float]:
        return [b - a for a, b in itertools.pairwise(stamps)]

    def durations(self) -> tuple[list[float], list[float]]:
        return self._diff(self.wall), self._diff(self.cpu)


class Turns:
    """The turn shared by Trainers run in lockstep: one runs at a time, in a fixed cycle."""

    def __init__(self, names: list[str]):
        self.names = names
        self.go = {n: threading.Event() for n in names}
        self.parked = {n: threading.Event() for n in names}
        self.done: set[str] = set()
        self.lock = threading.Lock()

    def hand_on(self, me: str) -> None:
        """Give the turn to the next side that has not finished (or keep it when all others have)."""
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
        self.go[me].wait()
        self.go[me].clear()

    def finish(self, me: str) -> None:
        with self.lock:
            self.done.add(me)
        if len(self.done) < len(self.names):
            self.hand_on(me)

    def abort(self) -> None:
        """A side failed: release everyone so that no thread waits forever."""
        with self.lock:
            self.done.update(self.names)
        for e in (*self.go.values(), *self.parked.values()):
            e.set()


class LockstepTimer(StepTimer):
    """Times this side's steps only: the clock runs from getting the turn to handing it on."""

    def __init__(self, name: str, turns: Turns):
        super().__init__()
        self.name, self.turns = name, turns
        self._start: tuple[float, float] | None = None
        self._wall_acc, self._cpu_acc = 0.0, 0.0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.turns.parked[self.name].set()
        self.turns.wait(self.name)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        now = (time.perf_counter(), time.process_time())
        if self._start is not None:
            self.wall.append(now[0] - self._start[0])
            self.cpu.append(now[1] - self._start[1])
        self.turns.hand_on(self.name)
        self.turns.wait(self.name)
        self._start = (time.perf_counter(), time.process_time())

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.turns.finish(self.name)

    def durations(self) -> tuple[list[float], list[float]]:
        return self.wall, self.cpu


class AdvanceFP8(TrainerCallback):
    """Baseline for FP8 recipes: advance delayed scaling after each step (part of the precision, not ours)."""

    def on_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        from hf_mixedprec.fp8 import fp8_step

        fp8_step(model)


def build_model(kind: str) -> torch.nn.Module:
    if kind == "tiny":
        return tiny_llama(seed=0)
    try:
        from hf_mixedprec.demo import small_llama
    except ImportError:  # an older checkout without small_llama: the same dims
        return tiny_llama(
            seed=0,
            hidden_size=256,
            intermediate_size=704,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
        )
    return small_llama(seed=0)


def load(name: str, rehearse: bool) -> tuple[Any, bool]:
    """The recipe; one this machine cannot run is rehearsed (said on stderr), unless --no-rehearse."""
    try:
        return hf_mixedprec.load_recipe(name), False
    except HardwareRefusal as exc:
        if not rehearse:
            raise
        print(f"note: {name}: {str(exc).splitlines()[0]} -> rehearsed", file=sys.stderr)
        return hf_mixedprec.load_recipe(name, rehearse=True), True


def reset_accelerate() -> None:
    """Accelerate keeps process-wide state; every Trainer starts from a clean one."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def build_trainer(
    side: str,
    recipe: Any,
    model_kind: str,
    data: Dataset,
    opts: argparse.Namespace,
    log_every: int,
    timer: StepTimer,
    workdir: str,
) -> Trainer:
    """A Trainer for ``--warmup + --steps + 1`` steps of one side ("baseline" or "ours")."""
    model = build_model(model_kind)
    max_steps = opts.warmup + opts.steps + 1  # +1: a step's end is the next step's begin
    common: dict[str, Any] = {
        "output_dir": workdir,
        "max_steps": max_steps,
        "per_device_train_batch_size": opts.batch_size,
        "learning_rate": 1e-3,
        "logging_steps": log_every if log_every > 0 else max_steps,
        "report_to": [],
        "save_strategy": "no",
        "disable_tqdm": True,
        "seed": 0,
        "dataloader_num_workers": 0,
    }
    callbacks: list[TrainerCallback] = [timer]
    on_cuda = torch.cuda.is_available()
    if side == "ours":
        args = recipe.training_args(**common)
        callbacks += recipe.callbacks()
    else:
        p = recipe.precision
        flags: dict[str, Any] = {"bf16": p in ("bf16", "fp8"), "fp16": p == "fp16" and on_cuda}
        if not on_cuda:
            flags["use_cpu"] = True
        args = TrainingArguments(**common, **flags)  # Trainer's default max_grad_norm=1.0
        if p == "fp8":
            from hf_mixedprec.fp8 import convert

            convert(model, recipe, backend="emulated" if recipe.rehearse or not on_cuda else None)
            callbacks.append(AdvanceFP8())
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    if side == "baseline" and recipe.precision == "fp16" and not on_cuda:
        # what Trainer(fp16=True) runs on a GPU; Accelerate ignores fp16 on CPU, so switch its native path on
        from hf_mixedprec.integrations.accelerate_plugin import enable_native_fp16

        enable_native_fp16(trainer.accelerator, torch.amp.GradScaler("cpu"))
    return trainer


def run_once(
    side: str, recipe: Any, model_kind: str, data: Dataset, opts: argparse.Namespace, log_every: int
) -> tuple[list[float], list[float]]:
    """One training run on its own; the measured steps' wall and CPU seconds."""
    reset_accelerate()
    timer = StepTimer()
    build_trainer(side, recipe, model_kind, data, opts, log_every, timer, opts.workdir).train()
    wall, cpu = timer.durations()
    return wall[opts.warmup :], cpu[opts.warmup :]


def run_lockstep(
    sides: list[str], recipe: Any, model_kind: str, data: Dataset, opts: argparse.Namespace, log_every: int
) -> list[tuple[list[float], list[float]]]:
    """Trainers for ``sides`` (e.g. baseline, ours) in lockstep threads; each one's measured wall and CPU seconds.

    Setup is serialised too: a side's thread starts only once the previous one is parked at ``on_train_begin``
    (Accelerate's process-wide state is shared, and both sides ask it for the same thing).
    """
    reset_accelerate()
    names = [f"{i}:{s}" for i, s in enumerate(sides)]
    turns = Turns(names)
    timers = [LockstepTimer(n, turns) for n in names]
    trainers = [
        build_trainer(s, recipe, model_kind, data, opts, log_every, t, os.path.join(opts.workdir, n.replace(":", "_")))
        for s, t, n in zip(sides, timers, names)
    ]
    train_in_lockstep(turns, dict(zip(names, trainers)))
    return [(t.wall[opts.warmup :], t.cpu[opts.warmup :]) for t in timers]


def train_in_lockstep(turns: Turns, trainers: dict[str, Trainer]) -> None:
    """Train every Trainer (keyed by its name in ``turns``) in its own thread, in lockstep. Setup is serialised: a
    thread starts once the previous one is parked at ``on_train_begin`` (Accelerate's state is process-wide). The
    first error of any thread stops the others and is raised here."""
    errors: list[BaseException] = []

    def train(tr: Trainer) -> None:
        try:
            tr.train()
        except BaseException as exc:  # re-raised in the main thread
            errors.append(exc)
            turns.abort()

    threads = {n: threading.Thread(target=train, args=(tr,), daemon=True) for n, tr in trainers.items()}
    for n, th in threads.items():
        th.start()
        turns.parked[n].wait()
    turns.go[turns.names[0]].set()
    for th in threads.values():
        th.join()
    if errors:
        raise errors[0]


def describe(ts: list[float]) -> dict[str, float]:
    return {
        "median_ms": statistics.median(ts) * 1e3,
        "mean_ms": statistics.fmean(ts) * 1e3,
        "stdev_ms": (statistics.stdev(ts) if len(ts) > 1 else 0.0) * 1e3,
        "n": len(ts),
    }


def bench(
    recipe: Any,
    rehearsed: bool,
    model_kind: str,
    log_every: int,
    opts: argparse.Namespace,
    data: Dataset,
    control: bool = False,
) -> dict:
    """``control``: the baseline against a second baseline ("ours" is then a plain Trainer too)."""
    wall: dict[str, list[float]] = {"baseline": [], "ours": []}
    cpu: dict[str, list[float]] = {"baseline": [], "ours": []}
    round_ratios: list[float] = []  # CPU time
    round_ratios_wall: list[float] = []
    other = "baseline" if control else "ours"
    for r in range(opts.repeats):
        # A B, B A, B A, A B, ...: which side runs first is balanced against the parity of the round, since
        # memory reused from the previous round favoured one of the two models every other round
        order = ("baseline", "ours") if r % 4 in (0, 3) else ("ours", "baseline")
        got: list[tuple[list[float], list[float]]]
        if opts.interleave == "step":
            got = run_lockstep([other if s == "ours" else s for s in order], recipe, model_kind, data, opts, log_every)
        else:
            got = [run_once(other if s == "ours" else s, recipe, model_kind, data, opts, log_every) for s in order]
        this_wall = {side: w for side, (w, _) in zip(order, got)}
        this_cpu = {side: c for side, (_, c) in zip(order, got)}
        for side in order:
            wall[side] += this_wall[side]
            cpu[side] += this_cpu[side]
        for ratios, this in ((round_ratios, this_cpu), (round_ratios_wall, this_wall)):
            if opts.interleave == "step":  # step k of one side next to step k of the other
                ratios.append(statistics.median(o / b for o, b in zip(this["ours"], this["baseline"])))
            else:
                ratios.append(statistics.median(this["ours"]) / statistics.median(this["baseline"]))
        print(
            f"  {'control ' if control else ''}{recipe.name} {model_kind} log_every={log_every} "
            f"round {r + 1}/{opts.repeats}: ratio {round_ratios[-1]:.3f} (CPU time), {round_ratios_wall[-1]:.3f} (wall)",
            file=sys.stderr,
        )
    base, ours = describe(wall["baseline"]), describe(wall["ours"])
    base_cpu, ours_cpu = describe(cpu["baseline"]), describe(cpu["ours"])
    return {
        "recipe": recipe.name,
        "control": control,
        "rehearsed": rehearsed,
        "model": model_kind,
        "params": sum(p.numel() for p in build_model(model_kind).parameters()),
        "log_every": log_every,
        "baseline": base,
        "ours": ours,
        "baseline_cpu": base_cpu,
        "ours_cpu": ours_cpu,
        "ratio_median": ours["median_ms"] / base["median_ms"],
        "ratio_mean": ours["mean_ms"] / base["mean_ms"],
        "ratio_cpu_median": ours_cpu["median_ms"] / base_cpu["median_ms"],
        "ratio_rounds_median": statistics.median(round_ratios),
        "ratio_rounds_median_wall": statistics.median(round_ratios_wall),
        "round_ratios": round_ratios,
        "round_ratios_wall": round_ratios_wall,
    }


def cpu_name() -> str:
    """The CPU model as ``lscpu`` names it (``/proc/cpuinfo``), else what ``platform`` knows."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "python": platform.python_version(),
    }


def table(rows: list[dict]) -> str:
    out = [
        "| recipe | model | logging | baseline ms/step (median) | ours ms/step (median) "
        "| ratio, CPU time (median of rounds) | ratio, wall time (median of rounds) | per-round ratios (CPU time) |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        b, o = r["baseline"], r["ours"]
        name = r["recipe"] + (" (rehearsed)" if r["rehearsed"] else "")
        if r.get("control"):
            name = f"control: baseline vs baseline ({name})"
        logging_ = f"every {r['log_every']} steps" if r["log_every"] else "last step only"
        rr = ", ".join(f"{x:.3f}" for x in r["round_ratios"])
        out.append(
            f"| {name} | {r['model']} ({r['params'] / 1e6:.2f}M) | {logging_} "
            f"| {b['median_ms']:.2f} | {o['median_ms']:.2f} "
            f"| {r['ratio_rounds_median']:.3f} | {r['ratio_rounds_median_wall']:.3f} | {rr} |"
        )
    return "\n".join(out)


HOOKS = ("begin_step", "before_optimizer_step", "after_optimizer_step", "check+metrics")


class _OpCount(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.n += 1
        return func(*args, **(kwargs or {}))


def _hook_step(rt: Any, model: Any, opt: Any, scaler: Any, batch: torch.Tensor, kind: str, count: bool) -> dict:
    """One optimizer step driven as the Trainer callback drives it; per hook, CPU microseconds (or op counts)."""
    from hf_mixedprec.runtime import _tell_fp8_layers

    out: dict[str, float] = {}

    def timed(name: str, fn: Any) -> None:
        if count:
            with _OpCount() as c:
                fn()
            out[name] = out.get(name, 0) + c.n
        else:
            t0 = time.process_time()
            fn()
            out[name] = out.get(name, 0.0) + (time.process_time() - t0) * 1e6

    def begin() -> None:
        rt.begin_step(model)
        if rt.recipe.precision == "fp8" and (kind == "fp8-sampled") != rt._sampling:  # this bench picks the steps
            rt._sampling = kind == "fp8-sampled"
            rt._recording = _tell_fp8_layers(model, rt._sampling, rt._recording)

    timed("begin_step", begin)
    with rt.autocast():
        loss = model(input_ids=batch, labels=batch).loss
    rt.record_loss(loss)
    scaler.scale(loss).backward()
    timed("before_optimizer_step", lambda: rt.before_optimizer_step(model.parameters(), opt))
    scaler.step(opt)
    scaler.update()
    timed("after_optimizer_step", lambda: rt.after_optimizer_step(model, opt))
    rt.rewind_schedule(opt, None)
    if kind == "logging":
        timed("check+metrics", lambda: (rt.check(model, opt), rt.metrics()))
    opt.zero_grad(set_to_none=True)
    return out


def bench_hooks(name: str, layers: int, opts: argparse.Namespace) -> list[dict]:
    """Per hook: median CPU microseconds and tensor operations, per step kind, for one recipe and model depth."""
    from hf_mixedprec.runtime import MixedPrecisionRuntime

    recipe, rehearsed = load(name, opts.rehearse)
    rt = MixedPrecisionRuntime(recipe, device="cpu", rehearse=rehearsed or recipe.rehearse)
    model = tiny_llama(seed=0, num_hidden_layers=layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    rt.convert_model(model, opt)
    scaler = rt.make_grad_scaler() or rt.make_guard_scaler()
    kinds = ["non-logging", "logging"] + (["fp8-sampled"] if recipe.precision == "fp8" else [])
    n = opts.steps + opts.warmup
    batches = byte_batches(builtin_text(), seq_len=opts.seq_len, batch_size=opts.batch_size, n_batches=3 * n, seed=0)
    rows = []
    times: dict[str, list[dict]] = {k: [] for k in kinds}
    for i, batch in enumerate(batches[: len(kinds) * n]):
        kind = kinds[i % len(kinds)]
        got = _hook_step(rt, model, opt, scaler, batch, kind, count=False)
        if i >= len(kinds) * opts.warmup:
            times[kind].append(got)
    for kind in kinds:
        ops = _hook_step(rt, model, opt, scaler, batches[-1], kind, count=True)
        if kind == "fp8-sampled":  # its statistics are read at the next check: count that too
            rt.check(model, opt)
            rt.metrics()
        us = {h: statistics.median(t.get(h, 0.0) for t in times[kind]) for h in HOOKS}
        rows.append(
            {
                "recipe": name,
                "rehearsed": rehearsed,
                "layers": layers,
                "fp8_layers": len(rt.fp8_report.converted) if rt.fp8_report else 0,
                "step": kind,
                "us": us,
                "us_total": sum(us.values()),
                "ops": {h: ops.get(h, 0) for h in HOOKS},
                "ops_total": sum(ops.values()),
            }
        )
    return rows


def hooks_table(rows: list[dict]) -> str:
    head = " | ".join(f"{h} µs / ops" for h in HOOKS)
    out = [
        f"| recipe | blocks (FP8 Linears) | step | {head} | total µs / ops |",
        "| --- | --- | --- |" + " ---: |" * (len(HOOKS) + 1),
    ]
    for r in rows:
        cells = " | ".join(f"{r['us'][h]:.0f} / {r['ops'][h]}" for h in HOOKS)
        name = r["recipe"] + (" (rehearsed)" if r["rehearsed"] else "")
        out.append(
            f"| {name} | {r['layers']} ({r['fp8_layers']}) | {r['step']} | {cells} "
            f"| {r['us_total']:.0f} / {r['ops_total']} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--recipe", nargs="+", default=["cpu-bf16"], help="recipe name(s) or YAML path(s) (default: cpu-bf16)"
    )
    ap.add_argument("--model", nargs="+", choices=MODELS, default=["tiny"], help="tiny (test Llama) and/or small")
    ap.add_argument("--steps", type=int, default=60, help="measured steps per repetition (default 60)")
    ap.add_argument("--warmup", type=int, default=10, help="steps discarded at the start of each repetition")
    ap.add_argument(
        "--repeats", type=int, default=8, help="repetitions per side (default 8; a multiple of 4 balances the order)"
    )
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument(
        "--log-every", nargs="+", type=int, default=[0], help="Trainer logging_steps; 0 = only the last step (default)"
    )
    ap.add_argument(
        "--threads", type=int, default=1, help="torch.set_num_threads, the same for both sides (default 1, see above)"
    )
    ap.add_argument(
        "--interleave",
        choices=("step", "run"),
        default="step",
        help="step: both sides in lockstep, step by step (default); run: whole runs alternate",
    )
    ap.add_argument("--control", action="store_true", help="also measure the baseline against itself (the noise floor)")
    ap.add_argument(
        "--cpu",
        type=int,
        default=-1,
        help="pin the process to this CPU (default -1: the last one it may use; -2: do not pin)",
    )
    ap.add_argument(
        "--no-rehearse", dest="rehearse", action="store_false", help="refuse recipes this machine can't run"
    )
    ap.add_argument("--hooks", action="store_true", help="measure each hook's CPU time and tensor ops (see above)")
    ap.add_argument("--layers", nargs="+", type=int, default=[2, 8, 16], help="--hooks: Llama blocks (default 2 8 16)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON on stdout instead of the table")
    ap.add_argument("--out", metavar="FILE", help="also write the results as JSON to FILE")
    opts = ap.parse_args(argv)
    if opts.steps < 2 or opts.repeats < 1 or opts.warmup < 0:
        ap.error("--steps must be >= 2, --repeats >= 1, --warmup >= 0")
    if opts.cpu != -2 and hasattr(os, "sched_setaffinity"):
        allowed = sorted(os.sched_getaffinity(0))
        cpu = allowed[-1] if opts.cpu == -1 else opts.cpu
        if cpu not in allowed:
            ap.error(f"--cpu {cpu}: this process may use CPUs {allowed}")
        os.sched_setaffinity(0, {cpu})
        opts.pinned_cpu = cpu
    torch.set_num_threads(opts.threads)
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    logging.getLogger("hf_mixedprec").setLevel(logging.ERROR)  # notes would be repeated every repetition
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    if opts.hooks:
        return main_hooks(opts)
    data = Bytes(n=opts.batch_size * (opts.warmup + opts.steps + 2), seq_len=opts.seq_len)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, stdout_to_stderr():
        opts.workdir = tmp
        for name in opts.recipe:
            recipe, rehearsed = load(name, opts.rehearse)
            for kind in opts.model:
                for every in opts.log_every:
                    if opts.control:
                        rows.append(bench(recipe, rehearsed, kind, every, opts, data, control=True))
                    rows.append(bench(recipe, rehearsed, kind, every, opts, data))
    settings = {k: v for k, v in vars(opts).items() if k != "workdir"}
    what = (
        f"{opts.steps} measured steps after {opts.warmup} warm-up, {opts.repeats} repetitions per side, "
        f"interleaved by {opts.interleave}"
    )
    _report({"machine": machine(), "settings": settings, "rows": rows}, opts, what, lambda: table(rows))
    bad = [r for r in rows if not math.isfinite(r["ratio_median"])]
    return 1 if bad else 0


def main_hooks(opts: argparse.Namespace) -> int:
    with stdout_to_stderr():
        rows = [r for name in opts.recipe for n in opts.layers for r in bench_hooks(name, n, opts)]
    doc = {"machine": machine(), "settings": dict(vars(opts)), "hook_rows": rows}
    _report(doc, opts, f"{opts.steps} steps of each kind after {opts.warmup} warm-up", lambda: hooks_table(rows))
    return 0


def _report(doc: dict, opts: argparse.Namespace, what: str, render: Any) -> None:
    """Write ``doc`` to ``--out``; print it as JSON (``--json``) or as the machine line and ``render()``'s table."""
    if opts.out:
        with open(opts.out, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
    if opts.json:
        print(json.dumps(doc, indent=2))
        return
    m = doc["machine"]
    print(
        f"{m['cpu']}, {m['cores']} cores, {m['torch_threads']} torch threads, torch {m['torch']}; "
        f"batch {opts.batch_size} x {opts.seq_len} tokens; {what}"
    )
    print(render())


if __name__ == "__main__":
    sys.exit(main())
