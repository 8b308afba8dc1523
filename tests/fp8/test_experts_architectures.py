"""FP8 experts on every MoE architecture of the installed transformers whose experts run through its experts interface
(``@use_experts_implementation``): each is built tiny from its config class (hidden 64, 2 layers, 4 experts of 32,
top-2, dimensions multiples of 32 as MXFP8 blocks need) and planned under every built-in FP8 recipe: the plan lists every experts module as FP8, FP8 layers
hold >= 90% of the non-embedding, non-head parameters and the routers compute in FP32. A Trainer run of 2 steps under
one of them converts exactly what its plan says, and the experts train; ``estimate`` runs its fake step.

An architecture whose tiny config cannot be built, or whose tiny model cannot run a step in high precision (a config
validator this generic shrinking does not satisfy), is skipped with the reason: what is asserted is our conversion, not
transformers' configs.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math

import pytest
import torch
import transformers
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import model_type_to_module_name
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import hf_mixedprec
from hf_mixedprec.fp8 import fp8_layers
from hf_mixedprec.fp8.experts import EXPERTS_SCALINGS, converted_experts, is_experts_module
from hf_mixedprec.precision.plan import build_plan
from hf_mixedprec.recipes.files import builtin_recipe_names, load_recipe_file

SMALL = {
    "hidden_size": 64, "intermediate_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16, "vocab_size": 256, "num_experts": 4,
    "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": 0,
    "n_shared_experts": 1, "max_position_embeddings": 128, "kv_lora_rank": 32, "q_lora_rank": 32,
    "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16, "n_group": 1, "topk_group": 1,
    "decoder_sparse_step": 1, "moe_layer_freq": 1, "mlp_only_layers": [], "num_experts_per_token": 2,
    "num_expert_group": 1, "moe_shared_expert_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "mamba_num_heads": 32, "mamba_head_dim": 4, "ssm_state_size": 16, "n_groups": 1,
}  # fmt: skip
PER_LAYER_LISTS = ("layer_types", "num_attention_heads_per_layer", "sliding_window_pattern")
MAX_PARAMS = 20_000_000


def _uses_experts_interface(model_type: str) -> bool:
    name = model_type_to_module_name(model_type)
    try:
        mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    except Exception:
        return False
    return "@use_experts_implementation" in inspect.getsource(mod)


ARCHS = sorted(mt for mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if _uses_experts_interface(mt))


@functools.cache
def _config(model_type: str) -> transformers.PretrainedConfig:
    cls = transformers.CONFIG_MAPPING[model_type]
    d = cls().to_dict()
    over = {k: v for k, v in SMALL.items() if k in d}
    n = over.get("num_hidden_layers", 2)
    for key in PER_LAYER_LISTS:  # keep the first layer and the first full-attention one
        if isinstance(d.get(key), list) and len(d[key]) > n:
            full = [i for i, t in enumerate(d[key]) if t in ("full_attention", "attention")]
            keep = sorted({0, full[0]}) if full else [0]
            keep = (keep + [i for i in range(len(d[key])) if i not in keep])[:n]
            over[key] = [d[key][i] for i in sorted(keep)]
    if isinstance(d.get("mlp_layer_types"), list):  # every layer an MoE one
        over["mlp_layer_types"] = ["sparse"] * n
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(d.get(key), int) and d[key] >= SMALL["vocab_size"]:
            over[key] = 0
    return cls(**{**d, **over})


def _tiny(model_type: str) -> nn.Module:
    try:
        cfg = _config(model_type)
        with torch.device("meta"):
            size = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    except Exception as exc:
        pytest.skip(f"{model_type}: its tiny config cannot be built here ({type(exc).__name__}: {str(exc)[:120]})")
    if size > MAX_PARAMS:
        pytest.skip(f"{model_type}: the shrunk config still has {size:,} parameters (nested sub-configs)")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    try:
        model(input_ids=ids, labels=ids).loss.backward()  # the tiny model itself, before any conversion
    except Exception as exc:
        pytest.skip(f"{model_type}: its tiny model cannot run a step ({type(exc).__name__}: {str(exc)[:120]})")
    model.zero_grad(set_to_none=True)
    return model


#: The built-in recipes that run experts in FP8: b200-nvfp4 keeps them in BF16 (no NVFP4 grouped GEMM yet; the
#: conversion report says so per module, tests/fp8/test_nvfp4_layer.py)
FP8_RECIPES = [
    n
    for n in builtin_recipe_names()
    if load_recipe_file(n).precision == "fp8" and load_recipe_file(n).fp8.scaling in EXPERTS_SCALINGS
]


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("model_type", ARCHS)
def test_every_experts_interface_architecture_runs_its_experts_in_fp8(model_type, tmp_path):
    """Under every built-in FP8 recipe the plan lists every experts module as FP8 and FP8 layers hold >= 90% of the
    non-embedding, non-head parameters; a Trainer run of 2 steps under one of them converts exactly what its plan
    says, and the experts train (finite losses, moved and finite weights) with the routers in FP32."""
    from transformers import Trainer

    from hf_mixedprec.integrations.trainer import attach
    from tests.integrations.test_integration import Bytes

    model = _tiny(model_type)
    experts = [n for n, m in model.named_modules() if is_experts_module(m)]
    assert experts, f"{model_type}: no experts module found"
    skip = {n for n, m in model.named_modules() if isinstance(m, nn.Embedding)} | plan_heads(model)
    params = {n: p.numel() for n, p in model.named_parameters() if n.rsplit(".", 1)[0] not in skip}
    plans = {}
    for name in FP8_RECIPES:
        plan = build_plan(hf_mixedprec.load_recipe(name, rehearse=True), model, fp8_backend="emulated")
        planned = {d.name for d in plan.fp8_layers if d.fp8}
        assert set(experts) <= planned, (name, [d for d in plan.fp8_layers if d.kind == "Experts" and not d.fp8])
        share = sum(v for n, v in params.items() if n.rsplit(".", 1)[0] in planned) / sum(params.values())
        assert share >= 0.9, f"{model_type} under {name}: {share:.1%} of the non-embedding, non-head params in FP8"
        routers = [a for a, r in plan.assignment.owner.items() if plan.assignment.rules[r].select == "moe_routers"]
        for router in routers:  # the router rule owns them (the default rules keep them in FP32)
            assert plan.assignment.compute_of(router, "fp8") == "fp32", (name, router)
        plans[name] = planned

    recipe = hf_mixedprec.load_recipe("h100-fp8-current", rehearse=True)
    before = {n: model.get_submodule(n).down_proj.detach().clone() for n in experts}
    args = recipe.training_args(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=2,
                                learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no",
                                disable_tqdm=True)  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=Bytes(n=4, seq_len=16))
    attach(trainer, recipe)
    trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses), losses
    m = trainer.model
    held = {n for n, _ in fp8_layers(m, fresh=True)} | set(converted_experts(m))
    assert held == plans["h100-fp8-current"], held ^ plans["h100-fp8-current"]
    for name in experts:
        after = m.get_submodule(name).down_proj.detach()
        assert torch.isfinite(after).all() and not torch.equal(after, before[name]), name

    from hf_mixedprec.commands.estimate import estimate_memory

    est = estimate_memory(_config(model_type), ["h100-fp8-current"], batch_size=2, seq_len=16).recipes[0]
    assert est.memory.activations > 0 and est.memory.total > est.memory.activations  # the fake step ran


def plan_heads(model: nn.Module) -> set[str]:
    from hf_mixedprec.recipes.module_rules import output_projection_names

    return output_projection_names(model)
