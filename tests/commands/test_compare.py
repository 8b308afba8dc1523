"""hf-mixedprec compare: the same start and batches for every run, self-comparison, gradient fidelity against a
direct computation, verdicts and exit codes."""

from __future__ import annotations

import json
import math

import pytest
import torch

from hf_mixedprec.cli.app import main
from hf_mixedprec.commands.compare import EXIT_FAILED, gradient_fidelity, run_compare
from hf_mixedprec.core.demo import builtin_text, byte_batches, tiny_llama

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

#: Shapes small enough that a BF16 or FP16 run stays quick on a CPU that emulates 16-bit GEMMs (tests check what
#: compare does, not how fast): 4 blocks of 32 tokens a step instead of the default 8 of 128, on the tiny Llama.
SMALL = {"seq_len": 32, "batch_size": 4}
SMALL_ARGS = ["--seq-len", "32", "--batch-size", "4"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The test suite's tiny Llama (FP32, 2 blocks), with room for the byte-level tokenizer compare trains."""
    d = tmp_path_factory.mktemp("tiny-model")
    tiny_llama(0, vocab_size=512).save_pretrained(d)
    return str(d)


BROKEN_FP16 = """\
name: broken-fp16
extends: v100-fp16
loss_scale: {init_scale: 1.0e-6, min_scale: 1.0e-6, growth_interval: 1000000}
"""


@pytest.mark.slow
def test_a_recipe_compared_with_itself_has_zero_gap_and_the_same_start_and_batches(tiny_dir, tmp_path):
    res = run_compare(
        ["fp32", "cpu-bf16"], baseline="fp32", model=tiny_dir, max_steps=4, output_dir=tmp_path, fidelity_points=2,
        **SMALL,
    )  # fmt: skip
    base, same, bf16 = res.baseline, res.runs[0], res.runs[1]
    # identical initial weights and the same batches in the same order, in every run
    assert base.init_digest == same.init_digest == bf16.init_digest
    assert len(base.batch_digests) == 4 and len(set(base.batch_digests)) == 4
    assert base.batch_digests == same.batch_digests == bf16.batch_digests
    # fp32 against the fp32 baseline: no gap, gradients identical
    assert same.loss_gap_abs == [0.0] * 4 and same.final_delta_pct == 0.0
    assert sorted(same.fidelity) == [1, 2, 4]
    for layers in same.fidelity.values():
        assert len(layers) == 16  # 14 Linears, embeddings and lm_head of the tiny Llama
        assert all(f.cosine == pytest.approx(1.0, abs=1e-12) and f.sqnr_db == math.inf for f in layers.values())
    # held-out loss at the sampled steps, the same for both FP32 runs; the last one is the final eval loss
    assert sorted(same.eval_curve) == [1, 2, 4] and same.eval_gap_abs == {1: 0.0, 2: 0.0, 4: 0.0}
    assert base.eval_curve[4] == pytest.approx(base.eval_loss, rel=1e-5)
    # BF16 differs, a little
    assert any(g != 0.0 for g in bf16.loss_gap_abs)
    assert all(0.99 < f.cosine < 1.0 and 15 < f.sqnr_db < 80 for f in bf16.fidelity[4].values())
    assert res.passed and same.verdict == bf16.verdict == "pass"
    doc = json.loads((tmp_path / "compare.json").read_text())
    assert doc["passed"] is True and [r["recipe"] for r in doc["runs"]] == ["fp32", "cpu-bf16"]
    assert {p.rsplit("/", 1)[-1] for p in doc["files"]} == {
        "compare.json",
        "compare.md",
        "compare_loss.png",
        "compare_grad_sqnr.png",
    }
    assert "| cpu-bf16 | native |" in (tmp_path / "compare.md").read_text()


@pytest.mark.slow
def test_cpu_bf16_compared_with_itself_as_baseline_has_zero_gap(tiny_dir, tmp_path):
    res = run_compare(
        ["cpu-bf16"], baseline="cpu-bf16", model=tiny_dir, max_steps=3, output_dir=tmp_path, fidelity_points=1, **SMALL
    )
    assert res.runs[0].loss_gap_abs == [0.0] * 3 and res.runs[0].final_delta_pct == 0.0


def test_gradient_fidelity_matches_a_direct_computation():
    model, reference = tiny_llama(seed=0), tiny_llama(seed=1)  # the reference gets model's weights copied in
    b = byte_batches(builtin_text(), batch_size=2, seq_len=16, n_batches=1)[0]
    batch = {"input_ids": b, "labels": b}
    got = gradient_fidelity(model, reference, batch, autocast=torch.autocast("cpu", dtype=torch.bfloat16))
    # by hand: the BF16-autocast gradient and the FP32 gradient of the same weights
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(**batch).loss.backward()
    fp32 = tiny_llama(seed=0)
    fp32(**batch).loss.backward()
    ref = dict(fp32.named_parameters())
    n = 0
    for name, p in model.named_parameters():
        if p.dim() != 2:
            continue
        g, r = p.grad.double().flatten(), ref[name].grad.double().flatten()
        cos = float(torch.dot(g, r) / (g.norm() * r.norm()))
        sqnr = 10 * math.log10(float(r.pow(2).sum()) / float((g - r).pow(2).sum()))
        f = got[name.removesuffix(".weight")]
        assert f.cosine == pytest.approx(cos, rel=1e-12) and f.sqnr_db == pytest.approx(sqnr, rel=1e-9), name
        n += 1
    assert n == len(got) == 16
    assert all(f.cosine < 1.0 for f in got.values())


@pytest.mark.slow
def test_exit_codes_pass_fail_and_bad_input(tiny_dir, tmp_path, capsys):
    from hf_mixedprec.recipes.loader import resolve_auto

    # exit codes, not BF16 numerics: the recipe auto picks (cpu-bf16 where the CPU computes BF16 natively, else fp32)
    small = ["--model", tiny_dir, *SMALL_ARGS]
    argv = ["compare", "--recipes", "auto", "--max-steps", "3", *small, "--output-dir", str(tmp_path / "a")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"| {resolve_auto()[0]} | native |" in out and "PASS" in out

    broken = tmp_path / "broken-fp16.yaml"
    broken.write_text(BROKEN_FP16)
    # a learning rate at which the tiny Llama's baseline learns in 12 steps (the default for --model is 5e-5)
    argv = ["compare", "--recipes", str(broken), "--max-steps", "12", *small, "--lr", "1e-2"]
    code = main([*argv, "--output-dir", str(tmp_path / "b")])
    out = capsys.readouterr().out
    assert code == EXIT_FAILED
    assert "**broken-fp16: FAIL**" in out and "from the baseline's" in out
    assert "the loss scale stayed at 1e-06 or below" in out

    for argv, msg in (
        (["--recipes", ""], "--recipes: '' must list at least one recipe"),
        (["--recipes", "cpu-bf16", "--max-skip-rate", "2"], "--max-skip-rate: 2.0 is not a fraction"),
        (["--recipes", "no-such-recipe"], "no-such-recipe"),
        (["--recipes", "cpu-bf16", "--eval-split", "0.9"], "--eval-split: 0.9 is out of range"),
        (["--recipes", "cpu-bf16", "--lr", "-1"], "--lr: -1.0 is out of range (allowed: > 0)"),
    ):
        assert main(["compare", *argv, "--output-dir", str(tmp_path / "c")]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and msg in err and "Traceback" not in err, err
