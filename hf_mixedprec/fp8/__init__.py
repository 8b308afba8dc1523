"""FP8 backends behind one ``convert(model, recipe) -> ConversionReport``.

The layers converted are the GEMM layers: ``nn.Linear`` and transformers' ``Conv1D`` (GPT-2). The emulated
backend converts both; torchao and Transformer Engine convert only ``nn.Linear``, so under them a ``Conv1D``
stays in high precision with that reason in the report and a note. A recipe that converts no GEMM layer, or under
half of them, is flagged in the report (``nothing_converted``, ``under_half_converted``) and its summary.

Backends: ``emulated`` (any device, exact numerics, GEMMs in float32), ``torchao`` (torchao float8 training;
``emulate=True`` off-GPU) and ``transformer_engine`` (TE Linears + TE's autocast; imported lazily).
``fp8.backend: auto`` takes Transformer Engine on CUDA, else torchao for current scaling, and otherwise
refuses with a message that says what to install or set; every choice it makes is written in the report.
"""

from __future__ import annotations

import importlib.util
import logging
import warnings
import zlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from hf_mixedprec.fp8.conversion import ConversionReport
from hf_mixedprec.fp8.emulated import EmulatedFP8Conv1D, EmulatedFP8GEMM, EmulatedFP8Linear, EmulationSpec
from hf_mixedprec.fp8.layers import FP8Layer, fp8_layers, fp8_step, invalidate_layer_cache, model_parameters
from hf_mixedprec.fp8.policy import (
    BACKEND_GEMM_KINDS,
    EXPERTS_KIND,
    GEMM_KINDS,
    LayerDecision,
    gemm_work,
    plan_conversion,
)
from hf_mixedprec.fp8.probe import probe_of
from hf_mixedprec.fp8.swap import replace_module
from hf_mixedprec.recipes.hardware import fp8_backend_for
from hf_mixedprec.recipes.schema import CurrentFP8Config, RecipeSpec

__all__ = [
    "ConversionReport",
    "EmulatedFP8Conv1D",
    "EmulatedFP8GEMM",
    "EmulatedFP8Linear",
    "FP8BackendUnavailable",
    "FP8Layer",
    "LayerDecision",
    "conversion_backend",
    "convert",
    "converted_types",
    "emulated_layers",
    "fp8_layers",
    "fp8_step",
    "invalidate_layer_cache",
    "iter_emulated",
    "iter_monitored",
    "model_parameters",
    "monitored_layers",
    "plan_conversion",
    "replace_module",
    "resolve_backend",
    "to_high_precision",
]

log = logging.getLogger("hf_mixedprec")

BACKENDS = ("emulated", "native", "torchao", "transformer_engine")


class FP8BackendUnavailable(RuntimeError):
    """No backend can run this recipe's FP8 scaling here; the message says what to install or set."""


# -- the FP8-layer listers before fp8_layers replaced them: kept, warning, so code written against them still runs ------
def _renamed(old: str, new: str) -> None:
    warnings.warn(f"hf_mixedprec.fp8.{old} is deprecated: use hf_mixedprec.fp8.{new}", DeprecationWarning, stacklevel=3)


def iter_monitored(model: nn.Module) -> Iterator[tuple[str, FP8Layer]]:
    """Deprecated: ``fp8_layers(model, fresh=True)``."""
    _renamed("iter_monitored(model)", "fp8_layers(model, fresh=True)")
    return iter(fp8_layers(model, fresh=True))


def monitored_layers(model: nn.Module) -> list[tuple[str, FP8Layer]]:
    """Deprecated: ``fp8_layers(model)``."""
    _renamed("monitored_layers(model)", "fp8_layers(model)")
    return fp8_layers(model)


def iter_emulated(model: nn.Module) -> Iterator[tuple[str, EmulatedFP8GEMM]]:
    """Deprecated: ``fp8_layers(model, emulated_only=True, fresh=True)``."""
    _renamed("iter_emulated(model)", "fp8_layers(model, emulated_only=True, fresh=True)")
    return iter(fp8_layers(model, emulated_only=True, fresh=True))


def emulated_layers(model: nn.Module) -> list[tuple[str, EmulatedFP8GEMM]]:
    """Deprecated: ``fp8_layers(model, emulated_only=True)``."""
    _renamed("emulated_layers(model)", "fp8_layers(model, emulated_only=True)")
    return fp8_layers(model, emulated_only=True)


def to_high_precision(layer: nn.Module) -> nn.Module | None:
    """``layer``'s high-precision equivalent (``nn.Linear`` or ``Conv1D``, the same Parameter objects) when it is an
    FP8 layer of any backend, else None. The caller swaps it in, so the per-model layer lists are forgotten."""
    invalidate_layer_cache()
    if isinstance(layer, EmulatedFP8GEMM):
        return layer.high_precision()
    p = probe_of(layer)
    return None if p is None else p.high_precision()


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def resolve_backend(recipe: RecipeSpec, device: torch.device) -> tuple[str, list[str]]:
    """The concrete backend for ``recipe.fp8.backend`` on ``device``, and notes on the choice
    (:func:`hf_mixedprec.recipes.hardware.fp8_backend_for`, with this machine's installs and torch's FP8 GEMM probed)."""
    assert recipe.fp8 is not None
    choice = recipe.fp8.backend
    if choice != "auto":
        return choice, []
    from hf_mixedprec.fp8 import native

    cuda = device.type == "cuda"
    backend, note = fp8_backend_for(
        choice,
        recipe.fp8.scaling,
        device_type=device.type,
        te=_has("transformer_engine"),
        torchao=_has("torchao"),
        native=native.native_available(device) if cuda else (False, "not a CUDA GPU"),
    )
    if backend is None:
        raise FP8BackendUnavailable(note)
    return backend, [note]


def converted_types() -> tuple[type, ...]:
    """The module classes that are FP8 layers already (emulated, and torchao's ``Float8Linear`` when installed)."""
    found: tuple[type, ...] = (EmulatedFP8GEMM,)
    if _has("torchao"):
        try:
            from torchao.float8.float8_linear import Float8Linear

            found += (Float8Linear,)
        except ImportError:  # pragma: no cover - torchao layout changed
            pass
    return found


def conversion_backend(recipe: RecipeSpec, model: nn.Module, *, rehearse: bool) -> tuple[str, list[str]]:
    """The backend a run converts ``model`` with, and notes: the emulated one when rehearsing (except torchao, which
    emulates itself off FP8 hardware, and native where torch's FP8 GEMM runs, e.g. on a CPU), else
    :func:`resolve_backend` on the model's device."""
    assert recipe.fp8 is not None
    if rehearse and recipe.fp8.backend == "native":
        from hf_mixedprec.fp8.native import native_available

        runs, why = native_available(_model_device(model))
        if runs:
            return "native", []
        return "emulated", [f"fp8.backend native does not run here ({why}): rehearsing with the emulated layers"]
    if rehearse and recipe.fp8.backend != "torchao":
        return "emulated", []
    return resolve_backend(recipe, _model_device(model))


def _model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _unsupported_kind_notes(decisions: list[LayerDecision], backend: str) -> list[str]:
    """One note per GEMM kind the backend left in high precision because it cannot convert that kind."""
    notes = []
    for kind in GEMM_KINDS:
        if kind in BACKEND_GEMM_KINDS[backend]:
            continue
        names = [d.name for d in decisions if d.kind == kind and d.reason.startswith(f"{kind}: backend ")]
        if names:
            notes.append(
                f"backend {backend} converts only nn.Linear: {len(names)} {kind} layers stay in high precision "
                f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}); fp8.backend: emulated converts them "
                "(exact FP8 numerics, no speed-up)"
            )
    return notes


def _convert_experts(model: nn.Module, recipe: RecipeSpec, backend: str, names: list[str]) -> list[str]:
    """Run the experts modules ``names`` in FP8 with the backend's numerics: the emulated layers' spec, or torchao's
    ``torchao_recipe`` per expert; return the report's notes."""
    from hf_mixedprec.fp8.experts import ExpertsFP8, convert_experts

    fp8 = recipe.fp8
    if backend != "torchao":
        assert fp8 is not None
        convert_experts(model, names, ExpertsFP8.from_spec(EmulationSpec.from_config(fp8)))
        return []
    assert isinstance(fp8, CurrentFP8Config)
    convert_experts(model, names, ExpertsFP8.for_torchao(fp8))
    return [
        f"{len(names)} MoE experts modules run torchao's {fp8.torchao_recipe or 'tensorwise'} FP8 numerics per expert "
        "through hf_mixedprec's emulated grouped GEMMs (exact casts, float32 GEMMs)"
    ]


def convert(
    model: nn.Module,
    recipe: RecipeSpec,
    *,
    backend: str | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    decisions: Iterable[LayerDecision] | None = None,
) -> ConversionReport:
    """Convert ``model``'s GEMM layers (Linear, Conv1D) to FP8 in place as ``recipe`` says; return what was done
    and why.

    ``backend`` overrides ``recipe.fp8.backend`` (e.g. ``"emulated"`` to rehearse). Layers the recipe keeps in
    high precision are left untouched; nothing stops at the first layer that cannot be converted. ``decisions``:
    the FP8 decisions of the run's precision plan (:mod:`hf_mixedprec.precision.plan`), made for this backend; without them
    they are made here by the same policy.
    """
    if recipe.precision != "fp8" or recipe.fp8 is None:
        raise ValueError(f"recipe {recipe.name!r} has precision {recipe.precision!r}: nothing to convert to FP8")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r} is not allowed (allowed: {', '.join(BACKENDS)})")
    notes: list[str] = []
    if backend is None:
        backend, notes = resolve_backend(recipe, _model_device(model))
    if decisions is None:
        decisions = plan_conversion(
            model, recipe.fp8, converted_types=converted_types(), backend=backend, rules=recipe.modules
        )
    decisions = list(decisions)
    notes += _unsupported_kind_notes(decisions, backend)
    experts = [d.name for d in decisions if d.to_swap and d.kind == EXPERTS_KIND]  # planned on EXPERTS_BACKENDS only
    if backend == "emulated":
        spec = EmulationSpec.from_config(recipe.fp8)
        for d in decisions:
            if d.to_swap and d.kind != EXPERTS_KIND:
                cls = EmulatedFP8Conv1D if d.kind == "Conv1D" else EmulatedFP8Linear
                layer = cls(model.get_submodule(d.name), spec)
                layer.sr_stream = zlib.crc32(d.name.encode())  # the same draws in every process and after a resume
                replace_module(model, d.name, layer)
    elif backend == "native":
        from hf_mixedprec.fp8.native import native_available, native_layer

        runs, why = native_available(_model_device(model))
        if not runs:
            raise FP8BackendUnavailable(
                f"fp8.backend native cannot run here: {why}; use fp8.backend emulated (the same quantization with "
                "float32 GEMMs, anywhere) or run on a GPU with FP8 tensor cores"
            )
        spec = EmulationSpec.from_config(recipe.fp8)
        for d in decisions:
            if d.to_swap:
                replace_module(model, d.name, native_layer(d.kind, model.get_submodule(d.name), spec))
    elif backend == "torchao":
        from hf_mixedprec.fp8.torchao_backend import convert_torchao

        notes += convert_torchao(model, recipe, [d for d in decisions if d.kind != EXPERTS_KIND])
    else:
        from hf_mixedprec.fp8.transformer_engine import convert_te

        notes += convert_te(model, recipe, decisions, optimizer)
    if experts:
        notes += _convert_experts(model, recipe, backend, experts)
    invalidate_layer_cache()  # FP8 layers were swapped in: per-model layer lists are collected anew
    work = gemm_work(model, decisions)
    report = ConversionReport(backend, recipe.fp8.scaling, recipe.fp8.format, decisions, notes, work)
    for n in notes:
        log.warning("hf_mixedprec: %s", n)
    return report
