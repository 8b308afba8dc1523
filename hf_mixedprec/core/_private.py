"""The fence: every private attribute of torch, Accelerate and transformers that hf_mixedprec reads, writes or
wraps, each behind one small function here and nowhere else.

Each is listed in :data:`PRIVATES` with the library version it was checked on and a check that it is still where
and what it was; ``tests/core/test_private_fence.py`` runs every check (so an upgrade that moves one fails loudly, naming
it) and scans the package for private accesses outside this module. Why each is needed is said where it is used
here, with the upstream file that defines it.

Checked on: torch 2.13, accelerate 1.15, transformers 5.23.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch.amp import grad_scaler as _torch_grad_scaler

__all__ = [
    "PRIVATES",
    "OptState",
    "Private",
    "add_keys_to_ignore_on_save",
    "cpu_native_16bit",
    "custom_object_count",
    "declared_fp32_modules",
    "ensure_scale_tensor",
    "fake_tensor_mode",
    "find_trainer",
    "foreach_add_",
    "foreach_copy_",
    "foreach_mul_",
    "foreach_norm",
    "foreach_sub_",
    "foreach_zero_",
    "found_inf_handed_to",
    "fsdp2_on_cpu",
    "fsdp2_possible_on_cpu",
    "fused_adamw_",
    "give_scaler",
    "grouped_mm_as_fallback",
    "has_scaled_mm",
    "in_backward",
    "in_dispatch_mode",
    "inductor_fma",
    "is_fake_tensor",
    "mkldnn_fp16_supported",
    "optimizer_state",
    "pin_scale",
    "reset_accelerate_state",
    "reset_optimizer_states",
    "resumed_from",
    "scale_tensor",
    "scaled_mm",
    "scaler_settings",
    "set_last_lr",
    "set_mixed_precision",
    "skips_inside_step",
    "track_steps_for_scheduler",
    "trainer_output_dir",
    "unset_fake_temporarily",
    "wrap_save_checkpoint",
    "wrap_save_scaler",
]

# -- torch: functions with a leading underscore -----------------------------------------------------------------

# torch's fused per-list kernels (``torch/_foreach``; one kernel per list on CUDA), used by clipping and the FP8 state
# updates, and torch's FP8 GEMM (``_scaled_mm``, aten/src/ATen/native/cuda/Blas.cpp), the native FP8 backend's GEMM.
# Each is looked up on torch at every call, so that what torch holds then (a test's wrapper included) runs.


def foreach_norm(tensors: list[torch.Tensor], ord: float, *, dtype: torch.dtype) -> list[torch.Tensor]:
    return list(torch._foreach_norm(tensors, ord, dtype=dtype))


def foreach_mul_(tensors: list[torch.Tensor], scalar: Any) -> None:
    torch._foreach_mul_(tensors, scalar)


def foreach_copy_(dst: Any, src: Any) -> None:
    torch._foreach_copy_(dst, src)


def foreach_zero_(tensors: Any) -> None:
    torch._foreach_zero_(tensors)


def foreach_add_(tensors: list[torch.Tensor], other: Any) -> None:
    torch._foreach_add_(tensors, other)


def foreach_sub_(tensors: list[torch.Tensor], other: Any) -> None:
    torch._foreach_sub_(tensors, other)


def fused_adamw_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    **hyper: Any,
) -> None:
    """torch's fused AdamW kernel (aten/src/ATen/native/FusedAdam.cpp, cuda/FusedAdamKernel.cu), the one behind
    ``AdamW(fused=True)``: one call for a list of tensors, skipping on ``found_inf`` on the device."""
    torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, maximize=False, **hyper)


def inductor_fma() -> Any:
    # torch/_inductor/inductor_prims.py ``fma``: a * b + c with one rounding in the code torch.compile generates (a
    # written a * b + c is two); StorageAdamW's single pass needs it where torch's CPU fused AdamW kernel has one
    from torch._inductor import inductor_prims

    return inductor_prims.fma


def no_recompile_limit() -> Any:
    # torch/_dynamo/utils.py: lifts dynamo's recompile limit for a block, as torchao's low-bit AdamW step does around
    # its per-parameter compiled update (one compile per parameter shape and dtype, a fixed number per model)
    return torch._dynamo.utils.disable_cache_limit()


def torchao_new_state(optimizer: Any, p: torch.Tensor, signed: bool) -> torch.Tensor:
    # torchao/optim/adam.py ``_AdamBase._new_buffer``: the low-bit (or FP32, for small tensors) moment torchao's own
    # step makes on a parameter's first step
    return optimizer._new_buffer(p, signed)


def has_scaled_mm() -> bool:
    """Whether this torch has its FP8 GEMM."""
    return hasattr(torch, "_scaled_mm")


def scaled_mm(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch._scaled_mm(*args, **kwargs)


def mkldnn_fp16_supported() -> bool:
    """Whether oneDNN has native FP16 arithmetic on this CPU (``torch.ops.mkldnn._is_mkldnn_fp16_supported``; what
    DeepSpeed's CPU accelerator asks before it accepts FP16)."""
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def cpu_native_16bit() -> dict[str, bool]:
    """What this CPU computes natively in 16 bits, as torch's CPU queries answer (``torch/cpu/__init__.py``):
    ``avx512_bf16`` (AVX512-BF16), ``amx_tile`` (AMX, BF16 tiles) and ``amx_fp16`` (AMX-FP16). x86 answers only; on
    other processors every answer is False whatever the hardware has."""
    return {
        "avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported()),
        "amx_tile": bool(torch.cpu._is_amx_tile_supported()),
        "amx_fp16": bool(torch.cpu._is_amx_fp16_supported()),
    }


def fake_tensor_mode(**kwargs: Any) -> Any:
    """torch's ``FakeTensorMode`` (``torch/_subclasses/fake_tensor.py``): tensors with shapes and dtypes and no data,
    how ``estimate`` runs a training step without memory."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(**kwargs)


def in_backward() -> bool:
    """Whether autograd's backward is running now (torch's engine sets a graph task id while it runs one,
    ``torch/csrc/autograd/engine.cpp``): a checkpointed forward recomputed there routes the same tokens again."""
    return torch._C._current_graph_task_id() != -1


def in_dispatch_mode() -> bool:
    """Whether a ``TorchDispatchMode`` is active (``torch/utils/_python_dispatch.py``): ``FakeTensorMode``, an
    operation counter; ``torch.compile`` refuses to trace under one, so code that compiles takes its eager path."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode() is not None


def is_fake_tensor(t: Any) -> bool:
    """Whether ``t`` is one of ``FakeTensorMode``'s tensors (``torch/_subclasses/fake_tensor.py``), whose kernels
    follow the meta device's rules (``estimate``'s step runs on them)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def unset_fake_temporarily() -> Any:
    """Leave fake mode for a block (``torch/_subclasses/fake_tensor.py``): for code that must read real values."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily as unset

    return unset()


# -- torch: GradScaler and optimizer internals -------------------------------------------------------------------

# torch/amp/grad_scaler.py: the stage of one optimizer in the scaler's unscale_ -> step -> update cycle
# (READY, UNSCALED, STEPPED). Private enum; needed to mark an optimizer unscaled without unscaling (the guard).
OptState = _torch_grad_scaler.OptState
# torch/amp/grad_scaler.py: the default factory of ``_per_optimizer_states``; ``update()`` resets the states
# with it, and so does the guard's ``update()``.
_fresh_optimizer_state = _torch_grad_scaler._refresh_per_optimizer_state


def optimizer_state(scaler: torch.amp.GradScaler, optimizer: Any, *, create: bool = True) -> dict[str, Any] | None:
    """One optimizer's ``{"stage", "found_inf_per_device"}`` in the scaler; ``create=False`` peeks (None if absent)."""
    # torch/amp/grad_scaler.py: ``GradScaler._per_optimizer_states`` (a defaultdict keyed by ``id(optimizer)``)
    # holds the inf flags ``unscale_`` wrote and ``step`` reads to decide a skip. No public API reads or sets
    # them: the runtime folds its own skip flag into them, so the skip stays on the device.
    states = scaler._per_optimizer_states
    return states[id(optimizer)] if create else states.get(id(optimizer))


def reset_optimizer_states(scaler: torch.amp.GradScaler) -> None:
    # torch/amp/grad_scaler.py: what ``GradScaler.update()`` does last (same attribute as above).
    scaler._per_optimizer_states = defaultdict(_fresh_optimizer_state)


def scale_tensor(scaler: torch.amp.GradScaler) -> torch.Tensor | None:
    """The loss scale as a device tensor (None before the scaler's first use)."""
    # torch/amp/grad_scaler.py: ``GradScaler._scale``. ``get_scale()`` reads it on the host (a sync); the
    # monitor needs it on the device every step and the recipe's min_scale/max_scale clamp it in place.
    return scaler._scale


def ensure_scale_tensor(scaler: torch.amp.GradScaler, device: torch.device) -> None:
    # torch/amp/grad_scaler.py: ``_lazy_init_scale_growth_tracker`` makes ``_scale`` and ``_growth_tracker``,
    # which ``step()`` requires; torch calls it from ``scale()``/``unscale_``, which the guard never runs.
    if scaler._scale is None:
        scaler._lazy_init_scale_growth_tracker(device)


def pin_scale(scaler: torch.amp.GradScaler, value: float) -> None:
    # torch/amp/grad_scaler.py: ``_init_scale`` is the scale ``_scale`` is made with (``load_state_dict`` sets it
    # from a checkpoint); ``_scale`` the live one. Both are set so the guard stays at ``value`` after a restore.
    scaler._init_scale = value
    if scaler._scale is not None:
        scaler._scale.fill_(value)


def scaler_settings(scaler: torch.amp.GradScaler) -> tuple[float, int]:
    """The scaler's initial scale and growth interval, for a report (``state_dict()`` would read the live scale on
    the host: a sync on a GPU)."""
    # torch/amp/grad_scaler.py: the constructor's ``init_scale`` and ``growth_interval``, kept as private attributes
    return float(scaler._init_scale), int(scaler._growth_interval)


def skips_inside_step(optimizer: Any) -> bool:
    # torch/optim/adam.py (also sgd.py, adagrad.py): ``_step_supports_amp_scaling`` is True for fused optimizers,
    # whose ``step()`` reads the scaler's found-inf itself and skips on the device; ``GradScaler.step`` then calls
    # it without a host read, and Accelerate (``accelerate/optimizer.py``) cannot tell the step was skipped.
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


@contextlib.contextmanager
def found_inf_handed_to(optimizer: Any, found: torch.Tensor) -> Iterator[None]:
    # torch/amp/grad_scaler.py ``GradScaler.step``: for such an optimizer it sets ``grad_scale`` and ``found_inf``
    # attributes for the duration of ``step()`` (the fused kernels read them); the guard does the same directly.
    optimizer.grad_scale = None
    optimizer.found_inf = found
    try:
        yield
    finally:
        del optimizer.grad_scale
        del optimizer.found_inf


def set_last_lr(scheduler: Any, lrs: list[float]) -> None:
    # torch/optim/lr_scheduler.py: ``LRScheduler._last_lr`` is what ``get_last_lr()`` returns (Trainer logs it
    # as ``learning_rate``); only ``step()`` writes it, so a rewound schedule sets it too.
    scheduler._last_lr = list(lrs)


def track_steps_for_scheduler(optimizer: Any) -> None:
    """Let an LR scheduler moved onto ``optimizer`` (a replacement built after the scheduler) see its steps."""
    # torch/optim/lr_scheduler.py ``LRScheduler.__init__`` (``patch_track_step_called``): the scheduler wraps its
    # optimizer's ``step`` to set ``_opt_called`` and marks the wrapper ``_wrapped_by_lr_sched``; ``step()`` warns
    # on its first call when either is missing. The replacement gets the same wrapper.
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    inner = optimizer.step

    def step(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True
        return inner(*args, **kwargs)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = step


# -- Accelerate ---------------------------------------------------------------------------------------------------


def set_mixed_precision(accelerator: Any, value: str) -> None:
    """Change a built Accelerator's mixed precision (``no`` under a recipe whose autocast is ours; ``fp16`` to run
    Accelerate's native FP16 path where it would not)."""
    # accelerate/state.py: ``AcceleratorState._mixed_precision`` backs the read-only ``mixed_precision`` property
    # that ``Accelerator.autocast`` and ``prepare`` read; it is settable only through the constructor.
    accelerator.state._mixed_precision = value


def fsdp2_possible_on_cpu(accelerator: Any) -> bool:
    """Whether ``accelerator`` runs several CPU processes without sharding (what :func:`fsdp2_on_cpu` switches)."""
    from accelerate.utils import DistributedType

    return (
        accelerator.distributed_type == DistributedType.MULTI_CPU
        and accelerator.num_processes > 1
        and getattr(accelerator.state, "fsdp_plugin", None) is None
    )


def fsdp2_on_cpu(accelerator: Any, *, broadcast_weights: bool = True, mp_policy: Any = None) -> None:
    """Switch an Accelerator built for several CPU processes (:func:`fsdp2_possible_on_cpu`) to Accelerate's FSDP2
    path before the model is prepared.

    ``accelerate/state.py`` (``AcceleratorState.__init__``) takes the FSDP branch only for GPU-like distributed types,
    so on CPU processes (gloo) Accelerate trains as DDP; its FSDP2 code itself (``fsdp2_prepare_model``:
    ``fully_shard`` per wrapped module, then the root) runs on CPU. The plugin: every module class the model names
    as not to be split (its decoder layers) sharded, then the root; parameters resharded after forward; sharded
    state dicts (Distributed Checkpoint); ``mp_policy``, the recipe's FSDP2 ``MixedPrecisionPolicy`` (None: FSDP2's
    default, parameters gathered as stored and gradients reduced in their dtype).
    ``broadcast_weights``: rank 0's weights are sent to every rank at preparation (Accelerate's
    ``cpu_ram_efficient_loading``, whose loader takes each state-dict entry for a sharded parameter: a model with
    other buffers in its state dict, FP8 layers' scaling state, must go without it and start from the same weights
    on every rank by itself)."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        reshard_after_forward=True,
        state_dict_type="SHARDED_STATE_DICT",
        cpu_ram_efficient_loading=broadcast_weights,
        mixed_precision_policy=mp_policy,
    )
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    # every later ``AcceleratorState()`` (an ``AcceleratedOptimizer`` makes one) copies PartialState's shared
    # attributes over its own (accelerate/state.py, ``AcceleratorState.__init__``): the switch is made there too
    from accelerate.state import PartialState

    PartialState().distributed_type = DistributedType.FSDP


def fsdp2_retarget(root: Any, qualified_name: str, old: Any, new: Any) -> None:
    """After ``new`` replaced ``old`` at ``qualified_name`` under ``root`` holding the same Parameter objects: make the
    FSDP2 unit that owns those parameters set them on ``new`` from now on. A no-op without FSDP2.

    FSDP2 swaps each parameter between its sharded and unsharded tensor with ``setattr`` on the module it found the
    parameter on at ``fully_shard`` (torch/distributed/fsdp/_fully_shard/_fsdp_param.py: ``ParamModuleInfo``,
    ``FSDPParam._setattr_on_modules``), and registers a state-dict pre-hook on that module that reshards first
    (``_fsdp_param_group.py``: ``_register_state_dict_hooks``) and, per parameter, a post-load hook that re-points
    the sharded parameter after an ``assign=True`` load (``_fsdp_param.py``). A module swapped in later (an FP8 layer at a phase
    boundary, a Linear at its end) would otherwise keep the sharded tensor while the forward's unsharded one went to
    the detached old module. The owner is the innermost fully-sharded module on the path to ``qualified_name``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return
    owner = root if isinstance(root, FSDPModule) else None
    path = qualified_name.split(".")[:-1]
    node = root
    for part in path:
        node = getattr(node, part)
        if isinstance(node, FSDPModule):
            owner = node
    if owner is None:
        return
    group = owner._get_fsdp_state()._fsdp_param_group
    if group is None:
        return
    for fsdp_param in group.fsdp_params:
        info = fsdp_param._module_info
        if info.module is old:
            info.module = new
            # the post-load hook that re-points the sharded parameter after an assign=True load (_fsdp_param.py)
            fsdp_param._post_load_hook_handle.remove()
            fsdp_param._post_load_hook_handle = new.register_load_state_dict_post_hook(
                lambda *a, _p=fsdp_param, **k: _p.reset_sharded_param()
            )
        info.shared_modules = [new if m is old else m for m in info.shared_modules]
    for hooks in (group._module_to_pre_save_state_dict_hook_handle, group._module_to_pre_load_state_dict_hook_handle):
        handle = hooks.pop(old, None)
        if handle is not None:
            handle.remove()
    if group._module_to_pre_save_state_dict_hook_handle or group._module_to_pre_load_state_dict_hook_handle:
        # hooks are registered once, at the first forward; re-register this module's pair on the new one
        reshard = group._to_sharded
        group._module_to_pre_save_state_dict_hook_handle[new] = new.register_state_dict_pre_hook(
            lambda *a, **k: reshard()
        )
        group._module_to_pre_load_state_dict_hook_handle[new] = new._register_load_state_dict_pre_hook(
            lambda *a, **k: reshard()
        )


def give_scaler(optimizer: Any, scaler: torch.amp.GradScaler) -> None:
    """Hand ``scaler`` to an already prepared ``AcceleratedOptimizer``, as its constructor would have."""
    # accelerate/optimizer.py ``AcceleratedOptimizer.__init__``: with a scaler it patches the wrapped optimizer's
    # step to record whether the scaler skipped it (``_accelerate_step_called`` and the two step methods) and
    # ``step_was_skipped`` reads that record.
    from accelerate.optimizer import patch_optimizer_step

    if getattr(optimizer, "scaler", None) is None:
        optimizer._accelerate_step_called = False
        optimizer._optimizer_original_step_method = optimizer.optimizer.step
        optimizer._optimizer_patched_step_method = patch_optimizer_step(optimizer, optimizer.optimizer.step)
    optimizer.scaler = scaler


def custom_object_count(accelerator: Any) -> int:
    """How many objects ``register_for_checkpointing`` holds: Accelerate names each one's file by its place in that
    list (``accelerator.py``, ``save_state``: ``custom_checkpoint_{i}.pkl``)."""
    return len(accelerator._custom_objects)


def reset_accelerate_state() -> None:
    """Forget Accelerate's process-wide state (the mixed precision, the device, the distributed setup), so that the
    next Accelerator is built afresh."""
    # accelerate/state.py: ``AcceleratorState._reset_state`` (what Accelerate's own tests call between runs)
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


# -- transformers ---------------------------------------------------------------------------------------------------


def wrap_save_checkpoint(trainer: Any, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``trainer._save_checkpoint`` on the instance with ``make(the bound original)``
    (``transformers/trainer.py``: writes one ``checkpoint-N`` folder and rotates old ones; the manifest, and the
    rotation after it, are ours)."""
    trainer._save_checkpoint = make(trainer._save_checkpoint)


def wrap_save_scaler(trainer: Any, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``trainer._save_scaler`` on the instance with ``make(the bound original)`` (``transformers/trainer.py``:
    writes ``scaler.pt``; the runtime checkpoints its scaler in its own state)."""
    trainer._save_scaler = make(trainer._save_scaler)


def wrap_load_optimizer(trainer: Any, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``trainer._load_optimizer_and_scheduler`` on the instance with ``make(the bound original)``
    (``transformers/trainer.py``: loads ``optimizer.pt`` into ``trainer.optimizer`` after the model's weights were
    loaded; a storage change at resume converts that state)."""
    trainer._load_optimizer_and_scheduler = make(trainer._load_optimizer_and_scheduler)


def trainer_output_dir(trainer: Any, trial: Any) -> str:
    """The folder ``Trainer._save_checkpoint`` writes ``checkpoint-N`` into (a search trial's run folder included)."""
    # transformers/trainer.py: ``Trainer._get_output_dir(trial)``
    return os.fspath(trainer._get_output_dir(trial=trial))


def add_keys_to_ignore_on_save(module: Any, keys: set[str]) -> bool:
    """Add ``keys`` to a ``PreTrainedModel``'s ``_keys_to_ignore_on_save`` (what ``save_pretrained`` drops and
    ``Trainer._issue_warnings_after_load`` expects missing); False for a module that is no ``PreTrainedModel``."""
    # transformers/modeling_utils.py: ``PreTrainedModel._keys_to_ignore_on_save`` (a class attribute, None or a set)
    if not hasattr(type(module), "_keys_to_ignore_on_save"):
        return False
    module._keys_to_ignore_on_save = set(module._keys_to_ignore_on_save or ()) | set(keys)
    return True


def declared_fp32_modules(model: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A model class's ``(strict, non-strict)`` FP32 module declarations (``transformers/modeling_utils.py``:
    ``_keep_in_fp32_modules_strict`` always applies, ``_keep_in_fp32_modules`` when loading in FP16)."""
    strict = tuple(sorted(getattr(model, "_keep_in_fp32_modules_strict", None) or ()))
    loose = tuple(sorted(getattr(model, "_keep_in_fp32_modules", None) or ()))
    return strict, loose


def _trainer_frame(trainer_cls: type) -> FrameType | None:
    # Callback events are not handed the Trainer: ``on_init_end`` runs inside ``Trainer.__init__`` and
    # ``on_train_begin`` inside ``Trainer._inner_training_loop`` (transformers/trainer.py); the nearest frame whose
    # ``self`` is a Trainer is that method's.
    frame = sys._getframe(1)
    while frame is not None:
        if isinstance(frame.f_locals.get("self"), trainer_cls):
            return frame
        frame = frame.f_back
    return None


def find_trainer(trainer_cls: type) -> Any:
    """The Trainer whose method is calling the current callback event, or None."""
    frame = _trainer_frame(trainer_cls)
    return None if frame is None else frame.f_locals["self"]


def resumed_from(trainer_cls: type) -> str | None:
    """At ``on_train_begin``, the checkpoint folder the Trainer resumes from (None when it starts afresh): the
    ``resume_from_checkpoint`` that ``Trainer.train`` resolves (``True`` -> the last checkpoint) and hands to
    ``Trainer._inner_training_loop`` as a local of that name."""
    frame = _trainer_frame(trainer_cls)
    folder = None if frame is None else frame.f_locals.get("resume_from_checkpoint")
    return os.fspath(folder) if isinstance(folder, (str, os.PathLike)) else None


@contextlib.contextmanager
def grouped_mm_as_fallback() -> Iterator[None]:
    """MoE experts (transformers 5 runs them through ``torch._grouped_mm``) on fake tensors: torch's fake kernel for
    ``_grouped_mm`` accepts BF16 only, so ``estimate``'s step routes them through transformers' own fallback op,
    whose fake kernel takes every dtype and whose output and saved tensors have the same shapes
    (``transformers/integrations/moe.py``: ``_can_use_grouped_mm`` decides, ``transformers::grouped_mm_fallback``)."""
    try:
        import transformers.integrations.moe as moe
    except ImportError:  # a transformers without it has no grouped experts either
        yield
        return
    original = getattr(moe, "_can_use_grouped_mm", None)
    if original is None:
        yield
        return
    moe._can_use_grouped_mm = lambda *a, **k: False
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original


# -- the list, with the check of each -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Private:
    """One private name: where it lives (``module:Object.attribute``), the library version it was checked on,
    and what must hold for the code here to stay right."""

    where: str
    checked_on: str
    holds: str

    @property
    def name(self) -> str:
        """The private name itself (``_save_checkpoint``)."""
        return self.where.partition(":")[2].rsplit(".", 1)[-1]

    def check(self) -> None:
        """Raise AssertionError, naming this private, when the installed library no longer has it."""
        module, _, path = self.where.partition(":")
        try:
            obj: Any = importlib.import_module(module)
        except ImportError as exc:
            raise AssertionError(f"{self.where}: {module} does not import ({exc})") from None
        for part in path.split(".")[:-1]:
            obj = getattr(obj, part, None)
            if obj is None:
                raise AssertionError(f"{self.where}: {module} has no {path} any more (checked on {self.checked_on})")
        name = path.split(".")[-1]
        if not _has_attribute(obj, name):
            raise AssertionError(
                f"{self.where}: gone from the installed {module.split('.')[0]} (checked on {self.checked_on}): "
                f"{self.holds}"
            )


def _has_attribute(obj: Any, name: str) -> bool:
    """``name`` on ``obj``: a module or class attribute or method, or an instance attribute its class's methods set
    (read from the class's source, so that no instance needs to be built)."""
    if hasattr(obj, name):
        return True
    if not isinstance(obj, type):
        return False
    import inspect

    for cls in obj.__mro__:
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            continue
        if f"self.{name} =" in source or f"self.{name}: " in source:
            return True
    return False


#: Every private name this module touches.
PRIVATES: tuple[Private, ...] = (
    Private("torch:_foreach_norm", "torch 2.13", "per-list norms in one kernel (clipping)"),
    Private("torch:_foreach_mul_", "torch 2.13", "per-list in-place scaling (clipping)"),
    Private("torch:_foreach_copy_", "torch 2.13", "per-list copies (FP8 amax history updates)"),
    Private("torch:_foreach_zero_", "torch 2.13", "per-list zeroing (FP8 amax history updates)"),
    Private("torch:_foreach_add_", "torch 2.13", "StorageAdamW's step counters"),
    Private("torch:_foreach_sub_", "torch 2.13", "StorageAdamW's step counters back on a skipped step"),
    Private("torch:_fused_adamw_", "torch 2.13", "StorageAdamW's update (AdamW(fused=True)'s kernel)"),
    Private("torch:_scaled_mm", "torch 2.13", "the FP8 GEMM of fp8.backend native"),
    Private("torch.utils._python_dispatch:_get_current_dispatch_mode", "torch 2.13", "None outside a dispatch mode"),
    Private("torch._inductor.inductor_prims:fma", "torch 2.13", "one rounding for a*b+c in a compiled update"),
    Private("torch._dynamo.utils:disable_cache_limit", "torch 2.13", "torchao's update compiled per parameter"),
    Private("torchao.optim.adam:_AdamBase._new_buffer", "torchao 0.18", "a low-bit moment made as torchao makes it"),
    Private("torch._subclasses.fake_tensor:FakeTensorMode", "torch 2.13", "estimate's data-free training step"),
    Private(
        "torch._subclasses.fake_tensor:FakeTensor", "torch 2.13", "the FP8 experts' grouped GEMM on estimate's tensors"
    ),
    Private("torch._subclasses.fake_tensor:unset_fake_temporarily", "torch 2.13", "real values inside fake mode"),
    Private("torch:_C._current_graph_task_id", "torch 2.13", "-1 outside backward (MoE token counts skip recomputes)"),
    Private("torch:ops.mkldnn._is_mkldnn_fp16_supported", "torch 2.13", "DeepSpeed's CPU FP16 question"),
    Private("torch.cpu:_is_avx512_bf16_supported", "torch 2.13", "auto's CPU BF16 question"),
    Private("torch.cpu:_is_amx_tile_supported", "torch 2.13", "auto's CPU BF16 question (AMX)"),
    Private("torch.cpu:_is_amx_fp16_supported", "torch 2.13", "a rehearsal's CPU FP16 question (AMX-FP16)"),
    Private("torch.amp.grad_scaler:OptState", "torch 2.13", "the unscale/step stages the guard scaler marks"),
    Private(
        "torch.amp.grad_scaler:_refresh_per_optimizer_state", "torch 2.13", "the fresh per-optimizer state factory"
    ),
    Private("torch.amp.grad_scaler:GradScaler._per_optimizer_states", "torch 2.13", "found-inf flags per optimizer"),
    Private("torch.amp.grad_scaler:GradScaler._scale", "torch 2.13", "the live loss scale on the device"),
    Private("torch.amp.grad_scaler:GradScaler._init_scale", "torch 2.13", "the scale the live one is made with"),
    Private("torch.amp.grad_scaler:GradScaler._growth_interval", "torch 2.13", "steps between scale growths"),
    Private(
        "torch.amp.grad_scaler:GradScaler._lazy_init_scale_growth_tracker", "torch 2.13", "makes _scale on a device"
    ),
    Private("torch.distributed.fsdp:FSDPModule._get_fsdp_state", "torch 2.13", "the FSDP2 unit of a module"),
    Private(
        "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam._module_info",
        "torch 2.13",
        "the module FSDP2 sets a parameter on",
    ),
    Private(
        "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup._module_to_pre_save_state_dict_hook_handle",
        "torch 2.13",
        "FSDP2's reshard-before-save hooks",
    ),
    Private(
        "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup._module_to_pre_load_state_dict_hook_handle",
        "torch 2.13",
        "FSDP2's reshard-before-load hooks",
    ),
    Private(
        "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup._to_sharded", "torch 2.13", "reshard"
    ),
    Private(
        "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam._post_load_hook_handle",
        "torch 2.13",
        "FSDP2's post-load re-pointing of the sharded parameter, moved with the module",
    ),
    Private("torch.nn:Module._register_load_state_dict_pre_hook", "torch 2.13", "FSDP2's pre-load hook, moved"),
    Private("torch.optim.lr_scheduler:LRScheduler._last_lr", "torch 2.13", "what get_last_lr() returns"),
    Private("torch.optim:Adam._step_supports_amp_scaling", "torch 2.13", "fused optimizers skip on the device"),
    Private("accelerate.state:AcceleratorState._mixed_precision", "accelerate 1.15", "backs mixed_precision"),
    Private("accelerate.state:AcceleratorState._reset_state", "accelerate 1.15", "forgets the process-wide state"),
    Private("accelerate:Accelerator._custom_objects", "accelerate 1.15", "the register_for_checkpointing list"),
    Private("accelerate.optimizer:patch_optimizer_step", "accelerate 1.15", "records a skipped step"),
    Private("accelerate.optimizer:AcceleratedOptimizer._accelerate_step_called", "accelerate 1.15", "step_was_skipped"),
    Private("transformers.integrations.moe:_can_use_grouped_mm", "transformers 5.23", "MoE experts' GEMM choice"),
    Private("transformers:Trainer._save_checkpoint", "transformers 5.23", "writes and rotates checkpoint-N"),
    Private("transformers:Trainer._save_scaler", "transformers 5.23", "writes scaler.pt"),
    Private("transformers:Trainer._get_output_dir", "transformers 5.23", "the folder checkpoints go into"),
    Private("transformers:Trainer._inner_training_loop", "transformers 5.23", "holds resume_from_checkpoint"),
    Private("transformers:PreTrainedModel._keys_to_ignore_on_save", "transformers 5.23", "keys save_pretrained drops"),
    Private("transformers:PreTrainedModel._keep_in_fp32_modules", "transformers 5.23", "FP32 modules under FP16"),
    Private("transformers:PreTrainedModel._keep_in_fp32_modules_strict", "transformers 5.23", "FP32 modules always"),
)
