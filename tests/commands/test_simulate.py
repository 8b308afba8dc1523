"""`hf-mixedprec simulate`: FP8 readiness with per-layer numerics, as a table and as JSON."""

from __future__ import annotations

import json

import pytest
import torch

from hf_mixedprec.cli.app import main
from hf_mixedprec.commands.simulate import simulate
from hf_mixedprec.core.demo import tiny_llama
from hf_mixedprec.integrations.recipe import load_recipe_file, resolve_recipe


def run(capfd, *args: str) -> tuple[int, str, str]:
    """``hf-mixedprec simulate ARGS`` in this process (what the entry point calls): exit code, stdout, stderr, read at
    the file descriptors as a subprocess's would be."""
    capfd.readouterr()
    code = main(["simulate", *args])
    out, err = capfd.readouterr()
    return code, out, err


@pytest.mark.slow
def test_simulate_json_is_machine_readable_and_consistent(tmp_path, capfd):
    # a 4-block tiny Llama (the default model's 4 blocks of 7 Linears, narrower): JSON, not model size, is tested
    tiny_llama(num_hidden_layers=4).save_pretrained(tmp_path / "m")
    argv = ["--recipe", "b200-mxfp8", "--model", str(tmp_path / "m"), "--steps", "6", "--seq-len", "32"]
    code, stdout, stderr = run(capfd, *argv, "--batch-size", "2", "--json")
    assert code == 0, stderr
    out = json.loads(stdout)
    assert out["recipe"] == "b200-mxfp8" and out["scaling"] == "mxfp8" and out["backend"] == "emulated"
    assert len(out["loss"]["fp8"]) == 6 and len(out["loss"]["bf16"]) == 6
    assert out["loss"]["fp8"][-1] < out["loss"]["fp8"][0]
    names = [layer["name"] for layer in out["layers"]]
    assert len(names) == 28 and "lm_head" not in names  # 4 blocks x 7 Linears; lm_head kept
    for layer in out["layers"]:
        for role in ("input", "weight", "grad"):
            st = layer[role]
            assert 0.0 <= st["saturation"] <= 1.0 and 0.0 <= st["underflow"] <= 1.0
            assert st["amax"] > 0 and "mx_clamp" in st
        assert layer["recommend_keep"] == bool(layer["reasons"])
        assert layer["input"]["saturation"] == 0.0  # RCEIL never saturates
    assert out["recommend_keep_in_bf16"] == [lay["name"] for lay in out["layers"] if lay["recommend_keep"]]
    assert {d["name"]: d["fp8"] for d in out["conversion"]["layers"]}["lm_head"] is False


@pytest.mark.slow
def test_simulate_table_and_outlier_is_recommended(tmp_path, capfd):
    # a local save_pretrained model whose one layer sees a huge activation outlier
    model = tiny_llama(hidden_size=64, intermediate_size=128)
    with torch.no_grad():
        model.model.layers[1].post_attention_layernorm.weight[5] = 2000.0
    model.save_pretrained(tmp_path / "m")
    code, out, err = run(
        capfd, "--recipe", "h100-fp8-current", "--model", str(tmp_path / "m"), "--steps", "4", "--seq-len", "32"
    )
    assert code == 0, err
    assert "simulate: recipe h100-fp8-current (scaling=current" in out
    assert "model.layers.1.mlp.up_proj" in out and "recommend keeping in BF16:" in out
    res = simulate(load_recipe_file("h100-fp8-current"), model_dir=str(tmp_path / "m"), steps=4, seq_len=32)
    flagged = {layer.name for layer in res.recommended}
    assert {"model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"} <= flagged
    up = next(layer for layer in res.layers if layer.name == "model.layers.1.mlp.up_proj")
    # a 2000x outlier pushes the per-tensor scale down so far that most ordinary values quantize to zero;
    # whole-tensor SQNR hides this (the outlier dominates the signal energy), underflow shows it
    threshold = load_recipe_file("h100-fp8-current").health.detectors.fp8_underflow.threshold
    assert up.stats["grad"]["underflow"] > threshold
    assert any(reason.startswith("grad underflow") for reason in up.keep_reasons)
    down = next(layer for layer in res.layers if layer.name == "model.layers.1.mlp.down_proj")
    assert down.stats["input"]["underflow"] > threshold
    assert all(not layer.keep_reasons for layer in res.layers if layer.name.startswith("model.layers.0."))


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--recipe", "a100-bf16"], "--recipe: 'a100-bf16' has precision bf16; simulate rehearses FP8 recipes"),
        (["--recipe", "h100-fp8-delayed", "--steps", "1"], "--steps: 1 is out of range (allowed: >= 2)"),
        (["--recipe", "h100-fp8-delayed", "--model", "/no/such/dir"], "--model: '/no/such/dir' is not a directory"),
        (["--recipe", "nope"], "nope: no such recipe"),
    ],
)
def test_simulate_mistakes_exit_2(args, expected, capfd):
    code, _, err = run(capfd, *args)
    assert code == 2 and "Traceback" not in err
    assert expected in err.strip().splitlines()[-1]


def test_simulate_refuses_non_fp8_in_python():
    with pytest.raises(ValueError, match="simulate rehearses fp8 recipes"):
        simulate(resolve_recipe({"name": "x", "precision": "bf16"}))


@pytest.mark.slow
def test_simulate_nvfp4_names_the_layer_an_outlier_ruins_and_passes_the_others(tmp_path, capfd):
    """``simulate --recipe b200-nvfp4`` on a tiny Llama whose block 0 feeds its MLP a 2000x outlier channel: the
    per-tensor FP32 scale follows the outlier, which pushes the MLP's gradients and down_proj's input under E2M1's
    smallest step (over half of them flush to zero, where healthy layers lose 5-25%); the last block is kept out by
    the recipe (16% of 4 blocks, rounded)."""
    model = tiny_llama(hidden_size=64, intermediate_size=128, num_hidden_layers=4)
    with torch.no_grad():
        model.model.layers[0].post_attention_layernorm.weight[5] = 2000.0
    model.save_pretrained(tmp_path / "m")
    code, out, err = run(
        capfd,
        "--recipe",
        "b200-nvfp4",
        "--model",
        str(tmp_path / "m"),
        "--steps",
        "4",
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--json",
    )
    assert code == 0, err
    res = json.loads(out)
    assert res["scaling"] == "nvfp4"
    names = [layer["name"] for layer in res["layers"]]
    assert len(names) == 21 and not [n for n in names if n.startswith("model.layers.3.")]
    # block 0's MLP, and nothing else: the other layers pass
    assert set(res["recommend_keep_in_bf16"]) == {
        f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")
    }
    later = [layer for layer in res["layers"] if layer["name"].startswith(("model.layers.1.", "model.layers.2."))]
    assert len(later) == 14 and not [x["name"] for x in later if x["reasons"]]
    gate = next(layer for layer in res["layers"] if layer["name"] == "model.layers.0.mlp.gate_proj")
    assert gate["grad"]["underflow"] > 0.4 and any(r.startswith("grad underflow") for r in gate["reasons"])
