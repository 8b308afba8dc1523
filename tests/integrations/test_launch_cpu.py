"""`hf-mixedprec launch` without CUDA: several processes go through torch.distributed.run (gloo ranks on
loopback), because `accelerate launch --cpu` / MULTI_CPU starts a single process unless given an MPI hostfile."""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hf_mixedprec.integrations.launch import plan_launch, uses_torch_distributed_run
from hf_mixedprec.integrations.recipe import RECIPE_ENV, load_recipe_file, resolve_recipe

REPO = Path(__file__).resolve().parents[2]


#: A folder whose ``sitecustomize`` hides DeepSpeed's shared-memory all-reduce op from the processes a launch starts
#: (see that file: its JIT build cost a fresh machine's suite 50 s).
DS_NO_SHM = Path(__file__).resolve().parents[1] / "ds_no_shm"


def _cli(*args: str, timeout: float = 120, deepspeed: bool = False) -> subprocess.CompletedProcess[str]:
    """Run the CLI as on a machine without CUDA (CUDA hidden), from any working directory; ``deepspeed``: its ranks
    reduce through gloo, without DeepSpeed's shared-memory op."""
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.pop(RECIPE_ENV, None)
    path = [str(DS_NO_SHM)] if deepspeed else []
    env["PYTHONPATH"] = os.pathsep.join(p for p in [*path, str(REPO), env.get("PYTHONPATH", "")] if p)
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
    assert cmd[1:11] == [
        "-m", "hf_mixedprec.core._launcher",
        "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
    ]  # fmt: skip
    assert cmd[11] == "--master_port" and 0 < int(cmd[12]) < 65536
    assert cmd[13:] == ["train.py", "--lr", "1"]
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
        sys.executable, "-m", "hf_mixedprec.core._launcher",
        "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", "29611", "t.py", "--x", "1",
    ]  # fmt: skip
    assert cpu.env[RECIPE_ENV] == str(tmp_path / "recipe.yaml")
    assert cpu.env["ACCELERATE_USE_CPU"] == "true" and cpu.env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert any("torch.distributed.run" in n for n in cpu.notes)
    cuda = plan_launch(recipe, "t.py", ["--x", "1"], config_dir=str(tmp_path), num_processes=2, device_type="cuda")
    acc_path = str(tmp_path / "accelerate_config.yaml")
    assert cuda.command == [
        sys.executable, "-m", "hf_mixedprec.core._launcher",
        "-m", "accelerate.commands.launch", "--config_file", acc_path, "t.py", "--x", "1",
    ]  # fmt: skip
    assert cuda.env == {RECIPE_ENV: str(tmp_path / "recipe.yaml")}
    assert not any("torch.distributed.run" in n for n in cuda.notes)
    acc = yaml.safe_load(cuda.files[acc_path])
    assert acc["distributed_type"] == "MULTI_GPU" and acc["use_cpu"] is False and acc["num_processes"] == 2


def test_cpu_keeps_accelerate_launch_where_it_works(tmp_path):
    bf16 = load_recipe_file("cpu-bf16")
    one = plan_launch(bf16, "t.py", [], config_dir=str(tmp_path), device_type="cpu")
    assert one.command[1:5] == ["-m", "hf_mixedprec.core._launcher", "-m", "accelerate.commands.launch"]
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
# gloo on CPU (torch 2.13) now and then aborts a rank in interpreter teardown ("terminate called without an active
# exception", SIGABRT) after everything is written: wait for the other rank, then leave without the teardown
dist.barrier()
os._exit(0)
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


# --- exit codes ---------------------------------------------------------------------------------------------------

_EXIT = """
import os, signal, sys, time
from pathlib import Path

rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
Path(sys.argv[1], f"started.rank{rank}").write_text(os.environ.get("HF_MIXEDPREC_LAUNCH_COMMAND", ""))
# No rank ends before every rank has started: the launcher stops the others once one fails, and a rank slower to
# start would be stopped before it wrote its file.
deadline = time.monotonic() + 60
while len(list(Path(sys.argv[1]).glob("started.rank*"))) < world and time.monotonic() < deadline:
    time.sleep(0.05)
what = sys.argv[2].split(",")[rank]
if what == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(int(what))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc,codes,expected",
    [
        (1, "3", 3),  # accelerate launch (its simple launcher raises CalledProcessError)
        (1, "0", 0),
        (2, "0,3", 3),  # torch.distributed.run (ChildFailedError); only rank 1 fails
        (2, "2,2", 2),  # not 143: a rank the launcher SIGTERMs after the other failed is not the cause
        (2, "0,kill", 128 + 9),  # death by signal N: 128+N, as a shell reports it
    ],
)
def test_launch_exits_with_the_scripts_code(tmp_path, nproc, codes, expected):
    script = tmp_path / "script.py"
    script.write_text(_EXIT)
    r = _cli("--recipe", "cpu-bf16", "--num-processes", str(nproc), str(script), str(tmp_path), codes)
    assert r.returncode == expected, r.stderr[-3000:]
    started = sorted(tmp_path.glob("started.rank*"))
    assert len(started) == nproc  # every rank ran the script
    # the launch command, up to the script, for the resume command a stopped `finetune` prints
    assert {p.read_text() for p in started} == {
        f"hf-mixedprec launch --recipe cpu-bf16 --num-processes {nproc} {script}"
    }
    if expected:
        last = r.stderr.strip().splitlines()[-1]
        assert last.endswith(f"launch exits with {expected}"), last
        if nproc == 1:
            assert "the training process" in last
        elif codes != "2,2":
            assert f"rank 1 {'was killed by SIGKILL' if 'kill' in codes else 'exited with code 3'}" in last
        assert "Traceback" not in r.stderr  # the launcher's ChildFailedError is reported in one line


@pytest.mark.slow
def test_dry_run_prints_a_command_that_runs(tmp_path):
    """The printed command, run by hand with the printed environment and files, passes the exit code through."""
    script = tmp_path / "script.py"
    script.write_text(_EXIT)
    cfg = tmp_path / "cfg"
    r = _cli("--recipe", "cpu-bf16", "--num-processes", "2", "--config-dir", str(cfg), "--dry-run", str(script))
    assert r.returncode == 0, r.stderr
    sections = _sections(r.stdout)
    for name, text in sections.items():
        if name.startswith("file: "):
            path = Path(name[len("file: ") :])
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env.update(line.split("=", 1) for line in sections["environment"].splitlines())
    env["PYTHONPATH"] = str(REPO)
    cmd = [*shlex.split(sections["command"]), str(tmp_path), "4,0"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 4, done.stderr[-3000:]
    assert "rank 0 exited with code 4" in done.stderr


# --- DeepSpeed on CPU ---------------------------------------------------------------------------------------------


def test_the_deepspeed_launch_tests_ranks_build_no_shared_memory_op(tmp_path):
    """What ``_cli(..., deepspeed=True)`` puts on the ranks' path: DeepSpeed's CPU accelerator offers no shared-memory
    op (so none is JIT-built), every other op builder is DeepSpeed's, and a ``sitecustomize`` it shadows still runs."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['OTHER_SITECUSTOMIZE'] = 'ran'\n")
    probe = (
        "import os\n"
        "from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator\n"
        "a = CPU_Accelerator()\n"
        "print(a.create_op_builder('ShareMemCommBuilder'), a.get_op_builder('CPUAdamBuilder').__name__,\n"
        "      os.environ.get('OTHER_SITECUSTOMIZE'))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(DS_NO_SHM), str(other)])}
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines()[-1].split() == ["None", "CPUAdamBuilder", "ran"], r.stdout  # after DeepSpeed's log


@pytest.mark.slow
def test_zero3_with_two_gloo_ranks_saves_a_loadable_model(tmp_path):
    """`finetune` under `launch` with ZeRO-3: the weights are sharded over 2 ranks, and the saved model.safetensors
    holds every weight of the model (DeepSpeed gathers them on save)."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_mixedprec.core.demo import tiny_llama

    base = tmp_path / "base"
    tiny_llama(vocab_size=512).save_pretrained(base)  # no tokenizer: finetune trains a 512-token one
    recipe = tmp_path / "cpu-zero3.yaml"
    recipe.write_text("name: cpu-zero3\nextends: cpu-fp32\ndistributed: {strategy: deepspeed, zero_stage: 3}\n")
    out, cfg = tmp_path / "run", tmp_path / "cfg"
    r = _cli(
        "--recipe", str(recipe), "--num-processes", "2", "--config-dir", str(cfg), str(REPO / "hf_mixedprec" / "cli" / "finetune.py"),
        "--model", str(base), "--max-steps", "3", "--seq-len", "32", "--batch-size", "2", "--lr", "1e-3",
        "--output-dir", str(out), "--eval-split", "0", "--json", timeout=240, deepspeed=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    summary = json.loads(r.stdout)
    assert summary["world_size"] == 2 and summary["steps"] == 3 and summary["recipe"] == "cpu-zero3"
    ds = json.loads((cfg / "deepspeed_config.json").read_text())
    assert ds["zero_optimization"] == {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}
    assert yaml.safe_load((cfg / "accelerate_config.yaml").read_text())["deepspeed_config"]["zero3_init_flag"] is False
    assert "0.14M parameters" in r.stderr  # the sharded model is counted whole (ds_numel), not as its shard

    before = AutoModelForCausalLM.from_pretrained(base)
    after, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set() and info["mismatched_keys"] == set()
    old, new = before.state_dict(), after.state_dict()
    assert sorted(new) == sorted(old)
    for key, value in new.items():
        assert value.shape == old[key].shape and value.numel() > 0, key
        assert torch.isfinite(value.float()).all(), key
    changed = [k for k in old if not torch.equal(old[k], new[k].to(old[k].dtype))]
    assert len(changed) > len(old) // 2, changed  # trained weights were gathered, not the initial ones


@pytest.mark.slow
def test_deepspeed_fp16_refused_before_any_rank_starts(tmp_path):
    from hf_mixedprec.integrations.deepspeed import deepspeed_fp16_supported

    if deepspeed_fp16_supported("cpu"):
        pytest.skip("DeepSpeed has FP16 on this CPU (AVX512-FP16/AMX-FP16): nothing to refuse")
    recipe = tmp_path / "v100-zero2.yaml"
    recipe.write_text("name: v100-zero2\nextends: v100-fp16\ndistributed: {strategy: deepspeed, zero_stage: 2}\n")
    script = tmp_path / "script.py"
    script.write_text(_EXIT)
    cfg = tmp_path / "cfg"
    argv = ["--recipe", str(recipe), "--rehearse", "--num-processes", "2", "--config-dir", str(cfg)]
    r = _cli(*argv, str(script), str(tmp_path), "0,0")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, lines
    assert lines[0].startswith("hf-mixedprec: error: recipe 'v100-zero2': precision fp16 with distributed.strategy ")
    assert "deepspeed (zero_stage 2) cannot run on this CPU" in lines[0]
    assert "(allowed: precision bf16, e.g. a recipe that extends cpu-bf16" in lines[0]
    assert "distributed.strategy none/ddp with --rehearse" in lines[0]
    assert not list(tmp_path.glob("started.rank*")) and not cfg.exists()  # no rank started, nothing written


@pytest.mark.slow
def test_an_fp32_deepspeed_recipe_trains_on_two_cpu_ranks(tmp_path):
    """An FP32 recipe under DeepSpeed on CPU: recipe.training_args says it is a CPU run, so Trainer counts the
    launch's 2 ranks as DeepSpeed does (it counted 1, and DeepSpeed's batch check failed: 4 != 4 * 1 * 2)."""
    recipe = tmp_path / "cpu-fp32-zero1.yaml"
    recipe.write_text("name: cpu-fp32-zero1\nextends: cpu-bf16\nprecision: fp32\ndistributed: {strategy: deepspeed}\n")
    out = tmp_path / "run"
    r = _cli(
        "--recipe", str(recipe), "--num-processes", "2", str(REPO / "scripts" / "finetune_trainer.py"),
        "--max-steps", "2", "--batch-size", "2", "--seq-len", "32", "--output-dir", str(out), timeout=240, deepspeed=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    for rank in (0, 1):
        rows = [row for row in json.loads((out / f"log_history.rank{rank}.json").read_text()) if "loss" in row]
        assert [row["step"] for row in rows] == [1, 2] and all(math.isfinite(row["loss"]) for row in rows)
