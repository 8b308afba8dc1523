"""A full disk is a message, not a traceback: recognising the errors a full filesystem surfaces as.

``torch.save`` on a full disk raises ``RuntimeError: [enforce fail at inline_container.cc:...] . unexpected pos ...``
(or ``PytorchStreamWriter failed writing file``), safetensors ``No space left on device``, plain writes
``OSError(ENOSPC)`` or, over a quota, ``OSError(EDQUOT)``. :func:`is_disk_full` recognises each (through the chained
causes too), :class:`DiskFull` says so in one line.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil

from hf_mixedprec.core.errors import MixedPrecisionError

__all__ = ["DiskFull", "free_bytes", "is_disk_full", "tree_bytes"]

_FULL_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
_FULL_WORDS = ("No space left on device", "Disk quota exceeded")
#: torch's writer on a full disk: it names the position it could not reach, not the reason
_TORCH_WRITER = ("unexpected pos", "PytorchStreamWriter failed writing")
#: below this many free bytes a failed torch writer is taken for a full disk
_NEARLY_FULL = 64 * 2**20


class DiskFull(MixedPrecisionError):
    """The filesystem a run writes to is full (or over quota): what was removed, what is kept, how to resume."""


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Free bytes on the filesystem holding ``path`` (its nearest existing parent); None when unknown."""
    p = os.fspath(path)
    while p and not os.path.exists(p):
        p = os.path.dirname(p)
    try:
        return shutil.disk_usage(p or ".").free
    except OSError:
        return None


def tree_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of the files under ``path`` (0 when it does not exist)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):  # gone meanwhile
                total += os.path.getsize(os.path.join(root, f))
    return total


def is_disk_full(exc: BaseException, where: str | os.PathLike[str]) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a full filesystem's error, for a write under
    ``where``. A failed torch writer counts when ``where``'s filesystem has under 64 MiB free."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
            return True
        text = str(e)
        if any(w in text for w in _FULL_WORDS):
            return True
        if any(w in text for w in _TORCH_WRITER):
            free = free_bytes(where)
            if free is not None and free < _NEARLY_FULL:
                return True
        e = e.__cause__ or e.__context__
    return False
