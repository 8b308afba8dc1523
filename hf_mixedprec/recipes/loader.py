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

from hf_mixedprec.core.errors import EnvValueError, Problem, RecipeError
from hf_mixedprec.recipes.files import load_recipe_file
from hf_mixedprec.recipes.hardware import HardwareInfo, auto_recipe_name, check_recipe, detect, torch_has_fp8_gemm
from hf_mixedprec.recipes.schema import RECIPE_ENV, RecipeSpec

R = TypeVar("R", bound=RecipeSpec)

__all__ = [
    "REHEARSE_ENV",
    "EnvValueError",
    "accelerate_precision_env",
    "check_process_env",
    "load_recipe",
    "load_recipe_named",
    "rehearse_from_env",
    "resolve_auto",
]

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


#: Process-placement variables torchrun / ``accelerate launch`` set and torch, Accelerate and transformers read with
#: a bare ``int(...)``: checked first, so a bad value is one line naming it instead of a traceback from inside them.
PROCESS_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_PORT")
#: Accelerate's values for ``ACCELERATE_MIXED_PRECISION`` (``accelerate.utils.PrecisionType``).
ACCELERATE_PRECISIONS = ("no", "fp16", "bf16", "fp8")


def check_process_env() -> None:
    """Refuse, in one line naming the variable, a process variable that is not a count (:data:`PROCESS_ENV`), a
    rank outside its world, a port outside 1..65535, or an ``ACCELERATE_MIXED_PRECISION`` Accelerate has no name
    for (it would be dropped on the Trainer path and fail deep inside Accelerate on another)."""
    values: dict[str, int] = {}
    for var in PROCESS_ENV:
        raw = os.environ.get(var)
        if raw is None:
            continue
        text = raw.strip()
        if not (text.isascii() and text.isdigit()) or len(text) > 9:
            raise EnvValueError(
                f"{var}={raw[:40]!r} is not a process count or index (allowed: an integer >= 0, as torchrun and "
                "accelerate launch set it; or unset for one process)"
            )
        values[var] = int(raw)
    port = values.get("MASTER_PORT")
    if port is not None and not 1 <= port <= 65535:
        raise EnvValueError(f"MASTER_PORT={port} is not a port (allowed: 1 to 65535)")
    for rank, size in (("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        if rank in values and size in values and values[rank] >= values[size]:
            raise EnvValueError(
                f"{rank}={values[rank]} is not a rank of {size}={values[size]} (allowed: 0 to {values[size] - 1})"
            )
    if "WORLD_SIZE" in values and values["WORLD_SIZE"] < 1:
        raise EnvValueError("WORLD_SIZE=0 is not a world (allowed: an integer >= 1)")
    accelerate_precision_env()


def accelerate_precision_env() -> str | None:
    """``ACCELERATE_MIXED_PRECISION`` (what ``accelerate launch`` exports), lower-cased; None when unset. A name
    Accelerate has no precision for is an :class:`EnvValueError` naming the variable."""
    raw = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if raw is None:
        return None
    value = raw.strip().lower()
    if value not in ACCELERATE_PRECISIONS:
        raise EnvValueError(
            f"ACCELERATE_MIXED_PRECISION={raw[:40]!r} is not a precision Accelerate knows (allowed: "
            f"{', '.join(ACCELERATE_PRECISIONS)}; or unset, and the recipe decides)"
        )
    return value


def load_recipe_named(name: str | os.PathLike[str] | None, *, cls: type[R] = RecipeSpec) -> R:  # type: ignore[assignment]
    """:func:`load_recipe_file` of ``name``, or of ``HF_MIXEDPREC_RECIPE`` when ``name`` is None; a problem with the
    variable's recipe names the variable (``HF_MIXEDPREC_RECIPE=/old/run.yaml: file not found ...``)."""
    if name is not None:
        return load_recipe_file(name, cls=cls)
    value = os.environ.get(RECIPE_ENV) or "auto"
    try:
        return load_recipe_file(value, cls=cls)
    except RecipeError as exc:
        if not os.environ.get(RECIPE_ENV):
            raise
        raise RecipeError(Problem(f"{RECIPE_ENV}={p.source}", p.key, p.message) for p in exc.problems) from None


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
        native_available=torch_has_fp8_gemm(),
        cpu_bf16=info.cpu_bf16,
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

    Builds ``cls`` (the facade :func:`hf_mixedprec.integrations.recipe.load_recipe` passes its ``Recipe``). Raises
    :class:`~hf_mixedprec.core.errors.RecipeError` for invalid recipes (every problem, one line each) and
    :class:`~hf_mixedprec.recipes.hardware.HardwareRefusal` when ``check_hardware`` and this machine cannot run it.
    """
    from_env = name_or_path is None
    if name_or_path is None:
        name_or_path = os.environ.get(RECIPE_ENV) or "auto"
    info = hardware
    if os.fspath(name_or_path) == "auto":
        info = info or detect()
        name, notes = resolve_auto(info)
        for note in notes:  # a fallback loudly; the choice itself (cpu-fp32 on a CPU without BF16) at INFO
            log.log(logging.WARNING if note.startswith("FALLBACK") else logging.INFO, "hf_mixedprec: %s", note)
        recipe = load_recipe_file(name, cls=cls).chosen_by_auto(notes)
    else:
        recipe = load_recipe_named(None if from_env else name_or_path, cls=cls)
    if rehearse is None:
        rehearse = rehearse_from_env()
    if rehearse:
        # the runtime records (and prints) the one REHEARSAL note, saying what is emulated
        log.info("hf_mixedprec: recipe %r is rehearsed (no hardware check)", recipe.name)
        return recipe.rehearsed(True)
    if check_hardware:
        check_recipe(recipe, info or detect())
    return recipe
