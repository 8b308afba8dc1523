"""torchao's low-bit AdamW (8-bit, 4-bit or FP8 optimizer states) that skips a flagged step on the device.

torchao's ``AdamW8bit`` / ``AdamW4bit`` / ``AdamWFp8`` (``torchao/optim/adam.py``) take no found-inf flag, so
``GradScaler.step`` decides on the host whether to call ``step()`` at all (``torch/amp/grad_scaler.py``,
``_maybe_opt_step``: ``found_inf.item()``): a host-device sync every optimizer step, also under the scale-1 guard of a
BF16 or FP8 run. The classes here are torchao's with one change: like torch's fused AdamW they declare
``_step_supports_amp_scaling`` and read the scaler's ``found_inf`` (and ``grad_scale``, dividing the gradient by it)
inside ``step()``. Each parameter is updated by torchao's own per-parameter function (``single_param_adam``, compiled
as torchao compiles it), on its gradient with a flagged step's values replaced by zeros (so no NaN reaches the
states); where the step is flagged, the weight and its states are then put back from a copy of that one
parameter's taken before its update (``torch.where`` on the device), and the step count is not advanced. An
unflagged step is torchao's step; a flagged one changes no weight and no state. Without a flag (no scaler)
``step()`` is torchao's own.

Two differences from torchao's own class: the step count lives on the parameter's device (torchao keeps it on the
host; a checkpoint's is moved at the first step run with a flag), so on a GPU the bias corrections are computed there,
as torch's capturable AdamW computes them, which may differ from torchao's in the last bit; and with
``bf16_stochastic_round`` a flagged step still draws its random numbers from torch's generator (undoing that would
need the flag on the host), so the rounding of later steps draws other numbers than a run without that step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from hf_mixedprec.core._private import no_recompile_limit, torchao_new_state
from hf_mixedprec.storage.optim import _local

__all__ = ["LOW_BIT_CLASSES", "is_low_bit", "keeps_class", "low_bit_class"]


def _parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s values that an update writes: a DTensor's local shard, a tensor subclass's
    inner tensors (torchao's ``OptimState8bit``: codes and scale; its ``qmap``, the constant code book, left out),
    else ``t``."""
    t = _local(t)
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [part for name in names if name != "qmap" for part in _parts(getattr(t, name))]
    return [t]


def _without_flagged(grad: torch.Tensor, flag: torch.Tensor | None, scale: torch.Tensor | None) -> torch.Tensor:
    """The gradient the update takes: divided by the loss scale (when the scaler did not unscale it), zeros where
    the step is flagged. A new tensor: the parameter's own gradient is left as it is."""
    local = _local(grad)
    # unscaled in FP32, as torch's fused AdamW unscales (torchao's update takes the FP32 values as they are)
    if scale is not None:
        local = local.float() / scale.to(local.device, torch.float32)
    if flag is not None:
        local = torch.where(flag, torch.zeros((), dtype=local.dtype, device=local.device), local)
    if isinstance(grad, DTensor):
        return DTensor.from_local(
            local, grad.device_mesh, grad.placements, run_check=False, shape=grad.shape, stride=grad.stride()
        )
    return local


class _SkipsOnDevice:
    """Mixed in before a torchao low-bit AdamW class (see the module docs)."""

    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self: Any, closure: Any = None) -> Any:
        found: torch.Tensor | None = getattr(self, "found_inf", None)
        scale: torch.Tensor | None = getattr(self, "grad_scale", None)
        if found is None and scale is None:
            # torchao's own step without the step-hook wrapper torch puts on every optimizer class it builds
            # (torch/optim/optimizer.py, _patch_step_function): this class's wrapper has run the hooks already
            own = self.torchao_class.step
            return (own.__wrapped__ if getattr(own, "hooked", False) else own)(self, closure)
        from torchao.optim.adam import single_param_adam

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        update = torch.compile(single_param_adam, fullgraph=True, dynamic=False)  # as torchao's step compiles it
        # the skip flag as a bool on each device the parameters are on (GradScaler hands the sum of all devices' flags)
        flags: dict[torch.device, torch.Tensor] = {}
        with no_recompile_limit():
            for group in self.param_groups:
                if not isinstance(group["lr"], torch.Tensor):
                    raise RuntimeError(
                        "lr was changed to a non-Tensor object; torchao's low-bit AdamW keeps it a tensor "
                        "(set it with optimizer.param_groups[i]['lr'].fill_(new_lr))"
                    )
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if p.grad.is_sparse:
                        raise RuntimeError("Sparse gradient is not supported")
                    device = _local(p).device
                    state = self._state_of(p, group, device)
                    flag = None
                    if found is not None:
                        if device not in flags:
                            flags[device] = found.to(device) > 0
                        flag = flags[device]
                    held = [p, *(state[k] for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if k in state)]
                    tensors = [part for t in held for part in _parts(t)]
                    kept = [t.clone() for t in tensors] if flag is not None else []
                    step = state["step"]
                    step += 1
                    update(
                        p.detach(),
                        _without_flagged(p.grad, flag, scale),
                        step,
                        state["exp_avg"],
                        state["exp_avg_sq"],
                        state.get("max_exp_avg_sq"),
                        group["lr"],
                        group["betas"][0],
                        group["betas"][1],
                        group["weight_decay"],
                        group["eps"],
                        self.is_adamw,
                        self.bf16_stochastic_round and p.dtype is torch.bfloat16,
                    )
                    if flag is not None:
                        for now, before in zip(tensors, kept):
                            now.copy_(torch.where(flag, before, now))
                        step.sub_(flag.to(step.dtype))
        return loss

    def _state_of(self: Any, p: torch.Tensor, group: dict[str, Any], device: torch.device) -> dict[str, Any]:
        """``p``'s state, made as torchao makes it on a first step, its step count on ``p``'s ``device`` (a flagged
        step takes it back there, without a host read; torchao keeps it on the host)."""
        state = self.state[p]
        if not state:
            state["exp_avg"] = torchao_new_state(self, p, True)
            state["exp_avg_sq"] = torchao_new_state(self, p, False)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torchao_new_state(self, p, False)
        step = state.get("step")
        if step is None or step.device != device:  # a first step, or a state loaded on the host: once
            state["step"] = torch.zeros((), device=device) if step is None else step.to(device, torch.float32)
        return state


def _make(base: type) -> type:
    return type(
        base.__name__,
        (_SkipsOnDevice, base),
        {
            "__module__": __name__,
            "__qualname__": base.__name__,
            "torchao_class": base,
            "__doc__": f"torchao's ``{base.__name__}`` that skips a flagged step on the device (see "
            ":mod:`hf_mixedprec.storage.lowbit`).",
        },
    )


LOW_BIT_CLASSES: dict[str, type[torch.optim.Optimizer]] = {}


def is_low_bit(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a torchao low-bit AdamW: torchao's own class, or one of the classes here."""
    cls = type(optimizer)
    return cls.__module__.startswith("torchao.") or hasattr(cls, "torchao_class")


def keeps_class(cls: Any, wanted: type) -> bool:
    """Whether an optimizer of class ``cls`` is what a storage that needs ``wanted`` asks for: ``wanted`` itself, or
    for one of the classes here torchao's own (the same storage; it skips flagged steps with a host read)."""
    return cls is wanted or cls is getattr(wanted, "torchao_class", None)


def low_bit_class(states: str) -> type[torch.optim.Optimizer]:
    """The low-bit AdamW for ``storage.optimizer_states`` ``states`` (8bit, 4bit, fp8): torchao's class, skipping
    flagged steps on the device. Made on first use (torchao is imported then)."""
    if not LOW_BIT_CLASSES:
        import torchao.optim as ao

        for key, base in (("8bit", ao.AdamW8bit), ("4bit", ao.AdamW4bit), ("fp8", ao.AdamWFp8)):
            LOW_BIT_CLASSES[key] = _make(base)
    return LOW_BIT_CLASSES[states]
