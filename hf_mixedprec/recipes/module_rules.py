"""The recipe's ``modules:`` rules applied to one model: which rule governs each module, checked where it meets it.

:func:`assign_rules` walks the model once: a module takes the first rule that matches it, and a module no rule
matches takes its parent's (a rule on a transformer block covers the Linears inside it). A ``required`` rule that
matches nothing, and a rule that would lower a parameter the model declares must stay in FP32
(``_keep_in_fp32_modules_strict``; transformers' ``modeling_utils.py`` ``_get_dtype_plan`` keeps it in FP32 under
both 16-bit dtypes), are refused here with the rule's dotted key and the closest names. The model's non-strict
``_keep_in_fp32_modules`` (honoured by transformers under FP16 only) wins over a rule with a note.

:func:`install_compute` puts the ``compute`` of ``fp32`` / ``bf16`` / ``fp16`` rules into effect: the module's
forward runs in an autocast region of that dtype, or outside autocast with its floating inputs cast to FP32, opened
and closed by forward hooks (a deep copy of the model keeps them and runs its own weights).
"""

from __future__ import annotations

import difflib
import fnmatch
import math
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch
from torch import nn

from hf_mixedprec.core._private import declared_fp32_modules
from hf_mixedprec.core.errors import ModuleRuleError
from hf_mixedprec.recipes.modules_config import ModuleRule

__all__ = [
    "RuleAssignment",
    "assign_rules",
    "declared_fp32",
    "find_block_list",
    "install_compute",
    "output_projection_names",
]

#: The compute each recipe precision gives a module no rule changes (FP8 recipes: FP8 GEMMs inside BF16 autocast).
DEFAULT_COMPUTE = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16", "fp8": "fp8"}
_AUTOCAST_OF = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16", "fp8": "bf16"}
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def find_block_list(model: nn.Module) -> tuple[str, int] | None:
    """The dotted name and length of the transformer block list: the longest ModuleList of same-class modules."""
    best: tuple[str, int] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            classes = {type(m) for m in mod}
            if len(classes) == 1 and (best is None or len(mod) > best[1]):
                best = (name, len(mod))
    return best


def output_projection_names(model: nn.Module) -> set[str]:
    """Names of the output projection: ``get_output_embeddings()`` and modules named lm_head / output / embed_out."""
    names = set()
    get_out = getattr(model, "get_output_embeddings", None)
    out = get_out() if callable(get_out) else None
    for name, mod in model.named_modules():
        if (out is not None and mod is out) or name.split(".")[-1] in ("lm_head", "output", "embed_out"):
            names.add(name)
    return names


def _class_names(mod: nn.Module) -> set[str]:
    return {c.__name__ for c in type(mod).__mro__}


def _is_norm(mod: nn.Module) -> bool:
    if isinstance(mod, (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)):
        return True
    return type(mod).__name__.lower().endswith("norm")


def experts_count(mod: nn.Module) -> int | None:
    """How many experts ``mod`` holds if it is an MoE experts module (one holding 3-D expert weights itself, with
    "Expert" in its class name or a 3-D ``down_proj``: transformers 5's experts classes, ``gate_up_proj`` /
    ``down_proj`` ``[experts, ...]``, JetMoE's ``JetMoeParallelExperts``), else None. A model or block that only
    records ``num_experts`` is none, nor is a convolution (its weight is 3-D too: a linear-attention block's
    ``Conv1d``)."""
    if isinstance(mod, nn.modules.conv._ConvNd):
        return None
    three_d = [p for p in mod.parameters(recurse=False) if p.dim() == 3]
    down = getattr(mod, "down_proj", None)
    named = "expert" in type(mod).__name__.lower() or (isinstance(down, torch.Tensor) and down.dim() == 3)
    return int(three_d[0].shape[0]) if three_d and named else None


def _experts_beside(parent: nn.Module | None) -> int | None:
    """The number of experts of the MoE block ``parent`` (a child ``experts``, or a child holding experts)."""
    if parent is None:
        return None
    experts = getattr(parent, "experts", None)
    if isinstance(experts, nn.ModuleList) and len(experts) > 0:
        return len(experts)
    if isinstance(experts, nn.Module) and (n := experts_count(experts)) is not None:
        return n
    for child in parent.children():
        if (n := experts_count(child)) is not None:
            return n
    return None


def _is_router(name: str, mod: nn.Module, parent: nn.Module | None) -> bool:
    """An MoE router, found by its name or by what it does: a class named ``*Router*`` or ``*Gating*``
    (transformers 5's ``MixtralTopKRouter``, ``DeepseekV3TopkRouter``, JetMoE's ``JetMoeTopKGating``), a module
    named ``gate`` / ``router`` beside the block's experts, or a module beside the experts whose output has one score
    per expert (a Linear with ``out_features`` equal to the number of experts, or a module holding one: its output
    picks the experts)."""
    cls = type(mod).__name__.lower()
    if "router" in cls or "gating" in cls:
        return True
    n_experts = _experts_beside(parent)
    if n_experts is None or experts_count(mod) is not None:
        return False
    if name.split(".")[-1] in ("gate", "router"):
        return True
    linears = [mod] if isinstance(mod, nn.Linear) else [m for m in mod.children() if isinstance(m, nn.Linear)]
    return len(linears) == 1 and linears[0].out_features == n_experts


@dataclass(frozen=True)
class _Model:
    """What matching needs to know about the model, found once."""

    heads: set[str]
    blocks: tuple[str, int] | None
    block_re: re.Pattern[str] | None


def _block_index(name: str, m: _Model) -> int | None:
    hit = m.block_re.match(name) if m.block_re is not None else None
    return int(hit.group(1)) if hit else None


def _matches(rule: ModuleRule, name: str, mod: nn.Module, parent: nn.Module | None, m: _Model) -> bool:
    """Whether ``rule`` matches this module itself (every matcher it gives must hold)."""
    if rule.match and not any(fnmatch.fnmatchcase(name, g) for g in rule.match):
        return False
    if rule.classes and not _class_names(mod) & set(rule.classes):
        return False
    if rule.select == "lm_head" and name not in m.heads:
        return False
    if rule.select == "embeddings" and not isinstance(mod, nn.Embedding):
        return False
    if rule.select == "norms" and not _is_norm(mod):
        return False
    if rule.select == "moe_routers" and not _is_router(name, mod, parent):
        return False
    if rule.select == "experts" and experts_count(mod) is None:
        return False
    if rule.first_blocks or rule.last_blocks or rule.last_blocks_share:
        idx = _block_index(name, m)
        if idx is None or m.blocks is None or name.count(".") != m.blocks[0].count(".") + 1:
            return False  # the block module itself; what it holds inherits its rule
        n = m.blocks[1]
        last = rule.last_blocks or (shared_blocks(rule.last_blocks_share, n) if rule.last_blocks_share else 0)
        if not ((rule.first_blocks and idx < rule.first_blocks) or (last and idx >= n - last)):
            return False
    return True


def shared_blocks(share: float, blocks: int) -> int:
    """How many of ``blocks`` a ``last_blocks_share`` selects: ``share * blocks`` rounded half up, never all."""
    exact = Fraction(str(share)) * blocks  # the decimal share as written: 0.29 x 50 is 14.5, not 14.4999...
    return min(math.floor(exact + Fraction(1, 2)), blocks - 1)


@dataclass(frozen=True)
class RuleAssignment:
    """Which rule governs each module of one model: ``owner`` (own match or inherited) by module name."""

    rules: tuple[ModuleRule, ...]
    owner: dict[str, int]
    matched: tuple[tuple[str, ...], ...]
    """Per rule, the modules it matched itself (not those that inherit it, not those an earlier rule took)."""
    notes: tuple[str, ...] = ()
    fp32_params: frozenset[str] = field(default_factory=frozenset)
    """Parameters the model declares must stay in FP32 here (strict always, non-strict under FP16)."""

    def rule_of(self, name: str) -> ModuleRule | None:
        i = self.owner.get(name)
        return None if i is None else self.rules[i]

    def label_of(self, name: str) -> str | None:
        i = self.owner.get(name)
        return None if i is None else self.rules[i].label(i)

    def compute_of(self, name: str, precision: str) -> str:
        """What the module's GEMMs compute in: the rule's ``compute``, the autocast dtype where a rule keeps FP8 off,
        else the recipe's precision (``fp8``: FP8 where the shapes allow)."""
        rule = self.rule_of(name)
        if rule is not None and rule.compute is not None:
            return rule.compute
        if rule is not None and rule.fp8 is False:
            return _AUTOCAST_OF[precision]
        return DEFAULT_COMPUTE[precision]


def declared_fp32(model: nn.Module, precision: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The model's ``(strict, non-strict)`` FP32 declarations in force for ``precision``: the strict list always,
    ``_keep_in_fp32_modules`` under FP16 only (as transformers applies them when loading)."""
    strict, loose = declared_fp32_modules(model)
    return strict, (loose if precision == "fp16" else ())


def _declared(param_name: str, entries: Iterable[str]) -> bool:
    """transformers' match of a declaration against a parameter name: the entry, ``*`` as ``.*``, searched in it
    (``core_model_loading.py`` ``build_glob_alternation``)."""
    return any(re.search(e.replace("*", ".*"), param_name) for e in entries)


def _closest(rule: ModuleRule, names: list[str], model: nn.Module) -> str:
    """The module names (blocks' indices as ``*``) or class names closest to what the rule asked for."""
    if rule.classes:
        classes = sorted({type(m).__name__ for m in model.modules()})
        lower = {c.lower(): c for c in classes}  # a wrong case is the commonest class-name typo
        near = [
            lower[c] for want in rule.classes for c in difflib.get_close_matches(want.lower(), lower, n=3, cutoff=0.5)
        ]
        return f"closest classes: {', '.join(dict.fromkeys(near)) or ', '.join(classes[:6])}"
    generic = list(dict.fromkeys(re.sub(r"\.\d+(?=\.|$)", ".*", n) for n in names if n))
    near = [g for want in rule.match for g in difflib.get_close_matches(want, generic, n=3, cutoff=0.5)]
    return f"closest names: {', '.join(dict.fromkeys(near)) or ', '.join(generic[:6])}"


#: Why a rule's ``compute`` / ``storage`` cannot take effect under a launch strategy.
_STRATEGY_LIMITS = {
    "deepspeed": "the DeepSpeed engine keeps every weight in its own dtype and runs no autocast",
    "fsdp2": "FSDP2 casts the sharded parameters itself (per-module compute regions on it are not supported yet)",
}


def assign_rules(
    model: nn.Module, rules: tuple[ModuleRule, ...], precision: str, strategy: str = "none"
) -> RuleAssignment:
    """Which rule governs each module of ``model``; refuses a required rule matching nothing and a rule lowering a
    strict FP32 declaration (:class:`~hf_mixedprec.core.errors.ModuleRuleError`, the rule's dotted key first). Under a
    ``strategy`` that cannot put a rule's ``compute`` / ``storage`` into effect, a required rule that matches is
    refused and an optional one is left out, loudly (a note)."""
    rules, notes = _usable(model, tuple(rules), precision, strategy)
    assignment = _assign(model, rules, precision)
    return RuleAssignment(
        rules=assignment.rules,
        owner=assignment.owner,
        matched=assignment.matched,
        notes=(*notes, *assignment.notes),
        fp32_params=assignment.fp32_params,
    )


def _usable(
    model: nn.Module, rules: tuple[ModuleRule, ...], precision: str, strategy: str
) -> tuple[tuple[ModuleRule, ...], list[str]]:
    why = _STRATEGY_LIMITS.get(strategy)
    if why is None:
        return rules, []
    trial = _assign(model, rules, precision)
    out, notes = [], []
    for i, (r, names) in enumerate(zip(rules, trial.matched)):
        if not names or (r.compute not in ("fp32", "bf16", "fp16") and r.storage is None):
            out.append(r)
            continue
        key = "compute" if r.compute is not None else "storage"
        if r.required:
            raise ModuleRuleError(
                f"modules.{i}.{key} ({r.label(i)}: {r.describe()}) cannot take effect under distributed.strategy "
                f"{strategy}: {why} (allowed there: fp8 on/off rules; or remove the rule)"
            )
        notes.append(
            f"NOT APPLIED: modules rule {r.label(i)} ({r.describe()}) matches {len(names)} module(s), but under "
            f"distributed.strategy {strategy} {why}"
        )
        out.append(
            r.model_copy(update={"compute": None, "storage": None, "fp8": r.fp8 if r.fp8 is not None else False})
        )
    return tuple(out), notes


def _assign(model: nn.Module, rules: tuple[ModuleRule, ...], precision: str) -> RuleAssignment:
    blocks = find_block_list(model)
    m = _Model(
        heads=output_projection_names(model),
        blocks=blocks,
        block_re=re.compile(rf"^{re.escape(blocks[0])}\.(\d+)(\.|$)") if blocks else None,
    )
    owner: dict[str, int] = {}
    matched: list[list[str]] = [[] for _ in rules]
    parents: dict[str, nn.Module] = {}
    names: list[str] = []
    for name, mod in model.named_modules():
        names.append(name)
        for child_name, _ in mod.named_children():
            parents[f"{name}.{child_name}" if name else child_name] = mod
        hit = next((i for i, r in enumerate(rules) if _matches(r, name, mod, parents.get(name), m)), None)
        if hit is not None:
            owner[name] = hit
            matched[hit].append(name)
        elif name:
            up = name.rsplit(".", 1)[0] if "." in name else ""
            if up in owner:
                owner[name] = owner[up]
    for i, r in enumerate(rules):
        if r.required and not matched[i] and not _shadowed(r, model, m, parents):
            key = (
                "select"
                if r.select
                else "class"
                if r.classes
                else "match"
                if r.match
                else "first_blocks"
                if r.first_blocks
                else "last_blocks"
                if r.last_blocks
                else "last_blocks_share"
            )
            raise ModuleRuleError(
                f"modules.{i}.{key} ({r.label(i)}: {r.describe()}) matches no module of {type(model).__name__} "
                f"({_closest(r, names, model)}; allowed: a name or class the model has, or required: false)"
            )
    strict, loose = declared_fp32(model, precision)
    fp32_params: set[str] = set()
    notes: list[str] = []
    for pname, _ in model.named_parameters():
        mod_name = pname.rsplit(".", 1)[0] if "." in pname else ""
        is_strict, is_loose = _declared(pname, strict), _declared(pname, loose)
        if not (is_strict or is_loose):
            continue
        fp32_params.add(pname)
        i = owner.get(mod_name)
        rule = None if i is None else rules[i]
        if rule is None or not _lowers(rule):
            continue
        if is_strict:
            raise ModuleRuleError(
                f"modules.{i}.{'storage' if rule.storage == 'bf16' else 'compute'} ({rule.label(i)}: "
                f"{rule.describe()}) would lower {pname}, which {type(model).__name__}._keep_in_fp32_modules_strict "
                "keeps in FP32 (allowed: compute fp32 or storage fp32 for it, or a match that leaves it out)"
            )
        notes.append(
            f"{pname}: {type(model).__name__}._keep_in_fp32_modules keeps it in FP32 under fp16; rule "
            f"{rule.label(i)} ({rule.describe()}) does not apply to it"
        )
    return RuleAssignment(
        rules=rules,
        owner=owner,
        matched=tuple(tuple(x) for x in matched),
        notes=tuple(dict.fromkeys(notes)),
        fp32_params=frozenset(fp32_params),
    )


def _shadowed(rule: ModuleRule, model: nn.Module, m: _Model, parents: dict[str, Any]) -> bool:
    """Whether ``rule`` matches modules that earlier rules took first (not a typo: the order decided)."""
    return any(_matches(rule, n, mod, parents.get(n), m) for n, mod in model.named_modules())


def _lowers(rule: ModuleRule) -> bool:
    return rule.compute in ("bf16", "fp16", "fp8") or rule.fp8 is True or rule.storage == "bf16"


# -- compute regions -------------------------------------------------------------------------------------------------
#: The attribute a module given a compute region carries (its compute): copied with the module by ``copy.deepcopy``
#: (TRL's reference models, EMA copies) together with the hooks, so a copy is never given a second region.
_MARK = "_hf_mixedprec_compute"
_STACKS = threading.local()  # each thread's open regions, innermost last (forward calls nest)


def _to_fp32(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in (torch.float16, torch.bfloat16) else value
    if isinstance(value, tuple):
        return tuple(_to_fp32(v) for v in value)
    if isinstance(value, list):
        return [_to_fp32(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_fp32(v) for k, v in value.items()}
    return value


def _region(mod: nn.Module, compute: str, device_type: str) -> None:
    """A forward pre-hook that opens the region (autocast off and FP32 inputs, or an autocast of ``compute``'s dtype)
    and a forward hook that closes it, also when the forward raises (``always_call``). Hooks hold no reference to the
    module, so a deep copy of it runs its own forward in its own region (a forward wrapper would call the original)."""

    def open_region(module: nn.Module, args: Any, kwargs: Any) -> Any:
        if compute == "fp32":
            ctx = torch.autocast(device_type, enabled=False)
            args, kwargs = _to_fp32(args), _to_fp32(kwargs)
        else:
            ctx = torch.autocast(device_type, dtype=_DTYPES[compute])
        ctx.__enter__()
        stack = getattr(_STACKS, "open", None)
        if stack is None:
            stack = _STACKS.open = []
        stack.append(ctx)
        return args, kwargs

    def close_region(module: nn.Module, args: Any, output: Any) -> None:
        _STACKS.open.pop().__exit__(None, None, None)

    mod.register_forward_pre_hook(open_region, with_kwargs=True)
    mod.register_forward_hook(close_region, always_call=True)
    setattr(mod, _MARK, compute)


def install_compute(model: nn.Module, assignment: RuleAssignment, precision: str, device_type: str) -> list[str]:
    """Run every module a rule gives ``compute`` fp32 / bf16 / fp16 (itself matched; what it holds runs inside)
    in that precision; once per module. Returns one note per rule put into effect."""
    notes = []
    modules = dict(model.named_modules())
    for i, (rule, names) in enumerate(zip(assignment.rules, assignment.matched)):
        if rule.compute not in ("fp32", "bf16", "fp16") or not names:
            continue
        if rule.compute == _AUTOCAST_OF[precision] and rule.compute != "fp32":
            continue  # the run's own autocast already computes it so
        done = [n for n in names if getattr(modules[n], _MARK, None) is None]
        for n in done:
            _region(modules[n], rule.compute, device_type)
        if done:
            how = "outside autocast, FP32 inputs" if rule.compute == "fp32" else f"in a {rule.compute} autocast region"
            notes.append(f"modules rule {rule.label(i)} ({rule.describe()}): {len(done)} module(s) compute {how}")
    return notes


def compute_installed(mod: nn.Module) -> str | None:
    """The compute region :func:`install_compute` gave this module, if any."""
    return getattr(mod, _MARK, None)
