"""Pure FP8 / MXFP8 scaling math (torch only, no nn.Module, no host-device sync).

* :mod:`.fp8` per-tensor quantize/dequantize, current scaling (TE Float8CurrentScaling, torchao tensorwise),
  delayed scaling (TE DelayedScaling), NaN-ignoring amax.
* :mod:`.mx` MXFP8 blocks with E8M0 scales (OCP MX v1.0 FLOOR, TE/hardware RCEIL).
* :mod:`.blockwise` 1x128 / 128x128 tiles (TE Float8BlockScaling, DeepSeek-V3).
* :mod:`.nvfp4` NVFP4: FP4 E2M1 values, E4M3 scales per 1x16 / 16x16 block and an FP32 scale per tensor (TE
  NVFP4BlockScaling), the random Hadamard transform and stochastic rounding of its training recipe.
* :mod:`.stats` saturation, underflow, SQNR and MX clamp fractions, and the per-layer :class:`LayerStats`.
"""

from hf_mixedprec.scaling.blockwise import dequantize_blockwise, quantize_blockwise
from hf_mixedprec.scaling.fp8 import current_scale, delayed_update, dequantize_fp8, quantize_fp8, tensor_amax
from hf_mixedprec.scaling.mx import E8M0_NAN, dequantize_mxfp8, mx_scale_codes, quantize_mxfp8
from hf_mixedprec.scaling.stats import (
    LayerStats,
    RoleStats,
    mx_clamp_fraction,
    operand_stats,
    saturation_fraction,
    sqnr_db,
    underflow_fraction,
)

__all__ = [
    "E8M0_NAN",
    "LayerStats",
    "RoleStats",
    "current_scale",
    "delayed_update",
    "dequantize_blockwise",
    "dequantize_fp8",
    "dequantize_mxfp8",
    "mx_clamp_fraction",
    "mx_scale_codes",
    "operand_stats",
    "quantize_blockwise",
    "quantize_fp8",
    "quantize_mxfp8",
    "saturation_fraction",
    "sqnr_db",
    "tensor_amax",
    "underflow_fraction",
]
