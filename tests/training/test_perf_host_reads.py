"""A logging step reads everything hf_mixedprec reports (the detectors' records, the FP8 layers' statistics, loss
scale, skipped steps, the clipper's state and result) with ONE device-to-host copy, in every precision; steps that
do not log read nothing. The values logged are those the device holds."""

from __future__ import annotations

import collections
import math

import pytest
import torch

from hf_mixedprec.core import metrics as M
from hf_mixedprec.fp8 import fp8_layers
from hf_mixedprec.integrations.trainer import runtime_of
from tests.training.test_health import _recipe, _run, _StepTracker, _SyncCounter

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


@pytest.mark.slow
@pytest.mark.parametrize("base", ["cpu-bf16", "v100-fp16", "h100-fp8-delayed"])
def test_a_logging_step_makes_one_host_read(tmp_path, monkeypatch, base):
    recipe = _recipe("{clipping: {method: zclip, warmup_steps: 3}, health: {fp8_sample_every: 5}}", base=base)
    counter = _SyncCounter(monkeypatch)
    tr = _run(recipe, tmp_path, steps=10, callbacks=[_StepTracker(counter)], logging_steps=5)
    hits = [h for h in counter.hits if h[0] > 0]  # step 0: building the data set
    assert collections.Counter(h[0] for h in hits) == {5: 1, 10: 1}, hits
    assert all(h[1] == "tolist" and h[2].startswith("runtime_stats.py") for h in hits), hits  # the logging read
    rows = [r for r in tr.state.log_history if "loss" in r]
    assert [r["step"] for r in rows] == [5, 10]
    last = rows[-1]
    rt = runtime_of(tr)
    # the values read in that one copy are the device's
    assert last[M.GRAD_NORM] == float(rt._last.total_norm) == last["grad_norm"]
    assert last[M.CLIPPED] == float(rt._last.clipped) == 0.0
    assert last[M.CLIP_THRESHOLD] == float(rt.clipper.boundary())
    assert last[M.SKIPPED_STEPS] == float(rt.amp.skipped) == 0.0
    assert rt.clipper._warm_done  # learnt from the same copy
    if base == "v100-fp16":
        assert last[M.LOSS_SCALE] == rt.scaler.get_scale()
    layer_keys = [k for k in last if k.startswith(M.FP8_PREFIX)]
    if base != "h100-fp8-delayed":
        assert not layer_keys
        return
    layers = fp8_layers(tr.model)
    assert len(layer_keys) == 4 * len(layers) == 4 * 14
    for name, m in layers:  # the statistics of the step-10 sample, as each layer holds them
        vals = m.stats.to_floats()
        roles = vals.values()
        assert last[M.fp8_layer_key(name, "saturation")] == max(v["saturation"] for v in roles)
        assert last[M.fp8_layer_key(name, "sqnr_db")] == min(v["sqnr_db"] for v in roles)
        assert last[M.fp8_layer_key(name, "input_amax")] == vals["input"]["amax"] > 0
        assert math.isfinite(last[M.fp8_layer_key(name, "sqnr_db")])


def test_monitor_check_with_values_read_elsewhere_matches_its_own_read():
    """``HealthMonitor.check(values)`` with the request read by the caller gives the events its own read gives."""
    from hf_mixedprec.integrations.recipe import load_recipe_file
    from hf_mixedprec.scaling.stats import LayerStats, RoleStats
    from hf_mixedprec.training.health import HealthMonitor

    cfg = load_recipe_file("h100-fp8-delayed").health
    a, b = HealthMonitor(cfg), HealthMonitor(cfg)
    for step in range(40):
        for mon in (a, b):
            loss = torch.tensor(math.nan if step == 17 else 2.0 + 0.01 * step)
            mon.pre_step(loss=loss, grad_norm=torch.tensor(1.0 + (50.0 if step == 30 else 0.0)))
            mon.post_step(skipped=torch.tensor(float(step == 17)), scale=None)
            sat = torch.tensor(0.5 if step == 35 else 0.0)
            stats = LayerStats(input=RoleStats(amax=torch.tensor(3.0), saturation=sat, sqnr_db=torch.tensor(30.0)))
            mon.observe_fp8({"l0": stats, "l1": LayerStats(grad=RoleStats(underflow=torch.tensor(0.9)))})
        if step % 10 == 9:
            request = b.check_request()
            got_a = a.check()
            got_b = b.check(request.tolist())
            assert [repr(e) for e in got_a] == [repr(e) for e in got_b]
            assert got_a, step


@pytest.mark.parametrize("base", ["cpu-bf16", "h100-fp8-delayed"])
def test_steps_walk_no_module_tree(monkeypatch, base):
    """After the first step, the Accelerate plugin's hooks never walk the model's modules or parameters (the lists
    are collected once per model); only the loop's own calls do."""
    from torch import nn

    from hf_mixedprec.core.demo import tiny_llama
    from hf_mixedprec.integrations.accelerate_plugin import make_accelerator
    from tests.integrations.test_integration import Bytes

    acc = make_accelerator(_recipe("{clipping: {method: zclip, warmup_steps: 2}}", base=base), cpu=True)
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    data = Bytes(n=12)
    walks = collections.Counter()
    for method in ("named_modules", "parameters", "named_parameters", "modules"):
        real = getattr(nn.Module, method)

        def counted(self, *a, _real=real, _name=method, **k):
            walks[_name] += 1
            return _real(self, *a, **k)

        monkeypatch.setattr(nn.Module, method, counted)
    for i in range(6):
        if i == 1:
            walks.clear()  # the first step collects the lists
        batch = {k: torch.stack([data[2 * i][k], data[2 * i + 1][k]]) for k in ("input_ids", "labels")}
        acc.backward(model(**batch).loss)
        opt.step()
        opt.zero_grad()
    assert walks == collections.Counter(), walks
    assert acc.mp._last is not None and acc.mp.steps == 6  # the clipper and the hooks ran on every step
