"""FP8 health statistics from the quantization the forward and backward already do (one pass over its tensors,
finished later for all layers at once) equal the two-pass values of ``operand_stats`` on the same tensors."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hf_mixedprec.fp8 import EmulatedFP8Linear, fp8_step
from hf_mixedprec.fp8.emulated import EmulationSpec
from hf_mixedprec.scaling.stats import ROLES, operand_stats


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 16, 64, generator=gen) * torch.logspace(-6, 3, 64)
    x[0, 0, :5] = torch.tensor([math.nan, math.inf, -math.inf, 0.0, 1e-30])
    x[1, 2, 7] = 1e5  # saturates under delayed scaling
    x[2, :, :3] = 0.0
    gy = torch.randn(4, 16, 96, generator=gen) * 1e-6
    gy[3, 1, :4] = torch.tensor([0.0, math.nan, 1e-40, 3e4])
    return x, gy


@pytest.mark.parametrize("scaling", ["delayed", "current", "mxfp8", "blockwise", "delayed-margin-12"])
def test_single_pass_statistics_equal_the_two_pass_values(scaling):
    """Per-tensor scales take the count_nonzero form, block scales (and delayed scaling with a margin so large that
    a scale's reciprocal could overflow) the general one: both equal the reference."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 96)
    margin = 12 if scaling.endswith("margin-12") else 0
    scaling = scaling.split("-")[0]
    spec = EmulationSpec(scaling=scaling, amax_history_len=4, margin=margin)
    mod = EmulatedFP8Linear(lin, spec)
    warm, _ = _inputs(1)
    mod(torch.nan_to_num(warm, nan=0.0, posinf=1.0, neginf=-1.0)).sum().backward()
    fp8_step(mod)
    mod.record_stats = True
    x, gy = _inputs(2)
    mod(x).backward(gy)
    got = mod.stats
    assert isinstance(mod.records[0], list) == (scaling in ("delayed", "current") and margin <= 8)
    mod.record_stats = False
    mod.eval()  # the same quantization again, without touching delayed scaling's pending amaxes
    operands = {
        "input": x.reshape(-1, 64).float(),
        "weight": mod.gemm_weight(mod.weight),
        "grad": gy.reshape(-1, 96).float(),
    }
    for role_i, role in enumerate(ROLES):
        t = operands[role]
        q = mod.quantize_for(t, role_i, gemm="fprop" if role_i < 2 else "dgrad")
        fmt = mod._fmt(role_i)
        want = operand_stats(t, q.data, q.deq, fmt, scale_codes=q.codes, block_size=spec.block_size)
        have = got.role(role)
        assert have is not None, role
        for metric in ("amax", "saturation", "underflow"):  # counts and maxima: exactly
            a, b = getattr(have, metric), getattr(want, metric)
            assert torch.equal(a, b.to(a.dtype)), (role, metric, a, b)
        assert (have.mx_clamp is None) == (want.mx_clamp is None)
        if want.mx_clamp is not None:
            assert torch.equal(have.mx_clamp, want.mx_clamp), role
        # SQNR: float64 sums here, float32 sums (scaled by a power of two) there
        a, b = float(have.sqnr_db), float(want.sqnr_db)
        assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-5, abs=1e-5), (role, a, b)
    assert scaling != "delayed" or float(got.role("grad").saturation) > 0  # the cases do clip and flush
    assert float(got.role("input").underflow) > 0


def test_sampled_statistics_reach_the_monitor_only_at_the_check():
    """A sampled step keeps one stacked copy of the layers' rows; the monitor sees them at the next check, the
    worst of several samples."""
    import hf_mixedprec
    from hf_mixedprec.core.demo import builtin_text, byte_batches, tiny_llama
    from hf_mixedprec.training.runtime import MixedPrecisionRuntime

    recipe = hf_mixedprec.load_recipe("h100-fp8-delayed", rehearse=True)
    rt = MixedPrecisionRuntime(recipe, device="cpu")
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rt.convert_model(model, opt)
    scaler = rt.make_guard_scaler()
    every = recipe.health.fp8_sample_every
    rt.steps = every - 1  # the next step samples
    for batch in byte_batches(builtin_text(), seq_len=32, batch_size=2, n_batches=1, seed=0):
        rt.begin_step(model)
        assert rt._sampling
        with rt.autocast():
            loss = model(input_ids=batch, labels=batch).loss
        rt.record_loss(loss)
        loss.backward()
        rt.before_optimizer_step(model.parameters(), opt)
        scaler.step(opt)
        scaler.update()
        rt.after_optimizer_step(model, opt)
    assert len(rt.fp8_stats.samples) == 1 and rt.monitor.layer_values == {}
    name = "model.layers.0.mlp.down_proj"
    layer = model.get_submodule(name)
    rt.check(model)
    assert rt.fp8_stats.samples == []
    metrics = rt.metrics()
    assert metrics[f"mp/fp8/{name}/input_amax"] == float(layer.stats.role("input").amax)
    assert metrics[f"mp/fp8/{name}/sqnr_db"] == min(float(layer.stats.role(r).sqnr_db) for r in ROLES)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scale", [1.0, 3.0, 0.37, 2.0**-100, 448.0 / 3.4028234663852886e38, 3.4028234663852886e38])
def test_per_tensor_statistics_are_exact_at_the_edges(fmt, scale):
    """The count_nonzero form equals the masked reference at the clipping edge (values a few ulps either side of what
    the max dequantizes to), for infinite, NaN, signed-zero and subnormal inputs, and for scales whose reciprocal is
    subnormal or huge."""
    from hf_mixedprec.core.formats import get_format
    from hf_mixedprec.scaling import dequantize_fp8, quantize_fp8
    from hf_mixedprec.scaling.fp8 import abs_and_amax
    from hf_mixedprec.scaling.stats import finish_operand_stats, raw_from_tensorwise, tensorwise_operand_stats

    f = get_format(fmt)
    s = torch.tensor(scale, dtype=torch.float32)
    top = torch.tensor(f.max, dtype=torch.float32) * torch.reciprocal(s)
    edge = [torch.nextafter(top, torch.tensor(d)) for d in (0.0, math.inf)]  # one ulp below and above
    near = torch.stack([top, *edge, top * 0.999, top * 1.001, top * 0.97, top * 0.95])
    gen = torch.Generator().manual_seed(0)
    x = torch.cat(
        [
            near,
            -near,
            torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-45, -1e-44, 1e-30, 3e38, 1.0]),
            torch.randn(200, generator=gen) * float(top) * torch.logspace(-8, 0.5, 200),
        ]
    ).reshape(-1, 4)
    q = quantize_fp8(x, s, f)
    x_hat = dequantize_fp8(q, s)
    mag, amax = abs_and_amax(x)
    fast = tensorwise_operand_stats(x, x_hat, amax=amax, top=top, magnitude=mag)
    got = finish_operand_stats(raw_from_tensorwise([fast]))[0]
    want = operand_stats(x, q, x_hat, f)
    for i, metric in enumerate(("amax", "saturation", "underflow")):
        assert torch.equal(got[i], getattr(want, metric)), (metric, got[i], getattr(want, metric))
    a, b = float(got[3]), float(want.sqnr_db)
    assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-5, abs=1e-5), (a, b)
    x_clean = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)  # SQNR is defined without NaN or inf
    q2 = quantize_fp8(x_clean, s, f)
    fast = tensorwise_operand_stats(x_clean, dequantize_fp8(q2, s), amax=abs_and_amax(x_clean)[1], top=top)
    a = float(finish_operand_stats(raw_from_tensorwise([fast]))[0, 3])
    b = float(operand_stats(x_clean, q2, dequantize_fp8(q2, s), f).sqnr_db)
    assert a == pytest.approx(b, rel=1e-5, abs=1e-5), (a, b)  # float64 sums here, float32 there
    assert float(want.underflow) > 0  # the cases do flush, and clip where the max dequantizes to a finite value
    assert float(want.saturation) > 0 or math.isinf(float(top))
