"""Checkpoints that survive a kill: a manifest written last, verified before a resume trusts a checkpoint.

Trainer writes a ``checkpoint-N`` folder file by file (model, optimizer, scheduler, scaler, RNG states,
``trainer_state.json``; then hf_mixedprec's FP8 state at ``on_save``) and nothing marks the folder complete:
``transformers.trainer_utils.get_last_checkpoint`` takes the highest N whatever it holds, so a kill during a save
leaves a folder a resume picks and then fails on (or, worse, trains from half-restored state). Here the folder is
complete when its manifest, :data:`MANIFEST` (every file's size and SHA-256), exists and matches; the manifest is
written after every other file, to a temporary name, flushed and renamed (``os.replace`` is atomic on POSIX), the
way ``torch.distributed.checkpoint``'s file writer publishes its ``.metadata`` last.

:func:`verify` checks a folder against its manifest (a missing manifest, where the checkpoint's trainer state promised
one, means the save never finished), and :func:`newest_verified` picks what ``--resume latest`` and
``resume_from_checkpoint=True`` resume from. A checkpoint saved without manifests (by a Trainer without
hf_mixedprec, or before manifests existed) promises none, and is taken as Trainer takes it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hf_mixedprec.core.errors import MixedPrecisionError

__all__ = [
    "MANIFEST",
    "CheckpointDamaged",
    "Choice",
    "atomic_write",
    "checkpoint_folders",
    "newest_verified",
    "unmanaged",
    "verify",
    "write_manifest",
]

#: The file that marks a checkpoint folder complete (written last).
MANIFEST = "hf_mixedprec_manifest.json"
MANIFEST_VERSION = 1
#: The key, in the attributes of a callback's exported state in ``trainer_state.json``, that promises a manifest.
MARK = "hf_mixedprec_manifest"
TRAINER_STATE = "trainer_state.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_CHUNK = 1 << 20
#: Folders this process verified, with their files' sizes and modification times then.
_VERIFIED: set[tuple[str, tuple[tuple[str, int, int], ...]]] = set()


class CheckpointDamaged(MixedPrecisionError):
    """A checkpoint chosen explicitly does not verify (one line: the folder, the file and what is wrong)."""


class CheckpointLayoutRefusal(MixedPrecisionError):
    """A checkpoint this run cannot load as it was written (sharded for another engine or world size), in one line:
    the folder, what it holds, what the run needs and what to do."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(folder: Path) -> Iterator[Path]:
    for path in sorted(folder.rglob("*")):
        if path.is_file() and not path.is_symlink() and path.name != MANIFEST and not path.name.endswith(".tmp"):
            yield path


def atomic_write(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` so that a kill leaves the old file or the new one, never a part: a temporary file
    beside it, flushed to disk, renamed over ``path``, and the folder's entry flushed."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:  # a platform without directory handles: the rename is all there is
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(folder: str | os.PathLike[str]) -> Path:
    """Record every file in ``folder`` (size, SHA-256) in :data:`MANIFEST`, atomically; call it after the last file
    of the checkpoint is written."""
    folder = Path(folder)
    files = {str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in _files(folder)}
    data = json.dumps({"version": MANIFEST_VERSION, "files": files}, indent=1, sort_keys=True).encode()
    atomic_write(folder / MANIFEST, data)
    return folder / MANIFEST


def _promised(folder: Path) -> bool | None:
    """Whether the checkpoint's ``trainer_state.json`` says a manifest was to follow (:data:`MARK` in a callback's
    exported state); None when that file is missing or unreadable (the save did not get that far)."""
    try:
        doc = json.loads((folder / TRAINER_STATE).read_text())
        callbacks = doc.get("stateful_callbacks") or {}
    except (OSError, ValueError, AttributeError):
        return None
    for value in callbacks.values() if isinstance(callbacks, dict) else ():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, dict) and isinstance(item.get("attributes"), dict) and MARK in item["attributes"]:
                return True
    return False


def unmanaged(folder: str | os.PathLike[str]) -> bool:
    """A checkpoint saved without manifests (by a Trainer without hf_mixedprec's callback, or before manifests
    existed): complete as far as anything here can tell, so taken as Trainer takes it."""
    folder = Path(folder)
    return not (folder / MANIFEST).exists() and _promised(folder) is False


def verify(folder: str | os.PathLike[str]) -> str | None:
    """Why ``folder`` is not a complete checkpoint (None when every file matches its manifest, or when it is
    :func:`unmanaged`): no manifest where one was promised or no trainer state at all (the save did not finish),
    an unreadable manifest, or a file missing, of another size or with other content."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        promised = _promised(folder)
        if promised is False:
            return None
        if promised is None:
            return f"{TRAINER_STATE} is missing or unreadable (the save did not finish)"
        return f"{MANIFEST} is missing (the save did not finish)"
    try:
        doc = json.loads(path.read_text())
        files = doc["files"]
        if doc.get("version") != MANIFEST_VERSION or not isinstance(files, dict):
            raise ValueError("unknown layout")
        entries = [(str(name), int(e["size"]), str(e["sha256"])) for name, e in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"{MANIFEST} is unreadable ({type(exc).__name__})"
    # every file's size and modification time: a folder this process verified, untouched since, is not hashed again
    # (``--resume latest`` chooses a checkpoint, then Trainer's resume checks it)
    seen: list[tuple[str, int, int]] = []
    for name, size, _ in entries:
        p = folder / name
        if not p.is_file():
            return f"{name}: missing"
        st = p.stat()
        if st.st_size != size:
            return f"{name}: {st.st_size:,} bytes where {size:,} were written"
        seen.append((name, st.st_size, st.st_mtime_ns))
    key = (str(folder.resolve()), tuple(seen))
    if key in _VERIFIED:
        return None
    for name, _, digest in entries:
        if _sha256(folder / name) != digest:
            return f"{name}: its content changed after it was written (SHA-256 differs)"
    _VERIFIED.add(key)
    return None


def checkpoint_folders(out: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """The ``checkpoint-N`` folders of a run folder, by step."""
    out = Path(out)
    found = []
    for p in out.iterdir() if out.is_dir() else ():
        m = _CHECKPOINT.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


@dataclass
class Choice:
    """What :func:`newest_verified` found: the checkpoint to resume from (None when none verifies) and the newer
    folders it passed over, each with the reason."""

    path: Path | None
    skipped: list[tuple[Path, str]]
    #: the chosen folder has no manifest: written before manifests existed, or by a Trainer without the callback
    unmanaged: bool = False

    def note(self) -> str | None:
        """The loud line a resume records about the folders it passed over (None when it passed over none)."""
        if not self.skipped:
            return None
        damaged = "; ".join(f"{p.name} is damaged: {why}" for p, why in self.skipped)
        then = f"resuming from {self.path.name}" if self.path is not None else "no complete checkpoint is left"
        return f"{damaged}; {then}"


def newest_verified(out: str | os.PathLike[str]) -> Choice:
    """The newest ``checkpoint-N`` of ``out`` that verifies (:func:`verify`); :attr:`Choice.unmanaged` when that
    one was saved without manifests."""
    skipped: list[tuple[Path, str]] = []
    for _, p in reversed(checkpoint_folders(out)):
        why = verify(p)
        if why is None:
            return Choice(p, skipped, unmanaged=unmanaged(p))
        skipped.append((p, why))
    return Choice(None, skipped)
