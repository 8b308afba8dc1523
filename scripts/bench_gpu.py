"""Training throughput and peak memory of a ~1.1B Llama in every precision, side by side in one run.

Model: a Llama with TinyLlama-1.1B's shapes (hidden 2048, 22 layers, 32 heads, 4 KV heads, intermediate 5632,
vocab 32000, untied embeddings; 1,100,048,384 parameters, counted and printed at run time), built from its
config with random weights (no download). Same batch, sequence length and data for every variant; AdamW
(fused on CUDA), gradient clipping at 1.0, ``--warmup`` steps excluded (they include torch.compile), then
``--steps`` timed steps (the device is synchronized after each). Variants:

- ``fp32``: no autocast (torch's default matmul precision, TF32 off);
- ``bf16``: ``torch.autocast(bfloat16)``, FP32 master weights; ``bf16-compile``: the same under torch.compile,
  the reference for the torchao FP8 rows, which are compiled too;
- ``fp16``: ``torch.autocast(float16)`` + ``torch.amp.GradScaler``;
- ``fp8-torchao-tensorwise`` / ``fp8-torchao-rowwise``: torchao float8 training
  (``convert_to_float8_training`` with ``Float8LinearConfig.from_recipe_name(...)``, lm_head kept in BF16),
  under BF16 autocast and torch.compile; needs CUDA with compute capability >= 8.9;
- ``fp8-emulated``: hf_mixedprec's emulated FP8 (``hf_mixedprec.fp8.convert(model, recipe, backend="emulated")``,
  recipe ``h100-fp8-current``): exact FP8 numerics with FP32 GEMMs, a reference for what rehearsal costs;
- ``accel-bf16`` / ``accel-bf16-hf_mixedprec``: the callback overhead: the same hand-written Accelerate loop
  (``accelerator.backward``, ``accelerator.clip_grad_norm_(params, 1.0)``, ``optimizer.step()``) with a plain
  ``accelerate.Accelerator(mixed_precision="bf16")`` and with ``hf_mixedprec``'s ``make_accelerator(recipe)``
  (``a100-bf16`` on CUDA, ``cpu-bf16`` otherwise: ZClip, health detectors, guard GradScaler). Its row shows
  ms/step relative to the plain Accelerator.

A variant that cannot run here is a ``skipped`` row with the reason; one that fails is an ``error`` row with
the exception (the exit status is then 1). Memory is freed between variants. Each variant's training loop is in
``bench_gpu_variants.py``; timing, peak memory, the machine and the output are ``bench_harness.py``'s.

    python scripts/bench_gpu.py                                   # on a CUDA GPU
    python scripts/bench_gpu.py --variants bf16 fp8-torchao-tensorwise --steps 20 --out gpu.json
    python scripts/bench_gpu.py --dry-run                         # tiny config, few steps, CPU is fine
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import Any

import bench_harness as bh
import torch
from bench_gpu_variants import LLAMA_1B, REFERENCE, RUNNERS, TINY, VARIANTS, Ctx


# -- driver -------------------------------------------------------------------------------------------
def run_variant(key: str, ctx: Ctx, tokens_per_step: int) -> dict[str, Any]:
    row: dict[str, Any] = {
        "key": key,
        "variant": VARIANTS[key],
        "status": "ok",
        "reason": None,
        "compiled": False,
        "notes": [],
        "tokens_per_s": None,
        "ms_per_step_median": None,
        "ms_per_step_mean": None,
        "peak_mem_gib": None,
        "steps": 0,
    }
    bh.release_memory(ctx.device)
    from torch._dynamo.utils import counters

    counters.clear()  # the graph breaks torch.compile meets in this row (warm-up and timed steps)
    t0 = time.perf_counter()
    with bh.row_outcome(row):
        times = RUNNERS[key](ctx, row)
        med = statistics.median(times)
        row.update(
            tokens_per_s=tokens_per_step / med,
            ms_per_step_median=med * 1e3,
            ms_per_step_mean=statistics.fmean(times) * 1e3,
            steps=len(times),
        )
        row["peak_mem_gib"] = bh.cuda_peak_gib(ctx.device)
    row["wall_s"] = time.perf_counter() - t0
    row["graph_breaks"] = sum(counters["graph_break"].values()) if row["compiled"] else None
    if row["graph_breaks"] is not None:
        row["notes"].append(f"{row['graph_breaks']} graph breaks")
    bh.release_memory(ctx.device)
    print(f"  {key}: {row['status']} ({row['wall_s']:.1f} s)", file=sys.stderr)
    return row


def relative(rows: list[dict[str, Any]]) -> None:
    """Each row's speed relative to its reference row (bf16 autocast, or the row in REFERENCE)."""
    by_key = {r["key"]: r for r in rows}
    for r in rows:
        ref_key = REFERENCE.get(r["key"], "bf16")
        ref = by_key.get(ref_key)
        r["reference"] = ref_key
        r["speed_vs_reference"] = None
        if r["status"] == "ok" and ref is not None and ref["status"] == "ok":
            r["speed_vs_reference"] = r["tokens_per_s"] / ref["tokens_per_s"]


def machine(device: torch.device) -> dict[str, Any]:
    """``bench_harness.machine`` with the library versions; on a CPU ``device`` names the CPU too."""
    out = bh.machine(device, libraries=("transformers", "accelerate", "torchao"))
    if device.type != "cuda":
        out["device"] = f"cpu ({out['cpu']})"
    return out


def table(rows: list[dict[str, Any]]) -> str:
    header = ["variant", "status", "tokens/s", "ms/step (median)", "peak mem GiB", "speed vs reference", "notes"]
    cells = []
    for r in rows:
        if r["status"] != "ok":
            cells.append([r["variant"], r["status"], "–", "–", "–", "–", r["reason"]])
            continue
        mem = f"{r['peak_mem_gib']:.2f}" if r["peak_mem_gib"] is not None else "n/a (CPU)"
        rel = (
            f"{r['speed_vs_reference']:.2f}x vs {VARIANTS[r['reference']]}"
            if r["speed_vs_reference"] is not None and r["reference"] != r["key"]
            else "–"
        )
        speed = [f"{r['tokens_per_s']:,.0f}", f"{r['ms_per_step_median']:.1f}"]
        cells.append([r["variant"], "ok", *speed, mem, rel, "; ".join(r["notes"])])
    return bh.md_table(header, "llrrrll", cells)


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line, with the defaults of a full or a dry run filled in."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS), metavar="NAME")
    ap.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 8; dry run 2)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 1024; dry run 64)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per variant (default 10; dry run 3)")
    ap.add_argument(
        "--warmup", type=int, default=None, help="untimed steps first, compile included (default 3; dry run 1)"
    )
    ap.add_argument("--dry-run", action="store_true", help="tiny config, few steps, any device: checks the script only")
    ap.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default: cores; 1 for a dry run on CPU)"
    )
    ap.add_argument("--json", action="store_true", help="print the results as JSON on stdout instead of the table")
    ap.add_argument("--out", metavar="FILE", help="also write the results as JSON to FILE")
    opts = ap.parse_args(argv)
    dry = opts.dry_run
    opts.batch_size = opts.batch_size or (2 if dry else 8)
    opts.seq_len = opts.seq_len or (64 if dry else 1024)
    opts.steps = opts.steps or (3 if dry else 10)
    opts.warmup = opts.warmup if opts.warmup is not None else (1 if dry else 3)
    return opts


def count_parameters(config: dict[str, Any]) -> int:
    """Parameters of the Llama ``config`` describes (built on the meta device: no memory, no time)."""
    with torch.device("meta"):
        from transformers import LlamaConfig, LlamaForCausalLM

        return sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**config)).parameters())


def measure(opts: argparse.Namespace, device: torch.device) -> tuple[dict[str, Any], str]:
    """Every variant asked for; the JSON document and the heading line."""
    from hf_mixedprec.core.demo import builtin_text, byte_batches

    dry, batch, seq, steps, warmup = opts.dry_run, opts.batch_size, opts.seq_len, opts.steps, opts.warmup
    config = dict(TINY if dry else LLAMA_1B)
    if seq > config["max_position_embeddings"]:
        config["max_position_embeddings"] = seq
    data = byte_batches(builtin_text(), seq_len=seq, batch_size=batch, n_batches=min(warmup + steps, 8))
    ctx = Ctx(device, dry, config, [b.to(device) for b in data], warmup, steps)
    n_params = count_parameters(config)
    label = "tiny dry-run config" if dry else "Llama ~1.1B (TinyLlama shapes)"
    head = (
        f"{label}: {n_params:,} parameters; batch {batch} x {seq} tokens; {warmup} warm-up + {steps} timed steps "
        f"per variant; device {device}"
    )
    print(head, file=sys.stderr)
    if dry:
        print("DRY RUN: tiny config, not a performance figure", file=sys.stderr)
    rows = [run_variant(k, ctx, batch * seq) for k in dict.fromkeys(opts.variants)]
    relative(rows)
    by_key = {r["key"]: r for r in rows}
    overhead = None
    plain, ours = by_key.get("accel-bf16"), by_key.get("accel-bf16-hf_mixedprec")
    if plain and ours and plain["status"] == ours["status"] == "ok":
        overhead = ours["ms_per_step_median"] / plain["ms_per_step_median"]
    doc = {
        "dry_run": dry,
        "machine": machine(device),
        "model": {"config": config, "parameters": n_params},
        "settings": {"batch_size": batch, "seq_len": seq, "steps": steps, "warmup": warmup},
        "callback_overhead_ratio": overhead,
        "rows": rows,
    }
    return doc, head


def render(doc: dict[str, Any], head: str) -> str:
    """The heading, the machine line, the table and the callback overhead, as printed without --json."""
    m, overhead = doc["machine"], doc["callback_overhead_ratio"]
    lines = [
        ("DRY RUN (tiny config, not a performance figure). " if doc["dry_run"] else "") + head,
        f"{m['device']}, torch {m['torch']}, torchao {m['torchao'] or 'not installed'}",
        table(doc["rows"]),
    ]
    if overhead is not None:
        lines.append(f"\nhf_mixedprec callback overhead (Accelerate loop, bf16): {overhead:.3f}x ms/step of plain")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # a tiny model gains nothing from more CPU threads, and on a shared machine OpenMP's waits between them
    # made dry-run steps up to 100x slower and erratic
    bh.set_threads(opts.threads or (1 if opts.dry_run and device.type == "cpu" else os.cpu_count() or 1))
    if device.type != "cuda" and not opts.dry_run:
        print(
            "bench_gpu.py: no CUDA GPU here; a ~1.1B model on CPU would take hours. Run it on a GPU, or use "
            "--dry-run to check the script on a tiny config",
            file=sys.stderr,
        )
        return 2
    bh.quiet()
    with bh.stdout_to_stderr():  # stdout carries the results only
        doc, head = measure(opts, device)
    bh.report(doc, out=opts.out, as_json=opts.json, render=lambda: render(doc, head))
    rows, overhead = doc["rows"], doc["callback_overhead_ratio"]
    bad = [r for r in rows if r["status"] == "error"]
    if overhead is not None and not math.isfinite(overhead):
        bad.append(next(r for r in rows if r["key"] == "accel-bf16-hf_mixedprec"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
