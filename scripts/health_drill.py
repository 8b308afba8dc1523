"""Health drill: train the tiny Llama with Trainer + recipe.callbacks() and inject faults, then write the run report.

Faults are injected from a TrainerCallback, so the recipe's monitoring sees them exactly as it would see real
ones: --overflow-at makes one weight's gradient inf during the backward of the given optimizer steps (an FP16
overflow: the GradScaler halves the scale and the step is skipped); --nan-loss-at makes the loss NaN at the
given steps; --outlier-at makes 8 input features of one FP8 layer huge (3e4) from that step on (an activation
outlier that saturates E4M3). The model is the tiny Llama (hidden 64, 2 blocks, byte-level vocabulary), so a
drill takes seconds to a minute on a CPU.

At the end it writes health.json and the PNG plots into --output-dir (hf_mixedprec.training.run_report.write_run_report)
and prints the same summary as `hf-mixedprec report`. A run stopped by a health reaction leaves a checkpoint in
--output-dir; continue it with --resume CHECKPOINT (e.g. under the BF16 recipe the stop message names).

    python scripts/health_drill.py --recipe v100-fp16 --rehearse --overflow-at 20-60 --steps 60
    python scripts/health_drill.py --recipe cpu-bf16 --resume runs/health_drill/checkpoint-27 --steps 60 \\
        --output-dir runs/health_drill_resumed
"""

from __future__ import annotations

import hf_mixedprec  # first: it quiets known backend noise before transformers imports torchao

# isort: split

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import PrinterCallback, Trainer, TrainerCallback

from hf_mixedprec.core.demo import builtin_text, byte_batches, tiny_llama
from hf_mixedprec.integrations.trainer import runtime_of
from hf_mixedprec.training.run_report import HEALTH_FILE, summarize, write_run_report


class ByteRows(Dataset):
    """Byte sequences cut from the built-in text (labels = inputs, as for causal LM)."""

    def __init__(self, n: int, seq_len: int, seed: int):
        batches = byte_batches(builtin_text(), seq_len=seq_len, batch_size=1, n_batches=n, seed=seed)
        self.rows = [b[0] for b in batches]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class Overflow(TrainerCallback):
    """inf gradients for one weight (model.layers.0.mlp.down_proj) during the given optimizer steps (1-based)."""

    def __init__(self, steps: set[int]):
        self.steps, self.armed = steps, False

    def on_train_begin(self, args, state, control, model=None, **kw):
        weight = model.get_submodule("model.layers.0.mlp.down_proj").weight
        weight.register_hook(lambda g: torch.full_like(g, float("inf")) if self.armed else g)

    def on_step_begin(self, args, state, control, **kw):
        self.armed = state.global_step + 1 in self.steps


class NanLoss(TrainerCallback):
    """The model's loss is NaN during the given optimizer steps (1-based), as bad data or a bad kernel would make it."""

    def __init__(self, steps: set[int]):
        self.steps, self.armed = steps, False

    def on_train_begin(self, args, state, control, model=None, **kw):
        def hook(module, inputs, output):
            if self.armed and module.training:
                output.loss = output.loss * float("nan")
            return output

        model.register_forward_hook(hook, prepend=True)  # before the recipe's own hook reads the loss

    def on_step_begin(self, args, state, control, **kw):
        self.armed = state.global_step + 1 in self.steps


class Outlier(TrainerCallback):
    """From optimizer step ``at`` on, 8 input features of ``layer`` are set to 3e4 (an activation outlier)."""

    def __init__(self, layer: str, at: int):
        self.layer, self.at, self.on = layer, at, False

    def on_train_begin(self, args, state, control, model=None, **kw):
        def pre(module, inputs):
            if not self.on:
                return None
            x = inputs[0].clone()
            x[..., :8] = 3e4
            return (x, *inputs[1:])

        model.get_submodule(self.layer).register_forward_pre_hook(pre)

    def on_step_begin(self, args, state, control, **kw):
        self.on = state.global_step + 1 >= self.at


def parse_steps(text: str) -> set[int]:
    """'5,10-12' -> {5, 10, 11, 12}."""
    steps: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            steps.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of steps (allowed: e.g. 5,10-12)") from None
    if not steps or min(steps) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: steps start at 1")
    return steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="v100-fp16", help="recipe name or YAML (default v100-fp16)")
    ap.add_argument("--rehearse", action="store_true", help="rehearse a recipe this machine cannot run natively")
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps (default 60)")
    ap.add_argument(
        "--overflow-at", type=parse_steps, metavar="STEPS", help="inf gradients at these steps, e.g. 5,20-25"
    )
    ap.add_argument("--nan-loss-at", type=parse_steps, metavar="STEPS", help="a NaN loss at these steps, e.g. 7")
    ap.add_argument("--outlier-at", type=int, metavar="STEP", help="FP8 recipes: an input outlier from this step on")
    ap.add_argument(
        "--outlier-layer",
        default="model.layers.1.mlp.down_proj",
        metavar="NAME",
        help="the layer that gets the outlier (default model.layers.1.mlp.down_proj)",
    )
    ap.add_argument("--resume", metavar="CHECKPOINT", help="continue from this checkpoint (e.g. after a health stop)")
    ap.add_argument("--output-dir", default="runs/health_drill", help="default runs/health_drill")
    ap.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate (default 2e-3)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    recipe = hf_mixedprec.load_recipe(args.recipe, rehearse=True if args.rehearse else None)
    model = tiny_llama(seed=args.seed)
    training_args = recipe.training_args(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=4,
        learning_rate=args.lr,
        logging_steps=1,
        save_strategy="steps",  # only a health stop saves (save_steps is out of reach)
        save_steps=10**9,
        report_to=[],
        seed=args.seed,
        disable_tqdm=True,
    )
    drills: list[TrainerCallback] = []
    if args.overflow_at:
        drills.append(Overflow(args.overflow_at))
    if args.nan_loss_at:
        drills.append(NanLoss(args.nan_loss_at))
    if args.outlier_at:
        drills.append(Outlier(args.outlier_layer, args.outlier_at))
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=ByteRows(args.steps * 4, seq_len=64, seed=args.seed),
        callbacks=[*drills, *recipe.callbacks()],
    )
    trainer.remove_callback(PrinterCallback)  # the summary below replaces Trainer's per-step dicts
    trainer.train(resume_from_checkpoint=args.resume)
    runtime = runtime_of(model)
    files = write_run_report(args.output_dir, log_history=trainer.state.log_history, runtime=runtime)
    doc = json.loads((Path(args.output_dir) / HEALTH_FILE).read_text())
    for line in summarize(doc)["lines"]:
        print(line)
    for f in files:
        print(f"wrote: {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
