"""FP8 for MoE experts: the grouped GEMMs of transformers 5's experts modules, quantized per expert.

transformers 5 keeps an MoE layer's experts as 3-D parameters in one module (``gate_up_proj`` ``[experts, 2 *
intermediate, hidden]``, ``down_proj`` ``[experts, hidden, intermediate]``, or the transposes when the class says
``is_transposed``) and runs them through its experts interface (``transformers/integrations/moe.py``:
``use_experts_implementation``, ``ALL_EXPERTS_FUNCTIONS``, chosen by ``config._experts_implementation``). There is no
``nn.Linear`` to swap, so this module registers an experts implementation of its own, :data:`IMPLEMENTATION`, that
runs the experts of every module holding an :class:`ExpertsFP8` (put there by :func:`convert_experts`) through FP8
grouped GEMMs, and every other experts module through the implementation the model had before.

Each expert is quantized exactly as the dense emulated path (:mod:`hf_mixedprec.fp8.emulated`) quantizes a Linear
holding that expert's weight and fed that expert's token rows: *current* scaling gives each expert's weight and each
expert's group of rows its own per-tensor scale (their amax now); *blockwise* uses 1x128 tiles along each GEMM's
contraction dim for rows and gradients and 128x128 tiles per expert weight (TE's ``Float8BlockScaling``); *mxfp8*
gives every 32 elements along the contraction dim an E8M0 scale (OCP MX v1.0). The weight-gradient GEMM contracts over
each expert's tokens, so its tiles and blocks start at each group's first row: a group whose size is not a multiple
of the tile is padded with zeros, as the dense path pads a Linear's input. Empty groups give zero rows and a zero
weight gradient. Under ``fp8.backend: torchao``
*rowwise* (:meth:`ExpertsFP8.for_torchao`) is torchao's ``prototype.moe_training`` FP8 grouped GEMM: a scale per row
along each GEMM's contraction dim, and per expert group and column for the weight gradient. The GEMMs run in float32 on
the dequantized operands (:func:`grouped_mm_f32`), one grouped GEMM per operand pair whatever the number of experts,
and nothing reads the device on the host.

*Delayed* scaling keeps, per experts module, an amax history and a scale for each expert and each operand (the
expert's input rows, its weight, its output gradient, for each of the two projections: ``fp8_amax_history``
``[L, 2 * experts, 3]``, ``fp8_scale`` ``[2 * experts, 3]``) in an :class:`ExpertsDelayedState` child module; the amaxes each expert sees during a step are kept
pending and :func:`~hf_mixedprec.fp8.fp8_step` updates every history at once after the optimizer step (reduced with
MAX over ranks, as for Linears), so each expert is scaled exactly as a dense delayed-scaling Linear holding it. The
state travels in checkpoints as the Linears' does and is kept out of a saved model.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hf_mixedprec.core._device import several_ranks
from hf_mixedprec.core._private import is_fake_tensor
from hf_mixedprec.core.formats import NumberFormat, get_format
from hf_mixedprec.fp8.emulated import EmulationSpec, activation_grad
from hf_mixedprec.fp8.stats import SampledStats
from hf_mixedprec.recipes.schema import TORCHAO_AMAX_EPS, CurrentFP8Config
from hf_mixedprec.scaling import (
    current_scale,
    delayed_update,
    dequantize_blockwise,
    dequantize_fp8,
    dequantize_mxfp8,
    quantize_blockwise,
    quantize_fp8,
    quantize_mxfp8,
)
from hf_mixedprec.scaling.fp8 import delayed_scaled_max
from hf_mixedprec.scaling.stats import combine_raw, grouped_raw_stats

__all__ = [
    "EXPERTS_SCALINGS",
    "IMPLEMENTATION",
    "ExpertsDelayedState",
    "ExpertsFP8",
    "ExpertsStats",
    "convert_experts",
    "converted_experts",
    "experts_states",
    "experts_stats",
    "fp8_experts_forward",
    "is_experts_module",
    "restore_experts",
    "tokens_per_expert",
]

#: The name this package's experts implementation has in transformers' ``ALL_EXPERTS_FUNCTIONS``.
IMPLEMENTATION = "hf_mixedprec_fp8"

#: The FP8 scalings the experts path implements.
EXPERTS_SCALINGS: tuple[str, ...] = ("delayed", "current", "blockwise", "mxfp8")

#: Where a converted experts module keeps its :class:`ExpertsFP8`.
_ATTR = "_hf_mixedprec_fp8"
#: The name of a delayed-scaling experts module's :class:`ExpertsDelayedState` child.
STATE_NAME = "hf_mixedprec_fp8_state"
#: Where a converted experts module keeps its two :class:`ExpertsStats` (gate/up projection, down projection).
_STATS = "_hf_mixedprec_fp8_stats"


def is_experts_module(mod: nn.Module) -> bool:
    """Whether ``mod`` is an experts module run through transformers' experts interface (its class was decorated with
    ``use_experts_implementation``: it has ``has_gate`` / ``is_transposed`` and 3-D ``down_proj``)."""
    down = getattr(mod, "down_proj", None)
    return (
        hasattr(mod, "is_transposed")
        and hasattr(mod, "has_gate")
        and isinstance(down, Tensor)
        and down.dim() == 3
        and hasattr(mod, "config")
    )


def experts_shape(mod: nn.Module) -> tuple[int, int, int]:
    """``(experts, hidden, intermediate)`` of an experts module (from ``down_proj``)."""
    e, a, b = mod.down_proj.shape  # [E, hidden, inter] or, transposed, [E, inter, hidden]
    return (int(e), int(b), int(a)) if mod.is_transposed else (int(e), int(a), int(b))


def experts_macs_per_token(mod: nn.Module) -> int:
    """Multiply-adds one token costs in this experts module's forward GEMMs: its top-k experts (the config's
    ``num_experts_per_tok``, 1 when it has none) each run the gate/up and the down projection."""
    _, hidden, inter = experts_shape(mod)
    k = int(getattr(mod.config, "num_experts_per_tok", None) or 1)
    up = 2 * inter if mod.has_gate else inter
    return k * (hidden * up + inter * hidden)


@dataclass(frozen=True)
class ExpertsFP8(EmulationSpec):
    """How one experts module's GEMMs are quantized: the dense path's
    :class:`~hf_mixedprec.fp8.emulated.EmulationSpec` (the same scaling, options and defaults), and the experts
    implementation the model ran before (``previous``)."""

    previous: str | None = None
    #: current scaling only: ``"tensor"`` (a scale per expert and operand) or ``"row"`` (torchao's rowwise
    #: ``prototype.moe_training``: a scale per row of each GEMM operand along its contraction dim)
    granularity: str = "tensor"
    #: the weight-gradient GEMM takes the unquantized operands (torchao's ``rowwise_with_gw_hp``)
    wgrad_high_precision: bool = False

    @classmethod
    def from_spec(cls, spec: EmulationSpec, previous: str | None = None) -> ExpertsFP8:
        """The experts' numerics for a recipe's :class:`~hf_mixedprec.fp8.emulated.EmulationSpec`."""
        return cls(**{**dataclasses.asdict(spec), "previous": previous})

    @classmethod
    def for_torchao(cls, cfg: CurrentFP8Config, previous: str | None = None) -> ExpertsFP8:
        """The experts' numerics under ``fp8.backend: torchao``: its ``torchao_recipe`` applied per expert.
        ``tensorwise`` scales each expert's operands as torchao's tensorwise Float8Linear scales a Linear holding that
        expert; ``rowwise`` is ``torchao.prototype.moe_training``'s FP8 grouped GEMM (``fp8_grouped_mm.py``: E4M3
        rows along the contraction dim, power-of-2 scales, the weight-gradient operands scaled per expert group and
        column); ``rowwise_with_gw_hp`` keeps its weight-gradient GEMM in high precision as the dense recipe does.
        torchao clamps every amax at 1e-12 (``torchao/float8/float8_utils.py``), whatever ``fp8.epsilon`` says."""
        name = cfg.torchao_recipe or "tensorwise"
        spec = dataclasses.replace(EmulationSpec.from_config(cfg), epsilon=TORCHAO_AMAX_EPS)
        return cls(
            **{**dataclasses.asdict(spec), "previous": previous},
            granularity="tensor" if name == "tensorwise" else "row",
            wgrad_high_precision=name == "rowwise_with_gw_hp",
        )

    @property
    def per_tensor(self) -> bool:
        """One scale per expert and operand (current or delayed scaling, tensor granularity): the forward's FP8
        operands serve the backward GEMMs as they are."""
        return self.scaling in ("current", "delayed") and self.granularity == "tensor"

    def fmt(self, role: int) -> NumberFormat:
        return get_format(self.bwd_format if role == 2 else self.fwd_format)


class ExpertsDelayedState(nn.Module):
    """Delayed scaling's state for one experts module: per projection (0: gate/up, 1: down), expert and operand (input,
    weight, output gradient) an amax history ``[L, 2 * experts, 3]`` (newest last; row ``p * experts + e``) and a
    scale ``[2 * experts, 3]``, both saved in checkpoints, and the step's amaxes (``fp8_amax_pending``, not saved)."""

    def __init__(self, n_experts: int, spec: ExpertsFP8, device: torch.device | None = None) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.algo = spec.amax_compute_algo
        n = 2 * n_experts
        self.register_buffer("fp8_amax_history", torch.zeros(spec.amax_history_len, n, 3, device=device))
        self.register_buffer("fp8_scale", torch.ones(n, 3, device=device))
        self.register_buffer("fp8_amax_pending", torch.zeros(n, 3, device=device), persistent=False)
        fmts = (spec.fwd_format, spec.fwd_format, spec.bwd_format)  # input, weight, output gradient
        scaled_max = delayed_scaled_max(fmts, margin=spec.margin, device=device)
        self.register_buffer("fp8_scaled_max", scaled_max, persistent=False)

    @torch.no_grad()
    def step(self) -> None:
        """One delayed-scaling update of every expert's histories and scales from the step's pending amaxes (MAX over
        ranks first), then the pending amaxes start again from zero: a fixed number of tensor ops, no host read."""
        pending = self.fp8_amax_pending
        if several_ranks():
            dist.all_reduce(pending, op=dist.ReduceOp.MAX)
        hist, scale = delayed_update(
            self.fp8_amax_history, self.fp8_scale, pending, scaled_max=self.fp8_scaled_max, algo=self.algo
        )
        self.fp8_amax_history.copy_(hist)
        self.fp8_scale.copy_(scale)
        pending.zero_()

    def _rows(self, proj: int) -> slice:
        return slice(proj * self.n_experts, (proj + 1) * self.n_experts)

    def note_amax(self, proj: int, role: int, amax: Tensor) -> None:
        """Keep ``amax`` (``[experts]``) as the step's pending amax of operand ``role`` of projection ``proj`` (the
        max over the step's calls: gradient accumulation and recomputation call the GEMMs more than once)."""
        pending = self.fp8_amax_pending[self._rows(proj), role]
        pending.copy_(torch.maximum(pending, amax.to(pending.dtype)))

    def scale(self, proj: int, role: int) -> Tensor:
        """The experts' scales (``[experts]``) for operand ``role`` of projection ``proj``."""
        return self.fp8_scale[self._rows(proj), role]


class ExpertsStats(SampledStats):
    """The sampled FP8 statistics of one projection of an experts module (its input, weight and output gradient over
    all experts), as an FP8 Linear keeps its own: one :data:`~hf_mixedprec.scaling.stats.RAW_COLUMNS` row per role,
    combined over the experts (:func:`~hf_mixedprec.scaling.stats.combine_raw`) from one row per expert
    (:func:`~hf_mixedprec.scaling.stats.grouped_raw_stats`), which :attr:`per_expert` keeps. Device tensors only."""

    def __init__(self, spec: ExpertsFP8) -> None:
        self.mx_clamp = spec.scaling == "mxfp8"
        self.start_records()
        #: the last sampled step's rows per expert, per role (``[experts, 8]``), None before
        self.per_expert: list[Tensor | None] = [None, None, None]

    def note(
        self,
        role: int,
        x: Tensor,
        x_hat: Tensor,
        keep: list[Tensor | None],
        group: Tensor,
        experts: int,
        spec: ExpertsFP8,
    ) -> None:
        """Record role ``role`` of a sampled step from the rows ``x``, their dequantized ``x_hat``, what the quantizer
        kept (FP8 values, MX codes) and each row's expert ``group`` (of ``experts``)."""
        data, codes = keep
        assert data is not None
        fmt = spec.fmt(role)
        rows = grouped_raw_stats(x, data, x_hat, fmt, group, experts, scale_codes=codes, block_size=spec.block_size)
        self.per_expert[role] = rows
        self.records[role] = combine_raw(rows)


def experts_stats(model: nn.Module) -> list[tuple[str, ExpertsStats]]:
    """The FP8 statistics holders of ``model``'s converted experts modules, named ``<module>.gate_up_proj`` (or
    ``.up_proj``) and ``<module>.down_proj`` after the parameters of each projection."""
    out: list[tuple[str, ExpertsStats]] = []
    for name, mod in model.named_modules():
        pair = getattr(mod, _STATS, None)
        if pair is not None:
            up = "gate_up_proj" if mod.has_gate else "up_proj"
            out += [(f"{name}.{up}", pair[0]), (f"{name}.down_proj", pair[1])]
    return out


def experts_states(model: nn.Module) -> list[tuple[str, ExpertsDelayedState]]:
    """Every :class:`ExpertsDelayedState` of ``model`` with its dotted name."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, ExpertsDelayedState)]


#: Delayed scaling's state as the quantizers take it: the module's state and the projection (0: gate/up, 1: down).
_Delayed = tuple[ExpertsDelayedState, int]


# -- quantization -----------------------------------------------------------------------------------------------------
def _group_of_rows(offsets: Tensor, rows: int) -> Tensor:
    """The expert of each of ``rows`` sorted rows, from the cumulative ends ``offsets`` (int32 ``[E]``)."""
    idx = torch.arange(rows, device=offsets.device, dtype=offsets.dtype)
    return torch.searchsorted(offsets, idx, right=True).clamp_(max=offsets.numel() - 1)


def _per_group_amax(rows: Tensor, gid: Tensor, n_groups: int) -> Tensor:
    """The amax of each group's rows (0 for an empty group), NaN-propagating as ``amax`` is."""
    row_amax = rows.abs().amax(dim=-1) if rows.numel() else rows.new_zeros(rows.shape[0])
    out = torch.zeros(n_groups, dtype=rows.dtype, device=rows.device)
    return out.scatter_reduce(0, gid, row_amax, reduce="amax", include_self=True)


def _pad_groups(rows: Tensor, offsets: Tensor, gid: Tensor, multiple: int) -> tuple[Tensor, Tensor]:
    """``rows`` copied into a zero buffer where each group starts at a multiple of ``multiple`` rows; the buffer and
        each row's position in it. The buffer's size is a static bound (rows + groups * (multiple - 1), rounded up to whole
    tiles): no host read."""
    n_groups = offsets.numel()
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    padded = (counts + multiple - 1) // multiple * multiple
    starts = torch.cumsum(padded, 0) - padded  # each group's first row in the buffer
    first = offsets - counts  # each group's first row in `rows`
    pos = starts[gid] + torch.arange(rows.shape[0], device=rows.device, dtype=offsets.dtype) - first[gid]
    bound = rows.shape[0] + n_groups * (multiple - 1)
    buf = rows.new_zeros((bound + multiple - 1) // multiple * multiple, rows.shape[1])  # whole tiles
    return buf.index_copy(0, pos.long(), rows), pos.long()


def _per_tensor_scale(spec: ExpertsFP8, amax: Tensor, role: int, state: _Delayed | None, record: bool) -> Tensor:
    """Each expert's per-tensor scale for operand ``role`` from its amax now (current) or its history (delayed, which
    keeps the amax pending when ``record``)."""
    if spec.scaling == "delayed":
        assert state is not None, "delayed scaling needs the experts module's ExpertsDelayedState"
        if record:
            state[0].note_amax(state[1], role, amax)
        return state[0].scale(state[1], role)
    return current_scale(amax, fmt=spec.fmt(role), epsilon=spec.epsilon, power_2=spec.power_2_scales)


def quantize_rows(
    spec: ExpertsFP8,
    rows: Tensor,
    offsets: Tensor,
    role: int,
    *,
    along_tokens: bool,
    src_dtype: torch.dtype,
    state: _Delayed | None = None,
    record: bool = False,
    keep: list[Tensor | None] | None = None,
) -> Tensor:
    """Quantize-dequantize the sorted token rows ``rows`` ``[S, K]`` (float32) of the groups ``offsets`` for one GEMM:
    along the feature dim (forward, input gradient) or, with ``along_tokens``, along each group's tokens (the weight
    gradient). Role 0 is the input, 2 the output gradient. ``state`` and ``record``: delayed scaling's; ``keep``
    (feature-dim quantization only): a list that receives the FP8 values and the MX scale codes (or None)."""
    fmt = spec.fmt(role)
    if spec.granularity == "row":
        return _rowwise_rows(spec, rows, offsets, fmt, along_tokens=along_tokens, keep=keep)
    if spec.per_tensor:  # a per-tensor scale per group serves both orientations
        gid = _group_of_rows(offsets, rows.shape[0])
        amax = _per_group_amax(rows, gid, offsets.numel())
        scale = _per_tensor_scale(spec, amax, role, state, record)[gid].unsqueeze(-1)
        data = quantize_fp8(rows, scale, fmt)
        if keep is not None:
            keep += [data, None]
        return dequantize_fp8(data, scale)
    tile = spec.block_size if spec.scaling == "mxfp8" else 128
    if not along_tokens:  # tiles within a row: the groups do not matter
        return _blocked_rows(spec, rows, fmt, tile, src_dtype, keep)
    gid = _group_of_rows(offsets, rows.shape[0])
    buf, pos = _pad_groups(rows, offsets, gid, tile)
    deq = _blocked_rows(spec, buf.t(), fmt, tile, src_dtype)  # [K, padded S]: tiles along the tokens of a group
    return deq.t()[pos]


def _rowwise_rows(
    spec: ExpertsFP8,
    rows: Tensor,
    offsets: Tensor,
    fmt: NumberFormat,
    *,
    along_tokens: bool,
    keep: list[Tensor | None] | None = None,
) -> Tensor:
    """Rowwise current scaling of sorted token rows ``[S, K]``: along the feature dim, a scale per row (the forward's
    input, the input gradient's output gradient: :func:`_per_row`); along the tokens, a scale per expert group and
    column (the weight-gradient GEMM's two operands, as ``torch_to_float8_per_group_colwise`` in
    ``torchao/prototype/moe_training/utils.py``). ``keep``: a list that receives the FP8 values (and None)."""
    if not along_tokens:
        return _per_row(spec, rows, fmt, keep)
    gid = _group_of_rows(offsets, rows.shape[0])
    amax = rows.new_zeros(offsets.numel(), rows.shape[1])
    amax = amax.scatter_reduce(0, gid.long()[:, None].expand_as(rows), rows.abs(), "amax", include_self=True)
    scale = current_scale(amax, fmt=fmt, epsilon=spec.epsilon, power_2=spec.power_2_scales)[gid]
    data = quantize_fp8(rows, scale, fmt)
    if keep is not None:
        keep += [data, None]
    return dequantize_fp8(data, scale)


def _per_row(spec: ExpertsFP8, t: Tensor, fmt: NumberFormat, keep: list[Tensor | None] | None = None) -> Tensor:
    """Quantize-dequantize a 2-D tensor with a current scale per row along its last dim (torchao's rowwise casts);
    ``keep``: a list that receives the FP8 values (and None)."""
    scale = current_scale(
        t.abs().amax(dim=-1, keepdim=True), fmt=fmt, epsilon=spec.epsilon, power_2=spec.power_2_scales
    )  # [rows, 1]: no rows, no scales
    data = quantize_fp8(t, scale, fmt)
    if keep is not None:
        keep += [data, None]
    return dequantize_fp8(data, scale)


def _blocked_rows(
    spec: ExpertsFP8,
    t: Tensor,
    fmt: NumberFormat,
    tile: int,
    src_dtype: torch.dtype,
    keep: list[Tensor | None] | None = None,
) -> Tensor:
    """Quantize-dequantize a 2-D tensor in 1 x ``tile`` blocks along its last dim (MXFP8 or 1x128 tiles); ``keep``:
    a list that receives the FP8 values (``t``'s shape) and the MX scale codes (None for 1x128 tiles)."""
    cols = t.shape[-1]
    pad = (-cols) % tile
    if spec.scaling == "mxfp8":
        padded = torch.nn.functional.pad(t, (0, pad)) if pad else t
        data, codes = quantize_mxfp8(padded, fmt=fmt.name, block_size=tile, rounding=spec.mx_rounding, dim=-1)
        if keep is not None:
            keep += [data[..., :cols], codes]
        return dequantize_mxfp8(data, codes, block_size=tile, dim=-1)[..., :cols]
    data, scales = quantize_blockwise(
        t, tile=(1, 128), fmt=fmt.name, power_2=spec.power_2_scales, input_dtype=src_dtype
    )
    if keep is not None:
        keep += [data, None]
    return dequantize_blockwise(data, scales, tile=(1, 128))


def quantize_weights(
    spec: ExpertsFP8,
    w: Tensor,
    *,
    for_dgrad: bool,
    src_dtype: torch.dtype,
    state: _Delayed | None = None,
    record: bool = False,
    keep: list[Tensor | None] | None = None,
) -> Tensor:
    """Quantize-dequantize the experts' GEMM weights ``W`` ``[E, out, in]`` (float32), each expert as the dense path
    quantizes a Linear's weight: per expert tensor (current), 128x128 tiles per expert (blockwise), MX blocks (or
    torchao's rowwise scales, a scale per row) along ``in`` for the forward and along ``out`` for the input gradient
    (``for_dgrad``). ``keep`` (forward only): a list
    that receives the FP8 values as ``[E * out, in]`` rows and the MX scale codes of those rows (or None)."""
    fmt = spec.fmt(1)
    e, out_f, in_f = w.shape
    if spec.per_tensor:
        amax = w.abs().amax(dim=(1, 2)) if w.numel() else w.new_zeros(w.shape[0])
        scale = _per_tensor_scale(spec, amax, 1, state, record)[:, None, None]
        data = quantize_fp8(w, scale, fmt)
        if keep is not None:
            keep += [data.reshape(e * out_f, in_f), None]
        return dequantize_fp8(data, scale)
    if spec.scaling == "blockwise":  # orientation-free 128x128 tiles over each expert's last two dims
        data, scales = quantize_blockwise(
            w, tile=(128, 128), fmt=fmt.name, power_2=spec.power_2_scales, input_dtype=src_dtype
        )
        if keep is not None:
            keep += [data.reshape(e * out_f, in_f), None]
        return dequantize_blockwise(data, scales, tile=(128, 128))

    def along_rows(t: Tensor, kept: list[Tensor | None] | None = None) -> Tensor:
        """Each row of ``t`` along the GEMM's contraction dim: in MX blocks, or with torchao's per-row scale."""
        if spec.granularity == "row":
            return _per_row(spec, t, fmt, kept)
        return _blocked_rows(spec, t, fmt, spec.block_size, src_dtype, kept)

    if for_dgrad:  # contracted over ``out``
        return along_rows(w.transpose(1, 2).reshape(e * in_f, out_f)).view(e, in_f, out_f).transpose(1, 2)
    return along_rows(w.reshape(e * out_f, in_f), keep).view(e, out_f, in_f)


# -- float32 grouped GEMMs ------------------------------------------------------------------------------------------
#: Rows per chunk of the chunked float32 grouped GEMM (devices whose grouped_mm takes BF16 only).
_CHUNK = 128


def grouped_mm_f32(a: Tensor, b: Tensor, offsets: Tensor, *, chunked: bool | None = None) -> Tensor:
    """A float32 grouped GEMM over the groups ``offsets``: ``a`` ``[S, K]`` rows times ``b[e]`` ``[K, N]`` (``b`` 3-D),
    or, with ``b`` 2-D, the per-group ``a[:, rows of e] @ b[rows of e]`` stacked ``[E, K', N]`` (the weight gradient).

    On the CPU this is ``torch.nn.functional.grouped_mm``, which takes float32 there. On a GPU (and meta, and the fake
    tensors ``estimate`` runs) it takes BF16 only, so the rows go in chunks of 128 that never straddle two groups (each group padded with zero rows) and the
    chunks run as one float32 ``bmm`` against their expert's matrix: a fixed number of ops and no host read, at the cost
    of gathering one ``[K, N]`` matrix per chunk (the emulated backend is a rehearsal, not a fast path)."""
    if chunked is None:  # fake tensors (estimate) follow grouped_mm's meta rule: BF16 only
        chunked = a.device.type != "cpu" or is_fake_tensor(a)
    if not chunked:
        return torch.nn.functional.grouped_mm(a, b, offs=offsets)
    n_groups = offsets.numel()
    if b.dim() == 3:  # forward / input gradient: a [S, K] @ b[e] [K, N]
        gid = _group_of_rows(offsets, a.shape[0])
        buf, pos = _pad_groups(a, offsets, gid, _CHUNK)
        chunks = buf.view(-1, _CHUNK, a.shape[1])
        expert = _chunk_group(offsets, chunks.shape[0])
        out = torch.bmm(chunks, b[expert]).view(-1, b.shape[2])
        return out[pos]
    # weight gradient: a is [K', S] (the transposed gradient), b is [S, N]
    gid = _group_of_rows(offsets, b.shape[0])
    left, _ = _pad_groups(a.t(), offsets, gid, _CHUNK)
    right, _ = _pad_groups(b, offsets, gid, _CHUNK)
    n_chunks = left.shape[0] // _CHUNK
    expert = _chunk_group(offsets, n_chunks)
    per_chunk = torch.bmm(left.view(n_chunks, _CHUNK, -1).transpose(1, 2), right.view(n_chunks, _CHUNK, -1))
    out = per_chunk.new_zeros(n_groups, per_chunk.shape[1], per_chunk.shape[2])
    return out.index_add(0, expert, per_chunk)


def _chunk_group(offsets: Tensor, n_chunks: int) -> Tensor:
    """The group of each chunk of the padded buffer :func:`_pad_groups` made with ``_CHUNK``-row tiles (a chunk past
    every group's end is all zeros and goes to the last group, adding nothing)."""
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    ends = torch.cumsum((counts + _CHUNK - 1) // _CHUNK, 0)
    idx = torch.arange(n_chunks, device=offsets.device, dtype=ends.dtype)
    return torch.searchsorted(ends, idx, right=True).clamp_(max=offsets.numel() - 1)


# -- the grouped GEMM ----------------------------------------------------------------------------------------------
class _FP8GroupedLinear(torch.autograd.Function):
    """``y[rows of expert e] = x[rows of e] @ W[e].T`` with FP8 operands in all three GEMMs (forward, input gradient,
    weight gradient), float32 accumulation."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        offsets: Tensor,
        spec: ExpertsFP8,
        transposed: bool,
        out_dtype: torch.dtype,
        state: _Delayed | None,
        stats: ExpertsStats | None,
    ) -> Tensor:
        record = state is not None and state[0].training
        sampled = stats is not None and stats.record_stats
        w = (weight.transpose(1, 2) if transposed else weight).float()  # [E, out, in]
        x_dtype = x.dtype
        x = x.to(out_dtype)  # TE's GroupedLinear casts its input to the activation dtype before quantizing it
        x32 = x.float()
        keep_x: list[Tensor | None] | None = [] if sampled else None
        keep_w: list[Tensor | None] | None = [] if sampled else None
        xq = quantize_rows(
            spec, x32, offsets, 0, along_tokens=False, src_dtype=x.dtype, state=state, record=record, keep=keep_x
        )
        wq = quantize_weights(spec, w, for_dgrad=False, src_dtype=weight.dtype, state=state, record=record, keep=keep_w)
        if stats is not None and keep_x is not None and keep_w is not None:
            e, out_f, in_f = w.shape
            stats.note(0, x32, xq, keep_x, _group_of_rows(offsets, x32.shape[0]).long(), e, spec)
            experts = torch.arange(e, device=w.device).repeat_interleave(out_f)
            stats.note(1, w.reshape(e * out_f, in_f), wq.reshape(e * out_f, in_f), keep_w, experts, e, spec)
        y = grouped_mm_f32(xq, wq.transpose(1, 2), offsets)
        if spec.per_tensor:
            x_w, w_d = xq, wq
        else:
            if spec.wgrad_high_precision:
                x_w = x32
            else:
                x_w = quantize_rows(spec, x32, offsets, 0, along_tokens=True, src_dtype=x.dtype)
            w_d = (
                wq if spec.scaling == "blockwise" else quantize_weights(spec, w, for_dgrad=True, src_dtype=weight.dtype)
            )
        ctx.save_for_backward(x_w, w_d, offsets)
        ctx.spec, ctx.transposed, ctx.dtypes, ctx.state, ctx.record = (
            spec,
            transposed,
            (x_dtype, weight.dtype, out_dtype),
            state,
            record,
        )
        ctx.stats = stats if sampled else None
        return y.to(out_dtype)

    @staticmethod
    def backward(ctx: Any, gy: Tensor) -> tuple[Tensor | None, ...]:
        x_w, w_d, offsets = ctx.saved_tensors
        spec: ExpertsFP8 = ctx.spec
        x_dtype, w_dtype, act = ctx.dtypes
        g32 = gy.float()
        keep: list[Tensor | None] | None = [] if ctx.stats is not None else None
        g_d = quantize_rows(
            spec, g32, offsets, 2, along_tokens=False, src_dtype=gy.dtype, state=ctx.state, record=ctx.record, keep=keep
        )
        if ctx.stats is not None and keep is not None:
            ctx.stats.note(2, g32, g_d, keep, _group_of_rows(offsets, g32.shape[0]).long(), offsets.numel(), spec)
        gx = activation_grad(grouped_mm_f32(g_d, w_d, offsets), act, x_dtype) if ctx.needs_input_grad[0] else None
        gw = None
        if ctx.needs_input_grad[1]:  # frozen experts need no weight-gradient GEMM
            if spec.per_tensor:
                g_w = g_d
            elif spec.wgrad_high_precision:
                g_w = g32
            else:
                g_w = quantize_rows(spec, g32, offsets, 2, along_tokens=True, src_dtype=gy.dtype)
            dw = grouped_mm_f32(g_w.t(), x_w, offsets)  # [E, out, in]
            gw = activation_grad(dw.transpose(1, 2) if ctx.transposed else dw, act, w_dtype)
        return gx, gw, None, None, None, None, None, None


def fp8_grouped_linear(
    x: Tensor,
    weight: Tensor,
    offsets: Tensor,
    spec: ExpertsFP8,
    *,
    transposed: bool,
    out_dtype: torch.dtype,
    state: _Delayed | None = None,
    stats: ExpertsStats | None = None,
) -> Tensor:
    """The experts' grouped GEMM ``x @ W[e].T`` per group of sorted rows, in FP8 (see :class:`_FP8GroupedLinear`);
    ``state``: the module's delayed-scaling state and the projection (delayed scaling only); ``stats``: where the
    projection's sampled statistics go."""
    return _FP8GroupedLinear.apply(x, weight, offsets, spec, transposed, out_dtype, state, stats)


def _no_autocast(device_type: str) -> Any:
    """A region outside autocast (nothing to leave on a device without autocast, e.g. meta)."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _out_dtype(x: Tensor) -> torch.dtype:
    dev = x.device.type
    if torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def tokens_per_expert(ids: Tensor, n_experts: int) -> Tensor:
    """How many of the expert indices ``ids`` go to each of ``n_experts`` experts (float32 ``[n_experts]``), with no
    host read: ``histc``, not ``bincount``, which sizes its output from the largest id (a host read on a GPU);
    ``histc`` takes floats on CPU and MPS, integers elsewhere."""
    flat = ids.reshape(-1)
    return torch.histc(flat.float() if flat.device.type in ("cpu", "mps") else flat.int(), bins=n_experts, min=0,
                       max=n_experts - 1)  # fmt: skip


def fp8_experts_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """transformers' experts call (``hidden_states`` ``[tokens, hidden]``, each token's top-k experts and weights) with
    the experts' GEMMs in FP8 where this module holds an :class:`ExpertsFP8`, else through its previous
    implementation. Rows are sorted by expert, both projections run as grouped GEMMs, and each token's outputs are
    summed in float32 over its k experts (as transformers' ``grouped_mm`` implementation does)."""
    spec: ExpertsFP8 | None = getattr(self, _ATTR, None)
    if spec is None or getattr(self, "_is_expert_parallel", False):
        return _previous(self, spec)(self, hidden_states, top_k_index, top_k_weights)
    n_tokens, hidden = hidden_states.shape
    k = top_k_index.shape[-1]
    flat_ids = top_k_index.reshape(-1)
    ids_sorted, order = torch.sort(flat_ids, stable=True)
    rows = hidden_states[order // k]
    offsets = torch.cumsum(tokens_per_expert(ids_sorted, self.num_experts), 0, dtype=torch.int32)
    out_dtype = _out_dtype(hidden_states)
    with _no_autocast(hidden_states.device.type):
        up_w = self.gate_up_proj if self.has_gate else self.up_proj
        state = getattr(self, STATE_NAME, None)
        stats = getattr(self, _STATS, (None, None))
        h = fp8_grouped_linear(
            rows, up_w, offsets, spec, transposed=self.is_transposed, out_dtype=out_dtype,
            state=None if state is None else (state, 0), stats=stats[0],
        )  # fmt: skip
        if self.has_bias:
            h = h + (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias)[ids_sorted]
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    with _no_autocast(hidden_states.device.type):
        out = fp8_grouped_linear(
            h, self.down_proj, offsets, spec, transposed=self.is_transposed, out_dtype=out_dtype,
            state=None if state is None else (state, 1), stats=stats[1],
        )  # fmt: skip
        if self.has_bias:
            out = out + self.down_proj_bias[ids_sorted]
    if getattr(self, "has_post_expert_norm", False):
        out = self.post_expert_norm(out)
    out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
    unsorted = torch.empty_like(out).index_copy_(0, order, out)
    return unsorted.view(n_tokens, k, hidden).float().sum(dim=1).to(hidden_states.dtype)


def _previous(mod: nn.Module, spec: ExpertsFP8 | None) -> Any:
    """The experts function the model ran before :data:`IMPLEMENTATION` was set (its eager forward for "eager")."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    name = spec.previous if spec is not None else getattr(mod, "_hf_mixedprec_previous", None)
    if name not in (None, "eager", IMPLEMENTATION) and name in ALL_EXPERTS_FUNCTIONS:
        return ALL_EXPERTS_FUNCTIONS[name]
    eager = getattr(type(mod).forward, "__wrapped__", None)  # the class's own forward, kept by functools.wraps
    return eager if eager is not None else ALL_EXPERTS_FUNCTIONS["grouped_mm"]


def register() -> None:
    """Register :data:`IMPLEMENTATION` with transformers' experts interface (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, fp8_experts_forward)


def convert_experts(model: nn.Module, names: list[str], spec: ExpertsFP8) -> None:
    """Run the experts modules ``names`` of ``model`` in FP8 as ``spec`` says: each gets its :class:`ExpertsFP8`, and
    every config those modules read switches to :data:`IMPLEMENTATION` (experts not named keep running through the
    implementation their config had). Parameters, their names and the state_dict are unchanged."""
    register()
    for name in names:
        mod = model.get_submodule(name)
        cfg = mod.config
        before = cfg._experts_implementation
        previous = getattr(cfg, "_hf_mixedprec_previous_experts", before)
        setattr(mod, _ATTR, dataclasses.replace(spec, previous=previous))
        if not hasattr(mod, _STATS):
            setattr(mod, _STATS, (ExpertsStats(spec), ExpertsStats(spec)))
        if spec.scaling == "delayed" and not isinstance(getattr(mod, STATE_NAME, None), ExpertsDelayedState):
            n_experts = experts_shape(mod)[0]
            mod.add_module(STATE_NAME, ExpertsDelayedState(n_experts, spec, mod.down_proj.device))
        if before != IMPLEMENTATION:
            cfg._hf_mixedprec_previous_experts = before
            cfg._experts_implementation_internal = IMPLEMENTATION
    for mod in model.modules():  # experts sharing a switched config but not converted keep their implementation
        if is_experts_module(mod) and not hasattr(mod, _ATTR):
            mod._hf_mixedprec_previous = getattr(mod.config, "_hf_mixedprec_previous_experts", None)


def converted_experts(model: nn.Module) -> list[str]:
    """The names of ``model``'s experts modules that run in FP8 (:func:`convert_experts`)."""
    return [n for n, m in model.named_modules() if getattr(m, _ATTR, None) is not None]


def restore_experts(model: nn.Module, only: list[str] | None = None) -> list[str]:
    """Undo :func:`convert_experts` (for the modules ``only`` names, else all): the experts compute in high precision
    through the implementation their config had before; returns the names of the modules restored. Their delayed-scaling states go with them: the caller
    calls :func:`~hf_mixedprec.fp8.invalidate_layer_cache` (this module sits below the layer lists)."""
    restored = []
    for name, mod in model.named_modules():
        spec = getattr(mod, _ATTR, None)
        if spec is None or (only is not None and name not in only):
            continue
        delattr(mod, _ATTR)
        if hasattr(mod, _STATS):
            delattr(mod, _STATS)
        if hasattr(mod, STATE_NAME):
            delattr(mod, STATE_NAME)
        mod._hf_mixedprec_previous = spec.previous  # what fp8_experts_forward runs while others stay converted
        restored.append(name)
    left = {id(m.config) for _, m in model.named_modules() if getattr(m, _ATTR, None) is not None}
    for name in restored:  # a config the restored modules share with converted ones keeps this implementation
        mod = model.get_submodule(name)
        cfg = mod.config
        if cfg._experts_implementation == IMPLEMENTATION and id(cfg) not in left:
            cfg._experts_implementation_internal = mod._hf_mixedprec_previous
    return restored
