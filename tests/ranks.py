"""Two gloo ranks in spawned processes, for the tests that shard or reduce for real on CPU.

A rank leaves with ``os._exit`` once its group is destroyed: at interpreter teardown, gloo's worker threads can still
own work objects (FSDP2 keeps some in reference cycles) and abort the process with "terminate called without an
active exception" after the test's work is done and written (pytorch/pytorch#179291 describes the mechanism). The
result a test asserts on is written before that point, so skipping teardown loses nothing.
"""

from __future__ import annotations

import gc
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
