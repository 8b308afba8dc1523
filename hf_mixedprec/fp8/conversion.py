"""``ConversionReport``: every Linear (and Embedding) of a model, converted or kept, and why."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from hf_mixedprec.fp8.policy import LayerDecision

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

    @property
    def converted(self) -> list[str]:
        return [d.name for d in self.layers if d.fp8]

    @property
    def kept(self) -> list[str]:
        return [d.name for d in self.layers if not d.fp8]

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
            "notes": list(self.notes),
            "layers": [d.to_dict() for d in self.layers],
        }

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), indent=kw.pop("indent", 2), **kw)

    def summary(self) -> str:
        """Two lines for the console: how many Linears went FP8, and which stayed in high precision and why."""
        head = (
            f"FP8 conversion ({self.backend}, {self.scaling} scaling, {self.format}): {len(self.converted)} of "
            f"{sum(d.kind == 'Linear' for d in self.layers)} Linear layers in FP8"
        )
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
        lines = [head, f"{'layer':<{width}}  {'kind':<9}  {'shape':>11}  {'fp8':<4}  reason"]
        for d in self.layers:
            shape = f"{d.in_features}x{d.out_features}"
            lines.append(f"{d.name:<{width}}  {d.kind:<9}  {shape:>11}  {'yes' if d.fp8 else 'no':<4}  {d.reason}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _names(names: list[str], most: int = 4) -> str:
    shown = ", ".join(names[:most])
    return shown if len(names) <= most else f"{shown} and {len(names) - most} more"
