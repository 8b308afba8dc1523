"""The recipe sections that come in kinds: ``fp8:`` (one model per ``scaling``) and ``clipping:`` (one per
``method``), each kind with only the keys that apply to it, so that an option of another kind cannot be written.

Each family has a base (:class:`FP8Config`, :class:`ClippingConfig`) that code names for "any such section":
constructing it or calling its ``model_validate`` builds the kind the data names (``FP8Config(scaling="current")``
is a :class:`CurrentFP8Config`), and the recipe holds a pydantic discriminated union of the kinds
(:data:`FP8Section`, :data:`ClippingSection`). A key of another kind is refused by the kind's own validator with
the message the flat section always gave (``margin: does not apply to scaling 'current' (it applies to: delayed,
mxfp8); remove it``); set to null it is dropped, which is how a recipe that extends another removes one. A dump
keeps the one flat shape of the section (every key, null where it does not apply). Split out of
:mod:`hf_mixedprec.recipes.sections`, whose strict base and rule errors these share.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, get_args

from pydantic import (
    Discriminator,
    Field,
    GetJsonSchemaHandler,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    Tag,
    create_model,
    model_serializer,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue

from hf_mixedprec.core._text import shown
from hf_mixedprec.core.formats import FP8_SCALING_DEFAULTS
from hf_mixedprec.recipes.sections import MAX_AMAX_HISTORY, MAX_STEPS, MAX_WINDOW, _rule, _Section

__all__ = [
    "CLIP_DEFAULTS",
    "TORCHAO_AMAX_EPS",
    "AGCConfig",
    "AutoClipConfig",
    "BlockwiseFP8Config",
    "ClippingConfig",
    "ClippingSection",
    "CurrentFP8Config",
    "DelayedFP8Config",
    "FP8Config",
    "FP8Section",
    "MXFP8Config",
    "NoClipConfig",
    "NormClipConfig",
    "ZClipConfig",
]


class _Kinded(_Section):
    """A section that is one of several kinds, chosen by one key (``SELECTOR``); each kind is a subclass whose
    selector field is a one-value ``Literal``. The family's base (the subclass that sets ``KINDS``) stands for "any
    kind": building it builds the kind the data names, so no path (YAML, ``model_validate``, keywords) can make a
    section holding another kind's option."""

    SELECTOR: ClassVar[str]
    #: Every key any kind accepts, in the order the flat section always had (dumps and error messages use it).
    SECTION_KEYS: ClassVar[tuple[str, ...]]
    #: The family's kinds by selector value, in definition order (filled as each kind class is made).
    KINDS: ClassVar[dict[str, type[Any]]]

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        """Register a kind (a class whose selector is a one-value Literal) with its family."""
        super().__pydantic_init_subclass__(**kwargs)
        values = get_args(cls.model_fields[cls.SELECTOR].annotation)
        if len(values) == 1:
            cls.KINDS[values[0]] = cls

    @classmethod
    def family(cls) -> type[_Kinded]:
        """The family's base: the class that owns ``KINDS``."""
        return next(c for c in cls.__mro__ if "KINDS" in c.__dict__)

    @classmethod
    def kind(cls) -> str:
        """This kind's selector value (a family's base has none: it is never validated itself)."""
        values = get_args(cls.model_fields[cls.SELECTOR].annotation)
        if len(values) != 1:
            raise TypeError(
                f"{cls.__name__} stands for any of {', '.join(k.__name__ for k in cls.KINDS.values())}: build it "
                f"with {cls.__name__}(...) or {cls.__name__}.model_validate(...), which pick the kind; a pydantic "
                "field that holds any of them takes their union (FP8Section, ClippingSection)"
            )
        return str(values[0])

    @classmethod
    def kind_of(cls, data: Any) -> str:
        """The kind ``data`` (a mapping or a section) names: the family default when it names none or no valid one
        (that kind's validator then reports the value). The discriminator of the recipe's union."""
        default = cls.family().model_fields[cls.SELECTOR].default
        value = data.get(cls.SELECTOR, default) if isinstance(data, Mapping) else getattr(data, cls.SELECTOR, default)
        return value if isinstance(value, str) and value in cls.KINDS else default

    def __new__(cls, *args: Any, **data: Any) -> Any:
        """``Family(**data)`` builds the kind ``data`` names (a kind class builds itself)."""
        kind = cls.KINDS[cls.kind_of(data)] if cls.family() is cls else cls
        return super().__new__(kind)

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """``Family.model_validate(data)`` validates ``data`` as the kind it names."""
        if cls.family() is cls:
            return cls.KINDS[cls.kind_of(obj)].model_validate(obj, **kwargs)
        return super().model_validate(obj, **kwargs)

    @classmethod
    def model_validate_json(cls, json_data: str | bytes | bytearray, **kwargs: Any) -> Any:  # type: ignore[override]
        """``Family.model_validate_json(text)`` validates the JSON object as the kind it names."""
        if cls.family() is cls:
            try:
                data = json.loads(json_data)
            except ValueError:  # not JSON: the default kind's validation says so, as pydantic would
                data = None
            return cls.KINDS[cls.kind_of(data)].model_validate_json(json_data, **kwargs)
        return super().model_validate_json(json_data, **kwargs)

    if not TYPE_CHECKING:  # pydantic's own __getattr__ is hidden from type checkers the same way

        def __getattr__(self, name: str) -> Any:
            """Another kind's option reads None, as the one flat section held it (``recipe.fp8.margin`` on current
            scaling); writing one is what a kind refuses."""
            try:
                return super().__getattr__(name)
            except AttributeError:
                if name in type(self).SECTION_KEYS:
                    return None
                raise

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Any:
        """pydantic's copy; an ``update`` that names another kind (``{"scaling": "delayed"}``) builds that kind, validated,
        from this section's options the new kind also has and the update (pydantic would keep this kind's class)."""
        sel = self.SELECTOR
        if not update or sel not in update or update[sel] == self.kind():
            return super().model_copy(update=update, deep=deep)
        family = self.family()
        target = family.KINDS.get(update[sel]) if isinstance(update[sel], str) else None
        own = self.model_dump(exclude_unset=True)
        kept = {k: v for k, v in own.items() if k != sel and (target is None or k in target.model_fields)}
        return family.model_validate({**kept, **update})

    @classmethod
    def _selected(cls, data: Mapping[str, Any]) -> str:
        """The selector value ``data`` gives (this kind's when absent). One that names no kind is refused together
        with every other problem of the section: each key is checked against its own field, as in one flat model
        (the selector's ``Literal`` there lists every kind, so that check always fails)."""
        value = data.get(cls.SELECTOR, cls.kind())
        if not (isinstance(value, str) and value in cls.KINDS):
            _every_key_model(cls.family()).model_validate(data)
            raise TypeError(f"{cls.SELECTOR} {shown(value)} passed a Literal that lists only the kinds")  # never
        return value

    @classmethod
    def _foreign_nulls_dropped(cls, data: dict[str, Any]) -> dict[str, Any]:
        """``data`` without the keys of other kinds set to null (a recipe extending another removes one so; a dump
        carries them)."""
        return {
            k: v for k, v in data.items() if not (v is None and k in cls.SECTION_KEYS and k not in cls.model_fields)
        }

    @model_serializer(mode="wrap")
    def _flat(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> dict[str, Any]:
        """Dumped in the section's one flat shape: keys in ``SECTION_KEYS`` order and, unless excluded (by
        ``exclude_none``, ``include``...), those of other kinds as null, so a dumped recipe reads as it always has."""
        data = handler(self)
        fill = not (info.exclude_none or info.exclude_unset or info.exclude_defaults or info.include)
        skip = info.exclude or ()
        sel = self.SELECTOR
        wanted = sel not in skip and (info.include is None or sel in info.include)
        if sel not in data and wanted and self.kind() != self.family().model_fields[sel].default:
            data[sel] = self.kind()  # another kind than the default is never left out: a reload would change it
        own = type(self).model_fields
        return {k: data.get(k) for k in self.SECTION_KEYS if k in data or (fill and k not in own and k not in skip)}

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: Any, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        """A kind's JSON schema as the recipe reads it: the keys of other kinds allowed as null (how a recipe that
        extends another removes one), and the selector required except for the family's default kind (a section
        without it is that kind), so that exactly one kind matches any section."""
        ref = handler(core_schema)
        schema = handler.resolve_ref_schema(ref)
        if cls.family() is cls:
            return ref
        props = schema.setdefault("properties", {})
        for key in cls.SECTION_KEYS:
            props.setdefault(key, {"type": "null"})
        if cls.kind() != cls.family().model_fields[cls.SELECTOR].default:
            schema.setdefault("required", []).append(cls.SELECTOR)
        return ref


@functools.cache
def _every_key_model(family: type[_Kinded]) -> type[_Section]:
    """One model with every key of ``family`` (each as the base or its first kind declares it) and no rule across
    keys: it only lists the problems of a section whose selector names no kind, and never validates one."""
    fields: dict[str, Any] = {}
    for key in family.SECTION_KEYS:
        owners = [family, *family.KINDS.values()]
        field = next(o.model_fields[key] for o in owners if key in o.model_fields)
        fields[key] = (field.annotation, field)
    return create_model(family.__name__, __base__=_Section, __module__=__name__, **fields)


# -- fp8: one kind per scaling ---------------------------------------------------------------------------------

_FP8_SCALING_ONLY = (
    "amax_history_len",
    "amax_compute_algo",
    "margin",
    "epsilon",
    "power_2_scales",
    "mx_rounding",
    "block_size",
    "weight_2d",
    "rht",
    "rht_signs",
    "stochastic_rounding",
    "sr_seed",
)


def fp8_options_dropped_on_switch(old: str | None, new: str | None) -> set[str]:
    """The ``fp8`` options a recipe stops inheriting when it switches the scaling from ``old`` to ``new`` (a child
    through ``extends`` or a ``phases:`` entry): those of the old scaling, and ``format`` across nvfp4 and an FP8
    scaling (E2M1 values with E4M3 block scales: an FP8 format does not carry over, either way)."""
    old, new = old or "delayed", new or "delayed"  # unset is the default scaling: no switch to an explicit one
    if old == new:
        return set()
    dropped = set(_FP8_SCALING_ONLY)
    if "nvfp4" in (old, new):
        dropped.add("format")
    return dropped


_ALLOWED_BLOCK_SIZE = {"mxfp8": (32,), "blockwise": (128,), "nvfp4": (16,)}
_DELAYED, _CURRENT, _MX, _BLOCKWISE, _NVFP4 = (
    FP8_SCALING_DEFAULTS[s] for s in ("delayed", "current", "mxfp8", "blockwise", "nvfp4")
)

# Options more than one scaling has (each kind sets its own default).
_Margin = Annotated[
    int | None,
    Field(
        ge=0,
        le=64,
        description="delayed/mxfp8: scale is divided by 2**margin (at most 64: beyond it every value underflows).",
    ),
]
_Power2 = Annotated[bool | None, Field(description="current/blockwise: round scales down to a power of two.")]
_BlockSize = Annotated[
    int | None,
    Field(ge=1, le=4096, description="mxfp8: 32 (OCP MX); blockwise: 128 (TE); nvfp4: 16 (TE); at most 4096."),
]
# Declared in each kind, after its options, so that a section's fields (and its errors) keep the flat order.
_Align = Annotated[
    int, Field(ge=1, description="Linear layers whose in/out features are not multiples of this stay in BF16.")
]


class FP8Config(_Kinded):
    """FP8 training settings (only with ``precision: fp8``).

    Any ``fp8:`` section: one of :class:`DelayedFP8Config`, :class:`CurrentFP8Config`, :class:`MXFP8Config`,
    :class:`BlockwiseFP8Config`, :class:`NVFP4Config` by ``scaling`` (delayed when absent); ``FP8Config(...)``
    builds that kind."""

    SELECTOR: ClassVar[str] = "scaling"
    SECTION_KEYS: ClassVar[tuple[str, ...]] = (
        "backend",
        "scaling",
        "format",
        *_FP8_SCALING_ONLY,
        "torchao_recipe",
        "align",
    )
    KINDS: ClassVar[dict[str, type[Any]]] = {}

    backend: Literal["auto", "transformer_engine", "torchao", "native", "emulated"] = Field(
        "auto",
        description="Who runs the FP8 math: auto picks transformer_engine on CUDA, else torchao for current scaling, "
        "else refuses loudly; native: hf_mixedprec's quantizers on torch._scaled_mm (delayed, current); emulated: "
        "exact FP8 values with float32 GEMMs, anywhere.",
    )
    scaling: Literal["delayed", "current", "mxfp8", "blockwise", "nvfp4"] = Field(
        "delayed",
        description="How scales are chosen: amax history, amax now, per-32-block E8M0, 1x128/128x128 tiles, or "
        "NVFP4 (FP4 E2M1 values, an E4M3 scale per 16 and an FP32 one per tensor).",
    )
    format: Literal["HYBRID", "E4M3"] = Field(
        "HYBRID", description="HYBRID = E4M3 forward, E5M2 gradients; E4M3 = E4M3 everywhere. Pure E5M2 is refused."
    )
    if TYPE_CHECKING:  # every kind declares it last (see _Align)
        align: int

    @model_validator(mode="before")
    @classmethod
    def _scaling_options(cls, data: Any) -> Any:
        """The rules across keys, before the fields: pure E5M2, what torchao and native can run, and no option of
        another scaling (a null one is dropped, so the kind's default applies)."""
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        if str(data.get("format", "")).upper() == "E5M2":
            raise _rule("format", "pure E5M2 training is refused (Transformer Engine refuses it too); use HYBRID")
        scaling = cls._selected(data)
        if scaling != cls.kind():
            return data  # a kind built by its own name, given another's scaling: its scaling field reports it
        backend = data.get("backend", "auto")
        if backend == "torchao":
            _torchao_rules(data, scaling)
        elif backend == "native" and scaling == "nvfp4":
            raise _rule(
                "backend",
                "native has no NVFP4 GEMM yet (torch's scaled_mm takes 1x16 E4M3 block scales only on compute "
                "capability 10.x, which hf_mixedprec has not been run on); use emulated (any device, the exact "
                "rehearsal) or transformer_engine (NVFP4BlockScaling, TE >= 2.9 on a B200)",
            )
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
                if key in data and data[key] is None:
                    del data[key]  # null means the default
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
        return cls._foreign_nulls_dropped(data)

    def options(self) -> dict[str, Any]:
        """The scaling-specific options that apply to this recipe's scaling (resolved)."""
        return {k: getattr(self, k) for k in FP8_SCALING_DEFAULTS[self.scaling]}


class DelayedFP8Config(FP8Config):
    """Delayed scaling (TE ``DelayedScaling``): each scale comes from a history of past amaxes."""

    scaling: Literal["delayed"] = "delayed"
    amax_history_len: int | None = Field(
        _DELAYED["amax_history_len"],
        ge=1,
        le=MAX_AMAX_HISTORY,
        description=f"delayed only: amax history length (TE default 1024; at most {MAX_AMAX_HISTORY}, kept per layer).",
    )
    amax_compute_algo: Literal["max", "most_recent"] | None = Field(
        _DELAYED["amax_compute_algo"],
        description="delayed only: scale from the max of the history or the most recent amax.",
    )
    margin: _Margin = _DELAYED["margin"]
    align: _Align = 16


class CurrentFP8Config(FP8Config):
    """Current scaling (TE ``Float8CurrentScaling``, torchao): each scale from the tensor's amax now; the one
    scaling backend torchao runs, so the only kind with ``torchao_recipe``."""

    scaling: Literal["current"] = "current"
    epsilon: float | None = Field(
        _CURRENT["epsilon"], ge=0, description="current only: amax floor before computing the scale."
    )
    power_2_scales: _Power2 = _CURRENT["power_2_scales"]
    torchao_recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] | None = Field(
        None,
        description="backend torchao only: torchao's float8 recipe name (default tensorwise); MoE experts follow it "
        "per expert (rowwise: torchao's moe_training FP8 grouped GEMM).",
    )
    align: _Align = 16


class MXFP8Config(FP8Config):
    """MXFP8 (OCP MX v1.0): 32-element blocks, each with an E8M0 scale."""

    scaling: Literal["mxfp8"] = "mxfp8"
    margin: _Margin = _MX["margin"]
    mx_rounding: Literal["rceil", "floor"] | None = Field(
        _MX["mx_rounding"],
        description="mxfp8 only: rceil (TE/hardware, never saturates) or floor (OCP spec, may saturate).",
    )
    block_size: _BlockSize = _MX["block_size"]
    align: _Align = 16


class BlockwiseFP8Config(FP8Config):
    """Blockwise scaling (TE ``Float8BlockScaling``): 1x128 activation/gradient tiles, 128x128 weight blocks."""

    scaling: Literal["blockwise"] = "blockwise"
    power_2_scales: _Power2 = _BLOCKWISE["power_2_scales"]
    block_size: _BlockSize = _BLOCKWISE["block_size"]
    align: _Align = 16


class NVFP4Config(FP8Config):
    """NVFP4 (TE ``NVFP4BlockScaling``; NVIDIA, "Pretraining Large Language Models with NVFP4", 2025): FP4 E2M1
    values, an E4M3 scale per 16 elements along the GEMM's contraction dim, an FP32 scale per tensor; the
    published recipe's three techniques each with a switch (TE's ``disable_*`` options, here on by default as
    there)."""

    scaling: Literal["nvfp4"] = "nvfp4"
    block_size: _BlockSize = _NVFP4["block_size"]
    weight_2d: bool | None = Field(
        _NVFP4["weight_2d"],
        description="nvfp4 only: weights in 16x16 blocks, so a weight quantizes the same in forward and backward "
        "(TE: not disable_2d_quantization); false: 1x16 along each GEMM's contraction dim.",
    )
    rht: bool | None = Field(
        _NVFP4["rht"],
        description="nvfp4 only: a 16-point random Hadamard transform on both inputs of the weight-gradient GEMM "
        "(TE: not disable_rht).",
    )
    rht_signs: list[Literal[-1, 1]] | None = Field(
        _NVFP4["rht_signs"],
        min_length=16,
        max_length=16,
        description="nvfp4 only: the transform's 16 signs (+1/-1); null: Transformer Engine's fixed vector.",
    )
    stochastic_rounding: bool | None = Field(
        _NVFP4["stochastic_rounding"],
        description="nvfp4 only: gradients rounded stochastically, everything else to nearest even "
        "(TE: not disable_stochastic_rounding).",
    )
    sr_seed: int | None = Field(
        _NVFP4["sr_seed"],
        ge=0,
        lt=2**31,
        description="nvfp4 only: seed of the rehearsal's stochastic rounding (reproducible, resumed exactly); TE's "
        "hardware draws its own bits.",
    )
    align: _Align = 16

    @model_validator(mode="before")
    @classmethod
    def _e4m3_only(cls, data: Any) -> Any:
        """``format`` names the block scales' format here, E4M3 (TE's only choice, and the default); HYBRID (E5M2
        gradients) has no NVFP4 meaning: NVFP4 values are E2M1 in every GEMM."""
        if not isinstance(data, Mapping):
            return data
        if data.get("format") is None:
            return {**data, "format": "E4M3"}
        if str(data["format"]).upper() != "E4M3":
            raise _rule(
                "format",
                f"{data['format']!r} does not apply to scaling 'nvfp4' (allowed: E4M3, the block scales' format; "
                "NVFP4 values are E2M1 in every GEMM, gradients too)",
            )
        return data


#: The recipe's ``fp8:`` field: the kind its ``scaling`` names (delayed when absent).
FP8Section = Annotated[
    Annotated[DelayedFP8Config, Tag("delayed")]
    | Annotated[CurrentFP8Config, Tag("current")]
    | Annotated[MXFP8Config, Tag("mxfp8")]
    | Annotated[BlockwiseFP8Config, Tag("blockwise")]
    | Annotated[NVFP4Config, Tag("nvfp4")],
    Discriminator(FP8Config.kind_of),
]

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


# -- clipping: one kind per method -----------------------------------------------------------------------------

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
_MaxNorm = Annotated[float | None, Field(gt=0, description="norm: the threshold; zclip: optional hard cap.")]


class ClippingConfig(_Kinded):
    """Gradient clipping: fixed norm, or adaptive (ZClip, AutoClip, AGC).

    Any ``clipping:`` section: one of :class:`NoClipConfig`, :class:`NormClipConfig`, :class:`ZClipConfig`,
    :class:`AutoClipConfig`, :class:`AGCConfig` by ``method`` (zclip when absent); ``ClippingConfig(...)`` builds
    that kind. A parameter given as null stays null (``history_size: null``: AutoClip keeps every norm)."""

    SELECTOR: ClassVar[str] = "method"
    SECTION_KEYS: ClassVar[tuple[str, ...]] = ("method", *_CLIP_PARAMS)
    KINDS: ClassVar[dict[str, type[Any]]] = {}

    method: ClipMethod = Field("zclip", description="none | norm | zclip | autoclip | agc.")

    @model_validator(mode="before")
    @classmethod
    def _method_options(cls, data: Any) -> Any:
        """No parameter of another method (a null one is dropped)."""
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        method = cls._selected(data)
        if method != cls.kind():
            return data  # a kind built by its own name, given another's method: its method field reports it
        applicable = CLIP_DEFAULTS[method]
        for key in _CLIP_PARAMS:
            if key not in applicable and data.get(key) is not None:
                users = [m for m, opts in CLIP_DEFAULTS.items() if key in opts]
                raise _rule(key, f"does not apply to method {method!r} (it applies to: {', '.join(users)}); remove it")
        return cls._foreign_nulls_dropped(data)

    def params(self) -> dict[str, Any]:
        """The parameters that apply to this method (resolved)."""
        return {k: getattr(self, k) for k in CLIP_DEFAULTS[self.method]}


class NoClipConfig(ClippingConfig):
    """No clipping."""

    method: Literal["none"] = "none"


class NormClipConfig(ClippingConfig):
    """Clip the global gradient norm at a fixed threshold."""

    method: Literal["norm"] = "norm"
    max_norm: _MaxNorm = CLIP_DEFAULTS["norm"]["max_norm"]


class ZClipConfig(ClippingConfig):
    """ZClip: clip steps whose gradient norm is a z-score outlier of its running mean and variance."""

    method: Literal["zclip"] = "zclip"
    max_norm: _MaxNorm = CLIP_DEFAULTS["zclip"]["max_norm"]
    alpha: float | None = Field(
        CLIP_DEFAULTS["zclip"]["alpha"], gt=0, lt=1, description="zclip: EMA factor for the norm mean/variance."
    )
    z_thresh: float | None = Field(
        CLIP_DEFAULTS["zclip"]["z_thresh"], gt=0, description="zclip: z-score above which a step is clipped."
    )
    warmup_steps: int | None = Field(
        CLIP_DEFAULTS["zclip"]["warmup_steps"],
        ge=1,
        le=MAX_STEPS,
        description="zclip: steps used to initialise mean/variance.",
    )


class AutoClipConfig(ClippingConfig):
    """AutoClip: clip at a percentile of the gradient-norm history."""

    method: Literal["autoclip"] = "autoclip"
    percentile: float | None = Field(
        CLIP_DEFAULTS["autoclip"]["percentile"], gt=0, le=100, description="autoclip: percentile of the norm history."
    )
    history_size: int | None = Field(
        CLIP_DEFAULTS["autoclip"]["history_size"],
        ge=1,
        le=MAX_WINDOW,
        description=f"autoclip: how many past norms are kept (at most {MAX_WINDOW:,}, kept in memory).",
    )


class AGCConfig(ClippingConfig):
    """AGC: clip each unit's gradient relative to its weight norm."""

    method: Literal["agc"] = "agc"
    clip_factor: float | None = Field(
        CLIP_DEFAULTS["agc"]["clip_factor"], gt=0, description="agc: lambda, the allowed grad/weight norm ratio."
    )
    eps: float | None = Field(CLIP_DEFAULTS["agc"]["eps"], gt=0, description="agc: floor for weight norms.")


#: The recipe's ``clipping:`` field: the kind its ``method`` names (zclip when absent).
ClippingSection = Annotated[
    Annotated[NoClipConfig, Tag("none")]
    | Annotated[NormClipConfig, Tag("norm")]
    | Annotated[ZClipConfig, Tag("zclip")]
    | Annotated[AutoClipConfig, Tag("autoclip")]
    | Annotated[AGCConfig, Tag("agc")],
    Discriminator(ClippingConfig.kind_of),
]
