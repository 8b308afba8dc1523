"""Transformer Engine backend: recipe -> TE recipe object, Linear swap, and the autocast around forward.

Transformer Engine is imported lazily (only inside :func:`build_te_recipe` and :func:`convert_te`), so the
rest of the package, :func:`te_recipe_spec` and :func:`accelerate_fp8_config` work without it. The spec
targets the TE 2.x recipe classes of ``transformer_engine/common/recipe/__init__.py``:

- ``DelayedScaling(margin, fp8_format, amax_history_len, amax_compute_algo, reduce_amax, ...)``
- ``Float8CurrentScaling(fp8_format, use_power_2_scales, ...)``: TE never forwards an amax epsilon, so a
  recipe with ``fp8.epsilon > 0`` is refused here rather than silently ignored.
- ``MXFP8BlockScaling(fp8_format, margin, ...)``: TE and the hardware use the RCEIL rule only.
- ``Float8BlockScaling(fp8_format, use_f32_scales, x_block_scaling_dim=1, w_block_scaling_dim=2,
  grad_block_scaling_dim=1)``: 1x128 tiles for activations and gradients, 128x128 blocks for weights.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
from torch import nn

from hf_mixedprec.core._device import wrap_forward
from hf_mixedprec.core.formats import E2M1
from hf_mixedprec.fp8.policy import LayerDecision
from hf_mixedprec.fp8.probe import QuantizeRule, attach_probe
from hf_mixedprec.fp8.swap import linear_holding, replace_module
from hf_mixedprec.recipes.schema import RecipeSpec
from hf_mixedprec.scaling import (
    current_scale,
    dequantize_blockwise,
    dequantize_fp8,
    dequantize_mxfp8,
    quantize_blockwise,
    quantize_fp8,
    quantize_mxfp8,
    tensor_amax,
)
from hf_mixedprec.scaling.fp8 import FP8Format
from hf_mixedprec.scaling.nvfp4 import NVFP4_BLOCK, e2m1_values, nvfp4_quantize

__all__ = [
    "TE_INSTALL_HINT",
    "accelerate_fp8_config",
    "build_te_recipe",
    "convert_te",
    "te_probe_formats",
    "te_quantize_rule",
    "te_recipe_spec",
]

log = logging.getLogger("hf_mixedprec")

TE_INSTALL_HINT = (
    "Transformer Engine is not installed: pip install 'hf_mixedprec[transformer-engine]' on a CUDA machine "
    "(compute capability >= 8.9), or set fp8.backend: emulated to rehearse the recipe anywhere"
)


def te_recipe_spec(recipe: RecipeSpec) -> tuple[str, dict[str, Any]]:
    """The TE recipe class name and its keyword arguments for ``recipe`` (pure; needs no TE).

    ``fp8_format`` is given by name ("HYBRID" or "E4M3"); :func:`build_te_recipe` turns it into TE's
    ``Format`` enum.
    """
    if recipe.precision != "fp8" or recipe.fp8 is None:
        raise ValueError(f"recipe {recipe.name!r} has precision {recipe.precision}, not fp8: no TE recipe")
    fp8 = recipe.fp8
    fmt = fp8.format
    if fp8.scaling == "delayed":
        return "DelayedScaling", {
            "margin": fp8.margin,
            "fp8_format": fmt,
            "amax_history_len": fp8.amax_history_len,
            "amax_compute_algo": fp8.amax_compute_algo,
            "reduce_amax": True,
            "fp8_dpa": False,
            "fp8_mha": False,
        }
    if fp8.scaling == "current":
        if fp8.epsilon:
            raise ValueError(
                f"fp8.epsilon: {fp8.epsilon:g} has no effect with backend transformer_engine (Float8CurrentScaling "
                "never forwards an amax epsilon to its quantizers) (allowed: 0.0, or backend torchao/emulated)"
            )
        return "Float8CurrentScaling", {
            "fp8_format": fmt,
            "use_power_2_scales": bool(fp8.power_2_scales),
            "fp8_dpa": False,
            "fp8_mha": False,
        }
    if fp8.scaling == "mxfp8":
        if fp8.mx_rounding != "rceil":
            raise ValueError(
                f"fp8.mx_rounding: {fp8.mx_rounding!r} is not what Transformer Engine does (allowed: rceil with "
                "backend transformer_engine; use backend emulated to study the OCP floor rule)"
            )
        return "MXFP8BlockScaling", {"fp8_format": fmt, "margin": fp8.margin, "fp8_dpa": False, "fp8_mha": False}
    if fp8.scaling == "blockwise":
        return "Float8BlockScaling", {
            "fp8_format": fmt,
            "use_f32_scales": not fp8.power_2_scales,
            "x_block_scaling_dim": 1,
            "w_block_scaling_dim": 2,
            "grad_block_scaling_dim": 1,
        }
    if fp8.scaling == "nvfp4":
        if fp8.rht_signs is not None:
            raise ValueError(
                "fp8.rht_signs: Transformer Engine applies its own fixed sign vector (get_wgrad_sign_vector) "
                "(allowed: null with backend transformer_engine; use backend emulated to study other signs)"
            )
        # TE's NVFP4BlockScaling (transformer_engine/common/recipe/__init__.py): the published recipe's techniques,
        # each on unless disabled; its values are E2M1 and its block scales E4M3, neither a choice
        return "NVFP4BlockScaling", {
            "disable_rht": not fp8.rht,
            "disable_stochastic_rounding": not fp8.stochastic_rounding,
            "disable_2d_quantization": not fp8.weight_2d,
            "fp8_dpa": False,
            "fp8_mha": False,
        }
    raise ValueError(f"fp8.scaling: {fp8.scaling!r} has no Transformer Engine recipe")


def accelerate_fp8_config(recipe: RecipeSpec) -> dict[str, Any] | None:
    """The ``fp8_config`` of an ``accelerate launch`` config for ``recipe``, from :func:`te_recipe_spec`.

    Its keys are those Accelerate's launcher exports as ``ACCELERATE_FP8_*`` for ``TERecipeKwargs``, which
    builds only ``DelayedScaling`` and ``MXFP8BlockScaling`` (Accelerate 1.15); ``None`` for other classes.
    """
    cls_name, kwargs = te_recipe_spec(recipe)
    if "fp8_format" not in kwargs:  # NVFP4BlockScaling: Accelerate's TERecipeKwargs cannot build it
        return None
    cfg: dict[str, Any] = {"backend": "TE", "fp8_format": kwargs["fp8_format"], "use_autocast_during_eval": False}
    if cls_name == "DelayedScaling":
        cfg.update({k: kwargs[k] for k in ("amax_history_len", "amax_compute_algo", "margin")})
    elif cls_name == "MXFP8BlockScaling":
        cfg.update(margin=kwargs["margin"], use_mxfp8_block_scaling=True)
    else:
        return None
    return cfg


def _import_te() -> Any:
    try:
        import transformer_engine.common.recipe as te_recipe
        import transformer_engine.pytorch as te
    except ImportError as exc:
        raise ImportError(TE_INSTALL_HINT) from exc
    return te, te_recipe


def build_te_recipe(recipe: RecipeSpec) -> Any:
    """Instantiate the TE recipe object for ``recipe`` (imports Transformer Engine).

    In TE 2.x, ``Float8CurrentScaling`` and ``Float8BlockScaling`` derive their per-tensor ``QParams``
    (``fp8_quant_fwd_inp`` / ``_fwd_weight`` / ``_bwd_grad``) from environment variables when the class is
    defined, so the constructor's ``use_power_2_scales`` / ``use_f32_scales`` alone do not reach the
    quantizers. Where the recipe has ``QParams``, they are set explicitly from the recipe.
    """
    _, te_recipe = _import_te()
    cls_name, kwargs = te_recipe_spec(recipe)
    kwargs = dict(kwargs)
    if "fp8_format" in kwargs:
        kwargs["fp8_format"] = getattr(te_recipe.Format, kwargs["fp8_format"])
    cls = getattr(te_recipe, cls_name, None)
    if cls is None:  # NVFP4BlockScaling came with TE 2.9, Float8BlockScaling with 2.3; check_recipe refuses it first
        raise ValueError(
            f"fp8.scaling {recipe.fp8.scaling if recipe.fp8 else None!r}: this Transformer Engine has no "
            f"{cls_name} (pip install -U transformer-engine)"
        )
    rec = cls(**kwargs)
    qparams = getattr(te_recipe, "QParams", None)
    if qparams is not None and cls_name in ("Float8CurrentScaling", "Float8BlockScaling"):
        assert recipe.fp8 is not None
        q = qparams(power_2_scale=bool(recipe.fp8.power_2_scales), amax_epsilon=0.0)
        for attr in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
            if hasattr(rec, attr):
                setattr(rec, attr, q)
    return rec


def _te_autocast(te: Any, te_rec: Any) -> Any:
    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=te_rec)
    return te.fp8_autocast(enabled=True, fp8_recipe=te_rec)  # TE < 2.8 spelling


def refuse_sharded(model: nn.Module) -> None:
    """Refuse to swap TE layers into a model FSDP2 has already sharded (a phase boundary under ``fsdp2``): a TE layer
    owns new parameters, which the FSDP2 unit and the sharded optimizer have never seen."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise RuntimeError(
            "fp8.backend transformer_engine cannot convert a model FSDP2 has already sharded (its layers own new "
            "parameters, which the sharded optimizer has never seen): a phase entering FP8 under distributed.strategy "
            "fsdp2 needs fp8.backend torchao, native or emulated (layers that keep the same parameters)"
        )


def convert_te(
    model: nn.Module, recipe: RecipeSpec, decisions: list[LayerDecision], optimizer: torch.optim.Optimizer | None = None
) -> list[str]:
    """Swap the planned Linears for ``te.Linear`` (weights copied), wrap ``forward`` in TE's autocast.

    TE Linears own new parameters, so parameter identity is not kept; pass ``optimizer`` to have its
    parameter groups pointed at the new parameters. Returns notes for the report.
    """
    refuse_sharded(model)
    te, _ = _import_te()
    te_rec = build_te_recipe(recipe)
    notes: list[str] = []
    mapping: dict[int, nn.Parameter] = {}
    for d in decisions:
        if not d.to_swap:
            continue
        old = model.get_submodule(d.name)
        assert isinstance(old, nn.Linear)
        new = te.Linear(
            old.in_features,
            old.out_features,
            bias=old.bias is not None,
            params_dtype=old.weight.dtype,
            device=old.weight.device,
        )
        with torch.no_grad():
            new.weight.copy_(old.weight)
            if old.bias is not None:
                new.bias.copy_(old.bias)
        new.weight.requires_grad_(old.weight.requires_grad)
        mapping[id(old.weight)] = new.weight
        if old.bias is not None:
            mapping[id(old.bias)] = new.bias
        replace_module(model, d.name, new)
        attach_probe(new, te_quantize_rule(recipe, _delayed_scale_of(new)), te_probe_formats(recipe), _te_as_linear)
    if optimizer is not None:
        for group in optimizer.param_groups:
            group["params"] = [mapping.get(id(p), p) for p in group["params"]]
    else:
        notes.append("transformer_engine creates new parameters: build the optimizer after convert()")
    wrap_forward(model, lambda: _te_autocast(te, te_rec))
    return notes


def te_probe_formats(recipe: RecipeSpec) -> dict[str, FP8Format]:
    """The FP8 format of each operand under TE's ``Format``: HYBRID is E4M3 forward and E5M2 for gradients."""
    assert recipe.fp8 is not None
    if recipe.fp8.scaling == "nvfp4":
        return {"input": E2M1, "weight": E2M1, "grad": E2M1}  # type: ignore[dict-item]
    grad: FP8Format = "e5m2" if recipe.fp8.format == "HYBRID" else "e4m3"
    return {"input": "e4m3", "weight": "e4m3", "grad": grad}


def te_quantize_rule(recipe: RecipeSpec, delayed_scale: Any = None) -> QuantizeRule:
    """How a TE module quantizes each operand under ``recipe``, for the health probe (pure; needs no TE):

    * delayed: with the scale TE holds for that operand (``delayed_scale(role)``, read from the module's
      ``fp8_meta``; None before TE has made one, and nothing is measured);
    * current: ``compute_scale_from_amax`` with epsilon 0 (TE forwards none) and the recipe's power-of-2 setting;
    * mxfp8: 32-element E8M0 blocks along the last dim, RCEIL (the only rule TE and the hardware use);
    * blockwise: 1x128 tiles for input and gradient, 128x128 blocks for the weight, the overflow value of the
      operand's own type (``transformer_engine/common/recipe/recipe_common.cuh``);
    * nvfp4: 1x16 E4M3 blocks along the last dim under the tensor's FP32 scale, 16x16 for the weight with
      ``weight_2d`` (``reference_nvfp4.py``); the probe rounds the gradient to nearest, where TE's backward rounds it
      stochastically, so its gradient statistics are those of the expected value.
    """
    fp8 = recipe.fp8
    assert fp8 is not None
    formats = te_probe_formats(recipe)

    def rule(t: torch.Tensor, role: str, src_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        fmt = formats[role]
        if fp8.scaling in ("delayed", "current"):
            if fp8.scaling == "delayed":
                scale = None if delayed_scale is None else delayed_scale(role)
                if scale is None:
                    return None
            else:
                scale = current_scale(tensor_amax(t), fmt=fmt, power_2=bool(fp8.power_2_scales))
            data = quantize_fp8(t, scale, fmt)
            return data, dequantize_fp8(data, scale)
        if fp8.scaling == "nvfp4":
            tile = (NVFP4_BLOCK, NVFP4_BLOCK) if role == "weight" and fp8.weight_2d else (1, NVFP4_BLOCK)
            if t.dim() != 2 or t.shape[0] % tile[0] or t.shape[1] % tile[1]:
                return None
            q = nvfp4_quantize(t.float(), tile=tile)
            return e2m1_values(q.codes), q.dequantize()
        if fp8.scaling == "mxfp8":
            bs = fp8.block_size or 32
            if t.shape[-1] % bs:
                return None
            data, codes = quantize_mxfp8(t, fmt=fmt, block_size=bs, rounding="rceil", dim=-1)
            return data, dequantize_mxfp8(data, codes, block_size=bs, dim=-1)
        tile = (128, 128) if role == "weight" else (1, 128)
        data, scales = quantize_blockwise(
            t, tile=tile, fmt=fmt, power_2=bool(fp8.power_2_scales), input_dtype=src_dtype
        )
        return data, dequantize_blockwise(data, scales, tile=tile)

    return rule


#: Where TE keeps each operand's delayed-scaling scale: ``fp8_meta[key].scale[index]`` (TE's forward GEMM meta:
#: input 0, weight 1; backward: grad_output 0).
_TE_SCALE_SLOTS = {"input": ("scaling_fwd", 0), "weight": ("scaling_fwd", 1), "grad": ("scaling_bwd", 0)}


def _delayed_scale_of(module: nn.Module) -> Any:
    """``role -> scale`` from the TE module's own delayed-scaling state (None until TE has initialised it)."""
    ref = weakref.ref(module)

    def scale(role: str) -> torch.Tensor | None:
        mod = ref()
        key, index = _TE_SCALE_SLOTS[role]
        meta = getattr(mod, "fp8_meta", None) or {}
        state = meta.get(key)
        tensor = getattr(state, "scale", None)
        if not isinstance(tensor, torch.Tensor) or tensor.numel() <= index:
            return None
        return tensor[index]

    return scale


def _te_as_linear(layer: nn.Module) -> nn.Linear:
    """A plain ``nn.Linear`` holding the TE Linear's Parameter objects (the health fallback to BF16)."""
    bias = getattr(layer, "bias", None)
    return linear_holding(layer.weight, bias if isinstance(bias, torch.Tensor) and bias.numel() > 0 else None)
