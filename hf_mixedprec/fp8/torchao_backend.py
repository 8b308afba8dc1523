"""torchao backend: torchao float8 training (tensorwise, rowwise, rowwise_with_gw_hp) with our layer filter.

torchao's tensorwise recipe is current scaling: scale = fp8_max / clamp(amax, 1e-12), E4M3 for inputs and
weights, E5M2 for gradients (HYBRID). Its rowwise recipes use E4M3 everywhere with power-of-2 scales; the
recipe must say so (``format: E4M3``, ``power_2_scales: true``) rather than be silently overridden.
Off CUDA (or below compute capability 8.9) torchao runs with ``emulate=True``, which keeps its exact
casting numerics but does the GEMM in high precision. torchao keeps the original Parameter objects, so an
optimizer built before conversion stays valid.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import nn

from hf_mixedprec.core._device import has_fp8_tensor_cores
from hf_mixedprec.core._private import fsdp2_retarget
from hf_mixedprec.fp8.policy import LayerDecision
from hf_mixedprec.fp8.probe import QuantizeRule, attach_probe
from hf_mixedprec.fp8.swap import linear_holding
from hf_mixedprec.recipes.schema import TORCHAO_AMAX_EPS, CurrentFP8Config, RecipeSpec
from hf_mixedprec.scaling.fp8 import FP8Format

__all__ = ["TORCHAO_INSTALL_HINT", "convert_torchao", "precompute_fsdp_scales", "torchao_config"]

log = logging.getLogger("hf_mixedprec")

TORCHAO_INSTALL_HINT = "torchao is not installed: pip install 'hf_mixedprec[torchao]'"


def torchao_config(recipe: RecipeSpec, *, emulate: bool) -> Any:
    """Build torchao's ``Float8LinearConfig`` for ``recipe``.

    The schema refuses what torchao cannot express (see ``hf_mixedprec.recipes.kinds._torchao_rules``); this
    repeats the checks for recipes that reach torchao through ``backend: auto``. ``format: E4M3`` with the
    tensorwise recipe sets both grad-output casts (the dgrad and the wgrad GEMM) to E4M3: torchao refuses a config
    whose two grad-output casts differ in dtype.
    """
    try:
        from torchao.float8 import Float8LinearConfig
    except ImportError as exc:
        raise ImportError(TORCHAO_INSTALL_HINT) from exc
    fp8 = recipe.fp8
    assert fp8 is not None
    if not isinstance(fp8, CurrentFP8Config):  # the one kind with torchao's options
        raise ValueError(
            f"fp8.scaling: {fp8.scaling!r} is not available with backend torchao (allowed: current; use "
            "backend transformer_engine or emulated for delayed, mxfp8 and blockwise)"
        )
    name = fp8.torchao_recipe or "tensorwise"
    cfg = Float8LinearConfig.from_recipe_name(name)
    if fp8.epsilon not in (None, 0.0, TORCHAO_AMAX_EPS):
        raise ValueError(
            f"fp8.epsilon: {fp8.epsilon:g} cannot be set with backend torchao, which always clamps amax at 1e-12 "
            "(allowed: 1e-12 or 0; or backend emulated)"
        )
    if name == "tensorwise":
        if fp8.format == "E4M3":
            cfg = dataclasses.replace(
                cfg,
                cast_config_grad_output=_with_dtype(cfg.cast_config_grad_output, torch.float8_e4m3fn),
                cast_config_grad_output_for_grad_weight=_with_dtype(
                    cfg.cast_config_grad_output_for_grad_weight, torch.float8_e4m3fn
                ),
            )
        cfg = dataclasses.replace(cfg, round_scales_to_power_of_2=bool(fp8.power_2_scales))
    else:
        if fp8.format != "E4M3":
            raise ValueError(
                f"fp8.format: {fp8.format!r} does not match torchao's {name} recipe, which uses E4M3 for every "
                f"tensor (allowed: E4M3 with torchao_recipe {name})"
            )
        if not fp8.power_2_scales:
            raise ValueError(
                f"fp8.power_2_scales: false does not match torchao's {name} recipe, which rounds scales to powers "
                f"of two (allowed: true with torchao_recipe {name})"
            )
    # FSDP2 all-gathers the weights of the converted layers in FP8 (torchao/float8/fsdp_utils.py); the schema
    # allows it with tensorwise only
    all_gather = recipe.distributed.fp8_all_gather
    return dataclasses.replace(cfg, emulate=emulate, enable_fsdp_float8_all_gather=all_gather)


def _with_dtype(cast: Any, dtype: torch.dtype) -> Any:
    return dataclasses.replace(cast, target_dtype=dtype)


def convert_torchao(model: nn.Module, recipe: RecipeSpec, decisions: list[LayerDecision]) -> list[str]:
    """Convert the planned Linears with torchao; return notes for the report."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as exc:
        raise ImportError(TORCHAO_INSTALL_HINT) from exc
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    emulate = not has_fp8_tensor_cores(device)  # torchao emulates its FP8 GEMMs there (emulate=True)
    notes = []
    if emulate:
        notes.append(
            f"torchao runs with emulate=True on {device.type} (exact FP8 casts, high-precision GEMMs: no speed-up)"
        )
    cfg = torchao_config(recipe, emulate=emulate)
    assert recipe.fp8 is not None
    if recipe.distributed.fp8_all_gather:
        notes.append(
            "FP8 all-gather: FSDP2 gathers these layers' weights already in FP8, so their health statistics cover "
            "inputs and gradients (the weights' are not sampled)"
        )
    if recipe.fp8.options().get("epsilon") in (None, 0.0):
        notes.append("torchao clamps every amax at 1e-12 before scaling (the recipe's fp8.epsilon is 0)")
    wanted = {d.name for d in decisions if d.to_swap}
    before = {name: model.get_submodule(name) for name in wanted}
    convert_to_float8_training(model, config=cfg, module_filter_fn=lambda mod, fqn: fqn in wanted)
    for name, old in before.items():  # torchao swaps with its own setattr: an FSDP2 unit must follow (phases)
        fsdp2_retarget(model, name, old, model.get_submodule(name))
    rule, formats = _quantize_rule(cfg)
    for name in wanted:
        layer = model.get_submodule(name)
        layer.register_forward_pre_hook(_autocast_input)
        attach_probe(layer, rule, formats, lambda lay: linear_holding(lay.weight, lay.bias))
    return notes


def _quantize_rule(cfg: Any) -> tuple[QuantizeRule, dict[str, FP8Format]]:
    """How torchao quantizes each operand of the fprop and dgrad GEMMs under ``cfg``, for the health probe: its
    own ``tensor_to_scale`` (amax clamped at 1e-12, scale computed in float64, optional power-of-2 rounding) and
    ``to_fp8_saturated``, per tensor or per row along the GEMM's contraction dim (``torchao/float8/float8_linear.py``:
    input and grad_output along their last dim, the weight per output row)."""
    from torchao.float8.config import ScalingGranularity, ScalingType
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    casts = {"input": cfg.cast_config_input, "weight": cfg.cast_config_weight, "grad": cfg.cast_config_grad_output}
    pow2 = bool(cfg.round_scales_to_power_of_2)

    def rule(t: torch.Tensor, role: str, src_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        c = casts[role]
        if c.scaling_type is ScalingType.DISABLED:
            return None
        axiswise = c.scaling_granularity is ScalingGranularity.AXISWISE
        scale = tensor_to_scale(
            t,
            c.target_dtype,
            scaling_granularity=c.scaling_granularity,
            axiswise_dim=-1 if axiswise else None,
            round_scales_to_power_of_2=pow2,
        )
        data = to_fp8_saturated(t * scale, c.target_dtype)
        return data, data.to(torch.float32) / scale

    formats: dict[str, FP8Format] = {  # a role torchao keeps in high precision has nothing to measure
        role: "e4m3" if c.target_dtype == torch.float8_e4m3fn else "e5m2"
        for role, c in casts.items()
        if c.scaling_type is not ScalingType.DISABLED
    }
    return rule, formats


def _autocast_input(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Cast the input to its device's autocast dtype, as ``Float8Linear.forward`` does itself, but for CUDA's only:
    off CUDA, a CPU autocast run would hand its high-precision GEMMs a float32 input and a bfloat16 gradient, which
    ``rowwise_with_gw_hp``'s wgrad GEMM refuses. On CUDA it is the cast torchao then makes a no-op. Either way the
    layer's health probe (a forward hook) sees the input as torchao quantizes it."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return None
    if not torch.is_autocast_enabled(x.device.type):
        return None
    dtype = torch.get_autocast_dtype(x.device.type)
    return None if x.dtype == dtype else (x.to(dtype), *args[1:])


def precompute_fsdp_scales(model: nn.Module) -> None:
    """After an optimizer step under ``distributed.fp8_all_gather``: the FP8 scales of every sharded torchao weight
    for the next all-gather, from one all-reduce of their amaxes (torchao's
    ``precompute_float8_dynamic_scale_for_fsdp``; without it each layer's all-gather reduces its own amax).
    Weights that are not sharded are left alone, so one process runs it as a no-op."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
