"""The Transformer Engine mapping, tested without TE against TE 2.x's recipe class fields."""

from __future__ import annotations

import pytest

from hf_mixedprec.fp8.transformer_engine import TE_INSTALL_HINT, build_te_recipe, te_recipe_spec
from hf_mixedprec.integrations.recipe import load_recipe_file, resolve_recipe

# Constructor fields of transformer_engine.common.recipe classes in TE 2.x (pydantic dataclasses).
TE2_FIELDS = {
    "DelayedScaling": {
        "margin",
        "fp8_format",
        "amax_history_len",
        "amax_compute_algo",
        "scaling_factor_compute_algo",
        "reduce_amax",
        "fp8_dpa",
        "fp8_mha",
    },
    "Float8CurrentScaling": {"fp8_format", "use_power_2_scales", "fp8_dpa", "fp8_mha"},
    "MXFP8BlockScaling": {"fp8_format", "margin", "fp8_dpa", "fp8_mha"},
    "Float8BlockScaling": {
        "fp8_format",
        "use_f32_scales",
        "x_block_scaling_dim",
        "w_block_scaling_dim",
        "grad_block_scaling_dim",
    },
}
TE_FORMATS = {"E4M3", "HYBRID"}  # TE refuses pure E5M2 training


def _fp8(scaling: str, **kw):
    return resolve_recipe({"name": "t", "precision": "fp8", "fp8": {"scaling": scaling, **kw}})


@pytest.mark.parametrize(
    "recipe_name, cls",
    [
        ("h100-fp8-delayed", "DelayedScaling"),
        ("h100-fp8-current", "Float8CurrentScaling"),
        ("b200-mxfp8", "MXFP8BlockScaling"),
        ("h100-fp8-blockwise", "Float8BlockScaling"),
    ],
)
def test_spec_uses_only_te2_fields(recipe_name, cls):
    name, kwargs = te_recipe_spec(load_recipe_file(recipe_name))
    assert name == cls
    assert set(kwargs) <= TE2_FIELDS[cls], set(kwargs) - TE2_FIELDS[cls]
    assert kwargs["fp8_format"] in TE_FORMATS


def test_delayed_values_follow_the_recipe():
    _, kw = te_recipe_spec(
        _fp8("delayed", amax_history_len=16, amax_compute_algo="most_recent", margin=2, format="E4M3")
    )
    assert kw == {
        "margin": 2,
        "fp8_format": "E4M3",
        "amax_history_len": 16,
        "amax_compute_algo": "most_recent",
        "reduce_amax": True,
        "fp8_dpa": False,
        "fp8_mha": False,
    }


def test_current_values_and_epsilon_refusal():
    _, kw = te_recipe_spec(_fp8("current", power_2_scales=True))
    assert kw == {"fp8_format": "HYBRID", "use_power_2_scales": True, "fp8_dpa": False, "fp8_mha": False}
    with pytest.raises(ValueError, match=r"fp8.epsilon: 1e-06 has no effect with backend transformer_engine"):
        te_recipe_spec(_fp8("current", epsilon=1e-6))


def test_mxfp8_values_and_floor_refusal():
    _, kw = te_recipe_spec(_fp8("mxfp8", margin=1, format="E4M3"))
    assert kw == {"fp8_format": "E4M3", "margin": 1, "fp8_dpa": False, "fp8_mha": False}
    with pytest.raises(ValueError, match=r"fp8.mx_rounding: 'floor' is not what Transformer Engine does"):
        te_recipe_spec(_fp8("mxfp8", mx_rounding="floor"))


def test_blockwise_values():
    _, kw = te_recipe_spec(_fp8("blockwise", format="E4M3", power_2_scales=False))
    assert kw == {
        "fp8_format": "E4M3",
        "use_f32_scales": True,
        "x_block_scaling_dim": 1,
        "w_block_scaling_dim": 2,
        "grad_block_scaling_dim": 1,
    }
    _, kw = te_recipe_spec(load_recipe_file("h100-fp8-blockwise"))
    assert kw["use_f32_scales"] is False  # TE default: power-of-2 scales


def test_non_fp8_recipe_has_no_te_recipe():
    with pytest.raises(ValueError, match="not fp8"):
        te_recipe_spec(load_recipe_file("a100-bf16"))


def test_missing_te_says_what_to_install():
    pytest.importorskip("torch")
    from tests.conftest import HAS_TE

    if HAS_TE:
        pytest.skip("Transformer Engine is installed here")
    with pytest.raises(ImportError) as exc:
        build_te_recipe(load_recipe_file("h100-fp8-delayed"))
    assert str(exc.value) == TE_INSTALL_HINT


@pytest.mark.te
@pytest.mark.parametrize("recipe_name", ["h100-fp8-delayed", "h100-fp8-current", "b200-mxfp8", "h100-fp8-blockwise"])
def test_build_real_te_recipe(recipe_name):
    rec = build_te_recipe(load_recipe_file(recipe_name))
    cls, kw = te_recipe_spec(load_recipe_file(recipe_name))
    assert type(rec).__name__ == cls
    for k, v in kw.items():
        got = getattr(rec, k)
        assert (got.name if k == "fp8_format" else got) == v


# -- per-layer health probe: the rule it applies, checked without TE against the emulated layers -----------------


@pytest.mark.parametrize(
    ("scaling", "kw"),
    [("current", {}), ("current", {"power_2_scales": True}), ("mxfp8", {}), ("blockwise", {})],
)
def test_te_probe_rule_quantizes_as_the_emulated_layer(scaling, kw):
    """The probe on a TE module measures the quantization TE does; the emulated layer implements the same TE rule,
    so both give the same FP8 values for the same operand (fprop orientation)."""
    import torch
    from torch import nn

    from hf_mixedprec.fp8.emulated import EmulatedFP8Linear, EmulationSpec
    from hf_mixedprec.fp8.transformer_engine import te_probe_formats, te_quantize_rule

    recipe = _fp8(scaling, backend="emulated", **kw)
    rule = te_quantize_rule(recipe)
    emu = EmulatedFP8Linear(nn.Linear(256, 128), EmulationSpec.from_config(recipe.fp8))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=gen) * torch.logspace(-3, 2, 256)
    w = emu.weight.detach().float()
    g = torch.randn(64, 128, generator=gen) * 1e-4
    for role, idx, t, gemm in (("input", 0, x, "fprop"), ("weight", 1, w, "fprop"), ("grad", 2, g, "dgrad")):
        data, deq = rule(t, role, torch.float32)
        want = emu.quantize_for(t, idx, gemm=gemm)
        assert torch.equal(deq, want.deq), (scaling, role)
        assert torch.equal(data.float(), want.data.float()), (scaling, role)
    assert te_probe_formats(recipe)["grad"] == "e5m2"


def test_te_probe_delayed_rule_uses_the_modules_own_scale():
    import torch

    from hf_mixedprec.fp8.transformer_engine import te_quantize_rule
    from hf_mixedprec.scaling import dequantize_fp8, quantize_fp8

    recipe = _fp8("delayed", backend="emulated")
    scales = {"input": torch.tensor(2.0), "weight": None, "grad": torch.tensor(1024.0)}
    rule = te_quantize_rule(recipe, delayed_scale=scales.get)
    x = torch.linspace(-300, 300, 64).reshape(4, 16)
    data, deq = rule(x, "input", torch.bfloat16)
    assert torch.equal(data, quantize_fp8(x, scales["input"], "e4m3"))  # 300 * 2 saturates at 448, as in TE
    assert torch.equal(deq, dequantize_fp8(data, scales["input"]))
    assert rule(x, "weight", torch.float32) is None  # no scale yet: nothing measured
    assert rule(x, "grad", torch.float32)[0].dtype == torch.float8_e5m2


def test_te_module_probe_and_fallback_with_transformer_engine():
    """Needs Transformer Engine and a GPU: the probe reads a real te.Linear and the fallback keeps its Parameters."""
    te = pytest.importorskip("transformer_engine.pytorch")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from torch import nn

    from hf_mixedprec.fp8 import convert, fp8_layers, to_high_precision

    model = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 128)).cuda()
    convert(model, _fp8("delayed", backend="transformer_engine", keep_lm_head=False))
    probes = dict(fp8_layers(model, fresh=True))
    assert set(probes) == {"0", "1"}
    for p in probes.values():
        p.record_stats = True
    for _ in range(2):
        model(torch.randn(32, 128, device="cuda", requires_grad=True)).sum().backward()
    st = probes["0"].stats
    assert st.input is not None and st.weight is not None and st.grad is not None
    w = model[0].weight
    lin = to_high_precision(model[0])
    assert isinstance(lin, nn.Linear) and not isinstance(lin, te.Linear) and lin.weight is w
