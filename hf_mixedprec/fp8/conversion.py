"""``ConversionReport``: every GEMM layer (Linear, Conv1D) and Embedding of a model, converted or kept, and why.

A report whose recipe converts no GEMM layer, or under half of those it found, says so loudly: the flags
``nothing_converted`` / ``under_half_converted``, and :attr:`ConversionReport.warning` at the head of
:meth:`~ConversionReport.summary` (the line the runtime logs at WARNING when it converts a model).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from hf_mixedprec.fp8.policy import EXPERTS_KIND, GEMM_KINDS, LORA_ADAPTER, LayerDecision

#: What the report counts as GEMM layers: Linear, Conv1D and MoE experts modules (grouped GEMMs).
_COUNTED = (*GEMM_KINDS, EXPERTS_KIND)

__all__ = ["ConversionReport"]


@dataclass
class ConversionReport:
    """What :func:`hf_mixedprec.fp8.convert` did to a model."""

    backend: str
    scaling: str
    format: str
    layers: list[LayerDecision]
    notes: list[str] = field(default_factory=list)
    """Fallbacks and caveats, each also logged as a warning."""
    work: dict[str, int] = field(default_factory=dict)
    """Multiply-adds per token of each GEMM layer (:func:`~hf_mixedprec.fp8.policy.gemm_work`), when known."""

    @property
    def fp8_work_share(self) -> float | None:
        """The share of the model's forward GEMM work per token that runs in FP8 (None when the work is not known):
        an MoE model whose experts stay BF16 runs most of its GEMMs in BF16 however many Linears are FP8."""
        total = sum(self.work.get(d.name, 0) for d in self.gemm_layers)
        if not total:
            return None
        return sum(self.work.get(d.name, 0) for d in self.gemm_layers if d.fp8) / total

    @property
    def converted(self) -> list[str]:
        return [d.name for d in self.layers if d.fp8]

    @property
    def kept(self) -> list[str]:
        return [d.name for d in self.layers if not d.fp8]

    @property
    def gemm_layers(self) -> list[LayerDecision]:
        """The GEMM layers found (Linear, Conv1D, MoE experts modules), converted or not."""
        return [d for d in self.layers if d.kind in _COUNTED]

    @property
    def nothing_converted(self) -> bool:
        """No GEMM layer runs in FP8 (none was found, or every one was kept): the model trains in high precision."""
        return not any(d.fp8 for d in self.gemm_layers)

    def _counted(self) -> list[LayerDecision]:
        """The GEMM layers coverage is judged on: PEFT LoRA adapters, kept in high precision by design, are not."""
        return [d for d in self.gemm_layers if d.reason != LORA_ADAPTER]

    @property
    def under_half_converted(self) -> bool:
        """Fewer than half of the GEMM layers found (LoRA adapters aside) run in FP8; true when none does."""
        gemms = self._counted()
        return self.nothing_converted or 2 * sum(d.fp8 for d in gemms) < len(gemms)

    @property
    def warning(self) -> str | None:
        """The loud sentence for a recipe that converts nothing or under half of the GEMM layers, else None."""
        gemms = self._counted()
        n_fp8 = sum(d.fp8 for d in gemms)
        if not gemms:
            return (
                "WARNING: FP8 converted nothing: this model has no Linear or Conv1D layer, so it trains entirely in "
                "high precision (no FP8 GEMM, no speed-up)"
            )
        if self.nothing_converted:
            return (
                f"WARNING: FP8 converted nothing: 0 of {len(gemms)} GEMM layers in FP8, so this model trains entirely "
                "in high precision (no FP8 GEMM, no speed-up); the reasons follow"
            )
        if self.under_half_converted:
            return (
                f"WARNING: FP8 converted under half of the GEMM layers: {n_fp8} of {len(gemms)} in FP8, the rest train "
                "in high precision; the reasons follow"
            )
        return None

    def decision(self, name: str) -> LayerDecision:
        for d in self.layers:
            if d.name == name:
                return d
        raise KeyError(f"no layer named {name!r} in the report")

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "scaling": self.scaling,
            "format": self.format,
            "converted": len(self.converted),
            "kept": len(self.kept),
            "gemm_layers": len(self.gemm_layers),
            "nothing_converted": self.nothing_converted,
            "under_half_converted": self.under_half_converted,
            "fp8_gemm_work_share": self.fp8_work_share,
            "warning": self.warning,
            "notes": list(self.notes),
            "layers": [d.to_dict() for d in self.layers],
        }

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), indent=kw.pop("indent", 2), **kw)

    def _kinds(self) -> str:
        """The GEMM kinds this model has, as "Linear", "Conv1D" or "Linear/Conv1D" (both when it has none)."""
        found = {d.kind for d in self.gemm_layers}
        return "/".join(k for k in _COUNTED if k in found or (not found and k in GEMM_KINDS))

    def summary(self) -> str:
        """One line for the console: how many GEMM layers went FP8, and which stayed in high precision and why;
        led by :attr:`warning` when the recipe converts nothing or under half of them."""
        head = (
            f"FP8 conversion ({self.backend}, {self.scaling} scaling, {self.format}): "
            f"{sum(d.fp8 for d in self.gemm_layers)} of {len(self.gemm_layers)} {self._kinds()} layers in FP8"
        )
        share = self.fp8_work_share
        if share is not None and any(d.kind == EXPERTS_KIND for d in self.gemm_layers):
            head += f" ({100 * share:.1f}% of the GEMM work per token, experts included)"
        if self.warning is not None:
            head = f"{self.warning}. {head}"
        by_reason: dict[str, list[str]] = {}
        for d in self.layers:
            if not d.fp8:
                by_reason.setdefault(d.reason, []).append(d.name)
        if not by_reason:
            return head + "; none kept in high precision"
        kept = "; ".join(f"{reason}: {_names(names)}" for reason, names in by_reason.items())
        return f"{head}; kept in high precision: {kept}"

    def __str__(self) -> str:
        head = (
            f"FP8 conversion: backend={self.backend} scaling={self.scaling} format={self.format}: "
            f"{len(self.converted)} layers in FP8, {len(self.kept)} kept in high precision"
        )
        width = max([len(d.name) for d in self.layers] + [5])
        lines = ([self.warning] if self.warning else []) + [
            head,
            f"{'layer':<{width}}  {'kind':<9}  {'shape':>11}  {'fp8':<4}  reason",
        ]
        for d in self.layers:
            shape = f"{d.in_features}x{d.out_features}"
            lines.append(f"{d.name:<{width}}  {d.kind:<9}  {shape:>11}  {'yes' if d.fp8 else 'no':<4}  {d.reason}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _names(names: list[str], most: int = 4) -> str:
    shown = ", ".join(names[:most])
    return shown if len(names) <= most else f"{shown} and {len(names) - most} more"
