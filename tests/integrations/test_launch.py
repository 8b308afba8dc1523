"""`hf-mixedprec launch`: configs match the recipe key for key, read back through Accelerate's own launcher."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hf_mixedprec.integrations.launch import plan_launch
from hf_mixedprec.integrations.recipe import RECIPE_ENV, load_recipe_file, resolve_recipe


def _variant(tmp_path: Path, base: str, name: str, extra: str) -> Path:
    p = tmp_path / f"{name}.yaml"
    p.write_text(f"name: {name}\nextends: {base}\n{extra}")
    return p


def _dry_run(*args: str) -> dict[str, str]:
    """Run the CLI's dry run and split its output into the command, env and files."""
    r = subprocess.run(
        [sys.executable, "-m", "hf_mixedprec.cli", "launch", *args], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    sections: dict[str, str] = {}
    current = None
    for line in r.stdout.splitlines(keepends=True):
        if line.startswith("# command") or line.startswith("# environment") or line.startswith("# file: "):
            current = line[2:].strip()
            sections[current] = ""
        else:
            sections[current] += line
    return sections


def _accelerate_env(config_file: str) -> dict[str, str]:
    """What `accelerate launch --config_file` would export, computed by Accelerate's own code."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import (
        prepare_deepspeed_cmd_env,
        prepare_multi_gpu_env,
        prepare_simple_launcher_cmd_env,
    )

    args = launch_command_parser().parse_args(["--config_file", config_file, "train.py"])
    args, defaults, mp_from_config = _validate_launch_command(args)
    if args.use_deepspeed:
        fields = list(defaults.deepspeed_config.keys()) + (["mixed_precision"] if mp_from_config else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        _, env = prepare_deepspeed_cmd_env(args)
    elif args.multi_gpu or args.use_fsdp:
        env = prepare_multi_gpu_env(args)
    else:
        _, env = prepare_simple_launcher_cmd_env(args)
    return env


def test_h100_fp8_delayed_dry_run(tmp_path):
    """A recipe naming Transformer Engine goes to Accelerate's own FP8 path (fp8_config with the recipe's scaling)."""
    te = tmp_path / "te-delayed.yaml"
    te.write_text("name: te-delayed\nextends: h100-fp8-delayed\nfp8: {backend: transformer_engine}\n")
    sections = _dry_run("--recipe", str(te), "--config-dir", str(tmp_path), "--dry-run", "train.py", "--lr", "1")
    cmd = sections["command"].strip()
    assert cmd.endswith(
        f"-m accelerate.commands.launch --config_file {tmp_path}/accelerate_config.yaml train.py --lr 1"
    )
    assert sections["environment"].strip().splitlines() == [
        f"{RECIPE_ENV}={tmp_path}/recipe.yaml",
        "PET_SIGNALS_TO_HANDLE=SIGHUP,SIGQUIT",
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=120",
    ]
    acc = yaml.safe_load(sections[f"file: {tmp_path}/accelerate_config.yaml"])
    recipe = load_recipe_file(te)
    assert acc["mixed_precision"] == "fp8" and acc["distributed_type"] == "NO" and acc["num_processes"] == 1
    fp8 = acc["fp8_config"]
    assert fp8["backend"] == "TE"
    assert fp8["fp8_format"] == recipe.fp8.format
    assert fp8["amax_history_len"] == recipe.fp8.amax_history_len
    assert fp8["amax_compute_algo"] == recipe.fp8.amax_compute_algo
    assert fp8["margin"] == recipe.fp8.margin
    exported = yaml.safe_load(sections[f"file: {tmp_path}/recipe.yaml"])
    assert exported == recipe.to_dict()
    assert not (tmp_path / "accelerate_config.yaml").exists(), "a dry run writes nothing"


def test_h100_fp8_delayed_through_accelerates_launcher(tmp_path, monkeypatch):
    from hf_mixedprec.integrations import launch

    monkeypatch.setattr(launch, "_te_installed", lambda: True)  # auto -> Accelerate's TE path where TE is installed
    recipe = load_recipe_file("h100-fp8-delayed")
    plan = plan_launch(recipe, "train.py", [], config_dir=str(tmp_path))
    plan.write()
    env = _accelerate_env(str(tmp_path / "accelerate_config.yaml"))
    assert env["ACCELERATE_MIXED_PRECISION"] == "fp8"
    assert env["ACCELERATE_FP8_BACKEND"] == "TE"
    assert env["ACCELERATE_FP8_FORMAT"] == "HYBRID"
    assert env["ACCELERATE_FP8_AMAX_HISTORY_LEN"] == "1024"
    assert env["ACCELERATE_FP8_AMAX_COMPUTE_ALGO"] == "max"
    assert env["ACCELERATE_FP8_MARGIN"] == "0"


def test_deepspeed_zero2_fp16_variant_of_v100(tmp_path):
    src = _variant(
        tmp_path, "v100-fp16", "v100-zero2", "distributed: {strategy: deepspeed, zero_stage: 2, num_processes: 4}\n"
    )
    out = tmp_path / "cfg"
    sections = _dry_run("--recipe", str(src), "--config-dir", str(out), "--dry-run", "train.py")
    acc = yaml.safe_load(sections[f"file: {out}/accelerate_config.yaml"])
    ds = json.loads(sections[f"file: {out}/deepspeed_config.json"])
    recipe = load_recipe_file(src)
    ls = recipe.loss_scale
    assert acc["distributed_type"] == "DEEPSPEED" and acc["num_processes"] == 4
    assert acc["deepspeed_config"]["deepspeed_config_file"] == f"{out}/deepspeed_config.json"
    assert "mixed_precision" not in acc  # DeepSpeed takes precision from its own file
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["fp16"] == {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": int(math.log2(ls.init_scale)),
        "loss_scale_window": ls.growth_interval,
        "hysteresis": ls.hysteresis,
        "min_loss_scale": ls.min_scale,
    }
    assert ds["bf16"] == {"enabled": False}
    # ZeRO-2: the recipe's ZClip decides DeepSpeed's clipping in the training process, nothing falls back
    assert "FALLBACK" not in sections[f"file: {out}/accelerate_config.yaml"]
    assert ds["gradient_clipping"] == 1.0
    # Accelerate's launcher accepts it
    plan = plan_launch(recipe, "train.py", [], config_dir=str(out))
    plan.write()
    env = _accelerate_env(str(out / "accelerate_config.yaml"))
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true"
    assert env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == str(out / "deepspeed_config.json")


def test_fsdp2_variant_of_a100(tmp_path):
    src = _variant(tmp_path, "a100-bf16", "a100-fsdp2", "distributed: {strategy: fsdp2, num_processes: 8}\n")
    out = tmp_path / "cfg"
    sections = _dry_run("--recipe", str(src), "--config-dir", str(out), "--dry-run", "train.py")
    acc = yaml.safe_load(sections[f"file: {out}/accelerate_config.yaml"])
    assert acc["distributed_type"] == "FSDP" and acc["num_processes"] == 8 and acc["mixed_precision"] == "bf16"
    assert acc["fsdp_config"]["fsdp_version"] == 2
    plan = plan_launch(load_recipe_file(src), "train.py", [], config_dir=str(out))
    plan.write()
    env = _accelerate_env(str(out / "accelerate_config.yaml"))
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"


@pytest.mark.parametrize("name", ["h100-fp8-current", "h100-fp8-blockwise"])
def test_fp8_accelerate_cannot_build_runs_bf16_and_says_so(tmp_path, name):
    plan = plan_launch(load_recipe_file(name), "t.py", [], config_dir=str(tmp_path))
    text = plan.files[str(tmp_path / "accelerate_config.yaml")]
    acc = yaml.safe_load(text)
    assert acc["mixed_precision"] == "bf16" and "fp8_config" not in acc
    assert "hf_mixedprec applies FP8 in the training process" in text


def test_auto_without_transformer_engine_is_not_handed_to_accelerates_te_path(tmp_path, monkeypatch):
    """``fp8.backend: auto`` where TE is not installed resolves to a backend hf_mixedprec applies itself (native,
    torchao); Accelerate's TE path would fail in ``prepare``, so the launch runs BF16 and says why."""
    from hf_mixedprec.integrations import launch

    monkeypatch.setattr(launch, "_te_installed", lambda: False)
    plan = plan_launch(load_recipe_file("h100-fp8-delayed"), "t.py", [], config_dir=str(tmp_path))
    text = plan.files[str(tmp_path / "accelerate_config.yaml")]
    acc = yaml.safe_load(text)
    assert acc["mixed_precision"] == "bf16" and "fp8_config" not in acc
    assert "(Transformer Engine is not installed here)" in text
    monkeypatch.setattr(launch, "_te_installed", lambda: True)
    assert launch.fp8_via_accelerate(load_recipe_file("h100-fp8-delayed"))


def test_mxfp8_config(monkeypatch):
    from hf_mixedprec.integrations import launch

    monkeypatch.setattr(launch, "_te_installed", lambda: True)  # auto -> TE where TE is installed
    acc = plan_launch(load_recipe_file("b200-mxfp8"), "t.py", [], config_dir="/tmp/x").files[
        "/tmp/x/accelerate_config.yaml"
    ]
    fp8 = yaml.safe_load(acc)["fp8_config"]
    assert fp8 == {
        "backend": "TE",
        "fp8_format": "E4M3",
        "use_autocast_during_eval": False,
        "margin": 0,
        "use_mxfp8_block_scaling": True,
    }


def test_num_processes_flag_overrides_recipe():
    r = resolve_recipe({"name": "x", "precision": "bf16"})
    plan = plan_launch(r, "t.py", [], config_dir="/tmp/y", num_processes=2, device_type="cuda")
    acc = yaml.safe_load(plan.files["/tmp/y/accelerate_config.yaml"])
    assert acc["num_processes"] == 2 and acc["distributed_type"] == "MULTI_GPU"


def test_launch_on_several_machines_dry_run(capsys, monkeypatch):
    from hf_mixedprec.cli.app import main
    from hf_mixedprec.integrations import launch

    monkeypatch.setattr(launch, "_te_installed", lambda: True)  # the machines have TE: auto -> Accelerate's TE

    argv = ["launch", "--recipe", "h100-fp8-delayed", "--num-processes", "16", "--num-machines", "2"]
    argv += ["--machine-rank", "1", "--main-process-ip", "10.0.0.1", "--main-process-port", "29500"]
    assert main([*argv, "--device", "cuda", "--dry-run", "train.py"]) == 0
    out = capsys.readouterr().out
    acc = yaml.safe_load(out.split("accelerate_config.yaml\n", 1)[1].split("# file:")[0])
    assert (acc["num_machines"], acc["machine_rank"], acc["num_processes"]) == (2, 1, 16)
    assert (acc["main_process_ip"], acc["main_process_port"]) == ("10.0.0.1", 29500)
    assert acc["distributed_type"] == "MULTI_GPU" and acc["mixed_precision"] == "fp8"
    exported = yaml.safe_load(out.split("recipe.yaml\n", 2)[2])
    assert exported["distributed"]["num_processes"] == 16 and exported["distributed"]["num_machines"] == 2


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--num-machines", "2"], "--main-process-ip: required for 2 machines"),
        (["--num-machines", "2", "--main-process-ip", "h", "--machine-rank", "2"], "--machine-rank: 2 is out of range"),
        (["--main-process-port", "70000"], "--main-process-port: 70000 is out of range (allowed: 1 to 65535)"),
        (["--device", "cuda"], "--device: only plans a launch for other hardware (allowed: with --dry-run)"),
        (["--grace-s", "0"], "--grace-s: 0 is out of range (allowed: > 0 seconds)"),
        (["--grace-s", "nan"], "--grace-s: nan is out of range (allowed: > 0 seconds)"),
    ],
)
def test_launch_multi_machine_mistakes(capsys, extra, message, tmp_path):
    from hf_mixedprec.cli.app import main

    script = tmp_path / "train.py"
    script.write_text("")
    assert main(["launch", "--recipe", "cpu-bf16", *extra, str(script)]) == 2
    assert message in capsys.readouterr().err


def test_rehearsed_fp8_on_cpu_does_not_ask_accelerate_for_te_fp8(capsys):
    from hf_mixedprec.cli.app import main

    argv = ["launch", "--recipe", "h100-fp8-delayed", "--rehearse", "--num-processes", "2"]
    assert main([*argv, "--device", "cpu", "--dry-run", "train.py"]) == 0
    out = capsys.readouterr().out
    assert "ACCELERATE_MIXED_PRECISION=bf16" in out and "fp8_config" not in out


@pytest.mark.parametrize("flag", [False, True])
def test_zero3_init_reaches_accelerate(tmp_path, flag):
    """distributed.zero3_init is Accelerate's zero3_init_flag; its launcher exports it to the processes."""
    extra = f"distributed: {{strategy: deepspeed, zero_stage: 3, zero3_init: {str(flag).lower()}, num_processes: 2}}\n"
    recipe = load_recipe_file(_variant(tmp_path, "a100-bf16", "a100-zero3", extra))
    assert recipe.distributed.zero3_init is flag
    plan = plan_launch(recipe, "train.py", [], config_dir=str(tmp_path / "cfg"), device_type="cuda")
    plan.write()
    acc = yaml.safe_load((tmp_path / "cfg" / "accelerate_config.yaml").read_text())
    assert acc["deepspeed_config"]["zero3_init_flag"] is flag
    env = _accelerate_env(str(tmp_path / "cfg" / "accelerate_config.yaml"))
    assert env["ACCELERATE_DEEPSPEED_ZERO3_INIT"] == str(flag).lower()
    ds = json.loads((tmp_path / "cfg" / "deepspeed_config.json").read_text())
    assert ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True


@pytest.mark.parametrize(
    "distributed,message",
    [
        (
            "{strategy: deepspeed, zero_stage: 2, zero3_init: true}",
            "only applies to strategy deepspeed with zero_stage 3 (zero_stage is 2)",
        ),
        ("{strategy: deepspeed, zero3_init: yes}", "(zero_stage is 1)"),  # the default stage; YAML's yes is true
        ("{zero3_init: true}", "(strategy is 'none')"),
        ("{strategy: deepspeed, zero_stage: 3, zero3_init: sometimes}", "input should be a valid boolean"),
    ],
)
def test_zero3_init_mistakes(tmp_path, capsys, distributed, message):
    from hf_mixedprec.cli.app import main

    path = _variant(tmp_path, "a100-bf16", "bad", f"distributed: {distributed}\n")
    assert main(["validate", str(path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{path}: distributed.zero3_init: "), lines
    assert message in lines[0]


@pytest.mark.parametrize(
    "exitcodes,code,line",
    [
        ({0: -15, 1: 2}, 2, "rank 1 exited with code 2 (also: rank 0 was killed by SIGTERM)"),
        ({0: 3, 1: 4}, 3, "rank 0 exited with code 3 (also: rank 1 exited with code 4)"),
        ({0: -15, 1: -9}, 137, "rank 1 was killed by SIGKILL (also: rank 0 was killed by SIGTERM)"),
        ({0: 1, 1: -11}, 1, "rank 0 exited with code 1 (also: rank 1 was killed by SIGSEGV)"),
        ({1: -6}, 134, "rank 1 was killed by SIGABRT"),
        ({0: -15, 1: -15}, 143, "rank 0 was killed by SIGTERM (also: rank 1 was killed by SIGTERM)"),
    ],
)
def test_launcher_exit_code_of_a_failed_job(exitcodes, code, line):
    """torch.distributed.run SIGTERMs the surviving ranks once one fails: the code reported is the cause's."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from hf_mixedprec.core._launcher import exit_code

    failures = {r: ProcessFailure(local_rank=r, pid=1000 + r, exitcode=c, error_file="") for r, c in exitcodes.items()}
    assert exit_code(ChildFailedError("train.py", failures)) == (code, line)
    assert exit_code(subprocess.CalledProcessError(-9, ["python", "t.py"])) == (
        137,
        "the training process was killed by SIGKILL",
    )
    assert exit_code(subprocess.CalledProcessError(5, ["python", "t.py"])) == (
        5,
        "the training process exited with code 5",
    )
    assert exit_code(ValueError("not a launcher failure")) is None


def test_a_launch_leaves_sigint_and_sigterm_to_hf_mixedprecs_launcher_and_bounds_the_shutdown(capsys):
    """torch.distributed.run would SIGTERM the ranks itself on a signal (a second one, cutting their save short, when
    a scheduler signals every process): it is told to handle SIGHUP and SIGQUIT only, and to wait --grace-s."""
    from hf_mixedprec.cli.app import main

    assert main(["launch", "--recipe", "cpu-bf16", "--num-processes", "2", "--grace-s", "45", "--dry-run", "t.py"]) == 0
    env = capsys.readouterr().out.split("# environment\n", 1)[1]
    assert "PET_SIGNALS_TO_HANDLE=SIGHUP,SIGQUIT\n" in env and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=45\n" in env
