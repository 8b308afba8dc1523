"""Per-tensor FP8 scaling: quantize/dequantize, current scaling, delayed scaling, amax, no host sync.

References are plain-python scalar implementations of the DESIGN.md rules (math.frexp, struct, round()),
independent of the torch code under test; torchao is a second, bit-exact cross-check for current scaling.
"""

from __future__ import annotations

import math
import random
import struct

import pytest
import torch

from hf_mixedprec.core.formats import E4M3, E5M2, FLOAT32_MAX
from hf_mixedprec.scaling import (
    current_scale,
    delayed_update,
    dequantize_blockwise,
    dequantize_fp8,
    dequantize_mxfp8,
    mx_clamp_fraction,
    quantize_blockwise,
    quantize_fp8,
    quantize_mxfp8,
    saturation_fraction,
    sqnr_db,
    tensor_amax,
    underflow_fraction,
)

FMTS = ["e4m3", "e5m2"]
DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# (max, mantissa bits, exponent of the smallest normal): OCP FP8 spec constants, written out independently.
SPEC = {"e4m3": (448.0, 3, -6), "e5m2": (57344.0, 2, -14)}
INF, NAN = math.inf, math.nan


# ---------------------------------------------------------------- plain-python references


def f32(v: float) -> float:
    """Round a python float to float32 with round-to-nearest-even; overflow gives ±inf."""
    if math.isnan(v) or math.isinf(v):
        return v
    try:
        return struct.unpack("<f", struct.pack("<f", v))[0]
    except OverflowError:
        return math.copysign(INF, v)


def ref_fp8(v: float, fmt: str) -> float:
    """Saturating round-to-nearest-even of ``v`` to the FP8 grid (value, as a python float)."""
    fmax, mbits, emin = SPEC[fmt]
    if math.isnan(v):
        return NAN
    a = abs(v)
    if a >= fmax:
        r = fmax
    elif a == 0.0:
        r = 0.0
    else:
        _, e = math.frexp(a)  # a = m * 2**e with m in [0.5, 1)
        quantum = math.ldexp(1.0, max(e - 1, emin) - mbits)
        r = min(round(a / quantum) * quantum, fmax)  # round(): ties to even
    return math.copysign(r, v)


def ref_quantize(v: float, scale: float, fmt: str) -> float:
    return ref_fp8(f32(v * scale), fmt)


def ref_current_scale(amax: float, fmt: str, eps: float = 0.0, power_2: bool = False) -> float:
    fmax = SPEC[fmt][0]
    if math.isnan(amax):
        return 1.0
    a = max(amax, eps)
    if a <= 0.0 or math.isinf(a):
        return 1.0
    s = f32(fmax / a)
    if math.isinf(s):
        s = FLOAT32_MAX
    if power_2:
        s = math.ldexp(1.0, math.frexp(s)[1] - 1)
    return s


def ref_delayed_step(hist: list[float], scale: float, a: float, fmt: str, margin: int, algo: str):
    """TE's delayed scaling for one quantizer (``transformer_engine/common/recipe/delayed_scaling.cu``): the window
    max is an fmaxf reduction from 0 (NaN entries drop out), the margin scales the format maximum first and the
    scale is one float32 division."""
    if a == 0.0:
        return hist, scale
    hist = [*hist[1:], a]
    if algo == "max":
        used = max([0.0, *(h for h in hist if not math.isnan(h))])
    else:
        used = a
    if math.isfinite(used) and used > 0.0:
        s = f32(f32(SPEC[fmt][0] * 2.0**-margin) / used)
        return hist, FLOAT32_MAX if math.isinf(s) else s
    return hist, scale


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32) if t.dtype == torch.float32 else t.contiguous().view(torch.uint8)


def assert_same_f32(actual: torch.Tensor, expected: list[float]) -> None:
    """Bit-exact float32 comparison (signed zeros matter), NaN positions must agree."""
    exp_t = torch.tensor(expected, dtype=torch.float32).reshape(actual.shape)
    act = actual.to(torch.float32)
    assert torch.equal(torch.isnan(act), torch.isnan(exp_t))
    keep = ~torch.isnan(exp_t)
    assert torch.equal(bits(act)[keep], bits(exp_t)[keep]), (act[keep], exp_t[keep])


def edge_values(fmt: str) -> list[float]:
    fmax, mbits, emin = SPEC[fmt]
    sub = math.ldexp(1.0, emin - mbits)  # smallest fp8 subnormal
    up = float(torch.nextafter(torch.tensor(fmax), torch.tensor(INF)))
    down = float(torch.nextafter(torch.tensor(fmax), torch.tensor(0.0)))
    vals = [0.0, -0.0, fmax, -fmax, up, -up, down, fmax * 1.03, fmax * 1.0625, 1.0625, 1.1875, 3.0, -5.5]
    vals += [sub, -sub, sub / 2, sub * 0.75, sub * 1.5, sub * 2.5, math.ldexp(1.0, emin), math.ldexp(1.0, emin) * 0.96]
    vals += [1e38, -1e38, FLOAT32_MAX, 1e-38, -1e-38, 1.4e-45, 1.1754943508222875e-38, INF, -INF, NAN]
    return [f32(v) for v in vals]


# ---------------------------------------------------------------- quantize / dequantize


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("scale", [1.0, 0.125, 3.0, 1e30, 1e-30, 0.0])
def test_quantize_fp8_edge_values_match_scalar_reference(fmt: str, scale: float) -> None:
    vals = edge_values(fmt)
    q = quantize_fp8(torch.tensor(vals), torch.tensor(scale), fmt)
    assert q.dtype == DTYPES[fmt]
    assert_same_f32(q.float(), [ref_quantize(v, f32(scale), fmt) for v in vals])


@pytest.mark.parametrize("fmt", FMTS)
def test_quantize_fp8_random_matches_scalar_reference(fmt: str) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3000, generator=g) * torch.exp2(torch.randint(-40, 40, (3000,), generator=g).float())
    scale = torch.tensor(f32(1.7))
    q = quantize_fp8(x, scale, fmt.upper())
    assert_same_f32(q.float(), [ref_quantize(v, scale.item(), fmt) for v in x.tolist()])


def test_quantize_fp8_bf16_input_and_broadcast_scale() -> None:
    x = torch.tensor([[1.0, 500.0], [-3.0, 2.0**-12]], dtype=torch.bfloat16)
    scale = torch.tensor([[1.0], [2.0**6]])
    q = quantize_fp8(x, scale, E4M3)
    assert_same_f32(q.float(), [1.0, 448.0, -192.0, 2.0**-6])


@pytest.mark.parametrize("fmt", FMTS)
def test_dequantize_fp8_multiplies_by_reciprocal(fmt: str) -> None:
    vals = [v for v in edge_values(fmt) if not math.isnan(v)]
    scale = f32(3.0)
    q = quantize_fp8(torch.tensor(vals), torch.tensor(scale), fmt)
    out = dequantize_fp8(q, torch.tensor(scale))
    inv = f32(1.0 / scale)
    assert_same_f32(out, [f32(ref_quantize(v, scale, fmt) * inv) for v in vals])
    half = dequantize_fp8(q, torch.tensor(scale), dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16
    assert torch.equal(half, out.to(torch.bfloat16))


def test_dequantize_fp8_power_of_two_round_trip_is_exact() -> None:
    x = torch.tensor([1.0, -0.375, 2.0**-12, 448.0 / 64])
    scale = torch.tensor(64.0)
    assert torch.equal(dequantize_fp8(quantize_fp8(x, scale, "e4m3"), scale), x)


# ---------------------------------------------------------------- amax


def test_tensor_amax_ignores_nan_keeps_inf() -> None:
    assert torch.equal(tensor_amax(torch.tensor([1.0, NAN, -3.5, 2.0])), torch.tensor(3.5))
    assert torch.equal(tensor_amax(torch.tensor([1.0, NAN, -INF])), torch.tensor(INF))
    assert torch.equal(tensor_amax(torch.tensor([NAN, NAN])), torch.tensor(0.0))
    assert torch.equal(tensor_amax(torch.empty(0, 4)), torch.tensor(0.0))
    bf = tensor_amax(torch.tensor([[-2.5, 1.0]], dtype=torch.bfloat16))
    assert bf.dtype == torch.float32 and bf.dim() == 0 and bf.item() == 2.5
    f8 = tensor_amax(torch.tensor([-448.0, 3.0]).to(torch.float8_e4m3fn))
    assert f8.item() == 448.0


# ---------------------------------------------------------------- current scaling


def amax_edge_values(fmt: str) -> list[float]:
    fmax = SPEC[fmt][0]
    vals = [0.0, 1e-45, 1e-40, 1e-38, 1.1754943508222875e-38, 1e-13, 1e-12, 9.999999e-13, 1.0000001e-12]
    vals += [1e-6, 0.5, 1.0, 3.0, fmax, fmax * 2, 1e30, 1e38, FLOAT32_MAX]
    vals += [float(torch.nextafter(torch.tensor(fmax), torch.tensor(INF)))]
    return [f32(v) for v in vals]


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("power_2", [False, True])
def test_current_scale_matches_scalar_reference(fmt: str, power_2: bool) -> None:
    vals = [*amax_edge_values(fmt), INF, NAN, -1.0]
    out = current_scale(torch.tensor(vals), fmt=fmt, power_2=power_2)
    assert out.dtype == torch.float32
    assert_same_f32(out, [ref_current_scale(v, fmt, 0.0, power_2) for v in vals])
    eps = 1e-6
    out = current_scale(torch.tensor(vals), fmt=fmt, epsilon=eps, power_2=power_2)
    assert_same_f32(out, [ref_current_scale(v, fmt, eps, power_2) for v in vals])


def test_current_scale_special_values() -> None:
    s = current_scale(torch.tensor([0.0, INF, NAN, 1e-38, 448.0, 1.0]), fmt="e4m3")
    assert s.tolist() == [1.0, 1.0, 1.0, FLOAT32_MAX, 1.0, 448.0]
    p2 = current_scale(torch.tensor([1e-38, 1.0, 3.0]), fmt="e4m3", power_2=True)
    assert p2.tolist() == [2.0**127, 256.0, 128.0]
    # epsilon replaces a zero amax, so the scale is fmax / epsilon (not 1.0)
    assert current_scale(torch.tensor(0.0), fmt="e5m2", epsilon=1.0).item() == 57344.0


@pytest.mark.parametrize(("fmt", "dtype"), list(DTYPES.items()))
@pytest.mark.parametrize("power_2", [False, True])
def test_current_scale_matches_torchao_bit_exact(fmt: str, dtype: torch.dtype, power_2: bool) -> None:
    """torchao amax_to_scale = fp8_max / clamp(amax, 1e-12) in float64 -> float32 (checked in 0.18).

    Matching it needs epsilon=1e-12 (applied exactly, as torchao's float64 clamp does).  Compared on finite
    non-negative amax: torchao gives NaN for NaN amax and 0 for inf amax, where DESIGN/TE give 1.0.  With
    power_2 torchao uses exp2(floor(log2(s))), which rounds up for s just below a power of two (see
    test_current_scale_power_2_exact_where_torchao_rounds_up), so power_2 is compared on random amax only.
    """
    float8_utils = pytest.importorskip("torchao.float8.float8_utils")
    g = torch.Generator().manual_seed(2)
    rand = torch.rand(20000, generator=g) * torch.exp2(torch.randint(-149, 128, (20000,), generator=g).float())
    amax = rand[torch.isfinite(rand)]
    if not power_2:
        amax = torch.cat([amax, torch.tensor(amax_edge_values(fmt))])
    ours = current_scale(amax, fmt=fmt, epsilon=1e-12, power_2=power_2)
    theirs = float8_utils.amax_to_scale(amax, dtype, round_scales_to_power_of_2=power_2)
    assert torch.equal(bits(ours), bits(theirs))


def test_current_scale_power_2_exact_where_torchao_rounds_up() -> None:
    """amax = nextafter(448 * 2**-k) gives scale = prevfloat(2**k); floor(log2) is k - 1.

    DESIGN/TE (mantissa bits cleared) give 2**(k-1); torchao 0.18's float32 log2 rounds to k and returns 2**k.
    """
    for k in (4, 10, 20, -20):
        amax = torch.nextafter(torch.tensor(448.0 * 2.0**-k), torch.tensor(INF))
        assert current_scale(amax, fmt="e4m3").item() < 2.0**k
        assert current_scale(amax, fmt="e4m3", power_2=True).item() == 2.0 ** (k - 1)
        assert ref_current_scale(amax.item(), "e4m3", power_2=True) == 2.0 ** (k - 1)


# ---------------------------------------------------------------- delayed scaling


def amax_sequence(steps: int, n: int, seed: int, length: int) -> list[list[float]]:
    rng = random.Random(seed)
    special = [f32(v) for v in (0.0, INF, NAN, 1e-38, 1e38, FLOAT32_MAX, 1e-45, 448.0, 3.125e36)]
    seq = []
    for t in range(steps):
        row = []
        for j in range(n):
            r = rng.random()
            if j == 0:  # quantizer 0: all zeros for a while, then values
                row.append(0.0 if t < steps // 3 else f32(rng.uniform(0.1, 10.0)))
            elif r < 0.25:
                row.append(rng.choice(special))
            elif r < 0.35:
                row.append(0.0)
            else:
                row.append(f32(rng.lognormvariate(0.0, 3.0)))
        seq.append(row)
    # a NaN and an inf early, then only finite values: they must roll out after `length` steps
    seq[1][1] = NAN
    seq[2][2] = INF
    for t in range(3, steps):
        seq[t][1] = f32(1.0 + t)
        seq[t][2] = f32(2.0 + t)
    return seq


@pytest.mark.parametrize("length", [1, 31, 1024])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize("fmt", FMTS)
def test_delayed_update_matches_reference(length: int, algo: str, margin: int, fmt: str) -> None:
    n = 6
    steps = length + 40 if length > 1 else 60
    seq = amax_sequence(steps, n, seed=length + margin, length=length)
    hist_t = torch.zeros(length, n)
    scale_t = torch.ones(n)
    ref = [([0.0] * length, 1.0) for _ in range(n)]
    for t, row in enumerate(seq):
        amax = torch.tensor(row)
        hist_t, scale_t = delayed_update(hist_t, scale_t, amax, fmt=fmt, margin=margin, algo=algo)
        ref = [ref_delayed_step(h, s, a, fmt, margin, algo) for (h, s), a in zip(ref, row)]
        assert_same_f32(scale_t, [s for _, s in ref])
        if length <= 31 or t % 64 == 0 or t == steps - 1:
            assert_same_f32(hist_t, [ref[j][0][i] for i in range(length) for j in range(n)])
    # the NaN/inf injected at steps 1-2 rolled out: every quantizer 1/2 scale is fresh again
    assert math.isfinite(scale_t[1].item()) and scale_t[1].item() != 1.0


def test_delayed_max_ignores_a_nan_in_the_window_as_te_does() -> None:
    """TE's window max is fmaxf: a NaN amax in the history does not freeze the scale (it did here before)."""
    hist = torch.tensor([[2.0], [4.0]])
    _, scale = delayed_update(hist, torch.ones(1), torch.tensor([NAN]), fmt="e4m3", algo="max")
    assert scale.item() == 448.0 / 4.0  # max(4, NaN) == 4, not NaN
    _, scale = delayed_update(hist, torch.ones(1), torch.tensor([1.0]), fmt="e4m3", algo="max")
    assert scale.item() == 448.0 / 4.0


def test_delayed_margin_scales_the_format_max_first_as_te_does() -> None:
    """TE: ``scaled_max = fp8_max * 2**-margin`` then one division. A tiny amax with a margin is finite there;
    dividing first overflowed to inf (then FLT_MAX) before the margin was applied."""
    amax = torch.tensor([f32(448.0 / 5.0e38)])  # 448 / amax overflows float32; (448 / 4) / amax does not
    _, scale = delayed_update(torch.zeros(2, 1), torch.ones(1), amax, fmt="e4m3", margin=2)
    assert scale.item() == f32(f32(448.0 / 4.0) / amax.item()) and scale.item() < FLOAT32_MAX


def test_delayed_update_rules_by_hand() -> None:
    hist = torch.tensor([[1.0, 4.0, 0.0], [2.0, 8.0, 0.0]])  # newest row last
    scale = torch.tensor([5.0, 6.0, 7.0])
    amax = torch.tensor([0.0, 2.0, NAN])
    new_hist, new_scale = delayed_update(hist, scale, amax, fmt="e4m3", algo="max")
    assert torch.equal(new_hist[:, 0], hist[:, 0])  # zero amax: no roll
    assert new_hist[:, 1].tolist() == [8.0, 2.0]  # rolled, newest last
    assert new_hist[0, 2].item() == 0.0 and math.isnan(new_hist[1, 2].item())
    assert new_scale.tolist() == [5.0, 448.0 / 8.0, 7.0]  # kept / max(history) / kept (NaN)
    _, recent = delayed_update(hist, scale, amax, fmt="e4m3", algo="most_recent", margin=1)
    assert recent.tolist() == [5.0, 448.0 / 2.0 / 2.0, 7.0]
    # inputs were not modified
    assert hist.tolist() == [[1.0, 4.0, 0.0], [2.0, 8.0, 0.0]] and scale.tolist() == [5.0, 6.0, 7.0]
    # tiny amax: infinite scale becomes FLT_MAX
    _, s = delayed_update(torch.zeros(3, 1), torch.ones(1), torch.tensor([1e-38]), fmt="e5m2")
    assert s.item() == FLOAT32_MAX


def test_delayed_update_single_quantizer_shapes() -> None:
    h, s = delayed_update(torch.zeros(4), torch.tensor(1.0), torch.tensor(2.0), fmt="e4m3")
    assert h.tolist() == [0.0, 0.0, 0.0, 2.0] and s.item() == 224.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"algo": "mean"}, "algo='mean'.*'max', 'most_recent'"),
        ({"margin": -1}, "margin=-1"),
        ({"margin": 1.5}, "margin=1.5"),
        ({"fmt": "fp16"}, "fmt='fp16'.*e4m3"),
        ({"fmt": "e3m4"}, "fmt='e3m4'.*e4m3"),
    ],
)
def test_delayed_update_validation(kwargs: dict, match: str) -> None:
    args = {"fmt": "e4m3", **kwargs}
    with pytest.raises(ValueError, match=match):
        delayed_update(torch.zeros(2, 3), torch.ones(3), torch.ones(3), **args)


def test_delayed_update_shape_validation() -> None:
    with pytest.raises(ValueError, match="scale and amax must have shape"):
        delayed_update(torch.zeros(2, 3), torch.ones(2), torch.ones(3), fmt="e4m3")
    with pytest.raises(ValueError, match="amax_history"):
        delayed_update(torch.zeros(0, 3), torch.ones(3), torch.ones(3), fmt="e4m3")


def test_fmt_and_epsilon_validation() -> None:
    with pytest.raises(ValueError, match="fmt='bf16'"):
        quantize_fp8(torch.ones(2), torch.tensor(1.0), "bf16")
    with pytest.raises(ValueError, match=r"epsilon=-1\.0"):
        current_scale(torch.ones(2), fmt="e4m3", epsilon=-1.0)
    assert current_scale(torch.tensor(1.0), fmt=E5M2).item() == 57344.0


# ---------------------------------------------------------------- no host-device sync


def _run_everything(x: torch.Tensor) -> list[torch.Tensor]:
    amax = tensor_amax(x)
    scale = current_scale(amax, fmt="e4m3", power_2=True)
    q = quantize_fp8(x, scale, "e4m3")
    out = [amax, scale, dequantize_fp8(q, scale)]
    hist, prev = torch.zeros(3, 2, device=x.device), torch.ones(2, device=x.device)
    out += list(delayed_update(hist, prev, torch.stack([amax, amax * 0]), fmt="e5m2"))
    for rounding in ("floor", "rceil"):
        d, s = quantize_mxfp8(x, rounding=rounding)
        out += [d.float(), s, dequantize_mxfp8(d, s)]
    d, s = quantize_blockwise(x, tile=(1, 48))
    out += [d.float(), s, dequantize_blockwise(d, s, tile=(1, 48))]
    out += [saturation_fraction(x, scale, "e4m3"), underflow_fraction(x, scale, "e4m3")]
    out += [sqnr_db(x, dequantize_fp8(q, scale)), mx_clamp_fraction(x, fmt="e4m3", block_size=32, dim=-1)]
    return out


def test_no_host_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every public function runs with the tensor->python conversions that force a sync disabled."""
    x = torch.randn(4, 64)
    x[0, 3] = NAN
    x[1, :32] = 0.0
    expected = _run_everything(x)

    def boom(*_args, **_kwargs):
        raise AssertionError("host-device sync in hf_mixedprec.scaling")

    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy", "__array__"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    with pytest.raises(AssertionError, match="host-device sync"):
        bool(torch.tensor(True))  # the patch is active
    got = _run_everything(x)
    monkeypatch.undo()
    for a, b in zip(got, expected):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_no_host_sync_cuda() -> None:
    """On CUDA, torch's sync debug mode errors on any synchronizing call."""
    x = torch.randn(4, 64, device="cuda")
    ref = [t.cpu() for t in _run_everything(x.cpu())]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = _run_everything(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=0.0, equal_nan=True)
