"""Step time and memory of FSDP2 on 2 ranks against one process, per recipe kind, on the same global batches.

Runs ``hf-mixedprec finetune`` in one process (global batch B) and ``hf-mixedprec launch --num-processes 2
hf_mixedprec/cli/finetune.py`` with ``distributed.strategy: fsdp2`` (B/2 per rank), side by side in one invocation, and
prints a Markdown table: training seconds (the Trainer's own train loop), tokens per second, each process's peak RSS
(on a CPU) and the last loss.

    .venv/bin/python scripts/bench_fsdp2.py --steps 20 --batch-size 8 --seq-len 128
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import bench_harness as bh

ROOT = Path(__file__).resolve().parents[1]
#: kind -> (base recipe, extra recipe lines, rehearse, keys for the sharded run's distributed section)
KINDS = {
    "bf16": ("cpu-bf16", "", False, ""),
    "fp16": ("v100-fp16", "", True, ""),
    "fp8-delayed (emulated)": ("h100-fp8-delayed", "", True, ""),
    "fp8 torchao + FP8 all-gather": ("h100-fp8-current", "fp8: {backend: torchao}\n", True, ", fp8_all_gather: true"),
}


def _run(cmd: list[str], cwd: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=1800)
    if res.returncode != 0:
        sys.exit(f"failed ({res.returncode}): {' '.join(cmd)}\n{res.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps per run (default 20)")
    ap.add_argument("--batch-size", type=int, default=8, help="global batch (each of the 2 ranks takes half)")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per example (default 128)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated subset of: " + ", ".join(KINDS))
    args = ap.parse_args()
    if args.batch_size % 2:
        ap.error(f"--batch-size: {args.batch_size} is odd (allowed: an even global batch, split over 2 ranks)")
    kinds = [k.strip() for k in args.kinds.split(",")]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        ap.error(f"--kinds: {unknown[0]!r} is not a kind (allowed: {', '.join(KINDS)})")
    common = ["--max-steps", str(args.steps), "--save-steps", str(args.steps), "--seq-len", str(args.seq_len)]
    common += ["--eval-split", "0"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for kind in kinds:
            base, extra, rehearse, sharded = KINDS[kind]
            body = f"extends: {base}\n{extra}"
            slug = str(len(rows))
            (tmp / f"one{slug}.yaml").write_text(f"name: one{slug}\n{body}")
            (tmp / f"two{slug}.yaml").write_text(f"name: two{slug}\n{body}distributed: {{strategy: fsdp2{sharded}}}\n")
            reh = ["--rehearse"] if rehearse else []
            one_dir, two_dir = tmp / f"one{slug}", tmp / f"two{slug}"
            _run(
                [sys.executable, "-m", "hf_mixedprec", "finetune", "--recipe", str(tmp / f"one{slug}.yaml"), *reh,
                 *common, "--batch-size", str(args.batch_size), "--output-dir", str(one_dir)], tmp,
            )  # fmt: skip
            _run(
                [sys.executable, "-m", "hf_mixedprec", "launch", "--recipe", str(tmp / f"two{slug}.yaml"),
                 "--num-processes", "2", *reh, str(ROOT / "hf_mixedprec" / "cli" / "finetune.py"), *common,
                 "--batch-size", str(args.batch_size // 2), "--output-dir", str(two_dir)], tmp,
            )  # fmt: skip
            one = json.loads((one_dir / "summary.json").read_text())
            two = json.loads((two_dir / "summary.json").read_text())
            rows.append((kind, one, two))
    print(f"{args.steps} steps, global batch {args.batch_size} x {args.seq_len} tokens, same batches in both runs\n")
    print(table(rows))


def table(rows: list[tuple[str, dict, dict]]) -> str:
    """Per kind: seconds, tokens/s and peak MiB of the one-process and the 2-rank run, their time ratio, last losses."""
    header = ["recipe kind", "1 process: s / tok/s / peak MiB", "2 FSDP2 ranks: s / tok/s / peak MiB per rank"]
    header += ["time ratio 2/1", "last loss 1 / 2"]
    cells = []
    for kind, one, two in rows:
        ratio = two["train_seconds"] / one["train_seconds"]
        cells.append(
            [
                kind,
                f"{one['train_seconds']:.2f} / {one['tokens_per_s']:.0f} / {one['peak_memory_mib']:.0f}",
                f"{two['train_seconds']:.2f} / {two['tokens_per_s']:.0f} / {two['peak_memory_mib']:.0f}",
                f"{ratio:.2f}",
                f"{one['loss_last']:.4f} / {two['loss_last']:.4f}",
            ]
        )
    return bh.md_table(header, "lllll", cells)


if __name__ == "__main__":
    main()
