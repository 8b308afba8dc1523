"""FP8 runs save plain Hugging Face models; the FP8 layers' state (amax histories, scales) lives beside each
checkpoint's model in ``hf_mixedprec_fp8.safetensors`` and a resume from it is bit for bit the straight run."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM, Trainer

import hf_mixedprec
from hf_mixedprec.core.checkpoints import MANIFEST, MARK
from hf_mixedprec.core.demo import builtin_text, byte_batches, tiny_llama
from hf_mixedprec.integrations.trainer import runtime_of
from hf_mixedprec.training.runtime import FP8_STATE_FILE
from tests.integrations.test_integration import Bytes

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_accelerate_state")]

STEPS, SAVE = 6, 3


@pytest.fixture
def logs(caplog):
    """Warnings of hf_mixedprec and of transformers (whose loggers do not propagate to the root)."""
    hf = logging.getLogger("transformers")
    hf.addHandler(caplog.handler)
    caplog.set_level(logging.WARNING)
    yield caplog
    hf.removeHandler(caplog.handler)


def _recipe():
    return hf_mixedprec.load_recipe("h100-fp8-delayed", rehearse=True)


def _trainer(out):
    recipe = _recipe()
    args = recipe.training_args(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=2e-3,
        report_to=[],
        disable_tqdm=True,
        seed=0,
        save_strategy="steps",
        save_steps=SAVE,
    )
    return Trainer(model=tiny_llama(), args=args, train_dataset=Bytes(), callbacks=recipe.callbacks())


def _reset():
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def _fp8_keys(state: dict) -> list[str]:
    return [k for k in state if ".fp8_" in k]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """One straight FP8 run with a checkpoint every 3 steps, shared by the resume tests (its model and files)."""
    _reset()
    tr = _trainer(tmp_path_factory.mktemp("straight"))
    tr.train()
    _reset()
    return tr


def _checkpoint(tr, step: int) -> str:
    return os.path.join(tr.args.output_dir, f"checkpoint-{step}")


def _copy_checkpoint(src, dst) -> None:
    shutil.copytree(src, dst)


def _assert_plain(folder, logs) -> LlamaForCausalLM:
    logs.clear()
    model, info = LlamaForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), info
    assert not [r for r in logs.records if "fp8_" in r.getMessage() or "LOAD REPORT" in r.getMessage()]
    return model


def test_saved_models_are_plain_and_checkpoints_keep_the_fp8_state_beside(tmp_path, logs):
    straight = _trainer(tmp_path / "out")
    straight.train()
    want = straight.model.state_dict()
    keys = _fp8_keys(want)
    assert len(keys) == 28  # 14 FP8 layers x (amax history, scales): still in the model's state_dict
    straight.save_model(str(tmp_path / "final"))
    loaded = _assert_plain(tmp_path / "final", logs)
    got = loaded.state_dict()
    assert sorted(got) == sorted(k for k in want if k not in keys)
    assert all(torch.equal(got[k], want[k]) for k in got)
    for step in (SAVE, STEPS):
        folder = _checkpoint(straight, step)
        _assert_plain(folder, logs)
        with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as f:
            assert not _fp8_keys(list(f.keys()))
        side = load_file(os.path.join(folder, FP8_STATE_FILE))
        assert sorted(side) == sorted(keys)
    assert all(torch.equal(side[k], want[k]) for k in keys)  # the last checkpoint holds the final state
    assert any(side[k].gt(0).any() for k in keys if k.endswith("fp8_amax_history"))


def _resume(tmp_path, folder):
    tr = _trainer(tmp_path / "resumed")
    tr.train(resume_from_checkpoint=str(folder))
    return tr


def _assert_same_end(straight, resumed) -> None:
    want, got = straight.model.state_dict(), resumed.model.state_dict()
    assert list(got) == list(want) and _fp8_keys(want)
    diff = [k for k in want if not torch.equal(want[k], got[k])]
    assert diff == [], f"{diff[:3]} differ from the straight run"


def test_a_resume_from_the_checkpoint_ends_bit_for_bit_as_the_straight_run(straight, tmp_path, logs):
    resumed = _resume(tmp_path, _checkpoint(straight, SAVE))
    _assert_same_end(straight, resumed)  # weights and amax histories / scales
    text = " ".join(r.getMessage() for r in logs.records)
    assert "restart from scratch" not in text and "missing keys" not in text


def _as_saved_before_manifests(ckpt) -> None:
    """Make ``ckpt`` what an hf_mixedprec without manifests wrote: no manifest, and none promised."""
    import json

    (ckpt / MANIFEST).unlink()
    doc = json.loads((ckpt / "trainer_state.json").read_text())
    for value in doc["stateful_callbacks"].values():
        for item in value if isinstance(value, list) else [value]:
            item.get("attributes", {}).pop(MARK, None)
    (ckpt / "trainer_state.json").write_text(json.dumps(doc))


def test_a_checkpoint_without_the_fp8_file_resumes_with_a_loud_warning(straight, tmp_path, logs):
    ckpt = tmp_path / "ckpt"
    _copy_checkpoint(_checkpoint(straight, SAVE), ckpt)
    (ckpt / FP8_STATE_FILE).unlink()
    _as_saved_before_manifests(ckpt)  # an older hf_mixedprec's checkpoint, before the FP8 file existed
    resumed = _resume(tmp_path, ckpt)
    said = [r for r in logs.records if "restart from scratch" in r.getMessage()]
    assert said and said[0].levelno == logging.WARNING and FP8_STATE_FILE in said[0].getMessage()
    assert resumed.state.global_step == STEPS
    assert any("restart from scratch" in n for n in runtime_of(resumed).notes)  # in the run report too
    layer = resumed.model.model.layers[0].self_attn.q_proj
    assert layer.fp8_amax_history[-(STEPS - SAVE) :].gt(0).all()  # trained on, histories refilled since the resume
    assert layer.fp8_amax_history[: -(STEPS - SAVE)].eq(0).all()  # the rows before the resume are gone


def test_an_older_checkpoint_with_the_fp8_state_in_its_weights_still_resumes_exactly(straight, tmp_path, logs):
    ckpt = tmp_path / "old"
    _copy_checkpoint(_checkpoint(straight, SAVE), ckpt)
    weights = {**load_file(ckpt / "model.safetensors"), **load_file(ckpt / FP8_STATE_FILE)}
    save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})
    (ckpt / FP8_STATE_FILE).unlink()
    _as_saved_before_manifests(ckpt)
    resumed = _resume(tmp_path, ckpt)
    _assert_same_end(straight, resumed)
    assert "restart from scratch" not in " ".join(r.getMessage() for r in logs.records)


def test_accelerate_save_state_carries_the_fp8_state_and_save_pretrained_leaves_it_out(tmp_path, logs):
    recipe = _recipe()
    acc = recipe.accelerator()
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    for batch in byte_batches(builtin_text(), seq_len=32, batch_size=2, n_batches=3, seed=0):
        acc.backward(model(input_ids=batch, labels=batch).loss)
        opt.step()
        opt.zero_grad()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    assert _fp8_keys(want) and want["model.layers.0.self_attn.q_proj.fp8_amax_history"][-1].gt(0).all()
    acc.save_state(str(tmp_path / "state"))
    acc.unwrap_model(model).save_pretrained(str(tmp_path / "plain"))
    _assert_plain(tmp_path / "plain", logs)
    _reset()
    acc2 = recipe.accelerator()
    fresh = tiny_llama(seed=1)
    fresh, _ = acc2.prepare(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3))
    acc2.load_state(str(tmp_path / "state"))
    got = fresh.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
