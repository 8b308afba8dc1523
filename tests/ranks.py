"""Two gloo ranks in spawned processes, for the tests that shard or reduce for real on CPU; several runs in each
(:func:`run_scenarios`), since every spawned process costs seconds of imports.

A rank leaves with ``os._exit`` once its group is destroyed: at interpreter teardown, gloo's worker threads can still
own work objects (FSDP2 keeps some in reference cycles) and abort the process with "terminate called without an
active exception" after the test's work is done and written (pytorch/pytorch#179291 describes the mechanism). The
result a test asserts on is written before that point, so skipping teardown loses nothing.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import sys
from collections.abc import Callable, Sequence
from typing import Any


def free_port() -> int:
    """A TCP port free on this host now (for ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_as_rank(rank: int, world: int, port: int) -> None:
    """Make this spawned process rank ``rank`` of ``world`` CPU processes for Accelerate (torchrun's variables,
    ``ACCELERATE_USE_CPU``), with one torch thread: the ranks share the 2 cores."""
    import torch

    torch.set_num_threads(1)
    os.environ.update(
        {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "ACCELERATE_USE_CPU": "true"}
    )  # fmt: skip


def leave_group() -> None:
    """End a rank: free what holds gloo work, meet the other rank, destroy the group, exit without teardown."""
    import torch.distributed as dist

    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(target: Callable[..., None], args: Sequence[Sequence[Any]], timeout: float = 300) -> None:
    """Start ``target(*args[rank])`` for each rank as a spawned process; all must exit 0 within ``timeout``."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=tuple(a)) for a in args]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.exitcode is None:
            p.kill()
    assert codes == [0] * len(procs), (
        f"rank exit codes {codes} (None: still running after {timeout} s; negative: a signal)"
    )


def run_two_ranks(target: Callable[..., None], args: Sequence[Sequence[Any]], timeout: float = 300) -> None:
    """Start ``target(*args[rank])`` for ranks 0 and 1 as spawned processes; both must exit 0 within ``timeout``."""
    assert len(args) == 2
    run_ranks(target, args, timeout)


Scenario = tuple[str, Callable[..., Any], Sequence[Any]]


def run_scenarios(rank: int, out: str, scenarios: Sequence[Scenario]) -> None:
    """Run ``fn(rank, *args)`` for each ``(name, fn, args)`` in turn in this process, writing its JSON result to
    ``{out}/{name}-{rank}.json``, so that several runs share one process's imports. Accelerate's state is reset after
    each, its PartialState included (the process group stays, and the next PartialState takes it): a run leaves
    ``distributed_type`` FSDP (or DeepSpeed's plugin) behind, and the next Accelerator would take that instead of
    its own. A run that raises writes ``{"error": traceback}`` and ends the process at once, so that the other rank's
    next collective fails instead of waiting for it; the runs after it write nothing."""
    import traceback

    from accelerate.state import AcceleratorState

    for name, fn, args in scenarios:
        path = os.path.join(out, f"{name}-{rank}.json")
        try:
            result = json.dumps(fn(rank, *args))
        except BaseException:
            with open(path, "w") as f:
                f.write(json.dumps({"error": traceback.format_exc()}))
            sys.stderr.flush()
            os._exit(1)
        with open(path, "w") as f:
            f.write(result)
        AcceleratorState._reset_state(reset_partial_state=True)


def scenario_results(out: str, starts: Sequence[Callable[[], None]]) -> Callable[..., Any]:
    """Call each of ``starts`` (``run_ranks`` of processes that call :func:`run_scenarios` into ``out``); return
    ``get(name, rank=0)``, the result that rank wrote for that scenario. ``get`` fails with the scenario's traceback
    where it raised, with every traceback written where it wrote nothing, and with the exit codes where a process
    ended badly although no scenario raised (as ``run_ranks`` fails a test of its own)."""
    ended = []
    for start in starts:
        try:
            start()
        except AssertionError as exc:  # what the scenarios reached wrote is kept; the tests decide
            ended.append(str(exc))

    def errors() -> list[str]:
        found = []
        for name in sorted(os.listdir(out)):
            if name.endswith(".json"):
                with open(os.path.join(out, name)) as f:
                    seen = json.load(f)
                if isinstance(seen, dict) and "error" in seen:
                    found.append(f"{name}:\n{seen['error']}")
        return found

    def get(name: str, rank: int = 0) -> Any:
        path = os.path.join(out, f"{name}-{rank}.json")
        if not os.path.exists(path):
            raise AssertionError(f"scenario {name!r} wrote nothing for rank {rank}: {ended}\n" + "\n".join(errors()))
        with open(path) as f:
            seen = json.load(f)
        if isinstance(seen, dict) and "error" in seen:
            raise AssertionError(f"scenario {name!r} raised on rank {rank}:\n{seen['error']}")
        if ended and not errors():
            raise AssertionError(f"no scenario raised, yet a process ended badly: {ended}")
        return seen

    return get
