"""``python -m hf_mixedprec.core._launcher -m MODULE [ARGS...]``: run a launcher module, exit with the script's code.

``hf-mixedprec launch`` runs ``accelerate launch`` or ``torch.distributed.run`` through this module. Both
collapse a failed training script to exit status 1 (``torch.distributed.run`` raises ``ChildFailedError``;
Accelerate's launchers re-raise it, or raise ``subprocess.CalledProcessError`` for a single process), so a
script's ``sys.exit(3)`` would reach the shell as 1. Here the launcher runs in this process (``runpy``, as
``python -m MODULE`` would) and those exceptions become the failing process's own exit code, 128+N for a
process killed by signal N (as a shell reports it).

Which rank's code: once one rank fails, ``torch.distributed.run`` stops the others with SIGTERM (SIGKILL after a
timeout), and those can be reported as failures too. So the rank taken is the lowest one among those that ended
by themselves (an exit code, or a crash signal such as SIGSEGV or SIGABRT); if there is none, the lowest one
killed by SIGKILL, then by SIGTERM.

Stopping a job: a SIGINT or SIGTERM this process receives (``hf-mixedprec launch`` forwards its own; a scheduler may
signal every process of the job) is forwarded once to the training processes, its children (torch.distributed.run
starts each rank in a session of its own, so a signal to a process group never reaches them), which save a checkpoint
and stop; the launcher then reports their exit codes as for any end (``finetune``: 130). The same signal again within
:data:`DUPLICATE_S` is the first one delivered twice and is dropped; later, it stops the ranks at once (SIGKILL).
``launch`` tells torch.distributed.run to leave SIGINT and SIGTERM to this handler (``PET_SIGNALS_TO_HANDLE``).
"""

from __future__ import annotations

import contextlib
import os
import runpy
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hf_mixedprec.core._stdio import say_in_handler

__all__ = ["DUPLICATE_S", "PARENT_ENV", "children", "exit_code", "main", "run_stoppable", "stop_with_parent"]

PROG = "hf-mixedprec"
#: Seconds within which a second SIGINT/SIGTERM is the first one delivered again (hf_mixedprec.training.run_control
#: uses the same rule in each rank).
DUPLICATE_S = 2.0


def children(pid: int) -> list[int]:
    """The PIDs of ``pid``'s child processes (Linux ``/proc``); empty where the system has no such file."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError, ValueError):
            found += [int(c) for c in task.read_text().split()]
    return found


def _descendants(pid: int) -> list[int]:
    """``pid``'s children, theirs, and so on (Linux ``/proc``)."""
    out, todo = [], children(pid)
    while todo:
        child = todo.pop()
        out.append(child)
        todo += children(child)
    return out


def _kill(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


class _Forward:
    """The SIGINT/SIGTERM handler of the launcher process (see the module docs). ``killed``: the training processes
    were stopped at once (the job ends 137 then, whatever a rank that ended first said)."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.killed = False

    def __call__(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        ranks = children(os.getpid())
        if self.first is None:
            self.first = time.monotonic()
            _kill(ranks, signum)
            say_in_handler(
                f"{PROG}: {name} received: forwarded to the {len(ranks)} training processes, which save a checkpoint "
                "and stop"
            )
            if not ranks:  # no /proc: torch.distributed.run's own shutdown signals its workers once
                from torch.distributed.elastic.multiprocessing.api import SignalException

                raise SignalException(f"{name} received", sigval=signal.Signals(signum))
            return
        if time.monotonic() - self.first < DUPLICATE_S:
            return
        self.killed = True
        _kill(_descendants(os.getpid()), signal.SIGKILL)
        say_in_handler(f"{PROG}: {name} received again: the training processes were stopped at once (SIGKILL)")


def _code(returncode: int) -> int:
    """A process's exit status as a shell reports it: a death by signal N (negative returncode) is 128+N."""
    return 128 - returncode if returncode < 0 else returncode


def _how(returncode: int) -> str:
    """How a process ended, in words: ``exited with code 3``, ``was killed by SIGTERM``."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def _stopped_by_launcher(returncode: int) -> int:
    """0 for a rank that ended by itself; 1 for SIGKILL, 2 for SIGTERM: what the launcher sends the survivors."""
    return {-signal.SIGKILL: 1, -signal.SIGTERM: 2}.get(returncode, 0)


#: The environment variable naming the ``hf-mixedprec launch`` process the launcher stops with (PR_SET_PDEATHSIG).
PARENT_ENV = "HF_MIXEDPREC_LAUNCH_PID"


def run_stoppable(command: Sequence[str], env: dict[str, str], grace_s: float) -> int:
    """Run ``command`` (the launcher, through this module) as ``hf-mixedprec launch`` does, and return its exit
    status. It runs in a session of its own, so that a signal to this process's group (Ctrl-C in a terminal, ``kill
    -TERM -PGID``) reaches this process alone, which forwards the first SIGINT/SIGTERM to it once (it forwards it to
    the ranks, which save a checkpoint and stop) and gives the job ``grace_s`` seconds to end; past that, or at a
    second signal (after :data:`DUPLICATE_S`), the job is stopped at once and the exit code is 137. On Linux the
    launcher stops the job the same way should this process die first (:func:`stop_with_parent`)."""
    first: list[float] = []
    pending: list[int] = []
    procs: list[subprocess.Popen[bytes]] = []

    def forward(signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            procs[0].send_signal(signum)

    def on_signal(signum: int, frame: Any) -> None:
        if not first:
            first.append(time.monotonic())
            if procs:
                forward(signum)
            else:  # before Popen returned: forwarded once it has
                pending.append(signum)
            say_in_handler(
                f"{PROG}: {signal.Signals(signum).name} received: the training processes save a checkpoint and stop "
                f"(up to --grace-s {grace_s:g} s; send it again to stop them at once)"
            )
        elif time.monotonic() - first[0] >= DUPLICATE_S and procs:
            forward(signum)  # the launcher takes a second one as: stop at once

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        procs.append(subprocess.Popen(list(command), env={**env, PARENT_ENV: str(os.getpid())}, start_new_session=True))
        for signum in pending:
            forward(signum)
        while True:
            try:
                code = _code(procs[0].wait(timeout=0.5))
                return 137 if first and len(first) > 1 else code
            except subprocess.TimeoutExpired:
                pass
            if first and len(first) == 1 and time.monotonic() - first[0] > grace_s:
                first.append(time.monotonic())  # the grace period is over: the job ends 137
                say_in_handler(f"{PROG}: --grace-s {grace_s:g} s passed: stopping the training processes at once")
                job = _descendants(procs[0].pid)
                forward(signal.SIGTERM)  # the launcher takes it as a second signal: SIGKILL to the ranks
                with contextlib.suppress(subprocess.TimeoutExpired):
                    procs[0].wait(timeout=10.0)
                _kill([procs[0].pid, *job], signal.SIGKILL)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stop_with_parent() -> bool:
    """In the launcher process (first thing): SIGTERM should ``hf-mixedprec launch`` (:data:`PARENT_ENV`) die
    (Linux ``PR_SET_PDEATHSIG``; nothing elsewhere). True when it has died already (before the call): the job is
    then not started."""
    parent = os.environ.get(PARENT_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return False
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    return str(os.getppid()) != parent


def exit_code(exc: BaseException) -> tuple[int, str] | None:
    """The exit code a launcher's exception stands for, and a line saying whose it is; None if not a launcher's."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if isinstance(exc, ChildFailedError):
        rank = min(exc.failures, key=lambda r: (_stopped_by_launcher(exc.failures[r].exitcode), r))
        others = [f"rank {r} {_how(exc.failures[r].exitcode)}" for r in sorted(exc.failures) if r != rank]
        also = f" (also: {', '.join(others)})" if others else ""
        return _code(exc.failures[rank].exitcode), f"rank {rank} {_how(exc.failures[rank].exitcode)}{also}"
    if isinstance(exc, subprocess.CalledProcessError):
        return _code(exc.returncode), f"the training process {_how(exc.returncode)}"
    if isinstance(exc, SignalException):
        return 128 + int(exc.sigval), f"the launcher received {exc.sigval.name}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[0] != "-m":
        print(f"usage: python -m hf_mixedprec.core._launcher -m MODULE [ARGS...] (got {args!r})", file=sys.stderr)
        return 2
    module, rest = args[1], args[2:]
    sys.argv = [module, *rest]
    forward = _Forward()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    if stop_with_parent():
        print(f"{PROG}: hf-mixedprec launch ended before the job started; launch exits with 143", file=sys.stderr)
        return 143
    try:
        # what the launcher itself prints (DeepSpeed's import banner) goes to stderr; the training processes
        # inherit the real stdout, where a script's results (`finetune --json`) stay parseable
        with contextlib.redirect_stdout(sys.stderr):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except KeyboardInterrupt:
        return 137 if forward.killed else 130
    except Exception as exc:
        known = exit_code(exc)
        if known is None:
            raise
        code, why = known
        if forward.killed:  # a rank that ended first (130) does not make a job stopped at once look saved
            code, why = 137, f"the training processes were stopped at once (SIGKILL; {why})"
        print(f"{PROG}: {why}; launch exits with {code}", file=sys.stderr, flush=True)
        return code
    return 137 if forward.killed else 0


if __name__ == "__main__":
    sys.exit(main())
