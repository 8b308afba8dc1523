"""Number-format facts: the limits of FP8 (E4M3, E5M2), FP16, BF16 and their torch dtypes.

Values follow the OCP 8-bit floating point spec as used by Transformer Engine and torchao:
E4M3 (``float8_e4m3fn``) max 448, E5M2 max 57344; FP16 max 65504 with min normal 2**-14;
BF16 shares FP32's exponent range.  This module is the only place such constants live.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BF16", "E4M3", "E5M2", "FLOAT32_MAX", "FORMATS", "FP16", "FP32", "NumberFormat", "get_format"]

#: Largest finite float32; TE replaces an infinite scale with this value.
FLOAT32_MAX: float = float(torch.finfo(torch.float32).max)


@dataclass(frozen=True)
class NumberFormat:
    """Static facts about one floating-point format."""

    name: str
    dtype: torch.dtype
    max: float
    """Largest finite magnitude."""
    min_normal: float
    """Smallest positive normal number."""
    min_subnormal: float
    """Smallest positive subnormal number (values below half of it round to zero)."""
    mantissa_bits: int
    emax: int
    """Exponent of the largest normal power of two (OCP MX ``emax_elem``: 8 for E4M3, 15 for E5M2)."""


_MANTISSA_BITS = {
    torch.float8_e4m3fn: 3,
    torch.float8_e5m2: 2,
    torch.float16: 10,
    torch.bfloat16: 7,
    torch.float32: 23,
}


def _from_finfo(name: str, dtype: torch.dtype, emax: int) -> NumberFormat:
    fi = torch.finfo(dtype)
    nmant = _MANTISSA_BITS[dtype]
    return NumberFormat(
        name=name,
        dtype=dtype,
        max=float(fi.max),
        min_normal=float(fi.tiny),
        min_subnormal=float(fi.smallest_normal) * 2.0**-nmant,
        mantissa_bits=nmant,
        emax=emax,
    )


E4M3 = _from_finfo("e4m3", torch.float8_e4m3fn, emax=8)
E5M2 = _from_finfo("e5m2", torch.float8_e5m2, emax=15)
FP16 = _from_finfo("fp16", torch.float16, emax=15)
BF16 = _from_finfo("bf16", torch.bfloat16, emax=127)
FP32 = _from_finfo("fp32", torch.float32, emax=127)

FORMATS: dict[str, NumberFormat] = {f.name: f for f in (E4M3, E5M2, FP16, BF16, FP32)}


def get_format(fmt: str | torch.dtype | NumberFormat) -> NumberFormat:
    """Return the :class:`NumberFormat` for a name (``"e4m3"``, ``"E5M2"``...), a torch dtype or a format."""
    if isinstance(fmt, NumberFormat):
        return fmt
    if isinstance(fmt, torch.dtype):
        for f in FORMATS.values():
            if f.dtype == fmt:
                return f
        raise ValueError(f"unsupported dtype {fmt} (allowed: {', '.join(str(f.dtype) for f in FORMATS.values())})")
    key = str(fmt).lower()
    if key not in FORMATS:
        raise ValueError(f"unknown number format {fmt!r} (allowed: {', '.join(FORMATS)})")
    return FORMATS[key]
