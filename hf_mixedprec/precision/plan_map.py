"""``hf-mixedprec plan``: the precision map of a model under a recipe, read from its precision plan.

One row per module that holds parameters: its class, the dtype its parameters are loaded in and kept in, what keeps
their master, what its GEMM computes in (FP8 with the recipe's scaling, or the autocast dtype) and the rule that
decided. Rows of the transformer blocks that are the same in every block collapse into one
(``model.layers.[0-31].mlp.up_proj``), so a 32-layer model reads in one screen. The model is built from its
``config.json`` on the meta device in the dtype the config names (what ``from_pretrained`` would load): no weights are
read or allocated.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from hf_mixedprec.precision.plan import PrecisionPlan, run_plan
from hf_mixedprec.recipes.module_rules import DEFAULT_COMPUTE
from hf_mixedprec.recipes.schema import RecipeSpec

__all__ = ["MapRow", "format_map", "format_rows", "map_rows", "meta_model", "plan_notes", "precision_map"]

_AUTOCAST = {"bf16": "bf16 (autocast)", "fp8": "bf16 (autocast)", "fp16": "fp16 (autocast)", "fp32": "fp32"}


@dataclass(frozen=True)
class MapRow:
    """One module (or the same module in several blocks) of the precision map."""

    name: str
    kind: str
    parameters: int
    loaded: str
    kept: str
    master: str
    compute: str
    rule: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def meta_model(config: Any) -> nn.Module:
    """The causal LM of ``config`` on the meta device, in the dtype the config names (float32 if none)."""
    from transformers import AutoModelForCausalLM

    dtype = getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, torch.float32)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _rows(plan: PrecisionPlan) -> list[MapRow]:
    """One row per module holding parameters, read from the plan alone (a tied weight is listed at its first
    module), so the run report can print it after the model is gone."""
    owned: dict[str, list[Any]] = {}
    for p in plan.params:
        owned.setdefault(p.name.rsplit(".", 1)[0] if "." in p.name else "", []).append(p)
    fp8 = {d.name: d for d in plan.fp8_layers}
    rows = []
    for mp in plan.modules:
        name, plans = mp.name, owned.get(mp.name, [])
        if not plans and mp.kind not in ("Linear", "Conv1D"):
            continue  # holds no parameter (a GEMM layer whose weight is tied elsewhere still gets its row)
        label, d = mp.rule, fp8.get(name)
        by_rule = f"rule {label}" if label else f"precision {plan.precision}"
        if d is not None and d.fp8:
            section = getattr(plan.recipe_spec, "fp8", None)
            kind = "nvfp4" if section is not None and section.scaling == "nvfp4" else "fp8"
            compute = f"{kind} ({plan.fp8_backend}, {_scaling(plan)})"
            rule = f"rule {label}; converted" if label else "converted"
        elif mp.kind == "Embedding":  # a lookup returns its weight's dtype, under any autocast
            compute = f"lookup ({plans[0].weight})"
            rule = (f"rule {label}; " if label else "") + (d.reason if d is not None else f"precision {plan.precision}")
        elif d is not None:
            compute, rule = _compute_text(mp.compute, label), d.reason
        elif label is not None and mp.compute != DEFAULT_COMPUTE[plan.precision]:
            compute, rule = _compute_text(mp.compute, label), by_rule
        elif plan.precision == "fp8" and any(len(p.shape) == 3 for p in plans):
            compute, rule = _AUTOCAST["fp8"], "3-D expert weights (no nn.Linear to convert): no FP8 GEMM"
        elif mp.kind in ("Linear", "Conv1D"):
            compute, rule = _AUTOCAST[plan.precision], by_rule
        else:
            compute, rule = "autocast op policy", by_rule
        rows.append(
            MapRow(
                name=name,
                kind=mp.kind,
                parameters=sum(p.numel for p in plans),
                loaded="/".join(sorted({p.loaded for p in plans})) or "tied",
                kept="/".join(sorted({p.weight for p in plans})) or "tied",
                master="/".join(sorted({p.master for p in plans})) or "tied",
                compute=compute,
                rule=rule,
            )
        )
    return rows


def _compute_text(compute: str, label: str | None) -> str:
    """What a module a rule governs computes in, in the map's words."""
    if compute == "fp32":
        return "fp32 (outside autocast)" if label else "fp32"
    return f"{compute} (autocast)" if compute in ("bf16", "fp16") else compute


def _scaling(plan: PrecisionPlan) -> str:
    spec = plan.recipe_spec
    fp8 = getattr(spec, "fp8", None)
    if fp8 is not None and fp8.scaling == "nvfp4":
        return "E2M1 values, E4M3 scale per 16"  # 0.5 byte a value, 1 byte per 16 values and 4 per tensor
    return f"{fp8.scaling}, {fp8.format}" if fp8 is not None else "?"


def _collapse(rows: list[MapRow], blocks: tuple[str, int] | None) -> list[MapRow]:
    """Merge the rows of a module that every block (or a run of blocks) decides the same way."""
    if blocks is None:
        return rows
    pat = re.compile(rf"^{re.escape(blocks[0])}\.(\d+)(\..*)?$")
    groups: dict[tuple[Any, ...], list[int]] = {}
    order: list[tuple[Any, ...] | MapRow] = []
    for r in rows:
        m = pat.match(r.name)
        if m is None:
            order.append(r)
            continue
        key = (m.group(2) or "", r.kind, r.parameters, r.loaded, r.kept, r.master, r.compute, r.rule)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(int(m.group(1)))
    out = []
    for item in order:
        if isinstance(item, MapRow):
            out.append(item)
            continue
        idx = groups[item]
        suffix, kind, n, loaded, kept, master, compute, rule = item
        name = f"{blocks[0]}.[{_ranges(idx)}]{suffix}"
        out.append(MapRow(name, kind, n * len(idx), loaded, kept, master, compute, rule))
    return out


def _ranges(idx: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    parts, start = [], idx[0]
    for a, b in zip(idx, [*idx[1:], None]):
        if b != a + 1:
            parts.append(str(start) if start == a else f"{start}-{a}")
            start = b if b is not None else start
    return ",".join(parts)


def precision_map(spec: RecipeSpec, model: nn.Module, *, rehearse: bool = True) -> tuple[PrecisionPlan, list[MapRow]]:
    """The plan of ``spec`` for ``model`` (FP8 decisions for the rehearsed backend unless ``rehearse=False``) and its
    rows, collapsed over the transformer blocks."""
    plan = run_plan(spec, model, rehearse=rehearse)
    return plan, map_rows(plan)


def map_rows(plan: PrecisionPlan) -> list[MapRow]:
    """The precision map of a plan: its rows, collapsed over the transformer blocks."""
    return _collapse(_rows(plan), plan.blocks)


def plan_notes(plan: PrecisionPlan) -> list[str]:
    """What the plan decided that a row cannot show: old recipe keys read as rules, rules left out under the launch
    strategy, the model's FP32 declarations winning over a rule."""
    legacy = list(getattr(plan.recipe_spec, "legacy_notes", ()) or ())
    return legacy + list(plan.assignment.notes if plan.assignment is not None else ())


def format_map(plan: PrecisionPlan, rows: list[MapRow], model_name: str) -> str:
    """The map as the command prints it: a head line, a markdown table, the storage lines."""
    head = (
        f"precision map: {model_name} under recipe {plan.recipe} ({'->'.join(plan.phases) or plan.precision}); "
        f"{plan.bytes_per_param():.2f} bytes per trainable parameter (weights, master, gradients, optimizer states)"
    )
    lines = [head, "", *format_rows([r.to_dict() for r in rows])]
    lines += ["", "storage:", *(f"  {line}" for line in plan.storage_lines())]
    notes = plan_notes(plan)
    if notes:  # rules left out under a launch strategy, old keys read as rules, declarations that won
        lines += ["", "notes:", *(f"  {n}" for n in notes)]
    return "\n".join(lines)


_COLUMNS = ("module", "class", "params", "loaded", "kept", "master", "compute", "rule")
_KEYS = ("name", "kind", "parameters", "loaded", "kept", "master", "compute", "rule")


def format_rows(rows: list[dict[str, Any]]) -> list[str]:
    """The map's rows (as :meth:`MapRow.to_dict` gives them, or read back from ``health.json``) as a markdown
    table; a cell of another type than written is shown as it is, never trusted."""
    lines = ["| " + " | ".join(_COLUMNS) + " |", "|" + "|".join(["---"] * len(_COLUMNS)) + "|"]
    for r in rows:
        cells = [r.get(k, "?") for k in _KEYS]
        cells[0] = cells[0] or "(model)"
        cells[2] = f"{cells[2]:,}" if isinstance(cells[2], int) and not isinstance(cells[2], bool) else cells[2]
        lines.append("| " + " | ".join(str(c)[:120] for c in cells) + " |")
    return lines
