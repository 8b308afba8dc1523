"""The precision plan is what runs: for every built-in recipe, the modules a prepared model holds and the dtypes of
its parameters are the plan's, module by module; ``simulate`` converts exactly the plan's layers."""

from __future__ import annotations

import pytest
import torch

from hf_mixedprec.core.demo import tiny_llama
from hf_mixedprec.fp8 import EmulatedFP8GEMM, fp8_layers
from hf_mixedprec.integrations.recipe import load_recipe
from hf_mixedprec.precision.plan import dtype_name, run_plan
from hf_mixedprec.recipes.files import builtin_recipe_names
from hf_mixedprec.training.runtime import MixedPrecisionRuntime

RECIPES = builtin_recipe_names()


def _prepared(name: str, dtype: torch.dtype = torch.bfloat16):
    recipe = load_recipe(name, rehearse=True)
    model = tiny_llama(0).to(dtype)  # as transformers 5 loads most published models
    rt = MixedPrecisionRuntime(recipe, rehearse=True)
    plan = rt.prepare_storage(model)
    rt.convert_model(model)
    return recipe, model, plan, rt


@pytest.mark.parametrize("name", RECIPES)
def test_the_prepared_model_is_the_plan_module_by_module(name):
    recipe, model, plan, rt = _prepared(name)
    fp8 = {n for n, _ in fp8_layers(model, fresh=True)}
    assert {d.name for d in plan.fp8_layers if d.fp8} == fp8
    if recipe.precisions()[0] == "fp8":
        assert fp8, name  # the tiny Llama's projections are FP8 under every FP8 recipe
        assert [d.name for d in rt.fp8_report.layers] == [d.name for d in plan.fp8_layers]
    else:
        assert plan.fp8_layers == () and not fp8
    params = dict(model.named_parameters())
    for p in plan.params:
        assert dtype_name(params[p.name].dtype) == p.weight, (name, p.name)
    # a BF16-loaded model keeps an FP32 master under every built-in recipe (all say storage.master fp32)
    assert {p.weight for p in plan.params if p.trainable} == {"fp32"}


@pytest.mark.parametrize("name", RECIPES)
def test_simulate_converts_the_plans_layers(name):
    """simulate rehearses FP8 recipes on the plan's layers; a recipe whose plan has no FP8 layer is refused."""
    from hf_mixedprec.commands.simulate import simulate

    recipe = load_recipe(name, rehearse=True)
    if recipe.precision != "fp8":
        assert run_plan(recipe, tiny_llama(0), rehearse=True).fp8_layers == ()
        with pytest.raises(ValueError, match=f"has precision '{recipe.precision}'; simulate rehearses fp8 recipes"):
            simulate(recipe, steps=2, seq_len=32, batch_size=2)
        return
    res = simulate(recipe, steps=2, seq_len=32, batch_size=2)
    assert res.plan is not None
    assert [(d.name, d.fp8) for d in res.conversion.layers] == [(d.name, d.fp8) for d in res.plan.fp8_layers]


def test_a_phase_switch_converts_with_the_phases_own_plan():
    recipe = load_recipe("h100-fp8-anneal-bf16", rehearse=True)
    model = tiny_llama(0)
    rt = MixedPrecisionRuntime(recipe, rehearse=True)
    plan = rt.prepare_storage(model)
    assert plan.phases == ("fp8", "bf16")
    rt.convert_model(model)
    assert all(isinstance(m, EmulatedFP8GEMM) for n, m in fp8_layers(model, fresh=True))
    assert {n for n, _ in fp8_layers(model, fresh=True)} == {d.name for d in plan.fp8_layers if d.fp8}


def test_run_plan_of_an_fp32_recipe_has_no_fp8_and_fp32_storage():
    plan = run_plan(load_recipe("cpu-bf16", rehearse=True), tiny_llama(0), rehearse=True)
    assert plan.fp8_backend is None and plan.fp8_layers == ()
    assert plan.bytes_by_component()["weights"] == sum(p.numel() * 4 for p in tiny_llama(0).parameters())


@pytest.mark.parametrize("name", RECIPES)
def test_estimate_prepares_the_plans_model_module_by_module_and_counts_its_bytes(name):
    """``estimate`` on the tiny Llama's config, for this CPU, under every built-in recipe: the model its fake step
    ran is the plan's, module by module (the FP8 layers, each parameter's dtype), and its weights / master /
    gradients / optimizer are the plan's bytes (the model built in FP32, as finetune builds it)."""
    from hf_mixedprec.commands.estimate import estimate_memory
    from hf_mixedprec.commands.estimate_step import _run_fake_step, _Settings
    from hf_mixedprec.core.demo import tiny_llama_config
    from hf_mixedprec.precision.plan import build_plan

    recipe = load_recipe(name, rehearse=True)
    est = estimate_memory(tiny_llama_config(), [recipe], batch_size=1, seq_len=32, target="cpu").recipes[0]
    plan = build_plan(recipe, tiny_llama(0), fp8_backend=est.fp8_backend)
    fp8 = [d.name for d in plan.fp8_layers if d.fp8]
    assert est.fp8_layers == len(fp8) and (len(fp8) > 0) == (recipe.precision == "fp8")
    step = _run_fake_step(tiny_llama_config(), recipe, _Settings(1, 32, False, "adamw", None, None, "cpu"))
    assert step.fp8_names == fp8
    assert {n: dtype_name(d) for n, d in step.param_dtypes.items()} == {p.name: p.weight for p in plan.params}
    b = plan.bytes_by_component()
    assert est.memory.weights == b["weights"] and est.memory.gradients == b["gradients"]
    assert est.memory.optimizer == b["exp_avg"] + b["exp_avg_sq"] + b["optimizer_step"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["a100-bf16", "h100-fp8-current", "examples/recipes/storage-bf16_remainder.yaml"])
def test_plan_command_prints_what_the_model_holds_after_attach(tmp_path, recipe, capfd):
    """``hf-mixedprec plan --model DIR`` (the config only, on the meta device) lists, per module, the dtypes and the
    FP8 layers a BF16 checkpoint of a tiny Llama really gets when the recipe is attached to it."""
    import json

    from transformers import AutoModelForCausalLM

    from hf_mixedprec.cli.app import main
    from hf_mixedprec.core.demo import tiny_llama as build

    build(0).to(torch.bfloat16).save_pretrained(tmp_path)
    capfd.readouterr()
    code = main(["plan", "--recipe", recipe, "--model", str(tmp_path), "--json"])  # in this process
    stdout, stderr = capfd.readouterr()  # read at the file descriptors, as a subprocess's output would be
    assert code == 0, stderr[-2000:]
    out = json.loads(stdout)  # stdout holds the JSON only
    rows = {r["name"]: r for r in out["modules"]}
    assert "model.layers.[0-1].mlp.up_proj" in rows  # the two blocks collapse
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    rt = MixedPrecisionRuntime(load_recipe(recipe, rehearse=True), rehearse=True)
    rt.prepare_storage(model)
    rt.convert_model(model)
    fp8 = {n for n, _ in fp8_layers(model, fresh=True)}
    for name, mod in model.named_modules():
        params = list(mod.parameters(recurse=False))
        if not params:
            continue
        key = name.replace("model.layers.0.", "model.layers.[0-1].").replace("model.layers.1.", "model.layers.[0-1].")
        row = rows[key]
        assert row["loaded"] == "bf16"
        assert row["kept"] == dtype_name(params[0].dtype), name
        assert row["compute"].startswith("fp8") == (name in fp8), name


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--recipe", "no-such-recipe"], "no-such-recipe"),
        (["--recipe", "a100-bf16", "--model", "/nonexistent"], "--model: '/nonexistent' is not a directory"),
        (["--recipe", "a100-bf16", "--config", "/nonexistent.json"], "--config: '/nonexistent.json' is not a file"),
    ],
)
def test_plan_command_refuses_bad_input_in_one_line(args, message, capsys):
    from hf_mixedprec.cli.app import main

    code = main(["plan", *args])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert message in err and "Traceback" not in err
