"""Recipes applied with one line to Trainer, SFTTrainer, PEFT models and a hand-written Accelerate loop (CPU)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset
from transformers import Trainer, TrainerCallback

import hf_mixedprec
from hf_mixedprec.core.demo import builtin_text, byte_batches, tiny_llama, train_tokenizer
from hf_mixedprec.fp8 import EmulatedFP8Linear
from hf_mixedprec.integrations.trainer import runtime_of

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_accelerate_state")]


class Bytes(Dataset):
    def __init__(self, n: int = 256, seq_len: int = 64, seed: int = 0):
        self.rows = [b[0] for b in byte_batches(builtin_text(), seq_len=seq_len, batch_size=1, n_batches=n, seed=seed)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class InjectOverflow(TrainerCallback):
    """Make every gradient of one weight inf during the backward of optimizer step ``at`` (1-based)."""

    def __init__(self, at: int):
        self.at, self.armed, self.before, self.after = at, False, None, None

    def on_train_begin(self, args, state, control, model=None, **kw):
        self.param = model.model.layers[0].mlp.down_proj.weight
        self.param.register_hook(lambda g: torch.full_like(g, float("inf")) if self.armed else g)

    def on_step_begin(self, args, state, control, model=None, **kw):
        self.armed = state.global_step + 1 == self.at
        if self.armed:
            self.before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def on_optimizer_step(self, args, state, control, model=None, **kw):
        if self.armed:
            self.after = {n: p.detach().clone() for n, p in model.named_parameters()}


def _trainer(recipe, tmp_path, *, steps=16, extra_callbacks=(), model=None, **targs):
    model = model if model is not None else tiny_llama()
    settings = {
        "output_dir": str(tmp_path / "out"),
        "max_steps": steps,
        "per_device_train_batch_size": 4,
        "learning_rate": 2e-3,
        "logging_steps": 1,
        "report_to": [],
        "save_strategy": "no",
        "disable_tqdm": True,
        "seed": 0,
    }
    args = recipe.training_args(**{**settings, **targs})
    return Trainer(model=model, args=args, train_dataset=Bytes(), callbacks=[*extra_callbacks, *recipe.callbacks()])


def _logs(trainer, key):
    return [r[key] for r in trainer.state.log_history if key in r]


def test_trainer_cpu_bf16(tmp_path):
    recipe = hf_mixedprec.load_recipe("cpu-bf16")
    tr = _trainer(recipe, tmp_path)
    tr.train()
    loss = _logs(tr, "loss")
    assert loss[-1] < loss[0] - 1.0
    assert tr.args.max_grad_norm == 0.0  # the recipe's ZClip clips instead
    norms = _logs(tr, "mp/grad_norm")
    assert len(norms) == 16 and norms == pytest.approx(_logs(tr, "grad_norm"), rel=1e-5)
    assert tr.accelerator.mixed_precision == "bf16"


def test_trainer_rehearsed_v100_fp16_overflow_halves_scale_and_skips(tmp_path):
    recipe = hf_mixedprec.load_recipe("v100-fp16", rehearse=True)
    inject = InjectOverflow(at=6)
    tr = _trainer(recipe, tmp_path, extra_callbacks=[inject])
    tr.train()
    scale = _logs(tr, "mp/loss_scale")
    skipped = _logs(tr, "mp/skipped_steps")
    assert scale[:5] == [65536.0] * 5 and scale[5:] == [32768.0] * 11  # halved at step 6, growth needs 2000
    assert skipped[:5] == [0.0] * 5 and skipped[5:] == [1.0] * 11
    # the overflow step changed no weight, bit for bit
    assert all(torch.equal(inject.before[n], inject.after[n]) for n in inject.before)
    lr = _logs(tr, "learning_rate")
    assert lr[5] == lr[6], "the LR schedule must not advance on a skipped step"
    loss = _logs(tr, "loss")
    assert all(math.isfinite(v) for v in loss) and loss[-1] < loss[0] - 1.0
    assert isinstance(tr.accelerator.scaler, torch.amp.GradScaler)
    rt = runtime_of(tr)
    assert any(n.startswith("REHEARSAL") for n in rt.notes)


def test_trainer_rehearsed_h100_fp8_delayed(tmp_path):
    recipe = hf_mixedprec.load_recipe("h100-fp8-delayed", rehearse=True)
    tr = _trainer(recipe, tmp_path)
    layer = tr.model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, EmulatedFP8Linear) and not isinstance(tr.model.lm_head, EmulatedFP8Linear)
    tr.train()
    loss = _logs(tr, "loss")
    assert loss[-1] < loss[0] - 1.0
    assert layer.fp8_amax_history[-1].gt(0).all() and layer.fp8_amax_history[-17].eq(0).all()
    assert layer.fp8_amax_history[-16:].gt(0).all()  # one history row per optimizer step
    assert "mp/grad_norm" in tr.state.log_history[0]


def test_conflicting_training_args_are_refused(tmp_path):
    recipe = hf_mixedprec.load_recipe("v100-fp16", rehearse=True)
    with pytest.raises(ValueError, match=r"TrainingArguments.bf16=True contradicts recipe 'v100-fp16'"):
        recipe.training_args(output_dir=str(tmp_path), bf16=True)


THREE = ["cpu-bf16", "v100-fp16", "h100-fp8-delayed"]


def _load(name):
    return hf_mixedprec.load_recipe(name, rehearse=name != "cpu-bf16")


@pytest.mark.parametrize("name", THREE)
def test_sft_trainer_with_recipe(tmp_path, name):
    from datasets import Dataset as HFDataset
    from trl import SFTConfig, SFTTrainer

    tok = train_tokenizer(builtin_text(), vocab_size=512)
    text = builtin_text()
    ds = HFDataset.from_dict({"text": [text[i : i + 400] for i in range(0, 400 * 64, 400)]})
    recipe = _load(name)
    model = tiny_llama(vocab_size=len(tok))
    cfg = recipe.training_args(
        args_class=SFTConfig,
        output_dir=str(tmp_path),
        max_steps=12,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        max_length=64,
        disable_tqdm=True,
    )
    tr = SFTTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok, callbacks=recipe.callbacks())
    fp8 = isinstance(tr.model.model.layers[1].mlp.up_proj, EmulatedFP8Linear)
    assert fp8 == (name == "h100-fp8-delayed")
    tr.train()
    loss = _logs(tr, "loss")
    assert loss[-1] < loss[0] - 0.5 and _logs(tr, "mp/grad_norm")
    if name == "v100-fp16":
        assert _logs(tr, "mp/loss_scale")[-1] == 65536.0


@pytest.mark.parametrize("name", THREE)
def test_peft_lora_keeps_adapters_in_high_precision(tmp_path, name):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"]))
    recipe = _load(name)
    tr = _trainer(recipe, tmp_path, model=model, steps=10)
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    if name == "h100-fp8-delayed":
        rep = runtime_of(model).fp8_report
        assert rep.decision(f"{q}.base_layer").fp8 is True
        assert rep.decision(f"{q}.lora_A.default").fp8 is False
        assert rep.decision(f"{q}.lora_A.default").reason.startswith("LoRA adapter")
        assert rep.decision("base_model.model.lm_head").fp8 is False
    lora_b = dict(model.named_parameters())[f"{q}.lora_B.default.weight"]
    base = dict(model.named_parameters())[f"{q}.base_layer.weight"]
    before, base_before = lora_b.detach().clone(), base.detach().clone()
    tr.train()
    assert not torch.equal(before, lora_b)  # adapters train
    assert torch.equal(base_before, base)  # the frozen base does not
    loss = _logs(tr, "loss")
    assert loss[-1] < loss[0]
    if name == "v100-fp16":
        assert _logs(tr, "mp/loss_scale")[-1] == 65536.0


@pytest.mark.parametrize("recipe", THREE)
def test_accelerate_loop_with_plugin(tmp_path, recipe):
    out = tmp_path / recipe
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "finetune_accelerate.py"),
        "--recipe",
        recipe,
        "--max-steps",
        "20",
        "--output-dir",
        str(out),
        "--log-every",
        "5",
    ]
    if recipe != "cpu-bf16":
        cmd.append("--rehearse")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads((out / "history.json").read_text())
    hist = data["history"]
    assert hist[-1]["loss"] < hist[0]["loss"] - 1.0
    assert all("mp/grad_norm" in h for h in hist)
    if recipe == "v100-fp16":
        assert all(h["mp/loss_scale"] == 65536.0 for h in hist)
        assert any("fp16 autocast and GradScaler enabled on cpu" in n for n in data["notes"])
    if recipe != "cpu-bf16":
        assert any(n.startswith("REHEARSAL") for n in data["notes"])


def test_accelerate_plugin_builds_stock_handlers():
    from accelerate.utils import GradScalerKwargs

    from hf_mixedprec.integrations.accelerate_plugin import grad_scaler_kwargs

    recipe = hf_mixedprec.load_recipe("v100-fp16", rehearse=True)
    kw = grad_scaler_kwargs(recipe)
    assert type(kw) is GradScalerKwargs  # Accelerate matches handlers by exact class
    assert (kw.init_scale, kw.growth_factor, kw.backoff_factor, kw.growth_interval) == (65536.0, 2.0, 0.5, 2000)
    acc = recipe.accelerator()
    assert acc.scaler.get_scale() == 65536.0 and acc.scaler._growth_interval == 2000
    assert acc.mixed_precision == "fp16" and acc.native_amp


# -- resume ----------------------------------------------------------------------------------------


def _resume_case(tmp_path, name, *, steps=12, k=6):
    recipe = hf_mixedprec.load_recipe(name, rehearse=True)
    full = _trainer(recipe, tmp_path / "full", steps=steps, save_strategy="no")
    full.train()
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    # same max_steps as the full run (so the LR schedule is the same), stopped right after checkpoint k
    part = _trainer(recipe, tmp_path / "part", steps=steps, save_strategy="steps", save_steps=k)
    part.add_callback(_StopAt(k))
    part.train()
    AcceleratorState._reset_state(reset_partial_state=True)
    resumed = _trainer(recipe, tmp_path / "part", steps=steps, save_strategy="no")
    resumed.train(resume_from_checkpoint=str(tmp_path / "part" / "out" / f"checkpoint-{k}"))
    return full, resumed


class _StopAt(TrainerCallback):
    def __init__(self, k: int):
        self.k = k

    def on_step_end(self, args, state, control, **kw):
        if state.global_step >= self.k:
            control.should_training_stop = True


@pytest.mark.parametrize("name", ["v100-fp16", "h100-fp8-delayed"])
def test_resume_is_exact(tmp_path, name):
    full, resumed = _resume_case(tmp_path, name)
    lf = [r for r in full.state.log_history if "loss" in r and r["step"] > 6]
    lr = [r for r in resumed.state.log_history if "loss" in r and r["step"] > 6]
    assert [r["step"] for r in lr] == list(range(7, 13))
    assert [r["loss"] for r in lr] == [r["loss"] for r in lf]
    for key in ("mp/grad_norm", "mp/loss_scale"):
        a = [r[key] for r in full.state.log_history if key in r and r["step"] > 6]
        b = [r[key] for r in resumed.state.log_history if key in r and r["step"] > 6]
        assert a == b, key
    rf, rr = runtime_of(full), runtime_of(resumed)
    assert rf.steps == rr.steps == 12
    assert json.dumps(rf.state_dict()) == json.dumps(rr.state_dict())
    sf, sr = full.model.state_dict(), resumed.model.state_dict()
    for key in sf:
        assert torch.equal(sf[key], sr[key]), key
    if name == "h100-fp8-delayed":
        assert any(k.endswith("fp8_amax_history") for k in sf)


# -- the Accelerate plugin honours or refuses what the user asked of Accelerate ---------------------------


def test_plugin_refuses_a_conflicting_accelerate_mixed_precision_env(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    recipe = hf_mixedprec.load_recipe("cpu-bf16")
    with pytest.raises(ValueError, match=r"ACCELERATE_MIXED_PRECISION='fp16' contradicts recipe 'cpu-bf16'.*'bf16'"):
        recipe.accelerator()


def test_plugin_argument_wins_over_env_and_must_agree(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    recipe = hf_mixedprec.load_recipe("cpu-bf16")
    acc = recipe.accelerator(mixed_precision="bf16")  # Accelerate's own precedence: argument > env
    assert acc.mixed_precision == "bf16"
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    with pytest.raises(ValueError, match=r"mixed_precision='no' contradicts recipe 'cpu-bf16'"):
        recipe.accelerator(mixed_precision="no")


def test_plugin_fp8_recipe_accepts_the_fp8_env_and_says_what_it_does(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    acc = hf_mixedprec.load_recipe("h100-fp8-delayed", rehearse=True).accelerator()
    assert acc.mixed_precision == "bf16"
    assert any("ACCELERATE_MIXED_PRECISION='fp8'" in n and "applies FP8 itself" in n for n in acc.mp.notes)


def test_plugin_merges_a_users_grad_scaler_kwargs_into_the_recipe():
    from accelerate.utils import GradScalerKwargs

    recipe = hf_mixedprec.load_recipe("v100-fp16", rehearse=True)
    acc = recipe.accelerator(kwargs_handlers=[GradScalerKwargs(init_scale=1024, growth_interval=10)])
    assert acc.scaler.get_scale() == 1024.0 and acc.scaler._growth_interval == 10
    assert acc.scaler._growth_factor == 2.0 and acc.scaler._backoff_factor == 0.5  # the recipe's, untouched
    ls = acc.mp.recipe.loss_scale  # what the runtime clamps and the detectors use
    assert (ls.init_scale, ls.growth_interval, ls.min_scale) == (1024.0, 10, 1.0)
    note = next(n for n in acc.mp.notes if n.startswith("GradScalerKwargs("))
    assert "loss_scale.init_scale 65536.0 -> 1024" in note and "loss_scale.growth_interval 2000 -> 10" in note


@pytest.mark.parametrize(
    ("name", "kwargs", "match"),
    [
        ("cpu-bf16", {"init_scale": 1024}, r"applies to fp16 loss scaling, but recipe 'cpu-bf16' has precision bf16"),
        ("v100-fp16", {"enabled": False}, r"enabled=False\) contradicts recipe 'v100-fp16'"),
        ("v100-fp16", {"init_scale": 0.5}, r"GradScalerKwargs\(init_scale=0.5\) merged into recipe 'v100-fp16'"),
    ],
)
def test_plugin_refuses_grad_scaler_kwargs_it_cannot_honour(name, kwargs, match):
    from accelerate.utils import GradScalerKwargs

    recipe = hf_mixedprec.load_recipe(name, rehearse=name != "cpu-bf16")
    with pytest.raises(ValueError, match=match):
        recipe.accelerator(kwargs_handlers=[GradScalerKwargs(**kwargs)])


def test_fp8_conversion_summary_is_visible_at_the_default_log_level(tmp_path):
    """Rank 0 prints which Linears went FP8 and which stayed in high precision, once, at WARNING."""
    code = (
        "import hf_mixedprec\n"
        "from hf_mixedprec.core.demo import tiny_llama\n"
        "from hf_mixedprec.training.runtime import MixedPrecisionRuntime\n"
        "rt = MixedPrecisionRuntime(hf_mixedprec.load_recipe('h100-fp8-delayed', rehearse=True))\n"
        "rt.convert_model(tiny_llama())\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if "FP8 conversion" in ln]
    assert len(lines) == 1, r.stderr[-2000:]
    assert "(emulated, delayed scaling, HYBRID): 14 of 15 Linear layers in FP8" in lines[0]
    assert lines[0].endswith(
        "kept in high precision: embedding lookup (no GEMM): model.embed_tokens; rule lm_head (select lm_head: fp8 off): lm_head"
    )


def test_a_loss_the_runtime_cannot_see_is_said_once_and_never_skips_a_step():
    """A loop that calls loss.backward() itself bypasses accelerator.backward: no loss is guessed."""
    from hf_mixedprec.core.demo import tiny_llama

    recipe = hf_mixedprec.load_recipe("cpu-bf16")
    acc = recipe.accelerator()
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batches = byte_batches(builtin_text(), seq_len=32, batch_size=2, n_batches=4, seed=0)
    for ids in batches:
        model(input_ids=ids, labels=ids).loss.backward()  # not through accelerator.backward
        opt.step()
        opt.zero_grad()
    assert acc.mp_metrics()["mp/skipped_steps"] == 0.0
    assert all(not torch.equal(before[n], p.detach()) for n, p in model.named_parameters())
    said = [n for n in acc.mp.notes if n.startswith("no loss reached accelerator.backward")]
    assert len(said) == 1


@pytest.mark.parametrize(("name", "override"), [("cpu-bf16", {"fp16": True}), ("v100-fp16", {"bf16": True})])
def test_training_args_name_the_recipe_when_an_override_contradicts_it(name, override):
    """``recipe.training_args(fp16=True)`` on a BF16 recipe is our one-line error naming the key and the recipe,
    not Transformers' "At most one of fp16 and bf16"."""
    from hf_mixedprec.integrations.recipe import load_recipe_file

    recipe = load_recipe_file(name)
    key, value = next(iter(override.items()))
    with pytest.raises(ValueError, match=rf"TrainingArguments\.{key}={value!r} contradicts recipe '{name}'"):
        recipe.training_args(output_dir="/tmp/unused", **override)
