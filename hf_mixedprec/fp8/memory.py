"""What Transformer Engine keeps in memory for one FP8 ``Linear``, for the memory estimate (no TE needed).

Read from Transformer Engine's PyTorch sources:

- ``module/linear.py`` (``_Linear.forward``): with FP8 the input is quantized and, for backward, only its
  column-wise (transposed) copy is kept ("Discard row-wise data since it is not needed in backward pass");
  the quantized weight (``weightmat``) is saved for the dgrad GEMM, with row-wise usage for the forward GEMM
  and column-wise usage for backward, so a weight is held twice in FP8 from its forward to its backward.
- ``module/base.py`` (``set_meta_tensor``): delayed scaling keeps ``num_gemms * 3`` forward quantizers
  (input, weight, output) and ``num_gemms * 2`` backward ones (grad_output, grad_input);
  ``quantization.py`` (``DelayedScalingRecipeState``) gives each group a float32 ``scale[n]`` and
  ``amax_history[amax_history_len, n]``.
- Scale layouts: per-tensor FP8 (delayed, current) has one float32 scale per tensor; MXFP8 one E8M0 byte per
  32 values along the block direction (OCP MX v1.0); ``Float8BlockScaling`` one float32 scale per 1x128
  tile of activations and per 128x128 tile of weights; NVFP4 (``NVFP4BlockScaling``) half a byte per value (two E2M1
  codes per byte), one E4M3 byte per 16 values along the block direction and a float32 scale per tensor
  (``transformer_engine/pytorch/tensor/nvfp4_tensor.py``); a 16x16 weight block still stores a scale per row of 16.

Padding of scale tensors to TE's kernel alignment is left out (under 1% for the layer sizes of LLMs).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

#: Quantizers per Linear under delayed scaling: 3 forward (input, weight, output) + 2 backward.
TE_DELAYED_QUANTIZERS = 5


def _scale_bytes(scaling: str, rows: int, cols: int, *, weight: bool) -> int:
    """Bytes of the scales of one FP8 copy of a ``rows x cols`` tensor, blocks running along ``cols``."""
    if scaling in ("delayed", "current"):
        return 4
    if scaling == "mxfp8":
        return rows * math.ceil(cols / 32)
    if scaling == "blockwise":
        if weight:
            return 4 * math.ceil(rows / 128) * math.ceil(cols / 128)
        return 4 * rows * math.ceil(cols / 128)
    if scaling == "nvfp4":
        return rows * math.ceil(cols / 16) + 4
    raise ValueError(f"scaling: {scaling!r} is not allowed (allowed: delayed, current, mxfp8, blockwise, nvfp4)")


def _data_bytes(scaling: str, numel: int) -> int:
    """Bytes of the low-precision values of one copy: one per FP8 value, half a byte per FP4 value."""
    return math.ceil(numel / 2) if scaling == "nvfp4" else numel


def te_weight_bytes(out_features: int, in_features: int, scaling: str) -> int:
    """The FP8 copies TE holds of one Linear's weight between its forward and backward (row- and column-wise)."""
    data = 2 * _data_bytes(scaling, out_features * in_features)
    return (
        data
        + _scale_bytes(scaling, out_features, in_features, weight=True)
        + _scale_bytes(scaling, in_features, out_features, weight=True)
    )


def te_saved_input_bytes(tokens: int, in_features: int, scaling: str) -> int:
    """The column-wise FP8 (or FP4) copy of a ``[tokens, in_features]`` input TE saves for the wgrad GEMM."""
    return _data_bytes(scaling, tokens * in_features) + _scale_bytes(scaling, in_features, tokens, weight=False)


def te_meta_bytes(scaling: str, amax_history_len: int) -> int:
    """Per-Linear scaling state that lives for the whole run: delayed scaling's histories and scales."""
    if scaling != "delayed":
        return 0
    return 4 * TE_DELAYED_QUANTIZERS * (amax_history_len + 1)


class _SavesLikeTE(torch.autograd.Function):
    """``y = x W^T + b`` that saves for backward a byte tensor of the size TE's FP8 input copy has.

    For the memory estimate only (it runs on fake tensors): the backward has the right shapes, not FP8 values.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, scaling: str) -> Tensor:
        tokens = x.numel() // x.shape[-1]
        saved = torch.empty(te_saved_input_bytes(tokens, x.shape[-1], scaling), dtype=torch.uint8, device=x.device)
        ctx.save_for_backward(saved, weight)
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.has_bias = bias is not None
        return nn.functional.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx: Any, gy: Tensor) -> tuple[Tensor | None, ...]:
        saved, weight = ctx.saved_tensors
        del saved  # only its size mattered (an FP4 copy holds two values per byte): the GEMM needs x's shape
        x = torch.zeros(ctx.x_shape, dtype=gy.dtype, device=gy.device)
        gx = (gy @ weight.to(gy.dtype)).to(ctx.x_dtype)
        gw = (gy.reshape(-1, gy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])).to(weight.dtype)
        gb = gy.reshape(-1, gy.shape[-1]).sum(0) if ctx.has_bias else None
        return gx, gw, gb, None


class TEMemoryStandIn(nn.Module):
    """Stands in for a TE FP8 ``Linear`` in the memory estimate: same Parameters, TE's saved-for-backward size.

    Holds the wrapped ``nn.Linear``'s Parameter objects; never used to train.
    """

    def __init__(self, linear: nn.Linear, scaling: str) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.scaling = scaling

    def forward(self, x: Tensor) -> Tensor:
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            x = x.to(torch.get_autocast_dtype(device_type))
        with torch.autocast(device_type=device_type, enabled=False):
            return _SavesLikeTE.apply(x, self.weight, self.bias, self.scaling)
