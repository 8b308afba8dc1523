"""Swap one submodule of a model for another, by its dotted name (as ``nn.Module.get_submodule`` reads it)."""

from __future__ import annotations

from torch import nn

from hf_mixedprec.core._private import fsdp2_retarget

__all__ = ["linear_holding", "replace_module"]


def replace_module(root: nn.Module, qualified_name: str, new: nn.Module) -> nn.Module:
    """Put ``new`` where ``root.get_submodule(qualified_name)`` is (``setattr`` on its parent); return the old one.

    Used by FP8 conversion (emulated, Transformer Engine), phase switches and the health fallback to BF16. Under
    FSDP2 the unit that shards ``new``'s parameters is told to set them on ``new`` from now on
    (:func:`hf_mixedprec.core._private.fsdp2_retarget`).
    """
    parent_name, _, child = qualified_name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    old = getattr(parent, child)
    setattr(parent, child, new)
    fsdp2_retarget(root, qualified_name, old, new)
    return old


def linear_holding(weight: nn.Parameter, bias: nn.Parameter | None) -> nn.Linear:
    """A plain ``nn.Linear`` holding these Parameter objects (``weight`` is [out, in]), built without allocating:
    an FP8 layer's way back to high precision (the health fallback), whatever its backend."""
    out_features, in_features = weight.shape
    lin = nn.Linear(in_features, out_features, bias=bias is not None, device="meta")
    lin.weight, lin.bias = weight, bias
    return lin
