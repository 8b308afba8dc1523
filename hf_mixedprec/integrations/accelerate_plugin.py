"""Accelerate plugin: ``make_accelerator(recipe)`` returns an ``Accelerator`` configured by the recipe.

The returned object is an ``accelerate.Accelerator`` (a thin subclass) so a hand-written loop needs no other
change: ``prepare`` converts the model to FP8 as the recipe says (keep rules included) before wrapping it,
``backward`` scales the loss with a ``GradScaler`` built from the recipe's ``loss_scale`` (stock
``GradScalerKwargs``), ``clip_grad_norm_`` applies the recipe's clipper to unscaled gradients, and the
prepared optimizer's ``step`` advances FP8 delayed scaling after each real step.

Rehearsed FP16 on CPU: Accelerate ignores ``mixed_precision="fp16"`` on CPU (no autocast, no scaler), so
:func:`enable_native_fp16` switches on Accelerate's own native-AMP FP16 path there (autocast(float16) at
``prepare``, a real ``torch.amp.GradScaler("cpu")`` for ``backward``/unscale/step), exactly the code a V100
runs. The switch is logged and recorded.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import GradScalerKwargs

from hf_mixedprec.hardware import check_recipe, detect
from hf_mixedprec.recipe import Recipe
from hf_mixedprec.runtime import MixedPrecisionRuntime

__all__ = ["MixedPrecisionAccelerator", "enable_native_fp16", "grad_scaler_kwargs", "make_accelerator"]

log = logging.getLogger("hf_mixedprec")

_MIXED = {"fp32": "no", "fp16": "fp16", "bf16": "bf16", "fp8": "bf16"}


def grad_scaler_kwargs(recipe: Recipe) -> GradScalerKwargs | None:
    """Accelerate's stock ``GradScalerKwargs`` with the recipe's loss-scale settings (fp16 only)."""
    ls = recipe.loss_scale
    if recipe.precision != "fp16" or ls is None:
        return None
    return GradScalerKwargs(
        init_scale=ls.init_scale,
        growth_factor=ls.growth_factor,
        backoff_factor=ls.backoff_factor,
        growth_interval=ls.growth_interval,
    )


def enable_native_fp16(accelerator: Accelerator, scaler: torch.amp.GradScaler) -> None:
    """Make ``accelerator`` run its native FP16 path (autocast + ``scaler``) on a device where it would not."""
    accelerator.state._mixed_precision = "fp16"
    accelerator.native_amp = True
    accelerator.scaler = scaler


class MixedPrecisionAccelerator(Accelerator):
    """An ``Accelerator`` that applies a recipe (see module docs). Build it with :func:`make_accelerator`."""

    def __init__(self, recipe: Recipe, *, rehearse: bool | None = None, **kwargs: Any):
        rehearse = recipe.rehearse if rehearse is None else rehearse
        if not rehearse:
            check_recipe(recipe, detect())
        if "mixed_precision" in kwargs and kwargs["mixed_precision"] not in (None, _MIXED[recipe.precision]):
            raise ValueError(
                f"mixed_precision={kwargs['mixed_precision']!r} contradicts recipe {recipe.name!r} "
                f"(allowed: {_MIXED[recipe.precision]!r} or leave it out)"
            )
        kwargs["mixed_precision"] = _MIXED[recipe.precision]
        handlers = list(kwargs.pop("kwargs_handlers", None) or [])
        gsk = grad_scaler_kwargs(recipe)
        if gsk is not None and not any(isinstance(h, GradScalerKwargs) for h in handlers):
            handlers.append(gsk)
        super().__init__(kwargs_handlers=handlers, **kwargs)
        self.recipe = recipe
        self.mp = MixedPrecisionRuntime(recipe, device=self.device, rehearse=rehearse)
        if recipe.precision == "fp16":
            if self.scaler is None:  # Accelerate skipped fp16 here (CPU): run its native path ourselves
                enable_native_fp16(self, self.mp.make_grad_scaler())
                self.mp.note(
                    f"fp16 autocast and GradScaler enabled on {self.device.type} through Accelerate's "
                    "native-AMP path (Accelerate ignores fp16 there)"
                )
            else:
                self.mp.scaler = self.scaler
        elif self.mp.wants_guard():
            self.scaler = self.mp.make_guard_scaler()
        self.mp.apply_tf32()
        self._clipped_this_step = False

    # -- prepare -------------------------------------------------------------------------------------
    def prepare_model(
        self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ):
        if self.recipe.precision == "fp8" and not evaluation_mode:
            self.mp.convert_model(model)
        self._mp_model = model
        if not evaluation_mode:
            self.mp.watch_loss(model)
            self.mp.begin_step(model)
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None):
        opt = super().prepare_optimizer(optimizer, device_placement=device_placement)
        inner_step = opt.step

        @functools.wraps(inner_step)
        def step(*args: Any, **kwargs: Any) -> Any:
            if self.sync_gradients:
                if not self._clipped_this_step:
                    self.unscale_gradients()
                    self.mp.before_optimizer_step(self._params(), opt.optimizer)
                out = inner_step(*args, **kwargs)
                self.mp.after_optimizer_step(self._mp_model, opt)
                self.mp.begin_step(self._mp_model)
                self._clipped_this_step = False
                return out
            return inner_step(*args, **kwargs)

        opt.step = step  # type: ignore[method-assign]
        return opt

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for p in self._mp_model.parameters() if p.grad is not None]

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

    def mp_metrics(self) -> dict[str, float]:
        """The recipe's metrics (``mp/...``) after checking the health detectors; reads device values, so
        call it only when you log. Check :attr:`should_stop` afterwards."""
        opt = self._optimizers[0] if self._optimizers else None
        self.mp.rewind_schedule(opt, self._schedulers[0] if self._schedulers else None)
        self.mp.check(self._mp_model, opt)
        return self.mp.metrics()

    @property
    def should_stop(self) -> str | None:
        """Why a health reaction asked to stop (save a checkpoint, then stop), or None."""
        return self.mp.stop_requested


def make_accelerator(recipe: Recipe, **accelerator_kwargs: Any) -> MixedPrecisionAccelerator:
    """An ``Accelerator`` configured by ``recipe`` (precision, GradScaler settings, FP8 conversion, clipping)."""
    return MixedPrecisionAccelerator(recipe, **accelerator_kwargs)
