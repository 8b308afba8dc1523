"""FP8 health statistics: saturation, underflow, SQNR, MX clamp fraction.

All return a 0-d float32 tensor on the input's device and never sync with the host, so they can be
accumulated every step and read only when a log is due (DESIGN "FP8 health signals").
"""

from __future__ import annotations

import torch

from hf_mixedprec.scaling.fp8 import FP8Format, _exp2_int, _f32_exponent_field, _fp8_format, quantize_fp8
from hf_mixedprec.scaling.mx import _blocked, _check_block_size, _check_rounding, mx_scale_codes

__all__ = ["mx_clamp_fraction", "saturation_fraction", "sqnr_db", "underflow_fraction"]


def _fraction(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``num / den`` as float32, 0 where ``den`` is 0."""
    num = num.to(torch.float32)
    den = den.to(torch.float32)
    return torch.where(den > 0, num / torch.clamp(den, min=1.0), torch.zeros_like(num))


def saturation_fraction(x: torch.Tensor, scale: torch.Tensor | float, fmt: FP8Format) -> torch.Tensor:
    """Fraction of the FINITE elements of ``x`` with ``|float32(x) * scale| >= fmt.max``.

    Those are the elements :func:`quantize_fp8` clips to ``±max`` or that sit exactly at it (values that
    merely round up to ``max`` are not counted).  Non-finite elements (inf, NaN) are excluded from
    numerator and denominator; 0 when ``x`` has no finite element.
    """
    f = _fp8_format(fmt)
    x32 = x.to(torch.float32)
    s = scale.to(torch.float32) if isinstance(scale, torch.Tensor) else float(scale)
    finite = torch.isfinite(x32)
    y = x32 * s
    y, finite = torch.broadcast_tensors(y, finite)
    hit = finite & (torch.abs(y) >= f.max)
    return _fraction(hit.sum(), finite.sum())


def underflow_fraction(x: torch.Tensor, scale: torch.Tensor | float, fmt: FP8Format) -> torch.Tensor:
    """Fraction of the non-zero, non-NaN elements of ``x`` that :func:`quantize_fp8` turns into ±0.

    Uses the real round-to-nearest-even cast, so a value exactly at half the smallest subnormal counts
    as underflow (it rounds to even, 0).  0 when ``x`` has no such element.
    """
    q = quantize_fp8(x, scale, fmt).to(torch.float32)
    x32 = x.to(torch.float32)
    x32, q = torch.broadcast_tensors(x32, q)
    nonzero = (x32 != 0) & ~torch.isnan(x32)
    lost = nonzero & (q == 0)
    return _fraction(lost.sum(), nonzero.sum())


def sqnr_db(x: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:
    """Signal-to-quantization-noise ratio ``10 * log10(sum(x**2) / sum((x - x_hat)**2))`` in dB, float32.

    ``inf`` when ``x_hat == x`` everywhere (zero noise), ``-inf`` for zero signal with non-zero noise, NaN
    if either input has NaN.  To keep float32 sums from overflowing, both ``x`` and the noise are first
    multiplied by ``2**-e`` with ``e`` the exponent of ``max|x|`` (a power of two: exact except for
    float32 underflow of elements ~2**-149 below ``max|x|``, so the ratio is unchanged).
    Same quantity as torchao's ``compute_error`` (``20 * log10(||x|| / ||x - x_hat||)``).
    """
    if tuple(x.shape) != tuple(x_hat.shape):
        raise ValueError(f"x_hat.shape={tuple(x_hat.shape)} must equal x.shape={tuple(x.shape)}")
    x32 = x.to(torch.float32)
    noise = x32 - x_hat.to(torch.float32)
    if x32.numel() == 0:
        return torch.full((), float("inf"), dtype=torch.float32, device=x.device)
    amax = torch.amax(torch.abs(x32))
    exp, _ = _f32_exponent_field(amax)
    usable = torch.isfinite(amax) & (amax > 0)
    norm = torch.where(usable, _exp2_int(torch.clamp(-exp, -127, 127)), torch.ones_like(amax))
    signal_e = torch.sum(torch.square(x32 * norm))
    noise_e = torch.sum(torch.square(noise * norm))
    db = 10.0 * torch.log10(signal_e / noise_e)
    return torch.where(noise_e == 0, torch.full_like(db, float("inf")), db)


def mx_clamp_fraction(
    x: torch.Tensor,
    *,
    fmt: FP8Format = "e4m3",
    block_size: int = 32,
    dim: int = -1,
    rounding: str = "rceil",
) -> torch.Tensor:
    """Fraction of ALL MX blocks of ``x`` that are non-zero, not NaN and get an E8M0 code at the clamp.

    At the clamp means code 0 (``2**-127``: the block is so small its elements lose precision or flush to
    zero) or 254 (``2**127``, also what an inf block gets).  Zero blocks (code 0 but exact) and NaN blocks
    (code 255) are not counted in the numerator; the denominator is the number of blocks.  Same blocking
    and rules as :func:`~hf_mixedprec.scaling.mx.quantize_mxfp8` (OCP MX v1.0 / TE).
    """
    f = _fp8_format(fmt)
    _check_block_size(block_size)
    r = _check_rounding(rounding)
    blocks, _ = _blocked(x, block_size, dim)
    if blocks.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    amax = torch.amax(torch.abs(blocks.to(torch.float32)), dim=-1)
    codes = mx_scale_codes(amax, fmt=f, rounding=r)
    at_clamp = (amax > 0) & ((codes == 0) | (codes == 254))  # NaN amax: amax > 0 is False
    return _fraction(at_clamp.sum(), torch.full((), amax.numel(), dtype=torch.float32, device=amax.device))
