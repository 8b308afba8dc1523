"""Recognising a full disk (hf_mixedprec.core.disk) and the one line a run's final writes end with."""

from __future__ import annotations

import errno

import pytest

from hf_mixedprec.core import disk
from hf_mixedprec.core.disk import DiskFull, is_disk_full
from hf_mixedprec.integrations.checkpointing import disk_full_in_outputs


def test_each_form_a_full_disk_takes_is_recognised_and_nothing_else(tmp_path, monkeypatch):
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"), tmp_path)
    assert is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"), tmp_path)
    assert is_disk_full(RuntimeError("safetensors: No space left on device (os error 28)"), tmp_path)
    wrapped = RuntimeError("saving failed")
    wrapped.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    assert is_disk_full(wrapped, tmp_path)  # through the chained cause
    torch_writer = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 13842880 vs 13842768")
    monkeypatch.setattr(disk, "free_bytes", lambda p: 10 * 2**20)
    assert is_disk_full(torch_writer, tmp_path)  # a failed torch writer on a nearly full filesystem
    monkeypatch.setattr(disk, "free_bytes", lambda p: 10 * 2**30)
    assert not is_disk_full(torch_writer, tmp_path)  # ... and not where there is room: another failure
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"), tmp_path)
    assert not is_disk_full(ValueError("bad"), tmp_path)


def test_a_final_write_on_a_full_disk_is_one_line_and_other_errors_pass_through(tmp_path):
    out = tmp_path / "cmp"
    out.mkdir()
    with pytest.raises(DiskFull) as err, disk_full_in_outputs(out, "compare.json, compare.md and the plots"):
        raise OSError(errno.ENOSPC, "No space left on device", str(out / "compare.json"))
    text = str(err.value)
    assert text.startswith(f"{str(out)!r}: the disk is full (") and "bytes free): compare.json, compare.md" in text
    assert text.endswith("could not be written; free space, then run it again") and "\n" not in text
    with pytest.raises(PermissionError), disk_full_in_outputs(out, "x"):
        raise PermissionError(errno.EACCES, "Permission denied")
