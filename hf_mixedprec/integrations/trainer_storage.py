"""The Trainer callback's ``storage:`` setup: the model's parameters in the dtypes the recipe keeps them in, and the
optimizer that storage needs, built by the Trainer (or, under DeepSpeed, the engine's config checked to say the same).

Split from :mod:`hf_mixedprec.integrations.trainer` (which calls these from its setup) to keep each module short.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from transformers import Trainer

from hf_mixedprec.core._private import wrap_load_optimizer
from hf_mixedprec.recipes.module_rules import assign_rules
from hf_mixedprec.recipes.schema import RecipeSpec
from hf_mixedprec.training.recipe_change import RecipeChangeRefused
from hf_mixedprec.training.runtime import MixedPrecisionRuntime

__all__ = ["check_deepspeed_storage", "install_storage", "storage_at_resume", "storage_converted"]


def install_storage(trainer: Trainer, rt: MixedPrecisionRuntime, late: bool) -> list[str]:
    """The model's parameters in the dtypes the recipe's ``storage:`` and ``modules:`` keep them in, the optimizer
    it needs and the rules' compute regions (the runtime records its own notes: none returned)."""
    from hf_mixedprec.storage.setup import check_optimizer_family, optimizer_family

    cls, source = _trainer_optimizer_class(trainer)

    def optimizer_first(plan: Any) -> None:  # refused before any parameter changes dtype
        if plan.optimizer != "unchanged":
            _install_storage_optimizer(trainer, rt, late)
        elif cls is not None:
            check_optimizer_family(rt.recipe.storage, cls, source)

    family = optimizer_family(cls) if cls is not None else None
    rt.prepare_storage(trainer.model, check=optimizer_first, family=family)
    return []


def _trainer_optimizer_class(trainer: Trainer) -> tuple[type | None, str]:
    """The class of the optimizer the Trainer has or will build, and where it comes from (for messages); None when
    unknown (an ``optim`` needing a package that is missing: the Trainer says so when it builds it)."""
    current = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    if current is not None:
        return type(current), "the Trainer's optimizer"
    if trainer.optimizer_cls_and_kwargs is not None:
        return trainer.optimizer_cls_and_kwargs[0], "Trainer(optimizer_cls_and_kwargs=...)"
    try:
        cls, _ = trainer.get_optimizer_cls_and_kwargs(trainer.args, trainer.model)
    except Exception:
        return None, ""
    optim = getattr(trainer.args.optim, "value", trainer.args.optim)
    return (cls if isinstance(cls, type) else None), f"TrainingArguments.optim {optim!r}"


def check_deepspeed_storage(trainer: Trainer, recipe: RecipeSpec) -> list[str]:
    """Under DeepSpeed the engine keeps the master and optimizer states: its config must say what ``storage:`` says
    (``deepspeed_config(recipe)`` writes it so; a config of the user's is checked here, never silently overruled).
    ``modules:`` rules that need compute regions or weight dtypes are refused (required) or left out (returned
    notes): the engine keeps every weight in its own dtype."""
    from pydantic_core import PydanticCustomError

    from hf_mixedprec.integrations.deepspeed import deepspeed_storage_keys, engine_config
    from hf_mixedprec.recipes.storage_config import storage_rules
    from hf_mixedprec.storage import StorageRefusal

    config = engine_config(trainer.accelerator.state)
    stage = (config.get("zero_optimization") or {}).get("stage")  # None when absent: named as unset below
    try:
        storage_rules(recipe.storage, recipe.precision, "deepspeed", stage if isinstance(stage, int) else None)
    except PydanticCustomError as exc:  # the rule's own message, with its key
        raise StorageRefusal(f"recipe {recipe.name!r} under DeepSpeed: {exc.message()}") from None
    bf16 = config.get("bf16") or {}
    expected = deepspeed_storage_keys(recipe) or {"bf16_master_weights_and_grads": False}
    for key, value in expected.items():
        if bool(bf16.get(key, False)) != value:
            raise StorageRefusal(
                f"storage.master {recipe.storage.master} / optimizer_states {recipe.storage.optimizer_states}: the "
                f"DeepSpeed config has bf16.{key}={bf16.get(key, False)!r} (allowed: {value!r}; build the config with "
                "hf_mixedprec.integrations.deepspeed.deepspeed_config(recipe))"
            )
    return list(assign_rules(trainer.model, recipe.modules, recipe.precision, "deepspeed").notes)


def _install_storage_optimizer(trainer: Trainer, rt: MixedPrecisionRuntime, late: bool) -> None:
    """Make the Trainer build the optimizer the recipe's ``storage:`` needs (hf_mixedprec's StorageAdamW or torchao's
    low-bit AdamW) with the hyperparameters of the AdamW it would have built (``Trainer.get_optimizer_cls_and_kwargs``);
    an optimizer the user chose, or one already built, is refused with the fix."""
    from hf_mixedprec.storage import StorageRefusal, trainer_optimizer
    from hf_mixedprec.storage.lowbit import keeps_class
    from hf_mixedprec.storage.setup import matches_storage, optimizer_class

    storage = rt.recipe.storage
    what = f"storage.master {storage.master} with optimizer_states {storage.optimizer_states}"
    current = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    wanted = rt.plan.optimizer if rt.plan is not None else "?"
    if current is not None:
        if matches_storage(storage, current):  # e.g. optimizers=(storage_optimizer(recipe.storage, ...), None)
            return
        where = "built when train() began (the callback was added after construction)" if late else "passed in"
        raise StorageRefusal(
            f"{what} needs hf_mixedprec's optimizer ({wanted}), but the Trainer's "
            f"optimizer ({type(current).__name__}) was {where}; pass recipe.callbacks() to Trainer(callbacks=...) or "
            "attach(trainer, recipe) before train(), and no optimizers=(...); or build it with "
            "hf_mixedprec.storage.storage_optimizer(recipe.storage, params, lr=...)"
        )
    if trainer.optimizer_cls_and_kwargs is not None:
        cls, kwargs = trainer.optimizer_cls_and_kwargs
        name = getattr(cls, "__name__", "?")
        own_cls, own = optimizer_class(storage)
        keys = ("master", "state_dtype", "bf16_stochastic_round")
        # ours, or torchao's own low-bit class (accepted as it is: it keeps GradScaler's host check of the skip flag)
        if keeps_class(cls, own_cls) and all(kwargs.get(k) == own[k] for k in keys if k in own):  # said, not defaulted
            return
        raise StorageRefusal(
            f"{what} needs {wanted}, but Trainer(optimizer_cls_and_kwargs=({name}, ...)) chooses another or other "
            "storage arguments; remove optimizer_cls_and_kwargs, or use storage.master fp32 with optimizer_states fp32"
        )
    cls, kwargs = trainer.get_optimizer_cls_and_kwargs(trainer.args, trainer.model)
    trainer.optimizer_cls_and_kwargs = trainer_optimizer(storage, cls, kwargs)
    rt.note(
        f"{what}: the Trainer's optimizer {getattr(cls, '__name__', cls)} (optim="
        f"{getattr(trainer.args.optim, 'value', trainer.args.optim)!r}) is built as "
        f"{wanted} with the same lr, betas, eps and weight_decay"
    )


#: The Trainer attribute holding what the resume in progress converts (set before each resume's load).
_RESUME = "_hf_mixedprec_storage_resume"


def storage_at_resume(trainer: Trainer, rt: MixedPrecisionRuntime, folder: str, saved: dict[str, Any] | None) -> None:
    """Before Trainer loads the checkpoint ``folder`` (recorded as ``saved``, None without a record): when it loads
    the optimizer state (after the weights), that state is converted for the checkpoint's storage change
    (:func:`hf_mixedprec.training.recipe_change.storage_conversion`), or checked to be of the run's optimizer class.
    Decided for each checkpoint (a later resume from the run's own checkpoint converts nothing); every load of this
    resume converts (Trainer's retry under ``auto_find_batch_size`` loads again)."""
    from hf_mixedprec.training.recipe_change import storage_conversion

    engine = "DeepSpeed" if getattr(trainer, "is_deepspeed_enabled", False) else None
    engine = engine or ("FSDP" if getattr(trainer, "is_fsdp_enabled", False) else None)
    pair, weights = storage_conversion(saved, rt.history.record, folder, trainer.model, engine)
    if engine is not None:
        return
    if _RESUME not in trainer.__dict__:
        wrap_load_optimizer(trainer, lambda load: _converting_load(trainer, rt, load))
    setattr(trainer, _RESUME, {"folder": os.fspath(folder), "pair": pair, "weights": weights, "cache": {}})


def _converting_load(trainer: Trainer, rt: MixedPrecisionRuntime, load: Any) -> Any:
    """``Trainer._load_optimizer_and_scheduler`` converting (or checking) what it loads, as :data:`_RESUME` says."""
    from hf_mixedprec.storage.convert import convert_next_load, convert_without_state

    def load_optimizer_and_scheduler(checkpoint: Any) -> None:
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        info = getattr(trainer, _RESUME, None) or {}
        if checkpoint is None or optimizer is None:
            return load(checkpoint)
        ours = info.get("folder") == os.fspath(checkpoint)
        pair, weights = (info["pair"], info["weights"]) if ours else (None, None)
        notes: list[str] = []
        finish = convert_next_load(optimizer, pair, weights, cache=info.get("cache"), notes=notes)
        try:
            load(checkpoint)
        finally:
            loaded = finish()
        for text in notes:
            rt.note(text)
        if pair is None:
            return None
        if not loaded and "state" not in info["cache"]:
            # Trainer loads the optimizer state only when optimizer.pt and scheduler.pt are both there
            convert_without_state(optimizer, pair, weights() if weights is not None else None)
            info["cache"]["state"] = None
            rt.note(
                f"resume: Trainer loaded no optimizer state from {Path(checkpoint).name} (it needs optimizer.pt and "
                f"scheduler.pt): the storage.master {pair[0]} -> {pair[1]} conversion took the weights alone (a "
                "checkpoint's remainders or compensation are in its optimizer state) and the moments start at zero"
            )
        rt.history.converted(pair)
        return None

    return load_optimizer_and_scheduler


def storage_converted(rt: MixedPrecisionRuntime) -> None:
    """At ``on_train_begin``: refuse a resume whose storage change was decided after Trainer had loaded the
    checkpoint (a callback added with ``add_callback``, set up when ``train()`` began): its state went in as it was."""
    decision = rt.history.decision
    if decision is not None and decision.storage is not None and not decision.converted:
        source, target = decision.storage
        raise RecipeChangeRefused(
            f"resume: the checkpoint was written under storage.master {source}, this run keeps storage.master "
            f"{target}, and Trainer loaded it before hf_mixedprec's callback was set up (added with add_callback): "
            "pass recipe.callbacks() to Trainer(callbacks=...) or attach(trainer, recipe) before train() to convert "
            f"it (or resume with storage.master {source})"
        )
