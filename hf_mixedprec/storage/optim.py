"""``StorageAdamW``: AdamW whose master weights and moments are stored as a recipe's ``storage:`` section says.

The update is AdamW's (Loshchilov & Hutter 2019; torch ``AdamW`` semantics: decoupled weight decay, bias-corrected
moments, ``eps`` outside the square root), computed in FP32 one parameter at a time: the extra memory during a step
is a few FP32 temporaries (gradient, moments, master, new value) of the largest parameter, not of the model. What is
stored between steps is per parameter dtype:

* FP32 parameters are their own master (``master: fp32``);
* BF16 parameters get the master their recipe chose: ``bf16_remainder`` (the BF16 weight plus the 16 bits BF16
  drops, an int16 per element: the FP32 master exactly, see :mod:`hf_mixedprec.storage.bits`), ``bf16_kahan`` (a
  BF16 compensation buffer), ``bf16_stochastic`` (stochastic rounding with the optimizer's own generator, whose state
  is saved in ``state_dict()`` so a resumed run draws the same numbers), or ``none`` (round to nearest: updates below
  half a BF16 ulp are lost; chosen explicitly only);
* moments (``exp_avg``, ``exp_avg_sq``) in ``state_dtype``: float32, or bfloat16 written with stochastic rounding
  (round to nearest would freeze ``exp_avg_sq``'s 0.1%-a-step decay).

No host read: bias corrections come from the step count on the device, and like torch's fused AdamW the optimizer
takes ``found_inf``/``grad_scale`` from a ``GradScaler`` (``_step_supports_amp_scaling``) and skips a flagged step
on the device, weights, moments, remainders and step count alike.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch

from hf_mixedprec.core.errors import StorageRefusal
from hf_mixedprec.storage.bits import combine_remainder, kahan_store, split_remainder, stochastic_round_bf16

__all__ = ["MASTER_MODES", "StorageAdamW", "keeps_updates", "pending_state"]

#: How a BF16 parameter's master is kept (``storage.master`` minus ``fp32``, which upcasts the parameter itself).
MASTER_MODES: tuple[str, ...] = ("fp32", "bf16_remainder", "bf16_kahan", "bf16_stochastic", "none")

#: Remainders / compensations made when FP32 weights were split into BF16 before the optimizer existed (the Trainer
#: builds it later); the optimizer takes each into its state at the parameter's first step. Weak: an entry goes with
#: its parameter when no optimizer ever takes it (``estimate``'s fake model).
_PENDING: dict[int, tuple[weakref.ref[torch.Tensor], dict[str, torch.Tensor]]] = {}


def pending_state(entries: Iterable[tuple[torch.nn.Parameter, str, torch.Tensor]]) -> None:
    """Hand the optimizer the ``remainder`` or ``compensation`` of parameters split from FP32 before it was built."""
    for p, key, value in entries:
        got = _PENDING.get(id(p))
        if got is None or got[0]() is not p:
            got = _PENDING[id(p)] = (weakref.ref(p), {})
            weakref.finalize(p, _PENDING.pop, id(p), None)
        got[1][key] = value


def _take_pending(p: torch.Tensor, key: str) -> torch.Tensor | None:
    got = _PENDING.get(id(p))
    if got is None or got[0]() is not p:
        return None
    return got[1].pop(key, None)


class StorageAdamW(torch.optim.Optimizer):
    """AdamW with the storage choices of the module docs. Hyperparameters as torch's ``AdamW``."""

    _step_supports_amp_scaling = True  # reads GradScaler's found_inf / grad_scale like torch's fused AdamW

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        master: str = "fp32",
        state_dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> None:
        if master not in MASTER_MODES:
            raise ValueError(f"master {master!r} (allowed: {', '.join(MASTER_MODES)})")
        if state_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"state_dtype {state_dtype} (allowed: torch.float32, torch.bfloat16)")
        if not float(lr) >= 0.0:
            raise ValueError(f"lr {lr} (allowed: >= 0)")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas {betas} (allowed: each in [0, 1))")
        if eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f"eps {eps}, weight_decay {weight_decay} (allowed: >= 0)")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.master = master
        self.state_dtype = state_dtype
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self._saved_generators: dict[str, torch.Tensor] = {}  # device type -> state, from a checkpoint

    # -- stochastic rounding's generator (saved with the optimizer) ---------------------------------------------
    def _generator(self, device: torch.device) -> torch.Generator:
        """One generator per device type, seeded alike: every data-parallel replica draws the same numbers, and a
        resumed rank restores the one state saved (by rank 0) for its device type."""
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
            saved = self._saved_generators.get(device.type)
            if saved is not None:
                gen.set_state(saved)
            else:
                gen.manual_seed(self.seed)
        return gen

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out["hf_mixedprec"] = {
            "master": self.master,
            "state_dtype": str(self.state_dtype).removeprefix("torch."),
            "generators": {d.type: g.get_state() for d, g in self._generators.items()},
        }
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        ours = state_dict.pop("hf_mixedprec", None)
        wanted = {"master": self.master, "state_dtype": str(self.state_dtype).removeprefix("torch.")}
        if ours is None and state_dict.get("state"):
            raise StorageRefusal(
                f"the optimizer checkpoint was not written by StorageAdamW (no remainders, compensation or rounding "
                f"state), and this run keeps storage.master {self.master} with optimizer_states "
                f"{wanted['state_dtype']}: resume with the recipe the checkpoint was trained with"
            )
        for key, value in wanted.items():
            if ours is not None and ours.get(key) != value:
                name = "master" if key == "master" else "optimizer_states"
                raise StorageRefusal(
                    f"storage.{name}: the optimizer checkpoint was written with {ours.get(key)!r}, this run has "
                    f"{value!r} (allowed: the value the checkpoint was trained with)"
                )
        # torch casts floating state to the parameter's dtype on load; the moments and buffers keep their own
        super().load_state_dict(state_dict)
        saved = state_dict["state"]
        for index, p in enumerate(p for g in self.param_groups for p in g["params"]):
            for key, value in saved.get(index, {}).items():
                if torch.is_tensor(value) and key in self.state[p]:
                    self.state[p][key] = value.to(device=p.device, dtype=value.dtype).clone()
        self._generators = {}
        self._saved_generators = {t: st.cpu() for t, st in (ours or {}).get("generators", {}).items()}

    # -- the step -----------------------------------------------------------------------------------------------
    def _init_state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
        if p.dtype == torch.bfloat16 and self.master == "bf16_remainder":
            rem = _take_pending(p, "remainder")
            state["remainder"] = rem.to(p.device) if rem is not None else torch.zeros_like(p, dtype=torch.int16)
        elif p.dtype == torch.bfloat16 and self.master == "bf16_kahan":
            comp = _take_pending(p, "compensation")
            state["compensation"] = comp.to(p.device) if comp is not None else torch.zeros_like(p)
        return state

    def _master_of(self, p: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        """The FP32 value the update starts from."""
        if p.dtype == torch.float32:
            return p.detach().clone()
        if "remainder" in state:
            return combine_remainder(p.detach(), state["remainder"])
        if "compensation" in state:
            return p.detach().float() + state["compensation"].float()
        return p.detach().float()

    def _store(self, p: torch.Tensor, state: dict[str, Any], master: torch.Tensor) -> None:
        """Write the updated FP32 master back in the parameter's storage."""
        if p.dtype == torch.float32:
            p.data.copy_(master)
        elif "remainder" in state:
            upper, rem = split_remainder(master)
            p.data.copy_(upper)
            state["remainder"].copy_(rem)
        elif "compensation" in state:
            weight, comp = kahan_store(master)
            p.data.copy_(weight)
            state["compensation"].copy_(comp)
        elif p.dtype == torch.bfloat16 and self.master == "bf16_stochastic":
            p.data.copy_(stochastic_round_bf16(master, self._generator(p.device)))
        else:
            p.data.copy_(master)  # round to nearest (master none, or another dtype)

    def _store_moments(self, p: torch.Tensor, state: dict[str, Any], m: torch.Tensor, v: torch.Tensor) -> None:
        """The updated moments in ``state_dtype``. BF16 moments are stochastically rounded: with beta2 = 0.999 the
        decay of ``exp_avg_sq`` is 0.1% a step, under half a BF16 ulp (0.2-0.4%), so round-to-nearest would hold it
        at its largest value and shrink every later step."""
        if self.state_dtype == torch.bfloat16:
            gen = self._generator(p.device)
            state["exp_avg"].copy_(stochastic_round_bf16(m, gen))
            state["exp_avg_sq"].copy_(stochastic_round_bf16(v, gen))
        else:
            state["exp_avg"].copy_(m)
            state["exp_avg_sq"].copy_(v)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale: torch.Tensor | None = getattr(self, "grad_scale", None)
        found_inf: torch.Tensor | None = getattr(self, "found_inf", None)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("StorageAdamW does not support sparse gradients")
                state = self.state[p] if self.state[p] else self._init_state(p)
                skip = None if found_inf is None else (found_inf.to(p.device) > 0)
                grad = p.grad.float()
                if grad_scale is not None:
                    grad = grad / grad_scale.to(p.device)
                master = self._master_of(p, state)
                step = state["step"] + 1
                new = master * (1 - lr * wd) if wd != 0 else master
                m = state["exp_avg"].float().lerp(grad, 1 - beta1)
                v = state["exp_avg_sq"].float().mul(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias1 = 1 - beta1**step
                bias2_sqrt = (1 - beta2**step).sqrt()
                denom = (v.sqrt() / bias2_sqrt).add_(eps)
                new = new - (lr / bias1) * (m / denom)
                if skip is not None:  # a flagged step changes nothing, on the device
                    new = torch.where(skip, master, new)
                    m = torch.where(skip, state["exp_avg"].float(), m)
                    v = torch.where(skip, state["exp_avg_sq"].float(), v)
                    step = torch.where(skip, state["step"], step)
                self._store_moments(p, state, m, v)
                state["step"].copy_(step)
                self._store(p, state, new)
        return loss


def keeps_updates(optimizer: Any, p: torch.Tensor) -> bool:
    """Whether ``optimizer`` keeps the small updates of ``p``, a BF16 parameter, that plain rounding would lose: a
    remainder, a Kahan compensation or stochastic rounding (StorageAdamW's, or torchao's ``bf16_stochastic_round``)."""
    if p.dtype != torch.bfloat16:
        return False
    if isinstance(optimizer, StorageAdamW):
        return optimizer.master in ("bf16_remainder", "bf16_kahan", "bf16_stochastic")
    return bool(getattr(optimizer, "bf16_stochastic_round", False))
