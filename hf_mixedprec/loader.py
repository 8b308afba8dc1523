"""``load_recipe``: the one entry point that turns a name, a path or ``auto`` into a runnable recipe.

Precedence for what to load: the argument, else the recipe ``hf-mixedprec launch`` exported to this process
(``HF_MIXEDPREC_RECIPE``), else ``auto``. ``auto`` picks the built-in recipe for the detected hardware and
logs every fallback it made. A recipe the hardware cannot run is refused (:class:`HardwareRefusal`).
"""

from __future__ import annotations

import logging
import os

from hf_mixedprec.hardware import HardwareInfo, auto_recipe_name, check_recipe, detect
from hf_mixedprec.recipe import RECIPE_ENV, Recipe, load_recipe_file

__all__ = ["load_recipe", "resolve_auto"]

log = logging.getLogger("hf_mixedprec")


def resolve_auto(info: HardwareInfo | None = None) -> tuple[str, list[str]]:
    """The built-in recipe name ``auto`` means on this machine, with the fallback notes."""
    info = info or detect()
    return auto_recipe_name(
        info.device_type,
        info.capability,
        info.cuda_version,
        te_available=info.te_version is not None,
        torchao_available=info.torchao_version is not None,
    )


def load_recipe(
    name_or_path: str | os.PathLike[str] | None = None,
    *,
    check_hardware: bool = True,
    hardware: HardwareInfo | None = None,
) -> Recipe:
    """Load and validate a recipe by built-in name, YAML path or ``"auto"``.

    Raises :class:`~hf_mixedprec.recipe.RecipeError` for invalid recipes (every problem, one line each) and
    :class:`~hf_mixedprec.hardware.HardwareRefusal` when ``check_hardware`` and this machine cannot run it.
    """
    if name_or_path is None:
        name_or_path = os.environ.get(RECIPE_ENV) or "auto"
    info = hardware
    if os.fspath(name_or_path) == "auto":
        info = info or detect()
        name, notes = resolve_auto(info)
        for note in notes:
            log.warning("hf_mixedprec: %s", note)
        recipe = load_recipe_file(name)
    else:
        recipe = load_recipe_file(name_or_path)
    if check_hardware:
        check_recipe(recipe, info or detect())
    return recipe
