"""``hf-mixedprec finetune --recipe b200-nvfp4 --rehearse`` trains the embedded default in NVFP4 on a CPU, and a run
resumed from its checkpoint ends bit for bit where the straight run ends: the stochastic-rounding draws resume with
the checkpoint (each layer's ``nvfp4_sr_calls`` in the FP8 state file)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from hf_mixedprec.cli.app import main
from hf_mixedprec.fp8.state import FP8_STATE_FILE

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_accelerate_state")]

ARGS = ["--recipe", "b200-nvfp4", "--rehearse", "--seq-len", "16", "--batch-size", "2", "--eval-split", "0"]


def _reset() -> None:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def test_the_nvfp4_rehearsal_trains_and_resumes_bit_for_bit(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(["finetune", *ARGS, "--max-steps", "4", "--save-steps", "2", "--output-dir", str(straight)]) == 0
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["fp8_backend"] == "emulated" and "nvfp4 scaling" in summary["precision_used"]
    # the recipe keeps lm_head and the last 16% of the blocks (1 of 4) in BF16: 3 blocks' 21 GEMMs run in NVFP4
    assert summary["fp8_layers"] == {"converted": 21, "kept": 9}
    losses = json.loads((straight / "health.json").read_text())["series"]["loss"]
    assert len(losses) == 4 and all(5.0 < v < 9.0 for v in losses.values())
    state = load_file(straight / "checkpoint-2" / FP8_STATE_FILE)
    calls = {k: int(v) for k, v in state.items() if k.endswith("nvfp4_sr_calls")}
    # every NVFP4 layer rounded its output gradient twice per step (dgrad and wgrad operands), 2 steps
    assert len(calls) == 21 and set(calls.values()) == {4}, calls
    assert not [k for k in load_file(straight / "model.safetensors") if "nvfp4" in k]  # the model stays plain

    _reset()
    argv = ["finetune", *ARGS, "--max-steps", "4", "--save-steps", "2", "--output-dir", str(resumed)]
    assert main([*argv, "--resume", str(straight / "checkpoint-2")]) == 0
    a, b = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert sorted(a) == sorted(b)
    assert [n for n in a if not torch.equal(a[n], b[n])] == []
