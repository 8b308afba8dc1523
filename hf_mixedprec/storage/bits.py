"""Bit-level BF16 storage of FP32 values: the 16-bit remainder, stochastic rounding and Kahan compensation.

A BF16 number is the upper 16 bits of an FP32 number (same sign and exponent, 7 of the 23 mantissa bits), so an
FP32 master can be kept as its BF16 weight plus the 16 bits BF16 drops. Megatron-LM's precision-aware optimizer
("store param remainders", ``megatron/core/optimizer``) and the ``bf16-fused-adam`` package keep the BF16 weight
as the *truncated* upper half; here the BF16 weight is the upper half rounded to nearest (ties away from zero in
magnitude), and the remainder the signed difference, so the forward pass sees a correctly rounded weight and the
pair still gives back every FP32 bit: ``bits = (upper << 16) + remainder`` in integer arithmetic.

Stochastic rounding (Zamirai et al. 2020, "Revisiting BFloat16 Training") rounds up with probability equal to the
dropped fraction, so an update smaller than half a BF16 ulp survives in expectation (a generator's draws; a seed
made by :func:`hash_seed` from host values gives the same draws again); Kahan-compensated summation keeps what
rounding lost in a BF16 buffer and adds it back at the next update. All three are plain tensor operations on the
device (no host read).
"""

from __future__ import annotations

import sys

import torch

__all__ = [
    "combine_remainder",
    "hash_seed",
    "kahan_store",
    "split_remainder",
    "stochastic_round_bf16",
]

#: FP32 bit pattern of the quiet NaN a NaN master is stored as (its payload is not kept).
_NAN_BITS = 0x7FC00000


def _nan_free_on_host(x: torch.Tensor) -> bool:
    """Whether ``x`` is a CPU tensor known to hold no NaN: its sum, read on the host, is a NaN if any element is one
    (or if infinities of both signs cancel: the caller then takes its NaN-safe path too). The sum reads the tensor
    once, where the NaN mask and select of :func:`_bits` read and write it twice more (over half of a remainder
    split on a CPU). False without a read elsewhere: on a GPU the read would be a sync, and fake, traced or
    vmap-batched tensors have no values."""
    if x.device.type != "cpu" or type(x) is not torch.Tensor or torch.compiler.is_compiling():
        return False
    try:
        return not torch.isnan(x.sum())
    except RuntimeError:  # a batched tensor under torch.vmap has no one value to read
        return False


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The int32 bit pattern of a float32 tensor, NaNs made the quiet NaN (the shifts below then never overflow):
    ``x``'s own memory where it holds no NaN on a CPU (:func:`_nan_free_on_host`), a new tensor otherwise."""
    if _nan_free_on_host(x):
        return x.view(torch.int32)
    nan = torch.full((), _NAN_BITS, dtype=torch.int32, device=x.device)
    return torch.where(torch.isnan(x), nan, x.view(torch.int32))


def _halves(bits: torch.Tensor) -> torch.Tensor:
    """The int16 halves of int32 ``bits`` (any shape and layout, 0-dim included), shape ``(*bits.shape, 2)``:
    ``[..., 0]`` the low half read as a signed int16, ``[..., 1]`` the high half (torch's devices are little-endian,
    low half first)."""
    if sys.byteorder != "little":  # pragma: no cover - every platform torch supports is little-endian
        raise RuntimeError("hf_mixedprec's BF16 remainder layout assumes a little-endian host")
    return bits.contiguous().unsqueeze(-1).view(torch.int16)


def split_remainder(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bf16, remainder)`` of a float32 tensor: ``bf16`` is ``x`` rounded to nearest (ties away from zero),
    ``remainder`` (int16) the signed difference of the bit patterns, so :func:`combine_remainder` gives ``x`` back
    bit for bit (infinities and signed zeros included; a NaN comes back as the quiet NaN, and its BF16 weight is a
    NaN, so the forward pass and the health detectors see it).

    In int16, on the pattern's halves: the remainder is the low half read as a signed int16, and the rounded upper
    half, ``(bits - remainder) >> 16``, is the high half plus the carry a negative remainder brings (its ``>> 15`` is
    -1). For a finite value that cannot overflow (a finite float's high half is below the infinities')."""
    if x.dtype != torch.float32:
        raise TypeError(f"split_remainder needs float32 (got {x.dtype})")
    halves = _halves(_bits(x))
    # two plain copies, then contiguous arithmetic (faster than strided); copies even where a half is contiguous
    # already (one element): ``halves`` may be ``x``'s own memory, which the carry below must not write
    rem = halves[..., 0].clone(memory_format=torch.contiguous_format)
    upper = halves[..., 1].clone(memory_format=torch.contiguous_format)
    upper -= rem >> 15
    return upper.view(torch.bfloat16), rem


def combine_remainder(upper: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The float32 tensor :func:`split_remainder` split into ``upper`` (bf16) and ``remainder`` (int16): the
    pattern's high half is the weight's less the borrow of a negative remainder, its low half the remainder's 16
    bits (``upper * 2**16 + remainder`` in int32, done on the halves)."""
    high = upper.view(torch.int16) + (remainder >> 15)
    return torch.stack((remainder, high), dim=-1).view(torch.float32).squeeze(-1)


def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``x`` (float32) rounded to bfloat16 stochastically: away from zero with probability equal to the dropped
    16 bits / 2**16, else toward zero. Unbiased: E[result] = x. Infinities stay infinite, NaN stays NaN. On the int32
    pattern, adding the noise grows the magnitude bits for either sign, and the arithmetic shift drops the low half."""
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round_bf16 needs float32 (got {x.dtype})")
    noise = torch.randint(0, 1 << 16, x.shape, device=x.device, dtype=torch.int32, generator=generator)
    rounded = ((_bits(x) + noise) >> 16).to(torch.int16)
    return rounded.view(torch.bfloat16)


def _hash32(v: int) -> int:
    """A 32-bit integer hash (xor-shift-multiply with the multipliers of C. Wellons' "lowbias32", from his
    hash-prospector search): nearby inputs give unrelated outputs."""
    v &= 0xFFFFFFFF
    v ^= v >> 16
    v = (v * 0x7FEB352D) & 0xFFFFFFFF
    v ^= v >> 15
    v = (v * 0x846CA68B) & 0xFFFFFFFF
    return v ^ (v >> 16)


def hash_seed(*parts: int) -> int:
    """A generator seed (a non-negative 64-bit int) from ``parts`` (seed, step, stream, ...), each mixed in by a
    32-bit hash, on the host: seeding a generator with it reads nothing from a device."""
    h, lo = 0, 0
    for part in parts:
        h = _hash32((h ^ (part & 0xFFFFFFFF)) + 0x5BD1E995)
        lo = _hash32(lo + h + 0x3C6EF372)
    return (h << 32) | lo


def kahan_store(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bf16, compensation)`` for a float32 value: the nearest BF16 weight and what rounding lost, itself in BF16,
    added back to the weight before the next update (Kahan-compensated summation)."""
    weight = master.to(torch.bfloat16)
    return weight, (master - weight.float()).to(torch.bfloat16)
