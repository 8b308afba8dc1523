"""Another ``storage.master`` at resume: the checkpoint's weights and optimizer state converted into the form the
run's storage keeps them in, before its first step.

Taken (:data:`TRANSITIONS`; ``storage.optimizer_states`` and ``storage.optimizer`` unchanged, ``fp32`` or ``bf16``
states):

* ``bf16_remainder -> fp32``, exact: each BF16 weight and its 16-bit remainder give back the FP32 master bit for bit
  (:func:`~hf_mixedprec.storage.bits.combine_remainder`), which becomes the FP32 parameter;
* ``fp32 -> bf16_remainder``, exact: each FP32 weight the checkpoint holds is split into its BF16 weight and
  remainder (:func:`~hf_mixedprec.storage.bits.split_remainder`);
* ``bf16_kahan -> fp32``: the BF16 weight plus its Kahan compensation, the value the next update would have started
  from (what rounding lost before the compensation is not kept anywhere);
* ``bf16_stochastic -> fp32``: the BF16 weights as stored (stochastic rounding keeps nothing more).

Every other pair is refused in the recipe's words. The optimizer state is rewritten in the format of the run's own
optimizer class (torch's ``AdamW`` or :class:`~hf_mixedprec.storage.optim.StorageAdamW`: same moments and step count,
each group's hyperparameters from the checkpoint and its class's own flags from the run's optimizer), so a state is
never loaded into an optimizer of another class as it is.

A parameter that never stepped has no state in the checkpoint: its remainder (``fp32 -> bf16_remainder``) is handed
to the optimizer for its first step; its BF16 weight is its whole value the other way (its remainder was never
saved; zero when the model was loaded in BF16, as transformers loads a ``bfloat16`` ``config.json``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from hf_mixedprec.core.errors import StorageRefusal
from hf_mixedprec.core.model_dir import safetensors_files
from hf_mixedprec.storage.bits import combine_remainder, split_remainder
from hf_mixedprec.storage.optim import StorageAdamW, _take_pending, pending_state, saved_storage

__all__ = [
    "TRANSITIONS",
    "checkpoint_weight_keys",
    "convert_next_load",
    "convert_optimizer_state",
    "convert_without_state",
    "read_weights",
    "storage_transition",
]

#: (checkpoint's master, run's master) -> what the conversion keeps, said in the run's notes.
TRANSITIONS: dict[tuple[str, str], str] = {
    ("bf16_remainder", "fp32"): "the FP32 masters rebuilt bit for bit from the BF16 weights and their remainders",
    ("fp32", "bf16_remainder"): "the FP32 weights split into BF16 weights and remainders, bit for bit",
    ("bf16_kahan", "fp32"): "the FP32 masters taken as the BF16 weights plus their Kahan compensation",
    ("bf16_stochastic", "fp32"): "the FP32 masters taken as the stochastically rounded BF16 weights",
}
#: The optimizer states a conversion carries over unchanged (low-bit states belong to torchao's classes).
_STATES = ("fp32", "bf16")
#: The keys of a parameter group that belong to the run's optimizer class, not to the checkpoint's.
_OWN_FLAGS = (
    "amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused", "decoupled_weight_decay",
    "storage_master", "storage_states",  # StorageAdamW's: what this run keeps, not what the checkpoint kept
)  # fmt: skip


def storage_transition(saved: Mapping[str, Any], now: Mapping[str, Any]) -> tuple[str, str] | None:
    """The ``(from, to)`` masters of a storage change a resume converts, or None (refused): ``saved`` and ``now``
    are the ``storage`` of two recipe records (master, optimizer_states, optimizer)."""
    pair = (saved.get("master"), now.get("master"))
    same_rest = all(saved.get(k) == now.get(k) for k in ("optimizer_states", "optimizer"))
    if pair in TRANSITIONS and same_rest and now.get("optimizer_states") in _STATES:
        return pair  # type: ignore[return-value]
    return None


def checkpoint_weight_keys(
    folder: str | os.PathLike[str], model: torch.nn.Module, pair: tuple[str, str]
) -> dict[int, str]:
    """For each trainable parameter of ``model`` (by ``id``): the key the safetensors model files of ``folder`` hold
    it under (any of a tied parameter's names). Refuses the change ``pair`` for a checkpoint that lacks one (no model
    file, an adapter-only save, or weights transformers converts at load, such as MoE experts saved one tensor per
    expert): the parameter would not hold the checkpoint's weight when the conversion reads it."""
    from safetensors import safe_open

    files = safetensors_files(folder)
    stored: set[str] = set()
    for path in files:
        with safe_open(path, framework="pt") as f:
            stored.update(f.keys())
    found: dict[int, str] = {}
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.requires_grad:
            names.setdefault(id(p), []).append(name)
    for pid, aliases in names.items():
        key = next((n for n in aliases if n in stored), None)
        if key is None:
            where = (
                f"the model files of {os.fspath(folder)}" if files else f"{os.fspath(folder)} (no model.safetensors)"
            )
            raise StorageRefusal(
                f"storage.master {pair[0]} -> {pair[1]} at resume needs every trainable weight under its own name in "
                f"the checkpoint's model files, and {aliases[0]} is not in {where} (a weight transformers converts at "
                f"load, e.g. MoE experts, or an adapter-only save) (allowed: storage.master {pair[0]}, the "
                "checkpoint's)"
            )
        found[pid] = key
    return found


def read_weights(folder: str | os.PathLike[str], keys: Mapping[int, str]) -> dict[int, torch.Tensor]:
    """The tensors :func:`checkpoint_weight_keys` found, as float32, by parameter ``id``."""
    from safetensors import safe_open

    wanted = set(keys.values())
    tensors: dict[str, torch.Tensor] = {}
    for path in safetensors_files(folder):
        with safe_open(path, framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in wanted.intersection(f.keys())})
    return {pid: tensors[key].float() for pid, key in keys.items()}


def convert_optimizer_state(
    saved: Mapping[str, Any],
    optimizer: torch.optim.Optimizer,
    pair: tuple[str, str],
    fp32_weights: Mapping[int, torch.Tensor] | None = None,
    notes: list[str] | None = None,
) -> dict[str, Any]:
    """``saved`` (a checkpoint's optimizer ``state_dict``, written under master ``pair[0]``) in the format of
    ``optimizer`` (built for master ``pair[1]``), with the parameters' values set as the module docs say. The
    parameters must hold the checkpoint's weights already (the Trainer and Accelerate load them first);
    ``fp32_weights`` (by parameter ``id``) are the checkpoint's FP32 values, needed for ``fp32 -> bf16_remainder``;
    what could not be kept (a remainder of a parameter a ``modules:`` rule keeps in BF16) is said in ``notes``."""
    source, target = pair
    if pair not in TRANSITIONS:
        taken = ", ".join(f"{a} -> {b}" for a, b in TRANSITIONS)
        raise StorageRefusal(f"storage.master {source} -> {target} is not converted at resume (allowed: {taken})")
    groups = list(saved["param_groups"])
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if any(isinstance(k, str) for g in groups for k in g["params"]) or any(isinstance(p, DTensor) for p in params):
        # Distributed Checkpoint names the parameters and holds shards: the conversion below reads whole tensors
        # by index, and would find no state at all
        raise StorageRefusal(
            f"storage.master {source} -> {target} is not converted at resume for a sharded (FSDP2) checkpoint "
            f"(allowed: storage.master {source}, the checkpoint's)"
        )
    sizes, own = [len(g["params"]) for g in groups], [len(g["params"]) for g in optimizer.param_groups]
    if sizes != own:
        raise StorageRefusal(
            f"the optimizer checkpoint's parameter groups hold {sizes} parameters, this run's optimizer {own} (allowed: "
            "the same model and trainable parameters as the run that wrote it)"
        )
    state: dict[int, dict[str, Any]] = {}
    old_state = saved.get("state", {})
    pending: list[tuple[torch.nn.Parameter, str, torch.Tensor]] = []
    dropped = 0
    with torch.no_grad():
        for index, p in enumerate(params):
            old = old_state.get(index, {})
            entry = {k: v for k, v in old.items() if k not in ("remainder", "compensation")}
            if target == "fp32" and p.dtype == torch.float32:
                weight = p.detach().to(torch.bfloat16)  # the checkpoint's BF16 weight, loaded exactly into FP32
                if torch.is_tensor(old.get("remainder")):
                    p.copy_(combine_remainder(weight, old["remainder"].to(p.device)))
                elif torch.is_tensor(old.get("compensation")):
                    p.copy_(weight.float() + old["compensation"].to(p.device).float())
            elif target == "fp32" and any(torch.is_tensor(old.get(k)) for k in ("remainder", "compensation")):
                dropped += p.numel()  # kept in BF16 by a rule of this run: no FP32 master to take the bits
            elif target == "bf16_remainder" and p.dtype == torch.bfloat16:
                if fp32_weights is None or id(p) not in fp32_weights:
                    raise StorageRefusal(
                        f"storage.master fp32 -> bf16_remainder: the FP32 value of the trainable parameter {index} "
                        f"({tuple(p.shape)}) was not read from the checkpoint (allowed: storage.master fp32)"
                    )
                upper, rem = split_remainder(fp32_weights[id(p)].to(p.device).contiguous())
                p.copy_(upper)
                _take_pending(p, "remainder")  # the split made at setup, from the weights before the checkpoint's
                if entry:
                    entry["remainder"] = rem
                else:  # never stepped: the optimizer takes it at the parameter's first step
                    pending.append((p, "remainder", rem))
            if entry and "step" in entry:
                entry["step"] = torch.as_tensor(entry["step"], dtype=torch.float32)
            if entry:
                state[index] = entry
    pending_state(pending)
    if dropped and notes is not None:
        notes.append(
            f"resume: {dropped:,} trainable parameters this run keeps in BF16 (modules: rules) have no FP32 master to "
            f"take their storage.master {source} bits: they continue from their BF16 weights"
        )
    out: dict[str, Any] = {
        "state": state,
        "param_groups": [_group(old, new) for old, new in zip(groups, optimizer.param_groups, strict=True)],
    }
    if isinstance(optimizer, StorageAdamW):
        out["hf_mixedprec"] = {"master": target, "state_dtype": str(optimizer.state_dtype).removeprefix("torch.")}
    return out


def _group(saved: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, Any]:
    """A parameter group for the run's optimizer: the checkpoint's hyperparameters (lr, betas, ...) and the run's
    class flags (torch's ``AdamW.__setstate__`` would default a missing ``decoupled_weight_decay`` to L2 decay)."""
    out = {k: v for k, v in current.items() if k != "params"}
    out.update({k: v for k, v in saved.items() if k not in _OWN_FLAGS})
    return out


def convert_without_state(
    optimizer: torch.optim.Optimizer, pair: tuple[str, str], fp32_weights: Mapping[int, torch.Tensor] | None = None
) -> None:
    """The weights of a checkpoint that holds no optimizer state converted for the storage change ``pair`` (the
    optimizer's moments start at zero, as Trainer's do then); remainders made go to the optimizer's first step."""
    empty = {"state": {}, "param_groups": [dict(g) for g in optimizer.param_groups]}
    convert_optimizer_state(empty, optimizer, pair, fp32_weights)


def convert_next_load(
    optimizer: torch.optim.Optimizer,
    pair: tuple[str, str] | None,
    fp32_weights: Callable[[], Mapping[int, torch.Tensor]] | None = None,
    *,
    cache: dict[str, Any] | None = None,
    notes: list[str] | None = None,
) -> Callable[[], bool]:
    """Make ``optimizer``'s next ``load_state_dict`` (Trainer and Accelerate call it with a checkpoint's state)
    convert that state for the storage change ``pair`` (:func:`convert_optimizer_state`, ``fp32_weights`` read then),
    or, without one, refuse a state :class:`StorageAdamW` wrote when ``optimizer`` is of another class (torch's
    ``Optimizer.load_state_dict`` would take it with its remainders and the checkpoint's group flags). Once: the
    wrapper removes itself. ``cache``: the converted state is kept there, and a later load with the same ``cache``
    (Trainer's retry under ``auto_find_batch_size``, after the parameters were converted) loads it as it is. Returns
    ``finish``: removes the wrapper if no load came, and says whether one did."""
    before = optimizer.__dict__.get("load_state_dict")
    own = optimizer.load_state_dict
    fired: list[bool] = []

    def restore() -> None:
        if before is None:
            optimizer.__dict__.pop("load_state_dict", None)
        else:
            optimizer.load_state_dict = before  # type: ignore[method-assign]

    def load_state_dict(state_dict: dict[str, Any]) -> None:
        restore()
        fired.append(True)
        if pair is not None:
            if cache is not None and "state" in cache:
                own(cache["state"])
                return
            weights = fp32_weights() if fp32_weights is not None else None
            converted = convert_optimizer_state(state_dict, optimizer, pair, weights, notes)
            if cache is not None:
                cache["state"] = converted
            own(converted)
            return
        ours = saved_storage(state_dict)
        if ours is not None and not isinstance(optimizer, StorageAdamW):
            raise StorageRefusal(
                f"the optimizer checkpoint was written by hf_mixedprec's StorageAdamW (storage.master "
                f"{ours.get('master')}, optimizer_states {ours.get('state_dtype')}), and this run's optimizer is "
                f"{type(optimizer).__name__} (allowed: the recipe the checkpoint was trained with)"
            )
        own(state_dict)

    optimizer.load_state_dict = load_state_dict  # type: ignore[method-assign]

    def finish() -> bool:
        if not fired:
            restore()
        return bool(fired)

    return finish
