"""A ``--model`` folder (``save_pretrained`` output): checked, and its config read, with one-line errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hf_mixedprec.core._text import root_cause
from hf_mixedprec.core.errors import UsageError

__all__ = ["check_model_dir", "read_model_config"]


def check_model_dir(model_dir: str) -> None:
    """A :class:`UsageError` naming ``--model`` unless ``model_dir`` is a folder with a ``config.json``."""
    p = Path(model_dir)
    if not p.is_dir():
        raise UsageError(f"--model: {model_dir!r} is not a directory (allowed: a local save_pretrained folder)")
    if not (p / "config.json").is_file():
        raise UsageError(f"--model: {model_dir!r} has no config.json (allowed: a local save_pretrained folder)")


def read_model_config(model_dir: str) -> Any:
    """The config of a ``--model`` folder (checked by :func:`check_model_dir` first); a bad one is a UsageError."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except Exception as exc:
        raise UsageError(f"--model: cannot read the config in {model_dir!r} ({root_cause(exc)})") from None
