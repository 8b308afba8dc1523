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
and 128x128 blocks for weights; *nvfp4* (TE's ``NVFP4BlockScaling``, :mod:`hf_mixedprec.scaling.nvfp4`) gives every
16 elements along the contraction dim an E4M3 scale under an FP32 tensor scale, weights 16x16 blocks (``weight_2d``),
the weight-gradient GEMM's inputs a 16-point Hadamard transform along the token dim (``rht``: both operands get
the same orthogonal transform, so the product is unchanged in exact arithmetic and only the quantization sees it)
and gradients stochastic rounding (``stochastic_rounding``, reproducible: :func:`~hf_mixedprec.scaling.nvfp4.
hashed_uniform` keyed by a per-layer call counter, the ``nvfp4_sr_calls`` buffer a checkpoint keeps). Dims that are
not multiples of 16 are padded with zeros, as TE pads. The GEMMs run in float32, like an FP8 tensor-core GEMM with FP32
accumulation, and the output is cast to the autocast (or input) dtype.

Health statistics (amax, saturation, underflow, SQNR, MX clamp) are recorded as device tensors only when
``record_stats`` is set, so steps that don't log pay nothing and nothing syncs with the host; what happens to them
next is :mod:`hf_mixedprec.fp8.stats`. Under ``torch.compile`` they leave the autograd function the way it traces
in one graph (no Python state written inside the function): the input's and the weight's as extra
(non-differentiable) outputs, the output gradient's as an in-place write into the ``fp8_grad_stats`` buffer. In
eager mode, where that costs more than it saves, the function keeps them in Python state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from hf_mixedprec.core._device import Constants
from hf_mixedprec.core.formats import E2M1, E4M3, FP8_SCALING_DEFAULTS, NumberFormat, get_format
from hf_mixedprec.fp8.stats import SampledStats, StatsRecord, held_row, hold
from hf_mixedprec.fp8.swap import linear_holding
from hf_mixedprec.recipes.schema import FP8Config
from hf_mixedprec.scaling import (
    current_scale,
    dequantize_blockwise,
    dequantize_fp8,
    dequantize_mxfp8,
    quantize_blockwise,
    quantize_fp8,
    quantize_mxfp8,
)
from hf_mixedprec.scaling.fp8 import abs_and_amax, tensor_amax
from hf_mixedprec.scaling.nvfp4 import (
    E2M1_MAX,
    NVFP4_BLOCK,
    TE_RHT_SIGNS,
    draw_stream,
    e2m1_values,
    hadamard_matrix,
    hashed_uniform,
    nvfp4_quantize,
)
from hf_mixedprec.scaling.stats import raw_from_tensorwise, raw_operand_stats, tensorwise_operand_stats

__all__ = [
    "EmulatedFP8Conv1D",
    "EmulatedFP8GEMM",
    "EmulatedFP8Linear",
    "EmulationSpec",
]

_DELAYED, _CURRENT, _MX, _NV = (FP8_SCALING_DEFAULTS[s] for s in ("delayed", "current", "mxfp8", "nvfp4"))
_K = Constants()


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
    weight_2d: bool = _NV["weight_2d"]
    rht: bool = _NV["rht"]
    rht_signs: tuple[int, ...] = TE_RHT_SIGNS
    stochastic_rounding: bool = _NV["stochastic_rounding"]
    sr_seed: int = _NV["sr_seed"]

    @classmethod
    def from_config(cls, cfg: FP8Config) -> EmulationSpec:
        opts = cfg.options()
        if opts.get("rht_signs") is not None:
            opts["rht_signs"] = tuple(opts["rht_signs"])
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

    __slots__ = ("amax", "clamp", "codes", "data", "deq", "magnitude", "scale")

    def __init__(
        self,
        deq: Tensor | None,
        data: Tensor,
        codes: Tensor | None = None,
        *,
        scale: Tensor | None = None,
        magnitude: Tensor | None = None,
        amax: Tensor | None = None,
        clamp: Tensor | None = None,
    ) -> None:
        self.deq, self.data, self.codes = deq, data, codes
        self.clamp = clamp  # NVFP4: the share of 16-element blocks whose E4M3 scale saturated or flushed to zero
        # per-tensor scalings: the scale, |x| as the amax saw it, and the amax
        self.scale, self.magnitude, self.amax = scale, magnitude, amax


class EmulatedFP8GEMM(SampledStats, nn.Module):
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
        # records: a tensorwise_operand_stats record for per-tensor scales, a raw_operand_stats row for block scales;
        # the output gradient's row is written in place by the backward (grad_record), NaN until then
        self.start_records()
        self.register_buffer("fp8_grad_stats", held_row(dev), persistent=False)
        if spec.scaling == "nvfp4":
            # how many stochastically rounded quantizations this layer has made: the key of the next one's draws
            self.register_buffer("nvfp4_sr_calls", torch.zeros((), dtype=torch.int64, device=dev))
            self.register_buffer("nvfp4_rht", hadamard_matrix(spec.rht_signs, dev), persistent=False)
        #: tells this layer's stochastic-rounding draws from other layers' (set from the module name at conversion)
        self.sr_stream = 0
        # per-tensor scales with a finite reciprocal take the cheap statistics (tensorwise_operand_stats): current
        # scales are at least fmt.max / FLT_MAX, delayed ones fmt.max * 2**-margin / FLT_MAX, above 2**-128 up to 8
        self._tensorwise_stats = spec.scaling == "current" or (spec.scaling == "delayed" and spec.margin <= 8)

    def extra_repr(self) -> str:
        fmt = "e2m1/e4m3 blocks" if self.spec.scaling == "nvfp4" else f"{self.spec.fwd_format}/{self.spec.bwd_format}"
        return f"in_features={self.in_features}, out_features={self.out_features}, scaling={self.spec.scaling}, {fmt}"

    @property
    def mx_clamp(self) -> bool:  # type: ignore[override]
        """MXFP8 layers measure how many blocks' E8M0 scales sit at the clamp, NVFP4 ones how many blocks' E4M3
        scales saturated or flushed to zero."""
        return self.spec.scaling in ("mxfp8", "nvfp4")

    @property
    def weight_serves_dgrad(self) -> bool:
        """The forward's quantized weight is also the dgrad GEMM's (orientation-free 2-D blocks)."""
        return self.spec.scaling == "blockwise" or (self.spec.scaling == "nvfp4" and self.spec.weight_2d)

    # -- quantization ------------------------------------------------------------------------------
    def _fmt(self, role: int) -> NumberFormat:
        if self.spec.scaling == "nvfp4":
            return E2M1
        return self.bwd_fmt if role == 2 else self.fwd_fmt

    def _qdq_tensorwise(self, t: Tensor, role: int) -> _Quantized:
        """Per-tensor quantization of ``t`` (float32, or the operand's own BF16/FP16: the native backend quantizes
        it without an FP32 copy, and the amax of a 16-bit tensor is the amax of its FP32 upcast exactly). The
        magnitudes the statistics read are kept on a sampled step only."""
        fmt = self._fmt(role)
        if self.record_stats:
            mag, amax = abs_and_amax(t.float())
        else:
            mag, amax = None, tensor_amax(t)
        if self.spec.scaling == "delayed":
            if self.training:
                pending = self.fp8_amax_pending
                pending[role] = torch.maximum(pending[role], amax)
            scale = self.fp8_scale[role]
        else:
            scale = current_scale(amax, fmt=fmt, epsilon=self.spec.epsilon, power_2=self.spec.power_2_scales)
        q = quantize_fp8(t, scale, fmt)
        deq = dequantize_fp8(q, scale) if self.dequantizes or self.record_stats else None
        return _Quantized(deq, q, scale=scale, magnitude=mag, amax=amax)

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

    def _qdq_nvfp4(self, t: Tensor, role: int, gemm: str, src_dtype: torch.dtype | None = None) -> _Quantized:
        """NVFP4 quantize-dequantize of one 2-D GEMM operand as TE's ``NVFP4BlockScaling`` quantizes it: 1x16 blocks
        along the GEMM's contraction dim (16x16 for a weight with ``weight_2d``), a tensor scale from the operand's
        amax, the Hadamard transform on the wgrad GEMM's operands first (``rht``; the amax is the transformed
        tensor's, as TE takes it), stochastic rounding for the output gradient. A wgrad operand comes back with its
        token dim padded to 16 (the transform mixes the padding in; both operands carry it, so their product is
        whole); the others in ``t``'s shape."""
        spec = self.spec
        two_d = role == 1 and spec.weight_2d
        transposed = not two_d and (gemm == "wgrad" or (gemm == "dgrad" and role == 1))
        src = t.t() if transposed else t
        rows, cols = src.shape
        pad_r = (-rows) % NVFP4_BLOCK if two_d else 0
        pad_c = (-cols) % NVFP4_BLOCK
        if pad_r or pad_c:
            src = torch.nn.functional.pad(src, (0, pad_c, 0, pad_r))
        if gemm == "wgrad" and spec.rht:
            src = (src.reshape(-1, NVFP4_BLOCK) @ self.nvfp4_rht.float()).reshape(src.shape)
            if src_dtype in (torch.bfloat16, torch.float16):
                # TE transforms a 16-bit operand in its own dtype (FP32 accumulation, a 16-bit result): its amax and
                # codes come from the rounded values (reference_nvfp4.py's _apply_rht, the fused RHT kernel)
                src = src.to(src_dtype).float()
        noise = None
        if role == 2 and spec.stochastic_rounding:
            noise = hashed_uniform(src.shape, self.nvfp4_sr_calls, draw_stream(self.sr_stream, spec.sr_seed))
            self.nvfp4_sr_calls.add_(1)
        q = nvfp4_quantize(src, tile=(NVFP4_BLOCK, NVFP4_BLOCK) if two_d else (1, NVFP4_BLOCK), noise=noise)
        deq = q.dequantize()
        clamp = None
        if self.record_stats and gemm != "wgrad":
            block_amax = src.abs().reshape(src.shape[0], -1, NVFP4_BLOCK).amax(-1)
            unclamped = block_amax * (torch.reciprocal(q.global_decode) / E2M1_MAX)
            flushed = (q.block_scales.float() == 0) & (block_amax > 0)
            clamp = (flushed | (unclamped > E4M3.max)).float().mean()
        codes = q.codes
        if gemm == "wgrad":
            return _Quantized(deq.t(), codes.t())
        deq, codes = deq[:rows, :cols], codes[:rows, :cols]
        if transposed:
            deq, codes = deq.t(), codes.t()
        return _Quantized(deq, codes, amax=None, clamp=clamp)

    def operand_record(self, role: int, t: Tensor, q: _Quantized) -> StatsRecord:
        """Device-side health statistics of one quantization (no host sync), from the tensors the quantization
        made: a :func:`~hf_mixedprec.scaling.stats.tensorwise_operand_stats` list for per-tensor scales, else a
        :func:`~hf_mixedprec.scaling.stats.raw_operand_stats` row. MX clamp is measured on the rowwise blocks (along
        the last dim), the ones the forward GEMM and the output gradient's dgrad GEMM use.
        """
        fmt = self._fmt(role)
        t = t.float()  # the native backend quantizes 16-bit operands as they are; the statistics compare in FP32
        if self.spec.scaling == "nvfp4":
            return raw_operand_stats(t, e2m1_values(q.data), q.deq, fmt, block_clamp=q.clamp)
        if self._tensorwise_stats and q.amax is not None and q.scale is not None:
            top = _K(fmt.max, t.device) * torch.reciprocal(q.scale)  # what an FP8 value of fmt.max dequantizes to
            return tensorwise_operand_stats(t, q.deq, amax=q.amax, top=top, magnitude=q.magnitude)
        return raw_operand_stats(
            t, q.data, q.deq, fmt, amax=q.amax, scale_codes=q.codes, block_size=self.spec.block_size
        )

    def forward_records(self, ctx: Any, x2: Tensor, xq: _Quantized, w: Tensor, wq: _Quantized) -> tuple[Tensor, ...]:
        """Inside the autograd function's forward, on a sampled step (``ctx.record``): the input's and the weight's
        records. In eager mode they are kept in :attr:`records` here (nothing returned). Under ``torch.compile``,
        where a Python write inside the function breaks the graph, they are returned flat, as extra
        (non-differentiable) outputs of the function, and :meth:`_run` keeps them outside it."""
        ctx.record, ctx.compiling = self.record_stats, torch.compiler.is_compiling()
        if not ctx.record:
            return ()
        recs = [self.operand_record(0, x2, xq), self.operand_record(1, w, wq)]
        if not ctx.compiling:
            self.records[0], self.records[1] = recs
            return ()
        flat = [t for rec in recs for t in (rec if isinstance(rec, list) else [rec])]
        ctx.mark_non_differentiable(*flat)
        return tuple(flat)

    def grad_record(self, ctx: Any, g2: Tensor, gq: _Quantized) -> None:
        """Inside the autograd function's backward, on a sampled step: the output gradient's record, kept in
        :attr:`records` in eager mode; under ``torch.compile`` written in place into :attr:`fp8_grad_stats` (a
        buffer, which a compiled backward may write; its float64 row held as int64 bits, so casting the module to
        another float type leaves it whole)."""
        if not ctx.record:
            return
        rec = self.operand_record(2, g2, gq)
        if not ctx.compiling:
            self.records[2] = rec
            return
        row = raw_from_tensorwise([rec])[0] if isinstance(rec, list) else rec
        hold(self.fp8_grad_stats, row)

    def _run(self, fn: Any, x: Tensor, out_dtype: torch.dtype) -> Tensor:
        """``fn.apply`` (the emulated or native autograd function); on a sampled step under ``torch.compile``, keep
        the records it returned and point the output gradient's at the buffer :meth:`grad_record` writes."""
        out = fn.apply(x, self.weight, self.bias, self, out_dtype)
        # the function returns [tokens, out_features]: a view it returned could not be modified in place (an inplace
        # activation after the layer); reshaped here, it is an ordinary view
        if not isinstance(out, tuple):
            return out.reshape(*x.shape[:-1], out.shape[-1])
        y, *flat = out
        if self._tensorwise_stats:
            half = len(flat) // 2
            self.records[0], self.records[1] = flat[:half], flat[half:]
        else:
            self.records[0], self.records[1] = flat
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            self.records[2] = self.fp8_grad_stats
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def quantize_for(self, t: Tensor, role: int, *, gemm: str, src_dtype: torch.dtype | None = None) -> _Quantized:
        """Quantize ``t`` (2-D; float32, or the operand's own 16-bit dtype on the native backend) for one GEMM operand.

        ``gemm`` is "fprop" (contraction over the last dim of x and W), "dgrad" (over the last dim of dy and
        the first dim of W) or "wgrad" (over the first, token dim of dy and x). ``src_dtype``: the operand's type
        before it was upcast to float32 (default float32).
        """
        if self.spec.scaling in ("delayed", "current"):
            return self._qdq_tensorwise(t, role)
        if self.spec.scaling == "nvfp4":
            return self._qdq_nvfp4(t, role, gemm, src_dtype)
        weight_block = role == 1 and self.spec.scaling == "blockwise"
        dim = 0 if (gemm == "wgrad" or (gemm == "dgrad" and role == 1)) else -1
        return self._qdq_blocked(t, role, dim, weight_block, src_dtype)

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
        return self._run(_EmulatedFP8Fn, x, out_dtype)

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


def remember_gemm(
    ctx: Any, mod: EmulatedFP8GEMM, x: Tensor, weight: Tensor, bias: Tensor | None, act: torch.dtype
) -> None:
    """What a GEMM layer's backward needs besides its saved tensors (the emulated and native functions alike):
    the layer, and ``ctx.meta = (x's leading dims, x's dtype, weight's dtype, has bias, bias's dtype, act)``;
    ``act`` is the activation dtype (the autocast dtype, else x's)."""
    ctx.mod = mod
    ctx.meta = (x.shape[:-1], x.dtype, weight.dtype, bias is not None, bias.dtype if bias is not None else None, act)


def gemm_bias(bias: Tensor, act: torch.dtype) -> Tensor:
    """The bias an FP8 GEMM adds to its FP32 accumulator: in the activation dtype, BF16 where that is FP32 (TE's
    ``module/linear.py`` casts it so: cuBLAS takes no FP32 bias with FP8 operands)."""
    return bias.to(torch.bfloat16 if act == torch.float32 else act).float()


def activation_grad(g: Tensor, act: torch.dtype, dtype: torch.dtype) -> Tensor:
    """A gradient GEMM's FP32 result as TE returns it: written in the activation dtype ``act`` (TE's dgrad and wgrad
    GEMMs take ``out_dtype=activation_dtype``, ``module/linear.py``), then cast by autograd to the dtype of the
    tensor it belongs to (an FP32 master under BF16 autocast gets a BF16-rounded gradient)."""
    return g.to(act).to(dtype)


class _EmulatedFP8Fn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, mod: EmulatedFP8GEMM, out_dtype: torch.dtype
    ) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1]).float()
        w = mod.gemm_weight(weight)
        xquant = mod.quantize_for(x2, 0, gemm="fprop", src_dtype=x.dtype)
        wquant = mod.quantize_for(w, 1, gemm="fprop", src_dtype=weight.dtype)
        xq, wq = xquant.deq, wquant.deq
        y = xq @ wq.t()
        if bias is not None:
            y = y + gemm_bias(bias, out_dtype)
        if mod.spec.scaling in ("delayed", "current"):
            x_w, w_d = xq, wq  # a per-tensor scale serves both orientations
        else:
            x_w = mod.quantize_for(x2, 0, gemm="wgrad", src_dtype=x.dtype).deq
            w_d = wq if mod.weight_serves_dgrad else mod.quantize_for(w, 1, gemm="dgrad", src_dtype=weight.dtype).deq
        ctx.save_for_backward(x_w, w_d)
        remember_gemm(ctx, mod, x, weight, bias, out_dtype)
        records = mod.forward_records(ctx, x2, xquant, w, wquant)
        out = y.to(out_dtype)  # 2-D: _run restores x's leading dims outside, where the view is autograd's own
        return (out, *records) if records else out

    @staticmethod
    def backward(ctx: Any, gy: Tensor, *_records: Tensor) -> tuple[Tensor | None, ...]:
        x_w, w_d = ctx.saved_tensors
        mod: EmulatedFP8GEMM = ctx.mod
        lead, x_dtype, w_dtype, has_bias, b_dtype, act = ctx.meta
        g2 = gy.reshape(-1, gy.shape[-1]).float()
        gquant = mod.quantize_for(g2, 2, gemm="dgrad", src_dtype=gy.dtype)
        mod.grad_record(ctx, g2, gquant)
        g_d = gquant.deq
        gx = activation_grad(g_d @ w_d, act, x_dtype).reshape(*lead, w_d.shape[1]) if ctx.needs_input_grad[0] else None
        gw = None
        if ctx.needs_input_grad[1]:  # frozen weights (e.g. a PEFT base layer) need no wgrad GEMM
            g_w = (
                g_d
                if mod.spec.scaling in ("delayed", "current")
                else mod.quantize_for(g2, 2, gemm="wgrad", src_dtype=gy.dtype).deq
            )
            gw = mod.weight_grad(activation_grad(g_w.t() @ x_w, act, w_dtype))
        gb = activation_grad(g2.sum(0), act, b_dtype) if has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None, None
