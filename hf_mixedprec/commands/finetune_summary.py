"""What ``hf-mixedprec finetune`` reports when it ends: the run's summary (``summary.json``), the short text printed
from it, the precision actually used, the command that resumes a halted run, and the memory ``estimate`` predicted
for the run (beside the peak it measured)."""

from __future__ import annotations

import logging
import math
import shlex
from dataclasses import dataclass
from typing import Any

from hf_mixedprec.commands.workload import Prepared, RunSettings, peak_memory
from hf_mixedprec.core import metrics as M
from hf_mixedprec.core._private import scaler_settings
from hf_mixedprec.core._text import root_cause
from hf_mixedprec.fp8.policy import EXPERTS_KIND
from hf_mixedprec.integrations.recipe import Recipe

__all__ = ["Trained", "format_summary", "precision_used", "resume_command", "summary"]


def precision_used(recipe: Recipe, rt: Any, device: str) -> str:
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
            moe = any(d.kind == EXPERTS_KIND for d in rep.layers)
            share = rep.fp8_work_share
            work = f", {share:.1%} of the GEMM work per token" if moe and share is not None else ""
            text += (
                f" ({rep.backend} backend, {rep.scaling} scaling, {rep.format}; {len(rep.converted)} GEMM layers "
                f"(Linear/Conv1D{'/MoE experts' if moe else ''}) in FP8, {len(rep.kept)} kept in high precision"
                f"{work}) inside bf16 autocast"
            )
    else:
        text = "fp32"
    return f"{text} on {device}" + (" (REHEARSED)" if rt is not None and rt.rehearse else "")


@dataclass
class Trained:
    """What training left: the (last) Trainer and runtime, the recipe it ended under, the fallback taken."""

    trainer: Any
    runtime: Any
    recipe: Recipe
    model_desc: str
    fallback: dict[str, Any] | None
    train_seconds: float
    interrupted: dict[str, Any] | None = None


def summary(
    run: RunSettings, prepared: Prepared, trained: Trained, *, save: bool, command: list[str] | None
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
    used = precision_used(loaded, rt, device.type)
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
        "cpu_speed": getattr(rt, "cpu_speed", None),
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


def _estimated_memory(trainer: Any, recipe: Recipe, run: RunSettings, rt: Any) -> dict[str, float] | None:
    """What ``hf-mixedprec estimate`` predicts for this run, in MiB by component (None, said loudly, if it cannot)."""
    from hf_mixedprec.commands.estimate import recipe_memory

    device = trainer.args.device
    try:
        mem = recipe_memory(
            trainer.model.config,
            recipe,
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
    return {k: round(v / 2**20, 1) for k, v in mem.to_dict().items()}


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
    if s.get("cpu_speed"):
        lines.append(f"speed:        {s['cpu_speed']}")
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
