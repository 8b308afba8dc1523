"""What a health event makes the run do: its reaction (``log``/``warn``, ``stop``, ``lower_lr``, ``fallback``), the
advice a stop carries, and the FP8 layers a fallback moved to BF16 (moved again on resume).

The detectors (:class:`hf_mixedprec.training.health.HealthMonitor`) only latch events on the device; the runtime hands them
here at a check step (a logging step), the one place a reaction can touch the model, the optimizer or the
schedule. ``skip_step`` is not handled here: the runtime folds it into the step's skip flag on the device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch import nn

from hf_mixedprec.core._device import is_main_rank
from hf_mixedprec.fp8 import fp8_layers
from hf_mixedprec.fp8.experts import experts_stats
from hf_mixedprec.recipes.schema import RecipeSpec
from hf_mixedprec.training.health import HealthEvent, layers_to_bf16

__all__ = ["Reactions"]

log = logging.getLogger("hf_mixedprec")


class Reactions:
    """Applies the recipe's reactions to health events and keeps what they decided (all restored on resume):
    :attr:`events`, :attr:`stop_requested`, :attr:`fallback_recipe`, :attr:`moved_layers`."""

    def __init__(self, recipe: RecipeSpec, note: Callable[[str], None]) -> None:
        self.recipe = recipe
        self._note = note
        self.events: list[dict[str, Any]] = []
        #: why a reaction asked to stop (the integration saves a checkpoint, then stops), or None
        self.stop_requested: str | None = None
        #: the recipe an FP16 fallback asks to resume under (None: no safer precision on this hardware)
        self.fallback_recipe: str | None = None
        #: FP8 layers a fallback reaction moved to high precision, in order (restored on resume)
        self.moved_layers: list[str] = []
        #: the model is sharded with FSDP2 and the ranks' checks may decide differently (rank 0 alone checks): a
        #: fallback moving layers on some ranks only would unmatch their collectives, so it stops instead
        self.sharded = False

    def apply(
        self, events: list[HealthEvent], model: nn.Module, optimizer: Any = None, scheduler: Any = None, *, step: int
    ) -> None:
        """Record ``events`` (``step``: the optimizer steps seen at this check), log them and apply their reactions."""
        fallback_layers: list[str] = []
        for ev in events:
            self.events.append({**ev.to_dict(), "at_step": step})
            text = f"health: step {ev.step}: {ev.detector}: {ev.message} -> {ev.reaction}"
            if is_main_rank():  # every rank records and reacts alike; rank 0 prints
                log.log(logging.INFO if ev.reaction == "log" else logging.WARNING, "hf_mixedprec: %s", text)
            if ev.reaction == "stop" and self.stop_requested is None:
                self.stop_requested = f"{text}; {self.advice(ev)}"
            elif ev.reaction == "lower_lr":
                factor = getattr(self.recipe.health.detectors, ev.detector).lr_factor or 0.5
                _lower_lr(optimizer, scheduler, factor)
                self._note(f"health: learning rate multiplied by {factor:g} after {ev.detector} at step {ev.step}")
            elif ev.reaction == "fallback" and self.sharded:
                if self.stop_requested is None:
                    self.stop_requested = (
                        f"{text}: in a sharded model, FP8 layers move to BF16 during the run only under FSDP2 without "
                        "distributed.fp8_all_gather, where every rank checks at the same steps (the Trainer callback; "
                        "a loop of one's own checks on rank 0 alone), so it stops with a checkpoint instead; resume it "
                        f"with {ev.layer or 'the flagged layers'} kept in BF16 (a modules: rule with fp8: off) or under "
                        "a BF16 recipe"
                    )
            elif ev.reaction == "fallback":
                if ev.layer is not None:
                    fallback_layers.append(ev.layer)
                else:
                    self._whole_model_fallback(model, ev)
        if fallback_layers:
            moved = layers_to_bf16(model, sorted(set(fallback_layers)))
            if moved:
                self.moved_layers += moved
                self._note(f"FALLBACK: FP8 layers moved to BF16 after health events: {', '.join(moved)}")

    def advice(self, ev: HealthEvent) -> str:
        """What to change before resuming after ``ev`` stopped the run."""
        if ev.detector in ("death_spiral", "scale_floor", "consecutive_skips", "skip_rate"):
            return (
                "FP16 loss scaling is collapsing (typical for models pretrained in BF16): train in BF16 "
                "(a100-bf16 on Ampere or later, cpu-bf16 on CPU) or lower the learning rate"
            )
        if ev.detector.startswith("fp8") or ev.detector == "mx_clamp":
            return f"run `hf-mixedprec simulate --recipe {self.recipe.name}` and keep the flagged layers in BF16"
        return "check the data and the learning rate; a checkpoint was saved before stopping"

    def _whole_model_fallback(self, model: nn.Module, ev: HealthEvent) -> None:
        """FP8: every FP8 layer to BF16 in place. FP16: a loss-scaled run cannot switch precision mid-run, so stop
        and name the recipe to resume the checkpoint under. BF16/FP32: nothing safer; recorded only."""
        if self.recipe.precision == "fp8":
            every = [name for name, _ in (*fp8_layers(model, fresh=True), *experts_stats(model))]
            moved = layers_to_bf16(model, every)
            self.moved_layers += moved
            self._note(
                f"FALLBACK: whole model moved from FP8 to BF16 after {ev.detector} at step {ev.step} "
                f"({len(moved)} layers)"
            )
        elif self.recipe.precision == "fp16" and self.stop_requested is None:
            from hf_mixedprec.recipes.hardware import detect, support_for

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
            self._note(f"FALLBACK: FP16 -> {target} requested after {ev.detector} at step {ev.step}")
        elif self.recipe.precision in ("bf16", "fp32"):
            self._note(
                f"health: {ev.detector} asked for a fallback at step {ev.step}, but a {self.recipe.precision} run "
                "has no safer precision to fall back to; recorded only (use stop or lower_lr for this detector)"
            )

    def load(self, events: list[dict[str, Any]], moved_layers: list[str], model: nn.Module | None = None) -> None:
        """Restore the recorded events and moved layers; with ``model``, move those layers to BF16 again so the
        resumed run has the same module types and state-dict keys as the run that wrote the checkpoint."""
        self.events = list(events)
        self.moved_layers = list(moved_layers)
        if model is not None and self.moved_layers:
            moved = layers_to_bf16(model, self.moved_layers)
            if moved:
                self._note(f"resume: FP8 layers a fallback had moved to BF16 are moved again: {', '.join(moved)}")


def _lower_lr(optimizer: Any, scheduler: Any, factor: float) -> None:
    """Multiply the current learning rates and the schedule's base rates (so later steps keep the factor)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    for group in getattr(inner, "param_groups", []):
        group["lr"] *= factor
    if scheduler is not None and hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
