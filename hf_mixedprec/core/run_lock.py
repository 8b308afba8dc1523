"""One writer per run folder: an advisory lock on a file in the folder, which the kernel releases when its process ends.

Two runs writing into one folder (a second shell, a re-submitted job) interleave their files: one run's model beside
the other's summary, or a crash on a file the other removed. ``finetune``, ``compare`` and the Trainer callback's
checkpointing take the folder's lock (``flock`` on ``.hf_mixedprec.lock``, POSIX ``fcntl``) before they write
anything; a second writer is refused in one line naming the holder's PID, host, start time and command. The lock
belongs to the open file, so a run that is killed (even with SIGKILL) never leaves a stale lock behind (its file stays,
its lock does not); a run that ends removes the file.

Within one process the lock is taken once per folder and counted (``finetune`` and the Trainer callback it installs
share it). Only the main rank of a distributed run takes it: the ranks of one launch write one run together. A folder
the lock created and nothing else was written into (a mistake or refusal found after the lock was taken) is removed
again.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hf_mixedprec.core._device import is_main_rank
from hf_mixedprec.core.errors import UsageError

__all__ = ["LOCK_NAME", "RunFolderBusy", "hold_run_folder"]

#: The lock file a run keeps open in its folder (it stays after the run; the lock does not).
LOCK_NAME = ".hf_mixedprec.lock"
#: folder (resolved) -> [open lock file, holders in this process, the folder if this process created it]
_HELD: dict[str, list[Any]] = {}


class RunFolderBusy(UsageError):
    """Another process is writing into the run folder (one line: who, since when, what to do)."""


def hold_run_folder(folder: str | os.PathLike[str], *, key: str) -> Callable[[], None]:
    """Take the lock of run folder ``folder`` (created if missing) for this process; return the function that
    releases this hold. ``key`` names the setting the folder came from in the refusal (``--output-dir``,
    ``TrainingArguments.output_dir``). Raises :class:`RunFolderBusy` when another process holds it. A non-main rank,
    or a platform without ``fcntl``, takes nothing."""
    if not is_main_rank():
        return _nothing
    try:
        import fcntl
    except ImportError:  # not POSIX: no advisory lock to take
        return _nothing
    path = Path(folder)
    created = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    where = str(path.resolve())
    held = _HELD.get(where)
    if held is not None:
        held[1] += 1
        return _releaser(where)
    f = open(path / LOCK_NAME, "a+", encoding="utf-8")  # noqa: SIM115 - held open for the run's life
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read()
        f.close()
        raise RunFolderBusy(_busy(key, str(folder), holder)) from None
    f.seek(0)
    f.truncate()
    f.write(json.dumps(_me()) + "\n")
    f.flush()
    _HELD[where] = [f, 1, path if created else None]
    return _releaser(where)


def _nothing() -> None:
    return None


def _releaser(where: str) -> Callable[[], None]:
    done = False

    def release() -> None:
        nonlocal done
        if done:
            return
        done = True
        held = _HELD.get(where)
        if held is None:
            return
        held[1] -= 1
        if held[1] == 0:
            del _HELD[where]
            f, made = held[0], held[2]
            # removed while still locked: a run that opens the path afterwards makes a new lock file, never shares
            # this one; a killed run leaves its file behind, but not its lock
            with contextlib.suppress(OSError):
                os.unlink(f.name)
            f.close()  # closing the file releases the lock
            if made is not None:  # a folder this run created and wrote nothing into (a mistake found after the lock)
                with contextlib.suppress(OSError):
                    made.rmdir()

    return release


def _me() -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
    }


def _busy(key: str, folder: str, holder: str) -> str:
    try:
        who = json.loads(holder.strip().splitlines()[-1])
        by = f"PID {who['pid']} on {who['host']}, since {who['started']} ({who['command']})"
    except (ValueError, IndexError, KeyError, TypeError):
        by = "another process"
    return (
        f"{key}: {folder!r} is being written by another run: {by}. Wait for it to end, or choose another folder "
        "(a run that was killed releases its folder by itself)"
    )
