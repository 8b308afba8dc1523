"""A run of parameters' FP32 masters, made from the storage ``StorageAdamW`` keeps them in and stored back into it.

The multi-pass step (:mod:`hf_mixedprec.storage.optim`) makes a whole run's masters before torch's fused AdamW
kernel and stores them after it; the single pass (:mod:`hf_mixedprec.storage.single_pass`) does the same for the few
last elements of a parameter it leaves to that kernel. The bit arithmetic is :mod:`hf_mixedprec.storage.bits`'.
"""

from __future__ import annotations

from typing import Any

import torch

from hf_mixedprec.core._private import foreach_copy_
from hf_mixedprec.storage.bits import combine_remainder, kahan_store, split_remainder, stochastic_round_bf16

__all__ = ["gather", "gather_master", "scatter", "store_master"]


def gather_master(params: list[torch.Tensor], states: list[dict[str, Any]], mode: str) -> torch.Tensor:
    """The FP32 masters of ``params``, flat: the update starts from them."""
    if mode == "bf16_remainder":
        return combine_remainder(gather(params, None), gather([st["remainder"] for st in states], None))
    flat = gather(params)
    if mode == "bf16_kahan":
        flat += gather([st["compensation"] for st in states])
    return flat


def store_master(
    params: list[torch.Tensor],
    states: list[dict[str, Any]],
    mode: str,
    master: torch.Tensor,
    sizes: list[int],
    gen: torch.Generator | None,
) -> None:
    """Write the updated FP32 masters back in the parameters' storage."""
    if mode == "bf16_remainder":
        upper, rem = split_remainder(master)
        scatter(upper, params, sizes)
        scatter(rem, [st["remainder"] for st in states], sizes)
    elif mode == "bf16_kahan":
        weight, comp = kahan_store(master)
        scatter(weight, params, sizes)
        scatter(comp, [st["compensation"] for st in states], sizes)
    elif mode == "bf16_stochastic":
        scatter(stochastic_round_bf16(master, gen), params, sizes)
    else:
        scatter(master, params, sizes)  # round to nearest (master none, or another dtype)


def gather(tensors: list[torch.Tensor], dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
    """``tensors`` one after another in one new flat tensor of ``dtype`` (None: theirs): one copy, whatever their
    number, converted on the way."""
    pieces = [t.reshape(-1) for t in tensors]
    out_dtype = pieces[0].dtype if dtype is None else dtype
    out = torch.empty(sum(p.numel() for p in pieces), dtype=out_dtype, device=pieces[0].device)
    return torch.cat(pieces, out=out)


def scatter(flat: torch.Tensor, tensors: list[torch.Tensor], sizes: list[int]) -> None:
    """Copy the pieces of ``flat`` back into ``tensors`` (cast to their dtype: round to nearest), one operation."""
    foreach_copy_(tensors, [piece.view(t.shape) for piece, t in zip(flat.split(sizes), tensors)])
