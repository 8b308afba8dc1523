"""NVFP4 quantization (``hf_mixedprec.scaling.nvfp4``): Transformer Engine's rules written out here step by step,
torchao's NVFP4 quantizer where both define the same thing, 16x16 weight blocks, the random Hadamard transform and
stochastic rounding. Each test breaks when one rounding rule changes."""

from __future__ import annotations

import pytest
import torch

from hf_mixedprec.scaling.nvfp4 import (
    E2M1_VALUES,
    TE_RHT_SIGNS,
    e2m1_codes,
    e2m1_values,
    hadamard_matrix,
    nvfp4_quantize,
    pack_fp4,
    random_hadamard_transform,
    unpack_fp4,
)

F32_MAX = torch.finfo(torch.float32).max


def _te_rne(v: float) -> int:
    """TE's reference E2M1 cast (``cast_to_fp4x2``), interval by interval: ties go to the even code."""
    m = abs(v)
    steps = [(0.25, "le"), (0.75, "lt"), (1.25, "le"), (1.75, "lt"), (2.5, "le"), (3.5, "lt"), (5.0, "le")]
    code = 0
    for edge, kind in steps:
        if (m <= edge) if kind == "le" else (m < edge):
            break
        code += 1
    return code | (8 if v < 0 else 0)


def test_e2m1_rounds_to_nearest_with_ties_to_the_even_code():
    grid = [v for v in E2M1_VALUES] + [-v for v in E2M1_VALUES[1:]]
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    near = [t + d for t in ties for d in (-1e-6, 1e-6)]
    values = grid + ties + near + [-v for v in ties + near] + [7.0, -100.0, 0.1, -0.1]
    got = e2m1_codes(torch.tensor(values)).tolist()
    assert got == [_te_rne(min(max(v, -6.0), 6.0)) for v in values]
    assert e2m1_codes(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])).tolist() == [0, 2, 2, 4, 4, 6, 6]
    # -0.0 and NaN give code 0; a negative value rounding to zero keeps the sign bit (code 8)
    assert e2m1_codes(torch.tensor([-0.0, float("nan"), -0.2])).tolist() == [0, 0, 8]
    assert e2m1_values(torch.arange(16, dtype=torch.uint8)).tolist() == list(E2M1_VALUES) + [-v for v in E2M1_VALUES]


def test_pack_and_unpack_two_codes_a_byte_low_nibble_first():
    codes = torch.arange(16, dtype=torch.uint8).reshape(2, 8)
    packed = pack_fp4(codes)
    assert packed[0, 0].item() == 0 | (1 << 4) and packed.shape == (2, 4)
    assert torch.equal(unpack_fp4(packed), codes)


def _te_scales(x: torch.Tensor, tile_rows: int):
    """TE's ``_quantize_blockwise_reference`` scale arithmetic, step by step, in float32 tensors."""
    f = torch.float32
    amax = x.abs().max().to(f)
    g = torch.tensor(448.0 * 6.0, dtype=f) / amax
    g = torch.minimum(g, torch.tensor(F32_MAX, dtype=f))
    g = torch.where(g == 0, torch.tensor(1.0, dtype=f), g)
    m, n = x.shape
    if tile_rows == 1:
        vec = x.view(m, n // 16, 16).abs().amax(-1, keepdim=True)
    else:
        vec = x.view(m // 16, 16, n // 16, 16).abs().amax(dim=(1, 3)).repeat_interleave(16, 0).unsqueeze(-1)
    mult = g * torch.reciprocal(torch.tensor(6.0, dtype=f))
    d = torch.minimum(vec * mult, torch.tensor(F32_MAX, dtype=f)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    gd = torch.tensor(1.0, dtype=f) / g
    e = torch.minimum(1.0 / (d.to(f) * gd), torch.tensor(F32_MAX, dtype=f))
    return d.squeeze(-1), gd, e


@pytest.mark.parametrize("tile_rows", [1, 16])
def test_scales_and_codes_follow_transformer_engines_reference_step_by_step(tile_rows):
    torch.manual_seed(0)
    x = torch.randn(64, 128) * torch.logspace(-3, 2, 128)  # columns of very different magnitude
    q = nvfp4_quantize(x, tile=(tile_rows, 16))
    d, gd, e = _te_scales(x, tile_rows)
    assert torch.equal(q.block_scales.view(torch.uint8), d.view(torch.uint8))
    assert torch.equal(q.global_decode.view(torch.int32), gd.view(torch.int32))
    want = [_te_rne(v) for v in (x.view(64, 8, 16) * e).clamp(-6, 6).flatten().tolist()]
    assert q.codes.flatten().tolist() == want
    deq = q.dequantize()
    assert float((deq - x).norm() / x.norm()) < 0.15  # 4-bit values: close, not equal
    if tile_rows == 16:  # every 16x16 block one scale: rows of a block repeat it
        s = q.block_scales.float().view(4, 16, 8)
        assert torch.equal(s, s[:, :1, :].expand_as(s))


def test_sixteen_by_sixteen_blocks_quantize_a_weight_the_same_in_both_orientations():
    """With 2-D blocks the weight seen by the forward GEMM and the transposed one seen by the input-gradient GEMM are
    the same numbers (the reason the published recipe quantizes weights in 16x16 blocks); 1x16 blocks are not."""
    torch.manual_seed(1)
    w = torch.randn(64, 96) * torch.logspace(-2, 1, 96)
    two = nvfp4_quantize(w, tile=(16, 16)).dequantize()
    two_t = nvfp4_quantize(w.t().contiguous(), tile=(16, 16)).dequantize()
    assert torch.equal(two, two_t.t())
    one, one_t = (nvfp4_quantize(t, tile=(1, 16)).dequantize() for t in (w, w.t().contiguous()))
    assert not torch.equal(one, one_t.t())


def test_equal_to_torchaos_nvfp4_where_both_round_the_block_scale_alike():
    """torchao computes the block scale as ``(block_amax / 6) / (amax / 2688)``, TE as ``block_amax * ((2688 / amax)
    * (1 / 6))``: where the two float32 values are the same, the E4M3 scales and every packed FP4 byte are equal."""
    nvfp4 = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    torch.manual_seed(2)
    x = torch.randn(128, 256) * torch.logspace(-2, 2, 256)
    amax = x.abs().amax()
    theirs_scales, theirs_packed = nvfp4.nvfp4_quantize(x, per_tensor_scale=nvfp4.per_tensor_amax_to_scale(amax))
    ours = nvfp4_quantize(x, amax=amax)
    block_amax = x.view(128, 16, 16).abs().amax(-1)
    theirs_pre = (block_amax / 6.0) / (amax / (448.0 * 6.0))
    g = torch.tensor(448.0 * 6.0) / amax
    ours_pre = block_amax * (g * torch.reciprocal(torch.tensor(6.0)))
    alike = ours_pre == theirs_pre
    assert float(alike.float().mean()) > 0.5  # most blocks: the test compares something
    same_scale = ours.block_scales.view(torch.uint8) == theirs_scales.view(torch.uint8)
    assert bool(same_scale[alike].all())
    packed = pack_fp4(ours.codes).view(128, 16, 8)
    assert torch.equal(packed[alike], theirs_packed.view(128, 16, 8)[alike])


def test_global_scale_edge_cases():
    zeros = nvfp4_quantize(torch.zeros(16, 16))
    # 2688 / 0 is inf, held at FLT_MAX: the decode scale is 1 / FLT_MAX in float32
    assert torch.equal(zeros.global_decode, torch.tensor(1.0) / torch.tensor(F32_MAX))
    assert int(zeros.codes.max()) == 0 and float(zeros.dequantize().abs().max()) == 0.0
    with pytest.raises(ValueError, match=r"tile \(2, 16\)"):
        nvfp4_quantize(torch.zeros(16, 16), tile=(2, 16))
    with pytest.raises(ValueError, match="dims multiples"):
        nvfp4_quantize(torch.zeros(16, 20))


def test_hadamard_transform_is_tes_and_orthogonal():
    m = hadamard_matrix()
    assert torch.equal(m @ m.t(), torch.eye(16))  # entries ±1/4: every sum exact
    assert torch.equal(torch.sign(m[:, 0]), torch.tensor(TE_RHT_SIGNS, dtype=torch.float32))  # H's first column: 1s
    x = torch.arange(32, dtype=torch.float32).reshape(2, 16)
    want = torch.stack([torch.stack([sum(x[r, k] * m[k, c] for k in range(16)) for c in range(16)]) for r in range(2)])
    assert torch.equal(random_hadamard_transform(x), want)  # small integers: exact in any order
    # on both inputs of the weight-gradient GEMM (along the tokens) the product is unchanged
    torch.manual_seed(3)
    g, a = torch.randn(64, 32), torch.randn(64, 48)
    dw = g.t() @ a
    rg, ra = (random_hadamard_transform(t.t().contiguous()).t() for t in (g, a))
    assert torch.allclose(rg.t() @ ra, dw, atol=1e-4)
    with pytest.raises(ValueError, match="1 or -1"):
        hadamard_matrix((1,) * 15 + (0,))


def test_stochastic_rounding_is_unbiased_reproducible_and_keeps_grid_values():
    gen = torch.Generator().manual_seed(5)
    x = torch.full((20000,), 2.6)  # between 2 and 3: up with probability 0.6
    codes = e2m1_codes(x, gen)
    assert set(codes.unique().tolist()) == {4, 5}
    assert abs(float(e2m1_values(codes).mean()) - 2.6) < 0.02
    again = e2m1_codes(x, torch.Generator().manual_seed(5))
    assert torch.equal(codes, again)
    grid = torch.tensor([v for v in E2M1_VALUES] + [-v for v in E2M1_VALUES[1:]] + [7.0, -9.0])
    assert torch.equal(e2m1_codes(grid, gen), e2m1_codes(grid))
    neg = e2m1_codes(torch.full((4000,), -0.1), gen)  # between -0 and -0.5: sign kept either way
    assert set(neg.tolist()) == {8, 9} and abs(float(e2m1_values(neg).mean()) + 0.1) < 0.02
