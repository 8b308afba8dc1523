"""Two real gloo ranks through `hf-mixedprec launch`: every rank takes the same decisions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("mp/skipped_steps", "mp/clip_threshold", "mp/clipped", "mp/grad_norm", "mp/loss_scale")


@pytest.mark.slow
def test_two_ranks_agree_on_skips_and_clip_thresholds(tmp_path):
    recipe = tmp_path / "ddp-fp16.yaml"
    # ZClip warm-up shortened so that thresholds exist within the run
    recipe.write_text("name: ddp-fp16\nextends: v100-fp16\nclipping: {method: zclip, warmup_steps: 3}\n")
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "hf_mixedprec.cli",
        "launch",
        "--recipe",
        str(recipe),
        "--rehearse",
        "--num-processes",
        "2",
        str(ROOT / "scripts" / "finetune_trainer.py"),
        "--max-steps",
        "12",
        "--output-dir",
        str(out),
        "--inject-overflow-at",
        "7",
        "--inject-rank",
        "1",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "torch.distributed.run" in r.stderr and "--nproc_per_node 2" in r.stderr
    logs = [json.loads((out / f"log_history.rank{k}.json").read_text()) for k in (0, 1)]
    rows = [[{k: row.get(k) for k in ("step", *KEYS)} for row in log if "mp/grad_norm" in row] for log in logs]
    assert len(rows[0]) == 12
    assert rows[0] == rows[1], "ranks disagree"
    by_step = {row["step"]: row for row in rows[0]}
    # the overflow injected on rank 1 only reaches rank 0 through the gradient all-reduce: both skip step 7
    assert [by_step[s]["mp/skipped_steps"] for s in range(1, 13)] == [0.0] * 6 + [1.0] * 6
    assert by_step[7]["mp/loss_scale"] == 32768.0 and by_step[6]["mp/loss_scale"] == 65536.0
    thresholds = [by_step[s]["mp/clip_threshold"] for s in range(4, 13) if by_step[s]["mp/clip_threshold"]]
    assert thresholds, "ZClip produced no threshold after warm-up"
    losses = [[row["loss"] for row in log if "loss" in row] for log in logs]
    assert losses[0][-1] < losses[0][0]


@pytest.mark.slow
def test_two_bf16_ranks_skip_a_non_finite_step_whatever_the_reaction(tmp_path):
    """DDP, BF16, non-finite detectors set to `warn` (no skip_step): an inf gradient on rank 1 at step 3 reaches
    rank 0 through the all-reduce, and both ranks skip that step through the scale-1 guard; every checkpoint
    is finite."""
    from safetensors.torch import load_file

    recipe = tmp_path / "ddp-bf16.yaml"
    recipe.write_text(
        "name: ddp-bf16\nextends: cpu-bf16\n"
        "health: {detectors: {nonfinite_loss: {reaction: warn}, nonfinite_grad: {reaction: warn}}}\n"
    )
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "hf_mixedprec.cli", "launch", "--recipe", str(recipe), "--num-processes", "2"]
    cmd += [str(ROOT / "scripts" / "finetune_trainer.py"), "--max-steps", "6", "--output-dir", str(out)]
    cmd += ["--save-steps", "2", "--inject-overflow-at", "3", "--inject-rank", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    logs = [json.loads((out / f"log_history.rank{k}.json").read_text()) for k in (0, 1)]
    skipped = [[row["mp/skipped_steps"] for row in log if "mp/skipped_steps" in row] for log in logs]
    assert skipped[0] == skipped[1] == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    import torch

    for ckpt in sorted(out.glob("checkpoint-*")):
        weights = load_file(str(ckpt / "model.safetensors"))
        assert all(torch.isfinite(t).all() for t in weights.values() if t.is_floating_point()), ckpt.name
    assert len(list(out.glob("checkpoint-*"))) == 3
