"""The Trainer side of ``bench_overhead.py``, shared with ``bench_storage.py`` and ``bench_modules.py``: the byte
dataset, the step clocks (``bench_harness``'s) as a Trainer callback, the baseline and hf_mixedprec Trainers, and one
run of them alone or in lockstep."""

from __future__ import annotations

import hf_mixedprec  # first: it quiets known backend noise before transformers imports torchao

# isort: split

import argparse
import os
import sys
from typing import Any

import bench_harness as bh
import torch
from torch.utils.data import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_mixedprec.core.demo import builtin_text, byte_batches, tiny_llama
from hf_mixedprec.recipes.hardware import HardwareRefusal

MODELS = ("tiny", "small")


class Bytes(Dataset):
    """Fixed-length byte rows cut from the standard library's docstrings (as tests/integrations/test_integration.py)."""

    def __init__(self, n: int, seq_len: int, seed: int = 0):
        text = builtin_text()
        self.rows = [b[0] for b in byte_batches(text, seq_len=seq_len, batch_size=1, n_batches=n, seed=seed)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class ClockCallback(TrainerCallback):
    """Drives a ``bench_harness`` step clock from the Trainer's events: a tick at every ``on_step_begin`` (one full
    step, every callback included, between two ticks); a lockstep clock also parks at ``on_train_begin`` and hands
    its turn on for good at ``on_train_end``."""

    def __init__(self, clock: bh.StepClock | None = None) -> None:
        self.clock = clock if clock is not None else bh.StepClock()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.clock.begin()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.clock.tick()

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.clock.end()


class AdvanceFP8(TrainerCallback):
    """Baseline for FP8 recipes: advance delayed scaling after each step (part of the precision, not ours)."""

    def on_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        from hf_mixedprec.fp8 import fp8_step

        fp8_step(model)


def build_model(kind: str) -> torch.nn.Module:
    if kind == "tiny":
        return tiny_llama(seed=0)
    try:
        from hf_mixedprec.core.demo import small_llama
    except ImportError:  # an older checkout without small_llama: the same dims
        return tiny_llama(
            seed=0,
            hidden_size=256,
            intermediate_size=704,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
        )
    return small_llama(seed=0)


def load(name: str, rehearse: bool) -> tuple[Any, bool]:
    """The recipe; one this machine cannot run is rehearsed (said on stderr), unless --no-rehearse."""
    try:
        return hf_mixedprec.load_recipe(name), False
    except HardwareRefusal as exc:
        if not rehearse:
            raise
        print(f"note: {name}: {str(exc).splitlines()[0]} -> rehearsed", file=sys.stderr)
        return hf_mixedprec.load_recipe(name, rehearse=True), True


def build_trainer(
    side: str,
    recipe: Any,
    model_kind: str,
    data: Dataset,
    opts: argparse.Namespace,
    log_every: int,
    timer: ClockCallback,
    workdir: str,
) -> Trainer:
    """A Trainer for ``--warmup + --steps + 1`` steps of one side ("baseline" or "ours")."""
    model = build_model(model_kind)
    max_steps = opts.warmup + opts.steps + 1  # +1: a step's end is the next step's begin
    common: dict[str, Any] = {
        "output_dir": workdir,
        "max_steps": max_steps,
        "per_device_train_batch_size": opts.batch_size,
        "learning_rate": 1e-3,
        "logging_steps": log_every if log_every > 0 else max_steps,
        "report_to": [],
        "save_strategy": "no",
        "disable_tqdm": True,
        "seed": 0,
        "dataloader_num_workers": 0,
    }
    callbacks: list[TrainerCallback] = [timer]
    on_cuda = torch.cuda.is_available()
    if side == "ours":
        args = recipe.training_args(**common)
        callbacks += recipe.callbacks()
    else:
        p = recipe.precision
        flags: dict[str, Any] = {"bf16": p in ("bf16", "fp8"), "fp16": p == "fp16" and on_cuda}
        if not on_cuda:
            flags["use_cpu"] = True
        args = TrainingArguments(**common, **flags)  # Trainer's default max_grad_norm=1.0
        if p == "fp8":
            from hf_mixedprec.fp8 import convert

            convert(model, recipe, backend="emulated" if recipe.rehearse or not on_cuda else None)
            callbacks.append(AdvanceFP8())
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    if side == "baseline" and recipe.precision == "fp16" and not on_cuda:
        # what Trainer(fp16=True) runs on a GPU; Accelerate ignores fp16 on CPU, so switch its native path on
        from hf_mixedprec.integrations.accelerate_plugin import enable_native_fp16

        enable_native_fp16(trainer.accelerator, torch.amp.GradScaler("cpu"))
    return trainer


def run_once(
    side: str, recipe: Any, model_kind: str, data: Dataset, opts: argparse.Namespace, log_every: int
) -> tuple[list[float], list[float]]:
    """One training run on its own; the measured steps' wall and CPU seconds."""
    bh.reset_accelerate()
    timer = ClockCallback()
    build_trainer(side, recipe, model_kind, data, opts, log_every, timer, opts.workdir).train()
    wall, cpu = timer.clock.durations()
    return wall[opts.warmup :], cpu[opts.warmup :]


def run_lockstep(
    sides: list[str], recipe: Any, model_kind: str, data: Dataset, opts: argparse.Namespace, log_every: int
) -> list[tuple[list[float], list[float]]]:
    """Trainers for ``sides`` (e.g. baseline, ours) in lockstep threads; each one's measured wall and CPU seconds."""
    bh.reset_accelerate()
    names = [f"{i}:{s}" for i, s in enumerate(sides)]
    turns = bh.Turns(names)
    timers = [ClockCallback(bh.LockstepClock(n, turns)) for n in names]
    trainers = [
        build_trainer(s, recipe, model_kind, data, opts, log_every, t, os.path.join(opts.workdir, n.replace(":", "_")))
        for s, t, n in zip(sides, timers, names)
    ]
    bh.run_in_lockstep(turns, {n: tr.train for n, tr in zip(names, trainers)})
    out = []
    for t in timers:
        wall, cpu = t.clock.durations()
        out.append((wall[opts.warmup :], cpu[opts.warmup :]))
    return out
