"""Host-device syncs per training step on a CUDA GPU, counted by origin: hf_mixedprec's code vs everyone else's.

Runs a Hugging Face ``Trainer`` on a small Llama (random weights, built from a config) for each recipe twice,
one after the other in one process: a plain Trainer at the recipe's precision (baseline) and the same Trainer
with the recipe's ``training_args`` and ``callbacks()``. During every step that does not log (Trainer logs
every ``--logging-steps``), ``torch.cuda.set_sync_debug_mode("warn")`` is on, so torch warns at each
synchronizing CUDA call (``.item()``, a device-to-host copy, ``nonzero``...). Each warning is attributed to the
innermost Python frame of the stack that lies in a named package (``hf_mixedprec``, ``transformers``,
``accelerate``, ``torch``). The promise checked: **0 syncs from hf_mixedprec on a step that does not log**.
Logging steps are counted apart (there hf_mixedprec reads its metrics on purpose).

    python scripts/gpu_sync_check.py                      # a100-bf16, v100-fp16, h100-fp8-current (rehearsed)
    python scripts/gpu_sync_check.py --recipes a100-bf16 --steps 40 --json

Needs a CUDA GPU; exits 2 without one. Exit status 1 when hf_mixedprec synced on a non-logging step.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import bench_harness as bh
import torch

PACKAGES = ("hf_mixedprec", "accelerate", "transformers", "torch")
SMALL_LLAMA: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "max_position_embeddings": 1024,
}


def _origin(stack: list[traceback.FrameSummary]) -> str:
    """Whose sync it is: the innermost frame of hf_mixedprec or transformers decides (a sync inside torch or
    accelerate called by hf_mixedprec is hf_mixedprec's; one made by Trainer's own code is transformers', also
    where Trainer itself was called through hf_mixedprec's ``Trainer.train`` wrapper, which is further out on the
    stack); with neither on the stack, the innermost frame of accelerate or torch, else "other"."""
    for frame in reversed(stack):
        path = frame.filename.replace("\\", "/")
        for pkg in ("hf_mixedprec", "transformers"):
            if f"/{pkg}/" in path:
                return pkg
    for frame in reversed(stack):
        path = frame.filename.replace("\\", "/")
        for pkg in PACKAGES[1:]:
            if f"/{pkg}/" in path:
                return pkg
    return "other"


def _fp8_label(fp8_side: bool, rehearse: bool) -> str:
    """How an FP8 recipe's side ran (a plain Trainer's baseline runs no FP8: no label)."""
    if not fp8_side:
        return ""
    return " (rehearsed)" if rehearse else " (real FP8)"


class SyncLog:
    """Synchronizing CUDA calls counted by origin in the phase they happen in (``non_logging``, ``logging``, or
    ``None``: not counted); :meth:`hook` takes torch's sync warnings in place of ``warnings.showwarning``."""

    def __init__(self) -> None:
        self.counts: dict[str, collections.Counter] = {
            "non_logging": collections.Counter(),
            "logging": collections.Counter(),
        }
        self.where: collections.Counter = collections.Counter()
        self.phase: str | None = None

    def hook(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message) or self.phase is None:
            return
        stack = traceback.extract_stack()[:-1]
        origin = _origin(stack)
        self.counts[self.phase][origin] += 1
        if origin == "hf_mixedprec" and self.phase == "non_logging":
            frame = next(f for f in reversed(stack) if "/hf_mixedprec/" in f.filename.replace("\\", "/"))
            self.where[f"{frame.filename.split('hf_mixedprec/')[-1]}:{frame.lineno} {frame.name}"] += 1


def _phase_callback(log: SyncLog, logging_steps: int) -> Any:
    """A TrainerCallback that turns torch's sync warnings on for each step (and says whether it logs)."""
    from transformers import TrainerCallback

    class Phases(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            logs = (state.global_step + 1) % logging_steps == 0
            log.phase = "logging" if logs else "non_logging"
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")

        def on_step_end(self, args, state, control, **kw):
            torch.cuda.set_sync_debug_mode(0)
            log.phase = None

    return Phases()


class _Rows(torch.utils.data.Dataset):
    """Random token rows (labels = inputs), the same for every run."""

    def __init__(self, n: int, seq: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, SMALL_LLAMA["vocab_size"], (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def _train_counted(log: SyncLog, build: Callable[[], Any]) -> Any:
    """Build the Trainer and train it with every warning sent to ``log`` (torch's sync warnings counted, the rest
    dropped); the Trainer."""
    old = warnings.showwarning
    warnings.showwarning = log.hook
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = log.hook
            trainer = build()
            trainer.train()
    finally:
        warnings.showwarning = old
        torch.cuda.set_sync_debug_mode(0)
    return trainer


def run_one(
    recipe_name: str,
    use_recipe: bool,
    steps: int,
    logging_steps: int,
    batch: int,
    seq: int,
    *,
    rehearse: bool | None = None,
) -> dict:
    """One Trainer run, its syncs per step counted by origin. ``rehearse``: run an FP8 recipe's emulated layers
    (default: yes, for an FP8 recipe) or its real backend (``False``: ``auto`` picks torchao without TE)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from hf_mixedprec.integrations.recipe import load_recipe_file

    recipe = load_recipe_file(recipe_name)
    if rehearse is None:
        rehearse = recipe.precision == "fp8"
    if rehearse:
        recipe = recipe.rehearsed()
    log = SyncLog()
    bh.seed_all(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL_LLAMA))
    common = dict(
        output_dir="/tmp/gpu_sync_check",
        max_steps=steps,
        per_device_train_batch_size=batch,
        logging_steps=logging_steps,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        dataloader_pin_memory=True,
    )
    callbacks = [_phase_callback(log, logging_steps)]
    if use_recipe:
        args = recipe.training_args(**common)
        callbacks += recipe.callbacks()
    else:
        fp16 = recipe.precision == "fp16"
        args = TrainingArguments(**common, bf16=not fp16, fp16=fp16)
    data = _Rows(steps * batch, seq)
    trainer = _train_counted(log, lambda: Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks))
    n_log = steps // logging_steps
    return {
        "recipe": recipe_name + _fp8_label(recipe.precision == "fp8" and use_recipe, rehearse),
        "side": "hf_mixedprec" if use_recipe else "plain Trainer",
        "steps_non_logging": steps - n_log,
        "steps_logging": n_log,
        "non_logging": dict(log.counts["non_logging"]),
        "logging": dict(log.counts["logging"]),
        "hf_mixedprec_non_logging_sites": dict(log.where),
        "final_loss": next((h["loss"] for h in reversed(trainer.state.log_history) if "loss" in h), None),
    }


def table(rows: list[dict]) -> str:
    """Syncs per step by origin, on steps that do not log and on those that do."""
    header = ["recipe", "side", "non-logging steps", "syncs/step there: hf_mixedprec", "others"]
    header += ["logging steps: hf_mixedprec", "others"]
    cells = []
    for r in rows:
        nl, lg = r["non_logging"], r["logging"]
        ours_nl = nl.get("hf_mixedprec", 0) / max(r["steps_non_logging"], 1)
        others_nl = (sum(nl.values()) - nl.get("hf_mixedprec", 0)) / max(r["steps_non_logging"], 1)
        ours_lg = lg.get("hf_mixedprec", 0) / max(r["steps_logging"], 1)
        others_lg = (sum(lg.values()) - lg.get("hf_mixedprec", 0)) / max(r["steps_logging"], 1)
        shares = [f"{x:.2f}" for x in (ours_nl, others_nl, ours_lg, others_lg)]
        cells.append([r["recipe"], r["side"], r["steps_non_logging"], *shares])
    return bh.md_table(header, "llrrrrr", cells)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipes", nargs="+", default=["a100-bf16", "v100-fp16", "h100-fp8-current"])
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps per run (default 30)")
    ap.add_argument("--logging-steps", type=int, default=10, help="Trainer's logging_steps (default 10)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_sync_check: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    rows = []
    for name in a.recipes:
        for use in (False, True):
            rows.append(run_one(name, use, a.steps, a.logging_steps, a.batch_size, a.seq_len))
    if a.json:
        print(json.dumps(rows, indent=1))
    m = bh.machine()
    print(f"{m['device']}, torch {m['torch']}; syncs per step, by origin")
    print(table(rows))
    for r in rows:
        if r["hf_mixedprec_non_logging_sites"]:
            print(f"hf_mixedprec syncs on non-logging steps ({r['recipe']}): {r['hf_mixedprec_non_logging_sites']}")
    return 1 if any(r["non_logging"].get("hf_mixedprec", 0) > 0 for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
