"""What the runtime measures on sampled steps and reads at logging steps: the update-size probe for ``tiny_update``,
and the one device-to-host copy a logging step reads everything with (the health monitor's records, the FP8 layers'
statistics, which :mod:`hf_mixedprec.fp8.stats` owns, the loss scale and the clipper's state).

Split from :mod:`hf_mixedprec.training.runtime` (which sequences the step and calls these) to keep each module short.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hf_mixedprec.core import metrics as M
from hf_mixedprec.fp8.layers import sampled_layers
from hf_mixedprec.storage.optim import keeps_updates

#: Elements per parameter tensor sampled (strided) to measure the update size on sampled steps.
UPDATE_PROBE = 4096


class _UpdateProbe:
    """The relative size of a sampled step's update, for ``tiny_update``, on the device: a strided sample (at most
    UPDATE_PROBE elements per tensor) of the BF16/FP16 parameters is kept before the step and compared after it."""

    def __init__(self) -> None:
        self._kept: list[tuple[torch.Tensor, int, torch.Tensor]] = []

    def clear(self) -> None:
        self._kept = []

    def take(self, params: list[Any], optimizer: Any = None) -> None:
        """Keep the sample of ``params`` before the optimizer step: the BF16/FP16 parameters whose small updates
        rounding would lose (not those the storage keeps a remainder, a compensation or stochastic rounding for)."""
        self._kept = []
        for p in params:
            if p.dtype in (torch.bfloat16, torch.float16) and p.numel() > 0 and not keeps_updates(optimizer, p):
                stride = max(1, p.numel() // UPDATE_PROBE)
                self._kept.append((p, stride, p.detach().reshape(-1)[::stride].float().clone()))

    def ratio(self, device: torch.device) -> torch.Tensor | None:
        """||new - old|| / ||old|| over the sample (None when nothing was kept); forgets the sample."""
        if not self._kept:
            return None
        num = torch.zeros((), device=device)
        den = torch.zeros((), device=device)
        for p, stride, old in self._kept:
            new = p.detach().reshape(-1)[::stride].float()
            num = num + (new - old).pow(2).sum().to(num.device)
            den = den + old.pow(2).sum().to(den.device)
        self._kept = []
        return (num / den.clamp_min(1e-30)).sqrt()


def observe_fp8_samples(rt: Any) -> None:
    """Hand the FP8 samples taken since the last check to the health monitor (device operations only). Combining
    them over the ranks is a collective: every rank must call this at the same point (a check, a checkpoint save)."""
    rt.fp8_stats.observe(rt.monitor, rt.checks_on_every_rank)


@dataclass
class _LogRead:
    """A logging step's host values, read with one device-to-host copy (:func:`_read_for_log`)."""

    step: int
    monitor: list[float] | None = None  # HealthMonitor.check_request's values
    amp: dict[str, float] = field(default_factory=dict)  # LossScaling.metric_tensors' values
    clip_sync: float | None = None  # the clipper's host_request
    clip: dict[str, float] | None = None  # mp/grad_norm, mp/clip_threshold, mp/clipped
    moe: dict[str, float] = field(default_factory=dict)  # the mp/moe/ metrics (ExpertLoad.read)
    experts: dict[str, dict[str, float]] = field(default_factory=dict)  # what the experts detectors judge


def _read_for_log(rt: Any, model: nn.Module | None) -> _LogRead:
    """Everything a logging step reports, stacked on the device and read with ONE device-to-host copy: the health
    monitor's records (with ``model``: what :meth:`MixedPrecisionRuntime.check` needs), the FP8 layers' statistics
    of a sampled step, the loss scale and skipped steps, the clipper's state and the last clip result, and (with
    ``model``) the MoE experts' load since the last logging step."""
    parts: list[torch.Tensor] = []
    dev = rt.device

    def add(tensors: list[torch.Tensor]) -> slice:
        start = sum(p.numel() for p in parts)
        if tensors:
            flat = [t.detach().reshape(-1) for t in tensors]
            flat = [t if t.device == dev else t.to(dev) for t in flat]
            parts.append(torch.cat(flat).float())
        return slice(start, start + sum(t.numel() for t in tensors))

    got = _LogRead(rt.steps)
    if model is not None:
        observe_fp8_samples(rt)
    request = rt.monitor.check_request() if (model is not None and rt.monitor is not None) else None
    monitor = add([request] if request is not None else [])
    fp8_due = model is not None and rt.monitor is not None and rt.fp8_stats.pending  # a sampled step since the last
    layers, layout = rt.fp8_stats.log_tensor(sampled_layers(model), dev) if fp8_due else (None, [])
    fp8 = add([layers] if layers is not None else [])
    amp_t = rt.amp.metric_tensors()
    amp = add(list(amp_t.values()))
    sync = rt.clipper.host_request() if rt.clipper is not None else None
    clip_sync = add([sync] if sync is not None else [])
    last, boundary = rt._last, getattr(rt.clipper, "boundary", None)
    clip_t = [] if last is None else [last.total_norm, last.threshold, last.clipped]
    clip_t += [boundary()] if (last is not None and boundary is not None) else []
    clip = add(clip_t)
    watched = rt.experts.load
    load = watched.request() if (model is not None and watched is not None) else None
    moe = add([load] if load is not None else [])
    values = torch.cat(parts).tolist() if parts else []  # the one host read
    if request is not None:
        got.monitor = values[monitor]
    if fp8_due:
        rt.fp8_stats.read_log(values[fp8], layout, rt.plan.rule_groups if rt.plan is not None and rt.plan.rules else {})
    got.amp = dict(zip(amp_t, values[amp]))
    got.clip_sync = values[clip_sync][0] if sync is not None else None
    got.clip = _clip_metrics(values[clip]) if last is not None else None
    if load is not None:
        got.moe, got.experts = watched.read(values[moe])
    return got


def _clip_metrics(values: list[float]) -> dict[str, float]:
    """``mp/grad_norm``, ``mp/clip_threshold`` (when there is one) and ``mp/clipped`` from the host values of the last
    clip result's total norm, threshold, clipped flag and (ZClip) boundary."""
    norm, thr, clipped, *boundary = values
    out = {M.GRAD_NORM: norm}
    if thr == float("inf") and boundary:
        thr = boundary[0]  # ZClip on an unclipped step: where clipping would start
    if thr == thr and thr != float("inf"):  # NaN (AGC) and inf (warm-up) are not thresholds
        out[M.CLIP_THRESHOLD] = thr
    out[M.CLIPPED] = clipped
    return out
