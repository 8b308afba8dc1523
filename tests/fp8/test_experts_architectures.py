"""FP8 experts on every MoE architecture of the installed transformers whose experts run through its experts interface
(``@use_experts_implementation``): each is built tiny from its config class (hidden 64, 2 layers, 4 experts of 32,
top-2, FP8-aligned), planned and converted under an FP8 recipe, and trained a step. The plan lists every experts module
as FP8, the conversion runs exactly those, FP8 layers hold >= 90% of the non-embedding, non-head parameters (where the
model holds GEMMs only), the routers compute in FP32, and the step's loss and gradients are finite.

An architecture whose tiny config cannot be built, or whose tiny model cannot run a step in high precision (a config
validator this generic shrinking does not satisfy), is skipped with the reason: what is asserted is our conversion, not
transformers' configs.
"""

from __future__ import annotations

import functools
import importlib
import inspect

import pytest
import torch
import transformers
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import model_type_to_module_name
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import hf_mixedprec
from hf_mixedprec.fp8 import convert, fp8_layers
from hf_mixedprec.fp8.experts import converted_experts, is_experts_module
from hf_mixedprec.precision.plan import build_plan

SMALL = {
    "hidden_size": 64, "intermediate_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16, "vocab_size": 256, "num_experts": 4,
    "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": 0,
    "n_shared_experts": 1, "max_position_embeddings": 128, "kv_lora_rank": 16, "q_lora_rank": 16,
    "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16, "n_group": 1, "topk_group": 1,
    "decoder_sparse_step": 1, "moe_layer_freq": 1, "mlp_only_layers": [], "num_experts_per_token": 2,
    "num_expert_group": 1, "moe_shared_expert_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "mamba_num_heads": 16, "mamba_head_dim": 4, "ssm_state_size": 16, "n_groups": 1,
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


@pytest.mark.parametrize("model_type", ARCHS)
def test_every_experts_interface_architecture_runs_its_experts_in_fp8(model_type):
    model = _tiny(model_type)
    experts = [n for n, m in model.named_modules() if is_experts_module(m)]
    assert experts, f"{model_type}: no experts module found"
    recipe = hf_mixedprec.load_recipe("h100-fp8-current", rehearse=True)
    plan = build_plan(recipe, model, fp8_backend="emulated")
    planned = {d.name for d in plan.fp8_layers if d.fp8}
    assert set(experts) <= planned, [d for d in plan.fp8_layers if d.kind == "Experts" and not d.fp8]
    routers = [a for a, r in zip(plan.assignment.owner, plan.assignment.owner.values(), strict=True)
               if plan.assignment.rules[r].select == "moe_routers"]  # fmt: skip
    report = convert(model, recipe, backend="emulated")
    held = {n for n, _ in fp8_layers(model, fresh=True)} | set(converted_experts(model))
    assert held == planned and set(report.converted) == planned
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    for name in experts:
        grads = [p.grad for p in model.get_submodule(name).parameters(recurse=False) if p.requires_grad]
        assert grads and all(g is not None and torch.isfinite(g).all() for g in grads), name
    for name in routers:  # the router rule owns them (the default rules keep them in FP32)
        assert plan.assignment.compute_of(name, "fp8") == "fp32", name
    skip = {n for n, m in model.named_modules() if isinstance(m, nn.Embedding)} | plan_heads(model)
    params = {n: p.numel() for n, p in model.named_parameters() if n.rsplit(".", 1)[0] not in skip}
    share = sum(v for n, v in params.items() if n.rsplit(".", 1)[0] in planned) / sum(params.values())
    assert share >= 0.9, f"{model_type}: {share:.1%} of the non-embedding, non-head parameters in FP8"


def plan_heads(model: nn.Module) -> set[str]:
    from hf_mixedprec.recipes.module_rules import output_projection_names

    return output_projection_names(model)
