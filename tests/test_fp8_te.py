"""The Transformer Engine mapping, tested without TE against TE 2.x's recipe class fields."""

from __future__ import annotations

import pytest

from hf_mixedprec.fp8.transformer_engine import TE_INSTALL_HINT, build_te_recipe, te_recipe_spec
from hf_mixedprec.recipe import load_recipe_file, resolve_recipe

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
