"""The recipe's ``storage:`` section: the precision weights, master weights, gradients and optimizer states are kept in.

Compute precision (autocast, FP8 GEMMs) is the rest of the recipe; this section says what is *stored* between
steps. The default everywhere is the classic one: every trainable parameter has an FP32 master and AdamW keeps FP32
moments (16 bytes per parameter with its gradient; Rajbhandari et al. 2020, "ZeRO"). The other choices store less:

* ``master: bf16_remainder``: BF16 weights plus the 16 bits BF16 drops (int16): the exact FP32 master for 2 bytes
  more than BF16 (Megatron-LM's "store param remainders", ``--store-param-remainders``);
* ``master: bf16_kahan``: BF16 weights plus a BF16 Kahan compensation buffer; ``bf16_stochastic``: BF16 weights
  updated with stochastic rounding (both within about -0.1..+0.2% of FP32-master quality in Zamirai et al. 2020);
* ``master: none``: plain BF16 weights, no master: updates under half a BF16 ulp are rounded away. Only when asked;
* ``optimizer_states``: AdamW's two moments in fp32 or bf16 (hf_mixedprec's ``StorageAdamW``), or 8bit / 4bit /
  fp8 through torchao's ``AdamW8bit`` / ``AdamW4bit`` / ``AdamWFp8`` (``torchao.optim``).

Frozen parameters (a PEFT base model) are never given a master: they stay in the dtype they were loaded in.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

__all__ = [
    "LOW_BIT_STATES",
    "MASTER_CHOICES",
    "STATE_CHOICES",
    "StorageConfig",
    "storage_rules",
]

Master = Literal["fp32", "bf16_remainder", "bf16_kahan", "bf16_stochastic", "none"]
States = Literal["fp32", "bf16", "8bit", "4bit", "fp8"]
OptimizerFamily = Literal["auto", "adamw", "sgd", "adafactor"]

MASTER_CHOICES: tuple[str, ...] = ("fp32", "bf16_remainder", "bf16_kahan", "bf16_stochastic", "none")
STATE_CHOICES: tuple[str, ...] = ("fp32", "bf16", "8bit", "4bit", "fp8")
#: Optimizer-state choices torchao's low-bit AdamW optimizers provide (``torchao.optim``).
LOW_BIT_STATES: tuple[str, ...] = ("8bit", "4bit", "fp8")
#: Master choices whose BF16 weights torchao's optimizers can update (``bf16_stochastic_round`` or plain rounding).
_TORCHAO_MASTERS = ("fp32", "bf16_stochastic", "none")


def _rule(key: str, message: str) -> PydanticCustomError:
    return PydanticCustomError("recipe_rule", "{key}: {message}", {"key": key, "message": message})


class StorageConfig(BaseModel):
    """Storage precision: master weights, optimizer states and the optimizer they apply to (module docs)."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, strict=True, allow_inf_nan=False)

    master: Master = Field(
        "fp32",
        description="How trainable weights keep full precision: fp32 (FP32 weights, the master itself) | "
        "bf16_remainder (BF16 + int16 remainder = exact FP32) | bf16_kahan (BF16 + BF16 compensation) | "
        "bf16_stochastic (BF16, stochastic rounding) | none (plain BF16: small updates are lost; explicit only).",
    )
    optimizer_states: States = Field(
        "fp32",
        description="AdamW moments: fp32 | bf16 (hf_mixedprec's StorageAdamW) | 8bit | 4bit | fp8 (torchao's "
        "AdamW8bit / AdamW4bit / AdamWFp8).",
    )
    optimizer: OptimizerFamily = Field(
        "auto",
        description="The optimizer family of the run: auto (the Trainer's optim or your loop's optimizer, checked "
        "when the recipe is attached) | adamw | sgd | adafactor. Every choice but master fp32 with fp32 states "
        "needs AdamW.",
    )
    seed: int | None = Field(
        None,
        ge=0,
        description="bf16_stochastic only: seed of the rounding's random bits, hashed with the step count (default 0).",
    )

    @model_validator(mode="before")
    @classmethod
    def _seed(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("master") == "bf16_stochastic":
            data.setdefault("seed", 0)
            if data["seed"] is None:
                data["seed"] = 0
        elif data.get("seed") is not None:
            raise _rule("seed", f"only applies to master bf16_stochastic (master is {data.get('master', 'fp32')!r})")
        return data

    @model_validator(mode="after")
    def _combinations(self) -> StorageConfig:
        default = self.master == "fp32" and self.optimizer_states == "fp32"
        if not default and self.optimizer not in ("auto", "adamw"):
            what = (
                f"optimizer_states {self.optimizer_states}"
                if self.optimizer_states != "fp32"
                else f"master {self.master}"
            )
            raise _rule(
                "optimizer",
                f"{self.optimizer!r} cannot keep {what}: only AdamW's moments and update are implemented for it "
                "(allowed: auto or adamw; or master fp32 with optimizer_states fp32)",
            )
        if self.optimizer_states in LOW_BIT_STATES and self.master not in _TORCHAO_MASTERS:
            raise _rule(
                "optimizer_states",
                f"{self.optimizer_states} (torchao's low-bit AdamW) cannot keep master {self.master}: torchao updates "
                f"BF16 weights only by plain or stochastic rounding (allowed with {self.master}: fp32, bf16; or master "
                f"{', '.join(_TORCHAO_MASTERS)})",
            )
        return self

    # -- what the choices mean ----------------------------------------------------------------------------------
    @property
    def is_default(self) -> bool:
        """FP32 master and FP32 states: the Trainer's own optimizer runs unchanged."""
        return self.master == "fp32" and self.optimizer_states == "fp32"

    def weight_dtype(self, compute: str) -> str:
        """The dtype trainable weights are kept in between steps (``compute``: the recipe's precision)."""
        if self.master == "fp32":
            return "fp32"
        if self.master == "none":
            return "fp16" if compute == "fp16" else "bf16"
        return "bf16"

    def optimizer_impl(self) -> str:
        """Which optimizer applies the update: ``unchanged`` (the user's / Trainer's), ``StorageAdamW`` or the
        torchao class name."""
        if self.optimizer_states in LOW_BIT_STATES:
            return {"8bit": "AdamW8bit", "4bit": "AdamW4bit", "fp8": "AdamWFp8"}[self.optimizer_states]
        return "unchanged" if self.is_default else "StorageAdamW"


#: What torchao 0.18 (the version tested) does wrong with its low-bit states on FSDP2's sharded parameters, seen on 2
#: gloo ranks under the Trainer: its 8-bit states over FP32 weights train and resume exactly, the rest fail.
_TORCHAO_FSDP2_FAILURES = {
    "4bit": "torchao's compiled 4-bit step fails a shape check",
    "fp8": "torchao's FP8 state has no qmap",
    "8bit-bf16": "torchao's 8-bit state lacks aten.view.dtype over BF16 weights",
}


def storage_rules(storage: StorageConfig, precision: str, strategy: str, zero_stage: int | None) -> None:
    """Cross-section rules (raised at ``storage.<key>``): what the recipe's precision and launch allow."""
    m = storage.master
    if precision == "fp32" and m != "fp32":
        raise _rule(
            "storage.master",
            f"{m!r} keeps BF16 weights, which an fp32 recipe cannot compute with (precision is fp32; allowed: fp32)",
        )
    if precision == "fp16" and m != "fp32":
        why = (
            "FP16 weights trained under a loss scaler are refused: updates under half an FP16 ulp are lost and the "
            "range is 65504"
            if m == "none"
            else "BF16 storage under FP16 compute mixes two 16-bit formats"
        )
        raise _rule("storage.master", f"{m!r}: {why} (precision is fp16; allowed: fp32)")
    states = storage.optimizer_states
    fsdp2_failure = _TORCHAO_FSDP2_FAILURES.get("8bit-bf16" if states == "8bit" and m != "fp32" else states)
    if strategy == "fsdp2" and fsdp2_failure:
        raise _rule(
            "storage.optimizer_states",
            f"{states} with master {m} is not supported with distributed.strategy fsdp2 ({fsdp2_failure} on sharded "
            "parameters; allowed under fsdp2: fp32, bf16, or 8bit with master fp32)",
        )
    if strategy == "deepspeed":
        # DeepSpeed 0.19.8 keeps FP32 states beside a BF16 master only with ZeRO-Offload's DeepSpeedCPUAdam
        # (deepspeed/runtime/base_optimizer.py, _configure_master_weights)
        ok = (m == "fp32" and storage.optimizer_states == "fp32") or (
            m == "none" and storage.optimizer_states == "bf16" and precision == "bf16"
        )
        if not ok:
            raise _rule(
                "storage.master" if m not in ("fp32", "none") else "storage.optimizer_states",
                f"master {m} with optimizer_states {storage.optimizer_states} has no DeepSpeed equivalent (allowed "
                "under deepspeed: master fp32 with optimizer_states fp32, DeepSpeed's own FP32 master; or, for a bf16 "
                "recipe, master none with optimizer_states bf16 = bf16.bf16_master_weights_and_grads + "
                "bf16.bf16_optimizer_states)",
            )
        if m == "none" and not zero_stage:
            raise _rule(
                "storage.master",
                "none maps to DeepSpeed's bf16_master_weights_and_grads, which needs ZeRO stage 1, 2 or 3 "
                f"(distributed.zero_stage is {zero_stage}; allowed: zero_stage 1..3, or master fp32)",
            )
