"""What an FP8-sampled step costs against one that does not sample, on the emulated tiny Llama.

A sampled step (every ``health.fp8_sample_every`` optimizer steps) records each FP8 layer's statistics (amax,
saturation, underflow, SQNR) of its input, weight and output gradient. One training loop driven through
``MixedPrecisionRuntime`` (the hooks the Trainer callback calls) alternates unsampled and sampled steps, so each
pair is measured back to back under the same machine load; a pair's ratio is sampled / unsampled step time (process
CPU time and wall time; forward, backward, clipping, optimizer and every hook).

    python scripts/bench_fp8_sampling.py                        # h100-fp8-delayed, tiny Llama, 60 pairs
    python scripts/bench_fp8_sampling.py --recipe h100-fp8-current b200-mxfp8 --pairs 100 --json out.json
    python scripts/bench_fp8_sampling.py --compile inductor    # the forward and backward under torch.compile

With ``--compile`` the table also gives the graph breaks torch.compile met and the graphs it compiled (both kinds
of step together; the plain model compiles as one graph per kind of step).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import bench_harness as bh
import torch

import hf_mixedprec
from hf_mixedprec.core.demo import builtin_text, byte_batches, tiny_llama
from hf_mixedprec.fp8 import fp8_layers
from hf_mixedprec.training.runtime import MixedPrecisionRuntime


def _setup(name: str, layers: int, seed: int = 0) -> tuple[MixedPrecisionRuntime, Any, Any, Any]:
    recipe = hf_mixedprec.load_recipe(name, rehearse=True)
    rt = MixedPrecisionRuntime(recipe, device="cpu")
    model = tiny_llama(seed=seed, num_hidden_layers=layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    rt.convert_model(model, opt)
    scaler = rt.make_grad_scaler() or rt.make_guard_scaler()
    return rt, model, opt, scaler


def _step(
    rt: MixedPrecisionRuntime, model: Any, opt: Any, scaler: Any, batch: torch.Tensor, sample: bool, run: Any = None
) -> None:
    """One optimizer step as the Trainer callback runs it; ``sample`` forces this step to record FP8 statistics;
    ``run``: what computes the forward (the compiled model), else ``model``."""
    rt.begin_step(model)
    if sample != rt._sampling:  # the recipe's interval would sample other steps: this bench picks them
        rt._sampling = sample
        rt.fp8_stats.record(fp8_layers(model), sample)
    with rt.autocast():
        loss = (model if run is None else run)(input_ids=batch, labels=batch).loss
    rt.record_loss(loss)
    scaler.scale(loss).backward()
    rt.before_optimizer_step(model.parameters(), opt)
    scaler.step(opt)
    scaler.update()
    rt.after_optimizer_step(model, opt)
    rt.rewind_schedule(opt, None)
    opt.zero_grad(set_to_none=True)


def bench(
    name: str, layers: int, pairs: int, warmup: int, batch_size: int, seq_len: int, compile_backend: str | None = None
) -> dict[str, Any]:
    rt, model, opt, scaler = _setup(name, layers)
    run = None
    if compile_backend:
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
        run = torch.compile(model, backend=compile_backend)
    n = 2 * (pairs + warmup)
    batches = byte_batches(builtin_text(), seq_len=seq_len, batch_size=batch_size, n_batches=n, seed=0)
    cpu: dict[bool, list[float]] = {False: [], True: []}
    wall: dict[bool, list[float]] = {False: [], True: []}
    for i, batch in enumerate(batches):
        sample = not bh.abba(i)  # U S S U, U S S U ...: each kind goes first as often as second
        took = bh.measure(_step, rt, model, opt, scaler, batch, sample, run)
        if i >= 2 * warmup:
            cpu[sample].append(took.cpu)
            wall[sample].append(took.wall)
        if sample and i % 4 == 2:
            rt.check(model)  # what the logging step after a sample does (one read); not timed
            rt.metrics()
    ratios = bh.paired_ratios(cpu[True], cpu[False])
    ratios_wall = bh.paired_ratios(wall[True], wall[False])
    compiled = {}
    if compile_backend:
        compiled = {
            "compile": compile_backend,
            "graph_breaks": sum(counters["graph_break"].values()),
            "graphs": counters["stats"]["unique_graphs"],
        }
    return {
        **compiled,
        "recipe": name,
        "layers": layers,
        "fp8_layers": len(rt.fp8_report.converted) if rt.fp8_report else 0,
        "pairs": len(ratios),
        "unsampled_ms_median": statistics.median(cpu[False]) * 1e3,
        "sampled_ms_median": statistics.median(cpu[True]) * 1e3,
        "ratio_median": statistics.median(ratios),
        "ratio_wall_median": statistics.median(ratios_wall),
        "ratio_quartiles": [round(q, 3) for q in statistics.quantiles(ratios, n=4)],
    }


def table(rows: list[dict[str, Any]]) -> str:
    header = ["recipe", "blocks (FP8 Linears)", "unsampled ms (median)", "sampled ms (median)"]
    header += ["ratio, CPU time (median of pairs)", "ratio, wall", "pair quartiles"]
    cells = [
        [
            f"{r['recipe']} (rehearsed)",
            f"{r['layers']} ({r['fp8_layers']})",
            f"{r['unsampled_ms_median']:.2f}",
            f"{r['sampled_ms_median']:.2f}",
            f"{r['ratio_median']:.3f}",
            f"{r['ratio_wall_median']:.3f}",
            r["ratio_quartiles"],
        ]
        for r in rows
    ]
    if rows and "compile" in rows[0]:
        header = ["torch.compile", *header, "graph breaks", "graphs"]
        cells = [[r["compile"], *c, r["graph_breaks"], r["graphs"]] for r, c in zip(rows, cells, strict=True)]
        return bh.md_table(header, "lllrrrrlrr", cells)
    return bh.md_table(header, "llrrrrl", cells)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", nargs="+", default=["h100-fp8-delayed"])
    ap.add_argument("--layers", nargs="+", type=int, default=[2], help="Llama blocks (7 FP8 Linears each)")
    ap.add_argument("--pairs", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5, help="pairs discarded first")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    ap.add_argument(
        "--compile",
        metavar="BACKEND",
        help="run the model under torch.compile with this backend (inductor, aot_eager, eager); default: eager mode",
    )
    opts = ap.parse_args(argv)
    bh.set_threads(opts.threads)
    bh.quiet(("hf_mixedprec",))
    rows = [
        bench(r, n, opts.pairs, opts.warmup, opts.batch_size, opts.seq_len, opts.compile)
        for r in opts.recipe
        for n in opts.layers
    ]
    m = bh.machine()
    print(
        f"{bh.machine_line(m, allowed=True)}; batch {opts.batch_size} x {opts.seq_len} tokens; "
        f"sampled and unsampled steps alternate (U S S U), {opts.pairs} pairs"
    )
    print(table(rows))
    if opts.json:
        bh.write_json(opts.json, {"torch": torch.__version__, "machine": m, "settings": vars(opts), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
