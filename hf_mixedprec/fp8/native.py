"""FP8 of our own on torch's FP8 GEMM (``torch._scaled_mm``): the emulated backend's quantization, real FP8 GEMMs.

``NativeFP8Linear`` / ``NativeFP8Conv1D`` are the emulated layers (:mod:`hf_mixedprec.fp8.emulated`) with one
change: the three GEMMs of a linear layer (output ``y = x @ W.T``, input gradient ``dx = dy @ W``, weight gradient
``dW = dy.T @ x``) multiply the FP8 operands themselves with ``torch._scaled_mm`` (FP32 accumulation), passing each
operand's ``1 / scale`` as the GEMM's dequantization scale, instead of multiplying dequantized copies in float32.
Everything else is the emulated layer's: the same quantizers (so the FP8 values and scales fed to the GEMM are
bit for bit the rehearsal's), applied to the operands as they come (a BF16 input, weight or output gradient is
quantized with one FP32 temporary, none under ``torch.compile``, instead of an FP32 copy kept for the whole pass;
on a step that does not sample statistics nothing else is kept), the same buffers (``fp8_amax_history``, ``fp8_scale``: a checkpoint moves between
``emulated`` and ``native`` in both directions), the same delayed-scaling update (:func:`fp8_step`) and the same
sampled health statistics. A rehearsal on a CPU and a run on a GPU then differ only in GEMM accumulation order.

Scalings: *delayed* (Transformer Engine's ``DelayedScaling``: amax history, margin, ``amax_compute_algo``) and
*current* (``Float8CurrentScaling``), per-tensor scales, as torch's tensorwise ``_scaled_mm`` takes them (CUDA with
compute capability >= 8.9, and CPU). Block scalings (MXFP8, 1x128 / 128x128 blockwise) are refused by name.

``_scaled_mm`` wants the first operand row-major and the second column-major, every dim a multiple of 16; a dim
that is not is zero-padded (exact: zeros add nothing to the sums) and the result cut back.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from hf_mixedprec.core._private import scaled_mm
from hf_mixedprec.fp8.emulated import (
    EmulatedFP8Conv1D,
    EmulatedFP8GEMM,
    EmulatedFP8Linear,
    EmulationSpec,
    activation_grad,
    gemm_bias,
    remember_gemm,
)
from hf_mixedprec.recipes.hardware import NATIVE_FP8_SCALINGS, torch_has_fp8_gemm

__all__ = ["NATIVE_SCALINGS", "NativeFP8Conv1D", "NativeFP8Linear", "native_available", "native_layer"]

#: The scalings the native backend runs (per-tensor scales: torch's tensorwise ``_scaled_mm``).
NATIVE_SCALINGS = NATIVE_FP8_SCALINGS
_ALIGN = 16


_PROBED: dict[str, tuple[bool, str]] = {}


def native_available(device: torch.device) -> tuple[bool, str]:
    """Whether torch's FP8 GEMM runs on ``device``, and why not: FP8 tensor cores on CUDA, then one tiny
    ``torch._scaled_mm`` tried once per device type (its signature and CPU support changed across torch 2.x)."""
    if not torch_has_fp8_gemm():
        return False, f"torch {torch.__version__} has no torch._scaled_mm"
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            return False, f"compute capability {cap[0]}.{cap[1]} has no FP8 tensor cores (needs >= 8.9)"
    elif device.type not in ("cpu", "meta"):  # meta: shapes only (tests, estimate)
        return False, f"device {device.type!r}: torch._scaled_mm runs on CUDA and CPU"
    key = device.type
    if key not in _PROBED:
        try:
            a = torch.zeros(16, 16, device=device).to(torch.float8_e4m3fn)
            one = torch.ones((), device=device)
            out = scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
            ok = isinstance(out, torch.Tensor) and out.shape == (16, 16)
            _PROBED[key] = (True, "") if ok else (False, f"torch {torch.__version__}'s _scaled_mm returns {type(out)}")
        except Exception as exc:  # the probe is the question: any failure means "not here", said why
            _PROBED[key] = (False, f"torch {torch.__version__}'s _scaled_mm fails on {key}: {str(exc)[:120]}")
    return _PROBED[key]


def _pad(t: Tensor, rows: int, cols: int) -> Tensor:
    pr, pc = (-t.shape[0]) % rows, (-t.shape[1]) % cols
    if pr or pc:
        t = torch.nn.functional.pad(t.view(torch.uint8), (0, pc, 0, pr)).view(t.dtype)  # FP8 0 is byte 0
    return t


def fp8_mm(a: Tensor, b: Tensor, inv_a: Tensor, inv_b: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``(a * inv_a) @ (b * inv_b)`` for FP8 ``a`` [M, K] and ``b`` [K, N] (any layout) on FP8 tensor cores,
    accumulated in FP32 and returned as ``out_dtype``; dims padded to multiples of 16 where they are not (the result
    is then cut back and copied: a fresh tensor either way, never a view an autograd function would return)."""
    m, n = a.shape[0], b.shape[1]
    a = _pad(a, _ALIGN, _ALIGN).contiguous()
    b = _pad(b, _ALIGN, _ALIGN).t().contiguous().t()  # column-major
    out = scaled_mm(a, b, scale_a=inv_a, scale_b=inv_b, out_dtype=out_dtype)
    return out[:m, :n].clone() if out.shape != (m, n) else out


class _NativeGEMM:
    """What the native layers add to the emulated ones: FP8 GEMMs on the quantized data (first in their bases, so
    its ``_gemm`` is the one that runs)."""

    dequantizes = False

    def _gemm(self: Any, x: Tensor, out_dtype: torch.dtype) -> Tensor:
        return self._run(_NativeFP8Fn, x, out_dtype)

    def gemm_weight(self: Any, weight: Tensor) -> Tensor:
        """The GEMM's weight operand ``W`` ([out, in]) in the stored weight's own dtype: a view, not the emulated
        layer's FP32 copy (the quantization computes in FP32 element by element, as on that copy)."""
        return weight.t() if self.kind == "Conv1D" else weight


def _inv(scale: Tensor) -> Tensor:
    return torch.reciprocal(scale.float()).reshape(())


class _NativeFP8Fn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, mod: EmulatedFP8GEMM, out_dtype: torch.dtype
    ) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # as it came (BF16 under autocast): quantized without an FP32 copy
        w = mod.gemm_weight(weight)
        xq = mod.quantize_for(x2, 0, gemm="fprop", src_dtype=x.dtype)
        wq = mod.quantize_for(w, 1, gemm="fprop", src_dtype=weight.dtype)
        x_inv, w_inv = _inv(xq.scale), _inv(wq.scale)
        # without a bias the GEMM writes the output dtype itself (its FP32 accumulator rounded once, as a separate
        # cast would): no FP32 [tokens, out_features] buffer
        y = fp8_mm(xq.data, wq.data.t(), x_inv, w_inv, torch.float32 if bias is not None else out_dtype)
        if bias is not None:
            y = y + gemm_bias(bias, out_dtype)
        ctx.save_for_backward(xq.data, wq.data, x_inv, w_inv)
        remember_gemm(ctx, mod, x, weight, bias, out_dtype)
        records = mod.forward_records(ctx, x2, xq, w, wq)
        out = y.to(out_dtype)  # 2-D: _run restores x's leading dims outside, where the view is autograd's own
        return (out, *records) if records else out

    @staticmethod
    def backward(ctx: Any, gy: Tensor, *_records: Tensor) -> tuple[Tensor | None, ...]:
        xd, wd, x_inv, w_inv = ctx.saved_tensors
        mod: EmulatedFP8GEMM = ctx.mod
        lead, x_dtype, w_dtype, has_bias, b_dtype, act = ctx.meta
        g2 = gy.reshape(-1, gy.shape[-1])
        gq = mod.quantize_for(g2, 2, gemm="dgrad", src_dtype=gy.dtype)
        mod.grad_record(ctx, g2, gq)
        g_inv = _inv(gq.scale)
        gx = None
        if ctx.needs_input_grad[0]:
            gx = fp8_mm(gq.data, wd, g_inv, w_inv, act).to(x_dtype).reshape(*lead, wd.shape[1])
        gw = None
        if ctx.needs_input_grad[1]:  # the GEMMs round to the activation dtype once, as TE's (see activation_grad)
            gw = mod.weight_grad(fp8_mm(gq.data.t(), xd, g_inv, x_inv, act).to(w_dtype))
        gb = activation_grad(g2.float().sum(0), act, b_dtype) if has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None, None


def _check_spec(spec: EmulationSpec) -> None:
    if spec.scaling not in NATIVE_SCALINGS:
        raise ValueError(
            f"fp8.backend native runs scaling {'/'.join(NATIVE_SCALINGS)} (per-tensor scales, torch's tensorwise "
            f"_scaled_mm), not {spec.scaling!r}; use fp8.backend: emulated (any device) or transformer_engine"
        )


class NativeFP8Linear(_NativeGEMM, EmulatedFP8Linear):
    """``nn.Linear`` on FP8 GEMMs, quantized exactly as :class:`EmulatedFP8Linear` (see module docs)."""

    def __init__(self, linear: nn.Linear, spec: EmulationSpec):
        _check_spec(spec)
        super().__init__(linear, spec)


class NativeFP8Conv1D(_NativeGEMM, EmulatedFP8Conv1D):
    """transformers' ``Conv1D`` on FP8 GEMMs, quantized exactly as :class:`EmulatedFP8Conv1D`."""

    def __init__(self, conv: nn.Module, spec: EmulationSpec):
        _check_spec(spec)
        super().__init__(conv, spec)


def native_layer(kind: str, layer: nn.Module, spec: EmulationSpec) -> EmulatedFP8GEMM:
    """The native FP8 layer for a GEMM layer of ``kind`` ("Linear" or "Conv1D")."""
    return (NativeFP8Conv1D if kind == "Conv1D" else NativeFP8Linear)(layer, spec)
