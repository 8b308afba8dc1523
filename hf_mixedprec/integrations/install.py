"""The one installer: what every entry point does to put a recipe on an ``Accelerator``.

The Trainer callback (and through it ``attach``, ``finetune`` and ``compare``) and the Accelerate plugin
(``recipe.accelerator()``) reach a recipe's run through different doors, a Trainer's own Accelerator or one built by
the plugin, at different moments (before or after the model is prepared). What they install is decided here, once,
so the same recipe trains the same way whichever door a user takes:

- :func:`check_hardware` (skipped when rehearsing), then :func:`start_runtime`;
- :func:`refuse_late_autocast`: a recipe whose autocast cannot be put on a model prepared before it came;
- :func:`install_on_accelerator`: the recipe's TF32 setting, then the next three, in order;
- :func:`install_sharding`: FSDP2 on CPU processes or the recipe's FSDP2 precision policy, and whether a health
  fallback may move layers inside sharded blocks;
- :func:`install_loss_scaling`: who scales the loss (Accelerate's GradScaler when it already has the recipe's
  settings, else the runtime's) or, for every recipe but FP16, the scale-1 guard that skips flagged steps;
- :func:`autocast_owner`: who autocasts the forward (Accelerate, hf_mixedprec, each phase's own, or nobody for an FP32
  recipe), carried out on the model by :func:`install_autocast` once the caller has it.

What only one door has stays with it: the Trainer's ``TrainingArguments`` checks and checkpoint hooks
(``integrations/trainer.py``), the plugin's ``mixed_precision`` and ``GradScalerKwargs`` precedence and its wrapped
optimizer step (``integrations/accelerate_plugin.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, GradScalerKwargs

from hf_mixedprec.core._private import set_mixed_precision
from hf_mixedprec.integrations.sharding import (
    fsdp2_on_cpu_accelerator,
    fsdp2_policy_on_accelerate,
    keep_optimizer_params_by_name,
)
from hf_mixedprec.recipes.hardware import check_recipe, detect
from hf_mixedprec.recipes.schema import ACCELERATE_MIXED_PRECISION, RecipeSpec
from hf_mixedprec.training.runtime import MixedPrecisionRuntime

__all__ = [
    "GUARD_NOTE",
    "AutocastOwner",
    "Installed",
    "accelerate_precision",
    "accelerate_scaler_matches",
    "autocast_owner",
    "backpropagated_loss",
    "check_hardware",
    "enable_native_fp16",
    "grad_scaler_kwargs",
    "install_autocast",
    "install_loss_scaling",
    "install_on_accelerator",
    "install_sharding",
    "is_fsdp2",
    "refuse_late_autocast",
    "start_runtime",
]

#: Who runs the forward's autocast: Accelerate (its ``prepare_model`` wrapper), hf_mixedprec (the runtime's wrapper),
#: ``phases`` (the runtime's wrapper, reading the phase in force at every forward) or ``none`` (an FP32 recipe).
AutocastOwner = Literal["accelerate", "hf_mixedprec", "phases", "none"]

GUARD_NOTE = (
    "a scale-1 GradScaler guards the optimizer step: non-finite steps and skip_step reactions are skipped exactly"
)


def accelerate_precision(recipe: RecipeSpec) -> str:
    """Accelerate's ``mixed_precision`` for a recipe (FP8 layers run inside BF16 autocast, applied by us; a phased
    recipe's is bf16 when any phase autocasts, and the runtime sets each phase's own autocast)."""
    return ACCELERATE_MIXED_PRECISION[recipe.autocast_precision()]


def backpropagated_loss(accelerator: Accelerator, loss: torch.Tensor) -> torch.Tensor:
    """The loss ``Accelerator.backward`` back-propagates for ``loss``: divided by the accumulation steps,
    except under DeepSpeed, whose engine divides itself."""
    gas = 1 if accelerator.distributed_type == DistributedType.DEEPSPEED else accelerator.gradient_accumulation_steps
    return loss if gas == 1 else loss / gas


def enable_native_fp16(accelerator: Accelerator, scaler: torch.amp.GradScaler) -> None:
    """Make ``accelerator`` run its native FP16 path (autocast + ``scaler``) on a device where it would not."""
    set_mixed_precision(accelerator, "fp16")
    accelerator.native_amp = True
    accelerator.scaler = scaler


def check_hardware(recipe: RecipeSpec, *, rehearse: bool) -> None:
    """Refuse a recipe this machine cannot run (``HardwareMismatch``), unless rehearsed (emulated FP8 and FP16 run
    on any device). Every entry point calls it before it changes anything."""
    if not rehearse:
        check_recipe(recipe, detect())


def start_runtime(
    recipe: RecipeSpec, *, device: torch.device, rehearse: bool, notes: Iterable[str | None] = ()
) -> MixedPrecisionRuntime:
    """The run's runtime, with the decisions taken before it (``notes``, recorded in order). Nothing outside it
    changes yet (the recipe's TF32 comes with :func:`install_on_accelerator`), so a refusal after it leaves all as
    it was."""
    rt = MixedPrecisionRuntime(recipe, device=device, rehearse=rehearse)
    for text in notes:
        if text:
            rt.note(text)
    return rt


def is_fsdp2(accelerator: Accelerator) -> bool:
    """Whether ``accelerator`` shards with FSDP2 (``fully_shard``), as configured or as switched on here."""
    return getattr(getattr(accelerator.state, "fsdp_plugin", None), "fsdp_version", 1) == 2


def install_sharding(accelerator: Accelerator, rt: MixedPrecisionRuntime, *, late: bool) -> bool:
    """Before the model is prepared (not ``late``): FSDP2 on several CPU processes where the recipe asks
    (:func:`hf_mixedprec.integrations.sharding.fsdp2_on_cpu_accelerator`), else the recipe's FSDP2 precision policy
    on an FSDP2 Accelerate built itself, and under FSDP2 with FP8 all-gather the optimizer's parameters found by name.

    Under FSDP, however late, a health fallback may move layers inside the sharded blocks only under FSDP2 (the unit
    is pointed at the new module) with every rank checking at the same steps (``rt.checks_on_every_rank``: they
    move the same layers) and without torchao's FP8 all-gather (its weights reach a Linear as FP8 tensors);
    elsewhere it stops the run. True when FSDP2 was switched on here (Accelerate then autocasts nothing)."""
    recipe = rt.recipe
    sharded = not late and fsdp2_on_cpu_accelerator(accelerator, recipe, rt)
    if not late and not sharded:
        fsdp2_policy_on_accelerate(accelerator, recipe, rt)
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    swap = is_fsdp2(accelerator) and rt.checks_on_every_rank and not recipe.distributed.fp8_all_gather
    rt.reactions.sharded = plugin is not None and not swap
    if not late and recipe.distributed.fp8_all_gather and is_fsdp2(accelerator):  # torchao's: FSDP2 only
        keep_optimizer_params_by_name(accelerator)
    return sharded


def grad_scaler_kwargs(recipe: RecipeSpec) -> GradScalerKwargs | None:
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


def accelerate_scaler_matches(accelerator: Accelerator, recipe: RecipeSpec) -> bool:
    """Whether the GradScaler Accelerate built has the recipe's loss-scale settings: it is built from the
    Accelerator's ``GradScalerKwargs`` handler, or torch's defaults without one (accelerate/accelerator.py), which the
    plugin fills from the recipe and a Trainer leaves out."""
    if getattr(accelerator, "scaler", None) is None:
        return False
    handler = getattr(accelerator, "scaler_handler", None) or GradScalerKwargs()
    return handler == grad_scaler_kwargs(recipe)  # every field, ``enabled`` included


def _sharded_class(scaler: torch.amp.GradScaler) -> type[torch.amp.GradScaler] | None:
    """FSDP1's ``ShardedGradScaler`` class when ``scaler`` is one (None otherwise, or without torch.distributed)."""
    try:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    except ImportError:
        return None
    return ShardedGradScaler if isinstance(scaler, ShardedGradScaler) else None


def install_loss_scaling(accelerator: Accelerator, rt: MixedPrecisionRuntime) -> torch.amp.GradScaler:
    """Put the run's GradScaler on ``accelerator`` and in the runtime, and return it (DeepSpeed's own loss scaling is
    the Trainer callback's, which does not call this).

    - FP16 without phases, where Accelerate runs its native FP16 path: its GradScaler when it has the recipe's
      settings, else one of the same class (FSDP1's ``ShardedGradScaler``, whose found-inf flag is reduced over
      ranks, or torch's) with the recipe's settings in its place. Where Accelerate skipped FP16 (it ignores it on
      CPU, or its ``mixed_precision`` was ``no``), its native FP16 path is switched on with the runtime's scaler,
      said in a note.
    - Every other recipe: the scale-1 guard (a phased recipe's turns into the loss scaler in its FP16 phases).
    """
    recipe = rt.recipe
    if recipe.precision == "fp16" and rt.phases is None:
        if accelerator.native_amp and accelerator.mixed_precision == "fp16" and accelerator.scaler is not None:
            if accelerate_scaler_matches(accelerator, recipe):
                rt.amp.adopt_grad_scaler(accelerator.scaler)
            else:
                accelerator.scaler = rt.amp.make_grad_scaler(_sharded_class(accelerator.scaler))
            return accelerator.scaler
        before = accelerator.mixed_precision
        scaler = rt.make_grad_scaler()
        assert scaler is not None  # an fp16 recipe without phases has loss_scale (schema)
        enable_native_fp16(accelerator, scaler)
        cpu = accelerator.device.type == "cpu"
        why = "Accelerate runs no fp16 on cpu" if cpu else f"Accelerate's mixed_precision was {before!r}"
        rt.note(
            f"fp16 autocast and GradScaler enabled on {rt.device.type} through Accelerate's native-AMP path ({why})"
        )
        return scaler
    scaler = accelerator.scaler = rt.make_guard_scaler()
    rt.note(GUARD_NOTE, quiet=True)  # every non-FP16 run has it: nothing to act on
    return scaler


def autocast_owner(
    accelerator: Accelerator, rt: MixedPrecisionRuntime, *, late: bool, accelerate_wrapped: bool
) -> AutocastOwner:
    """Who autocasts the forward. A phased recipe's autocast changes at its boundaries: the runtime's wrapper, which
    reads the phase at every forward. Under FSDP2 Accelerate autocasts nothing (``Accelerator._prepare_fsdp2`` never
    reaches ``prepare_model``, and the compute dtype is the FSDP2 policy's, which the recipe's ``param_dtype: auto``
    leaves as stored): the runtime's wrapper. A model prepared before the recipe came (``late``) keeps Accelerate's
    autocast if it had the recipe's (``accelerate_wrapped``); otherwise Accelerate autocasts at ``prepare_model``
    when its native mixed precision is the recipe's."""
    recipe = rt.recipe
    if rt.phases is not None:
        return "phases"
    if recipe.autocast_precision() == "fp32":
        return "none"
    if is_fsdp2(accelerator):
        return "hf_mixedprec"
    if late:
        return "accelerate" if accelerate_wrapped else "hf_mixedprec"
    return "accelerate" if accelerate_autocasts(accelerator, recipe) else "hf_mixedprec"


def refuse_late_autocast(accelerator: Accelerator, recipe: RecipeSpec, *, late: bool) -> None:
    """A callback added after the Trainer prepared its model sits outside Accelerate's autocast and cannot turn it off:
    a recipe that trains in FP32 there (an FP32 recipe, or a phased recipe's FP32 phase) is refused before anything
    is installed, rather than trained under Accelerate's autocast."""
    if not (late and accelerator.native_amp and accelerator.mixed_precision != "no"):
        return
    if recipe.phases is not None and "fp32" in recipe.precisions():
        what = "has an fp32 phase"
    elif recipe.phases is None and recipe.autocast_precision() == "fp32":
        what = "trains in fp32"
    else:
        return
    raise ValueError(
        f"recipe {recipe.name!r} {what}, and this callback was added after the Trainer prepared the model under "
        f"mixed_precision={accelerator.mixed_precision!r}, whose autocast cannot be turned off then; pass "
        "recipe.callbacks() to Trainer(callbacks=...) or use attach(trainer, recipe) before train()"
    )


def accelerate_autocasts(accelerator: Accelerator, recipe: RecipeSpec) -> bool:
    """Whether ``accelerator`` would autocast (or, for a prepared model, did) in the recipe's precision."""
    return bool(accelerator.native_amp and accelerator.mixed_precision == accelerate_precision(recipe))


@dataclass(frozen=True)
class Installed:
    """What :func:`install_on_accelerator` put in place."""

    #: FSDP2 switched on here for several CPU processes
    sharded: bool
    #: the run's GradScaler (loss scaler or guard) on the Accelerator
    scaler: torch.amp.GradScaler
    #: who autocasts the forward (:func:`autocast_owner`)
    autocast: AutocastOwner


def install_autocast(
    accelerator: Accelerator, rt: MixedPrecisionRuntime, model: torch.nn.Module, installed: Installed, *, late: bool
) -> None:
    """Carry out :func:`autocast_owner`'s answer on ``model`` (before Accelerate prepares it, unless ``late``), with
    a note saying who autocasts where it is not Accelerate."""
    recipe, owner = rt.recipe, installed.autocast
    if owner == "accelerate":
        return
    if owner == "none":
        if accelerator.mixed_precision != "no":  # an FP32 recipe on an Accelerator built for mixed precision
            set_mixed_precision(accelerator, "no")
            accelerator.native_amp = False
        return
    if not rt.wrap_forward_with_autocast(model):  # wrapped already (a model passed to prepare again)
        return
    if owner == "phases":
        rt.note(f"phased recipe: hf_mixedprec sets the autocast of each phase ({' -> '.join(recipe.precisions())})")
        return
    if owner == "hf_mixedprec":
        precision = "fp16" if recipe.precision == "fp16" else "bf16"
        if installed.sharded:
            why = "FSDP2 on CPU"
        elif is_fsdp2(accelerator):
            why = "FSDP2: Accelerate autocasts nothing there"
        else:
            why = f"Accelerate's mixed_precision is {accelerator.mixed_precision!r}"
            why += ", callback added after the model was prepared" if late else ""
        rt.note(f"{precision} autocast installed by hf_mixedprec ({why})")


def install_on_accelerator(accelerator: Accelerator, rt: MixedPrecisionRuntime, *, late: bool) -> Installed:
    """The recipe's TF32, sharding, loss scaling and the autocast decision, in that order, for a run whose Accelerator
    is built (the model is wrapped by the caller, who has it: :func:`install_autocast`). A ``late`` caller has called
    :func:`refuse_late_autocast` first, before any change of its own."""
    rt.apply_tf32()
    wrapped_before = accelerate_autocasts(accelerator, rt.recipe)
    sharded = install_sharding(accelerator, rt, late=late)
    scaler = install_loss_scaling(accelerator, rt)
    owner = autocast_owner(accelerator, rt, late=late, accelerate_wrapped=wrapped_before)
    return Installed(sharded=sharded, scaler=scaler, autocast=owner)
