"""The trainer-free core that applies a recipe to a training loop: precision, loss scaling, clipping, FP8.

Both the Trainer callback and the Accelerate plugin delegate to :class:`MixedPrecisionRuntime`, so a
recipe behaves the same everywhere. Per optimizer step the order is (DESIGN.md, Trainer step order):
backward with the scaled loss -> unscale -> :meth:`before_optimizer_step` (read the scaler's found-inf,
clip the unscaled gradients) -> ``optimizer.step()`` (a real ``GradScaler`` skips it on overflow) ->
:meth:`after_optimizer_step` (advance FP8 delayed scaling, count skips). Nothing here reads a device value
on the host except :meth:`metrics` and :meth:`state_dict`, which run only when a log or checkpoint is due.

Rehearsal runs a recipe for hardware you don't have: FP16 recipes use autocast(float16) and a real
``torch.amp.GradScaler`` on the current device (CPU too), so loss scaling behaves as on a V100; FP8 recipes
use the emulated backend with the recipe's scaling. It is never silent: :attr:`notes` says so and the run
report records it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import os
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state
from torch.optim.lr_scheduler import LambdaLR

from hf_mixedprec._device import AsyncRead, Constants
from hf_mixedprec.clipping import Clipper, ClipResult, global_grad_norm, make_clipper
from hf_mixedprec.fp8 import ConversionReport, convert, fp8_step, iter_emulated
from hf_mixedprec.health import HealthEvent, HealthMonitor, layers_to_bf16
from hf_mixedprec.recipe import Recipe

__all__ = ["GuardScaler", "MixedPrecisionRuntime", "compute_dtype", "is_main_rank"]

log = logging.getLogger("hf_mixedprec")

STATE_VERSION = 1
#: Elements per parameter tensor sampled (strided) to measure the update size on sampled steps.
UPDATE_PROBE = 4096


def is_main_rank() -> bool:
    """Rank 0 of a distributed run (or a single process), before or after the process group exists."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def compute_dtype(recipe: Recipe) -> torch.dtype | None:
    """The autocast dtype a recipe trains in (None for fp32). FP8 layers sit inside a BF16 autocast."""
    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.bfloat16}.get(recipe.precision)


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
        state = self._per_optimizer_states[id(optimizer)]
        found = state["found_inf_per_device"]
        fn = getattr(optimizer.step, "__func__", optimizer.step)
        if fn not in self._takes_scaler:
            self._takes_scaler[fn] = "grad_scaler" in inspect.signature(optimizer.step).parameters
        direct = (
            state["stage"] is OptState.UNSCALED
            and len(found) == 1
            and "closure" not in kwargs
            and getattr(optimizer, "_step_supports_amp_scaling", False)
            and not self._takes_scaler[fn]
        )
        if not direct:
            return super().step(optimizer, *args, **kwargs)
        optimizer.grad_scale = None  # type: ignore[attr-defined]
        optimizer.found_inf = next(iter(found.values()))  # type: ignore[attr-defined]
        try:
            return optimizer.step(*args, **kwargs)
        finally:
            state["stage"] = OptState.STEPPED
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restoring any scaler's state (e.g. an FP16 run's ``scaler.pt``) keeps the guard at scale 1."""
        super().load_state_dict(state_dict)
        self._init_scale = 1.0
        if self._scale is not None:
            self._scale.fill_(1.0)


def _schedule_steps_per_step(scheduler: Any) -> int:
    """How far one optimizer step moves ``scheduler``: Accelerate's ``AcceleratedScheduler`` steps the wrapped
    schedule once per process per step unless batches are split (``accelerate/scheduler.py``); a plain
    scheduler (Trainer's) once."""
    if getattr(scheduler, "step_with_optimizer", False) and not getattr(scheduler, "split_batches", True):
        return max(1, dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1)
    return 1


class MixedPrecisionRuntime:
    """Applies one recipe to one model/optimizer pair (see module docs)."""

    def __init__(self, recipe: Recipe, *, device: torch.device | str = "cpu", rehearse: bool | None = None):
        self.recipe = recipe
        self.device = torch.device(device)
        self.rehearse = bool(recipe.rehearse if rehearse is None else rehearse)
        self.notes: list[str] = []
        self.clipper: Clipper | None = make_clipper(recipe.clipping.method, **recipe.clipping.params())
        if self.clipper is not None:  # its state is made on the device now, not copied there during a step
            self.clipper.to(self.device)
        self.scaler: torch.amp.GradScaler | None = None
        self.fp8_report: ConversionReport | None = None
        self.steps = 0  # optimizer steps seen (host-side count, known without looking at tensors)
        self._skipped = torch.zeros((), device=self.device)  # float32: exact up to 2**24 skipped steps
        self._last: ClipResult | None = None
        self._found_inf = torch.zeros((), device=self.device)
        self._k = Constants()
        #: Under DeepSpeed the engine owns loss scaling and clipping; this reads its scaler for the metrics.
        self.external_scaler: Any = None
        self._external_skips = 0  # the engine's skipped-step count already fed to the monitor
        self.monitor: HealthMonitor | None = (
            HealthMonitor(recipe.health, device=self.device) if recipe.health.enabled else None
        )
        self.guard = False  # a scale-1 GradScaler that only exists to skip steps exactly (bf16/fp8)
        self.events: list[dict[str, Any]] = []
        self.stop_requested: str | None = None
        self.fallback_recipe: str | None = None
        self._loss_sum = torch.zeros((), device=self.device)
        self._loss_n = 0  # forwards since the last optimizer step (host: the hook runs on the host)
        self._sampling = False
        self._fp8_pending = False  # a sampled step's FP8 statistics wait for the next check (a logging step)
        self._fp8_metrics: dict[str, float] = {}
        self._update_probe: list[tuple[torch.Tensor, int, torch.Tensor]] = []
        self.last_norm: torch.Tensor | None = None  # the unscaled gradient norm of the last step (device)
        self._optimizer_skips_itself = False
        self._schedule_rewound = 0  # skipped steps already taken back out of the LR schedule
        self._flag_read = AsyncRead()  # the last step's skip flag, on its way to the host
        self._unsettled_skips = 0  # skips read but not yet taken out of the schedule
        self._noted_schedule = False
        self._noted_no_loss = False
        #: FP8 layers a fallback reaction moved to high precision, in order (restored on resume)
        self.moved_layers: list[str] = []
        #: ``mp/`` metrics computed at a logging step, waiting to be merged into the trainer's own log row
        self.pending_log: dict[str, float] | None = None
        if self.rehearse:
            self.note(f"REHEARSAL: recipe {recipe.name!r} ({recipe.precision}) is rehearsed on {self.device.type}")

    def note(self, text: str) -> None:
        """Record a decision or fallback (also logged loudly); they all end up in the run report."""
        self.notes.append(text)
        log.warning("hf_mixedprec: %s", text)

    # -- setup -------------------------------------------------------------------------------------
    def wants_guard(self) -> bool:
        """Whether this run needs the scale-1 :class:`GuardScaler`: every precision but FP16 (whose real
        GradScaler already skips), so that a step with a non-finite loss or gradient, or one a ``skip_step``
        reaction flags, never reaches the weights or the optimizer state, whatever the reactions are."""
        return self.recipe.precision != "fp16"

    def make_guard_scaler(self) -> torch.amp.GradScaler:
        """A :class:`GuardScaler` (scale 1) whose only job is skipping flagged steps exactly."""
        self.guard = True
        self.scaler = GuardScaler(self.device.type)
        return self.scaler

    def make_grad_scaler(self) -> torch.amp.GradScaler | None:
        """A real ``torch.amp.GradScaler`` with the recipe's loss-scale settings (fp16 only)."""
        ls = self.recipe.loss_scale
        if self.recipe.precision != "fp16" or ls is None:
            return None
        if ls.hysteresis != 1:
            self.note(
                f"loss_scale.hysteresis {ls.hysteresis} is applied by DeepSpeed only; torch GradScaler backs off on "
                "every overflow (hysteresis 1)"
            )
        self.scaler = torch.amp.GradScaler(
            self.device.type,
            init_scale=ls.init_scale,
            growth_factor=ls.growth_factor,
            backoff_factor=ls.backoff_factor,
            growth_interval=ls.growth_interval,
        )
        return self.scaler

    def convert_model(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> ConversionReport | None:
        """Convert ``model`` to FP8 as the recipe says (emulated when rehearsing); None for other precisions."""
        if self.recipe.precision != "fp8":
            return None
        backend = "emulated" if self.rehearse else None
        self.fp8_report = convert(model, self.recipe, backend=backend, optimizer=optimizer)
        for n in self.fp8_report.notes:
            self.notes.append(n)
        if is_main_rank():  # which layers run in FP8 is a decision the user must see, once
            log.warning("hf_mixedprec: %s", self.fp8_report.summary())
        return self.fp8_report

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        dtype = compute_dtype(self.recipe)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def wrap_forward_with_autocast(self, model: nn.Module) -> None:
        """Run ``model.forward`` under the recipe's autocast (where the framework would not)."""
        if compute_dtype(self.recipe) is None or getattr(model, "_hf_mixedprec_autocast", False):
            return
        inner = model.forward

        @functools.wraps(inner)
        def forward(*args: Any, **kwargs: Any) -> Any:
            with self.autocast():
                return inner(*args, **kwargs)

        model.forward = forward  # type: ignore[method-assign]
        model._hf_mixedprec_autocast = True  # type: ignore[attr-defined]

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

    def begin_step(self, model: nn.Module) -> None:
        """Before the step's forward passes: turn FP8 statistics on for sampled steps only."""
        every = self.recipe.health.fp8_sample_every
        self._sampling = self.monitor is not None and (self.steps + 1) % every == 0
        if self.recipe.precision == "fp8":
            for _, m in iter_emulated(model):
                m.record_stats = self._sampling

    def apply_tf32(self) -> None:
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = self.recipe.tf32
            torch.backends.cudnn.allow_tf32 = self.recipe.tf32

    # -- per optimizer step ------------------------------------------------------------------------
    def _scaler_found_inf(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        if self.scaler is None:
            return None
        state = self.scaler._per_optimizer_states.get(id(optimizer), {})
        found = state.get("found_inf_per_device")
        if not found:
            return None
        return torch.stack([v.to(self._found_inf.device) for v in found.values()]).sum().clamp(max=1)

    def ensure_unscaled(self, optimizer: torch.optim.Optimizer | None) -> None:
        """FP16: unscale the gradients once (the GradScaler refuses a second unscale_ before update())."""
        if self.scaler is None or self.guard or optimizer is None:
            return
        state = self.scaler._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.READY:
            self.scaler.unscale_(optimizer)

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
        params = [p for p in parameters if getattr(p, "grad", None) is not None]
        norm = total_norm if total_norm is not None else global_grad_norm([p.grad for p in params])
        self.last_norm = norm
        found = self._scaler_found_inf(optimizer) if (optimizer is not None and not self.guard) else None
        if self.clipper is not None:
            self._last = self.clipper.clip_(params, total_norm=norm)
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
        found = bad.float() if found is None else torch.maximum(found, bad.float())
        self._mark_skip(optimizer, found)
        self._loss_n = 0
        self._found_inf = found
        self._probe_updates(params)
        return self._last

    def _step_loss(self) -> torch.Tensor | None:
        """The loss this optimizer step back-propagated (the sum of its micro-batches' :meth:`record_loss`), the
        mean over ranks; None when no backward recorded one (nothing is guessed)."""
        if self._loss_n == 0:
            return None
        loss = self._loss_sum
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            loss = loss.clone()
            dist.all_reduce(loss, op=dist.ReduceOp.SUM)  # one decision for every rank
            loss = loss / dist.get_world_size()
        return loss

    def _probe_updates(self, params: list[Any]) -> None:
        """On sampled steps, keep a strided sample (at most UPDATE_PROBE elements per tensor) of the BF16/FP16
        parameters so that :meth:`after_optimizer_step` can measure the update (``tiny_update``)."""
        self._update_probe = []
        if self.monitor is None or not self._sampling or not self.recipe.health.detectors.tiny_update.enabled:
            return
        for p in params:
            if p.dtype in (torch.bfloat16, torch.float16) and p.numel() > 0:
                stride = max(1, p.numel() // UPDATE_PROBE)
                self._update_probe.append((p, stride, p.detach().reshape(-1)[::stride].float().clone()))

    def _update_ratio(self) -> torch.Tensor | None:
        if not self._update_probe:
            return None
        num = torch.zeros((), device=self._found_inf.device)
        den = torch.zeros((), device=self._found_inf.device)
        for p, stride, old in self._update_probe:
            new = p.detach().reshape(-1)[::stride].float()
            num = num + (new - old).pow(2).sum().to(num.device)
            den = den + old.pow(2).sum().to(den.device)
        self._update_probe = []
        return (num / den.clamp_min(1e-30)).sqrt()

    def _mark_skip(self, optimizer: torch.optim.Optimizer | None, found: torch.Tensor) -> None:
        """Hand the skip decision to the GradScaler so that ``optimizer.step()`` is skipped exactly.

        FP16: fold it into the found-inf the scaler recorded while unscaling. The scale-1 guard (BF16/FP8)
        never unscales (multiplying by 1 is a pass over every gradient for nothing): its per-optimizer state
        is set to "unscaled" with our flag (non-finite gradient norm or a skip_step detector) as found-inf.
        """
        if self.scaler is None or optimizer is None:
            return
        state = self.scaler._per_optimizer_states[id(optimizer)]
        if self.guard:
            if self.scaler._scale is None:
                self.scaler._lazy_init_scale_growth_tracker(found.device)
            # ``found`` is a fresh float32 tensor of this step; nothing writes into it (the guard never unscales)
            state["found_inf_per_device"] = {found.device: found}
            state["stage"] = OptState.UNSCALED
            return
        for t in state["found_inf_per_device"].values():
            t.copy_(torch.maximum(t, found.to(t.dtype).to(t.device)))

    def after_optimizer_step(self, model: nn.Module, optimizer: Any = None) -> None:
        """Advance FP8 delayed scaling, update the monitor and count skipped steps (device only)."""
        if self.recipe.precision == "fp8":
            fp8_step(model)
        if self.monitor is not None:
            ratio = self._update_ratio()
            if ratio is not None:
                self.monitor.observe_update(ratio, self._found_inf)
            scale = self.scaler._scale if (self.scaler is not None and not self.guard) else None
            self.monitor.post_step(skipped=self._found_inf, scale=scale)
            if self._sampling and self.recipe.precision == "fp8":
                self.monitor.observe_fp8({name: dict(m.stats) for name, m in iter_emulated(model)})
                self._fp8_pending = True
        if (
            not self.guard
            and self.scaler is not None
            and self.scaler._scale is not None
            and self.recipe.loss_scale is not None
        ):
            # torch's GradScaler has no bounds; the recipe's min_scale/max_scale are applied on the device
            ls = self.recipe.loss_scale
            self.scaler._scale.clamp_(min=ls.min_scale, max=ls.max_scale)
        if self.scaler is not None:
            self._skipped.add_(self._found_inf)
            inner = getattr(optimizer, "optimizer", optimizer)
            self._optimizer_skips_itself = bool(getattr(inner, "_step_supports_amp_scaling", False))
            if self._optimizer_skips_itself:
                self._send_skip_flag()
        self.steps += 1

    def _send_skip_flag(self) -> None:
        """Start copying this step's skip flag to the host without waiting for it (see :meth:`rewind_schedule`)."""
        if self._flag_read.pending:  # not settled since the last step (no rewind call in between)
            self._unsettled_skips += int(self._flag_read.wait() or 0)
        self._flag_read.push(self._found_inf)
        if not self._flag_read.pending:  # a device AsyncRead cannot read without blocking (mps, xpu)
            self._unsettled_skips += int(float(self._found_inf))

    def after_external_step(self) -> None:
        """Under DeepSpeed, after the engine's step: feed its skip, loss scale and the step's loss to the monitor.

        DeepSpeed checks every step's gradients for inf/NaN itself and skips such a step, under FP16 and under
        BF16 alike (``OVERFLOW! Skipping step``, counted in ``engine.skipped_steps``), so a non-finite step never
        reaches its weights. It decides that on the host inside ``engine.step()``: reading the count, the scale
        (Python values) and the loss it has already waited for adds no stall; the monitor lives on the CPU.
        """
        if self.monitor is not None and self.external_scaler is not None:
            ds = self.external_scaler()
            if ds is not None:
                count = ds.get("skipped_steps")
                if count is not None:  # the engine's count covers BF16, where DeepSpeed has no scaler
                    skipped = count > self._external_skips
                    self._external_skips = count
                else:
                    skipped = bool(ds.get("overflow"))
                # DeepSpeed skips a step only for a non-finite gradient: that is what the grad detectors see
                norm = ds.get("grad_norm")
                grad = torch.tensor(math.inf) if skipped else (None if norm is None else torch.tensor(float(norm)))
                d = self.recipe.health.detectors
                loss = self._step_loss() if (d.loss_spike.enabled or d.nonfinite_loss.enabled) else None
                self.monitor.pre_step(loss=loss, grad_norm=grad)
                scale = ds.get("loss_scale")
                self.monitor.post_step(
                    skipped=torch.tensor(float(skipped)), scale=None if scale is None else torch.tensor(float(scale))
                )
        self._loss_n = 0
        self.steps += 1

    def rewind_schedule(self, optimizer: Any, scheduler: Any) -> int:
        """If the last optimizer step was skipped, take it back out of the LR schedule; returns how many steps.

        Call it before the next optimizer step (and at logging and checkpoint steps). torch's
        ``GradScaler.step`` lets optimizers that handle AMP scaling themselves (``_step_supports_amp_scaling``,
        e.g. fused AdamW, Trainer's default) skip a step inside ``optimizer.step()`` without a host read;
        Accelerate infers a skip from ``step()`` not being called, so it reports none and Trainer advances
        the LR schedule on a skipped step. The skip flag is therefore copied to the host without blocking
        right after the step and read here, one step later: by then the copy has long landed (Trainer's own
        loop waits on the device every step), so the wait is free, and the next step already runs at the
        learning rate it would have had without the skipped step. Closed-form schedules (``LambdaLR``, which
        Trainer's schedules are) are rewound exactly; others are left as they are, with a note.
        """
        n = self._unsettled_skips + int(self._flag_read.wait() or 0)
        self._unsettled_skips = 0
        if not n:
            return 0
        self._schedule_rewound += n
        if scheduler is None or not isinstance(getattr(scheduler, "scheduler", scheduler), LambdaLR):
            if not self._noted_schedule:
                self._noted_schedule = True
                self.note(
                    f"{n} skipped step(s) advanced the LR scheduler ({type(scheduler).__name__}): only "
                    "LambdaLR-based schedules (Trainer's) can be rewound"
                )
            return 0
        sched = getattr(scheduler, "scheduler", scheduler)
        sched.last_epoch -= n * _schedule_steps_per_step(scheduler)
        lrs = [base * fn(sched.last_epoch) for fn, base in zip(sched.lr_lambdas, sched.base_lrs)]
        inner = getattr(optimizer, "optimizer", optimizer)
        for group, lr in zip(inner.param_groups, lrs):
            group["lr"] = lr
        sched._last_lr = list(lrs)
        return n

    def check(self, model: nn.Module, optimizer: Any = None, scheduler: Any = None) -> list[HealthEvent]:
        """Turn what the detectors latched into events and apply their reactions (host sync: check steps only)."""
        if self.monitor is None:
            return []
        if self._fp8_pending:
            self._fp8_metrics = self._layer_metrics(model)
            self._fp8_pending = False
        events = self.monitor.check()
        fallback_layers: list[str] = []
        for ev in events:
            self.events.append({**ev.to_dict(), "at_step": self.steps})
            text = f"health: step {ev.step}: {ev.detector}: {ev.message} -> {ev.reaction}"
            if ev.reaction == "log":
                log.info("hf_mixedprec: %s", text)
            else:
                log.warning("hf_mixedprec: %s", text)
            if ev.reaction == "stop" and self.stop_requested is None:
                self.stop_requested = f"{text}; {self._advice(ev)}"
            elif ev.reaction == "lower_lr":
                factor = getattr(self.recipe.health.detectors, ev.detector).lr_factor or 0.5
                self._lower_lr(optimizer, scheduler, factor)
                self.note(f"health: learning rate multiplied by {factor:g} after {ev.detector} at step {ev.step}")
            elif ev.reaction == "fallback":
                if ev.layer is not None:
                    fallback_layers.append(ev.layer)
                else:
                    self._whole_model_fallback(model, ev)
        if fallback_layers:
            moved = layers_to_bf16(model, sorted(set(fallback_layers)))
            if moved:
                self.moved_layers += moved
                self.note(f"FALLBACK: FP8 layers moved to BF16 after health events: {', '.join(moved)}")
        return events

    def _advice(self, ev: HealthEvent) -> str:
        if ev.detector in ("death_spiral", "scale_floor", "consecutive_skips", "skip_rate"):
            return (
                "FP16 loss scaling is collapsing (typical for models pretrained in BF16): train in BF16 "
                "(a100-bf16 on Ampere or later, cpu-bf16 on CPU) or lower the learning rate"
            )
        if ev.detector.startswith("fp8") or ev.detector == "mx_clamp":
            return f"run `hf-mixedprec simulate --recipe {self.recipe.name}` and keep the flagged layers in BF16"
        return "check the data and the learning rate; a checkpoint was saved before stopping"

    def _lower_lr(self, optimizer: Any, scheduler: Any, factor: float) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)
        for group in getattr(inner, "param_groups", []):
            group["lr"] *= factor
        if scheduler is not None and hasattr(scheduler, "base_lrs"):
            scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]

    def _whole_model_fallback(self, model: nn.Module, ev: HealthEvent) -> None:
        if self.recipe.precision == "fp8":
            moved = layers_to_bf16(model, [name for name, _ in iter_emulated(model)])
            self.moved_layers += moved
            self.note(
                f"FALLBACK: whole model moved from FP8 to BF16 after {ev.detector} at step {ev.step} "
                f"({len(moved)} layers)"
            )
        elif self.recipe.precision == "fp16" and self.stop_requested is None:
            from hf_mixedprec.hardware import detect, support_for

            info = detect()
            sup = support_for(info.device_type, info.capability, info.cuda_version)
            self.fallback_recipe = (
                ("cpu-bf16" if info.device_type != "cuda" else "a100-bf16") if "bf16" in sup.precisions else None
            )
            target = self.fallback_recipe or "a recipe with precision fp32"
            self.stop_requested = (
                f"health: step {ev.step}: {ev.detector}: {ev.message} -> fallback: FP16 cannot "
                f"continue; a checkpoint was saved; resume it under {target}"
            )
            self.note(f"FALLBACK: FP16 -> {target} requested after {ev.detector} at step {ev.step}")
        elif self.recipe.precision in ("bf16", "fp32"):
            self.note(
                f"health: {ev.detector} asked for a fallback at step {ev.step}, but a {self.recipe.precision} run "
                "has no safer precision to fall back to; recorded only (use stop or lower_lr for this detector)"
            )

    def _layer_metrics(self, model: nn.Module) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, m in iter_emulated(model):
            st = m.stats
            if not st:
                continue
            vals = {k: float(v) for k, v in st.items()}
            out[f"mp/fp8/{name}/saturation"] = max(
                vals.get(f"{r}_saturation", 0.0) for r in ("input", "weight", "grad")
            )
            out[f"mp/fp8/{name}/underflow"] = max(vals.get(f"{r}_underflow", 0.0) for r in ("input", "weight", "grad"))
            out[f"mp/fp8/{name}/sqnr_db"] = min(
                vals.get(f"{r}_sqnr_db", float("inf")) for r in ("input", "weight", "grad")
            )
            out[f"mp/fp8/{name}/input_amax"] = vals.get("input_amax", 0.0)
        return out

    # -- reporting (host sync: only when a log is due) -----------------------------------------------
    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.external_scaler is not None:
            ds = self.external_scaler()
            if ds is not None:
                if ds.get("loss_scale") is not None:
                    out["mp/loss_scale"] = float(ds["loss_scale"])
                out["mp/overflow"] = float(bool(ds.get("overflow")))
                if ds.get("skipped_steps") is not None:
                    out["mp/skipped_steps"] = float(ds["skipped_steps"])
        if self.scaler is not None:
            if not self.guard:
                out["mp/loss_scale"] = float(self.scaler.get_scale())
            out["mp/skipped_steps"] = float(self._skipped.item())
        if self.monitor is not None:
            out["mp/health_events"] = float(len(self.events))
        out.update(self._fp8_metrics)
        self._fp8_metrics = {}
        if self.clipper is not None:
            self.clipper.host_sync()
        if self._last is not None:
            out["mp/grad_norm"] = float(self._last.total_norm.item())
            thr = float(self._last.threshold.item())
            boundary = getattr(self.clipper, "boundary", None)
            if thr == float("inf") and boundary is not None:
                thr = float(boundary().item())  # ZClip on an unclipped step: where clipping would start
            if thr == thr and thr != float("inf"):  # NaN (AGC) and inf (warm-up) are not thresholds
                out["mp/clip_threshold"] = thr
            out["mp/clipped"] = float(self._last.clipped.item())
        return out

    # -- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-friendly state (lists, not tensors) so it fits Trainer's trainer_state.json exactly."""
        clip = None
        if self.clipper is not None:
            sd = self.clipper.state_dict()
            clip = {**sd, "state": {k: _to_json(v) for k, v in sd["state"].items()}}
        return {
            "version": STATE_VERSION,
            "steps": self.steps,
            "skipped": int(self._skipped.item()),
            "schedule_rewound": self._schedule_rewound,
            "external_skips": self._external_skips,
            "clipper": clip,
            "monitor": self.monitor.state_dict() if self.monitor is not None else None,
            "events": list(self.events),
            "stopped": self.stop_requested,
            "moved_layers": list(self.moved_layers),
        }

    def load_state_dict(self, state: dict[str, Any], model: nn.Module | None = None) -> None:
        """Restore :meth:`state_dict`; with ``model``, also the decisions made on it (FP8 layers a fallback moved
        to high precision are moved again, so the resumed run has the same module types and state-dict keys)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"hf_mixedprec runtime state version {state.get('version')!r} (expected {STATE_VERSION})")
        self.steps = int(state["steps"])
        self._skipped = torch.tensor(float(state["skipped"]), device=self.device)
        self._schedule_rewound = int(state.get("schedule_rewound", 0))
        self._external_skips = int(state.get("external_skips", 0))
        clip = state.get("clipper")
        if (clip is None) != (self.clipper is None):
            raise ValueError("checkpointed clipping state does not match the recipe's clipping.method")
        if clip is not None and self.clipper is not None:
            self.clipper.load_state_dict({**clip, "state": {k: _from_json(v) for k, v in clip["state"].items()}})
        if state.get("monitor") is not None and self.monitor is not None:
            if state.get("stopped"):
                # the checkpoint was written by a stop reaction: start the detector windows afresh so the
                # resumed run (often under a changed recipe, with other windows) is not stopped again by the
                # same history
                self.monitor.step = int(state["monitor"]["step"])
                self.monitor.reset_windows()
                self.note(f"resumed after a health stop ({state['stopped']}); detector windows start afresh")
            else:
                self.monitor.load_state_dict(state["monitor"])
        self.events = list(state.get("events", []))
        self.moved_layers = list(state.get("moved_layers", []))
        if model is not None and self.moved_layers:
            moved = layers_to_bf16(model, self.moved_layers)
            if moved:
                self.note(f"resume: FP8 layers a fallback had moved to BF16 are moved again: {', '.join(moved)}")


def _to_json(t: Any) -> Any:
    if isinstance(t, torch.Tensor):
        return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "data": t.flatten().tolist()}
    return t


def _from_json(v: Any) -> Any:
    if isinstance(v, dict) and {"dtype", "shape", "data"} <= set(v):
        return torch.tensor(v["data"], dtype=getattr(torch, v["dtype"])).reshape(v["shape"])
    return v
