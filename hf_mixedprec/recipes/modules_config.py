"""The recipe's ``modules:`` section: ordered per-module precision rules, the first that matches a module wins.

A few modules decide whether low precision is stable, and every serious training stack keeps them apart:
Megatron-LM (``--first-last-layers-bf16``, ``--moe-router-dtype fp32``, a precision config of glob matchers, first
match wins), torchtitan's float8 converter (``filter_fqns``: its float8 docs keep ``output``, the LM head, and for MoE
``router.gate`` out),
Accelerate's FP8 path (first and last Linear kept out). A rule here names modules by

* ``match``: fnmatch globs on the qualified module name (``model.layers.*.mlp.down_proj``),
* ``class``: module class names (the class or any base class, e.g. ``LlamaRMSNorm``, ``Linear``),
* ``select``: a shorthand: ``lm_head`` (the output projection), ``embeddings``, ``norms``, ``moe_routers``,
  ``experts`` (MoE experts modules),
* ``first_blocks`` / ``last_blocks`` / ``first_last_blocks``: the first / last N transformer blocks
  (``last_blocks_share``: the last share of them, for a rule that scales with depth),

(several of them in one rule must all hold) and sets any of ``compute`` (``fp32``: outside autocast with FP32
inputs; ``bf16`` / ``fp16``: an autocast region of that dtype; ``fp8``: FP8 GEMMs with the recipe's scaling where
the shapes allow), ``fp8: off|on`` and ``storage`` (the dtype its parameters are kept in). A module no rule matches
takes the rule of its nearest matched ancestor, so a rule on a block covers the Linears inside it. A rule that matches
nothing is an error when the recipe is attached (a typo must not silently do nothing) unless it says
``required: false``, as the defaults do.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_serializer, model_validator
from pydantic_core import PydanticCustomError

__all__ = [
    "COMPUTE_CHOICES",
    "DEFAULT_RULES",
    "LEGACY_FP8_KEYS",
    "SELECT_CHOICES",
    "ModuleRule",
    "legacy_rules",
    "module_rules_check",
]

Compute = Literal["fp32", "bf16", "fp16", "fp8"]
Select = Literal["lm_head", "embeddings", "norms", "moe_routers", "experts"]
COMPUTE_CHOICES: tuple[str, ...] = ("fp32", "bf16", "fp16", "fp8")
SELECT_CHOICES: tuple[str, ...] = ("lm_head", "embeddings", "norms", "moe_routers", "experts")
#: The FP8 keep-list keys of recipes written before ``modules:`` (still read: each becomes a rule, with a note).
LEGACY_FP8_KEYS: tuple[str, ...] = ("keep_in_bf16", "keep_first_last_blocks", "keep_lm_head", "keep_embeddings")


def _rule(key: str, message: str) -> PydanticCustomError:
    return PydanticCustomError("recipe_rule", "{key}: {message}", {"key": key, "message": message})


def _names(value: Any) -> Any:
    """One name or a list of names; YAML lists become tuples (the frozen schema's form)."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(value)
    raise _rule("", f"{repr(value)[:60]} is not a name or a list of names")


def _on_off(value: Any) -> Any:
    """``fp8: off`` / ``on`` as YAML 1.2 and JSON users write them (YAML 1.1 already reads them as booleans)."""
    if isinstance(value, str) and value.lower() in ("on", "off"):
        return value.lower() == "on"
    return value


Names = Annotated[tuple[str, ...], BeforeValidator(_names)]


class ModuleRule(BaseModel):
    """One per-module rule: which modules (all matchers given must hold) and what they compute and store in.

    Module classes are given as ``class`` (``ModuleRule.model_validate({"class": "LlamaMLP", ...})`` in Python)."""

    #: Keys read besides the fields (they expand into fields), for "unknown key" messages.
    SHORTHAND_KEYS: ClassVar[tuple[str, ...]] = ("first_last_blocks",)

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, strict=True, allow_inf_nan=False)

    name: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="A label for the precision map and health groups (default: modules[<index>]).",
    )
    match: Names = Field((), description="fnmatch globs on the qualified module name; any one may match.")
    classes: Names = Field(
        (), alias="class", description="Module class names (the class or a base class); any one may match."
    )
    select: Select | None = Field(
        None,
        description="A shorthand: lm_head (output projection) | embeddings | norms | moe_routers | experts (MoE "
        "experts modules: 3-D expert weights run through transformers' experts interface).",
    )
    first_blocks: int | None = Field(None, ge=1, description="The first N transformer blocks (and what they hold).")
    last_blocks: int | None = Field(None, ge=1, description="The last N transformer blocks (and what they hold).")
    last_blocks_share: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="The last share of the transformer blocks (and what they hold): round(share x blocks), half up, "
        "never all of them; for a rule that must scale with depth (b200-nvfp4's 0.16).",
    )
    compute: Compute | None = Field(
        None,
        description="fp32 (outside autocast, FP32 inputs and weights) | bf16 | fp16 (an autocast region of that "
        "dtype; fp16 only in fp16 recipes) | fp8 (FP8 GEMMs with the recipe's scaling where the shapes allow).",
    )
    fp8: Annotated[bool | None, BeforeValidator(_on_off)] = Field(
        None, description="off: no FP8 GEMM here (the autocast dtype instead); on: FP8 where the shapes allow."
    )
    storage: Literal["fp32", "bf16"] | None = Field(
        None,
        description="The dtype the matched modules' trainable parameters are kept in (fp32 beside a BF16 master "
        "setting; bf16 needs storage.master other than fp32). compute fp32 implies fp32.",
    )
    required: bool = Field(
        True, description="Refuse the recipe at attach when the rule matches no module (false: a rule for some models)."
    )

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        if isinstance(data, dict) and "first_last_blocks" in data:
            data = dict(data)
            n = data.pop("first_last_blocks")
            for key in ("first_blocks", "last_blocks"):
                if data.get(key) is not None:
                    raise _rule(key, "give first_last_blocks or first_blocks/last_blocks, not both")
                data[key] = n
        return data

    @model_validator(mode="after")
    def _consistent(self) -> ModuleRule:
        if not (self.match or self.classes or self.select or self.first_blocks or self.last_blocks) and not (
            self.last_blocks_share
        ):
            raise _rule(
                "match",
                "the rule matches nothing (allowed: match, class, select, first_blocks, last_blocks, first_last_blocks,"
                " last_blocks_share)",
            )
        if self.last_blocks and self.last_blocks_share:
            raise _rule("last_blocks_share", "give last_blocks or last_blocks_share, not both")
        if self.compute is None and self.fp8 is None and self.storage is None:
            raise _rule("compute", "the rule changes nothing (allowed: compute, fp8, storage)")
        if self.fp8 is False and self.compute == "fp8":
            raise _rule("fp8", "off contradicts compute fp8 (allowed: one of them)")
        if self.fp8 is True and self.compute not in (None, "fp8"):
            raise _rule("fp8", f"on contradicts compute {self.compute} (allowed: fp8: on with compute fp8 or none)")
        if self.compute == "fp32" and self.storage == "bf16":
            raise _rule("storage", "bf16 cannot feed compute fp32 (FP32 GEMMs need FP32 weights; allowed: fp32)")
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> dict[str, Any]:
        """Only what the rule says: no empty matchers, no ``required: true`` (YAML dumps read like the recipe)."""
        data = handler(self)
        return {k: v for k, v in data.items() if v not in ((), []) and not (k == "required" and v is True)}

    # -- reading --------------------------------------------------------------------------------------------
    def label(self, index: int) -> str:
        """The rule's name in the map, the notes and the health groups."""
        return self.name or f"modules[{index}]"

    def keeps_out_of_fp8(self) -> bool:
        """Whether the rule keeps its modules' GEMMs out of FP8."""
        return self.fp8 is False or self.compute in ("fp32", "bf16", "fp16")

    def describe(self) -> str:
        """What the rule matches and sets, in recipe words (``select lm_head: fp8 off``)."""
        what = []
        if self.select:
            what.append(f"select {self.select}")
        if self.match:
            what.append("match " + ",".join(self.match))
        if self.classes:
            what.append("class " + ",".join(self.classes))
        if self.first_blocks and self.first_blocks == self.last_blocks:
            what.append(f"first_last_blocks {self.first_blocks}")
        else:
            what += [
                f"{k} {v}"
                for k, v in (
                    ("first_blocks", self.first_blocks),
                    ("last_blocks", self.last_blocks),
                    ("last_blocks_share", self.last_blocks_share),
                )
                if v
            ]
        sets = [f"{k} {v}" for k, v in (("compute", self.compute), ("storage", self.storage)) if v is not None]
        if self.fp8 is not None:
            sets.append(f"fp8 {'on' if self.fp8 else 'off'}")
        return f"{' '.join(what)}: {', '.join(sets)}"


#: The rules of a recipe that states none: MoE routers in FP32 (Megatron-LM ``--moe-router-dtype fp32``; torchtitan's
#: float8 docs filter ``router.gate``) and the output projection out of FP8 (``filter_fqns: ["output"]`` there too).
DEFAULT_RULES: tuple[ModuleRule, ...] = (
    ModuleRule(name="moe_router", select="moe_routers", compute="fp32", required=False),
    ModuleRule(name="lm_head", select="lm_head", fp8=False, required=False),
)


def legacy_rules(fp8: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """The rules an old recipe's ``fp8.keep_*`` keys mean (placed before the recipe's own, so they decide first) and
    one note per key saying what to write instead. ``fp8`` is the section's data with those keys."""
    rules: list[dict[str, Any]] = []
    notes: list[str] = []

    def moved(key: str, rule: dict[str, Any] | None) -> None:
        if rule is None:
            notes.append(f"fp8.{key} is no longer needed (embeddings are lookups, never FP8 GEMMs); remove it")
            return
        rules.append({**rule, "required": False})
        shown = ", ".join(f"{k}: {v}" for k, v in rule.items() if k != "name")
        notes.append(f"fp8.{key} is now a module rule: modules: [{{{shown}}}] (read as one; see docs/modules.md)")

    patterns = fp8.get("keep_in_bf16")
    if patterns:
        moved("keep_in_bf16", {"name": "keep_in_bf16", "match": list(_names(patterns)), "fp8": "off"})
        notes[-1] += (
            "; it comes first, so what it matches no longer gets a later rule (a router it matches is not computed in "
            "FP32 by the moe_router rule: use select: moe_routers instead of router globs)"
        )
    blocks = fp8.get("keep_first_last_blocks")
    if blocks:
        moved("keep_first_last_blocks", {"name": "keep_first_last_blocks", "first_last_blocks": blocks, "fp8": "off"})
    if fp8.get("keep_lm_head") is not None:
        on = "off" if fp8["keep_lm_head"] else "on"
        moved("keep_lm_head", {"name": "keep_lm_head", "select": "lm_head", "fp8": on})
    if fp8.get("keep_embeddings") is not None:
        moved("keep_embeddings", None)
    return rules, notes


def module_rules_check(rules: tuple[ModuleRule, ...], precisions: tuple[str, ...], master: str) -> None:
    """Cross-section rules (raised at ``modules.<index>.<key>``): what the recipe's precisions and storage allow."""
    for i, r in enumerate(rules):
        if r.compute == "fp8" and "fp8" not in precisions:
            raise _rule(
                f"modules.{i}.compute",
                f"fp8 needs an fp8 recipe or phase (precision is {'->'.join(precisions)}; allowed: fp32, bf16"
                + (", fp16)" if "fp16" in precisions else ")"),
            )
        if r.compute == "fp16" and "fp16" not in precisions:
            raise _rule(
                f"modules.{i}.compute",
                f"fp16 needs precision fp16 and its loss scaler (precision is {'->'.join(precisions)}; allowed: fp32, "
                "bf16" + (", fp8)" if "fp8" in precisions else ")"),
            )
        if r.storage == "bf16" and master == "fp32":
            raise _rule(
                f"modules.{i}.storage",
                "bf16 needs storage.master to say how a BF16 weight keeps its precision (storage.master is fp32, which "
                "keeps every trainable weight in FP32; allowed: fp32, or storage.master bf16_remainder | bf16_kahan | "
                "bf16_stochastic | none)",
            )
