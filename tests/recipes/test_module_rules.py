"""Per-module precision rules (``modules:``): each rule kind changes what runs, under Trainer and the Accelerate
plugin, with the emulated and the torchao FP8 backends; mistakes are one-line errors before anything changes.

What is asserted is what the model holds and computes after the recipe is attached: which Linears are FP8 layers,
the dtype each parameter is kept in and the dtype each module's output has under the run's autocast.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from torch import nn
from transformers import MixtralConfig, MixtralForCausalLM, Trainer

import hf_mixedprec
from hf_mixedprec.core.demo import tiny_llama
from hf_mixedprec.core.errors import ModuleRuleError
from hf_mixedprec.fp8 import fp8_layers
from hf_mixedprec.fp8.policy import plan_conversion
from hf_mixedprec.integrations.recipe import resolve_recipe
from hf_mixedprec.recipes.module_rules import assign_rules, shared_blocks
from hf_mixedprec.recipes.modules_config import ModuleRule
from tests.integrations.test_integration import Bytes


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    """``hf-mixedprec ARGS`` in this process (``main``, what the entry point calls): exit code, stdout, stderr."""
    from hf_mixedprec.cli.app import main

    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


#: One rule of every kind on a 4-block tiny Llama (first match wins, so the order is part of the test).
RULES = [
    {"name": "q0_on", "match": "model.layers.0.self_attn.q_proj", "fp8": "on"},  # fp8 on beats the edges rule
    {"name": "edges", "first_last_blocks": 1, "fp8": "off"},  # blocks 0 and 3
    {"name": "attn1_fp32", "match": "model.layers.1.self_attn", "compute": "fp32"},  # and the Linears inside it
    {"name": "mlp2_bf16", "class": "LlamaMLP", "match": "model.layers.2.*", "compute": "bf16"},  # both must hold
    {"name": "norms", "select": "norms", "storage": "fp32"},
    {"name": "emb", "select": "embeddings", "storage": "fp32"},
    {"name": "head", "select": "lm_head", "compute": "fp8"},
]
EXPECTED_FP8 = {
    "model.layers.0.self_attn.q_proj",
    *(f"model.layers.1.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")),
    *(f"model.layers.2.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
    "lm_head",
}


def _recipe(backend: str, rules=RULES, **extra):
    data = {
        "name": "rules",
        "extends": "h100-fp8-current",
        "fp8": {"backend": backend},
        "storage": {"master": "bf16_stochastic"},  # so that a storage rule has something to differ from
        "modules": rules,
        **extra,
    }
    return resolve_recipe(data).rehearsed()  # torchao runs itself (emulate=True); emulated is ours


def _model():
    return tiny_llama(0, num_hidden_layers=4).to(torch.bfloat16)  # as transformers 5 loads published models


def _fp8_names(model: nn.Module) -> set[str]:
    return {n for n, _ in fp8_layers(model, fresh=True)}


def _record(seen: dict, name: str, pick=lambda inputs, out: out):
    """A forward hook writing ``pick(inputs, output)``'s dtype into ``seen[name]`` once (it returns None, so the
    output is left as it is)."""

    def hook(mod, inputs, out):
        got = pick(inputs, out)
        seen.setdefault(name, (got[0] if isinstance(got, tuple) else got).dtype)

    return hook


def _output_dtypes(model: nn.Module, names: list[str]) -> dict[str, torch.dtype]:
    """Each module's output dtype in one forward under the run's BF16 autocast (what FP8 recipes train in)."""
    seen: dict[str, torch.dtype] = {}
    hooks = []
    for name in names:
        mod = model.get_submodule(name)
        hooks.append(mod.register_forward_hook(_record(seen, name)))
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=x)
    for h in hooks:
        h.remove()
    return seen


def _trainer_run(recipe, model, tmp_path, steps: int = 2):
    args = recipe.training_args(
        output_dir=str(tmp_path / "out"),
        max_steps=steps,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    tr = Trainer(model=model, args=args, train_dataset=Bytes(n=16, seq_len=32), callbacks=recipe.callbacks())
    tr.train()
    losses = [r["loss"] for r in tr.state.log_history if "loss" in r]
    assert len(losses) == steps and all(torch.isfinite(torch.tensor(losses)))
    return tr.model


def _plugin_run(recipe, model, steps: int = 2):
    acc = recipe.accelerator()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    data = Bytes(n=8, seq_len=32)
    for i in range(steps):
        batch = torch.stack([data[2 * i]["input_ids"], data[2 * i + 1]["input_ids"]])
        loss = model(input_ids=batch, labels=batch).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        assert torch.isfinite(loss)
    return acc.unwrap_model(model)


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("backend", ["emulated", "torchao"])
@pytest.mark.parametrize("entry", ["trainer", "plugin"])
def test_every_rule_kind_changes_what_runs(entry, backend, tmp_path):
    recipe = _recipe(backend)
    model = _model()
    model = _trainer_run(recipe, model, tmp_path) if entry == "trainer" else _plugin_run(recipe, model)
    # which Linears are FP8 layers: fp8 on, first/last blocks, a compute fp32 region, a class+glob bf16 rule,
    # compute fp8 on the LM head (out of FP8 by default), and the layers no rule governs
    assert _fp8_names(model) == EXPECTED_FP8
    if backend == "torchao":
        from torchao.float8.float8_linear import Float8Linear

        assert isinstance(model.lm_head, Float8Linear)
    # parameter dtypes: storage fp32 rules and compute fp32 keep FP32 beside the recipe's BF16 master
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    fp32 = {n for n, d in dtypes.items() if d == torch.float32}
    assert fp32 == {
        n
        for n in dtypes
        if n.startswith("model.layers.1.self_attn.") or "norm" in n or n == "model.embed_tokens.weight"
    }
    assert dtypes["model.layers.2.mlp.up_proj.weight"] == torch.bfloat16
    # output dtypes under the run's autocast: the FP32 region computes in FP32, everything else in BF16
    out = _output_dtypes(
        model,
        [
            "model.layers.1.self_attn",
            "model.layers.1.self_attn.q_proj",
            "model.layers.2.mlp",
            "model.layers.2.mlp.down_proj",
            "model.layers.0.self_attn.k_proj",
            "lm_head",
        ],
    )
    assert out["model.layers.1.self_attn"] == torch.float32
    assert out["model.layers.1.self_attn.q_proj"] == torch.float32
    assert out["model.layers.2.mlp"] == torch.bfloat16 and out["model.layers.2.mlp.down_proj"] == torch.bfloat16
    assert out["model.layers.0.self_attn.k_proj"] == torch.bfloat16 and out["lm_head"] == torch.bfloat16


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("entry", ["trainer", "plugin"])
def test_a_bf16_region_inside_an_fp16_run_and_fp16_elsewhere(entry, tmp_path):
    rules = [{"name": "mlp_bf16", "match": "model.layers.0.mlp", "compute": "bf16"}]
    recipe = resolve_recipe({"name": "r", "extends": "v100-fp16", "modules": rules}).rehearsed()
    model = _trainer_run(recipe, tiny_llama(0), tmp_path) if entry == "trainer" else _plugin_run(recipe, tiny_llama(0))
    seen: dict[str, torch.dtype] = {}
    for name in ("model.layers.0.mlp", "model.layers.1.mlp"):
        model.get_submodule(name).register_forward_hook(_record(seen, name))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        model(input_ids=torch.randint(0, 256, (1, 8)))
    assert seen == {"model.layers.0.mlp": torch.bfloat16, "model.layers.1.mlp": torch.float16}


def test_transformer_engine_backend_gets_the_same_rule_decisions_without_te():
    """TE converts only nn.Linear; the rules decide the same layers for it as for the others (no TE needed)."""
    recipe = _recipe("emulated")
    model = _model()
    rules = assign_rules(model, recipe.modules, "fp8")
    te = {d.name for d in plan_conversion(model, recipe.fp8, backend="transformer_engine", rules=rules) if d.fp8}
    ao = {d.name for d in plan_conversion(model, recipe.fp8, backend="torchao", rules=rules) if d.fp8}
    assert te == ao == EXPECTED_FP8


# -- MoE -------------------------------------------------------------------------------------------------------------
def _mixtral():
    cfg = MixtralConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    return MixtralForCausalLM(cfg).to(torch.bfloat16)


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("entry", ["trainer", "plugin"])
@pytest.mark.parametrize("name", ["cpu-bf16", "h100-fp8-current"])
def test_moe_router_computes_in_fp32_under_the_built_in_recipes(name, entry, tmp_path):
    model = _mixtral()
    seen: dict[str, torch.dtype] = {}
    for n, mod in model.named_modules():
        if n.endswith("mlp.gate"):  # MixtralTopKRouter: (logits, scores, indices)
            mod.register_forward_hook(_record(seen, n))
    recipe = hf_mixedprec.load_recipe(name, rehearse=name != "cpu-bf16")
    model = _trainer_run(recipe, model, tmp_path) if entry == "trainer" else _plugin_run(recipe, model)
    # the router computes and returns FP32 logits inside the run's BF16 autocast
    assert seen == {"model.layers.0.mlp.gate": torch.float32, "model.layers.1.mlp.gate": torch.float32}
    assert model.model.layers[0].mlp.gate.weight.dtype == torch.float32
    fp8 = _fp8_names(model)
    if name == "h100-fp8-current":  # attention projections are FP8; the experts are 3-D weights, no Linear
        assert fp8 == {
            f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("q_proj", "k_proj", "v_proj", "o_proj")
        }
    else:
        assert fp8 == set()


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate_state")
def test_without_the_router_rule_the_router_computes_in_bf16(tmp_path):
    """The counterfactual: the FP32 router comes from the rule, not from the model."""
    model = _mixtral()
    seen = {}
    model.model.layers[0].mlp.gate.register_forward_hook(_record(seen, "out"))
    recipe = resolve_recipe({"name": "r", "extends": "cpu-bf16", "modules": []})
    _trainer_run(recipe, model, tmp_path)
    assert seen["out"] == torch.bfloat16


# -- mistakes --------------------------------------------------------------------------------------------------------
def test_a_typo_in_a_glob_names_the_rule_and_the_closest_names():
    rules = (ModuleRule(name="mlp_out", match="model.layer.*.mlp", fp8=False),)
    with pytest.raises(ModuleRuleError) as exc:
        assign_rules(tiny_llama(0), rules, "fp8")
    msg = str(exc.value)
    assert msg.startswith("modules.0.match (mlp_out: match model.layer.*.mlp: fp8 off) matches no module")
    assert "closest names: model.layers.*.mlp" in msg and "\n" not in msg


def test_a_typo_in_a_class_names_the_closest_classes():
    with pytest.raises(ModuleRuleError, match=r"modules\.0\.class .*closest classes: LlamaMLP"):
        assign_rules(tiny_llama(0), (ModuleRule.model_validate({"class": "LlamaMlp", "compute": "fp32"}),), "bf16")


def test_optional_and_shadowed_rules_are_no_typo():
    model = tiny_llama(0)
    rules = (
        ModuleRule(select="moe_routers", compute="fp32", required=False),  # no router in a dense model
        ModuleRule(name="all", match="*", fp8=False),
        ModuleRule(name="later", match="lm_head", compute="fp32"),  # matches, but "all" took it first
    )
    a = assign_rules(model, rules, "fp8")
    assert a.label_of("lm_head") == "all" and a.matched[2] == ()


def test_a_rule_lowering_a_strict_fp32_declaration_is_refused_and_a_loose_one_wins_with_a_note():
    model = tiny_llama(0)
    model._keep_in_fp32_modules_strict = ["mlp.down_proj"]
    with pytest.raises(ModuleRuleError, match=r"^modules\.0\.compute .*model\.layers\.0\.mlp\.down_proj.*strict"):
        assign_rules(model, (ModuleRule(match="*.mlp", compute="bf16"),), "bf16")
    # and FP8 never takes a Linear the model keeps in FP32
    recipe = _recipe("emulated", rules=[])
    dec = {d.name: d for d in plan_conversion(model, recipe.fp8, rules=())}
    assert dec["model.layers.0.mlp.down_proj"].fp8 is False and "FP32" in dec["model.layers.0.mlp.down_proj"].reason
    model = tiny_llama(0)
    model._keep_in_fp32_modules = ["mlp.down_proj"]
    a = assign_rules(model, (ModuleRule(match="*.mlp", compute="bf16"),), "fp16")
    assert any("_keep_in_fp32_modules keeps it in FP32 under fp16" in n for n in a.notes)


def test_a_refused_rule_leaves_the_model_and_trainer_untouched(tmp_path):
    recipe = _recipe("emulated", rules=[{"match": "model.layers.9.mlp", "fp8": "off"}])
    model = _model()
    before = {n: p.dtype for n, p in model.named_parameters()}
    with pytest.raises(ModuleRuleError, match=r"^modules\.0\.match"):
        _trainer_run(recipe, model, tmp_path)
    assert {n: p.dtype for n, p in model.named_parameters()} == before  # storage not applied
    assert not _fp8_names(model)


def test_under_deepspeed_a_compute_rule_is_refused_or_left_out_loudly():
    model = _mixtral()
    a = assign_rules(model, hf_mixedprec.load_recipe("a100-bf16").modules, "bf16", "deepspeed")
    kept = a.rule_of("model.layers.0.mlp.gate")  # the optional router rule keeps only "no FP8"...
    assert kept is not None and kept.compute is None and kept.fp8 is False
    assert any(n.startswith("NOT APPLIED: modules rule moe_router") for n in a.notes)  # ...loudly
    with pytest.raises(ModuleRuleError, match=r"^modules\.0\.compute .*distributed\.strategy deepspeed"):
        assign_rules(model, (ModuleRule(select="moe_routers", compute="fp32"),), "bf16", "deepspeed")


@pytest.mark.parametrize(
    ("rule", "extends", "expected"),
    [
        ({"match": "*.mlp", "compute": "fp64"}, "a100-bf16", "modules.0.compute"),
        ({"match": "*.mlp", "compute": "fp16"}, "a100-bf16", "modules.0.compute: fp16 needs precision fp16"),
        ({"match": "*.mlp", "compute": "fp8"}, "a100-bf16", "modules.0.compute: fp8 needs an fp8 recipe"),
        ({"match": "*.mlp", "storage": "bf16"}, "a100-bf16", "modules.0.storage: bf16 needs storage.master"),
        ({"compute": "fp32"}, "a100-bf16", "modules.0.match: the rule matches nothing"),
        ({"match": "*.mlp"}, "a100-bf16", "modules.0.compute: the rule changes nothing"),
        ({"match": "*.mlp", "fp8": "off", "compute": "fp8"}, "h100-fp8-current", "modules.0.fp8: off contradicts"),
        ({"select": "heads", "fp8": "off"}, "h100-fp8-current", "modules.0.select"),
        ({"match": "*.mlp", "fp8": "off", "colour": 1}, "h100-fp8-current", "modules.0.colour"),
    ],
)
def test_validate_refuses_bad_rules_in_one_line_with_exit_2(tmp_path, capsys, rule, extends, expected):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"name": "r", "extends": extends, "modules": [rule]}))
    code, out, err = _cli(capsys, "validate", str(path))
    assert code == 2, out + err
    assert expected in err and "Traceback" not in err


@pytest.mark.slow
def test_plan_refuses_a_rule_matching_nothing_with_exit_2(tmp_path, capsys):
    path = tmp_path / "r.yaml"
    path.write_text(
        yaml.safe_dump({"name": "r", "extends": "h100-fp8-current", "modules": [{"match": "lm_haed", "fp8": "on"}]})
    )
    code, _, err = _cli(capsys, "plan", "--recipe", str(path))
    assert code == 2 and "Traceback" not in err
    assert "modules.0.match" in err and "closest names: lm_head" in err


def test_old_keep_keys_still_load_as_rules_with_a_note():
    r = resolve_recipe(
        {"name": "old", "precision": "fp8", "fp8": {"keep_lm_head": False, "keep_first_last_blocks": 1}}
    ).rehearsed()
    assert [m.name for m in r.modules[:2]] == ["keep_first_last_blocks", "keep_lm_head"]
    assert any("fp8.keep_lm_head is now a module rule" in n for n in r.legacy_notes)
    model = tiny_llama(0, num_hidden_layers=4)
    dec = {d.name: d.fp8 for d in plan_conversion(model, r.fp8, rules=r.modules)}
    assert dec["lm_head"] is True  # keep_lm_head: false put the LM head into FP8, as before
    assert dec["model.layers.0.mlp.up_proj"] is False and dec["model.layers.1.mlp.up_proj"] is True


# -- health per rule group -------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate_state")
def test_fp8_statistics_are_read_per_rule_group(tmp_path):
    from hf_mixedprec.integrations.trainer import runtime_of
    from hf_mixedprec.training.run_report import health_document, summarize

    rules = [
        {"name": "edges", "first_last_blocks": 1, "fp8": "off"},
        {"name": "attn", "match": "*.self_attn.*", "fp8": "on"},
    ]
    recipe = _recipe("emulated", rules=rules, health={"fp8_sample_every": 1})
    model = _model()
    args = recipe.training_args(
        output_dir=str(tmp_path / "out"),
        max_steps=3,
        per_device_train_batch_size=2,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    tr = Trainer(model=model, args=args, train_dataset=Bytes(n=16, seq_len=32), callbacks=recipe.callbacks())
    tr.train()
    row = next(r for r in reversed(tr.state.log_history) if "mp/fp8_rule/attn/underflow" in r)
    # the group's value is the worst of its layers' (read from the same host values, no extra device work)
    # a module's own match beats the rule it would inherit: the attention Linears of the edge blocks are attn's
    attn = [f"model.layers.{i}.self_attn.{p}" for i in range(4) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    assert row["mp/fp8_rule/attn/underflow"] == max(row[f"mp/fp8/{n}/underflow"] for n in attn)
    assert row["mp/fp8_rule/attn/sqnr_db"] == min(row[f"mp/fp8/{n}/sqnr_db"] for n in attn)
    # the rest: the middle blocks' MLPs and the LM head (these rules replace the defaults that keep it out)
    mlp = [f"model.layers.{i}.mlp.{p}" for i in (1, 2) for p in ("gate_proj", "up_proj", "down_proj")] + ["lm_head"]
    assert row["mp/fp8_rule/no_rule/saturation"] == max(row[f"mp/fp8/{n}/saturation"] for n in mlp)
    assert not any(k.startswith("mp/fp8_rule/edges/") for k in row)  # kept out of FP8: nothing to sample
    doc = health_document(tr.state.log_history, runtime_of(tr))
    groups = {g["rule"]: g for g in doc["rule_groups"]}
    assert (groups["edges"]["layers"], groups["edges"]["fp8_layers"]) == (6, 0)
    assert (groups["attn"]["layers"], groups["attn"]["fp8_layers"]) == (16, 16)
    assert (groups["no_rule"]["layers"], groups["no_rule"]["fp8_layers"]) == (7, 7)
    assert groups["attn"]["worst_sqnr_db"] == min(doc["series"]["mp/fp8_rule/attn/sqnr_db"].values())
    lines = summarize(doc)["lines"]
    assert any(line == "  edges: 6 layers, 0 in FP8" for line in lines), lines
    # the run report's precision map: every module as the run was prepared, with the rule that decided
    rows = {r["name"]: r for r in doc["precision_map"]}
    assert rows["model.layers.[0,3].mlp.up_proj"]["rule"] == "rule edges (first_last_blocks 1: fp8 off)"
    assert rows["model.layers.[0-3].self_attn.q_proj"]["rule"] == "rule attn; converted"
    assert rows["lm_head"]["compute"].startswith("fp8 (emulated, current")
    assert "precision map (as the run was prepared):" in lines


@pytest.mark.parametrize(
    ("modules", "expected"),
    [
        ("lm_head", "modules: 'lm_head' is not a list of rules"),
        ([None], "modules.0: expected a mapping, got None"),
        ([{"match": 5, "fp8": "off"}], "modules.0.match: 5 is not a name or a list of names"),
        ([{"match": f"x{i}", "fp8": "off"} for i in range(300)], "modules: 300 items (allowed: at most 256)"),
    ],
)
def test_hostile_modules_sections_are_one_line_problems(tmp_path, capsys, modules, expected):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"name": "r", "extends": "a100-bf16", "modules": modules}))
    code, _, err = _cli(capsys, "validate", str(path))
    assert code == 2 and "Traceback" not in err
    assert expected in err


@pytest.mark.slow
def test_plan_prints_what_rows_cannot_show_and_the_tied_lm_head(tmp_path, capsys):
    path = tmp_path / "r.yaml"
    rules = [{"name": "norms_fp32", "select": "norms", "compute": "fp32", "required": False}]
    data = {"name": "r", "extends": "a100-bf16", "distributed": {"strategy": "fsdp2"}, "modules": rules}
    path.write_text(yaml.safe_dump(data))
    cfg = "examples/model_configs/tiny-gpt2/config.json"
    code, out, err = _cli(capsys, "plan", "--recipe", str(path), "--config", cfg)
    assert code == 0, err
    assert "notes:\n  NOT APPLIED: modules rule norms_fp32 (select norms: compute fp32) matches 9 module(s)" in out
    # the rule was left out: the norms compute as the recipe says; GPT-2's LM head (tied to wte) still has its row
    assert "| transformer.ln_f | LayerNorm | 128 | bf16 | fp32 | fp32 weight | autocast op policy |" in out
    assert "| lm_head | Linear | 0 | tied | tied | tied | bf16 (autocast) | precision bf16 |" in out


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_deep_copy_runs_its_own_weights_in_its_own_region(tmp_path):
    """TRL's reference model and EMA copies are deep copies of the prepared model: the copy's router still computes
    in FP32, with the copy's own weight (a region that wrapped the original's forward would run the original)."""
    import copy

    model = _trainer_run(hf_mixedprec.load_recipe("cpu-bf16"), _mixtral(), tmp_path)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.model.layers[0].mlp.gate.weight.zero_()  # all logits 0 in the copy only
    seen: dict[str, torch.Tensor] = {}
    for name, m in (("model", model), ("twin", twin)):
        m.model.layers[0].mlp.gate.register_forward_hook(lambda mod, i, o, n=name: (seen.setdefault(n, o[0]), None)[1])
    x = torch.randint(0, 256, (1, 8))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=x)
        twin(input_ids=x)
    assert seen["model"].dtype == seen["twin"].dtype == torch.float32
    assert seen["model"].abs().sum() > 0 and seen["twin"].abs().sum() == 0


@pytest.mark.parametrize(("blocks", "kept"), [(2, 0), (4, 1), (16, 3), (32, 5), (62, 10)])
def test_last_blocks_share_keeps_a_share_of_the_blocks_whatever_the_depth(blocks, kept):
    """``last_blocks_share: 0.16`` (b200-nvfp4's rule): round(0.16 x blocks) half up, never every block; the FP8
    layers the plan leaves are those of the other blocks."""
    rules = [{"name": "tail", "last_blocks_share": 0.16, "fp8": "off", "required": False}]
    model = tiny_llama(0, num_hidden_layers=blocks, hidden_size=32, intermediate_size=64)
    recipe = _recipe("emulated", rules=rules)
    fp8 = {d.name for d in plan_conversion(model, recipe.fp8, rules=recipe.modules) if d.fp8}
    blocks_in_fp8 = {int(n.split(".")[2]) for n in fp8 if n.startswith("model.layers.")}
    assert blocks_in_fp8 == set(range(blocks - kept))


def test_last_blocks_share_rounds_the_share_as_written_not_its_binary_float():
    """0.29 x 50 is 14.5 and rounds half up to 15; the float product is 14.4999... and would give 14."""
    assert 0.29 * 50 < 14.5
    assert shared_blocks(0.29, 50) == 15 and shared_blocks(0.16, 32) == 5 and shared_blocks(0.125, 4) == 1
    assert shared_blocks(0.99, 4) == 3  # never every block


def test_last_blocks_share_mistakes_are_one_line():
    for bad, words in (
        ({"last_blocks_share": 1.0}, "last_blocks_share"),
        ({"last_blocks_share": 0}, "last_blocks_share"),
        ({"last_blocks_share": 0.2, "last_blocks": 2}, "give last_blocks or last_blocks_share, not both"),
    ):
        with pytest.raises(ValueError, match="last_blocks") as err:
            ModuleRule.model_validate({"name": "r", "fp8": "off", **bad})
        assert words in str(err.value)
