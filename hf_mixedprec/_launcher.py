"""``python -m hf_mixedprec._launcher -m MODULE [ARGS...]``: run a launcher module, exit with the script's code.

``hf-mixedprec launch`` runs ``accelerate launch`` or ``torch.distributed.run`` through this module. Both
collapse a failed training script to exit status 1 (``torch.distributed.run`` raises ``ChildFailedError``;
Accelerate's launchers re-raise it, or raise ``subprocess.CalledProcessError`` for a single process), so a
script's ``sys.exit(3)`` would reach the shell as 1. Here the launcher runs in this process (``runpy``, as
``python -m MODULE`` would) and those exceptions become the failing process's own exit code: that of the
lowest failing rank, and 128+N for a process killed by signal N (as a shell reports it).
"""

from __future__ import annotations

import contextlib
import runpy
import subprocess
import sys
from collections.abc import Sequence

__all__ = ["exit_code", "main"]

PROG = "hf-mixedprec"


def _code(returncode: int) -> int:
    """A process's exit status as a shell reports it: a death by signal N (negative returncode) is 128+N."""
    return 128 - returncode if returncode < 0 else returncode


def exit_code(exc: BaseException) -> tuple[int, str] | None:
    """The exit code a launcher's exception stands for, and a line saying whose it is; None if not a launcher's."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if isinstance(exc, ChildFailedError):
        rank = min(exc.failures)
        failure = exc.failures[rank]
        code = _code(failure.exitcode)
        others = sorted(r for r in exc.failures if r != rank)
        also = f"; rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} failed too" if others else ""
        how = f"was killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exited with code {code}"
        return code, f"rank {rank} {how} (the lowest failing rank{also})"
    if isinstance(exc, subprocess.CalledProcessError):
        code = _code(exc.returncode)
        how = f"killed by signal {-exc.returncode}" if exc.returncode < 0 else f"exited with code {code}"
        return code, f"the training process {how}"
    if isinstance(exc, SignalException):
        return 128 + int(exc.sigval), f"the launcher received {exc.sigval.name}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[0] != "-m":
        print(f"usage: python -m hf_mixedprec._launcher -m MODULE [ARGS...] (got {args!r})", file=sys.stderr)
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
