"""Sharding the Trainer callback takes care of: ``distributed.strategy: fsdp2`` on several CPU processes (gloo), where
Accelerate would train as plain data parallel (``accelerate/state.py`` takes its FSDP branch on GPUs only)."""

from __future__ import annotations

from typing import Any

from hf_mixedprec._private import fsdp2_on_cpu, fsdp2_possible_on_cpu
from hf_mixedprec.schema import RecipeSpec

__all__ = ["fsdp2_on_cpu_processes"]


def fsdp2_on_cpu_processes(trainer: Any, recipe: RecipeSpec, rt: Any) -> bool:
    """Switch Accelerate's FSDP2 path on for several CPU processes (it takes it on GPUs only): for BF16 and FP32
    recipes, whose autocast the runtime installs. FP16's loss scaler (found-inf per rank) and FP8's scaling state are
    not reduced over shards yet: such a recipe trains as plain data parallel, said as a fallback. Under FSDP
    Accelerate leaves precision to an FSDP mixed-precision policy and autocasts nothing; the FSDP2 switched on here has
    none (parameters and the gradient reduction stay float32), so the runtime installs the recipe's autocast."""
    if recipe.distributed.strategy != "fsdp2" or not fsdp2_possible_on_cpu(trainer):
        return False
    precisions = recipe.precisions()
    if not set(precisions) <= {"bf16", "fp32"}:
        rt.note(
            f"FALLBACK: FSDP2 on CPU processes runs BF16 and FP32 recipes only (FP16's loss scaler and FP8's scaling "
            f"state are not yet reduced over shards); this {'->'.join(precisions)} recipe trains as plain data "
            "parallel (no sharding)"
        )
        return False
    fsdp2_on_cpu(trainer)
    rt.note(
        f"FSDP2 on {trainer.accelerator.num_processes} CPU processes (gloo): Accelerate shards only on GPUs by itself, "
        "so its FSDP2 path was switched on here (decoder layers and the root sharded, sharded checkpoints, gradients "
        "reduced in float32)"
    )
    return True
