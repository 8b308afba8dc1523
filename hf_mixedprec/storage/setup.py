"""Putting a precision plan's storage into effect: parameter dtypes, initial master state, and the optimizer.

:func:`apply_storage` changes each trainable parameter's dtype in place (``param.data``: the same Parameter objects,
so an optimizer that already holds them keeps working), splitting FP32 weights into BF16 + remainder or compensation
when the plan keeps a BF16 master. :func:`storage_optimizer` builds the optimizer a storage choice needs
(hf_mixedprec's :class:`~hf_mixedprec.storage.optim.StorageAdamW`, or torchao's low-bit AdamW), from the
hyperparameters of the AdamW the user or the Trainer would have used; anything else is refused with the fix.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hf_mixedprec.core.errors import StorageRefusal
from hf_mixedprec.core.formats import FORMATS
from hf_mixedprec.recipes.storage_config import LOW_BIT_STATES, StorageConfig
from hf_mixedprec.storage.bits import kahan_store, split_remainder
from hf_mixedprec.storage.lowbit import is_low_bit, keeps_class, low_bit_class
from hf_mixedprec.storage.optim import StorageAdamW, pending_state

__all__ = [
    "StorageRefusal",
    "apply_storage",
    "check_optimizer_family",
    "matches_storage",
    "optimizer_class",
    "optimizer_family",
    "replace_optimizer",
    "replaceable",
    "storage_optimizer",
    "trainer_optimizer",
]


def apply_storage(model: nn.Module, plan: Any) -> list[str]:
    """Make every trainable parameter's dtype the one ``plan`` keeps it in; returns the notes to record (what was
    cast, and the memory it costs or saves). Frozen parameters are never touched."""
    by_name = {p.name: p for p in plan.params}
    seen: set[int] = set()
    up = down = 0
    delta = 0
    pending: list[tuple[nn.Parameter, str, torch.Tensor]] = []
    for name, p in model.named_parameters():
        if id(p) in seen or name not in by_name:
            continue
        seen.add(id(p))
        pp = by_name[name]
        if not pp.trainable or not pp.changes_dtype:
            continue
        target = FORMATS[pp.weight].dtype
        before = p.element_size()
        # FP32 and FP16 values are exact in FP32: the remainder or compensation keeps every bit BF16 drops
        if target == torch.bfloat16 and plan.storage["master"] == "bf16_remainder":
            upper, rem = split_remainder(p.data.float().contiguous())
            p.data = upper
            pending.append((p, "remainder", rem))
        elif target == torch.bfloat16 and plan.storage["master"] == "bf16_kahan":
            weight, comp = kahan_store(p.data.float())
            p.data = weight
            pending.append((p, "compensation", comp))
        else:
            p.data = p.data.to(target)
        if p.grad is not None:
            p.grad = p.grad.to(target)
        delta += p.numel() * (p.element_size() - before)
        if p.element_size() > before:
            up += p.numel()
        else:
            down += p.numel()
    names = {id(p): name for name, p in model.named_parameters()}
    pending_state(pending, model, names)
    notes = []
    master = plan.storage["master"]
    if up:
        notes.append(
            f"storage.master fp32: {up:,} trainable parameters loaded in 16 bits were upcast to FP32 so that updates "
            f"are not rounded away (weights +{delta / 2**20:.1f} MiB, gradients as much again)"
        )
    if down:
        kept = {
            "bf16_remainder": "with their 16-bit remainders (the FP32 master, exactly)",
            "bf16_kahan": "with a BF16 Kahan compensation of what rounding lost",
            "bf16_stochastic": "updated with stochastic rounding",
            "none": "with no master: updates under half a BF16 ulp are lost",
        }.get(master, "")
        notes.append(
            f"storage.master {master}: {down:,} trainable 32-bit (or FP16) parameters are kept in BF16 {kept} "
            f"(weights {delta / 2**20:+.1f} MiB)"
        )
    if master == "none":
        notes.append(
            "storage.master none: trainable weights are stored in low precision without a master copy (explicitly "
            "asked for); the tiny_update detector reports updates that round away"
        )
    return notes


def optimizer_family(cls: type) -> str:
    """``adamw`` (torch Adam/AdamW, StorageAdamW, torchao's AdamW classes), ``sgd``, ``adafactor``, or the class
    name."""
    names = {c.__name__ for c in cls.__mro__}
    if names & {"AdamW", "Adam", "StorageAdamW", "_AdamBase"}:
        return "adamw"
    if "SGD" in names:
        return "sgd"
    if "Adafactor" in names:
        return "adafactor"
    return cls.__name__


def check_optimizer_family(storage: StorageConfig, cls: type, source: str) -> None:
    """Refuse an optimizer whose family contradicts ``storage.optimizer`` (``auto`` accepts any)."""
    if storage.optimizer == "auto":
        return
    found = optimizer_family(cls)
    if found != storage.optimizer:
        raise StorageRefusal(
            f"storage.optimizer is {storage.optimizer!r}, but {source} is {cls.__name__} ({found}) (allowed: an "
            f"optimizer of the {storage.optimizer} family, or storage.optimizer auto)"
        )


def _adam_hparams(source: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """lr, betas, eps, weight_decay from an AdamW's keyword arguments; refuses what StorageAdamW does not do."""
    for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
        if kwargs.get(flag):
            raise StorageRefusal(
                f"{source} sets {flag}=True, which hf_mixedprec's storage optimizer does not implement (allowed: "
                "amsgrad/maximize off; or storage.master fp32 with storage.optimizer_states fp32)"
            )
    out = {k: kwargs[k] for k in ("lr", "betas", "eps", "weight_decay") if k in kwargs}
    if "betas" in out:
        out["betas"] = tuple(float(b) for b in out["betas"])
    return out


def matches_storage(storage: StorageConfig, optimizer: Any) -> bool:
    """Whether ``optimizer`` (an instance) keeps what ``storage`` asks for: the default needs nothing; otherwise a
    StorageAdamW with the same master and state dtype, or the torchao low-bit class with the same rounding."""
    if storage.is_default:
        return True
    cls, kwargs = optimizer_class(storage)
    if not keeps_class(type(optimizer), cls):
        return False
    if isinstance(optimizer, StorageAdamW):
        return optimizer.master == kwargs["master"] and optimizer.state_dtype == kwargs["state_dtype"]
    return bool(getattr(optimizer, "bf16_stochastic_round", False)) == kwargs["bf16_stochastic_round"]


def optimizer_class(storage: StorageConfig, **hparams: Any) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The optimizer class ``storage`` needs and its keyword arguments (AdamW's ``hparams``: lr, betas, eps,
    weight_decay, plus the storage's own)."""
    if storage.optimizer_states in LOW_BIT_STATES:
        try:
            cls = low_bit_class(storage.optimizer_states)  # torchao's, skipping flagged steps on the device
        except ImportError as exc:  # pragma: no cover - torchao is a dependency of the test extra
            raise StorageRefusal(
                f"storage.optimizer_states {storage.optimizer_states} needs torchao (pip install torchao)"
            ) from exc
        return cls, {**hparams, "bf16_stochastic_round": storage.master == "bf16_stochastic"}
    state_dtype = torch.bfloat16 if storage.optimizer_states == "bf16" else torch.float32
    return StorageAdamW, {**hparams, "master": storage.master, "state_dtype": state_dtype, "seed": storage.seed or 0}


def storage_optimizer(storage: StorageConfig, params: Any, **hparams: Any) -> torch.optim.Optimizer:
    """The optimizer ``storage`` needs over ``params`` (a list of tensors or param groups) with AdamW's
    ``hparams`` (lr, betas, eps, weight_decay)."""
    cls, kwargs = optimizer_class(storage, **hparams)
    return cls(params, **kwargs)


def trainer_optimizer(storage: StorageConfig, cls: type, kwargs: dict[str, Any]) -> tuple[type, dict[str, Any]]:
    """For ``Trainer.optimizer_cls_and_kwargs``: the storage optimizer in place of the AdamW Trainer chose
    (``Trainer.get_optimizer_cls_and_kwargs``), with the same hyperparameters."""
    if not (isinstance(cls, type) and optimizer_family(cls) == "adamw"):
        raise StorageRefusal(
            f"storage.master {storage.master} / optimizer_states {storage.optimizer_states} needs AdamW, but the "
            f"Trainer's optimizer is {getattr(cls, '__name__', cls)} (allowed: TrainingArguments.optim adamw_torch or "
            "adamw_torch_fused; or storage.master fp32 with optimizer_states fp32)"
        )
    hp = _adam_hparams("TrainingArguments.optim", kwargs)
    if issubclass(cls, torch.optim.Adam) and not issubclass(cls, torch.optim.AdamW) and hp.get("weight_decay"):
        raise StorageRefusal(
            f"storage.master {storage.master}: TrainingArguments.optim {cls.__name__} with weight_decay is L2 decay, "
            "which StorageAdamW does not implement (allowed: adamw_torch or adamw_torch_fused)"
        )
    return optimizer_class(storage, **hp)


def replaceable(storage: StorageConfig, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    """The AdamW hyperparameters :func:`replace_optimizer` builds the storage optimizer with (None: ``optimizer``
    stays as it is); refuses, before anything changes, an optimizer that cannot be replaced."""
    check_optimizer_family(storage, type(optimizer), "the optimizer passed to prepare()")
    if storage.is_default or isinstance(optimizer, StorageAdamW) or is_low_bit(optimizer):  # ours, or torchao's own
        return None
    if not isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam)):
        raise StorageRefusal(
            f"storage.master {storage.master} / optimizer_states {storage.optimizer_states} needs AdamW, but the "
            f"optimizer passed to prepare() is {type(optimizer).__name__} (allowed: torch.optim.AdamW; or "
            "storage.master fp32 with optimizer_states fp32)"
        )
    if any(optimizer.state.values()):
        raise StorageRefusal(
            "the optimizer passed to prepare() has already stepped; hf_mixedprec builds the storage optimizer from "
            "it, which must happen before the first step"
        )
    hp = _adam_hparams(type(optimizer).__name__, dict(optimizer.defaults))
    decoupled = isinstance(optimizer, torch.optim.AdamW) or optimizer.defaults.get("decoupled_weight_decay", False)
    for i, group in enumerate(optimizer.param_groups):
        _adam_hparams(f"{type(optimizer).__name__} param_groups[{i}]", group)
        if group.get("weight_decay") and not (decoupled or group.get("decoupled_weight_decay", False)):
            raise StorageRefusal(
                f"storage.master {storage.master}: torch.optim.Adam with weight_decay (param_groups[{i}]) is L2 decay, "
                "which StorageAdamW does not implement (allowed: torch.optim.AdamW, or Adam with "
                "decoupled_weight_decay=True)"
            )
    return hp


def replace_optimizer(storage: StorageConfig, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The storage optimizer over ``optimizer``'s parameter groups, with its hyperparameters (an own Accelerate
    loop hands its AdamW to ``prepare``); see :func:`replaceable` for what is refused."""
    hp = replaceable(storage, optimizer)
    if hp is None:
        return optimizer
    return storage_optimizer(storage, optimizer.param_groups, **hp)  # each group's own lr, weight decay, ...
