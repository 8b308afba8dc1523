"""One per-layer FP8 statistics record, one threshold check, one module swap, each table and default once."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hf_mixedprec.core.demo import tiny_llama
from hf_mixedprec.core.formats import COMPUTE_FORMATS, FP8_SCALING_DEFAULTS, compute_dtype
from hf_mixedprec.fp8 import EmulatedFP8Linear, convert, replace_module
from hf_mixedprec.fp8.emulated import EmulationSpec
from hf_mixedprec.fp8.policy import ALREADY_FP8, LayerDecision
from hf_mixedprec.fp8.transformer_engine import accelerate_fp8_config, te_recipe_spec
from hf_mixedprec.integrations.recipe import ClippingConfig, FP8Config, load_recipe_file, resolve_recipe
from hf_mixedprec.scaling.stats import LayerStats, RoleStats
from hf_mixedprec.training.clipping import CLIP_DEFAULTS, AutoClip, NormClipper, ZClip
from hf_mixedprec.training.health import HealthMonitor, layer_breaches


def _t(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def _role(sat: float, und: float = 0.0, sqnr: float = 30.0, clamp: float | None = None) -> RoleStats:
    return RoleStats(_t(1.0), _t(sat), _t(und), _t(sqnr), None if clamp is None else _t(clamp))


def test_layer_stats_is_a_flat_mapping_and_round_trips():
    empty = LayerStats()
    assert not empty and dict(empty) == {} and len(empty) == 0
    st = LayerStats(input=_role(0.1, clamp=0.5), grad=_role(0.2))
    assert list(st) == [f"input_{m}" for m in ("amax", "saturation", "underflow", "sqnr_db", "mx_clamp")] + [
        f"grad_{m}" for m in ("amax", "saturation", "underflow", "sqnr_db")
    ]
    assert st["input_mx_clamp"] is st.input.mx_clamp and "weight_amax" not in st and "grad_mx_clamp" not in st
    back = LayerStats.from_flat(dict(st))
    assert dict(back) == dict(st) and back.weight is None
    assert st.to_floats() == {
        "input": {"amax": 1.0, "saturation": pytest.approx(0.1), "underflow": 0.0, "sqnr_db": 30.0, "mx_clamp": 0.5},
        "grad": {"amax": 1.0, "saturation": pytest.approx(0.2), "underflow": 0.0, "sqnr_db": 30.0},
    }
    with pytest.raises(ValueError, match="not an FP8 layer statistic"):
        LayerStats.from_flat({"bias_amax": _t(1.0)})


def test_worst_keeps_the_lowest_sqnr_and_the_highest_rest():
    a = LayerStats(input=_role(0.1, sqnr=20.0))
    b = LayerStats(input=_role(0.05, und=0.3, sqnr=25.0), weight=_role(0.0))
    w = a.worst(b)
    assert w.to_floats()["input"] == {
        "amax": 1.0,
        "saturation": pytest.approx(0.1),
        "underflow": pytest.approx(0.3),
        "sqnr_db": 20.0,
    }
    assert w.weight is b.weight
    nan = LayerStats(input=_role(float("nan")))
    assert math.isnan(a.worst(nan).to_floats()["input"]["saturation"])  # as torch.maximum: NaN wins


def test_emulated_layer_records_the_typed_record():
    torch.manual_seed(0)
    mod = EmulatedFP8Linear(nn.Linear(64, 32), EmulationSpec(scaling="mxfp8"))
    assert isinstance(mod.stats, LayerStats) and not mod.stats
    mod.record_stats = True
    mod(torch.randn(8, 64)).sum().backward()
    st = mod.stats
    assert all(isinstance(getattr(st, r), RoleStats) for r in ("input", "weight", "grad"))
    assert st.input.mx_clamp is not None and set(dict(st)) == set(st)


def test_one_threshold_check_for_health_and_simulate():
    det = resolve_recipe(
        {
            "name": "t",
            "precision": "fp8",
            "fp8": {"scaling": "mxfp8", "backend": "emulated"},
            "health": {
                "detectors": {
                    "fp8_saturation": {"threshold": 0.01},
                    "fp8_sqnr": {"threshold": 25.0},
                    "fp8_underflow": {"enabled": False, "threshold": 0.1},
                    "mx_clamp": {"threshold": None},
                }
            },
        }
    ).health.detectors
    values = {
        "input": {"saturation": 0.02, "underflow": 0.5, "sqnr_db": 20.0, "mx_clamp": 1.0},
        "grad": {"saturation": 0.0, "sqnr_db": float("nan")},
    }
    got = [(b.detector, b.role, b.metric, b.value, b.threshold) for b in layer_breaches(values, det)]
    assert got == [("fp8_saturation", "input", "saturation", 0.02, 0.01), ("fp8_sqnr", "input", "sqnr_db", 20.0, 25.0)]


def test_monitor_takes_the_record_or_its_dict_alike():
    recipe = load_recipe_file("h100-fp8-delayed")
    st = LayerStats(input=_role(0.5), weight=_role(0.0, sqnr=-1.0))
    events = []
    for layers in ({"l": st}, {"l": dict(st)}):
        mon = HealthMonitor(recipe.health)
        mon.observe_fp8(layers)
        mon.observe_fp8({"l": LayerStats(input=_role(0.1))})
        events.append([e.to_dict() for e in mon.check()])
        assert mon.layer_values == {}
    # default thresholds: saturation 0.001 (input 0.5 fires, the later 0.1 sample does not lower it), SQNR 20 dB
    assert events[0] == events[1]
    assert [(e["detector"], e["layer"], e["value"]) for e in events[0]] == [
        ("fp8_saturation", "l", 0.5),
        ("fp8_sqnr", "l", -1.0),
    ]
    state_mon = HealthMonitor(recipe.health)
    state_mon.observe_fp8({"l": st})
    restored = HealthMonitor(recipe.health)
    restored.load_state_dict(state_mon.state_dict())
    assert isinstance(restored.layer_values["l"], LayerStats)
    assert [e.to_dict() for e in restored.check()] == [e.to_dict() for e in state_mon.check()]


def test_replace_module_top_level_and_nested():
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    old_top, old_inner = model[0], model[1][0]
    new_top, new_inner = nn.Identity(), nn.Identity()
    assert replace_module(model, "0", new_top) is old_top and model[0] is new_top
    assert replace_module(model, "1.0", new_inner) is old_inner and model[1][0] is new_inner


def test_already_fp8_is_a_field_and_the_report_text_is_unchanged():
    model = tiny_llama()
    recipe = resolve_recipe({"name": "t", "precision": "fp8", "fp8": {"scaling": "current", "backend": "emulated"}})
    first = convert(model, recipe)
    assert not any(d.already_fp8 for d in first.layers)
    again = convert(model, recipe)
    d = again.decision("model.layers.0.self_attn.q_proj")
    assert d.already_fp8 and d.fp8 and not d.to_swap and d.reason == ALREADY_FP8 == "already FP8"
    assert d.to_dict() == {
        "name": "model.layers.0.self_attn.q_proj",
        "kind": "Linear",
        "in_features": d.in_features,
        "out_features": d.out_features,
        "fp8": True,
        "reason": "already FP8",
    }
    assert LayerDecision("x", "Linear", 16, 16, True, "converted").to_swap


def test_each_default_and_table_is_written_once():
    for scaling, defaults in FP8_SCALING_DEFAULTS.items():
        assert FP8Config(scaling=scaling, backend="emulated").options() == defaults
    spec = EmulationSpec(scaling="delayed")
    assert (spec.amax_history_len, spec.amax_compute_algo, spec.margin) == (1024, "max", 0)
    for method, defaults in CLIP_DEFAULTS.items():
        assert ClippingConfig(method=method).params() == defaults
    assert NormClipper().max_norm == CLIP_DEFAULTS["norm"]["max_norm"]
    assert (ZClip().alpha, ZClip().warmup_steps) == (0.97, 25) and AutoClip().history_size == 1000
    assert {p: compute_dtype(p) for p in ("fp32", "fp16", "bf16", "fp8")} == {
        "fp32": None,
        "fp16": torch.float16,
        "bf16": torch.bfloat16,
        "fp8": torch.bfloat16,
    }
    assert COMPUTE_FORMATS["fp8"].name == "bf16" and COMPUTE_FORMATS["fp16"].name == "fp16"


@pytest.mark.parametrize("name", ["h100-fp8-delayed", "b200-mxfp8", "h100-fp8-current"])
def test_accelerate_fp8_config_derives_from_the_te_recipe_spec(name):
    recipe = load_recipe_file(name)
    cls_name, kwargs = te_recipe_spec(recipe)
    cfg = accelerate_fp8_config(recipe)
    if cls_name == "DelayedScaling":
        assert cfg == {
            "backend": "TE",
            "fp8_format": recipe.fp8.format,
            "use_autocast_during_eval": False,
            "amax_history_len": kwargs["amax_history_len"],
            "amax_compute_algo": kwargs["amax_compute_algo"],
            "margin": kwargs["margin"],
        }
    elif cls_name == "MXFP8BlockScaling":
        assert cfg == {
            "backend": "TE",
            "fp8_format": recipe.fp8.format,
            "use_autocast_during_eval": False,
            "margin": kwargs["margin"],
            "use_mxfp8_block_scaling": True,
        }
    else:
        assert cfg is None


def test_the_old_fp8_layer_listers_still_answer_with_a_deprecation_warning():
    """``iter_monitored``, ``monitored_layers``, ``iter_emulated`` and ``emulated_layers`` were public names of
    ``hf_mixedprec.fp8`` before ``fp8_layers`` replaced them: each still returns what it did, and warns."""
    import hf_mixedprec.fp8 as fp8
    from hf_mixedprec.core.demo import tiny_llama
    from hf_mixedprec.integrations.recipe import load_recipe
    from hf_mixedprec.training.runtime import MixedPrecisionRuntime

    model = tiny_llama(0)
    MixedPrecisionRuntime(load_recipe("h100-fp8-delayed", rehearse=True), rehearse=True).convert_model(model)
    every = fp8.fp8_layers(model, fresh=True)
    assert len(every) == 14
    for old, want in [
        ("iter_monitored", every),
        ("monitored_layers", every),
        ("iter_emulated", fp8.fp8_layers(model, emulated_only=True, fresh=True)),
        ("emulated_layers", every),
    ]:
        with pytest.warns(DeprecationWarning, match=f"hf_mixedprec.fp8.{old}\\(model\\) is deprecated: use"):
            got = list(getattr(fp8, old)(model))
        assert [(n, id(m)) for n, m in got] == [(n, id(m)) for n, m in want], old
