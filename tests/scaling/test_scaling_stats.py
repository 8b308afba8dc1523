"""FP8 health statistics: exact values on hand-made inputs."""

from __future__ import annotations

import math

import pytest
import torch

from hf_mixedprec.core.formats import FLOAT32_MAX
from hf_mixedprec.scaling import mx_clamp_fraction, saturation_fraction, sqnr_db, underflow_fraction

INF, NAN = math.inf, math.nan


def assert_scalar(t: torch.Tensor, value: float) -> None:
    assert t.dtype == torch.float32 and t.dim() == 0
    assert torch.equal(t, torch.tensor(value, dtype=torch.float32)), (t, value)


def test_saturation_fraction_counts_finite_elements_at_or_above_max() -> None:
    # finite: 448, 449, -500, 1, 0, 447.99 -> 6; at/above max: 448, 449, -500 -> 3
    x = torch.tensor([448.0, 449.0, -500.0, 1.0, INF, NAN, 0.0, 447.99])
    assert_scalar(saturation_fraction(x, torch.tensor(1.0), "e4m3"), 0.5)
    # scale 2: 447.99 * 2 saturates too (1 * 2 and 0 do not) -> 4/6
    assert_scalar(saturation_fraction(x, torch.tensor(2.0), "e4m3"), 4 / 6)
    assert_scalar(saturation_fraction(x, 2.0, "E4M3"), 4 / 6)
    # E5M2 max is 57344: nothing saturates at scale 1
    assert_scalar(saturation_fraction(x, torch.tensor(1.0), "e5m2"), 0.0)
    # x * scale overflowing float32 counts as saturated
    assert_scalar(saturation_fraction(torch.tensor([1e30, 1e-6]), torch.tensor(1e10), "e5m2"), 0.5)
    # broadcast per-row scales
    x2 = torch.tensor([[1.0, 2.0], [1.0, 2.0]])
    assert_scalar(saturation_fraction(x2, torch.tensor([[1.0], [300.0]]), "e4m3"), 0.25)
    assert_scalar(saturation_fraction(torch.tensor([NAN, INF]), torch.tensor(1.0), "e4m3"), 0.0)
    assert_scalar(saturation_fraction(torch.empty(0), torch.tensor(1.0), "e4m3"), 0.0)


def test_underflow_fraction_uses_round_nearest_even() -> None:
    sub = 2.0**-9  # smallest E4M3 subnormal
    # non-zero, non-NaN: sub/2 (tie -> 0), 0.75*sub (-> sub), 1e-30, 1.0, -sub/4, inf -> 6
    # underflow to 0: sub/2, 1e-30, -sub/4 -> 3
    x = torch.tensor([sub / 2, 0.75 * sub, 0.0, NAN, 1e-30, 1.0, -sub / 4, INF])
    assert_scalar(underflow_fraction(x, torch.tensor(1.0), "e4m3"), 0.5)
    # scale 2**10 lifts everything but 1e-30 out of the underflow range -> 1/6
    assert_scalar(underflow_fraction(x, torch.tensor(1024.0), "e4m3"), 1 / 6)
    # E5M2's smallest subnormal is 2**-16: sub / 4 = 2**-11 survives -> 1/6 (only 1e-30)
    assert_scalar(underflow_fraction(x, torch.tensor(1.0), "e5m2"), 1 / 6)
    assert_scalar(underflow_fraction(torch.zeros(3), torch.tensor(1.0), "e4m3"), 0.0)


def test_sqnr_db_exact_cases() -> None:
    x = torch.tensor([1.0, -1.0, 1.0, 1.0])
    assert_scalar(sqnr_db(x, x.clone()), INF)
    assert_scalar(sqnr_db(torch.zeros(3), torch.zeros(3)), INF)
    assert_scalar(sqnr_db(x, torch.zeros(4)), 0.0)  # noise == signal
    assert_scalar(sqnr_db(torch.zeros(3), torch.ones(3)), -INF)
    # signal 4, noise 1 -> 10 * log10(4)
    assert_scalar(sqnr_db(x, torch.tensor([1.0, -1.0, 1.0, 0.0])), (10.0 * torch.log10(torch.tensor(4.0))).item())
    # signal 100, noise 1 -> exactly 20 dB
    assert_scalar(sqnr_db(torch.tensor([6.0, 8.0]), torch.tensor([6.0, 7.0])), 20.0)
    assert math.isnan(sqnr_db(torch.tensor([NAN, 1.0]), torch.tensor([1.0, 1.0])).item())


def test_sqnr_db_no_float32_overflow() -> None:
    g = torch.Generator().manual_seed(10)
    x = torch.randn(1000, generator=g) * 1e30  # sum of squares ~1e63 overflows float32
    x_hat = x * (1 + 1e-3 * torch.randn(1000, generator=g))
    ref = 10 * math.log10(
        sum(v * v for v in x.double().tolist()) / sum((a - b) ** 2 for a, b in zip(x.tolist(), x_hat.tolist()))
    )
    got = sqnr_db(x, x_hat).item()
    assert math.isfinite(got) and abs(got - ref) < 1e-3
    tiny = x * 1e-32 * 1e-33  # ~1e-35: squares would underflow float32
    got_tiny = sqnr_db(tiny, x_hat * 1e-32 * 1e-33).item()
    assert abs(got_tiny - ref) < 1e-2
    bf = sqnr_db(x.to(torch.bfloat16), x_hat.to(torch.bfloat16))
    assert bf.dtype == torch.float32


def test_sqnr_db_shape_validation() -> None:
    with pytest.raises(ValueError, match=r"x_hat.shape=\(3,\) must equal x.shape=\(4,\)"):
        sqnr_db(torch.ones(4), torch.ones(3))


@pytest.mark.parametrize("rounding", ["floor", "rceil"])
def test_mx_clamp_fraction(rounding: str) -> None:
    blocks = torch.zeros(6, 4)
    blocks[1] = torch.tensor([1.0, 2.0, 3.0, 4.0])  # normal: code ~120, not at the clamp
    blocks[2] = torch.tensor([1e-39, 0.0, 0.0, 0.0])  # tiny: code 0 -> counted
    blocks[3] = torch.tensor([INF, 1.0, 0.0, 0.0])  # inf: code 254 -> counted
    blocks[4] = torch.tensor([NAN, 1.0, 0.0, 0.0])  # NaN: code 255 -> not counted
    blocks[5] = torch.tensor([FLOAT32_MAX, 1.0, 0.0, 0.0])  # huge but finite: code < 254
    # block 0 is all zero: code 0 but exact -> not counted.  2 of 6 blocks.
    x = blocks.reshape(1, 24)
    assert_scalar(mx_clamp_fraction(x, fmt="e4m3", block_size=4, dim=-1, rounding=rounding), 2 / 6)
    # the same blocks laid out along dim 0
    assert_scalar(mx_clamp_fraction(x.t().contiguous(), fmt="e5m2", block_size=4, dim=0, rounding=rounding), 2 / 6)
    assert_scalar(mx_clamp_fraction(torch.ones(2, 32), fmt="e4m3", block_size=32, dim=-1), 0.0)
    assert_scalar(mx_clamp_fraction(torch.empty(0, 32), fmt="e4m3", block_size=32, dim=-1), 0.0)
    with pytest.raises(ValueError, match="not divisible by block_size=5"):
        mx_clamp_fraction(x, fmt="e4m3", block_size=5, dim=-1)


def test_stats_validation() -> None:
    with pytest.raises(ValueError, match="fmt='int8'"):
        saturation_fraction(torch.ones(2), torch.tensor(1.0), "int8")
    with pytest.raises(ValueError, match="fmt='bf16'"):
        underflow_fraction(torch.ones(2), torch.tensor(1.0), "bf16")
