"""FP8 on transformers' Conv1D (GPT-2's projections): exact numerics, conversion policy, training, checkpoints,
and the loud warning for a recipe that converts nothing. Real transformers models built from configs, no mocks."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer
from transformers.pytorch_utils import Conv1D

import hf_mixedprec
from hf_mixedprec.commands.simulate import NOTHING_CHECKED, simulate
from hf_mixedprec.core.demo import builtin_text, byte_batches
from hf_mixedprec.fp8 import EmulatedFP8Conv1D, EmulatedFP8Linear, convert, fp8_layers, fp8_step
from hf_mixedprec.fp8.emulated import EmulationSpec
from hf_mixedprec.fp8.policy import plan_conversion
from hf_mixedprec.integrations.recipe import load_recipe_file, resolve_recipe
from hf_mixedprec.integrations.trainer import runtime_of
from hf_mixedprec.scaling import dequantize_mxfp8, quantize_mxfp8
from hf_mixedprec.training.runtime import MixedPrecisionRuntime

CONV1D_NAMES = [
    f"transformer.h.{i}.{p}" for i in (0, 1) for p in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
]
FP8_BUFFERS = (".fp8_amax_history", ".fp8_scale")


def tiny_gpt2(n_layer: int = 2, seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(
        n_embd=64, n_layer=n_layer, n_head=4, vocab_size=256, n_positions=128, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(cfg)


def fp8_recipe(scaling: str, **kw):
    return resolve_recipe({"name": "t", "precision": "fp8", "fp8": {"scaling": scaling, "backend": "emulated", **kw}})


class Bytes(Dataset):
    def __init__(self, n: int = 32, seq_len: int = 32):
        self.rows = [b[0] for b in byte_batches(builtin_text(), seq_len=seq_len, batch_size=1, n_batches=n, seed=0)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


# -- exact numerics: a Conv1D in FP8 is the equivalent Linear in FP8, bit for bit ---------------------------------


def _conv_and_linear(in_f=64, out_f=96, seed=0):
    torch.manual_seed(seed)
    conv = Conv1D(out_f, in_f)
    with torch.no_grad():
        conv.bias.normal_()
    lin = nn.Linear(in_f, out_f)
    with torch.no_grad():
        lin.weight.copy_(conv.weight.t())
        lin.bias.copy_(conv.bias)
    return conv, lin


def _inputs(in_f=64, out_f=96, tokens=32, step=0):
    g = torch.Generator().manual_seed(100 + step)
    # magnitudes spread over features and tokens, so that block scales differ between orientations
    x = torch.randn(2, tokens // 2, in_f, generator=g) * torch.logspace(-2, 2, in_f)
    gy = torch.randn(2, tokens // 2, out_f, generator=g) * torch.logspace(-3, 1, tokens).reshape(2, tokens // 2, 1)
    return x, gy


@pytest.mark.parametrize("scaling", ["delayed", "current", "mxfp8", "blockwise"])
@pytest.mark.parametrize("autocast", [False, True])
def test_conv1d_fp8_equals_the_equivalent_linear_bit_for_bit(scaling, autocast):
    conv, lin = _conv_and_linear()
    w_param, b_param = conv.weight, conv.bias
    spec = EmulationSpec(scaling=scaling, bwd_format="e4m3" if scaling == "mxfp8" else "e5m2", amax_history_len=4)
    mc, ml = EmulatedFP8Conv1D(conv, spec), EmulatedFP8Linear(lin, spec)
    # the same Parameter objects, the stored [in, out] shape: optimizer state and state_dict keys are unchanged
    assert mc.weight is w_param and mc.bias is b_param and mc.weight.shape == (64, 96)
    assert (mc.in_features, mc.out_features, mc.kind) == (64, 96, "Conv1D")
    for step in range(3):  # delayed scaling: later steps use the scales fp8_step derived from earlier ones
        x, gy = _inputs(step=step)
        xc, xl = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            yc, yl = mc(xc), ml(xl)
        assert yc.dtype == (torch.bfloat16 if autocast else torch.float32)
        assert torch.equal(yc, yl)
        yc.backward(gy.to(yc.dtype))
        yl.backward(gy.to(yl.dtype))
        assert torch.equal(xc.grad, xl.grad)
        assert conv.weight.grad.shape == (64, 96) and torch.equal(conv.weight.grad, lin.weight.grad.t())
        assert torch.equal(conv.bias.grad, lin.bias.grad)
        fp8_step(nn.ModuleList([mc, ml]))
        conv.zero_grad(set_to_none=True)
        lin.zero_grad(set_to_none=True)
    if scaling == "delayed":
        assert torch.equal(mc.fp8_scale, ml.fp8_scale) and torch.equal(mc.fp8_amax_history, ml.fp8_amax_history)
        assert mc.fp8_amax_history[-1].gt(0).all()


def test_mxfp8_conv1d_blocks_run_along_in_features_not_the_stored_rows():
    conv, _ = _conv_and_linear()
    with torch.no_grad():  # magnitudes spread over out_features: blocks along the stored rows mix them
        conv.weight.mul_(torch.logspace(-2, 2, 96))
    mod = EmulatedFP8Conv1D(conv, EmulationSpec(scaling="mxfp8", bwd_format="e4m3", block_size=32))
    x, _ = _inputs()
    x2 = x.reshape(-1, 64)

    def qdq(t, dim):
        d, c = quantize_mxfp8(t, fmt="e4m3", block_size=32, rounding="rceil", dim=dim)
        return dequantize_mxfp8(d, c, block_size=32, dim=dim)

    w = conv.weight.detach()  # [in, out]
    y = mod(x).reshape(-1, 96)
    bias = conv.bias.detach().bfloat16().float()  # an FP8 GEMM's bias is BF16 with FP32 activations (TE's linear.py)
    along_k = qdq(x2, -1) @ qdq(w.t().contiguous(), -1).t() + bias
    along_stored_rows = qdq(x2, -1) @ qdq(w, -1) + bias  # blocks along out_features: wrong for the GEMM
    assert torch.equal(y, along_k)
    assert not torch.equal(y, along_stored_rows)


def test_high_precision_restores_a_conv1d_with_the_same_parameters():
    conv, _ = _conv_and_linear()
    mod = EmulatedFP8Conv1D(conv, EmulationSpec(scaling="current"))
    back = mod.high_precision()
    assert isinstance(back, Conv1D) and back.weight is conv.weight and back.bias is conv.bias
    x, _ = _inputs()
    assert torch.equal(back(x), conv(x))


# -- conversion policy and report ----------------------------------------------------------------------------------


def test_gpt2_conv1d_projections_are_gemm_layers_with_the_same_keep_rules():
    model = tiny_gpt2()
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    rep = convert(model, fp8_recipe("current", keep_in_bf16=["*.h.1.mlp.c_fc"]))
    kinds = {d.name: d.kind for d in rep.layers}
    assert {n: kinds[n] for n in CONV1D_NAMES} == dict.fromkeys(CONV1D_NAMES, "Conv1D") and kinds["lm_head"] == "Linear"
    assert rep.decision("transformer.h.0.attn.c_attn").in_features == 64
    assert rep.decision("transformer.h.0.attn.c_attn").out_features == 192
    assert rep.decision("lm_head").reason == "rule lm_head (select lm_head: fp8 off)"
    assert rep.decision("transformer.h.1.mlp.c_fc").reason == "rule keep_in_bf16 (match *.h.1.mlp.c_fc: fp8 off)"
    assert sorted(rep.converted) == sorted(n for n in CONV1D_NAMES if n != "transformer.h.1.mlp.c_fc")
    assert isinstance(model.transformer.h[0].attn.c_attn, EmulatedFP8Conv1D)
    assert isinstance(model.transformer.h[1].mlp.c_fc, Conv1D)
    assert dict(model.named_parameters()) == params and list(model.state_dict()) == keys  # current: no buffers
    assert rep.summary().startswith("FP8 conversion (emulated, current scaling, HYBRID): 7 of 9 Linear/Conv1D layers")
    assert not rep.nothing_converted and not rep.under_half_converted and rep.warning is None
    d = rep.to_dict()
    assert (d["gemm_layers"], d["nothing_converted"], d["warning"]) == (9, False, None)
    assert {lay["name"]: lay["kind"] for lay in d["layers"]}["transformer.h.0.mlp.c_proj"] == "Conv1D"
    again = convert(model, fp8_recipe("current"))
    assert again.decision("transformer.h.0.attn.c_attn").already_fp8
    assert again.decision("transformer.h.0.attn.c_attn").kind == "Conv1D"


def test_conv1d_alignment_and_mx_block_rules():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=48, n_layer=1, n_head=4, n_inner=96, vocab_size=256, n_positions=64))
    dec = {d.name: d for d in plan_conversion(model, fp8_recipe("mxfp8", align=16).fp8)}
    assert dec["transformer.h.0.attn.c_attn"].reason == "in/out features 48x144 not divisible by the MX block size 32"
    dec = {d.name: d for d in plan_conversion(model, fp8_recipe("current", align=32).fp8)}
    assert dec["transformer.h.0.mlp.c_fc"].reason == "in/out features 48x96 not divisible by align=32"


@pytest.mark.parametrize("backend", ["torchao", "transformer_engine"])
def test_backends_that_convert_only_linear_list_every_conv1d_with_the_reason(backend):
    dec = {d.name: d for d in plan_conversion(tiny_gpt2(), fp8_recipe("current").fp8, backend=backend)}
    for name in CONV1D_NAMES:
        assert dec[name].fp8 is False and dec[name].reason == f"Conv1D: backend {backend} converts only nn.Linear"


def test_torchao_on_gpt2_converts_nothing_and_says_so_loudly():
    pytest.importorskip("torchao")
    rep = convert(tiny_gpt2(), fp8_recipe("current", backend="torchao"))
    assert rep.converted == [] and rep.nothing_converted and rep.to_dict()["nothing_converted"] is True
    assert all(rep.decision(n).reason == "Conv1D: backend torchao converts only nn.Linear" for n in CONV1D_NAMES)
    assert any(n.startswith("backend torchao converts only nn.Linear: 8 Conv1D layers stay") for n in rep.notes)
    assert rep.summary().startswith("WARNING: FP8 converted nothing: 0 of 9 GEMM layers in FP8")
    assert "Conv1D: backend torchao converts only nn.Linear: transformer.h.0.attn.c_attn" in rep.summary()


def test_under_half_converted_is_flagged():
    rep = convert(tiny_gpt2(), fp8_recipe("current", keep_in_bf16=["*.mlp.*", "*.c_proj"]))
    assert len(rep.converted) == 2 and not rep.nothing_converted and rep.under_half_converted
    assert rep.summary().startswith("WARNING: FP8 converted under half of the GEMM layers: 2 of 9 in FP8")
    assert str(rep).splitlines()[0] == rep.warning


# -- a recipe that converts nothing: a loud warning, and simulate never calls it safe ------------------------------


def test_runtime_warns_loudly_when_a_recipe_converts_nothing(caplog):
    model = tiny_gpt2(n_layer=0)  # embeddings and the (kept) lm_head only: no GEMM layer to convert
    rt = MixedPrecisionRuntime(hf_mixedprec.load_recipe("h100-fp8-delayed", rehearse=True))
    with caplog.at_level(logging.WARNING, logger="hf_mixedprec"):
        rep = rt.convert_model(model)
    assert rep.nothing_converted and rep.to_dict()["nothing_converted"] is True
    records = [r for r in caplog.records if r.name == "hf_mixedprec" and "FP8 converted nothing" in r.getMessage()]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    msg = records[0].getMessage()
    assert "WARNING: FP8 converted nothing: 0 of 1 GEMM layers in FP8" in msg
    assert "FP8 conversion (emulated, delayed scaling, HYBRID): 0 of 1 Linear layers in FP8" in msg
    assert "rule lm_head (select lm_head: fp8 off): lm_head" in msg
    assert rep.warning in rt.notes  # the run report records it too


@pytest.mark.slow
def test_simulate_says_nothing_checked_for_a_model_without_fp8_layers(tmp_path):
    tiny_gpt2(n_layer=0).save_pretrained(tmp_path / "m")
    res = simulate(load_recipe_file("h100-fp8-current"), model_dir=str(tmp_path / "m"), steps=2, seq_len=16)
    assert res.nothing_checked and res.layers == [] and res.verdict == NOTHING_CHECKED
    table = res.table()
    assert NOTHING_CHECKED in table and "looks safe" not in table
    assert "recommendation: none, nothing checked: no FP8 layer in this model" in table
    r = subprocess.run(
        [sys.executable, "-m", "hf_mixedprec.cli", "simulate", "--recipe", "h100-fp8-current", "--model",
         str(tmp_path / "m"), "--steps", "2", "--seq-len", "16", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["nothing_checked"] is True and out["checked_layers"] == 0 and out["verdict"] == NOTHING_CHECKED
    assert out["conversion"]["nothing_converted"] is True and out["layers"] == []


def test_simulate_checks_gpt2_conv1d_layers(tmp_path):
    tiny_gpt2().save_pretrained(tmp_path / "m")
    res = simulate(fp8_recipe("current"), model_dir=str(tmp_path / "m"), steps=2, seq_len=16, batch_size=2)
    assert sorted(layer.name for layer in res.layers) == sorted(CONV1D_NAMES)
    assert not res.nothing_checked and NOTHING_CHECKED not in res.table()


# -- GPT-2 trains with recipe.callbacks(), and its checkpoint loads with from_pretrained ---------------------------


def _train_gpt2(recipe_name: str, tmp_path):
    recipe = hf_mixedprec.load_recipe(recipe_name, rehearse=True)
    model = tiny_gpt2()
    before = {n: model.get_submodule(n).weight.detach().clone() for n in CONV1D_NAMES}
    args = recipe.training_args(
        output_dir=str(tmp_path / "out"),
        max_steps=5,
        per_device_train_batch_size=4,
        learning_rate=2e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    tr = Trainer(model=model, args=args, train_dataset=Bytes(), callbacks=recipe.callbacks())
    tr.train()
    return tr, before


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("recipe_name", ["h100-fp8-delayed", "h100-fp8-current", "b200-mxfp8"])
def test_gpt2_trains_five_steps_with_conv1d_in_fp8_and_reloads(recipe_name, tmp_path):
    tr, before = _train_gpt2(recipe_name, tmp_path)
    model = tr.model
    losses = [r["loss"] for r in tr.state.log_history if "loss" in r]
    assert len(losses) == 5 and all(math.isfinite(v) for v in losses)
    assert sorted(name for name, _ in fp8_layers(model, emulated_only=True, fresh=True)) == sorted(CONV1D_NAMES)
    for name in CONV1D_NAMES:
        mod = model.get_submodule(name)
        assert isinstance(mod, EmulatedFP8Conv1D) and mod.weight.shape == before[name].shape
        assert not torch.equal(mod.weight.detach(), before[name]), f"{name} did not train"
    rep = runtime_of(tr).fp8_report
    assert rep.backend == "emulated" and sorted(rep.converted) == sorted(CONV1D_NAMES)
    assert all(rep.decision(n).kind == "Conv1D" for n in CONV1D_NAMES) and rep.warning is None
    if recipe_name == "h100-fp8-delayed":
        assert model.transformer.h[0].attn.c_attn.fp8_amax_history[-1].gt(0).all()

    model.save_pretrained(tmp_path / "ckpt")
    loaded, info = GPT2LMHeadModel.from_pretrained(tmp_path / "ckpt", output_loading_info=True)
    assert not info["missing_keys"]
    assert not info.get("mismatched_keys")
    # the FP8 state stays out of save_pretrained (it goes to the checkpoint side file): a plain GPT-2 checkpoint
    assert list(info["unexpected_keys"]) == []
    for name in CONV1D_NAMES:
        got = loaded.get_submodule(name)
        assert isinstance(got, Conv1D) and torch.equal(got.weight, model.get_submodule(name).weight.detach())


def test_lora_on_gpt2_converts_the_frozen_conv1d_bases_and_adapters_do_not_count_as_unconverted():
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True)
    model = peft.get_peft_model(tiny_gpt2(), cfg)
    rep = convert(model, fp8_recipe("current"))
    bases = [d for d in rep.layers if d.name.endswith(".base_layer")]
    assert len(bases) == 8 and all(d.kind == "Conv1D" and d.fp8 for d in bases)
    adapters = [d for d in rep.layers if ".lora_" in d.name]
    assert len(adapters) == 16 and not any(d.fp8 for d in adapters)
    assert not rep.under_half_converted and rep.warning is None  # 8 of 9 weight layers; adapters are kept by design
    x = torch.randint(0, 256, (2, 16))
    model(input_ids=x, labels=x).loss.backward()
    assert model.base_model.model.transformer.h[0].attn.c_attn.lora_B.default.weight.grad is not None


def test_health_fallback_moves_conv1d_layers_back_with_the_same_parameters():
    """The health fallback to BF16 (``layers_to_bf16``) returns a GPT-2 Conv1D to transformers' ``Conv1D``."""
    from hf_mixedprec.training.health import layers_to_bf16

    model = tiny_gpt2()
    convert(model, fp8_recipe("current"), backend="emulated")
    params = {n: model.get_submodule(n).weight for n in CONV1D_NAMES}
    moved = layers_to_bf16(model, CONV1D_NAMES)
    assert moved == CONV1D_NAMES
    for name in CONV1D_NAMES:
        mod = model.get_submodule(name)
        assert type(mod) is Conv1D and mod.weight is params[name]
    assert not list(fp8_layers(model, emulated_only=True, fresh=True))
