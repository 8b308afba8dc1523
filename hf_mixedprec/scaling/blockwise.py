"""2-D blockwise FP8 scaling (TE ``Float8BlockScaling``, DeepSeek-V3 style; Hopper).

Activations and gradients use 1x128 tiles, weights 128x128 tiles, over the last two dims of ``x``.  Each
tile has its own float32 scale computed with the current-scaling rule (:func:`current_scale`, epsilon 0):
``scale = fp8_max / amax_tile`` (zero / inf amax -> 1.0), rounded down to a power of two by default
(TE default ``use_f32_scales=False``).  The tile amax ignores NaN elements (TE: amax ignores NaN), so a
NaN element does not poison its neighbours' scale; it stays NaN in ``data``.

A tile whose scale overflows float32 (an amax below ``fp8_max / FLT_MAX``) gets the largest finite value of the
*input* type instead (bfloat16's 0x7F7F for a BF16 input, FLT_MAX for float32), as TE's blockwise kernels do
(``compute_scale_from_types`` in ``transformer_engine/common/recipe/recipe_common.cuh``, used by
``transpose/quantize_transpose_{square,vector}_blockwise.cu``); power-of-2 rounding then clears its mantissa.

Partial tiles: when a dim is not a multiple of the tile, the last tile along it is partial (as in TE);
the amax is taken over the elements that exist (internally the tensor is zero-padded, and zeros never
change an amax).  ``scales`` has shape ``[..., ceil(M / tile[0]), ceil(N / tile[1])]``.
Returned ``scales`` multiply (``data = sat_RNE(x * scale)``); dequantization multiplies by ``1 / scale``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_mixedprec.core.formats import FLOAT32_MAX
from hf_mixedprec.scaling.fp8 import FP8Format, _fp8_format, current_scale
from hf_mixedprec.scaling.mx import _to_float32

__all__ = ["dequantize_blockwise", "quantize_blockwise"]


def _check_tile(tile: tuple[int, int]) -> tuple[int, int]:
    ok = (
        isinstance(tile, (tuple, list))
        and len(tile) == 2
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 1 for t in tile)
    )
    if not ok:
        raise ValueError(f"tile={tile!r} must be a pair of positive ints, e.g. (1, 128) or (128, 128)")
    return int(tile[0]), int(tile[1])


def _check_2d(x: torch.Tensor, arg: str) -> None:
    if x.dim() < 2:
        raise ValueError(f"{arg} must have at least 2 dims (tiles cover the last two), got shape {tuple(x.shape)}")


def _input_type_max(dtype: torch.dtype) -> float:
    """The largest finite value of a float input type, capped at FLT_MAX (float64 inputs are float32 in TE)."""
    if not dtype.is_floating_point or dtype.itemsize == 1:
        raise ValueError(f"input_dtype={dtype} must be a float type of 2 bytes or more (float32, bfloat16, float16)")
    return min(float(torch.finfo(dtype).max), FLOAT32_MAX)


def _n_tiles(size: int, t: int) -> int:
    return -(-size // t)


def _tiled(x: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """Zero-pad the last two dims of ``x`` to whole tiles and view as ``[..., Mt, tm, Nt, tn]``."""
    tm, tn = tile
    m, n = x.shape[-2], x.shape[-1]
    mt, nt = _n_tiles(m, tm), _n_tiles(n, tn)
    pad_m, pad_n = mt * tm - m, nt * tn - n
    if pad_m or pad_n:
        x = F.pad(x, (0, pad_n, 0, pad_m))
    return x.reshape(*x.shape[:-2], mt, tm, nt, tn)


def _untile(t: torch.Tensor, m: int, n: int) -> torch.Tensor:
    mt, tm, nt, tn = t.shape[-4:]
    return t.reshape(*t.shape[:-4], mt * tm, nt * tn)[..., :m, :n]


def quantize_blockwise(
    x: torch.Tensor,
    *,
    tile: tuple[int, int] = (1, 128),
    fmt: FP8Format = "e4m3",
    power_2: bool = True,
    input_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the last two dims of ``x`` in tiles (TE Float8BlockScaling): returns ``(data, scales)``.

    ``data``: ``x``'s shape, float8; ``scales``: float32 ``[..., ceil(M/tm), ceil(N/tn)]`` with
    ``scale = current_scale(nan-ignoring tile amax, fmt=fmt, power_2=power_2, value_for_inf=max of the input
    type)``. ``input_dtype`` is the type the tensor had before it was upcast (default ``x.dtype``); it decides
    the value an overflowing scale takes (see module docs).
    """
    f = _fp8_format(fmt)
    tm, tn = _check_tile(tile)
    _check_2d(x, "x")
    value_for_inf = _input_type_max(x.dtype if input_dtype is None else input_dtype)
    m, n = x.shape[-2], x.shape[-1]
    t = _tiled(x.to(torch.float32), (tm, tn))
    a = torch.abs(t)
    a = torch.where(torch.isnan(a), torch.zeros((), dtype=a.dtype, device=a.device), a)
    amax = torch.amax(a, dim=(-3, -1))
    scales = current_scale(amax, fmt=f, power_2=power_2, value_for_inf=value_for_inf)
    y = torch.clamp(t * scales[..., :, None, :, None], -f.max, f.max)
    return _untile(y, m, n).to(f.dtype), scales


def dequantize_blockwise(
    data: torch.Tensor,
    scales: torch.Tensor,
    *,
    tile: tuple[int, int] = (1, 128),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantize tiles: ``float32(data) * (1 / scale)`` per tile (TE: dequantize with scale_inv)."""
    tm, tn = _check_tile(tile)
    _check_2d(data, "data")
    m, n = data.shape[-2], data.shape[-1]
    expected = (*data.shape[:-2], _n_tiles(m, tm), _n_tiles(n, tn))
    if tuple(scales.shape) != expected:
        raise ValueError(
            f"scales.shape={tuple(scales.shape)} does not match data.shape={tuple(data.shape)} with "
            f"tile={(tm, tn)}; expected {expected}"
        )
    t = _tiled(_to_float32(data), (tm, tn))  # data.to(torch.float32), faster for E4M3 on the CPU
    inv = torch.reciprocal(scales.to(torch.float32))
    return _untile(t * inv[..., :, None, :, None], m, n).to(dtype)
