"""Bit-level BF16 storage of FP32 values: the 16-bit remainder, stochastic rounding and Kahan compensation.

A BF16 number is the upper 16 bits of an FP32 number (same sign and exponent, 7 of the 23 mantissa bits), so an
FP32 master can be kept as its BF16 weight plus the 16 bits BF16 drops. Megatron-LM's precision-aware optimizer
("store param remainders", ``megatron/core/optimizer``) and the ``bf16-fused-adam`` package keep the BF16 weight
as the *truncated* upper half; here the BF16 weight is the upper half rounded to nearest (ties away from zero in
magnitude), and the remainder the signed difference, so the forward pass sees a correctly rounded weight and the
pair still gives back every FP32 bit: ``bits = (upper << 16) + remainder`` in integer arithmetic.

Stochastic rounding (Zamirai et al. 2020, "Revisiting BFloat16 Training") rounds up with probability equal to the
dropped fraction, so an update smaller than half a BF16 ulp survives in expectation; Kahan-compensated summation
keeps what rounding lost in a BF16 buffer and adds it back at the next update. All three are plain tensor
operations on the device (no host read).
"""

from __future__ import annotations

import torch

__all__ = [
    "combine_remainder",
    "kahan_store",
    "split_remainder",
    "stochastic_round_bf16",
]

_TWO32 = 1 << 32


def split_remainder(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bf16, remainder)`` of a float32 tensor: ``bf16`` is ``x`` rounded to nearest (ties away from zero),
    ``remainder`` (int16) the signed difference of the bit patterns, so :func:`combine_remainder` gives ``x`` back
    bit for bit (NaN payloads and infinities included)."""
    if x.dtype != torch.float32:
        raise TypeError(f"split_remainder needs float32 (got {x.dtype})")
    bits = x.view(torch.int32).to(torch.int64)
    low = bits & 0xFFFF
    rem = torch.where(low >= 0x8000, low - 0x10000, low)  # the low half read as a signed int16
    upper = (bits - rem) >> 16  # arithmetic shift: the rounded upper half, sign included
    upper = torch.where(upper >= 0x8000, upper - 0x10000, upper)  # a carry out of +max wraps like the bit pattern
    return upper.to(torch.int16).view(torch.bfloat16), rem.to(torch.int16)


def combine_remainder(upper: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The float32 tensor :func:`split_remainder` split into ``upper`` (bf16) and ``remainder`` (int16)."""
    bits = (upper.view(torch.int16).to(torch.int64) << 16) + remainder.to(torch.int64)
    bits = bits & 0xFFFFFFFF
    bits = torch.where(bits >= 0x80000000, bits - _TWO32, bits)
    return bits.to(torch.int32).view(torch.float32)


def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``x`` (float32) rounded to bfloat16 stochastically: up (away from zero) with probability equal to the
    dropped 16 bits / 2**16, else toward zero. Unbiased: E[result] = x. Non-finite values keep their class."""
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round_bf16 needs float32 (got {x.dtype})")
    noise = torch.randint(0, 1 << 16, x.shape, device=x.device, dtype=torch.int64, generator=generator)
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # the unsigned bit pattern
    rounded = ((bits + noise) >> 16) << 16
    finite = torch.isfinite(x)
    rounded = torch.where(finite, rounded, bits & 0xFFFF0000)  # inf stays inf; NaN stays NaN (upper half kept)
    rounded = torch.where(rounded >= 0x80000000, rounded - _TWO32, rounded)
    out = rounded.to(torch.int32).view(torch.float32).to(torch.bfloat16)  # exact: the low half is zero
    return torch.where(torch.isnan(x), torch.full_like(out, float("nan")), out)  # a low-half-only NaN stays NaN


def kahan_store(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bf16, compensation)`` for a float32 value: the nearest BF16 weight and what rounding lost, itself in BF16,
    added back to the weight before the next update (Kahan-compensated summation)."""
    weight = master.to(torch.bfloat16)
    return weight, (master - weight.float()).to(torch.bfloat16)
