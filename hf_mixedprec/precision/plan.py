"""The precision plan: one immutable answer, built once from (recipe, model), to "what precision does each thing get".

For every module it holds the ``modules:`` rule that governs it and what its GEMMs compute in
(:func:`hf_mixedprec.recipes.module_rules.assign_rules`), for every GEMM layer and embedding the FP8 decision
(:func:`hf_mixedprec.fp8.policy.plan_conversion`, the only place that decides it), and for every parameter the dtype it is loaded in, the dtype it is kept in between
steps, how its master is kept, its gradient's dtype and its optimizer states' dtypes, with the bytes each takes.
Storage setup (:mod:`hf_mixedprec.storage.setup`), FP8 conversion, ``estimate`` and the run report read it; none
decides again.
"""

from __future__ import annotations

import functools
import json
import math
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from hf_mixedprec.core._private import unset_fake_temporarily
from hf_mixedprec.fp8 import conversion_backend, converted_types
from hf_mixedprec.fp8.policy import LayerDecision, plan_conversion
from hf_mixedprec.recipes.module_rules import RuleAssignment, assign_rules, find_block_list
from hf_mixedprec.recipes.schema import RecipeSpec
from hf_mixedprec.recipes.storage_config import LOW_BIT_STATES

__all__ = [
    "DTYPE_NAMES",
    "ModulePlan",
    "ParamPlan",
    "PrecisionPlan",
    "build_plan",
    "dtype_name",
    "low_bit_state_bytes",
    "run_plan",
]

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float64: "fp64",
    torch.int16: "int16",
}
#: The torch dtype of each name the plan writes (``fp32``, ``bf16``, ...).
_DTYPE_OF: dict[str, torch.dtype] = {name: dtype for dtype, name in DTYPE_NAMES.items()}
#: torchao's block sizes for its low-bit AdamW states (``torchao/optim/adam.py``: AdamW8bit / AdamWFp8 256, AdamW4bit
#: 128); tensors under 4096 elements or not a multiple of the block keep plain states in the parameter's dtype.
_TORCHAO_BLOCK = {"8bit": 256, "4bit": 128, "fp8": 256}
#: What keeps a BF16 weight's precision, by ``storage.master``.
MASTER_TEXT = {
    "fp32": "fp32 weight",
    "bf16_remainder": "bf16 + int16 remainder (exact fp32)",
    "bf16_kahan": "bf16 + bf16 Kahan compensation",
    "bf16_stochastic": "bf16, stochastic rounding",
    "none": "none (plain low precision)",
}


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def low_bit_state_bytes(states: str, shape: torch.Size, dtype: torch.dtype) -> int:
    """Bytes of one torchao low-bit AdamW state for a parameter (built on the meta device: no memory)."""
    numel = shape.numel()
    block = _TORCHAO_BLOCK[states]
    if numel < 4096 or numel % block:
        return numel * dtype.itemsize
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit
    from torchao.optim.subclass_fp8 import OptimStateFp8

    meta = torch.device("meta")
    with unset_fake_temporarily():  # torchao reads its quantization map on the host (estimate plans in fake mode)
        if states == "8bit":
            t = OptimState8bit.zeros(shape, True, block, meta, dtype=dtype)
        elif states == "4bit":
            t = OptimState4bit.zeros(shape, True, block, meta, dtype=dtype)
        else:
            t = OptimStateFp8.zeros(shape, block, meta, dtype=dtype)
    names, _ = t.__tensor_flatten__()
    return sum(getattr(t, n).numel() * getattr(t, n).element_size() for n in names)


@dataclass(frozen=True)
class ParamPlan:
    """One parameter's storage: what it is loaded in, what it is kept in, and what keeps its precision."""

    name: str
    shape: tuple[int, ...]
    loaded: str
    trainable: bool
    weight: str
    master: str
    grad: str | None
    states: str | None  # optimizer-state dtype ("fp32", "bf16", "8bit", ...) or None for frozen parameters
    bytes: dict[str, int] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def changes_dtype(self) -> bool:
        return self.loaded != self.weight


@dataclass(frozen=True)
class ModulePlan:
    """One module: its class, what its GEMMs compute in and the ``modules:`` rule that decided (None: the recipe's
    precision)."""

    name: str
    kind: str
    compute: str
    rule: str | None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "compute": self.compute, "rule": self.rule}


@dataclass(frozen=True)
class PrecisionPlan:
    """What each module computes in and what each parameter is stored in, for one recipe and one model."""

    recipe: str
    precision: str
    storage: dict[str, Any]
    optimizer: str
    fp8_backend: str | None
    fp8_layers: tuple[LayerDecision, ...]
    params: tuple[ParamPlan, ...]
    phases: tuple[str, ...] = ()
    fp8_notes: tuple[str, ...] = ()
    modules: tuple[ModulePlan, ...] = ()
    rules: tuple[str, ...] = ()
    """The label and text of every ``modules:`` rule, in order (``lm_head: select lm_head: fp8 off``)."""
    blocks: tuple[str, int] | None = None
    """The transformer block list (name, length): what the precision map collapses."""
    assignment: RuleAssignment | None = field(default=None, compare=False, repr=False)
    """Which rule governs each module (the runtime puts their compute regions into effect from it)."""
    recipe_spec: Any = field(default=None, compare=False, repr=False)
    """The recipe object the plan was built from (the runtime checks a conversion is for the same one)."""

    def with_run(self, spec: RecipeSpec, fp8_notes: list[str], phases: tuple[str, ...] = ()) -> PrecisionPlan:
        """This plan, tied to the recipe object a run converts with, the notes on its FP8 backend choice and (a
        phased run, whose plan is its first phase's) the precision of every phase."""
        return replace(self, recipe_spec=spec, fp8_notes=tuple(fp8_notes), phases=phases or self.phases)

    # -- reading ------------------------------------------------------------------------------------------------
    def module(self, name: str) -> ModulePlan:
        for m in self.modules:
            if m.name == name:
                return m
        raise KeyError(f"no module named {name!r} in the plan")

    @functools.cached_property
    def rule_groups(self) -> dict[str, list[str]]:
        """The GEMM layers (Linear, Conv1D; FP8 or not) of each rule, by label; ``no_rule`` for the rest: what
        health statistics are grouped by (found once per plan; the runtime reads it at every logging step)."""
        gemm = {d.name for d in self.fp8_layers if d.kind != "Embedding"} or {
            m.name for m in self.modules if m.kind in ("Linear", "Conv1D")
        }
        out: dict[str, list[str]] = {}
        for m in self.modules:
            if m.name in gemm:
                out.setdefault(m.rule or "no_rule", []).append(m.name)
        return out

    def param(self, name: str) -> ParamPlan:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(f"no parameter named {name!r} in the plan")

    def bytes_by_component(self) -> dict[str, int]:
        """Bytes per component over all parameters: weights, master (remainders, compensation), gradients,
        each optimizer state and the optimizer's step counters."""
        out: Counter[str] = Counter()
        for p in self.params:
            out.update(p.bytes)
        return dict(out)

    def trainable_numel(self) -> int:
        return sum(p.numel for p in self.params if p.trainable)

    def bytes_per_param(self) -> float:
        """Bytes per trainable parameter for weights, master, gradients and optimizer states together."""
        n = self.trainable_numel()
        total = sum(v for p in self.params if p.trainable for v in p.bytes.values())
        return total / n if n else 0.0

    def groups(self) -> list[dict[str, Any]]:
        """Parameters grouped by (trainable, loaded, kept, master, grad, states), with counts and bytes: the run
        report's storage table."""
        groups: dict[tuple[Any, ...], dict[str, Any]] = {}
        for p in self.params:
            key = (p.trainable, p.loaded, p.weight, p.master, p.grad, p.states)
            g = groups.setdefault(
                key,
                {
                    "trainable": p.trainable,
                    "loaded": p.loaded,
                    "weight": p.weight,
                    "master": p.master,
                    "grad": p.grad,
                    "optimizer_states": p.states,
                    "tensors": 0,
                    "parameters": 0,
                    "bytes": Counter(),
                },
            )
            g["tensors"] += 1
            g["parameters"] += p.numel
            g["bytes"].update(p.bytes)
        return [{**g, "bytes": dict(g["bytes"])} for g in groups.values()]

    def to_dict(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe,
            "precision": self.precision,
            "storage": dict(self.storage),
            "optimizer": self.optimizer,
            "fp8_backend": self.fp8_backend,
            "phases": list(self.phases),
            "bytes_per_param": round(self.bytes_per_param(), 4),
            "bytes": self.bytes_by_component(),
            "storage_groups": self.groups(),
            "fp8_layers": [d.to_dict() for d in self.fp8_layers],
            "rules": list(self.rules),
            "modules": [m.to_dict() for m in self.modules if m.rule is not None],
        }

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), indent=kw.pop("indent", 2), **kw)

    def rule_report(self) -> list[dict[str, Any]]:
        """The run report's ``rule_groups``: per rule (and ``(no rule)``), its GEMM layers and how many are FP8."""
        fp8 = {d.name for d in self.fp8_layers if d.fp8}
        texts = dict(r.split(": ", 1) for r in self.rules)
        return [
            {"rule": label, "what": texts.get(label, ""), "layers": len(names), "fp8_layers": len(fp8 & set(names))}
            for label, names in self.rule_groups.items()
        ]

    def storage_report(self) -> dict[str, Any]:
        """The run report's ``storage`` section: the choices, bytes per trainable parameter, the groups and lines."""
        return {
            "master": self.storage.get("master"),
            "optimizer_states": self.storage.get("optimizer_states"),
            "optimizer": self.optimizer,
            "bytes_per_param": round(self.bytes_per_param(), 4),
            "bytes": self.bytes_by_component(),
            "groups": self.groups(),
            "lines": self.storage_lines(),
        }

    def storage_lines(self) -> list[str]:
        """One line per storage group, for the console and the run report."""
        lines = []
        for g in self.groups():
            mib = sum(g["bytes"].values()) / 2**20
            if not g["trainable"]:
                lines.append(f"{g['parameters']:,} frozen parameters kept in {g['loaded']} ({mib:.1f} MiB, no master)")
                continue
            moved = f"loaded {g['loaded']}, kept {g['weight']}" if g["loaded"] != g["weight"] else f"{g['weight']}"
            lines.append(
                f"{g['parameters']:,} trainable parameters: {moved}; master {g['master']}; gradients {g['grad']}; "
                f"optimizer states {g['optimizer_states']} ({mib:.1f} MiB with gradients and states)"
            )
        return lines


def _param_bytes(p: nn.Parameter, weight: str, master: str, trainable: bool, states: str | None) -> dict[str, int]:
    """Bytes of one parameter kept as the plan says: the weight (and its gradient) in ``weight`` (the loaded dtype
    when it stays, whatever it is, e.g. a quantized base), the master's remainder or compensation, the states."""
    numel = p.numel()
    kept = p.dtype if weight == dtype_name(p.dtype) else _DTYPE_OF[weight]
    out = {"weights": numel * kept.itemsize}
    if not trainable:
        return out
    if master.startswith("bf16 + "):
        out["master"] = numel * 2  # int16 remainder or bf16 compensation
    out["gradients"] = numel * kept.itemsize
    if states is None:
        return out
    if states in LOW_BIT_STATES:
        each = low_bit_state_bytes(states, p.shape, kept)
    else:
        each = numel * _DTYPE_OF[states].itemsize
    out["exp_avg"] = each
    out["exp_avg_sq"] = each
    out["optimizer_step"] = 4  # one float32 step counter per parameter tensor
    return out


def _storage_of(
    spec: RecipeSpec, name: str, p: nn.Parameter, rules: RuleAssignment, family: str
) -> tuple[str, str, str | None, str | None]:
    """(kept dtype, master text, gradient dtype, state dtype) of one parameter under ``spec.storage`` and the rule
    governing its module (``storage``, or ``compute fp32``: FP32 GEMMs need FP32 weights)."""
    loaded = dtype_name(p.dtype)
    if not p.requires_grad:
        return loaded, "frozen (no master)", None, None
    if not p.is_floating_point():
        return loaded, "not a float tensor", None, None
    st = spec.storage
    module = name.rsplit(".", 1)[0] if "." in name else ""
    rule = rules.rule_of(module)
    wants_fp32 = rule is not None and (rule.storage == "fp32" or rule.compute == "fp32")
    if st.master == "fp32" or wants_fp32 or (loaded == "fp32" and name in rules.fp32_params):
        weight = "fp32"  # the master itself; a module the model or a rule keeps in FP32 stays there
    elif loaded in ("fp32", "bf16", "fp16"):
        weight = st.weight_dtype(spec.precision)
    else:
        weight = loaded
    master = MASTER_TEXT["fp32"] if weight == "fp32" else MASTER_TEXT[st.master]
    states = st.optimizer_states if family in ("auto", "adamw") else None  # another optimizer's states are unknown
    return weight, master, weight, states


def build_plan(
    spec: RecipeSpec,
    model: nn.Module,
    *,
    fp8_backend: str | None = None,
    converted_types: tuple[type, ...] = (),
    optimizer_family: str | None = None,
) -> PrecisionPlan:
    """The plan of ``spec`` for ``model`` as it is now (parameters in the dtypes they were loaded in).

    ``fp8_backend``: the FP8 backend that will convert the model (its layer kinds decide what can be FP8); the FP8
    decisions are left empty for recipes without FP8. ``optimizer_family``: the family of the optimizer the run really
    uses when it is known (``adamw``, ``sgd``, ...); otherwise ``storage.optimizer`` says (``auto``: AdamW)."""
    family = optimizer_family or spec.storage.optimizer
    rules = assign_rules(model, spec.modules, spec.precision, spec.distributed.strategy)
    fp8_layers: tuple[LayerDecision, ...] = ()
    if spec.precision == "fp8" and spec.fp8 is not None:
        fp8_layers = tuple(
            plan_conversion(model, spec.fp8, converted_types=converted_types, backend=fp8_backend, rules=rules)
        )
    params = []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:  # tied weights are one tensor
            continue
        seen.add(id(p))
        weight, master, grad, states = _storage_of(spec, name, p, rules, family)
        trainable = p.requires_grad and p.is_floating_point()
        params.append(
            ParamPlan(
                name=name,
                shape=tuple(p.shape),
                loaded=dtype_name(p.dtype),
                trainable=trainable,
                weight=weight,
                master=master,
                grad=grad,
                states=states,
                bytes=_param_bytes(p, weight, master, trainable, states),
            )
        )
    st = spec.storage
    return PrecisionPlan(
        recipe=spec.name,
        precision=spec.precision,
        storage=st.model_dump(exclude_none=True),
        optimizer=st.optimizer_impl(),
        fp8_backend=fp8_backend,
        fp8_layers=fp8_layers,
        params=tuple(params),
        phases=spec.precisions() if spec.phases is not None else (),
        modules=_modules(model, spec.precision, rules, fp8_layers),
        rules=tuple(f"{r.label(i)}: {r.describe()}" for i, r in enumerate(spec.modules)),
        blocks=find_block_list(model),
        assignment=rules,
    )


def _modules(
    model: nn.Module, precision: str, rules: RuleAssignment, fp8_layers: tuple[LayerDecision, ...]
) -> tuple[ModulePlan, ...]:
    """Every module's compute and rule; a GEMM layer an FP8 recipe keeps out of FP8 computes in BF16 autocast."""
    fp8 = {d.name: d for d in fp8_layers}
    out = []
    for name, mod in model.named_modules():
        compute = rules.compute_of(name, precision)
        d = fp8.get(name)
        if compute == "fp8" and d is not None and not d.fp8:
            compute = "bf16"
        out.append(ModulePlan(name, type(mod).__name__, compute, rules.label_of(name)))
    return tuple(out)


def run_plan(
    spec: RecipeSpec,
    model: nn.Module,
    *,
    rehearse: bool,
    phases: tuple[str, ...] = (),
    optimizer_family: str | None = None,
) -> PrecisionPlan:
    """The plan a run trains ``model`` with: FP8 decisions for the backend the run converts with (the emulated one
    when rehearsing; see :func:`hf_mixedprec.fp8.conversion_backend`), tied to ``spec`` (the phase in force for a
    phased recipe, whose ``phases`` are the precisions of all its phases)."""
    backend: str | None = None
    notes: list[str] = []
    if spec.precision == "fp8" and spec.fp8 is not None:
        backend, notes = conversion_backend(spec, model, rehearse=rehearse)
    plan = build_plan(
        spec, model, fp8_backend=backend, converted_types=converted_types(), optimizer_family=optimizer_family
    )
    return plan.with_run(spec, notes, phases)
