"""The measuring half of ``estimate``: one training step on fake tensors and the accounting of what it holds.

:func:`_fake_step` builds the model under ``FakeTensorMode``, prepares it by the recipe's precision plan (storage,
FP8 conversion), runs one forward and backward and, for another optimizer than AdamW, one optimizer step, and
records what it held in a :class:`_Step`: the peak of the tensors autograd saves (:class:`SavedTensorMeter`), the
optimizer state and the FP8 layers' buffers, each storage counted once (:func:`storage_bytes`).

Split out of :mod:`hf_mixedprec.commands.estimate` to keep both modules short: ``estimate`` holds the public API (inputs,
sharding, the results, the GPU fit, the table) and re-exports the public names defined here; see its module docs
for what each component counts.
"""

from __future__ import annotations

import contextlib
import copy
import os
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hf_mixedprec.core._private import fake_tensor_mode, grouped_mm_as_fallback, unset_fake_temporarily
from hf_mixedprec.core._text import root_cause
from hf_mixedprec.core.errors import MixedPrecisionError, UsageError
from hf_mixedprec.integrations.recipe import Recipe
from hf_mixedprec.precision.plan import PrecisionPlan, build_plan
from hf_mixedprec.training.runtime import compute_dtype

__all__ = ["OPTIMIZERS", "EstimateUnsupported", "SavedTensorMeter", "storage_bytes"]

#: ``--optimizer`` -> the ``TrainingArguments.optim`` Trainer builds it from.
OPTIMIZERS: dict[str, str] = {"adamw": "adamw_torch_fused", "sgd": "sgd", "adafactor": "adafactor"}


# -- measuring -----------------------------------------------------------------------------------------------


def _storage_key(t: torch.Tensor) -> int:
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage()).cdata


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view or a repeated tensor counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        seen.setdefault(_storage_key(t), t.untyped_storage().nbytes())
    return sum(seen.values())


class _Held:
    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedTensorMeter:
    """Live and peak bytes of the tensors autograd saves for backward, while the context is active.

    Each storage counts once, however many saved tensors view it; storages in ``exclude`` (the Parameters: they
    are weights, not activations) count zero. A storage stops counting when autograd frees the last saved
    tensor that holds it (after backward has used it).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {_storage_key(t) for t in exclude}
        self._live: dict[int, list[int]] = {}
        self.current = 0
        self.peak = 0

    def _release(self, key: int) -> None:
        entry = self._live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self._live[key]

    def _pack(self, t: torch.Tensor) -> _Held:
        held = _Held(t)
        key = _storage_key(t)
        if key in self._exclude:
            return held
        if key in self._live:
            self._live[key][0] += 1
        else:
            size = t.untyped_storage().nbytes()
            self._live[key] = [1, size]
            self.current += size
            self.peak = max(self.peak, self.current)
        weakref.finalize(held, self._release, key)
        return held

    @staticmethod
    def _unpack(held: _Held) -> torch.Tensor:
        return held.tensor

    @contextlib.contextmanager
    def recording(self) -> Iterator[SavedTensorMeter]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self


# -- the step record -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Settings:
    batch_size: int
    seq_len: int
    gradient_checkpointing: bool
    optimizer: str
    zero: int | None
    num_gpus: int | None
    target: str


@dataclass
class _Step:
    """What one fake training step held (single device, nothing sharded), and the plan it was prepared by.
    ``optimizer`` / ``states``: the measured optimizer state, in all and by state name (only when the plan does not
    give it: an optimizer other than AdamW)."""

    params: int = 0
    plan: PrecisionPlan | None = None
    optimizer: int = 0
    states: dict[str, int] | None = None
    activations: int = 0
    fp8_extras: int = 0
    fp8_layers: int = 0
    backend: str | None = None
    notes: list[str] = field(default_factory=list)
    #: the prepared model as the step ran it: the modules that are FP8 layers (or Transformer Engine's stand-ins), and
    #: each parameter's dtype
    fp8_names: list[str] = field(default_factory=list)
    param_dtypes: dict[str, torch.dtype] = field(default_factory=dict)


# -- the fake step -------------------------------------------------------------------------------------------


def _fp8_backend(recipe: Recipe, target: str) -> str:
    """The backend the recipe's FP8 layers run on: on a GPU its own choice (``auto`` takes Transformer Engine),
    on this CPU what a rehearsal runs (torchao emulated for ``backend: torchao``, else the emulated layers)."""
    assert recipe.fp8 is not None
    choice = recipe.fp8.backend
    if target == "cpu":  # torchao emulates itself off FP8 hardware; native runs torch._scaled_mm on a CPU too
        return choice if choice in ("torchao", "native") else "emulated"
    return "transformer_engine" if choice == "auto" else choice


def _convert(model: nn.Module, recipe: Recipe, backend: str, step: _Step) -> None:
    """Convert as the plan decided for ``backend``; Transformer Engine is stood in for (:mod:`fp8.memory`)."""
    from hf_mixedprec import fp8
    from hf_mixedprec.fp8 import memory
    from hf_mixedprec.fp8.swap import replace_module

    assert recipe.fp8 is not None and step.plan is not None
    step.backend = backend
    decisions = list(step.plan.fp8_layers)
    if backend != "transformer_engine":
        report = fp8.convert(model, recipe, backend=backend, decisions=decisions)
        step.fp8_layers = len(report.converted)
        return
    scaling, history = recipe.fp8.scaling, recipe.fp8.options().get("amax_history_len") or 1024
    step.notes += [f"{recipe.name}: {n}" for n in fp8._unsupported_kind_notes(decisions, backend)]
    for d in decisions:
        if d.to_swap:
            replace_module(model, d.name, memory.TEMemoryStandIn(model.get_submodule(d.name), scaling))
            step.fp8_layers += 1
            step.fp8_extras += memory.te_weight_bytes(d.out_features, d.in_features, scaling)
            step.fp8_extras += memory.te_meta_bytes(scaling, history)
    step.notes.append(
        "Transformer Engine: its FP8 weight copies and saved FP8 inputs follow its module/linear.py (not run here)"
    )


@contextlib.contextmanager
def _accelerate_state_kept() -> Iterator[None]:
    """Building ``TrainingArguments`` resets Accelerate's process-wide state (``AcceleratorState._reset_state``),
    which breaks an ``Accelerator`` or ``Trainer`` the caller already has: put it back afterwards."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    saved = [(cls, dict(cls._shared_state)) for cls in (PartialState, AcceleratorState, GradientState)]
    try:
        yield
    finally:
        for cls, state in saved:
            cls._shared_state.clear()
            cls._shared_state.update(state)


def _optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    """The optimizer Trainer builds for ``TrainingArguments(optim=...)``, from Trainer's own mapping."""
    from transformers import Trainer, TrainingArguments

    with _accelerate_state_kept():
        args = TrainingArguments(output_dir=os.devnull, optim=OPTIMIZERS[name], report_to=[], use_cpu=True)
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    return cls([p for p in model.parameters() if p.requires_grad], **kwargs)


def _enable_checkpointing(model: Any) -> None:
    kwargs = {"use_reentrant": True}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # pragma: no cover - transformers before activation_checkpointing_enable
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _fp8_buffers(model: nn.Module) -> int:
    from hf_mixedprec import fp8

    # a backend's layer (torchao) is sampled by a probe beside it; the emulated layer is its own monitor
    layers = [layer if isinstance(layer, nn.Module) else layer.module for _, layer in fp8.fp8_layers(model, fresh=True)]
    return storage_bytes(b for layer in layers if layer is not None for b in layer.buffers())


def _note_prepared(model: nn.Module, step: _Step) -> None:
    """What the prepared model holds, module by module (tests compare it with the plan)."""
    from hf_mixedprec.fp8 import converted_types
    from hf_mixedprec.fp8.memory import TEMemoryStandIn

    kinds = (*converted_types(), TEMemoryStandIn)
    step.fp8_names = [n for n, m in model.named_modules() if isinstance(m, kinds)]
    step.param_dtypes = {n: p.dtype for n, p in model.named_parameters()}


def _plan_has_states(plan: PrecisionPlan) -> bool:
    return any(p.states is not None for p in plan.params if p.trainable)


def _fake_step(config: Any, recipe: Recipe, s: _Settings, *, model_dtype: torch.dtype | None = None) -> _Step:
    """One training step of ``config``'s model under ``recipe`` on fake tensors, prepared by the recipe's plan;
    what it held, by kind.

    The model is built in float32 (what ``finetune`` loads), whatever dtype ``config.json`` names, and its storage
    made the plan's; ``model_dtype``: build in that dtype instead (DeepSpeed's BF16/FP16 module), leave the storage
    alone and train without autocast.
    """
    from transformers import AutoModelForCausalLM

    from hf_mixedprec.fp8 import converted_types
    from hf_mixedprec.storage import apply_storage

    step = _Step()
    with fake_tensor_mode(allow_non_fake_inputs=True), _quiet_logs(), grouped_mm_as_fallback(), _same_kind_swaps():
        # a copy: from_config records the dtype in the config it is given
        model = AutoModelForCausalLM.from_config(_as_loaded(config), dtype=model_dtype or torch.float32)
        model.train()
        backend = _fp8_backend(recipe, s.target) if recipe.precision == "fp8" else None
        with unset_fake_temporarily():  # the plan reads shapes only; torchao builds its quantization maps for real
            step.plan = build_plan(recipe, model, fp8_backend=backend, converted_types=converted_types())
        if model_dtype is None:  # as the run prepares it: BF16 weights change what autograd saves (the
            apply_storage(model, step.plan)  # remainders it leaves for an optimizer go with the fake model)
        if backend is not None:
            _convert(model, recipe, backend, step)
        _note_prepared(model, step)
        if s.gradient_checkpointing:
            _enable_checkpointing(model)
        params = list(model.parameters())
        step.params = sum(p.numel() for p in params)
        measure = s.optimizer != "adamw" or not _plan_has_states(step.plan)
        optimizer = _optimizer(model, s.optimizer) if measure else None
        ids = torch.zeros(s.batch_size, s.seq_len, dtype=torch.long)
        meter = SavedTensorMeter(exclude=params)
        dtype = None if model_dtype is not None else compute_dtype(recipe)
        with meter.recording(), torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = model(input_ids=ids, labels=ids).loss
        with meter.recording():
            loss.backward()
        step.activations = meter.peak
        if optimizer is not None:
            optimizer.step()
            step.optimizer, step.states = _state_bytes(optimizer)
        if recipe.precision == "fp8" and step.backend in ("emulated", "native"):
            from hf_mixedprec.fp8.layers import fp8_step

            fp8_step(model)
        if step.backend != "transformer_engine":
            step.fp8_extras = _fp8_buffers(model)
    return step


@contextlib.contextmanager
def _same_kind_swaps() -> Iterator[None]:
    """Models whose ``__init__`` converts a submodule to the dtype it already has (HunYuan-V4's
    ``HYV4HyperConnection(config).to(dtype=torch.float32)``, Inkling's): on fake tensors ``Module._apply`` swaps each
    parameter with a new one (torch swaps FakeTensor parameters), which fails on a tensor that fake mode holds a weak
    reference to. Where the two tensors have the same shape, dtype and device the conversion changed nothing: the
    parameter is kept as it is. Any other failed swap still raises."""
    import torch.utils

    swap = torch.utils.swap_tensors

    def lenient(t1: torch.Tensor, t2: torch.Tensor) -> None:
        try:
            swap(t1, t2)
        except RuntimeError:
            if (t1.shape, t1.dtype, t1.device) != (t2.shape, t2.dtype, t2.device):
                raise

    torch.utils.swap_tensors = lenient
    try:
        yield
    finally:
        torch.utils.swap_tensors = swap


def _as_loaded(config: Any) -> Any:
    """A copy of ``config`` as the model had it when loaded: a live run's config names hf_mixedprec's FP8 experts
    implementation once its experts were converted (the run summary estimates from it); the fake model is built
    unconverted, so it takes the implementation the experts had before (the plan converts them again)."""
    from hf_mixedprec.fp8.experts import IMPLEMENTATION

    config = copy.deepcopy(config)
    for cfg in {id(c): c for c in (config, config.get_text_config())}.values():
        if getattr(cfg, "_experts_implementation_internal", None) == IMPLEMENTATION:
            cfg._experts_implementation_internal = getattr(cfg, "_hf_mixedprec_previous_experts", None)
    return config


def _state_bytes(optimizer: torch.optim.Optimizer) -> tuple[int, dict[str, int]]:
    """Bytes of ``optimizer.state`` after a step: in all (each storage once) and by state name."""
    tensors: dict[str, list[torch.Tensor]] = {}
    for st in optimizer.state.values():
        for key, v in st.items():
            if torch.is_tensor(v):
                tensors.setdefault(key, []).append(v)
    total = storage_bytes(t for ts in tensors.values() for t in ts)
    return total, {key: storage_bytes(ts) for key, ts in tensors.items()}


@contextlib.contextmanager
def _quiet_logs() -> Iterator[None]:
    """transformers and hf_mixedprec log per model build (config checks, conversion notes): not for an estimate."""
    import logging

    loggers = [logging.getLogger(n) for n in ("transformers", "hf_mixedprec", "torch._subclasses.fake_tensor")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


class EstimateUnsupported(MixedPrecisionError):
    """The model's training step cannot run on fake tensors (said in one line, with the model type and recipe)."""


def _run_fake_step(config: Any, recipe: Recipe, s: _Settings, *, model_dtype: torch.dtype | None = None) -> _Step:
    try:
        return _fake_step(config, recipe, s, model_dtype=model_dtype)
    except UsageError:
        raise
    except Exception as exc:
        kind = getattr(config, "model_type", type(config).__name__)
        hint = ""
        if "grouped_mm" in str(exc) or "Expected inputs of BF16 type" in str(exc):
            hint = "; mixture-of-experts layers (torch._grouped_mm) have no fake-tensor kernel for float32 inputs"
        raise EstimateUnsupported(
            f"estimate: model type {kind!r} under recipe {recipe.name!r}: its training step cannot run on fake "
            f"tensors ({root_cause(exc)}){hint}"
        ) from None
