"""FP8 backends behind one ``convert(model, recipe) -> ConversionReport``.

Backends: ``emulated`` (any device, exact numerics, GEMMs in float32), ``torchao`` (torchao float8 training;
``emulate=True`` off-GPU) and ``transformer_engine`` (TE Linears + TE's autocast; imported lazily).
``fp8.backend: auto`` takes Transformer Engine on CUDA, else torchao for current scaling, and otherwise
refuses with a message that says what to install or set; every choice it makes is written in the report.
"""

from __future__ import annotations

import importlib.util
import logging

import torch
from torch import nn

from hf_mixedprec.fp8.conversion import ConversionReport
from hf_mixedprec.fp8.emulated import EmulatedFP8Linear, EmulationSpec, fp8_step, iter_emulated
from hf_mixedprec.fp8.policy import LayerDecision, plan_conversion
from hf_mixedprec.fp8.swap import replace_module
from hf_mixedprec.schema import RecipeSpec

__all__ = [
    "ConversionReport",
    "EmulatedFP8Linear",
    "FP8BackendUnavailable",
    "LayerDecision",
    "convert",
    "fp8_step",
    "iter_emulated",
    "plan_conversion",
    "replace_module",
    "resolve_backend",
]

log = logging.getLogger("hf_mixedprec")

BACKENDS = ("emulated", "torchao", "transformer_engine")


class FP8BackendUnavailable(RuntimeError):
    """No backend can run this recipe's FP8 scaling here; the message says what to install or set."""


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def resolve_backend(recipe: RecipeSpec, device: torch.device) -> tuple[str, list[str]]:
    """The concrete backend for ``recipe.fp8.backend`` on ``device``, and notes on the choice."""
    assert recipe.fp8 is not None
    choice = recipe.fp8.backend
    if choice != "auto":
        return choice, []
    scaling = recipe.fp8.scaling
    if device.type == "cuda" and _has("transformer_engine"):
        return "transformer_engine", ["fp8.backend auto -> transformer_engine"]
    if device.type == "cuda" and scaling == "current" and _has("torchao"):
        return "torchao", ["fp8.backend auto -> torchao tensorwise (Transformer Engine is not installed)"]
    where = "this CUDA GPU" if device.type == "cuda" else f"device {device.type!r}"
    raise FP8BackendUnavailable(
        f"fp8.backend: 'auto' finds no backend that runs scaling {scaling!r} on {where} (Transformer Engine: "
        f"{'installed' if _has('transformer_engine') else 'not installed'}; torchao: "
        f"{'installed' if _has('torchao') else 'not installed'}, current scaling only); install "
        "'hf_mixedprec[transformer-engine]' on a GPU with compute capability >= 8.9, or set fp8.backend: emulated "
        "to run the exact numerics anywhere (slowly)"
    )


def _model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def convert(
    model: nn.Module,
    recipe: RecipeSpec,
    *,
    backend: str | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> ConversionReport:
    """Convert ``model``'s Linears to FP8 in place as ``recipe`` says; return what was done and why.

    ``backend`` overrides ``recipe.fp8.backend`` (e.g. ``"emulated"`` to rehearse). Layers the recipe keeps in
    high precision are left untouched; nothing stops at the first layer that cannot be converted.
    """
    if recipe.precision != "fp8" or recipe.fp8 is None:
        raise ValueError(f"recipe {recipe.name!r} has precision {recipe.precision!r}: nothing to convert to FP8")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r} is not allowed (allowed: {', '.join(BACKENDS)})")
    notes: list[str] = []
    if backend is None:
        backend, notes = resolve_backend(recipe, _model_device(model))
    converted_types: tuple[type, ...] = (EmulatedFP8Linear,)
    if _has("torchao"):
        try:
            from torchao.float8.float8_linear import Float8Linear

            converted_types += (Float8Linear,)
        except ImportError:  # pragma: no cover - torchao layout changed
            pass
    decisions = plan_conversion(model, recipe.fp8, converted_types=converted_types)
    if backend == "emulated":
        spec = EmulationSpec.from_config(recipe.fp8)
        for d in decisions:
            if d.to_swap:
                replace_module(model, d.name, EmulatedFP8Linear(model.get_submodule(d.name), spec))
    elif backend == "torchao":
        from hf_mixedprec.fp8.torchao_backend import convert_torchao

        notes += convert_torchao(model, recipe, decisions)
    else:
        from hf_mixedprec.fp8.transformer_engine import convert_te

        notes += convert_te(model, recipe, decisions, optimizer)
    report = ConversionReport(backend, recipe.fp8.scaling, recipe.fp8.format, decisions, notes)
    for n in notes:
        log.warning("hf_mixedprec: %s", n)
    return report
