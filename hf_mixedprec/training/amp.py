"""Loss scaling and exact step skipping: the GradScaler a recipe trains with, its found-inf, the skipped-step count
and taking skipped steps back out of the LR schedule.

torch's ``GradScaler`` (``torch/amp/grad_scaler.py``) skips ``optimizer.step()`` when the gradients it unscaled
hold an inf/NaN; :class:`LossScaling` folds the runtime's own skip decision (a non-finite loss or gradient, a
``skip_step`` detector) into that found-inf, so every skip happens on the device, without a host read. FP16 uses
a real scaler with the recipe's ``loss_scale``; every other precision a scale-1 :class:`GuardScaler`.

The private torch attributes this needs (the scaler's found-inf flags and live scale, the optimizer's fused-step
flag, the scheduler's last LR) are read and written through :mod:`hf_mixedprec.core._private`, and only there.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR

from hf_mixedprec.core import metrics as M
from hf_mixedprec.core._device import AsyncRead
from hf_mixedprec.core._private import (
    OptState,
    ensure_scale_tensor,
    found_inf_handed_to,
    optimizer_state,
    pin_scale,
    reset_optimizer_states,
    scale_tensor,
    set_last_lr,
    skips_inside_step,
    track_steps_for_scheduler,
)
from hf_mixedprec.recipes.schema import RecipeSpec

__all__ = ["GuardScaler", "LossScaling", "PhaseScaler", "track_steps_for_scheduler"]


class GuardScaler(torch.amp.GradScaler):
    """A ``GradScaler`` held at scale 1 that only skips flagged optimizer steps (BF16/FP8 runs).

    torch's GradScaler skips ``optimizer.step()`` when found-inf is set, inside the optimizer for AMP-aware
    ones such as fused AdamW (Trainer's default), without a host read. At scale 1 the rest of its work is
    exact no-ops, so this one does none of it: :meth:`scale` returns the loss as it is (a product with 1),
    the runtime marks the optimizer unscaled with its skip flag as found-inf (no pass over the gradients),
    :meth:`step` hands that flag to an AMP-aware optimizer directly, and :meth:`update` leaves the scale at 1
    (torch's would halve it after a skipped step). Anything else (a closure, an optimizer that is not
    AMP-aware, a stage the runtime did not set) goes through torch's own code.
    """

    def __init__(self, device: str = "cpu") -> None:
        super().__init__(device, init_scale=1.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2**30)
        self._takes_scaler: dict[Any, bool] = {}

    def scale(self, outputs: Any) -> Any:
        return outputs

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        state = optimizer_state(self, optimizer)
        found = state["found_inf_per_device"]
        fn = getattr(optimizer.step, "__func__", optimizer.step)
        if fn not in self._takes_scaler:  # torch's older contract: step(grad_scaler=...) does its own skipping
            self._takes_scaler[fn] = "grad_scaler" in inspect.signature(optimizer.step).parameters
        direct = (
            state["stage"] is OptState.UNSCALED
            and len(found) == 1
            and "closure" not in kwargs
            and skips_inside_step(optimizer)
            and not self._takes_scaler[fn]
        )
        if not direct:
            return super().step(optimizer, *args, **kwargs)
        try:
            with found_inf_handed_to(optimizer, next(iter(found.values()))):
                return optimizer.step(*args, **kwargs)
        finally:
            state["stage"] = OptState.STEPPED

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        reset_optimizer_states(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restoring any scaler's state (e.g. an FP16 run's ``scaler.pt``) keeps the guard at scale 1."""
        super().load_state_dict(state_dict)
        pin_scale(self, 1.0)


#: The guard's settings: scale 1, and growth that never comes (its ``update`` does not run torch's anyway).
_GUARD_STATE = {
    "scale": 1.0,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2**30,
    "_growth_tracker": 0,
}


class PhaseScaler(GuardScaler):
    """The GradScaler of a phased run with FP16 phases: the scale-1 guard outside them, torch's dynamic loss scaler
    inside them (:meth:`start` at an FP16 phase's first step, :meth:`retire` at its last).

    One object for the whole run, because Accelerate hands the scaler to the prepared optimizer once
    (``AcceleratedOptimizer.scaler``) and ``Accelerator.backward`` scales with ``accelerator.scaler``: swapping
    objects at a boundary would leave one of them holding the old scaler. Both transitions go through
    ``GradScaler.load_state_dict``, the public way to set a scale, its growth settings and the growth tracker."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__(device)
        self.scaling = False

    def start(self, ls: Any) -> None:
        """Begin loss scaling at ``ls.init_scale`` with ``ls``'s growth settings (a fresh scaler's state)."""
        self.scaling = True
        torch.amp.GradScaler.load_state_dict(
            self,
            {
                "scale": float(ls.init_scale),
                "growth_factor": float(ls.growth_factor),
                "backoff_factor": float(ls.backoff_factor),
                "growth_interval": int(ls.growth_interval),
                "_growth_tracker": 0,
            },
        )

    def retire(self) -> None:
        """End loss scaling: back to the guard at scale 1."""
        self.scaling = False
        torch.amp.GradScaler.load_state_dict(self, dict(_GUARD_STATE))

    def scale(self, outputs: Any) -> Any:
        return torch.amp.GradScaler.scale(self, outputs) if self.scaling else outputs

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if self.scaling:
            return torch.amp.GradScaler.step(self, optimizer, *args, **kwargs)
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        if self.scaling:
            torch.amp.GradScaler.update(self, new_scale)
        else:
            super().update(new_scale)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A checkpoint's loss-scaler state while scaling; the guard keeps scale 1 otherwise."""
        if self.scaling:
            torch.amp.GradScaler.load_state_dict(self, state_dict)
        else:
            super().load_state_dict(state_dict)


def _schedule_steps_per_step(scheduler: Any) -> int:
    """How far one optimizer step moves ``scheduler``: Accelerate's ``AcceleratedScheduler`` steps the wrapped
    schedule once per process per step unless batches are split (``accelerate/scheduler.py``); a plain
    scheduler (Trainer's) once."""
    if getattr(scheduler, "step_with_optimizer", False) and not getattr(scheduler, "split_batches", True):
        return max(1, dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1)
    return 1


class LossScaling:
    """The run's GradScaler (a real one for FP16, the scale-1 guard otherwise), its per-step skip flag, the
    skipped-step count and the LR-schedule rewind. Owned by the runtime; nothing here reads a device value on
    the host except :meth:`metrics`, :meth:`skipped_count` and the one-step-late skip-flag read."""

    def __init__(self, recipe: RecipeSpec, device: torch.device, note: Callable[[str], None]) -> None:
        self.recipe = recipe
        self.device = device
        self._note = note
        self.scaler: torch.amp.GradScaler | None = None
        self.guard = False  # a scale-1 GradScaler that only exists to skip steps exactly (bf16/fp8)
        #: the loss-scale settings in force (the recipe's, or the FP16 phase's); their bounds clamp the scale
        self.loss_scale = recipe.loss_scale if recipe.phases is None else None
        self.skipped = torch.zeros((), device=device)  # float32: exact up to 2**24 skipped steps
        self.found_inf = torch.zeros((), device=device)  # this step's skip flag (device, float 0/1)
        self.optimizer_skips_itself = False
        self.schedule_rewound = 0  # skipped steps already taken back out of the LR schedule
        self.external_skips = 0  # DeepSpeed: the engine's skipped-step count already fed to the monitor
        self._flag_read = AsyncRead()  # the last step's skip flag, on its way to the host
        self._unsettled_skips = 0  # skips read but not yet taken out of the schedule
        self._noted_schedule = False

    # -- setup -------------------------------------------------------------------------------------------
    def wants_guard(self) -> bool:
        """Whether this run needs the scale-1 :class:`GuardScaler`: every precision but FP16 (whose real
        GradScaler already skips), so that a step with a non-finite loss or gradient, or one a ``skip_step``
        reaction flags, never reaches the weights or the optimizer state, whatever the reactions are. A phased
        recipe always starts with one: its FP16 phases turn it into a loss scaler (:class:`PhaseScaler`)."""
        return self.recipe.precision != "fp16" or self.recipe.phases is not None

    def make_guard_scaler(self) -> torch.amp.GradScaler:
        """A :class:`GuardScaler` (scale 1) whose only job is skipping flagged steps exactly; a :class:`PhaseScaler`
        when a phase of the recipe trains in FP16 (:meth:`enter_phase` switches it)."""
        self.guard = True
        fp16_phases = self.recipe.phases is not None and "fp16" in self.recipe.precisions()
        self.scaler = (PhaseScaler if fp16_phases else GuardScaler)(self.device.type)
        return self.scaler

    def enter_phase(self, spec: RecipeSpec, *, resume: bool = False, new_phase: bool = False) -> None:
        """At a phase boundary (or, with ``resume``, where a checkpoint left the run): an FP16 phase starts the loss
        scaler afresh at its ``loss_scale.init_scale`` with its own settings, also right after another FP16 phase
        (``new_phase``; a resume then loads the checkpoint's scale over it); any other phase retires it to the
        scale-1 guard. Said in the run's notes at a real boundary."""
        scaler = self.scaler
        if not isinstance(scaler, PhaseScaler):
            return
        if spec.precision == "fp16" and (not scaler.scaling or new_phase):
            assert spec.loss_scale is not None
            self._warn_hysteresis(spec.loss_scale)
            scaler.start(spec.loss_scale)
            self.guard, self.loss_scale = False, spec.loss_scale
            if not resume:
                self._note(f"fp16 loss scaler started at scale {spec.loss_scale.init_scale:g}")
        elif spec.precision != "fp16" and scaler.scaling:
            scaler.retire()
            self.guard, self.loss_scale = True, None
            if not resume:
                self._note("fp16 loss scaler retired (scale 1 guard from here on)")

    def _warn_hysteresis(self, ls: Any) -> None:
        if ls.hysteresis != 1:
            self._note(
                f"loss_scale.hysteresis {ls.hysteresis} is applied by DeepSpeed only; torch GradScaler backs off on "
                "every overflow (hysteresis 1)"
            )

    def make_grad_scaler(self, cls: type[torch.amp.GradScaler] | None = None) -> torch.amp.GradScaler | None:
        """A real ``torch.amp.GradScaler`` (or ``cls``, a subclass such as FSDP1's ``ShardedGradScaler``) with the
        recipe's loss-scale settings (an fp16 recipe without phases)."""
        ls = self.recipe.loss_scale
        if self.recipe.precision != "fp16" or ls is None or self.recipe.phases is not None:
            return None
        self._warn_hysteresis(ls)
        self.scaler = (cls or torch.amp.GradScaler)(
            self.device.type,
            init_scale=ls.init_scale,
            growth_factor=ls.growth_factor,
            backoff_factor=ls.backoff_factor,
            growth_interval=ls.growth_interval,
        )
        return self.scaler

    def adopt_grad_scaler(self, scaler: torch.amp.GradScaler) -> None:
        """Run with a GradScaler built elsewhere with the recipe's loss-scale settings (Accelerate's own, built from
        the recipe's ``GradScalerKwargs``), said as :meth:`make_grad_scaler` would."""
        assert self.recipe.loss_scale is not None
        self._warn_hysteresis(self.recipe.loss_scale)
        self.scaler, self.guard = scaler, False

    # -- per optimizer step (device only) ----------------------------------------------------------------
    def ensure_unscaled(self, optimizer: torch.optim.Optimizer | None) -> None:
        """FP16: unscale the gradients once (the GradScaler refuses a second unscale_ before update())."""
        if self.scaler is None or self.guard or optimizer is None:
            return
        if optimizer_state(self.scaler, optimizer)["stage"] is OptState.READY:
            self.scaler.unscale_(optimizer)

    def scaler_found_inf(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """The found-inf the scaler recorded while unscaling ``optimizer``'s gradients (0/1 on the device)."""
        if self.scaler is None:
            return None
        found = (optimizer_state(self.scaler, optimizer, create=False) or {}).get("found_inf_per_device")
        if not found:
            return None
        return torch.stack([v.to(self.found_inf.device) for v in found.values()]).sum().clamp(max=1)

    def set_skip(self, optimizer: torch.optim.Optimizer | None, bad: torch.Tensor) -> torch.Tensor:
        """Make this step's skip flag (``bad`` or the scaler's own found-inf) and hand it to the scaler."""
        found = self.scaler_found_inf(optimizer) if (optimizer is not None and not self.guard) else None
        found = bad.float() if found is None else torch.maximum(found, bad.float())
        self.mark_skip(optimizer, found)
        self.found_inf = found
        return found

    def mark_skip(self, optimizer: torch.optim.Optimizer | None, found: torch.Tensor) -> None:
        """Hand the skip decision to the GradScaler so that ``optimizer.step()`` is skipped exactly.

        FP16: fold it into the found-inf the scaler recorded while unscaling. The scale-1 guard (BF16/FP8)
        never unscales (multiplying by 1 is a pass over every gradient for nothing): its per-optimizer state
        is set to "unscaled" with our flag (non-finite gradient norm or a skip_step detector) as found-inf.
        """
        if self.scaler is None or optimizer is None:
            return
        state = optimizer_state(self.scaler, optimizer)
        if self.guard:
            ensure_scale_tensor(self.scaler, found.device)
            # ``found`` is a fresh float32 tensor of this step; nothing writes into it (the guard never unscales)
            state["found_inf_per_device"] = {found.device: found}
            state["stage"] = OptState.UNSCALED
            return
        for t in state["found_inf_per_device"].values():
            t.copy_(torch.maximum(t, found.to(t.dtype).to(t.device)))

    def device_scale(self) -> torch.Tensor | None:
        """The FP16 loss scale on the device, for the monitor (None under the guard or without a scaler)."""
        return scale_tensor(self.scaler) if (self.scaler is not None and not self.guard) else None

    def after_step(self, optimizer: Any) -> None:
        """After ``optimizer.step()``: clamp the loss scale to the recipe's bounds, count a skip and start
        reading the skip flag for :meth:`rewind_schedule` when the optimizer skipped inside its step."""
        scale = self.device_scale()
        if scale is not None and self.loss_scale is not None:
            # torch's GradScaler has no bounds; the recipe's min_scale/max_scale are applied on the device
            ls = self.loss_scale
            scale.clamp_(min=ls.min_scale, max=ls.max_scale)
        if self.scaler is not None:
            self.skipped.add_(self.found_inf)
            self.optimizer_skips_itself = skips_inside_step(getattr(optimizer, "optimizer", optimizer))
            if self.optimizer_skips_itself:
                self._send_skip_flag()

    def _send_skip_flag(self) -> None:
        """Start copying this step's skip flag to the host without waiting for it (see :meth:`rewind_schedule`)."""
        if self._flag_read.pending:  # not settled since the last step (no rewind call in between)
            self._unsettled_skips += int(self._flag_read.wait() or 0)
        self._flag_read.push(self.found_inf)
        if not self._flag_read.pending:  # a device AsyncRead cannot read without blocking (mps, xpu)
            self._unsettled_skips += int(float(self.found_inf))

    def rewind_schedule(self, optimizer: Any, scheduler: Any) -> int:
        """If the last optimizer step was skipped, take it back out of the LR schedule; returns how many steps.

        Call it before the next optimizer step (and at logging and checkpoint steps). torch's
        ``GradScaler.step`` lets optimizers that handle AMP scaling themselves (``_step_supports_amp_scaling``,
        e.g. fused AdamW, Trainer's default) skip a step inside ``optimizer.step()`` without a host read;
        Accelerate infers a skip from ``step()`` not being called (``accelerate/optimizer.py``), so it reports
        none and Trainer advances the LR schedule on a skipped step. The skip flag is therefore copied to the
        host without blocking right after the step and read here, one step later: by then the copy has long
        landed (Trainer's own loop waits on the device every step), so the wait is free, and the next step
        already runs at the learning rate it would have had without the skipped step. Closed-form schedules
        (``LambdaLR``, which Trainer's schedules are) are rewound exactly; others are left as they are, with a
        note.
        """
        n = self._unsettled_skips + int(self._flag_read.wait() or 0)
        self._unsettled_skips = 0
        if not n:
            return 0
        self.schedule_rewound += n
        sched = getattr(scheduler, "scheduler", scheduler)  # Accelerate's AcceleratedScheduler wraps it
        if scheduler is None or not isinstance(sched, LambdaLR):
            if not self._noted_schedule:
                self._noted_schedule = True
                self._note(
                    f"{n} skipped step(s) advanced the LR scheduler ({type(scheduler).__name__}): only "
                    "LambdaLR-based schedules (Trainer's) can be rewound"
                )
            return 0
        sched.last_epoch -= n * _schedule_steps_per_step(scheduler)
        lrs = [base * fn(sched.last_epoch) for fn, base in zip(sched.lr_lambdas, sched.base_lrs)]
        inner = getattr(optimizer, "optimizer", optimizer)
        for group, lr in zip(inner.param_groups, lrs):
            group["lr"] = lr
        set_last_lr(sched, lrs)
        return n

    def external_step(self, ds: dict[str, Any]) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """Under DeepSpeed, which skips a non-finite step itself: the step's gradient norm, skip flag and loss scale
        as the monitor takes them, made from the engine's step state (host values, read after ``engine.step()``;
        ``hf_mixedprec.integrations.deepspeed.deepspeed_step_state``)."""
        count = ds.get("skipped_steps")
        if count is not None:  # the engine's count covers BF16, where DeepSpeed has no scaler
            skipped = count > self.external_skips
            self.external_skips = count
        else:
            skipped = bool(ds.get("overflow"))
        # DeepSpeed skips a step only for a non-finite gradient: that is what the grad detectors see
        norm = ds.get("grad_norm")
        grad = torch.tensor(math.inf) if skipped else (None if norm is None else torch.tensor(float(norm)))
        scale = ds.get("loss_scale")
        return grad, torch.tensor(float(skipped)), None if scale is None else torch.tensor(float(scale))

    # -- reporting and state (host reads: logging and checkpoint steps only) --------------------------------
    def metric_tensors(self) -> dict[str, torch.Tensor]:
        """The device values :meth:`metrics` reports (skipped steps; the FP16 loss scale), by metric name, for a
        caller that reads them with others in one copy."""
        out: dict[str, torch.Tensor] = {}
        if self.scaler is not None:
            scale = None if self.guard else scale_tensor(self.scaler)
            if scale is not None and self.scaler.is_enabled():
                out[M.LOSS_SCALE] = scale
            out[M.SKIPPED_STEPS] = self.skipped
        return out

    def metrics(self, external: dict[str, Any] | None = None, host: dict[str, float] | None = None) -> dict[str, float]:
        """``mp/loss_scale``, ``mp/overflow`` and ``mp/skipped_steps``; ``external`` is DeepSpeed's step state
        (``hf_mixedprec.integrations.deepspeed.deepspeed_step_state``) when the engine owns loss scaling; ``host``
        the values of :meth:`metric_tensors` already read (else they are read here, in one copy)."""
        out: dict[str, float] = {}
        if external is not None:
            if external.get("loss_scale") is not None:
                out[M.LOSS_SCALE] = float(external["loss_scale"])
            out[M.OVERFLOW] = float(bool(external.get("overflow")))
            if external.get("skipped_steps") is not None:
                out[M.SKIPPED_STEPS] = float(external["skipped_steps"])
        if self.scaler is not None:
            if host is None:
                tensors = self.metric_tensors()
                host = dict(zip(tensors, torch.stack([t.float() for t in tensors.values()]).tolist()))
            if not self.guard:  # before the scaler's first use (or disabled) its scale is a Python number
                out[M.LOSS_SCALE] = host[M.LOSS_SCALE] if M.LOSS_SCALE in host else float(self.scaler.get_scale())
            out[M.SKIPPED_STEPS] = host[M.SKIPPED_STEPS]
        return out

    def skipped_count(self) -> int:
        """Steps skipped so far (a host read)."""
        return int(self.skipped.item())

    def load_counts(self, skipped: float, schedule_rewound: int, external_skips: int) -> None:
        """Restore :meth:`skipped_count`, :attr:`schedule_rewound` and :attr:`external_skips` from a checkpoint."""
        self.skipped = torch.tensor(float(skipped), device=self.device)
        self.schedule_rewound = schedule_rewound
        self.external_skips = external_skips
