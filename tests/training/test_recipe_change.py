"""A resume under another recipe than the checkpoint's (hf_mixedprec.training.recipe_change): a step down in
precision goes on as a phase change, noted, with the run report split into its recipes; another change is refused in
one line before anything is loaded unless allowed; a storage change a resume cannot convert is refused in the
recipe's own words (the conversions: tests/storage/test_storage_resume.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_mixedprec.core.errors import MixedPrecisionError
from hf_mixedprec.integrations.recipe import resolve_recipe
from hf_mixedprec.training.recipe_change import RecipeChangeRefused, decide, recipe_record


def _record(base: str, **over: object) -> dict:
    return recipe_record(resolve_recipe({"name": over.pop("name", base), "extends": base, **over}))


@pytest.mark.parametrize(
    "saved,now,ok",
    [
        ("h100-fp8-delayed", "cpu-bf16", True),
        ("h100-fp8-current", "cpu-fp32", True),
        ("v100-fp16", "a100-bf16", True),
        ("cpu-bf16", "cpu-fp32", True),
        ("cpu-bf16", "h100-fp8-delayed", False),
        ("cpu-fp32", "cpu-bf16", False),
        ("a100-bf16", "v100-fp16", False),
        ("h100-fp8-delayed", "h100-fp8-current", False),  # other FP8 numerics: the amax histories do not apply
        ("h100-fp8-anneal-bf16", "a100-bf16", False),  # a phased recipe is not one precision
    ],
)
def test_a_step_down_in_precision_goes_on_and_every_other_change_is_refused_unless_allowed(saved, now, ok):
    a, b = _record(saved), _record(now)
    if ok:
        got = decide(a, b, checkpoint="checkpoint-4", allow=False)
        assert got.switched and len(got.notes) == 1
        assert got.notes[0].startswith(f"resume: checkpoint-4 was written under recipe {saved!r}")
        assert got.drop_fp8 == (a["fp8"] is not None) and got.drop_scaler == (a["precision"] == "fp16")
        return
    with pytest.raises(RecipeChangeRefused) as info:
        decide(a, b, checkpoint="checkpoint-4", allow=False)
    msg = str(info.value)
    assert "\n" not in msg and isinstance(info.value, MixedPrecisionError)
    assert msg.startswith(f"resume: checkpoint-4 was written under recipe {saved!r}") and repr(now) in msg
    assert "--allow-recipe-change" in msg and "HF_MIXEDPREC_ALLOW_RECIPE_CHANGE=1" in msg
    allowed = decide(a, b, checkpoint="checkpoint-4", allow=True)
    assert allowed.switched and "as allowed by the flag" in allowed.notes[0]


def test_the_same_numerics_under_another_name_or_health_settings_resume_as_one_run():
    a = _record("cpu-bf16")
    same = decide(a, _record("cpu-bf16"), checkpoint="c", allow=False)
    assert not same.switched and same.notes == []
    renamed = decide(a, _record("cpu-bf16", name="mine", health={"fp8_sample_every": 7}), checkpoint="c", allow=False)
    assert not renamed.switched and "has the same precision, FP8 numerics, storage and clipping" in renamed.notes[0]
    old = decide(None, a, checkpoint="checkpoint-2", allow=False)
    assert not old.switched and "records no recipe" in old.notes[0]


def test_a_storage_change_is_refused_in_the_recipes_own_words_even_when_changes_are_allowed():
    a = _record("cpu-bf16", storage={"master": "bf16_remainder"})
    b = _record("cpu-bf16", storage={"master": "bf16_kahan"})
    for allow in (False, True):
        with pytest.raises(RecipeChangeRefused) as info:
            decide(a, b, checkpoint="checkpoint-4", allow=allow)
        msg = str(info.value)
        assert "changes storage.master bf16_remainder -> bf16_kahan" in msg and "float32" not in msg
        assert "or resume with storage.master bf16_remainder, storage.optimizer_states fp32" in msg


# -- through finetune: the checkpoint's record, the refusal before anything loads, the split report -----------------
ARGS = ["--max-steps", "4", "--save-steps", "2", "--seq-len", "16", "--batch-size", "2", "--eval-split", "0",
        "--no-save", "--logging-steps", "1"]  # fmt: skip


def _main(capsys, *args: str) -> tuple[int, str]:
    from accelerate.state import AcceleratorState

    from hf_mixedprec.cli.app import main

    capsys.readouterr()
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        code = main(["finetune", *args])
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    return code, capsys.readouterr().err


@pytest.mark.slow
def test_finetune_resumes_fp8_under_bf16_as_a_phase_change_and_refuses_the_reverse(tmp_path, capsys):
    """An FP8 run resumed under cpu-bf16 goes on from its checkpoint, and health.json says the run trained under
    both recipes (the issue: it said cpu-bf16 / bf16 for the whole run). A BF16 checkpoint resumed under an FP8
    recipe is refused in one line, exit 2, before a step or a file (no checkpoint-4); allowed, it trains."""
    fp8, bf16 = tmp_path / "fp8", tmp_path / "bf16"
    code, err = _main(capsys, "--recipe", "h100-fp8-delayed", "--rehearse", "--output-dir", str(fp8), *ARGS)
    assert code == 0, err[-3000:]
    saved = json.loads((fp8 / "checkpoint-2" / "trainer_state.json").read_text())
    payload = saved["stateful_callbacks"]["MixedPrecisionCallback"]["attributes"]["restored"]
    assert payload["recipe"]["name"] == "h100-fp8-delayed" and payload["recipe"]["fp8"]["scaling"] == "delayed"
    # the checkpoint-2 of the FP8 run, resumed under cpu-bf16 into a new folder
    resumed = tmp_path / "fp8-then-bf16"
    code, err = _main(capsys, "--recipe", "cpu-bf16", "--output-dir", str(resumed), "--resume",
                      str(fp8 / "checkpoint-2"), *ARGS)  # fmt: skip
    assert code == 0, err[-3000:]
    doc = json.loads((resumed / "health.json").read_text())
    assert doc["recipes"] == [
        {"name": "h100-fp8-delayed", "precision": "fp8", "from_step": 1},
        {"name": "cpu-bf16", "precision": "bf16", "from_step": 3},
    ]
    assert doc["precision"] == "fp8->bf16"
    assert any(
        n.startswith("resume: checkpoint-2 was written under recipe 'h100-fp8-delayed' (fp8)") for n in doc["notes"]
    )
    assert sorted(int(s) for s in doc["series"]["loss"]) == [1, 2, 3, 4]

    code, err = _main(capsys, "--recipe", "cpu-bf16", "--output-dir", str(bf16), *ARGS)
    assert code == 0, err[-3000:]
    up = tmp_path / "bf16-then-fp8"
    argv = [
        "--recipe",
        "h100-fp8-delayed",
        "--rehearse",
        "--output-dir",
        str(up),
        "--resume",
        str(bf16 / "checkpoint-2"),
    ]
    code, err = _main(capsys, *argv, *ARGS)
    assert code == 2
    lines = [line for line in err.strip().splitlines() if line.startswith("hf-mixedprec: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert "checkpoint-2 was written under recipe 'cpu-bf16' (bf16)" in lines[0]
    assert "changes precision bf16 -> fp8" in lines[0] and "--allow-recipe-change" in lines[0]
    assert not (up / "checkpoint-4").exists() and not (up / "health.json").exists()
    code, err = _main(capsys, *argv, *ARGS, "--allow-recipe-change")
    assert code == 0, err[-3000:]
    doc = json.loads((up / "health.json").read_text())
    assert [r["name"] for r in doc["recipes"]] == ["cpu-bf16", "h100-fp8-delayed"]


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_trainer_resumed_under_other_storage_is_refused_before_anything_loads(tmp_path):
    """A storage change a resume cannot convert (bf16_remainder -> bf16_kahan; remainder -> fp32 is converted, see
    tests/storage/test_storage_resume.py) is refused in one line before Trainer loads the weights or the optimizer
    state; the model keeps its weights."""
    import torch
    from transformers import Trainer

    from hf_mixedprec.core.demo import tiny_llama
    from tests.integrations.test_integration import Bytes

    def trainer(recipe: dict, out: Path) -> Trainer:
        rec = resolve_recipe(recipe)
        args = rec.training_args(output_dir=str(out), max_steps=4, save_steps=2, per_device_train_batch_size=2,
                                 report_to=[], logging_steps=1)  # fmt: skip
        return Trainer(model=tiny_llama(vocab_size=256), args=args, train_dataset=Bytes(n=8, seq_len=16),
                       callbacks=rec.callbacks())  # fmt: skip

    remainder = {"name": "remainder", "extends": "cpu-fp32", "storage": {"master": "bf16_remainder"},
                 "precision": "bf16"}  # fmt: skip
    first = trainer(remainder, tmp_path / "run")
    first.train()
    again = trainer({**remainder, "name": "kahan", "storage": {"master": "bf16_kahan"}}, tmp_path / "run")
    before = {k: v.clone() for k, v in again.model.state_dict().items()}
    with pytest.raises(RecipeChangeRefused, match=r"changes storage.master bf16_remainder -> bf16_kahan, which"):
        again.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert all(torch.equal(before[k], v) for k, v in again.model.state_dict().items())
