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
import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from hf_mixedprec.clipping import Clipper, ClipResult, global_grad_norm, make_clipper
from hf_mixedprec.fp8 import ConversionReport, convert, fp8_step
from hf_mixedprec.recipe import Recipe

__all__ = ["MixedPrecisionRuntime", "compute_dtype"]

log = logging.getLogger("hf_mixedprec")

STATE_VERSION = 1


def compute_dtype(recipe: Recipe) -> torch.dtype | None:
    """The autocast dtype a recipe trains in (None for fp32). FP8 layers sit inside a BF16 autocast."""
    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.bfloat16}.get(recipe.precision)


class MixedPrecisionRuntime:
    """Applies one recipe to one model/optimizer pair (see module docs)."""

    def __init__(self, recipe: Recipe, *, device: torch.device | str = "cpu", rehearse: bool | None = None):
        self.recipe = recipe
        self.device = torch.device(device)
        self.rehearse = bool(recipe.rehearse if rehearse is None else rehearse)
        self.notes: list[str] = []
        self.clipper: Clipper | None = make_clipper(recipe.clipping.method, **recipe.clipping.params())
        self.scaler: torch.amp.GradScaler | None = None
        self.fp8_report: ConversionReport | None = None
        self.steps = 0  # optimizer steps seen (host-side count, known without looking at tensors)
        self._skipped = torch.zeros((), dtype=torch.int64, device=self.device)
        self._last: ClipResult | None = None
        self._found_inf = torch.zeros((), device=self.device)
        self._corrected_skip = False
        #: Under DeepSpeed the engine owns loss scaling and clipping; this reads its scaler for the metrics.
        self.external_scaler: Any = None
        if self.rehearse:
            self.note(f"REHEARSAL: recipe {recipe.name!r} ({recipe.precision}) is rehearsed on {self.device.type}")

    def note(self, text: str) -> None:
        """Record a decision or fallback (also logged loudly); they all end up in the run report."""
        self.notes.append(text)
        log.warning("hf_mixedprec: %s", text)

    # -- setup -------------------------------------------------------------------------------------
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

    def before_optimizer_step(
        self,
        parameters: Iterable[Any],
        optimizer: torch.optim.Optimizer | None = None,
        total_norm: torch.Tensor | None = None,
    ) -> ClipResult | None:
        """Gradients are unscaled: note whether the scaler found inf/NaN, then clip (no host sync)."""
        params = [p for p in parameters if getattr(p, "grad", None) is not None]
        found = self._scaler_found_inf(optimizer) if optimizer is not None else None
        if found is None:
            norm = total_norm if total_norm is not None else global_grad_norm([p.grad for p in params])
            found = (~torch.isfinite(norm)).to(self._found_inf.dtype)
        self._found_inf = found
        if self.clipper is not None:
            self._last = self.clipper.clip_(params, total_norm=total_norm)
        return self._last

    def after_optimizer_step(self, model: nn.Module, optimizer: Any = None) -> None:
        """Advance FP8 delayed scaling, count skipped steps, and tell Accelerate whether the step was skipped.

        torch's ``GradScaler.step`` lets optimizers that support AMP scaling (``_step_supports_amp_scaling``,
        e.g. torch 2.x AdamW) skip an overflow step inside ``optimizer.step()``; Accelerate infers a skip
        from ``step()`` not being called, so it reports none and Trainer would advance the LR schedule on
        skipped steps. With a GradScaler this reads the scaler's found-inf once per optimizer step (FP16
        loss scaling needs that host decision anyway) and corrects ``step_was_skipped``.
        """
        fp8_step(model)
        if self.scaler is not None:
            self._skipped += self._found_inf.to(self._skipped.dtype)
            if optimizer is not None and hasattr(optimizer, "_is_overflow"):
                skipped = bool(self._found_inf.item())
                if skipped and not optimizer._is_overflow:
                    optimizer._is_overflow = True
                    if not self._corrected_skip:
                        self._corrected_skip = True
                        self.note(
                            "Accelerate reported an overflow step as taken (the optimizer skipped it itself); "
                            "hf_mixedprec marks such steps skipped so the LR scheduler does not advance"
                        )
        self.steps += 1

    # -- reporting (host sync: only when a log is due) -----------------------------------------------
    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.external_scaler is not None:
            ds = self.external_scaler()
            if ds is not None:
                out["mp/loss_scale"] = float(ds["loss_scale"])
                out["mp/overflow"] = float(ds["overflow"])
                if ds.get("skipped_steps") is not None:
                    out["mp/skipped_steps"] = float(ds["skipped_steps"])
        if self.scaler is not None:
            out["mp/loss_scale"] = float(self.scaler.get_scale())
            out["mp/skipped_steps"] = float(self._skipped.item())
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
        return {"version": STATE_VERSION, "steps": self.steps, "skipped": int(self._skipped.item()), "clipper": clip}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"hf_mixedprec runtime state version {state.get('version')!r} (expected {STATE_VERSION})")
        self.steps = int(state["steps"])
        self._skipped = torch.tensor(int(state["skipped"]), dtype=torch.int64, device=self.device)
        clip = state.get("clipper")
        if (clip is None) != (self.clipper is None):
            raise ValueError("checkpointed clipping state does not match the recipe's clipping.method")
        if clip is not None and self.clipper is not None:
            self.clipper.load_state_dict({**clip, "state": {k: _from_json(v) for k, v in clip["state"].items()}})


def _to_json(t: Any) -> Any:
    if isinstance(t, torch.Tensor):
        return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "data": t.flatten().tolist()}
    return t


def _from_json(v: Any) -> Any:
    if isinstance(v, dict) and {"dtype", "shape", "data"} <= set(v):
        return torch.tensor(v["data"], dtype=getattr(torch, v["dtype"])).reshape(v["shape"])
    return v
