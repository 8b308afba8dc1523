"""Precision phases: which phase an optimizer step trains in, and the in-place switch of a model at a boundary.

A phased recipe (``phases:`` in :class:`hf_mixedprec.recipes.schema.RecipeSpec`) lists phases by their start, in optimizer
steps done or as a fraction of ``max_steps``. :class:`PhaseSchedule` resolves the starts once the run length is
known and answers, with one integer comparison per step, whether a boundary is due. :func:`switch_layers` changes
the model in place at a boundary: FP8 layers go back to their high-precision type (``nn.Linear`` or ``Conv1D``
holding the same Parameter objects, so weights and optimizer state are untouched) and the next phase's FP8 layers
are converted from them. The runtime (:mod:`hf_mixedprec.training.runtime`) owns the rest of a switch: the autocast dtype,
which it reads per forward, and the FP8 state it keeps for ``fp8_history: restore``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hf_mixedprec.core.errors import MixedPrecisionError
from hf_mixedprec.fp8 import fp8_layers
from hf_mixedprec.fp8.state import fp8_state_tensors, load_fp8_state_dict
from hf_mixedprec.recipes.schema import RecipeSpec
from hf_mixedprec.training.health import layers_to_bf16

__all__ = ["PhaseRunner", "PhaseSchedule", "PhaseSwitch", "switch_layers"]


class PhaseSchedule:
    """The phases of one recipe and the optimizer step each starts at (resolved by :meth:`set_max_steps` when
    any start is a fraction)."""

    def __init__(self, recipe: RecipeSpec) -> None:
        if recipe.phases is None:
            raise ValueError(f"recipe {recipe.name!r} has no phases")
        self.recipe = recipe
        self.phases = recipe.phases
        self.specs = recipe.phase_specs()
        self.starts: list[int] | None = None if self.by_fraction else [int(p.start) for p in self.phases]

    @property
    def by_fraction(self) -> bool:
        return any(isinstance(p.start, float) and p.start for p in self.phases)

    def label(self, index: int) -> str:
        return self.phases[index].label(index)

    def set_max_steps(self, max_steps: int) -> list[str]:
        """Resolve fractional starts as ``round(fraction * max_steps)``; returns notes on phases this run length
        leaves empty or never reaches (said loudly by the runtime, never silent)."""
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
            raise MixedPrecisionError(f"max_steps: {max_steps!r} is not a run length (allowed: an integer >= 1)")
        if self.by_fraction:
            self.starts = [0 if p.start == 0 else round(float(p.start) * max_steps) for p in self.phases]
        assert self.starts is not None
        notes = []
        for i, start in enumerate(self.starts):
            end = self.starts[i + 1] if i + 1 < len(self.starts) else max_steps
            if start >= max_steps:
                notes.append(
                    f"phase {self.label(i)!r} starts at step {start}, at or after the run's {max_steps} steps: it never runs"
                )
            elif end <= start:
                notes.append(
                    f"phase {self.label(i)!r} has no steps in a run of {max_steps} (it starts at step {start}, as does the next)"
                )
        return notes

    def resolved(self) -> list[int]:
        """The start step of each phase; refuses when fractions wait for the run length."""
        if self.starts is None:
            raise MixedPrecisionError(
                f"recipe {self.recipe.name!r} starts phases at fractions of max_steps, and the run length is not known: "
                "give it (make_accelerator(recipe, max_steps=N), accelerator.set_max_steps(N), or "
                "runtime.set_max_steps(N)), or start the phases at step counts"
            )
        return self.starts

    def index_at(self, steps: int) -> int:
        """The phase an optimizer step trains in when ``steps`` steps are done."""
        starts = self.resolved()
        return max(i for i, s in enumerate(starts) if s <= steps)

    def next_start(self, index: int) -> int | None:
        """The step the phase after ``index`` starts at (None after the last phase)."""
        starts = self.resolved()
        later = [s for s in starts[index + 1 :] if s > starts[index]]
        return later[0] if later else None


@dataclass
class PhaseSwitch:
    """What one boundary did to the model (recorded in the run's notes and ``phase_changes``)."""

    step: int
    index: int
    name: str
    precision: str
    to_high_precision: int  # FP8 layers moved back to Linear/Conv1D
    to_fp8: int  # layers converted to the new phase's FP8

    def to_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def switch_layers(
    model: nn.Module,
    old: RecipeSpec,
    new: RecipeSpec,
    convert: Callable[[RecipeSpec], int],
) -> tuple[int, int]:
    """Change ``model``'s FP8 layers from phase recipe ``old`` to ``new`` in place: every FP8 layer back to high
    precision when ``old`` is FP8, then ``convert(new)`` (the runtime's conversion, returning how many layers went
    FP8) when ``new`` is. Parameters stay the same objects. Returns (layers moved back, layers converted)."""
    back = 0
    if old.precision == "fp8":
        from hf_mixedprec.fp8 import invalidate_layer_cache
        from hf_mixedprec.fp8.experts import restore_experts

        with torch.no_grad():
            back = len(layers_to_bf16(model, [name for name, _ in fp8_layers(model, fresh=True)]))
            restored = restore_experts(model)  # MoE experts: back to the implementation their config had
            if restored:
                invalidate_layer_cache()  # their delayed-scaling states are gone
            back += len(restored)
    return back, convert(new) if new.precision == "fp8" else 0


class PhaseRunner:
    """A phased run's position: the phase in force (:attr:`active`, the recipe that phase trains with), the switches
    made so far, and the FP8 state kept from the last FP8 phase for a later ``fp8_history: restore``. Owned by the
    runtime, which asks :meth:`due` before every step (an integer comparison) and calls :meth:`switch` when true."""

    def __init__(self, recipe: RecipeSpec, note: Callable[[str], None]) -> None:
        self.schedule = PhaseSchedule(recipe)
        self._note = note
        self.index = 0
        self.active: RecipeSpec = self.schedule.specs[0]
        self.changes: list[dict[str, object]] = []
        #: device copies of the FP8 layers' state when the last FP8 phase ended (for ``fp8_history: restore``)
        self.kept_fp8: dict[str, torch.Tensor] = {}
        #: whether a phase restores an earlier FP8 phase's state (only then is it kept and checkpointed)
        self.restores = any(p.fp8_history == "restore" for p in self.schedule.phases)
        self._resumed_index: int | None = None
        #: the step at which :meth:`due` next asks; 0 makes the first step resolve it (and, with fractional starts,
        #: ask for the run length)
        self._next: int | None = 0

    def set_max_steps(self, max_steps: int) -> None:
        for text in self.schedule.set_max_steps(max_steps):
            self._note(f"phases: {text}")
        self._next = 0  # the next step re-checks which phase it is in

    def due(self, steps: int) -> bool:
        """Whether the step after ``steps`` done may start another phase (no device work)."""
        return self._next is not None and steps >= self._next

    def label(self, index: int | None = None) -> str:
        return self.schedule.label(self.index if index is None else index)

    def switch(self, model: nn.Module, steps: int, convert: Callable[[RecipeSpec], int]) -> PhaseSwitch | None:
        """Enter the phase the step after ``steps`` done trains in, changing ``model`` in place; ``convert(spec)``
        converts the model to ``spec``'s FP8 and returns how many layers went FP8. None when the phase is unchanged."""
        target = self.schedule.index_at(steps)
        self._next = self.schedule.next_start(target)
        if target == self.index:
            return None
        old, new = self.active, self.schedule.specs[target]
        if old.precision == "fp8" and self.restores:
            self.kept_fp8 = {k: t.detach().clone() for k, t in fp8_state_tensors(model).items()}
        back, fp8 = switch_layers(model, old, new, convert)
        self.index, self.active = target, new
        change = PhaseSwitch(steps, target, self.label(), new.precision, back, fp8)
        self.changes.append(change.to_dict())
        parts = [f"{back} FP8 layers back to high precision"] if back else []
        parts += [f"{fp8} layers to FP8 ({new.fp8.scaling} scaling)"] if new.fp8 is not None else []
        what = ", ".join(parts)
        self._note(
            f"phase {self.label()!r} ({new.precision}) begins after step {steps}"
            + (f": {what}" if what else "")
            + ("; the weights are the same tensors" if back or fp8 else "")
        )
        if new.precision == "fp8" and self.schedule.phases[target].fp8_history == "restore":
            self._restore_fp8(model)
        return change

    def _restore_fp8(self, model: nn.Module) -> None:
        if not self.kept_fp8:
            self._note(f"phase {self.label()!r}: fp8_history restore: no earlier FP8 phase's state; it starts fresh")
            return
        restarted = load_fp8_state_dict(model, self.kept_fp8)
        if restarted:
            self._note(
                f"phase {self.label()!r}: fp8_history restore: {len(restarted)} FP8 buffers had no kept state of "
                "their shape and start fresh"
            )

    def state_dict(self) -> dict[str, object]:
        """JSON-friendly (Trainer's trainer_state.json); :attr:`kept_fp8` travels with the FP8 state file."""
        return {"index": self.index, "changes": list(self.changes)}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore the switches recorded so far and remember the checkpoint's phase for :meth:`restore`."""
        self.changes = list(state.get("changes", []))  # type: ignore[call-overload]
        self._resumed_index = int(state.get("index", 0))  # type: ignore[call-overload]

    def checkpointed(self) -> RecipeSpec:
        """After :meth:`load_state_dict`: the recipe of the phase the checkpoint was written in (before :meth:`restore`
        puts the model back in it)."""
        i = self._resumed_index
        return self.schedule.specs[i] if i is not None and 0 <= i < len(self.schedule.specs) else self.active

    def restore(self, model: nn.Module, convert: Callable[[RecipeSpec], int]) -> None:
        """After :meth:`load_state_dict`: put ``model`` in the phase the checkpoint was written in (its FP8 state then
        loads into the layers it came from); the next step's :meth:`switch` moves on exactly as the run that wrote
        the checkpoint did."""
        target, self._resumed_index = self._resumed_index, None
        if target is None or not 0 <= target < len(self.schedule.specs):
            return
        self._next = 0
        if target != self.index:
            new = self.schedule.specs[target]
            switch_layers(model, self.active, new, convert)
            self.index, self.active = target, new
            self._note(f"resume: the model is put back in phase {self.label()!r} ({new.precision}), as checkpointed")
