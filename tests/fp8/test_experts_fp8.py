"""FP8 MoE experts (:mod:`hf_mixedprec.fp8.experts`): each expert's operands are quantized bit for bit as the dense
emulated path quantizes a Linear holding that expert's weight and fed that expert's rows, in all three GEMMs; the
grouped GEMMs equal a loop of dense FP8 Linears; empty groups and a group of one token train; a tiny Qwen3-MoE runs
its experts through transformers' experts interface in FP8 and back."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from hf_mixedprec.fp8.emulated import EmulatedFP8Linear, EmulationSpec
from hf_mixedprec.fp8.experts import (
    IMPLEMENTATION,
    ExpertsFP8,
    convert_experts,
    converted_experts,
    fp8_grouped_linear,
    is_experts_module,
    quantize_rows,
    quantize_weights,
    restore_experts,
)

SCALINGS = ["current", "blockwise", "mxfp8"]
#: rows per expert: an empty group, a group of one token, sizes that are no multiple of 16, 32 or 128, one over 128
COUNTS = [5, 0, 1, 37, 130, 16]
IN_F, OUT_F = 64, 96


def _groups(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    offsets = torch.cumsum(torch.tensor(COUNTS), 0).to(torch.int32)
    x = torch.randn(sum(COUNTS), IN_F, generator=g) * torch.logspace(-2, 1, IN_F)  # columns of different ranges
    w = torch.randn(len(COUNTS), OUT_F, IN_F, generator=g) * torch.logspace(-3, 0, len(COUNTS))[:, None, None]
    return x, w, offsets


def _slices() -> list[slice]:
    ends = torch.cumsum(torch.tensor(COUNTS), 0).tolist()
    return [slice(e - c, e) for e, c in zip(ends, COUNTS, strict=True)]


def _dense(spec: EmulationSpec, weight: torch.Tensor) -> EmulatedFP8Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    lin.weight = nn.Parameter(weight.clone())
    return EmulatedFP8Linear(lin, spec)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_each_experts_operands_are_what_the_dense_fp8_path_makes_of_its_weight_and_rows(scaling):
    spec = EmulationSpec(scaling=scaling)
    ex = ExpertsFP8.from_spec(spec)
    x, w, offsets = _groups()
    g = torch.randn(x.shape[0], OUT_F) * 1e-3  # an output gradient
    fwd_x = quantize_rows(ex, x, offsets, 0, along_tokens=False, src_dtype=torch.float32)
    wgrad_x = quantize_rows(ex, x, offsets, 0, along_tokens=True, src_dtype=torch.float32)
    dgrad_g = quantize_rows(ex, g, offsets, 2, along_tokens=False, src_dtype=torch.float32)
    wgrad_g = quantize_rows(ex, g, offsets, 2, along_tokens=True, src_dtype=torch.float32)
    fwd_w = quantize_weights(ex, w, for_dgrad=False, src_dtype=torch.float32)
    dgrad_w = quantize_weights(ex, w, for_dgrad=True, src_dtype=torch.float32)
    for e, rows in enumerate(_slices()):
        dense = _dense(spec, w[e])
        assert torch.equal(fwd_w[e], dense.quantize_for(w[e], 1, gemm="fprop").deq), (scaling, e)
        assert torch.equal(dgrad_w[e], dense.quantize_for(w[e], 1, gemm="dgrad").deq), (scaling, e)
        if COUNTS[e] == 0:
            continue  # no rows: nothing to quantize, and the GEMMs below check the group gives zeros
        assert torch.equal(fwd_x[rows], dense.quantize_for(x[rows], 0, gemm="fprop").deq), (scaling, e)
        assert torch.equal(wgrad_x[rows], dense.quantize_for(x[rows], 0, gemm="wgrad").deq), (scaling, e)
        assert torch.equal(dgrad_g[rows], dense.quantize_for(g[rows], 2, gemm="dgrad").deq), (scaling, e)
        assert torch.equal(wgrad_g[rows], dense.quantize_for(g[rows], 2, gemm="wgrad").deq), (scaling, e)
    if scaling != "current":  # the orientations differ: a weight-gradient operand is not the forward one
        assert not torch.equal(fwd_x, wgrad_x)


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("transposed", [False, True])
def test_the_grouped_fp8_gemms_equal_a_loop_of_dense_fp8_linears(scaling, transposed):
    """Forward, input gradient and weight gradient per expert equal the dense emulated FP8 Linear of that expert;
    the empty expert's weight gradient is zero, the 1-token expert's is its outer product."""
    spec = EmulationSpec(scaling=scaling)
    x, w, offsets = _groups(1)
    stored = w.transpose(1, 2).contiguous() if transposed else w.clone()
    xg = x.clone().requires_grad_(True)
    weight = nn.Parameter(stored)
    y = fp8_grouped_linear(xg, weight, offsets, ExpertsFP8.from_spec(spec), transposed=transposed,
                           out_dtype=torch.float32)  # fmt: skip
    gy = torch.randn_like(y)
    y.backward(gy)
    for e, rows in enumerate(_slices()):
        if COUNTS[e] == 0:
            continue  # checked below (a dense Linear is never called on no rows)
        dense = _dense(spec, w[e])
        xe = x[rows].clone().requires_grad_(True)
        ye = dense(xe)
        ye.backward(gy[rows])
        torch.testing.assert_close(y[rows], ye, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(xg.grad[rows], xe.grad, rtol=1e-5, atol=1e-6)
        gw = weight.grad[e].t() if transposed else weight.grad[e]
        torch.testing.assert_close(gw, dense.weight.grad, rtol=1e-5, atol=1e-6)
    empty = COUNTS.index(0)
    assert torch.count_nonzero(weight.grad[empty]) == 0


def _qwen3_moe(seed: int = 0) -> nn.Module:
    cfg = Qwen3MoeConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, moe_intermediate_size=32, intermediate_size=64, num_experts=8,
                         num_experts_per_tok=2, vocab_size=256)  # fmt: skip
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(cfg)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_a_qwen3_moe_runs_its_experts_in_fp8_through_the_experts_interface_and_back(scaling):
    model = _qwen3_moe()
    names = [n for n, m in model.named_modules() if is_experts_module(m)]
    assert names == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    convert_experts(model, names[:1], ExpertsFP8.from_spec(EmulationSpec(scaling=scaling)))
    assert model.config._experts_implementation == IMPLEMENTATION
    calls = []
    from hf_mixedprec.fp8 import experts as mod

    real = mod._FP8GroupedLinear.forward
    mod._FP8GroupedLinear.forward = staticmethod(lambda ctx, *a: calls.append(a[0].shape) or real(ctx, *a))
    try:
        out = model(input_ids=ids, labels=ids)
    finally:
        mod._FP8GroupedLinear.forward = staticmethod(real)
    assert len(calls) == 2  # layer 0's two grouped GEMMs; layer 1 kept its implementation
    assert calls[0] == (2 * 24 * 2, 64)  # every token's k = 2 rows
    assert not torch.equal(out.logits, before)
    rel = ((out.logits - before).norm() / before.norm()).item()
    assert 0 < rel < 0.05, rel  # FP8 rounding of one layer's experts, not a different function
    out.loss.backward()
    exp0 = model.model.layers[0].mlp.experts
    assert exp0.gate_up_proj.grad is not None and torch.isfinite(exp0.gate_up_proj.grad).all()
    assert restore_experts(model) == names[:1]
    assert model.config._experts_implementation == "grouped_mm"
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)


# -- the plan decides it ------------------------------------------------------------------------------------------
def _expert_share(model: nn.Module, converted: set[str]) -> float:
    """The share of non-embedding, non-head parameters held by FP8 layers (Linears by their weight, experts whole)."""
    skip = {"model.embed_tokens.weight", "lm_head.weight"}
    total = sum(p.numel() for n, p in model.named_parameters() if n not in skip)
    fp8 = sum(p.numel() for n, p in model.named_parameters() if n.rsplit(".", 1)[0] in converted and n not in skip)
    return fp8 / total


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("recipe_name", ["h100-fp8-current", "h100-fp8-blockwise", "b200-mxfp8"])
def test_a_trainer_run_converts_the_experts_the_plan_gives_fp8(recipe_name, tmp_path):
    """The precision plan lists each experts module as FP8 with the recipe's scaling, a Trainer run converts exactly
    what the plan says (experts through the experts interface, Linears swapped), the router still computes in FP32,
    and FP8 layers hold >= 90% of the non-embedding, non-head parameters (attention Linears and experts)."""
    from transformers import Trainer

    import hf_mixedprec
    from hf_mixedprec.fp8 import fp8_layers
    from hf_mixedprec.precision.plan import build_plan
    from hf_mixedprec.precision.plan_map import map_rows
    from tests.integrations.test_integration import Bytes

    model = _qwen3_moe()
    recipe = hf_mixedprec.load_recipe(recipe_name, rehearse=True)
    plan = build_plan(recipe, model, fp8_backend="emulated")
    fp8_plan = {d.name for d in plan.fp8_layers if d.fp8}
    experts = {d.name for d in plan.fp8_layers if d.kind == "Experts"}
    assert experts == {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts"} <= fp8_plan
    rows = {r.name: r for r in map_rows(plan)}
    assert rows["model.layers.[0-1].mlp.experts"].compute.startswith("fp8 (emulated, ")
    assert rows["model.layers.[0-1].mlp.experts"].rule == "converted"
    assert rows["model.layers.[0-1].mlp.gate"].compute == "fp32 (outside autocast)"

    seen = {}
    model.model.layers[0].mlp.gate.register_forward_hook(lambda m, i, o: seen.update(router=o[0].dtype))
    args = recipe.training_args(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=2,
                                learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no",
                                disable_tqdm=True)  # fmt: skip
    before = model.model.layers[0].mlp.experts.down_proj.detach().clone()
    tr = Trainer(model=model, args=args, train_dataset=Bytes(n=16, seq_len=32), callbacks=recipe.callbacks())
    tr.train()
    losses = [r["loss"] for r in tr.state.log_history if "loss" in r]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    m = tr.model
    converted = {n for n, _ in fp8_layers(m, fresh=True)} | set(converted_experts(m))
    assert converted == fp8_plan
    assert m.config._experts_implementation == IMPLEMENTATION
    assert seen["router"] == torch.float32
    assert not torch.equal(m.model.layers[0].mlp.experts.down_proj.detach(), before)  # the experts trained
    assert _expert_share(m, converted) >= 0.9


def test_experts_stay_high_precision_where_the_recipe_or_a_rule_says_so_and_the_plan_says_why():
    import hf_mixedprec
    from hf_mixedprec.fp8.policy import plan_conversion
    from hf_mixedprec.integrations.recipe import resolve_recipe

    model = _qwen3_moe()
    delayed = hf_mixedprec.load_recipe("h100-fp8-delayed", rehearse=True)
    by = {d.name: d for d in plan_conversion(model, delayed.fp8, rules=delayed.modules, backend="emulated")}
    d = by["model.layers.0.mlp.experts"]
    assert not d.fp8 and d.reason.startswith("experts: delayed scaling has no per-expert amax history yet")
    off = resolve_recipe({"name": "experts-off", "extends": "h100-fp8-current",
                          "modules": [{"select": "experts", "fp8": "off"}]})  # fmt: skip
    by = {d.name: d for d in plan_conversion(model, off.fp8, rules=off.modules, backend="emulated")}
    assert not by["model.layers.1.mlp.experts"].fp8
    assert by["model.layers.1.mlp.experts"].reason == "rule modules[0] (select experts: fp8 off)"
    assert by["model.layers.1.self_attn.q_proj"].fp8
    current = hf_mixedprec.load_recipe("h100-fp8-current", rehearse=True)
    by = {d.name: d for d in plan_conversion(model, current.fp8, rules=current.modules, backend="torchao")}
    assert by["model.layers.0.mlp.experts"].reason.startswith("experts: backend torchao has no FP8 grouped GEMM here")
