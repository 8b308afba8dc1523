"""hf-mixedprec compare and storage choices: each run's storage and bytes per parameter come from its precision plan,
the tiny_update measure is what the health detector saw, and the loss shows which choice loses small updates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_mixedprec.cli.app import main
from hf_mixedprec.commands.compare import _sample_updates, run_compare
from hf_mixedprec.core.demo import tiny_llama
from hf_mixedprec.integrations.recipe import load_recipe

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

RECIPES = Path(__file__).resolve().parents[2] / "examples" / "recipes"
KEEPING = ("storage-bf16_remainder", "storage-bf16_kahan", "storage-bf16_stochastic", "storage-fp32-bf16")


def _yaml(name: str) -> str:
    return str(RECIPES / f"{name}.yaml")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The test suite's tiny Llama (FP32) with room for the byte-level tokenizer compare trains on the built-in data."""
    d = tmp_path_factory.mktemp("tiny-model")
    tiny_llama(0, vocab_size=512).save_pretrained(d)
    return d


def _sizes() -> tuple[int, int]:
    """Parameter tensors and parameters of the tiny Llama (all trainable)."""
    params = list(tiny_llama(0, vocab_size=512).parameters())
    return len(params), sum(p.numel() for p in params)


def _step_bytes() -> float:
    """AdamW's float32 step counter per parameter tensor, per trainable parameter of the tiny Llama."""
    tensors, n = _sizes()
    return 4 * tensors / n


@pytest.mark.slow
def test_each_storage_choice_reports_its_plan_bytes_and_the_updates_it_lost(tiny_dir, tmp_path):
    res = run_compare(
        [_yaml("storage-none"), *(_yaml(n) for n in KEEPING)],
        baseline=_yaml("storage-fp32"),
        model=str(tiny_dir),
        max_steps=10,
        seq_len=64,  # half the default 128: the loss margins below hold with room (measured: 2x and more)
        lr=1e-5,
        fidelity_points=1,
        output_dir=tmp_path,
    )
    base, none, *keeping = res.baseline, res.runs[0], *res.runs[1:]
    runs = {r.recipe: r for r in res.runs}
    step = _step_bytes()
    # storage and bytes per trainable parameter (weights + master + gradients + AdamW states), from each run's plan
    assert base.storage == {
        "master": "fp32",
        "optimizer_states": "fp32",
        "optimizer": "auto",
        "optimizer_class": "unchanged",
    }
    assert runs["storage-bf16_stochastic"].storage["seed"] == 0
    expected = {
        "storage-fp32": (16, "fp32", "fp32"),
        "storage-none": (12, "none", "fp32"),  # BF16 weights and gradients, FP32 moments
        "storage-bf16_remainder": (14, "bf16_remainder", "fp32"),  # + int16 remainder
        "storage-bf16_kahan": (14, "bf16_kahan", "fp32"),  # + BF16 compensation
        "storage-bf16_stochastic": (12, "bf16_stochastic", "fp32"),
        "storage-fp32-bf16": (12, "fp32", "bf16"),  # FP32 weights and gradients, BF16 moments
    }
    for r in (base, *res.runs):
        total, master, states = expected[r.recipe]
        assert r.bytes_per_param == pytest.approx(total + step, rel=1e-9), r.recipe
        assert (r.storage["master"], r.storage["optimizer_states"]) == (master, states), r.recipe
        assert sum(r.storage_bytes.values()) == pytest.approx(r.bytes_per_param * _sizes()[1], rel=1e-12)
        if r is not base:
            assert r.storage["optimizer_class"] == "StorageAdamW", r.recipe
    # tiny_update: measured where BF16 weights keep no master, sampled every step here (10 steps: a tenth of the run)
    tu = none.tiny_update
    assert tu is not None and tu.every == 1 and tu.steps == list(range(1, 11)) and tu.samples == 10
    assert tu.fired == sum(r < tu.threshold for r in tu.ratios) == 10 and tu.fired_fraction == 1.0
    events = [e for e in none.events if e["detector"] == "tiny_update"]
    assert [e["step"] for e in events] == tu.steps
    assert [e["value"] for e in events] == pytest.approx(tu.ratios, rel=1e-6)  # what the detector judged
    assert all(0 < r < 1e-4 for r in tu.ratios) and tu.threshold == 1e-3
    assert base.tiny_update is None and all(r.tiny_update is None for r in keeping)  # updates kept: nothing to lose
    # the loss: plain BF16 weights fall behind the FP32 master; the other choices track it
    assert none.final_loss - base.final_loss > 5e-4
    for r in keeping:
        assert abs(r.final_loss - base.final_loss) < 2e-4, r.recipe
        assert max(map(abs, r.loss_gap_abs)) < 3e-4, r.recipe
    # the same in compare.json and compare.md
    doc = json.loads((tmp_path / "compare.json").read_text())
    got = doc["runs"][0]
    assert got["tiny_update"]["samples"] == 10 and got["tiny_update"]["fired_fraction"] == 1.0
    assert got["tiny_update"]["median_ratio"] == pytest.approx(tu.median_ratio)
    assert got["bytes_per_param"] == pytest.approx(12 + step) and got["storage"]["master"] == "none"
    assert doc["baseline"]["tiny_update"] is None
    table = (tmp_path / "compare.md").read_text()
    assert "| storage-none | none | fp32 | StorageAdamW | 12.00 | 10 / 10 (100%) |" in table
    assert "| storage-fp32 | fp32 | fp32 | unchanged | 16.00 | not measured | - |" in table
    assert "| storage-bf16_remainder | bf16_remainder | fp32 | StorageAdamW | 14.00 | not measured | - |" in table


@pytest.mark.slow
def test_the_cli_prints_the_storage_table_only_when_a_storage_choice_is_compared(tiny_dir, tmp_path, capsys):
    common = ["--model", str(tiny_dir), "--max-steps", "2", "--seq-len", "32", "--batch-size", "4", "--lr", "1e-5"]
    assert main(["compare", "--recipes", "cpu-bf16", *common, "--output-dir", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "| cpu-bf16 | native |" in out and "tiny_update fired / sampled" not in out
    doc = json.loads((tmp_path / "a" / "compare.json").read_text())
    assert doc["runs"][0]["storage"]["master"] == "fp32" and doc["runs"][0]["tiny_update"] is None
    assert doc["runs"][0]["bytes_per_param"] == pytest.approx(16 + _step_bytes())

    argv = ["compare", "--recipes", _yaml("storage-none"), *common, "--output-dir", str(tmp_path / "b")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| fp32 | fp32 | fp32 | unchanged | 16.00 | not measured | - |" in out  # the plain FP32 baseline
    assert "| storage-none | none | fp32 | StorageAdamW | 12.00 | 2 / 2 (100%) |" in out


def test_compare_samples_tiny_update_often_only_where_bf16_weights_keep_no_master(capsys):
    none = load_recipe(_yaml("storage-none"))
    assert none.health.fp8_sample_every == 50
    lowered = _sample_updates(none, 20)
    assert lowered.health.fp8_sample_every == 20 and lowered.storage == none.storage
    assert "storage-none: tiny_update sampled every 20 steps" in capsys.readouterr().err
    assert _sample_updates(lowered, 40) is lowered  # never raised
    for name in ("storage-fp32", "storage-bf16_remainder", "storage-bf16_stochastic"):
        rec = load_recipe(_yaml(name))
        assert _sample_updates(rec, 20) is rec, name
