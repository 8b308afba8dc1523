"""Sharding hf_mixedprec takes care of (the installer, ``integrations/install.py``, decides when): ``distributed.strategy:
fsdp2`` on several CPU processes (gloo), where Accelerate would train as plain data parallel (``accelerate/state.py``
takes its FSDP branch on GPUs only), the recipe's FSDP2 precision policy, and torchao's FP8 all-gather weights."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hf_mixedprec.core._private import ensure_scale_tensor, fsdp2_on_cpu, fsdp2_possible_on_cpu
from hf_mixedprec.recipes.schema import RecipeSpec

__all__ = [
    "describe_policy",
    "fsdp2_on_cpu_accelerator",
    "fsdp2_policy",
    "fsdp2_policy_on_accelerate",
    "keep_optimizer_params_by_name",
    "scaler_ready_for_sharded_resume",
]


def scaler_ready_for_sharded_resume(trainer: Any, scaler: torch.amp.GradScaler) -> None:
    """Give ``scaler`` its scale tensor now when the Trainer shards with FSDP. Resuming a sharded optimizer, torch's
    Distributed Checkpoint first fills its empty state with one step at lr 0
    (torch/distributed/checkpoint/state_dict.py: ``_init_optim_state``); through Accelerate's optimizer that step goes
    through the scaler, which refuses to step without a scale. The checkpoint's scale is loaded after it."""
    if getattr(trainer, "is_fsdp_enabled", False):
        ensure_scale_tensor(scaler, trainer.args.device)


def fsdp2_on_cpu_accelerator(accelerator: Any, recipe: RecipeSpec, rt: Any) -> bool:
    """Switch Accelerate's FSDP2 path on for several CPU processes (it takes it on GPUs only), for every recipe
    kind. Under FSDP Accelerate leaves precision to an FSDP mixed-precision policy (here the recipe's,
    :func:`fsdp2_policy`) and autocasts nothing, so the runtime installs the recipe's autocast. What keeps the ranks in step: FP16's ``GradScaler`` finds infs on sharded (DTensor)
    gradients with a MAX all-reduce of its found-inf flag (torch/distributed/tensor/_dispatch.py); FP8 delayed
    scaling reduces its amaxes with MAX over ranks once per step (:func:`hf_mixedprec.fp8.fp8_step`); the gradient
    norm that clipping and the skip decision read is summed over the shards; the loss the detectors read is the
    mean over ranks."""
    if recipe.distributed.strategy != "fsdp2" or not fsdp2_possible_on_cpu(accelerator):
        return False
    fp8 = "fp8" in recipe.precisions()
    fsdp2_on_cpu(accelerator, broadcast_weights=not fp8, mp_policy=fsdp2_policy(recipe))
    gather = " (FP8 weights all-gathered in FP8)" if recipe.distributed.fp8_all_gather else ""
    if fp8:
        gather += (
            "; FP8 layers keep scaling state in their state dict, which Accelerate cannot broadcast from rank 0: "
            "every rank must build the same model (same checkpoint or same seed)"
        )
    rt.note(
        f"FSDP2 on {accelerator.num_processes} CPU processes (gloo): Accelerate shards only on GPUs by itself, "
        "so its FSDP2 path was switched on here (decoder layers and the root sharded, sharded checkpoints, "
        f"{describe_policy(recipe)}){gather}"
    )
    return True


def fsdp2_policy(recipe: RecipeSpec) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` from ``distributed.param_dtype`` / ``reduce_dtype``: the dtype weights are
    all-gathered in (None for ``auto``: as stored) and the dtype gradients are reduce-scattered in. The output dtype
    is left alone (the recipe's autocast decides it) and floating inputs are cast to the gathered dtype, as FSDP2
    does by default (torch/distributed/fsdp/_fully_shard/_fsdp_api.py)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtypes = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    d = recipe.distributed
    return MixedPrecisionPolicy(param_dtype=dtypes[d.param_dtype], reduce_dtype=dtypes[d.reduce_dtype])


def describe_policy(recipe: RecipeSpec) -> str:
    """The FSDP2 precision of the run in words, for its notes."""
    d = recipe.distributed
    gather = "as stored" if d.param_dtype == "auto" else f"in {d.param_dtype}"
    return f"weights all-gathered {gather}, gradients reduced in {d.reduce_dtype}"


def fsdp2_policy_on_accelerate(accelerator: Any, recipe: RecipeSpec, rt: Any) -> bool:
    """Where Accelerate built the FSDP2 plugin itself (a GPU launch with an FSDP2 config), put the recipe's
    ``MixedPrecisionPolicy`` in place of the one Accelerate derives from its ``mixed_precision`` (param and reduce
    dtype both BF16 under bf16: ``FullyShardedDataParallelPlugin.set_mixed_precision`` in accelerate/utils/
    dataclasses.py). Before the model is prepared; True when a policy was set."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if recipe.distributed.strategy != "fsdp2" or plugin is None or getattr(plugin, "fsdp_version", 1) != 2:
        return False
    plugin.mixed_precision_policy = fsdp2_policy(recipe)
    rt.note(f"FSDP2 precision from the recipe: {describe_policy(recipe)}")
    return True


def keep_optimizer_params_by_name(accelerator: Any) -> None:
    """Make ``accelerator.prepare(model, optimizer)`` under FSDP2 hand the optimizer the sharded parameter of each of
    its parameters, found by name.

    Accelerate's FSDP2 preparation (``Accelerator._prepare_fsdp2``, ``fsdp2_switch_optimizer_parameters``) finds the
    sharded parameter for each optimizer parameter by ``data_ptr()``. torchao's weights for FP8 all-gather
    (``WeightWithDynamicFloat8CastTensor``) are wrapper tensors whose ``data_ptr()`` is 0, all of them: every FP8
    weight in the optimizer becomes the same sharded parameter and the others are never updated, with no error
    (seen with accelerate 1.15 and torchao 0.18; a Trainer creates its optimizer before preparing the model). The
    names are taken before ``prepare`` and the groups rebuilt from them after it; nothing else changes."""
    from accelerate.utils import fsdp2_canonicalize_names

    prepare = accelerator.prepare

    def prepare_by_name(*args: Any, **kwargs: Any) -> Any:
        model = next((a for a in args if isinstance(a, nn.Module)), None)
        optimizers = [a for a in args if isinstance(a, torch.optim.Optimizer)]
        if model is None or not optimizers:
            return prepare(*args, **kwargs)
        names = {id(p): n for n, p in fsdp2_canonicalize_names(dict(model.named_parameters())).items()}
        before = [[[names.get(id(p)) for p in g["params"]] for g in o.param_groups] for o in optimizers]
        result = prepare(*args, **kwargs)
        prepared = result if isinstance(result, (tuple, list)) else (result,)
        new_model = next(r for r in prepared if isinstance(r, nn.Module))
        sharded = fsdp2_canonicalize_names(dict(new_model.named_parameters()))
        new_opts = [r for r in prepared if isinstance(r, torch.optim.Optimizer)]
        for opt, groups in zip(new_opts, before, strict=True):
            for group, wanted in zip(opt.param_groups, groups, strict=True):
                if None in wanted:  # a parameter the model does not name: leave Accelerate's choice
                    continue
                group["params"] = [sharded[n] for n in wanted]
        return result

    accelerator.prepare = prepare_by_name
