"""Accelerate plugin: ``make_accelerator(recipe)`` returns an ``Accelerator`` configured by the recipe.

The returned object is an ``accelerate.Accelerator`` (a thin subclass) so a hand-written loop needs no other
change: ``prepare`` converts the model to FP8 as the recipe says (keep rules included) before wrapping it,
``backward`` scales the loss with a ``GradScaler`` built from the recipe's ``loss_scale`` (stock
``GradScalerKwargs``), ``clip_grad_norm_`` applies the recipe's clipper to unscaled gradients, and the
prepared optimizer's ``step`` advances FP8 delayed scaling after each real step.

FP8 state (delayed scaling's amax histories and scales) stays in the model's ``state_dict``, so
``accelerator.save_state`` / ``load_state`` carry it with the model's weights (Accelerate saves and loads every
prepared model's full ``state_dict``), while ``accelerator.unwrap_model(model).save_pretrained(...)`` leaves it out
and writes a plain Hugging Face checkpoint.

Rehearsed FP16 on CPU: Accelerate ignores ``mixed_precision="fp16"`` on CPU (no autocast, no scaler), so
:func:`enable_native_fp16` switches on Accelerate's own native-AMP FP16 path there (autocast(float16) at
``prepare``, a real ``torch.amp.GradScaler("cpu")`` for ``backward``/unscale/step), exactly the code a V100
runs. The switch is logged and recorded.
"""

from __future__ import annotations

import functools
import logging
import os
import weakref
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import GradScalerKwargs
from pydantic import ValidationError

from hf_mixedprec.core._private import custom_object_count
from hf_mixedprec.fp8 import model_parameters
from hf_mixedprec.integrations.install import (
    accelerate_precision,
    backpropagated_loss,
    check_hardware,
    enable_native_fp16,
    grad_scaler_kwargs,
    install_autocast,
    install_on_accelerator,
    start_runtime,
)
from hf_mixedprec.recipes.schema import RecipeSpec
from hf_mixedprec.training.amp import PhaseScaler, track_steps_for_scheduler

__all__ = [
    "MixedPrecisionAccelerator",
    "accelerate_precision",
    "backpropagated_loss",
    "enable_native_fp16",
    "grad_scaler_kwargs",
    "make_accelerator",
]

log = logging.getLogger("hf_mixedprec")

#: Accelerate's environment variable for ``mixed_precision`` (what ``accelerate launch`` exports).
MIXED_PRECISION_ENV = "ACCELERATE_MIXED_PRECISION"


class MixedPrecisionAccelerator(Accelerator):
    """An ``Accelerator`` that applies a recipe (see module docs). Build it with :func:`make_accelerator`.

    What the user asked of Accelerate is honoured or refused, never dropped, with Accelerate's own precedence
    (argument > environment > recipe): ``mixed_precision=`` or ``ACCELERATE_MIXED_PRECISION`` must agree with
    the recipe's precision (a conflict is an error naming both values); a ``GradScalerKwargs`` handler's
    non-default fields override the recipe's ``loss_scale`` keys of the same name. Each such decision is
    recorded in :attr:`mp` ``.notes``.
    """

    def __init__(
        self, recipe: RecipeSpec, *, rehearse: bool | None = None, max_steps: int | None = None, **kwargs: Any
    ):
        rehearse = recipe.rehearse if rehearse is None else rehearse
        check_hardware(recipe, rehearse=rehearse)  # before Accelerate's own constructor changes anything
        _check_deepspeed_plugin(recipe, kwargs)
        decided = _mixed_precision_decision(recipe, kwargs.get("mixed_precision"))
        kwargs["mixed_precision"] = accelerate_precision(recipe)
        handlers = list(kwargs.pop("kwargs_handlers", None) or [])
        recipe, handlers, scaler_note = _merge_grad_scaler_kwargs(recipe, handlers)
        super().__init__(kwargs_handlers=handlers, **kwargs)
        self.recipe = recipe
        self.mp = start_runtime(recipe, device=self.device, rehearse=rehearse, notes=(decided, scaler_note))
        installed = install_on_accelerator(self, self.mp, late=False)
        #: what the installer put in place; who autocasts is carried out on each model at prepare (install_autocast)
        self._mp_installed = installed
        self._clipped_this_step = False
        self._mp_step_pending = False  # an optimizer step is done and the next has not begun (see _mp_next_step)
        #: the rows :meth:`mp_metrics` returned, with their step and the loop's values (the run report's series)
        self.mp_log: list[dict[str, Any]] = []
        self._mp_replaced: dict[int, torch.optim.Optimizer] = {}  # id(user's optimizer) -> the storage optimizer
        self._mp_storage_of: torch.nn.Module | None = None  # the model the storage was applied to
        #: a load_state in progress: the optimizers' conversion wrappers (their finish), the storage change, its notes
        self._mp_loading: tuple[list[Any], tuple[str, str] | None, list[str]] = ([], None, [])
        # the runtime's state rides in save_state/load_state; its decisions on the model come before the weights load
        checkpoint = _RuntimeCheckpoint(self)
        self.register_for_checkpointing(checkpoint)
        self.register_load_state_pre_hook(checkpoint.before_load)
        if max_steps is not None:
            self.set_max_steps(max_steps)

    def load_state(self, input_dir: str | None = None, **kwargs: Any) -> None:
        """Accelerate's ``load_state``; a storage change of the checkpoint's (see :func:`_storage_at_load`) must have
        been converted by the time it returns, and no conversion wrapper outlives it, whatever it raised."""
        from hf_mixedprec.training.recipe_change import RecipeChangeRefused

        self._mp_loading = ([], None, [])
        try:
            result = super().load_state(input_dir, **kwargs)
        finally:
            finishes, pair, notes = self._mp_loading
            loaded = [finish() for finish in finishes]
            self._mp_loading = ([], None, [])
        for text in notes:
            self.mp.note(text)
        if pair is not None and not any(loaded):
            raise RecipeChangeRefused(
                f"resume: the checkpoint was written under storage.master {pair[0]}, this run keeps storage.master "
                f"{pair[1]}, and load_state loaded no optimizer state to convert it with (allowed: prepare() the "
                f"optimizer before load_state, or storage.master {pair[0]})"
            )
        self.mp.history.converted(pair)
        return result

    def set_max_steps(self, max_steps: int) -> None:
        """The run's length in optimizer steps, for a phased recipe whose phases start at fractions of it (call it
        before ``prepare``, or pass ``make_accelerator(recipe, max_steps=N)``)."""
        self.mp.set_max_steps(max_steps)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Accelerate's ``backward``, after recording the loss it back-propagates for the loss detectors."""
        if isinstance(loss, torch.Tensor):
            self.mp.record_loss(backpropagated_loss(self, loss))
        return super().backward(loss, **kwargs)

    # -- prepare -------------------------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: Any = None) -> Any:
        """Accelerate's ``prepare``, after checking that every optimizer given can take the recipe's storage (a
        refusal leaves the model as it was: parameters change dtype when the model is prepared)."""
        from hf_mixedprec.storage.setup import replaceable

        for obj in args:
            if isinstance(obj, torch.optim.Optimizer):
                replaceable(self.recipe.storage, obj)
        # in any order of the arguments, and also where Accelerate's FSDP2 path skips prepare_model
        models = [obj for obj in args if isinstance(obj, torch.nn.Module)]
        for model in models:
            self._mp_storage(model)
        if not self.is_fsdp2:
            return super().prepare(*args, device_placement=device_placement)
        for model in models:  # Accelerate's FSDP2 path never calls prepare_model: its work comes before the sharding
            self.mp.convert_model(model)
            install_autocast(self, self.mp, model, self._mp_installed, late=False)
        result = super().prepare(*args, device_placement=device_placement)
        for model in models:
            self._mp_after_prepare(model)
        return result

    def _mp_storage(self, model: torch.nn.Module) -> None:
        """The recipe's storage on ``model``'s parameters, once per model."""
        if self.mp.plan is None or self._mp_storage_of is not model:
            self.mp.prepare_storage(model)
            self._mp_storage_of = model

    def prepare_model(
        self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ):
        if not evaluation_mode:
            self._mp_storage(model)  # parameter dtypes as the recipe's storage says, then FP8 layers
            self.mp.convert_model(model)  # FP8 state stays out of unwrap_model(model).save_pretrained()
            install_autocast(self, self.mp, model, self._mp_installed, late=False)  # ours innermost
            self._mp_after_prepare(model)
        else:
            self._mp_model = model
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    def _mp_after_prepare(self, model: torch.nn.Module) -> None:
        """The model is the run's: its steps begin at its first training forward after each optimizer step."""
        self._mp_model = model
        self.mp.begin_step(model)
        self._mp_step_pending = False
        model.register_forward_pre_hook(_next_step_hook(self))

    def _mp_next_step(self, model: torch.nn.Module, args: Any) -> None:
        """A forward pre-hook: the first training forward after an optimizer step begins the next step (a phase
        boundary, FP8 sampling). Not right after ``optimizer.step()``: what the loop logs between the two
        (:meth:`mp_metrics`, ``save_state``) then describes the step just done, as the Trainer callback's rows do."""
        if self._mp_step_pending and model.training and model is self._mp_model:
            self._mp_step_pending = False
            opt = self._optimizers[0].optimizer if self._optimizers else None
            self.mp.begin_step(model, opt)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None):
        plan = self.mp.plan
        if plan is None and not self.recipe.storage.is_default:
            from hf_mixedprec.storage import StorageRefusal

            raise StorageRefusal(
                f"storage.master {self.recipe.storage.master} / optimizer_states {self.recipe.storage.optimizer_states}: "
                "the optimizer was prepared before its model; pass the model to prepare() first or in the same call"
            )
        if plan is not None:
            from hf_mixedprec.storage import replace_optimizer

            built = replace_optimizer(self.recipe.storage, optimizer)
            if built is not optimizer:
                self._mp_replaced[id(optimizer)] = built
                track_steps_for_scheduler(built)  # before Accelerate keeps its step method
                self.mp.note(
                    f"storage.master {self.recipe.storage.master} with optimizer_states "
                    f"{self.recipe.storage.optimizer_states}: the {type(optimizer).__name__} passed to prepare() runs "
                    f"as {type(built).__name__} over the same parameter groups (an LR scheduler made for it still "
                    "drives it)"
                )
                optimizer = built
        opt = super().prepare_optimizer(optimizer, device_placement=device_placement)
        inner_step = opt.step

        @functools.wraps(inner_step)
        def step(*args: Any, **kwargs: Any) -> Any:
            if self.sync_gradients:
                # the previous step, if skipped, is taken out of the LR schedule before this step uses it
                self.mp.rewind_schedule(opt, self._schedulers[0] if self._schedulers else None)
                if not self._clipped_this_step:
                    self.unscale_gradients()
                    self.mp.before_optimizer_step(model_parameters(self._mp_model), opt.optimizer)
                out = inner_step(*args, **kwargs)
                self.mp.after_optimizer_step(self._mp_model, opt)
                self._mp_step_pending = True  # the next step begins at its first training forward
                self._clipped_this_step = False
                return out
            return inner_step(*args, **kwargs)

        opt.step = step  # type: ignore[method-assign]
        return opt

    def prepare_scheduler(self, scheduler: Any):
        """Accelerate's, after moving a scheduler made for an optimizer the storage replaced onto the replacement."""
        built = self._mp_replaced.get(id(getattr(scheduler, "optimizer", None)))
        if built is not None:
            scheduler.optimizer = built
        return super().prepare_scheduler(scheduler)

    # -- clipping --------------------------------------------------------------------------------------
    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Accelerate's, and in a phased run's FP16 phase the runtime's unscale (Accelerate unscales only when its
        ``mixed_precision`` is fp16, which a phased recipe's is not; the loss scaler is the runtime's)."""
        if not isinstance(self.mp.scaler, PhaseScaler):
            return super().unscale_gradients(optimizer)
        if not self.mp.guard:
            chosen = optimizer if optimizer is not None else self._optimizers
            for opt in chosen if isinstance(chosen, (list, tuple)) else [chosen]:
                self.mp.ensure_unscaled(getattr(opt, "optimizer", opt))
        return None

    # -- clipping --------------------------------------------------------------------------------------
    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        """With an adaptive recipe clipper, clip with it (``max_norm`` is ignored, as the recipe governs)."""
        if self.mp.clipper is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        self.unscale_gradients()
        optimizers = [getattr(o, "optimizer", o) for o in self._optimizers]
        res = self.mp.before_optimizer_step(list(parameters), optimizers[0] if optimizers else None)
        self._clipped_this_step = True
        return res.total_norm if res is not None else torch.zeros(())

    def mp_metrics(self, **row: float) -> dict[str, float]:
        """The recipe's metrics (``mp/...``) of the step just done, after checking the health detectors; reads device
        values, so call it only when you log. Check :attr:`should_stop` afterwards.

        The metrics, with the step and the loop's own values given as ``row`` (``mp_metrics(loss=loss.item())``),
        are kept as one log row in :attr:`mp_log` (the run report's series:
        ``hf_mixedprec.training.run_report.write_run_report(dir, log_history=accelerator.mp_log, runtime=accelerator.mp)``)
        and ride in ``save_state``."""
        opt = self._optimizers[0] if self._optimizers else None
        self.mp.rewind_schedule(opt, self._schedulers[0] if self._schedulers else None)
        self.mp.check(self._mp_model, opt)
        out = self.mp.metrics()
        self.mp_log.append({**row, **out, "step": self.mp.steps})
        return out

    @property
    def should_stop(self) -> str | None:
        """Why a health reaction asked to stop (save a checkpoint, then stop), or None."""
        return self.mp.stop_requested


#: The key of the plugin's log rows beside the runtime's state in ``save_state``'s checkpoint.
LOG_KEY = "plugin_log"


def _next_step_hook(accelerator: MixedPrecisionAccelerator) -> Any:
    """The forward pre-hook behind :meth:`MixedPrecisionAccelerator._mp_next_step`, holding the accelerator weakly: a
    bound method would make ``copy.deepcopy(model)`` (an EMA copy) and ``torch.save(model)`` copy the accelerator."""
    ref = weakref.ref(accelerator)

    def hook(module: torch.nn.Module, args: Any) -> None:
        acc = ref()
        if acc is not None:
            acc._mp_next_step(module, args)

    return hook


class _RuntimeCheckpoint:
    """hf_mixedprec's runtime state (clipper statistics, detector windows, events, skipped-step counts, FP8 fallbacks,
    the phase in force) as an object ``accelerator.save_state`` writes (``register_for_checkpointing``:
    ``custom_checkpoint_<index>.pkl``, plain lists and numbers) and ``load_state`` restores.

    ``load_state`` loads the model's weights before its registered objects, but a layer a fallback moved to high
    precision (or a phase's layers) has other state-dict keys: :meth:`before_load` runs as a ``load_state`` pre-hook
    and restores the state, layers included, before the weights load; the later call then has nothing left to do."""

    def __init__(self, accelerator: MixedPrecisionAccelerator) -> None:
        self._acc = weakref.ref(accelerator)
        # Accelerate names the file by the object's place in its registered list (accelerator.py, save_state)
        self.index = custom_object_count(accelerator)
        self._restored = False

    def state_dict(self) -> dict[str, Any]:
        acc = self._acc()
        return {**acc.mp.state_dict(), LOG_KEY: list(acc.mp_log)} if acc is not None else {}

    def before_load(self, models: list[torch.nn.Module], input_dir: str) -> None:
        acc = self._acc()
        path = os.path.join(input_dir, f"custom_checkpoint_{self.index}.pkl")
        if acc is None or not os.path.isfile(path):  # Accelerate refuses the mismatch itself
            return
        state = torch.load(path, map_location="cpu", weights_only=True)  # lists, numbers and strings only
        self._restore(acc, state)
        self._restored = True
        _storage_at_load(acc, models, input_dir, state.get("recipe"))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        acc = self._acc()
        if self._restored or acc is None:
            self._restored = False
            return
        self._restore(acc, state)

    @staticmethod
    def _restore(acc: MixedPrecisionAccelerator, state: dict[str, Any]) -> None:
        state = dict(state)
        acc.mp_log = list(state.pop(LOG_KEY, []))
        acc.mp.load_state_dict(state, model=getattr(acc, "_mp_model", None))
        # the step after the checkpoint begins at its first forward (its phase, its FP8 sampling), as in the run
        # that wrote it; the step begun at prepare() was the run's first
        acc._mp_step_pending = True


def _storage_at_load(
    acc: MixedPrecisionAccelerator, models: list[torch.nn.Module], input_dir: str, saved: dict[str, Any] | None
) -> None:
    """Before ``load_state`` loads the optimizers (after the weights): each optimizer's state converted for the
    storage change of this checkpoint, recorded as ``saved``
    (:func:`hf_mixedprec.training.recipe_change.storage_conversion`), or checked to be of its own class;
    :meth:`MixedPrecisionAccelerator.load_state` finishes what this starts."""
    from accelerate.utils import DistributedType

    from hf_mixedprec.storage.convert import convert_next_load
    from hf_mixedprec.training.recipe_change import storage_conversion

    sharded = acc.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
    engine = acc.distributed_type.value if sharded else None
    model = models[0] if models else None
    pair, weights = storage_conversion(saved, acc.mp.history.record, input_dir, model, engine)
    if sharded:
        return
    notes: list[str] = []
    finishes = [convert_next_load(getattr(o, "optimizer", o), pair, weights, notes=notes) for o in acc._optimizers]
    acc._mp_loading = (finishes, pair, notes)


def _check_deepspeed_plugin(recipe: RecipeSpec, kwargs: dict[str, Any]) -> None:
    """A DeepSpeed recipe needs an Accelerator that runs DeepSpeed (a ``deepspeed_plugin``, or the
    ``ACCELERATE_USE_DEEPSPEED`` an ``accelerate launch`` DeepSpeed config sets); otherwise the loop would train
    without it, silently. An FP8 recipe under DeepSpeed is the Trainer callback's (its layers are converted before the
    engine takes them); here Accelerate's DeepSpeed preparation would skip our conversion and autocast: refused."""
    asked = kwargs.get("deepspeed_plugin") is not None or kwargs.get("deepspeed_plugins") is not None
    runs = asked or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").strip().lower() == "true"
    if runs and "fp8" in recipe.precisions():
        raise ValueError(
            f"recipe {recipe.name!r} (precision fp8) with DeepSpeed on recipe.accelerator(): Accelerate's DeepSpeed "
            "preparation never reaches hf_mixedprec's FP8 conversion and autocast, so the loop would train without FP8 "
            "(allowed: an FP8 recipe under DeepSpeed through a Trainer with recipe.callbacks(); or distributed.strategy "
            "none, ddp or fsdp2 on recipe.accelerator())"
        )
    if recipe.distributed.strategy != "deepspeed" or runs:
        return
    raise ValueError(
        f"recipe {recipe.name!r} has distributed.strategy deepspeed, but this Accelerator runs without DeepSpeed (no "
        "deepspeed_plugin, no DeepSpeed config from accelerate launch), so the loop would train without it (allowed: "
        "`hf-mixedprec launch --recipe RECIPE.yaml your_script.py`, or a recipe with distributed.strategy none)"
    )


def _mixed_precision_decision(recipe: RecipeSpec, argument: Any) -> str | None:
    """Check what the user asked Accelerate for (argument, else ``ACCELERATE_MIXED_PRECISION``) against the
    recipe; returns the note to record (None when nothing was asked or it agrees). A conflict raises
    ``ValueError``."""
    wanted = accelerate_precision(recipe)
    # an FP8 recipe trains under BF16 autocast with its FP8 layers applied by hf_mixedprec
    allowed = (wanted, "fp8") if "fp8" in recipe.precisions() else (wanted,)
    env = os.environ.get(MIXED_PRECISION_ENV)
    if argument is not None:
        source, value = "mixed_precision", str(argument).lower()
    elif env:
        source, value = MIXED_PRECISION_ENV, env.strip().lower()
    else:
        return None
    if value not in allowed:
        raise ValueError(
            f"{source}={value!r} contradicts recipe {recipe.name!r} (precision {recipe.precision}, which Accelerate "
            f"runs as mixed_precision={wanted!r}) (allowed: {' or '.join(repr(a) for a in allowed)}; or leave it "
            f"out, or load a recipe with the precision you want)"
        )
    if value == wanted:
        log.info("hf_mixedprec: %s=%r agrees with recipe %r", source, value, recipe.name)
        return None
    return (
        f"{source}={value!r}: recipe {recipe.name!r} applies FP8 itself (backend "
        f"{recipe.fp8.backend if recipe.fp8 else '?'}); Accelerate runs mixed_precision={wanted!r}"
    )


def _merge_grad_scaler_kwargs(recipe: RecipeSpec, handlers: list[Any]) -> tuple[RecipeSpec, list[Any], str | None]:
    """Merge a user's ``GradScalerKwargs`` into the recipe's ``loss_scale`` (the handler's non-default fields
    win); returns the recipe to run, the handlers for Accelerate (one stock ``GradScalerKwargs``) and a note."""
    mine = [h for h in handlers if isinstance(h, GradScalerKwargs)]
    rest = [h for h in handlers if not isinstance(h, GradScalerKwargs)]
    note = None
    if mine:
        user = mine[-1].to_kwargs()  # only the fields the user changed from Accelerate's defaults
        shown = ", ".join(f"{k}={v!r}" for k, v in user.items())
        if recipe.precision != "fp16" or recipe.loss_scale is None:
            raise ValueError(
                f"GradScalerKwargs({shown}) applies to fp16 loss scaling, but recipe {recipe.name!r} has precision "
                f"{recipe.precision} (allowed: no GradScalerKwargs, or an fp16 recipe)"
            )
        if user.pop("enabled", True) is False:
            raise ValueError(
                f"GradScalerKwargs(enabled=False) contradicts recipe {recipe.name!r}: its fp16 precision needs loss "
                "scaling (allowed: enabled=True; to train without loss scaling use a bf16 or fp32 recipe)"
            )
        ls = recipe.loss_scale
        try:
            merged = type(ls).model_validate({**ls.model_dump(), **user})
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(["loss_scale", *map(str, err["loc"])])
            raise ValueError(
                f"GradScalerKwargs({shown}) merged into recipe {recipe.name!r}: {where}: {err['msg']}"
            ) from None
        changes = [f"loss_scale.{k} {getattr(ls, k)!r} -> {v!r}" for k, v in user.items() if getattr(ls, k) != v]
        note = (
            f"GradScalerKwargs({shown}) overrides recipe {recipe.name!r}: {', '.join(changes)}"
            if changes
            else f"GradScalerKwargs({shown}) agrees with recipe {recipe.name!r}"
        )
        recipe = recipe.model_copy(update={"loss_scale": merged})
    gsk = grad_scaler_kwargs(recipe)
    return recipe, [*rest, *([gsk] if gsk is not None else [])], note


def make_accelerator(recipe: RecipeSpec, **accelerator_kwargs: Any) -> MixedPrecisionAccelerator:
    """An ``Accelerator`` configured by ``recipe`` (precision, GradScaler settings, FP8 conversion, clipping)."""
    return MixedPrecisionAccelerator(recipe, **accelerator_kwargs)
