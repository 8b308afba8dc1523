"""Property sweep of the FP8 scaling math against an independent float64/float32 reference of TE's rules.

One array of float32 sweep values (zeros, subnormals, the normal boundary, every power of two 2**k for
k in -149..127 with its float32 neighbours, each format's max and its multiples ``fp8_max * 2**k``, the
scale-overflow boundary ``fp8_max / FLT_MAX``, inf, NaN and 2000 seeded log-uniform values) goes through each
package function once per configuration; the results are compared bit for bit with references written here in
numpy (one IEEE float32 operation per step, NaN-ness compared separately) and, for epsilon, with exact rationals.
Nothing of the reference is imported from ``hf_mixedprec``.  Upstream sources of the rules (Transformer Engine):

* ``transformer_engine/common/recipe/recipe_common.cuh`` (``compute_scale_from_amax``): current scaling;
* ``transformer_engine/common/recipe/delayed_scaling.cu``: delayed scaling;
* ``transformer_engine/common/util/ptx.cuh`` (``float_to_e8m0``) and the OCP MX v1.0 spec: MXFP8 scale codes;
* ``transformer_engine/common/transpose/quantize_transpose_{square,vector}_blockwise.cu``: blockwise tiles.
"""

from __future__ import annotations

import math
from fractions import Fraction
from functools import cache

import numpy as np
import pytest
import torch

from hf_mixedprec.scaling import (
    current_scale,
    delayed_update,
    mx_scale_codes,
    quantize_blockwise,
    quantize_fp8,
    quantize_mxfp8,
    tensor_amax,
)

FMTS = ["e4m3", "e5m2"]
# OCP FP8 constants, written out here: largest finite value, exponent of the largest power of two (emax_elem).
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
EMAX = {"e4m3": 8, "e5m2": 15}
FP8_DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FLT_MAX = 3.4028234663852886e38  # 0x7F7FFFFF
BF16_MAX = 3.3895313892515355e38  # 0x7F7F
INPUT_MAX = {torch.float32: FLT_MAX, torch.bfloat16: BF16_MAX}
F32_INF = np.float32(np.inf)
# A double epsilon (not a float32) for which fp8_max / epsilon, rounded to float64 first, lands exactly on a
# float32 rounding midpoint: the float64 -> float32 conversion then rounds to even, the other way from the
# exact quotient.  Found by a search over midpoints near 1e12 (see test_current_scale_epsilon_rounded_once).
DOUBLE_ROUNDING_EPS = 4.475354636307825e-10


# ---------------------------------------------------------------- sweep values


def _f32(values) -> np.ndarray:
    """Round python/float64 values to float32 (nearest-even; beyond the range -> ±inf)."""
    with np.errstate(over="ignore"):
        return np.asarray(values, dtype=np.float64).astype(np.float32)


def _neighbours(x: np.ndarray, ulps: int) -> np.ndarray:
    """``x`` with its float32 neighbours up to ``ulps`` steps on either side."""
    out, up, down = [x], x, x
    with np.errstate(over="ignore"):
        for _ in range(ulps):
            up, down = np.nextafter(up, F32_INF), np.nextafter(down, -F32_INF)
            out += [up, down]
    return np.concatenate(out)


def _dedupe(x: np.ndarray) -> np.ndarray:
    """Unique float32 bit patterns (keeps 0.0 and -0.0 apart), in a fixed order."""
    return np.unique(np.ascontiguousarray(x, dtype=np.float32).view(np.int32)).view(np.float32)


@cache
def sweep() -> np.ndarray:
    """The float32 sweep values (read-only), non-negative plus -0.0, inf and NaN."""
    tiny = 2.0**-149
    parts = [
        _f32([0.0, -0.0, 1.0, math.inf, math.nan]),
        _f32([tiny, 2 * tiny, 3 * tiny, 2.0**-140, 2.0**-130, 2.0**-127, 1.5 * 2.0**-127, 2.0**-126 - tiny]),
        _neighbours(_f32([2.0**-126]), 2),  # float32 min normal
        _neighbours(_f32([2.0**k for k in range(-149, 128)]), 1),
    ]
    for fmax in FP8_MAX.values():
        parts += [
            _neighbours(_f32([fmax]), 2),
            _neighbours(_f32([fmax / FLT_MAX, fmax * 2.0**-128]), 3),  # the float32 overflow boundary of the scale
            _neighbours(_f32([fmax * 2.0**k for k in range(-160, 128)]), 2),  # RCEIL / power-of-2 boundaries
        ]
    rng = np.random.default_rng(20240611)
    parts.append(_f32(np.exp2(rng.uniform(-149.0, 128.0, 2000))))  # log-uniform over the float32 range
    out = _dedupe(np.concatenate(parts))
    out.setflags(write=False)
    return out


def _bf16_round(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to bfloat16 (nearest-even), returned as float32."""
    return torch.from_numpy(np.array(x, dtype=np.float32)).to(torch.bfloat16).float().numpy()


@cache
def sweep_bf16() -> np.ndarray:
    """The sweep rounded to bfloat16, plus the bfloat16 neighbours of the powers of two and ``fp8_max * 2**k``."""
    edges = [2.0**k for k in range(-133, 128)] + [m * 2.0**k for m in FP8_MAX.values() for k in range(-150, 120)]
    bits = torch.from_numpy(_f32(edges)).to(torch.bfloat16).view(torch.int16)
    near = torch.cat([bits, bits + 1, bits - 1]).view(torch.bfloat16).float().numpy()
    near = near[np.isfinite(near) & (near > 0)]
    out = _dedupe(np.concatenate([_bf16_round(sweep()), near]))
    out.setflags(write=False)
    return out


def _t(x: np.ndarray, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.from_numpy(np.array(x, dtype=np.float32)).to(dtype)


def assert_same(got: torch.Tensor, want: np.ndarray, inputs: np.ndarray, what: str) -> None:
    """Bit-exact float32 comparison, NaN-ness compared on its own; the message names the first bad inputs."""
    g = got.detach().to(torch.float32).reshape(-1).numpy()
    w = np.asarray(want, dtype=np.float32).reshape(-1)
    assert g.shape == w.shape, (what, g.shape, w.shape)
    bad = (np.isnan(g) != np.isnan(w)) | (~np.isnan(w) & (g.view(np.int32) != w.view(np.int32)))
    if bad.any():
        idx = np.flatnonzero(bad)[:5]
        rows = [f"input={inputs.reshape(-1)[i]!r} got={g[i]!r} want={w[i]!r}" for i in idx]
        pytest.fail(f"{what}: {int(bad.sum())} of {w.size} differ; " + "; ".join(rows))


# ---------------------------------------------------------------- reference rules


def round_to_f32(q: Fraction) -> float:
    """The exact rational ``q`` > 0 rounded once to float32 (nearest-even, subnormals, overflow -> inf)."""
    e = q.numerator.bit_length() - q.denominator.bit_length()
    while Fraction(2) ** e > q:
        e -= 1
    while Fraction(2) ** (e + 1) <= q:
        e += 1
    quantum = Fraction(2) ** (max(e, -126) - 23)
    v = round(q / quantum) * quantum  # round() on a Fraction: ties to even
    return math.inf if v >= 2**128 else float(v)


def pow2_floor(s: np.ndarray) -> np.ndarray:
    """``2**floor(log2(s))`` for positive normal float32 ``s`` (what clearing the mantissa bits gives)."""
    with np.errstate(invalid="ignore"):
        _, e = np.frexp(s)  # s = m * 2**e, m in [0.5, 1)
        return np.ldexp(np.float32(1.0), e - 1).astype(np.float32)


def ref_current_scale(
    amax: np.ndarray, fmax: float, *, eps: float = 0.0, power_2: bool = False, value_for_inf: float = FLT_MAX
) -> np.ndarray:
    """TE ``compute_scale_from_amax`` (``recipe_common.cuh``) with the package's exact-real epsilon.

    ``if amax < eps: amax = eps``; inf, 0 or NaN -> 1.0; else ``float32(fp8_max / amax)`` (one float32 division,
    or ``fp8_max / eps`` rounded once for the exact epsilon); inf -> ``value_for_inf``; power_2 -> round down.
    """
    a = np.asarray(amax, dtype=np.float32)
    below = a.astype(np.float64) < eps  # exact: a float32 against the real epsilon (NaN compares False)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        q = np.float32(fmax) / a  # IEEE float32 division, correctly rounded
    if eps > 0.0:
        q = np.where(below, np.float32(round_to_f32(Fraction(fmax) / Fraction(eps))), q).astype(np.float32)
    used = np.where(below, eps, a.astype(np.float64))
    q = np.where(np.isinf(q), _f32(value_for_inf), q).astype(np.float32)
    if power_2:
        q = pow2_floor(q)
    return np.where(np.isfinite(used) & (used != 0.0), q, np.float32(1.0)).astype(np.float32)


def ref_delayed(hist: np.ndarray, scale: np.ndarray, a: np.ndarray, fmax: float, margin: int, algo: str):
    """TE ``delayed_scaling.cu`` per quantizer (history ``[L, n]``, newest last, as ``delayed_update`` documents).

    ``a == 0``: unchanged.  Else roll (drop row 0, append ``a``); ``used`` = fmaxf-reduction from 0 over the new
    history ("max"; NaN ignored, inf kept) or ``a`` ("most_recent"); ``scale = float32(fp8_max * 2**-margin / used)``
    if ``used`` is finite and > 0, else the previous scale; an inf quotient -> FLT_MAX.
    """
    update = a != 0  # NaN != 0: a NaN amax rolls in
    rolled = np.concatenate([hist[1:], a[None]], axis=0)
    new_hist = np.where(update[None], rolled, hist).astype(np.float32)
    used = np.fmax.reduce(rolled, axis=0, initial=np.float32(0.0)) if algo == "max" else a
    scaled_max = np.float32(math.ldexp(fmax, -margin))
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        cand = scaled_max / used.astype(np.float32)
        ok = update & np.isfinite(used) & (used > 0)
    cand = np.where(np.isinf(cand), np.float32(FLT_MAX), cand)
    return new_hist, np.where(ok, cand, scale).astype(np.float32)


def ref_e8m0(amax: np.ndarray, fmt: str, rounding: str) -> np.ndarray:
    """E8M0 codes as ``mx.py`` documents them (zero -> 0, inf -> 254, NaN -> 255).

    RCEIL (TE ``float_to_e8m0(amax * max_norm_rcp)``): ``r = float32(amax * float32(1 / fp8_max))``, code =
    ``clamp(ceil(log2(r)) + 127, 0, 254)`` (so a subnormal ``r <= 2**-127`` gives 0, ``r = 0`` gives 0).
    FLOOR (OCP MX v1.0 section 6.3): ``clamp(floor(log2(amax)) - emax_elem, -127, 127) + 127``.
    log2 of a float32 is exact here: ``np.frexp`` splits it into a mantissa in [0.5, 1) and an exponent.
    """
    a = np.asarray(amax, dtype=np.float32)
    finite = np.isfinite(a)
    if rounding == "rceil":
        rcp = np.float32(1.0) / np.float32(FP8_MAX[fmt])
        r = np.where(finite, a, np.float32(0.0)) * rcp
        m, e = np.frexp(r)
        k = np.where(m == 0.5, e - 1, e)  # ceil(log2(r)): exact power of two -> e - 1
        code = np.where(r == 0, 0, np.clip(k + 127, 0, 254))
    else:
        _, e = np.frexp(np.where(finite, a, np.float32(1.0)))
        code = np.where(a == 0, 0, np.clip(e - 1 - EMAX[fmt], -127, 127) + 127)
    code = np.where(np.isinf(a), 254, code)
    return np.where(np.isnan(a), 255, code).astype(np.int64)


def ref_fp8(y: np.ndarray, fmt: str) -> torch.Tensor:
    """``saturate(round_nearest_even(y))`` for a float32 product ``y`` (NaN stays NaN), as float8 bits."""
    fmax = np.float32(FP8_MAX[fmt])
    return torch.from_numpy(np.clip(y, -fmax, fmax).astype(np.float32)).to(FP8_DTYPE[fmt])


def assert_same_fp8(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    g, w = got.reshape(-1), want.reshape(-1)
    assert torch.equal(g.float().isnan(), w.float().isnan()), what
    keep = ~w.float().isnan()
    bad = g.view(torch.uint8)[keep] != w.view(torch.uint8)[keep]
    assert not bool(bad.any()), f"{what}: {int(bad.sum())} fp8 elements differ"


# ---------------------------------------------------------------- sanity of the sweep and the reference


def test_sweep_covers_the_named_points() -> None:
    """The sweep holds every power of two, its float32 neighbours, the overflow boundary and the specials."""
    s = sweep()
    bits = set(s.view(np.int32).tolist())
    for v in [0.0, -0.0, 2.0**-149, 2.0**-126, 1.0, 448.0, 57344.0, 448.0 / FLT_MAX, math.inf]:
        assert int(_f32([v]).view(np.int32)[0]) in bits, v
    assert np.isnan(s).sum() == 1 and len(s) > 4000
    pow2 = _f32([2.0**k for k in range(-149, 128)])
    assert set(_neighbours(pow2, 1).view(np.int32).tolist()) <= bits


def test_reference_float32_division_is_the_exactly_rounded_quotient() -> None:
    """The numpy float32 quotient the reference uses is the exact quotient rounded once (recipe_common.cuh's
    ``__fdiv_rn``), checked with rationals on every finite positive sweep value."""
    a = sweep()
    a = a[np.isfinite(a) & (a > 0)]
    for fmax in FP8_MAX.values():
        with np.errstate(over="ignore"):
            got = np.float32(fmax) / a
        want = [round_to_f32(Fraction(fmax) / Fraction(float(v))) for v in a]
        assert np.array_equal(got, _f32(want))


# ---------------------------------------------------------------- current scaling (recipe_common.cuh)


EPSILONS = [
    0.0,
    1e-12,  # torchao's EPS; not a float32
    1e-6,
    float(_f32([1e-6])[0]),
    0.1,
    2.0**-20,
    1.0,
    2.0**-112,  # fp8_max / eps = 1.75 * 2**127 for E5M2, just below FLT_MAX
    5e-324,  # fp8_max / eps overflows float64 too: value_for_inf
    FLT_MAX,
]


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("power_2", [False, True])
@pytest.mark.parametrize("eps", EPSILONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_current_scale_sweep(fmt: str, power_2: bool, eps: float, dtype: torch.dtype) -> None:
    """``current_scale`` = ``compute_scale_from_amax`` (``recipe_common.cuh``), value_for_inf FLT_MAX, on every
    sweep amax plus the float32 neighbours of epsilon (float32 and bfloat16 amax tensors)."""
    amax = sweep() if dtype == torch.float32 else sweep_bf16()
    if eps > 0:
        amax = np.concatenate([amax, _neighbours(_f32([eps]), 2), _f32([-1.0, -math.inf])])
        amax = _bf16_round(amax) if dtype == torch.bfloat16 else amax
    got = current_scale(_t(amax, dtype), fmt=fmt, epsilon=eps, power_2=power_2)
    assert got.dtype == torch.float32 and got.shape == (len(amax),)
    want = ref_current_scale(amax, FP8_MAX[fmt], eps=eps, power_2=power_2)
    assert_same(got, want, amax, f"current_scale({fmt}, eps={eps!r}, power_2={power_2})")


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("power_2", [False, True])
@pytest.mark.parametrize("value_for_inf", [BF16_MAX, 65504.0, 1.0, 3.0, 2.0**-100, 0.1])
def test_current_scale_value_for_inf_sweep(fmt: str, power_2: bool, value_for_inf: float) -> None:
    """An infinite ``float32(fp8_max / amax)`` takes ``value_for_inf`` (rounded to float32), then power-of-2
    rounding clears its mantissa too (``recipe_common.cuh``, ``compute_scale_from_types`` in the blockwise path)."""
    amax = sweep()
    got = current_scale(_t(amax), fmt=fmt, power_2=power_2, value_for_inf=value_for_inf)
    want = ref_current_scale(amax, FP8_MAX[fmt], power_2=power_2, value_for_inf=value_for_inf)
    assert_same(got, want, amax, f"current_scale({fmt}, value_for_inf={value_for_inf!r}, power_2={power_2})")


def _quotient_overflows_float32_only(fmax: float, eps: float) -> bool:
    """True where the float64 ``fmax / eps`` is finite but above FLT_MAX (see test_current_scale_tiny_epsilon)."""
    q = fmax / eps
    return math.isfinite(q) and q > FLT_MAX


def _random_epsilons(fmax: float) -> list[float]:
    """64 seeded doubles log-uniform in [2**-160, 2**100], and doubles at the overflow boundary of fmax / eps,
    without those whose quotient overflows float32 only (test_current_scale_tiny_epsilon covers them)."""
    rng = np.random.default_rng(7)
    out = [float(v) for v in np.exp2(rng.uniform(-160.0, 100.0, 64))]
    edge = fmax / FLT_MAX
    out += [edge + d * math.ulp(edge) for d in range(-3, 4)]
    return [e for e in out if not _quotient_overflows_float32_only(fmax, e)]


@pytest.mark.parametrize("fmt", FMTS)
def test_current_scale_random_epsilons(fmt: str) -> None:
    """The exact-real epsilon of ``current_scale``'s docstring over random doubles: ``amax < eps`` compared
    exactly and ``fp8_max / eps`` rounded once to float32, overflow -> FLT_MAX (``recipe_common.cuh``)."""
    base = sweep()
    epsilons = _random_epsilons(FP8_MAX[fmt])
    assert len(epsilons) > 50
    for eps in epsilons:
        amax = np.concatenate([base, _neighbours(_f32([eps]), 2)])
        got = current_scale(_t(amax), fmt=fmt, epsilon=eps)
        assert_same(got, ref_current_scale(amax, FP8_MAX[fmt], eps=eps), amax, f"current_scale({fmt}, eps={eps!r})")


TINY_EPSILONS = [
    ("e4m3", 2.0**-149),
    ("e4m3", 1e-40),
    ("e5m2", 1e-300),
    ("e4m3", 1.3165537121573202e-36),  # 448 / eps is within half a float32 ulp above FLT_MAX: rounds to FLT_MAX
    ("e5m2", 1.685188801783911e-34),  # likewise for 57344
]


@pytest.mark.parametrize(("fmt", "eps"), TINY_EPSILONS)
def test_current_scale_tiny_epsilon(fmt: str, eps: float) -> None:
    """An epsilon so small that ``fp8_max / epsilon`` overflows float32 (``recipe_common.cuh``): amax below it
    gets value_for_inf, the rest their ordinary scale."""
    assert _quotient_overflows_float32_only(FP8_MAX[fmt], eps)
    amax = sweep()
    got = current_scale(_t(amax), fmt=fmt, epsilon=eps)
    assert_same(got, ref_current_scale(amax, FP8_MAX[fmt], eps=eps), amax, f"current_scale({fmt}, eps={eps!r})")


def test_current_scale_epsilon_quotient_is_torchaos_float64_then_float32() -> None:
    """``current_scale``'s docstring: ``amax < epsilon`` -> ``fmt.max / epsilon`` divided in float64 and rounded to
    float32, as torchao's float64 clamp does (TE forwards no epsilon). At this epsilon the float64 quotient is a
    float32 midpoint, so it differs from a once-rounded quotient; the amax above epsilon is unaffected."""
    amax = _f32([0.0, 1e-20])
    got = current_scale(_t(amax), fmt="e4m3", epsilon=DOUBLE_ROUNDING_EPS)
    once = ref_current_scale(amax, 448.0, eps=DOUBLE_ROUNDING_EPS)
    assert float(once[0]) == 1001037955072.0
    assert got[0].item() == float(np.float32(448.0 / DOUBLE_ROUNDING_EPS)) == 1001038020608.0
    assert got[1].item() == got[0].item()  # 1e-20 < epsilon as well


@pytest.mark.parametrize("fmt", FMTS)
def test_current_scale_sweep_matches_torchao(fmt: str) -> None:
    """torchao ``amax_to_scale`` (float64 ``fp8_max / clamp(amax, 1e-12)`` -> float32) on every finite
    non-negative sweep amax equals ``current_scale(epsilon=1e-12)`` bit for bit (power_2=False only)."""
    float8_utils = pytest.importorskip("torchao.float8.float8_utils")
    amax = np.concatenate([sweep(), _neighbours(_f32([1e-12]), 3)])
    amax = amax[np.isfinite(amax)]
    ours = current_scale(_t(amax), fmt=fmt, epsilon=1e-12)
    theirs = float8_utils.amax_to_scale(_t(amax), FP8_DTYPE[fmt], round_scales_to_power_of_2=False)
    assert_same(ours, theirs.numpy(), amax, f"current_scale vs torchao ({fmt})")


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("power_2", [False, True])
def test_quantize_fp8_maps_amax_to_the_top_binade(fmt: str, power_2: bool) -> None:
    """With the current scale of ``amax`` (not replaced by FLT_MAX), ``quantize_fp8(amax)`` is exactly fp8_max,
    or lies in [fp8_max / 2, fp8_max] with power-of-2 scales (``recipe_common.cuh`` + TE's cast rule)."""
    fmax = FP8_MAX[fmt]
    amax = sweep()
    with np.errstate(divide="ignore", over="ignore"):
        amax = amax[np.isfinite(amax) & (amax > 0) & np.isfinite(np.float32(fmax) / amax)]
    scale = current_scale(_t(amax), fmt=fmt, power_2=power_2)
    q = quantize_fp8(_t(amax), scale, fmt).float().numpy()
    if power_2:
        assert np.all((q >= fmax / 2) & (q <= fmax)), amax[(q < fmax / 2) | (q > fmax)][:5]
        assert_same_fp8(quantize_fp8(_t(amax), scale, fmt), ref_fp8(amax * scale.numpy(), fmt), "pow2 data")
    else:
        assert np.all(q == fmax), amax[q != fmax][:5]


# ---------------------------------------------------------------- delayed scaling (delayed_scaling.cu)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 1, 7, 64])
def test_delayed_update_sweep(fmt: str, algo: str, margin: int) -> None:
    """``delayed_update`` vs ``delayed_scaling.cu`` for history lengths 1..16: random histories with NaN, inf and
    zero injected, every sweep value once as the new amax, random previous scales."""
    values = sweep()
    rng = np.random.default_rng(1000 * margin + 10 * FMTS.index(fmt) + (algo == "max"))
    pool = values[np.isfinite(values) & (values > 0)]
    for length, new_amax in enumerate(np.array_split(rng.permutation(values), 16), start=1):
        n = len(new_amax)
        hist = rng.choice(pool, size=(length, n)).astype(np.float32)
        r = rng.random((length, n))
        hist[r < 0.08] = np.nan
        hist[(r >= 0.08) & (r < 0.10)] = np.inf
        hist[(r >= 0.10) & (r < 0.25)] = 0.0
        prev = _f32(np.exp2(rng.uniform(-100.0, 100.0, n)))
        got_hist, got_scale = delayed_update(_t(hist), _t(prev), _t(new_amax), fmt=fmt, margin=margin, algo=algo)
        want_hist, want_scale = ref_delayed(hist, prev, new_amax, FP8_MAX[fmt], margin, algo)
        what = f"delayed_update({fmt}, {algo}, margin={margin}, L={length})"
        assert_same(got_scale, want_scale, new_amax, what + " scale")
        assert_same(got_hist, want_hist, np.broadcast_to(new_amax, hist.shape), what + " history")


# ---------------------------------------------------------------- MXFP8 E8M0 scales (mx.py)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_mx_scale_codes_sweep(fmt: str, rounding: str) -> None:
    """``mx_scale_codes`` on every sweep amax vs the documented RCEIL (TE ``float_to_e8m0`` in ``util/ptx.cuh``)
    and FLOOR (OCP MX v1.0) rules."""
    amax = np.concatenate([sweep(), sweep_bf16()])
    got = mx_scale_codes(_t(amax), fmt=fmt, rounding=rounding)
    assert got.dtype == torch.uint8
    want = ref_e8m0(amax, fmt, rounding)
    bad = got.numpy().astype(np.int64) != want
    assert not bad.any(), [(amax[i], int(got[i]), int(want[i])) for i in np.flatnonzero(bad)[:5]]


def _blocks(values: np.ndarray, width: int, rng: np.random.Generator, nan_elsewhere: bool) -> np.ndarray:
    """One row of ``width`` per value: the value (random sign, random position), the rest smaller in magnitude
    (random fractions of it; random normals when it is inf or NaN); optionally a NaN elsewhere in some rows."""
    n = len(values)
    v = values.astype(np.float32)
    finite = np.isfinite(v)
    frac = rng.random((n, width)).astype(np.float32) * rng.choice(np.float32([-1.0, 1.0]), (n, width))
    rows = np.where(finite[:, None], v[:, None] * frac, rng.standard_normal((n, width)).astype(np.float32))
    pos = rng.integers(0, width, n)
    rows[np.arange(n), pos] = v * rng.choice(np.float32([-1.0, 1.0]), n)
    if nan_elsewhere:
        hit = rng.random(n) < 0.3
        rows[np.flatnonzero(hit), (pos[hit] + 1) % width] = np.nan
    return rows.astype(np.float32)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("rounding", ["rceil", "floor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_mxfp8_sweep(fmt: str, rounding: str, dtype: torch.dtype) -> None:
    """``quantize_mxfp8`` with one 32-element block per sweep value: the block code follows ``ref_e8m0`` on the
    NaN-propagating block amax, elements are ``saturate(RNE(x * 2**(127 - E)))`` and NaN blocks all NaN (``mx.py``,
    TE ``float_to_e8m0`` in ``util/ptx.cuh``, OCP MX v1.0)."""
    values = sweep() if dtype == torch.float32 else sweep_bf16()
    rng = np.random.default_rng(11 + FMTS.index(fmt))
    x = _t(_blocks(values, 32, rng, nan_elsewhere=False), dtype)
    data, codes = quantize_mxfp8(x, fmt=fmt, rounding=rounding)
    xf = x.float().numpy()
    amax = np.max(np.abs(xf), axis=1)  # NaN-propagating, as mx.py documents
    want = ref_e8m0(amax, fmt, rounding)
    bad = codes.reshape(-1).numpy().astype(np.int64) != want
    assert not bad.any(), [(amax[i], int(codes[i, 0]), int(want[i])) for i in np.flatnonzero(bad)[:5]]
    mult = np.ldexp(np.float32(1.0), 127 - np.clip(want, 0, 254)).astype(np.float32)
    y = xf * mult[:, None]
    y[want == 255] = np.nan
    assert_same_fp8(data, ref_fp8(y, fmt), f"quantize_mxfp8({fmt}, {rounding}, {dtype}) data")


# ---------------------------------------------------------------- blockwise tiles (quantize_transpose_*_blockwise.cu)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("power_2", [True, False])
@pytest.mark.parametrize(
    ("dtype", "input_dtype"), [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.bfloat16)]
)
def test_quantize_blockwise_sweep(fmt: str, power_2: bool, dtype: torch.dtype, input_dtype: torch.dtype | None) -> None:
    """One 1x128 tile per sweep value, with NaN in some tiles: the tile amax ignores NaN, the scale is
    ``compute_scale_from_amax`` with epsilon 0 and value_for_inf = the input type's max (bfloat16 0x7F7F or
    FLT_MAX), then power-of-2 rounding (``transpose/quantize_transpose_{square,vector}_blockwise.cu``)."""
    values = sweep() if dtype == torch.float32 and input_dtype is None else sweep_bf16()
    rng = np.random.default_rng(21 + FMTS.index(fmt))
    x = _t(_blocks(values, 128, rng, nan_elsewhere=True), dtype)
    data, scales = quantize_blockwise(x, tile=(1, 128), fmt=fmt, power_2=power_2, input_dtype=input_dtype)
    xf = x.float().numpy()
    amax = np.fmax.reduce(np.abs(xf), axis=1, initial=np.float32(0.0))  # NaN ignored
    vfi = INPUT_MAX[input_dtype or dtype]
    want = ref_current_scale(amax, FP8_MAX[fmt], power_2=power_2, value_for_inf=vfi)
    assert_same(scales.reshape(-1), want, amax, f"quantize_blockwise({fmt}, power_2={power_2}, {dtype}) scales")
    assert_same_fp8(data, ref_fp8(xf * want[:, None], fmt), f"quantize_blockwise({fmt}, {dtype}) data")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensor_amax_sweep(dtype: torch.dtype) -> None:
    """``tensor_amax`` = fmaxf-reduction of |x| from 0 (NaN ignored, inf kept), as TE's amax kernels
    (``transformer_engine/common/recipe/current_scaling.cu``); 200 seeded rows of sweep values with NaN."""
    values = sweep() if dtype == torch.float32 else sweep_bf16()
    rng = np.random.default_rng(31)
    for _ in range(200):
        x = rng.choice(values, size=int(rng.integers(1, 40))) * rng.choice(np.float32([-1.0, 1.0]))
        x = _t(x.astype(np.float32), dtype)
        got = tensor_amax(x)
        want = np.fmax.reduce(np.abs(x.float().numpy()), initial=np.float32(0.0))
        assert got.dtype == torch.float32 and got.dim() == 0
        assert_same(got, np.float32([want]), x.float().numpy()[:1], f"tensor_amax({dtype})")
