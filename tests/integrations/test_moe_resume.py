"""A Trainer run of an MoE model resumed from a checkpoint trains on bit for bit as the uninterrupted run: weights,
FP8 experts' delayed-scaling state, the logged losses and the experts' load.

transformers 5 saves the experts in the model's original format (one tensor per expert) and Trainer loads a checkpoint
with ``load_state_dict(strict=False)``, which skips them: without the callback's repair a resumed run trains on with
the experts' initial weights (every tensor of the model then differs from the straight run after one step)."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM, Trainer

import hf_mixedprec
from hf_mixedprec.core import metrics as M
from hf_mixedprec.integrations.trainer import MixedPrecisionCallback
from tests.integrations.test_integration import Bytes

SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "intermediate_size": 32, "num_experts_per_tok": 2, "vocab_size": 256}  # fmt: skip
BUILD = {
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(**SMALL, moe_intermediate_size=32, num_experts=8)),
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(**SMALL, num_local_experts=4)),
}


def _train(kind: str, out, steps: int, resume=None) -> Trainer:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    recipe = hf_mixedprec.load_recipe("h100-fp8-delayed", rehearse=True)
    args = recipe.training_args(output_dir=str(out), max_steps=steps, per_device_train_batch_size=2,
                                learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="steps",
                                save_steps=2, disable_tqdm=True, seed=0, data_seed=0)  # fmt: skip
    torch.manual_seed(0)
    model: nn.Module = BUILD[kind]()
    trainer = Trainer(model=model, args=args, train_dataset=Bytes(n=16, seq_len=16), callbacks=recipe.callbacks())
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("kind", list(BUILD))
def test_an_moe_run_resumes_bit_for_bit_with_its_experts(kind, tmp_path):
    straight = _train(kind, tmp_path / "a", 4)
    ckpt = tmp_path / "c" / "checkpoint-2"
    shutil.copytree(tmp_path / "a" / "checkpoint-2", ckpt)
    saved = load_file(ckpt / "model.safetensors")
    assert not any(k.endswith("experts.down_proj") for k in saved)  # the original format: what strict=False skips
    resumed = _train(kind, tmp_path / "b", 4, resume=str(ckpt))
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []
    rows = {r["step"]: r for r in straight.state.log_history if "loss" in r}
    again = {r["step"]: r for r in resumed.state.log_history if "loss" in r}
    assert sorted(again) == [1, 2, 3, 4]  # the checkpoint's rows, then the resumed run's
    for step in (3, 4):
        assert again[step]["loss"] == rows[step]["loss"]
        moe = {k: v for k, v in rows[step].items() if k.startswith(M.MOE_PREFIX)}
        assert moe and moe == {k: again[step][k] for k in moe}
    (cb,) = [c for c in resumed.callback_handler.callbacks if isinstance(c, MixedPrecisionCallback)]
    notes = "\n".join(cb._runtime(resumed.model).notes)
    assert "loaded through transformers' weight conversion" in notes
