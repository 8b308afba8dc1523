"""What the runtime measures on sampled steps and reads at logging steps: the FP8 layers' statistics (told to record,
kept as taken, handed to the health monitor at the next check), the update-size probe for ``tiny_update``, and the
one device-to-host copy a logging step reads everything with.

Split from :mod:`hf_mixedprec.runtime` (which sequences the step and calls these) to keep each module short.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hf_mixedprec import metrics as M
from hf_mixedprec._device import several_ranks
from hf_mixedprec.fp8 import EmulatedFP8GEMM, monitored_layers
from hf_mixedprec.fp8.emulated import raw_stats_table
from hf_mixedprec.scaling.stats import (
    LayerStats,
    finish_operand_stats,
    layer_stats_from_table,
    stack_layer_stats,
    unstack_layer_stats,
)
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


def _tell_fp8_layers(model: nn.Module, on: bool, told: tuple[list[Any] | None, bool]) -> tuple[list[Any], bool]:
    """Set ``record_stats`` on every monitored FP8 layer where it changes (a sampled step begins or ends, or the
    layers changed); ``told`` is what the last call set. Returns what is set now."""
    layers = monitored_layers(model)
    if layers is not told[0] or on != told[1]:
        for _, m in layers:
            m.record_stats = on
    return layers, on


class _FP8Sample:
    """A sampled step's FP8 statistics, kept as taken (references, no tensor operation): the raw records of the
    emulated layers and of the other backends' probes; stacked, finished and given to the monitor at the next
    check."""

    def __init__(self, model: nn.Module) -> None:
        # emulated layers and other backends' probes keep the same raw records: one table for all of them
        sampled = [(n, m) for n, m in monitored_layers(model) if any(m.measured)]
        self.names = [n for n, _ in sampled]
        self.flags = [(m.measured, isinstance(m, EmulatedFP8GEMM) and m.spec.scaling == "mxfp8") for _, m in sampled]
        self.records = [list(m.records) for _, m in sampled]  # a later sampled step replaces the layers' lists

    def layer_stats(self, over_ranks: bool = False) -> dict[str, LayerStats]:
        """The sample's statistics per layer; ``over_ranks``: combined over the ranks (:func:`raw_over_ranks`, a
        collective: every rank must ask), for every backend's layers."""
        out: dict[str, LayerStats] = {}
        raw = raw_stats_table(self.records)
        if raw is not None:  # one finished table; every layer's record views it (a fixed number of operations)
            raw = raw_over_ranks(raw) if over_ranks else raw
            records = layer_stats_from_table(finish_operand_stats(raw), self.flags)
            out.update(zip(self.names, records))
        return out


def raw_over_ranks(raw: torch.Tensor) -> torch.Tensor:
    """The sampled statistics of every rank as one process on the global batch would have measured them, from rows of
    :data:`~hf_mixedprec.scaling.stats.RAW_COLUMNS` (``[..., 8]``): counts summed, L2 norms combined as the root of
    their summed squares, amax the MAX, the MX clamp fraction weighted by each rank's elements. One all-gather (at
    the check that finishes a sampled step, never on other steps), so every rank's health monitor sees the same
    figures and takes the same decisions, and rank 0 reports the global one. One process: ``raw`` as it is."""
    if not several_ranks():
        return raw
    import torch.distributed as dist

    n = dist.get_world_size()
    every = raw.new_empty((n * raw.shape[0], *raw.shape[1:]))  # ranks concatenated along the first dim
    dist.all_gather_into_tensor(every, raw.contiguous())
    every = every.view(n, *raw.shape)
    numel, nonzero, under, clipped, norm, noise, amax, mx = every.unbind(-1)
    total = numel.sum(0)
    columns = [total, nonzero.sum(0), under.sum(0), clipped.sum(0)]
    columns += [norm.square().sum(0).sqrt(), noise.square().sum(0).sqrt(), amax.amax(0), (mx * numel).sum(0) / total]
    return torch.stack(columns, -1)


def observe_fp8_samples(rt: Any) -> None:
    """Hand the FP8 samples taken since the last check to the health monitor (device operations only). Combining
    them over the ranks is a collective: every rank must call this at the same point (a check, a checkpoint save)."""
    samples, rt._fp8_samples = rt._fp8_samples, []
    if rt.monitor is not None:
        for sample in samples:
            rt._fp8_latest = sample.layer_stats(rt.checks_on_every_rank)
            rt.monitor.observe_fp8(rt._fp8_latest)


@dataclass
class _LogRead:
    """A logging step's host values, read with one device-to-host copy (:func:`_read_for_log`)."""

    step: int
    monitor: list[float] | None = None  # HealthMonitor.check_request's values
    fp8: dict[str, float] | None = None  # per-layer FP8 metrics (a sampled step since the last log)
    amp: dict[str, float] = field(default_factory=dict)  # LossScaling.metric_tensors' values
    clip_sync: float | None = None  # the clipper's host_request
    clip: dict[str, float] | None = None  # mp/grad_norm, mp/clip_threshold, mp/clipped


def _read_for_log(rt: Any, model: nn.Module | None) -> _LogRead:
    """Everything a logging step reports, stacked on the device and read with ONE device-to-host copy: the health
    monitor's records (with ``model``: what :meth:`MixedPrecisionRuntime.check` needs), the FP8 layers' statistics
    of a sampled step, the loss scale and skipped steps, the clipper's state and the last clip result."""
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
    layers, layout = (None, [])
    if model is not None and rt.monitor is not None and rt._fp8_pending:
        latest = rt._fp8_latest  # what the layers hold, finished once for the monitor already
        if latest is None:
            latest = {n: m.stats for n, m in monitored_layers(model)}
        layers, layout = stack_layer_stats({n: s for n, s in latest.items() if s}, dev)
    fp8 = add([layers] if layers is not None else [])
    amp_t = rt.amp.metric_tensors()
    amp = add(list(amp_t.values()))
    sync = rt.clipper.host_request() if rt.clipper is not None else None
    clip_sync = add([sync] if sync is not None else [])
    last, boundary = rt._last, getattr(rt.clipper, "boundary", None)
    clip_t = [] if last is None else [last.total_norm, last.threshold, last.clipped]
    clip_t += [boundary()] if (last is not None and boundary is not None) else []
    clip = add(clip_t)
    values = torch.cat(parts).tolist() if parts else []  # the one host read
    if request is not None:
        got.monitor = values[monitor]
    if model is not None and rt.monitor is not None and rt._fp8_pending:
        got.fp8 = _fp8_layer_metrics(unstack_layer_stats(values[fp8], layout))
        if rt.plan is not None and rt.plan.rules:
            got.fp8.update(M.fp8_rule_metrics(got.fp8, rt.plan.rule_groups))
    got.amp = dict(zip(amp_t, values[amp]))
    got.clip_sync = values[clip_sync][0] if sync is not None else None
    got.clip = _clip_metrics(values[clip]) if last is not None else None
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


def _fp8_layer_metrics(values: dict[str, dict[str, dict[str, float]]]) -> dict[str, float]:
    """Per FP8 layer, the worst saturation, underflow and SQNR over its input, weight and gradient."""
    out: dict[str, float] = {}
    for name, vals in values.items():
        roles = [vals.get(r, {}) for r in ("input", "weight", "grad")]
        out[M.fp8_layer_key(name, "saturation")] = max(v.get("saturation", 0.0) for v in roles)
        out[M.fp8_layer_key(name, "underflow")] = max(v.get("underflow", 0.0) for v in roles)
        out[M.fp8_layer_key(name, "sqnr_db")] = min(v.get("sqnr_db", float("inf")) for v in roles)
        out[M.fp8_layer_key(name, "input_amax")] = vals.get("input", {}).get("amax", 0.0)
    return out
