"""The recipe as users hold it: the validated schema plus what it does to a Trainer or an Accelerate loop.

:class:`Recipe` is :class:`hf_mixedprec.recipes.schema.RecipeSpec` with three conveniences, ``recipe.callbacks()``,
``recipe.training_args(...)`` and ``recipe.accelerator(...)``, and :meth:`Recipe.from_yaml`. This module sits
above the integrations (it imports them, lazily, so ``import hf_mixedprec`` does not import transformers),
and nothing below it imports it: the runtime, the FP8 backends and the integrations work with any
``RecipeSpec``. The loaders here are those of :mod:`hf_mixedprec.recipes.files` building a :class:`Recipe`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hf_mixedprec.core.errors import Problem, RecipeError
from hf_mixedprec.recipes.files import builtin_recipe_names, builtin_recipe_path
from hf_mixedprec.recipes.files import load_recipe_file as _load_file
from hf_mixedprec.recipes.files import parse_recipe_yaml as _parse
from hf_mixedprec.recipes.files import resolve_recipe as _resolve
from hf_mixedprec.recipes.hardware import HardwareInfo
from hf_mixedprec.recipes.loader import load_recipe as _load_spec
from hf_mixedprec.recipes.schema import (
    GENERATIONS,
    RECIPE_ENV,
    ClippingConfig,
    DetectorConfig,
    DetectorsConfig,
    DistributedConfig,
    FP8Config,
    HealthConfig,
    LossScaleConfig,
    RecipeSpec,
)

__all__ = [
    "GENERATIONS",
    "RECIPE_ENV",
    "ClippingConfig",
    "DetectorConfig",
    "DetectorsConfig",
    "DistributedConfig",
    "FP8Config",
    "HealthConfig",
    "LossScaleConfig",
    "Problem",
    "Recipe",
    "RecipeError",
    "RecipeSpec",
    "builtin_recipe_names",
    "builtin_recipe_path",
    "fp32_recipe",
    "load_recipe",
    "load_recipe_file",
    "resolve_recipe",
]


class Recipe(RecipeSpec):
    """A complete, validated mixed-precision training recipe, ready to apply with one line."""

    def callbacks(self, **kwargs: Any) -> list[Any]:
        """Trainer callbacks that apply this recipe: ``Trainer(..., callbacks=recipe.callbacks())``."""
        from hf_mixedprec.integrations.trainer import recipe_callbacks

        return recipe_callbacks(self, **kwargs)

    def training_args(self, **overrides: Any) -> Any:
        """``TrainingArguments`` whose precision and clipping flags agree with this recipe."""
        from hf_mixedprec.integrations.trainer import training_args

        return training_args(self, **overrides)

    def accelerator(self, **accelerator_kwargs: Any) -> Any:
        """An ``accelerate.Accelerator`` configured by this recipe (see ``hf_mixedprec.integrations.accelerate_plugin.make_accelerator``)."""
        from hf_mixedprec.integrations.accelerate_plugin import make_accelerator

        return make_accelerator(self, **accelerator_kwargs)

    @classmethod
    def from_yaml(cls, text: str, *, source: str = "<string>") -> Recipe:
        """A recipe from YAML text (every problem raised as one :class:`RecipeError`)."""
        return _parse(text, source=source, cls=cls)


def resolve_recipe(
    data: Mapping[str, Any], *, source: str = "<dict>", base_dir: Path | None = None, _ident: str | None = None
) -> Recipe:
    """Validate a raw mapping (following ``extends``) into a :class:`Recipe`, or raise :class:`RecipeError`."""
    return _resolve(data, source=source, base_dir=base_dir, _ident=_ident, cls=Recipe)


def fp32_recipe() -> Recipe:
    """Plain FP32 training (no autocast, no loss scaling): the baseline ``compare`` and ``estimate`` measure against."""
    return resolve_recipe({"name": "fp32", "precision": "fp32"})


def load_recipe_file(name_or_path: str | os.PathLike[str]) -> Recipe:
    """Load a built-in recipe by name, or a YAML file by path, resolving ``extends``. No hardware check."""
    return _load_file(name_or_path, cls=Recipe)


def load_recipe(
    name_or_path: str | os.PathLike[str] | None = None,
    *,
    rehearse: bool | None = None,
    check_hardware: bool = True,
    hardware: HardwareInfo | None = None,
) -> Recipe:
    """Load and validate a recipe by built-in name, YAML path or ``"auto"``, checked against this machine.

    The argument, else ``HF_MIXEDPREC_RECIPE`` (set by ``hf-mixedprec launch``), else ``auto``; rehearsed with
    ``rehearse=True`` or ``HF_MIXEDPREC_REHEARSE=1`` (see :func:`hf_mixedprec.recipes.loader.load_recipe`). Raises
    :class:`RecipeError` (every problem, one line each) and :class:`~hf_mixedprec.core.errors.HardwareRefusal`.
    """
    return _load_spec(name_or_path, rehearse=rehearse, check_hardware=check_hardware, hardware=hardware, cls=Recipe)
