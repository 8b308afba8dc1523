"""Emulated FP8 training on any device: exact quantize-dequantize, GEMMs in float32.

``EmulatedFP8Linear`` replaces an ``nn.Linear`` and ``EmulatedFP8Conv1D`` transformers' ``Conv1D`` (keeping the
same Parameter objects, so an optimizer built before conversion stays valid) and quantizes exactly what an FP8
GEMM would see (``W`` is the GEMM's [out, in] weight operand):

- forward ``y = x @ W.T``: input and weight in the forward format (E4M3);
- backward ``dx = dy @ W`` and ``dW = dy.T @ x``: the output gradient in the backward format (E5M2 for
  HYBRID, E4M3 for E4M3), the saved input and weight as quantized in the forward.

Scalings (TE's ``transformer_engine/common/recipe/__init__.py``, the OCP MX v1.0 spec, torchao's
``torchao/float8/float8_scaling_utils.py``): *delayed* uses scales from an amax history kept as buffers
(``fp8_amax_history`` ``[L, 3]`` and ``fp8_scale`` ``[3]`` for input, weight, grad-output; saved in the
state_dict) and updated once per optimizer step by :func:`fp8_step` (amaxes all-reduced with MAX across
ranks, as TE's ``reduce_amax``);
*current* scales each tensor by its amax now; *mxfp8* gives every 32 elements along each GEMM's contraction
dim an E8M0 scale, so the backward GEMMs need columnwise blocks quantized again from high precision (as TE
does); *blockwise* uses 1x128 tiles for activations and gradients (columnwise 1x128 for the wgrad GEMM)
and 128x128 blocks for weights. The GEMMs run in float32, like an FP8 tensor-core GEMM with FP32
accumulation, and the output is cast to the autocast (or input) dtype.

Health statistics (amax, saturation, underflow, SQNR, MX clamp) are recorded into ``stats``, a
:class:`~hf_mixedprec.scaling.stats.LayerStats` of device tensors, only when ``record_stats`` is set, so steps
that don't log pay nothing and nothing syncs with the host.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hf_mixedprec._device import Constants, several_ranks
from hf_mixedprec._private import foreach_copy_, foreach_zero_
from hf_mixedprec.formats import FP8_SCALING_DEFAULTS, NumberFormat, get_format
from hf_mixedprec.fp8.swap import linear_holding
from hf_mixedprec.scaling import (
    LayerStats,
    current_scale,
    delayed_update,
    dequantize_blockwise,
    dequantize_fp8,
    dequantize_mxfp8,
    quantize_blockwise,
    quantize_fp8,
    quantize_mxfp8,
)
from hf_mixedprec.scaling.fp8 import abs_and_amax, delayed_scaled_max
from hf_mixedprec.scaling.stats import (
    RAW_COLUMNS,
    finish_operand_stats,
    layer_stats_of,
    raw_from_tensorwise,
    raw_operand_stats,
    tensorwise_operand_stats,
)
from hf_mixedprec.schema import FP8Config

__all__ = [
    "EmulatedFP8Conv1D",
    "EmulatedFP8GEMM",
    "EmulatedFP8Linear",
    "EmulationSpec",
    "LayerCache",
    "emulated_layers",
    "fp8_step",
    "invalidate_layer_cache",
    "iter_emulated",
    "layer_cache",
    "raw_stats_table",
]

_DELAYED, _CURRENT, _MX = (FP8_SCALING_DEFAULTS[s] for s in ("delayed", "current", "mxfp8"))
_K = Constants()

#: What an emulated layer keeps of one role's sampled statistics (see :attr:`EmulatedFP8GEMM.records`).
StatsRecord = list[Tensor] | Tensor | None


@dataclass(frozen=True)
class EmulationSpec:
    """The numerics an :class:`EmulatedFP8Linear` reproduces (derived from a recipe's ``fp8`` section).

    An option left out takes the default of the scaling it belongs to (``FP8_SCALING_DEFAULTS``).
    """

    scaling: str
    fwd_format: str = "e4m3"
    bwd_format: str = "e5m2"
    amax_history_len: int = _DELAYED["amax_history_len"]
    amax_compute_algo: str = _DELAYED["amax_compute_algo"]
    margin: int = _DELAYED["margin"]
    epsilon: float = _CURRENT["epsilon"]
    power_2_scales: bool = _CURRENT["power_2_scales"]
    mx_rounding: str = _MX["mx_rounding"]
    block_size: int = _MX["block_size"]

    @classmethod
    def from_config(cls, cfg: FP8Config) -> EmulationSpec:
        opts = cfg.options()
        return cls(
            scaling=cfg.scaling,
            fwd_format="e4m3",
            bwd_format="e5m2" if cfg.format == "HYBRID" else "e4m3",
            **{k: v for k, v in opts.items() if v is not None},
        )


def _pad_to(t: Tensor, dim: int, multiple: int) -> tuple[Tensor, int]:
    size = t.shape[dim]
    pad = (-size) % multiple
    if pad == 0:
        return t, size
    shape = list(t.shape)
    shape[dim] = pad
    return torch.cat([t, t.new_zeros(shape)], dim=dim), size


class _Quantized:
    """A quantize-dequantize result with what the health statistics need."""

    __slots__ = ("codes", "data", "deq", "magnitude", "scale")

    def __init__(
        self,
        deq: Tensor | None,
        data: Tensor,
        codes: Tensor | None = None,
        *,
        scale: Tensor | None = None,
        magnitude: Tensor | None = None,
    ) -> None:
        self.deq, self.data, self.codes = deq, data, codes
        self.scale, self.magnitude = scale, magnitude  # per-tensor scalings: the scale, and |x| as the amax saw it


class EmulatedFP8GEMM(nn.Module):
    """A GEMM layer ``y = x @ W.T + b`` whose operands see exactly the FP8 values a real FP8 GEMM would.

    The quantization shared by :class:`EmulatedFP8Linear` and :class:`EmulatedFP8Conv1D`; a subclass says how
    the wrapped layer stores ``W`` (:meth:`gemm_weight`, :meth:`weight_grad`) and how to restore it.
    """

    #: the layer kind the conversion report names
    kind = "GEMM"
    #: whether the GEMMs take dequantized operands (the native backend multiplies the FP8 data; it dequantizes
    #: only for the sampled health statistics)
    dequantizes = True

    def __init__(self, layer: nn.Module, in_features: int, out_features: int, spec: EmulationSpec):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = layer.weight
        self.bias = layer.bias
        self.spec = spec
        self.fwd_fmt: NumberFormat = get_format(spec.fwd_format)
        self.bwd_fmt: NumberFormat = get_format(spec.bwd_format)
        dev = layer.weight.device
        if spec.scaling == "delayed":
            self.register_buffer("fp8_amax_history", torch.zeros(spec.amax_history_len, 3, device=dev))
            self.register_buffer("fp8_scale", torch.ones(3, device=dev))
            self.register_buffer("fp8_amax_pending", torch.zeros(3, device=dev), persistent=False)
        self.record_stats = False
        #: the latest sampled statistics of each role, as taken (None: never measured): a
        #: :func:`~hf_mixedprec.scaling.stats.tensorwise_operand_stats` record for per-tensor scales, a
        #: :func:`~hf_mixedprec.scaling.stats.raw_operand_stats` row for block scales; read as :attr:`stats`, or for
        #: many layers at once with :func:`raw_stats_table`
        self.records: list[StatsRecord] = [None, None, None]
        # per-tensor scales with a finite reciprocal take the cheap statistics (tensorwise_operand_stats): current
        # scales are at least fmt.max / FLT_MAX, delayed ones fmt.max * 2**-margin / FLT_MAX, above 2**-128 up to 8
        self._tensorwise_stats = spec.scaling == "current" or (spec.scaling == "delayed" and spec.margin <= 8)

    def extra_repr(self) -> str:
        fmt = f"{self.spec.fwd_format}/{self.spec.bwd_format}"
        return f"in_features={self.in_features}, out_features={self.out_features}, scaling={self.spec.scaling}, {fmt}"

    # -- quantization ------------------------------------------------------------------------------
    def _fmt(self, role: int) -> NumberFormat:
        return self.bwd_fmt if role == 2 else self.fwd_fmt

    def _qdq_tensorwise(self, t: Tensor, role: int) -> tuple[_Quantized, Tensor]:
        fmt = self._fmt(role)
        mag, amax = abs_and_amax(t)
        if self.spec.scaling == "delayed":
            if self.training:
                pending = self.fp8_amax_pending
                pending[role] = torch.maximum(pending[role], amax)
            scale = self.fp8_scale[role]
        else:
            scale = current_scale(amax, fmt=fmt, epsilon=self.spec.epsilon, power_2=self.spec.power_2_scales)
        q = quantize_fp8(t, scale, fmt)
        deq = dequantize_fp8(q, scale) if self.dequantizes or self.record_stats else None
        return _Quantized(deq, q, scale=scale, magnitude=mag), amax

    def _qdq_blocked(
        self, t: Tensor, role: int, dim: int, weight_block: bool = False, src_dtype: torch.dtype | None = None
    ) -> _Quantized:
        """Block-scaled quantize-dequantize of a 2-D tensor along ``dim`` (MXFP8 or 1x128 / 128x128 tiles);
        ``src_dtype`` is the operand's type before the float32 upcast (blockwise scales depend on it)."""
        fmt = self._fmt(role)
        if self.spec.scaling == "mxfp8":
            bs = self.spec.block_size
            padded, size = _pad_to(t, dim, bs)
            data, codes = quantize_mxfp8(padded, fmt=fmt.name, block_size=bs, rounding=self.spec.mx_rounding, dim=dim)
            deq = dequantize_mxfp8(data, codes, block_size=bs, dim=dim).narrow(dim, 0, size)
            return _Quantized(deq, data.narrow(dim, 0, size), codes)
        # blockwise: weights in 128x128 blocks (orientation-free); activations / grads in 1x128 along `dim`
        if weight_block:
            data, scales = quantize_blockwise(
                t, tile=(128, 128), fmt=fmt.name, power_2=self.spec.power_2_scales, input_dtype=src_dtype
            )
            return _Quantized(dequantize_blockwise(data, scales, tile=(128, 128)), data)
        src = t if dim in (-1, t.dim() - 1) else t.transpose(0, 1)
        data, scales = quantize_blockwise(
            src, tile=(1, 128), fmt=fmt.name, power_2=self.spec.power_2_scales, input_dtype=src_dtype
        )
        deq = dequantize_blockwise(data, scales, tile=(1, 128))
        if src is not t:
            deq, data = deq.transpose(0, 1), data.transpose(0, 1)
        return _Quantized(deq, data)

    def _record(self, role: int, t: Tensor, q: _Quantized, amax: Tensor | None) -> None:
        """Device-side health statistics of one quantization (no host sync), from the tensors the quantization
        made, kept as :attr:`records` ``[role]``; :attr:`stats` (or :func:`raw_stats_table`) finishes them.

        MX clamp is measured on the rowwise blocks (along the last dim), the ones recorded here.
        """
        fmt = self._fmt(role)
        if self._tensorwise_stats and amax is not None and q.scale is not None:
            top = _K(fmt.max, t.device) * torch.reciprocal(q.scale)  # what an FP8 value of fmt.max dequantizes to
            self.records[role] = tensorwise_operand_stats(t, q.deq, amax=amax, top=top, magnitude=q.magnitude)
        else:
            self.records[role] = raw_operand_stats(
                t, q.data, q.deq, fmt, amax=amax, scale_codes=q.codes, block_size=self.spec.block_size
            )

    @property
    def measured(self) -> tuple[bool, bool, bool]:
        """Which roles have statistics (a host fact: nothing is read)."""
        r = self.records
        return (r[0] is not None, r[1] is not None, r[2] is not None)

    @property
    def raw_stats(self) -> Tensor | None:
        """The latest statistics of each role as ``[3, 8]`` :data:`~hf_mixedprec.scaling.stats.RAW_COLUMNS` rows
        (NaN: never measured); None before the first sampled step."""
        table = raw_stats_table([self.records])
        return None if table is None else table[0]

    @property
    def stats(self) -> LayerStats:
        """The latest sampled statistics of each operand (a :class:`~hf_mixedprec.scaling.stats.LayerStats` of
        device tensors; empty before the first sampled step)."""
        raw = self.raw_stats
        if raw is None:
            return LayerStats()
        return layer_stats_of(finish_operand_stats(raw), self.measured, self.spec.scaling == "mxfp8")

    def quantize_for(self, t: Tensor, role: int, *, gemm: str, src_dtype: torch.dtype | None = None) -> _Quantized:
        """Quantize ``t`` (2-D, float32) for one GEMM operand.

        ``gemm`` is "fprop" (contraction over the last dim of x and W), "dgrad" (over the last dim of dy and
        the first dim of W) or "wgrad" (over the first, token dim of dy and x). ``src_dtype``: the operand's type
        before it was upcast to float32 (default float32).
        """
        amax = None
        if self.spec.scaling in ("delayed", "current"):
            q, amax = self._qdq_tensorwise(t, role)
        else:
            weight_block = role == 1 and self.spec.scaling == "blockwise"
            dim = 0 if (gemm == "wgrad" or (gemm == "dgrad" and role == 1)) else -1
            q = self._qdq_blocked(t, role, dim, weight_block, src_dtype)
        if self.record_stats and gemm != "wgrad" and not (role == 1 and gemm == "dgrad"):
            self._record(role, t, q, amax)
        return q

    # -- forward -----------------------------------------------------------------------------------
    def gemm_weight(self, weight: Tensor) -> Tensor:
        """The GEMM's weight operand ``W`` ([out, in], float32) from the stored weight."""
        return weight.float()

    def weight_grad(self, grad_w: Tensor) -> Tensor:
        """The stored weight's gradient from the GEMM's ``dW`` ([out, in])."""
        return grad_w

    def high_precision(self) -> nn.Module:
        """The original layer type holding the same Parameter objects (the health fallback to BF16)."""
        raise NotImplementedError

    def _gemm(self, x: Tensor, out_dtype: torch.dtype) -> Tensor:
        """The layer's GEMMs (forward, and backward through autograd): float32 on dequantized operands here; the
        native backend (:mod:`hf_mixedprec.fp8.native`) multiplies the FP8 operands themselves."""
        return _EmulatedFP8Fn.apply(x, self.weight, self.bias, self, out_dtype)

    def forward(self, x: Tensor) -> Tensor:
        device_type = x.device.type
        if not torch.amp.is_autocast_available(device_type):  # e.g. meta: no autocast to step out of
            return self._gemm(x, x.dtype)
        out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
        with torch.autocast(device_type=device_type, enabled=False):
            return self._gemm(x, out_dtype)


class EmulatedFP8Linear(EmulatedFP8GEMM):
    """An ``nn.Linear`` whose GEMMs see exactly the FP8 values a real FP8 GEMM would (see module docs)."""

    kind = "Linear"

    def __init__(self, linear: nn.Linear, spec: EmulationSpec):
        super().__init__(linear, linear.in_features, linear.out_features, spec)

    def high_precision(self) -> nn.Linear:
        return linear_holding(self.weight, self.bias)


class EmulatedFP8Conv1D(EmulatedFP8GEMM):
    """transformers' ``Conv1D`` (``transformers/pytorch_utils.py``, GPT-2's projections) in emulated FP8.

    ``Conv1D`` stores its weight as [in, out] (``nx``, ``nf``) and computes ``torch.addmm(bias, x, weight)``, a
    GEMM whose weight operand is ``W = weight.T``. The Parameters stay the same objects and shapes, so optimizer
    state, ``state_dict`` keys and checkpoints are unchanged. Every GEMM quantizes ``W`` as
    :class:`EmulatedFP8Linear` does a Linear holding ``W``, so outputs and gradients are bit-identical to it.
    Per-tensor scales (delayed, current) do not depend on the orientation, but MXFP8 blocks must run along the
    GEMM's reduction dim (the OCP MX v1.0 spec defines the dot product of two MX vectors block by block along it),
    in_features for the forward, and so must the 1x128 tiles of TE's blockwise recipe (``Float8BlockScaling``);
    never along the stored weight's rows.
    """

    kind = "Conv1D"

    def __init__(self, conv: nn.Module, spec: EmulationSpec):
        in_f, out_f = conv.weight.shape
        super().__init__(conv, in_f, out_f, spec)

    def gemm_weight(self, weight: Tensor) -> Tensor:
        return weight.float().t().contiguous()

    def weight_grad(self, grad_w: Tensor) -> Tensor:
        return grad_w.t()

    def high_precision(self) -> nn.Module:
        from transformers.pytorch_utils import Conv1D

        with torch.device("meta"):
            conv = Conv1D(self.out_features, self.in_features)
        conv.weight, conv.bias = self.weight, self.bias
        return conv


def remember_gemm(ctx: Any, mod: EmulatedFP8GEMM, x: Tensor, weight: Tensor, bias: Tensor | None) -> None:
    """What a GEMM layer's backward needs besides its saved tensors (the emulated and native functions alike):
    the layer, and ``ctx.meta = (x's leading dims, x's dtype, weight's dtype, has bias, bias's dtype)``."""
    ctx.mod = mod
    ctx.meta = (x.shape[:-1], x.dtype, weight.dtype, bias is not None, bias.dtype if bias is not None else None)


class _EmulatedFP8Fn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, mod: EmulatedFP8GEMM, out_dtype: torch.dtype
    ) -> Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).float()
        w = mod.gemm_weight(weight)
        xq = mod.quantize_for(x2, 0, gemm="fprop", src_dtype=x.dtype).deq
        wq = mod.quantize_for(w, 1, gemm="fprop", src_dtype=weight.dtype).deq
        y = xq @ wq.t()
        if bias is not None:
            y = y + bias.float()
        if mod.spec.scaling in ("delayed", "current"):
            x_w, w_d = xq, wq  # a per-tensor scale serves both orientations
        else:
            x_w = mod.quantize_for(x2, 0, gemm="wgrad", src_dtype=x.dtype).deq
            w_d = (
                wq
                if mod.spec.scaling == "blockwise"
                else mod.quantize_for(w, 1, gemm="dgrad", src_dtype=weight.dtype).deq
            )
        ctx.save_for_backward(x_w, w_d)
        remember_gemm(ctx, mod, x, weight, bias)
        return y.to(out_dtype).reshape(*lead, y.shape[-1])

    @staticmethod
    def backward(ctx: Any, gy: Tensor) -> tuple[Tensor | None, ...]:
        x_w, w_d = ctx.saved_tensors
        mod: EmulatedFP8GEMM = ctx.mod
        lead, x_dtype, w_dtype, has_bias, b_dtype = ctx.meta
        g2 = gy.reshape(-1, gy.shape[-1]).float()
        g_d = mod.quantize_for(g2, 2, gemm="dgrad", src_dtype=gy.dtype).deq
        gx = (g_d @ w_d).to(x_dtype).reshape(*lead, w_d.shape[1]) if ctx.needs_input_grad[0] else None
        gw = None
        if ctx.needs_input_grad[1]:  # frozen weights (e.g. a PEFT base layer) need no wgrad GEMM
            g_w = (
                g_d
                if mod.spec.scaling in ("delayed", "current")
                else mod.quantize_for(g2, 2, gemm="wgrad", src_dtype=gy.dtype).deq
            )
            gw = mod.weight_grad((g_w.t() @ x_w).to(w_dtype))
        gb = g2.sum(0).to(b_dtype) if has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None, None


def raw_stats_table(layers: Sequence[Sequence[StatsRecord]]) -> Tensor | None:
    """The sampled statistics of many layers (each its :attr:`EmulatedFP8GEMM.records`, or a copy of that list kept
    from an earlier step) as one ``[n, 3, 8]`` float64 table of :data:`~hf_mixedprec.scaling.stats.RAW_COLUMNS` rows
    (NaN where a role was never measured), in a fixed number of tensor operations however many layers: every
    per-tensor record is stacked once and converted together. None when no layer has any."""
    records = [rec for layer in layers for rec in layer]
    fast = [rec for rec in records if isinstance(rec, list)]  # per-tensor records; the others are rows already
    first = fast[0][0] if fast else next((rec for rec in records if rec is not None), None)
    if first is None:
        return None
    converted = iter(raw_from_tensorwise(fast).unbind(0) if fast else ())
    never = torch.full((len(RAW_COLUMNS),), math.nan, dtype=torch.float64, device=first.device)
    rows = [never if rec is None else next(converted) if isinstance(rec, list) else rec for rec in records]
    return torch.stack(rows).view(len(layers), 3, len(RAW_COLUMNS))


def iter_emulated(model: nn.Module) -> Iterator[tuple[str, EmulatedFP8GEMM]]:
    """Every emulated FP8 layer (Linear and Conv1D) of ``model``, with its dotted name (a walk over the model now;
    per-step code takes :func:`emulated_layers`)."""
    for name, mod in model.named_modules():
        if isinstance(mod, EmulatedFP8GEMM):
            yield name, mod


class LayerCache:
    """What a model's FP8 layers are, collected once (one walk over ``named_modules``) instead of every step.

    Valid until :func:`invalidate_layer_cache` (FP8 conversion and the health fallback to high precision call it,
    the two places that swap FP8 layers in or out). ``lists`` holds other per-model lists built on demand (the
    monitored layers of every backend, see ``hf_mixedprec.fp8.monitored_layers``).
    """

    def __init__(self, model: nn.Module, generation: int) -> None:
        self.generation = generation
        self.emulated: list[tuple[str, EmulatedFP8GEMM]] = list(iter_emulated(model))
        self.lists: dict[str, list[Any]] = {}
        groups: dict[tuple[Any, ...], list[EmulatedFP8GEMM]] = {}
        for _, m in self.emulated:
            if m.spec.scaling == "delayed":
                key = (m.fp8_amax_history.shape, m.spec.margin, m.spec.amax_compute_algo, m.fwd_fmt, m.bwd_fmt)
                groups.setdefault(key, []).append(m)
        self.delayed = [_DelayedGroup(mods) for mods in groups.values()]


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


def emulated_layers(model: nn.Module) -> list[tuple[str, EmulatedFP8GEMM]]:
    """:func:`iter_emulated` as a cached list (see :class:`LayerCache`); do not modify it."""
    return layer_cache(model).emulated


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
    """Advance delayed scaling by one optimizer step: reduce pending amaxes (MAX over ranks), update.

    Call once per optimizer step (the Trainer callback and the Accelerate plugin do). Layers with current, MXFP8
    or blockwise scaling have nothing to update. One batched update for all delayed layers that share their
    settings (usually all of them): a fixed number of tensor operations, however many layers. No host sync.
    """
    for group in layer_cache(model).delayed:
        group.step()
