"""Fine-tune a causal LM with an unchanged Hugging Face Trainer plus one line: callbacks=recipe.callbacks().

Runs anywhere: the default model is a small Llama built from a config and the data is prose from Python's
own docstrings (byte-level tokens), so nothing is downloaded. Under `hf-mixedprec launch` the recipe comes
from the launcher; otherwise from --recipe (default: auto).

    python scripts/finetune_trainer.py --recipe cpu-bf16 --max-steps 30
    python scripts/finetune_trainer.py --recipe v100-fp16 --rehearse --max-steps 30
    hf-mixedprec launch --recipe cpu-bf16 --num-processes 2 scripts/finetune_trainer.py --max-steps 20
"""

from __future__ import annotations

import hf_mixedprec  # first: it quiets known backend noise before transformers imports torchao

# isort: split

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback

from hf_mixedprec.core.demo import builtin_text, byte_batches, tiny_llama


class ByteDataset(Dataset):
    """Fixed-length byte sequences cut from the built-in text (labels = inputs, as for causal LM)."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int = 0):
        self.rows = [
            b[0] % vocab for b in byte_batches(builtin_text(), seq_len=seq_len, batch_size=1, n_batches=n, seed=seed)
        ]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class InjectOverflow(TrainerCallback):
    """Fault-injection drill: make one weight's gradient inf during optimizer step ``at`` (1-based) on one rank."""

    def __init__(self, at: int, rank: int | None):
        self.at, self.rank, self.armed = at, rank, False

    def on_train_begin(self, args, state, control, model=None, **kw):
        weight = next(p for n, p in model.named_parameters() if n.endswith("down_proj.weight"))
        weight.register_hook(lambda g: torch.full_like(g, float("inf")) if self.armed else g)

    def on_step_begin(self, args, state, control, **kw):
        here = self.rank is None or int(os.environ.get("RANK", "0")) == self.rank
        self.armed = here and state.global_step + 1 == self.at


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", help="recipe name or YAML (default: the launcher's, else auto)")
    ap.add_argument("--rehearse", action="store_true", help="rehearse a recipe this machine cannot run natively")
    ap.add_argument("--model", help="a local save_pretrained folder (default: a small Llama from a config)")
    ap.add_argument("--output-dir", default="runs/finetune_trainer")
    ap.add_argument("--max-steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: no checkpoints)")
    ap.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --output-dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--inject-overflow-at", type=int, metavar="STEP", help="drill: inf gradients at this step")
    ap.add_argument("--inject-rank", type=int, metavar="R", help="drill: only on this rank (default: all)")
    args = ap.parse_args()

    recipe = hf_mixedprec.load_recipe(args.recipe, rehearse=True if args.rehearse else None)
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, local_files_only=True)
    else:
        model = tiny_llama(seed=args.seed)
    train = ByteDataset(args.max_steps * args.batch_size * 8, args.seq_len, model.config.vocab_size, seed=args.seed)
    training_args = recipe.training_args(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        logging_steps=1,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to=[],
        seed=args.seed,
        disable_tqdm=True,
    )
    drills = [InjectOverflow(args.inject_overflow_at, args.inject_rank)] if args.inject_overflow_at else []
    trainer = Trainer(model=model, args=training_args, train_dataset=train, callbacks=[*drills, *recipe.callbacks()])
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    rank = int(os.environ.get("RANK", "0"))
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"log_history.rank{rank}.json").write_text(json.dumps(trainer.state.log_history, indent=1))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # every rank has written its log: wait for the others, then tear gloo down before interpreter exit
        # (a rank that destroys its group while a peer is still in a collective can abort in gloo)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        # CPU/gloo with torch 2.13: about 1 run in 10, a rank aborted during interpreter teardown after this point
        # ("terminate called without an active exception"), failing a finished run; everything is written,
        # so leave without the teardown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
