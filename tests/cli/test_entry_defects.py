"""Promises that held on the callback's main path but not on the others (each test failed before its fix)."""

from __future__ import annotations

import math

import pytest
from transformers import Trainer, TrainingArguments

from hf_mixedprec.core.demo import tiny_llama
from hf_mixedprec.integrations.recipe import load_recipe, resolve_recipe
from tests.integrations.test_integration import Bytes

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


# -- max_grad_norm=0: the user's "no clipping" is never silently overridden by the recipe's clipper ----------------
def test_training_args_refuses_an_explicit_max_grad_norm_under_a_clipping_recipe():
    recipe = load_recipe("cpu-bf16")  # ZClip
    with pytest.raises(ValueError, match=r"max_grad_norm=0 \(Trainer's 'no clipping'\) contradicts recipe 'cpu-bf16'"):
        recipe.training_args(output_dir="/tmp/x", max_grad_norm=0)
    with pytest.raises(ValueError, match=r"max_grad_norm=0\.5 contradicts"):
        recipe.training_args(output_dir="/tmp/x", max_grad_norm=0.5)


def test_a_users_own_max_grad_norm_zero_is_refused_at_attach_and_the_packages_zero_is_not(tmp_path):
    recipe = load_recipe("cpu-bf16")
    args = TrainingArguments(output_dir=str(tmp_path), max_grad_norm=0.0, use_cpu=True, bf16=True, report_to=[])
    with pytest.raises(ValueError, match=r"max_grad_norm=0 \(Trainer's 'no clipping'\) contradicts"):
        Trainer(model=tiny_llama(0), args=args, train_dataset=Bytes(n=4), callbacks=recipe.callbacks())
    # the package's own zero survives a round trip through to_dict() (TRL converts configs that way)
    ours = recipe.training_args(output_dir=str(tmp_path), report_to=[])
    assert ours.max_grad_norm == 0 and math.copysign(1.0, ours.max_grad_norm) < 0
    again = TrainingArguments(**{k: v for k, v in ours.to_dict().items() if not k.startswith("_")})
    tr = Trainer(model=tiny_llama(0), args=again, train_dataset=Bytes(n=4), callbacks=recipe.callbacks())
    assert tr.args.max_grad_norm == 0


def test_max_grad_norm_zero_is_honoured_under_a_recipe_without_clipping(tmp_path):
    recipe = resolve_recipe({"name": "n", "extends": "cpu-bf16", "clipping": {"method": "none"}})
    args = recipe.training_args(output_dir=str(tmp_path), max_grad_norm=0, max_steps=1, report_to=[])
    Trainer(model=tiny_llama(0), args=args, train_dataset=Bytes(n=4), callbacks=recipe.callbacks())
    assert args.max_grad_norm == 0


# -- compare: an earlier comparison is never overwritten; a loss scale stuck at its floor is not "settled" ----------
def test_compare_refuses_a_folder_holding_an_earlier_comparison_before_training(tmp_path, capsys):
    from hf_mixedprec.cli.app import main
    from hf_mixedprec.commands.compare import _output_folder

    out = tmp_path / "cmp"
    out.mkdir()
    (out / "compare.json").write_text('{"earlier": true}')
    assert main(["compare", "--recipes", "cpu-bf16", "--max-steps", "2", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "already holds a comparison (compare.json)" in err and "--overwrite" in err
    assert (out / "compare.json").read_text() == '{"earlier": true}' and not (out / "runs").exists()
    assert _output_folder(out, overwrite=True) == out


@pytest.mark.parametrize(
    "recipes,message",
    [
        (
            "ds",
            "--recipes: 'ds-bf16' has distributed.strategy deepspeed, but compare trains each recipe in one process",
        ),
        ("cpu-bf16,a100-bf16, cpu-bf16", "--recipes: cpu-bf16 listed more than once"),
    ],
)
def test_compare_refuses_a_deepspeed_recipe_and_a_repeated_one_in_one_line_before_any_work(
    tmp_path, capsys, recipes, message
):
    from hf_mixedprec.cli.app import main

    ds = tmp_path / "ds.yaml"
    ds.write_text("name: ds-bf16\nextends: cpu-bf16\ndistributed: {strategy: deepspeed, zero_stage: 1}\n")
    out = tmp_path / "cmp"
    args = ["compare", "--recipes", recipes.replace("ds", str(ds), 1) if recipes == "ds" else recipes]
    assert main([*args, "--max-steps", "2", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()  # refused before the folder was made or any data prepared


def test_compare_refuses_a_run_that_cannot_fit_in_memory_before_training_anything(tmp_path, capsys):
    """Each run's estimated step is held against the memory free on the device before the baseline trains: here
    a batch whose activations (about 1.3 TiB for the default model) no machine running this suite has free."""
    from hf_mixedprec.cli.app import main

    out = tmp_path / "cmp"
    args = ["compare", "--recipes", "cpu-bf16", "--max-steps", "1", "--batch-size", "100000", "--output-dir", str(out)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert "GiB free on cpu (allowed: a smaller --batch-size" in err[0]
    assert err[0].startswith("hf-mixedprec: error: --baseline: fp32 needs an estimated ")
    assert "--batch-size 100000 --seq-len 128" in err[0] and "--no-memory-check" in err[0]
    assert not (out / "runs").exists()  # nothing trained


def test_the_plugin_refuses_a_deepspeed_recipe_without_deepspeed_before_building_an_accelerator(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    recipe = resolve_recipe({"name": "ds", "extends": "cpu-bf16", "distributed": {"strategy": "deepspeed"}})
    with pytest.raises(
        ValueError, match=r"'ds' has distributed\.strategy deepspeed, but this Accelerator runs without"
    ):
        recipe.accelerator(cpu=True)


def test_a_loss_scale_at_its_floor_is_not_called_settled():
    from hf_mixedprec.commands.compare import RunResult

    def run(scales):
        return RunResult(
            recipe="v100-fp16", precision="fp16", rehearsed=True, init_digest="", batch_digests=[], train_loss=[1.0],
            eval_loss=None, final_loss=1.0, steps=len(scales), skipped=0, loss_scale=scales, events=[], stopped=None,
            fp8_layers={}, fidelity={}, tokens_per_s=0.0, peak_memory_bytes=None, cost_note="",
            loss_scale_floor=1.0,
        )  # fmt: skip

    assert run([65536.0] * 4).loss_scale_settled is True
    stuck = run([4.0, 2.0, 1.0, 1.0, 1.0, 1.0])  # no backoff in the second half: it cannot back off any more
    assert stuck.at_scale_floor and stuck.loss_scale_settled is False


# -- finetune without matplotlib: said before training, and the run still ends with its summary ---------------------
@pytest.mark.slow
def test_finetune_without_matplotlib_says_so_first_and_finishes_without_plots(tmp_path, monkeypatch, caplog, capsys):
    import json
    import logging
    import sys

    from hf_mixedprec.cli.app import main

    tiny_llama(vocab_size=512).save_pretrained(tmp_path / "base")  # what is tested is the report, not the model
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    out = tmp_path / "run"
    args = ["--model", str(tmp_path / "base"), "--max-steps", "2", "--seq-len", "32", "--batch-size", "2"]
    with caplog.at_level(logging.WARNING, logger="hf_mixedprec"):
        code = main(["finetune", "--output-dir", str(out), *args])
    assert code == 0
    said = [r.getMessage() for r in caplog.records if "matplotlib is not installed" in r.getMessage()]
    assert len(said) == 2  # once before training, once when the report is written
    summary = json.loads((out / "summary.json").read_text())
    assert "health.json" in summary["files"] and not any(f.endswith(".png") for f in summary["files"])
    assert any("plots not written" in n for n in json.loads((out / "health.json").read_text())["notes"])


# -- add_callback(...) then train(resume_from_checkpoint=...): no crash, and the resume is exact --------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", ["cpu-bf16", "h100-fp8-delayed", "v100-fp16"])
def test_a_callback_added_late_resumes_exactly(tmp_path, name):
    from accelerate.state import AcceleratorState

    from hf_mixedprec.integrations.trainer import runtime_of
    from tests.integrations.test_integration import InjectOverflow

    recipe = load_recipe(name, rehearse=name != "cpu-bf16")

    def trainer(out, **kw):
        args = recipe.training_args(
            output_dir=str(out), max_steps=8, per_device_train_batch_size=2, logging_steps=1, report_to=[],
            disable_tqdm=True, seed=0, **kw,
        )  # fmt: skip
        tr = Trainer(model=tiny_llama(0), args=args, train_dataset=Bytes(n=32, seq_len=32))
        tr.add_callback(InjectOverflow(at=2))  # a skipped step (FP16: the scale halves) before the checkpoint
        for cb in recipe.callbacks():
            tr.add_callback(cb)  # after the Trainer was built
        return tr

    full = trainer(tmp_path / "full", save_strategy="steps", save_steps=4)
    full.train()
    AcceleratorState._reset_state(reset_partial_state=True)
    resumed = trainer(tmp_path / "full", save_strategy="no")
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-4"))

    def rows(tr):
        return [{k: v for k, v in r.items() if k == "loss" or k.startswith("mp/")} for r in tr.state.log_history
                if "loss" in r and r["step"] > 4]  # fmt: skip

    assert rows(resumed) == rows(full) and len(rows(full)) == 4
    assert rows(full)[-1]["mp/skipped_steps"] == 1.0
    if name == "v100-fp16":
        assert rows(resumed)[0]["mp/loss_scale"] == 32768.0  # the halved scale came back, not the initial one
    assert runtime_of(resumed).steps == 8


# -- a DeepSpeed recipe through the callback without DeepSpeed: refused, never trained without it -------------------
def test_a_deepspeed_recipe_on_a_trainer_without_deepspeed_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    recipe = resolve_recipe(
        {"name": "z1", "extends": "cpu-bf16", "distributed": {"strategy": "deepspeed", "zero_stage": 1}}
    )
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, bf16=True, max_grad_norm=1.0, report_to=[])
    with pytest.raises(ValueError, match=r"distributed\.strategy deepspeed, but this Trainer runs without DeepSpeed"):
        Trainer(model=tiny_llama(0), args=args, train_dataset=Bytes(n=4), callbacks=recipe.callbacks())


# -- library use is quiet ----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_import_and_a_one_line_trainer_run_print_nothing_from_us_or_our_backends(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread, as a test worker computes
    r = subprocess.run(
        [sys.executable, "-c", "import hf_mixedprec"], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
    script = f"""
import hf_mixedprec
from transformers import Trainer
from hf_mixedprec.core.demo import tiny_llama
from tests.integrations.test_integration import Bytes
r = hf_mixedprec.load_recipe("cpu-bf16")
args = r.training_args(output_dir={str(tmp_path / "out")!r}, max_steps=2, report_to=[], save_strategy="no",
                       disable_tqdm=True, logging_steps=1)
Trainer(model=tiny_llama(0), args=args, train_dataset=Bytes(n=8, seq_len=32), callbacks=r.callbacks()).train()
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    # no torchao kernel-load lines, no torch Enum notes, no hf_mixedprec notes; on a CPU that emulates BF16, the one
    # line saying that this explicitly named BF16 recipe is slow here
    from hf_mixedprec.recipes.hardware import cpu_gemm_speed

    slow = (
        [] if cpu_gemm_speed("bf16").native else ["hf_mixedprec: SLOW ON THIS CPU: recipe 'cpu-bf16' computes in BF16"]
    )
    assert [ln[: len(slow[0])] if slow else ln for ln in r.stderr.splitlines()] == slow, r.stderr
    assert "Setting accelerator to CPU" not in r.stdout and "'loss'" in r.stdout  # Trainer's own log rows stay


@pytest.mark.slow
def test_the_example_scripts_start_without_backend_noise():
    """The scripts a user copies import hf_mixedprec before transformers, so torchao's kernel-load lines and torch's
    Enum notes (printed when transformers imports torchao) are quieted as for `import hf_mixedprec`."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    procs = [
        subprocess.Popen([sys.executable, str(root / "scripts" / s), "--help"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"})
        for s in ("finetune_trainer.py", "finetune_accelerate.py")
    ]  # fmt: skip
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and out.startswith("usage:") and err == "", err[-2000:]


# -- after a fallback switched recipes, the printed resume command names the recipe the checkpoint was written under
def test_the_resume_command_after_a_fallback_names_the_fallback_recipe():
    from hf_mixedprec.commands.finetune import resume_command

    cmd = ["hf-mixedprec", "finetune", "--recipe", "v100-fp16", "--max-steps", "200"]
    fallback = {"from": "v100-fp16", "to": "cpu-bf16", "at_step": 6, "checkpoint": "runs/x/checkpoint-6"}
    assert resume_command(cmd, "runs/x/checkpoint-40", None) == (
        "hf-mixedprec finetune --recipe v100-fp16 --max-steps 200 --resume runs/x/checkpoint-40"
    )
    assert resume_command(cmd, "runs/x/checkpoint-40", fallback) == (
        "hf-mixedprec finetune --max-steps 200 --recipe cpu-bf16 --resume runs/x/checkpoint-40"
    )
    eq = ["hf-mixedprec", "finetune", "--recipe=v100-fp16"]
    assert resume_command(eq, "c", fallback) == "hf-mixedprec finetune --recipe cpu-bf16 --resume c"
    assert (
        resume_command(["hf-mixedprec", "finetune"], "c", fallback)
        == "hf-mixedprec finetune --recipe cpu-bf16 --resume c"
    )
    assert resume_command(cmd, None, fallback) is None


def test_a_deep_copy_of_a_prepared_model_does_not_copy_the_accelerator():
    """An EMA copy (``copy.deepcopy(accelerator.unwrap_model(model))``) copies the model's hooks: the plugin's step hook
    holds the accelerator weakly, so the copy neither drags the accelerator (optimizer, loaders, process groups) along
    nor begins the run's steps when it trains."""
    import copy
    import gc

    import torch

    from hf_mixedprec.integrations.accelerate_plugin import MixedPrecisionAccelerator

    def alive() -> list[MixedPrecisionAccelerator]:
        gc.collect()
        return [o for o in gc.get_objects() if isinstance(o, MixedPrecisionAccelerator)]

    earlier = {id(o) for o in alive()}  # other tests' accelerators still referenced in this process
    acc = load_recipe("cpu-bf16").accelerator(cpu=True)
    model = tiny_llama()
    model, _ = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    ema = copy.deepcopy(acc.unwrap_model(model))
    assert [o for o in alive() if id(o) not in earlier] == [acc]
    acc._mp_step_pending = True
    ema(input_ids=torch.zeros(1, 4, dtype=torch.long))
    assert acc._mp_step_pending  # the copy's forward is not the run's next step


def test_a_deep_copy_of_an_autocast_wrapped_model_runs_its_own_weights_under_the_autocast():
    """TRL's reference model and an EMA copy are ``copy.deepcopy(model)``. hf_mixedprec's autocast wrapper used to be a
    closure over the original's bound forward, so the copy ran the original's weights (and wrote the original's FP8
    statistics); now it is a method bound to the model, which ``deepcopy`` rebinds to the copy."""
    import copy

    import torch

    from hf_mixedprec.training.runtime import MixedPrecisionRuntime

    rt = MixedPrecisionRuntime(load_recipe("cpu-bf16"))
    model = tiny_llama()
    assert rt.wrap_forward_with_autocast(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.lm_head.weight.mul_(2.0)
    seen = []
    twin.lm_head.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    ids = torch.arange(8).view(1, 8)
    with torch.no_grad():
        ours, theirs = model(input_ids=ids).logits, twin(input_ids=ids).logits
    assert seen == [torch.bfloat16]  # the copy's own lm_head ran, under the recipe's autocast
    assert torch.allclose(theirs.float(), 2 * ours.float(), rtol=1e-2, atol=1e-2)
    assert twin.forward.__self__ is twin and model.forward.__self__ is model


# -- an FP8 recipe no backend runs here (an H100 without Transformer Engine): refused or rehearsed before any work ------
def test_a_recipe_without_an_fp8_backend_here_is_refused_by_finetune_and_rehearsed_by_compare(
    tmp_path, monkeypatch, capsys
):
    """On an H200 without TE, ``fp8.backend: auto`` for blockwise scaling raised FP8BackendUnavailable inside Trainer's
    construction (compare: after training the baseline and two recipes). Now the hardware check knows the backends:
    finetune refuses in one line before reading data, compare rehearses the recipe and says so in its table."""
    import hf_mixedprec.recipes.hardware as hardware
    import hf_mixedprec.recipes.loader as loader
    from hf_mixedprec.cli.app import main
    from hf_mixedprec.commands.compare import _load

    h100 = hardware.HardwareInfo("cuda", (9, 0), "H100", "12.9", torch_version="2.13", torchao_version="0.18")
    monkeypatch.setattr(hardware, "detect", lambda: h100)
    monkeypatch.setattr(loader, "detect", lambda: h100)
    rec, rehearsed = _load("h100-fp8-blockwise")
    assert rehearsed and rec.rehearse
    assert _load("h100-fp8-current") == (_load("h100-fp8-current")[0], False)  # torchao runs it there
    capsys.readouterr()
    code = main(["finetune", "--recipe", "h100-fp8-blockwise", "--output-dir", str(tmp_path / "o"), "--max-steps", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "recipe 'h100-fp8-blockwise' has no FP8 backend on H100 (hopper" in err[0]
    assert "use 'h100-fp8-current' instead" in err[0]
    assert not (tmp_path / "o").exists()  # refused before any work
