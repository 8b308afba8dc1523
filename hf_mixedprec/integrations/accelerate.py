"""Recipe -> ``accelerate launch`` config, and the ``hf-mixedprec launch`` command line.

Key names are Accelerate's own (``fp8_config`` keys are the ones its launcher turns into
``ACCELERATE_FP8_*`` variables that ``TERecipeKwargs`` reads: ``fp8_format``, ``amax_history_len``,
``amax_compute_algo``, ``margin``, ``use_mxfp8_block_scaling``). Accelerate 1.15 can build only TE's
``DelayedScaling`` and ``MXFP8BlockScaling``; for current and blockwise scaling, and for the torchao and
emulated backends, the config asks Accelerate for BF16 and hf_mixedprec applies FP8 itself in the child
(from the recipe exported in ``HF_MIXEDPREC_RECIPE``). The config's header says which case applies.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hf_mixedprec.integrations.deepspeed import deepspeed_config
from hf_mixedprec.recipe import RECIPE_ENV, Recipe

__all__ = ["LaunchPlan", "accelerate_config", "fp8_via_accelerate", "plan_launch"]

_DIST_TYPE = {"none": "NO", "ddp": "MULTI_GPU", "fsdp2": "FSDP", "deepspeed": "DEEPSPEED"}


def fp8_via_accelerate(recipe: Recipe) -> bool:
    """True when Accelerate's own FP8 path (TE) builds exactly this recipe's scaling."""
    fp8 = recipe.fp8
    return (
        recipe.precision == "fp8"
        and fp8 is not None
        and fp8.backend in ("auto", "transformer_engine")
        and fp8.scaling in ("delayed", "mxfp8")
    )


def accelerate_config(
    recipe: Recipe, *, num_processes: int | None = None, deepspeed_config_file: str | None = None
) -> tuple[dict[str, Any], list[str]]:
    """The ``accelerate launch --config_file`` mapping for ``recipe``, and notes on choices made."""
    dist = recipe.distributed
    nproc = num_processes if num_processes is not None else dist.num_processes
    notes: list[str] = []
    strategy = dist.strategy
    dist_type = _DIST_TYPE[strategy]
    if strategy == "none" and nproc > 1:
        dist_type = "MULTI_GPU"
        notes.append(f"{nproc} processes with distributed.strategy none: plain data parallel (DDP), no sharding")
    if recipe.precision == "fp8":
        mixed = "fp8" if fp8_via_accelerate(recipe) else "bf16"
    else:
        mixed = {"fp32": "no", "fp16": "fp16", "bf16": "bf16"}[recipe.precision]
    cfg: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": dist_type,
        "downcast_bf16": "no",
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": mixed,
        "num_machines": dist.num_machines,
        "num_processes": nproc,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    }
    if recipe.precision == "fp8" and recipe.fp8 is not None:
        fp8 = recipe.fp8
        if mixed == "fp8":
            fp8_cfg: dict[str, Any] = {"backend": "TE", "fp8_format": fp8.format, "use_autocast_during_eval": False}
            if fp8.scaling == "delayed":
                fp8_cfg.update(
                    amax_history_len=fp8.amax_history_len, amax_compute_algo=fp8.amax_compute_algo, margin=fp8.margin
                )
            else:
                fp8_cfg.update(margin=fp8.margin, use_mxfp8_block_scaling=True)
            cfg["fp8_config"] = fp8_cfg
        else:
            notes.append(
                f"Accelerate cannot build fp8.scaling {fp8.scaling!r} with backend {fp8.backend!r}: it runs in BF16 and "
                "hf_mixedprec applies FP8 in the training process from the recipe"
            )
    if strategy == "fsdp2":
        cfg["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_reshard_after_forward": True,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_offload_params": False,
            "fsdp_activation_checkpointing": False,
        }
    elif strategy == "deepspeed":
        if deepspeed_config_file is None:
            raise ValueError("a DeepSpeed strategy needs the path of the generated DeepSpeed config")
        cfg["deepspeed_config"] = {"deepspeed_config_file": deepspeed_config_file, "zero3_init_flag": False}
        # With a DeepSpeed config file, Accelerate takes precision from the file.
        cfg.pop("mixed_precision")
    return cfg, notes


@dataclass
class LaunchPlan:
    """Everything ``hf-mixedprec launch`` writes and runs."""

    command: list[str]
    env: dict[str, str]
    files: dict[str, str]  # path -> text
    notes: list[str] = field(default_factory=list)

    def write(self) -> None:
        for path, text in self.files.items():
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text, encoding="utf-8")


def plan_launch(
    recipe: Recipe, script: str, script_args: list[str], *, config_dir: str, num_processes: int | None = None
) -> LaunchPlan:
    """Plan an ``accelerate launch`` of ``script`` under ``recipe``: config files, argv and child env."""
    cdir = Path(config_dir).resolve()
    recipe_path = cdir / "recipe.yaml"
    acc_path = cdir / "accelerate_config.yaml"
    files: dict[str, str] = {}
    notes: list[str] = []
    ds_path = None
    if recipe.distributed.strategy == "deepspeed":
        ds_cfg, ds_notes = deepspeed_config(recipe)
        ds_path = cdir / "deepspeed_config.json"
        files[str(ds_path)] = json.dumps(ds_cfg, indent=2) + "\n"
        notes += ds_notes
    acc_cfg, acc_notes = accelerate_config(
        recipe, num_processes=num_processes, deepspeed_config_file=str(ds_path) if ds_path else None
    )
    notes += acc_notes
    header = "".join(f"# {line}\n" for line in [f"accelerate launch config for recipe {recipe.name!r}", *notes])
    files[str(acc_path)] = header + yaml.safe_dump(acc_cfg, sort_keys=False)
    files[str(recipe_path)] = recipe.to_yaml()
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(acc_path), script, *script_args]
    env = {RECIPE_ENV: str(recipe_path)}
    return LaunchPlan(command, env, files, notes)


def child_env(plan: LaunchPlan) -> dict[str, str]:
    env = dict(os.environ)
    env.update(plan.env)
    return env
