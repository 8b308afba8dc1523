"""The sections of a recipe: the pydantic models of ``loss_scale:``, ``health:``, ``distributed:`` and each entry
of ``phases:``, the strict base every section shares, and the rules each checks on its own. The sections that come
in kinds (``fp8:`` by scaling, ``clipping:`` by method) are in :mod:`hf_mixedprec.recipes.kinds`.

Split out of :mod:`hf_mixedprec.recipes.schema` to keep both modules short: ``schema`` puts these sections together in
:class:`~hf_mixedprec.recipes.schema.RecipeSpec`, checks the rules that span sections, and re-exports the names other
modules read (import them from there). A problem is reported as ``dotted.key: what is wrong (allowed: ...)``
(:func:`_rule`), its key relative to the section that raises it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, create_model, model_validator
from pydantic_core import PydanticCustomError

from hf_mixedprec.recipes.detectors import DETECTORS, EXPERT_DETECTORS, EXPERT_REACTIONS, Detector, Reaction

__all__ = [
    "MAX_AMAX_HISTORY",
    "MAX_PHASES",
    "MAX_STEPS",
    "MAX_WINDOW",
    "PHASE_STRATEGIES",
    "DetectorConfig",
    "DetectorsConfig",
    "DistributedConfig",
    "HealthConfig",
    "LossScaleConfig",
    "PhaseConfig",
]

Precision = Literal["fp32", "fp16", "bf16", "fp8"]


def _rule(key: str, message: str) -> PydanticCustomError:
    """A cross-field rule violation located at ``key`` (relative to the model raising it)."""
    return PydanticCustomError("recipe_rule", "{key}: {message}", {"key": key, "message": message})


#: Upper bounds that keep memory and arithmetic sane (windows and histories are allocated up front).
MAX_WINDOW = 100_000
MAX_AMAX_HISTORY = 65_536
MAX_STEPS = 1_000_000_000


class _Section(BaseModel):
    """Strict: no string-to-number or string-to-bool coercion (``tf32: "yes"`` is refused, not read as True),
    and no NaN/Inf where a number is expected."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, strict=True, allow_inf_nan=False)


def _as_tuple(value: Any) -> Any:
    """YAML gives lists; the frozen schema keeps tuples (strict mode would refuse the list itself)."""
    return tuple(value) if isinstance(value, list) else value


StrTuple = Annotated[tuple[str, ...], BeforeValidator(_as_tuple)]


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


def _det(row: Detector) -> Any:
    """The recipe field of one detector row: a fresh :class:`DetectorConfig` with the row's defaults, its doc."""
    return Field(
        default_factory=lambda: DetectorConfig(threshold=row.threshold, window=row.window, reaction=row.reaction),
        description=row.doc,
    )


class _DetectorsBase(_Section):
    """The detectors, each with defaults that suit LLM fine-tuning."""

    if TYPE_CHECKING:  # the fields are built from DETECTORS below; to a type checker each is a DetectorConfig

        def __init__(self, **detectors: DetectorConfig | dict[str, Any]) -> None: ...

        def __getattr__(self, name: str) -> DetectorConfig: ...

    @model_validator(mode="after")
    def _expert_reactions(self) -> Any:
        for name in EXPERT_DETECTORS:
            reaction = getattr(self, name).reaction
            if reaction not in EXPERT_REACTIONS:
                raise _rule(
                    f"{name}.reaction",
                    f"is {reaction!r}; an MoE routing event is not changed by skipping a step or a precision "
                    f"fallback: use {' | '.join(EXPERT_REACTIONS)}",
                )
        return self

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


# One field per row of the detector table (hf_mixedprec.recipes.detectors), in its order: a new detector is a new row there.
if TYPE_CHECKING:
    DetectorsConfig = _DetectorsBase
else:
    DetectorsConfig = create_model(
        "DetectorsConfig",
        __base__=_DetectorsBase,
        __doc__=_DetectorsBase.__doc__,
        __module__=__name__,
        **{row.name: (DetectorConfig, _det(row)) for row in DETECTORS},
    )


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
    fp8_all_gather: bool = Field(
        False,
        description="fsdp2 with fp8.backend torchao (tensorwise) only: all-gather the FP8 layers' weights in FP8 "
        "(torchao's enable_fsdp_float8_all_gather, half the bytes of BF16) and compute their scales after each "
        "optimizer step with one all-reduce for all of them (precompute_float8_dynamic_scale_for_fsdp).",
    )
    param_dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto",
        description="fsdp2 only: the dtype FSDP2 all-gathers the weights in and the forward sees them in "
        "(MixedPrecisionPolicy.param_dtype). auto: as stored (storage.master; FP32 by default), so the recipe's "
        "autocast computes exactly as in one process; bf16 (bf16/fp8 recipes) or fp16 (fp16 recipes): half the "
        "all-gather bytes, and every parameter, norms included, enters the forward in it.",
    )
    reduce_dtype: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="fsdp2 only: the dtype gradients are reduce-scattered in (MixedPrecisionPolicy.reduce_dtype). "
        "fp32 (default): sums over ranks lose nothing; bf16 (bf16/fp8 recipes): half the bytes, each sum rounded to "
        "8 mantissa bits. Accelerate's own FSDP2 default under bf16 is bf16.",
    )

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
        if self.fp8_all_gather and self.strategy != "fsdp2":
            raise _rule("fp8_all_gather", f"only applies to strategy fsdp2 (strategy is {self.strategy!r}); remove it")
        for key, default in (("param_dtype", "auto"), ("reduce_dtype", "fp32")):
            if getattr(self, key) != default and self.strategy != "fsdp2":
                raise _rule(key, f"only applies to strategy fsdp2 (strategy is {self.strategy!r}); remove it")
        return self

    def check_dtypes(self, precision: str) -> None:
        """FSDP2's 16-bit gather and reduce dtypes must be the recipe's own 16-bit format (``precision``: the
        recipe's or a phase's): BF16 for bf16 and fp8 recipes (FP8 layers run inside BF16 autocast), FP16 for fp16."""
        half = {"bf16": "bf16", "fp8": "bf16", "fp16": "fp16"}.get(precision)
        if self.param_dtype not in ("auto", "fp32") and self.param_dtype != half:
            allowed = "auto, fp32" + (f", {half}" if half else "")
            raise _rule(
                "param_dtype",
                f"{self.param_dtype} under precision {precision} would compute in another format than the recipe's "
                f"(allowed: {allowed})",
            )
        if self.reduce_dtype == "bf16" and half != "bf16":
            why = (
                "loss-scaled FP16 gradients are unscaled after the reduction, and BF16 would round them before"
                if precision == "fp16"
                else "an fp32 recipe keeps its gradients in FP32"
            )
            raise _rule("reduce_dtype", f"bf16 under precision {precision}: {why} (allowed: fp32)")


#: At most this many phases (each is validated as a recipe of its own).
MAX_PHASES = 32
#: ``distributed.strategy`` values under which layers can be swapped in place at a phase boundary (under fsdp2 the
#: swapped-in layer holds the same sharded parameters and the FSDP2 unit is pointed at it).
PHASE_STRATEGIES: tuple[str, ...] = ("none", "ddp", "fsdp2")


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
