"""Scale-health monitoring: device-side detectors, read on check steps only, and the events they raise.

``HealthMonitor`` is trainer-free. Every optimizer step it takes device tensors (raw loss, unscaled grad
norm, the scaler's found-inf and scale) and updates ring buffers and latched flags with tensor ops only;
ring positions come from the host step counter, so nothing is read back. :meth:`HealthMonitor.check` (called
on logging steps only) is the only place that reads device values: it turns latched flags
into :class:`HealthEvent` objects and clears them. Detectors (thresholds from the recipe's ``health``):

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
- ``fp8_saturation`` / ``fp8_underflow`` / ``fp8_sqnr`` / ``mx_clamp``: per FP8 layer, on sampled steps.

A detector whose reaction is ``skip_step`` marks the step for skipping on the device (see
:meth:`skip_flag`); the runtime folds that into the GradScaler's found-inf so the optimizer skips it exactly.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from hf_mixedprec.recipe import DetectorConfig, HealthConfig

__all__ = ["STEP_DETECTORS", "HealthEvent", "HealthMonitor"]

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
LAYER_DETECTORS = {
    "fp8_saturation": "saturation",
    "fp8_underflow": "underflow",
    "fp8_sqnr": "sqnr_db",
    "mx_clamp": "mx_clamp",
}
#: A spike needs at least this many finite values in its window before it can fire.
MIN_SPIKE_HISTORY = 8


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


class _Ring:
    """A fixed-size device ring buffer of float32 values (NaN = empty) indexed by a host counter."""

    def __init__(self, size: int, device: torch.device):
        self.buf = torch.full((size,), float("nan"), device=device)

    def put(self, i: int, value: Tensor) -> None:
        self.buf[i % self.buf.numel()] = value


class HealthMonitor:
    """The detectors of a recipe's ``health`` section (see module docs)."""

    def __init__(self, cfg: HealthConfig, *, device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.det = cfg.detectors
        self.device = torch.device(device)
        dev = self.device
        d = self.det
        self.step = 0  # optimizer steps observed (host)
        self.loss_hist = _Ring(d.loss_spike.window or 128, dev)
        self.grad_hist = _Ring(d.grad_spike.window or 128, dev)
        self.skip_hist = _Ring(d.skip_rate.window or 100, dev)
        self.backoff_hist = _Ring(d.death_spiral.window or 50, dev)
        self.growth_hist = _Ring(d.death_spiral.window or 50, dev)
        self.consecutive = torch.zeros((), device=dev)
        self.prev_scale = torch.full((), float("nan"), device=dev)
        self.skipped_total = torch.zeros((), device=dev)
        # latched since the last check: fired flag, first step it fired, value then
        self.fired = {n: torch.zeros((), dtype=torch.bool, device=dev) for n in STEP_DETECTORS}
        self.first_step = {n: torch.full((), -1.0, device=dev) for n in STEP_DETECTORS}
        self.value = {n: torch.zeros((), device=dev) for n in STEP_DETECTORS}
        self._skip_now = torch.zeros((), dtype=torch.bool, device=dev)
        self.layer_values: dict[str, dict[str, Tensor]] = {}

    # -- per step (device only) ----------------------------------------------------------------------
    def _latch(self, name: str, cond: Tensor, value: Tensor) -> None:
        cfg: DetectorConfig = getattr(self.det, name)
        if not cfg.enabled:
            return
        cond = cond.to(torch.bool)
        new = cond & ~self.fired[name]
        self.first_step[name] = torch.where(
            new, torch.full((), float(self.step + 1), device=self.device), self.first_step[name]
        )
        self.value[name] = torch.where(new, value.float().detach(), self.value[name])
        self.fired[name] = self.fired[name] | cond

    @staticmethod
    def _zscore(ring: _Ring, x: Tensor) -> tuple[Tensor, Tensor]:
        valid = torch.isfinite(ring.buf)
        n = valid.sum()
        vals = torch.where(valid, ring.buf, 0.0)
        mean = vals.sum() / n.clamp_min(1)
        var = torch.where(valid, (ring.buf - mean) ** 2, 0.0).sum() / n.clamp_min(1)
        z = (x - mean) / (var.sqrt() + 1e-12)
        return z, n

    def pre_step(self, *, loss: Tensor | None, grad_norm: Tensor | None) -> Tensor:
        """Before the optimizer step: spike and non-finite checks; returns the device flag 'skip this step'."""
        skip = torch.zeros((), dtype=torch.bool, device=self.device)
        if loss is not None:
            skip = skip | self._value_checks(loss, self.loss_hist, "nonfinite_loss", "loss_spike")
        if grad_norm is not None:
            skip = skip | self._value_checks(grad_norm, self.grad_hist, "nonfinite_grad", "grad_spike")
        self._skip_now = skip
        return skip

    def _value_checks(self, value: Tensor, ring: _Ring, nonfinite: str, spike_name: str) -> Tensor:
        """Non-finite and z-score spike checks of one per-step value (loss or grad norm) against its ring."""
        v = value.detach().float().reshape(()).to(self.device)
        finite = torch.isfinite(v)
        self._latch(nonfinite, ~finite, v)
        z, n = self._zscore(ring, v)
        spike = finite & (n >= MIN_SPIKE_HISTORY) & (z > (getattr(self.det, spike_name).threshold or math.inf))
        self._latch(spike_name, spike, z)
        ring.put(self.step, torch.where(finite & ~spike, v, float("nan")))
        return (~finite & _skips(getattr(self.det, nonfinite))) | (spike & _skips(getattr(self.det, spike_name)))

    def post_step(self, *, skipped: Tensor, scale: Tensor | None) -> None:
        """After the optimizer step: skip statistics and loss-scale trend."""
        d = self.det
        skipped = skipped.detach().float().reshape(()).to(self.device).clamp(0, 1)
        self.skipped_total = self.skipped_total + skipped
        self.skip_hist.put(self.step, skipped)
        self.consecutive = (self.consecutive + 1) * skipped
        filled = min(self.step + 1, self.skip_hist.buf.numel())
        rate = torch.nan_to_num(self.skip_hist.buf, nan=0.0).sum() / filled
        self._latch("skip_rate", rate > (d.skip_rate.threshold or math.inf), rate)
        self._latch(
            "consecutive_skips", self.consecutive >= (d.consecutive_skips.threshold or math.inf), self.consecutive
        )
        if scale is not None:
            s = scale.detach().float().reshape(()).to(self.device).clone()  # the scaler updates its tensor in place
            self._latch("scale_floor", s <= (d.scale_floor.threshold or 0.0), s)
            prev = self.prev_scale
            known = torch.isfinite(prev)
            self.backoff_hist.put(self.step, (known & (s < prev)).float())
            self.growth_hist.put(self.step, (known & (s > prev)).float())
            backoffs = torch.nan_to_num(self.backoff_hist.buf, nan=0.0).sum()
            growths = torch.nan_to_num(self.growth_hist.buf, nan=0.0).sum()
            spiral = (backoffs >= (d.death_spiral.threshold or math.inf)) & (growths == 0)
            self._latch("death_spiral", spiral, backoffs)
            self.prev_scale = s
        self.step += 1

    def observe_update(self, ratio: Tensor, skipped: Tensor) -> None:
        """On a sampled step, before :meth:`post_step`: RMS(update)/RMS(weight) of the low-precision params."""
        thr = self.det.tiny_update.threshold
        if thr is None:
            return
        ratio = ratio.detach().float().reshape(()).to(self.device)
        taken = skipped.detach().reshape(()).to(self.device) < 0.5  # a skipped step changes nothing on purpose
        self._latch("tiny_update", taken & torch.isfinite(ratio) & (ratio < thr), ratio)

    # -- FP8 layers (sampled steps) ------------------------------------------------------------------
    def observe_fp8(self, layers: dict[str, dict[str, Tensor]]) -> None:
        """Per-layer FP8 statistics (``EmulatedFP8Linear.stats``) from a sampled step; the worst of the samples
        since the last check is kept until :meth:`check` (a logging step) reads it."""
        for name, stats in layers.items():
            seen = self.layer_values.setdefault(name, {})
            for k, v in stats.items():
                v = v.detach()
                if k in seen:  # several samples before a check: keep the worst of them
                    v = torch.minimum(seen[k], v) if k.endswith("sqnr_db") else torch.maximum(seen[k], v)
                seen[k] = v

    # -- decisions (host sync) -------------------------------------------------------------------------
    def check(self) -> list[HealthEvent]:
        """Events fired since the last check (reads device values; call on logging/sampling steps only)."""
        events: list[HealthEvent] = []
        names = list(STEP_DETECTORS)
        if names:
            packed = torch.stack(
                [torch.stack([self.fired[n].float(), self.first_step[n], self.value[n]]) for n in names]
            ).tolist()
            for n, (fired, first, value) in zip(names, packed):
                if fired:
                    cfg: DetectorConfig = getattr(self.det, n)
                    events.append(
                        HealthEvent(int(first), n, cfg.reaction, value, cfg.threshold, _message(n, value, cfg))
                    )
                self.fired[n].zero_()
                self.first_step[n].fill_(-1.0)
        events += self._check_layers()
        return events

    def _check_layers(self) -> list[HealthEvent]:
        events: list[HealthEvent] = []
        if not self.layer_values:
            return events
        for det_name, metric in LAYER_DETECTORS.items():
            cfg: DetectorConfig = getattr(self.det, det_name)
            if not cfg.enabled or cfg.threshold is None:
                continue
            for layer, stats in self.layer_values.items():
                for role in ("input", "weight", "grad"):
                    t = stats.get(f"{role}_{metric}")
                    if t is None:
                        continue
                    v = float(t)
                    bad = v < cfg.threshold if metric == "sqnr_db" else v > cfg.threshold
                    if bad:
                        msg = f"{layer} {role} {metric} {v:.4g} {'<' if metric == 'sqnr_db' else '>'} {cfg.threshold:g}"
                        events.append(HealthEvent(self.step, det_name, cfg.reaction, v, cfg.threshold, msg, layer))
        self.layer_values = {}
        return events

    def skip_flag(self) -> Tensor:
        """Device flag: a ``skip_step`` detector fired on the current step."""
        return self._skip_now

    def reset_windows(self) -> None:
        """Forget the windowed history (used when resuming a run that a health reaction stopped)."""
        for ring in (self.loss_hist, self.grad_hist, self.skip_hist, self.backoff_hist, self.growth_hist):
            ring.buf.fill_(float("nan"))
        self.consecutive.zero_()
        self.prev_scale.fill_(float("nan"))

    # -- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        def t(x: Tensor) -> list[float] | float:
            return x.tolist()

        return {
            "version": 1,
            "step": self.step,
            "loss_hist": t(self.loss_hist.buf),
            "grad_hist": t(self.grad_hist.buf),
            "skip_hist": t(self.skip_hist.buf),
            "backoff_hist": t(self.backoff_hist.buf),
            "growth_hist": t(self.growth_hist.buf),
            "consecutive": t(self.consecutive),
            "prev_scale": t(self.prev_scale),
            "skipped_total": t(self.skipped_total),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != 1:
            raise ValueError(f"health monitor state version {state.get('version')!r} (expected 1)")
        dev = self.device
        self.step = int(state["step"])
        for key in ("loss_hist", "grad_hist", "skip_hist", "backoff_hist", "growth_hist"):
            ring: _Ring = getattr(self, key)
            data = torch.tensor(state[key], dtype=torch.float32, device=dev)
            if data.numel() != ring.buf.numel():
                raise ValueError(
                    f"health state {key} has {data.numel()} entries, the recipe's window is {ring.buf.numel()}"
                )
            ring.buf = data
        self.consecutive = torch.tensor(state["consecutive"], dtype=torch.float32, device=dev)
        self.prev_scale = torch.tensor(state["prev_scale"], dtype=torch.float32, device=dev)
        self.skipped_total = torch.tensor(state["skipped_total"], dtype=torch.float32, device=dev)


def _skips(cfg: DetectorConfig) -> bool:
    return cfg.enabled and cfg.reaction == "skip_step"


def _message(name: str, value: float, cfg: DetectorConfig) -> str:
    thr_v = cfg.threshold or 0.0
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
    """Move the named FP8 layers back to plain ``nn.Linear`` (same Parameter objects); return those moved."""
    from hf_mixedprec.fp8.emulated import EmulatedFP8Linear

    modules = dict(model.named_modules())
    moved = []
    for name in names:
        mod = modules.get(name)
        if not isinstance(mod, EmulatedFP8Linear):
            continue
        lin = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None, device="meta")
        lin.weight = mod.weight
        lin.bias = mod.bias
        parent, _, child = name.rpartition(".")
        setattr(modules[parent] if parent else model, child, lin)
        moved.append(name)
    return moved
