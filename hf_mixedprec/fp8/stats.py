"""The FP8 layers' health statistics, from recording to the logged figures, in one place.

The path, in order:

1. **recording** (:class:`SampledStats`): on a sampled step an FP8 layer (emulated or native) or the probe of a
   torchao / Transformer Engine layer keeps, per operand (input, weight, output gradient), the raw record of its
   quantization (:func:`~hf_mixedprec.scaling.stats.raw_operand_stats` or, for per-tensor scales, the cheaper
   :func:`~hf_mixedprec.scaling.stats.tensorwise_operand_stats`), as device tensors (the output gradient's row
   written in place into a buffer, so a compiled backward can record it); other steps record nothing;
2. **sampling** (:class:`FP8Statistics`): the runtime tells the layers when a sampled step begins and ends, and
   after its optimizer step keeps the records as taken (:class:`FP8Sample`: references, and one copy of the rows
   held in buffers, which the next sampled step overwrites);
3. **the table** (:func:`raw_stats_table`): at the next check every kept record becomes one ``[layers, 3, 8]``
   table in a fixed number of tensor operations, combined over ranks when training is distributed
   (:func:`raw_over_ranks`, one all-gather), finished into per-layer
   :class:`~hf_mixedprec.scaling.stats.LayerStats` and handed to the health monitor;
4. **the host read**: a logging step stacks the latest figures into the one device-to-host copy the runtime makes
   (:meth:`FP8Statistics.log_tensor`) and turns the host values into ``mp/fp8/...`` metrics
   (:meth:`FP8Statistics.read_log`).

The math of each statistic is in :mod:`hf_mixedprec.scaling.stats`; which layers exist is
:func:`hf_mixedprec.fp8.layers.fp8_layers`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from hf_mixedprec.core import metrics as M
from hf_mixedprec.core._device import several_ranks
from hf_mixedprec.scaling.stats import (
    RAW_COLUMNS,
    LayerStats,
    StatsLayout,
    combine_raw,
    finish_operand_stats,
    layer_stats_from_table,
    layer_stats_of,
    raw_from_tensorwise,
    stack_layer_stats,
    unstack_layer_stats,
)

__all__ = [
    "FP8Sample",
    "FP8Statistics",
    "SampledStats",
    "StatsRecord",
    "fp8_layer_metrics",
    "held_row",
    "hold",
    "never_measured",
    "raw_over_ranks",
    "raw_stats_table",
]

#: What a layer keeps of one operand's sampled statistics: a list of per-tensor record tensors
#: (:func:`~hf_mixedprec.scaling.stats.tensorwise_operand_stats`), a raw row, or None (never measured). A raw row
#: may be held as the int64 bits of its float64 values: a buffer the layer's backward writes in place
#: (:attr:`~hf_mixedprec.fp8.emulated.EmulatedFP8GEMM.fp8_grad_stats`), which :class:`FP8Sample` copies.
StatsRecord = list[torch.Tensor] | torch.Tensor | None


def never_measured(device: torch.device) -> torch.Tensor:
    """The raw row of a role never measured: NaN in every :data:`~hf_mixedprec.scaling.stats.RAW_COLUMNS` column."""
    return torch.full((len(RAW_COLUMNS),), math.nan, dtype=torch.float64, device=device)


def held_row(device: torch.device) -> torch.Tensor:
    """A buffer for a raw row that a backward writes in place (:func:`hold`): the float64 values as int64 bits, so
    casting the module to another float type leaves it whole; never measured until written."""
    return never_measured(device).view(torch.int64)


def hold(buffer: torch.Tensor, row: torch.Tensor) -> None:
    """Write the float64 raw ``row`` into a :func:`held_row` buffer."""
    buffer.copy_(row.view(torch.int64))


def _is_held(rec: StatsRecord) -> bool:
    return isinstance(rec, torch.Tensor) and rec.dtype == torch.int64


def _row(rec: torch.Tensor) -> torch.Tensor:
    """A raw row as float64 (a view of a :func:`held_row` buffer)."""
    return rec.view(torch.float64) if _is_held(rec) else rec


class SampledStats:
    """What an FP8 layer, or the probe standing for one, keeps of its last sampled step (see the module docs).

    A subclass calls :meth:`start_records` when it is built and fills :attr:`records` ``[role]`` on sampled steps
    (when :attr:`record_stats` is set)."""

    #: whether the MX clamp column means something for this layer (MXFP8 scaling)
    mx_clamp: bool = False
    record_stats: bool
    records: list[StatsRecord]

    def start_records(self) -> None:
        #: set by the runtime for the steps that sample FP8 statistics
        self.record_stats = False
        #: the latest sampled statistics of each role (input, weight, output gradient), as taken
        self.records = [None, None, None]

    @property
    def measured(self) -> tuple[bool, bool, bool]:
        """Which roles have statistics (a host fact: nothing is read)."""
        r = self.records
        return (r[0] is not None, r[1] is not None, r[2] is not None)

    @property
    def raw_stats(self) -> torch.Tensor | None:
        """The latest statistics of each role as ``[3, 8]`` :data:`~hf_mixedprec.scaling.stats.RAW_COLUMNS` rows
        (NaN: never measured); None before the first sampled step."""
        table = raw_stats_table([self.records])
        return None if table is None else table[0]

    @property
    def stats(self) -> LayerStats:
        """The latest sampled statistics of each operand (a :class:`~hf_mixedprec.scaling.stats.LayerStats` of
        device tensors; empty before the first sampled step)."""
        raw = self.raw_stats
        if raw is None:
            return LayerStats()
        return layer_stats_of(finish_operand_stats(raw), self.measured, self.mx_clamp)


#: A listed FP8 layer: its dotted name and what keeps its statistics.
NamedLayers = Sequence[tuple[str, SampledStats]]


def raw_stats_table(layers: Sequence[Sequence[StatsRecord]]) -> torch.Tensor | None:
    """The sampled statistics of many layers (each its :attr:`SampledStats.records`, or a copy of that list kept from
    an earlier step) as one ``[n, 3, 8]`` float64 table of :data:`~hf_mixedprec.scaling.stats.RAW_COLUMNS` rows
    (NaN where a role was never measured), in a fixed number of tensor operations however many layers: every
    per-tensor record is stacked once and converted together. None when no layer has any."""
    records = [rec for layer in layers for rec in layer]
    fast = [rec for rec in records if isinstance(rec, list)]  # per-tensor records; the others are rows already
    first = fast[0][0] if fast else next((rec for rec in records if rec is not None), None)
    if first is None:
        return None
    converted = iter(raw_from_tensorwise(fast).unbind(0) if fast else ())
    never = never_measured(first.device)
    rows = [never if rec is None else next(converted) if isinstance(rec, list) else _row(rec) for rec in records]
    return torch.stack(rows).view(len(layers), 3, len(RAW_COLUMNS))


class FP8Sample:
    """A sampled step's FP8 statistics, kept as taken (references, and one stacked copy of the rows held in buffers),
    finished at the next check."""

    def __init__(self, layers: NamedLayers) -> None:
        sampled = [(n, m) for n, m in layers if any(m.measured)]
        self.names = [n for n, _ in sampled]
        self.flags = [(m.measured, m.mx_clamp) for _, m in sampled]
        self.records = [list(m.records) for _, m in sampled]  # a later sampled step replaces the layers' lists
        # rows in buffers that a later sampled step overwrites: one copy of them all
        held = [(i, r) for i, rec in enumerate(self.records) for r, x in enumerate(rec) if _is_held(x)]
        if held:
            copies = _row(torch.stack([self.records[i][r] for i, r in held])).unbind(0)
            for (i, r), row in zip(held, copies, strict=True):
                self.records[i][r] = row

    def layer_stats(self, over_ranks: bool = False) -> dict[str, LayerStats]:
        """The sample's statistics per layer; ``over_ranks``: combined over the ranks (:func:`raw_over_ranks`, a
        collective: every rank must ask)."""
        raw = raw_stats_table(self.records)
        if raw is None:
            return {}
        raw = raw_over_ranks(raw) if over_ranks else raw
        # one finished table; every layer's statistics view it (a fixed number of operations)
        return dict(zip(self.names, layer_stats_from_table(finish_operand_stats(raw), self.flags), strict=True))


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
    return combine_raw(every.view(n, *raw.shape), dim=0)


class _Monitor(Protocol):
    def observe_fp8(self, layers: Mapping[str, LayerStats]) -> None: ...


class FP8Statistics:
    """A run's FP8 statistics between the layers and the log: which layers were told to record, the samples not yet
    handed to the health monitor, the latest finished figures and the metrics the next log row reports."""

    def __init__(self) -> None:
        self._told: tuple[NamedLayers | None, bool] = (None, False)
        #: sampled steps not yet handed to the monitor
        self.samples: list[FP8Sample] = []
        #: the last sample handed over, finished (what a logging step reports)
        self.latest: dict[str, LayerStats] | None = None
        #: a sampled step's statistics wait for the next logging step
        self.pending = False
        self._metrics: dict[str, float] = {}

    def record(self, layers: NamedLayers, on: bool) -> None:
        """Set ``record_stats`` on every listed layer where it changes (a sampled step begins or ends, or the layers
        changed): host attributes only."""
        if layers is not self._told[0] or on != self._told[1]:
            for _, m in layers:
                m.record_stats = on
        self._told = (layers, on)

    def layers_changed(self) -> None:
        """The model's FP8 layers were swapped (a phase boundary): tell the next list whatever it holds."""
        self._told = (None, False)

    def keep(self, layers: NamedLayers) -> None:
        """After a sampled step's optimizer step: keep its records for the next check."""
        self.samples.append(FP8Sample(layers))
        self.pending = True

    def observe(self, monitor: _Monitor | None, over_ranks: bool) -> None:
        """Hand the samples kept since the last check to ``monitor`` (device operations only). With ``over_ranks``
        this is a collective: every rank must call it at the same point (a check, a checkpoint save)."""
        samples, self.samples = self.samples, []
        if monitor is not None:
            for sample in samples:
                self.latest = sample.layer_stats(over_ranks)
                monitor.observe_fp8(self.latest)

    def log_tensor(self, layers: NamedLayers, device: torch.device) -> tuple[torch.Tensor | None, StatsLayout]:
        """The figures a logging step reports as one flat device tensor for the runtime's one host read, and where
        each value sits: the last finished sample, else what the layers hold."""
        latest = self.latest if self.latest is not None else {n: m.stats for n, m in layers}
        return stack_layer_stats({n: s for n, s in latest.items() if s}, device)

    def read_log(self, values: Sequence[float], layout: StatsLayout, rule_groups: dict[str, list[str]]) -> None:
        """Turn the host values of :meth:`log_tensor` into the ``mp/fp8/`` metrics of the next log row (and
        ``mp/fp8_rule/`` per module rule in ``rule_groups``)."""
        got = fp8_layer_metrics(unstack_layer_stats(values, layout))
        if rule_groups:
            got.update(M.fp8_rule_metrics(got, rule_groups))
        self._metrics = got
        self.pending = False

    def take_metrics(self) -> dict[str, float]:
        """The metrics :meth:`read_log` made, once."""
        got, self._metrics = self._metrics, {}
        return got


def fp8_layer_metrics(values: dict[str, dict[str, dict[str, float]]]) -> dict[str, float]:
    """Per FP8 layer, the worst saturation, underflow and SQNR over its input, weight and gradient, and the input's
    amax."""
    out: dict[str, float] = {}
    for name, vals in values.items():
        roles = [vals.get(r, {}) for r in ("input", "weight", "grad")]
        out[M.fp8_layer_key(name, "saturation")] = max(v.get("saturation", 0.0) for v in roles)
        out[M.fp8_layer_key(name, "underflow")] = max(v.get("underflow", 0.0) for v in roles)
        out[M.fp8_layer_key(name, "sqnr_db")] = min(v.get("sqnr_db", float("inf")) for v in roles)
        out[M.fp8_layer_key(name, "input_amax")] = vals.get("input", {}).get("amax", 0.0)
    return out
