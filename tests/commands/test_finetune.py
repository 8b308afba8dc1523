"""`hf-mixedprec finetune`: the embedded default, local models and data, and one-line errors for user mistakes.

The command runs in this process (``hf_mixedprec.cli.app.main``, what the entry point calls) except where the
process is what is tested: Ctrl-C (SIGINT) and the printed resume commands, run as printed."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_accelerate_state")]

FAST = ["--max-steps", "12", "--seq-len", "32", "--batch-size", "4", "--logging-steps", "3"]


def _env() -> dict[str, str]:
    """A spawned run computes on one thread, as a test worker does: on a CPU shared with other workers, torch's
    threads mostly wait on each other (a tiny model's step then takes seconds)."""
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _finetune(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hf_mixedprec.cli", "finetune", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=cwd, env=_env())


def _main(capsys, *args: str) -> tuple[int, str, str]:
    """``hf-mixedprec finetune ARGS`` in this process: exit code, stdout, stderr."""
    from hf_mixedprec.cli.app import main

    capsys.readouterr()
    code = main(["finetune", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> Path:
    """The embedded default (built-in data, a small Llama built from a config, the recipe auto picks), short."""
    from accelerate.state import AcceleratorState

    from hf_mixedprec.cli.app import main

    out = tmp_path_factory.mktemp("ft") / "default"
    stdout, stderr = io.StringIO(), io.StringIO()
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            # one checkpoint and one evaluation (at the end) instead of one every 3 steps
            code = main(["finetune", "--output-dir", str(out), "--json", *FAST, "--save-steps", "12"])
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert code == 0, stderr.getvalue()[-3000:]
    summary = json.loads(stdout.getvalue())
    assert summary == json.loads((out / "summary.json").read_text())
    return out


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny Llama (FP32, no tokenizer: finetune trains one on the data) for runs whose model size is no matter."""
    from hf_mixedprec.core.demo import tiny_llama

    d = tmp_path_factory.mktemp("tiny") / "base"
    tiny_llama(vocab_size=512).save_pretrained(d)
    return d


def test_default_run_learns_and_writes_the_report(default_run):
    from hf_mixedprec.recipes.loader import resolve_auto

    auto = resolve_auto()[0]  # cpu-bf16 on a CPU with native BF16, else cpu-fp32 (tests/recipes/test_cpu_bf16.py)
    s = json.loads((default_run / "summary.json").read_text())
    assert s["recipe"] == auto and s["precision"] == auto.removeprefix("cpu-") and not s["rehearsed"]
    assert s["cpu_speed"] is None  # what auto picks is fast on this CPU
    assert s["steps"] == 12 and s["skipped_steps"] == 0
    assert s["loss_first_step"] == 1 and s["loss_last_step"] == 12
    assert s["loss_last"] < s["loss_first"] - 0.5  # from ~log(2048) = 7.6
    assert s["tokens_trained"] == 12 * 4 * 32 and s["tokens_per_s"] > 0 and s["peak_memory_mib"] > 0
    for name in ("health.json", "grad_norm.png", "model.safetensors", "tokenizer.json", "config.json"):
        assert (default_run / name).is_file(), name
    # the estimate printed beside the peak: its weights are the saved model's float32 parameters
    from safetensors import safe_open

    with safe_open(str(default_run / "model.safetensors"), "pt") as f:
        n = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118 (safe_open is no dict)
    est = s["estimated_memory_mib"]
    assert est["weights"] == round(4 * n / 2**20, 1) and est["gradients"] == est["weights"]
    assert abs(est["optimizer"] - 2 * est["weights"]) <= 0.2 and est["activations"] > 0  # AdamW: exp_avg, exp_avg_sq
    assert est["total"] < s["peak_memory_mib"]
    health = json.loads((default_run / "health.json").read_text())
    assert health["recipe"] == auto and health["steps"] == 12
    assert sorted(int(k) for k in health["series"]["loss"]) == [1, 3, 6, 9, 12]


def test_report_rebuilds_the_plots(default_run, capsys):
    from hf_mixedprec.cli.app import main

    (default_run / "grad_norm.png").unlink()
    assert main(["report", str(default_run), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (default_run / "grad_norm.png").stat().st_size > 1000
    assert str(default_run / "grad_norm.png") in info["plots"]
    health = json.loads((default_run / "health.json").read_text())
    assert info["events"] == len(health["events"]) and info["notes"] == health["notes"]
    assert info["last"]["loss"] == pytest.approx(float(health["series"]["loss"]["12"]))
    assert main(["report", str(default_run / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_local_model_and_jsonl_data(default_run, tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    rows = [{"body": f"Example {i}: the quick brown fox jumps over the lazy dog, then rests. " * 3} for i in range(60)]
    rows += [{"body": ""}, {"body": None}, {"other": "x"}]  # skipped: not a non-empty string
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "run"
    code, stdout, stderr = _main(
        capsys, "--model", str(default_run), "--data", str(data), "--text-field", "body", "--lr", "1e-3",
        "--output-dir", str(out), "--json", "--no-save", *FAST,
    )  # fmt: skip
    assert code == 0, stderr[-3000:]
    s = json.loads(stdout)
    assert s["model"].startswith(str(default_run)) and s["tokenizer"].startswith(f"the tokenizer in {default_run}")
    assert s["examples"] == 60 and s["examples_skipped"] == 3
    assert s["loss_last"] < s["loss_first"]  # repetitive text: learnt quickly
    assert not (out / "model.safetensors").exists()


def test_save_to_disk_and_text_file(tiny_dir, tmp_path, capsys):
    import datasets

    text = "\n\n".join(f"Paragraph {i}. " + "Sing, muse, of numbers small and large. " * 4 for i in range(80))
    (tmp_path / "prose.txt").write_text(text)
    datasets.Dataset.from_dict({"text": text.split("\n\n")}).save_to_disk(str(tmp_path / "ds"))
    for data, n in ((tmp_path / "prose.txt", 80), (tmp_path / "ds", 80)):
        out = tmp_path / f"out-{data.name}"  # one run per folder (a folder with another run is refused)
        args = ["--model", str(tiny_dir), "--max-steps", "2", "--seq-len", "32", "--batch-size", "4"]
        code, stdout, stderr = _main(
            capsys, "--data", str(data), "--output-dir", str(out), "--json", "--no-save", *args
        )
        assert code == 0, stderr[-3000:]
        assert json.loads(stdout)["examples"] == n


@pytest.mark.parametrize(
    "make,args,expected",
    [
        (None, ["--data", "{tmp}/missing.jsonl"], "--data: '{tmp}/missing.jsonl' not found"),
        (None, ["--model", "{tmp}/nomodel"], "--model: '{tmp}/nomodel' is not a directory"),
        ("rows", ["--data", "{tmp}/d.jsonl", "--text-field", "content"], "--text-field: 'content' is not a column"),
        ("empty", ["--data", "{tmp}/d.jsonl"], "is empty: 0 usable examples"),
        ("blank", ["--data", "{tmp}/d.jsonl"], "has 0 usable examples"),
        (None, ["--max-steps", "0"], "--max-steps: 0 is out of range (allowed: >= 1)"),
        (None, ["--recipe", "nope"], "nope: no such recipe (allowed: a YAML path or one of: auto, a100-bf16"),
        (None, ["--data", "{tmp}/x.xlsx"], "--data: '{tmp}/x.xlsx' not found"),
    ],
)
def test_user_mistakes_are_one_line_and_exit_2(tmp_path, capsys, make, args, expected):
    from hf_mixedprec.cli.app import main

    d = tmp_path / "d.jsonl"
    if make == "rows":
        d.write_text('{"text": "hello there"}\n')
    elif make == "empty":
        d.write_text("")
    elif make == "blank":
        d.write_text('{"text": ""}\n{"text": "   "}\n')
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert main(["finetune", *args, "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert expected.replace("{tmp}", str(tmp_path)) in lines[0]
    assert not (tmp_path / "out").exists()  # nothing written on a mistake


def test_unknown_file_type_exits_2_without_traceback(tmp_path, capsys):
    (tmp_path / "x.xlsx").write_text("a")
    code, _, stderr = _main(capsys, "--data", str(tmp_path / "x.xlsx"), "--output-dir", str(tmp_path / "out"))
    assert code == 2 and "Traceback" not in stderr
    assert stderr.strip().splitlines() == [
        f"hf-mixedprec: error: --data: '{tmp_path}/x.xlsx' has an unknown file type '.xlsx' (allowed: a .txt, "
        ".jsonl, .json, .csv or .parquet file, or a datasets save_to_disk folder)"
    ]


def test_fp16_collapse_falls_back_to_bf16_and_finishes(tiny_dir, tmp_path, capsys):
    # an init scale far above what FP16 can hold overflows every step: the scale backs off without
    # growing (a death spiral), the fallback reaction stops with a checkpoint, and finetune goes on from it
    # under the BF16 recipe this machine has (a tiny model: FP16 and BF16 are emulated on most CPUs)
    recipe = tmp_path / "hot.yaml"
    recipe.write_text(
        "name: hot-fp16\nextends: v100-fp16\nloss_scale: {init_scale: 1.0e+12}\n"
        "health: {detectors: {death_spiral: {threshold: 4, window: 10, reaction: fallback}}}\n"
    )
    out = tmp_path / "run"
    code, stdout, stderr = _main(
        capsys, "--recipe", str(recipe), "--rehearse", "--model", str(tiny_dir), "--lr", "1e-2", "--max-steps", "12",
        "--seq-len", "32", "--batch-size", "4", "--logging-steps", "2", "--output-dir", str(out), "--no-save", "--json",
    )  # fmt: skip
    assert code == 0, stderr[-3000:]
    s = json.loads(stdout)
    # found at the step-6 check (checks run on logging steps), so the checkpoint is checkpoint-6
    assert s["fallback"] == {
        "from": "hot-fp16",
        "to": "cpu-bf16",
        "at_step": 6,
        "checkpoint": str(out / "checkpoint-6"),
        "precision_before": "fp16 autocast + GradScaler (init scale 1e+12, growth every 2000 steps) on cpu (REHEARSED)",
    }
    assert s["recipe"] == "cpu-bf16" and s["steps"] == 12 and s["skipped_steps"] == 6
    assert s["stopped"] is None and s["resume_command"] is None  # the fallback finished the run: exit 0
    health = json.loads((out / "health.json").read_text())
    losses = {int(k): float(v) for k, v in health["series"]["loss"].items()}
    assert sorted(losses) == [1, 2, 4, 6, 8, 10, 12] and losses[12] < losses[8]
    assert [e["step"] for e in health["events"] if e["detector"] == "death_spiral"] == [5]
    assert any("FALLBACK: finetune resumes" in n for n in health["notes"])
    grad = {int(k): float(v) for k, v in health["series"]["mp/grad_norm"].items()}
    assert all(math.isnan(grad[k]) for k in (2, 4, 6)) and all(math.isfinite(grad[k]) for k in (8, 10, 12))


def test_health_stop_exits_3_with_the_resume_command_that_works(tmp_path, capsys, monkeypatch):
    """A `stop` reaction: exit code 3, the checkpoint and the exact command to resume; that command resumes."""
    import shlex

    from hf_mixedprec.core.demo import tiny_llama

    tiny_llama(vocab_size=512).save_pretrained(tmp_path / "base")  # a small model keeps FP16 emulation quick
    (tmp_path / "hot.yaml").write_text(
        "name: hot-fp16\nextends: v100-fp16\nloss_scale: {init_scale: 1.0e+12}\n"
        "health: {detectors: {death_spiral: {threshold: 4, window: 10}}}\n"  # default reaction: stop
    )
    args = ["--recipe", "hot.yaml", "--rehearse", "--model", "base", "--lr", "1e-3", "--max-steps", "8"]
    args += ["--seq-len", "32", "--batch-size", "2", "--logging-steps", "2", "--output-dir", "run", "--no-save"]
    monkeypatch.chdir(tmp_path)  # the paths given are relative, as the printed command's are
    code, stdout, stderr = _main(capsys, *args, "--json")
    assert code == 3, stderr[-3000:]
    s = json.loads(stdout)
    assert s["steps"] == 6 and s["stopped"].startswith("health: step 5: death_spiral: ")
    assert (
        s["resume_from"] == "run/checkpoint-6" and (tmp_path / "run" / "checkpoint-6" / "trainer_state.json").is_file()
    )
    command = shlex.join(["hf-mixedprec", "finetune", *args, "--json", "--resume", "run/checkpoint-6"])
    assert s["resume_command"] == command
    assert stderr.strip().splitlines()[-2:] == [
        "hf-mixedprec: STOPPED by a health reaction at step 6 (exit code 3); checkpoint run/checkpoint-6",
        f"hf-mixedprec: resume with: {command}",
    ]
    from hf_mixedprec.commands.finetune import format_summary

    assert f"resume:       {command}" in format_summary(s).splitlines()

    # the printed command, run as printed (`python -m hf_mixedprec` stands for the hf-mixedprec script)
    tokens = shlex.split(command)
    again = subprocess.run(
        [sys.executable, "-m", "hf_mixedprec", *tokens[1:]],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=_env(),
    )
    assert again.returncode == 0, again.stderr[-3000:]  # steps 7-8: too few for the fresh detector window
    s2 = json.loads(again.stdout)  # the real process's stdout holds the JSON only
    assert s2["steps"] == 8 and s2["stopped"] is None and s2["resume_command"] is None
    assert "resumed after a health stop" in again.stderr


def test_deepspeed_recipe_without_a_deepspeed_launch_is_refused(tmp_path, capsys, monkeypatch):
    """Run directly, Trainer would train without DeepSpeed: refused in one line, nothing written."""
    from hf_mixedprec.cli.app import main

    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    (tmp_path / "z2.yaml").write_text(
        "name: z2\nextends: cpu-bf16\ndistributed: {strategy: deepspeed, zero_stage: 2}\n"
    )
    out = tmp_path / "out"
    assert main(["finetune", "--recipe", str(tmp_path / "z2.yaml"), "--output-dir", str(out)]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("hf-mixedprec: error: --recipe: 'z2' has distributed.strategy deepspeed, which needs a ")
    assert "(allowed: `hf-mixedprec launch --recipe RECIPE.yaml hf_mixedprec/cli/finetune.py ...`" in lines[0]
    assert not out.exists()


def test_sigint_saves_a_checkpoint_and_the_resumed_run_ends_bitwise_as_an_uninterrupted_one(tiny_dir, tmp_path):
    """Ctrl-C (SIGINT) mid-run: exit 130, a checkpoint of the step it stopped at, the resume command printed;
    that command finishes the run with the same weights, bit for bit, as a run that was never interrupted.
    (Three real processes, a tiny model: the signal and the printed command are what is tested.)"""
    import os
    import shlex
    import signal

    from safetensors.torch import load_file

    args = ["--model", str(tiny_dir), "--max-steps", "40", "--seq-len", "32", "--batch-size", "4"]
    args += ["--logging-steps", "2", "--save-steps", "100", "--eval-split", "0"]
    straight = _finetune("--output-dir", str(tmp_path / "straight"), *args)
    assert straight.returncode == 0, straight.stderr[-3000:]

    out = tmp_path / "cut"
    cmd = [sys.executable, "-m", "hf_mixedprec.cli", "finetune", "--output-dir", str(out), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    lines = []
    for line in proc.stderr:  # interrupt once training is under way
        lines.append(line)
        if "finetune: step 4/40" in line:
            proc.send_signal(signal.SIGINT)
            break
    err = "".join(lines) + proc.stderr.read()
    proc.wait(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    assert "SIGINT received: saving a checkpoint" in err
    resume_line = next(line for line in err.splitlines() if "resume with:" in line)
    at = int(err.split("interrupted by SIGINT at step ")[1].split()[0])
    assert 4 <= at < 40 and (out / f"checkpoint-{at}" / "trainer_state.json").is_file()
    tokens = shlex.split(resume_line.split("resume with: ", 1)[1])
    assert tokens[:2] == ["hf-mixedprec", "finetune"]  # what a user types; run here through this interpreter
    resumed = subprocess.run(
        [sys.executable, "-m", "hf_mixedprec.cli", *tokens[1:]], capture_output=True, text=True, timeout=300, env=_env()
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a = load_file(str(tmp_path / "straight" / "model.safetensors"))
    b = load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch_equal(a[k], b[k]) for k in a), "the resumed run diverged"
    assert os.path.isdir(out / "checkpoint-40")


def torch_equal(x, y) -> bool:
    import torch

    return bool(torch.equal(x, y))


def test_an_output_folder_with_another_run_is_refused_unless_overwrite_or_resume(
    default_run, tiny_dir, tmp_path, capsys
):
    import shutil

    from hf_mixedprec.cli.app import main

    run = tmp_path / "again"
    shutil.copytree(default_run, run)
    (run / "notes.txt").write_text("mine")
    assert main(["finetune", "--output-dir", str(run), *FAST]) == 2
    err = capsys.readouterr().err
    assert "already holds a run (summary.json" in err and "--overwrite" in err and len(err.splitlines()) == 1
    assert (run / "summary.json").is_file()  # nothing was touched
    for ckpt in run.glob("checkpoint-*"):
        shutil.rmtree(ckpt)
    assert main(["finetune", "--output-dir", str(run), "--resume", "latest", *FAST]) == 2  # no checkpoint to take
    assert "has no checkpoint-N folder" in capsys.readouterr().err
    # a run of 2 steps (the one removed had 12): the summary left is the new run's
    args = ["--model", str(tiny_dir), "--max-steps", "2", "--seq-len", "32", "--batch-size", "4"]
    code, _, stderr = _main(capsys, "--output-dir", str(run), "--overwrite", *args)
    assert code == 0, stderr[-3000:]
    assert "--overwrite: removed the previous run's summary.json" in stderr
    assert (run / "notes.txt").read_text() == "mine"  # only the run's own files are removed
    assert json.loads((run / "summary.json").read_text())["steps"] == 2


def test_report_prints_the_summary_finetune_printed(default_run, capsys):
    from hf_mixedprec.cli.app import main
    from hf_mixedprec.commands.finetune import format_summary

    assert main(["report", str(default_run)]) == 0
    out = capsys.readouterr().out
    summary = json.loads((default_run / "summary.json").read_text())
    assert out.startswith(format_summary(summary) + "\n")
    assert "throughput:" in out and "loss:" in out


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate_state")
def test_finetune_a_local_moe_checkpoint_runs_its_experts_in_fp8_and_says_how_much_work_that_is(tmp_path, capsys):
    """``finetune --model`` on a saved tiny Qwen3-MoE under an FP8 recipe: the experts run in FP8, the summary's
    precision line counts them and says the share of the GEMM work in FP8 (the conversion report's figure), and the
    summary's memory estimate is made (a converted model's config names hf_mixedprec's experts implementation)."""
    from tests.moe import tiny_qwen3_moe

    tiny_qwen3_moe(vocab_size=512).save_pretrained(tmp_path / "moe")
    out = tmp_path / "out"
    args = ["--recipe", "h100-fp8-current", "--rehearse", "--model", str(tmp_path / "moe"), "--max-steps", "2"]
    code, stdout, stderr = _main(capsys, *args, "--seq-len", "16", "--output-dir", str(out), "--json", "--no-save")
    assert code == 0, stderr[-3000:]
    summary = json.loads(stdout)
    report = json.loads((out / "conversion_report.json").read_text())
    share = report["fp8_gemm_work_share"]
    assert 0.5 < share < 1 and report["converted"] == 10  # 8 attention Linears and 2 experts modules
    line = f"(Linear/Conv1D/MoE experts) in FP8, 2 kept in high precision, {share:.1%} of the GEMM work per token"
    assert line in summary["precision_used"]
    assert summary["estimated_memory_mib"] and summary["estimated_memory_mib"]["total"] > 0
    assert not any("memory estimate unavailable" in n for n in summary["notes"])


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_second_finetune_into_a_folder_a_run_is_writing_is_refused_and_the_first_run_is_whole(
    tiny_dir, tmp_path, capsys
):
    """Run A (a real process) writes into a folder; run B into the same folder, started while A trains, is refused in
    one line naming A's PID (exit 2, nothing written); A ends normally and its folder loads."""
    from transformers import AutoModelForCausalLM

    from hf_mixedprec.core.run_lock import LOCK_NAME

    out = tmp_path / "run"
    args = ["--model", str(tiny_dir), "--seq-len", "32", "--batch-size", "4", "--output-dir", str(out)]
    cmd = [sys.executable, "-m", "hf_mixedprec.cli", "finetune", *args, "--max-steps", "20"]
    a = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        deadline = time.monotonic() + 120
        while f'"pid": {a.pid}' not in ((out / LOCK_NAME).read_text() if (out / LOCK_NAME).exists() else ""):
            assert a.poll() is None and time.monotonic() < deadline, a.stderr.read() if a.stderr else ""
            time.sleep(0.1)
        code, _, err = _main(capsys, *args, "--max-steps", "2")
        assert code == 2 and "Traceback" not in err
        (line,) = [x for x in err.splitlines() if "being written by another run" in x]
        assert f"--output-dir: {str(out)!r} is being written by another run: PID {a.pid} on " in line
        _, a_err = a.communicate(timeout=300)
    finally:
        a.kill()
    assert a.returncode == 0, a_err[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 20  # run A's, not a mix
    assert AutoModelForCausalLM.from_pretrained(out).num_parameters() > 0


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_disk_that_fills_up_during_a_checkpoint_ends_in_one_line_and_a_resumable_folder(
    tiny_dir, tmp_path, capsys, monkeypatch
):
    """The save of checkpoint-4 meets a full disk (an injected ENOSPC in torch.save, as a full filesystem raises
    it): finetune ends with exit code 5 and one line naming the folder, the sizes, the checkpoint kept and the resume
    command; the partial checkpoint-4 is gone, checkpoint-2 verifies, and the resume command finishes the run."""
    import errno

    from hf_mixedprec.core.checkpoints import verify

    out = tmp_path / "run"
    args = ["--model", str(tiny_dir), "--seq-len", "32", "--batch-size", "4", "--output-dir", str(out)]
    args += ["--max-steps", "6", "--save-steps", "2", "--save-total-limit", "3"]
    save = torch.save

    def full(obj, f, *a, **kw):
        if "checkpoint-4" in str(f):
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return save(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", full)
    code, _, err = _main(capsys, *args)
    assert code == 5 and "Traceback" not in err, err[-3000:]
    (line,) = [x for x in err.splitlines() if "is full" in x]
    assert line.startswith(f"hf-mixedprec: error: checkpoint-4: the disk holding {str(out)!r} is full (about ")
    assert "bytes needed" in line and "free)" in line and "checkpoint-2 is the newest complete checkpoint" in line
    assert line.endswith(f"--output-dir {out} --max-steps 6 --save-steps 2 --save-total-limit 3 --resume latest")
    assert not (out / "checkpoint-4").exists() and verify(out / "checkpoint-2") is None
    monkeypatch.setattr(torch, "save", save)
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    code, stdout, err = _main(capsys, *args, "--resume", "latest", "--json")
    assert code == 0, err[-3000:]
    assert json.loads(stdout)["steps"] == 6 and (out / "checkpoint-6").is_dir()


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_disk_that_fills_up_as_the_trained_model_is_written_ends_in_one_line(tiny_dir, tmp_path, capsys, monkeypatch):
    """The final model's save meets a full disk (an injected ENOSPC in transformers' safetensors writer, outside any
    checkpoint): exit 5, one line naming the folder, what was not written and the checkpoint that holds the run."""
    import errno

    import transformers.modeling_utils as mu

    out = tmp_path / "run"
    args = ["--model", str(tiny_dir), "--seq-len", "32", "--batch-size", "4", "--output-dir", str(out)]
    write = mu.safe_save_file

    def full(tensors, filename, *a, **kw):
        if "checkpoint-" not in str(filename):
            raise OSError(errno.ENOSPC, "No space left on device", str(filename))
        return write(tensors, filename, *a, **kw)

    monkeypatch.setattr(mu, "safe_save_file", full)
    code, _, err = _main(capsys, *args, "--max-steps", "4", "--save-steps", "4")
    assert code == 5 and "Traceback" not in err, err[-3000:]
    (line,) = [x for x in err.splitlines() if "disk is full" in x]
    assert line.startswith(f"hf-mixedprec: error: {str(out)!r}: the disk is full (")
    assert "the trained model could not be written; checkpoint-4 is the newest complete checkpoint" in line
    assert line.endswith("--resume latest")
