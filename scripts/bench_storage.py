"""Step time and memory of each storage choice (the recipe's ``storage:`` section) under the Trainer callback.

Every choice trains ``finetune``'s default model (:func:`hf_mixedprec.core.demo.default_model_config`: the small Llama
with a 2048-token vocabulary, random weights, no download) from the same seed on the same byte batches, with the
recipe ``cpu-bf16`` (BF16 autocast on CPU) and only ``storage:`` changed; the callback swaps the Trainer's AdamW for
the storage optimizer (hf_mixedprec's ``StorageAdamW``, or torchao's ``AdamW8bit`` / ``AdamW4bit`` / ``AdamWFp8``
from ``torchao/optim/adam.py`` with ``--low-bit``).

Step time: all choices run at once, in lockstep (``bench_harness.py``'s ``Turns``/``LockstepClock``: one thread per
Trainer, the turn handed on at every ``on_step_begin``), so step k of every choice runs back to back and load on a
shared machine hits them alike. A step's time is the process CPU time from getting the turn to handing it on; the
first ``--warmup`` steps of a round are discarded (torchao's step is ``torch.compile``d there). Per round and choice
the ratio to the ``fp32`` row is the median of the per-step ratios; the table gives the median over ``--rounds``
rounds (fresh Trainers each round, the order of the choices rotated).

Memory, measured from the tensors at the last step, after the optimizer step and before gradients are zeroed:
weights (every parameter), gradients, the master kept in the optimizer (``remainder``: int16, ``compensation``:
BF16) and the optimizer states (moments and step counters; a torchao low-bit state counted by the tensors it is made
of), each per trainable parameter, beside the bytes the run's precision plan predicted. ``--rss`` also trains each
choice alone in a fresh process and reports its peak RSS during setup and training above the RSS just before the
model was built.

    python scripts/bench_storage.py                          # 6 choices, 4 rounds of 5 + 20 steps
    python scripts/bench_storage.py --low-bit --rss --out storage.json
"""

from __future__ import annotations

# isort: split

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

import bench_harness as bh
import torch
from bench_overhead_trainers import Bytes, ClockCallback
from transformers import Trainer, TrainerCallback

#: name -> storage section; the first is the reference row.
CHOICES: dict[str, dict[str, Any]] = {
    "fp32": {"master": "fp32", "optimizer_states": "fp32"},
    "fp32 + bf16 states": {"master": "fp32", "optimizer_states": "bf16"},
    "bf16_remainder": {"master": "bf16_remainder"},
    "bf16_kahan": {"master": "bf16_kahan"},
    "bf16_stochastic": {"master": "bf16_stochastic"},
    "none": {"master": "none"},
}
LOW_BIT: dict[str, dict[str, Any]] = {
    "fp32 + 8bit states": {"master": "fp32", "optimizer_states": "8bit"},
    "fp32 + 4bit states": {"master": "fp32", "optimizer_states": "4bit"},
    "fp32 + fp8 states": {"master": "fp32", "optimizer_states": "fp8"},
}
MASTER_KEYS = ("remainder", "compensation")


def recipe_for(name: str, storage: dict[str, Any]) -> Any:
    from hf_mixedprec.integrations.recipe import resolve_recipe

    slug = name.replace(" + ", "-").replace(" ", "-")
    return resolve_recipe({"name": f"cpu-bf16-storage-{slug}", "extends": "cpu-bf16", "storage": storage})


def build_model(seed: int = 0, layers: int | None = None) -> torch.nn.Module:
    """The default model; with ``layers``, that many decoder layers (9 parameter tensors each, 3 besides)."""
    from transformers import LlamaForCausalLM

    from hf_mixedprec.core.demo import default_model_config

    bh.seed_all(seed)
    cfg = default_model_config()
    if layers is not None:
        cfg.num_hidden_layers = layers
    return LlamaForCausalLM(cfg)


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``; a tensor subclass (torchao's low-bit states) by the plain tensors it is made of."""
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def measured_bytes(model: torch.nn.Module, optimizer: Any) -> dict[str, int]:
    """Weights, gradients, master (remainder / compensation) and optimizer-state bytes of the live tensors."""
    params = {id(p): p for p in model.parameters()}.values()
    out = {
        "weights": sum(tensor_bytes(p) for p in params),
        "gradients": sum(tensor_bytes(p.grad) for p in params if p.grad is not None),
        "master": 0,
        "optimizer_states": 0,
        "trainable": sum(p.numel() for p in params if p.requires_grad),
    }
    for state in optimizer.state.values():
        for key, v in state.items():
            if torch.is_tensor(v):
                out["master" if key in MASTER_KEYS else "optimizer_states"] += tensor_bytes(v)
    return out


class LastStepBytes(TrainerCallback):
    """At the last optimizer step (gradients and optimizer state all there): :func:`measured_bytes`."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step + 1 == state.max_steps:  # global_step is incremented after this event
            opt = kw["optimizer"]
            self.bytes = measured_bytes(kw["model"], getattr(opt, "optimizer", opt))


def build_trainer(name: str, opts: argparse.Namespace, data: Any, callbacks: list[Any], workdir: str) -> Trainer:
    return recipe_trainer(recipe_for(name, opts.choices[name]), opts, data, callbacks, workdir, lr=opts.lr)


def recipe_trainer(
    recipe: Any, opts: argparse.Namespace, data: Any, callbacks: list[Any], workdir: str, *, lr: float
) -> Trainer:
    """A Trainer of the default model under ``recipe`` for ``--warmup + --steps + 1`` steps, logging only at the
    last, with ``callbacks`` before the recipe's (a lockstep timer first)."""
    args = recipe.training_args(
        output_dir=workdir,
        max_steps=opts.warmup + opts.steps + 1,  # +1: a step's end is the next step's begin
        per_device_train_batch_size=opts.batch_size,
        learning_rate=lr,
        logging_steps=opts.warmup + opts.steps + 1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    model = build_model(layers=getattr(opts, "layers", None))  # bench_modules.py passes its own options
    return Trainer(model=model, args=args, train_dataset=data, callbacks=[*callbacks, *recipe.callbacks()])


def lockstep_round(order: list[str], opts: argparse.Namespace, data: Any) -> dict[str, Any]:
    """One round: a fresh Trainer per choice, in lockstep; per choice its measured CPU seconds per step, the bytes
    at the last step and the plan's bytes per parameter."""
    from hf_mixedprec.integrations.trainer import runtime_of

    bh.reset_accelerate()
    turns = bh.Turns(order)
    clocks = {n: bh.LockstepClock(n, turns) for n in order}
    sizes = {n: LastStepBytes() for n in order}
    trainers = {
        n: build_trainer(n, opts, data, [ClockCallback(clocks[n]), sizes[n]], os.path.join(opts.workdir, str(i)))
        for i, n in enumerate(order)
    }
    bh.run_in_lockstep(turns, {n: tr.train for n, tr in trainers.items()})
    out = {}
    for n in order:
        rt = runtime_of(trainers[n])
        plan = rt.plan if rt is not None else None
        out[n] = {
            "cpu": clocks[n].durations()[1][opts.warmup :],
            "bytes": sizes[n].bytes,
            "plan_bytes_per_param": plan.bytes_per_param() if plan is not None else None,
            "optimizer": plan.optimizer if plan is not None else None,
        }
    return out


def bench(opts: argparse.Namespace, data: Any) -> list[dict[str, Any]]:
    names = list(opts.choices)
    ref = names[0]
    cpu: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    last: dict[str, Any] = {}
    for r in range(opts.rounds):
        got = lockstep_round(bh.rotated(names, r), opts, data)  # who goes first rotates
        for n in names:
            cpu[n] += got[n]["cpu"]
            ratios[n].append(statistics.median(bh.paired_ratios(got[n]["cpu"], got[ref]["cpu"], strict=True)))
        last = got
        print(
            f"  round {r + 1}/{opts.rounds}: " + ", ".join(f"{n} {ratios[n][-1]:.3f}" for n in names),
            file=sys.stderr,
        )
    rows = []
    for n in names:
        b = last[n]["bytes"]
        per = {k: b[k] / b["trainable"] for k in ("weights", "gradients", "master", "optimizer_states")}
        rows.append(
            {
                "choice": n,
                "storage": opts.choices[n],
                "optimizer": last[n]["optimizer"],
                "cpu": bh.ms_summary(cpu[n]),
                "ratio_rounds_median": statistics.median(ratios[n]),
                "round_ratios": ratios[n],
                "bytes": b,
                "bytes_per_param": per,
                "bytes_per_param_total": sum(per.values()),
                "plan_bytes_per_param": last[n]["plan_bytes_per_param"],
            }
        )
    return rows


def one_rss(name: str, opts: argparse.Namespace, data: Any) -> dict[str, Any]:
    """This process trains ``name`` alone: its peak RSS during setup and training above its RSS just before (MiB).
    The peak is reset first (``bench_harness.reset_peak_rss``): importing and building the data peak higher than
    training does, so the lifetime peak (``ru_maxrss``) would hide it."""
    bh.reset_peak_rss()
    before, hwm = bh.rss_mib("VmRSS"), bh.rss_mib("VmHWM")
    reset = hwm <= before + 1.0  # the peak now is the present RSS: the reset took
    with tempfile.TemporaryDirectory() as tmp:
        build_trainer(name, opts, data, [], tmp).train()
    peak = bh.rss_mib("VmHWM")
    return {"rss_before_mib": before, "peak_rss_mib": peak, "delta_mib": peak - before if reset else None}


def rss_rows(opts: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """:func:`one_rss` of every choice, each in a fresh process (peak RSS is per process)."""
    out = {}
    for n in opts.choices:
        argv = [sys.executable, __file__, "--one-rss", n, *opts.passthrough]
        proc = subprocess.run(argv, capture_output=True, text=True, check=True)
        out[n] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"  rss {n}: {out[n]}", file=sys.stderr)
    return out


def table(rows: list[dict[str, Any]], rss: dict[str, dict[str, Any]] | None) -> str:
    header = ["storage", "optimizer", "ms/step (CPU, median)", "x fp32 (median of rounds)", "weights", "grads"]
    header += ["master", "optimizer states", "bytes/param measured", "bytes/param plan"]
    header += ["peak RSS above start (MiB)"] if rss else []
    cells = []
    for r in rows:
        p = r["bytes_per_param"]
        plan = r["plan_bytes_per_param"]
        line = [r["choice"], r["optimizer"], f"{r['cpu']['median_ms']:.1f}", f"{r['ratio_rounds_median']:.3f}"]
        line += [f"{p[k]:.2f}" for k in ("weights", "gradients", "master", "optimizer_states")]
        line += [f"{r['bytes_per_param_total']:.2f}", "-" if plan is None else f"{plan:.2f}"]
        if rss:
            delta = rss[r["choice"]]["delta_mib"]
            line.append("n/a (peak not resettable)" if delta is None else f"{delta:.0f}")
        cells.append(line)
    return bh.md_table(header, "ll" + "r" * (len(header) - 2), cells)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="measured steps per round (default 20)")
    ap.add_argument("--warmup", type=int, default=5, help="steps discarded at the start of each round (default 5)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds, the order of the choices rotated (default 4)")
    ap.add_argument("--batch-size", type=int, default=8, help="blocks per step (default 8, as finetune)")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per block (default 128, as finetune)")
    ap.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate (default 1e-5)")
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help="decoder layers of the model (default: the default model's 4, 39 parameter tensors; 12 gives 111)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1, see bench_overhead.py)")
    ap.add_argument("--cpu", type=int, default=-1, help="pin to this CPU (default -1: the last allowed; -2: no pin)")
    ap.add_argument("--low-bit", action="store_true", help="add torchao's 8bit, 4bit and fp8 optimizer states")
    ap.add_argument("--only", nargs="+", metavar="CHOICE", help="a subset of the choices (the first is the reference)")
    ap.add_argument("--rss", action="store_true", help="also each choice's peak RSS, alone in a fresh process")
    ap.add_argument("--one-rss", metavar="CHOICE", help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    ap.add_argument("--out", metavar="FILE", help="also write the results as JSON to FILE")
    opts = ap.parse_args(argv)
    known = {**CHOICES, **LOW_BIT}
    names = [opts.one_rss] if opts.one_rss else opts.only or [*CHOICES, *(LOW_BIT if opts.low_bit else {})]
    bad = [n for n in names if n not in known]
    if opts.layers is not None and opts.layers < 1:
        ap.error(f"--layers {opts.layers}: at least 1")
    if bad or opts.steps < 2 or opts.rounds < 1 or opts.warmup < 0:
        ap.error(f"unknown choice {bad} (allowed: {', '.join(known)})" if bad else "--steps >= 2, --rounds >= 1")
    opts.choices = {n: known[n] for n in names}
    opts.passthrough = [
        *("--steps", str(opts.steps), "--warmup", str(opts.warmup), "--batch-size", str(opts.batch_size)),
        *("--seq-len", str(opts.seq_len), "--lr", str(opts.lr), "--threads", str(opts.threads), "--cpu", str(opts.cpu)),
        *(["--layers", str(opts.layers)] if opts.layers is not None else []),
        *(["--low-bit"] if opts.low_bit else []),
    ]
    return opts


def setup_process(opts: argparse.Namespace) -> None:
    bh.pin_cpu(opts.cpu)
    bh.set_threads(opts.threads, interop=1)
    bh.quiet()  # the notes would repeat every round


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    setup_process(opts)
    data = Bytes(n=opts.batch_size * (opts.warmup + opts.steps + 2), seq_len=opts.seq_len)
    if opts.one_rss:
        with bh.stdout_to_stderr():
            got = one_rss(opts.one_rss, opts, data)
        print(json.dumps(got))
        return 0
    with tempfile.TemporaryDirectory() as tmp, bh.stdout_to_stderr():
        opts.workdir = tmp
        rows = bench(opts, data)
    rss = rss_rows(opts) if opts.rss else None
    settings = {k: v for k, v in vars(opts).items() if k not in ("workdir", "passthrough", "one_rss")}
    doc = {"machine": bh.machine(), "settings": settings, "rows": rows, "rss": rss}
    m = doc["machine"]
    heading = (
        f"{bh.machine_line(m)}, device {m['device']}; batch {opts.batch_size} x {opts.seq_len} tokens; "
        f"{opts.steps} measured steps after {opts.warmup} warm-up, {opts.rounds} rounds in lockstep"
    )
    bh.report(doc, out=opts.out, as_json=opts.json, render=lambda: f"{heading}\n{table(rows, rss)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
