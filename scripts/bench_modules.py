"""What ``modules:`` rules cost on the step path: nothing beyond the precision they choose.

Rules are resolved once, when the recipe is attached. On the step path the only thing a rule can add is a compute
region (an autocast region, or an FP32 region with its input casts) around the modules it names, and only where it
asks for a compute dtype other than the run's. Three choices train ``finetune``'s default model (the small Llama,
random weights, no download) under ``cpu-bf16`` from the same seed on the same byte batches:

- ``no rules``: ``modules: []``;
- ``rules, same precision``: rules that decide nothing new on this model and recipe (``compute: bf16`` on every
  MLP in a BF16 run, ``fp8: off`` on the first/last block in a recipe without FP8, the default MoE-router rule on a
  dense model): the policy's own cost, which should be none;
- ``fp32 MLPs``: ``{match: "*.mlp", compute: fp32}``: a real precision change (the MLP GEMMs in FP32 instead of
  BF16), what that precision costs.

Step time: the three run at once, in lockstep (``bench_harness.py``'s ``Turns``/``LockstepClock``: one thread per
Trainer, the turn handed on at every ``on_step_begin``); a step's time is its process CPU time; per round and choice
the ratio to ``no rules`` is the median of the per-step ratios; the table gives the median over ``--rounds`` rounds.
Tensor operations: one forward and backward of each choice's prepared model counted with a ``TorchDispatchMode`` (one
per aten call).

    python scripts/bench_modules.py                  # 4 rounds of 5 + 30 steps
    python scripts/bench_modules.py --rounds 8 --out modules.json
    python scripts/bench_modules.py --set fp8         # LM head / first-last blocks in or out of FP8 (emulated)
"""

from __future__ import annotations

# isort: split

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import bench_harness as bh
import torch
from bench_overhead_trainers import Bytes, ClockCallback
from bench_storage import recipe_trainer
from transformers import Trainer

ROOT = Path(__file__).resolve().parent.parent

#: ``--set fp8``: the FP8 recipes of docs/modules.md's compare (rehearsed: emulated FP8 on CPU, so what keeping a
#: layer out of FP8 saves here is emulation work, not what it costs on an FP8 GPU).
FP8_SET: dict[str, str] = {
    "fp8-all-layers": "examples/recipes/fp8-all-layers.yaml",
    "h100-fp8-current": "h100-fp8-current",
    "fp8-edges-kept": "examples/recipes/fp8-edges-kept.yaml",
}

CHOICES: dict[str, list[dict[str, Any]]] = {
    "no rules": [],
    "rules, same precision": [
        {"name": "router", "select": "moe_routers", "compute": "fp32", "required": False},
        {"name": "edges", "first_last_blocks": 1, "fp8": "off"},
        {"name": "mlp", "match": "*.mlp", "compute": "bf16"},
    ],
    "fp32 MLPs": [{"name": "mlp_fp32", "match": "*.mlp", "compute": "fp32"}],
}


def recipe_for(name: str) -> Any:
    from hf_mixedprec.integrations.recipe import load_recipe, resolve_recipe

    if name in FP8_SET:
        path = ROOT / FP8_SET[name]
        return load_recipe(str(path) if path.exists() else FP8_SET[name], rehearse=True)
    slug = name.replace(", ", "-").replace(" ", "-")
    return resolve_recipe({"name": f"cpu-bf16-{slug}", "extends": "cpu-bf16", "modules": CHOICES[name]})


def build_trainer(name: str, opts: argparse.Namespace, data: Any, callbacks: list[Any], workdir: str) -> Trainer:
    return recipe_trainer(recipe_for(name), opts, data, callbacks, workdir, lr=1e-3)


def op_count(trainer: Trainer, data: Any) -> int:
    """Aten calls of one forward and backward of the prepared model under the run's autocast."""
    from hf_mixedprec.integrations.trainer import runtime_of

    model = trainer.model
    batch = torch.stack([data[0]["input_ids"], data[1]["input_ids"]])
    with bh.OpCounter() as c, runtime_of(trainer).autocast():
        model(input_ids=batch, labels=batch).loss.backward()
    model.zero_grad(set_to_none=True)
    return c.n


def bench(opts: argparse.Namespace, data: Any) -> list[dict[str, Any]]:
    names = list(FP8_SET if opts.set == "fp8" else CHOICES)
    ref = names[0]
    cpu: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    ops: dict[str, int] = {}
    for r in range(opts.rounds):
        order = bh.rotated(names, r)
        bh.reset_accelerate()
        turns = bh.Turns(order)
        clocks = {n: bh.LockstepClock(n, turns) for n in order}
        trainers = {
            n: build_trainer(n, opts, data, [ClockCallback(clocks[n])], os.path.join(opts.workdir, str(i)))
            for i, n in enumerate(order)
        }
        bh.run_in_lockstep(turns, {n: tr.train for n, tr in trainers.items()})
        got = {n: clocks[n].durations()[1][opts.warmup :] for n in order}
        for n in names:
            cpu[n] += got[n]
            ratios[n].append(statistics.median(bh.paired_ratios(got[n], got[ref], strict=True)))
        if not ops:
            ops = {n: op_count(trainers[n], data) for n in names}
        print(
            f"  round {r + 1}/{opts.rounds}: " + ", ".join(f"{n} {ratios[n][-1]:.3f}" for n in names), file=sys.stderr
        )
    return [
        {
            "choice": n,
            "modules": CHOICES.get(n, FP8_SET.get(n)),
            "cpu": bh.ms_summary(cpu[n]),
            "ratio_rounds_median": statistics.median(ratios[n]),
            "round_ratios": ratios[n],
            "ops_per_forward_backward": ops[n],
        }
        for n in names
    ]


def table(rows: list[dict[str, Any]]) -> str:
    header = ["choice", "step (median ms, CPU)", f"ratio to {rows[0]['choice']} (median of rounds)"]
    header.append("aten ops per forward+backward")
    cells = [
        [r["choice"], f"{r['cpu']['median_ms']:.1f}", f"{r['ratio_rounds_median']:.3f}", r["ops_per_forward_backward"]]
        for r in rows
    ]
    return bh.md_table(header, "llll", cells)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4, help="fresh lockstep rounds (default 4)")
    ap.add_argument("--steps", type=int, default=30, help="measured steps per round (default 30)")
    ap.add_argument("--warmup", type=int, default=5, help="steps discarded at the start of each round (default 5)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as bench_overhead.py)")
    ap.add_argument(
        "--set",
        choices=("policy", "fp8"),
        default="policy",
        help="policy: the three modules choices above (default); fp8: fp8-all-layers vs h100-fp8-current vs "
        "fp8-edges-kept, rehearsed",
    )
    ap.add_argument("--out", metavar="FILE", help="also write the results as JSON to FILE")
    opts = ap.parse_args(argv)
    bh.set_threads(opts.threads)
    data = Bytes(n=(opts.warmup + opts.steps + 1) * opts.batch_size, seq_len=opts.seq_len)
    with tempfile.TemporaryDirectory() as work, bh.stdout_to_stderr():
        opts.workdir = work
        rows = bench(opts, data)
    m = bh.machine()
    print(table(rows))
    print(f"\nmachine: {m}")
    if opts.out:
        bh.write_json(opts.out, {"machine": m, "rows": rows, "args": vars(opts) | {"workdir": None}}, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
