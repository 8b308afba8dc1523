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
"""

from __future__ import annotations

import contextlib
import runpy
import signal
import subprocess
import sys
from collections.abc import Sequence

__all__ = ["exit_code", "main"]

PROG = "hf-mixedprec"


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
    try:
        # what the launcher itself prints (DeepSpeed's import banner) goes to stderr; the training processes
        # inherit the real stdout, where a script's results (`finetune --json`) stay parseable
        with contextlib.redirect_stdout(sys.stderr):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        known = exit_code(exc)
        if known is None:
            raise
        code, why = known
        print(f"{PROG}: {why}; launch exits with {code}", file=sys.stderr, flush=True)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
