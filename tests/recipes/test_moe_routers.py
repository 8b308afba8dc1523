"""MoE routers never break under FP8: a router whose class is a Linear with its own ``forward`` (Phi-3.5-MoE's
``PhimoeTopKRouter``, Llama-4's ``Llama4Router``) is never swapped for an FP8 Linear, even when a recipe's
``modules:`` leaves out the router rule; and ``select: moe_routers`` finds routers by what they do, JetMoE's
``JetMoeTopKGating`` (no ``experts`` attribute beside it, no "router" in its class name) included."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import (
    JetMoeConfig,
    JetMoeForCausalLM,
    Llama4ForCausalLM,
    Llama4TextConfig,
    PhimoeConfig,
    PhimoeForCausalLM,
)

import hf_mixedprec
from hf_mixedprec.fp8 import convert
from hf_mixedprec.fp8.policy import plan_conversion
from hf_mixedprec.integrations.recipe import resolve_recipe
from hf_mixedprec.recipes.module_rules import assign_rules, experts_count
from hf_mixedprec.recipes.modules_config import DEFAULT_RULES

SMALL = {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 64, "vocab_size": 128}  # fmt: skip


def _phimoe() -> nn.Module:
    torch.manual_seed(0)
    return PhimoeForCausalLM(PhimoeConfig(**SMALL, num_local_experts=16, num_experts_per_tok=2))  # 16: FP8-aligned


def _llama4() -> nn.Module:
    torch.manual_seed(0)
    cfg = Llama4TextConfig(**SMALL, intermediate_size_mlp=64, num_local_experts=16, num_experts_per_tok=1,
                           head_dim=16, interleave_moe_layer_step=1)  # fmt: skip
    return Llama4ForCausalLM(cfg)


def _jetmoe() -> nn.Module:
    torch.manual_seed(0)
    cfg = JetMoeConfig(**{k: v for k, v in SMALL.items() if k != "num_key_value_heads"}, kv_channels=16,
                       num_local_experts=4, num_experts_per_tok=2)  # fmt: skip
    return JetMoeForCausalLM(cfg)


def _routers(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if "Router" in type(m).__name__ or "Gating" in type(m).__name__]


@pytest.mark.parametrize("build", [_phimoe, _llama4], ids=["phimoe", "llama4"])
def test_a_linear_router_with_its_own_forward_is_never_swapped_and_trains(build):
    """``modules: []`` drops the router rule: the router (an nn.Linear subclass whose forward returns its top-k) stays
    as it is, with the reason in the plan, and a training step runs (on main it crashed with "too many values to
    unpack": the FP8 Linear put in its place returned plain logits)."""
    model = build()
    routers = _routers(model)
    assert routers and all(isinstance(model.get_submodule(n), nn.Linear) for n in routers)
    recipe = resolve_recipe({"name": "no-rules", "extends": "h100-fp8-current", "modules": []})
    by_name = {d.name: d for d in plan_conversion(model, recipe.fp8, rules=recipe.modules)}
    for n in routers:
        cls = type(model.get_submodule(n)).__name__
        assert not by_name[n].fp8
        assert by_name[n].reason == f"its class {cls} defines its own forward, which an FP8 Linear would lose"
    report = convert(model, recipe, backend="emulated")
    assert set(report.converted) == {n for n, d in by_name.items() if d.fp8} and report.converted
    for n in routers:
        assert type(model.get_submodule(n)).__name__ in ("PhimoeTopKRouter", "Llama4Router")
    ids = torch.randint(0, 128, (2, 16))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(model.get_submodule(n).weight.grad is not None for n in routers)


def test_jetmoe_routers_are_found_by_what_they_do():
    """JetMoE's routers sit in ``mlp.router`` and ``self_attention.experts.router`` (class ``JetMoeTopKGating``, its
    parent without an ``experts`` attribute, its own Linear inside): ``select: moe_routers`` takes both, so the default
    rules keep their Linears out of FP8 and compute them in FP32."""
    model = _jetmoe()
    want = {"model.layers.0.mlp.router", "model.layers.0.self_attention.experts.router"}
    assert set(_routers(model)) == want
    a = assign_rules(model, DEFAULT_RULES, "fp8")
    router_rule = next(i for i, r in enumerate(a.rules) if r.select == "moe_routers")
    assert set(a.matched[router_rule]) == want
    for n in want:
        assert a.label_of(f"{n}.layer") == a.rules[router_rule].label(router_rule)  # the inner Linear inherits it
        assert a.compute_of(f"{n}.layer", "fp8") == "fp32"
    recipe = hf_mixedprec.load_recipe("h100-fp8-current", rehearse=True)
    by_name = {d.name: d for d in plan_conversion(model, recipe.fp8, rules=recipe.modules)}
    assert not by_name["model.layers.0.mlp.router.layer"].fp8
    assert by_name["model.layers.0.self_attention.kv_proj"].fp8  # an ordinary Linear still goes to FP8


def test_a_router_is_found_by_its_output_not_its_name():
    """A renamed router (no "router"/"gate" in its name or class) whose Linear scores each expert is still a router;
    a Linear beside the experts with another width (a shared expert's 1-wide gate) is not."""

    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.zeros(6, 32, 16))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scorer = nn.Linear(16, 6, bias=False)
            self.shared_expert_gate = nn.Linear(16, 1, bias=False)
            self.experts = Experts()

    class LinearAttention(nn.Module):  # Qwen3.5-MoE's linear attention: a Conv1d (3-D weight) beside its in_proj
        def __init__(self) -> None:
            super().__init__()
            self.in_proj_qkv = nn.Linear(16, 48, bias=False)
            self.conv1d = nn.Conv1d(48, 48, 4, groups=48)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Block()
            self.linear_attn = LinearAttention()

    model = Model()
    assert experts_count(model.block.experts) == 6 and experts_count(model.block.scorer) is None
    assert experts_count(model.linear_attn.conv1d) is None  # a convolution holds no experts
    a = assign_rules(model, DEFAULT_RULES, "fp8")
    router_rule = next(i for i, r in enumerate(a.rules) if r.select == "moe_routers")
    assert a.matched[router_rule] == ("block.scorer",)
