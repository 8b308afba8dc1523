"""The trainer-free core that applies a recipe to a training loop: precision, loss scaling, clipping, FP8.

Both the Trainer callback and the Accelerate plugin delegate to :class:`MixedPrecisionRuntime`, so a
recipe behaves the same everywhere. Per optimizer step the order follows transformers' training step
(``Trainer._inner_training_loop`` in ``transformers/trainer.py``): backward with the scaled loss -> unscale ->
:meth:`before_optimizer_step` (read the scaler's found-inf, clip the unscaled gradients) -> ``optimizer.step()``
(a real ``GradScaler`` skips it on overflow) -> :meth:`after_optimizer_step` (advance FP8 delayed scaling, count
skips). Nothing here reads a device value on the host except :meth:`metrics`, :meth:`state_dict` and
:func:`fp8_state_dict`, which run only when a log or checkpoint is due.

The runtime sequences a step; loss scaling and exact skipping live in :mod:`hf_mixedprec.training.amp`
(:class:`~hf_mixedprec.training.amp.LossScaling`), what health events make the run do in :mod:`hf_mixedprec.training.reactions`, what
sampled steps measure and logging steps read in :mod:`hf_mixedprec.training.runtime_stats`.

Rehearsal runs a recipe for hardware you don't have: FP16 recipes use autocast(float16) and a real
``torch.amp.GradScaler`` on the current device (CPU too), so loss scaling behaves as on a V100; FP8 recipes
use the emulated backend with the recipe's scaling. It is never silent: :attr:`notes` says so and the run
report records it.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hf_mixedprec.core import formats
from hf_mixedprec.core import metrics as M
from hf_mixedprec.core._device import Constants, is_main_rank, several_ranks, wrap_forward
from hf_mixedprec.fp8 import ConversionReport, convert, fp8_layers, fp8_step
from hf_mixedprec.fp8.layers import sampled_layers
from hf_mixedprec.fp8.state import (
    FP8_STATE_FILE,
    exclude_fp8_state_from_saves,
    fp8_state_dict,
    load_fp8_state,
    load_fp8_state_dict,
    save_fp8_state,
)
from hf_mixedprec.fp8.stats import FP8Statistics
from hf_mixedprec.fp8.torchao_backend import precompute_fsdp_scales
from hf_mixedprec.precision.plan import PrecisionPlan, run_plan
from hf_mixedprec.recipes.hardware import cpu_speed_note
from hf_mixedprec.recipes.module_rules import install_compute
from hf_mixedprec.recipes.schema import RecipeSpec
from hf_mixedprec.storage import apply_storage
from hf_mixedprec.training.amp import GuardScaler, LossScaling
from hf_mixedprec.training.clipping import Clipper, ClipResult, global_grad_norm, make_clipper, with_grads
from hf_mixedprec.training.expert_load import ExpertWatch
from hf_mixedprec.training.health import HealthEvent, HealthMonitor, layers_to_bf16
from hf_mixedprec.training.phases import PhaseRunner
from hf_mixedprec.training.reactions import Reactions
from hf_mixedprec.training.recipe_change import RecipeHistory
from hf_mixedprec.training.runtime_stats import _LogRead, _read_for_log, _UpdateProbe, observe_fp8_samples

__all__ = [
    "FP8_STATE_FILE",
    "GuardScaler",
    "MixedPrecisionRuntime",
    "compute_dtype",
    "exclude_fp8_state_from_saves",
    "fp8_state_dict",
    "is_main_rank",
    "load_fp8_state",
    "load_fp8_state_dict",
    "save_fp8_state",
]

log = logging.getLogger("hf_mixedprec")

STATE_VERSION = 1


#: Models whose forward already runs under a recipe's autocast (weak: no attribute is set on the user's model).
_AUTOCAST_WRAPPED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def compute_dtype(recipe: RecipeSpec) -> torch.dtype | None:
    """The autocast dtype a recipe trains in (None for fp32). FP8 layers sit inside a BF16 autocast."""
    return formats.compute_dtype(recipe.precision)


def _optimizer_notes(optimizer: Any) -> list[str]:
    """What the optimizer (StorageAdamW: its single pass turned down) decided since the last step, for the run report;
    it logged each loudly already."""
    take_notes = getattr(getattr(optimizer, "optimizer", optimizer), "take_notes", None)
    return take_notes() if take_notes is not None else []


def _rehearsed_what(recipe: RecipeSpec) -> str:
    """What a rehearsal runs differently from the recipe's own hardware, in a few words."""
    if recipe.precision == "fp8" and recipe.fp8 is not None and recipe.fp8.backend == "torchao":
        return "FP8 layers run through torchao with emulate=True (torchao's exact FP8 casts, GEMMs in high precision)"
    if recipe.precision == "fp8" and recipe.fp8 is not None and recipe.fp8.backend == "native":
        return (
            "FP8 layers run natively where torch._scaled_mm runs here (the same quantization; else emulated), "
            "only the hardware check is skipped"
        )
    if recipe.precision == "fp8":
        return "FP8 layers are emulated (exact FP8 quantization, GEMMs in FP32), not sped up"
    if recipe.precision == "fp16":
        return "FP16 autocast and the real dynamic loss scaler run here (slower than on a GPU; numerics are FP16's)"
    return f"{recipe.precision} runs here as it would on its hardware (only the hardware check is skipped)"


def _delegate(part: str, name: str, doc: str, *, writable: bool = True) -> Any:
    """A property for ``self.<part>.<name>``: state :mod:`hf_mixedprec.training.amp` and :mod:`hf_mixedprec.training.reactions` keep
    now, which integrations and tests still read (and set) on the runtime."""

    def fget(self: Any) -> Any:
        return getattr(getattr(self, part), name)

    def fset(self: Any, value: Any) -> None:
        setattr(getattr(self, part), name, value)

    return property(fget, fset if writable else None, doc=doc)


class MixedPrecisionRuntime:
    """Applies one recipe to one model/optimizer pair (see module docs)."""

    def __init__(self, recipe: RecipeSpec, *, device: torch.device | str = "cpu", rehearse: bool | None = None):
        self.recipe, self.device = recipe, torch.device(device)
        self.rehearse = bool(recipe.rehearse if rehearse is None else rehearse)
        self.notes: list[str] = []
        #: a phased recipe's schedule and the phase in force (None without ``phases:``)
        self.phases: PhaseRunner | None = PhaseRunner(recipe, self.note) if recipe.phases is not None else None
        self.clipper: Clipper | None = make_clipper(recipe.clipping.method, **recipe.clipping.params())
        if self.clipper is not None:  # its state is made on the device now, not copied there during a step
            self.clipper.to(self.device)
        self.fp8_report: ConversionReport | None = None
        #: the precision plan of the model this runtime prepared (:meth:`prepare_storage`), None before
        self.plan: PrecisionPlan | None = None
        self.steps = 0  # optimizer steps seen (host-side count, known without looking at tensors)
        #: the GradScaler, the step's skip flag, the skipped-step count and the LR-schedule rewind
        self.amp = LossScaling(recipe, self.device, self.note)
        #: what health events make the run do (stop, fallback, lower_lr) and what they decided
        self.reactions = Reactions(recipe, self.note)
        self._last: ClipResult | None = None
        self._k = Constants()
        #: Under DeepSpeed the engine owns loss scaling and clipping; this reads its scaler for the metrics.
        self.external_scaler: Any = None
        self.monitor: HealthMonitor | None = (
            HealthMonitor(recipe.health, device=self.device) if recipe.health.enabled else None
        )
        self._loss_sum = torch.zeros((), device=self.device)
        self._loss_n = 0  # forwards since the last optimizer step (host: the hook runs on the host)
        self._sampling = False
        #: the FP8 layers' sampled statistics on their way to the monitor and the log (:mod:`hf_mixedprec.fp8.stats`)
        self.fp8_stats = FP8Statistics()
        self.experts = ExpertWatch(recipe.health, self.device)  # an MoE model's tokens per expert (health on)
        self.checks_on_every_rank = False  # True: checks run on every rank at once (sampled FP8 stats are combined)
        self._log_read: _LogRead | None = None  # what check() read for this logging step's metrics()
        self._update_probe = _UpdateProbe()
        self.last_norm: torch.Tensor | None = None  # the unscaled gradient norm of the last step (device)
        self._noted_no_loss = False
        #: ``mp/`` metrics computed at a logging step, waiting to be merged into the trainer's own log row
        self.pending_log: dict[str, float] | None = None
        self.history = RecipeHistory(recipe)  #: the recipes trained under; what a resume under another may do
        if self.rehearse:
            for spec in dict.fromkeys(recipe.phase_specs()):
                self.note(f"REHEARSAL: recipe {recipe.name!r} on {self.device.type}: {_rehearsed_what(spec)}")
        for text in recipe.auto_notes:  # load_recipe("auto") logged them loudly already; the run report keeps them
            self.note(text, quiet=True)
        #: on a CPU, the one line saying this recipe computes in a 16-bit format the CPU emulates, and how much
        #: slower its GEMMs are (None where native, or not on a CPU); the run summary repeats it
        self.cpu_speed: str | None = cpu_speed_note(recipe) if self.device.type == "cpu" else None
        if self.cpu_speed is not None:
            self.note(self.cpu_speed)

    @property
    def active(self) -> RecipeSpec:
        """The recipe the current step trains with: the recipe itself, or the phase in force."""
        return self.recipe if self.phases is None else self.phases.active

    def note(self, text: str, *, quiet: bool = False) -> None:
        """Record a decision or fallback for the run report; logged as a warning (at INFO when ``quiet``: routine)."""
        self.notes.append(text)
        if is_main_rank():  # every rank records it; one prints it
            log.log(logging.INFO if quiet else logging.WARNING, "hf_mixedprec: %s", text)

    # -- what amp and reactions keep, readable (and settable) here as before they took it over -----------------
    scaler: torch.amp.GradScaler | None = _delegate("amp", "scaler", "The run's GradScaler (loss scaler or guard).")
    guard: bool = _delegate("amp", "guard", "Whether :attr:`scaler` is the scale-1 guard rather than a loss scaler.")
    _skipped: torch.Tensor = _delegate("amp", "skipped", "Skipped optimizer steps so far (device).", writable=False)
    _optimizer_skips_itself: bool = _delegate(
        "amp", "optimizer_skips_itself", "Whether the optimizer skips inside ``step()`` (fused).", writable=False
    )
    events: list[dict[str, Any]] = _delegate("reactions", "events", "Every health event so far, as a dict.")
    stop_requested: str | None = _delegate("reactions", "stop_requested", "Why a reaction asked to stop, or None.")
    fallback_recipe: str | None = _delegate("reactions", "fallback_recipe", "The recipe an FP16 fallback names.")
    moved_layers: list[str] = _delegate("reactions", "moved_layers", "FP8 layers a fallback moved to BF16.")

    # -- setup -------------------------------------------------------------------------------------
    def wants_guard(self) -> bool:
        """See :meth:`hf_mixedprec.training.amp.LossScaling.wants_guard`."""
        return self.amp.wants_guard()

    def make_guard_scaler(self) -> torch.amp.GradScaler:
        """A :class:`GuardScaler` (scale 1) whose only job is skipping flagged steps exactly."""
        return self.amp.make_guard_scaler()

    def make_grad_scaler(self) -> torch.amp.GradScaler | None:
        """A real ``torch.amp.GradScaler`` with the recipe's loss-scale settings (fp16 only)."""
        return self.amp.make_grad_scaler()

    def convert_model(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, spec: RecipeSpec | None = None
    ) -> ConversionReport | None:
        """Convert ``model`` to FP8 as the plan of the recipe (``spec``: a phase's) says; None for other precisions.
        The FP8 layers' state is kept out of ``save_pretrained``."""
        return _convert_model(self, model, optimizer, spec or self.active)

    def prepare_storage(self, model: nn.Module, check: Any = None, family: str | None = None) -> PrecisionPlan:
        """Build the run's precision plan for ``model`` and put its storage into effect (see :func:`_prepare_storage`)."""
        return _prepare_storage(self, model, check, family)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The autocast of the step in force; a phased run's FP32 phase turns off any autocast around it."""
        dtype = compute_dtype(self.active)
        if dtype is None:
            return contextlib.nullcontext() if self.phases is None else torch.autocast(self.device.type, enabled=False)
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def wrap_forward_with_autocast(self, model: nn.Module) -> bool:
        """Run ``model.forward`` under the recipe's autocast (where the framework would not; always for a phased
        recipe, whose autocast changes at its boundaries: the wrapper reads it at every forward). False when there
        was nothing to do (no autocast, or wrapped already)."""
        if (compute_dtype(self.recipe) is None and self.phases is None) or model in _AUTOCAST_WRAPPED:
            return False
        wrap_forward(model, self.autocast)
        _AUTOCAST_WRAPPED.add(model)
        return True

    def apply_tf32(self) -> None:
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = self.recipe.tf32
            torch.backends.cudnn.allow_tf32 = self.recipe.tf32

    # -- per optimizer step (device only) ------------------------------------------------------------
    def record_loss(self, loss: torch.Tensor) -> None:
        """Record the loss one backward pass back-propagates (before any loss scaling); no host read.

        Called from ``accelerator.backward`` (the Trainer callback and the Accelerate plugin route it here), so
        the loss detectors see the loss that trains the model however it was computed: the model's forward,
        label smoothing, ``compute_loss_func``, an overridden ``compute_loss`` or a hand-written loop. Under
        gradient accumulation each micro-batch's loss is already divided for accumulation, so the step's loss
        is their sum.
        """
        value = loss.detach()
        if value.dtype != torch.float32 or value.device != self.device:
            value = value.to(device=self.device, dtype=torch.float32)
        if value.dim():
            value = value.sum()
        self._loss_sum = value if self._loss_n == 0 else self._loss_sum + value
        self._loss_n += 1

    def set_max_steps(self, max_steps: int) -> None:
        """The run's length in optimizer steps, for phases that start at fractions of it."""
        if self.phases is not None:
            self.phases.set_max_steps(max_steps)

    def begin_step(self, model: nn.Module, optimizer: Any = None) -> None:
        """Before the step's forward passes: enter the next phase at a boundary (``optimizer``: the one a backend
        that replaces Parameters must update), and turn FP8 statistics on for sampled steps only."""
        if self.phases is not None and self.phases.due(self.steps):
            self._switch_phase(model, optimizer)
        if self.monitor is not None:
            self.experts.see(model)
        every = self.recipe.health.fp8_sample_every
        self._sampling = self.monitor is not None and (self.steps + 1) % every == 0
        if self.active.precision == "fp8":
            self.fp8_stats.record(sampled_layers(model), self._sampling)

    def ensure_unscaled(self, optimizer: torch.optim.Optimizer | None) -> None:
        """FP16: unscale the gradients once (the GradScaler refuses a second unscale_ before update())."""
        self.amp.ensure_unscaled(optimizer)

    def before_optimizer_step(
        self,
        parameters: Iterable[Any],
        optimizer: torch.optim.Optimizer | None = None,
        total_norm: torch.Tensor | None = None,
    ) -> ClipResult | None:
        """Unscale (FP16), note whether the step must be skipped, clip, run the detectors (no host sync).

        The gradient norm is computed once and shared by the clipper and the detectors.
        """
        self.ensure_unscaled(optimizer)
        params, grads = with_grads(parameters)  # the one pass over the parameters this step
        norm = total_norm if total_norm is not None else global_grad_norm(grads)
        self.last_norm = norm
        if self.clipper is not None:
            self._last = self.clipper.clip_grads_(params, grads, total_norm=norm)
        loss = self._step_loss()
        if loss is None and not self._noted_no_loss:
            self._noted_no_loss = True
            self.note(
                "no loss reached accelerator.backward before this optimizer step (a loss back-propagated with "
                "loss.backward() is not seen): such steps are judged by their gradients alone and never skipped "
                "for a missing loss"
            )
        skip = None
        if self.monitor is not None:
            d = self.recipe.health.detectors
            watched = loss if (d.loss_spike.enabled or d.nonfinite_loss.enabled) else None
            flag = self.monitor.pre_step(loss=watched, grad_norm=norm)
            skip = flag if self.monitor.can_skip else None
        # a non-finite loss or gradient never reaches the weights, whatever the detectors' reactions
        bad = self._k.nonfinite(norm) if loss is None else self._k.nonfinite(norm) | self._k.nonfinite(loss)
        if skip is not None:
            bad = bad | skip
        self.amp.set_skip(optimizer, bad)
        self._loss_n = 0
        if self.monitor is not None and self._sampling and self.recipe.health.detectors.tiny_update.enabled:
            self._update_probe.take(params, optimizer)
        else:
            self._update_probe.clear()
        return self._last

    def _switch_phase(self, model: nn.Module, optimizer: Any, *, resume: bool = False) -> None:
        """Enter the phase of the coming step, or with ``resume`` put the model back in the checkpoint's phase (see
        :class:`hf_mixedprec.training.phases.PhaseRunner`)."""
        assert self.phases is not None
        inner = getattr(optimizer, "optimizer", optimizer)

        def to_fp8(spec: RecipeSpec) -> int:
            self.convert_model(model, inner, spec)
            layers_to_bf16(model, self.moved_layers)  # layers a health fallback moved stay in high precision
            return len(fp8_layers(model))

        if resume:
            self.phases.restore(model, to_fp8)
            entered = False
        else:
            entered = self.phases.switch(model, self.steps, to_fp8) is not None
        self.amp.enter_phase(self.active, resume=resume, new_phase=entered)
        self.reactions.recipe = self.active  # a whole-model fallback acts on the phase's precision
        self.fp8_stats.layers_changed()

    def _step_loss(self) -> torch.Tensor | None:
        """The loss this optimizer step back-propagated (the sum of its micro-batches' :meth:`record_loss`), the
        mean over ranks; None when no backward recorded one (nothing is guessed)."""
        return None if self._loss_n == 0 else _mean_over_ranks(self._loss_sum)

    def after_optimizer_step(self, model: nn.Module, optimizer: Any = None) -> None:
        """Advance FP8 delayed scaling, update the monitor and count skipped steps (device only)."""
        _fp8_after_step(self, model)
        self.experts.after_step()
        if self.monitor is not None:
            ratio = self._update_probe.ratio(self.amp.found_inf.device)
            if ratio is not None:
                self.monitor.observe_update(ratio, self.amp.found_inf)
            self.monitor.post_step(skipped=self.amp.found_inf, scale=self.amp.device_scale())
        self.amp.after_step(optimizer)
        self.steps += 1
        self.notes += _optimizer_notes(optimizer)

    def after_external_step(self, model: nn.Module | None = None) -> None:
        """Under DeepSpeed, after the engine's step: advance FP8 scaling as :meth:`after_optimizer_step` does, and
        feed the engine's skip, loss scale and the step's loss to the monitor (see :func:`_feed_external_step`)."""
        if model is not None:
            _fp8_after_step(self, model)
        self.experts.after_step()
        _feed_external_step(self)
        self._loss_n = 0
        self.steps += 1

    def rewind_schedule(self, optimizer: Any, scheduler: Any) -> int:
        """If the last optimizer step was skipped, take it back out of the LR schedule; returns how many steps.
        Call it before the next optimizer step (and at logging and checkpoint steps); see
        :meth:`hf_mixedprec.training.amp.LossScaling.rewind_schedule`."""
        return self.amp.rewind_schedule(optimizer, scheduler)

    # -- check and reporting (host sync: only when a log is due) ---------------------------------------
    def check(self, model: nn.Module, optimizer: Any = None, scheduler: Any = None) -> list[HealthEvent]:
        """Turn what the detectors latched into events and apply their reactions (host sync: check steps only).

        Everything this logging step reports is read here with one device-to-host copy (:func:`_read_for_log`):
        the detectors' records, the FP8 layers' statistics and what :meth:`metrics` reports next."""
        self._log_read = _read_for_log(self, model)
        if self.monitor is None:
            return []
        events = self.monitor.check(self._log_read.monitor)
        if self._log_read.experts:
            events += self.monitor.check_experts(self._log_read.experts)
        self.reactions.apply(events, model, optimizer, scheduler, step=self.steps)
        return events

    def metrics(self) -> dict[str, float]:
        """The ``mp/`` metrics of the last step; reads device values (with :meth:`check`'s one copy when it ran at
        this step), so only when a log is due."""
        got = self._log_read
        if got is None or got.step != self.steps:
            got = _read_for_log(self, None)
        self._log_read = None
        out = self.amp.metrics(self.external_scaler() if self.external_scaler is not None else None, host=got.amp)
        if self.monitor is not None:
            out[M.HEALTH_EVENTS] = float(len(self.events))
        if self.phases is not None:
            out[M.PHASE] = float(self.phases.index)
        out.update(self.fp8_stats.take_metrics())
        out.update(got.moe)
        if self.clipper is not None:
            self.clipper.host_sync(got.clip_sync)
        if got.clip is not None:
            out.update(got.clip)
        return out

    # -- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-friendly state (lists, not tensors) so it fits Trainer's trainer_state.json exactly."""
        return _runtime_state(self)

    def load_state_dict(self, state: dict[str, Any], model: nn.Module | None = None) -> None:
        """Restore :meth:`state_dict`; with ``model``, also the decisions made on it (FP8 layers a fallback moved
        to high precision are moved again, so the resumed run has the same module types and state-dict keys)."""
        _load_runtime_state(self, state, model)


def _prepare_storage(rt: MixedPrecisionRuntime, model: nn.Module, check: Any, family: str | None) -> PrecisionPlan:
    """The run's precision plan for ``model`` as loaded, and its storage put into effect: trainable parameters get the
    dtype ``storage:`` keeps them in, each change said in the notes; frozen ones are untouched. ``check(plan)`` runs
    first, so a refusal it raises leaves the model as it was. ``family``: the optimizer family the run uses, if known
    (the plan then says which optimizer states exist)."""
    phases = rt.recipe.precisions() if rt.phases is not None else ()
    rt.plan = run_plan(rt.active, model, rehearse=rt.rehearse, phases=phases, optimizer_family=family)
    if check is not None:
        check(rt.plan)
    for text in apply_storage(model, rt.plan):
        rt.note(text)
    assignment = rt.plan.assignment
    if assignment is not None:
        regions = install_compute(model, assignment, rt.active.precision, rt.device.type)
        for text in (*rt.recipe.legacy_notes, *assignment.notes, *regions):
            rt.note(text)
    return rt.plan


def _convert_model(
    rt: MixedPrecisionRuntime, model: nn.Module, optimizer: Any, spec: RecipeSpec
) -> ConversionReport | None:
    """:meth:`MixedPrecisionRuntime.convert_model`: with the FP8 decisions of the run's plan when it was made for
    ``spec``, else of a plan made for it now (a phase's recipe)."""
    if spec.precision != "fp8" or spec.fp8 is None:
        return None
    plan = rt.plan if (rt.plan is not None and rt.plan.recipe_spec is spec) else None
    plan = plan or run_plan(spec, model, rehearse=rt.rehearse)
    report = convert(model, spec, backend=plan.fp8_backend, optimizer=optimizer, decisions=plan.fp8_layers)
    report.notes[:0] = plan.fp8_notes
    rt.fp8_report = report
    exclude_fp8_state_from_saves(model)
    warning = [report.warning] if report.warning else []  # converting nothing: run report too
    rt.notes += [*report.notes, *warning]
    if is_main_rank():  # which layers run in FP8 is a decision the user must see, once; loud if it is none
        log.warning("hf_mixedprec: %s", report.summary())
    return report


def _fp8_after_step(rt: MixedPrecisionRuntime, model: nn.Module) -> None:
    """After an optimizer step of an FP8 phase: advance delayed scaling (amaxes reduced over the ranks), recompute
    FSDP2's FP8 all-gather scales, and keep a sampled step's statistics for the next check."""
    if rt.active.precision != "fp8":
        return
    fp8_step(model)
    if rt.recipe.distributed.fp8_all_gather:
        precompute_fsdp_scales(model)
    if rt.monitor is not None and rt._sampling:
        rt.fp8_stats.keep(sampled_layers(model))  # finished and observed at the next check


def _runtime_state(rt: MixedPrecisionRuntime) -> dict[str, Any]:
    """:meth:`MixedPrecisionRuntime.state_dict`."""
    observe_fp8_samples(rt)  # the monitor's state holds them
    clip = None
    if rt.clipper is not None:
        sd = rt.clipper.state_dict()
        clip = {**sd, "state": {k: _to_json(v) for k, v in sd["state"].items()}}
    return {
        "version": STATE_VERSION,
        "steps": rt.steps,
        "skipped": rt.amp.skipped_count(),
        "schedule_rewound": rt.amp.schedule_rewound,
        "external_skips": rt.amp.external_skips,
        "clipper": clip,
        "monitor": rt.monitor.state_dict() if rt.monitor is not None else None,
        "events": list(rt.events),
        "stopped": rt.stop_requested,
        "moved_layers": list(rt.moved_layers),
        "phases": rt.phases.state_dict() if rt.phases is not None else None,
        "expert_load": rt.experts.state_dict(),
        "recipe": rt.history.record,
        "recipes": [dict(r) for r in rt.history.entries],
        # FP16's loss scaler (numbers only); the guard's never changes. Trainer's scaler.pt may be absent: a callback
        # added after the Trainer was built installs the scaler after Trainer would have loaded that file
        "scaler": rt.scaler.state_dict() if rt.scaler is not None and not rt.guard else None,
    }


def _feed_external_step(rt: MixedPrecisionRuntime) -> None:
    """DeepSpeed checks every step's gradients for inf/NaN itself and skips such a step, under FP16 and under
    BF16 alike (``OVERFLOW! Skipping step``, counted in ``engine.skipped_steps``), so a non-finite step never
    reaches its weights. It decides that on the host inside ``engine.step()``: reading the count, the scale
    (Python values) and the loss it has already waited for adds no stall; the monitor lives on the CPU."""
    if rt.monitor is None or rt.external_scaler is None:
        return
    ds = rt.external_scaler()
    if ds is not None:
        grad, skipped, scale = rt.amp.external_step(ds)
        d = rt.recipe.health.detectors
        loss = rt._step_loss() if (d.loss_spike.enabled or d.nonfinite_loss.enabled) else None
        rt.monitor.pre_step(loss=loss, grad_norm=grad)
        rt.monitor.post_step(skipped=skipped, scale=scale)


def _load_runtime_state(rt: MixedPrecisionRuntime, state: dict[str, Any], model: nn.Module | None) -> None:
    """:meth:`MixedPrecisionRuntime.load_state_dict`."""
    if state.get("version") != STATE_VERSION:
        raise ValueError(f"hf_mixedprec runtime state version {state.get('version')!r} (expected {STATE_VERSION})")
    decision = rt.history.check(state, "the checkpoint", rt.note)  # decided before Trainer's load, if it could
    rt.steps = int(state["steps"])
    rt.history.resumed(state, rt.steps)
    if rt.phases is not None and state.get("phases") is not None:
        rt.phases.load_state_dict(state["phases"])
        if model is not None:  # the checkpoint's phase first, so its layers and FP8 state fit
            rt._switch_phase(model, None, resume=True)
        else:  # the loss scaler as the checkpoint's phase has it, before its state is loaded below
            rt.amp.enter_phase(rt.phases.checkpointed(), resume=True)
    if state.get("scaler") is not None and rt.scaler is not None and not rt.guard and not decision.drop_scaler:
        rt.scaler.load_state_dict(state["scaler"])
    rt.amp.load_counts(state["skipped"], int(state.get("schedule_rewound", 0)), int(state.get("external_skips", 0)))
    clip = None if decision.drop_clipper else state.get("clipper")
    if clip is None and rt.clipper is not None and rt.external_scaler is not None and not decision.drop_clipper:
        # under DeepSpeed the run that wrote it found at its first step that its engine could not take the clipper
        rt.clipper = None
        rt.note("resume: the checkpointed run trained without the recipe's clipper under DeepSpeed; so does this one")
    if (clip is None) != (rt.clipper is None) and not decision.drop_clipper:
        raise ValueError("checkpointed clipping state does not match the recipe's clipping.method")
    if clip is not None and rt.clipper is not None:
        rt.clipper.load_state_dict({**clip, "state": {k: _from_json(v) for k, v in clip["state"].items()}})
    if state.get("monitor") is not None and rt.monitor is not None:
        if state.get("stopped"):
            # the checkpoint was written by a stop reaction: start the detector windows afresh so the
            # resumed run (often under a changed recipe, with other windows) is not stopped again by the
            # same history
            rt.monitor.step = int(state["monitor"]["step"])
            rt.monitor.reset_windows()
            rt.note(f"resumed after a health stop ({state['stopped']}); detector windows start afresh")
        else:
            rt.monitor.load_state_dict(state["monitor"])
    rt.reactions.load(state.get("events", []), state.get("moved_layers", []), model)
    rt.experts.load_state_dict(state.get("expert_load"))  # absent in checkpoints written before it was kept


def _mean_over_ranks(loss: torch.Tensor) -> torch.Tensor:
    """``loss`` averaged over the ranks of a distributed run, so that every rank takes the same decision."""
    if several_ranks():
        loss = loss.clone()
        dist.all_reduce(loss, op=dist.ReduceOp.SUM)  # one decision for every rank
        loss = loss / dist.get_world_size()
    return loss


def _to_json(t: Any) -> Any:
    if isinstance(t, torch.Tensor):
        return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "data": t.flatten().tolist()}
    return t


def _from_json(v: Any) -> Any:
    if isinstance(v, dict) and {"dtype", "shape", "data"} <= set(v):
        return torch.tensor(v["data"], dtype=getattr(torch, v["dtype"])).reshape(v["shape"])
    return v
