"""NVFP4 quantization, exactly as Transformer Engine's NVFP4 recipe computes it (for the emulated rehearsal).

NVFP4 (NVIDIA Blackwell; TE ``NVFP4BlockScaling``) stores FP4 E2M1 values (``±{0, 0.5, 1, 1.5, 2, 3, 4, 6}``)
with two levels of scale: an FP8 E4M3 *decode* scale per block of 16 consecutive elements (``1x16``; ``16x16``
two-dimensional blocks for weights, so a weight quantizes the same way in both orientations) and one FP32 scale
per tensor. The rules, as TE's pure-PyTorch reference states them
(``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py``, ``_quantize_blockwise_reference``; the kernels
in ``transformer_engine/common/cast/nvfp4/`` follow it):

* global encode scale ``g = (448 * 6) / amax`` in float32 (amax of the whole tensor), at most FLT_MAX, and 1 where
  it is 0; the global decode scale is ``1 / g``;
* a block's decode scale ``d = block_amax * (g * (1 / 6))``, at most FLT_MAX, clamped to ±448 and cast to E4M3
  (round to nearest even);
* a block's encode scale ``e = 1 / (float32(d) * (1 / g))``, at most FLT_MAX;
* elements ``x * e`` clamped to ±6 and rounded to E2M1: to nearest, ties to the even code (0.25 -> 0, 0.75 -> 1,
  1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4); a negative value that rounds to zero keeps its sign bit, -0.0
  and NaN give code 0;
* dequantized: ``value(code) * float32(d) * (1 / g)``.

The published training recipe (NVIDIA, "Pretraining Large Language Models with NVFP4", 2025) adds a random
Hadamard transform of size 16 on the inputs of the weight-gradient GEMM (:func:`random_hadamard_transform`, with
TE's fixed sign vector by default) and stochastic rounding for gradients (:func:`e2m1_codes` with a generator).
TE rounds stochastically in hardware with its own random bits; here a value between two E2M1 neighbours rounds up
with probability equal to its distance from the lower one over their gap, drawn from a seeded ``torch.Generator``,
so a run is reproducible: the same distribution, not TE's bits.

torchao (``torchao/prototype/mx_formats/nvfp4_tensor.py``, ``nvfp4_quantize``) computes the block scale in another
order (``(block_amax / 6) / (amax / (448 * 6))``); the two can differ in the last float32 bit before the E4M3 cast,
which changes a block's scale in rare ties. Here TE's order is followed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from hf_mixedprec.core.formats import E4M3, FLOAT32_MAX

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "NVFP4_BLOCK",
    "TE_RHT_SIGNS",
    "NVFP4Quantized",
    "draw_stream",
    "e2m1_codes",
    "e2m1_values",
    "hadamard_matrix",
    "hashed_uniform",
    "nvfp4_quantize",
    "pack_fp4",
    "random_hadamard_transform",
    "unpack_fp4",
]

#: Largest E2M1 magnitude.
E2M1_MAX = 6.0
#: E2M1 magnitudes by code 0-7; code ``c | 8`` is ``-value(c)``.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: Elements per NVFP4 block (along the GEMM's contraction dim).
NVFP4_BLOCK = 16
#: The signs TE's NVFP4 recipe applies before its 16-point Hadamard transform of the weight-gradient GEMM's inputs
#: (``get_wgrad_sign_vector`` in ``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py``).
TE_RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)

#: Where round-to-nearest-even moves from one E2M1 code to the next, and whether the boundary itself goes up
#: (``>=``: the upper neighbour's code is even) or stays (``>``).
_RNE_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def _magnitude(code: Tensor) -> Tensor:
    """:data:`E2M1_VALUES` ``[code]`` for codes 0-7, computed on the codes' device (a table built from a Python list
    would be a host-to-device copy, a sync on a GPU): exponent ``code >> 1``, mantissa bit ``code & 1``; exponent 0
    is subnormal (0 or 0.5), exponent e >= 1 is ``2**(e - 1) * (1 + mantissa / 2)``."""
    e = (code >> 1).float()
    m = (code & 1).float()
    return torch.where(e == 0, m * 0.5, torch.exp2(e - 1) * (1 + m * 0.5))


def e2m1_codes(x: Tensor, generator: torch.Generator | None = None, *, noise: Tensor | None = None) -> Tensor:
    """E2M1 codes (uint8, 0-15: bit 3 the sign) of float32 ``x``, which is clamped to ±6 first. Round to nearest,
    ties to the even code; with ``generator`` or ``noise`` (uniform draws in [0, 1), ``x``'s shape, e.g.
    :func:`hashed_uniform`), stochastic rounding instead (see the module docs)."""
    x = x.float().clamp(-E2M1_MAX, E2M1_MAX)
    mag = x.abs()
    if generator is None and noise is None:
        code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
        for edge, up in _RNE_STEPS:
            code += (mag >= edge if up else mag > edge).to(torch.uint8)
    else:
        low = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)  # the code of the magnitude at or below |x|
        for value in E2M1_VALUES[1:]:
            low += (mag >= value).to(torch.uint8)
        low = low.long()
        grid = _grid(x.device)[0]
        base = grid[low]
        gap = grid[(low + 1).clamp(max=len(E2M1_VALUES) - 1)] - base
        frac = torch.where(gap > 0, (mag - base) / torch.where(gap > 0, gap, 1.0), 0.0)
        draw = (
            noise.reshape(x.shape) if noise is not None else torch.rand(x.shape, generator=generator, device=x.device)
        )
        code = low + (draw < frac).to(torch.int64)
    code = torch.where(torch.isnan(x), 0, code).to(torch.uint8)  # torch.where promotes: back to uint8
    return code | ((x < 0).to(torch.uint8) << 3)


_MASK32 = 0xFFFFFFFF


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (xor-shift-multiply, int64 arithmetic that never overflows: products stay below 2**59)."""
    for _ in range(2):
        x = x ^ (x >> 16)
        x = (x * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def _mix32_int(x: int) -> int:
    """:func:`_mix32` on a Python int (the same bits)."""
    for _ in range(2):
        x ^= x >> 16
        x = (x * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def draw_stream(layer: int, seed: int) -> int:
    """The ``stream`` of :func:`hashed_uniform` for one layer (a number that tells layers apart) under one
    ``sr_seed``: both are hashed before they are combined, so another seed gives unrelated draws, not this seed's
    draws at shifted counters or of another layer (what adding or XOR-ing the raw seed in would give)."""
    return _mix32_int(_mix32_int(layer & _MASK32) ^ _mix32_int((seed ^ 0x5BD1E995) & _MASK32))


def hashed_uniform(shape: tuple[int, ...] | torch.Size, key: Tensor, stream: int = 0) -> Tensor:
    """Uniform draws in [0, 1) (float32, 24 random bits each) for stochastic rounding, computed on ``key``'s device
    from ``(key, stream, element index)`` by an integer hash: no generator state and no host value, so a compiled
    step keeps it in its graph, and a counter ``key`` (an int64 buffer) saved in a checkpoint replays the same draws
    after a resume. ``stream`` tells layers apart."""
    n = 1
    for d in shape:
        n *= int(d)
    k = _mix32((_mix32(key.to(torch.int64) & _MASK32) + (stream & _MASK32)) & _MASK32)
    k2 = _mix32((k + 0x3C6EF372) & _MASK32)
    idx = torch.arange(n, dtype=torch.int64, device=key.device)
    bits = _mix32(_mix32((idx ^ k) & _MASK32) ^ k2)
    return ((bits >> 8).to(torch.float32) * 2.0**-24).reshape(shape)


def e2m1_values(codes: Tensor) -> Tensor:
    """The float32 values of E2M1 ``codes`` (-0.0 for code 8)."""
    return _grid(codes.device)[1:3].reshape(16)[codes.long()]


def _grid(device: torch.device) -> Tensor:
    """A ``[3, 8]`` float32 table computed on ``device`` (one built from a Python list would be a host-to-device
    copy, a sync on a GPU): row 0 the E2M1 magnitudes by code, rows 1-2 the values of codes 0-15 (-0.0 for code
    8), so that a lookup replaces the arithmetic."""
    mag = _magnitude(torch.arange(8, device=device))
    return torch.stack([mag, mag, -mag])


def pack_fp4(codes: Tensor) -> Tensor:
    """Two E2M1 codes per byte along the last dim (even index in the low nibble, as TE and torchao store them)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dim (got {codes.shape[-1]})")
    return codes[..., ::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: Tensor) -> Tensor:
    """The codes :func:`pack_fp4` packed."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


@dataclass(frozen=True)
class NVFP4Quantized:
    """One NVFP4 tensor: ``codes`` (uint8, one E2M1 code per element, ``[m, n]``), ``block_scales`` (E4M3 decode
    scales, ``[m, n / 16]``, repeated over the 16 rows of a 16x16 block) and ``global_decode`` (FP32, 0-d)."""

    codes: Tensor
    block_scales: Tensor
    global_decode: Tensor

    def dequantize(self) -> Tensor:
        """``value(code) * decode_scale * global_decode`` in float32 (the first product is exact)."""
        m, n = self.codes.shape
        values = e2m1_values(self.codes).view(m, n // NVFP4_BLOCK, NVFP4_BLOCK)
        return (values * self.block_scales.float().unsqueeze(-1) * self.global_decode).view(m, n)


def global_encode_scale(amax: Tensor) -> Tensor:
    """TE's per-tensor encode scale ``(448 * 6) / amax`` (float32), at most FLT_MAX, 1 where it is 0."""
    g = torch.div(torch.full_like(amax.float(), E4M3.max * E2M1_MAX), amax.float())
    g = torch.clamp(g, max=FLOAT32_MAX)
    return torch.where(g == 0, torch.ones_like(g), g)


def nvfp4_quantize(
    x: Tensor,
    *,
    amax: Tensor | None = None,
    tile: tuple[int, int] = (1, NVFP4_BLOCK),
    generator: torch.Generator | None = None,
    noise: Tensor | None = None,
) -> NVFP4Quantized:
    """NVFP4 quantization of a 2-D ``x`` (both dims multiples of the tile; TE pads with zeros, which change no
    amax) with TE's rules (module docs). ``amax``: the tensor's amax (default: computed from ``x``); ``tile``
    ``(1, 16)`` or ``(16, 16)``; ``generator`` or ``noise`` (uniform draws of ``x``'s shape): stochastic rounding
    of the elements."""
    if tile not in ((1, NVFP4_BLOCK), (NVFP4_BLOCK, NVFP4_BLOCK)):
        raise ValueError(f"tile {tile} (allowed: (1, 16), (16, 16))")
    if x.dim() != 2 or x.shape[0] % tile[0] or x.shape[1] % tile[1]:
        raise ValueError(f"nvfp4_quantize needs a 2-D tensor with dims multiples of {tile} (got {tuple(x.shape)})")
    m, n = x.shape
    x = x.float()
    if amax is None:
        amax = x.abs().amax() if x.numel() else torch.zeros((), device=x.device)
    g = global_encode_scale(amax.reshape(()))
    blocks = x.view(m, n // NVFP4_BLOCK, NVFP4_BLOCK)
    if tile[0] == 1:
        block_amax = blocks.abs().amax(dim=-1, keepdim=True)
    else:
        tiles = x.view(m // NVFP4_BLOCK, NVFP4_BLOCK, n // NVFP4_BLOCK, NVFP4_BLOCK).abs().amax(dim=(1, 3))
        block_amax = tiles.repeat_interleave(NVFP4_BLOCK, dim=0).unsqueeze(-1)
    multiplier = g * torch.reciprocal(torch.full_like(g, E2M1_MAX))
    decode = torch.clamp(block_amax * multiplier, max=FLOAT32_MAX)
    decode = torch.clamp(decode, -E4M3.max, E4M3.max).to(torch.float8_e4m3fn)
    global_decode = torch.div(torch.ones_like(g), g)
    encode = torch.clamp(torch.div(1.0, decode.float() * global_decode), max=FLOAT32_MAX)
    codes = e2m1_codes((blocks * encode).view(m, n), generator, noise=noise)
    return NVFP4Quantized(codes, decode.squeeze(-1), global_decode)


def hadamard_matrix(signs: tuple[int, ...] | Tensor = TE_RHT_SIGNS, device: torch.device | None = None) -> Tensor:
    """The 16-point transform ``diag(signs) @ H16 / 4`` (float32; ``H16`` Sylvester's Hadamard matrix of ±1), an
    orthogonal matrix: its transpose undoes it. As TE builds it (``_build_hadamard_matrix``)."""
    h = torch.ones((1, 1), dtype=torch.float32, device=device)
    while h.shape[0] < NVFP4_BLOCK:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    if isinstance(signs, Tensor):
        signs = tuple(int(v) for v in signs.tolist())
    if len(signs) != NVFP4_BLOCK or any(v not in (1, -1) for v in signs):
        raise ValueError(f"signs: 16 values, each 1 or -1 (got {list(signs)})")
    rows = [h[i] * float(v) for i, v in enumerate(signs)]  # diag(signs) @ H, with no host-to-device copy
    return torch.stack(rows) * 0.25


def random_hadamard_transform(x: Tensor, signs: tuple[int, ...] | Tensor = TE_RHT_SIGNS) -> Tensor:
    """``x`` (float32) with every run of 16 consecutive elements along its last dim multiplied by
    :func:`hadamard_matrix` (``x_block @ M``), as TE applies it to the weight-gradient GEMM's inputs."""
    if x.shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"the last dim ({x.shape[-1]}) must be a multiple of {NVFP4_BLOCK}")
    m = hadamard_matrix(signs, x.device)
    return (x.float().reshape(-1, NVFP4_BLOCK) @ m).reshape(x.shape)
