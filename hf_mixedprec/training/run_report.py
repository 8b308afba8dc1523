"""The run report: ``health.json`` (events and per-step series) and PNG plots in the output directory.

``write_run_report(out_dir, log_history=..., runtime=...)`` is called at the end of a run (``finetune`` does,
and so can any Trainer script); ``hf-mixedprec report RUN_DIR`` rebuilds the plots from ``health.json``.
Plots: loss scale, grad norm with the clip threshold, skipped steps, and per-layer FP8 saturation.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from hf_mixedprec.core import metrics as M
from hf_mixedprec.core._optional import available, require
from hf_mixedprec.core._text import shorten
from hf_mixedprec.precision.plan_map import format_rows, map_rows
from hf_mixedprec.recipes.schema import MAX_STEPS

__all__ = ["HEALTH_FILE", "build_plots", "health_document", "summarize", "write_run_report"]

HEALTH_FILE = "health.json"
SERIES_KEYS = (
    "loss",
    "eval_loss",
    "grad_norm",
    "learning_rate",
    M.LOSS_SCALE,
    M.SKIPPED_STEPS,
    M.GRAD_NORM,
    M.CLIP_THRESHOLD,
    M.CLIPPED,
    M.OVERFLOW,
    M.PHASE,
)


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no inf/NaN; keep them readable
    return v


def health_document(
    log_history: list[dict[str, Any]], runtime: Any = None, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The content of ``health.json``: per-step series from the logs plus the runtime's notes and events."""
    series: dict[str, dict[str, Any]] = {}
    for row in log_history:
        step = row.get("step")
        if step is None:
            continue
        for key, value in row.items():
            if key in SERIES_KEYS or key.startswith((M.FP8_PREFIX, M.FP8_RULE_PREFIX)):
                series.setdefault(key, {})[str(step)] = _clean(value)
    doc: dict[str, Any] = {
        "version": 1,
        "series": {k: dict(sorted(v.items(), key=lambda kv: int(kv[0]))) for k, v in series.items()},
    }
    if runtime is not None:
        recipe = runtime.recipe
        doc.update(
            recipe=recipe.name,
            precision="->".join(recipe.precisions()),
            rehearsed=bool(runtime.rehearse),
            notes=list(runtime.notes),
            events=[{k: _clean(v) for k, v in e.items()} for e in getattr(runtime, "events", [])],
            steps=runtime.steps,
        )
        history = runtime.history.entries if hasattr(runtime, "history") else []
        if len(history) > 1:  # resumed under another recipe: each recipe and the step it took over at
            doc["recipes"] = [dict(r) for r in history]
            doc["precision"] = "->".join(r["precision"] for r in history)
        phases = getattr(runtime, "phases", None)
        if phases is not None:  # each switch: the step after which it happened, the phase's name and precision
            doc["phases"] = [dict(c) for c in phases.changes]
        if getattr(runtime, "fp8_report", None) is not None:
            doc["fp8_conversion"] = runtime.fp8_report.to_dict()
        plan = getattr(runtime, "plan", None)
        if plan is not None:  # what each parameter group was kept in and the bytes it took
            doc["storage"] = plan.storage_report()
            groups = plan.rule_report()
            if any(g["rule"] != "no_rule" for g in groups):  # each modules: rule's layers and worst FP8 statistics
                doc["rule_groups"] = _rule_groups(groups, series)
            # what each module computed in and why (the table `hf-mixedprec plan` prints), as the run was prepared
            doc["precision_map"] = [r.to_dict() for r in map_rows(plan)]
    if extra:
        doc.update(extra)
    return doc


def _rule_groups(groups: list[dict[str, Any]], series: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for g in groups:
        row = dict(g)
        for stat, worst in (("saturation", max), ("underflow", max), ("sqnr_db", min)):
            vals = [v for v in series.get(f"{M.FP8_RULE_PREFIX}{g['rule']}/{stat}", {}).values() if _finite(v)]
            if vals:
                row[f"worst_{stat}"] = worst(vals)
        out.append(row)
    return out


#: How :func:`_clean` writes the values JSON has no number for.
NON_FINITE = ("inf", "-inf", "nan")


def _step_key(k: Any) -> bool:
    return isinstance(k, str) and k.isdigit() and len(k) <= 10 and int(k) <= MAX_STEPS


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_document(doc: Any) -> str | None:
    """What is wrong with a ``health.json`` read from disk (the first problem, one line), or None if it has the
    shape :func:`health_document` writes: ``series`` a mapping of key -> {step: value}, ``events`` a list of
    mappings, ``notes`` a list of strings."""
    if not isinstance(doc, dict) or doc.get("version") != 1:
        return "is not a health report of version 1"
    series = doc.get("series", {})
    if not isinstance(series, dict):
        return f"field 'series' is a {type(series).__name__} (allowed: a mapping of name -> {{step: value}})"
    for key, data in series.items():
        where = f"field 'series.{shorten(str(key), 40)}'"
        if not isinstance(data, dict) or not all(_step_key(k) for k in data):
            return f"{where} is not a mapping of step -> value (allowed: steps 0 to {MAX_STEPS:,})"
        for step, value in data.items():
            if not (_number(value) or value is None or value in NON_FINITE):
                return (
                    f"{where} at step {step}: {shorten(repr(value), 40)} is not a number "
                    f"(allowed: a number, null, {', '.join(map(repr, NON_FINITE))})"
                )
    events = doc.get("events", [])
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        return "field 'events' is not a list of mappings"
    for i, e in enumerate(events):
        step = e.get("step", 0)
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEPS:
            return f"field 'events.{i}.step' is {shorten(repr(step), 40)} (allowed: a step, 0 to {MAX_STEPS:,})"
        for name in ("detector", "message", "reaction", "layer"):
            if e.get(name) is not None and not isinstance(e[name], str):
                return f"field 'events.{i}.{name}' is a {type(e[name]).__name__} (allowed: a string)"
    notes = doc.get("notes", [])
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        return "field 'notes' is not a list of strings"
    phases = doc.get("phases", [])
    if not isinstance(phases, list) or not all(isinstance(c, dict) for c in phases):
        return "field 'phases' is not a list of mappings"
    for name in ("recipe", "precision"):
        if name in doc and not isinstance(doc[name], str):
            return f"field {name!r} is a {type(doc[name]).__name__} (allowed: a string)"
    return None


def _series(doc: dict[str, Any], key: str) -> tuple[list[int], list[float]]:
    data = doc.get("series", {}).get(key, {})
    xs, ys = [], []
    for k, v in data.items():
        try:
            y = float(v)
        except (TypeError, ValueError):
            continue
        xs.append(int(k))
        ys.append(y)
    return xs, ys


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    """What ``hf-mixedprec report`` prints: counts, the last value of the main series, events and notes."""
    events = list(doc.get("events", []))
    by_detector: dict[str, int] = {}
    for e in events:
        by_detector[e.get("detector", "?")] = by_detector.get(e.get("detector", "?"), 0) + 1
    last: dict[str, float] = {}
    for key in ("loss", M.LOSS_SCALE, M.SKIPPED_STEPS, M.GRAD_NORM, M.CLIP_THRESHOLD):
        xs, ys = _series(doc, key)
        if xs:
            last[key] = ys[-1]
    head = f"recipe {doc.get('recipe', '?')} ({doc.get('precision', '?')}"
    head += ", rehearsed)" if doc.get("rehearsed") else ")"
    head += f", {doc.get('steps', '?')} optimizer steps"
    lines = [head]
    if last:
        lines.append("last: " + ", ".join(f"{k} {v:g}" for k, v in last.items()))
    lines.append(
        f"health events: {len(events)}"
        + (" (" + ", ".join(f"{k} x{v}" for k, v in sorted(by_detector.items())) + ")" if events else "")
    )
    storage = doc.get("storage")
    if isinstance(storage, dict) and isinstance(storage.get("lines"), list):
        lines.append(f"storage ({storage.get('bytes_per_param', 0):.2f} bytes per trainable parameter):")
        lines += [f"  {line}" for line in storage["lines"]]
    rows = doc.get("precision_map")
    if isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows):
        lines.append("precision map (as the run was prepared):")
        lines += [f"  {line}" for line in format_rows(rows)]
    groups = doc.get("rule_groups")
    if isinstance(groups, list) and groups:
        lines.append("modules rules (GEMM layers each governs; worst FP8 statistics over the run):")
        lines += [f"  {_group_line(g)}" for g in groups if isinstance(g, dict)]
    switches = _phase_switches(doc)
    if switches:
        lines.append("phases: " + ", ".join(f"{name} ({prec}) after step {step}" for step, name, prec in switches))
    for e in events:
        where = f" [{e['layer']}]" if e.get("layer") else ""
        lines.append(f"  step {e.get('step')}: {e.get('detector')}{where}: {e.get('message')} -> {e.get('reaction')}")
    notes = list(doc.get("notes", []))
    lines.append(f"notes: {len(notes)}")
    lines += [f"  {n}" for n in notes]
    return {"events": len(events), "by_detector": by_detector, "last": last, "notes": notes, "lines": lines}


def _group_line(g: dict[str, Any]) -> str:
    text = f"{shorten(str(g.get('rule')), 40)}: {g.get('layers', '?')} layers, {g.get('fp8_layers', '?')} in FP8"
    stats = [
        f"{k.removeprefix('worst_')} {g[k]:.4g}"
        for k in ("worst_saturation", "worst_underflow", "worst_sqnr_db")
        if _finite(g.get(k))
    ]
    return text + (f" ({', '.join(stats)})" if stats else "")


def build_plots(run_dir: str | Path, doc: dict[str, Any] | None = None) -> list[Path]:
    """Write the PNG plots for ``run_dir`` (from ``doc`` or its ``health.json``); return the files written.

    ``loss.png`` (train and eval loss), ``loss_scale.png`` (FP16), ``grad_norm.png`` (with the clip threshold),
    ``skipped_steps.png`` (each skipped step marked where it happened) and ``fp8_saturation.png`` (FP8 with
    sampled per-layer statistics); a plot is written only when the run has its series.
    """
    require("matplotlib", "finetune", "the run report's plots")
    # a Figure on its own Agg canvas, not pyplot: no global backend switched in the user's process (a notebook keeps
    # its own), no figure manager to close, and half a second less per run than pyplot's import and tight layout
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    run_dir = Path(run_dir)
    if doc is None:
        doc = json.loads((run_dir / HEALTH_FILE).read_text())
    written: list[Path] = []
    for name, draw in _PLOTS:
        fig = Figure(figsize=(7, 3.5))
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        if draw(ax, doc):
            _mark_phases(ax, doc)
            ax.set_xlabel("optimizer step")
            ax.grid(alpha=0.3)
            fig.subplots_adjust(left=0.11, right=0.98, bottom=0.14, top=0.91)
            fig.savefig(run_dir / name, dpi=100)
            written.append(run_dir / name)
    return written


def _phase_switches(doc: dict[str, Any]) -> list[tuple[int, str, str]]:
    """A phased run's switches as (step, phase name, precision); malformed entries are left out."""
    out = []
    for c in doc.get("phases", []) or []:
        if isinstance(c, dict) and isinstance(c.get("step"), int):
            out.append((c["step"], str(c.get("name", "?")), str(c.get("precision", "?"))))
    return out


def _mark_phases(ax: Any, doc: dict[str, Any]) -> None:
    """A dotted line at every phase switch, labelled with the phase that begins there."""
    for step, name, precision in _phase_switches(doc):
        ax.axvline(step + 0.5, color="tab:purple", ls=":", lw=1.2)
        ax.annotate(
            f"{name} ({precision})",
            (step + 0.5, 1.0),
            xycoords=("data", "axes fraction"),
            fontsize=7,
            color="tab:purple",
            rotation=90,
            ha="right",
            va="top",
        )


def _plot_loss(ax: Any, doc: dict[str, Any]) -> bool:
    x, y = _series(doc, "loss")
    if not x:
        return False
    ax.plot(x, y, label="train loss (logged steps)", lw=1, marker="." if len(x) < 40 else None)
    ex, ey = _series(doc, "eval_loss")
    if ex:
        ax.plot(ex, ey, label="eval loss (held-out blocks)", lw=1.5, marker="o")
    ax.set(title="loss", ylabel="cross-entropy (nats/token)")
    ax.legend(fontsize=8)
    return True


def _plot_loss_scale(ax: Any, doc: dict[str, Any]) -> bool:
    x, y = _series(doc, M.LOSS_SCALE)
    if not x:
        return False
    ax.step(x, y, where="post")
    ax.set_yscale("log", base=2)
    ax.set(title="FP16 loss scale (red: health events)", ylabel="scale")
    for e in doc.get("events", []):
        ax.axvline(e.get("step", 0), color="red", alpha=0.3, lw=1)
    return True


def _plot_grad_norm(ax: Any, doc: dict[str, Any]) -> bool:
    x, y = _series(doc, M.GRAD_NORM)
    if not x:
        x, y = _series(doc, "grad_norm")
    if not x:
        return False
    ax.plot(x, y, label="grad norm (unscaled, before clipping)", lw=1)
    tx, ty = _series(doc, M.CLIP_THRESHOLD)
    if tx:
        ax.plot(tx, ty, label="clip threshold", lw=1, ls="--")
    ax.set_yscale("log")
    ax.set(title="gradient norm", ylabel="L2 norm")
    ax.legend(fontsize=8)
    return True


def _plot_skips(ax: Any, doc: dict[str, Any]) -> bool:
    """Where skips happened (the cumulative count rising between two logged steps), not a flat count line."""
    x, y = _series(doc, M.SKIPPED_STEPS)
    if not x:
        return False
    rises = [(s, b - a) for s, a, b in zip(x[1:], y, y[1:]) if b > a]
    if y and y[0] > 0:
        rises.insert(0, (x[0], y[0]))
    total = int(y[-1]) if y else 0
    if rises:
        ax.bar([s for s, _ in rises], [n for _, n in rises], width=max(1.0, (x[-1] - x[0]) / 150), color="tab:red")
        ax.set(ylabel="steps skipped since the last log")
    else:
        ax.text(0.5, 0.5, "no optimizer step was skipped", ha="center", va="center", transform=ax.transAxes)
        ax.set_yticks([])
    ax.set_xlim(x[0] - 0.5, x[-1] + 0.5)
    ax.set(title=f"skipped optimizer steps: {total} in {int(x[-1])} steps")
    return True


def _plot_fp8(ax: Any, doc: dict[str, Any]) -> bool:
    series = doc.get("series", {})
    sat = {k: _series(doc, k) for k in series if k.startswith(M.FP8_PREFIX) and k.endswith("/saturation")}
    if not sat:
        return False
    top = sorted(sat.items(), key=lambda kv: -max(kv[1][1] or [0]))[:8]
    for key, (sx, sy) in top:
        ax.plot(sx, [100 * v for v in sy], label=key[len(M.FP8_PREFIX) : -len("/saturation")], lw=1, marker=".")
    ax.set(title="FP8 saturation per layer (top 8)", ylabel="% of values clipped")
    ax.legend(fontsize=7)
    return True


_PLOTS = (
    ("loss.png", _plot_loss),
    ("loss_scale.png", _plot_loss_scale),
    ("grad_norm.png", _plot_grad_norm),
    ("skipped_steps.png", _plot_skips),
    ("fp8_saturation.png", _plot_fp8),
)


#: Said when the run report's plots are left out.
NO_PLOTS = "plots not written: matplotlib is not installed (pip install 'hf_mixedprec[finetune]'; then `hf-mixedprec report RUN_DIR` draws them)"


def write_run_report(
    out_dir: str | Path, *, log_history: list[dict[str, Any]], runtime: Any = None, extra: dict[str, Any] | None = None
) -> list[Path]:
    """Write ``health.json``, the plots and (FP8) ``conversion_report.json`` into ``out_dir``. Without matplotlib the
    plots are left out, loudly (a note in ``health.json`` and the log): a finished run is worth more than its plots."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = health_document(log_history, runtime, extra)
    plots = available("matplotlib")
    if not plots:
        doc.setdefault("notes", []).append(NO_PLOTS)
        logging.getLogger("hf_mixedprec").warning("hf_mixedprec: %s", NO_PLOTS)
    path = out / HEALTH_FILE
    path.write_text(json.dumps(doc, indent=1))
    written = [path]
    if runtime is not None and getattr(runtime, "fp8_report", None) is not None:
        conv = out / "conversion_report.json"
        conv.write_text(runtime.fp8_report.to_json())
        written.append(conv)
    if plots:
        written += build_plots(out, doc)
    return written
