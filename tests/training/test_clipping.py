"""Clippers: exact rules against independent references, non-finite steps, state round trips, no host sync."""

from __future__ import annotations

import contextlib
import io
import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from torch import nn

from hf_mixedprec.core._device import HOST_COPY_ATTR, AsyncRead
from hf_mixedprec.training.clipping import (
    AGC,
    STATE_VERSION,
    AutoClip,
    ClipResult,
    NormClipper,
    ZClip,
    global_grad_norm,
    make_clipper,
)

# -- helpers ---------------------------------------------------------------------------------------------------


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view for bitwise comparisons (NaN == NaN, -0.0 != 0.0)."""
    return t.detach().contiguous().view({4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def one_param(norm: float, size: int = 4) -> nn.Parameter:
    """A parameter whose gradient has exactly one non-zero entry, so its norm is ``norm``."""
    p = nn.Parameter(torch.zeros(size))
    grad = torch.zeros(size)
    grad[1] = norm
    p.grad = grad
    return p


def random_params(seed: int, scale: float = 1.0) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(5, 3, generator=gen)), nn.Parameter(torch.randn(7, generator=gen))]
    params.append(nn.Parameter(torch.randn(2, 3, 2, generator=gen)))
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * scale
    return params


def zclip_reference(
    norms: list[float],
    *,
    alpha: float,
    z_thresh: float,
    warmup: int,
    mode: str = "zscore",
    clip_option: str = "adaptive_scaling",
    max_norm: float | None = None,
    eps: float = 1e-6,
) -> list[dict[str, float]]:
    """ZClip written from the paper / reference-code rules in float64, one dict per step."""
    buffer: list[float] = []
    mu = var = math.nan
    ready = False
    out = []
    for g in norms:
        margin = math.inf
        if not ready:
            buffer.append(g)
            if len(buffer) == warmup:
                mu = sum(buffer) / warmup
                var = sum((x - mu) ** 2 for x in buffer) / warmup  # population variance
                ready = True
            bound = math.inf
        else:
            sigma = math.sqrt(var)
            if mode == "zscore":
                z = (g - mu) / (sigma + eps)
                margin = abs(z - z_thresh)
                if z > z_thresh:
                    bound = mu + z_thresh**2 * sigma / z if clip_option == "adaptive_scaling" else mu
                else:
                    bound = math.inf
            else:
                level = mu + z_thresh * sigma
                margin = abs(g - level)
                bound = level if g > level else math.inf
            g_c = min(g, bound)
            mu = alpha * mu + (1 - alpha) * g_c
            var = alpha * var + (1 - alpha) * (g_c - mu) ** 2
        threshold = bound if max_norm is None else min(bound, max_norm)
        clipped = g > threshold
        out.append(
            {
                "threshold": threshold,
                "clipped": clipped,
                "coef": threshold / (g + 1e-6) if clipped else 1.0,
                "mean": mu,
                "var": var,
                "margin": margin,
            }
        )
    return out


# Warm-up of 5 ending on a large norm (not clipped), then calm steps and spikes.
NORMS = [
    1.0,
    1.3,
    0.9,
    1.2,
    6.0,
    1.1,
    9.0,
    1.0,
    0.95,
    1.4,
    3.5,
    1.2,
    0.8,
    20.0,
    1.05,
    1.3,
    2.2,
    1.0,
    4.0,
    1.1,
    1.2,
    5.0,
    0.9,
    1.0,
]


def f32(x: float) -> float:
    return float(np.float32(x))


def run_zclip(clipper: ZClip, norms: list[float]) -> list[dict[str, float]]:
    got = []
    for g in norms:
        p = one_param(g)
        res = clipper.clip_([p])
        got.append(
            {
                "threshold": float(res.threshold),
                "clipped": bool(res.clipped),
                "coef": float(p.grad[1]) / f32(g),
                "mean": float(clipper.mean),
                "var": float(clipper.var),
                "total_norm": float(res.total_norm),
            }
        )
    return got


def assert_matches_reference(got: list[dict[str, float]], want: list[dict[str, float]], warmup: int) -> None:
    for step, (g, w) in enumerate(zip(got, want, strict=True), start=1):
        assert w["margin"] > 1e-3, f"step {step} is too close to the z threshold for a float32 comparison"
        assert g["clipped"] == w["clipped"], step
        assert g["threshold"] == pytest.approx(w["threshold"], rel=2e-6), step
        assert g["coef"] == pytest.approx(w["coef"], rel=2e-6), step
        if step >= warmup:
            assert g["mean"] == pytest.approx(w["mean"], rel=2e-6), step
            assert g["var"] == pytest.approx(w["var"], rel=1e-5), step


# -- global norm and NormClipper -------------------------------------------------------------------------------


@pytest.mark.parametrize("max_norm", [0.5, 3.0, 100.0])
def test_norm_clipper_bitwise_equal_to_torch(max_norm):
    ours, theirs = random_params(0, scale=0.7), random_params(0, scale=0.7)
    res = NormClipper(max_norm).clip_(ours)
    ref_norm = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert same_bits(res.total_norm, ref_norm)
    for a, b in zip(ours, theirs):
        assert same_bits(a.grad, b.grad)
    assert bool(res.clipped) == (max_norm < float(ref_norm))
    assert float(res.threshold) == max_norm
    assert res.total_norm.dtype == torch.float32 and res.clipped.dtype == torch.bool and res.total_norm.ndim == 0


def test_global_norm_is_float32_and_does_not_overflow_for_fp16():
    grads = [torch.full((4,), 60000.0, dtype=torch.float16), torch.full((3,), 3.0, dtype=torch.float16)]
    norm = global_grad_norm(grads)
    assert norm.dtype == torch.float32
    assert float(norm) == pytest.approx(math.sqrt(4 * 60000.0**2 + 3 * 9.0), rel=1e-6)


def test_norm_clipper_uses_given_total_norm_and_keeps_dtype():
    p = nn.Parameter(torch.zeros(3, dtype=torch.float16))
    p.grad = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float16)
    res = NormClipper(1.0).clip_([p], total_norm=torch.tensor(10.0))
    assert float(res.total_norm) == 10.0 and bool(res.clipped)
    coef = 1.0 / (10.0 + 1e-6)
    assert p.grad.dtype == torch.float16
    assert p.grad.tolist() == pytest.approx([1.0 * coef, -2.0 * coef, 0.5 * coef], rel=1e-3)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_norm_clipper_leaves_grads_alone_on_non_finite_norm(bad):
    params = random_params(1)
    params[0].grad[0, 0] = bad
    before = [p.grad.clone() for p in params]
    res = NormClipper(0.1).clip_(params)
    assert not math.isfinite(float(res.total_norm))
    assert not bool(res.clipped)
    for p, b in zip(params, before):
        assert same_bits(p.grad, b)


def test_no_grads_is_a_no_op():
    clipper = ZClip(warmup_steps=2)
    p = nn.Parameter(torch.zeros(3))
    res = clipper.clip_([p])
    assert float(res.total_norm) == 0.0 and not bool(res.clipped)
    assert int(clipper.count) == 0 and clipper.steps == 1


# -- ZClip -----------------------------------------------------------------------------------------------------


def test_zclip_hand_computed_warmup_end_and_reciprocal_threshold():
    clipper = ZClip(alpha=0.97, z_thresh=2.5, warmup_steps=5)
    warm = run_zclip(clipper, [1.0, 2.0, 3.0, 4.0, 5.0])
    # Warm-up: nothing clipped, no threshold; at its last step mean 3 and population variance 2.
    assert all(not s["clipped"] and s["threshold"] == math.inf and s["coef"] == 1.0 for s in warm)
    assert warm[-1]["mean"] == 3.0 and warm[-1]["var"] == pytest.approx(2.0, rel=1e-7)
    (step,) = run_zclip(clipper, [10.0])
    sigma = math.sqrt(2.0)
    z = (10.0 - 3.0) / (sigma + 1e-6)
    threshold = 3.0 + 2.5**2 * sigma / z  # reciprocal rule: mu + z_thr^2 sigma / z = 4.785714...
    assert threshold == pytest.approx(4.7857136, rel=1e-6)
    assert step["clipped"] and step["threshold"] == pytest.approx(threshold, rel=1e-6)
    assert step["coef"] == pytest.approx(threshold / (10.0 + 1e-6), rel=1e-6)
    # EMA with the clipped norm, variance with the updated mean.
    mean = 0.97 * 3.0 + 0.03 * threshold
    assert step["mean"] == pytest.approx(mean, rel=1e-6)
    assert step["var"] == pytest.approx(0.97 * 2.0 + 0.03 * (threshold - mean) ** 2, rel=1e-6)
    # A norm below mu + z_thr*sigma is not clipped; the EMA takes it as it is.
    (calm,) = run_zclip(clipper, [3.2])
    assert not calm["clipped"] and calm["threshold"] == math.inf and calm["coef"] == 1.0
    assert calm["mean"] == pytest.approx(0.97 * mean + 0.03 * 3.2, rel=1e-6)


def test_zclip_warmup_end_step_is_not_clipped_and_next_one_is():
    clipper = ZClip(warmup_steps=3, z_thresh=2.0)
    steps = run_zclip(clipper, [1.0, 30.0, 1.2, 200.0])
    assert [s["clipped"] for s in steps] == [False, False, False, True]


@pytest.mark.parametrize(
    ("mode", "clip_option", "max_norm"),
    [
        ("zscore", "adaptive_scaling", None),
        ("zscore", "mean", None),
        ("percentile", "adaptive_scaling", None),
        ("zscore", "adaptive_scaling", 2.0),
    ],
)
def test_zclip_matches_python_reference(mode, clip_option, max_norm):
    kw = {"alpha": 0.9, "z_thresh": 2.0, "mode": mode, "clip_option": clip_option, "max_norm": max_norm}
    norms = [f32(g) for g in NORMS]
    got = run_zclip(ZClip(warmup_steps=5, **kw), norms)
    want = zclip_reference(norms, warmup=5, **kw)
    assert_matches_reference(got, want, warmup=5)
    assert sum(w["clipped"] for w in want) >= 3  # the sequence exercises the rule


def test_zclip_max_norm_caps_during_warmup_but_not_the_statistics():
    clipper = ZClip(warmup_steps=2, max_norm=1.5)
    steps = run_zclip(clipper, [1.0, 4.0])
    assert not steps[0]["clipped"] and steps[1]["clipped"]
    assert steps[1]["threshold"] == 1.5 and steps[1]["coef"] == pytest.approx(1.5 / (4.0 + 1e-6), rel=1e-6)
    assert steps[1]["mean"] == 2.5 and steps[1]["var"] == 2.25  # from the raw norms 1 and 4


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_zclip_non_finite_steps_change_nothing(bad):
    clipper = ZClip(alpha=0.9, z_thresh=2.0, warmup_steps=5)
    clean = ZClip(alpha=0.9, z_thresh=2.0, warmup_steps=5)
    norms = [f32(g) for g in NORMS]
    for i, g in enumerate(norms):
        if i in (2, 5, 6):  # in warm-up, right after it, and on a spike step
            p = one_param(1.0)
            p.grad[1] = bad
            p.grad[2] = 3.0
            before = p.grad.clone()
            state = {k: v.clone() for k, v in clipper.state_dict()["state"].items()}
            res = clipper.clip_([p])
            assert not bool(res.clipped)
            assert same_bits(p.grad, before)
            for k, v in clipper.state_dict()["state"].items():
                assert same_bits(v, state[k]), k
        a, b = one_param(g), one_param(g)
        ra, rb = clipper.clip_([a]), clean.clip_([b])
        assert same_bits(ra.threshold, rb.threshold) and same_bits(a.grad, b.grad)
    assert clipper.steps == len(norms) + 3 and int(clipper.count) == len(norms)


@pytest.mark.parametrize("kw", [{}, {"max_norm": 4.0}, {"mode": "percentile"}, {"clip_option": "mean"}])
def test_zclip_branches_the_host_knows_give_the_same_bits(kw):
    """host_sync() (a logging step) lets ZClip drop its warm-up operations; the results must not change.

    Non-finite norms in the warm-up keep it going past ``warmup_steps`` calls, so the clipper that syncs
    every step runs the "either" branch until its read sees the warm-up end, then the lean one."""
    kw = {"alpha": 0.9, "z_thresh": 2.0, "warmup_steps": 5, **kw}
    never, always, async_ = ZClip(**kw), ZClip(**kw), ZClip(**kw)
    never._warm_read = NoRead()  # the host never learns the warm-up ended: the "either" branch throughout
    async_lean_from = None
    norms = [f32(x) for x in (1.0, 2.0, math.inf, 1.5, math.nan, 2.5, 1.0, 9.0, 1.2, math.inf, 1.1, 30.0, 1.3)]
    lean_from = None
    for i, g in enumerate(norms):
        a, b = random_params(i), random_params(i)
        norm = float(torch.linalg.vector_norm(torch.cat([x.grad.flatten() for x in a])))
        for p, q in zip(a, b):  # the same gradients, scaled to norm g (non-finite: one entry)
            if math.isfinite(g):
                p.grad.mul_(g / norm)
            else:
                p.grad.view(-1)[0] = g
            q.grad = p.grad.clone()
        c = [nn.Parameter(p.detach().clone()) for p in a]
        for p, q in zip(c, a):
            p.grad = q.grad.clone()
        ra, rb, rc = never.clip_(a), always.clip_(b), async_.clip_(c)
        always.host_sync()
        if always._warm_done and lean_from is None:
            lean_from = i + 1  # calls after this one take the lean branch
        if async_._warm_done and async_lean_from is None:
            async_lean_from = i  # learnt at the start of this call, without a read that waits
        for other, r, ps in ((always, rb, b), (async_, rc, c)):
            assert same_bits(ra.threshold, r.threshold) and torch.equal(ra.clipped, r.clipped), i
            assert all(same_bits(p.grad, q.grad) for p, q in zip(a, ps)), i
            for k, v in never.state_dict()["state"].items():
                assert same_bits(v, other.state_dict()["state"][k]), (i, k)
    assert lean_from == 7 and not never._warm_done  # the 7th call stores the 5th finite norm; never read: never lean
    assert async_lean_from == 7  # the 8th call (index 7) sees the read the 7th started


class NoRead:
    """An ``AsyncRead`` that never delivers."""

    pending = False

    def push(self, value):
        pass

    def poll(self):
        return None


def test_zclip_state_dict_round_trip_continues_bit_for_bit():
    kw = {"alpha": 0.9, "z_thresh": 2.0, "warmup_steps": 4}
    whole, first = ZClip(**kw), ZClip(**kw)
    seq = [random_params(s, scale=1.0 + 5.0 * (s % 7 == 3)) for s in range(20)]
    seq_copy = [[nn.Parameter(p.detach().clone()) for p in ps] for ps in seq]
    for ps, qs in zip(seq_copy, seq):
        for p, q in zip(ps, qs):
            p.grad = q.grad.clone()
    results_whole = [whole.clip_(ps) for ps in seq]
    for ps in seq_copy[:7]:
        first.clip_(ps)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = ZClip(**kw)
    resumed.load_state_dict(torch.load(buf))
    assert resumed.steps == 7
    for i, ps in enumerate(seq_copy[7:], start=7):
        r = resumed.clip_(ps)
        assert same_bits(r.threshold, results_whole[i].threshold), i
        assert same_bits(r.total_norm, results_whole[i].total_norm), i
        for p, q in zip(ps, seq[i]):
            assert same_bits(p.grad, q.grad)
    assert any(bool(r.clipped) for r in results_whole[7:])
    for k, v in resumed.state_dict()["state"].items():
        assert same_bits(v, whole.state_dict()["state"][k]), k


def test_state_dict_is_a_copy_and_load_checks_it():
    clipper = ZClip(warmup_steps=2)
    run_zclip(clipper, [1.0, 2.0, 3.0])
    sd = clipper.state_dict()
    assert sd["version"] == STATE_VERSION and sd["type"] == "ZClip" and sd["steps"] == 3
    sd["state"]["mean"].fill_(123.0)
    assert float(clipper.mean) != 123.0
    with pytest.raises(ValueError, match="warmup_steps"):
        ZClip(warmup_steps=3).load_state_dict(sd)
    with pytest.raises(ValueError, match="AutoClip"):
        ZClip(warmup_steps=2).load_state_dict({**sd, "type": "AutoClip"})
    with pytest.raises(ValueError, match="version"):
        ZClip(warmup_steps=2).load_state_dict({**sd, "version": 99})
    fresh = ZClip(warmup_steps=2)
    fresh.load_state_dict(sd)
    assert float(fresh.mean) == 123.0  # the dict's value, copied in
    sd["state"]["mean"].fill_(0.0)
    assert float(fresh.mean) == 123.0


# -- AutoClip --------------------------------------------------------------------------------------------------


def norm_stream(n: int, seed: int) -> list[float]:
    rng = np.random.default_rng(seed)
    values = rng.lognormal(0.0, 0.6, size=n).astype(np.float32)
    values[::9] *= 8.0  # spikes
    return [float(v) for v in values]


@pytest.mark.parametrize(("percentile", "history_size"), [(10.0, 7), (50.0, 7), (0.0, 5), (100.0, 5), (37.5, None)])
def test_autoclip_threshold_is_numpy_percentile_of_history(percentile, history_size):
    clipper = AutoClip(percentile=percentile, history_size=history_size)
    history: list[float] = []
    n_steps = 150 if history_size is None else 40  # None: grows past the initial 64 slots
    for i, g in enumerate(norm_stream(n_steps, seed=3)):
        p = one_param(1.0)
        if i % 11 == 5:  # a non-finite step: not recorded, grads untouched
            before = p.grad.clone()
            res = clipper.clip_([p], total_norm=torch.tensor(math.inf))
            assert not bool(res.clipped) and same_bits(p.grad, before)
            continue
        history.append(g)
        window = history if history_size is None else history[-history_size:]
        want = np.float32(np.percentile(np.asarray(window, dtype=np.float64), percentile))
        res = clipper.clip_([p], total_norm=torch.tensor(g))
        assert float(res.threshold) == float(want), i
        assert bool(res.clipped) == (g > float(want))
        coef = float(want) / (g + 1e-6) if g > float(want) else 1.0
        assert float(p.grad[1]) == pytest.approx(coef, rel=1e-6)
    assert int(clipper.count) == len(history)


def test_autoclip_first_step_and_reported_values():
    clipper = AutoClip(percentile=10.0, history_size=3)
    r1 = clipper.clip_([one_param(2.0)])
    assert float(r1.threshold) == 2.0 and not bool(r1.clipped)  # history [2]: its own percentile
    r2 = clipper.clip_([one_param(4.0)])
    assert float(r2.threshold) == pytest.approx(2.2) and bool(r2.clipped)  # [2, 4]: 2 + 0.1 * 2


@pytest.mark.parametrize("history_size", [4, None])
def test_autoclip_state_dict_round_trip(history_size):
    norms = norm_stream(90, seed=5)
    whole, first = AutoClip(25.0, history_size), AutoClip(25.0, history_size)
    want = [whole.clip_([one_param(1.0)], total_norm=torch.tensor(g)).threshold for g in norms]
    for g in norms[:70]:
        first.clip_([one_param(1.0)], total_norm=torch.tensor(g))
    resumed = AutoClip(25.0, history_size)
    resumed.load_state_dict(first.state_dict())
    for i, g in enumerate(norms[70:], start=70):
        got = resumed.clip_([one_param(1.0)], total_norm=torch.tensor(g)).threshold
        assert same_bits(got, want[i]), i


# -- AGC -------------------------------------------------------------------------------------------------------

W = [
    [3.0, 0.0, 4.0, 0.0],  # ||W_0|| = 5     -> max 0.5
    [1.0, 2.0, 2.0, 0.0],  # ||W_1|| = 3     -> max 0.3
    [0.0, 0.0, 0.0, 1e-4],  # ||W_2|| = 1e-4 -> eps floor 1e-3 -> max 1e-4
]
G = [
    [0.3, 0.4, 0.0, 0.0],  # ||G_0|| = 0.5   -> not clipped (equal, not above)
    [0.0, 0.0, 0.6, 0.8],  # ||G_1|| = 1     -> scaled by 0.3
    [0.02, 0.0, 0.0, 0.0],  # ||G_2|| = 0.02 -> scaled by 1e-4 / 0.02 = 0.005
]


def agc_layer() -> nn.Linear:
    layer = nn.Linear(4, 3)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor(W))
        layer.bias.copy_(torch.tensor([0.0, 2.0, -1.0]))  # ||b|| = sqrt(5)
    layer.weight.grad = torch.tensor(G)
    layer.bias.grad = torch.tensor([0.0, 0.3, 0.4])  # ||g_b|| = 0.5 > 0.1 * sqrt(5) = 0.2236
    return layer


def test_agc_per_row_exact():
    layer = agc_layer()
    res = AGC(clip_factor=0.1, eps=1e-3).clip_(layer.parameters())
    expected = np.array(G, dtype=np.float64)
    expected[1] *= 0.3 / 1.0
    expected[2] *= (0.1 * 1e-3) / 0.02
    np.testing.assert_allclose(layer.weight.grad.numpy(), expected, rtol=1e-6, atol=0)
    assert layer.weight.grad[0].tolist() == [pytest.approx(0.3), pytest.approx(0.4), 0.0, 0.0]
    b_scale = 0.1 * math.sqrt(5.0) / 0.5
    np.testing.assert_allclose(layer.bias.grad.numpy(), [0.0, 0.3 * b_scale, 0.4 * b_scale], rtol=1e-6)
    assert float(res.clipped_fraction) == pytest.approx(3 / 4)  # rows 1, 2 and the bias of 4 units
    assert bool(res.clipped) and math.isnan(float(res.threshold))
    assert float(res.total_norm) == pytest.approx(math.sqrt(0.25 + 1.0 + 0.02**2 + 0.25), rel=1e-6)


def test_agc_1d_and_name_excludes():
    layer = agc_layer()
    bias_before = layer.bias.grad.clone()
    res = AGC(clip_factor=0.1, include_1d=False).clip_(layer.parameters())
    assert same_bits(layer.bias.grad, bias_before)
    assert float(res.clipped_fraction) == pytest.approx(2 / 3)

    layer = agc_layer()
    weight_before = layer.weight.grad.clone()
    AGC(clip_factor=0.1, exclude=["*.weight"]).clip_([(f"head.{n}", p) for n, p in layer.named_parameters()])
    assert same_bits(layer.weight.grad, weight_before)
    assert not torch.equal(layer.bias.grad, bias_before)

    layer = agc_layer()
    AGC(clip_factor=0.1, exclude=lambda name: name == "bias").clip_(layer.named_parameters())
    assert same_bits(layer.bias.grad, bias_before)
    with pytest.raises(ValueError, match="named_parameters"):
        AGC(exclude=["x"]).clip_(layer.parameters())


def test_agc_conv_weight_units_are_output_channels():
    conv = nn.Conv2d(2, 3, kernel_size=2)
    gen = torch.Generator().manual_seed(0)
    conv.weight.grad = torch.randn(conv.weight.shape, generator=gen)
    grad, weight = conv.weight.grad.clone().double(), conv.weight.detach().double()
    AGC(clip_factor=0.05).clip_([conv.weight])
    for i in range(3):
        limit = 0.05 * max(weight[i].norm().item(), 1e-3)
        gn = grad[i].norm().item()
        want = grad[i] * (limit / gn if gn > limit else 1.0)
        np.testing.assert_allclose(conv.weight.grad[i].numpy(), want.numpy(), rtol=1e-5)


def test_agc_non_finite_global_norm_changes_nothing():
    layer = agc_layer()
    layer.weight.grad[0, 0] = math.nan
    before = [p.grad.clone() for p in layer.parameters()]
    res = AGC(clip_factor=0.1).clip_(layer.parameters())
    assert not bool(res.clipped) and float(res.clipped_fraction) == 0.0
    for p, b in zip(layer.parameters(), before):
        assert same_bits(p.grad, b)


# -- no host-device sync ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def host_reads_forbidden(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Any read of a tensor value raises, except reads of host copies made by ``AsyncRead`` (final values in
    host memory: on CUDA a pinned buffer whose copy event has completed), which wait for nothing."""
    with monkeypatch.context() as m:
        for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__"):
            orig = getattr(torch.Tensor, name)

            def forbidden(self, *args, _orig=orig, **kwargs):
                if getattr(self, HOST_COPY_ATTR, False):
                    return _orig(self, *args, **kwargs)
                raise AssertionError("host-device sync: a tensor value was read on the host")

            m.setattr(torch.Tensor, name, forbidden)
        yield


def test_no_tensor_value_is_read_on_the_host(monkeypatch):
    clippers = [
        NormClipper(1.0),
        ZClip(warmup_steps=3, max_norm=50.0),
        ZClip(warmup_steps=3, mode="percentile"),
        AutoClip(10.0, history_size=4),
        AutoClip(90.0, history_size=None),
        AGC(0.01, exclude=["*.bias"]),
    ]
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    gen = torch.Generator().manual_seed(0)
    for step in range(70):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen) * (30.0 if step % 6 == 4 else 1.0)
        if step % 10 == 7:
            model[0].weight.grad[0, 0] = math.inf
        for clipper in clippers:
            named = list(model.named_parameters())
            given = torch.tensor(2.0) if step % 5 == 1 else None
            with host_reads_forbidden(monkeypatch):
                res = clipper.clip_(named, total_norm=given)
            assert isinstance(res, ClipResult)
    with host_reads_forbidden(monkeypatch), pytest.raises(AssertionError, match="host-device sync"):
        bool(torch.tensor(True))  # the guard itself works
    assert int(clippers[1].count) >= 3  # warm-up ended under the guard


@pytest.mark.gpu
def test_no_cuda_sync_per_step():
    device = torch.device("cuda")
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8)).to(device)
    clippers = [NormClipper(1.0), ZClip(warmup_steps=3), AutoClip(10.0, 8), AutoClip(10.0, None), AGC(0.01)]
    for clipper in clippers:  # first call moves the state to the GPU (a one-time copy)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        clipper.clip_(model.parameters())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(80):
            for p in model.parameters():
                p.grad = torch.randn_like(p) * (50.0 if step % 7 == 3 else 1.0)
            for clipper in clippers:
                clipper.clip_(model.parameters())
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert clippers[1].mean.device.type == "cuda"
    assert clippers[1]._warm_done  # learnt from the asynchronous read, under sync debug mode "error"


def test_async_read_on_cpu_is_final_at_once():
    r = AsyncRead()
    assert r.poll() is None and not r.pending
    r.push(torch.tensor(True))
    r.push(torch.tensor(False))  # ignored while a read is pending
    assert r.pending and r.poll() is True
    assert not r.pending and r.poll() is None
    r.push(torch.tensor(7, dtype=torch.int64))
    assert r.poll() == 7


@pytest.mark.gpu
def test_async_read_on_cuda_never_waits():
    x = torch.randn(4096, 4096, device="cuda")
    r = AsyncRead()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = x @ x  # keeps the GPU busy for a while
        r.push((y.sum() * 0 + 3).to(torch.int64))
        first = r.poll()  # most likely still in flight: None, and no wait either way
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert first in (None, 3) and (first == 3 or r.poll() == 3)


# -- factory and validation ------------------------------------------------------------------------------------


def test_make_clipper_accepts_every_recipe_method():
    from hf_mixedprec.integrations.recipe import ClippingConfig

    expected = {"none": type(None), "norm": NormClipper, "zclip": ZClip, "autoclip": AutoClip, "agc": AGC}
    for method, cls in expected.items():
        cfg = ClippingConfig(method=method)
        assert type(make_clipper(cfg.method, **cfg.params())) is cls
    z = make_clipper("zclip", alpha=0.9, z_thresh=3.0, warmup_steps=10, max_norm=2.0)
    assert (z.alpha, z.z_thresh, z.warmup_steps, z.max_norm) == (0.9, 3.0, 10, 2.0)
    assert make_clipper("agc", clip_factor=0.02).clip_factor == 0.02


def test_make_clipper_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"'zclipp'.*none, norm, zclip, autoclip, agc"):
        make_clipper("zclipp")
    with pytest.raises(ValueError, match=r"'percentile', 'window'.*'zclip'.*alpha"):
        make_clipper("zclip", percentile=5.0, window=3)
    with pytest.raises(ValueError, match=r"'max_norm'.*'none'"):
        make_clipper("none", max_norm=1.0)


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        (NormClipper, {"max_norm": 0.0}, "max_norm"),
        (ZClip, {"alpha": 1.0}, "alpha"),
        (ZClip, {"warmup_steps": 0}, "warmup_steps"),
        (ZClip, {"mode": "median"}, "mode"),
        (ZClip, {"clip_option": "max"}, "clip_option"),
        (AutoClip, {"percentile": 101.0}, "percentile"),
        (AutoClip, {"history_size": 0}, "history_size"),
        (AGC, {"clip_factor": -1.0}, "clip_factor"),
    ],
)
def test_constructor_validation(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


def test_zclip_boundary_is_mean_plus_z_sigma_after_warmup():
    import math

    z = ZClip(warmup_steps=5, z_thresh=2.5)
    assert z.boundary().item() == math.inf
    for g in (1.0, 2.0, 3.0, 4.0, 5.0):  # warm-up: mean 3, population variance 2
        p = torch.zeros(1, requires_grad=True)
        p.grad = torch.tensor([g])
        z.clip_([p])
    assert z.boundary().item() == pytest.approx(3.0 + 2.5 * math.sqrt(2.0), rel=1e-6)
    capped = ZClip(warmup_steps=1, max_norm=0.5)
    p = torch.zeros(1, requires_grad=True)
    p.grad = torch.tensor([1.0])
    capped.clip_([p])
    assert capped.boundary().item() == 0.5


def test_runtime_makes_the_clipper_state_on_its_device() -> None:
    """The clipper's state lives on the runtime's device from the start: a copy at the first clip would be a
    host-device sync inside a training step (found on an H200 by scripts/gpu_sync_check.py)."""
    from hf_mixedprec.integrations.recipe import load_recipe_file
    from hf_mixedprec.training.runtime import MixedPrecisionRuntime

    rt = MixedPrecisionRuntime(load_recipe_file("cpu-bf16"), device="meta")
    assert rt.clipper is not None and rt.clipper._state_names
    assert {getattr(rt.clipper, n).device.type for n in rt.clipper._state_names} == {"meta"}
