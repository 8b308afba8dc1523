"""Scale-health monitoring: detectors recorded on the device every step, evaluated on check steps only.

``HealthMonitor`` is trainer-free. Every optimizer step it *records* device tensors (raw loss, unscaled grad
norm, whether the step was skipped, the loss scale) without reading them, and computes on the device only
what must act on that very step (the flags of ``skip_step`` detectors). :meth:`HealthMonitor.check` (called
on logging steps only) reads the records with one device-to-host copy and replays every detector over them
step by step (ring buffers and latched flags in Python floats), so each event carries the first step it
fired and its value then, exactly as a per-step evaluation would, for a few tensor operations per step.
Detectors (thresholds from the recipe's ``health``):

- ``nonfinite_loss`` / ``nonfinite_grad``: NaN/Inf in the raw loss (before Trainer's NaN filter) / gradients;
- ``skip_rate``: skipped optimizer steps over the last ``window`` steps above ``threshold``;
- ``consecutive_skips``: ``threshold`` skipped steps in a row;
- ``scale_floor``: loss scale at or below ``threshold``;
- ``death_spiral``: at least ``threshold`` backoffs and no growth within ``window`` steps (a model pretrained in
  BF16 and fine-tuned in FP16 drives the scale down this way);
- ``loss_spike`` / ``grad_spike``: z-score of the loss / grad norm against the previous ``window`` finite
  values above ``threshold`` (OLMo-core skips steps over 6 sigma in a window of 128);
- ``tiny_update``: on sampled steps, RMS(update) / RMS(weight) of the parameters stored in BF16/FP16 (pure
  low-precision training, no FP32 master copy) below ``threshold``. BF16 keeps 8 significant bits, so an
  update smaller than half an ulp (2**-9 of the weight, about 2e-3) rounds away and the weight stops
  changing. Parameters kept in FP32 (Trainer's default with autocast) accumulate any update, so they are
  not measured;
- ``fp8_saturation`` / ``fp8_underflow`` / ``fp8_sqnr`` / ``mx_clamp``: per FP8 layer, on sampled steps, from
  the layers' :class:`~hf_mixedprec.scaling.stats.LayerStats` (:func:`layer_breaches` decides, for simulate too).

A detector whose reaction is ``skip_step`` marks the step for skipping on the device (see
:meth:`skip_flag`); the runtime folds that into the GradScaler's found-inf so the optimizer skips it exactly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from hf_mixedprec._device import Constants
from hf_mixedprec.scaling.stats import (
    METRICS,
    ROLES,
    LayerStats,
    StatsLayout,
    layer_stats_from_table,
    stack_layer_stats,
    unstack_layer_stats,
)
from hf_mixedprec.schema import DetectorConfig, DetectorsConfig, HealthConfig

__all__ = ["STEP_DETECTORS", "HealthEvent", "HealthMonitor", "LayerBreach", "layer_breaches", "threshold_of"]

STEP_DETECTORS = (
    "nonfinite_loss",
    "nonfinite_grad",
    "skip_rate",
    "consecutive_skips",
    "scale_floor",
    "death_spiral",
    "loss_spike",
    "grad_spike",
    "tiny_update",
)
#: Per-layer FP8 detector -> the :class:`~hf_mixedprec.scaling.stats.RoleStats` metric it watches.
LAYER_DETECTORS = {
    "fp8_saturation": "saturation",
    "fp8_underflow": "underflow",
    "fp8_sqnr": "sqnr_db",
    "mx_clamp": "mx_clamp",
}
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
    :data:`LAYER_DETECTORS` order. SQNR fires below its threshold, the other metrics above; a disabled
    detector, one without a threshold, a metric not measured and NaN never fire."""
    out = []
    for role in ROLES:
        got = values.get(role, {})
        for det_name, metric in LAYER_DETECTORS.items():
            cfg: DetectorConfig = getattr(detectors, det_name)
            v = got.get(metric)
            if not cfg.enabled or cfg.threshold is None or v is None:
                continue
            if v < cfg.threshold if metric == "sqnr_db" else v > cfg.threshold:
                out.append(LayerBreach(det_name, role, metric, v, cfg.threshold))
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
        d = self.det
        self.step = 0  # optimizer steps recorded (host)
        self.loss_hist = _Window(d.loss_spike.window or 128)
        self.grad_hist = _Window(d.grad_spike.window or 128)
        self.skip_hist = _Window(d.skip_rate.window or 100)
        self.backoff_hist = _Window(d.death_spiral.window or 50)
        self.growth_hist = _Window(d.death_spiral.window or 50)
        self.consecutive = 0.0
        self.prev_scale = math.nan
        self.skipped_total = 0.0
        # latched since the last check: fired flag, first step it fired, value then
        self.fired = dict.fromkeys(STEP_DETECTORS, False)
        self.first_step = dict.fromkeys(STEP_DETECTORS, -1)
        self.value = dict.fromkeys(STEP_DETECTORS, 0.0)
        self.layer_values: dict[str, LayerStats] = {}
        # per-step records not yet replayed: the open step, closed steps, and stacked chunks of older ones
        self._cur: dict[str, Tensor] = {}
        self._rows: list[tuple[int, dict[str, Tensor]]] = []
        self._chunks: list[tuple[Tensor, list[tuple[int, tuple[str, ...]]]]] = []
        self._requested: tuple[list[Any], StatsLayout] = ([], [])  # what check_request stacked, for check
        # device side, only for what must act on the step itself (skip_step reactions)
        self._skip_loss = _skips(d.nonfinite_loss)
        self._skip_grad = _skips(d.nonfinite_grad)
        self._dev_rings = {
            name: _Ring(len(getattr(self, hist).vals), self.device)
            for name, hist in (("loss_spike", "loss_hist"), ("grad_spike", "grad_hist"))
            if _skips(getattr(d, name)) and getattr(d, name).threshold is not None
        }
        self._never = torch.zeros((), dtype=torch.bool, device=self.device)
        self._k = Constants()
        self._skip_now = self._never

    @property
    def can_skip(self) -> bool:
        """Whether any detector has the ``skip_step`` reaction (else :meth:`pre_step` never asks for a skip)."""
        return self._skip_loss or self._skip_grad or bool(self._dev_rings)

    # -- per step (device only) ----------------------------------------------------------------------
    def pre_step(self, *, loss: Tensor | None, grad_norm: Tensor | None) -> Tensor:
        """Before the optimizer step: record the raw loss and grad norm; returns the device flag 'skip this
        step' (non-finite or spiking values whose detector reacts with ``skip_step``)."""
        skip: Tensor | None = None
        for key, value, nonfinite, spike in (
            ("loss", loss, self._skip_loss, "loss_spike"),
            ("grad", grad_norm, self._skip_grad, "grad_spike"),
        ):
            if value is None:
                continue
            v = self._as_f32(value)
            self._cur[key] = v
            if nonfinite:
                bad = self._k.nonfinite(v)
                skip = bad if skip is None else skip | bad
            ring = self._dev_rings.get(spike)
            if ring is not None:
                flag = self._device_spike(ring, v, getattr(self.det, spike).threshold)
                self._cur[spike] = flag
                skip = flag if skip is None else skip | flag
        self._skip_now = self._never if skip is None else skip
        return self._skip_now

    def _device_spike(self, ring: _Ring, v: Tensor, threshold: float) -> Tensor:
        """z-score spike test of ``v`` against its device ring (``skip_step`` spike detectors only)."""
        valid = torch.isfinite(ring.buf)
        n = valid.sum()
        vals = torch.where(valid, ring.buf, 0.0)
        mean = vals.sum() / n.clamp_min(1)
        var = torch.where(valid, (ring.buf - mean) ** 2, 0.0).sum() / n.clamp_min(1)
        z = (v - mean) / (var.sqrt() + 1e-12)
        finite = torch.isfinite(v)
        spike = finite & (n >= MIN_SPIKE_HISTORY) & (z > threshold)
        ring.put(self.step, torch.where(finite & ~spike, v, float("nan")))
        return spike

    def observe_update(self, ratio: Tensor, skipped: Tensor) -> None:
        """On a sampled step, before :meth:`post_step`: RMS(update)/RMS(weight) of the low-precision params."""
        if self.det.tiny_update.threshold is None:
            return
        self._cur["ratio"] = self._as_f32(ratio)
        self._cur["ratio_skipped"] = self._as_f32(skipped)

    def post_step(self, *, skipped: Tensor, scale: Tensor | None) -> None:
        """After the optimizer step: record whether it was skipped and the loss scale; closes the step."""
        self._cur["skipped"] = self._as_f32(skipped)
        if scale is not None:
            self._cur["scale"] = self._as_f32(scale).clone()  # the scaler updates its tensor in place
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
        if cond and not self.fired[name] and getattr(self.det, name).enabled:
            self.fired[name] = True
            self.first_step[name] = step
            self.value[name] = value

    def _replay(self, step: int, rec: dict[str, float]) -> None:
        """One step's detectors, on the host, in the order the device would have run them."""
        d = self.det
        i = step - 1  # ring position (steps before this one)
        for key, hist, nonfinite, spike in (
            ("loss", self.loss_hist, "nonfinite_loss", "loss_spike"),
            ("grad", self.grad_hist, "nonfinite_grad", "grad_spike"),
        ):
            v = rec.get(key)
            if v is None:
                continue
            finite = math.isfinite(v)
            self._latch(nonfinite, not finite, v, step)
            thr = threshold_of(getattr(d, spike), math.inf)
            if spike in rec:  # decided on the device (a skip_step reaction): use that very decision
                fired = rec[spike] > 0.5
            else:
                fired = finite and hist.n >= MIN_SPIKE_HISTORY and hist.above(v, thr)
            if fired and getattr(d, spike).enabled and not self.fired[spike]:
                self._latch(spike, True, hist.zscore(v), step)
            hist.put(i, v if finite and not fired else math.nan)
        ratio = rec.get("ratio")
        if ratio is not None and d.tiny_update.threshold is not None:
            taken = rec["ratio_skipped"] < 0.5  # a skipped step changes nothing on purpose
            self._latch("tiny_update", taken and math.isfinite(ratio) and ratio < d.tiny_update.threshold, ratio, step)
        s = rec["skipped"]
        s = min(max(s, 0.0), 1.0) if s == s else 0.0
        self.skipped_total += s
        self.skip_hist.put(i, s)
        self.consecutive = (self.consecutive + 1) * s
        rate = self.skip_hist.s1 / min(step, len(self.skip_hist.vals))
        self._latch("skip_rate", rate > threshold_of(d.skip_rate, math.inf), rate, step)
        thr = threshold_of(d.consecutive_skips, math.inf)
        self._latch("consecutive_skips", self.consecutive >= thr, self.consecutive, step)
        scale = rec.get("scale")
        if scale is not None:
            self._latch("scale_floor", scale <= threshold_of(d.scale_floor, -math.inf), scale, step)
            prev = self.prev_scale
            known = math.isfinite(prev)
            self.backoff_hist.put(i, float(known and scale < prev))
            self.growth_hist.put(i, float(known and scale > prev))
            backoffs, growths = self.backoff_hist.s1, self.growth_hist.s1
            spiral = backoffs >= threshold_of(d.death_spiral, math.inf) and growths == 0
            self._latch("death_spiral", spiral, backoffs, step)
            self.prev_scale = scale

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
        events: list[HealthEvent] = []
        for n in STEP_DETECTORS:
            if self.fired[n]:
                cfg: DetectorConfig = getattr(self.det, n)
                value = self.value[n]
                events.append(
                    HealthEvent(self.first_step[n], n, cfg.reaction, value, cfg.threshold, _message(n, value, cfg))
                )
            self.fired[n] = False
            self.first_step[n] = -1
        events += self._check_layers(unstack_layer_stats(values[n_steps:], layout))
        return events

    def _check_layers(self, values: dict[str, dict[str, dict[str, float]]]) -> list[HealthEvent]:
        events: list[HealthEvent] = []
        active = [
            n for n in LAYER_DETECTORS if getattr(self.det, n).enabled and getattr(self.det, n).threshold is not None
        ]
        self.layer_values = {}
        if not values or not active:
            return events
        found = [(layer, layer_breaches(v, self.det)) for layer, v in values.items()]
        for det_name in active:  # events by detector, then layer, then role
            cfg: DetectorConfig = getattr(self.det, det_name)
            for layer, breaches in found:
                for b in breaches:
                    if b.detector == det_name:
                        op = "<" if b.metric == "sqnr_db" else ">"
                        msg = f"{layer} {b.role} {b.metric} {b.value:.4g} {op} {b.threshold:g}"
                        events.append(HealthEvent(self.step, det_name, cfg.reaction, b.value, b.threshold, msg, layer))
        return events

    def skip_flag(self) -> Tensor:
        """Device flag: a ``skip_step`` detector fired on the current step."""
        return self._skip_now

    def reset_windows(self) -> None:
        """Forget the windowed history (used when resuming a run that a health reaction stopped)."""
        self.sync()
        for key in _HISTORIES:
            getattr(self, key).load(None)
        for ring in self._dev_rings.values():
            ring.buf.fill_(float("nan"))
        self.consecutive = 0.0
        self.prev_scale = math.nan

    # -- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-friendly state (reads the recorded steps first: call on checkpoint steps only)."""
        return _monitor_state(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _load_monitor_state(self, state)


def _monitor_state(mon: HealthMonitor) -> dict[str, Any]:
    """:meth:`HealthMonitor.state_dict`."""
    mon.sync()
    return {
        "version": 1,
        "step": mon.step,
        **{key: list(getattr(mon, key).vals) for key in _HISTORIES},
        "consecutive": mon.consecutive,
        "prev_scale": mon.prev_scale,
        "skipped_total": mon.skipped_total,
        # latched since the last check: a resumed run turns them into the same events at the same check
        "latched": {n: [mon.first_step[n], mon.value[n]] for n in STEP_DETECTORS if mon.fired[n]},
        "layer_values": {layer: {k: float(v) for k, v in stats.items()} for layer, stats in mon.layer_values.items()},
    }


def _load_monitor_state(mon: HealthMonitor, state: dict[str, Any]) -> None:
    """:meth:`HealthMonitor.load_state_dict`."""
    if state.get("version") != 1:
        raise ValueError(f"health monitor state version {state.get('version')!r} (expected 1)")
    mon._cur, mon._rows, mon._chunks = {}, [], []
    mon.step = int(state["step"])
    for key in _HISTORIES:
        hist = getattr(mon, key)
        data = [float(x) for x in state[key]]
        if len(data) != len(hist.vals):
            raise ValueError(f"health state {key} has {len(data)} entries, the recipe's window is {len(hist.vals)}")
        hist.load(data)
    for name, ring in mon._dev_rings.items():
        src = mon.loss_hist if name == "loss_spike" else mon.grad_hist
        ring.buf = torch.tensor(src.vals, dtype=torch.float32, device=mon.device)
    mon.consecutive = float(state["consecutive"])
    mon.prev_scale = float(state["prev_scale"])
    mon.skipped_total = float(state["skipped_total"])
    latched = state.get("latched", {})  # absent in checkpoints written before latches were saved
    for name in STEP_DETECTORS:
        mon.fired[name] = name in latched
        mon.first_step[name], mon.value[name] = (
            (int(latched[name][0]), float(latched[name][1])) if name in latched else (-1, 0.0)
        )
    mon.layer_values = {
        layer: LayerStats.from_flat({k: torch.tensor(float(v), device=mon.device) for k, v in stats.items()})
        for layer, stats in state.get("layer_values", {}).items()
    }


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


_HISTORIES = ("loss_hist", "grad_hist", "skip_hist", "backoff_hist", "growth_hist")


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

    def zscore(self, x: float) -> float:
        """(x - mean) / (population std + 1e-12) of the finite values, computed in two passes (exact)."""
        finite = [v for v in self.vals if math.isfinite(v)]
        n = max(len(finite), 1)
        mean = math.fsum(finite) / n
        var = math.fsum((v - mean) ** 2 for v in finite) / n
        return (x - mean) / (math.sqrt(var) + 1e-12)

    def above(self, x: float, threshold: float) -> bool:
        """Whether :meth:`zscore` of ``x`` exceeds ``threshold``: from the running sums, and in two passes
        where the two are close enough for rounding to matter."""
        n = max(self.n, 1)
        mean = self.s1 / n
        var = max(self.s2 / n - mean * mean, 0.0)
        z = (x - mean) / (math.sqrt(var) + 1e-12)
        if abs(z - threshold) <= 1e-6 * max(1.0, abs(threshold)) or (var < 1e-9 * mean * mean):
            z = self.zscore(x)  # close to the threshold, or a variance lost in cancellation: recompute
        return z > threshold


def threshold_of(cfg: DetectorConfig, unset: float) -> float:
    """The detector's threshold, or ``unset`` (a value that never fires) when the recipe gives none; 0 is a value."""
    return unset if cfg.threshold is None else cfg.threshold


def _skips(cfg: DetectorConfig) -> bool:
    return cfg.enabled and cfg.reaction == "skip_step"


def _message(name: str, value: float, cfg: DetectorConfig) -> str:
    thr_v = threshold_of(cfg, 0.0)
    thr = f"{thr_v:g}"
    return {
        "nonfinite_loss": f"loss is {value} (NaN/Inf)",
        "nonfinite_grad": f"gradient norm is {value} (NaN/Inf)",
        "skip_rate": f"{100 * value:.1f}% of the last {cfg.window} steps were skipped (threshold {100 * thr_v:g}%)",
        "consecutive_skips": f"{value:g} optimizer steps in a row were skipped (threshold {thr})",
        "scale_floor": f"loss scale {value:g} is at or below the floor {thr}",
        "death_spiral": f"{value:g} loss-scale backoffs without any growth in {cfg.window} steps (threshold {thr})",
        "loss_spike": f"loss is {value:.1f} standard deviations above its last {cfg.window} steps (threshold {thr})",
        "grad_spike": f"grad norm is {value:.1f} standard deviations above its last {cfg.window} steps (threshold {thr})",
        "tiny_update": f"updates are {value:.3g} of the weights' RMS in BF16/FP16 parameters (threshold {thr}): below "
        "about 2e-3 a BF16 weight rounds the update away; keep FP32 master weights or raise the learning rate",
    }.get(name, f"{name}: {value}")


def layers_to_bf16(model: nn.Module, names: list[str]) -> list[str]:
    """Move the named FP8 layers back to their high-precision type (``nn.Linear`` or transformers' ``Conv1D``,
    the same Parameter objects); return those moved."""
    from hf_mixedprec.fp8 import to_high_precision
    from hf_mixedprec.fp8.swap import replace_module

    modules = dict(model.named_modules())
    moved = []
    for name in names:
        mod = modules.get(name)
        high = to_high_precision(mod) if mod is not None else None
        if high is None:
            continue
        replace_module(model, name, high)
        moved.append(name)
    return moved
