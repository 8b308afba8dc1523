"""The tiny MoE model the MoE tests train: a Qwen3-MoE built from its config (2 layers, hidden 64, 8 experts of 32,
top-2), whose experts run through transformers' experts interface."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

TINY_QWEN3_MOE: dict[str, Any] = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "moe_intermediate_size": 32, "intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2,
    "vocab_size": 256,
}  # fmt: skip


def tiny_qwen3_moe(seed: int = 0, **overrides: Any) -> nn.Module:
    """:data:`TINY_QWEN3_MOE` (with ``overrides``) built with ``seed`` (on the current default device)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(**{**TINY_QWEN3_MOE, **overrides})
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(cfg)
