"""Number-format facts: the limits of FP8 (E4M3, E5M2), FP16, BF16, their torch dtypes, and defaults.

Values follow the OCP 8-bit floating point spec as used by Transformer Engine and torchao:
E4M3 (``float8_e4m3fn``) max 448, E5M2 max 57344; FP16 max 65504 with min normal 2**-14;
BF16 shares FP32's exponent range.  Also here, because every layer needs them and they must be written once:
the compute format of each recipe precision (:data:`COMPUTE_FORMATS`) and the FP8 scaling options' defaults
(:data:`FP8_SCALING_DEFAULTS`).  This module is the only place such constants live.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "BF16",
    "COMPUTE_FORMATS",
    "E4M3",
    "E5M2",
    "FLOAT32_MAX",
    "FORMATS",
    "FP8_SCALING_DEFAULTS",
    "FP16",
    "FP32",
    "NumberFormat",
    "compute_dtype",
    "get_format",
]

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
#: FP4 E2M1 (OCP MX v1.0, Sec. 5.3.3; NVFP4's values): ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}. torch has no unpacked FP4
#: dtype; its codes are held as uint8 (``hf_mixedprec.scaling.nvfp4``). Not in :data:`FORMATS`: no tensor is cast to it.
E2M1 = NumberFormat(name="e2m1", dtype=torch.uint8, max=6.0, min_normal=1.0, min_subnormal=0.5, mantissa_bits=1, emax=2)


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


#: The format a recipe precision computes in (its autocast dtype; ``.name`` is Accelerate's ``mixed_precision``).
#: FP8 layers run inside a BF16 autocast; ``fp32`` has no entry (no autocast).
COMPUTE_FORMATS: dict[str, NumberFormat] = {"fp16": FP16, "bf16": BF16, "fp8": BF16}


def compute_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a recipe precision (``None`` for ``fp32``)."""
    fmt = COMPUTE_FORMATS.get(precision)
    return None if fmt is None else fmt.dtype


#: The options each FP8 scaling accepts, and their defaults (an option not listed does not apply to it).
FP8_SCALING_DEFAULTS: dict[str, dict[str, Any]] = {
    # TE DelayedScaling (transformer_engine/common/recipe/__init__.py): margin=0, amax_history_len=1024, "max".
    "delayed": {"amax_history_len": 1024, "amax_compute_algo": "max", "margin": 0},
    # TE Float8CurrentScaling / torchao tensorwise: amax now, optional epsilon floor, optional pow-2 scales.
    "current": {"epsilon": 0.0, "power_2_scales": False},
    # OCP MX v1.0: 32-element blocks with an E8M0 scale; TE uses the RCEIL rule.
    "mxfp8": {"mx_rounding": "rceil", "block_size": 32, "margin": 0},
    # TE Float8BlockScaling: 1x128 activation/grad tiles, 128x128 weight blocks, pow-2 scales by default.
    "blockwise": {"block_size": 128, "power_2_scales": True},
    # TE NVFP4BlockScaling: E2M1 values, an E4M3 scale per 16 elements and an FP32 one per tensor; 16x16 weight
    # blocks, a random Hadamard transform on the wgrad GEMM's inputs and stochastic rounding of gradients, each on by
    # default there (disable_2d_quantization, disable_rht, disable_stochastic_rounding). rht_signs None: TE's vector.
    "nvfp4": {
        "block_size": 16,
        "weight_2d": True,
        "rht": True,
        "rht_signs": None,
        "stochastic_rounding": True,
        "sr_seed": 0,
    },
}
