"""FP8 health statistics: saturation, underflow, SQNR, MX clamp fraction, and the per-layer record.

All return 0-d float32 tensors on the input's device and never sync with the host, so they can be
recorded on any step and read only when a log is due.  SQNR is torchao's ``compute_error``
(``torchao/float8/float8_utils.py``); E8M0 codes and blocks follow the OCP MX v1.0 spec.

:func:`operand_stats` measures one quantized GEMM operand into a :class:`RoleStats`; a layer's three operands
(input, weight, output gradient) make a :class:`LayerStats`, which also reads as a flat mapping
(``"input_saturation"`` -> tensor) for code that wants a ``dict``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from hf_mixedprec.core._device import Constants
from hf_mixedprec.core.formats import E2M1
from hf_mixedprec.scaling.fp8 import (
    FP8Format,
    _exp2_int,
    _f32_exponent_field,
    _fp8_format,
    quantize_fp8,
    tensor_amax,
)
from hf_mixedprec.scaling.mx import _blocked, _check_block_size, _check_rounding, mx_scale_codes

__all__ = [
    "METRICS",
    "RAW_COLUMNS",
    "ROLES",
    "LayerStats",
    "RoleStats",
    "StatsLayout",
    "combine_raw",
    "finish_operand_stats",
    "grouped_raw_stats",
    "layer_stats_from_table",
    "layer_stats_of",
    "mx_clamp_fraction",
    "operand_stats",
    "raw_from_tensorwise",
    "raw_operand_stats",
    "saturation_fraction",
    "sqnr_db",
    "stack_layer_stats",
    "tensorwise_operand_stats",
    "underflow_fraction",
    "unstack_layer_stats",
]

#: The GEMM operands of an FP8 Linear, in TE's order (``fp8_quant_fwd_inp``, ``_fwd_weight``, ``_bwd_grad``).
ROLES = ("input", "weight", "grad")
#: The statistics of one operand; SQNR is the one where lower is worse.
METRICS = ("amax", "saturation", "underflow", "sqnr_db", "mx_clamp")


def _fraction(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``num / den`` as float32, 0 where ``den`` is 0."""
    num = num.to(torch.float32)
    den = den.to(torch.float32)
    return torch.where(den > 0, num / torch.clamp(den, min=1.0), torch.zeros_like(num))


def saturation_fraction(x: torch.Tensor, scale: torch.Tensor | float, fmt: FP8Format) -> torch.Tensor:
    """Fraction of the FINITE elements of ``x`` with ``|float32(x) * scale| >= fmt.max``.

    Those are the elements :func:`quantize_fp8` clips to ``±max`` or that sit exactly at it (values that
    merely round up to ``max`` are not counted).  Non-finite elements (inf, NaN) are excluded from
    numerator and denominator; 0 when ``x`` has no finite element.
    """
    f = _fp8_format(fmt)
    x32 = x.to(torch.float32)
    s = scale.to(torch.float32) if isinstance(scale, torch.Tensor) else float(scale)
    finite = torch.isfinite(x32)
    y = x32 * s
    y, finite = torch.broadcast_tensors(y, finite)
    hit = finite & (torch.abs(y) >= f.max)
    return _fraction(hit.sum(), finite.sum())


def underflow_fraction(x: torch.Tensor, scale: torch.Tensor | float, fmt: FP8Format) -> torch.Tensor:
    """Fraction of the non-zero, non-NaN elements of ``x`` that :func:`quantize_fp8` turns into ±0.

    Uses the real round-to-nearest-even cast, so a value exactly at half the smallest subnormal counts
    as underflow (it rounds to even, 0).  0 when ``x`` has no such element.
    """
    q = quantize_fp8(x, scale, fmt).to(torch.float32)
    x32 = x.to(torch.float32)
    x32, q = torch.broadcast_tensors(x32, q)
    nonzero = (x32 != 0) & ~torch.isnan(x32)
    lost = nonzero & (q == 0)
    return _fraction(lost.sum(), nonzero.sum())


def sqnr_db(x: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:
    """Signal-to-quantization-noise ratio ``10 * log10(sum(x**2) / sum((x - x_hat)**2))`` in dB, float32.

    ``inf`` when ``x_hat == x`` everywhere (zero noise), ``-inf`` for zero signal with non-zero noise, NaN
    if either input has NaN.  To keep float32 sums from overflowing, both ``x`` and the noise are first
    multiplied by ``2**-e`` with ``e`` the exponent of ``max|x|`` (a power of two: exact except for
    float32 underflow of elements ~2**-149 below ``max|x|``, so the ratio is unchanged).
    Same quantity as torchao's ``compute_error`` (``20 * log10(||x|| / ||x - x_hat||)``).
    """
    if tuple(x.shape) != tuple(x_hat.shape):
        raise ValueError(f"x_hat.shape={tuple(x_hat.shape)} must equal x.shape={tuple(x.shape)}")
    x32 = x.to(torch.float32)
    noise = x32 - x_hat.to(torch.float32)
    if x32.numel() == 0:
        return torch.full((), float("inf"), dtype=torch.float32, device=x.device)
    amax = torch.amax(torch.abs(x32))
    exp, _ = _f32_exponent_field(amax)
    usable = torch.isfinite(amax) & (amax > 0)
    norm = torch.where(usable, _exp2_int(torch.clamp(-exp, -127, 127)), torch.ones_like(amax))
    signal_e = torch.sum(torch.square(x32 * norm))
    noise_e = torch.sum(torch.square(noise * norm))
    db = 10.0 * torch.log10(signal_e / noise_e)
    return torch.where(noise_e == 0, torch.full_like(db, float("inf")), db)


def mx_clamp_fraction(
    x: torch.Tensor,
    *,
    fmt: FP8Format = "e4m3",
    block_size: int = 32,
    dim: int = -1,
    rounding: str = "rceil",
) -> torch.Tensor:
    """Fraction of ALL MX blocks of ``x`` that are non-zero, not NaN and get an E8M0 code at the clamp.

    At the clamp means code 0 (``2**-127``: the block is so small its elements lose precision or flush to
    zero) or 254 (``2**127``, also what an inf block gets).  Zero blocks (code 0 but exact) and NaN blocks
    (code 255) are not counted in the numerator; the denominator is the number of blocks.  Same blocking
    and rules as :func:`~hf_mixedprec.scaling.mx.quantize_mxfp8` (OCP MX v1.0 / TE).
    """
    f = _fp8_format(fmt)
    _check_block_size(block_size)
    r = _check_rounding(rounding)
    blocks, _ = _blocked(x, block_size, dim)
    if blocks.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    amax = torch.amax(torch.abs(blocks.to(torch.float32)), dim=-1)
    codes = mx_scale_codes(amax, fmt=f, rounding=r)
    at_clamp = (amax > 0) & ((codes == 0) | (codes == 254))  # NaN amax: amax > 0 is False
    return _fraction(at_clamp.sum(), torch.full((), amax.numel(), dtype=torch.float32, device=amax.device))


@dataclass(frozen=True, eq=False)
class RoleStats:
    """Health statistics of one quantized GEMM operand: 0-d float32 tensors (``None``: not measured).

    ``amax`` of the finite values, ``saturation`` (finite values clipped to the FP8 max), ``underflow``
    (finite non-zero values that became 0), ``sqnr_db`` of quantize-dequantize, ``mx_clamp`` (MXFP8 only:
    blocks whose E8M0 scale is at the clamp).  ``eq=False``: comparing tensors would read them on the host.
    """

    amax: torch.Tensor | None = None
    saturation: torch.Tensor | None = None
    underflow: torch.Tensor | None = None
    sqnr_db: torch.Tensor | None = None
    mx_clamp: torch.Tensor | None = None

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(metric, value)`` for the measured metrics, in :data:`METRICS` order."""
        for metric in METRICS:
            value = getattr(self, metric)
            if value is not None:
                yield metric, value

    def worst(self, other: RoleStats) -> RoleStats:
        """Per metric, the worse of ``self`` and ``other`` (the lower SQNR, else the higher value; NaN wins)."""
        out = {}
        for metric in METRICS:
            a, b = getattr(self, metric), getattr(other, metric)
            if a is None or b is None:
                out[metric] = b if a is None else a
            else:
                out[metric] = torch.minimum(a, b) if metric == "sqnr_db" else torch.maximum(a, b)
        return RoleStats(**out)

    def detach(self) -> RoleStats:
        """Without autograd history; values that have none are kept as they are (no tensor operation)."""
        if not any(v.requires_grad for _, v in self.items()):
            return self
        return RoleStats(**{m: v.detach() for m, v in self.items()})


@dataclass(frozen=True, eq=False)
class LayerStats(Mapping[str, torch.Tensor]):
    """The latest :class:`RoleStats` of each operand of one FP8 layer (``None``: never measured).

    Also a read-only mapping from flat keys ``f"{role}_{metric}"`` (``"input_amax"``, ``"grad_sqnr_db"``...)
    to tensors, so ``dict(stats)`` gives what callers kept before there was a record.
    """

    input: RoleStats | None = None
    weight: RoleStats | None = None
    grad: RoleStats | None = None
    #: ``(table, i)`` when every value is a view of row ``i`` of one :func:`finish_operand_stats` table ``[n, 3, 5]``
    #: (:func:`layer_stats_from_table`): :func:`stack_layer_stats` then sends the table whole, in one operation
    source: tuple[torch.Tensor, int] | None = dataclasses.field(default=None, compare=False, repr=False)

    def role(self, role: str) -> RoleStats | None:
        if role not in ROLES:
            raise KeyError(role)
        return getattr(self, role)

    def with_role(self, role: str, stats: RoleStats) -> LayerStats:
        """A copy with ``role``'s statistics replaced (the others kept)."""
        if role not in ROLES:
            raise ValueError(f"role {role!r} is not one of {', '.join(ROLES)}")
        return dataclasses.replace(self, **{role: stats}, source=None)

    def worst(self, other: LayerStats) -> LayerStats:
        """Per operand and metric, the worse of ``self`` and ``other`` (see :meth:`RoleStats.worst`)."""
        out = {}
        for role in ROLES:
            a, b = getattr(self, role), getattr(other, role)
            if a is None or b is None:
                out[role] = b if a is None else a
            else:
                out[role] = a.worst(b)
        return LayerStats(**out)

    def detach(self) -> LayerStats:
        """Without autograd history (no tensor operation where there is none)."""
        roles = {r: s for r in ROLES if (s := getattr(self, r)) is not None}
        detached = {r: s.detach() for r, s in roles.items()}
        if all(detached[r] is roles[r] for r in roles):
            return self
        return LayerStats(**detached)

    def to_floats(self) -> dict[str, dict[str, float]]:
        """``role -> metric -> value`` on the host, with one device-to-host copy (call on logging steps only)."""
        items = [
            (role, metric, v) for role in ROLES if (s := getattr(self, role)) is not None for metric, v in s.items()
        ]
        if not items:
            return {}
        device = items[0][2].device
        flat = torch.stack([v.detach().reshape(()).to(device) for _, _, v in items]).tolist()
        out: dict[str, dict[str, float]] = {}
        for (role, metric, _), value in zip(items, flat):
            out.setdefault(role, {})[metric] = value
        return out

    @classmethod
    def from_flat(cls, flat: Mapping[str, torch.Tensor]) -> LayerStats:
        """The record for a flat mapping (``dict(stats)``, or a checkpoint's values as tensors)."""
        if isinstance(flat, LayerStats):
            return flat
        roles: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in flat.items():
            role, _, metric = key.partition("_")
            if role not in ROLES or metric not in METRICS:
                raise ValueError(f"{key!r} is not an FP8 layer statistic (role_metric with roles {ROLES}, {METRICS})")
            roles.setdefault(role, {})[metric] = value
        return cls(**{role: RoleStats(**metrics) for role, metrics in roles.items()})

    # -- flat mapping view -------------------------------------------------------------------------------
    def __getitem__(self, key: str) -> torch.Tensor:
        role, _, metric = key.partition("_")
        stats = getattr(self, role, None) if role in ROLES else None
        value = getattr(stats, metric, None) if metric in METRICS else None
        if value is None:
            raise KeyError(key)
        return value

    def __iter__(self) -> Iterator[str]:
        for role in ROLES:
            stats = getattr(self, role)
            if stats is not None:
                for metric, _ in stats.items():
                    yield f"{role}_{metric}"

    def __len__(self) -> int:
        return sum(1 for _ in self)


def operand_stats(
    x: torch.Tensor,
    data: torch.Tensor,
    x_hat: torch.Tensor,
    fmt: FP8Format,
    *,
    scale_codes: torch.Tensor | None = None,
    block_size: int = 32,
) -> RoleStats:
    """Health statistics of one quantization of ``x`` (float32): ``data`` the FP8 values (scaled, before
    dequantization), ``x_hat`` the dequantized result, ``fmt`` the FP8 format. Computed directly, one mask per
    statistic: the reference that :func:`raw_operand_stats` and :func:`tensorwise_operand_stats` equal.

    - ``saturation``: the fraction of the elements of ``x`` that were clipped: FP8 value ``±fmt.max`` and
      ``|x| > |x_hat|`` (an infinite input is clipped; a value that merely rounds to the max is not, nor is a NaN);
    - ``underflow``: the fraction of the non-zero elements of ``x`` (NaN among them) whose FP8 value is ``±0``;
    - ``sqnr_db``: :func:`sqnr_db` of ``x_hat`` over every element (NaN when ``x`` has a NaN or an inf, -inf when
      ``x_hat`` overflowed where ``x`` is finite);
    - ``amax``: :func:`tensor_amax` of ``x``;
    - ``mx_clamp`` with ``scale_codes`` (the E8M0 codes of MXFP8 blocks of ``block_size`` along the last dim): the
      fraction of blocks with code 254 (``2**127``) or with code 0 (``2**-127``) that are not all zero (OCP MX v1.0).

    No host sync.
    """
    f = _fp8_format(fmt)
    d = data.float()
    nonzero = x != 0
    clipped = (d.abs() == f.max) & (x.abs() > x_hat.abs())
    mx_clamp = None
    if scale_codes is not None:
        codes = scale_codes.to(torch.int32)
        block_amax = torch.where(torch.isfinite(x), x.abs(), 0.0).reshape(*x.shape[:-1], -1, block_size).amax(-1)
        clamp = (codes == 254) | ((codes == 0) & (block_amax > 0))
        mx_clamp = clamp.float().mean()
    return RoleStats(
        amax=tensor_amax(x),
        saturation=clipped.sum() / max(x.numel(), 1),
        underflow=(nonzero & (d == 0)).sum() / nonzero.sum().clamp_min(1),
        sqnr_db=sqnr_db(x, x_hat),
        mx_clamp=mx_clamp,
    )


#: Where each layer's values sit in :func:`stack_layer_stats`'s tensor: ``(layer, [(role, metric, position), ...])``.
StatsLayout = list[tuple[str, list[tuple[str, str, int]]]]


def stack_layer_stats(
    layers: Mapping[str, LayerStats], device: torch.device | str | None = None
) -> tuple[torch.Tensor | None, StatsLayout]:
    """Every measured statistic of ``layers`` as one flat float32 tensor (on ``device``, default the first
    value's), and the layout :func:`unstack_layer_stats` reads it back with; ``(None, [])`` when nothing was
    measured. No host read: the caller reads the tensor (with others) in one copy.

    Layers whose statistics are views of one finished table (:func:`layer_stats_from_table`, the emulated and
    native layers' samples) are sent as that table, whole: a fixed number of operations however many layers;
    the others value by value."""
    tables: dict[int, tuple[torch.Tensor, int]] = {}  # id(table) -> (table, offset)
    singles: list[torch.Tensor] = []
    entries: list[tuple[str, list[tuple[str, str, int | None]]]] = []
    offset = 0
    for layer, stats in layers.items():
        keys: list[tuple[str, str, int | None]] = []
        src = stats.source
        if src is not None:
            table, i = src
            if id(table) not in tables:
                tables[id(table)] = (table, offset)
                offset += table.numel()
            base = tables[id(table)][1] + i * table.shape[-2] * table.shape[-1]
        for r, role in enumerate(ROLES):
            rs = getattr(stats, role)
            if rs is None:
                continue
            for metric, v in rs.items():
                if src is not None:
                    keys.append((role, metric, base + r * table.shape[-1] + METRICS.index(metric)))
                else:
                    keys.append((role, metric, None))
                    singles.append(v.detach().reshape(()))
        if keys:
            entries.append((layer, keys))
    parts = [t.reshape(-1) for t, _ in tables.values()]
    first = parts[0] if parts else (singles[0] if singles else None)
    if first is None:
        return None, []
    dev = torch.device(device) if device is not None else first.device
    if singles:
        parts.append(torch.stack([v if v.device == dev else v.to(dev) for v in singles]))
    parts = [p if p.device == dev else p.to(dev) for p in parts]
    flat = parts[0] if len(parts) == 1 else torch.cat(parts)
    layout: StatsLayout = []
    k = offset
    for layer, keys in entries:
        placed = []
        for role, metric, pos in keys:
            if pos is None:
                pos, k = k, k + 1
            placed.append((role, metric, pos))
        layout.append((layer, placed))
    return (flat if flat.dtype == torch.float32 else flat.float()), layout


def unstack_layer_stats(values: Sequence[float], layout: StatsLayout) -> dict[str, dict[str, dict[str, float]]]:
    """``layer -> role -> metric -> value`` from the host values of :func:`stack_layer_stats`'s tensor (as
    :meth:`LayerStats.to_floats` gives for one layer)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for layer, keys in layout:
        roles: dict[str, dict[str, float]] = {}
        for role, metric, pos in keys:
            roles.setdefault(role, {})[metric] = values[pos]
        out[layer] = roles
    return out


#: The columns of :func:`raw_operand_stats`: the counts and sums one quantization's statistics are made of (elements,
#: the non-zero ones, those that became ±0, those clipped, the float64 L2 norms of ``x`` and of ``x - x_hat``, amax,
#: MX clamp).
RAW_COLUMNS = ("numel", "nonzero", "underflow", "clipped", "norm", "noise_norm", "amax", "mx_clamp")


def raw_operand_stats(
    x: torch.Tensor,
    data: torch.Tensor,
    x_hat: torch.Tensor,
    fmt: FP8Format,
    *,
    amax: torch.Tensor | None = None,
    scale_codes: torch.Tensor | None = None,
    block_size: int = 32,
    block_clamp: torch.Tensor | None = None,
) -> torch.Tensor:
    """The sums behind :func:`operand_stats`, as one float64 vector (:data:`RAW_COLUMNS`), for any scaling (per-tensor
    scalings have the cheaper :func:`tensorwise_operand_stats`); :func:`finish_operand_stats` turns rows of it (many
    layers and roles at once) into the statistics, later and batched. ``fmt`` may also be
    :data:`~hf_mixedprec.core.formats.E2M1` (NVFP4: ``data`` holds the E2M1 values after block scaling), whose
    block scales' share at their clamp comes as ``block_clamp`` (the ``mx_clamp`` column).

    ``amax``: :func:`tensor_amax` of ``x`` when the quantization computed it. Counts, amax and MX clamp give exactly
    :func:`operand_stats`'s values; the L2 norms are float64 sums, so the SQNR agrees with :func:`sqnr_db`'s float32
    sums to float32 rounding. No host sync.
    """
    f = fmt if fmt is E2M1 else _fp8_format(fmt)
    zero_t = _K(0.0, x.device)
    d = data.float()
    nonzero = torch.ne(x, zero_t)
    if f is E2M1:
        # NVFP4 clips a block's largest element by design: its E4M3 block scale is rounded to nearest (3 mantissa
        # bits: at most 2**-4 below the exact one, so the element exceeds 6 by a factor 16/15 at most). Saturation
        # counts clipping beyond that; a block whose scale flushed to zero underflows.
        under = nonzero & torch.eq(x_hat, zero_t)
        clipped = torch.eq(d.abs(), _K(f.max, x.device)) & torch.gt(x.abs(), x_hat.abs() * _K(16 / 15, x.device))
        clipped = clipped & ~under
    else:
        under = nonzero & torch.eq(d, zero_t)
        clipped = torch.eq(d.abs(), _K(f.max, x.device)) & torch.gt(x.abs(), x_hat.abs())
    counts = torch.stack([nonzero, under, clipped]).reshape(3, -1).sum(1).to(torch.float64)
    norms = torch.linalg.vector_norm(torch.stack([x, x - x_hat]).reshape(2, -1), dim=1, dtype=torch.float64)
    a = tensor_amax(x) if amax is None else amax
    if block_clamp is not None:
        mx = block_clamp.reshape(()).float()
    elif scale_codes is not None:
        codes = scale_codes.to(torch.int32)
        block_amax = torch.where(torch.isfinite(x), x.abs(), zero_t).reshape(*x.shape[:-1], -1, block_size).amax(-1)
        mx = ((codes == 254) | ((codes == 0) & (block_amax > 0))).float().mean()
    else:
        mx = _K(math.nan, x.device)
    numel = torch.full((1,), x.numel(), dtype=torch.float64, device=x.device)
    return torch.cat([numel, counts, norms, torch.stack([a.reshape(()), mx]).to(torch.float64)])


def grouped_raw_stats(
    x: torch.Tensor,
    data: torch.Tensor,
    x_hat: torch.Tensor,
    fmt: FP8Format,
    group: torch.Tensor,
    n_groups: int,
    *,
    scale_codes: torch.Tensor | None = None,
    block_size: int = 32,
) -> torch.Tensor:
    """:func:`raw_operand_stats` of each group of rows of ``x`` ``[S, ...]`` (the row's group in ``group`` ``[S]``,
    int64) as ``[n_groups, 8]`` float64 rows, in a fixed number of tensor operations for any number of groups: MoE
    experts, whose token rows (or weights, one row per expert) are quantized per expert. ``data`` holds the FP8
    values of ``x`` (same shape), ``x_hat`` their dequantized values; ``scale_codes``: MXFP8's E8M0 codes, ``[S,
    blocks]`` of ``block_size`` along the last dim (else the MX clamp column is NaN). An empty group has numel 0 and
    amax 0. No host sync."""
    f = _fp8_format(fmt)
    rows = x.shape[0]
    x2, d, xh = x.reshape(rows, -1), data.float().reshape(rows, -1), x_hat.reshape(rows, -1)
    zero = _K(0.0, x.device)
    nonzero = torch.ne(x2, zero)
    under = nonzero & torch.eq(d, zero)
    clipped = torch.eq(d.abs(), _K(f.max, x.device)) & torch.gt(x2.abs(), xh.abs())
    per_row = torch.stack([nonzero, under, clipped], 1).sum(-1).to(torch.float64)
    squares = torch.stack([x2, x2 - xh], 1).to(torch.float64).square().sum(-1)
    sums = torch.zeros(n_groups, 5, dtype=torch.float64, device=x.device)
    sums.index_add_(0, group, torch.cat([per_row, squares], 1))
    row_amax = x2.abs().amax(-1) if x2.shape[1] else x2.new_zeros(rows)
    amax = torch.zeros(n_groups, dtype=x2.dtype, device=x.device).scatter_reduce(
        0, group, row_amax, reduce="amax", include_self=True
    )
    numel = torch.zeros(n_groups, dtype=torch.float64, device=x.device)
    numel.index_add_(0, group, torch.full((rows,), float(x2.shape[1]), dtype=torch.float64, device=x.device))
    if scale_codes is not None:
        codes = scale_codes.to(torch.int32).reshape(rows, -1)
        finite = torch.where(torch.isfinite(x2), x2.abs(), zero)
        block_amax = torch.nn.functional.pad(finite, (0, (-finite.shape[1]) % block_size))
        block_amax = block_amax.reshape(rows, -1, block_size).amax(-1)
        at_clamp = ((codes == 254) | ((codes == 0) & (block_amax > 0))).sum(-1).to(torch.float64)
        clamped = torch.zeros(n_groups, dtype=torch.float64, device=x.device).index_add_(0, group, at_clamp)
        blocks = torch.zeros_like(clamped).index_add_(
            0, group, torch.full((rows,), float(codes.shape[1]), dtype=torch.float64, device=x.device)
        )
        mx = clamped / blocks.clamp_min(1.0)
    else:
        mx = torch.full((n_groups,), math.nan, dtype=torch.float64, device=x.device)
    counts, norms = sums[:, :3], sums[:, 3:].sqrt()
    return torch.cat([numel[:, None], counts, norms, amax.to(torch.float64)[:, None], mx[:, None]], 1)


def combine_raw(rows: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Rows of :data:`RAW_COLUMNS` (``[..., 8]``) combined along ``dim`` into what one measurement of all their
    elements gives: counts summed, L2 norms as the root of their summed squares, amax the max, the MX clamp fraction
    weighted by each row's elements (NaN where a row has none measured, or no row has elements)."""
    numel, nonzero, under, clipped, norm, noise, amax, mx = rows.unbind(-1)
    total = numel.sum(dim)
    columns = [total, nonzero.sum(dim), under.sum(dim), clipped.sum(dim)]
    columns += [
        norm.square().sum(dim).sqrt(),
        noise.square().sum(dim).sqrt(),
        amax.amax(dim),
        (mx * numel).sum(dim) / total,
    ]
    return torch.stack(columns, -1)


#: cached 0-d float32 constants (no scalar-to-tensor wrap per operation)
_K = Constants()


def tensorwise_operand_stats(
    x: torch.Tensor,
    x_hat: torch.Tensor,
    *,
    amax: torch.Tensor,
    top: torch.Tensor,
    magnitude: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """:func:`raw_operand_stats` for a per-tensor scale, from ``count_nonzero`` and two float64 L2 norms (no boolean
    mask, no FP8 value read): the 0-d values numel, the non-zero ``x``, the non-zero ``x_hat``, the clipped (``|x| >
    top``), the L2 norms of ``x`` and of ``x - x_hat``, and ``amax``. Nothing is assembled per operand:
    :func:`raw_from_tensorwise` stacks many operands' lists and finishes them together.

    ``amax`` is the quantization's :func:`tensor_amax` of ``x``, ``top`` what an FP8 value of ``fmt.max`` dequantizes
    to (``fmt.max * (1 / scale)``, 0-d), ``magnitude`` ``|x|`` if the caller has it (it is overwritten).

    Exact when ``scale`` and ``1 / scale`` are finite and positive: an FP8 value then dequantizes to 0 exactly when it
    is ±0, a NaN or infinite ``x`` to a non-zero value, and ``x`` is clipped exactly where ``|x| > top`` (``±max``
    dequantizes to ``±top``, and ``|x| > top`` makes ``|x| * scale`` round past the last step below the max). That
    holds for every scale of current scaling, and of delayed scaling with a margin up to 8 (see
    ``hf_mixedprec.fp8.emulated``). No host sync.
    """
    mag = x.abs() if magnitude is None else magnitude
    over = mag.sub_(top).clamp_min_(0.0).nan_to_num_(nan=0.0)  # > 0 where |x| > top (a NaN x: 0)
    norms = [torch.linalg.vector_norm(t, dtype=torch.float64) for t in (x, x - x_hat)]
    counts = [torch.count_nonzero(t) for t in (x, x_hat, over)]
    return [_K(float(x.numel()), x.device), *counts, *norms, amax]


def raw_from_tensorwise(records: Sequence[list[torch.Tensor]]) -> torch.Tensor:
    """``[n, 8]`` float64 :data:`RAW_COLUMNS` rows of ``n`` :func:`tensorwise_operand_stats` lists, in a fixed
    number of tensor operations for any ``n``."""
    values = torch.stack([t for r in records for t in r]).view(len(records), -1).to(torch.float64)
    numel, nonzero, nonzero_hat, clipped, norm, noise_norm, amax = values.unbind(-1)
    mx = torch.full_like(norm, math.nan)
    return torch.stack([numel, nonzero, nonzero - nonzero_hat, clipped, norm, noise_norm, amax, mx], -1)


def finish_operand_stats(raw: torch.Tensor) -> torch.Tensor:
    """Rows of :func:`raw_operand_stats` (shape ``[..., 8]``) -> ``[..., 5]`` float32 in :data:`METRICS` order
    (amax, saturation, underflow, sqnr_db, mx_clamp; NaN where not measured). A fixed number of operations for any
    number of rows."""
    numel, nonzero, under, clipped, norm, noise_norm, amax, mx = raw.unbind(-1)
    one = torch.ones((), dtype=raw.dtype, device=raw.device)
    db = 20.0 * torch.log10(norm / noise_norm)
    db = torch.where(noise_norm == 0, math.inf, db)
    sat = clipped / torch.maximum(numel, one)
    out = torch.stack([amax, sat, under / torch.maximum(nonzero, one), db, mx], -1).float()
    return torch.where(torch.isnan(numel).unsqueeze(-1), math.nan, out)


def layer_stats_from_table(table: torch.Tensor, flags: Sequence[tuple[Sequence[bool], bool]]) -> list[LayerStats]:
    """:func:`layer_stats_of` for every layer of one finished table ``[n, 3, 5]`` (``flags``: each layer's measured
    roles and whether MX clamp was measured), in a fixed number of tensor operations however many layers; each
    record knows the table it views (:attr:`LayerStats.source`)."""
    n = table.shape[0]
    columns = [c.unbind(0) for c in table.reshape(n * len(ROLES), len(METRICS)).t().unbind(0)]
    out = []
    for i, (measured, mx_clamp) in enumerate(flags):
        roles = {}
        for r, (role, seen) in enumerate(zip(ROLES, measured)):
            if seen:
                amax, sat, under, db, mx = (col[i * len(ROLES) + r] for col in columns)
                roles[role] = RoleStats(amax, sat, under, db, mx if mx_clamp else None)
        out.append(LayerStats(**roles, source=(table, i)))
    return out


def layer_stats_of(table: torch.Tensor, measured: Sequence[bool], mx_clamp: bool) -> LayerStats:
    """A :class:`LayerStats` of views into one layer's :func:`finish_operand_stats` table (``[3, 5]``, rows in
    :data:`ROLES` order); ``measured`` says which roles have a row and ``mx_clamp`` whether that metric was
    measured (both host facts: nothing is read)."""
    rows = table.unbind(0)
    roles = {}
    for role, row, seen in zip(ROLES, rows, measured):
        if seen:
            amax, sat, under, db, mx = row.unbind(0)
            roles[role] = RoleStats(amax, sat, under, db, mx if mx_clamp else None)
    return LayerStats(**roles)
