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


@pytest.mark.parametrize("scaling", ["delayed", "current", "mxfp8", "blockwise"])
def test_single_pass_statistics_equal_the_two_pass_values(scaling):
    torch.manual_seed(0)
    lin = nn.Linear(64, 96)
    spec = EmulationSpec(scaling=scaling, amax_history_len=4)
    mod = EmulatedFP8Linear(lin, spec)
    warm, _ = _inputs(1)
    mod(torch.nan_to_num(warm, nan=0.0, posinf=1.0, neginf=-1.0)).sum().backward()
    fp8_step(mod)
    mod.record_stats = True
    x, gy = _inputs(2)
    mod(x).backward(gy)
    got = mod.stats
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
    from hf_mixedprec.demo import builtin_text, byte_batches, tiny_llama
    from hf_mixedprec.runtime import MixedPrecisionRuntime

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
    assert len(rt._fp8_samples) == 1 and rt.monitor.layer_values == {}
    name = "model.layers.0.mlp.down_proj"
    layer = model.get_submodule(name)
    rt.check(model)
    assert rt._fp8_samples == []
    metrics = rt.metrics()
    assert metrics[f"mp/fp8/{name}/input_amax"] == float(layer.stats.role("input").amax)
    assert metrics[f"mp/fp8/{name}/sqnr_db"] == min(float(layer.stats.role(r).sqnr_db) for r in ROLES)
