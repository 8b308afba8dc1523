"""What ``hf-mixedprec compare`` found and how it is written: the result types (:class:`Criteria`,
:class:`RunResult`, :class:`CompareResult` and the per-layer and ``tiny_update`` measures they hold), the markdown
table with its storage table, the plots, and ``compare.json`` / ``compare.md``.

Split from :mod:`hf_mixedprec.commands.compare` (which re-exports every public name) to keep each module short; it sits below
both the run orchestration there and the measurements in :mod:`hf_mixedprec.commands.compare_measure`, which fill these
types in.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hf_mixedprec.core._optional import available

__all__ = [
    "COMPARE_FILE",
    "TABLE_FILE",
    "CompareResult",
    "Criteria",
    "LayerFidelity",
    "RunResult",
    "UpdateMeasure",
]

COMPARE_FILE = "compare.json"
TABLE_FILE = "compare.md"


# -- results ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Criteria:
    """What a recipe must do to pass (each a ``compare`` flag)."""

    max_skip_rate: float = 0.05
    """Largest fraction of optimizer steps skipped (overflow, non-finite)."""
    max_loss_delta_pct: float = 1.0
    """Largest final loss above the baseline's, in % of it (a recipe ending below the baseline passes)."""
    allow_stop: bool = False
    """Whether a health reaction that stopped the run is tolerated."""


@dataclass(frozen=True)
class LayerFidelity:
    """One layer's gradient under a recipe against the FP32 gradient of the same weights and batch."""

    cosine: float
    sqnr_db: float


@dataclass(frozen=True)
class UpdateMeasure:
    """The ``tiny_update`` detector over one run (docs/health.md): RMS(update) / RMS(weight) of the parameters stored
    in BF16/FP16 whose small updates rounding would lose (no remainder, Kahan compensation or stochastic rounding
    keeps them), at each sampled step the optimizer took, and how many of those steps the detector reported as below
    its threshold."""

    threshold: float
    every: int
    """The sampling interval in optimizer steps (``health.fp8_sample_every`` of the run)."""
    steps: list[int]
    ratios: list[float]
    fired: int
    """``tiny_update`` health events of the run (one per sampled step below the threshold: compare checks every
    step)."""

    @property
    def samples(self) -> int:
        return len(self.ratios)

    @property
    def fired_fraction(self) -> float | None:
        """The fraction of sampled steps whose update the detector reported as rounded away."""
        return self.fired / self.samples if self.samples else None

    @property
    def last_ratio(self) -> float | None:
        return self.ratios[-1] if self.ratios else None

    @property
    def median_ratio(self) -> float | None:
        return statistics.median(self.ratios) if self.ratios else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            samples=self.samples,
            fired_fraction=self.fired_fraction,
            median_ratio=self.median_ratio,
            last_ratio=self.last_ratio,
        )
        return d


@dataclass
class RunResult:
    """One run (the baseline or a recipe) and, for a recipe, how it compares with the baseline."""

    recipe: str
    precision: str
    rehearsed: bool
    init_digest: str
    batch_digests: list[str]
    train_loss: list[float]
    eval_loss: float | None
    final_loss: float
    steps: int
    skipped: int
    loss_scale: list[float]
    events: list[dict[str, Any]]
    stopped: str | None
    fp8_layers: dict[str, dict[str, float]]
    fidelity: dict[int, dict[str, LayerFidelity]]
    tokens_per_s: float
    peak_memory_bytes: int | None
    cost_note: str
    notes: list[str] = field(default_factory=list)
    eval_curve: dict[int, float] = field(default_factory=dict)
    """Held-out loss at the sampled steps (with an eval split)."""
    loss_gap_abs: list[float] = field(default_factory=list)
    loss_gap_rel: list[float] = field(default_factory=list)
    eval_gap_abs: dict[int, float] = field(default_factory=dict)
    eval_gap_rel: dict[int, float] = field(default_factory=dict)
    final_delta_pct: float | None = None
    storage: dict[str, Any] = field(default_factory=dict)
    """The run plan's ``storage:`` (master, optimizer_states, ...) and ``optimizer_class`` (the optimizer that
    applies the update: ``unchanged`` for the Trainer's own AdamW, ``StorageAdamW`` or a torchao class)."""
    bytes_per_param: float | None = None
    """Bytes per trainable parameter of weights + master + gradients + optimizer states (the run's plan)."""
    storage_bytes: dict[str, int] = field(default_factory=dict)
    """The plan's bytes by component over all parameters (frozen ones included)."""
    tiny_update: UpdateMeasure | None = None
    """None when nothing was measured: no weight stored in BF16/FP16 without a remainder, Kahan compensation or
    stochastic rounding keeping its small updates, or the detector is off."""
    loss_scale_floor: float | None = None
    """FP16: the recipe's ``loss_scale.min_scale`` (a scale there is stuck, not settled)."""
    verdict: str = "baseline"
    reasons: list[str] = field(default_factory=list)
    suggestions: list[str] = field(default_factory=list)

    @property
    def skip_rate(self) -> float:
        return self.skipped / self.steps if self.steps else 0.0

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.final_loss, 700.0))

    @property
    def loss_scale_settled(self) -> bool | None:
        """FP16: no backoff in the second half of the run and not at the scaler's floor, where it cannot back off any
        more (None without a loss scale)."""
        s = self.loss_scale
        if not s:
            return None
        if self.at_scale_floor:
            return False
        half = s[len(s) // 2 :]
        return all(b >= a for a, b in itertools.pairwise(half))

    @property
    def at_scale_floor(self) -> bool:
        """The last logged loss scale is at the recipe's ``loss_scale.min_scale``."""
        return (
            bool(self.loss_scale) and self.loss_scale_floor is not None and self.loss_scale[-1] <= self.loss_scale_floor
        )

    def worst_fidelity(self) -> tuple[str, LayerFidelity] | None:
        """The layer with the lowest gradient SQNR at the last sampled step."""
        if not self.fidelity:
            return None
        last = self.fidelity[max(self.fidelity)]
        return min(last.items(), key=lambda kv: kv[1].sqnr_db) if last else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["fidelity"] = {str(k): {n: asdict(f) for n, f in v.items()} for k, v in self.fidelity.items()}
        for key in ("eval_curve", "eval_gap_abs", "eval_gap_rel"):
            d[key] = {str(k): v for k, v in getattr(self, key).items()}
        d["tiny_update"] = self.tiny_update.to_dict() if self.tiny_update is not None else None
        d.update(skip_rate=self.skip_rate, perplexity=self.perplexity, loss_scale_settled=self.loss_scale_settled)
        return _finite_json(d)

    @property
    def default_storage(self) -> bool:
        """FP32 master and FP32 optimizer states (or no plan known)."""
        return self.storage.get("master", "fp32") == "fp32" and self.storage.get("optimizer_states", "fp32") == "fp32"


@dataclass
class CompareResult:
    """The baseline, every recipe's result and the criteria they were judged by."""

    baseline: RunResult
    runs: list[RunResult]
    criteria: Criteria
    loss_metric: str
    output_dir: Path | None = None
    files: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(r.verdict == "pass" for r in self.runs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "loss_metric": self.loss_metric,
            "criteria": asdict(self.criteria),
            "baseline": self.baseline.to_dict(),
            "runs": [r.to_dict() for r in self.runs],
            "files": self.files,
        }

    def markdown(self) -> str:
        """The comparison as a markdown table, then each failure's reasons and suggestions."""
        return _markdown(self)


def _finite_json(v: Any) -> Any:
    """JSON has no inf/NaN: they become strings."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {k: _finite_json(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_finite_json(x) for x in v]
    return v


# -- output -----------------------------------------------------------------------------------------------------


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _events(events: list[dict[str, Any]]) -> str:
    """``"7 (fp8_sqnr x5, fp8_underflow x2)"``: how many health events, by detector."""
    if not events:
        return "0"
    counts: dict[str, int] = {}
    for e in events:
        counts[e.get("detector", "?")] = counts.get(e.get("detector", "?"), 0) + 1
    return f"{len(events)} (" + ", ".join(f"{d} x{n}" for d, n in sorted(counts.items())) + ")"


def _markdown(res: CompareResult) -> str:
    head = (
        "| recipe | run | final loss | vs baseline | perplexity | skip rate | loss scale | worst FP8 layer "
        "(saturation / underflow) | weakest gradient (SQNR, cosine) | events | verdict |"
    )
    lines = [head, "| " + " | ".join(["---"] * 11) + " |"]
    for r in [res.baseline, *res.runs]:
        fp8 = "-"
        if r.fp8_layers:
            name, d = max(r.fp8_layers.items(), key=lambda kv: (kv[1]["saturation"], kv[1]["underflow"]))
            fp8 = f"{name} ({d['saturation']:.2%} / {d['underflow']:.2%})"
        w = r.worst_fidelity()
        weak = "-" if w is None else f"{w[0]} ({w[1].sqnr_db:.1f} dB, {w[1].cosine:.4f})"
        scale = "-"
        if r.loss_scale:
            how = "at its floor" if r.at_scale_floor else ("settled" if r.loss_scale_settled else "backing off")
            scale = f"{r.loss_scale[-1]:g} ({how})"
        delta = "baseline" if r is res.baseline else f"{_fmt(r.final_delta_pct, '+.2f')}%"
        kind = "rehearsed" if r.rehearsed else "native"
        lines.append(
            f"| {r.recipe} | {kind} | {_fmt(r.final_loss, '.4f')} | {delta} | {_fmt(r.perplexity, '.1f')} | "
            f"{r.skip_rate:.1%} | {scale} | {fp8} | {weak} | {_events(r.events)} | {r.verdict.upper()} |"
        )
    lines.append("")
    lines.append(
        f"Final loss: {res.loss_metric}. Criteria: skip rate <= {res.criteria.max_skip_rate:.0%}, final loss at most "
        f"{res.criteria.max_loss_delta_pct:g}% above the baseline's, "
        f"{'a health stop tolerated' if res.criteria.allow_stop else 'no health stop'}."
    )
    every = [res.baseline, *res.runs]
    if any(not r.default_storage for r in every):  # a storage choice is compared: what each run kept, and lost
        lines += ["", *_storage_table(every)]
    for r in res.runs:
        if r.reasons:
            lines.append("")
            lines.append(f"**{r.recipe}: FAIL**")
            lines += [f"- {x}" for x in r.reasons]
            lines += [f"- try: {x}" for x in r.suggestions]
    lines.append("")
    if any(r.peak_memory_bytes is not None for r in every):  # on a GPU: what each precision costs
        lines.append("Cost on this GPU:")
        for r in every:
            peak = "-" if r.peak_memory_bytes is None else f"{r.peak_memory_bytes / 2**30:.2f} GiB"
            lines.append(f"- {r.recipe}: {r.tokens_per_s:,.0f} tokens/s, peak memory {peak} ({r.cost_note})")
    else:
        lines.append("Cost: " + "; ".join(sorted({r.cost_note for r in every})))
    return "\n".join(lines) + "\n"


def _storage_table(runs: list[RunResult]) -> list[str]:
    """Per run: its storage, bytes per trainable parameter and the ``tiny_update`` measure (docs/storage.md)."""
    lines = [
        "| recipe | master | optimizer states | optimizer | bytes/param (weights+master+grads+states) | "
        "tiny_update fired / sampled | update ratio, median (last) |",
        "| " + " | ".join(["---"] * 7) + " |",
    ]
    for r in runs:
        st = r.storage
        tu = r.tiny_update
        fired = "not measured" if tu is None else f"{tu.fired} / {tu.samples}"
        if tu is not None and tu.fired_fraction is not None:
            fired += f" ({tu.fired_fraction:.0%})"
        ratio = "-"
        if tu is not None and tu.median_ratio is not None:
            ratio = f"{tu.median_ratio:.3g} ({tu.last_ratio:.3g}; threshold {tu.threshold:g})"
        lines.append(
            f"| {r.recipe} | {st.get('master', '-')} | {st.get('optimizer_states', '-')} | "
            f"{st.get('optimizer_class', '-')} | {_fmt(r.bytes_per_param, '.2f')} | {fired} | {ratio} |"
        )
    lines += [
        "",
        "tiny_update: RMS(update)/RMS(weight) of the weights stored in BF16/FP16 without anything keeping their small "
        "updates, at the sampled steps (health.fp8_sample_every, at most a tenth of the run in compare); fired: "
        "sampled steps below the threshold, where updates round away. Not measured: no such weight (FP32 weights, or "
        "a remainder, Kahan compensation or stochastic rounding keeps the updates).",
    ]
    return lines


def _write(res: CompareResult) -> None:
    out = res.output_dir
    assert out is not None
    files = [out / COMPARE_FILE, out / TABLE_FILE]
    files[1].write_text(res.markdown())
    if available("matplotlib"):
        files += _plots(res, out)
    else:  # the comparison itself is in compare.json and compare.md
        logging.getLogger("hf_mixedprec").warning(
            "hf_mixedprec: compare plots not written: matplotlib is not installed (pip install 'hf_mixedprec[finetune]')"
        )
    res.files = [str(p) for p in files]
    files[0].write_text(json.dumps(res.to_dict(), indent=2))


def _plots(res: CompareResult, out: Path) -> list[Path]:
    """``compare_loss.png`` (every run's train loss over the baseline's) and ``compare_grad_sqnr.png`` (each
    layer's gradient SQNR against FP32 at the last sampled step, per recipe)."""
    from hf_mixedprec.core._optional import require

    matplotlib = require("matplotlib", "finetune", "the comparison plots")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, (ax, gap) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(3, 2))
    for r in [res.baseline, *res.runs]:
        style = {"color": "black", "linewidth": 2.2} if r is res.baseline else {"linewidth": 1.2}
        label = f"{r.recipe} (baseline)" if r is res.baseline else r.recipe
        ax.plot(range(1, len(r.train_loss) + 1), r.train_loss, label=label, **style)
        if r is not res.baseline:
            gap.plot(range(1, len(r.loss_gap_abs) + 1), r.loss_gap_abs, label=r.recipe, linewidth=1.2)
    gap.axhline(0.0, color="black", linewidth=1.0)
    ax.set_ylabel("train loss")
    gap.set_ylabel(f"loss - {res.baseline.recipe}")
    gap.set_xlabel("optimizer step")
    for a in (ax, gap):
        a.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "compare_loss.png", dpi=100)
    plt.close(fig)
    written.append(out / "compare_loss.png")
    runs = [r for r in res.runs if r.fidelity and r.precision != "fp32"]
    if runs:
        layers = list(runs[0].fidelity[max(runs[0].fidelity)])
        fig, ax = plt.subplots(figsize=(8, 0.22 * len(layers) + 1.6))
        for j, r in enumerate(runs):
            last = r.fidelity[max(r.fidelity)]
            vals = [min(last[n].sqnr_db, 99.0) if n in last else math.nan for n in layers]
            ax.scatter(vals, range(len(layers)), s=14, label=r.recipe, marker="os^dv"[j % 5])
        ax.set_yticks(range(len(layers)))
        ax.set_yticklabels(layers, fontsize=6)
        ax.invert_yaxis()
        ax.set_xlabel(f"gradient SQNR vs FP32 (dB, step {max(runs[0].fidelity)}; higher is better)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "compare_grad_sqnr.png", dpi=100)
        plt.close(fig)
        written.append(out / "compare_grad_sqnr.png")
    return written
