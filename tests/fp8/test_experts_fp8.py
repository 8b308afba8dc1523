"""FP8 MoE experts (:mod:`hf_mixedprec.fp8.experts`): each expert's operands are quantized bit for bit as the dense
emulated path quantizes a Linear holding that expert's weight and fed that expert's rows, in all three GEMMs; the
grouped GEMMs equal a loop of dense FP8 Linears; empty groups and a group of one token train; a tiny Qwen3-MoE runs
its experts through transformers' experts interface in FP8 and back."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from hf_mixedprec.fp8.emulated import EmulatedFP8Linear, EmulationSpec
from hf_mixedprec.fp8.experts import (
    IMPLEMENTATION,
    ExpertsDelayedState,
    ExpertsFP8,
    convert_experts,
    converted_experts,
    fp8_grouped_linear,
    is_experts_module,
    quantize_rows,
    quantize_weights,
    restore_experts,
)
from tests.moe import tiny_qwen3_moe
from tests.training.test_no_host_sync_device import traffic  # noqa: F401 (the guard fixture)

SCALINGS = ["delayed", "current", "blockwise", "mxfp8"]
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
    """Delayed scaling: each expert's scales come from its own rows of the state (set here to distinct values), and
    the amaxes it keeps pending are the ones a dense delayed Linear of that expert keeps."""
    spec = EmulationSpec(scaling=scaling)
    ex = ExpertsFP8.from_spec(spec)
    x, w, offsets = _groups()
    g = torch.randn(x.shape[0], OUT_F) * 1e-3  # an output gradient
    state = None
    if scaling == "delayed":
        st = ExpertsDelayedState(len(COUNTS), ex)
        st.fp8_scale.copy_(torch.logspace(-1, 3, st.fp8_scale.numel()).view_as(st.fp8_scale))
        state = (st, 0)
    q = {"state": state, "record": True, "src_dtype": torch.float32}
    fwd_x = quantize_rows(ex, x, offsets, 0, along_tokens=False, **q)
    wgrad_x = quantize_rows(ex, x, offsets, 0, along_tokens=True, **q)
    dgrad_g = quantize_rows(ex, g, offsets, 2, along_tokens=False, **q)
    wgrad_g = quantize_rows(ex, g, offsets, 2, along_tokens=True, **q)
    fwd_w = quantize_weights(ex, w, for_dgrad=False, **q)
    dgrad_w = quantize_weights(ex, w, for_dgrad=True, **q)
    for e, rows in enumerate(_slices()):
        dense = _dense(spec, w[e])
        if state is not None:
            dense.fp8_scale.copy_(state[0].fp8_scale[e])
        assert torch.equal(fwd_w[e], dense.quantize_for(w[e], 1, gemm="fprop").deq), (scaling, e)
        assert torch.equal(dgrad_w[e], dense.quantize_for(w[e], 1, gemm="dgrad").deq), (scaling, e)
        if COUNTS[e] > 0:  # no rows: nothing to quantize (the GEMM test checks the group gives zeros)
            assert torch.equal(fwd_x[rows], dense.quantize_for(x[rows], 0, gemm="fprop").deq), (scaling, e)
            assert torch.equal(wgrad_x[rows], dense.quantize_for(x[rows], 0, gemm="wgrad").deq), (scaling, e)
            assert torch.equal(dgrad_g[rows], dense.quantize_for(g[rows], 2, gemm="dgrad").deq), (scaling, e)
            assert torch.equal(wgrad_g[rows], dense.quantize_for(g[rows], 2, gemm="wgrad").deq), (scaling, e)
        if state is not None:
            assert torch.equal(state[0].fp8_amax_pending[e], dense.fp8_amax_pending), e
    if state is not None:
        assert torch.count_nonzero(state[0].fp8_amax_pending[len(COUNTS) :]) == 0  # projection 1 untouched
    if scaling not in (
        "current",
        "delayed",
    ):  # the orientations differ: a weight-gradient operand is not the forward one
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
    ex = ExpertsFP8.from_spec(spec)
    state = None
    if scaling == "delayed":  # scales as a few steps would have left them: one per expert and operand
        st = ExpertsDelayedState(len(COUNTS), ex)
        st.fp8_scale.copy_(torch.logspace(0, 2, st.fp8_scale.numel()).view_as(st.fp8_scale))
        state = (st, 1)  # the down projection's rows of the state
    y = fp8_grouped_linear(xg, weight, offsets, ex, transposed=transposed, out_dtype=torch.float32, state=state)
    gy = torch.randn_like(y)
    y.backward(gy)
    for e, rows in enumerate(_slices()):
        if COUNTS[e] == 0:
            continue  # checked below (a dense Linear is never called on no rows)
        dense = _dense(spec, w[e])
        if state is not None:
            dense.fp8_scale.copy_(state[0].fp8_scale[len(COUNTS) + e])
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
    return tiny_qwen3_moe(seed)


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
@pytest.mark.parametrize("recipe_name", ["h100-fp8-delayed", "h100-fp8-current", "h100-fp8-blockwise", "b200-mxfp8"])
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
    off = resolve_recipe({"name": "experts-off", "extends": "h100-fp8-current",
                          "modules": [{"select": "experts", "fp8": "off"}]})  # fmt: skip
    by = {d.name: d for d in plan_conversion(model, off.fp8, rules=off.modules, backend="emulated")}
    assert not by["model.layers.1.mlp.experts"].fp8
    assert by["model.layers.1.mlp.experts"].reason == "rule modules[0] (select experts: fp8 off)"
    assert by["model.layers.1.self_attn.q_proj"].fp8
    current = hf_mixedprec.load_recipe("h100-fp8-current", rehearse=True)
    by = {d.name: d for d in plan_conversion(model, current.fp8, rules=current.modules, backend="native")}
    assert by["model.layers.0.mlp.experts"].reason.startswith("experts: backend native has no FP8 grouped GEMM here")


def test_delayed_experts_update_after_the_step_from_their_own_amaxes():
    """``fp8_step`` turns each expert's pending amaxes into its scales (history empty before: scale = fmt.max / amax
    for E4M3 inputs and weights, E5M2 output gradients), then starts the pending amaxes again from zero."""
    from hf_mixedprec.fp8 import fp8_step
    from hf_mixedprec.fp8.experts import experts_states

    model = _qwen3_moe()
    names = [n for n, m in model.named_modules() if is_experts_module(m)]
    convert_experts(model, names, ExpertsFP8.from_spec(EmulationSpec(scaling="delayed")))
    states = experts_states(model)
    assert [n for n, _ in states] == [f"{n}.hf_mixedprec_fp8_state" for n in names]
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    st = states[0][1]
    pending = st.fp8_amax_pending.clone()
    assert (pending[:, 1] > 0).all()  # every expert's weights, both projections
    routed = pending[:8, 0] > 0  # the experts layer 0 routed tokens to
    assert routed.any() and torch.equal(routed, pending[:8, 2] > 0)
    fp8_step(model)
    fmax = torch.tensor([448.0, 448.0, 57344.0])
    hit = pending > 0
    assert torch.equal(st.fp8_scale[hit], (fmax.expand_as(pending) / pending)[hit])
    assert torch.equal(st.fp8_scale[~hit], torch.ones_like(st.fp8_scale[~hit]))  # an expert without tokens keeps 1
    assert torch.equal(st.fp8_amax_history[-1], pending) and torch.count_nonzero(st.fp8_amax_pending) == 0


def test_delayed_experts_state_resumes_bit_for_bit_and_stays_out_of_a_saved_model(tmp_path):
    """The experts' amax histories and scales are FP8 state like the Linears': saved beside a checkpoint
    (:func:`save_fp8_state`), restored on resume (:func:`load_fp8_state`), kept out of ``save_pretrained``. A loop cut
    after step 2 and resumed from the saved weights, optimizer and FP8 state ends bit for bit as the straight 4 steps.
    (Through Trainer, transformers 5.23 writes MoE checkpoints in the split per-expert layout and reloads them with
    ``load_state_dict(strict=False)``, leaving the fused experts as initialised: no MoE run resumes exactly there.)"""
    from safetensors.torch import load_file

    from hf_mixedprec.fp8 import fp8_step
    from hf_mixedprec.fp8.experts import experts_states
    from hf_mixedprec.fp8.state import exclude_fp8_state_from_saves, load_fp8_state, save_fp8_state

    spec = ExpertsFP8.from_spec(EmulationSpec(scaling="delayed", amax_history_len=4))
    batches = [torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(i)) for i in range(4)]

    def fresh():
        model = _qwen3_moe()
        convert_experts(model, [n for n, m in model.named_modules() if is_experts_module(m)], spec)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train(model, opt, steps):
        for ids in steps:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            fp8_step(model)

    straight, opt = fresh()
    train(straight, opt, batches)
    cut, opt = fresh()
    train(cut, opt, batches[:2])
    ckpt = tmp_path / "checkpoint-2"
    ckpt.mkdir()
    torch.save({"model": cut.state_dict(), "opt": opt.state_dict()}, ckpt / "train.pt")
    assert save_fp8_state(cut, ckpt) is not None
    saved = load_file(ckpt / "hf_mixedprec_fp8.safetensors")
    key = "model.layers.0.mlp.experts.hf_mixedprec_fp8_state.fp8_amax_history"
    assert saved[key].shape == (4, 16, 3) and torch.count_nonzero(saved[key]) > 0

    resumed, opt = fresh()
    blob = torch.load(ckpt / "train.pt")
    resumed.load_state_dict(blob["model"])
    opt.load_state_dict(blob["opt"])
    _, st = experts_states(resumed)[0]
    st.fp8_amax_history.zero_()  # what a model rebuilt from a plain checkpoint starts with
    st.fp8_scale.fill_(1.0)
    assert load_fp8_state(resumed, ckpt) is None  # every buffer restored
    train(resumed, opt, batches[2:])
    a, b = straight.state_dict(), resumed.state_dict()
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []

    exclude_fp8_state_from_saves(straight)
    straight.save_pretrained(tmp_path / "saved")
    assert not any("hf_mixedprec" in k for k in load_file(tmp_path / "saved" / "model.safetensors"))


@pytest.mark.parametrize("name", ["h100-fp8-delayed", "h100-fp8-current", "h100-fp8-blockwise", "b200-mxfp8"])
def test_fp8_experts_add_no_host_traffic_on_a_step_that_does_not_log(name, traffic):  # noqa: F811
    """The experts' path (routing, per-group scales, padded tiles, grouped GEMMs, the delayed update) on the meta
    device, under tests/training/test_no_host_sync_device.py's guard and steps: no host read or host-device copy from
    hf_mixedprec on a step that does not log (FP8-sampled steps included)."""
    from hf_mixedprec.fp8.experts import converted_experts
    from tests.training.test_no_host_sync_device import DEVICE, _steps

    def build() -> nn.Module:
        with torch.device(DEVICE):
            return _qwen3_moe().train()

    model = _steps(name, traffic, build=build)
    assert converted_experts(model) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert traffic.hits == [], sorted(set(traffic.hits))


def test_the_chunked_float32_grouped_gemm_equals_grouped_mm():
    """Where grouped_mm takes BF16 only (CUDA, meta), the float32 grouped GEMM runs in 128-row chunks that never
    straddle a group: checked on the CPU against torch's grouped_mm, forward and weight-gradient forms, with an empty
    group, a group of one row and groups over 128 rows."""
    from hf_mixedprec.fp8.experts import grouped_mm_f32

    x, w, offsets = _groups(2)
    b = w.transpose(1, 2).contiguous()  # [E, in, out]
    ref = torch.nn.functional.grouped_mm(x, b, offs=offsets)
    torch.testing.assert_close(grouped_mm_f32(x, b, offsets, chunked=True), ref, rtol=1e-5, atol=1e-5)
    g = torch.randn(x.shape[0], OUT_F)
    ref_w = torch.nn.functional.grouped_mm(g.t(), x, offs=offsets)
    got_w = grouped_mm_f32(g.t(), x, offsets, chunked=True)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-5, atol=1e-4)
    assert torch.count_nonzero(got_w[COUNTS.index(0)]) == 0


def test_the_conversion_report_says_how_much_of_the_gemm_work_runs_in_fp8():
    """Work per token: attention 64x64 + 64x32 + 64x32 + 64x64 = 12,288 multiply-adds per layer, the experts
    2 (top-k) x (64 x 64 + 32 x 64) = 12,288, the head 64 x 256 = 16,384 (kept in BF16): FP8 experts make it
    49,152 / 65,536 = 75%; BF16 experts 24,576 / 65,536 = 37.5%, which the summary says."""
    from hf_mixedprec.fp8 import convert
    from hf_mixedprec.integrations.recipe import resolve_recipe

    on = resolve_recipe({"name": "on", "extends": "h100-fp8-current"})
    report = convert(_qwen3_moe(), on, backend="emulated")
    assert report.fp8_work_share == 0.75 and report.to_dict()["fp8_gemm_work_share"] == 0.75
    assert "in FP8 (75.0% of the GEMM work per token, experts included)" in report.summary()
    off = resolve_recipe({"name": "off", "extends": "h100-fp8-current",
                          "modules": [{"select": "experts", "fp8": "off"}, {"select": "lm_head", "fp8": "off"}]})  # fmt: skip
    report = convert(_qwen3_moe(), off, backend="emulated")
    assert report.fp8_work_share == 0.375
    assert "(37.5% of the GEMM work per token, experts included)" in report.summary()


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_the_accelerate_plugin_and_peft_lora_run_frozen_experts_in_fp8():
    """A loop of one's own on the Accelerate plugin, with PEFT LoRA on the attention: the frozen experts still run in
    FP8 (their grouped GEMMs quantize the input gradient only: no weight gradient), the adapters train."""
    from peft import LoraConfig, get_peft_model

    import hf_mixedprec
    from tests.integrations.test_integration import Bytes

    recipe = hf_mixedprec.load_recipe("h100-fp8-current", rehearse=True)
    model = get_peft_model(_qwen3_moe(), LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    experts = model.base_model.model.model.layers[0].mlp.experts
    before = experts.gate_up_proj.detach().clone()
    acc = recipe.accelerator()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, opt = acc.prepare(model, opt)
    assert converted_experts(acc.unwrap_model(model)) == [
        "base_model.model.model.layers.0.mlp.experts", "base_model.model.model.layers.1.mlp.experts",
    ]  # fmt: skip
    calls = []
    from hf_mixedprec.fp8 import experts as mod

    real = mod._FP8GroupedLinear.backward
    mod._FP8GroupedLinear.backward = staticmethod(
        lambda ctx, gy: calls.append(ctx.needs_input_grad[1]) or real(ctx, gy)
    )
    try:
        data = Bytes(n=8, seq_len=32)
        lora = [p for n, p in model.named_parameters() if "lora_B" in n]
        start = [p.detach().clone() for p in lora]
        for i in range(2):
            batch = torch.stack([data[2 * i]["input_ids"], data[2 * i + 1]["input_ids"]])
            loss = model(input_ids=batch, labels=batch).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            assert torch.isfinite(loss)
    finally:
        mod._FP8GroupedLinear.backward = staticmethod(real)
    assert calls and not any(calls)  # every experts backward ran, none needed a weight gradient
    assert torch.equal(experts.gate_up_proj.detach(), before) and experts.gate_up_proj.grad is None
    assert any(not torch.equal(p.detach(), s) for p, s in zip(lora, start, strict=True))  # the adapters trained


def test_mxfp8_experts_equal_torchaos_moe_training_bit_for_bit(monkeypatch):
    """Our MXFP8 experts (b200-mxfp8's settings), forward and all three gradients, equal torchao's
    ``prototype.moe_training`` MXFP8 grouped GEMMs run through its emulated kernels (what runs on a CPU), driven by
    scripts/bench_moe.py's torchao row: the same quantization, scales and accumulation, bit for bit."""
    import sys

    import torchao.prototype.moe_training as moe_training
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    sys.path.insert(0, "scripts")
    try:
        import bench_moe
    finally:
        sys.path.remove("scripts")
    original = moe_training._to_mxfp8_then_scaled_grouped_mm

    def emulated(a, b_t, offs, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False):
        return original(a, b_t, offs, out_dtype=out_dtype, kernel_preference=KernelPreference.EMULATED,
                        pad_token_groups_for_grouped_mm=pad_token_groups_for_grouped_mm)  # fmt: skip

    monkeypatch.setattr(moe_training, "_to_mxfp8_then_scaled_grouped_mm", emulated)
    cpu = torch.device("cpu")
    shape = {**bench_moe.TINY_MOE, "hidden_size": 96}  # 3 MX blocks per row
    x, idx, w = bench_moe.routed_inputs(shape, 80, cpu)
    ours = bench_moe.experts_module(shape, cpu)
    bench_moe.prepare("fp8-ours-emulated-mxfp8", ours, cpu)
    theirs = bench_moe.experts_module(shape, cpu)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa, idx, w), bench_moe._torchao_experts(rowwise=False)(theirs, xb, idx, w)
    assert torch.equal(ya, yb)
    assert (ya.float() - theirs.__class__.forward.__wrapped__(theirs, x, idx, w).float()).abs().max() > 0  # FP8
    g = torch.randn(ya.shape, generator=torch.Generator().manual_seed(5)).to(ya.dtype)
    ya.backward(g)
    yb.backward(g)
    assert torch.equal(xa.grad, xb.grad)
    for name in ("gate_up_proj", "down_proj"):
        assert torch.equal(getattr(ours, name).grad, getattr(theirs, name).grad), name


@pytest.mark.parametrize("mx", [False, True])
def test_grouped_raw_stats_are_each_groups_raw_operand_stats(mx):
    """Per group of rows, the statistics one call gives for all groups equal raw_operand_stats of that group's rows
    alone (counts and amax exactly, L2 norms to float64 rounding); combined, they equal the whole tensor's. An empty
    group has numel 0."""
    from hf_mixedprec.scaling import dequantize_fp8, dequantize_mxfp8, quantize_fp8, quantize_mxfp8
    from hf_mixedprec.scaling.stats import combine_raw, grouped_raw_stats, raw_operand_stats

    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 64, generator=g) * torch.logspace(-6, 2, 40)[:, None]  # under- and overflowing rows
    x[5, 7] = 0.0
    group = torch.tensor([0] * 9 + [2] * 30 + [3])  # group 1 empty, group 3 one row
    if mx:
        data, codes = quantize_mxfp8(x, fmt="e4m3", block_size=32, rounding="floor")
        x_hat = dequantize_mxfp8(data, codes, block_size=32)
    else:
        scale = torch.tensor(448.0 / 30.0)  # clips every value above 30
        data, codes = quantize_fp8(x, scale, "e4m3"), None
        x_hat = dequantize_fp8(data, scale)
    rows = grouped_raw_stats(x, data, x_hat, "e4m3", group, 4, scale_codes=codes)
    assert rows.shape == (4, 8) and rows[1, 0] == 0 and rows[1, 6] == 0
    for gi in (0, 2, 3):
        sel = group == gi
        one = raw_operand_stats(
            x[sel], data[sel], x_hat[sel], "e4m3", scale_codes=None if codes is None else codes[sel]
        )
        assert torch.equal(rows[gi, :4], one[:4]) and rows[gi, 6] == one[6], gi
        torch.testing.assert_close(rows[gi, 4:6], one[4:6], rtol=1e-12, atol=0)
        if mx:
            torch.testing.assert_close(rows[gi, 7], one[7])
    whole = raw_operand_stats(x, data, x_hat, "e4m3", scale_codes=codes)
    both = combine_raw(rows)
    assert torch.equal(both[:4], whole[:4]) and both[6] == whole[6]
    assert rows[:, 3].sum() > 0 and (mx or rows[:, 2].sum() > 0)  # the data clips (and underflows a per-tensor scale)


@pytest.mark.parametrize("recipe_name", ["h100-fp8-current", "b200-mxfp8"])
def test_experts_report_fp8_statistics_per_projection_on_sampled_steps(recipe_name):
    """On a sampled step each experts module's two projections log their FP8 statistics like Linears
    (``mp/fp8/<module>.gate_up_proj/...``); the input amax is the largest value the experts were given, seen by a
    hook of the test's own and rounded to the autocast's BF16 (TE's GroupedLinear quantizes its input cast to the
    activation dtype), and nothing is recorded on steps that are not sampled."""
    from hf_mixedprec.core import metrics as M
    from hf_mixedprec.fp8.layers import sampled_layers
    from hf_mixedprec.integrations.recipe import resolve_recipe
    from hf_mixedprec.training.runtime import MixedPrecisionRuntime

    model = _qwen3_moe()
    seen = {}
    for i in (0, 1):
        experts = model.model.layers[i].mlp.experts
        experts.register_forward_pre_hook(
            lambda m, a, i=i: seen.__setitem__(i, a[0].detach().bfloat16().abs().max().item())
        )
    recipe = resolve_recipe({"name": "s", "extends": recipe_name, "health": {"fp8_sample_every": 2}})
    rt = MixedPrecisionRuntime(recipe, rehearse=True)
    rt.prepare_storage(model)
    rt.convert_model(model, None)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    stats = dict(sampled_layers(model))
    up, down = (f"model.layers.0.mlp.experts.{p}" for p in ("gate_up_proj", "down_proj"))
    for step in (1, 2):
        rt.begin_step(model, opt)
        with rt.autocast():
            model(input_ids=ids, labels=ids).loss.backward()
        assert stats[up].measured == ((True, True, True) if step == 2 else (False, False, False))
        opt.step()
        opt.zero_grad()
        rt.after_optimizer_step(model, opt)
    rt.check(model, opt)
    got = rt.metrics()
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float32  # FP32 inputs, BF16 autocast
    assert got[M.fp8_layer_key(up, "input_amax")] == seen[0]
    for name in (up, down, "model.layers.1.mlp.experts.down_proj"):
        assert 15 < got[M.fp8_layer_key(name, "sqnr_db")] < 40, name  # E4M3's 3 mantissa bits: about 25-31 dB
        # current scaling maps the amax to E4M3's top value: only the few values within its top step saturate
        assert got[M.fp8_layer_key(name, "saturation")] < 4e-3, name
    per_expert = stats[down].per_expert[1]
    assert per_expert.shape == (8, 8) and torch.all(per_expert[:, 0] == 64 * 32)  # one weight per expert


def test_a_saturating_expert_fires_fp8_saturation_and_its_fallback_moves_that_experts_module_only():
    """Delayed scaling, one expert's down_proj weight made 1000x larger after its history was filled: the next
    sampled step saturates that projection's weight, fp8_saturation names ``<module>.down_proj``, and the recipe's
    fallback moves that experts module (not the other layer's) back to high precision; the run trains on."""
    from hf_mixedprec.fp8.experts import converted_experts
    from hf_mixedprec.integrations.recipe import resolve_recipe
    from hf_mixedprec.training.runtime import MixedPrecisionRuntime

    model = _qwen3_moe()
    recipe = resolve_recipe({"name": "d", "extends": "h100-fp8-delayed", "health": {
        "fp8_sample_every": 1, "detectors": {"fp8_saturation": {"threshold": 0.01, "reaction": "fallback"}}}})  # fmt: skip
    rt = MixedPrecisionRuntime(recipe, rehearse=True)
    rt.prepare_storage(model)
    rt.convert_model(model, None)
    opt = torch.optim.SGD(model.parameters(), 0.0)  # the weights stay as set
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    events = []
    for step in range(1, 5):
        if step == 3:
            with torch.no_grad():
                model.model.layers[0].mlp.experts.down_proj[5].mul_(1000.0)
        rt.begin_step(model, opt)
        with rt.autocast():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        assert torch.isfinite(loss)
        opt.step()
        opt.zero_grad()
        rt.after_optimizer_step(model, opt)
        events += rt.check(model, opt)
    fired = {e.layer: e for e in events if e.detector == "fp8_saturation"}
    down = "model.layers.0.mlp.experts.down_proj"  # and its gate/up projection, whose gradient the outlier scales
    assert down in fired and set(fired) <= {down, "model.layers.0.mlp.experts.gate_up_proj"}
    assert fired[down].step == 3 and "weight saturation" in fired[down].message
    assert converted_experts(model) == ["model.layers.1.mlp.experts"]
    assert sorted(rt.reactions.moved_layers) == sorted(fired)


# -- torchao's recipes for experts (fp8.backend: torchao) -------------------------------------------------------------
def _torchao_experts(name: str) -> ExpertsFP8:
    from hf_mixedprec.integrations.recipe import resolve_recipe

    rowwise = name != "tensorwise"
    recipe = resolve_recipe({"name": f"torchao-{name}", "extends": "h100-fp8-current",
                             "fp8": {"backend": "torchao", "torchao_recipe": name, "format": "E4M3" if rowwise else "HYBRID",
                                     "power_2_scales": rowwise}})  # fmt: skip
    return ExpertsFP8.for_torchao(recipe.fp8)


def _torchao_rowwise_reference(x, w, offsets, g, *, gw_hp: bool):
    """torchao's rowwise FP8 grouped GEMM (``torchao/prototype/moe_training/fp8_grouped_mm.py``) with its CPU torch
    functions in place of its Triton kernels: each operand cast by torchao, dequantized, then the float32 grouped GEMM
    our emulation runs (so only the casts can differ). ``x`` ``[S, K]`` sorted rows, ``w`` ``[E, N, K]``."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated
    from torchao.prototype.moe_training.utils import (
        torch_to_3d_rowwise_float8_transpose_rhs,
        torch_to_float8_per_group_colwise,
        torch_to_float8_per_group_rowwise,
    )

    e4m3, axis = torch.float8_e4m3fn, ScalingGranularity.AXISWISE

    def cast(t, dim):  # torchao's fused rowwise casts, as its tensor_to_scale + to_fp8_saturated
        s = tensor_to_scale(t, e4m3, scaling_granularity=axis, axiswise_dim=dim, round_scales_to_power_of_2=True)
        return to_fp8_saturated(t.float() * s, e4m3), s

    # torchao's per-group CPU functions take no empty group (amax over no rows): it has no rows to cast anyway
    filled = offsets[torch.diff(offsets, prepend=offsets.new_zeros(1)) > 0]

    def per_group(data, scales, along_rows):  # the per-group casts' flat scales back onto their rows / columns
        out, start, k = torch.empty(data.shape), 0, 0
        n = data.shape[0] if along_rows else data.shape[1]
        for end in filled.tolist():
            s = scales[k : k + n]
            if along_rows:  # data [N, S]: columns start:end of group, a scale per row
                out[:, start:end] = data[:, start:end].float() / s[:, None]
            else:  # data [S, K]: rows start:end, a scale per column
                out[start:end] = data[start:end].float() / s[None, :]
            start, k = end, k + n
        return out

    def gmm(a, b):
        return torch.nn.functional.grouped_mm(a, b, offs=offsets)

    b_t = w.transpose(-2, -1)  # [E, K, N], per-group column-major as torchao takes it
    a_q, a_s = cast(x, -1)
    b_q, b_s = cast(b_t, -2)
    y = gmm(a_q.float() / a_s, b_q.float() / b_s)
    g_q, g_s = cast(g, -1)
    bt_q, bt_s = torch_to_3d_rowwise_float8_transpose_rhs(b_t, e4m3, round_scales_to_power_of_2=True)  # [E, N, K]
    gx = gmm(g_q.float() / g_s, bt_q.float() / bt_s)
    if gw_hp:
        gw = gmm(g.float().t(), x.float())
    else:
        gt_q, gt_s = torch_to_float8_per_group_rowwise(
            g.t().contiguous(), filled, e4m3, round_scales_to_power_of_2=True
        )
        xc_q, xc_s = torch_to_float8_per_group_colwise(x, filled, e4m3, round_scales_to_power_of_2=True)
        gt = per_group(gt_q, gt_s, True).t().contiguous().t()  # [N, S] column-major, as grouped_mm's rows need
        gw = gmm(gt, per_group(xc_q, xc_s, False))  # [E, N, K]
    casts = {"x": (a_q, a_s), "w": (b_q.transpose(-2, -1), b_s.transpose(-2, -1)), "g": (g_q, g_s),
             "w_dgrad": (bt_q, bt_s)}  # fmt: skip
    return y, gx, gw, casts


@pytest.mark.parametrize("name", ["rowwise", "rowwise_with_gw_hp"])
def test_rowwise_experts_equal_torchaos_moe_training_casts_bit_for_bit(name):
    """Under torchao's rowwise recipes the experts' operands are cast as torchao's ``prototype.moe_training`` casts
    them (its CPU torch functions: rows along the contraction dim, per-group columns for the weight gradient, E4M3,
    power-of-2 scales), empty groups and a group of one token included; forward and both gradients then equal
    torchao's casts run through the same float32 grouped GEMM, bit for bit."""
    from hf_mixedprec.core.formats import get_format
    from hf_mixedprec.fp8.experts import _rowwise_rows

    spec = _torchao_experts(name)
    assert spec.granularity == "row" and spec.wgrad_high_precision == (name == "rowwise_with_gw_hp")
    x, w, offsets = _groups()
    x = x.to(torch.bfloat16)
    w = w.to(torch.bfloat16)
    x[3, 5] = 1e-30  # below every scale's reach: underflows to 0
    g = (torch.randn(x.shape[0], OUT_F, generator=torch.Generator().manual_seed(1)) * 1e-3).to(torch.bfloat16)
    y_ref, gx_ref, gw_ref, casts = _torchao_rowwise_reference(x, w, offsets, g, gw_hp=name == "rowwise_with_gw_hp")

    keep: list = []
    quantize_weights(spec, w.float(), for_dgrad=False, src_dtype=w.dtype, keep=keep)
    assert torch.equal(keep[0].view(w.shape).view(torch.uint8), casts["w"][0].view(torch.uint8))
    keep = []
    _rowwise_rows(spec, x.float(), offsets, get_format("e4m3"), along_tokens=False, keep=keep)
    assert torch.equal(keep[0].view(torch.uint8), casts["x"][0].view(torch.uint8))
    deq = quantize_weights(spec, w.float(), for_dgrad=True, src_dtype=w.dtype)
    assert torch.equal(deq, casts["w_dgrad"][0].float() / casts["w_dgrad"][1])

    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_grouped_linear(xa, wa, offsets, spec, transposed=False, out_dtype=torch.float32)
    y.backward(g.float())
    assert torch.equal(y, y_ref)
    assert torch.equal(xa.grad, gx_ref.to(torch.bfloat16))
    assert torch.equal(wa.grad, gw_ref.to(torch.bfloat16))
    assert torch.equal(wa.grad[1], torch.zeros_like(wa.grad[1]))  # the empty expert gets no weight gradient
    assert (y - x.float() @ w[0].float().t()).abs()[:5].max() > 0  # FP8, not the BF16 GEMM


@pytest.mark.parametrize("name", ["tensorwise", "rowwise"])
def test_a_torchao_recipe_runs_the_experts_in_fp8_on_a_cpu_and_the_report_says_how(name):
    """``fp8.backend: torchao`` converts the Linears with torchao and the experts with its recipe's numerics (where
    torchao emulates: here, a CPU); a CUDA FP8 device keeps them in BF16 with the reason in the plan."""
    import hf_mixedprec
    from hf_mixedprec.fp8 import policy
    from hf_mixedprec.fp8.experts import _ATTR
    from hf_mixedprec.integrations.recipe import resolve_recipe

    base = _torchao_experts(name)
    model = _qwen3_moe()
    fp8 = {"backend": "torchao", "torchao_recipe": name}
    if name == "rowwise":
        fp8 |= {"format": "E4M3", "power_2_scales": True}
    recipe = resolve_recipe({"name": "t", "extends": "h100-fp8-current", "fp8": fp8})
    report = hf_mixedprec.fp8.convert(model, recipe)
    assert report.backend == "torchao"
    assert converted_experts(model) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    spec = getattr(model.model.layers[0].mlp.experts, _ATTR)
    assert spec == dataclasses.replace(base, previous=spec.previous)
    assert any(f"run torchao's {name} FP8 numerics per expert" in n for n in report.notes)
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "Float8Linear"
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and model.model.layers[0].mlp.experts.gate_up_proj.grad.abs().sum() > 0

    fresh = _qwen3_moe()
    orig = policy.has_fp8_tensor_cores
    try:  # as on an FP8 GPU, where torchao runs its own FP8 GEMMs
        policy.has_fp8_tensor_cores = lambda device: True
        by = {d.name: d for d in policy.plan_conversion(fresh, recipe.fp8, rules=recipe.modules, backend="torchao")}
    finally:
        policy.has_fp8_tensor_cores = orig
    assert not by["model.layers.0.mlp.experts"].fp8
    assert by["model.layers.0.mlp.experts"].reason.startswith("experts: backend torchao's FP8 grouped GEMMs are not")


def test_rowwise_experts_add_no_host_traffic(traffic):  # noqa: F811
    """The rowwise casts (per-row and per-group-column amaxes, scales, both GEMMs' operands) on the meta device
    under the host-traffic guard: no host read or host-device copy."""
    from tests.training.test_no_host_sync_device import DEVICE

    spec = _torchao_experts("rowwise")
    x = torch.randn(40, IN_F, device=DEVICE, requires_grad=True)
    w = torch.randn(4, OUT_F, IN_F, device=DEVICE, requires_grad=True)
    offsets = torch.cumsum(torch.ones(4, dtype=torch.int32, device=DEVICE) * 10, 0, dtype=torch.int32)
    with traffic:
        traffic.on = True
        y = fp8_grouped_linear(x, w, offsets, spec, transposed=False, out_dtype=torch.float32)
        y.sum().backward()
        traffic.on = False
    assert traffic.hits == [], sorted(set(traffic.hits))
    assert x.grad is not None and w.grad is not None and w.grad.shape == w.shape
