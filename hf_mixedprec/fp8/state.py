"""The FP8 layers' state across optimizer steps (delayed scaling's amax histories and scales): read, restored, kept
out of a saved model's weights and written beside a Trainer checkpoint's model.

The state is the persistent buffers of every emulated FP8 layer. A saved model stays a plain Hugging Face checkpoint
(:func:`exclude_fp8_state_from_saves`); a Trainer checkpoint keeps the state in :data:`FP8_STATE_FILE` beside it.
Extra tensors (a phased run's state kept from an earlier FP8 phase) travel in the same file under
:data:`EXTRA_PREFIX`.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from hf_mixedprec.core._private import add_keys_to_ignore_on_save
from hf_mixedprec.core.checkpoints import atomic_write
from hf_mixedprec.fp8.experts import experts_states
from hf_mixedprec.fp8.layers import fp8_layers

__all__ = [
    "EXTRA_PREFIX",
    "FP8_STATE_FILE",
    "exclude_fp8_state_from_saves",
    "fp8_state_dict",
    "fp8_state_tensors",
    "load_fp8_state",
    "load_fp8_state_dict",
    "read_fp8_state_file",
    "save_fp8_state",
]

#: Version written in the file's metadata.
FP8_STATE_VERSION = 1
#: The file beside a Trainer checkpoint's model that holds the FP8 layers' state (:func:`save_fp8_state`).
FP8_STATE_FILE = "hf_mixedprec_fp8.safetensors"
#: Keys of extra tensors saved with the state (not any layer's buffer).
EXTRA_PREFIX = "extra/"


def fp8_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """What the emulated FP8 layers keep across optimizer steps (their persistent buffers: delayed scaling's amax
    histories and scales), by ``model.state_dict()`` key, copied to the CPU (a host read: checkpoint steps only).
    Under DDP every rank holds the same values (:func:`~hf_mixedprec.fp8.fp8_step` reduces the amaxes with MAX over
    the ranks before the update)."""
    return {k: t.detach().to("cpu", copy=True) for k, t in fp8_state_tensors(model).items()}


def load_fp8_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> list[str]:
    """Copy :func:`fp8_state_dict` into ``model``'s FP8 layers in place; returns the keys left as they were
    (absent from ``state`` or of another shape, e.g. after a changed ``amax_history_len``)."""
    live = fp8_state_tensors(model)
    restarted = [k for k, t in live.items() if k not in state or state[k].shape != t.shape]
    with torch.no_grad():
        for k in live.keys() - set(restarted):
            live[k].copy_(state[k])
    return restarted


def exclude_fp8_state_from_saves(model: nn.Module) -> None:
    """Keep the FP8 layers' state out of ``save_pretrained`` so a saved model is a plain Hugging Face checkpoint.

    Their keys join ``_keys_to_ignore_on_save`` of every ``PreTrainedModel`` in ``model`` (relative to it), which
    ``PreTrainedModel.save_pretrained`` drops and ``Trainer._issue_warnings_after_load`` expects missing when a
    Trainer resumes. The state stays in ``model.state_dict()``; a Trainer checkpoint keeps it beside the model
    (:func:`save_fp8_state`).
    """
    keys = list(fp8_state_tensors(model))
    for prefix, sub in model.named_modules():
        cut = f"{prefix}." if prefix else ""
        mine = {k[len(cut) :] for k in keys if k.startswith(cut)}
        if mine:
            add_keys_to_ignore_on_save(sub, mine)  # a transformers PreTrainedModel; any other module is passed over


def save_fp8_state(
    model: nn.Module, folder: str | os.PathLike[str], extra: dict[str, torch.Tensor] | None = None
) -> str | None:
    """Write :func:`fp8_state_dict` (and ``extra`` tensors, under :data:`EXTRA_PREFIX`) to
    ``folder``/:data:`FP8_STATE_FILE` (an existing folder); returns its path, or None when there is nothing to keep
    (e.g. current or MX scaling). A host read: checkpoint steps only."""
    state = fp8_state_dict(model)
    state.update({EXTRA_PREFIX + k: t.detach().to("cpu", copy=True) for k, t in (extra or {}).items()})
    if not state:
        return None
    from safetensors.torch import save

    path = os.path.join(folder, FP8_STATE_FILE)
    # whole or not at all: a kill mid-write leaves no truncated file behind
    atomic_write(path, save(state, metadata={"format": "pt", "hf_mixedprec_fp8": str(FP8_STATE_VERSION)}))
    return path


def read_fp8_state_file(
    folder: str | os.PathLike[str] | None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The layers' state and the extra tensors :func:`save_fp8_state` wrote in ``folder`` (empty when absent)."""
    path = None if folder is None else os.path.join(folder, FP8_STATE_FILE)
    if path is None or not os.path.isfile(path):
        return {}, {}
    from safetensors.torch import load_file

    state = load_file(path)
    extra = {k[len(EXTRA_PREFIX) :]: t for k, t in state.items() if k.startswith(EXTRA_PREFIX)}
    return {k: t for k, t in state.items() if not k.startswith(EXTRA_PREFIX)}, extra


def load_fp8_state(model: nn.Module, folder: str | os.PathLike[str] | None) -> str | None:
    """Restore the FP8 layers' state from the checkpoint ``folder`` a run resumes from (:func:`save_fp8_state`, or
    ``model.safetensors`` of a checkpoint written before that file existed). Returns what restarts from scratch,
    as a sentence to say loudly (None when everything was restored or the model has no FP8 state)."""
    live = fp8_state_tensors(model)
    if not live:
        return None
    path = None if folder is None else os.path.join(folder, FP8_STATE_FILE)
    state, _ = read_fp8_state_file(folder)
    if not state and path is not None and not os.path.isfile(path):
        state = _fp8_state_in_weights(folder, set(live))
        path = os.path.join(folder, "model.safetensors") if state else path
    if not state:
        where = f"{path} is missing" if path is not None else "the checkpoint folder is not known"
        return (
            f"FP8 state: {where}, so the amax histories and scales of {len(live)} FP8 buffers restart from scratch "
            "(the resumed run will not match an uninterrupted one bit for bit)"
        )
    restarted = load_fp8_state_dict(model, state)
    if not restarted:
        return None
    more = ", ..." if len(restarted) > 3 else ""
    return (
        f"FP8 state: {len(restarted)} of {len(live)} buffers were not in {path} or had another shape and "
        f"restart from scratch ({', '.join(restarted[:3])}{more})"
    )


def fp8_state_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The live (device) persistent buffers of every emulated FP8 layer and every delayed-scaling experts state
    (:class:`~hf_mixedprec.fp8.experts.ExpertsDelayedState`) in ``model``, by ``model.state_dict()`` key."""
    out: dict[str, torch.Tensor] = {}
    holders: list[tuple[str, nn.Module]] = [*fp8_layers(model, emulated_only=True, fresh=True), *experts_states(model)]
    for name, m in holders:
        params = {n for n, _ in m.named_parameters()}
        for k, t in m.state_dict(keep_vars=True).items():
            if k not in params and isinstance(t, torch.Tensor):
                out[f"{name}.{k}" if name else k] = t
    return out


def _fp8_state_in_weights(folder: str | os.PathLike[str], keys: set[str]) -> dict[str, torch.Tensor]:
    """FP8 state from the ``model.safetensors`` (or its shards) of a checkpoint that kept it there."""
    from safetensors import safe_open

    files = [os.path.join(folder, "model.safetensors")]
    index = files[0] + ".index.json"
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            files = sorted({os.path.join(folder, v) for v in json.load(f).get("weight_map", {}).values()})
    out: dict[str, torch.Tensor] = {}
    for file in files:
        if os.path.isfile(file):
            with safe_open(file, framework="pt") as sf:
                out.update({k: sf.get_tensor(k) for k in keys.intersection(sf.keys())})
    return out
