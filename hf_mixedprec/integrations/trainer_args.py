"""The ``TrainingArguments`` side of the Trainer integration: :func:`training_args` builds arguments that agree with
a recipe, :func:`_check_args` refuses those that contradict it (``fp16``/``bf16``, ``max_grad_norm``, DeepSpeed,
``ACCELERATE_MIXED_PRECISION``) and fixes library defaults that do.

Split from :mod:`hf_mixedprec.integrations.trainer` (which re-exports :func:`training_args`) to keep each module short.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from transformers import TrainingArguments

from hf_mixedprec.integrations.accelerate_plugin import MIXED_PRECISION_ENV
from hf_mixedprec.integrations.install import accelerate_precision
from hf_mixedprec.recipes.loader import accelerate_precision_env
from hf_mixedprec.recipes.schema import RecipeSpec

__all__ = ["RECIPE_CLIPS", "training_args"]

#: The ``max_grad_norm`` :func:`training_args` writes when the recipe's clipper clips: -0.0 equals 0 (Trainer does not
#: clip) and keeps its sign through ``to_dict()`` / JSON / TRL's config conversion, so a user's explicit 0 ("no
#: clipping", +0.0) can be told from it and is never silently overridden.
RECIPE_CLIPS = -0.0


def training_args(recipe: RecipeSpec, *, args_class: type | None = None, **overrides: Any) -> TrainingArguments:
    """``TrainingArguments`` (or ``args_class``, e.g. TRL's ``SFTConfig``) whose flags agree with ``recipe``.

    Rehearsed FP16 on CPU keeps ``fp16=False`` (Accelerate would silently ignore it there); the callback
    supplies autocast and the GradScaler. A conflicting override is an error that names the key.
    """
    wanted: dict[str, Any] = {"bf16": recipe.autocast_precision() in ("bf16", "fp8"), "fp16": False}
    on_cuda = torch.cuda.is_available() and not overrides.get("use_cpu", False)
    if recipe.precision == "fp16" and recipe.phases is None:  # a phased recipe's FP16 autocast is the runtime's
        wanted["fp16"] = on_cuda
    if recipe.distributed.strategy == "deepspeed" or overrides.get("deepspeed"):
        from hf_mixedprec.integrations.deepspeed import deepspeed_clip_value

        # DeepSpeed runs FP16 itself (its own loss scaler, on CPU too) and Trainer checks fp16 against its config
        wanted["fp16"] = recipe.precision == "fp16"
        # an FP8 recipe runs DeepSpeed in FP32 (deepspeed_config); the BF16 autocast around its FP8 layers is ours
        wanted["bf16"] = recipe.precision == "bf16"
        # DeepSpeed clips inside engine.step() by the config's gradient_clipping (under ZeRO 1-3 the recipe's
        # clipper sets the threshold through it), and Trainer refuses a max_grad_norm that differs from it
        wanted["max_grad_norm"] = deepspeed_clip_value(recipe)
    elif recipe.clipping.method != "none":
        if "max_grad_norm" in overrides:  # the user's own clipping (0: Trainer's "none") against the recipe's
            raise ValueError(_clip_conflict(recipe, overrides["max_grad_norm"]))
        wanted["max_grad_norm"] = RECIPE_CLIPS  # the recipe's clipper does the clipping
    for key, value in wanted.items():
        rehearsed_fp16 = key == "fp16" and recipe.precision == "fp16"  # fp16=True is fine for an FP16 recipe on CPU
        if key in overrides and overrides[key] != value and not (rehearsed_fp16 and overrides[key]):
            raise ValueError(
                f"TrainingArguments.{key}={overrides[key]!r} contradicts recipe {recipe.name!r} "
                f"(precision {recipe.precision}, clipping {recipe.clipping.method}) (allowed: {value!r})"
            )
    if recipe.tf32 and on_cuda:
        wanted["tf32"] = True
    if not on_cuda and "use_cpu" not in overrides and not torch.backends.mps.is_available():
        # a CPU run, said so: TrainingArguments refuses bf16 without a GPU otherwise, and under DeepSpeed its
        # process state would count one process where DeepSpeed counts the launch's ranks (its batch check fails)
        wanted["use_cpu"] = True
    wanted.update(overrides)
    return (args_class or TrainingArguments)(**wanted)


def _defaults_to_none(args: Any, name: str) -> bool:
    """Whether ``args``'s dataclass declares ``name`` with default None (resolved later by the library)."""
    for f in dataclasses.fields(args) if dataclasses.is_dataclass(args) else ():
        if f.name == name:
            return f.default is None
    return False


def _clip_conflict(recipe: RecipeSpec, value: Any) -> str:
    what = "0 (Trainer's 'no clipping')" if value == 0 else repr(value)
    return (
        f"TrainingArguments.max_grad_norm={what} contradicts recipe {recipe.name!r}, whose clipping.method "
        f"{recipe.clipping.method!r} clips every step (allowed: leave max_grad_norm out of recipe.training_args(...), "
        "or Trainer's default 1.0, which the recipe's clipper replaces; for no clipping use a recipe with "
        "clipping: {method: none})"
    )


def _check_args(recipe: RecipeSpec, args: TrainingArguments, deepspeed: bool = False) -> list[str]:
    """Refuse arguments that contradict the recipe; fix library defaults that do (returned as notes). ``deepspeed``:
    whether the Trainer runs under DeepSpeed (``TrainingArguments.deepspeed`` or an ``accelerate launch`` config)."""
    p = recipe.precision
    notes: list[str] = _env_precision_notes(recipe, args, deepspeed)
    if recipe.distributed.strategy == "deepspeed" and not deepspeed:
        raise ValueError(
            f"recipe {recipe.name!r} has distributed.strategy deepspeed, but this Trainer runs without DeepSpeed (no "
            "TrainingArguments.deepspeed, no DeepSpeed config from accelerate launch), so it would train without it "
            "(allowed: recipe.training_args(deepspeed=deepspeed_config(recipe)[0], ...) from "
            "hf_mixedprec.integrations.deepspeed, or `hf-mixedprec launch --recipe RECIPE.yaml your_script.py`)"
        )
    norm = getattr(args, "max_grad_norm", None)
    deepspeed = bool(getattr(args, "deepspeed", None)) or recipe.distributed.strategy == "deepspeed"
    if recipe.clipping.method != "none" and not deepspeed and norm == 0 and math.copysign(1.0, norm) > 0:
        raise ValueError(_clip_conflict(recipe, norm))  # the user's explicit 0, not training_args()'s -0.0
    if args.fp16 and p != "fp16":
        raise ValueError(
            f"TrainingArguments.fp16=True contradicts recipe {recipe.name!r} (precision {p}); "
            "remove fp16=True or build the arguments with recipe.training_args(...)"
        )
    p = recipe.autocast_precision()  # a phased recipe: bf16 when any phase autocasts
    if args.bf16 and p in ("fp16", "fp32") and _defaults_to_none(args, "bf16"):
        # TRL's configs leave bf16=None and turn it into True when fp16 is not set: a library default, not
        # the user's choice (an explicit bf16=True cannot be told apart there and is treated the same)
        args.bf16 = False
        notes.append(
            f"{type(args).__name__}.bf16 was True by its library's default (bf16=None becomes True); set to "
            f"False for recipe {recipe.name!r} (precision {p})"
        )
    if args.bf16 and p in ("fp16", "fp32"):
        raise ValueError(
            f"TrainingArguments.bf16=True contradicts recipe {recipe.name!r} (precision {p}); "
            "remove bf16=True or build the arguments with recipe.training_args(...)"
        )
    if getattr(args, "deepspeed", None) and p not in ("fp16", "bf16", "fp32", "fp8"):
        raise ValueError(
            f"recipe {recipe.name!r} (precision {p}) cannot run under DeepSpeed here "
            "(allowed: fp32, fp16, bf16 or fp8 recipes; build the config with deepspeed_config(recipe))"
        )
    if getattr(args, "deepspeed", None) and p == "fp8" and args.bf16:
        raise ValueError(
            f"TrainingArguments.bf16=True with recipe {recipe.name!r} (precision fp8) under DeepSpeed: DeepSpeed runs "
            "FP32 for an FP8 recipe and hf_mixedprec autocasts around its FP8 layers (allowed: bf16=False; build the "
            "arguments with recipe.training_args(...) and the config with deepspeed_config(recipe))"
        )
    return notes


def _env_precision_notes(recipe: RecipeSpec, args: TrainingArguments, deepspeed: bool) -> list[str]:
    """``ACCELERATE_MIXED_PRECISION`` (what ``accelerate launch`` exports, ``no`` without a config): a name Accelerate
    does not know is refused wherever it is set. A known one is TrainingArguments' ``mixed_precision`` only when
    neither ``fp16`` nor ``bf16`` is set (those flags win, and ``training_args`` sets them from the recipe); then a
    value other than the recipe's is replaced by the recipe's precision, said in a note. Under DeepSpeed its config
    decides."""
    value = accelerate_precision_env()
    if value is None:
        return []
    wanted = accelerate_precision(recipe)
    if deepspeed or args.fp16 or args.bf16 or value == wanted or (value == "fp8" and "fp8" in recipe.precisions()):
        return []
    return [
        f"{MIXED_PRECISION_ENV}={value!r} is replaced by recipe {recipe.name!r}'s precision (mixed_precision={wanted!r})"
    ]
