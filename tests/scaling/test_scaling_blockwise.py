"""Blockwise FP8 (TE Float8BlockScaling, DeepSeek-V3): hand-made tiles, partial tiles, round trip."""

from __future__ import annotations

import math

import pytest
import torch

from hf_mixedprec.core.formats import FLOAT32_MAX
from hf_mixedprec.scaling import (
    current_scale,
    dequantize_blockwise,
    quantize_blockwise,
    quantize_fp8,
    sqnr_db,
    tensor_amax,
)

INF, NAN = math.inf, math.nan


def test_hand_made_tiles_exact() -> None:
    """2x3 tiles on a 2x9 tensor: each tile's scale is 2**floor(log2(448 / amax)) (zero/inf amax -> 1)."""
    x = torch.tensor(
        [
            [1.0, -0.5, 0.25, 448.0, 3.0, 1.0, 0.0, 0.0, 0.0],
            [0.75, 0.0, 0.125, -2.0, 1.0, 0.5, 0.0, 0.0, -0.0],
        ]
    )
    data, scales = quantize_blockwise(x, tile=(2, 3))
    assert scales.tolist() == [[256.0, 1.0, 1.0]]  # 448/1 -> 256; 448/448 -> 1; zero tile -> 1
    assert data.dtype == torch.float8_e4m3fn
    assert data.float().tolist() == [
        [256.0, -128.0, 64.0, 448.0, 3.0, 1.0, 0.0, 0.0, 0.0],
        [192.0, 0.0, 32.0, -2.0, 1.0, 0.5, 0.0, 0.0, -0.0],
    ]
    back = dequantize_blockwise(data, scales, tile=(2, 3))
    assert torch.equal(back, x)
    _, f32_scales = quantize_blockwise(x, tile=(2, 3), power_2=False)
    assert f32_scales.tolist() == [[448.0, 1.0, 1.0]]


def test_nan_is_ignored_by_the_tile_amax_and_inf_saturates() -> None:
    """Tile amax ignores NaN (TE amax rule): [NaN, 2] -> amax 2 -> 224 -> 128; inf tile -> scale 1, inf -> max."""
    x = torch.tensor([[NAN, 2.0, -1.0, 0.5], [INF, 3.0, -INF, 1.0]])
    data, scales = quantize_blockwise(x, tile=(1, 4), fmt="e5m2")
    assert scales.tolist() == [[16384.0], [1.0]]  # 57344/2 = 28672 -> 16384
    got = data.float()
    assert math.isnan(got[0, 0].item())
    assert got[0, 1:].tolist() == [32768.0, -16384.0, 8192.0]
    assert got[1].tolist() == [57344.0, 3.0, -57344.0, 1.0]


def test_tiny_amax_scale_is_flt_max_rounded_down() -> None:
    x = torch.full((1, 4), 1e-38)
    _, scales = quantize_blockwise(x, tile=(1, 4))
    assert scales.item() == 2.0**127  # 448 / 1e-38 overflows -> FLT_MAX -> power of two below
    _, s32 = quantize_blockwise(x, tile=(1, 4), power_2=False)
    assert s32.item() == FLOAT32_MAX


def reference_blockwise(x: torch.Tensor, tile: tuple[int, int], fmt: str, power_2: bool):
    """Loop over tiles (edge tiles partial) and apply the per-tensor rules to each slice."""
    tm, tn = tile
    m, n = x.shape[-2:]
    mt, nt = -(-m // tm), -(-n // tn)
    xb = x.reshape(-1, m, n)
    data = torch.empty(xb.shape, dtype=torch.float32)
    scales = torch.empty(xb.shape[0], mt, nt)
    for b in range(xb.shape[0]):
        for i in range(mt):
            for j in range(nt):
                rows, cols = slice(i * tm, (i + 1) * tm), slice(j * tn, (j + 1) * tn)
                s = current_scale(tensor_amax(xb[b, rows, cols]), fmt=fmt, power_2=power_2)
                scales[b, i, j] = s
                data[b, rows, cols] = quantize_fp8(xb[b, rows, cols], s, fmt).float()
    return data.reshape(x.shape), scales.reshape(*x.shape[:-2], mt, nt)


@pytest.mark.parametrize(
    ("shape", "tile"),
    [((3, 200), (1, 128)), ((130, 300), (128, 128)), ((2, 5, 256), (1, 128)), ((1, 128), (1, 128))],
)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("power_2", [True, False])
def test_partial_tiles_match_per_tile_reference(shape, tile, fmt: str, power_2: bool) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-20, 20, (*shape[:-1], 1), generator=g).float())
    x.view(-1)[5] = NAN
    data, scales = quantize_blockwise(x, tile=tile, fmt=fmt, power_2=power_2)
    ref_data, ref_scales = reference_blockwise(x, tile, fmt, power_2)
    assert scales.dtype == torch.float32 and scales.shape == ref_scales.shape
    assert torch.equal(scales.view(torch.int32), ref_scales.view(torch.int32))
    got = data.float()
    assert torch.equal(got.isnan(), ref_data.isnan())
    assert torch.equal(got.nan_to_num().view(torch.int32), ref_data.nan_to_num().view(torch.int32))


def test_last_partial_tile_uses_only_its_own_elements() -> None:
    x = torch.ones(2, 130)
    x[0, 129] = 3.5  # the 2-wide edge tile of row 0 is [1, 3.5]: 448 / 3.5 = 128 exactly
    x[1, 128:] = 0.0  # row 1's edge tile is all zero: scale 1
    data, scales = quantize_blockwise(x, tile=(1, 128))
    assert scales.tolist() == [[256.0, 128.0], [256.0, 1.0]]
    assert data[0, 127:].float().tolist() == [256.0, 128.0, 448.0]
    assert data[1, 127:].float().tolist() == [256.0, 0.0, 0.0]
    assert torch.equal(dequantize_blockwise(data, scales), x)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("tile", [(1, 128), (128, 128)])
def test_round_trip_sqnr_floor(fmt: str, tile: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(9)
    x = torch.randn(256, 384, generator=g)
    x[:, :7] *= 50.0  # an outlier channel: per-tile scales keep the rest accurate
    data, scales = quantize_blockwise(x, tile=tile, fmt=fmt)
    floor_db = {"e4m3": 30.0, "e5m2": 24.0}[fmt]
    assert sqnr_db(x, dequantize_blockwise(data, scales, tile=tile)).item() > floor_db
    bf = dequantize_blockwise(data, scales, tile=tile, dtype=torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and bf.shape == x.shape


def test_empty_and_validation() -> None:
    data, scales = quantize_blockwise(torch.empty(0, 300))
    assert data.shape == (0, 300) and scales.shape == (0, 3)
    with pytest.raises(ValueError, match=r"tile=\(0, 128\)"):
        quantize_blockwise(torch.ones(2, 2), tile=(0, 128))
    with pytest.raises(ValueError, match=r"tile=\(128,\)"):
        quantize_blockwise(torch.ones(2, 2), tile=(128,))
    with pytest.raises(ValueError, match="at least 2 dims"):
        quantize_blockwise(torch.ones(5))
    with pytest.raises(ValueError, match="fmt='fp16'"):
        quantize_blockwise(torch.ones(2, 2), fmt="fp16")
    data, scales = quantize_blockwise(torch.ones(4, 256))
    with pytest.raises(ValueError, match=r"scales.shape=\(4, 2\).*expected \(1, 2\)"):
        dequantize_blockwise(data, scales, tile=(128, 128))


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [(torch.bfloat16, float(torch.finfo(torch.bfloat16).max)), (torch.float32, float(torch.finfo(torch.float32).max))],
)
def test_overflowing_fp32_scale_takes_the_input_types_max(dtype: torch.dtype, expected: float) -> None:
    """TE's blockwise kernels (compute_scale_from_types in recipe_common.cuh) replace a scale that overflows float32
    with the largest finite value of the input type: bfloat16's 0x7F7F for a BF16 input, not FLT_MAX."""
    x = torch.full((2, 128), 1e-38, dtype=dtype)  # 448 / 1e-38 overflows float32
    x[1] = 0.5  # a normal tile next to it keeps its ordinary scale
    _, scales = quantize_blockwise(x, tile=(1, 128), power_2=False)
    assert scales[0, 0].item() == expected
    assert scales[1, 0].item() == torch.tensor(448.0 / 0.5, dtype=torch.float32).item()
    # the emulated layers upcast first and pass the type the operand had
    _, upcast = quantize_blockwise(x.float(), tile=(1, 128), power_2=False, input_dtype=dtype)
    assert torch.equal(upcast, scales)
    # power-of-2 scales clear the replacement's mantissa: 2**127 for both types
    _, p2 = quantize_blockwise(x, tile=(1, 128), power_2=True)
    assert p2[0, 0].item() == 2.0**127


def test_input_dtype_must_be_a_wide_float() -> None:
    with pytest.raises(ValueError, match=r"input_dtype=torch.float8_e4m3fn must be a float type"):
        quantize_blockwise(torch.ones(2, 128), input_dtype=torch.float8_e4m3fn)
