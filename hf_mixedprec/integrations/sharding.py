"""Sharding hf_mixedprec takes care of (the installer, ``integrations/install.py``, decides when): ``distributed.strategy:
fsdp2`` on several CPU processes (gloo), where Accelerate would train as plain data parallel (``accelerate/state.py``
takes its FSDP branch on GPUs only), the recipe's FSDP2 precision policy, and torchao's FP8 all-gather weights."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hf_mixedprec.core._private import (
    ensure_scale_tensor,
    fsdp2_on_cpu,
    fsdp2_possible_on_cpu,
    set_mixed_precision,
)
from hf_mixedprec.core.model_dir import safetensors_files
from hf_mixedprec.recipes.schema import RecipeSpec

#: Accelerate's folders of a sharded (Distributed Checkpoint) model and optimizer in a Trainer checkpoint
#: (``accelerate.utils.constants``: FSDP_MODEL_NAME, OPTIMIZER_NAME; ``save_fsdp_model`` / ``save_fsdp_optimizer``).
SHARDED_MODEL, SHARDED_OPTIMIZER = "pytorch_model_fsdp_0", "optimizer_0"

__all__ = [
    "SHARDED_MODEL",
    "SHARDED_OPTIMIZER",
    "describe_policy",
    "fsdp2_on_cpu_accelerator",
    "fsdp2_policy",
    "fsdp2_policy_on_accelerate",
    "gather_sharded_checkpoint",
    "keep_optimizer_params_by_name",
    "scaler_ready_for_sharded_resume",
    "shard_ready_checkpoint",
    "sharded_ranks",
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
    keep_stored_dtypes(accelerator, recipe, rt)
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
    keep_stored_dtypes(accelerator, recipe, rt)
    return True


def keep_stored_dtypes(accelerator: Any, recipe: RecipeSpec, rt: Any) -> None:
    """Under FSDP2 with BF16 trainable weights (``storage.master`` other than fp32): Accelerate's ``mixed_precision``
    made ``no`` before the model is prepared. Its FSDP2 preparation upcasts every trainable weight that is not FP32
    to FP32 whenever ``mixed_precision`` is not ``no`` (accelerate/utils/fsdp_utils.py, ``fsdp2_prepare_model``),
    which would undo the recipe's storage; under FSDP2 Accelerate autocasts nothing either way (the runtime does)."""
    if recipe.storage.master == "fp32" or accelerator.mixed_precision == "no":
        return
    before = accelerator.mixed_precision
    set_mixed_precision(accelerator, "no")
    rt.note(
        f"storage.master {recipe.storage.master} under FSDP2: Accelerate's mixed_precision {before!r} made 'no' "
        "before the model is prepared (its FSDP2 preparation upcasts trainable BF16 weights to FP32 otherwise); "
        "the recipe's autocast is installed by hf_mixedprec"
    )


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


def sharded_ranks(folder: str | Path) -> int | None:
    """How many ranks wrote the sharded (FSDP) checkpoint ``folder`` (its ``rng_state_<rank>.pth`` files); None when
    ``folder`` holds no sharded model."""
    folder = Path(folder)
    if not (folder / SHARDED_MODEL).is_dir():
        return None
    return max(1, len(list(folder.glob("rng_state_*.pth"))))


def gather_sharded_checkpoint(folder: str | Path, dest: str | Path, groups: list[list[str]] | None = None) -> Path:
    """Write ``dest``: the Trainer checkpoint ``folder`` of a sharded (FSDP) run as an unsharded run writes one, for a
    run that resumes it without FSDP (another world size: one process, or data parallel). Distributed Checkpoint
    reshards as it reads (``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``: every shard of a tensor
    read back into the whole tensor, exactly), so the model becomes ``model.safetensors`` and the optimizer state,
    keyed by parameter name in the checkpoint, becomes ``optimizer.pt`` keyed by position in its parameter groups,
    which is how the unsharded Trainer builds its optimizer (the same groups, the same order). Every other file is
    copied (rank 0's RNG state also as ``rng_state.pth``); ``folder`` is not changed. ``groups``: the parameter
    names of each group of the optimizer that will load it, in order; the checkpoint's groups must be those, else
    ``ValueError`` says where they part."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder, dest = Path(folder), Path(dest)
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for f in folder.iterdir():
        if f.is_file() and f.name != "hf_mixedprec_manifest.json":
            shutil.copy2(f, dest / f.name)
    if (folder / "rng_state_0.pth").is_file():
        shutil.copy2(folder / "rng_state_0.pth", dest / "rng_state.pth")
    whole = dest / ".gathered.pt"
    dcp_to_torch_save(folder / SHARDED_MODEL, whole)
    model = torch.load(whole, weights_only=True)
    model = model.get("model", model)
    save_file({k: v.contiguous().clone() for k, v in model.items() if torch.is_tensor(v)}, dest / "model.safetensors")
    if (folder / SHARDED_OPTIMIZER).is_dir():
        dcp_to_torch_save(folder / SHARDED_OPTIMIZER, whole)
        optim = torch.load(whole, weights_only=True)
        optim = optim.get("optimizer", optim)
        if groups is not None:
            _check_groups([list(g["params"]) for g in optim["param_groups"]], groups)
        order = [name for group in optim["param_groups"] for name in group["params"]]
        index = {name: i for i, name in enumerate(order)}
        positional = [{**g, "params": [index[name] for name in g["params"]]} for g in optim["param_groups"]]
        state = {index[name]: st for name, st in optim["state"].items() if name in index}
        torch.save({"state": state, "param_groups": positional}, dest / "optimizer.pt")
    whole.unlink(missing_ok=True)
    return dest


def _check_group_sizes(saved: list[int], wanted: list[int]) -> None:
    if saved != wanted:
        raise ValueError(f"its optimizer has groups of {saved} parameters, this run's has {wanted}")


def _check_groups(saved: list[list[str]], wanted: list[list[str]]) -> None:
    _check_group_sizes([len(g) for g in saved], [len(g) for g in wanted])
    for g, (mine, theirs) in enumerate(zip(saved, wanted, strict=True)):
        for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            if a != b:
                raise ValueError(f"its optimizer's group {g} holds {a!r} at position {i}, this run's {b!r}")


def shard_ready_checkpoint(
    folder: str | Path, dest: str | Path, model: nn.Module, groups: list[list[str]] | None
) -> Path:
    """Write ``dest``: the Trainer checkpoint ``folder`` of an unsharded run (``model.safetensors``, ``optimizer.pt``)
    as a sharded (FSDP) run writes one, for an FSDP run that resumes it: the model and the optimizer state as
    Distributed Checkpoints of whole tensors (``torch_save_to_dcp``), which each rank's load then cuts into its own
    shards (Distributed Checkpoint reshards as it reads). ``optimizer.pt`` keys its state by position; ``groups``
    names the parameters of each of its groups in that order (how the run groups ``model``'s parameters), and the
    positions are checked against it (counts, and each moment's shape against its parameter's), else
    ``ValueError``. A weight the file leaves out because it is tied to another (``lm_head`` to the embedding) is
    written under both names, as the sharded model's state dict holds both. Every other file is copied (the
    single-process RNG state as rank 0's); ``folder`` is not changed."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

    folder, dest = Path(folder), Path(dest)
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    weights: dict[str, torch.Tensor] = {}
    for f in safetensors_files(folder):
        weights.update(load_file(f))
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, p in params.items():
        if name not in weights:
            twin = next((n for n, q in params.items() if q is p and n in weights), None)
            if twin is not None:
                weights[name] = weights[twin]
    whole = dest / ".whole.pt"
    torch.save({"model": weights}, whole)
    torch_save_to_dcp(whole, dest / SHARDED_MODEL)
    optim_file = folder / "optimizer.pt"
    if optim_file.is_file() and groups is not None:
        saved = torch.load(optim_file, weights_only=True, map_location="cpu")
        _check_group_sizes([len(g["params"]) for g in saved["param_groups"]], [len(g) for g in groups])
        state: dict[str, Any] = {}
        for group, names in zip(saved["param_groups"], groups, strict=True):
            for index, name in zip(group["params"], names, strict=True):
                st = saved["state"].get(index)
                if st is None:
                    continue
                shape = tuple(params[name].shape)
                for key, value in st.items():
                    if torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) != shape:
                        raise ValueError(
                            f"its optimizer state {key!r} at position {index} has shape "
                            f"{tuple(value.shape)}, this run's parameter there ({name}) {shape}"
                        )
                state[name] = st
        param_groups = [{**g, "params": list(names)} for g, names in zip(saved["param_groups"], groups, strict=True)]
        torch.save({"optimizer": {"state": state, "param_groups": param_groups}}, whole)
        torch_save_to_dcp(whole, dest / SHARDED_OPTIMIZER)
    whole.unlink(missing_ok=True)
    skip = {"hf_mixedprec_manifest.json", "optimizer.pt"} | {Path(f).name for f in safetensors_files(folder)}
    for f in folder.iterdir():
        if f.is_file() and f.name not in skip and f.name != "model.safetensors.index.json":
            shutil.copy2(f, dest / f.name)
    if (folder / "rng_state.pth").is_file():
        shutil.copy2(folder / "rng_state.pth", dest / "rng_state_0.pth")
    return dest
