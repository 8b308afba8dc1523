"""``hf-mixedprec compare``: train the same model on the same batches under each recipe and under an FP32 baseline,
and judge each recipe against the baseline before a long run pays for the GPUs.

Every run starts from the same initial weights (built once, loaded into each run's model) and sees the same
batches in the same order (one seeded order for all; both are recorded as digests and checked). Recipes this
machine cannot run are rehearsed, and the table says so. Per recipe it measures:

- the trajectory: train loss gap to the baseline per step (absolute and relative), the final loss delta in %
  (eval loss on held-out blocks when there are some, else the mean train loss of the last tenth of the steps) and
  the perplexity;
- gradient fidelity: at sampled steps, on the recipe run's current weights and one fixed batch, each layer's
  gradient under the recipe against the FP32 gradient of the same weights (cosine similarity and SQNR in dB), so
  the cause of a gap is located, not just seen;
- numerics health: skip rate, FP16 loss-scale settling, per-layer FP8 saturation and underflow, health events;
- storage: what the run's precision plan keeps weights, master weights and optimizer states in, the bytes per
  trainable parameter of weights + master + gradients + optimizer states, and the ``tiny_update`` measure (the
  RMS(update)/RMS(weight) ratio, at each sampled step, of BF16-stored weights that nothing keeps the small updates
  of, and how often it fell below the detector's threshold: updates under half a BF16 ulp are rounded away; Zamirai
  et al. 2020, "Revisiting BFloat16 Training");
- cost: tokens/s and peak memory on a GPU; on a CPU the timings of emulated precisions mean nothing, and say so.

A verdict per recipe follows from :class:`Criteria`; :data:`EXIT_FAILED` is the CLI's exit code when one fails.

This module runs the comparison (checks, training each run, judging); the result types and the written table,
plots and files are in :mod:`hf_mixedprec.commands.compare_report`, the measurements taken during a run in
:mod:`hf_mixedprec.commands.compare_measure`. Every public name is importable from here.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hf_mixedprec.commands.compare_measure import (
    _digest,
    _fill_storage,
    _fp8_layers,
    _recording_updates,
    _RecordingCollator,
    gradient_fidelity,
    held_out_loss,
)
from hf_mixedprec.commands.compare_report import (
    COMPARE_FILE,
    TABLE_FILE,
    CompareResult,
    Criteria,
    LayerFidelity,
    RunResult,
    UpdateMeasure,
    _write,
)
from hf_mixedprec.core.errors import HardwareRefusal, UsageError
from hf_mixedprec.core.run_lock import hold_run_folder
from hf_mixedprec.integrations.recipe import Recipe, fp32_recipe, load_recipe

__all__ = [
    "EXIT_FAILED",
    "CompareResult",
    "Criteria",
    "LayerFidelity",
    "RunResult",
    "UpdateMeasure",
    "gradient_fidelity",
    "held_out_loss",
    "run_compare",
]

#: ``hf-mixedprec compare`` exits with this code when at least one recipe fails its verdict.
EXIT_FAILED = 4


# -- one run ---------------------------------------------------------------------------------------------------


@dataclass
class _Setup:
    """What every run shares: data, tokenizer, initial weights, the fidelity batch and the run settings."""

    prepared: Any
    model_dir: str | None
    init_state: dict[str, torch.Tensor]
    probe_batch: dict[str, torch.Tensor]
    fidelity_steps: list[int]
    out: Path
    max_steps: int
    seq_len: int
    batch_size: int
    lr: float
    seed: int


def _measure_callback(
    setup: _Setup, fidelity: dict[int, dict[str, LayerFidelity]] | None, curve: dict[int, float] | None
) -> Any:
    """At the sampled steps, after the optimizer step, on the current weights: the per-layer gradient against FP32
    into ``fidelity`` and the held-out loss into ``curve`` (each only when given)."""
    from transformers import TrainerCallback

    from hf_mixedprec.commands.workload import build_model
    from hf_mixedprec.integrations.trainer import runtime_of

    class Measure(TrainerCallback):
        reference: Any = None

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            if state.global_step not in setup.fidelity_steps or model is None:
                return
            rt = runtime_of(model)
            if fidelity is not None:
                if self.reference is None:
                    self.reference, _ = build_model(
                        setup.model_dir, setup.prepared.tokenizer, seq_len=setup.seq_len, seed=setup.seed
                    )
                scale = rt.amp.device_scale() if rt is not None else None
                device = next(model.parameters()).device
                self.reference.to(device)
                batch = {k: v.to(device) for k, v in setup.probe_batch.items()}
                fidelity[state.global_step] = gradient_fidelity(
                    model,
                    self.reference,
                    batch,
                    autocast=rt.autocast() if rt is not None else None,
                    loss_scale=float(scale) if scale is not None else 1.0,
                )
            if curve is not None:
                curve[state.global_step] = held_out_loss(
                    model, setup.prepared.eval_ds, setup.batch_size, rt.autocast() if rt is not None else None
                )

    return Measure()


def _training_args(rec: Recipe, setup: _Setup) -> Any:
    """The same Trainer settings for every run: only the recipe's own flags differ."""
    return rec.training_args(
        output_dir=str(setup.out / "runs" / rec.name),
        max_steps=setup.max_steps,
        per_device_train_batch_size=setup.batch_size,
        per_device_eval_batch_size=setup.batch_size,
        learning_rate=setup.lr,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=setup.seed,
        disable_tqdm=True,
        logging_nan_inf_filter=False,
        dataloader_pin_memory=torch.cuda.is_available(),
    )


def _cost_note(rec: Recipe, device: torch.device, rehearsed: bool, rt: Any = None) -> str:
    if device.type != "cuda":
        emulated = rehearsed or "fp8" in rec.precisions()
        slow = "; 16-bit GEMMs emulated by this CPU, see its notes" if getattr(rt, "cpu_speed", None) else ""
        return (
            "CPU: timings compare nothing (no tensor cores" + ("; FP8/FP16 emulated" if emulated else "") + slow + ")"
        )
    return "GPU" + (" (rehearsed: emulation, not the recipe's speed)" if rehearsed else "")


def _trainer(rec: Recipe, setup: _Setup, collator: _RecordingCollator, callbacks: list[Any]) -> tuple[Any, str]:
    """The run's Trainer over a model loaded with the shared initial weights, and the digest of those weights."""
    from transformers import PrinterCallback, Trainer

    from hf_mixedprec.commands.workload import build_model

    model, _ = build_model(setup.model_dir, setup.prepared.tokenizer, seq_len=setup.seq_len, seed=setup.seed)
    model.load_state_dict(setup.init_state)
    init_digest = _digest(model.state_dict().values())
    tr = Trainer(
        model=model,
        args=_training_args(rec, setup),
        train_dataset=setup.prepared.train_ds,
        data_collator=collator,
        processing_class=setup.prepared.tokenizer,
        callbacks=callbacks,
    )
    tr.remove_callback(PrinterCallback)
    return tr, init_digest


def _train_one(rec: Recipe, setup: _Setup, *, rehearsed: bool, measure: bool = True) -> RunResult:
    """One run; ``measure=False`` skips the gradient-fidelity samples of an FP32 run (the baseline itself)."""
    from hf_mixedprec.commands.workload import peak_memory
    from hf_mixedprec.integrations.trainer import runtime_of

    collator = _RecordingCollator()
    fidelity: dict[int, dict[str, LayerFidelity]] = {}
    curve: dict[int, float] = {}
    measure_cb = _measure_callback(
        setup,
        fidelity if rec.precision != "fp32" or measure else None,
        curve if setup.prepared.eval_ds is not None else None,
    )
    tr, init_digest = _trainer(rec, setup, collator, [*rec.callbacks(), measure_cb])
    rt = runtime_of(tr)
    device = tr.args.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with _recording_updates(rt) as updates:
        t0 = time.perf_counter()
        tr.train()
        seconds = time.perf_counter() - t0
    batches = list(collator.digests[: tr.state.global_step])
    eval_loss = None
    if setup.prepared.eval_ds is not None and rt is not None and not rt.stop_requested:
        eval_loss = float(tr.evaluate(setup.prepared.eval_ds)["eval_loss"])
    logs = tr.state.log_history
    train_loss = [float(r["loss"]) for r in logs if "loss" in r and "step" in r]
    tail = train_loss[-max(1, len(train_loss) // 10) :]
    final = eval_loss if eval_loss is not None else (sum(tail) / len(tail) if tail else math.nan)
    steps = tr.state.global_step
    tokens = steps * setup.batch_size * setup.seq_len * tr.args.world_size
    peak_mib, _ = peak_memory(device)  # MiB (finetune's unit); RunResult keeps bytes
    run = RunResult(
        recipe=rec.name,
        precision="->".join(rec.precisions()),  # a phased recipe: each phase's, in order
        rehearsed=rehearsed,
        init_digest=init_digest,
        batch_digests=batches,
        train_loss=train_loss,
        eval_loss=eval_loss,
        final_loss=final,
        steps=steps,
        skipped=rt.amp.skipped_count() if rt is not None else 0,
        loss_scale=[float(r["mp/loss_scale"]) for r in logs if "mp/loss_scale" in r],
        loss_scale_floor=rec.loss_scale.min_scale if rec.loss_scale is not None else None,
        events=list(rt.events) if rt is not None else [],
        stopped=rt.stop_requested if rt is not None else None,
        fp8_layers=_fp8_layers(logs),
        fidelity=fidelity,
        tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
        peak_memory_bytes=round(peak_mib * 2**20) if device.type == "cuda" else None,
        cost_note=_cost_note(rec, device, rehearsed, rt),
        notes=list(rt.notes) if rt is not None else [],
        eval_curve=curve,
    )
    _fill_storage(run, rt, updates)
    return run


# -- judging against the baseline --------------------------------------------------------------------------------


def _judge(run: RunResult, base: RunResult, crit: Criteria) -> None:
    """Fill ``run``'s gaps to ``base``, its verdict, the reasons for a failure and what to change."""
    n = min(len(run.train_loss), len(base.train_loss))
    run.loss_gap_abs = [run.train_loss[i] - base.train_loss[i] for i in range(n)]
    run.loss_gap_rel = [
        g / base.train_loss[i] if base.train_loss[i] else math.nan for i, g in enumerate(run.loss_gap_abs)
    ]
    for step, loss in run.eval_curve.items():
        if step in base.eval_curve:
            run.eval_gap_abs[step] = loss - base.eval_curve[step]
            run.eval_gap_rel[step] = (
                run.eval_gap_abs[step] / base.eval_curve[step] if base.eval_curve[step] else math.nan
            )
    if math.isfinite(run.final_loss) and math.isfinite(base.final_loss) and base.final_loss:
        run.final_delta_pct = 100.0 * (run.final_loss - base.final_loss) / base.final_loss
    reasons: list[str] = []
    if run.skip_rate > crit.max_skip_rate:
        reasons.append(
            f"skip rate {run.skip_rate:.1%} ({run.skipped} of {run.steps} steps) is above {crit.max_skip_rate:.1%}"
        )
    if run.final_delta_pct is None:
        reasons.append(f"the final loss is {run.final_loss} (not finite)")
    elif run.final_delta_pct > crit.max_loss_delta_pct:
        reasons.append(
            f"final loss {run.final_loss:.4f} is {run.final_delta_pct:+.2f}% from the baseline's "
            f"{base.final_loss:.4f} (allowed: up to +{crit.max_loss_delta_pct:g}%)"
        )
    if run.stopped and not crit.allow_stop:
        reasons.append(f"a health reaction stopped the run: {run.stopped}")
    run.reasons = reasons
    run.verdict = "fail" if reasons else "pass"
    run.suggestions = _suggestions(run) if reasons else []


def _suggestions(run: RunResult) -> list[str]:
    """What to change, from what went wrong (the precision, the loss scale, the weakest layers)."""
    out: list[str] = []
    if run.precision == "fp16":
        settled = run.loss_scale_settled
        if run.skip_rate > 0 or settled is False:
            out.append(
                "FP16 loss scaling is struggling (skips, or a scale backing off or stuck at its floor): train in BF16 (a100-bf16 "
                "on Ampere or later, cpu-bf16 on CPU) if the hardware has it"
            )
        if run.loss_scale and max(run.loss_scale) < 2.0**10:
            out.append(
                f"the loss scale stayed at {max(run.loss_scale):g} or below, so small gradients flush to zero in FP16: "
                "use the default loss_scale (init_scale 65536, growth_interval 2000)"
            )
    tu = run.tiny_update
    if run.storage.get("master") == "none" and tu is not None and tu.fired:
        out.append(
            f"updates rounded away in BF16 at {tu.fired} of {tu.samples} sampled steps (storage.master none): keep a "
            "master, storage.master bf16_remainder (exact, +2 bytes/param) or bf16_stochastic (no extra bytes)"
        )
    worst = run.worst_fidelity()
    if "fp8" in run.precision.split("->"):
        weak = sorted(run.fidelity[max(run.fidelity)].items(), key=lambda kv: kv[1].sqnr_db)[:3] if worst else []
        if weak:
            patterns = ", ".join(f"'{name}'" for name, _ in weak)
            out.append(
                "keep the layers with the lowest gradient SQNR in BF16: a first modules rule "
                f"{{match: [{patterns}], fp8: off}}"
            )
        out.append(f"see each layer's FP8 numerics: hf-mixedprec simulate --recipe {run.recipe}")
        out.append("or use a BF16 recipe (a100-bf16) for this model")
    elif worst is not None and run.precision != "fp32":
        name, f = worst
        out.append(f"the weakest gradient is {name} (SQNR {f.sqnr_db:.1f} dB, cosine {f.cosine:.4f})")
    return out


# -- the command ------------------------------------------------------------------------------------------------


def _sample_fp8(rec: Recipe, every: int) -> Recipe:
    """FP8 statistics at least every ``every`` steps, so that a short comparison sees them (said on stderr)."""
    from hf_mixedprec.commands.workload import sample_fp8_at_least_every

    lowered = sample_fp8_at_least_every(rec, every) if rec.health.enabled else rec
    if lowered is not rec:
        cur = rec.health.fp8_sample_every
        print(
            f"compare: {rec.name}: FP8 statistics sampled every {every} steps (the recipe says {cur})", file=sys.stderr
        )
    return lowered


def _sample_updates(rec: Recipe, every: int) -> Recipe:
    """``tiny_update`` measured at least every ``every`` steps where the recipe stores weights in BF16 without a master
    (``storage.master: none``), so that a short comparison sees it (said on stderr); the probe reads a strided sample
    of each weight and changes nothing in the run."""
    h = rec.health
    if rec.storage.master != "none" or not h.enabled or not h.detectors.tiny_update.enabled:
        return rec
    if h.fp8_sample_every <= every:
        return rec
    print(
        f"compare: {rec.name}: tiny_update sampled every {every} steps (the recipe's health.fp8_sample_every says "
        f"{h.fp8_sample_every})",
        file=sys.stderr,
    )
    return rec.model_copy(update={"health": h.model_copy(update={"fp8_sample_every": every})})


def _load(name: str) -> tuple[Recipe, bool]:
    """The recipe ``name`` (``fp32`` as a baseline is plain FP32 training), rehearsed where this machine cannot
    run it; and whether it is rehearsed."""
    if name == "fp32":
        return fp32_recipe(), False
    try:
        return load_recipe(name), False
    except HardwareRefusal:
        return load_recipe(name, rehearse=True), True


def _check_strategy(rec: Recipe) -> None:
    """compare trains every recipe in this one process: a DeepSpeed recipe would train without DeepSpeed."""
    if rec.distributed.strategy == "deepspeed":
        raise UsageError(
            f"--recipes: {rec.name!r} has distributed.strategy deepspeed, but compare trains each recipe in one "
            "process without DeepSpeed, so it would not compare what the recipe runs (allowed: recipes with "
            "distributed.strategy none or ddp; compare the same precision with a copy of the recipe that sets "
            "distributed.strategy none)"
        )


def _output_folder(out: Path, overwrite: bool) -> Path:
    """``out``, created; refused (before any data is prepared) when it is no folder or holds an earlier comparison."""
    from hf_mixedprec.commands.workload import check_output_dir

    if out.exists() and not out.is_dir():
        raise UsageError(f"--output-dir: {out} exists and is not a folder (allowed: a folder, new or empty)")
    earlier = [f for f in (COMPARE_FILE, TABLE_FILE) if (out / f).exists()]
    if earlier and not overwrite:
        raise UsageError(
            f"--output-dir: {out} already holds a comparison ({', '.join(earlier)}), which this one would overwrite "
            "(allowed: another --output-dir, or --overwrite to replace it)"
        )
    check_output_dir(str(out))  # no dangling link, writable (a probe file), before any data is prepared
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--output-dir: {out} cannot be created ({exc.strerror})") from None
    return out


def _check_args(
    recipes: Sequence[str],
    max_steps: int,
    batch_size: int,
    seq_len: int,
    crit: Criteria,
    lr: float | None,
    eval_split: float | None,
    model: str | None,
    data: str | None,
) -> None:
    from hf_mixedprec.commands.workload import check_data_path, check_eval_split, check_numbers
    from hf_mixedprec.core.model_dir import check_model_dir

    if not recipes or any(not r.strip() for r in recipes):
        raise UsageError(
            f"--recipes: {','.join(recipes)!r} must list at least one recipe, comma-separated (allowed: built-in "
            "names, YAML paths, e.g. a100-bf16,v100-fp16)"
        )
    twice = sorted({r.strip() for r in recipes if [x.strip() for x in recipes].count(r.strip()) > 1})
    if twice:
        raise UsageError(
            f"--recipes: {', '.join(twice)} listed more than once (allowed: each recipe once; every recipe is already "
            "compared with the same baseline, start and batches)"
        )
    check_numbers(
        **{"max-steps": (max_steps, 1), "batch-size": (batch_size, 1), "seq-len": (seq_len, 2), "lr": (lr, 0.0)}
    )
    if not 0 <= crit.max_skip_rate <= 1:
        raise UsageError(f"--max-skip-rate: {crit.max_skip_rate} is not a fraction (allowed: 0 to 1)")
    if not (crit.max_loss_delta_pct >= 0 and math.isfinite(crit.max_loss_delta_pct)):
        raise UsageError(f"--max-loss-delta: {crit.max_loss_delta_pct} (allowed: a percentage >= 0)")
    check_eval_split(eval_split)
    if model is not None:
        check_model_dir(model)
    if data is not None:
        check_data_path(data)


def run_compare(
    recipes: Sequence[str],
    *,
    baseline: str = "fp32",
    model: str | None = None,
    data: str | None = None,
    text_field: str | None = None,
    max_steps: int = 40,
    seq_len: int = 128,
    batch_size: int = 8,
    lr: float | None = None,
    seed: int = 0,
    eval_split: float | None = None,
    output_dir: str | Path = "runs/compare",
    criteria: Criteria | None = None,
    fidelity_points: int = 4,
    overwrite: bool = False,
    memory_check: bool = True,
) -> CompareResult:
    """Train the baseline and each recipe from the same weights on the same batches; judge each recipe.

    Writes ``compare.json``, ``compare.md`` and the plots into ``output_dir``. ``eval_split``: the fraction of
    blocks held out for the final loss (default 0.05 with the built-in data, 0 with ``data``, when the mean train
    loss of the last tenth of the steps is the final loss). ``fidelity_points``: how many steps (spread over the
    run, the first included) measure per-layer gradient fidelity. An ``output_dir`` holding an earlier comparison is
    refused before anything is trained, unless ``overwrite``. ``memory_check``: refuse, before training anything,
    a run whose estimated training tensors (``hf-mixedprec estimate``) exceed the memory free on the device.
    """
    crit = criteria or Criteria()
    _check_args(recipes, max_steps, batch_size, seq_len, crit, lr, eval_split, model, data)
    loaded = [_load(r.strip()) for r in recipes]
    for rec, _ in loaded:
        _check_strategy(rec)
    out = _output_folder(Path(output_dir), overwrite)
    release = hold_run_folder(out, key="--output-dir")  # one writer: a second comparison into it is refused
    try:
        return _compare(
            loaded, baseline, out, max_steps=max_steps, batch_size=batch_size, seq_len=seq_len, lr=lr, seed=seed,
            eval_split=eval_split, data=data, text_field=text_field, model=model, memory_check=memory_check,
            fidelity_points=fidelity_points, crit=crit,
        )  # fmt: skip
    finally:
        release()


def _compare(
    loaded: list[tuple[Recipe, bool]],
    baseline: str,
    out: Path,
    *,
    max_steps: int,
    batch_size: int,
    seq_len: int,
    lr: float | None,
    seed: int,
    eval_split: float | None,
    data: str | None,
    text_field: str | None,
    model: str | None,
    memory_check: bool,
    fidelity_points: int,
    crit: Criteria,
) -> CompareResult:
    """:func:`run_compare` once its inputs are checked and its folder is held."""
    from hf_mixedprec.commands.workload import DEFAULTS, build_model, prepare_data

    every = max(1, max_steps // 10)
    loaded = [(_sample_updates(_sample_fp8(rec, every), every), rehearsed) for rec, rehearsed in loaded]
    base_recipe, base_rehearsed = _load(baseline)
    base_recipe = _sample_updates(base_recipe, every)
    if eval_split is None:
        eval_split = DEFAULTS["eval_split"] if data is None else 0.0
    prepared = prepare_data(data, text_field, model, seq_len, eval_split)
    net, _ = build_model(model, prepared.tokenizer, seq_len=seq_len, seed=seed)
    init_state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    if memory_check:
        _check_memory_fit(base_recipe, [rec for rec, _ in loaded], net.config, batch_size, seq_len)
    del net
    probe = prepared.eval_ds if prepared.eval_ds is not None else prepared.train_ds
    rows = [probe[i] for i in range(min(batch_size, len(probe)))]
    probe_batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    k = max(1, fidelity_points)
    steps = sorted({1, *(max(1, round(max_steps * (i + 1) / k)) for i in range(k))})
    setup = _Setup(
        prepared=prepared,
        model_dir=model,
        init_state=init_state,
        probe_batch=probe_batch,
        fidelity_steps=steps,
        out=out,
        max_steps=max_steps,
        seq_len=seq_len,
        batch_size=batch_size,
        lr=lr if lr is not None else (DEFAULTS["lr"] if model is None else DEFAULTS["lr_pretrained"]),
        seed=seed,
    )
    base = _train_one(base_recipe, setup, rehearsed=base_rehearsed, measure=False)
    runs = []
    for rec, rehearsed in loaded:
        _reset_accelerate()
        run = _train_one(rec, setup, rehearsed=rehearsed)
        _check_same_start(run, base)
        _judge(run, base, crit)
        runs.append(run)
    metric = "eval loss" if prepared.eval_ds is not None else "mean train loss of the last tenth of the steps"
    result = CompareResult(base, runs, crit, metric, out)
    from hf_mixedprec.integrations.checkpointing import disk_full_in_outputs

    with disk_full_in_outputs(out, "compare.json, compare.md and the plots"):
        _write(result)
    return result


def _check_memory_fit(baseline: Recipe, recipes: Sequence[Recipe], config: Any, batch_size: int, seq_len: int) -> None:
    """Refuse, before anything trains, a run whose estimated step (``estimate_memory``: weights, master, gradients,
    optimizer states, activations) needs more than the device has free: compare trains the runs one after the
    other, so each must fit alone. Within 10% of the free memory it says so and goes on."""
    from hf_mixedprec.commands.estimate import RESERVE, estimate_memory
    from hf_mixedprec.commands.workload import free_memory

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    free = free_memory(device)
    if free is None:
        print(f"compare: the free memory on {device} cannot be read: no memory check before training", file=sys.stderr)
        return
    try:
        est = estimate_memory(
            config,
            [baseline, *recipes],
            batch_size=batch_size,
            seq_len=seq_len,
            num_gpus=1,
            target="gpu" if device.type == "cuda" else "cpu",
        )
    except Exception as exc:  # the check guards the runs; a model estimate cannot read must not stop them unsaid
        from hf_mixedprec.core._text import root_cause

        print(f"compare: no memory check before training: the estimate failed ({root_cause(exc)})", file=sys.stderr)
        return
    gib = 2**30
    for r in est.recipes:
        need = r.memory.total
        if need > free:
            flag = (
                "--baseline" if r.recipe == baseline.name or r.recipe.startswith(f"{baseline.name}/") else "--recipes"
            )
            raise UsageError(
                f"{flag}: {r.recipe} needs an estimated {need / gib:.2f} GiB for one training step at --batch-size "
                f"{batch_size} --seq-len {seq_len} (weights {r.memory.weights / gib:.2f}, gradients "
                f"{r.memory.gradients / gib:.2f}, optimizer {r.memory.optimizer / gib:.2f}, activations "
                f"{r.memory.activations / gib:.2f} GiB), more than the {free / gib:.2f} GiB free on {device} (allowed: "
                "a smaller --batch-size or --seq-len, a smaller --model, or --no-memory-check to try anyway)"
            )
        if need > free * (1 - RESERVE):
            print(
                f"compare: {r.recipe} needs an estimated {need / gib:.2f} GiB of the {free / gib:.2f} GiB free on "
                f"{device}: it may run out of memory",
                file=sys.stderr,
            )


def _reset_accelerate() -> None:
    """Each run builds its own Accelerator: forget the previous run's mixed-precision state."""
    from hf_mixedprec.core._private import reset_accelerate_state

    reset_accelerate_state()


def _check_same_start(run: RunResult, base: RunResult) -> None:
    """Same initial weights and the same batches in the same order as the baseline, or the comparison is void."""
    if run.init_digest != base.init_digest:
        raise RuntimeError(f"{run.recipe}: its initial weights differ from the baseline's (a bug: please report it)")
    n = min(len(run.batch_digests), len(base.batch_digests))
    if run.batch_digests[:n] != base.batch_digests[:n]:
        raise RuntimeError(f"{run.recipe}: its batches differ from the baseline's (a bug: please report it)")
