"""``hf-mixedprec finetune``: causal-LM fine-tuning with an unchanged ``Trainer`` plus ``recipe.callbacks()``.

The pipeline is data -> examples -> tokens -> fixed-length blocks (:mod:`hf_mixedprec.commands.workload`, shared with
``compare``) -> ``Trainer`` -> report:

- **Training**: ``recipe.training_args(...)`` and ``Trainer(..., callbacks=recipe.callbacks())``, as any user
  script would; progress goes to stderr, one line per logging step.
- **Output** (in ``output_dir``): ``summary.json`` (what :func:`run_finetune` returns), the run report of
  :func:`hf_mixedprec.training.run_report.write_run_report` (``health.json``, PNG plots, and ``conversion_report.json`` for
  FP8 recipes), and the trained model and tokenizer (``save_pretrained``) unless ``save=False``.

User mistakes raise :class:`hf_mixedprec.core.errors.UsageError` with one line naming the flag. They are checked
before anything heavy is imported or built (numbers, paths, the recipe, the data, the tokenizer, the packed
blocks, then the model), so that a mistake costs seconds and prints nothing else.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from hf_mixedprec.commands.finetune_summary import Trained, format_summary, precision_used, resume_command, summary
from hf_mixedprec.commands.workload import (
    DEFAULTS,
    PackedBlocks,
    Prepared,
    RunSettings,
    TextData,
    build_model,
    build_tokenizer,
    check_data_path,
    check_eval_split,
    check_numbers,
    check_output_dir,
    load_texts,
    pack_blocks,
    prepare_data,
    sample_fp8_at_least_every,
)
from hf_mixedprec.core._optional import available
from hf_mixedprec.core.errors import UsageError
from hf_mixedprec.core.model_dir import check_model_dir
from hf_mixedprec.core.run_lock import hold_run_folder
from hf_mixedprec.integrations.recipe import RECIPE_ENV, Recipe, builtin_recipe_names, load_recipe

__all__ = [
    "DEFAULTS",
    "PackedBlocks",
    "TextData",
    "build_model",
    "build_tokenizer",
    "format_summary",
    "load_texts",
    "pack_blocks",
    "resume_command",
    "run_finetune",
]


# -- training --------------------------------------------------------------------------------------------


def _precheck_recipe(recipe: str | Recipe | None, rehearse: bool | None) -> None:
    """Validate the recipe (and that this machine can run it) silently, before the data is read."""
    if isinstance(recipe, Recipe):
        _check_deepspeed(recipe)
        return
    name = recipe or os.environ.get(RECIPE_ENV) or "auto"
    if name == "auto":
        return
    from hf_mixedprec.recipes.loader import load_recipe_named, rehearse_from_env

    loaded = load_recipe_named(recipe)

    if not (rehearse if rehearse is not None else rehearse_from_env()):
        from hf_mixedprec.recipes.hardware import check_recipe, detect

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
            f"{recipe.name if recipe.name in builtin_recipe_names() else 'RECIPE.yaml'} hf_mixedprec/cli/finetune.py "
            "...`, or a recipe with distributed.strategy none)"
        )
    from hf_mixedprec.integrations.deepspeed import deepspeed_device, deepspeed_fp16_supported, deepspeed_refusal
    from hf_mixedprec.recipes.hardware import HardwareRefusal

    device = deepspeed_device()
    why = deepspeed_refusal(recipe, device, fp16_supported=deepspeed_fp16_supported(device))
    if why is not None:
        raise HardwareRefusal(why)


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
    allow_recipe_change: bool = False,
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
    with the built-in data, 0 with ``data``). ``allow_recipe_change``: a ``resume`` under a recipe of other
    numerics than the checkpoint's goes on instead of being refused (:mod:`hf_mixedprec.training.recipe_change`).
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
    release = hold_run_folder(output_dir, key="--output-dir")  # one writer: a second run into it is refused
    try:
        return _finetune(
            recipe=recipe, rehearse=rehearse, model=model, data=data, text_field=text_field, output_dir=output_dir,
            max_steps=max_steps, seq_len=seq_len, batch_size=batch_size, lr=lr, seed=seed,
            logging_steps=logging_steps, save=save, resume=resume, save_steps=save_steps,
            save_total_limit=save_total_limit, command=command, overwrite=overwrite, eval_split=eval_split,
            allow_recipe_change=allow_recipe_change,
        )  # fmt: skip
    finally:
        release()


def _finetune(
    *,
    recipe: str | Recipe | None,
    rehearse: bool | None,
    model: str | None,
    data: str | None,
    text_field: str | None,
    output_dir: str,
    max_steps: int,
    seq_len: int,
    batch_size: int,
    lr: float | None,
    seed: int,
    logging_steps: int | None,
    save: bool,
    resume: str | None,
    save_steps: int | None,
    save_total_limit: int | None,
    command: list[str] | None,
    overwrite: bool,
    eval_split: float | None,
    allow_recipe_change: bool,
) -> dict[str, Any]:
    """:func:`run_finetune` once its inputs are checked and its folder is held."""
    resume, start = _prepare_run_folder(Path(output_dir), overwrite=overwrite, resume=resume), time.perf_counter()
    if not available("matplotlib"):  # said before training, not found out after it
        from hf_mixedprec.training.run_report import NO_PLOTS

        logging.getLogger("hf_mixedprec").warning("hf_mixedprec: %s", NO_PLOTS)
    if eval_split is None:  # held-out text by default only for the built-in data: the user's may be small
        eval_split = DEFAULTS["eval_split"] if data is None else 0.0
    prepared = prepare_data(data, text_field, model, seq_len, eval_split)
    if isinstance(recipe, Recipe):
        loaded = recipe.rehearsed(rehearse) if rehearse is not None else recipe
    else:
        loaded = load_recipe(recipe, rehearse=rehearse)
    run = RunSettings(
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
        allow_recipe_change=allow_recipe_change,
    )
    from hf_mixedprec.training.run_control import release_signals

    try:
        trained = _train(run, prepared, _sample_fp8_at_every_log(loaded, run), resume)
        result = summary(run, prepared, trained, save=save, command=command)
        _write_outputs(run, trained, result, save=save, start=start)
    finally:
        release_signals()  # a run stopped by a signal kept its handler through its report and summary
    return result


def _sample_fp8_at_every_log(recipe: Recipe, run: RunSettings) -> Recipe:
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


def _write_outputs(run: RunSettings, trained: Trained, summary: dict[str, Any], *, save: bool, start: float) -> None:
    """The model (``save``), and on the main process the run report and ``summary.json``."""
    from hf_mixedprec.integrations.checkpointing import disk_full_in_outputs

    if save:
        # on every rank: under DeepSpeed ZeRO-3 and FSDP2 saving gathers the sharded weights (rank 0 writes)
        with disk_full_in_outputs(run.out, "the trained model"):
            _save_model(trained.trainer, run.out)
    if trained.trainer.is_world_process_zero():
        from hf_mixedprec.training.run_report import write_run_report

        with disk_full_in_outputs(run.out, "the run report and summary.json"):
            files = write_run_report(run.out, log_history=trained.trainer.state.log_history, runtime=trained.runtime)
            summary["files"] = sorted({p.name for p in files} | {"summary.json"})
            summary["seconds"] = round(time.perf_counter() - start, 3)
            (run.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def _save_model(trainer: Any, out: Path) -> None:
    """``save_pretrained`` of the trained model and its tokenizer into ``out``. Under FSDP with sharded state dicts
    ``Trainer.save_model`` writes no model (its checkpoints hold the shards), so the whole weights are gathered onto
    rank 0's host memory (``torch.distributed.checkpoint.state_dict.get_model_state_dict``, a collective) and saved
    as one model that loads anywhere."""
    if not getattr(trainer, "is_fsdp_enabled", False):
        trainer.save_model(str(out))
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    whole = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if trainer.is_world_process_zero():
        trainer.model.save_pretrained(str(out), state_dict=whole)
        if trainer.processing_class is not None:
            trainer.processing_class.save_pretrained(str(out))


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
    from hf_mixedprec.training.run_control import check_run_folder

    check_run_folder(Path(output_dir), overwrite=overwrite, resume=resume)
    _precheck_recipe(recipe, rehearse)


def _prepare_run_folder(out: Path, *, overwrite: bool, resume: str | None) -> str | None:
    """``--overwrite``: remove the previous run's files; ``--resume latest``: the newest checkpoint's path."""
    from hf_mixedprec.training.run_control import clear_previous_run, latest_checkpoint

    if overwrite and (removed := clear_previous_run(out)):
        print(f"finetune: --overwrite: removed the previous run's {', '.join(removed)}", file=sys.stderr)
    if resume != "latest":
        return resume
    return str(latest_checkpoint(out, note=lambda text: print(f"finetune: {text}", file=sys.stderr)))


def _make_trainer(run: RunSettings, prepared: Prepared, rec: Recipe, interrupt: Any) -> tuple[Any, Any, str]:
    """The Trainer, its model and the model's description. The arguments come first: under DeepSpeed ZeRO-3
    they make ``from_pretrained`` load the model already partitioned over the ranks; except for an FP8 recipe,
    whose layers are converted from whole weights before DeepSpeed partitions them (``deepspeed.initialize``)."""
    from transformers import PrinterCallback, Trainer, default_data_collator

    from hf_mixedprec.training.run_control import Progress

    # loaded as saved (a BF16 checkpoint stays BF16 until the recipe's storage decides); DeepSpeed casts the module
    # itself and keeps its FP32 master from the loaded weights
    dtype = torch.float32 if rec.distributed.strategy == "deepspeed" else "auto"
    whole_first = rec.distributed.strategy == "deepspeed" and "fp8" in rec.precisions()
    if whole_first:
        net, desc = build_model(run.model, prepared.tokenizer, seq_len=run.seq_len, seed=run.seed, dtype=dtype)
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
    if not whole_first:
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
            *rec.callbacks(allow_recipe_change=run.allow_recipe_change or None),  # None: the environment decides
        ],
    )
    tr.remove_callback(PrinterCallback)
    return tr, net, desc


def _train(run: RunSettings, prepared: Prepared, loaded: Recipe, resume: str | None) -> Trained:
    """Train; after a whole-model fallback (FP16 -> BF16) that stopped the run with a checkpoint, go on from it
    under the fallback recipe, as the message tells a plain Trainer user to do by hand."""
    from hf_mixedprec.integrations.trainer import runtime_of
    from hf_mixedprec.training.run_control import Interrupt

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
        if interrupt.at_step is None:  # stopped by a signal: the handler stays until run_finetune returns, so a
            interrupt.uninstall()  # launcher stopping the other ranks does not cut the report and summary short
    halted = interrupt.at_step is not None or (rt is not None and rt.stop_requested)
    step = trainer.state.global_step
    evaluated = any(r.get("step") == step and "eval_loss" in r for r in trainer.state.log_history[-3:])
    if prepared.eval_ds is not None and not halted and not evaluated:
        trainer.evaluate()  # the final eval loss (Trainer evaluates only every eval_steps)
    interrupted = None
    if interrupt.at_step is not None:
        ckpt = run.out / f"checkpoint-{interrupt.at_step}"
        interrupted = {"signal": interrupt.requested, "at_step": interrupt.at_step, "checkpoint": str(ckpt)}
    return Trained(trainer, rt, loaded, model_desc, fallback, time.perf_counter() - t0, interrupted)


def _train_with_fallback(
    run: RunSettings, prepared: Prepared, loaded: Recipe, resume: str | None, trainer: Any, rt: Any, interrupt: Any
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
        fallback["precision_before"] = precision_used(loaded, rt, device.type)
        before = list(rt.notes)
        loaded = load_recipe(rt.fallback_recipe)
        trainer, _, _ = _make_trainer(run, prepared, loaded, interrupt)
        rt = runtime_of(trainer)
        if rt is not None:
            rt.notes[:0] = before
            rt.note(f"FALLBACK: finetune resumes {ckpt} under recipe {loaded.name} ({loaded.precision})")
        trainer.train(resume_from_checkpoint=str(ckpt))
    return trainer, rt, loaded, fallback
