"""Recipe -> DeepSpeed config (JSON), for Trainer's ``deepspeed=`` and for ``hf-mixedprec launch``.

DeepSpeed's dynamic loss scaler names (``initial_scale_power``, ``loss_scale_window``, ``hysteresis``,
``min_loss_scale``) are derived from the recipe's torch-style ``loss_scale`` keys; ``loss_scale: 0`` selects
dynamic scaling. DeepSpeed clips inside ``engine.step()`` with a value fixed at init, so adaptive clipping
cannot run there: that is reported as a fallback note, never silently.
"""

from __future__ import annotations

import math
from typing import Any

from hf_mixedprec.recipe import Recipe

__all__ = ["deepspeed_config"]


def deepspeed_config(recipe: Recipe, *, zero_stage: int | None = None) -> tuple[dict[str, Any], list[str]]:
    """Build a DeepSpeed config dict for ``recipe`` and the fallback notes that go with it.

    Batch size, accumulation and optimizer settings are ``"auto"`` so that Trainer / Accelerate fill them.
    """
    if recipe.precision == "fp8":
        raise ValueError(f"recipe {recipe.name!r}: DeepSpeed is not supported with precision fp8")
    notes: list[str] = []
    stage = zero_stage if zero_stage is not None else (recipe.distributed.zero_stage or 0)
    cfg: dict[str, Any] = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": stage},
    }
    if recipe.precision == "fp16":
        ls = recipe.loss_scale
        assert ls is not None
        cfg["fp16"] = {
            "enabled": True,
            "loss_scale": 0,  # 0 = dynamic
            "initial_scale_power": int(math.log2(ls.init_scale)),
            "loss_scale_window": ls.growth_interval,
            "hysteresis": ls.hysteresis,
            "min_loss_scale": ls.min_scale,
        }
        cfg["bf16"] = {"enabled": False}
    elif recipe.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
        cfg["fp16"] = {"enabled": False}
    else:
        cfg["bf16"] = {"enabled": False}
        cfg["fp16"] = {"enabled": False}
    clip = recipe.clipping
    if clip.method == "norm":
        cfg["gradient_clipping"] = clip.max_norm
    elif clip.method == "none":
        cfg["gradient_clipping"] = 0.0
    else:
        cap = clip.max_norm if clip.method == "zclip" and clip.max_norm else 1.0
        cfg["gradient_clipping"] = cap
        notes.append(
            f"FALLBACK: clipping.method {clip.method!r} is adaptive, but DeepSpeed clips inside engine.step() with a "
            f"value fixed at init; using a fixed gradient_clipping of {cap:g} under DeepSpeed "
            "(set clipping.method: norm to choose it, or use ddp/fsdp2 for adaptive clipping)"
        )
    return cfg, notes
