"""Swap one submodule of a model for another, by its dotted name (as ``nn.Module.get_submodule`` reads it)."""

from __future__ import annotations

from torch import nn

__all__ = ["replace_module"]


def replace_module(root: nn.Module, qualified_name: str, new: nn.Module) -> nn.Module:
    """Put ``new`` where ``root.get_submodule(qualified_name)`` is (``setattr`` on its parent); return the old one.

    Used by FP8 conversion (emulated, Transformer Engine) and by the health fallback to BF16.
    """
    parent_name, _, child = qualified_name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    old = getattr(parent, child)
    setattr(parent, child, new)
    return old
