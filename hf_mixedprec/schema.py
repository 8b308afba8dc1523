"""The recipe schema: one validated, immutable description of how to train on one GPU generation.

A recipe is YAML on disk (read by :mod:`hf_mixedprec.recipe_files`) and a frozen pydantic model in memory.
Everything a user can type is checked here, and every problem is reported as ``dotted.key: what is wrong
(allowed: ...)``. Key names follow Transformer Engine / torch spellings (``amax_history_len``,
``amax_compute_algo``, ``init_scale``, ``growth_interval``) and each option has exactly one spelling. What a
recipe does to a Trainer or an Accelerate loop is in :mod:`hf_mixedprec.recipe` (``recipe.callbacks()``...).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic_core import PydanticCustomError

from hf_mixedprec.formats import FP8_SCALING_DEFAULTS
from hf_mixedprec.modules_config import DEFAULT_RULES, LEGACY_FP8_KEYS, ModuleRule, legacy_rules, module_rules_check
from hf_mixedprec.storage_config import StorageConfig, storage_rules

__all__ = [
    "ACCELERATE_MIXED_PRECISION",
    "CLIP_DEFAULTS",
    "GENERATIONS",
    "RECIPE_ENV",
    "ClippingConfig",
    "DetectorConfig",
    "DetectorsConfig",
    "DistributedConfig",
    "FP8Config",
    "HealthConfig",
    "LossScaleConfig",
    "ModuleRule",
    "PhaseConfig",
    "RecipeSpec",
    "StorageConfig",
]

Generation = Literal["cpu", "mps", "volta", "turing", "ampere", "ada", "hopper", "blackwell"]
GENERATIONS: tuple[str, ...] = ("cpu", "mps", "volta", "turing", "ampere", "ada", "hopper", "blackwell")
Precision = Literal["fp32", "fp16", "bf16", "fp8"]
Reaction = Literal["log", "warn", "skip_step", "stop", "fallback", "lower_lr"]

#: Accelerate's ``mixed_precision`` for each recipe precision: FP8 layers run inside BF16 autocast, applied by
#: hf_mixedprec (Accelerate's own ``fp8`` is Transformer Engine's, chosen only by ``hf-mixedprec launch``).
ACCELERATE_MIXED_PRECISION: dict[str, str] = {"fp32": "no", "fp16": "fp16", "bf16": "bf16", "fp8": "bf16"}

#: Environment variable through which ``hf-mixedprec launch`` hands the resolved recipe to its child.
RECIPE_ENV = "HF_MIXEDPREC_RECIPE"


def _rule(key: str, message: str) -> PydanticCustomError:
    """A cross-field rule violation located at ``key`` (relative to the model raising it)."""
    return PydanticCustomError("recipe_rule", "{key}: {message}", {"key": key, "message": message})


#: Upper bounds that keep memory and arithmetic sane (windows and histories are allocated up front).
MAX_WINDOW = 100_000
MAX_AMAX_HISTORY = 65_536
MAX_STEPS = 1_000_000_000
#: Rules in ``modules:`` (each is matched against every module name once, at attach).
MAX_RULES = 256


class _Section(BaseModel):
    """Strict: no string-to-number or string-to-bool coercion (``tf32: "yes"`` is refused, not read as True),
    and no NaN/Inf where a number is expected."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, strict=True, allow_inf_nan=False)


def _as_tuple(value: Any) -> Any:
    """YAML gives lists; the frozen schema keeps tuples (strict mode would refuse the list itself)."""
    return tuple(value) if isinstance(value, list) else value


StrTuple = Annotated[tuple[str, ...], BeforeValidator(_as_tuple)]


def _rule_list(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(value)
    raise _rule("", f"{repr(value)[:60]} is not a list of rules (allowed: a list of mappings, see docs/modules.md)")


class LossScaleConfig(_Section):
    """Dynamic loss scaling for FP16 (torch ``GradScaler`` names; DeepSpeed names are derived).

    torch GradScaler defaults: init 2**16, growth 2.0, backoff 0.5, interval 2000, no minimum.
    DeepSpeed: initial_scale_power 16, loss_scale_window 1000, hysteresis 2, min_loss_scale 1.
    """

    init_scale: float = Field(65536.0, gt=0, description="Initial loss scale (torch GradScaler default 2**16).")
    growth_factor: float = Field(2.0, gt=1, description="Multiply the scale by this after growth_interval clean steps.")
    backoff_factor: float = Field(0.5, gt=0, lt=1, description="Multiply the scale by this on an overflow step.")
    growth_interval: int = Field(
        2000,
        ge=1,
        le=MAX_STEPS,
        description=f"Clean steps before the scale grows (at most {MAX_STEPS:,}: longer than any run).",
    )
    min_scale: float = Field(1.0, gt=0, description="Floor for the scale; reaching it is a health event.")
    max_scale: float | None = Field(None, gt=0, description="Ceiling for the scale; null = no ceiling.")
    hysteresis: int = Field(
        1, ge=1, description="Overflows tolerated before backing off (1 = back off on every overflow, as torch does)."
    )

    @model_validator(mode="after")
    def _order(self) -> LossScaleConfig:
        if self.min_scale > self.init_scale:
            raise _rule("min_scale", f"{self.min_scale:g} is above init_scale {self.init_scale:g}")
        if self.max_scale is not None and self.max_scale < self.init_scale:
            raise _rule("max_scale", f"{self.max_scale:g} is below init_scale {self.init_scale:g}")
        return self


_FP8_SCALING_ONLY = (
    "amax_history_len",
    "amax_compute_algo",
    "margin",
    "epsilon",
    "power_2_scales",
    "mx_rounding",
    "block_size",
)
_ALLOWED_BLOCK_SIZE = {"mxfp8": (32,), "blockwise": (128,)}


class FP8Config(_Section):
    """FP8 training settings (only with ``precision: fp8``)."""

    backend: Literal["auto", "transformer_engine", "torchao", "native", "emulated"] = Field(
        "auto",
        description="Who runs the FP8 math: auto picks transformer_engine on CUDA, else torchao for current scaling, "
        "else refuses loudly; native: hf_mixedprec's quantizers on torch._scaled_mm (delayed, current); emulated: "
        "exact FP8 values with float32 GEMMs, anywhere.",
    )
    scaling: Literal["delayed", "current", "mxfp8", "blockwise"] = Field(
        "delayed",
        description="How scales are chosen: amax history, amax now, per-32-block E8M0, or 1x128/128x128 tiles.",
    )
    format: Literal["HYBRID", "E4M3"] = Field(
        "HYBRID", description="HYBRID = E4M3 forward, E5M2 gradients; E4M3 = E4M3 everywhere. Pure E5M2 is refused."
    )
    amax_history_len: int | None = Field(
        None,
        ge=1,
        le=MAX_AMAX_HISTORY,
        description=f"delayed only: amax history length (TE default 1024; at most {MAX_AMAX_HISTORY}, kept per layer).",
    )
    amax_compute_algo: Literal["max", "most_recent"] | None = Field(
        None, description="delayed only: scale from the max of the history or the most recent amax."
    )
    margin: int | None = Field(
        None,
        ge=0,
        le=64,
        description="delayed/mxfp8: scale is divided by 2**margin (at most 64: beyond it every value underflows).",
    )
    epsilon: float | None = Field(None, ge=0, description="current only: amax floor before computing the scale.")
    power_2_scales: bool | None = Field(None, description="current/blockwise: round scales down to a power of two.")
    mx_rounding: Literal["rceil", "floor"] | None = Field(
        None, description="mxfp8 only: rceil (TE/hardware, never saturates) or floor (OCP spec, may saturate)."
    )
    block_size: int | None = Field(
        None, ge=1, le=4096, description="mxfp8: 32 (OCP MX); blockwise: 128 (TE); at most 4096."
    )
    torchao_recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] | None = Field(
        None, description="backend torchao only: torchao's float8 recipe name (default tensorwise)."
    )
    align: int = Field(
        16, ge=1, description="Linear layers whose in/out features are not multiples of this stay in BF16."
    )

    @model_validator(mode="before")
    @classmethod
    def _scaling_options(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        if str(data.get("format", "")).upper() == "E5M2":
            raise _rule("format", "pure E5M2 training is refused (Transformer Engine refuses it too); use HYBRID")
        scaling = data.get("scaling", "delayed")
        if scaling not in FP8_SCALING_DEFAULTS:
            return data  # the field validator reports the bad value
        backend = data.get("backend", "auto")
        if backend == "torchao":
            _torchao_rules(data, scaling)
        elif backend == "native" and scaling not in ("delayed", "current"):
            raise _rule(
                "backend",
                f"native runs delayed and current scaling (per-tensor scales on torch._scaled_mm), not {scaling!r}; "
                "use emulated (any device) or transformer_engine for it",
            )
        if backend != "torchao" and data.get("torchao_recipe") is not None:
            raise _rule("torchao_recipe", f"only applies to backend torchao (backend is {backend!r}); remove it")
        applicable = FP8_SCALING_DEFAULTS[scaling]
        for key in _FP8_SCALING_ONLY:
            if key in applicable:
                if data.get(key) is None:
                    data[key] = applicable[key]
            elif data.get(key) is not None:
                users = [s for s, opts in FP8_SCALING_DEFAULTS.items() if key in opts]
                raise _rule(
                    key,
                    f"does not apply to scaling {scaling!r} (it applies to: {', '.join(users)}); remove it"
                    " (set it to null in a recipe that extends another)",
                )
        size = data.get("block_size")
        allowed = _ALLOWED_BLOCK_SIZE.get(scaling)
        if allowed and isinstance(size, int) and size not in allowed:
            raise _rule(
                "block_size", f"{size} is not supported for {scaling} (allowed: {', '.join(map(str, allowed))})"
            )
        return data

    def options(self) -> dict[str, Any]:
        """The scaling-specific options that apply to this recipe's scaling (resolved)."""
        return {k: getattr(self, k) for k in FP8_SCALING_DEFAULTS[self.scaling]}


#: torchao clamps every amax at this value before computing a scale (``torchao/float8/float8_utils.py``, EPS).
TORCHAO_AMAX_EPS = 1e-12
#: torchao's float8 recipes that use E4M3 for every tensor with power-of-2 scales (``Float8LinearConfig.from_recipe_name``).
_TORCHAO_ROWWISE = ("rowwise", "rowwise_with_gw_hp")


def _torchao_rules(data: dict[str, Any], scaling: Any) -> None:
    """What torchao's ``Float8LinearConfig`` can express, checked before any model exists (``validate`` and every
    load say it in one line), and the defaults that make a torchao recipe say what torchao will do.

    * scaling: current only (torchao dropped delayed scaling; it has no TE-style mxfp8/blockwise training);
    * ``torchao_recipe`` defaults to tensorwise; the rowwise recipes use E4M3 for every tensor and power-of-2
      scales: those are their defaults, and a recipe saying otherwise is refused, never overridden;
    * ``epsilon``: torchao always clamps amax at 1e-12, so that is the default; 0 (no floor, the value recipes
      written for Transformer Engine carry) is accepted and the conversion notes the 1e-12 clamp; others are refused.
    """
    if scaling != "current":
        raise _rule(
            "scaling",
            f"{scaling!r} is not available with backend torchao (allowed: current; torchao dropped delayed "
            "scaling and has no TE-style mxfp8/blockwise training; use backend transformer_engine or emulated)",
        )
    name = data.get("torchao_recipe")
    if name is None:
        name = data["torchao_recipe"] = "tensorwise"
    if name in _TORCHAO_ROWWISE:
        if data.get("format") is None:
            data["format"] = "E4M3"
        elif str(data["format"]).upper() != "E4M3":
            raise _rule(
                "format",
                f"{data['format']!r} does not match torchao's {name} recipe, which casts every tensor to E4M3 "
                f"(allowed: E4M3 with torchao_recipe {name}; or torchao_recipe tensorwise for HYBRID)",
            )
        if data.get("power_2_scales") is None:
            data["power_2_scales"] = True
        elif data["power_2_scales"] is not True:
            raise _rule(
                "power_2_scales",
                f"{data['power_2_scales']!r} does not match torchao's {name} recipe, which rounds every scale to a "
                f"power of two (allowed: true with torchao_recipe {name}; or torchao_recipe tensorwise)",
            )
    eps = data.get("epsilon")
    if eps is None:
        data["epsilon"] = TORCHAO_AMAX_EPS
    elif isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps not in (0.0, TORCHAO_AMAX_EPS):
        raise _rule(
            "epsilon",
            f"{eps!r} cannot be set with backend torchao, which always clamps amax at 1e-12 (allowed: 1e-12, the "
            "default, or 0; or backend emulated for another floor)",
        )


ClipMethod = Literal["none", "norm", "zclip", "autoclip", "agc"]
#: Each method's recipe parameters and their defaults (the clippers' keyword defaults in clipping.py come from here).
CLIP_DEFAULTS: dict[str, dict[str, Any]] = {
    "none": {},
    "norm": {"max_norm": 1.0},
    # ZClip (2025): 25 warm-up steps, EMA alpha 0.97, z threshold 2.5; max_norm is an optional hard cap.
    "zclip": {"alpha": 0.97, "z_thresh": 2.5, "warmup_steps": 25, "max_norm": None},
    # AutoClip (2020): clip at the p-th percentile of the grad-norm history.
    "autoclip": {"percentile": 10.0, "history_size": 1000},
    # AGC (2021): clip each unit's gradient to clip_factor * max(||W_i||, eps).
    "agc": {"clip_factor": 0.01, "eps": 0.001},
}
_CLIP_PARAMS = ("max_norm", "alpha", "z_thresh", "warmup_steps", "percentile", "history_size", "clip_factor", "eps")


class ClippingConfig(_Section):
    """Gradient clipping: fixed norm, or adaptive (ZClip, AutoClip, AGC)."""

    method: ClipMethod = Field("zclip", description="none | norm | zclip | autoclip | agc.")
    max_norm: float | None = Field(None, gt=0, description="norm: the threshold; zclip: optional hard cap.")
    alpha: float | None = Field(None, gt=0, lt=1, description="zclip: EMA factor for the norm mean/variance.")
    z_thresh: float | None = Field(None, gt=0, description="zclip: z-score above which a step is clipped.")
    warmup_steps: int | None = Field(
        None, ge=1, le=MAX_STEPS, description="zclip: steps used to initialise mean/variance."
    )
    percentile: float | None = Field(None, gt=0, le=100, description="autoclip: percentile of the norm history.")
    history_size: int | None = Field(
        None,
        ge=1,
        le=MAX_WINDOW,
        description=f"autoclip: how many past norms are kept (at most {MAX_WINDOW:,}, kept in memory).",
    )
    clip_factor: float | None = Field(None, gt=0, description="agc: lambda, the allowed grad/weight norm ratio.")
    eps: float | None = Field(None, gt=0, description="agc: floor for weight norms.")

    @model_validator(mode="before")
    @classmethod
    def _method_options(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        method = data.get("method", "zclip")
        if method not in CLIP_DEFAULTS:
            return data
        applicable = CLIP_DEFAULTS[method]
        for key in _CLIP_PARAMS:
            if key in applicable:
                if key not in data:
                    data[key] = applicable[key]
            elif data.get(key) is not None:
                users = [m for m, opts in CLIP_DEFAULTS.items() if key in opts]
                raise _rule(key, f"does not apply to method {method!r} (it applies to: {', '.join(users)}); remove it")
        return data

    def params(self) -> dict[str, Any]:
        """The parameters that apply to this method (resolved)."""
        return {k: getattr(self, k) for k in CLIP_DEFAULTS[self.method]}


class DetectorConfig(_Section):
    """One health detector: its threshold, the window it looks at, and what happens when it fires."""

    enabled: bool = Field(True, description="Whether this detector runs.")
    threshold: float | None = Field(None, description="Meaning depends on the detector (see docs/health.md).")
    window: int | None = Field(
        None,
        ge=1,
        le=MAX_WINDOW,
        description=f"Steps the detector looks back over (at most {MAX_WINDOW:,}, kept in memory).",
    )
    reaction: Reaction = Field("warn", description="log | warn | skip_step | stop | fallback | lower_lr.")
    lr_factor: float | None = Field(None, gt=0, lt=1, description="lower_lr only: multiply the learning rate by this.")

    @model_validator(mode="after")
    def _lr_factor(self) -> DetectorConfig:
        if self.reaction == "lower_lr" and self.lr_factor is None:
            raise _rule("lr_factor", "is required when reaction is lower_lr (e.g. 0.5)")
        if self.reaction != "lower_lr" and self.lr_factor is not None:
            raise _rule("lr_factor", f"only applies to reaction lower_lr (reaction is {self.reaction!r}); remove it")
        return self


def _det(doc: str, threshold: float | None = None, window: int | None = None, reaction: Reaction = "warn") -> Any:
    return Field(
        default_factory=lambda: DetectorConfig(threshold=threshold, window=window, reaction=reaction), description=doc
    )


class DetectorsConfig(_Section):
    """The detectors, each with defaults that suit LLM fine-tuning."""

    nonfinite_loss: DetectorConfig = _det(
        "NaN/Inf in the raw loss (before Trainer's NaN filter).", reaction="skip_step"
    )
    nonfinite_grad: DetectorConfig = _det(
        "NaN/Inf in the gradients (FP16: an overflow step the scaler skips).", reaction="log"
    )
    skip_rate: DetectorConfig = _det(
        "threshold: fraction of skipped optimizer steps over the last `window` steps.", threshold=0.2, window=100
    )
    consecutive_skips: DetectorConfig = _det("threshold: this many skipped steps in a row.", threshold=10)
    scale_floor: DetectorConfig = _det("threshold: loss scale at or below this value.", threshold=1.0, reaction="warn")
    death_spiral: DetectorConfig = _det(
        "threshold: this many loss-scale backoffs without a growth within `window` steps.",
        threshold=8,
        window=50,
        reaction="stop",
    )
    loss_spike: DetectorConfig = _det(
        "threshold: z-score of the loss over the last `window` steps.", threshold=6.0, window=128
    )
    grad_spike: DetectorConfig = _det(
        "threshold: z-score of the grad norm over the last `window` steps.", threshold=6.0, window=128
    )
    tiny_update: DetectorConfig = _det(
        "threshold: RMS(update)/RMS(weight) of parameters stored in BF16/FP16, measured on sampled steps; "
        "below about 2e-3 BF16 rounds updates away.",
        threshold=1e-3,
        reaction="log",
    )
    fp8_saturation: DetectorConfig = _det(
        "threshold: fraction of a layer's values clipped at the FP8 max.", threshold=0.001, reaction="warn"
    )
    fp8_underflow: DetectorConfig = _det(
        "threshold: fraction of a layer's non-zero values that quantize to zero.", threshold=0.1, reaction="log"
    )
    fp8_sqnr: DetectorConfig = _det(
        "threshold: minimum quantization SQNR in dB for a layer.", threshold=20.0, reaction="log"
    )
    mx_clamp: DetectorConfig = _det(
        "threshold: fraction of MXFP8 blocks whose E8M0 scale is at the clamp.", threshold=0.01, reaction="warn"
    )

    @model_validator(mode="before")
    @classmethod
    def _over_defaults(cls, data: Any) -> Any:
        """A detector given in a recipe changes only the keys it names: ``death_spiral: {reaction: fallback}``
        keeps the default threshold and window (without this it would start from empty values and never fire)."""
        if not isinstance(data, dict):
            return data
        merged = dict(data)
        for name, value in data.items():
            field = cls.model_fields.get(name)
            if isinstance(value, dict) and field is not None and field.default_factory is not None:
                default = field.default_factory().model_dump(exclude_none=True)  # type: ignore[call-arg]
                merged[name] = {**default, **value}
        return merged


class HealthConfig(_Section):
    """Scale-health monitoring: how often FP8 statistics are sampled, and the detectors."""

    enabled: bool = Field(True, description="Whether health monitoring runs at all.")
    fp8_sample_every: int = Field(
        50,
        ge=1,
        le=MAX_STEPS,
        description="Collect per-layer FP8 statistics (and the tiny_update probe) every N optimizer steps.",
    )
    detectors: DetectorsConfig = Field(default_factory=DetectorsConfig)


class DistributedConfig(_Section):
    """How the job is launched: single process, DDP, FSDP2 or DeepSpeed ZeRO."""

    strategy: Literal["none", "ddp", "fsdp2", "deepspeed"] = Field(
        "none", description="none: no sharding (plain data parallel when num_processes > 1); ddp; fsdp2; deepspeed."
    )
    zero_stage: int | None = Field(None, ge=0, le=3, description="deepspeed only: ZeRO stage 0..3.")
    zero3_init: bool = Field(
        False,
        description="deepspeed zero_stage 3 only: Accelerate's zero3_init_flag (build the model already partitioned "
        "over the ranks with DeepSpeed zero.Init). With Accelerate 1.15 and Transformers 5.23 a model loaded by "
        "from_pretrained/from_config after TrainingArguments or the Accelerator exist is partitioned either way.",
    )
    num_processes: int = Field(1, ge=1, description="Processes in total (all machines).")
    num_machines: int = Field(1, ge=1, description="Machines (nodes).")

    @model_validator(mode="before")
    @classmethod
    def _zero(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        strategy = data.get("strategy", "none")
        if strategy == "deepspeed" and data.get("zero_stage") is None:
            data["zero_stage"] = 1
        elif strategy != "deepspeed" and data.get("zero_stage") is not None:
            raise _rule("zero_stage", f"only applies to strategy deepspeed (strategy is {strategy!r}); remove it")
        return data

    @model_validator(mode="after")
    def _counts(self) -> DistributedConfig:
        if self.num_processes < self.num_machines:
            raise _rule("num_processes", f"{self.num_processes} is fewer than num_machines {self.num_machines}")
        if self.zero3_init and self.zero_stage != 3:
            where = (
                f"zero_stage is {self.zero_stage}" if self.strategy == "deepspeed" else f"strategy is {self.strategy!r}"
            )
            raise _rule("zero3_init", f"only applies to strategy deepspeed with zero_stage 3 ({where}); remove it")
        return self


#: At most this many phases (each is validated as a recipe of its own).
MAX_PHASES = 32
#: ``distributed.strategy`` values under which layers can be swapped in place at a phase boundary.
PHASE_STRATEGIES: tuple[str, ...] = ("none", "ddp")


def _step_or_fraction(value: Any) -> Any:
    """A phase start is an integer step count or a fraction; a string or a bool is neither (strict mode would
    report it twice, once per type of the union)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _rule(
            "", f"{value!r} is not a step count or a fraction (allowed: an integer >= 0, or a number in [0, 1))"
        )
    return value


class PhaseConfig(_Section):
    """One precision phase of a run, from its ``start`` until the next phase's start.

    ``start`` counts optimizer steps done, or is a fraction of ``max_steps``. Everything not named here (clipping,
    health, tf32, distribution) is the recipe's own, so the clipper's statistics and the detectors' windows run on
    across boundaries."""

    name: str | None = Field(
        None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="A label for reports (default: 'phase <index>')."
    )
    start: Annotated[int | float, BeforeValidator(_step_or_fraction)] = Field(
        ...,
        description="Where the phase begins: optimizer steps already done (an integer), or a fraction of max_steps "
        "in [0, 1) (resolved as round(fraction * max_steps)). The first phase starts at 0.",
    )
    precision: Precision = Field(
        ...,
        description="The phase's precision: fp32, bf16, fp16 or fp8. An fp16 phase starts a dynamic loss scaler at "
        "its loss_scale.init_scale when it begins and retires it when it ends.",
    )
    loss_scale: dict[str, Any] | None = Field(
        None,
        description="fp16 phases: keys of the loss_scale section that differ from the recipe's own loss_scale (or "
        "from the loss_scale defaults when the recipe's precision is not fp16).",
    )
    fp8: dict[str, Any] | None = Field(
        None,
        description="fp8 phases: keys of the fp8 section that differ from the recipe's own fp8 section (or from the "
        "fp8 defaults when the recipe's precision is not fp8).",
    )
    fp8_history: Literal["fresh", "restore"] | None = Field(
        None,
        description="fp8 phases (default fresh): start the FP8 layers' amax histories and scales afresh, or restore those the last "
        "FP8 phase ended with (restore suits a short BF16 interlude; layers whose state no longer fits restart).",
    )

    @model_validator(mode="after")
    def _start(self) -> PhaseConfig:
        if isinstance(self.start, float) and not 0.0 <= self.start < 1.0:
            raise _rule(
                "start", f"{self.start!r} is out of range (allowed: an integer step >= 0, or a fraction in [0, 1))"
            )
        if isinstance(self.start, int) and not 0 <= self.start <= MAX_STEPS:
            raise _rule("start", f"{self.start!r} is out of range (allowed: 0 to {MAX_STEPS:,} steps)")
        if self.precision != "fp8":
            for key in ("fp8", "fp8_history"):
                if getattr(self, key) is not None:
                    raise _rule(key, f"only applies to an fp8 phase (precision is {self.precision}); remove it")
        if self.precision != "fp16" and self.loss_scale is not None:
            raise _rule("loss_scale", f"only applies to an fp16 phase (precision is {self.precision}); remove it")
        return self

    def label(self, index: int) -> str:
        """The phase's name in reports."""
        return self.name or f"phase {index}"


def _check_legacy(fp8: Mapping[str, Any]) -> None:
    """The types of the moved ``fp8.keep_*`` keys, checked where the user wrote them."""
    pats = fp8.get("keep_in_bf16")
    if pats is not None and not (
        isinstance(pats, str) or (isinstance(pats, (list, tuple)) and all(isinstance(p, str) for p in pats))
    ):
        raise _rule("fp8.keep_in_bf16", f"{pats!r} is not a list of module-name globs")
    n = fp8.get("keep_first_last_blocks")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise _rule("fp8.keep_first_last_blocks", f"{n!r} is not a block count (allowed: an integer >= 0)")
    for key in ("keep_lm_head", "keep_embeddings"):
        if fp8.get(key) is not None and not isinstance(fp8[key], bool):
            raise _rule(f"fp8.{key}", f"{fp8[key]!r} is not true or false")


def _phase_data(base: dict[str, Any], phase: PhaseConfig) -> dict[str, Any]:
    """The plain recipe data one phase trains with: ``base`` (the recipe's data without ``phases``) with the phase's
    precision and fp8 keys. Options that belong to the recipe's own FP8 scaling (or torchao backend) are dropped when
    the phase changes the scaling (or backend), as ``extends`` would need them set to null."""
    data = {k: v for k, v in base.items() if k not in ("fp8", "loss_scale", "phases")}
    data["precision"] = phase.precision
    if phase.precision == "fp16":
        own = dict(base.get("loss_scale") or {}) if base.get("precision") == "fp16" else {}
        data["loss_scale"] = {**own, **(phase.loss_scale or {})}
    if phase.precision == "fp8":
        own = dict(base.get("fp8") or {}) if base.get("precision") == "fp8" else {}
        wanted = dict(phase.fp8 or {})
        if "scaling" in wanted and wanted["scaling"] != own.get("scaling"):
            own = {k: v for k, v in own.items() if k not in _FP8_SCALING_ONLY}
        if "backend" in wanted and wanted["backend"] != own.get("backend"):
            own.pop("torchao_recipe", None)
        data["fp8"] = {**own, **wanted}
    return data


def _phase_rules(spec: RecipeSpec) -> tuple[RecipeSpec, ...]:
    """Check ``spec.phases`` as a whole (starts, strategy) and validate each phase as a recipe of its own; returns
    those phase recipes. Every problem names its ``phases.<index>.<key>``."""
    phases = spec.phases or ()
    if not 2 <= len(phases) <= MAX_PHASES:
        raise _rule(
            "phases", f"{len(phases)} phase(s) given (allowed: 2 to {MAX_PHASES}; one phase is the recipe itself)"
        )
    if spec.distributed.strategy not in PHASE_STRATEGIES:
        raise _rule(
            "phases",
            f"not supported with distributed.strategy {spec.distributed.strategy} (allowed: "
            f"{', '.join(PHASE_STRATEGIES)}): layers are swapped in place at a boundary, which a sharded model forbids",
        )
    if phases[0].start != 0:
        raise _rule(
            "phases.0.start",
            f"{phases[0].start!r}: the first phase must start at 0 (steps before it would have no precision)",
        )
    fractions = [i for i, p in enumerate(phases) if isinstance(p.start, float) and p.start != 0]
    counts = [i for i, p in enumerate(phases) if isinstance(p.start, int) and p.start != 0]
    if fractions and counts:
        i, j = fractions[0], counts[0]
        raise _rule(
            f"phases.{max(i, j)}.start",
            f"{phases[max(i, j)].start!r} mixes a {'fraction' if max(i, j) == i else 'step count'} with "
            f"phases.{min(i, j)}.start {phases[min(i, j)].start!r} (allowed: all steps or all fractions of max_steps; "
            "0 fits both)",
        )
    for i in range(1, len(phases)):
        if phases[i].start <= phases[i - 1].start:
            raise _rule(
                f"phases.{i}.start",
                f"{phases[i].start!r} is not after phases.{i - 1}.start {phases[i - 1].start!r} (phases overlap; "
                "allowed: starts in increasing order)",
            )
    base = spec.to_dict()
    out = []
    for i, phase in enumerate(phases):
        try:
            out.append(type(spec).model_validate(_phase_data(base, phase), context={"phase": True}))
        except ValidationError as exc:
            # the phase's own problems, each reported at phases.<i>.<key> (recipe_files formats them)
            raise PydanticCustomError(
                "recipe_phase",
                "phases.{index}: {count} problem(s)",
                {"index": i, "count": exc.error_count(), "errors": exc.errors(include_url=False)},
            ) from None
    return tuple(out)


class RecipeSpec(_Section):
    """A complete, validated mixed-precision training recipe (what :class:`hf_mixedprec.recipe.Recipe` adds:
    applying it to a Trainer or an Accelerate loop)."""

    name: str = Field(..., min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="The recipe's name.")
    description: str = Field("", description="One line on what the recipe is for.")
    extends: str | None = Field(None, description="A recipe name or path whose values this one starts from.")
    hardware: Annotated[tuple[Generation, ...], BeforeValidator(_as_tuple)] = Field(
        (), description="GPU generations the recipe is meant for."
    )
    precision: Precision = Field(..., description="Training precision: fp32, fp16 (+ loss scaling), bf16, or fp8.")
    tf32: bool = Field(False, description="Allow TF32 matmuls (Ampere and later).")
    loss_scale: LossScaleConfig | None = Field(None, description="fp16 only: dynamic loss scaling.")
    fp8: FP8Config | None = Field(None, description="fp8 only: FP8 scaling and what stays in BF16.")
    storage: StorageConfig = Field(
        default_factory=StorageConfig,
        description="What weights, master weights and optimizer states are stored in (default: FP32 master and "
        "FP32 AdamW moments). See docs/storage.md.",
    )
    modules: Annotated[tuple[ModuleRule, ...], BeforeValidator(_rule_list)] = Field(
        DEFAULT_RULES,
        max_length=MAX_RULES,
        description="Per-module precision rules, first match wins (default: MoE routers compute fp32, the output "
        "projection out of FP8; a list given replaces them). See docs/modules.md.",
    )
    clipping: ClippingConfig = Field(default_factory=ClippingConfig, description="Gradient clipping.")
    health: HealthConfig = Field(default_factory=HealthConfig, description="Scale-health monitoring and reactions.")
    distributed: DistributedConfig = Field(default_factory=DistributedConfig, description="How the job is launched.")
    phases: Annotated[tuple[PhaseConfig, ...], BeforeValidator(_as_tuple)] | None = Field(
        None,
        description="Precision phases over the run (e.g. BF16 warm-up, FP8, BF16 anneal), switched in place at their "
        "starts; null = the whole run in `precision`. See docs/phases.md.",
    )

    @model_validator(mode="before")
    @classmethod
    def _precision_sections(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        precision = data.get("precision")
        if precision == "fp16" and data.get("loss_scale") is None:
            data["loss_scale"] = {}
        elif precision in ("fp32", "bf16", "fp8") and data.get("loss_scale") is not None:
            raise _rule("loss_scale", f"only applies to precision fp16 (precision is {precision}); remove it")
        if precision == "fp8" and data.get("fp8") is None:
            data["fp8"] = {}
        elif precision in ("fp32", "fp16", "bf16") and data.get("fp8") is not None:
            raise _rule("fp8", f"only applies to precision fp8 (precision is {precision}); remove it")
        return data

    @model_validator(mode="wrap")
    @classmethod
    def _legacy_fp8_keys(cls, data: Any, handler: Any) -> Any:
        """Recipes written before ``modules:`` keep loading: their ``fp8.keep_*`` keys become rules placed first
        (they decided before any default did), each with a note the run records (:attr:`legacy_notes`)."""
        fp8 = data.get("fp8") if isinstance(data, Mapping) else None
        if not isinstance(fp8, Mapping) or not any(k in fp8 for k in LEGACY_FP8_KEYS):
            return handler(data)
        _check_legacy(fp8)
        rules, notes = legacy_rules(dict(fp8))
        data = dict(data)
        data["fp8"] = {k: v for k, v in fp8.items() if k not in LEGACY_FP8_KEYS}
        own = data.get("modules", [r.model_dump(exclude_none=True, by_alias=True) for r in DEFAULT_RULES])
        data["modules"] = [*rules, *(own if isinstance(own, (list, tuple)) else [own])]
        spec = handler(data)
        spec._legacy_notes = tuple(notes)
        return spec

    @model_validator(mode="after")
    def _module_rules(self, info: ValidationInfo) -> RecipeSpec:
        if not (info.context or {}).get("phase"):  # a phase's recipe shares the rules checked for the whole run
            module_rules_check(self.modules, self.precisions_declared(), self.storage.master)
        return self

    @model_validator(mode="after")
    def _deepspeed_scaler(self) -> RecipeSpec:
        if self.distributed.strategy == "deepspeed":
            if self.precision == "fp8":
                raise _rule(
                    "distributed.strategy", "deepspeed is not supported with precision fp8 (allowed: none, ddp, fsdp2)"
                )
            ls = self.loss_scale
            if ls is not None:
                if ls.growth_factor != 2.0 or ls.backoff_factor != 0.5:
                    raise _rule(
                        "loss_scale.growth_factor",
                        "DeepSpeed's dynamic scaler only grows by 2 and backs off by 0.5 (allowed: growth_factor 2, backoff_factor 0.5)",
                    )
                if not math.log2(ls.init_scale).is_integer():
                    raise _rule(
                        "loss_scale.init_scale",
                        f"{ls.init_scale:g} must be a power of two with DeepSpeed (initial_scale_power)",
                    )
                if ls.max_scale is not None:
                    raise _rule("loss_scale.max_scale", "DeepSpeed's scaler has no ceiling; remove it")
        return self

    @model_validator(mode="after")
    def _storage(self) -> RecipeSpec:
        if self.phases is None:  # a phased recipe's storage is checked against each phase's precision
            d = self.distributed
            storage_rules(self.storage, self.precision, d.strategy, d.zero_stage)
        return self

    @model_validator(mode="after")
    def _phases(self) -> RecipeSpec:
        if self.phases is not None:
            _phase_rules(self)
        return self

    _rehearse: bool = PrivateAttr(default=False)
    _legacy_notes: tuple[str, ...] = PrivateAttr(default=())

    @property
    def legacy_notes(self) -> tuple[str, ...]:
        """What an old recipe's moved keys became (``fp8.keep_lm_head`` -> a ``modules`` rule), one note each."""
        return self._legacy_notes

    def precisions_declared(self) -> tuple[str, ...]:
        """The recipe's precision and those its phases name (read before the phases are validated as recipes)."""
        return (self.precision, *(p.precision for p in self.phases or ()))

    # -- phases ---------------------------------------------------------------------------------------
    def phase_specs(self) -> tuple[RecipeSpec, ...]:
        """The recipe each phase trains with (validated, rehearsed as this recipe is); ``(self,)`` without phases.
        Made from the recipe as it is now, so a ``model_copy(update=...)`` of its shared sections reaches them."""
        if self.phases is None:
            return (self,)
        return tuple(s.rehearsed(self._rehearse) for s in _phase_rules(self))

    def precisions(self) -> tuple[str, ...]:
        """Every precision the run trains in, in phase order (one entry without phases)."""
        return tuple(s.precision for s in self.phase_specs())

    def autocast_precision(self) -> str:
        """The precision Accelerate is set up with: the recipe's own, or for a phased recipe bf16 when any phase
        autocasts (FP8 layers sit inside BF16 autocast) and fp32 otherwise; the runtime switches per phase."""
        if self.phases is None:
            return self.precision
        return "bf16" if any(p in ("bf16", "fp8") for p in self.precisions()) else "fp32"

    # -- run-time use -----------------------------------------------------------------------------
    @property
    def rehearse(self) -> bool:
        """Whether this recipe is rehearsed (run for hardware this machine lacks; see ``load_recipe``)."""
        return self._rehearse

    def rehearsed(self, flag: bool = True) -> RecipeSpec:
        """A copy of this recipe marked for rehearsal (``flag=True``) or for native execution."""
        copy = self.model_copy()
        copy._rehearse = flag
        return copy

    # -- serialisation ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain data (lists, not tuples), omitting options that do not apply."""
        return json.loads(self.model_dump_json(exclude_none=True, by_alias=True))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)

    @classmethod
    def json_schema(cls) -> dict[str, Any]:
        return cls.model_json_schema()


# -- errors ----------------------------------------------------------------------------------------
