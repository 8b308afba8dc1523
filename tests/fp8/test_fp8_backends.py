"""FP8 backends on CPU: exact emulation numerics, conversion policy, training a tiny Llama, torchao."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from hf_mixedprec.core.demo import builtin_text, byte_batches, tiny_llama
from hf_mixedprec.fp8 import EmulatedFP8Linear, FP8BackendUnavailable, convert, fp8_step, resolve_backend
from hf_mixedprec.fp8.emulated import EmulationSpec
from hf_mixedprec.fp8.native import native_available, native_layer
from hf_mixedprec.integrations.recipe import load_recipe_file, resolve_recipe
from hf_mixedprec.scaling import (
    current_scale,
    dequantize_blockwise,
    dequantize_fp8,
    dequantize_mxfp8,
    quantize_blockwise,
    quantize_fp8,
    quantize_mxfp8,
    tensor_amax,
)
from tests.ranks import free_port, leave_group


def fp8_recipe(scaling: str, **kw):
    fp8 = {"scaling": scaling, "backend": kw.pop("backend", "emulated"), **kw}
    return resolve_recipe({"name": "t", "precision": "fp8", "fp8": fp8})


def qdq_tensor(t: torch.Tensor, fmt: str) -> torch.Tensor:
    s = current_scale(tensor_amax(t), fmt=fmt)
    return dequantize_fp8(quantize_fp8(t, s, fmt), s)


def qdq_mx(t: torch.Tensor, dim: int, fmt: str = "e4m3") -> torch.Tensor:
    d, c = quantize_mxfp8(t, fmt=fmt, block_size=32, rounding="rceil", dim=dim)
    return dequantize_mxfp8(d, c, block_size=32, dim=dim)


def te_bias(b: torch.Tensor) -> torch.Tensor:
    """The bias an FP8 GEMM adds with FP32 activations: rounded to BF16 (TE's module/linear.py: cuBLAS takes no FP32
    bias with FP8 operands)."""
    return b.detach().bfloat16().float()


def _linear_case(in_f=64, out_f=96, tokens=32, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(in_f, out_f)
    # magnitudes spread over features (x) and tokens (dy), so that block scales differ between
    # rowwise and columnwise blocks, as they do in real activations and gradients
    x = torch.randn(2, tokens // 2, in_f) * torch.logspace(-2, 2, in_f)
    gy = torch.randn(2, tokens // 2, out_f) * torch.logspace(-3, 1, tokens).reshape(2, tokens // 2, 1)
    return lin, x, gy


# -- exact numerics of one layer -------------------------------------------------------------------


def test_current_scaling_linear_is_exactly_qdq_gemms():
    lin, x, gy = _linear_case()
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    mod = EmulatedFP8Linear(lin, EmulationSpec(scaling="current", bwd_format="e5m2"))
    xr = x.clone().requires_grad_(True)
    y = mod(xr)
    y.backward(gy)
    x2, g2 = x.reshape(-1, 64), gy.reshape(-1, 96)
    xq, wq, gq = qdq_tensor(x2, "e4m3"), qdq_tensor(w, "e4m3"), qdq_tensor(g2, "e5m2")
    assert torch.equal(y.reshape(-1, 96), xq @ wq.t() + te_bias(b))
    assert torch.equal(xr.grad.reshape(-1, 64), gq @ wq)
    assert torch.equal(lin.weight.grad, gq.t() @ xq)
    assert torch.equal(lin.bias.grad, g2.sum(0))


def test_mxfp8_linear_uses_blocks_along_each_gemms_contraction_dim():
    lin, x, gy = _linear_case()
    w = lin.weight.detach().clone()
    mod = EmulatedFP8Linear(lin, EmulationSpec(scaling="mxfp8", bwd_format="e4m3", block_size=32))
    xr = x.clone().requires_grad_(True)
    y = mod(xr)
    y.backward(gy)
    x2, g2 = x.reshape(-1, 64), gy.reshape(-1, 96)
    # fprop: contraction over in_features (last dim of x and W)
    assert torch.equal(y.reshape(-1, 96), qdq_mx(x2, -1) @ qdq_mx(w, -1).t() + te_bias(lin.bias))
    # dgrad: contraction over out_features: dy rowwise, W columnwise (re-quantized from high precision)
    assert torch.equal(xr.grad.reshape(-1, 64), qdq_mx(g2, -1) @ qdq_mx(w, 0))
    # wgrad: contraction over tokens: dy and x columnwise
    assert torch.equal(lin.weight.grad, qdq_mx(g2, 0).t() @ qdq_mx(x2, 0))
    # and that differs from reusing the rowwise copies (the point of columnwise blocks)
    assert not torch.equal(lin.weight.grad, qdq_mx(g2, -1).t() @ qdq_mx(x2, -1))


def test_blockwise_linear_tiles():
    lin, x, gy = _linear_case(in_f=256, out_f=128, tokens=256)
    w = lin.weight.detach().clone()
    mod = EmulatedFP8Linear(lin, EmulationSpec(scaling="blockwise", fwd_format="e4m3", bwd_format="e4m3"))
    xr = x.clone().requires_grad_(True)
    y = mod(xr)
    y.backward(gy)

    def q1x128(t):
        d, s = quantize_blockwise(t, tile=(1, 128), fmt="e4m3", power_2=False)
        return dequantize_blockwise(d, s, tile=(1, 128))

    def q128(t):
        d, s = quantize_blockwise(t, tile=(128, 128), fmt="e4m3", power_2=False)
        return dequantize_blockwise(d, s, tile=(128, 128))

    x2, g2 = x.reshape(-1, 256), gy.reshape(-1, 128)
    assert torch.equal(y.reshape(-1, 128), q1x128(x2) @ q128(w).t() + te_bias(lin.bias))
    assert torch.equal(xr.grad.reshape(-1, 256), q1x128(g2) @ q128(w))
    assert torch.equal(lin.weight.grad, q1x128(g2.t()) @ q1x128(x2.t()).t())


def test_delayed_scaling_uses_previous_steps_amax_and_is_in_state_dict():
    lin, x, gy = _linear_case()
    mod = EmulatedFP8Linear(lin, EmulationSpec(scaling="delayed", amax_history_len=4))
    assert torch.equal(mod.fp8_scale, torch.ones(3))  # TE starts from scale 1
    mod(x).backward(gy)
    assert torch.equal(mod.fp8_scale, torch.ones(3)), "scales change only at fp8_step"
    fp8_step(mod)
    amaxes = torch.stack([tensor_amax(x), tensor_amax(lin.weight.detach()), tensor_amax(gy)])
    assert torch.equal(mod.fp8_amax_history[-1], amaxes)
    assert torch.equal(mod.fp8_amax_history[:-1], torch.zeros(3, 3))
    expected = torch.tensor([448.0, 448.0, 57344.0]) / amaxes
    assert torch.equal(mod.fp8_scale, expected)
    assert torch.equal(mod.fp8_amax_pending, torch.zeros(3))
    sd = mod.state_dict()
    assert {"fp8_amax_history", "fp8_scale"} <= set(sd) and "fp8_amax_pending" not in sd
    # the next forward quantizes with the scale derived from step 1
    x_next = x * 0.5
    y = mod(x_next)
    s0 = mod.fp8_scale[0]
    xq = dequantize_fp8(quantize_fp8(x_next.reshape(-1, 64), s0, "e4m3"), s0)
    s1 = mod.fp8_scale[1]
    wq = dequantize_fp8(quantize_fp8(lin.weight.detach(), s1, "e4m3"), s1)
    assert torch.equal(y.reshape(-1, 96).detach(), xq @ wq.t() + te_bias(lin.bias))


@pytest.mark.parametrize("native", [False, True])
def test_under_autocast_fp32_operands_quantize_as_they_are_and_gradients_round_to_bf16(native):
    """FP32 weights and input under BF16 autocast, as TE's Linear computes them (module/linear.py): the FP8 input and
    weight quantizers take the FP32 tensors as they are; the bias is added in BF16; the output, and the dgrad, wgrad
    and bias-gradient GEMMs, are written in the activation dtype (BF16) and only then cast to the FP32 tensors
    they belong to. The emulated and native layers alike."""
    ok, why = native_available(torch.device("cpu"))
    if native and not ok:
        pytest.skip(why)
    lin, x, gy = _linear_case()
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    spec = EmulationSpec(scaling="current", bwd_format="e5m2")
    mod = native_layer("Linear", lin, spec) if native else EmulatedFP8Linear(lin, spec)
    xr = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mod(xr)
    assert y.dtype == torch.bfloat16
    y.backward(gy.bfloat16())
    x2, g2 = x.reshape(-1, 64), gy.bfloat16().float().reshape(-1, 96)
    xq, wq, gq = qdq_tensor(x2, "e4m3"), qdq_tensor(w, "e4m3"), qdq_tensor(g2, "e5m2")
    bf16 = lambda t: t.bfloat16().float()  # noqa: E731
    assert torch.equal(y.reshape(-1, 96), (xq @ wq.t() + bf16(b)).bfloat16())
    assert xr.grad.dtype == lin.weight.grad.dtype == lin.bias.grad.dtype == torch.float32
    assert torch.equal(xr.grad.reshape(-1, 64), bf16(gq @ wq))
    assert torch.equal(lin.weight.grad, bf16(gq.t() @ xq))
    assert not torch.equal(lin.weight.grad, gq.t() @ xq)  # the FP32 wgrad is not what TE returns
    assert torch.equal(lin.bias.grad, bf16(g2.sum(0)))


# -- conversion policy -----------------------------------------------------------------------------


def test_report_keeps_lm_head_and_embeddings_and_serialises():
    model = tiny_llama()
    rep = convert(model, load_recipe_file("h100-fp8-delayed"), backend="emulated")
    assert rep.decision("lm_head").fp8 is False and "rule lm_head" in rep.decision("lm_head").reason
    assert rep.decision("model.embed_tokens").fp8 is False and rep.decision("model.embed_tokens").kind == "Embedding"
    assert len(rep.converted) == 14 and set(rep.kept) == {"lm_head", "model.embed_tokens"}
    assert isinstance(model.model.layers[0].mlp.up_proj, EmulatedFP8Linear)
    data = rep.to_dict()
    assert data["backend"] == "emulated" and data["converted"] == 14 and len(data["layers"]) == 16
    assert "lm_head" in str(rep) and "14 layers in FP8" in str(rep)


def test_policy_rules_never_stop_at_the_first_unconvertible_layer():
    # intermediate 100 is not divisible by 16: every MLP layer is kept, attention still converts
    model = tiny_llama(num_hidden_layers=4, intermediate_size=100)
    r = fp8_recipe("current", keep_first_last_blocks=1, keep_in_bf16=["*.v_proj"])
    rep = convert(model, r)
    dec = {d.name: d for d in rep.layers}
    blocks = "rule keep_first_last_blocks (first_last_blocks 1: fp8 off)"  # the old keys, read as module rules
    assert dec["model.layers.0.self_attn.q_proj"].reason == blocks
    assert dec["model.layers.3.mlp.up_proj"].reason == blocks
    assert dec["model.layers.1.self_attn.v_proj"].reason == "rule keep_in_bf16 (match *.v_proj: fp8 off)"
    assert dec["model.layers.1.mlp.up_proj"].reason == "in/out features 64x100 not divisible by align=16"
    assert dec["model.layers.2.mlp.down_proj"].reason == "in/out features 100x64 not divisible by align=16"
    assert dec["model.layers.2.self_attn.o_proj"].fp8 is True  # after an unconvertible layer
    assert sorted(rep.converted) == sorted(
        f"model.layers.{i}.self_attn.{p}" for i in (1, 2) for p in ("q_proj", "k_proj", "o_proj")
    )


def test_moe_router_pattern_in_shipped_recipes():
    from hf_mixedprec.fp8.policy import plan_conversion

    class Moe(nn.Module):  # a Linear router named gate beside the experts (Mixtral before transformers 5)
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(64, 32)
            self.gate_proj = nn.Linear(64, 64)
            self.experts = nn.ModuleList([nn.Linear(64, 64)])

    class Dense(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(64, 32)

    r = load_recipe_file("h100-fp8-current")
    dec = {d.name: d for d in plan_conversion(Dense(), r.fp8, rules=r.modules)}
    assert dec["gate"].fp8 is True  # a "gate" with no experts beside it is no router
    m = nn.Module()
    m.block_sparse_moe = Moe()
    dec = {d.name: d for d in plan_conversion(m, r.fp8, rules=r.modules)}
    assert dec["block_sparse_moe.gate"].reason == "rule moe_router (select moe_routers: compute fp32)"
    assert dec["block_sparse_moe.gate_proj"].fp8 is True and dec["block_sparse_moe.experts.0"].fp8 is True


def test_conversion_keeps_parameter_identity_and_is_idempotent():
    model = tiny_llama()
    params = {n: p for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    convert(model, fp8_recipe("current"))
    assert {n: p for n, p in model.named_parameters()} == params
    assert all(a is b for a, b in zip(opt.param_groups[0]["params"], model.parameters()))
    again = convert(model, fp8_recipe("current"))
    assert again.decision("model.layers.0.self_attn.q_proj").reason == "already FP8"


def test_auto_backend_refuses_on_cpu_with_the_fix():
    with pytest.raises(FP8BackendUnavailable, match=r"set fp8.backend: emulated"):
        resolve_backend(load_recipe_file("h100-fp8-delayed"), torch.device("cpu"))
    with pytest.raises(ValueError, match="nothing to convert"):
        convert(tiny_llama(), load_recipe_file("cpu-bf16"))


# -- training --------------------------------------------------------------------------------------

STEPS = 50


@pytest.fixture(scope="module")
def batches():
    return byte_batches(builtin_text(), seq_len=64, batch_size=8, n_batches=STEPS, seed=0)


def _train(batches, recipe=None, backend=None):
    model = tiny_llama(seed=0)
    rep = convert(model, recipe, backend=backend) if recipe is not None else None
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses = []
    for b in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=b, labels=b).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        fp8_step(model)
        losses.append(loss.detach())
    losses = torch.stack(losses).float()
    return losses, rep, model


@pytest.fixture(scope="module")
def bf16_losses(batches):
    return _train(batches)[0]


#: FP8 emulation must end within this much (nats) of the BF16 run's mean loss over its last 5 steps.
FP8_TOLERANCE = 0.1


@pytest.mark.slow
@pytest.mark.parametrize("scaling", ["delayed", "current", "mxfp8", "blockwise"])
def test_tiny_llama_trains_in_emulated_fp8_close_to_bf16(batches, bf16_losses, scaling):
    losses, rep, _ = _train(batches, fp8_recipe(scaling))
    first, last = losses[0].item(), losses[-5:].mean().item()
    bf16_last = bf16_losses[-5:].mean().item()
    assert last < first - 1.5, (first, last)
    assert abs(last - bf16_last) < FP8_TOLERANCE, (scaling, last, bf16_last)
    assert set(rep.kept) == {"lm_head", "model.embed_tokens"}


@pytest.mark.slow
def test_torchao_backend_trains_with_emulate(batches, bf16_losses):
    from torchao.float8.float8_linear import Float8Linear

    losses, rep, model = _train(batches, fp8_recipe("current", backend="torchao"))
    assert rep.backend == "torchao" and any("emulate=True" in n for n in rep.notes)
    assert isinstance(model.model.layers[0].self_attn.q_proj, Float8Linear)
    assert not isinstance(model.lm_head, Float8Linear)
    assert losses[-5:].mean().item() < losses[0].item() - 1.5
    assert abs(losses[-5:].mean().item() - bf16_losses[-5:].mean().item()) < FP8_TOLERANCE


def test_torchao_rowwise_defaults_to_what_torchao_does():
    r = fp8_recipe("current", backend="torchao", torchao_recipe="rowwise")
    assert (r.fp8.format, r.fp8.power_2_scales, r.fp8.epsilon) == ("E4M3", True, 1e-12)
    rep = convert(tiny_llama(), r)
    assert len(rep.converted) == 14


@pytest.mark.slow
def test_delayed_state_resumes_exactly(batches):
    r = fp8_recipe("delayed", amax_history_len=8)
    _, _, model = _train(batches[:10], r)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    assert any(k.endswith("fp8_amax_history") for k in sd)
    fresh = tiny_llama(seed=1)
    convert(fresh, r)
    fresh.load_state_dict(sd)
    b = batches[10]
    with torch.no_grad():
        a = model(input_ids=b, labels=b).loss
        c = fresh(input_ids=b, labels=b).loss
    assert torch.equal(a, c)


# -- health statistics without host sync -----------------------------------------------------------


def test_stats_are_recorded_on_request_without_sync(monkeypatch):
    lin, x, gy = _linear_case()
    mod = EmulatedFP8Linear(lin, EmulationSpec(scaling="delayed", amax_history_len=4))
    mod(x).backward(gy)
    fp8_step(mod)
    mod.record_stats = True
    x_out = x.clone()
    x_out[0, 0, 0] = 1e4  # an outlier far above last step's amax: saturates under delayed scaling

    def boom(*a, **k):
        raise AssertionError("host sync")

    for name in ("item", "tolist", "cpu", "__bool__", "__float__", "__int__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    mod(x_out).backward(gy)
    fp8_step(mod)
    monkeypatch.undo()
    st = mod.stats
    assert st["input_saturation"].item() == pytest.approx(1 / x_out.numel())
    assert st["weight_saturation"].item() == 0.0
    assert st["input_amax"].item() == pytest.approx(1e4)
    assert {"input_sqnr_db", "grad_underflow", "weight_underflow"} <= set(st)


# -- distributed amax reduction --------------------------------------------------------------------


def _ddp_worker(rank: int, world: int, port: int, out: dict) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    lin = nn.Linear(32, 32)
    mod = EmulatedFP8Linear(lin, EmulationSpec(scaling="delayed", amax_history_len=2))
    x = torch.full((4, 32), float(rank + 1))  # rank 1 sees the larger amax
    mod(x).sum().backward()
    fp8_step(mod)
    out[rank] = (mod.fp8_scale.clone(), mod.fp8_amax_history.clone())
    leave_group()


@pytest.mark.slow
def test_delayed_amax_is_reduced_across_ranks():
    mgr = mp.Manager()
    out = mgr.dict()
    mp.spawn(_ddp_worker, args=(2, free_port(), out), nprocs=2, join=True)
    s0, h0 = out[0]
    s1, h1 = out[1]
    assert torch.equal(s0, s1) and torch.equal(h0, h1)
    assert h0[-1, 0].item() == 2.0  # the MAX over ranks of the input amax
