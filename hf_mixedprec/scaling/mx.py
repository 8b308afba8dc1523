"""MXFP8 block scaling (OCP Microscaling Formats (MX) v1.0; TE ``MXFP8BlockScaling``).

One E8M0 scale per block of ``block_size`` consecutive elements along ``dim``.  An E8M0 code ``E`` is a
biased power of two, ``2**(E - 127)``; code 255 is NaN, there is no zero.  Two rules for the shared exponent
(``amax`` is the block's abs max, NaN-propagating, so one NaN element makes the block NaN):

* ``"floor"`` (OCP MX v1.0 section 6.3): ``E - 127 = floor(log2(amax)) - emax_elem`` (emax 8 for E4M3,
  15 for E5M2), clamped to [-127, 127]; the largest elements may saturate.
* ``"rceil"`` (TE / Blackwell hardware, cuBLAS "1D block quantization"): ``E`` is the float32 product
  ``amax * (1 / fp8_max)`` rounded up to a power of two, so nothing saturates; as TE computes it
  (``float_to_e8m0`` in ``transformer_engine/common/util/ptx.cuh``, ``utils.cuh`` in older releases, fed
  ``amax * max_norm_rcp``): the product is
  rounded to float32 first, and a product at or below ``2**-127`` (a subnormal) gives code 0.

Both: a zero block gets code 0, a NaN block code 255, an inf block code 254 (the clamp of +inf).
Elements: ``q = saturate(round_nearest_even(x * 2**(127 - E)))``; a NaN block's elements are all NaN.

log2 is taken exactly from the float32 exponent and mantissa bits, never with ``torch.log2`` (which
rounds, e.g. ``log2(2**100 * (1 + 2**-23))`` rounds to exactly 100 in float32).
"""

from __future__ import annotations

import torch

from hf_mixedprec.core.formats import NumberFormat
from hf_mixedprec.scaling.fp8 import (
    _F32_MANTISSA_BITS,
    _F32_NAN_BITS,
    FP8Format,
    _exp2_int,
    _f32_exponent_field,
    _fp8_format,
)

__all__ = ["E8M0_NAN", "dequantize_mxfp8", "mx_scale_codes", "quantize_mxfp8"]

#: E8M0 code that encodes NaN.
E8M0_NAN = 255
_E8M0_BIAS = 127
_E8M0_MAX_FINITE = 254
_ROUNDINGS = ("floor", "rceil")


def _check_rounding(rounding: str) -> str:
    r = rounding.lower() if isinstance(rounding, str) else rounding
    if r not in _ROUNDINGS:
        raise ValueError(f"rounding={rounding!r} is not supported; allowed: 'floor' (OCP MX v1.0), 'rceil' (TE)")
    return r


def _check_block_size(block_size: int) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size={block_size!r} must be a positive int (OCP MX v1.0 uses 32)")
    return block_size


def _blocked(x: torch.Tensor, block_size: int, dim: int, arg: str = "x") -> tuple[torch.Tensor, int]:
    """``x`` with ``dim`` moved last and split into ``[..., n_blocks, block_size]``; returns it and ``dim``."""
    dim = _check_blocking(x, block_size, dim, arg)
    moved = x.movedim(dim, -1)
    return moved.reshape(*moved.shape[:-1], x.shape[dim] // block_size, block_size), dim


def _check_blocking(x: torch.Tensor, block_size: int, dim: int, arg: str) -> int:
    """Check that ``block_size`` tiles ``x`` along ``dim``; returns ``dim`` made non-negative."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise ValueError(f"dim={dim!r} must be an int")
    if x.dim() == 0:
        raise ValueError(f"{arg} must have at least one dimension to block, got a 0-d tensor")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is out of range for {arg} with {x.dim()} dimensions")
    dim = dim % x.dim()
    size = x.shape[dim]
    if size % block_size != 0:
        raise ValueError(
            f"{arg}.shape[{dim}]={size} is not divisible by block_size={block_size}; "
            f"MX blocks must tile dim exactly (pad the tensor or choose another block_size)"
        )
    return dim


def mx_scale_codes(amax: torch.Tensor, *, fmt: FP8Format = "e4m3", rounding: str = "rceil") -> torch.Tensor:
    """E8M0 codes (uint8) for block abs-maxima ``amax`` (float32, >= 0), elementwise.

    ``"floor"``: OCP MX v1.0 ``floor(log2(amax)) - emax_elem``, clamped to [-127, 127] and biased by 127.
    ``"rceil"``: TE's rule on the float32 product ``r = amax * fl32(1 / fp8_max)``: code = the exponent field of
    ``r``, plus one when its mantissa is non-zero, except at code 254 and for subnormals up to ``2**-127``
    (which give 0). Zero -> 0, inf -> 254, NaN -> 255. Integer arithmetic on float32 bits, no ``log2``.
    """
    f = _fp8_format(fmt)
    r = _check_rounding(rounding)
    a = amax.to(torch.float32)
    if r == "rceil":
        return _rceil_codes(a, f.max)
    exp, _ = _f32_exponent_field(a)  # zero/subnormal -> -127: always clamps to code 0 below
    codes = torch.clamp(exp - f.emax, -_E8M0_BIAS, _E8M0_BIAS) + _E8M0_BIAS
    codes = torch.where(torch.isinf(a), _E8M0_MAX_FINITE, codes)
    codes = torch.where(torch.isnan(a), E8M0_NAN, codes)
    return codes.to(torch.uint8)


def _rceil_codes(a: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """TE's ``float_to_e8m0(amax * max_norm_rcp)`` (round toward +inf to a power of two), elementwise."""
    rcp = torch.full((), 1.0 / fp8_max, dtype=torch.float32, device=a.device)  # fl32(1 / fp8_max): TE 1.0f / max
    r = torch.where(torch.isfinite(a), a, torch.zeros_like(a)) * rcp  # one float32 product, rounded to nearest
    bits = r.view(torch.int32)
    exp_field = (bits >> _F32_MANTISSA_BITS) & 0xFF
    mant = bits & ((1 << _F32_MANTISSA_BITS) - 1)
    half_subnormal = 1 << (_F32_MANTISSA_BITS - 1)  # 2**-127: subnormals up to it round to code 0
    up = (mant > 0) & (exp_field != _E8M0_MAX_FINITE) & ~((exp_field == 0) & (mant <= half_subnormal))
    codes = exp_field + up.to(torch.int32)
    codes = torch.where(torch.isinf(a), _E8M0_MAX_FINITE, codes)
    codes = torch.where(torch.isnan(a), E8M0_NAN, codes)
    return codes.to(torch.uint8)


def _e8m0_to_float(codes: torch.Tensor) -> torch.Tensor:
    """``2**(E - 127)`` as float32 (exact, 2**-127 is a float32 subnormal); code 255 -> NaN."""
    c = codes.to(torch.int32)
    value = _exp2_int(c - _E8M0_BIAS)
    nan = torch.full_like(c, _F32_NAN_BITS).view(torch.float32)
    return torch.where(c == E8M0_NAN, nan, value)


def quantize_mxfp8(
    x: torch.Tensor,
    *,
    fmt: FP8Format = "e4m3",
    block_size: int = 32,
    rounding: str = "rceil",
    dim: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to MXFP8 (OCP MX v1.0 layout): returns ``(data, scale_e8m0)``.

    ``data`` has ``x``'s shape and ``fmt``'s float8 dtype; ``scale_e8m0`` (torch.uint8 codes) has ``x``'s
    shape with ``dim`` divided by ``block_size``.  ``rounding`` is ``"rceil"`` (TE default, no saturation)
    or ``"floor"`` (OCP).  ``x.shape[dim]`` must be divisible by ``block_size``.
    Elements: ``saturate(round_nearest_even(float32(x) * 2**(127 - E)))``; NaN blocks are all NaN.
    """
    f = _fp8_format(fmt)
    _check_block_size(block_size)
    r = _check_rounding(rounding)
    d = _check_blocking(x, block_size, dim, "x")
    moved = x.movedim(d, -1)
    n_blocks = moved.shape[-1] // block_size
    if not (x.is_contiguous() and (d == x.dim() - 1 or 1 not in (*moved.shape[:-1], n_blocks))):
        return _quantize_mxfp8_strided(x, f, block_size, r, d)
    # blocks along a contiguous tensor's last dim, or across its rows (dim 0 of [tokens, features]): for the
    # latter one copy makes the blocks contiguous, and every pass below then runs over contiguous memory,
    # several times faster than over the strided view; the data keeps that view's layout (dim last in memory)
    moved = moved.to(torch.float32).contiguous()
    blocks = moved.view(*moved.shape[:-1], n_blocks, block_size)
    amax = torch.amax(torch.abs(blocks), dim=-1)  # NaN-propagating on purpose (NaN block -> code 255)
    codes = mx_scale_codes(amax, fmt=f, rounding=r)
    c = codes.to(torch.int32)
    mult = _exp2_int(_E8M0_BIAS - torch.clamp(c, 0, _E8M0_MAX_FINITE))
    y = blocks * mult.unsqueeze(-1)
    y.clamp_(-f.max, f.max)
    # a NaN block's elements all become +NaN (always filled: deciding whether any block is NaN would read the
    # device on the host, and fake tensors, as `estimate` runs them, cannot answer it)
    y.masked_fill_((c == E8M0_NAN).unsqueeze(-1), float("nan"))
    data = y.to(f.dtype).view(moved.shape).movedim(-1, d)
    return data, codes.movedim(-1, d)


def _quantize_mxfp8_strided(
    x: torch.Tensor, f: NumberFormat, block_size: int, r: str, d: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_mxfp8` over the strided view of ``x`` (a non-contiguous ``x``, or a size-1 dim, where
    PyTorch's choice of output layout decides which NaN payload dequantization gives a NaN block)."""
    blocks, _ = _blocked(x, block_size, d)
    blocks = blocks.to(torch.float32)
    amax = torch.amax(torch.abs(blocks), dim=-1)
    codes = mx_scale_codes(amax, fmt=f, rounding=r)
    c = codes.to(torch.int32)
    mult = _exp2_int(_E8M0_BIAS - torch.clamp(c, 0, _E8M0_MAX_FINITE))
    y = torch.clamp(blocks * mult.unsqueeze(-1), -f.max, f.max)
    nan_block = (c == E8M0_NAN).unsqueeze(-1)
    y = torch.where(nan_block, torch.full_like(y, float("nan")), y)
    data = y.to(f.dtype).reshape(*blocks.shape[:-2], -1).movedim(-1, d)
    return data, codes.movedim(-1, d)


def dequantize_mxfp8(
    data: torch.Tensor,
    scale_e8m0: torch.Tensor,
    *,
    block_size: int = 32,
    dim: int = -1,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantize MXFP8: ``float32(data) * 2**(E - 127)`` per block (OCP MX v1.0), code 255 -> NaN."""
    _check_block_size(block_size)
    blocks, d = _blocked(data, block_size, dim, arg="data")
    expected = tuple(blocks.shape[:-1])
    got = tuple(scale_e8m0.movedim(d, -1).shape) if scale_e8m0.dim() == data.dim() else None
    if got != expected:
        raise ValueError(
            f"scale_e8m0.shape={tuple(scale_e8m0.shape)} does not match data.shape={tuple(data.shape)} "
            f"with block_size={block_size} along dim={dim}"
        )
    s = _e8m0_to_float(scale_e8m0.movedim(d, -1)).unsqueeze(-1)
    out = _to_float32(blocks) * s
    return out.reshape(*blocks.shape[:-2], -1).movedim(-1, d).to(dtype)


def _to_float32(t: torch.Tensor) -> torch.Tensor:
    """``t.to(torch.float32)``, bit for bit and in the same layout; a contiguous float8 E4M3 CPU tensor goes
    through a 256-entry table.

    PyTorch converts E4M3 to float32 one element at a time on the CPU (about 4x slower than the table lookup);
    the table holds PyTorch's own conversion of every code, so the result is the same to the bit, NaNs included.
    """
    if (
        t.dtype != torch.float8_e4m3fn
        or t.device.type != "cpu"
        or not t.is_contiguous()
        or torch.compiler.is_compiling()  # a compiled graph converts on its own; the cache write would be a side effect
    ):
        return t.to(torch.float32)
    table = _E4M3_TABLE.get(t.device)
    if table is None:
        codes = torch.arange(256, dtype=torch.int32, device=t.device).to(torch.uint8)
        table = codes.view(torch.float8_e4m3fn).to(torch.float32)
        if type(table) is torch.Tensor:  # never keep a fake tensor (estimate) beyond its mode
            _E4M3_TABLE[t.device] = table
    idx = t.view(torch.uint8).reshape(-1).to(torch.int32)
    return torch.index_select(table, 0, idx).view(t.shape)


_E4M3_TABLE: dict[torch.device, torch.Tensor] = {}
