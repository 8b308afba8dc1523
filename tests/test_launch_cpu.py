"""`hf-mixedprec launch` without CUDA: several processes go through torch.distributed.run (gloo ranks on
loopback), because `accelerate launch --cpu` / MULTI_CPU starts a single process unless given an MPI hostfile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hf_mixedprec.integrations.accelerate import plan_launch, uses_torch_distributed_run
from hf_mixedprec.recipe import RECIPE_ENV, load_recipe_file, resolve_recipe

REPO = Path(__file__).resolve().parents[1]


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the CLI as on a machine without CUDA (CUDA hidden), from any working directory."""
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.pop(RECIPE_ENV, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p)
    return subprocess.run(
        [sys.executable, "-m", "hf_mixedprec.cli", "launch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def _sections(stdout: str) -> dict[str, str]:
    sections: dict[str, str] = {}
    current = None
    for line in stdout.splitlines(keepends=True):
        if line.startswith(("# command", "# environment", "# file: ")):
            current = line[2:].strip()
            sections[current] = ""
        else:
            sections[current] += line
    return sections


def test_cpu_dry_run_prints_torch_distributed_run(tmp_path):
    r = _cli(
        "--recipe", "cpu-bf16", "--num-processes", "2", "--config-dir", str(tmp_path), "--dry-run",
        "train.py", "--lr", "1",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    sections = _sections(r.stdout)
    cmd = sections["command"].strip().split(" ")
    assert cmd[0] == sys.executable
    assert cmd[1:9] == [
        "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
    ]  # fmt: skip
    assert cmd[9] == "--master_port" and 0 < int(cmd[10]) < 65536
    assert cmd[11:] == ["train.py", "--lr", "1"]
    env = dict(line.split("=", 1) for line in sections["environment"].splitlines())
    assert env[RECIPE_ENV] == f"{tmp_path}/recipe.yaml"
    assert env["ACCELERATE_USE_CPU"] == "true"
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    text = sections[f"file: {tmp_path}/accelerate_config.yaml"]
    assert "started with torch.distributed.run" in text and "starts only one process" in text
    acc = yaml.safe_load(text)
    assert acc["distributed_type"] == "MULTI_CPU" and acc["use_cpu"] is True and acc["num_processes"] == 2
    assert not (tmp_path / "accelerate_config.yaml").exists(), "a dry run writes nothing"


def test_plan_cpu_vs_cuda(tmp_path):
    recipe = load_recipe_file("cpu-bf16")
    cpu = plan_launch(
        recipe, "t.py", ["--x", "1"], config_dir=str(tmp_path), num_processes=2, device_type="cpu", master_port=29611
    )
    assert cpu.command == [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", "29611", "t.py", "--x", "1",
    ]  # fmt: skip
    assert cpu.env[RECIPE_ENV] == str(tmp_path / "recipe.yaml")
    assert cpu.env["ACCELERATE_USE_CPU"] == "true" and cpu.env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert any("torch.distributed.run" in n for n in cpu.notes)
    cuda = plan_launch(recipe, "t.py", ["--x", "1"], config_dir=str(tmp_path), num_processes=2, device_type="cuda")
    acc_path = str(tmp_path / "accelerate_config.yaml")
    assert cuda.command == [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", acc_path, "t.py", "--x", "1",
    ]  # fmt: skip
    assert cuda.env == {RECIPE_ENV: str(tmp_path / "recipe.yaml")}
    assert not any("torch.distributed.run" in n for n in cuda.notes)
    acc = yaml.safe_load(cuda.files[acc_path])
    assert acc["distributed_type"] == "MULTI_GPU" and acc["use_cpu"] is False and acc["num_processes"] == 2


def test_cpu_keeps_accelerate_launch_where_it_works(tmp_path):
    bf16 = load_recipe_file("cpu-bf16")
    one = plan_launch(bf16, "t.py", [], config_dir=str(tmp_path), device_type="cpu")
    assert one.command[1:3] == ["-m", "accelerate.commands.launch"]
    assert one.env == {RECIPE_ENV: str(tmp_path / "recipe.yaml")}
    fsdp = resolve_recipe({"name": "f", "precision": "bf16", "distributed": {"strategy": "fsdp2"}})
    assert not uses_torch_distributed_run(fsdp, 2, "cpu")
    assert uses_torch_distributed_run(bf16, 2, "cpu") and not uses_torch_distributed_run(bf16, 2, "cuda")
    with pytest.raises(ValueError, match="device_type"):
        plan_launch(bf16, "t.py", [], config_dir=str(tmp_path), device_type="tpu")


_CHILD = """
import argparse, json, os
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator

import hf_mixedprec

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
args = p.parse_args()
a = Accelerator()
t = torch.tensor([float(a.process_index + 1)])
dist.all_reduce(t)
rec = {
    "num_processes": a.num_processes,
    "process_index": a.process_index,
    "distributed_type": a.distributed_type.value,
    "backend": dist.get_backend(),
    "mixed_precision": a.mixed_precision,
    "recipe_env": os.environ["HF_MIXEDPREC_RECIPE"],
    "recipe_name": hf_mixedprec.load_recipe().name,
    "all_reduce": t.item(),
}
Path(args.out, f"rank{a.process_index}.json").write_text(json.dumps(rec))
"""


@pytest.mark.slow
def test_cpu_launch_really_starts_two_gloo_ranks(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(_CHILD)
    out = tmp_path / "out"
    out.mkdir()
    cfg = tmp_path / "cfg"
    r = _cli(
        "--recipe", "cpu-bf16", "--num-processes", "2", "--config-dir", str(cfg), str(script), "--out", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "torch.distributed.run" in r.stderr
    recs = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    assert len(recs) == 2
    assert {rec["process_index"] for rec in recs} == {0, 1}
    for rec in recs:
        assert rec["num_processes"] == 2
        assert rec["distributed_type"] == "MULTI_CPU"
        assert rec["backend"] == "gloo"
        assert rec["mixed_precision"] == "bf16"
        assert rec["recipe_env"] == str(cfg / "recipe.yaml")
        assert rec["recipe_name"] == "cpu-bf16"
        assert rec["all_reduce"] == 3.0
