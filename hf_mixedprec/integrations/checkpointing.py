"""Trainer checkpoints that a kill cannot leave half-trusted (see :mod:`hf_mixedprec.core.checkpoints`).

The Trainer callback installs this on its Trainer:

- ``Trainer._save_checkpoint`` (wrapped on the instance) first removes a ``checkpoint-N`` folder an earlier, killed
  save left incomplete, and defers Trainer's rotation (``save_total_limit``): Trainer rotates inside
  ``_save_checkpoint``, before ``on_save`` writes the FP8 state, so an older complete checkpoint could be deleted
  while the new one is still unfinished.
- :func:`finish_checkpoint`, at the end of the callback's ``on_save``: the manifest, written last, then the deferred
  rotation.
- ``Trainer.train`` (wrapped on the instance) verifies what it resumes from before anything loads:
  ``resume_from_checkpoint=True`` takes the newest complete checkpoint (passing over damaged newer ones, loudly), and
  a named checkpoint that does not verify is refused in one line (:class:`CheckpointDamaged`).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hf_mixedprec.core._device import several_ranks
from hf_mixedprec.core._private import trainer_output_dir, wrap_save_checkpoint
from hf_mixedprec.core.checkpoints import (
    CheckpointDamaged,
    CheckpointLayoutRefusal,
    newest_verified,
    verify,
    write_manifest,
)
from hf_mixedprec.core.disk import DiskFull, free_bytes, is_disk_full, tree_bytes
from hf_mixedprec.core.model_dir import safetensors_files
from hf_mixedprec.integrations.sharding import gather_sharded_checkpoint, shard_ready_checkpoint, sharded_ranks

__all__ = [
    "DiskFull",
    "disk_full_in_outputs",
    "disk_full_is_said",
    "finish_checkpoint",
    "manage_checkpoints",
    "restore_converted_weights",
    "resume_target",
]

#: The attribute of a Trainer whose rotation is deferred: the ``save_total_limit`` it asked for.
_DEFERRED = "_hf_mixedprec_save_total_limit"
#: The attribute holding the folder of the checkpoint being saved, for :func:`finish_checkpoint`.
_FOLDER = "_hf_mixedprec_checkpoint_folder"


def manage_checkpoints(
    trainer: Any,
    note: Callable[[str], None],
    before_resume: Callable[[str], None] | None = None,
    before_save: Callable[[], None] | None = None,
) -> None:
    """Wrap ``trainer``'s checkpoint save and ``train`` (see the module docs); once per Trainer. ``before_resume``:
    called with the verified checkpoint folder a ``train`` resumes from, before Trainer loads anything from it;
    ``before_save``: on every rank before a checkpoint is saved (Trainer asks callbacks for their state on rank 0
    only, so whatever needs the other ranks is done here)."""
    if hasattr(trainer, _DEFERRED):
        return
    setattr(trainer, _DEFERRED, None)
    train = trainer.train

    def make(save: Callable[..., Any]) -> Callable[..., Any]:
        def save_checkpoint(model: Any, trial: Any) -> Any:
            args = trainer.args
            folder = Path(trainer_output_dir(trainer, trial)) / f"checkpoint-{trainer.state.global_step}"
            if args.should_save and folder.is_dir() and verify(folder) is not None:
                # what a killed save left: written afresh, no stale file survives in it
                shutil.rmtree(folder, ignore_errors=True)
            if several_ranks():
                dist.barrier()  # no rank writes its files into the folder before it is gone
            setattr(trainer, _FOLDER, folder)  # where on_save finds it (a search trial's run folder included)
            if before_save is not None:
                before_save()
            limit, args.save_total_limit = args.save_total_limit, None
            setattr(trainer, _DEFERRED, limit)
            try:
                with disk_full_is_said(folder):
                    return save(model, trial)
            finally:
                args.save_total_limit = limit

        return save_checkpoint

    def train_verified(resume_from_checkpoint: Any = None, *a: Any, **kw: Any) -> Any:
        target = resume_target(trainer.args.output_dir, resume_from_checkpoint, note)
        if before_resume is not None and isinstance(target, (str, os.PathLike)):
            before_resume(os.fspath(target))
        gathered = _layout_for_this_run(trainer, target, note)
        try:
            return train(target if gathered is None else str(gathered), *a, **kw)
        finally:
            if gathered is not None and trainer.args.should_save:
                shutil.rmtree(gathered, ignore_errors=True)

    wrap_save_checkpoint(trainer, make)
    trainer.train = train_verified  # type: ignore[method-assign]


def _layout_for_this_run(trainer: Any, target: Any, note: Callable[[str], None]) -> Path | None:
    """A resume whose checkpoint was written sharded (FSDP, N ranks) by a run that now trains unsharded (one process
    or data parallel): the checkpoint gathered whole (:func:`gather_sharded_checkpoint`) into a hidden folder of this
    run's output dir, which Trainer then resumes from; an unsharded checkpoint resumed by an FSDP run is written
    sharded the same way (:func:`shard_ready_checkpoint`); None when the layouts agree. The optimizer positions are
    named by :func:`_optimizer_groups`; a checkpoint they do not fit is refused in one line. DeepSpeed checkpoints:
    :func:`_deepspeed_layout`."""
    if not isinstance(target, (str, os.PathLike)) or not Path(target).is_dir():
        return None
    folder = Path(target)
    ranks = sharded_ranks(folder)
    fsdp = bool(getattr(trainer, "is_fsdp_enabled", False))
    _deepspeed_layout(trainer, folder, ranks)
    if ranks is not None and not fsdp:
        how, kind = "gathered", f"written sharded by {ranks} FSDP rank(s)"

        def write(dest: Path) -> None:
            gather_sharded_checkpoint(folder, dest, _optimizer_groups(trainer))

        told = (
            "this run is unsharded, so its model and optimizer state were gathered whole (Distributed Checkpoint "
            "resharding)"
        )
    elif ranks is None and fsdp and safetensors_files(folder):
        how, kind = "sharded", "written by an unsharded run"

        def write(dest: Path) -> None:
            shard_ready_checkpoint(folder, dest, trainer.model, _optimizer_groups(trainer))

        told = "this run shards with FSDP, so its model and optimizer state were written as Distributed Checkpoints"
    else:
        return None
    out = Path(trainer.args.output_dir)
    dest = out / f".resume-{folder.name}-{how}"
    box: list[str | None] = [None]
    if trainer.args.process_index == 0:  # one writer; every rank reads what it wrote
        for stale in out.glob(".resume-checkpoint-*"):  # what a killed resume left
            shutil.rmtree(stale, ignore_errors=True)
        try:
            out.mkdir(parents=True, exist_ok=True)
            write(dest)
        except Exception as exc:
            shutil.rmtree(dest, ignore_errors=True)
            why = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
            box[0] = (
                f"resume: {folder.name} was {kind} and this run cannot load it as it is, nor could it be rewritten "
                f"for this run ({why}); resume it with the recipe it was written under"
            )
    if several_ranks():
        dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise CheckpointLayoutRefusal(box[0])
    note(f"resume: {folder.name} was {kind}; {told} into {dest}, removed once training ends")
    return dest


def _optimizer_groups(trainer: Any) -> list[list[str]]:
    """The parameter names of each group of the optimizer this run resumes into, in order: the one given to the
    Trainer where there is one, else those ``Trainer.create_optimizer`` builds (the trainable parameters that decay,
    then the others, each in the model's order; an empty group is kept, as Trainer keeps it). Raises ``ValueError``
    for a parameter of the given optimizer that the model does not name."""
    model = trainer.model
    optimizer = getattr(trainer, "optimizer", None)
    if optimizer is not None:
        name_of = {id(p): n for n, p in model.named_parameters()}
        groups = [[name_of.get(id(p)) for p in g["params"]] for g in optimizer.param_groups]
        if any(n is None for g in groups for n in g):
            raise ValueError("the optimizer given to the Trainer holds a parameter the model does not name")
        return groups  # type: ignore[return-value]
    decay = set(trainer.get_decay_parameter_names(model))
    named = [n for n, p in model.named_parameters() if p.requires_grad]
    return [[n for n in named if n in decay], [n for n in named if n not in decay]]


def _step_number(name: str) -> int:
    """``global_step12`` -> 12 (a text sort puts global_step10 before global_step9)."""
    digits = "".join(ch for ch in name if ch.isdigit())
    return int(digits) if digits else -1


def _deepspeed_layout(trainer: Any, folder: Path, ranks: int | None) -> None:
    """DeepSpeed resumes only its own checkpoints (``global_step*`` folders: ``deepspeed_load_checkpoint`` raises on
    any other), and a run without DeepSpeed would load such a checkpoint's weights but none of its optimizer state
    (partitioned in DeepSpeed's own files: Trainer finds no ``optimizer.pt`` and starts the moments afresh, or, under
    ZeRO-3, finds no weights): either is refused in one line, before anything loads. So is a ZeRO checkpoint resumed
    on another number of ranks, which DeepSpeed's engine refuses on every rank once the model is built
    (``ZeRORuntimeException``, deepspeed/runtime/engine.py ``_load_zero_checkpoint``), unless the run loads
    DeepSpeed's universal checkpoint (``checkpoint.load_universal``)."""
    steps = sorted((p.name for p in folder.glob("global_step*") if p.is_dir()), key=_step_number)
    latest = folder / "latest"  # the tag DeepSpeed loads (deepspeed/runtime/engine.py, load_checkpoint)
    with contextlib.suppress(OSError):
        tag = latest.read_text(encoding="utf-8").strip()
        if tag in steps:
            steps.append(tag)
    deepspeed = bool(getattr(trainer, "is_deepspeed_enabled", False))
    if steps and not deepspeed:
        raise CheckpointLayoutRefusal(
            f"resume: {folder.name} was written by DeepSpeed (its optimizer state is partitioned in {steps[-1]}/) and "
            "this run does not use DeepSpeed, which would resume the weights with a fresh optimizer; resume it with "
            "the DeepSpeed recipe it was written under (distributed.strategy deepspeed), or start a new run from "
            "its weights"
        )
    if deepspeed and steps:
        written = {
            m.group(1)
            for f in (folder / steps[-1]).glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt")
            if (m := re.search(r"zero_pp_rank_(\d+)_", f.name))
        }
        world = int(getattr(trainer.args, "world_size", 1) or 1)
        config = getattr(getattr(trainer.args, "hf_deepspeed_config", None), "config", None) or {}
        universal = bool((config.get("checkpoint") or {}).get("load_universal"))
        if written and len(written) != world and not universal:
            raise CheckpointLayoutRefusal(
                f"resume: {folder.name} holds DeepSpeed ZeRO optimizer state partitioned over {len(written)} rank(s) "
                f"and this run has {world}: DeepSpeed resumes such a checkpoint on as many ranks as wrote it (each "
                "rank loads its own partition); resume it on that many, or convert it first with DeepSpeed's "
                "universal checkpoint (deepspeed.checkpoint.ds_to_universal, then checkpoint.load_universal: true)"
            )
    if deepspeed and not steps and (ranks is not None or safetensors_files(folder)):
        what = f"sharded by {ranks} FSDP rank(s)" if ranks is not None else "by a run without DeepSpeed"
        raise CheckpointLayoutRefusal(
            f"resume: {folder.name} was written {what} and this run uses DeepSpeed, which resumes only its own "
            "checkpoints (global_step* folders); resume it with the recipe it was written under, or start a new "
            "run from its weights"
        )


@contextlib.contextmanager
def disk_full_is_said(folder: Path) -> Iterator[None]:
    """Around the writes of checkpoint ``folder``: a full disk removes the partial checkpoint and raises
    :class:`~hf_mixedprec.core.disk.DiskFull` in one line naming the folder, the space it needed (the last complete
    checkpoint's size) and what was free, and the newest complete checkpoint to resume from."""
    try:
        yield
    except Exception as exc:
        if not is_disk_full(exc, folder):
            raise
        shutil.rmtree(folder, ignore_errors=True)
        kept = newest_verified(folder.parent).path
        need = tree_bytes(kept) if kept is not None else None
        free = free_bytes(folder.parent)
        sizes = f"about {need:,} bytes needed" if need else "its size unknown"
        sizes += f", {free:,} free" if free is not None else ""
        then = (
            f"{kept.name} is the newest complete checkpoint" if kept is not None else "no complete checkpoint is kept"
        )
        raise DiskFull(
            f"{folder.name}: the disk holding {str(folder.parent)!r} is full ({sizes}): the partial {folder.name} was "
            f"removed and {then}; free space, then resume from it"
        ) from None


@contextlib.contextmanager
def disk_full_in_outputs(out: Path, what: str) -> Iterator[None]:
    """Around a run's final writes into ``out`` (``what``: the model, the report, the summary): a full disk raises
    :class:`~hf_mixedprec.core.disk.DiskFull` in one line naming the folder, what could not be written, the free space
    and the newest complete checkpoint (whose resume writes them again)."""
    try:
        yield
    except Exception as exc:
        if not is_disk_full(exc, out):
            raise
        kept = newest_verified(out).path
        free = free_bytes(out)
        room = f" ({free:,} bytes free)" if free is not None else ""
        then = (
            f"{kept.name} is the newest complete checkpoint; free space, then resume from it"
            if kept is not None
            else "free space, then run it again"
        )
        raise DiskFull(f"{str(out)!r}: the disk is full{room}: {what} could not be written; {then}") from None


def finish_checkpoint(trainer: Any) -> None:
    """After every file of the checkpoint just saved is written (every rank's): its manifest, then Trainer's deferred
    rotation. Nothing when this Trainer's saves are not managed (:func:`manage_checkpoints` was not installed)."""
    args = trainer.args
    folder = getattr(trainer, _FOLDER, None)
    if folder is None:
        return
    setattr(trainer, _FOLDER, None)
    if several_ranks():
        dist.barrier()  # the other ranks' files (their RNG states) are written before the manifest lists them
    if args.should_save and Path(folder).is_dir():
        write_manifest(folder)
        limit = getattr(trainer, _DEFERRED, None)
        if limit:
            from transformers.trainer_utils import rotate_checkpoints

            rotate_checkpoints(
                output_dir=str(Path(folder).parent),
                save_total_limit=limit,
                best_model_checkpoint=trainer.state.best_model_checkpoint,
                use_mtime=True,
            )
    if several_ranks():
        # no rank goes on, or ends (a stopped run: torch.distributed.run then stops the others), before the manifest
        dist.barrier()


def resume_target(out: str | os.PathLike[str] | None, wanted: Any, note: Callable[[str], None]) -> Any:
    """What Trainer should resume from for ``resume_from_checkpoint=wanted``: unchanged for None/False; for True
    the newest complete checkpoint (a note names each damaged newer one); a named checkpoint only when it verifies
    (else :class:`CheckpointDamaged`, naming the newest that does). Checkpoints saved without manifests pass as
    Trainer would take them (:func:`hf_mixedprec.core.checkpoints.unmanaged`).

    In a distributed run rank 0 alone reads and hashes the checkpoints and hands its decision (the target, its notes
    or the refusal) to every rank: one pass over the files instead of one per rank, and every rank resumes from the
    same checkpoint."""
    if wanted is None or wanted is False or out is None or not several_ranks():
        return _resume_target(out, wanted, note)
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        notes: list[str] = []
        try:
            box[0] = ("ok", _resume_target(out, wanted, notes.append), notes)
        except CheckpointDamaged as exc:
            box[0] = ("damaged", str(exc), notes)
    dist.broadcast_object_list(box, src=0)
    kind, value, notes = box[0]
    for n in notes:
        note(n)
    if kind == "damaged":
        raise CheckpointDamaged(value)
    return value


def _resume_target(out: str | os.PathLike[str] | None, wanted: Any, note: Callable[[str], None]) -> Any:
    if wanted is None or wanted is False or out is None:
        return wanted
    if wanted is True:
        choice = newest_verified(out)
        if choice.path is None and not choice.skipped:
            return True  # nothing saved: Trainer's own error
        if choice.path is None:
            raise CheckpointDamaged(f"resume_from_checkpoint=True: {choice.note()} in {str(out)!r}")
        if choice.note():
            note(f"CHECKPOINT: {choice.note()}")
        return str(choice.path)
    folder = Path(str(wanted))
    why = verify(folder) if folder.is_dir() else None  # a folder that is not there: Trainer's own error
    if why is None:
        return wanted
    other = newest_verified(folder.parent).path
    raise CheckpointDamaged(
        f"resume_from_checkpoint: {str(folder)!r} is damaged: {why} (allowed: a complete checkpoint"
        + (f", e.g. {other.name}" if other is not None else "")
        + "; resume_from_checkpoint=True takes the newest complete one)"
    )


def restore_converted_weights(model: Any, folder: str) -> str | None:
    """After ``Trainer`` loaded the model weights of the checkpoint ``folder``: the weights it skipped because the
    checkpoint holds them in the model's original format, loaded through transformers' own conversion, into the very
    Parameters the optimizer holds. Returns what it did, for the run report; None where nothing was skipped.

    transformers 5 saves a model whose weights it converted at load (MoE experts fused into 3-D ``gate_up_proj`` /
    ``down_proj``) back in the original format (``save_pretrained(save_original_format=True)``: one tensor per
    expert), and ``Trainer._load_from_checkpoint`` loads that file with ``load_state_dict(strict=False)``, which
    skips every such key with a warning: a resumed MoE run trains on with the experts' initial weights."""
    from safetensors import safe_open

    files = safetensors_files(folder)
    if not files or not hasattr(model, "state_dict"):
        return None
    own = model.state_dict()
    stored: dict[str, str] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            stored.update(dict.fromkeys(f.keys(), path))
    skipped = {k: p for k, p in stored.items() if k not in own}
    missing = [k for k in own if k not in stored]
    if not skipped or not missing:
        return None
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    tensors = {}
    for path in dict.fromkeys(skipped.values()):  # each file opened once, however many of its keys were skipped
        with safe_open(path, framework="pt") as f:
            tensors.update({key: f.get_tensor(key) for key, p in skipped.items() if p == path})
    held = {k: _owner(model, k) for k in missing}
    before = {k: getattr(mod, attr) for k, (mod, attr) in held.items()}
    mapping = get_model_conversion_mapping(model, add_legacy=False)
    info, _ = convert_and_load_state_dict_in_model(model, tensors, LoadStateDictConfig(weight_mapping=mapping))
    loaded = [k for k in missing if k not in info.missing_keys]
    for key in loaded:  # the optimizer holds the Parameters from before: the values go into them
        mod, attr = held[key]
        new, old = getattr(mod, attr), before[key]
        if new is not old:
            old.data.copy_(new.detach())
            setattr(mod, attr, old)
    still = [k for k in missing if k in info.missing_keys]
    text = (
        f"resume: {len(loaded)} weights the checkpoint holds in the model's original format "
        f"({', '.join(loaded[:2])}{', ...' if len(loaded) > 2 else ''}) were skipped by Trainer's load and are "
        "loaded through transformers' weight conversion"
    )
    if still:
        text += f"; {len(still)} are still missing and keep their initial values: {', '.join(still[:4])}"
    return text


def _owner(model: Any, key: str) -> tuple[Any, str]:
    """The module holding the parameter or buffer ``key`` of ``model``'s state_dict, and its attribute name."""
    path, _, attr = key.rpartition(".")
    return (model.get_submodule(path) if path else model), attr
