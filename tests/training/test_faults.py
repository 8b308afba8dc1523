"""Fault injection: a step with a NaN loss or an inf gradient never changes the weights or the optimizer state,
in any precision and whatever reaction the recipe gives the non-finite detectors; every checkpoint is finite.

Tiny Llama on CPU under ``cpu-bf16``, rehearsed ``h100-fp8-delayed``, rehearsed ``v100-fp16`` and FP32; each
reaction of ``nonfinite_loss`` and ``nonfinite_grad`` in turn (``warn``, ``stop``, ``fallback``, ``lower_lr``).
"""

from __future__ import annotations

import math

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import Trainer, TrainerCallback

from hf_mixedprec.core.demo import tiny_llama
from hf_mixedprec.integrations.recipe import resolve_recipe
from hf_mixedprec.integrations.trainer import runtime_of
from tests.integrations.test_integration import Bytes

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_accelerate_state")]

FAULT_AT = 3  # the optimizer step (1-based) whose loss or gradient is made non-finite
STEPS = 5


class Fault(TrainerCallback):
    """Makes step :data:`FAULT_AT`'s loss NaN (``kind="nan_loss"``) or one weight's gradient inf
    (``kind="inf_grad"``), and copies the parameters and the optimizer state just before and just after it."""

    def __init__(self, kind: str, at: int = FAULT_AT):
        self.kind, self.at, self.armed, self.before, self.after = kind, at, False, None, None

    def on_train_begin(self, args, state, control, model=None, **kw):
        weight = model.model.layers[0].mlp.down_proj.weight
        weight.register_hook(lambda g: torch.full_like(g, math.inf) if self.armed and self.kind == "inf_grad" else g)

    def _snapshot(self, model, optimizer):
        inner = getattr(optimizer, "optimizer", optimizer)
        opt = [t.detach().clone() for s in inner.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        return [p.detach().clone() for p in model.parameters()], opt

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kw):
        self.armed = state.global_step + 1 == self.at
        if self.armed:
            self.before = self._snapshot(model, optimizer)

    def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
        if self.armed:
            self.after = self._snapshot(model, optimizer)


class NanLossTrainer(Trainer):
    """A Trainer whose loss is NaN on the faulty step (only when the fault is a NaN loss)."""

    fault: Fault

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.fault.armed and self.fault.kind == "nan_loss":
            loss = loss * math.nan
        return loss


def _recipe(base: str, reaction: str):
    det = {"reaction": reaction, **({"lr_factor": 0.5} if reaction == "lower_lr" else {})}
    data = {"name": f"fault-{reaction}", "extends": base}
    if base == "fp32":  # no built-in FP32 recipe: cpu-bf16's settings in full precision
        data = {**data, "extends": "cpu-bf16", "precision": "fp32"}
    data["health"] = {"detectors": {"nonfinite_loss": det, "nonfinite_grad": det}}
    recipe = resolve_recipe(yaml.safe_load(yaml.safe_dump(data)))
    return recipe if base in ("cpu-bf16", "fp32") else recipe.rehearsed()


@pytest.mark.parametrize("kind", ["nan_loss", "inf_grad"])
@pytest.mark.parametrize("reaction", ["warn", "stop", "fallback", "lower_lr"])
@pytest.mark.parametrize("base", ["cpu-bf16", "h100-fp8-delayed", "v100-fp16", "fp32"])
def test_a_non_finite_step_changes_nothing(tmp_path, base, reaction, kind):
    recipe = _recipe(base, reaction)
    fault = Fault(kind)
    args = recipe.training_args(
        output_dir=str(tmp_path),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=2e-3,
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    NanLossTrainer.fault = fault
    tr = NanLossTrainer(
        model=tiny_llama(), args=args, train_dataset=Bytes(n=64, seq_len=32), callbacks=[fault, *recipe.callbacks()]
    )
    tr.train()
    assert fault.before is not None and fault.after is not None, "the faulty step did not run"
    (p0, o0), (p1, o1) = fault.before, fault.after
    assert all(torch.equal(a, b) for a, b in zip(p0, p1)), "the faulty step changed a weight"
    assert len(o0) == len(o1) and all(torch.equal(a, b) for a, b in zip(o0, o1)), "it changed the optimizer state"
    assert all(torch.isfinite(p).all() for p in tr.model.parameters())
    checkpoints = sorted(tmp_path.glob("checkpoint-*"))
    assert checkpoints, "no checkpoint was written"
    for ckpt in checkpoints:
        weights = load_file(str(ckpt / "model.safetensors"))
        bad = [k for k, t in weights.items() if t.is_floating_point() and not torch.isfinite(t).all()]
        assert bad == [], f"{ckpt.name} holds non-finite tensors: {bad[:3]}"
    skipped = [r["mp/skipped_steps"] for r in tr.state.log_history if "mp/skipped_steps" in r]
    assert skipped[FAULT_AT - 1] == 1.0 and (FAULT_AT < 2 or skipped[FAULT_AT - 2] == 0.0)
    if reaction == "stop":
        assert tr.state.global_step == FAULT_AT  # stopped at the check right after the fault, with a checkpoint
        assert (tmp_path / f"checkpoint-{FAULT_AT}").is_dir()


def test_a_stop_on_the_last_step_still_saves_its_checkpoint(tmp_path):
    recipe = _recipe("cpu-bf16", "stop")
    fault = Fault("nan_loss", at=STEPS)
    args = recipe.training_args(
        output_dir=str(tmp_path),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )
    NanLossTrainer.fault = fault
    tr = NanLossTrainer(
        model=tiny_llama(), args=args, train_dataset=Bytes(n=64, seq_len=32), callbacks=[fault, *recipe.callbacks()]
    )
    tr.train()
    assert runtime_of(tr).stop_requested
    weights = load_file(str(tmp_path / f"checkpoint-{STEPS}" / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in weights.values() if t.is_floating_point())


class LrUsed(TrainerCallback):
    """The learning rate each optimizer step ran with (read after the step, before the scheduler moves)."""

    def __init__(self):
        self.lrs: list[float] = []

    def on_optimizer_step(self, args, state, control, optimizer=None, **kw):
        self.lrs.append(getattr(optimizer, "optimizer", optimizer).param_groups[0]["lr"])


@pytest.mark.parametrize("base", ["cpu-bf16", "v100-fp16", "h100-fp8-delayed"])
def test_a_skipped_step_does_not_advance_the_lr_schedule_between_logs(base):
    """Logging only at the end: the step after a skipped one runs at the learning rate the skipped one had,
    and every later step one schedule position behind a run without the fault (linear decay, exact)."""
    used = {}
    for kind in ("none", "inf_grad"):
        recipe = _recipe(base, "warn")
        fault, lrs = Fault(kind), LrUsed()
        args = recipe.training_args(
            output_dir="/tmp/unused",
            max_steps=STEPS + 1,
            per_device_train_batch_size=4,
            learning_rate=2e-3,
            logging_steps=100,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            seed=0,
        )
        NanLossTrainer.fault = fault
        tr = NanLossTrainer(
            model=tiny_llama(),
            args=args,
            train_dataset=Bytes(n=64, seq_len=32),
            callbacks=[*recipe.callbacks(), fault, lrs],
        )
        tr.train()
        used[kind] = lrs.lrs
    clean, faulty = used["none"], used["inf_grad"]
    assert len(clean) == len(faulty) == STEPS + 1
    assert clean[0] > clean[1] > clean[2]  # the schedule really decays step by step
    k = FAULT_AT - 1  # 0-based index of the skipped step
    assert faulty[: k + 1] == clean[: k + 1]
    assert faulty[k + 1 :] == clean[k : len(clean) - 1], "the skipped step advanced the LR schedule"


@pytest.mark.parametrize("base", ["cpu-bf16", "v100-fp16"])
def test_own_accelerate_loop_with_fused_adamw_holds_the_schedule_on_a_skipped_step(base):
    """Fused AdamW skips inside ``step()`` (no host read), so Accelerate's prepared scheduler would advance;
    the plugin takes the skipped step back out before the next step runs."""
    from torch.utils.data import DataLoader
    from transformers import get_linear_schedule_with_warmup

    used = {}
    for inject in (False, True):
        recipe = _recipe(base, "warn")
        accelerator = recipe.accelerator()
        torch.manual_seed(0)
        model = tiny_llama()
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3, fused=True)
        sched = get_linear_schedule_with_warmup(opt, 0, STEPS + 1)
        loader = DataLoader(Bytes(n=4 * (STEPS + 1), seq_len=32), batch_size=4)
        model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
        lrs = []
        for step, batch in enumerate(loader, start=1):
            loss = model(**batch).loss
            if inject and step == FAULT_AT:
                loss = loss * math.inf
            accelerator.backward(loss)
            opt.step()
            lrs.append(opt.optimizer.param_groups[0]["lr"])
            sched.step()
            opt.zero_grad()
        used[inject] = lrs
    clean, faulty = used[False], used[True]
    k = FAULT_AT - 1
    assert clean[0] > clean[1] > clean[2]
    assert faulty[: k + 1] == clean[: k + 1]
    assert faulty[k + 1 :] == clean[k : len(clean) - 1], "the skipped step advanced the LR schedule"
