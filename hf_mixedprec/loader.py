"""``load_recipe``: the one entry point that turns a name, a path or ``auto`` into a runnable recipe.

Precedence for what to load: the argument, else the recipe ``hf-mixedprec launch`` exported to this process
(``HF_MIXEDPREC_RECIPE``), else ``auto``. ``auto`` picks the built-in recipe for the detected hardware and
logs every fallback it made. A recipe the hardware cannot run is refused (:class:`HardwareRefusal`) unless
it is rehearsed: ``rehearse=True``, else ``HF_MIXEDPREC_REHEARSE=1`` in the environment (the CLI's
``--rehearse`` sets it for child processes). Rehearsal is logged and recorded, never silent.
"""

from __future__ import annotations

import logging
import os
from typing import TypeVar

from hf_mixedprec.errors import EnvValueError
from hf_mixedprec.hardware import HardwareInfo, auto_recipe_name, check_recipe, detect
from hf_mixedprec.recipe_files import load_recipe_file
from hf_mixedprec.schema import RECIPE_ENV, RecipeSpec

R = TypeVar("R", bound=RecipeSpec)

__all__ = ["REHEARSE_ENV", "EnvValueError", "load_recipe", "rehearse_from_env", "resolve_auto"]

#: Set to 1 to rehearse recipes this machine cannot run natively.
REHEARSE_ENV = "HF_MIXEDPREC_REHEARSE"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def rehearse_from_env() -> bool:
    """``HF_MIXEDPREC_REHEARSE`` as a bool; anything but a clear yes/no is an error naming the variable."""
    raw = os.environ.get(REHEARSE_ENV, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise EnvValueError(f"{REHEARSE_ENV}={raw!r} is not a boolean (allowed: 1, 0, true, false, yes, no, on, off)")


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
    rehearse: bool | None = None,
    check_hardware: bool = True,
    hardware: HardwareInfo | None = None,
    cls: type[R] = RecipeSpec,  # type: ignore[assignment]
) -> R:
    """Load and validate a recipe by built-in name, YAML path or ``"auto"``.

    Builds ``cls`` (the facade :func:`hf_mixedprec.recipe.load_recipe` passes its ``Recipe``). Raises
    :class:`~hf_mixedprec.errors.RecipeError` for invalid recipes (every problem, one line each) and
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
        recipe = load_recipe_file(name, cls=cls)
    else:
        recipe = load_recipe_file(name_or_path, cls=cls)
    if rehearse is None:
        rehearse = rehearse_from_env()
    if rehearse:
        # the runtime records (and prints) the one REHEARSAL note, saying what is emulated
        log.info("hf_mixedprec: recipe %r is rehearsed (no hardware check)", recipe.name)
        return recipe.rehearsed(True)
    if check_hardware:
        check_recipe(recipe, info or detect())
    return recipe
