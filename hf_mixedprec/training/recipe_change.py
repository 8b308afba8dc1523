"""A resume under another recipe than the checkpoint's: decided, never silent.

Every checkpoint's runtime state records the recipe it was written under (:func:`recipe_record`: its name, precision
and phases, FP8 numerics, storage and clipping method) and the recipes the run has trained under so far. At resume,
:func:`decide` compares that record with the run's recipe:

* the same numerics (another name or other health settings included): the run goes on, a changed name noted;
* a precision the run may step down to (:data:`STEP_DOWN`: FP8 -> BF16 or FP32, FP16 -> BF16 or FP32, BF16 -> FP32):
  a documented transition, taken as a phase change is (the checkpoint's weights and optimizer state carry over, FP8
  scaling state and the FP16 loss scale do not), noted, and the run report lists the run's recipes with the step each
  took over at;
* another precision, other FP8 numerics or another clipping method: refused in one line naming both recipes, unless
  the run allows recipe changes (``finetune --allow-recipe-change``, ``MixedPrecisionCallback(allow_recipe_change=
  True)`` or ``HF_MIXEDPREC_ALLOW_RECIPE_CHANGE=1``), which then drops the state that no longer applies, noted;
* another ``storage.master`` that :mod:`hf_mixedprec.storage.convert` converts (``bf16_remainder`` <-> ``fp32``,
  ``bf16_kahan`` or ``bf16_stochastic`` -> ``fp32``): the weights and optimizer state are converted before the first
  step, noted; any other storage change is refused in one line in the recipe's own words whatever the flag says, so
  that an optimizer state is never loaded into another optimizer or onto weights stored otherwise.

A checkpoint written before the record existed resumes unchecked, with a note that says so.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hf_mixedprec.core.errors import MixedPrecisionError
from hf_mixedprec.recipes.schema import RecipeSpec
from hf_mixedprec.storage.convert import TRANSITIONS, storage_transition

__all__ = [
    "ALLOW_ENV",
    "STEP_DOWN",
    "RecipeChangeRefused",
    "RecipeHistory",
    "ResumeDecision",
    "allowed_by_env",
    "decide",
    "recipe_record",
    "storage_change",
    "storage_conversion",
]

#: The environment variable that allows a resume under a recipe of other numerics (for Trainer scripts).
ALLOW_ENV = "HF_MIXEDPREC_ALLOW_RECIPE_CHANGE"
#: (checkpoint's precision, run's precision) pairs a resume takes without a flag: to a wider format, never narrower.
STEP_DOWN: frozenset[tuple[str, str]] = frozenset(
    {("fp8", "bf16"), ("fp8", "fp32"), ("fp16", "bf16"), ("fp16", "fp32"), ("bf16", "fp32")}
)
#: How to allow a refused change, said in every refusal.
_HOW = (
    "--allow-recipe-change (finetune), MixedPrecisionCallback(allow_recipe_change=True) or "
    f"{ALLOW_ENV}=1 resumes under it anyway"
)


class RecipeChangeRefused(MixedPrecisionError):
    """A resume under a recipe whose numerics or storage differ from the checkpoint's, refused (the message names
    both and what allows it)."""


def recipe_record(recipe: RecipeSpec) -> dict[str, Any]:
    """What a checkpoint keeps of the recipe it was written under (JSON): the backend and rehearsal are left out, as
    they change how the same numerics run, not what they are."""
    fp8 = None
    if recipe.fp8 is not None and "fp8" in recipe.precisions():
        fp8 = {"scaling": recipe.fp8.scaling, "format": recipe.fp8.format, **recipe.fp8.options()}
    return {
        "name": recipe.name,
        "precision": recipe.precision,
        "phases": list(recipe.precisions()) if recipe.phases else None,
        "fp8": fp8,
        "storage": {k: getattr(recipe.storage, k) for k in ("master", "optimizer_states", "optimizer")},
        "clipping": recipe.clipping.method,
    }


def allowed_by_env() -> bool:
    """Whether :data:`ALLOW_ENV` allows recipe changes at resume (``1``/``true``/``yes``)."""
    return os.environ.get(ALLOW_ENV, "").strip().lower() in ("1", "true", "yes")


@dataclass
class ResumeDecision:
    """What :func:`decide` found: ``notes`` for the run report; ``switched`` when the run continues under other
    numerics (its report then lists both recipes); ``drop_fp8`` / ``drop_clipper`` / ``drop_scaler``: checkpointed
    state the run's recipe has no use for; ``storage``: the (checkpoint's, run's) ``storage.master`` when the resume
    converts the weights and optimizer state (:mod:`hf_mixedprec.storage.convert`)."""

    notes: list[str] = field(default_factory=list)
    switched: bool = False
    drop_fp8: bool = False
    drop_clipper: bool = False
    drop_scaler: bool = False
    storage: tuple[str, str] | None = None
    converted: bool = False  #: set once the checkpoint's weights and optimizer state were converted for ``storage``


def _precision(rec: dict[str, Any]) -> str:
    return "->".join(rec["phases"]) if rec.get("phases") else rec["precision"]


def _describe(rec: dict[str, Any]) -> str:
    return f"{rec['name']!r} ({_precision(rec)})"


def decide(saved: dict[str, Any] | None, now: dict[str, Any], *, checkpoint: str, allow: bool) -> ResumeDecision:
    """The decision for a resume from ``checkpoint`` (its name, for messages) whose record is ``saved`` (None:
    written before records were kept) under the run's record ``now``; raises :class:`RecipeChangeRefused`."""
    out = ResumeDecision()
    if saved is None:
        out.notes.append(
            f"resume: {checkpoint} records no recipe (written by an earlier hf_mixedprec): resumed under recipe "
            f"{now['name']!r} unchecked"
        )
        return out
    out.storage = storage_change(saved, now, checkpoint)
    if out.storage is not None:
        out.switched = True
        out.notes.append(
            f"resume: {checkpoint} was written under storage.master {out.storage[0]}; this run keeps storage.master "
            f"{out.storage[1]}: {TRANSITIONS[out.storage]}, before the first step"
        )
    same_precision = (saved["precision"], saved.get("phases")) == (now["precision"], now.get("phases"))
    step_down = (
        (saved["precision"], now["precision"]) in STEP_DOWN and not saved.get("phases") and not now.get("phases")
    )
    other_fp8 = same_precision and saved.get("fp8") != now.get("fp8")
    other_clip = saved.get("clipping") != now.get("clipping")
    if same_precision and not other_fp8 and not other_clip:
        if saved["name"] != now["name"] and out.storage is None:
            out.notes.append(
                f"resume: {checkpoint} was written under recipe {saved['name']!r}, this run's recipe {now['name']!r} "
                "has the same precision, FP8 numerics, storage and clipping: resumed as one run"
            )
        return out
    changes = []
    if not same_precision:
        changes.append(f"precision {_precision(saved)} -> {_precision(now)}")
    if other_fp8:
        changes.append(f"fp8 {_fp8_text(saved['fp8'])} -> {_fp8_text(now['fp8'])}")
    if other_clip:
        changes.append(f"clipping.method {saved.get('clipping')} -> {now.get('clipping')}")
    what = ", ".join(changes)
    if step_down and not other_clip:
        out.notes.append(
            f"resume: {checkpoint} was written under recipe {_describe(saved)}; this run continues under "
            f"{_describe(now)} ({what}), a precision change taken as a phase change is: the weights and optimizer "
            "state carry over, FP8 scaling state and the FP16 loss scale do not"
        )
    elif allow:
        out.notes.append(
            f"resume: {checkpoint} was written under recipe {_describe(saved)}; this run continues under "
            f"{_describe(now)} ({what}) as allowed by the flag: checkpointed state of the other numerics is dropped"
        )
    else:
        raise RecipeChangeRefused(
            f"resume: {checkpoint} was written under recipe {_describe(saved)}; this run's recipe {_describe(now)} "
            f"changes {what}, which a resume does not do silently (taken without a flag: precision fp8 -> bf16/fp32, "
            f"fp16 -> bf16/fp32, bf16 -> fp32, same FP8 numerics and clipping method); {_HOW}"
        )
    out.switched = True
    out.drop_fp8 = saved.get("fp8") is not None and saved.get("fp8") != now.get("fp8")
    out.drop_clipper = other_clip
    out.drop_scaler = saved["precision"] == "fp16" and now["precision"] != "fp16"
    return out


def storage_change(saved: dict[str, Any] | None, now: dict[str, Any], checkpoint: str) -> tuple[str, str] | None:
    """The (checkpoint's, run's) masters of the storage change a resume from a checkpoint recorded as ``saved``
    converts (:func:`hf_mixedprec.storage.convert.storage_transition`); None for the same storage or no record; any
    other change is refused in one line, whatever the flag says. Asked for each checkpoint a run loads."""
    if saved is None or saved.get("storage") == now["storage"]:
        return None
    pair = storage_transition(saved["storage"], now["storage"])
    if pair is not None:
        return pair
    diff = [
        f"storage.{k} {saved['storage'].get(k)} -> {now['storage'].get(k)}"
        for k in ("master", "optimizer_states", "optimizer")
        if saved["storage"].get(k) != now["storage"].get(k)
    ]
    taken = ", ".join(f"{a} -> {b}" for a, b in TRANSITIONS)
    raise RecipeChangeRefused(
        f"resume: {checkpoint} was written under recipe {_describe(saved)}; this run's recipe {now['name']!r} changes "
        f"{', '.join(diff)}, which a resume cannot convert (converted: storage.master {taken}, with optimizer_states "
        "fp32 or bf16 and storage.optimizer unchanged; or resume with "
        + ", ".join(f"storage.{k} {v}" for k, v in saved["storage"].items())
        + ")"
    )


def storage_conversion(
    saved: dict[str, Any] | None, now: dict[str, Any], folder: str, model: Any, engine: str | None
) -> tuple[tuple[str, str] | None, Callable[[], Any] | None]:
    """What a resume from the checkpoint ``folder`` (recorded as ``saved``) into ``model`` converts: the storage
    change (:func:`storage_change`; None for none) and the reader of the checkpoint's FP32 weights that ``fp32 ->
    bf16_remainder`` splits (None otherwise). Under a sharding ``engine`` (FSDP, DeepSpeed: they load their own sharded
    optimizer states) a change is refused; every trainable weight must be in the checkpoint's model files under its
    own name (:func:`hf_mixedprec.storage.convert.checkpoint_weight_keys`)."""
    from hf_mixedprec.storage.convert import checkpoint_weight_keys, read_weights

    name = os.path.basename(os.path.normpath(folder))
    pair = storage_change(saved, now, name)
    if pair is None:
        return None, None
    if engine is not None:
        raise RecipeChangeRefused(
            f"resume: {name} was written under storage.master {pair[0]}, this run keeps storage.master {pair[1]} "
            f"under {engine}, which loads its own sharded optimizer state: the conversion is made for runs that are "
            f"not sharded (allowed: storage.master {pair[0]} under {engine})"
        )
    keys = checkpoint_weight_keys(folder, model, pair) if model is not None else {}
    return pair, ((lambda: read_weights(folder, keys)) if pair == ("fp32", "bf16_remainder") else None)


def _fp8_text(fp8: dict[str, Any] | None) -> str:
    if fp8 is None:
        return "none"
    return f"{fp8.get('scaling')}/{fp8.get('format')}"


class RecipeHistory:
    """A run's side of the decision: whether it allows a recipe change at resume (:attr:`allow`, from
    :data:`ALLOW_ENV` unless set), the recipes it has trained under (:attr:`entries`: name, precision and the step
    each took over at) and the decision its resume took (:attr:`decision`, None before a resume)."""

    def __init__(self, recipe: RecipeSpec) -> None:
        self.record = recipe_record(recipe)
        self.allow = allowed_by_env()
        self.entries: list[dict[str, Any]] = [
            {"name": recipe.name, "precision": "->".join(recipe.precisions()), "from_step": 1}
        ]
        self.decision: ResumeDecision | None = None

    def check(self, state: dict[str, Any], checkpoint: str, note: Any) -> ResumeDecision:
        """Decide a resume from runtime ``state`` once (the first call's decision stands), each note to ``note``."""
        if self.decision is None:
            got = decide(state.get("recipe"), self.record, checkpoint=checkpoint, allow=self.allow)
            for text in got.notes:
                note(text)
            self.decision = got
        return self.decision

    def converted(self, pair: tuple[str, str] | None) -> None:
        """A load converted the storage change ``pair``: when it is the decided one, the decision says so."""
        if pair is not None and self.decision is not None and self.decision.storage == pair:
            self.decision.converted = True

    def resumed(self, state: dict[str, Any], steps: int) -> None:
        """The entries after a resume at ``steps`` from ``state``: the checkpoint's, and this run's recipe from the
        next step when it switched (in a fresh run's key order: ``trainer_state.json`` comes back with keys sorted)."""
        saved = state.get("recipe")
        entries = state.get("recipes") or (
            [{"name": saved["name"], "precision": saved["precision"], "from_step": 1}] if saved else []
        )
        if self.decision is not None and self.decision.switched:
            entries = [*entries, {**self.entries[0], "from_step": steps + 1}]
        if entries:
            self.entries = [{k: e[k] for k in ("name", "precision", "from_step")} for e in entries]
