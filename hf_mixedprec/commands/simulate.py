"""FP8 readiness on any hardware: a few training steps in emulated FP8, per-layer numerics, advice.

``simulate(recipe)`` trains a copy of the model for a few steps with the emulated backend (the recipe's
scaling, format and keep rules, exact quantization), and the same steps in BF16 for reference. Every few
steps it samples each FP8 layer's amax, saturation (values clipped at the FP8 max), underflow (non-zero
values that quantize to zero), SQNR of quantize-dequantize and, for MXFP8, the fraction of blocks whose
E8M0 scale sits at the clamp, for NVFP4 the fraction of 16-element blocks whose E4M3 scale saturated or flushed
(each layer's ``LayerStats``). Layers that cross the recipe's ``health.detectors``
thresholds for ``fp8_saturation``, ``fp8_underflow``, ``fp8_sqnr`` or ``mx_clamp`` (decided by
:func:`hf_mixedprec.training.health.layer_breaches`, as in training) are recommended for an ``fp8: off`` rule in ``modules:``.
Published FP8 divergences start from outliers that saturate E4M3 first, so saturation leads the list.
A model in which the recipe converts no layer (every Linear/Conv1D kept, or none found) has nothing to check:
the result says so (:data:`NOTHING_CHECKED`) and never calls the recipe safe.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hf_mixedprec.core.formats import COMPUTE_FORMATS
from hf_mixedprec.fp8 import ConversionReport, convert, converted_types, fp8_layers, fp8_step
from hf_mixedprec.precision.plan import PrecisionPlan, build_plan
from hf_mixedprec.recipes.hardware import cpu_speed_note
from hf_mixedprec.recipes.schema import RecipeSpec
from hf_mixedprec.scaling.stats import ROLES
from hf_mixedprec.training.health import LayerBreach, layer_breaches

log = logging.getLogger("hf_mixedprec")

__all__ = ["NOTHING_CHECKED", "LayerNumerics", "SimulationResult", "default_simulation_model", "simulate"]

#: The verdict when no layer of the model ran in FP8, so no layer's numerics were checked.
NOTHING_CHECKED = "nothing checked: no FP8 layer in this model"


@dataclass
class LayerNumerics:
    """Worst values seen over the sampled steps for one FP8 layer."""

    name: str
    stats: dict[str, dict[str, float]]  # role -> metric -> value (max, but min for sqnr_db)
    keep_reasons: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            **self.stats,
            "recommend_keep": bool(self.keep_reasons),
            "reasons": self.keep_reasons,
        }


@dataclass
class SimulationResult:
    recipe: str
    scaling: str
    format: str
    steps: int
    model: str
    fp8_losses: list[float]
    bf16_losses: list[float]
    layers: list[LayerNumerics]
    conversion: ConversionReport
    seconds: float
    notes: list[str] = field(default_factory=list)
    rules: list[str] = field(default_factory=list)  # the recipe's own modules rules, YAML flow (a list replaces them)
    plan: PrecisionPlan | None = None  # the precision plan the FP8 conversion read

    @property
    def recommended(self) -> list[LayerNumerics]:
        return [layer for layer in self.layers if layer.keep_reasons]

    @property
    def nothing_checked(self) -> bool:
        """No layer ran in FP8, so there are no numerics to judge the recipe by."""
        return not self.layers

    @property
    def verdict(self) -> str:
        if self.nothing_checked:
            return NOTHING_CHECKED
        if self.recommended:
            return "recommend keeping layers in BF16"
        return "no layer crossed the recipe's FP8 health thresholds"

    def to_dict(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe,
            "scaling": self.scaling,
            "format": self.format,
            "backend": "emulated",
            "steps": self.steps,
            "model": self.model,
            "loss": {"fp8": self.fp8_losses, "bf16": self.bf16_losses},
            "layers": [layer.to_dict() for layer in self.layers],
            "checked_layers": len(self.layers),
            "nothing_checked": self.nothing_checked,
            "verdict": self.verdict,
            "recommend_keep_in_bf16": [layer.name for layer in self.recommended],
            "conversion": self.conversion.to_dict(),
            "seconds": round(self.seconds, 2),
            "notes": self.notes,
        }

    def table(self) -> str:
        fl, bl = self.fp8_losses, self.bf16_losses
        lines = [
            f"simulate: recipe {self.recipe} (scaling={self.scaling}, format={self.format}, backend=emulated), "
            f"model {self.model}, {self.steps} steps in {self.seconds:.1f}s",
            f"loss: fp8 {fl[0]:.4f} -> {fl[-1]:.4f}   bf16 {bl[0]:.4f} -> {bl[-1]:.4f}   "
            f"(final gap {fl[-1] - bl[-1]:+.4f})",
            "",
        ]
        if self.nothing_checked:
            n = len(self.conversion.gemm_layers)
            why = (
                f"all {n} Linear/Conv1D layers are kept in high precision" if n else "it has no Linear or Conv1D layer"
            )
            lines.append(f"{NOTHING_CHECKED} ({why}; the FP8 loss above is a high-precision run)")
        lines += self._layer_rows()
        lines.append("")
        kept = [d for d in self.conversion.layers if not d.fp8]
        lines.append("already kept in high precision: " + ", ".join(f"{d.name} ({d.reason})" for d in kept))
        if self.nothing_checked:
            lines.append(f"recommendation: none, {NOTHING_CHECKED}: the recipe's FP8 numerics were not tested")
        elif self.recommended:
            lines.append("recommend keeping in BF16:")
            for layer in self.recommended:
                lines.append(f"  {layer.name}: {'; '.join(layer.keep_reasons)}")
            # a list in a child recipe replaces the parent's, so the suggestion repeats the recipe's rules after it
            pats = ", ".join(f'"{n}"' for n in dict.fromkeys(layer.name for layer in self.recommended))
            lines.append("  -> add to your recipe (first match wins; the list replaces the recipe's own):")
            lines.append("     modules:")
            lines.append(f"       - {{name: simulate_keep, match: [{pats}], fp8: off}}")
            lines += [f"       - {rule}" for rule in self.rules]
        else:
            lines.append("recommendation: no layer crossed the recipe's FP8 health thresholds; the recipe looks safe")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _layer_rows(self) -> list[str]:
        """The per-layer table (header and one row per FP8 layer); nothing when no layer was checked."""
        if self.nothing_checked:
            return []
        lines = []
        width = max([len(layer.name) for layer in self.layers] + [5])
        hdr = f"{'layer':<{width}}  {'amax in/w/grad':>26}  {'sat% in/w/grad':>20}  {'undfl% in/w/grad':>20}  {'SQNR dB min':>11}"
        if self.scaling in ("mxfp8", "nvfp4"):
            hdr += f"  {'clamp%':>6}"
        lines += [hdr + "  keep?"]
        for layer in self.layers:
            s = layer.stats
            amax = "/".join(f"{s[r]['amax']:.3g}" for r in ROLES)
            sat = "/".join(f"{100 * s[r]['saturation']:.2f}" for r in ROLES)
            und = "/".join(f"{100 * s[r]['underflow']:.1f}" for r in ROLES)
            sq = min(s[r]["sqnr_db"] for r in ROLES)
            row = f"{layer.name:<{width}}  {amax:>26}  {sat:>20}  {und:>20}  {sq:>11.1f}"
            if self.scaling in ("mxfp8", "nvfp4"):
                row += f"  {100 * max(s[r].get('mx_clamp', 0.0) for r in ROLES):>6.2f}"
            lines.append(row + ("  KEEP" if layer.keep_reasons else "  -"))
        return lines


def default_simulation_model(seed: int = 0) -> Any:
    """The default model: a small Llama (4 layers, hidden 256) built from a config, float32."""
    from hf_mixedprec.core.demo import tiny_llama

    return tiny_llama(
        seed=seed,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
    )


def _load_model(model_dir: str | None) -> tuple[Any, str]:
    if model_dir is None:
        return default_simulation_model(), "tiny-llama (4 layers, hidden 256, built from a config)"
    from transformers import AutoModelForCausalLM

    path = Path(model_dir)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    return model, str(path)


def _batches(model: Any, steps: int, seq_len: int, batch_size: int, seed: int) -> list[torch.Tensor]:
    from hf_mixedprec.core.demo import builtin_text, byte_batches

    vocab = int(getattr(model.config, "vocab_size", 256))
    batches = byte_batches(builtin_text(), seq_len=seq_len, batch_size=batch_size, n_batches=steps, seed=seed)
    return [b % vocab for b in batches]


def _train(model: Any, batches: list[torch.Tensor], lr: float, sample_at: set[int], collect: Any = None) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    mods = [m for _, m in fp8_layers(model, emulated_only=True, fresh=True)]
    for i, b in enumerate(batches):
        for m in mods:
            m.record_stats = i in sample_at
        with torch.autocast(b.device.type, dtype=COMPUTE_FORMATS["fp8"].dtype):
            loss = model(input_ids=b, labels=b).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        fp8_step(model)
        losses.append(loss.detach())
        if collect is not None and i in sample_at:
            collect()
    for m in mods:
        m.record_stats = False
    return [float(v) for v in torch.stack(losses).float().tolist()]


def _flow(rule: dict[str, Any]) -> str:
    """A rule as one YAML flow mapping (``{name: lm_head, select: lm_head, fp8: off}``)."""

    def text(k: str, v: Any) -> str:
        if isinstance(v, bool):
            return ("on" if v else "off") if k == "fp8" else str(v).lower()
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(f'"{x}"' for x in v) + "]"
        return str(v)

    return "{" + ", ".join(f"{k}: {text(k, v)}" for k, v in rule.items()) + "}"


def _reason(b: LayerBreach, scaling: str = "mxfp8") -> str:
    """Why a layer is recommended for ``keep_in_bf16``, in the words of the table."""
    if b.metric == "saturation":
        return f"{b.role} saturation {100 * b.value:.3f}% > {100 * b.threshold:g}%"
    if b.metric == "underflow":
        return f"{b.role} underflow {100 * b.value:.1f}% > {100 * b.threshold:g}%"
    if b.metric == "sqnr_db":
        return f"{b.role} SQNR {b.value:.1f} dB < {b.threshold:g} dB"
    if scaling == "nvfp4":
        return f"{b.role} NVFP4 blocks whose E4M3 scale saturated or flushed {100 * b.value:.2f}%"
    return f"{b.role} MX blocks at the E8M0 clamp {100 * b.value:.2f}%"


def simulate(
    recipe: RecipeSpec,
    *,
    model_dir: str | None = None,
    steps: int = 20,
    seq_len: int = 128,
    batch_size: int = 8,
    lr: float = 1e-3,
    seed: int = 0,
) -> SimulationResult:
    """Rehearse ``recipe``'s FP8 numerics with the emulated backend (see module docs)."""
    if recipe.precision != "fp8" or recipe.fp8 is None:
        raise ValueError(f"recipe {recipe.name!r} has precision {recipe.precision!r}; simulate rehearses fp8 recipes")
    start = time.perf_counter()
    notes = []
    # simulate trains on the CPU, the FP8 layers and the BF16 twin both inside BF16 autocast: said once, and kept
    if (slow := cpu_speed_note(recipe)) is not None:
        notes.append(slow)
        log.warning("hf_mixedprec: %s", slow)
    if recipe.fp8.backend != "emulated":
        notes.append(f"fp8.backend {recipe.fp8.backend!r} replaced by 'emulated' for the rehearsal (same numerics)")
    model, model_name = _load_model(model_dir)
    model.train()
    batches = _batches(model, steps, seq_len, batch_size, seed)
    # sample after the first step: delayed scaling starts from scale 1, which says nothing about the recipe
    every = max(1, steps // 5)
    sample_at = {i for i in range(1, steps) if i % every == 0 or i == steps - 1}

    ref = _load_model(model_dir)[0]
    ref.load_state_dict(model.state_dict())
    torch.manual_seed(seed)
    bf16_losses = _train(ref, batches, lr, set())
    del ref

    # the emulated backend, whatever the recipe names (torchao included): the same numerics, anywhere
    plan = build_plan(recipe, model, fp8_backend="emulated", converted_types=converted_types()).with_run(recipe, [])
    report = convert(model, recipe, backend=plan.fp8_backend, decisions=plan.fp8_layers)
    if report.warning is not None:
        notes.append(report.warning)
    agg: dict[str, dict[str, dict[str, float]]] = {}

    def collect() -> None:
        for name, m in fp8_layers(model, emulated_only=True, fresh=True):
            layer = agg.setdefault(name, {r: {} for r in ROLES})
            for role, values in m.stats.to_floats().items():
                for metric, v in values.items():
                    if not math.isfinite(v) and metric != "sqnr_db":
                        v = float("inf")
                    old = layer[role].get(metric)
                    if old is None:
                        layer[role][metric] = v
                    elif metric == "sqnr_db":
                        layer[role][metric] = min(old, v)
                    else:
                        layer[role][metric] = max(old, v)

    torch.manual_seed(seed)
    fp8_losses = _train(model, batches, lr, sample_at, collect)
    det = recipe.health.detectors
    layers = [
        LayerNumerics(name, roles, [_reason(b, recipe.fp8.scaling) for b in layer_breaches(roles, det)])
        for name, roles in agg.items()
    ]
    return SimulationResult(
        recipe=recipe.name,
        scaling=recipe.fp8.scaling,
        format=recipe.fp8.format,
        steps=steps,
        model=model_name,
        fp8_losses=fp8_losses,
        bf16_losses=bf16_losses,
        layers=layers,
        conversion=report,
        seconds=time.perf_counter() - start,
        notes=notes,
        rules=[_flow(r.model_dump(exclude_defaults=True, by_alias=True)) for r in recipe.modules],
        plan=plan,
    )
