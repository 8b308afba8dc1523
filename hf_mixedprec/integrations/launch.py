"""Recipe -> ``accelerate launch`` config, and the ``hf-mixedprec launch`` command line.

Key names are Accelerate's own (``fp8_config`` keys are the ones its launcher turns into
``ACCELERATE_FP8_*`` variables that ``TERecipeKwargs`` reads: ``fp8_format``, ``amax_history_len``,
``amax_compute_algo``, ``margin``, ``use_mxfp8_block_scaling``). Accelerate 1.15 can build only TE's
``DelayedScaling`` and ``MXFP8BlockScaling``; for current and blockwise scaling, and for the torchao and
emulated backends, the config asks Accelerate for BF16 and hf_mixedprec applies FP8 itself in the child
(from the recipe exported in ``HF_MIXEDPREC_RECIPE``). The config's header says which case applies.

Several processes on a machine without CUDA are started with ``torch.distributed.run`` instead of
``accelerate launch``: Accelerate 1.15 sends ``--cpu`` and ``MULTI_CPU`` jobs to its simple launcher, which
starts exactly one process unless given an MPI hostfile (``--mpirun_hostfile``), so ``--num_processes 2`` ran
one process. ``torch.distributed.run`` starts the ranks on loopback and exports ``RANK``/``WORLD_SIZE``/
``LOCAL_RANK``; with ``ACCELERATE_USE_CPU=true`` Accelerate's state then picks ``MULTI_CPU`` over gloo.

Either launcher runs through ``python -m hf_mixedprec.core._launcher -m MODULE ...`` (:data:`LAUNCHER`), so that
``hf-mixedprec launch`` exits with the training script's own exit code instead of the launchers' 1.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hf_mixedprec.core.errors import UsageError
from hf_mixedprec.fp8.transformer_engine import accelerate_fp8_config
from hf_mixedprec.integrations.deepspeed import deepspeed_config
from hf_mixedprec.recipes.schema import ACCELERATE_MIXED_PRECISION, RECIPE_ENV, RecipeSpec

__all__ = [
    "LAUNCHER",
    "LaunchPlan",
    "accelerate_config",
    "fp8_via_accelerate",
    "plan_launch",
    "stop_env",
    "uses_torch_distributed_run",
]

_DIST_TYPE = {"none": "NO", "ddp": "MULTI_GPU", "fsdp2": "FSDP", "deepspeed": "DEEPSPEED"}

#: Every launch runs its launcher module through hf_mixedprec.core._launcher, which exits with the training
#: script's own exit code (the launchers turn any failure into 1).
LAUNCHER = (sys.executable, "-m", "hf_mixedprec.core._launcher")


def _te_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def fp8_via_accelerate(recipe: RecipeSpec) -> bool:
    """True when Accelerate's own FP8 path (TE) builds exactly this recipe's scaling (never for a phased recipe:
    Accelerate's FP8 would hold for the whole run, and the phases switch it in the training process). ``auto``
    means TE only where TE is installed; elsewhere it resolves to another backend (native, torchao) that
    hf_mixedprec applies in the training process, and Accelerate's TE path would fail in ``prepare``."""
    fp8 = recipe.fp8
    return (
        recipe.phases is None
        and recipe.distributed.strategy != "deepspeed"  # DeepSpeed runs FP32; our layers and autocast do FP8
        and recipe.precision == "fp8"
        and fp8 is not None
        and (fp8.backend == "transformer_engine" or (fp8.backend == "auto" and _te_installed()))
        and fp8.scaling in ("delayed", "mxfp8")
    )


def accelerate_config(
    recipe: RecipeSpec,
    *,
    num_processes: int | None = None,
    deepspeed_config_file: str | None = None,
    num_machines: int | None = None,
    machine_rank: int = 0,
    main_process_ip: str | None = None,
    main_process_port: int | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """The ``accelerate launch --config_file`` mapping for ``recipe``, and notes on choices made.

    For several machines (``num_machines`` or ``distributed.num_machines`` > 1) every machine runs the same
    launch with its own ``machine_rank``; ``main_process_ip``/``main_process_port`` name machine 0, as in
    Accelerate's own config keys.
    """
    dist = recipe.distributed
    nproc = num_processes if num_processes is not None else dist.num_processes
    machines = num_machines if num_machines is not None else dist.num_machines
    notes: list[str] = []
    strategy = dist.strategy
    dist_type = _DIST_TYPE[strategy]
    if strategy == "none" and nproc > 1:
        dist_type = "MULTI_GPU"
        notes.append(f"{nproc} processes with distributed.strategy none: plain data parallel (DDP), no sharding")
    mixed = "fp8" if fp8_via_accelerate(recipe) else ACCELERATE_MIXED_PRECISION[recipe.autocast_precision()]
    cfg: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": dist_type,
        "downcast_bf16": "no",
        "machine_rank": machine_rank,
        "main_training_function": "main",
        "mixed_precision": mixed,
        "num_machines": machines,
        "num_processes": nproc,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    }
    if main_process_ip is not None:
        cfg["main_process_ip"] = main_process_ip
    if main_process_port is not None:
        cfg["main_process_port"] = main_process_port
    _add_fp8_section(cfg, recipe, notes)
    _add_strategy_section(cfg, recipe, deepspeed_config_file)
    return cfg, notes


def _add_fp8_section(cfg: dict[str, Any], recipe: RecipeSpec, notes: list[str]) -> None:
    """Accelerate's ``fp8_config`` (Transformer Engine) where Accelerate can build the recipe's FP8, else a note."""
    fp8 = recipe.fp8
    if recipe.precision != "fp8" or fp8 is None or recipe.distributed.strategy == "deepspeed":
        return  # under DeepSpeed the FP8 layers are always ours (deepspeed_config says so in its note)
    if cfg["mixed_precision"] != "fp8":
        why = " (Transformer Engine is not installed here)" if fp8.backend == "auto" and not _te_installed() else ""
        notes.append(
            f"Accelerate cannot build fp8.scaling {fp8.scaling!r} with backend {fp8.backend!r}{why}: it runs in BF16 "
            "and hf_mixedprec applies FP8 in the training process from the recipe"
        )
        return
    cfg["fp8_config"] = accelerate_fp8_config(recipe)


def _add_strategy_section(cfg: dict[str, Any], recipe: RecipeSpec, deepspeed_config_file: str | None) -> None:
    """FSDP2's or DeepSpeed's section of the Accelerate config."""
    strategy = recipe.distributed.strategy
    if strategy == "fsdp2":
        cfg["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_reshard_after_forward": True,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            # rank 0 loads and broadcasts the weights; Accelerate's loader takes every state-dict entry for a
            # sharded parameter, so FP8 layers' scaling buffers (and torchao's FP8 weights) cannot go through it
            "fsdp_cpu_ram_efficient_loading": "fp8" not in recipe.precisions(),
            "fsdp_offload_params": False,
            "fsdp_activation_checkpointing": False,
        }
    elif strategy == "deepspeed":
        if deepspeed_config_file is None:
            raise ValueError("a DeepSpeed strategy needs the path of the generated DeepSpeed config")
        cfg["deepspeed_config"] = {
            "deepspeed_config_file": deepspeed_config_file,
            "zero3_init_flag": bool(recipe.distributed.zero3_init),
        }
        # With a DeepSpeed config file, Accelerate takes precision from the file.
        cfg.pop("mixed_precision")


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


def uses_torch_distributed_run(recipe: RecipeSpec, num_processes: int, device_type: str) -> bool:
    """True when the launch goes through ``torch.distributed.run`` rather than ``accelerate launch``.

    That is several data-parallel processes on one machine without CUDA: Accelerate's launcher would start
    only one of them (see the module docstring). DeepSpeed, FSDP and multi-machine launches keep
    ``accelerate launch``.
    """
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type {device_type!r} is not supported (allowed: 'cpu', 'cuda')")
    return (
        device_type == "cpu"
        and num_processes > 1
        and recipe.distributed.strategy in ("none", "ddp")
        and recipe.distributed.num_machines == 1
    )


def _detect_device_type() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _loopback_ifname() -> str | None:
    """The network interface holding 127.0.0.1 (``lo`` on Linux, ``lo0`` on macOS), for gloo; None if unknown."""
    try:
        import psutil  # an Accelerate dependency

        for name, addrs in psutil.net_if_addrs().items():
            if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addrs):
                return name
    except Exception:
        return None
    return None


def _cpu_threads_per_process(num_processes: int) -> int:
    """What ``accelerate launch`` gives each CPU process: physical cores shared out (torch.distributed.run gives 1)."""
    try:
        import psutil

        cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    except ImportError:
        cores = os.cpu_count() or 1
    return max(1, cores // num_processes)


#: Launched scripts of the package that moved, by their old path: ``hf-mixedprec launch`` takes the old path still.
MOVED_SCRIPTS = {"hf_mixedprec/finetune.py": "hf_mixedprec/cli/finetune.py"}


def moved_script(script: str) -> tuple[str, str | None]:
    """``script``, or where it moved to when it is a moved script of the package that is not there any more, with a
    note saying so (None when it did not move)."""
    if Path(script).is_file():
        return script, None
    tail = Path(script).as_posix()
    for old, new in MOVED_SCRIPTS.items():
        if tail == old or tail.endswith("/" + old):
            moved = tail[: len(tail) - len(old)] + new
            return moved, f"{old} moved to {new}: launching that (change the command to it)"
    return script, None


def script_argv(script: str) -> list[str]:
    """How a launcher is handed ``script``: a script of this package as its module (``--module
    hf_mixedprec.cli.finetune``: run as ``python -m`` does, so its folder does not go first on ``sys.path``), any
    other as its path. ``accelerate launch`` and ``torch.distributed.run`` both take ``--module``."""
    package = Path(__file__).resolve().parent.parent
    path = Path(script).resolve()
    if path.suffix == ".py" and path.is_relative_to(package) and path.is_file():
        parts = path.relative_to(package.parent).with_suffix("").parts
        return ["--module", ".".join(parts)]
    return [script]


def plan_launch(
    recipe: RecipeSpec,
    script: str,
    script_args: list[str],
    *,
    config_dir: str,
    num_processes: int | None = None,
    device_type: str | None = None,
    master_port: int | None = None,
    num_machines: int | None = None,
    machine_rank: int = 0,
    main_process_ip: str | None = None,
    main_process_port: int | None = None,
) -> LaunchPlan:
    """Plan the launch of ``script`` under ``recipe``: config files, argv and child env.

    ``device_type`` (``"cuda"`` or ``"cpu"``; default: ``"cuda"`` when ``torch.cuda.is_available()``) decides
    the launcher: ``accelerate launch --config_file`` normally, ``torch.distributed.run`` for several processes
    without CUDA (:func:`uses_torch_distributed_run`). ``master_port`` is the loopback rendezvous port of the
    latter (default: a free one).
    """
    if device_type is None:
        device_type = _detect_device_type()
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
        recipe,
        num_processes=num_processes,
        deepspeed_config_file=str(ds_path) if ds_path else None,
        num_machines=num_machines,
        machine_rank=machine_rank,
        main_process_ip=main_process_ip,
        main_process_port=main_process_port,
    )
    notes += acc_notes
    nproc = int(acc_cfg["num_processes"])
    if device_type == "cpu" and recipe.distributed.strategy == "fsdp2":
        notes.append(
            "FSDP2 on CPU processes: Accelerate shards only on GPUs by itself; hf_mixedprec's Trainer callback "
            "(finetune, a Trainer with recipe.callbacks()) and recipe.accelerator() switch its FSDP2 path on in each "
            "process; a script with a plain Accelerator trains as plain data parallel (no sharding) here"
        )
    env = {RECIPE_ENV: str(recipe_path)}
    if not uses_torch_distributed_run(recipe, nproc, device_type):
        title = f"accelerate launch config for recipe {recipe.name!r}"
        command = [
            *LAUNCHER, "-m", "accelerate.commands.launch", "--config_file", str(acc_path),
            *script_argv(script), *script_args,
        ]  # fmt: skip
    else:
        title = f"Accelerate settings for recipe {recipe.name!r} (exported as ACCELERATE_* variables)"
        command = _cpu_processes(acc_cfg, env, notes, nproc, master_port, script, script_args)
    header = "".join(f"# {line}\n" for line in [title, *notes])
    files[str(acc_path)] = header + yaml.safe_dump(acc_cfg, sort_keys=False)
    launched = recipe.distributed.model_copy(update={"num_processes": nproc, "num_machines": acc_cfg["num_machines"]})
    files[str(recipe_path)] = recipe.model_copy(update={"distributed": launched}).to_yaml()
    return LaunchPlan(command, env, files, notes)


def _cpu_processes(
    acc_cfg: dict[str, Any],
    env: dict[str, str],
    notes: list[str],
    nproc: int,
    master_port: int | None,
    script: str,
    script_args: list[str],
) -> list[str]:
    """Several CPU processes: the ``torch.distributed.run`` command, with Accelerate's settings moved into the
    child environment (``acc_cfg``, ``env`` and ``notes`` are updated in place)."""
    acc_cfg.update(distributed_type="MULTI_CPU", use_cpu=True)
    if acc_cfg.get("mixed_precision") == "fp8":
        # no FP8 hardware here: the training processes run the recipe's FP8 emulated (rehearsal) in BF16
        # autocast, so Accelerate must not be asked for Transformer Engine FP8
        acc_cfg["mixed_precision"] = "bf16"
        acc_cfg.pop("fp8_config", None)
        notes.append("no CUDA device: Accelerate gets mixed_precision bf16; FP8 runs emulated (rehearsal)")
    notes.append(
        f"no CUDA device: {nproc} CPU processes are started with torch.distributed.run (gloo, loopback "
        "127.0.0.1), not accelerate launch, whose launcher starts only one process for --cpu/MULTI_CPU "
        "unless given an MPI hostfile; ACCELERATE_USE_CPU=true makes Accelerate in each process pick "
        "MULTI_CPU, and ACCELERATE_MIXED_PRECISION carries this file's mixed_precision"
    )
    port = master_port if master_port is not None else _free_loopback_port()
    env["ACCELERATE_USE_CPU"] = "true"
    env["ACCELERATE_MIXED_PRECISION"] = str(acc_cfg.get("mixed_precision", "no"))
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(_cpu_threads_per_process(nproc))
    ifname = _loopback_ifname()
    if ifname is not None and "GLOO_SOCKET_IFNAME" not in os.environ:
        env["GLOO_SOCKET_IFNAME"] = ifname
    return [
        *LAUNCHER, "-m", "torch.distributed.run",
        "--nnodes", "1",
        "--nproc_per_node", str(nproc),
        "--master_addr", "127.0.0.1",
        "--master_port", str(port),
        *script_argv(script), *script_args,
    ]  # fmt: skip


def stop_env(grace_s: float) -> dict[str, str]:
    """The launcher's environment for stopping a job (``--grace-s``): torch.distributed.run leaves SIGINT and SIGTERM
    to :mod:`hf_mixedprec.core._launcher`, which forwards them to the ranks once, instead of its own shutdown
    (``PET_SIGNALS_TO_HANDLE``, the user's own list kept but for those two); ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, read by
    torch.distributed.launcher.api, bounds its own shutdown after a signal it handles. (When one rank ends and it
    stops the others, it waits 30 s whatever this says: every rank leaves a checkpoint save only after its manifest
    is written, so no rank is stopped in the middle of one.)"""
    if not grace_s > 0:
        raise UsageError(f"--grace-s: {grace_s:g} is out of range (allowed: > 0 seconds)")
    mine = os.environ.get("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")  # a user's own list (SIGUSR1)
    kept = [s.strip() for s in mine.split(",") if s.strip() and s.strip() not in ("SIGTERM", "SIGINT")]
    return {"PET_SIGNALS_TO_HANDLE": ",".join(kept), "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(max(1, round(grace_s)))}


def child_env(plan: LaunchPlan) -> dict[str, str]:
    env = dict(os.environ)
    env.update(plan.env)
    return env
