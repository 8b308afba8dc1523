"""Scale-health monitoring: detectors recorded on the device every step, evaluated on check steps only.

``HealthMonitor`` is trainer-free. Every optimizer step it *records* device tensors (raw loss, unscaled grad
norm, whether the step was skipped, the loss scale) without reading them, and computes on the device only
what must act on that very step (the flags of ``skip_step`` detectors). :meth:`HealthMonitor.check` (called
on logging steps only) reads the records with one device-to-host copy and replays every detector over them
step by step (ring buffers and latched flags in Python floats), so each event carries the first step it
fired and its value then, exactly as a per-step evaluation would, for a few tensor operations per step.

The detectors are the rows of :data:`hf_mixedprec.recipes.detectors.DETECTORS`, each evaluated by its measure kind with
code shared by that kind (:func:`_judge` on the host; :meth:`HealthMonitor.pre_step` on the device for the
``skip_step`` rows of the loss and grad norm), with thresholds from the recipe's ``health``. A detector whose
reaction is ``skip_step`` marks the step for skipping on the device (see :meth:`skip_flag`); the runtime folds
that into the GradScaler's found-inf so the optimizer skips it exactly.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from hf_mixedprec.core._device import Constants
from hf_mixedprec.recipes.detectors import DETECTORS, STATE_SLOTS, STEP_DETECTORS, Detector
from hf_mixedprec.recipes.detectors import LAYER_DETECTORS as LAYER_DETECTORS  # re-exported, as before the table
from hf_mixedprec.recipes.schema import DetectorConfig, DetectorsConfig, HealthConfig
from hf_mixedprec.scaling.stats import (
    METRICS,
    ROLES,
    LayerStats,
    StatsLayout,
    layer_stats_from_table,
    stack_layer_stats,
    unstack_layer_stats,
)

__all__ = ["STEP_DETECTORS", "HealthEvent", "HealthMonitor", "LayerBreach", "layer_breaches", "threshold_of"]

_STEP_ROWS = tuple(d for d in DETECTORS if d.kind not in ("fp8_layer", "experts"))
_LAYER_ROWS = tuple(d for d in DETECTORS if d.kind == "fp8_layer")
_EXPERT_ROWS = tuple(d for d in DETECTORS if d.kind == "experts")
#: The signals :meth:`HealthMonitor.pre_step` receives: the only ones a device-side check can read.
_PRE_STEP_SIGNALS = ("loss", "grad_norm")
#: Each comparison of the table, its sign in messages, and the threshold it never crosses (a recipe's null).
_CROSSES = {"above": operator.gt, "below": operator.lt, "at_or_above": operator.ge, "at_or_below": operator.le}
_SIGN = {"above": ">", "below": "<", "at_or_above": ">=", "at_or_below": "<="}
_NEVER = {"above": math.inf, "below": -math.inf, "at_or_above": math.inf, "at_or_below": -math.inf}
#: Start values of the running numbers a kind keeps (:data:`~hf_mixedprec.recipes.detectors.STATE_SLOTS`).
_START = {"count": 0.0, "last": math.nan}
#: A spike needs at least this many finite values in its window before it can fire.
MIN_SPIKE_HISTORY = 8
#: Recorded steps are stacked into one device tensor this often, so a run that never logs holds little.
FLUSH_EVERY = 256


@dataclass(frozen=True)
class HealthEvent:
    """A detector fired: when, what it saw, and what the recipe says to do."""

    step: int
    detector: str
    reaction: str
    value: float
    threshold: float | None
    message: str
    layer: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class LayerBreach:
    """A per-layer FP8 detector's threshold crossed by one operand of one layer."""

    detector: str
    role: str
    metric: str
    value: float
    threshold: float


def layer_breaches(values: Mapping[str, Mapping[str, float]], detectors: DetectorsConfig) -> list[LayerBreach]:
    """The per-layer FP8 detectors one layer's ``values`` (role -> metric -> value) set off, role by role in
    table order, each compared as its row says (SQNR below its threshold, the other metrics above); a disabled
    detector, one without a threshold, a metric not measured and NaN never fire."""
    out = []
    for role in ROLES:
        got = values.get(role, {})
        for row in _LAYER_ROWS:
            cfg: DetectorConfig = getattr(detectors, row.name)
            v = got.get(row.signal)
            if cfg.enabled and cfg.threshold is not None and v is not None and _crosses(row, cfg, v):
                out.append(LayerBreach(row.name, role, row.signal, v, cfg.threshold))
    return out


class _Ring:
    """A fixed-size device ring buffer of float32 values (NaN = empty) indexed by a host counter."""

    def __init__(self, size: int, device: torch.device):
        self.buf = torch.full((size,), float("nan"), device=device)

    def put(self, i: int, value: Tensor) -> None:
        self.buf[i % self.buf.numel()] = value


class HealthMonitor:
    """The detectors of a recipe's ``health`` section (see module docs).

    Per step it only *records* device tensors (raw loss, grad norm, skipped flag, loss scale) and computes
    the flags of ``skip_step`` detectors on the device; the records are stacked into one device tensor every
    :data:`FLUSH_EVERY` steps. :meth:`check` reads them all with one copy and replays the detectors step by
    step on the host (Python floats, microseconds for a logging interval), so the events, the latched first
    step and value, and the windows are the same as if every step had been evaluated when it ran. Per step
    this costs a handful of tensor operations instead of ~150 on 0-d tensors (each a kernel launch on a GPU).
    """

    def __init__(self, cfg: HealthConfig, *, device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.det = cfg.detectors
        self.device = torch.device(device)
        self.step = 0  # optimizer steps recorded (host)
        #: the per-step rows with the recipe's settings for each, in table order (the order of events)
        self.rows: list[tuple[Detector, DetectorConfig]] = [(r, getattr(self.det, r.name)) for r in _STEP_ROWS]
        # the rows' running state under its checkpoint keys: windows of past values, and running numbers
        self.windows: dict[str, _Window] = {}
        self._starts: dict[str, float] = {}
        for row, c in self.rows:
            for key, slot in zip(row.state, STATE_SLOTS.get(row.kind, ()), strict=True):
                if slot == "window":  # Detector makes sure windowed kinds have a default
                    self.windows[key] = _Window(c.window or row.window)  # type: ignore[arg-type]
                else:
                    self._starts[key] = _START[slot]
        self.counters = dict(self._starts)
        self.skipped_total = 0.0
        self.latched: dict[str, tuple[int, float]] = {}  # since the last check: first step fired, value then
        self.layer_values: dict[str, LayerStats] = {}
        # per-step records not yet replayed: the open step, closed steps, and stacked chunks of older ones
        self._cur: dict[str, Tensor] = {}
        self._rows: list[tuple[int, dict[str, Tensor]]] = []
        self._chunks: list[tuple[Tensor, list[tuple[int, tuple[str, ...]]]]] = []
        self._requested: tuple[list[Any], StatsLayout] = ([], [])  # what check_request stacked, for check
        # device side, only for what must act on the step itself (skip_step reactions)
        self._on_device = [
            (row, c)
            for row, c in self.rows
            if c.enabled and c.reaction == "skip_step" and row.signal in _PRE_STEP_SIGNALS
            if row.kind == "nonfinite" or (row.kind == "zscore" and c.threshold is not None)
        ]
        rings = [row.state[0] for row, _ in self._on_device if row.kind == "zscore"]  # beside the host window
        self._dev_rings = {key: _Ring(len(self.windows[key].vals), self.device) for key in rings}
        self._samples_update = any(c.threshold is not None for row, c in self.rows if row.signal == "update_ratio")
        self._never = torch.zeros((), dtype=torch.bool, device=self.device)
        self._k = Constants()
        self._skip_now = self._never

    @property
    def can_skip(self) -> bool:
        """Whether any detector has the ``skip_step`` reaction (else :meth:`pre_step` never asks for a skip)."""
        return bool(self._on_device)

    # -- per step (device only) ----------------------------------------------------------------------
    def pre_step(self, *, loss: Tensor | None, grad_norm: Tensor | None) -> Tensor:
        """Before the optimizer step: record the raw loss and grad norm; returns the device flag 'skip this
        step' (non-finite or spiking values whose detector reacts with ``skip_step``)."""
        skip: Tensor | None = None
        for signal, value in zip(_PRE_STEP_SIGNALS, (loss, grad_norm), strict=True):
            if value is None:
                continue
            v = self._cur[signal] = self._as_f32(value)
            for row, c in self._on_device:
                if row.signal != signal:
                    continue
                if row.kind == "nonfinite":
                    flag = self._k.nonfinite(v)
                else:  # zscore: decided here, and the replay takes this very decision
                    flag = self._cur[row.name] = self._device_spike(row, v, c.threshold)
                skip = flag if skip is None else skip | flag
        self._skip_now = self._never if skip is None else skip
        return self._skip_now

    def _device_spike(self, row: Detector, v: Tensor, threshold: Any) -> Tensor:
        """z-score spike test of ``v`` against its device ring (``skip_step`` zscore detectors only)."""
        ring = self._dev_rings[row.state[0]]
        valid = torch.isfinite(ring.buf)
        n = valid.sum()
        vals = torch.where(valid, ring.buf, 0.0)
        mean = vals.sum() / n.clamp_min(1)
        var = torch.where(valid, (ring.buf - mean) ** 2, 0.0).sum() / n.clamp_min(1)
        z = (v - mean) / (var.sqrt() + 1e-12)
        finite = torch.isfinite(v)
        spike = finite & (n >= MIN_SPIKE_HISTORY) & _CROSSES[str(row.compare)](z, threshold)
        ring.put(self.step, torch.where(finite & ~spike, v, float("nan")))
        return spike

    def observe_update(self, ratio: Tensor, skipped: Tensor) -> None:
        """On a sampled step, before :meth:`post_step`: RMS(update)/RMS(weight) of the low-precision params."""
        if not self._samples_update:
            return
        self._cur["update_ratio"] = self._as_f32(ratio)
        self._cur["update_ratio_skipped"] = self._as_f32(skipped)

    def post_step(self, *, skipped: Tensor, scale: Tensor | None) -> None:
        """After the optimizer step: record whether it was skipped and the loss scale; closes the step."""
        self._cur["skipped"] = self._as_f32(skipped)
        if scale is not None:
            self._cur["loss_scale"] = self._as_f32(scale).clone()  # the scaler updates its tensor in place
        self.step += 1
        self._rows.append((self.step, self._cur))
        self._cur = {}
        if len(self._rows) >= FLUSH_EVERY:
            self._flush()

    def _as_f32(self, t: Tensor) -> Tensor:
        if t.requires_grad:
            t = t.detach()
        if t.dtype != torch.float32 or t.device != self.device:
            t = t.to(device=self.device, dtype=torch.float32)
        return t if t.dim() == 0 else t.reshape(())

    def _flush(self) -> None:
        """Stack the closed steps' records into one device tensor (no host read), bounding what is held."""
        if not self._rows:
            return
        layout = [(step, tuple(rec)) for step, rec in self._rows]
        flat = [t if t.dtype == torch.float32 else t.float() for _, rec in self._rows for t in rec.values()]
        self._chunks.append((torch.stack(flat), layout))
        self._rows = []

    # -- FP8 layers (sampled steps) ------------------------------------------------------------------
    def observe_fp8(self, layers: Mapping[str, LayerStats | Mapping[str, Tensor]]) -> None:
        """Per-layer FP8 statistics (``EmulatedFP8Linear.stats``, or its flat ``dict``) from a sampled step; the
        worst of the samples since the last check is kept until :meth:`check` (a logging step) reads it."""
        records = {name: LayerStats.from_flat(stats).detach() for name, stats in layers.items()}
        merged = _worst_of_tables(self.layer_values, records)
        if merged is not None:  # one table each (the emulated and native layers): merged whole
            self.layer_values = merged
            return
        for name, new in records.items():
            seen = self.layer_values.get(name)
            # several samples before a check: keep the worst of them
            self.layer_values[name] = new if seen is None else seen.worst(new)

    # -- decisions (host sync) -------------------------------------------------------------------------
    def sync(self) -> None:
        """Read the recorded steps (one device-to-host copy) and run the detectors over them in order."""
        self._flush()
        chunks, self._chunks = self._chunks, []
        if chunks:
            self._replay_chunks(chunks, torch.cat([c for c, _ in chunks]).tolist())

    def _replay_chunks(self, chunks: list[tuple[Tensor, list[tuple[int, tuple[str, ...]]]]], data: list[float]) -> None:
        pos = 0
        for _, layout in chunks:
            for step, keys in layout:
                rec = dict(zip(keys, data[pos : pos + len(keys)]))
                pos += len(keys)
                self._replay(step, rec)

    def check_request(self) -> Tensor | None:
        """Everything the next :meth:`check` reads (the recorded steps, the sampled FP8 layers' statistics) as one
        flat float32 device tensor, so a caller can read it with its own values in one copy and pass the host
        values to :meth:`check`; None when there is nothing to read. No host read."""
        self._flush()
        chunks, self._chunks = self._chunks, []
        layers, layout = stack_layer_stats(self.layer_values, self.device)
        self._requested = (chunks, layout)
        parts = [c for c, _ in chunks] + ([layers] if layers is not None else [])
        return (parts[0] if len(parts) == 1 else torch.cat(parts)) if parts else None

    def _latch(self, name: str, cond: bool, value: float, step: int) -> None:
        if cond and name not in self.latched and getattr(self.det, name).enabled:
            self.latched[name] = (step, value)

    def _replay(self, step: int, rec: dict[str, float]) -> None:
        """One step's detectors on the host, each by its kind (:func:`_judge`), in table order."""
        s = rec["skipped"]
        rec["skipped"] = min(max(s, 0.0), 1.0) if s == s else 0.0  # a 0/1 flag (NaN: not skipped)
        self.skipped_total += rec["skipped"]
        for row, c in self.rows:
            v = rec.get(row.signal)
            if v is not None:  # else not recorded this step (no loss scale, not a sampled step)
                _judge(self, row, c, v, rec, step)

    def check(self, values: list[float] | None = None) -> list[HealthEvent]:
        """Events fired since the last check (reads device values; call on logging/sampling steps only).

        ``values``: the host values of :meth:`check_request`'s tensor, read by the caller; without them this
        makes the request and reads it itself (one copy)."""
        if values is None:
            request = self.check_request()
            values = [] if request is None else request.tolist()
        chunks, layout = self._requested
        self._requested = ([], [])
        n_steps = sum(len(keys) for _, lay in chunks for _, keys in lay)
        self._replay_chunks(chunks, values[:n_steps])
        events = []
        for row, c in self.rows:
            if row.name in self.latched:
                step, value = self.latched[row.name]
                msg = _message(row, c, value)
                events.append(HealthEvent(step, row.name, c.reaction, value, c.threshold, msg))
        self.latched = {}
        return events + self._check_layers(unstack_layer_stats(values[n_steps:], layout))

    def _check_layers(self, values: dict[str, dict[str, dict[str, float]]]) -> list[HealthEvent]:
        """The per-layer FP8 events of the values read: by detector, then layer, then role."""
        events: list[HealthEvent] = []
        self.layer_values = {}
        active = [(row, c) for row in _LAYER_ROWS if (c := getattr(self.det, row.name)).enabled]
        if not values or not any(c.threshold is not None for _, c in active):
            return events
        found = [(layer, layer_breaches(v, self.det)) for layer, v in values.items()]
        for row, c in active:
            for layer, breaches in found:
                for b in breaches:
                    if b.detector == row.name:
                        msg = row.message.format(layer=layer, op=_SIGN[str(row.compare)], **asdict(b))
                        events.append(HealthEvent(self.step, row.name, c.reaction, b.value, b.threshold, msg, layer))
        return events

    def check_experts(self, modules: Mapping[str, Mapping[str, float]]) -> list[HealthEvent]:
        """The MoE experts events of the values a logging step read per experts module
        (:meth:`hf_mixedprec.training.expert_load.ExpertLoad.read`): by detector, then module; NaN never fires."""
        events: list[HealthEvent] = []
        for row in _EXPERT_ROWS:
            c: DetectorConfig = getattr(self.det, row.name)
            if not c.enabled or c.threshold is None:
                continue
            for layer, v in modules.items():
                value = v[row.signal]
                if math.isfinite(value) and _crosses(row, c, value):
                    msg = row.message.format(
                        layer=layer, value=value, threshold=c.threshold, expert=int(v["idle_expert"]),
                        busiest=int(v["busiest_expert"]), dead=v["dead_experts"],
                    )  # fmt: skip
                    events.append(HealthEvent(self.step, row.name, c.reaction, value, c.threshold, msg, layer))
        return events

    def skip_flag(self) -> Tensor:
        """Device flag: a ``skip_step`` detector fired on the current step."""
        return self._skip_now

    def reset_windows(self) -> None:
        """Forget the windowed history (used when resuming a run that a health reaction stopped)."""
        self.sync()
        for window in self.windows.values():
            window.load(None)
        for ring in self._dev_rings.values():
            ring.buf.fill_(float("nan"))
        self.counters.update(self._starts)

    # -- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-friendly state (reads the recorded steps first: call on checkpoint steps only)."""
        return _monitor_state(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _load_monitor_state(self, state)


def _monitor_state(mon: HealthMonitor) -> dict[str, Any]:
    """:meth:`HealthMonitor.state_dict`: the rows' running state under their table keys (``loss_hist``...)."""
    mon.sync()
    return {
        "version": 1,
        "step": mon.step,
        **{key: list(window.vals) for key, window in mon.windows.items()},
        **mon.counters,
        "skipped_total": mon.skipped_total,
        # latched since the last check: a resumed run turns them into the same events at the same check
        "latched": {n: list(mon.latched[n]) for n in STEP_DETECTORS if n in mon.latched},
        "layer_values": {layer: {k: float(v) for k, v in stats.items()} for layer, stats in mon.layer_values.items()},
    }


def _load_monitor_state(mon: HealthMonitor, state: dict[str, Any]) -> None:
    """:meth:`HealthMonitor.load_state_dict`."""
    if state.get("version") != 1:
        raise ValueError(f"health monitor state version {state.get('version')!r} (expected 1)")
    mon._cur, mon._rows, mon._chunks = {}, [], []
    mon.step = int(state["step"])
    for key, hist in mon.windows.items():
        data = [float(x) for x in state[key]]
        if len(data) != len(hist.vals):
            raise ValueError(f"health state {key} has {len(data)} entries, the recipe's window is {len(hist.vals)}")
        hist.load(data)
        if key in mon._dev_rings:  # the device ring holds what the host window holds
            mon._dev_rings[key].buf = torch.tensor(hist.vals, dtype=torch.float32, device=mon.device)
    mon.counters = {key: float(state[key]) for key in mon.counters}
    mon.skipped_total = float(state["skipped_total"])
    latched = state.get("latched", {})  # absent in checkpoints written before latches were saved
    mon.latched = {n: (int(latched[n][0]), float(latched[n][1])) for n in STEP_DETECTORS if n in latched}
    mon.layer_values = {
        layer: LayerStats.from_flat({k: torch.tensor(float(v), device=mon.device) for k, v in stats.items()})
        for layer, stats in state.get("layer_values", {}).items()
    }


def _judge(mon: HealthMonitor, row: Detector, c: DetectorConfig, v: float, rec: dict[str, float], step: int) -> None:
    """One per-step row's verdict on its signal's value ``v`` at ``step``, by the row's kind (the kinds are
    described in :mod:`hf_mixedprec.recipes.detectors`); latches the detector when it fires. Host only."""
    name, state = row.name, row.state
    match row.kind:
        case "nonfinite":
            mon._latch(name, not math.isfinite(v), v, step)
        case "zscore":  # a value that fires stays out of the window
            hist, finite = mon.windows[state[0]], math.isfinite(v)
            if name in rec:  # decided on the device (a skip_step reaction): use that very decision
                fired = rec[name] > 0.5
            else:
                thr = _limit(row, c)
                fired = finite and hist.n >= MIN_SPIKE_HISTORY and _CROSSES[str(row.compare)](hist.zscore(v, thr), thr)
            if fired and c.enabled and name not in mon.latched:
                mon._latch(name, True, hist.zscore(v), step)
            hist.put(step - 1, v if finite and not fired else math.nan)
        case "rate":  # over the steps seen while the window fills
            hist = mon.windows[state[0]]
            hist.put(step - 1, v)
            rate = hist.s1 / min(step, len(hist.vals))
            mon._latch(name, _crosses(row, c, rate), rate, step)
        case "run":
            n = mon.counters[state[0]] = (mon.counters[state[0]] + 1) * v
            mon._latch(name, _crosses(row, c, n), n, step)
        case "floor":
            mon._latch(name, _crosses(row, c, v), v, step)
        case "backoffs":  # decreases within the window, firing only without an increase there
            down, up, prev = mon.windows[state[0]], mon.windows[state[1]], mon.counters[state[2]]
            known = math.isfinite(prev)
            down.put(step - 1, float(known and v < prev))
            up.put(step - 1, float(known and v > prev))
            mon._latch(name, _crosses(row, c, down.s1) and up.s1 == 0, down.s1, step)
            mon.counters[state[2]] = v
        case "ratio":  # on steps taken only: a skipped step changes nothing on purpose
            taken = rec[f"{row.signal}_skipped"] < 0.5
            mon._latch(name, taken and math.isfinite(v) and _crosses(row, c, v), v, step)
        case _:
            raise ValueError(f"detector {name}: no host evaluation for kind {row.kind!r}")


def _message(row: Detector, cfg: DetectorConfig, value: float) -> str:
    """The row's message for a per-step event (an unset threshold reads 0)."""
    thr = threshold_of(cfg, 0.0)
    return row.message.format(
        value=value, threshold=thr, window=cfg.window, value_pct=100 * value, threshold_pct=100 * thr
    )


def _table_of(records: Mapping[str, LayerStats]) -> tuple[Tensor, list[tuple[str, int, Any]]] | None:
    """The one finished table every record views, with each layer's row and measured roles; None otherwise."""
    table, rows = None, []
    for name, rec in records.items():
        src = rec.source
        if src is None or (table is not None and src[0] is not table):
            return None
        table = src[0]
        rows.append((name, src[1], tuple(getattr(rec, r) is not None for r in ROLES)))
    return None if table is None else (table, rows)


def _worst_of_tables(held: Mapping[str, LayerStats], new: Mapping[str, LayerStats]) -> dict[str, LayerStats] | None:
    """``new`` merged into ``held`` (the worse of each statistic, as :meth:`LayerStats.worst`) in a fixed number of
    tensor operations, when both are whole views of one table each over the same layers, rows and measured roles;
    None when the per-layer merge is needed."""
    b = _table_of(new)
    if b is None:
        return None
    if not held:
        return dict(new)
    a = _table_of(held)
    if a is None or a[1] != b[1] or a[0].shape != b[0].shape:
        return None
    if [i for _, i, _ in b[1]] != list(range(b[0].shape[0])):
        return None  # a table that holds other layers too, or in another order: merge per layer
    x, y = a[0], b[0]
    sqnr = METRICS.index("sqnr_db")  # the lower SQNR is the worse; every other statistic, the higher (NaN wins)
    worst = torch.cat(
        [
            torch.maximum(x[..., :sqnr], y[..., :sqnr]),
            torch.minimum(x[..., sqnr : sqnr + 1], y[..., sqnr : sqnr + 1]),
            torch.maximum(x[..., sqnr + 1 :], y[..., sqnr + 1 :]),
        ],
        dim=-1,
    )
    flags = []
    for name, _, measured in b[1]:
        roles = [s for r in ROLES if (s := getattr(new[name], r)) is not None]
        flags.append((measured, any(s.mx_clamp is not None for s in roles)))
    return dict(zip((name for name, _, _ in b[1]), layer_stats_from_table(worst, flags)))


class _Window:
    """The last ``size`` values of a per-step series on the host (NaN: empty or excluded), indexed by step,
    with the count, sum and sum of squares of its finite values kept up to date, so that replaying a step
    costs O(1) rather than a pass over the window. The sums are recomputed exactly (``math.fsum``) once per
    ``size`` updates, so rounding cannot drift; for 0/1 series (skips, backoffs) they are exact anyway."""

    def __init__(self, size: int):
        self.vals = [math.nan] * size
        self.n, self.s1, self.s2 = 0, 0.0, 0.0
        self._puts = 0

    def put(self, i: int, value: float) -> None:
        j = i % len(self.vals)
        old = self.vals[j]
        if math.isfinite(old):
            self.n, self.s1, self.s2 = self.n - 1, self.s1 - old, self.s2 - old * old
        self.vals[j] = value
        if math.isfinite(value):
            self.n, self.s1, self.s2 = self.n + 1, self.s1 + value, self.s2 + value * value
        self._puts += 1
        if self._puts % len(self.vals) == 0:
            self._recount()

    def load(self, values: list[float] | None) -> None:
        self.vals = [math.nan] * len(self.vals) if values is None else list(values)
        self._recount()

    def _recount(self) -> None:
        finite = [v for v in self.vals if math.isfinite(v)]
        self.n, self.s1, self.s2 = len(finite), math.fsum(finite), math.fsum(v * v for v in finite)

    def zscore(self, x: float, near: float | None = None) -> float:
        """(x - mean) / (population std + 1e-12) of the finite values, in two passes (exact); with ``near`` (a
        threshold) from the running sums instead, unless the result is close enough to ``near`` for rounding to
        decide a comparison or the variance was lost in cancellation."""
        if near is not None:
            n = max(self.n, 1)
            mean = self.s1 / n
            var = max(self.s2 / n - mean * mean, 0.0)
            z = (x - mean) / (math.sqrt(var) + 1e-12)
            if not (abs(z - near) <= 1e-6 * max(1.0, abs(near)) or (var < 1e-9 * mean * mean)):
                return z
        finite = [v for v in self.vals if math.isfinite(v)]
        n = max(len(finite), 1)
        mean = math.fsum(finite) / n
        var = math.fsum((v - mean) ** 2 for v in finite) / n
        return (x - mean) / (math.sqrt(var) + 1e-12)

    def above(self, x: float, threshold: float) -> bool:
        """Whether :meth:`zscore` of ``x`` exceeds ``threshold`` (from the running sums where that is exact)."""
        return self.zscore(x, threshold) > threshold


def threshold_of(cfg: DetectorConfig, unset: float) -> float:
    """The detector's threshold, or ``unset`` (a value that never fires) when the recipe gives none; 0 is a value."""
    return unset if cfg.threshold is None else cfg.threshold


def _limit(row: Detector, cfg: DetectorConfig) -> float:
    """The recipe's threshold, or one the row's comparison never crosses."""
    return threshold_of(cfg, _NEVER[str(row.compare)])


def _crosses(row: Detector, cfg: DetectorConfig, x: float) -> bool:
    """Whether ``x`` is past the detector's threshold, as its row compares."""
    return bool(_CROSSES[str(row.compare)](x, _limit(row, cfg)))


def layers_to_bf16(model: nn.Module, names: list[str]) -> list[str]:
    """Move the named FP8 layers back to their high-precision type (``nn.Linear`` or transformers' ``Conv1D``,
    the same Parameter objects); return those moved. A projection of an MoE experts module
    (``<module>.down_proj``, as its statistics are named) moves the whole module: its experts compute in high
    precision again through the implementation they had."""
    from hf_mixedprec.fp8 import invalidate_layer_cache, to_high_precision
    from hf_mixedprec.fp8.experts import experts_stats, restore_experts
    from hf_mixedprec.fp8.swap import replace_module

    modules = dict(model.named_modules())
    moved = []
    projections = {n for n, _ in experts_stats(model)}
    owners = sorted({n.rsplit(".", 1)[0] for n in names if n in projections})
    if owners:
        restore_experts(model, owners)
        invalidate_layer_cache()
        moved += [n for n in names if n in projections]
    for name in names:
        mod = modules.get(name)
        high = to_high_precision(mod) if mod is not None else None
        if high is None:
            continue
        replace_module(model, name, high)
        moved.append(name)
    return moved
