"""``hf-mixedprec finetune``: causal-LM fine-tuning with an unchanged ``Trainer`` plus ``recipe.callbacks()``.

The pipeline is data -> examples -> tokens -> fixed-length blocks (:mod:`hf_mixedprec.workload`, shared with
``compare``) -> ``Trainer`` -> report:

- **Training**: ``recipe.training_args(...)`` and ``Trainer(..., callbacks=recipe.callbacks())``, as any user
  script would; progress goes to stderr, one line per logging step.
- **Output** (in ``output_dir``): ``summary.json`` (what :func:`run_finetune` returns), the run report of
  :func:`hf_mixedprec.run_report.write_run_report` (``health.json``, PNG plots, and ``conversion_report.json`` for
  FP8 recipes), and the trained model and tokenizer (``save_pretrained``) unless ``save=False``.

User mistakes raise :class:`hf_mixedprec.errors.UsageError` with one line naming the flag. They are checked
before anything heavy is imported or built (numbers, paths, the recipe, the data, the tokenizer, the packed
blocks, then the model), so that a mistake costs seconds and prints nothing else.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hf_mixedprec import metrics as M
from hf_mixedprec._optional import available
from hf_mixedprec._private import scaler_settings
from hf_mixedprec._text import root_cause
from hf_mixedprec.errors import UsageError
from hf_mixedprec.model_dir import check_model_dir
from hf_mixedprec.recipe import RECIPE_ENV, Recipe, builtin_recipe_names, load_recipe
from hf_mixedprec.workload import (
    DEFAULTS,
    PackedBlocks,
    Prepared,
    TextData,
    build_model,
    build_tokenizer,
    check_data_path,
    check_eval_split,
    check_numbers,
    check_output_dir,
    load_texts,
    pack_blocks,
    peak_memory,
    prepare_data,
    sample_fp8_at_least_every,
)

__all__ = [
    "DEFAULTS",
    "PackedBlocks",
    "TextData",
    "build_model",
    "build_tokenizer",
    "format_summary",
    "load_texts",
    "pack_blocks",
    "run_finetune",
]


# -- data ----------------------------------------------------------------------------------------------


# -- tokenizer and model ------------------------------------------------------------------------------


# -- packing ---------------------------------------------------------------------------------------------


# -- training --------------------------------------------------------------------------------------------


def _precheck_recipe(recipe: str | Recipe | None, rehearse: bool | None) -> None:
    """Validate the recipe (and that this machine can run it) silently, before the data is read."""
    if isinstance(recipe, Recipe):
        _check_deepspeed(recipe)
        return
    name = recipe or os.environ.get(RECIPE_ENV) or "auto"
    if name == "auto":
        return
    from hf_mixedprec.loader import load_recipe_named, rehearse_from_env

    loaded = load_recipe_named(recipe)

    if not (rehearse if rehearse is not None else rehearse_from_env()):
        from hf_mixedprec.hardware import check_recipe, detect

        check_recipe(loaded, detect())
    _check_deepspeed(loaded)


def _check_deepspeed(recipe: Recipe) -> None:
    """A DeepSpeed recipe needs a DeepSpeed launch, and a precision DeepSpeed accepts here; else refuse it.

    Outside a DeepSpeed launch Trainer would train without DeepSpeed, which the recipe did not ask for.
    """
    if recipe.distributed.strategy != "deepspeed":
        return
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() != "true":
        raise UsageError(
            f"--recipe: {recipe.name!r} has distributed.strategy deepspeed, which needs a DeepSpeed launch; run "
            "directly, finetune would train without DeepSpeed (allowed: `hf-mixedprec launch --recipe "
            f"{recipe.name if recipe.name in builtin_recipe_names() else 'RECIPE.yaml'} hf_mixedprec/finetune.py "
            "...`, or a recipe with distributed.strategy none)"
        )
    from hf_mixedprec.hardware import HardwareRefusal
    from hf_mixedprec.integrations.deepspeed import deepspeed_device, deepspeed_fp16_supported, deepspeed_refusal

    device = deepspeed_device()
    why = deepspeed_refusal(recipe, device, fp16_supported=deepspeed_fp16_supported(device))
    if why is not None:
        raise HardwareRefusal(why)


def _precision_used(recipe: Recipe, rt: Any, device: str) -> str:
    if recipe.phases is not None:
        changes = getattr(getattr(rt, "phases", None), "changes", [])
        after = "".join(f", then {c['name']} ({c['precision']}) after step {c['step']}" for c in changes)
        text = f"phases {'->'.join(recipe.precisions())}: {recipe.phases[0].label(0)} ({recipe.precisions()[0]}){after}"
        return f"{text} on {device}" + (" (REHEARSED)" if rt is not None and rt.rehearse else "")
    if recipe.precision == "fp16":
        scaler = getattr(rt, "scaler", None)
        text = "fp16 autocast + GradScaler"
        if scaler is not None:
            init, every = scaler_settings(scaler)
            text += f" (init scale {init:g}, growth every {every} steps)"
    elif recipe.precision == "bf16":
        text = "bf16 autocast"
    elif recipe.precision == "fp8":
        rep = getattr(rt, "fp8_report", None)
        text = "fp8"
        if rep is not None:
            text += (
                f" ({rep.backend} backend, {rep.scaling} scaling, {rep.format}; {len(rep.converted)} GEMM layers "
                f"(Linear/Conv1D) in FP8, {len(rep.kept)} kept in high precision) inside bf16 autocast"
            )
    else:
        text = "fp32"
    return f"{text} on {device}" + (" (REHEARSED)" if rt is not None and rt.rehearse else "")


def run_finetune(
    *,
    recipe: str | Recipe | None = None,
    rehearse: bool | None = None,
    model: str | None = None,
    data: str | None = None,
    text_field: str | None = None,
    output_dir: str = DEFAULTS["output_dir"],
    max_steps: int = DEFAULTS["max_steps"],
    seq_len: int = DEFAULTS["seq_len"],
    batch_size: int = DEFAULTS["batch_size"],
    lr: float | None = None,
    seed: int = DEFAULTS["seed"],
    logging_steps: int | None = None,
    save: bool = True,
    resume: str | None = None,
    command: list[str] | None = None,
    save_steps: int | None = None,
    save_total_limit: int | None = 2,
    overwrite: bool = False,
    eval_split: float | None = None,
) -> dict[str, Any]:
    """Fine-tune and write the run's files into ``output_dir``; return the summary (also ``summary.json``).

    ``recipe``: a built-in name, a YAML path, ``"auto"`` or a :class:`Recipe`; ``None``: the recipe
    ``hf-mixedprec launch`` exported, else ``auto``. ``lr``: 1e-3 for the model built from a config, 5e-5 with
    ``model``. ``logging_steps``: ``max_steps // 10`` within 1..10 (step 1 always logged). ``save_steps``:
    ``max_steps // 4`` within 1..500, keeping the last ``save_total_limit``. ``resume``: any checkpoint folder,
    or ``"latest"`` in ``output_dir``. An ``output_dir`` holding another run is refused unless ``overwrite``
    (its files are removed) or ``resume`` continues it. ``command`` (the command line, without ``--resume``)
    becomes ``summary["resume_command"]`` when a health reaction or SIGINT/SIGTERM stops the run with a
    checkpoint. A whole-model ``fallback`` (FP16 -> BF16) continues under the fallback recipe
    (``summary["fallback"]``). ``eval_split``: the fraction of blocks held out for evaluation (default 0.05
    with the built-in data, 0 with ``data``).
    """
    _check_inputs(
        recipe=recipe,
        rehearse=rehearse,
        model=model,
        data=data,
        output_dir=output_dir,
        max_steps=max_steps,
        seq_len=seq_len,
        batch_size=batch_size,
        logging_steps=logging_steps,
        lr=lr,
        resume=resume,
        save_steps=save_steps,
        save_total_limit=save_total_limit,
        overwrite=overwrite,
        eval_split=eval_split,
    )
    resume, start = _prepare_run_folder(Path(output_dir), overwrite=overwrite, resume=resume), time.perf_counter()
    if not available("matplotlib"):  # said before training, not found out after it
        from hf_mixedprec.run_report import NO_PLOTS

        logging.getLogger("hf_mixedprec").warning("hf_mixedprec: %s", NO_PLOTS)
    if eval_split is None:  # held-out text by default only for the built-in data: the user's may be small
        eval_split = DEFAULTS["eval_split"] if data is None else 0.0
    prepared = prepare_data(data, text_field, model, seq_len, eval_split)
    if isinstance(recipe, Recipe):
        loaded = recipe.rehearsed(rehearse) if rehearse is not None else recipe
    else:
        loaded = load_recipe(recipe, rehearse=rehearse)
    run = _RunSettings(
        out=Path(output_dir),
        model=model,
        max_steps=max_steps,
        seq_len=seq_len,
        batch_size=batch_size,
        lr=lr if lr is not None else (DEFAULTS["lr"] if model is None else DEFAULTS["lr_pretrained"]),
        seed=seed,
        logging_steps=logging_steps or max(1, min(10, max_steps // 10)),
        save_steps=save_steps or max(1, min(500, max_steps // 4)),
        save_total_limit=save_total_limit,
    )
    trained = _train(run, prepared, _sample_fp8_at_every_log(loaded, run), resume)
    summary = _summary(run, prepared, trained, save=save, command=command)
    _write_outputs(run, trained, summary, save=save, start=start)
    return summary


def _sample_fp8_at_every_log(recipe: Recipe, run: _RunSettings) -> Recipe:
    """Sample FP8 statistics at least once per logging interval, so that a short run's saturation plot is a
    curve (said on stderr)."""
    lowered = sample_fp8_at_least_every(recipe, run.logging_steps)
    if lowered is not recipe:
        every = recipe.health.fp8_sample_every
        print(
            f"finetune: FP8 statistics are sampled every {run.logging_steps} steps in this run (the recipe's "
            f"health.fp8_sample_every {every} would give {run.max_steps // every} points in {run.max_steps} steps)",
            file=sys.stderr,
        )
    return lowered


def _write_outputs(run: _RunSettings, trained: _Trained, summary: dict[str, Any], *, save: bool, start: float) -> None:
    """The model (``save``), and on the main process the run report and ``summary.json``."""
    if save:
        # on every rank: under DeepSpeed ZeRO-3 saving gathers the sharded weights (Trainer writes on rank 0 only)
        trained.trainer.save_model(str(run.out))
    if trained.trainer.is_world_process_zero():
        from hf_mixedprec.run_report import write_run_report

        files = write_run_report(run.out, log_history=trained.trainer.state.log_history, runtime=trained.runtime)
        summary["files"] = sorted({p.name for p in files} | {"summary.json"})
        summary["seconds"] = round(time.perf_counter() - start, 3)
        (run.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def _check_inputs(
    *,
    recipe: str | Recipe | None,
    rehearse: bool | None,
    model: str | None,
    data: str | None,
    output_dir: str,
    max_steps: int,
    seq_len: int,
    batch_size: int,
    logging_steps: int | None,
    lr: float | None,
    resume: str | None,
    save_steps: int | None,
    save_total_limit: int | None,
    overwrite: bool,
    eval_split: float | None,
) -> None:
    """Every check that needs no data read and no model built: flags, paths, the recipe (one line each)."""
    check_numbers(
        **{
            "max-steps": (max_steps, 1),
            "seq-len": (seq_len, 2),
            "batch-size": (batch_size, 1),
            "logging-steps": (logging_steps, 1),
            "lr": (lr, 0.0),
            "save-steps": (save_steps, 1),
            "save-total-limit": (save_total_limit, 1),
        }
    )
    check_eval_split(eval_split)
    if data is not None:
        check_data_path(data)
    if model is not None:
        check_model_dir(model)
    if resume is not None and resume != "latest" and not (Path(resume) / "trainer_state.json").is_file():
        raise UsageError(
            f"--resume: {resume!r} is not a Trainer checkpoint (no trainer_state.json) (allowed: a checkpoint-N "
            "folder, e.g. the one a health stop saved, or latest)"
        )
    check_output_dir(output_dir)
    from hf_mixedprec.run_control import check_run_folder

    check_run_folder(Path(output_dir), overwrite=overwrite, resume=resume)
    _precheck_recipe(recipe, rehearse)


def _prepare_run_folder(out: Path, *, overwrite: bool, resume: str | None) -> str | None:
    """``--overwrite``: remove the previous run's files; ``--resume latest``: the newest checkpoint's path."""
    from hf_mixedprec.run_control import clear_previous_run, latest_checkpoint

    if overwrite and (removed := clear_previous_run(out)):
        print(f"finetune: --overwrite: removed the previous run's {', '.join(removed)}", file=sys.stderr)
    if resume != "latest":
        return resume
    return str(latest_checkpoint(out, note=lambda text: print(f"finetune: {text}", file=sys.stderr)))


@dataclass(frozen=True)
class _RunSettings:
    out: Path
    model: str | None
    max_steps: int
    seq_len: int
    batch_size: int
    lr: float
    seed: int
    logging_steps: int
    save_steps: int
    save_total_limit: int | None


@dataclass
class _Trained:
    """What training left: the (last) Trainer and runtime, the recipe it ended under, the fallback taken."""

    trainer: Any
    runtime: Any
    recipe: Recipe
    model_desc: str
    fallback: dict[str, Any] | None
    train_seconds: float
    interrupted: dict[str, Any] | None = None


def _make_trainer(run: _RunSettings, prepared: Prepared, rec: Recipe, interrupt: Any) -> tuple[Any, Any, str]:
    """The Trainer, its model and the model's description. The arguments come first: under DeepSpeed ZeRO-3
    they make ``from_pretrained`` load the model already partitioned over the ranks."""
    from transformers import PrinterCallback, Trainer, default_data_collator

    from hf_mixedprec.run_control import Progress

    targs = rec.training_args(
        output_dir=str(run.out),
        max_steps=run.max_steps,
        per_device_train_batch_size=run.batch_size,
        learning_rate=run.lr,
        logging_steps=run.logging_steps,
        logging_first_step=True,
        save_strategy="steps",  # a health `stop`/`fallback` and SIGINT also save the checkpoint they need
        save_steps=run.save_steps,
        save_total_limit=run.save_total_limit,
        report_to=[],
        seed=run.seed,
        disable_tqdm=True,
        logging_nan_inf_filter=False,  # a NaN loss is logged as NaN (a gap in loss.png), not replaced by a mean
        dataloader_pin_memory=torch.cuda.is_available(),  # pinned memory only helps a copy to a GPU
        eval_strategy="steps" if prepared.eval_ds is not None else "no",
        eval_steps=run.save_steps,
        per_device_eval_batch_size=run.batch_size,
    )
    # loaded as saved (a BF16 checkpoint stays BF16 until the recipe's storage decides); DeepSpeed casts the module
    # itself and keeps its FP32 master from the loaded weights
    dtype = torch.float32 if rec.distributed.strategy == "deepspeed" else "auto"
    net, desc = build_model(run.model, prepared.tokenizer, seq_len=run.seq_len, seed=run.seed, dtype=dtype)
    tr = Trainer(
        model=net,
        args=targs,
        train_dataset=prepared.train_ds,
        eval_dataset=prepared.eval_ds,
        data_collator=default_data_collator,
        processing_class=prepared.tokenizer,
        callbacks=[
            Progress(run.max_steps, run.batch_size * run.seq_len * targs.world_size),
            interrupt,
            *rec.callbacks(),
        ],
    )
    tr.remove_callback(PrinterCallback)
    return tr, net, desc


def _train(run: _RunSettings, prepared: Prepared, loaded: Recipe, resume: str | None) -> _Trained:
    """Train; after a whole-model fallback (FP16 -> BF16) that stopped the run with a checkpoint, go on from it
    under the fallback recipe, as the message tells a plain Trainer user to do by hand."""
    from hf_mixedprec.integrations.trainer import runtime_of
    from hf_mixedprec.run_control import Interrupt

    interrupt = Interrupt()
    trainer, _, model_desc = _make_trainer(run, prepared, loaded, interrupt)
    interrupt.world_size = trainer.args.world_size
    rt = runtime_of(trainer)
    device = trainer.args.device
    if trainer.is_world_process_zero():
        texts = prepared.texts
        print(
            f"finetune: recipe {loaded.name} ({'->'.join(loaded.precisions())}{', rehearsed' if loaded.rehearse else ''}) on "
            f"{device.type}; model: {model_desc}; tokenizer: {prepared.tokenizer_how}; data: {texts.source} "
            f"({len(texts.texts)} examples, {prepared.n_tokens} tokens -> {len(prepared.train_ds)} blocks of "
            f"{run.seq_len}); {run.max_steps} steps x {run.batch_size} x {trainer.args.world_size} process(es), "
            f"lr {run.lr:g}",
            file=sys.stderr,
            flush=True,
        )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    interrupt.install()
    try:
        trainer, rt, loaded, fallback = _train_with_fallback(run, prepared, loaded, resume, trainer, rt, interrupt)
    finally:
        interrupt.uninstall()
    halted = interrupt.at_step is not None or (rt is not None and rt.stop_requested)
    step = trainer.state.global_step
    evaluated = any(r.get("step") == step and "eval_loss" in r for r in trainer.state.log_history[-3:])
    if prepared.eval_ds is not None and not halted and not evaluated:
        trainer.evaluate()  # the final eval loss (Trainer evaluates only every eval_steps)
    interrupted = None
    if interrupt.at_step is not None:
        ckpt = run.out / f"checkpoint-{interrupt.at_step}"
        interrupted = {"signal": interrupt.requested, "at_step": interrupt.at_step, "checkpoint": str(ckpt)}
    return _Trained(trainer, rt, loaded, model_desc, fallback, time.perf_counter() - t0, interrupted)


def _train_with_fallback(
    run: _RunSettings, prepared: Prepared, loaded: Recipe, resume: str | None, trainer: Any, rt: Any, interrupt: Any
) -> tuple[Any, Any, Recipe, dict[str, Any] | None]:
    """``trainer.train()``; after a whole-model fallback that stopped the run, on under the fallback recipe."""
    from hf_mixedprec.integrations.trainer import runtime_of

    device = trainer.args.device
    trainer.train(resume_from_checkpoint=resume)
    fallback: dict[str, Any] | None = None
    if (
        rt is not None
        and rt.fallback_recipe
        and trainer.state.global_step < run.max_steps
        and interrupt.at_step is None
    ):
        step = int(trainer.state.global_step)
        ckpt = run.out / f"checkpoint-{step}"
        fallback = {"from": loaded.name, "to": rt.fallback_recipe, "at_step": step, "checkpoint": str(ckpt)}
        fallback["precision_before"] = _precision_used(loaded, rt, device.type)
        before = list(rt.notes)
        loaded = load_recipe(rt.fallback_recipe)
        trainer, _, _ = _make_trainer(run, prepared, loaded, interrupt)
        rt = runtime_of(trainer)
        if rt is not None:
            rt.notes[:0] = before
            rt.note(f"FALLBACK: finetune resumes {ckpt} under recipe {loaded.name} ({loaded.precision})")
        trainer.train(resume_from_checkpoint=str(ckpt))
    return trainer, rt, loaded, fallback


def _summary(
    run: _RunSettings, prepared: Prepared, trained: _Trained, *, save: bool, command: list[str] | None
) -> dict[str, Any]:
    """The run's summary (``summary.json``; :func:`format_summary` prints it)."""
    trainer, rt, loaded, fallback = trained.trainer, trained.runtime, trained.recipe, trained.fallback
    args, device = trainer.args, trainer.args.device
    history = trainer.state.log_history
    losses = [(r["step"], float(r["loss"])) for r in history if "loss" in r and "step" in r]
    evals = [(r["step"], float(r["eval_loss"])) for r in history if "eval_loss" in r and "step" in r]
    steps = int(trainer.state.global_step)
    tokens = steps * run.batch_size * args.gradient_accumulation_steps * args.world_size * run.seq_len
    train_s = trained.train_seconds
    peak_mib, peak_source = peak_memory(device)
    metrics = rt.metrics() if rt is not None else {}
    events = list(getattr(rt, "events", []) or []) if rt is not None else []
    fp8 = getattr(rt, "fp8_report", None)
    stopped = rt.stop_requested if rt is not None else None
    ckpt_dir = run.out / f"checkpoint-{steps}"
    # a stop (also one after a fallback took over) or a signal leaves the checkpoint Trainer saved when it stopped
    halted = stopped or trained.interrupted
    resume_from = str(ckpt_dir) if halted and ckpt_dir.is_dir() else None
    used = _precision_used(loaded, rt, device.type)
    if fallback:
        used = (
            f"{fallback['precision_before']} for steps 1-{fallback['at_step']}, then {used} "
            f"(fallback recipe {loaded.name})"
        )
    return {
        "recipe": loaded.name,
        "precision": "->".join(loaded.precisions()),
        "precision_used": used,
        "rehearsed": bool(loaded.rehearse),
        "device": device.type,
        "fp8_backend": fp8.backend if fp8 is not None else None,
        "fp8_layers": {"converted": len(fp8.converted), "kept": len(fp8.kept)} if fp8 is not None else None,
        "model": trained.model_desc,
        "tokenizer": prepared.tokenizer_how,
        "data": prepared.texts.source,
        "examples": len(prepared.texts.texts),
        "examples_skipped": prepared.texts.skipped,
        "tokens_in_data": prepared.n_tokens,
        "blocks": len(prepared.train_ds),
        "seq_len": run.seq_len,
        "batch_size": run.batch_size,
        "world_size": args.world_size,
        "learning_rate": run.lr,
        "seed": run.seed,
        "steps": steps,
        "skipped_steps": int(metrics.get(M.SKIPPED_STEPS, 0)),
        "loss_first": losses[0][1] if losses else None,
        "loss_first_step": losses[0][0] if losses else None,
        "loss_last": losses[-1][1] if losses else None,
        "loss_last_step": losses[-1][0] if losses else None,
        "eval_blocks": len(prepared.eval_ds) if prepared.eval_ds is not None else 0,
        "eval_loss": evals[-1][1] if evals else None,
        "eval_loss_step": evals[-1][0] if evals else None,
        "eval_perplexity": round(math.exp(min(evals[-1][1], 50.0)), 3) if evals else None,
        "tokens_trained": tokens,
        "train_seconds": round(train_s, 3),
        "tokens_per_s": round(tokens / train_s, 1) if train_s > 0 else None,
        "peak_memory_mib": round(peak_mib, 1),
        "peak_memory_source": peak_source,
        "estimated_memory_mib": _estimated_memory(trainer, loaded, run, rt),
        "health_events": len(events),
        "fallback": fallback,
        "stopped": stopped,
        "interrupted": trained.interrupted,
        "resume_from": resume_from,
        "resume_command": resume_command(command, resume_from, fallback),
        "notes": list(rt.notes) if rt is not None else [],
        "output_dir": str(run.out),
        "saved_model": bool(save),
    }


def resume_command(command: list[str] | None, resume_from: str | None, fallback: dict[str, Any] | None) -> str | None:
    """The command that resumes ``resume_from``: the run's own (``command``, without ``--resume``), under the recipe it
    trained in last: after a fallback switched recipes, the checkpoint was written under ``fallback["to"]``."""
    if not resume_from or not command:
        return None
    argv = list(command)
    if fallback is not None and fallback.get("to"):
        kept, skip = [], False
        for tok in argv:
            if skip or tok.startswith("--recipe="):
                skip = False
                continue
            skip = tok == "--recipe"
            if not skip:
                kept.append(tok)
        argv = [*kept, "--recipe", str(fallback["to"])]
    return shlex.join([*argv, "--resume", resume_from])


def _estimated_memory(trainer: Any, recipe: Recipe, run: _RunSettings, rt: Any) -> dict[str, float] | None:
    """What ``hf-mixedprec estimate`` predicts for this run, in MiB by component (None, said loudly, if it cannot)."""
    from hf_mixedprec.estimate import estimate_memory

    device = trainer.args.device
    try:
        est = estimate_memory(
            trainer.model.config,
            [recipe],
            batch_size=run.batch_size,
            seq_len=run.seq_len,
            gradient_checkpointing=bool(trainer.args.gradient_checkpointing),
            num_gpus=trainer.args.world_size,
            target="gpu" if device.type == "cuda" else "cpu",
        )
    except Exception as exc:  # the estimate is a report: it must not fail a finished run, and it says why
        note = f"memory estimate unavailable: {root_cause(exc)}"
        if rt is not None:
            rt.note(note)
        else:
            logging.getLogger("hf_mixedprec").warning("hf_mixedprec: %s", note)
        return None
    top = max(est.recipes, key=lambda r: r.memory.total)  # a phased recipe: its largest phase sets the peak
    return {k: round(v / 2**20, 1) for k, v in top.memory.to_dict().items()}


def _estimate_line(s: dict[str, Any]) -> str | None:
    est = s.get("estimated_memory_mib")
    if not est:
        return None
    parts = ", ".join(
        f"{label} {est[key]:,.0f}"
        for key, label in (
            ("weights", "weights"),
            ("master_weights", "master weights"),
            ("gradients", "grads"),
            ("ddp_buckets", "DDP buckets"),
            ("optimizer", "optimizer"),
            ("activations", "activations"),
            ("fp8_extras", "FP8"),
        )
        if est.get(key)
    )
    extra = "temporaries" if s["device"] == "cuda" else "the interpreter, libraries and temporaries"
    return f"estimated:    {est['total']:,.0f} MiB of training tensors ({parts}); the peak also counts {extra}"


def format_summary(s: dict[str, Any]) -> str:
    """The short human summary printed at the end of ``hf-mixedprec finetune``."""
    lines = [f"recipe:       {s['recipe']} ({s['precision']}{', rehearsed' if s['rehearsed'] else ''})"]
    lines.append(f"precision:    {s['precision_used']}")
    if s.get("fp8_backend"):
        lines.append(f"fp8 backend:  {s['fp8_backend']}")
    lines.append(f"steps:        {s['steps']} ({s['skipped_steps']} skipped)")
    if s["loss_first"] is not None:
        lines.append(
            f"loss:         {s['loss_first']:.4f} (step {s['loss_first_step']}) -> {s['loss_last']:.4f} "
            f"(step {s['loss_last_step']})"
        )
    if s.get("eval_loss") is not None:
        lines.append(
            f"eval loss:    {s['eval_loss']:.4f} (perplexity {s['eval_perplexity']:.1f}) at step {s['eval_loss_step']} "
            f"on {s['eval_blocks']} held-out blocks"
        )
    lines.append(f"throughput:   {s['tokens_per_s']:,.0f} tokens/s ({s['train_seconds']:.1f} s of training)")
    lines.append(f"peak memory:  {s['peak_memory_mib']:,.0f} MiB ({s['peak_memory_source']})")
    if (est_line := _estimate_line(s)) is not None:
        lines.append(est_line)
    lines.append(f"health:       {s['health_events']} events, {len(s['notes'])} notes (health.json)")
    if s.get("fallback"):
        fb = s["fallback"]
        lines.append(f"FALLBACK:     {fb['from']} -> {fb['to']} at step {fb['at_step']} (resumed {fb['checkpoint']})")
    if s.get("stopped"):
        lines.append(f"STOPPED:      {s['stopped']}")
        if s.get("resume_command"):
            lines.append(f"resume:       {s['resume_command']}")
        elif s.get("resume_from"):
            lines.append(f"resume:       add --resume {s['resume_from']} to the same command")
    saved = ", model + tokenizer" if s["saved_model"] else ""
    lines.append(f"output:       {s['output_dir']}/ (summary.json, health.json, plots{saved})")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m hf_mixedprec.finetune ... (e.g. under torch.distributed.run -m)
    from hf_mixedprec.cli import main

    code = main(["finetune", *sys.argv[1:]])
    if "LOCAL_RANK" in os.environ:
        # A rank of a launched run, its work written and its process group closed: end here. Interpreter teardown
        # can abort the process afterwards (a native thread of the communication libraries still joinable:
        # "terminate called without an active exception"), which the launcher would report as a failed rank.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
