"""Step time of a plain Hugging Face ``Trainer`` vs the same ``Trainer`` with hf_mixedprec's callbacks.

Both sides train the same model (same seed, same data, same batch) at the same precision, in one process:

- baseline: what a user without hf_mixedprec runs: ``TrainingArguments(bf16=True)`` (Trainer's BF16 autocast
  and its default ``max_grad_norm=1.0`` norm clipping), no extra callbacks;
- ours: ``recipe.training_args(...)`` + ``recipe.callbacks()``: the recipe's clipper (ZClip for ``cpu-bf16``)
  instead of Trainer's clipping, the health detectors, the scale-1 guard GradScaler that makes
  ``skip_step`` reactions exact, the ``mp/...`` metrics at logging steps.

FP16 recipes rehearsed on CPU: the baseline gets what ``Trainer(fp16=True)`` runs on a GPU (Accelerate's
native AMP, autocast(float16) and a default ``GradScaler``), switched on the same way the callback does, since
Accelerate ignores fp16 on CPU. FP8 recipes: the baseline model is converted to (emulated) FP8 and advances
delayed scaling after each step, so both sides pay for the FP8 layers and only the callbacks differ.

Interleaving (``--interleave``):

- ``step`` (default): both Trainers run at once, in lockstep: each runs in its own thread and they hand a
  turn back and forth at every ``on_step_begin``, so step k of one side and step k of the other run back to
  back and only one of them runs at any time. Load on a shared machine, CPU frequency and thermal drift then
  hit both sides alike, step by step; a repetition's ratio is the median of the per-step ratios.
- ``run``: whole runs alternate; drift within a run is not cancelled.

Which side goes first alternates A B, B A, B A, A B, ... The process is pinned to one CPU (``--cpu``; in
lockstep only one side runs at a time anyway): on a 2-vCPU virtual machine the two threads otherwise landed
on different vCPUs that were not equally fast.

``--control`` adds a row that pits the baseline against itself the same way: its ratio is what the
measurement reads when nothing differs, so it says how far from 1.0 a ratio must be to mean anything.

A step's time is the time between consecutive ``on_step_begin`` events (forward, backward, clipping,
optimizer, scheduler, every callback's ``on_step_end`` and logging, and loading the next batch), with the
other side's turn taken out in lockstep mode; the first ``--warmup`` steps of each repetition are discarded.
With ``--log-every 0`` (default) Trainer logs only at the last step, so the measured steps are non-logging
steps; ``--log-every 10`` measures with a log every 10 steps. Both the process CPU time and the wall time of
each step are recorded; the headline ratio is the CPU-time one, since on a shared or virtual machine wall
time also counts the moments the machine ran something else (time stolen from the virtual CPU).

Threads: one by default (``--threads``). What is measured, the per-step work hf_mixedprec adds, runs on one
thread; a 0.1M-parameter model gains nothing from more, and on a shared 2-core machine OpenMP's waits between
threads made steps up to 30x slower at random, on either side (ratios per round from 0.03 to 38).

    python scripts/bench_overhead.py                       # cpu-bf16, tiny Llama
    python scripts/bench_overhead.py --model tiny small --log-every 0 10 --steps 100 --repeats 16 --control
    python scripts/bench_overhead.py --json --out overhead.json
    python scripts/bench_overhead.py --hooks --recipe cpu-bf16 v100-fp16 h100-fp8-delayed --layers 2 8 16

``--hooks`` measures the hooks directly instead: a loop drives ``MixedPrecisionRuntime`` as the Trainer callback
does, and each hook (``begin_step``, ``before_optimizer_step``, ``after_optimizer_step``, and ``check`` +
``metrics`` on a logging step) is timed on its own (median microseconds of process CPU time) and its tensor
operations counted (a ``TorchDispatchMode``: one per aten call, a foreach op counting once), for a non-logging
step, a logging step and an FP8-sampled step, on Llamas of ``--layers`` blocks (7 Linears each).
"""

from __future__ import annotations

import hf_mixedprec  # noqa: F401  (first: it quiets known backend noise before transformers imports torchao)

# isort: split

import argparse
import math
import statistics
import sys
import tempfile
from typing import Any

import bench_harness as bh
import torch
from bench_overhead_trainers import MODELS, Bytes, build_model, load, run_lockstep, run_once
from torch.utils.data import Dataset

from hf_mixedprec.core.demo import builtin_text, byte_batches, tiny_llama

HOOKS = ("begin_step", "before_optimizer_step", "after_optimizer_step", "check+metrics")


def bench(
    recipe: Any,
    rehearsed: bool,
    model_kind: str,
    log_every: int,
    opts: argparse.Namespace,
    data: Dataset,
    control: bool = False,
) -> dict:
    """``control``: the baseline against a second baseline ("ours" is then a plain Trainer too)."""
    wall: dict[str, list[float]] = {"baseline": [], "ours": []}
    cpu: dict[str, list[float]] = {"baseline": [], "ours": []}
    round_ratios: list[float] = []  # CPU time
    round_ratios_wall: list[float] = []
    other = "baseline" if control else "ours"
    for r in range(opts.repeats):
        # A B, B A, B A, A B, ...: which side runs first is balanced against the parity of the round, since
        # memory reused from the previous round favoured one of the two models every other round
        order = ("baseline", "ours") if bh.abba(r) else ("ours", "baseline")
        got: list[tuple[list[float], list[float]]]
        if opts.interleave == "step":
            got = run_lockstep([other if s == "ours" else s for s in order], recipe, model_kind, data, opts, log_every)
        else:
            got = [run_once(other if s == "ours" else s, recipe, model_kind, data, opts, log_every) for s in order]
        this_wall = {side: w for side, (w, _) in zip(order, got)}
        this_cpu = {side: c for side, (_, c) in zip(order, got)}
        for side in order:
            wall[side] += this_wall[side]
            cpu[side] += this_cpu[side]
        for ratios, this in ((round_ratios, this_cpu), (round_ratios_wall, this_wall)):
            if opts.interleave == "step":  # step k of one side next to step k of the other
                ratios.append(statistics.median(bh.paired_ratios(this["ours"], this["baseline"])))
            else:
                ratios.append(statistics.median(this["ours"]) / statistics.median(this["baseline"]))
        print(
            f"  {'control ' if control else ''}{recipe.name} {model_kind} log_every={log_every} "
            f"round {r + 1}/{opts.repeats}: ratio {round_ratios[-1]:.3f} (CPU time), {round_ratios_wall[-1]:.3f} (wall)",
            file=sys.stderr,
        )
    base, ours = bh.ms_summary(wall["baseline"]), bh.ms_summary(wall["ours"])
    base_cpu, ours_cpu = bh.ms_summary(cpu["baseline"]), bh.ms_summary(cpu["ours"])
    return {
        "recipe": recipe.name,
        "control": control,
        "rehearsed": rehearsed,
        "model": model_kind,
        "params": sum(p.numel() for p in build_model(model_kind).parameters()),
        "log_every": log_every,
        "baseline": base,
        "ours": ours,
        "baseline_cpu": base_cpu,
        "ours_cpu": ours_cpu,
        "ratio_median": ours["median_ms"] / base["median_ms"],
        "ratio_mean": ours["mean_ms"] / base["mean_ms"],
        "ratio_cpu_median": ours_cpu["median_ms"] / base_cpu["median_ms"],
        "ratio_rounds_median": statistics.median(round_ratios),
        "ratio_rounds_median_wall": statistics.median(round_ratios_wall),
        "round_ratios": round_ratios,
        "round_ratios_wall": round_ratios_wall,
    }


def table(rows: list[dict]) -> str:
    header = [
        "recipe",
        "model",
        "logging",
        "baseline ms/step (median)",
        "ours ms/step (median)",
        "ratio, CPU time (median of rounds)",
        "ratio, wall time (median of rounds)",
        "per-round ratios (CPU time)",
    ]
    cells = []
    for r in rows:
        name = r["recipe"] + (" (rehearsed)" if r["rehearsed"] else "")
        if r.get("control"):
            name = f"control: baseline vs baseline ({name})"
        cells.append(
            [
                name,
                f"{r['model']} ({r['params'] / 1e6:.2f}M)",
                f"every {r['log_every']} steps" if r["log_every"] else "last step only",
                f"{r['baseline']['median_ms']:.2f}",
                f"{r['ours']['median_ms']:.2f}",
                f"{r['ratio_rounds_median']:.3f}",
                f"{r['ratio_rounds_median_wall']:.3f}",
                ", ".join(f"{x:.3f}" for x in r["round_ratios"]),
            ]
        )
    return bh.md_table(header, "lllrrrrl", cells)


def _hook_step(rt: Any, model: Any, opt: Any, scaler: Any, batch: torch.Tensor, kind: str, count: bool) -> dict:
    """One optimizer step driven as the Trainer callback drives it; per hook, CPU microseconds (or op counts)."""
    from hf_mixedprec.fp8 import fp8_layers

    out: dict[str, float] = {}

    def timed(name: str, fn: Any) -> None:
        if count:
            with bh.OpCounter() as c:
                fn()
            out[name] = out.get(name, 0) + c.n
        else:
            out[name] = out.get(name, 0.0) + bh.cpu_seconds(fn) * 1e6

    def begin() -> None:
        rt.begin_step(model)
        if rt.recipe.precision == "fp8" and (kind == "fp8-sampled") != rt._sampling:  # this bench picks the steps
            rt._sampling = kind == "fp8-sampled"
            rt.fp8_stats.record(fp8_layers(model), rt._sampling)

    timed("begin_step", begin)
    with rt.autocast():
        loss = model(input_ids=batch, labels=batch).loss
    rt.record_loss(loss)
    scaler.scale(loss).backward()
    timed("before_optimizer_step", lambda: rt.before_optimizer_step(model.parameters(), opt))
    scaler.step(opt)
    scaler.update()
    timed("after_optimizer_step", lambda: rt.after_optimizer_step(model, opt))
    rt.rewind_schedule(opt, None)
    if kind == "logging":
        timed("check+metrics", lambda: (rt.check(model, opt), rt.metrics()))
    opt.zero_grad(set_to_none=True)
    return out


def bench_hooks(name: str, layers: int, opts: argparse.Namespace) -> list[dict]:
    """Per hook: median CPU microseconds and tensor operations, per step kind, for one recipe and model depth."""
    from hf_mixedprec.training.runtime import MixedPrecisionRuntime

    recipe, rehearsed = load(name, opts.rehearse)
    rt = MixedPrecisionRuntime(recipe, device="cpu", rehearse=rehearsed or recipe.rehearse)
    model = tiny_llama(seed=0, num_hidden_layers=layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    rt.convert_model(model, opt)
    scaler = rt.make_grad_scaler() or rt.make_guard_scaler()
    kinds = ["non-logging", "logging"] + (["fp8-sampled"] if recipe.precision == "fp8" else [])
    n = opts.steps + opts.warmup
    batches = byte_batches(builtin_text(), seq_len=opts.seq_len, batch_size=opts.batch_size, n_batches=3 * n, seed=0)
    rows = []
    times: dict[str, list[dict]] = {k: [] for k in kinds}
    for i, batch in enumerate(batches[: len(kinds) * n]):
        kind = kinds[i % len(kinds)]
        got = _hook_step(rt, model, opt, scaler, batch, kind, count=False)
        if i >= len(kinds) * opts.warmup:
            times[kind].append(got)
    for kind in kinds:
        ops = _hook_step(rt, model, opt, scaler, batches[-1], kind, count=True)
        if kind == "fp8-sampled":  # its statistics are read at the next check: count that too
            rt.check(model, opt)
            rt.metrics()
        us = {h: statistics.median(t.get(h, 0.0) for t in times[kind]) for h in HOOKS}
        rows.append(
            {
                "recipe": name,
                "rehearsed": rehearsed,
                "layers": layers,
                "fp8_layers": len(rt.fp8_report.converted) if rt.fp8_report else 0,
                "step": kind,
                "us": us,
                "us_total": sum(us.values()),
                "ops": {h: ops.get(h, 0) for h in HOOKS},
                "ops_total": sum(ops.values()),
            }
        )
    return rows


def hooks_table(rows: list[dict]) -> str:
    header = ["recipe", "blocks (FP8 Linears)", "step", *(f"{h} µs / ops" for h in HOOKS), "total µs / ops"]
    cells = [
        [
            r["recipe"] + (" (rehearsed)" if r["rehearsed"] else ""),
            f"{r['layers']} ({r['fp8_layers']})",
            r["step"],
            *(f"{r['us'][h]:.0f} / {r['ops'][h]}" for h in HOOKS),
            f"{r['us_total']:.0f} / {r['ops_total']}",
        ]
        for r in rows
    ]
    return bh.md_table(header, "lll" + "r" * (len(HOOKS) + 1), cells)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--recipe", nargs="+", default=["cpu-bf16"], help="recipe name(s) or YAML path(s) (default: cpu-bf16)"
    )
    ap.add_argument("--model", nargs="+", choices=MODELS, default=["tiny"], help="tiny (test Llama) and/or small")
    ap.add_argument("--steps", type=int, default=60, help="measured steps per repetition (default 60)")
    ap.add_argument("--warmup", type=int, default=10, help="steps discarded at the start of each repetition")
    ap.add_argument(
        "--repeats", type=int, default=8, help="repetitions per side (default 8; a multiple of 4 balances the order)"
    )
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument(
        "--log-every", nargs="+", type=int, default=[0], help="Trainer logging_steps; 0 = only the last step (default)"
    )
    ap.add_argument(
        "--threads", type=int, default=1, help="torch.set_num_threads, the same for both sides (default 1, see above)"
    )
    ap.add_argument(
        "--interleave",
        choices=("step", "run"),
        default="step",
        help="step: both sides in lockstep, step by step (default); run: whole runs alternate",
    )
    ap.add_argument("--control", action="store_true", help="also measure the baseline against itself (the noise floor)")
    ap.add_argument(
        "--cpu",
        type=int,
        default=-1,
        help="pin the process to this CPU (default -1: the last one it may use; -2: do not pin)",
    )
    ap.add_argument(
        "--no-rehearse", dest="rehearse", action="store_false", help="refuse recipes this machine can't run"
    )
    ap.add_argument("--hooks", action="store_true", help="measure each hook's CPU time and tensor ops (see above)")
    ap.add_argument("--layers", nargs="+", type=int, default=[2, 8, 16], help="--hooks: Llama blocks (default 2 8 16)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON on stdout instead of the table")
    ap.add_argument("--out", metavar="FILE", help="also write the results as JSON to FILE")
    opts = ap.parse_args(argv)
    if opts.steps < 2 or opts.repeats < 1 or opts.warmup < 0:
        ap.error("--steps must be >= 2, --repeats >= 1, --warmup >= 0")
    try:
        pinned = bh.pin_cpu(opts.cpu)
    except ValueError as exc:
        ap.error(str(exc))
    if pinned is not None:
        opts.pinned_cpu = pinned
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    bh.set_threads(opts.threads, interop=1)
    bh.quiet()  # notes would be repeated every repetition
    if opts.hooks:
        return main_hooks(opts)
    data = Bytes(n=opts.batch_size * (opts.warmup + opts.steps + 2), seq_len=opts.seq_len)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, bh.stdout_to_stderr():
        opts.workdir = tmp
        for name in opts.recipe:
            recipe, rehearsed = load(name, opts.rehearse)
            for kind in opts.model:
                for every in opts.log_every:
                    if opts.control:
                        rows.append(bench(recipe, rehearsed, kind, every, opts, data, control=True))
                    rows.append(bench(recipe, rehearsed, kind, every, opts, data))
    settings = {k: v for k, v in vars(opts).items() if k != "workdir"}
    what = (
        f"{opts.steps} measured steps after {opts.warmup} warm-up, {opts.repeats} repetitions per side, "
        f"interleaved by {opts.interleave}"
    )
    _report({"machine": bh.machine(), "settings": settings, "rows": rows}, opts, what, lambda: table(rows))
    bad = [r for r in rows if not math.isfinite(r["ratio_median"])]
    return 1 if bad else 0


def main_hooks(opts: argparse.Namespace) -> int:
    with bh.stdout_to_stderr():
        rows = [r for name in opts.recipe for n in opts.layers for r in bench_hooks(name, n, opts)]
    doc = {"machine": bh.machine(), "settings": dict(vars(opts)), "hook_rows": rows}
    _report(doc, opts, f"{opts.steps} steps of each kind after {opts.warmup} warm-up", lambda: hooks_table(rows))
    return 0


def _report(doc: dict, opts: argparse.Namespace, what: str, render: Any) -> None:
    """``--out`` / ``--json`` / the machine line and ``render()``'s table (``bench_harness.report``)."""
    heading = f"{bh.machine_line(doc['machine'])}; batch {opts.batch_size} x {opts.seq_len} tokens; {what}"
    bh.report(doc, out=opts.out, as_json=opts.json, render=lambda: f"{heading}\n{render()}")


if __name__ == "__main__":
    sys.exit(main())
