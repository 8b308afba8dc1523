"""A ``--model`` folder (``save_pretrained`` output): checked, and its config read, with one-line errors; and the
safetensors files a saved model or checkpoint holds its weights in."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hf_mixedprec.core._text import root_cause
from hf_mixedprec.core.errors import UsageError

__all__ = ["check_model_dir", "read_model_config", "safetensors_files"]


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


def safetensors_files(folder: str | os.PathLike[str]) -> list[str]:
    """The safetensors files of the model saved in ``folder`` (``model.safetensors``, or the shards its
    ``model.safetensors.index.json`` names); empty when there are none."""
    folder = os.fspath(folder)
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    index = os.path.join(folder, "model.safetensors.index.json")
    if not os.path.isfile(index):
        return []
    with open(index, encoding="utf-8") as f:
        shards = sorted(set(json.load(f).get("weight_map", {}).values()))
    return [os.path.join(folder, s) for s in shards]
