"""Which layers of a model run in FP8: :func:`fp8_layers`, the one function that lists them, for every backend.

A model's FP8 layers are found with one walk over ``named_modules`` and kept (:class:`LayerCache`) until FP8
layers are swapped in or out (:func:`invalidate_layer_cache`: FP8 conversion and the fallback to high precision
call it), so per-step hooks walk no module tree. Here too is the per-step work done on all of them at once: the
delayed-scaling update (:func:`fp8_step`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any, Literal, overload

import torch
import torch.distributed as dist
from torch import nn

from hf_mixedprec.core._device import several_ranks
from hf_mixedprec.core._private import foreach_copy_, foreach_zero_
from hf_mixedprec.fp8.emulated import EmulatedFP8GEMM
from hf_mixedprec.fp8.experts import ExpertsStats, experts_states, experts_stats
from hf_mixedprec.fp8.probe import LayerProbe, probe_of
from hf_mixedprec.scaling import delayed_update
from hf_mixedprec.scaling.fp8 import delayed_scaled_max

__all__ = [
    "FP8Layer",
    "LayerCache",
    "fp8_layers",
    "fp8_step",
    "invalidate_layer_cache",
    "model_parameters",
    "sampled_layers",
]

#: An FP8 layer as listed: the emulated or native layer itself, or the probe of a torchao / Transformer Engine layer
#: (each keeps its sampled statistics, :class:`~hf_mixedprec.fp8.stats.SampledStats`).
FP8Layer = EmulatedFP8GEMM | LayerProbe


def _walk(model: nn.Module) -> Iterator[tuple[str, FP8Layer]]:
    for name, m in model.named_modules():
        if isinstance(m, EmulatedFP8GEMM):
            yield name, m
        else:
            p = probe_of(m)
            if p is not None:
                yield name, p


@overload
def fp8_layers(
    model: nn.Module, *, emulated_only: Literal[True], fresh: bool = False
) -> list[tuple[str, EmulatedFP8GEMM]]: ...
@overload
def fp8_layers(
    model: nn.Module, *, emulated_only: Literal[False] = False, fresh: bool = False
) -> list[tuple[str, FP8Layer]]: ...
def fp8_layers(model: nn.Module, *, emulated_only: bool = False, fresh: bool = False) -> list[Any]:
    """Every FP8 layer of ``model`` with its dotted name, in module order: emulated and native layers themselves,
    torchao and Transformer Engine layers through their :class:`~hf_mixedprec.fp8.probe.LayerProbe`. Each has
    ``record_stats``, ``records``, ``measured`` and ``stats``.

    ``emulated_only``: the emulated and native layers alone (they hold the delayed-scaling buffers). ``fresh``: walk
    the model now, for one-off callers (a checkpoint, a fallback, a report); otherwise the list collected once per
    model (:class:`LayerCache`), which per-step hooks take: do not modify it."""
    if fresh:
        found = list(_walk(model))
        return [(n, m) for n, m in found if isinstance(m, EmulatedFP8GEMM)] if emulated_only else found
    cache = layer_cache(model)
    return cache.emulated if emulated_only else cache.all


def sampled_layers(model: nn.Module) -> list[tuple[str, FP8Layer | ExpertsStats]]:
    """What keeps FP8 statistics in ``model``, collected once per model: :func:`fp8_layers`, then each converted MoE
    experts module's two projections (``<module>.gate_up_proj``, ``<module>.down_proj``). The runtime samples,
    checks and logs these; do not modify the list."""
    return layer_cache(model).sampled


def model_parameters(model: nn.Module) -> list[nn.Parameter]:
    """``list(model.parameters())`` collected once per model (and again after FP8 conversion or a health fallback
    swaps layers), so a per-step hook walks no module tree; do not modify it."""
    cache = layer_cache(model)
    if cache.parameters is None:
        cache.parameters = list(model.parameters())
    return cache.parameters


class LayerCache:
    """A model's FP8 layers, collected with one walk over ``named_modules``, and its delayed-scaling layers grouped
    for one batched update. Valid until :func:`invalidate_layer_cache`."""

    def __init__(self, model: nn.Module, generation: int) -> None:
        self.generation = generation
        self.all: list[tuple[str, FP8Layer]] = list(_walk(model))
        self.emulated: list[tuple[str, EmulatedFP8GEMM]] = [
            (n, m) for n, m in self.all if isinstance(m, EmulatedFP8GEMM)
        ]
        self.parameters: list[nn.Parameter] | None = None
        groups: dict[tuple[Any, ...], list[EmulatedFP8GEMM]] = {}
        for _, m in self.emulated:
            if m.spec.scaling == "delayed":
                key = (m.fp8_amax_history.shape, m.spec.margin, m.spec.amax_compute_algo, m.fwd_fmt, m.bwd_fmt)
                groups.setdefault(key, []).append(m)
        self.delayed = [_DelayedGroup(mods) for mods in groups.values()]
        self.experts = [st for _, st in experts_states(model)]  # MoE experts under delayed scaling
        self.sampled: list[tuple[str, FP8Layer | ExpertsStats]] = [*self.all, *experts_stats(model)]


_generation = 0
_CACHES: weakref.WeakKeyDictionary[nn.Module, LayerCache] = weakref.WeakKeyDictionary()


def invalidate_layer_cache() -> None:
    """Forget every model's :class:`LayerCache`: FP8 layers were swapped in or out (the next step collects anew)."""
    global _generation
    _generation += 1


def layer_cache(model: nn.Module) -> LayerCache:
    """``model``'s :class:`LayerCache`, collected on first use after conversion or a swap."""
    cache = _CACHES.get(model)
    if cache is None or cache.generation != _generation:
        cache = _CACHES[model] = LayerCache(model, _generation)
    return cache


class _DelayedGroup:
    """Delayed-scaling layers with the same history length, margin, algorithm and formats: their state is updated
    by one batched :func:`~hf_mixedprec.scaling.fp8.delayed_update` per step, whatever their number.

    Each layer keeps its own buffers (``fp8_amax_history``, ``fp8_scale``: state_dict keys, checkpoints and DDP's
    buffer broadcast stay as they are); a step stacks them, updates them together and writes them back with
    ``torch._foreach_copy_`` (one fused kernel per list on CUDA). Bit-identical to one update per layer per role.
    """

    def __init__(self, mods: list[EmulatedFP8GEMM]) -> None:
        m0 = mods[0]
        self.mods = mods
        self.algo = m0.spec.amax_compute_algo
        fmts = (m0.fwd_fmt, m0.fwd_fmt, m0.bwd_fmt)  # input, weight, grad-output
        self.scaled_max = delayed_scaled_max(fmts, margin=m0.spec.margin, device=m0.fp8_scale.device)

    def step(self) -> None:
        mods = self.mods
        pendings = [m.fp8_amax_pending for m in mods]
        hists = [m.fp8_amax_history for m in mods]
        scales = [m.fp8_scale for m in mods]
        pending = torch.stack(pendings)  # [n, 3]
        if several_ranks():
            dist.all_reduce(pending, op=dist.ReduceOp.MAX)
        if self.scaled_max.device != pending.device:  # the model moved since the group was made
            self.scaled_max = self.scaled_max.to(pending.device)
        hist, scale = delayed_update(
            torch.stack(hists, dim=1),  # [L, n, 3], newest amax last
            torch.stack(scales),
            pending,
            scaled_max=self.scaled_max,
            algo=self.algo,
        )
        foreach_copy_(hists, hist.transpose(0, 1).contiguous().unbind(0))
        foreach_copy_(scales, scale.unbind(0))
        foreach_zero_(pendings)


@torch.no_grad()
def fp8_step(model: nn.Module) -> None:
    """Advance delayed scaling by one optimizer step: reduce pending amaxes (MAX over ranks, as Transformer Engine's
    ``reduce_amax``), update.

    Call once per optimizer step (the Trainer callback and the Accelerate plugin do). Layers with current, MXFP8
    or blockwise scaling have nothing to update. One batched update for all delayed layers that share their
    settings (usually all of them): a fixed number of tensor operations, however many layers. No host sync.
    """
    cache = layer_cache(model)
    for group in cache.delayed:
        group.step()
    for state in cache.experts:
        state.step()
