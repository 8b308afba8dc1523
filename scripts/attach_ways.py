"""Every way of attaching a recipe to a Hugging Face Trainer, each run for a few steps on the tiny Llama.

    python scripts/attach_ways.py                                   # cpu-bf16
    python scripts/attach_ways.py --recipe v100-fp16 --rehearse

For each way it prints the Trainer's last training log row (Trainer's own keys and the recipe's `mp/` keys in
one row) and whether the weights moved. The ways, as docs/quickstart.md describes them:

- ``Trainer(callbacks=recipe.callbacks())``: installed at construction;
- ``trainer.add_callback(cb)`` for each of ``recipe.callbacks()``: installed when ``train()`` starts;
- ``trainer.add_callback(MixedPrecisionCallback)``, the class: its recipe comes from ``load_recipe()``
  (``HF_MIXEDPREC_RECIPE``, else ``auto``; ``HF_MIXEDPREC_REHEARSE=1`` rehearses);
- ``attach(trainer, recipe)``: installed at once, refusals raised there.

Each Trainer computes its loss outside the model (label smoothing), as many real scripts do.
"""

from __future__ import annotations

import hf_mixedprec  # first: it quiets known backend noise before transformers imports torchao

# isort: split

import argparse
import os
from collections.abc import Callable

import torch
from accelerate.state import AcceleratorState
from torch.utils.data import Dataset
from transformers import Trainer

from hf_mixedprec.core.demo import builtin_text, byte_batches, tiny_llama
from hf_mixedprec.integrations.recipe import RECIPE_ENV
from hf_mixedprec.integrations.trainer import MixedPrecisionCallback, attach


class Bytes(Dataset):
    def __init__(self, n: int = 64, seq_len: int = 64):
        self.rows = [b[0] for b in byte_batches(builtin_text(), seq_len=seq_len, batch_size=1, n_batches=n)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="cpu-bf16", help="recipe name or YAML (default: cpu-bf16)")
    ap.add_argument("--rehearse", action="store_true", help="rehearse a recipe this machine cannot run natively")
    ap.add_argument("--max-steps", type=int, default=4)
    ap.add_argument("--output-dir", default="runs/attach_ways")
    args = ap.parse_args()
    recipe = hf_mixedprec.load_recipe(args.recipe, rehearse=True if args.rehearse else None)
    targs = recipe.training_args(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=4,
        learning_rate=2e-3,
        logging_steps=args.max_steps,
        label_smoothing_factor=0.1,  # Trainer computes this loss itself, outside the model
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )

    def with_callbacks(model: torch.nn.Module) -> Trainer:
        return Trainer(model=model, args=targs, train_dataset=Bytes(), callbacks=recipe.callbacks())

    def add_instances(model: torch.nn.Module) -> Trainer:
        trainer = Trainer(model=model, args=targs, train_dataset=Bytes())
        for cb in recipe.callbacks():
            trainer.add_callback(cb)
        return trainer

    def add_class(model: torch.nn.Module) -> Trainer:
        os.environ[RECIPE_ENV] = args.recipe  # what `hf-mixedprec launch` exports
        if args.rehearse:
            os.environ["HF_MIXEDPREC_REHEARSE"] = "1"
        trainer = Trainer(model=model, args=targs, train_dataset=Bytes())
        trainer.add_callback(MixedPrecisionCallback)
        return trainer

    def attach_now(model: torch.nn.Module) -> Trainer:
        trainer = Trainer(model=model, args=targs, train_dataset=Bytes())
        attach(trainer, recipe)
        return trainer

    ways: dict[str, Callable[[torch.nn.Module], Trainer]] = {
        "Trainer(callbacks=recipe.callbacks())": with_callbacks,
        "trainer.add_callback(cb)": add_instances,
        "trainer.add_callback(MixedPrecisionCallback)": add_class,
        "attach(trainer, recipe)": attach_now,
    }
    for name, build in ways.items():
        AcceleratorState._reset_state(reset_partial_state=True)
        model = tiny_llama()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        trainer = build(model)
        trainer.train()
        moved = sum(not torch.equal(before[n], p.detach()) for n, p in model.named_parameters())
        row = next(r for r in reversed(trainer.state.log_history) if "loss" in r)
        shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
        print(f"{name}: {moved}/{len(before)} weight tensors moved; last log row: {shown}")


if __name__ == "__main__":
    main()
