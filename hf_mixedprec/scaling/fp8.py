"""Per-tensor FP8 scaling math: quantize/dequantize, current scaling, delayed scaling, amax.

Everything here is a pure torch function on device tensors: no ``.item()``, no python branching on tensor
values, so it can run every step without a host-device sync.  Conventions follow Transformer Engine (TE):

* ``scale`` multiplies: ``q = saturate(round_nearest_even(x * scale))`` and dequantization multiplies by
  ``scale_inv = 1 / scale`` (TE stores ``scale_inv`` and dequantizes as ``q * scale_inv``).
* ``fmt`` is ``"e4m3"`` / ``"e5m2"`` (any case) or a :class:`~hf_mixedprec.core.formats.NumberFormat`.

Divisions that define a scale are done tensor/tensor (``torch.div``), never ``python_float / tensor``:
the latter is ``reciprocal() * x`` in torch (two roundings), and tensor/CPU-scalar division is a multiply
by the reciprocal on CUDA; a correctly rounded float32 quotient is what TE computes and (by the
double-rounding theorem, 53 >= 2*24 + 2) what torchao's float64 path produces.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import torch

from hf_mixedprec.core.formats import E4M3, E5M2, FLOAT32_MAX, NumberFormat, get_format

__all__ = [
    "FP8Format",
    "current_scale",
    "delayed_scaled_max",
    "delayed_update",
    "dequantize_fp8",
    "quantize_fp8",
    "tensor_amax",
]

#: What the ``fmt`` arguments accept.
FP8Format = str | NumberFormat

_AMAX_ALGOS = ("max", "most_recent")
_F32_MANTISSA_BITS = 23
_F32_BIAS = 127
_F32_NAN_BITS = 0x7FC00000


def _fp8_format(fmt: FP8Format, arg: str = "fmt") -> NumberFormat:
    """Resolve ``fmt`` to E4M3 or E5M2, raising ValueError that names ``arg`` otherwise."""
    allowed = "'e4m3' or 'e5m2' (any case) or hf_mixedprec.core.formats.E4M3/E5M2"
    try:
        f = get_format(fmt)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{arg}={fmt!r} is not an FP8 format; allowed: {allowed}") from exc
    if f not in (E4M3, E5M2):
        raise ValueError(f"{arg}={fmt!r} is not an FP8 format; allowed: {allowed}")
    return f


def _float32_bits(value: float) -> int:
    """The IEEE bits of ``value`` rounded to float32 (python side, no tensors)."""
    return struct.unpack("<I", struct.pack("<f", value))[0]


def _round_to_float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (ties to even), ``inf`` beyond its range, in Python: no tensor, so
    no ``item()`` the host-traffic guard would see."""
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _float32_ceil(value: float) -> float:
    """Smallest float32 >= ``value`` for finite non-negative ``value`` (python side)."""
    bits = _float32_bits(value)
    as_f32 = struct.unpack("<f", struct.pack("<I", bits))[0]
    if as_f32 < value:
        bits += 1
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _f32_exponent_field(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(unbiased exponent, mantissa field) of float32 ``x`` from its bits, as int32.

    For normal ``x`` the exponent is exactly ``floor(log2(|x|))`` (no rounding, unlike ``torch.log2``);
    zero and subnormals give -127, inf and NaN give 128.
    """
    bits = x.contiguous().view(torch.int32)
    exp = torch.bitwise_and(torch.bitwise_right_shift(bits, _F32_MANTISSA_BITS), 0xFF) - _F32_BIAS
    mant = torch.bitwise_and(bits, (1 << _F32_MANTISSA_BITS) - 1)
    return exp, mant


def _exp2_int(k: torch.Tensor) -> torch.Tensor:
    """Exactly ``2.0**k`` as float32 for integer ``k`` in [-149, 127], built from bits (no exp2 rounding)."""
    k = k.to(torch.int32)
    normal = torch.bitwise_left_shift(torch.clamp(k + _F32_BIAS, 1, 254), _F32_MANTISSA_BITS)
    subnormal = torch.bitwise_left_shift(torch.ones_like(k), torch.clamp(k + 149, 0, 22))
    return torch.where(k >= -126, normal, subnormal).view(torch.float32)


def _floor_pow2(x: torch.Tensor) -> torch.Tensor:
    """``2**floor(log2(x))`` for positive normal float32 ``x``, exact (clears the mantissa bits).

    Current-scaling scales are always normal (``fp8_max / FLT_MAX`` > 2**-126), so clearing the mantissa
    is the exact rule; ``torch.exp2(torch.floor(torch.log2(x)))`` can round up for ``x`` just below a
    power of two.
    """
    bits = x.contiguous().view(torch.int32)
    return torch.bitwise_and(bits, ~((1 << _F32_MANTISSA_BITS) - 1)).view(torch.float32)


def _as_scale(scale: torch.Tensor | float) -> torch.Tensor | float:
    """A float32 tensor for tensor scales; python numbers stay python (no host-to-device copy)."""
    if isinstance(scale, torch.Tensor):
        return scale.to(torch.float32)
    return float(scale)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float, fmt: FP8Format) -> torch.Tensor:
    """Quantize ``x`` to FP8: ``saturate(round_nearest_even(float32(x) * scale))`` (TE DelayedScaling rule).

    The product is computed in float32, clamped to ``±fmt.max`` (so ``±inf`` becomes ``±max``, NaN stays
    NaN) and cast with round-to-nearest-even.  ``scale`` broadcasts against ``x`` (0-d for per-tensor).
    Returns a tensor of ``fmt``'s float8 dtype.
    """
    f = _fp8_format(fmt)
    y = x.to(torch.float32, copy=True)  # one FP32 temporary, scaled and clamped in place
    y.mul_(_as_scale(scale)).clamp_(-f.max, f.max)
    return y.to(f.dtype)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize FP8 ``q``: ``float32(q) * (1 / scale)``, returned as ``dtype``.

    TE semantics ("dequantize with 1/scale"): TE keeps ``scale_inv = 1/scale`` next to the data and
    multiplies by it.  For power-of-two scales this equals ``q / scale`` exactly; for other scales it can
    differ from a true division in the last float32 bit.
    """
    s = _as_scale(scale)
    if isinstance(s, torch.Tensor):
        inv = torch.reciprocal(s)
    else:
        inv = 1.0 / s if s != 0.0 else math.copysign(math.inf, s)
    return (q.to(torch.float32) * inv).to(dtype)


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """``max(|x|)`` ignoring NaN elements, as a 0-d float32 tensor on ``x``'s device (TE: amax ignores NaN).

    Infinite elements count (amax is then inf).  An empty or all-NaN tensor gives 0.
    """
    return abs_and_amax(x)[1]


def abs_and_amax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(|x|, tensor_amax(x))``: the magnitudes (NaN kept; float32 for FP8 or integer ``x``) that the amax was taken
    from, for callers that need them too."""
    if not x.dtype.is_floating_point or x.element_size() == 1:
        x = x.to(torch.float32)
    a = torch.abs(x)
    if x.numel() == 0:
        return a, torch.zeros((), dtype=torch.float32, device=x.device)
    amax = torch.amax(torch.where(torch.isnan(a), torch.zeros((), dtype=a.dtype, device=a.device), a))
    return a, amax.to(torch.float32)


def _check_epsilon(epsilon: float) -> float:
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)):
        raise ValueError(f"epsilon={epsilon!r} must be a python float in [0, {FLOAT32_MAX}]")
    eps = float(epsilon)
    if not (0.0 <= eps <= FLOAT32_MAX):
        raise ValueError(f"epsilon={epsilon!r} must be a finite float in [0, {FLOAT32_MAX}]")
    return eps


def current_scale(
    amax: torch.Tensor,
    *,
    fmt: FP8Format,
    epsilon: float = 0.0,
    power_2: bool = False,
    value_for_inf: float = FLOAT32_MAX,
) -> torch.Tensor:
    """Current-scaling scale from ``amax`` (TE ``Float8CurrentScaling``, torchao "tensorwise").

    ``a = max(amax, epsilon)``; if ``a`` is 0, inf or NaN (or negative) the scale is 1.0, else
    ``fmt.max / a`` rounded once to float32, with an infinite result replaced by ``value_for_inf`` (FLT_MAX for
    per-tensor scaling; TE's blockwise kernels pass the input type's largest finite value, see
    :func:`hf_mixedprec.scaling.blockwise.quantize_blockwise`); with ``power_2`` the scale is then rounded down to
    ``2**floor(log2(scale))`` exactly (mantissa bits cleared, as TE does, the replacement value included).
    As ``compute_scale_from_amax`` in Transformer Engine's ``transformer_engine/common/recipe/recipe_common.cuh``.
    Elementwise over ``amax``; returns float32 of ``amax``'s shape.

    ``epsilon`` is applied as torchao applies its float64 ``clamp(amax, 1e-12)``: ``amax < epsilon`` compared
    exactly, and then ``fmt.max / epsilon`` divided in float64 and rounded to float32 (an overflow takes
    ``value_for_inf`` like any other). TE's current scaling forwards no epsilon, so torchao is the backend whose
    rule this follows; so
    ``current_scale(amax, fmt=..., epsilon=1e-12)`` equals ``torchao.float8.float8_utils.amax_to_scale``
    bit for bit on finite non-negative amax (torchao gives NaN for NaN amax and 0 for inf amax, where
    this function follows TE and gives 1.0).
    """
    f = _fp8_format(fmt)
    eps = _check_epsilon(epsilon)
    a = amax.to(torch.float32)
    fmax = torch.full_like(a, f.max)
    scale = torch.div(fmax, a)
    valid = torch.isfinite(a) & (a > 0)
    if eps > 0.0:
        below = a < _float32_ceil(eps)  # exact "a < eps" since the threshold is float32-representable
        # float64 quotient -> float32: inf (not an error) where it is beyond float32's range
        # rounded on the host, filled on the device: a host tensor here is a host-to-device copy per call on a GPU
        eps_scale = _round_to_float32(f.max / eps)
        scale = scale.masked_fill(below, eps_scale)
        valid = valid | below
    if not (0.0 < value_for_inf <= FLOAT32_MAX):
        raise ValueError(f"value_for_inf={value_for_inf!r} must be a positive finite float32 value")
    scale = scale.masked_fill(torch.isinf(scale), value_for_inf)
    if power_2:
        scale = _floor_pow2(scale)
    return torch.where(valid, scale, torch.ones_like(scale))


def delayed_scaled_max(
    fmt: FP8Format | Sequence[FP8Format], *, margin: int = 0, device: torch.device | str | None = None
) -> torch.Tensor:
    """``fmt.max * 2**-margin`` as float32 (0-d, or ``[R]`` for a sequence of formats): the numerator of delayed
    scaling, made once and passed to :func:`delayed_update` as ``scaled_max`` so a step makes no host-to-device copy.

    A sequence gives one value per entry of the quantizers' last dim (e.g. input, weight and gradient of many
    layers stacked as ``[n, 3]``, with E4M3, E4M3, E5M2).
    """
    values = _scaled_max_values(fmt, margin)
    # filled on the device (torch.tensor(list, device=...) would copy host data over: a host sync on a GPU)
    if isinstance(values, list):
        return torch.stack([torch.full((), v, dtype=torch.float32, device=device) for v in values])
    return torch.full((), values, dtype=torch.float32, device=device)


def _scaled_max_values(fmt: FP8Format | Sequence[FP8Format], margin: int) -> float | list[float]:
    """``fmt.max * 2**-margin`` on the host (exact: a power-of-two multiple of the format maximum)."""
    _check_margin(margin)
    if isinstance(fmt, (list, tuple)):
        return [_fp8_format(f).max * math.ldexp(1.0, -margin) for f in fmt]
    return _fp8_format(fmt).max * math.ldexp(1.0, -margin)


def _check_margin(margin: int) -> None:
    if isinstance(margin, bool) or not isinstance(margin, int) or not (0 <= margin <= 127):
        raise ValueError(f"margin={margin!r} must be an int in [0, 127] (TE DelayedScaling.margin)")


def delayed_update(
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor,
    *,
    fmt: FP8Format | Sequence[FP8Format] | None = None,
    margin: int = 0,
    algo: str = "max",
    scaled_max: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One delayed-scaling step for many quantizers at once (TE ``DelayedScaling`` semantics).

    Shapes: ``amax_history`` ``[L, *q]`` with the newest amax in the LAST row, ``scale`` and ``amax``
    ``[*q]`` (usually ``q = (n,)``).  Per quantizer with new amax ``a``:

    * ``a == 0``: nothing changes (no roll, scale kept);
    * otherwise the history rolls (row 0 dropped, ``a`` appended as row -1) and
      ``amax_used = max(new history)`` for ``algo="max"`` or ``a`` for ``"most_recent"``;
      ``scale = (fmt.max / amax_used) / 2**margin`` if ``amax_used`` is finite and > 0, else the previous
      scale; an infinite scale becomes FLT_MAX.

    As in Transformer Engine's ``amax_and_scale_update`` kernel (``transformer_engine/common/recipe/
    delayed_scaling.cu``): the window max is an ``fmaxf`` reduction starting from 0, so a NaN in the history is
    ignored (an inf is not: it freezes the scale while in the window); ``most_recent`` uses the new amax as it
    is, so a NaN keeps the previous scale for that step.  The margin is applied to the format's maximum first
    (``scaled_max = fmt.max * 2**-margin``) and the scale is ``scaled_max / amax_used`` in one division, so a
    tiny amax with a margin gives the finite quotient TE gives; a quotient that is still infinite becomes
    FLT_MAX.  A NaN amax is non-zero, so it rolls into the history like any other value.  Returns new float32
    tensors; inputs are not modified.

    Many layers in one call: ``fmt`` may be a sequence with one format per entry of the last quantizer dim (an
    ``[L, n, 3]`` history of n layers' input, weight and gradient takes ``(e4m3, e4m3, e5m2)``); or pass
    ``scaled_max`` from :func:`delayed_scaled_max` (made once, so the step copies nothing to the device) instead
    of ``fmt`` and ``margin``. Every element gets the same float32 operations as a call of its own, so one
    batched call is bit-identical to one call per quantizer.
    """
    if (fmt is None) == (scaled_max is None):
        raise ValueError("pass exactly one of fmt= and scaled_max= (from delayed_scaled_max)")
    if algo not in _AMAX_ALGOS:
        raise ValueError(f"algo={algo!r} is not supported; allowed: {', '.join(map(repr, _AMAX_ALGOS))}")
    _check_margin(margin)
    if amax_history.dim() < 1 or amax_history.shape[0] < 1:
        raise ValueError(f"amax_history must have shape [L, *q] with L >= 1, got {tuple(amax_history.shape)}")
    q_shape = tuple(amax_history.shape[1:])
    if tuple(scale.shape) != q_shape or tuple(amax.shape) != q_shape:
        raise ValueError(
            f"scale and amax must have shape {q_shape} (amax_history.shape[1:]), "
            f"got scale {tuple(scale.shape)} and amax {tuple(amax.shape)}"
        )
    hist = amax_history.to(torch.float32)
    prev = scale.to(torch.float32)
    a = amax.to(torch.float32)

    update = a != 0
    rolled = torch.cat([hist[1:], a.unsqueeze(0)], dim=0)
    new_hist = torch.where(update.unsqueeze(0), rolled, hist)
    if algo == "max":  # fmaxf from 0: NaN entries drop out, as in TE's kernel
        used = torch.amax(torch.where(torch.isnan(rolled), torch.zeros_like(rolled), rolled), dim=0)
    else:
        used = a

    if scaled_max is None:
        scaled_max = delayed_scaled_max(fmt, margin=margin, device=used.device)  # type: ignore[arg-type]
    cand = torch.div(scaled_max.expand_as(used), used)
    cand = torch.where(torch.isinf(cand), FLOAT32_MAX, cand)
    ok = update & torch.isfinite(used) & (used > 0)
    new_scale = torch.where(ok, cand, prev)
    return new_hist, new_scale
