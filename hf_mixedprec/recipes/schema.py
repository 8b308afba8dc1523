"""The recipe schema: one validated, immutable description of how to train on one GPU generation.

A recipe is YAML on disk (read by :mod:`hf_mixedprec.recipes.files`) and a frozen pydantic model in memory.
Everything a user can type is checked here, and every problem is reported as ``dotted.key: what is wrong
(allowed: ...)``. Key names follow Transformer Engine / torch spellings (``amax_history_len``,
``amax_compute_algo``, ``init_scale``, ``growth_interval``) and each option has exactly one spelling. What a
recipe does to a Trainer or an Accelerate loop is in :mod:`hf_mixedprec.integrations.recipe` (``recipe.callbacks()``...).

The sections (``loss_scale:``, ``health:``, ``distributed:``, ``phases:``) are defined in
:mod:`hf_mixedprec.recipes.sections`, those that come in kinds (``fp8:`` by scaling, ``clipping:`` by method) in
:mod:`hf_mixedprec.recipes.kinds`, and re-exported here; this module puts them together in :class:`RecipeSpec`
and checks the rules that span sections (precision vs. its sections, DeepSpeed, storage, each phase as a recipe).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import yaml
from pydantic import BeforeValidator, Field, PrivateAttr, ValidationError, ValidationInfo, model_validator
from pydantic_core import PydanticCustomError

from hf_mixedprec.recipes.detectors import NVFP4_LAYER_THRESHOLDS
from hf_mixedprec.recipes.kinds import (
    CLIP_DEFAULTS,
    TORCHAO_AMAX_EPS,
    AGCConfig,
    AutoClipConfig,
    BlockwiseFP8Config,
    ClippingConfig,
    ClippingSection,
    CurrentFP8Config,
    DelayedFP8Config,
    FP8Config,
    FP8Section,
    MXFP8Config,
    NoClipConfig,
    NormClipConfig,
    NVFP4Config,
    ZClipConfig,
    fp8_options_dropped_on_switch,
)
from hf_mixedprec.recipes.modules_config import (
    DEFAULT_RULES,
    LEGACY_FP8_KEYS,
    ModuleRule,
    legacy_rules,
    module_rules_check,
)
from hf_mixedprec.recipes.sections import (
    MAX_PHASES,
    MAX_STEPS,
    PHASE_STRATEGIES,
    DetectorConfig,
    DetectorsConfig,
    DistributedConfig,
    HealthConfig,
    LossScaleConfig,
    PhaseConfig,
    Precision,
    _as_tuple,
    _rule,
    _Section,
)
from hf_mixedprec.recipes.storage_config import StorageConfig, storage_rules

__all__ = [
    "ACCELERATE_MIXED_PRECISION",
    "CLIP_DEFAULTS",
    "GENERATIONS",
    "MAX_STEPS",
    "RECIPE_ENV",
    "TORCHAO_AMAX_EPS",
    "AGCConfig",
    "AutoClipConfig",
    "BlockwiseFP8Config",
    "ClippingConfig",
    "ClippingSection",
    "CurrentFP8Config",
    "DelayedFP8Config",
    "DetectorConfig",
    "DetectorsConfig",
    "DistributedConfig",
    "FP8Config",
    "FP8Section",
    "HealthConfig",
    "LossScaleConfig",
    "MXFP8Config",
    "ModuleRule",
    "NVFP4Config",
    "NoClipConfig",
    "NormClipConfig",
    "PhaseConfig",
    "RecipeSpec",
    "StorageConfig",
    "ZClipConfig",
]

Generation = Literal["cpu", "mps", "volta", "turing", "ampere", "ada", "hopper", "blackwell"]
GENERATIONS: tuple[str, ...] = ("cpu", "mps", "volta", "turing", "ampere", "ada", "hopper", "blackwell")

#: Accelerate's ``mixed_precision`` for each recipe precision: FP8 layers run inside BF16 autocast, applied by
#: hf_mixedprec (Accelerate's own ``fp8`` is Transformer Engine's, chosen only by ``hf-mixedprec launch``).
ACCELERATE_MIXED_PRECISION: dict[str, str] = {"fp32": "no", "fp16": "fp16", "bf16": "bf16", "fp8": "bf16"}

#: Environment variable through which ``hf-mixedprec launch`` hands the resolved recipe to its child.
RECIPE_ENV = "HF_MIXEDPREC_RECIPE"

#: Rules in ``modules:`` (each is matched against every module name once, at attach).
MAX_RULES = 256


def _rule_list(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(value)
    raise _rule("", f"{repr(value)[:60]} is not a list of rules (allowed: a list of mappings, see docs/modules.md)")


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


def _nvfp4_thresholds(health: Any) -> Any:
    """``health`` with each per-layer detector's threshold that it leaves unset taken from
    :data:`~hf_mixedprec.recipes.detectors.NVFP4_LAYER_THRESHOLDS` (an nvfp4 recipe's defaults); a section that is
    not a mapping is left for its own validation to report."""
    if health is None:
        health = {}
    if not isinstance(health, Mapping):
        return health
    detectors = health.get("detectors")
    if detectors is None:
        detectors = {}
    if not isinstance(detectors, Mapping):
        return health
    detectors = dict(detectors)
    for name, threshold in NVFP4_LAYER_THRESHOLDS.items():
        entry = detectors.get(name)
        if entry is None:
            detectors[name] = {"threshold": threshold}
        elif isinstance(entry, Mapping) and "threshold" not in entry:
            detectors[name] = {**entry, "threshold": threshold}
    return {**health, "detectors": detectors}


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
            dropped = fp8_options_dropped_on_switch(own.get("scaling"), wanted["scaling"])
            own = {k: v for k, v in own.items() if k not in dropped}
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
            f"{', '.join(PHASE_STRATEGIES)}): DeepSpeed's engine flattens the parameters into its own buffers at "
            "the start, so no layer can be swapped at a boundary",
        )
    if spec.distributed.fp8_all_gather:
        raise _rule(
            "distributed.fp8_all_gather",
            "not with phases: torchao wraps the FP8 layers' weights for the FP8 all-gather once, before FSDP2 shards "
            "them, so a phase boundary cannot change which weights are gathered in FP8 (allowed: false)",
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
    if spec.distributed.strategy == "fsdp2":
        for i, one in enumerate(out[1:], start=1):
            if one.fp8 is not None and one.fp8.backend == "transformer_engine":
                raise _rule(
                    f"phases.{i}.fp8.backend",
                    "transformer_engine cannot enter at a phase boundary under distributed.strategy fsdp2: its "
                    "layers own new parameters, which the sharded model and optimizer have never seen (allowed: "
                    "torchao, native, emulated, or auto where Transformer Engine is not installed)",
                )
    return tuple(out)


#: DeepSpeed ZeRO stages an FP8 recipe trains under (DeepSpeed in FP32, hf_mixedprec's FP8 layers and BF16 autocast).
DEEPSPEED_FP8_STAGES: tuple[int, ...] = (1, 2, 3)


def _fp8_under_zero3(spec: RecipeSpec) -> None:
    """What an FP8 recipe cannot do under ZeRO-3, each refused in one line. ZeRO-3 gathers a module's partitioned
    weights through hooks DeepSpeed registers on the modules it finds at ``deepspeed.initialize``
    (deepspeed/runtime/zero/parameter_offload.py): the FP8 layers are converted before that and keep them, but a
    ``fallback`` moves FP8 layers to BF16 as new modules without them (a layer's own detector moves that layer, a
    step detector every FP8 layer), their weights a rank's partition. ``zero3_init`` builds the model already
    partitioned, before the FP8 conversion reads each weight."""
    for name, detector in spec.health.detectors:
        if getattr(detector, "reaction", None) == "fallback":
            raise _rule(
                f"health.detectors.{name}.reaction",
                "'fallback' with precision fp8 under deepspeed zero_stage 3: the layers moved to BF16 would be modules "
                "DeepSpeed never hooked, so their partitioned weights would not be gathered (allowed: any other "
                "reaction; or zero_stage 1/2, ddp, fsdp2)",
            )
    if spec.distributed.zero3_init:
        raise _rule(
            "distributed.zero3_init",
            "true with precision fp8: the model would be built already partitioned, and the FP8 conversion reads "
            "each Linear's whole weight before DeepSpeed starts (allowed: false)",
        )


class RecipeSpec(_Section):
    """A complete, validated mixed-precision training recipe (what :class:`hf_mixedprec.integrations.recipe.Recipe` adds:
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
    fp8: FP8Section | None = Field(None, description="fp8 only: FP8 scaling and what stays in BF16.")
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
    clipping: ClippingSection = Field(default_factory=ClippingConfig, description="Gradient clipping.")
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
        fp8 = data.get("fp8")
        if precision == "fp8" and isinstance(fp8, Mapping) and fp8.get("scaling") == "nvfp4":
            data["health"] = _nvfp4_thresholds(data.get("health"))
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
    def _fp8_all_gather(self) -> RecipeSpec:
        if not self.distributed.fp8_all_gather:
            return self
        fp8 = self.fp8
        recipe = fp8.torchao_recipe if isinstance(fp8, CurrentFP8Config) else None  # backend torchao: always current
        if fp8 is None or fp8.backend != "torchao" or recipe != "tensorwise":
            if fp8 is None:
                have = "no fp8 section"
            else:
                have = f"fp8.backend {fp8.backend!r}" + (
                    f", torchao_recipe {recipe!r}" if fp8.backend == "torchao" else ""
                )
            raise _rule(
                "distributed.fp8_all_gather",
                f"needs fp8.backend torchao with torchao_recipe tensorwise (this recipe has {have}): torchao's FP8 "
                "all-gather casts weights with one scale per tensor",
            )
        return self

    @model_validator(mode="after")
    def _deepspeed_scaler(self) -> RecipeSpec:
        if self.distributed.strategy == "deepspeed":
            stage = self.distributed.zero_stage
            if self.precision == "fp8" and stage not in DEEPSPEED_FP8_STAGES:
                raise _rule(
                    "distributed.zero_stage",
                    f"{stage} with precision fp8: stage 0 is DeepSpeed without ZeRO: use distributed.strategy ddp "
                    f"for that (allowed with fp8: zero_stage {', '.join(map(str, DEEPSPEED_FP8_STAGES))}; or strategy "
                    "ddp/fsdp2)",
                )
            if self.precision == "fp8" and stage == 3:
                _fp8_under_zero3(self)
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
    def _fsdp2_dtypes(self) -> RecipeSpec:
        try:
            self.distributed.check_dtypes(self.precision)
        except PydanticCustomError as exc:
            raise _rule(f"distributed.{exc.context['key']}", exc.context["message"]) from None  # type: ignore[index]
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
    _auto_notes: tuple[str, ...] = PrivateAttr(default=())

    @property
    def legacy_notes(self) -> tuple[str, ...]:
        """What an old recipe's moved keys became (``fp8.keep_lm_head`` -> a ``modules`` rule), one note each."""
        return self._legacy_notes

    @property
    def auto_notes(self) -> tuple[str, ...]:
        """Why ``auto`` chose this recipe on this machine (its fallbacks), for the run report; empty when it was named."""
        return self._auto_notes

    def chosen_by_auto(self, notes: tuple[str, ...] | list[str]) -> RecipeSpec:
        """A copy that remembers the notes ``auto`` gave when it chose this recipe."""
        copy = self.model_copy()
        copy._auto_notes = tuple(notes)
        return copy

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
