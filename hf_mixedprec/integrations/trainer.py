"""Trainer integration: ``Trainer(..., callbacks=recipe.callbacks())`` applies a recipe to an unchanged script.

``MixedPrecisionCallback`` reaches its Trainer at ``on_init_end`` (still inside ``Trainer.__init__``, before
the model is prepared), or at ``on_train_begin`` when it was added with ``trainer.add_callback`` after
construction (then the prepared model and optimizer are adjusted in place), and:

- refuses a recipe the hardware cannot run (unless rehearsed) and ``TrainingArguments`` that contradict it
  (a library default that contradicts it, such as TRL's ``bf16``, is fixed and said);
- FP16: installs a real ``torch.amp.GradScaler`` with the recipe's loss-scale settings on the Trainer's
  Accelerator, so ``accelerator.backward`` scales the loss, Trainer's gradient-norm step unscales, the
  optimizer step is skipped on overflow, and Trainer saves and restores the scaler with checkpoints. Where
  Accelerate would not autocast (it ignores fp16 on CPU), the model's forward runs under autocast(float16);
- FP8: converts the model's Linears (emulated when rehearsing), recording the conversion report;
- clipping: the recipe's clipper replaces Trainer's fixed ``max_grad_norm`` (set to 0, said in the log);
- sees every loss ``accelerator.backward`` back-propagates, however the Trainer computed it;
- after each optimizer step advances FP8 delayed scaling; at logging steps merges the ``mp/...`` metrics into
  Trainer's own log row.

Its state (clipper statistics, counters) is saved in ``trainer_state.json`` through Transformers'
``ExportableState`` and restored on resume. The FP8 layers' state (delayed scaling's amax histories and scales)
stays out of the saved model, so ``save_model`` and every checkpoint's model are plain Hugging Face checkpoints
that ``from_pretrained`` loads without warnings; it is written beside each checkpoint's model in
``hf_mixedprec_fp8.safetensors`` and restored from there on resume.
Works for ``Trainer`` and subclasses such as TRL's ``SFTTrainer``; with PEFT models only the frozen base
Linears go to FP8 (LoRA adapters stay in high precision). The ``TrainingArguments`` checks live in
:mod:`hf_mixedprec.integrations.trainer_args`.
"""

from __future__ import annotations

import json
import logging
import os
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from hf_mixedprec.core._private import (
    find_trainer,
    give_scaler,
    resumed_from,
    wrap_save_scaler,
)
from hf_mixedprec.core.checkpoints import MANIFEST_VERSION, MARK
from hf_mixedprec.core.run_lock import hold_run_folder
from hf_mixedprec.fp8 import model_parameters
from hf_mixedprec.fp8.state import read_fp8_state_file
from hf_mixedprec.integrations.checkpointing import (
    disk_full_is_said,
    finish_checkpoint,
    manage_checkpoints,
    restore_converted_weights,
)
from hf_mixedprec.integrations.install import (
    backpropagated_loss,
    check_hardware,
    install_autocast,
    install_on_accelerator,
    install_sharding,
    refuse_late_autocast,
    start_runtime,
)
from hf_mixedprec.integrations.sharding import scaler_ready_for_sharded_resume
from hf_mixedprec.integrations.trainer_args import RECIPE_CLIPS, _check_args, training_args
from hf_mixedprec.integrations.trainer_storage import (
    check_deepspeed_storage,
    install_storage,
    storage_at_resume,
    storage_converted,
)
from hf_mixedprec.recipes.files import resolve_recipe
from hf_mixedprec.recipes.schema import RecipeSpec
from hf_mixedprec.training.health import HealthMonitor
from hf_mixedprec.training.runtime import MixedPrecisionRuntime, fp8_state_dict, load_fp8_state, save_fp8_state
from hf_mixedprec.training.runtime_stats import observe_fp8_samples

__all__ = ["MixedPrecisionCallback", "attach", "recipe_callbacks", "runtime_of", "training_args"]

log = logging.getLogger("hf_mixedprec")

#: The runtime a MixedPrecisionCallback installed on each model, and the Trainer it belongs to. Keyed weakly by
#: the model, so nothing is set on the user's model and nothing outlives it. A Trainer restoring callback state
#: on resume builds a fresh callback instance, which finds its runtime here.
_ATTACHED: weakref.WeakKeyDictionary[Any, tuple[MixedPrecisionRuntime, weakref.ref[Trainer]]] = (
    weakref.WeakKeyDictionary()
)


def runtime_of(obj: Any) -> MixedPrecisionRuntime | None:
    """The :class:`~hf_mixedprec.training.runtime.MixedPrecisionRuntime` applying a recipe to ``obj`` (a Trainer, its
    model, or a ``MixedPrecisionAccelerator``), e.g. for its ``events``, ``notes`` or
    ``hf_mixedprec.training.run_report.write_run_report(..., runtime=runtime_of(trainer))``; None if none is attached."""
    mp = getattr(obj, "mp", None)
    if isinstance(mp, MixedPrecisionRuntime):
        return mp
    model = obj.model if isinstance(obj, Trainer) else obj
    found = _ATTACHED.get(model)
    return found[0] if found is not None else None


def recipe_callbacks(
    recipe: RecipeSpec, *, rehearse: bool | None = None, allow_recipe_change: bool | None = None
) -> list[TrainerCallback]:
    """The callbacks for ``Trainer(callbacks=...)`` (``allow_recipe_change``: see :class:`MixedPrecisionCallback`)."""
    rehearse = recipe.rehearse if rehearse is None else rehearse
    return [MixedPrecisionCallback(recipe=recipe, rehearse=rehearse, allow_recipe_change=allow_recipe_change)]


def _find_trainer() -> Trainer | None:
    """The Trainer calling this callback event (callback events are not handed the Trainer itself)."""
    return find_trainer(Trainer)


def _resumed_from() -> str | None:
    """At ``on_train_begin``, the checkpoint folder the Trainer resumes from (None when it starts afresh)."""
    return resumed_from(Trainer)


def attach(
    trainer: Trainer, recipe: RecipeSpec | None = None, *, rehearse: bool | None = None
) -> MixedPrecisionCallback:
    """Apply ``recipe`` (default: :func:`hf_mixedprec.load_recipe`) to an already constructed ``trainer`` now.

    The same as ``trainer.add_callback(cb)`` for ``cb`` in ``recipe.callbacks()``, except that the recipe is
    installed at once (before ``trainer.train()``) and hardware or argument refusals are raised here.
    """
    cb = MixedPrecisionCallback(recipe=recipe, rehearse=rehearse)
    trainer.add_callback(cb)
    cb.setup(trainer)
    return cb


def _hand_scaler(trainer: Trainer, scaler: torch.amp.GradScaler, late: bool) -> None:
    """The prepared optimizer takes a scaler that came after it (``late``); under FSDP the scaler holds its scale
    before any checkpoint is loaded (:func:`scaler_ready_for_sharded_resume`)."""
    if late:
        give_scaler(trainer.optimizer, scaler)
    scaler_ready_for_sharded_resume(trainer, scaler)


class MixedPrecisionCallback(TrainerCallback, ExportableState):
    """Applies a recipe inside a Trainer (see module docs)."""

    def __init__(
        self,
        recipe: RecipeSpec | dict[str, Any] | None = None,
        rehearse: bool | None = None,
        *,
        allow_recipe_change: bool | None = None,
    ):
        """``allow_recipe_change``: resume a checkpoint written under a recipe of other numerics (another precision
        than a step down, other FP8 numerics, another clipping method) instead of refusing it (None: the
        ``HF_MIXEDPREC_ALLOW_RECIPE_CHANGE`` environment variable decides); a storage change is refused anyway."""
        self.allow_recipe_change = allow_recipe_change
        if recipe is None:  # `trainer.add_callback(MixedPrecisionCallback)`: the launcher's recipe, else auto
            from hf_mixedprec.recipes.loader import load_recipe

            recipe = load_recipe(rehearse=rehearse)
        self.recipe = recipe if isinstance(recipe, RecipeSpec) else resolve_recipe(recipe, source="<checkpoint>")
        self.rehearse = bool(self.recipe.rehearse if rehearse is None else rehearse)
        self.restored: dict[str, Any] | None = None  # set by Trainer when resuming from a checkpoint
        self._release_folder: Any = None  # lets go of the output folder's lock (hf_mixedprec.core.run_lock)
        self.runtime: MixedPrecisionRuntime | None = None
        self.trainer: Trainer | None = None
        self.deepspeed = False
        self._ds_routed = False  # under DeepSpeed: whether the first step routed the clipper into the engine
        self._pre_step_done = False
        self._stop_saved = False

    # -- ExportableState ------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        payload = self.runtime.state_dict() if self.runtime is not None else self.restored
        return {
            "args": {"recipe": self.recipe.to_dict(), "rehearse": self.rehearse},
            # MARK: this checkpoint's manifest follows (one without it was killed before the end of its save)
            "attributes": {"restored": payload, MARK: MANIFEST_VERSION},
        }

    # -- setup -------------------------------------------------------------------------------------------
    def on_init_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        self.setup(self._calling_trainer("on_init_end"))

    def _calling_trainer(self, event: str) -> Trainer:
        trainer = _find_trainer()
        if trainer is None:
            raise RuntimeError(
                f"MixedPrecisionCallback.{event} was not called by a transformers Trainer: pass it with "
                "Trainer(callbacks=recipe.callbacks()), trainer.add_callback(cb) or "
                "hf_mixedprec.integrations.trainer.attach(trainer, recipe)"
            )
        return trainer

    def _check_attachment(self, trainer: Trainer) -> None:
        """One recipe per Trainer, one Trainer per callback: anything else would install two scalers."""
        if self.trainer is not None and self.trainer is not trainer:
            raise RuntimeError(
                "this MixedPrecisionCallback is already attached to another Trainer; give each Trainer its own "
                "(recipe.callbacks() makes new ones)"
            )
        others = [
            cb for cb in trainer.callback_handler.callbacks if isinstance(cb, MixedPrecisionCallback) and cb is not self
        ]
        if others:
            names = ", ".join(repr(cb.recipe.name) for cb in [self, *others])
            raise RuntimeError(
                f"more than one MixedPrecisionCallback on this Trainer (recipes {names}): a Trainer takes one recipe; "
                "pass recipe.callbacks() once, either to Trainer(callbacks=...) or with add_callback, not both"
            )

    def setup(self, trainer: Trainer, *, late: bool = False) -> None:
        """Install the recipe on ``trainer``: at ``on_init_end`` (before its model is prepared), or at
        ``on_train_begin`` for a callback added after construction (the prepared model and optimizer are
        adjusted in place)."""
        self._check_attachment(trainer)
        if self.runtime is not None:
            return
        self.trainer = trainer
        recipe, args, model = self.recipe, trainer.args, trainer.model
        deepspeed = bool(getattr(args, "deepspeed", None) or getattr(trainer, "is_deepspeed_enabled", False))
        check_hardware(recipe, rehearse=self.rehearse)
        notes = _check_args(recipe, args, deepspeed)
        refuse_late_autocast(trainer.accelerator, recipe, late=late)
        # one writer per checkpoint folder, taken once the refusals that change nothing have passed
        release = (
            hold_run_folder(args.output_dir, key="TrainingArguments.output_dir") if args.save_strategy != "no" else None
        )
        try:
            rt = start_runtime(recipe, device=args.device, rehearse=self.rehearse)
            if self.allow_recipe_change is not None:
                rt.history.allow = self.allow_recipe_change
            rt.checks_on_every_rank = True  # on_step_end runs on every rank with the same control.should_log
            # storage first: a refusal leaves the model, its forward and the Trainer as they were
            notes += check_deepspeed_storage(trainer, recipe) if deepspeed else install_storage(trainer, rt, late)
        except BaseException:
            if release is not None:  # refused: the folder is let go (and removed if the lock made it)
                release()
            raise
        self._release_folder = release
        self.runtime = rt
        for text in notes:
            rt.note(text)
        _manage_checkpoints(trainer, rt)
        _ATTACHED[model] = (rt, weakref.ref(trainer))
        if deepspeed:
            # DeepSpeed through TrainingArguments(deepspeed=...) or through `accelerate launch` with a
            # DeepSpeed config (what `hf-mixedprec launch` writes for distributed.strategy: deepspeed)
            rt.apply_tf32()
            install_sharding(trainer.accelerator, rt, late=late)
            self._setup_deepspeed(trainer, rt, late)
            return
        installed = install_on_accelerator(trainer.accelerator, rt, late=late)
        if installed.sharded:  # Trainer routes its checkpoints through Accelerate's FSDP save and load
            trainer.is_fsdp_enabled = True
        if installed.scaler is not None:
            _hand_scaler(trainer, installed.scaler, late)
        install_autocast(trainer.accelerator, rt, model, installed, late=late)
        self._route_backward_and_log(trainer, rt)
        self._route_clip_grad_norm(trainer, rt)
        # FP8 layers hold the Parameters storage made (an FP32 master for BF16-loaded weights by default); FP8 state
        # is kept out of saved models and written beside each checkpoint (on_save)
        rt.convert_model(model, getattr(trainer.optimizer, "optimizer", trainer.optimizer) if late else None)
        if rt.clipper is not None and args.max_grad_norm:
            rt.note(
                f"clipping.method {recipe.clipping.method!r} replaces Trainer's max_grad_norm="
                f"{args.max_grad_norm:g} (set to 0)"
            )
            args.max_grad_norm = RECIPE_CLIPS

    def _route_backward_and_log(self, trainer: Trainer, rt: MixedPrecisionRuntime) -> None:
        """See the loss every backward pass takes (however the Trainer or its subclass computed it), and merge
        the ``mp/`` metrics into the Trainer's own training log row.

        ``accelerator.backward`` is where every Trainer loss goes (``compute_loss``, ``compute_loss_func``,
        label smoothing, TRL's trainers). ``Trainer.log`` is wrapped on the instance, so a subclass's own
        ``log`` (TRL adds its metrics there) still runs and one row carries everything to the log history,
        the console and every ``report_to`` integration.
        """
        acc = trainer.accelerator
        inner_backward = acc.backward

        def backward(loss: Any, **kwargs: Any) -> Any:
            if isinstance(loss, torch.Tensor):
                rt.record_loss(backpropagated_loss(acc, loss))
            return inner_backward(loss, **kwargs)

        acc.backward = backward  # type: ignore[method-assign]
        inner_log = trainer.log

        def log_row(logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
            if rt.pending_log is not None and "loss" in logs:
                logs.update(rt.pending_log)
                rt.pending_log = None
            return inner_log(logs, *args, **kwargs)

        trainer.log = log_row  # type: ignore[method-assign]
        _scaler_in_runtime_state(trainer, rt)

    def _route_clip_grad_norm(self, trainer: Trainer, rt: MixedPrecisionRuntime) -> None:
        """Trainer asks ``accelerator.clip_grad_norm_`` for the gradient norm every step (with ``max_norm=inf``
        when it does not clip); answering it from the runtime, which unscales, clips with the recipe's clipper
        and runs the detectors on one norm, saves the extra passes over the gradients, and Trainer's logged
        ``grad_norm`` is the recipe's. ``on_pre_optimizer_step`` does the same work if Trainer never asked."""
        acc = trainer.accelerator

        def clip_grad_norm_(parameters: Any, max_norm: float = float("inf"), norm_type: float = 2, **kw: Any) -> Any:
            opt = trainer.optimizer
            rt.before_optimizer_step(parameters, getattr(opt, "optimizer", opt))
            self._pre_step_done = True
            return rt.last_norm

        acc.clip_grad_norm_ = clip_grad_norm_  # type: ignore[method-assign]

    def _setup_deepspeed(self, trainer: Trainer, rt: MixedPrecisionRuntime, late: bool) -> None:
        """DeepSpeed owns loss scaling and clipping: monitor its scaler, apply nothing that would fight it; an FP8
        recipe's layers and autocast are ours (DeepSpeed in FP32)."""
        from hf_mixedprec.integrations import deepspeed as ds

        self.deepspeed = True
        rt.external_scaler = lambda: ds.deepspeed_step_state(trainer.model_wrapped)
        for text in ds.ownership_notes(self.recipe):
            rt.note(text)
        if rt.monitor is not None:
            # fed from DeepSpeed's host-side step state (skips, scale, gradient norm) and the loss; skip_step
            # would need the step DeepSpeed owns
            rt.monitor = HealthMonitor(self.recipe.health, device="cpu")
            rt.note(
                "under DeepSpeed the health monitor reads its skipped steps, loss scale and gradient norm, and the "
                "loss; the skip_step reaction is not applied (DeepSpeed owns the step and skips non-finite ones)"
            )
        config = ds.engine_config(trainer.accelerator.state)
        why = ds.clipping_refusal(self.recipe.clipping.method, config, trainer.args.max_grad_norm)
        if why is not None:  # decided before any checkpoint loads, so a resumed run expects the same clipper
            ds.drop_clipper(rt, self.recipe.clipping.method, why, trainer.args.max_grad_norm)
        self._route_backward_and_log(trainer, rt)
        if self.recipe.precision == "fp8":
            ds.fp8_under_deepspeed(rt, trainer.model, trainer.accelerator.state, late=late)

    def _runtime(self, model: Any) -> MixedPrecisionRuntime:
        if self.runtime is None:  # a fresh instance made by Trainer when restoring callback state
            self.runtime, trainer_ref = _ATTACHED[model]
            self.trainer = trainer_ref()
        return self.runtime

    # -- training ------------------------------------------------------------------------------------------
    def on_train_begin(self, args: TrainingArguments, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        if model not in _ATTACHED or self.trainer is not None:
            # added with trainer.add_callback(...): Trainer.train has already prepared the model and optimizer;
            # else (set up already) this checks that no second callback or second Trainer appeared since
            self.setup(self._calling_trainer("on_train_begin"), late=True)
        self._ds_routed = False  # each train() builds its DeepSpeed engine anew: route its clipping at its first step
        rt = self._runtime(model)
        if rt.phases is not None:
            rt.set_max_steps(state.max_steps)
        payload = self.restored
        if payload is None and state.global_step > 0:
            # Trainer restores callback objects only with restore_callback_states_from_checkpoint=True, but
            # the checkpoint's trainer_state.json (loaded into `state`) always holds what state() returned
            payload = _checkpointed_payload(state.stateful_callbacks, type(self).__name__)
        if payload is not None:
            rt.load_state_dict(payload, model)  # first: FP8 layers a fallback moved are moved again
            self.restored = None
            storage_converted(rt)
        folder = _resumed_from()
        sharded = self.deepspeed or getattr(self.trainer, "is_fsdp_enabled", False)
        if folder is not None and not sharded:  # DeepSpeed and FSDP load their own, unconverted, model states
            restored = restore_converted_weights(model, folder)
            if restored is not None:
                rt.note(restored)
        _restore_fp8_state(rt, model, state)

    def on_save(self, args: TrainingArguments, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        with disk_full_is_said(folder):
            _save_fp8_state(self._runtime(model), model, args, state)  # beside a DeepSpeed checkpoint too
            if self.trainer is not None:  # every file is written: the manifest marks the checkpoint complete
                finish_checkpoint(self.trainer)

    def on_step_begin(self, args: TrainingArguments, state: Any, control: Any, **kw: Any) -> None:
        self._runtime(kw["model"]).begin_step(kw["model"], kw.get("optimizer"))  # FP8 sampling (DeepSpeed too)
        if (
            self.deepspeed and not self._ds_routed and self.trainer is not None
        ):  # the engine exists from the first step on
            from hf_mixedprec.integrations.deepspeed import clip_through_deepspeed

            self._ds_routed = True
            rt = self._runtime(kw["model"])
            clip_through_deepspeed(rt, self.trainer.model_wrapped, self.recipe.clipping.method, args.max_grad_norm)

    def on_pre_optimizer_step(self, args: TrainingArguments, state: Any, control: Any, **kw: Any) -> None:
        if self.deepspeed:
            return
        # the previous step, if skipped, is taken out of the LR schedule before this step uses it
        self._runtime(kw["model"]).rewind_schedule(kw.get("optimizer"), kw.get("lr_scheduler"))
        if self._pre_step_done:  # Trainer's clip_grad_norm_ call already ran it this step
            self._pre_step_done = False
            return
        model, optimizer = kw["model"], kw.get("optimizer")
        inner = getattr(optimizer, "optimizer", optimizer)
        self._runtime(model).before_optimizer_step(model_parameters(model), inner)

    def on_optimizer_step(self, args: TrainingArguments, state: Any, control: Any, **kw: Any) -> None:
        if self.deepspeed:
            self._runtime(kw["model"]).after_external_step(kw["model"])
            return
        self._runtime(kw["model"]).after_optimizer_step(kw["model"], kw.get("optimizer"))

    def on_step_end(self, args: TrainingArguments, state: Any, control: Any, **kw: Any) -> None:
        rt = self._runtime(kw["model"])
        if (control.should_log or control.should_save or control.should_training_stop) and not self.deepspeed:
            rt.rewind_schedule(kw.get("optimizer"), kw.get("lr_scheduler"))  # what is logged or saved is exact
        if control.should_log:  # the only steps that read device values
            rt.check(kw["model"], kw.get("optimizer"), kw.get("lr_scheduler"))
            if rt.stop_requested and not self._stop_saved:
                # Trainer saves the checkpoint, then stops (also when this was the last step anyway)
                self._stop_saved = True
                control.should_save = True
                control.should_training_stop = True
            # merged into the row Trainer logs right after this event (see _route_backward_and_log)
            rt.pending_log = rt.metrics()

    def on_train_end(self, args: TrainingArguments, state: Any, control: Any, **kw: Any) -> None:
        if self._release_folder is not None:
            self._release_folder()
            self._release_folder = None
        rt = self._runtime(kw["model"])
        if rt.stop_requested:
            ckpt = f"{args.output_dir}/checkpoint-{state.global_step}"
            how = (
                f"hf_mixedprec.load_recipe({rt.fallback_recipe!r}) and trainer.train(resume_from_checkpoint={ckpt!r})"
                if rt.fallback_recipe
                else f"trainer.train(resume_from_checkpoint={ckpt!r}) after changing what the message says"
            )
            rt.note(f"STOPPED: {rt.stop_requested}. Resume with {how}")


def _manage_checkpoints(trainer: Trainer, rt: MixedPrecisionRuntime) -> None:
    """Complete, verified checkpoints (:func:`manage_checkpoints`), with the model given the checkpoint's layers
    before a resume loads it, and pending FP8 samples combined over the ranks on every rank before a save (Trainer
    asks the callback for its state on rank 0 only)."""
    manage_checkpoints(
        trainer,
        rt.note,
        before_resume=lambda folder: _layers_before_load(trainer, rt, folder),
        before_save=lambda: observe_fp8_samples(rt),
    )


def _checkpointed_payload(stateful_callbacks: Any, name: str) -> Any:
    """The runtime state the callback class ``name``'s ``state()`` left in a checkpoint's ``trainer_state.json``
    (``stateful_callbacks``), or None."""
    stored = (stateful_callbacks or {}).get(name)
    if isinstance(stored, list):
        stored = stored[0] if stored else None
    return (stored or {}).get("attributes", {}).get("restored")


def _layers_before_load(trainer: Trainer, rt: MixedPrecisionRuntime, folder: str) -> None:
    """A run resumed under FSDP or DeepSpeed: give the model the layers of the checkpoint (its phase, the FP8 layers a
    health fallback had moved to BF16) before Trainer loads it. Distributed Checkpoint loads into the model's own
    state-dict keys and refuses keys the checkpoint lacks, and DeepSpeed loads the module strictly, so a model still
    holding FP8 layers (with their scaling buffers) cannot take a checkpoint written with those layers in BF16, or
    the reverse; the runtime state read at ``on_train_begin`` then finds the model as it is."""
    try:
        saved = json.loads((Path(folder) / "trainer_state.json").read_text(encoding="utf-8"))
        payload = _checkpointed_payload(saved.get("stateful_callbacks"), MixedPrecisionCallback.__name__) or {}
    except (OSError, ValueError, AttributeError):
        return  # Trainer's own load reports a damaged file; the runtime state then restores what it can
    if payload:  # a recipe change is decided (or refused) before Trainer loads the weights and optimizer state
        rt.history.check(payload, Path(folder).name, rt.note)
    # the optimizer state converted for this checkpoint's storage change, or checked
    storage_at_resume(trainer, rt, folder, payload.get("recipe") if payload else None)
    if not (getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_deepspeed_enabled", False)):
        return
    if rt.phases is not None and isinstance(payload.get("phases"), dict):
        rt.phases.load_state_dict(payload["phases"])
        rt._switch_phase(trainer.model, None, resume=True)
    moved = payload.get("moved_layers")
    if isinstance(moved, list) and moved:
        rt.reactions.load(list(payload.get("events") or []), moved, trainer.model)


def _scaler_in_runtime_state(trainer: Trainer, rt: MixedPrecisionRuntime) -> None:
    """Checkpoint the runtime's scaler (the FP16 loss scaler, or the scale-1 guard) in the runtime's own state instead
    of Trainer's ``scaler.pt`` (``Trainer._save_scaler``, wrapped on the instance). A resume whose callback is added
    after the Trainer was built (``add_callback``) installs the scaler at ``on_train_begin``, after
    ``Trainer._load_scaler`` ran and found no scaler to load a ``scaler.pt`` into (it crashed); the runtime's state is
    loaded once the scaler exists. The guard's state never changes (scale 1, no growth)."""

    def make(inner: Callable[[str], None]) -> Callable[[str], None]:
        def save_scaler(output_dir: str) -> None:
            if rt.scaler is not None and getattr(trainer.accelerator, "scaler", None) is rt.scaler:
                return
            inner(output_dir)

        return save_scaler

    wrap_save_scaler(trainer, make)


def _save_fp8_state(rt: MixedPrecisionRuntime, model: Any, args: TrainingArguments, state: Any) -> None:
    """At ``on_save`` (``TrainerCallback.on_save`` runs right after ``Trainer._save_checkpoint`` wrote
    ``<output_dir>/checkpoint-<global_step>``): the FP8 layers' state beside that checkpoint's model, written by the
    process that wrote its ``trainer_state.json`` (every rank holds the same state). A host read, at saves only."""
    if not args.should_save:
        return
    folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
    if os.path.isdir(folder):
        save_fp8_state(model, folder, extra=rt.phases.kept_fp8 if rt.phases is not None else None)
    elif fp8_state_dict(model):  # e.g. a hyperparameter-search trial's run folder
        rt.note(f"FP8 state not saved: no checkpoint folder {folder}; a resume from it restarts the amax histories")


def _restore_fp8_state(rt: MixedPrecisionRuntime, model: Any, state: Any) -> None:
    """At ``on_train_begin``, after the runtime's own state (so FP8 layers a fallback moved are moved again): the FP8
    layers' state from the checkpoint the Trainer resumes from; a missing file is said loudly (histories restart)."""
    folder = _resumed_from()
    decision = rt.history.decision
    if decision is not None and decision.drop_fp8:  # written under other FP8 numerics (or none): scales start afresh
        return
    if rt.phases is not None and rt.phases.restores and folder is not None:  # a later phase's fp8_history: restore
        rt.phases.kept_fp8 = {k: t.to(rt.device) for k, t in read_fp8_state_file(folder)[1].items()}
    if folder is not None or state.global_step > 0:
        problem = load_fp8_state(model, folder)
        if problem is not None:
            rt.note(problem)
