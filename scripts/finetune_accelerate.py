"""Fine-tune a causal LM with a hand-written Accelerate loop; the recipe comes in through the plugin.

The only hf_mixedprec lines are `recipe = hf_mixedprec.load_recipe(...)` and `accelerator = recipe.accelerator()`;
the loop is plain Accelerate (`prepare`, `backward`, `clip_grad_norm_`, `step`).

    python scripts/finetune_accelerate.py --recipe cpu-bf16 --max-steps 30
    python scripts/finetune_accelerate.py --recipe h100-fp8-delayed --rehearse --max-steps 30
    hf-mixedprec launch --recipe cpu-bf16 --num-processes 2 scripts/finetune_accelerate.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import hf_mixedprec
from hf_mixedprec.core.demo import builtin_text, byte_batches, tiny_llama


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", help="recipe name or YAML (default: the launcher's, else auto)")
    ap.add_argument("--rehearse", action="store_true", help="rehearse a recipe this machine cannot run natively")
    ap.add_argument("--output-dir", default="runs/finetune_accelerate")
    ap.add_argument("--max-steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    recipe = hf_mixedprec.load_recipe(args.recipe, rehearse=True if args.rehearse else None)
    accelerator = recipe.accelerator()
    torch.manual_seed(args.seed)
    model = tiny_llama(seed=args.seed)
    batches = byte_batches(
        builtin_text(), seq_len=args.seq_len, batch_size=1, n_batches=args.max_steps * args.batch_size
    )
    loader = DataLoader([b[0] for b in batches], batch_size=args.batch_size, shuffle=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    history = []
    model.train()
    for step, ids in enumerate(loader, start=1):
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step % args.log_every == 0 or step == 1:
            row = {"step": step, "loss": accelerator.gather(loss.detach()).mean().item(), **accelerator.mp_metrics()}
            history.append(row)
            accelerator.print(row)
    if accelerator.is_main_process:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "history.json").write_text(
            json.dumps({"recipe": recipe.name, "notes": accelerator.mp.notes, "history": history}, indent=1)
        )


if __name__ == "__main__":
    main()
