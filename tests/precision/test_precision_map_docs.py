"""The precision maps in docs/modules.md are what `hf-mixedprec plan` prints, and what it prints is what a Trainer run
holds: for the tiny example configs under h100-fp8-current (rehearsed), the modules the map says are FP8 are the FP8
layers the model has after one training step, and the modules it says compute in FP32 outside autocast return FP32.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset
from transformers import AutoConfig, AutoModelForCausalLM, Trainer

import hf_mixedprec
from hf_mixedprec.cli.app import main
from hf_mixedprec.fp8 import fp8_layers
from hf_mixedprec.fp8.experts import converted_experts

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "h100-fp8-current"
MODELS = ("tiny-llama", "tiny-gpt2", "tiny-mixtral")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_accelerate_state")]


def test_docs_maps_are_the_commands_output():
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_precision_maps.py"), "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    text = (ROOT / "docs" / "modules.md").read_text(encoding="utf-8")
    for model in MODELS:
        assert f"<!-- precision-map:{model} -->" in text
        assert f"hf-mixedprec plan --config examples/model_configs/{model}/config.json --recipe {RECIPE}" in text


def _expand(name: str) -> list[str]:
    """``model.layers.[0-2,5].mlp`` -> the names of the blocks it stands for (a collapsed map row)."""
    m = re.fullmatch(r"(.*)\.\[([\d,-]+)\](.*)", name)
    if m is None:
        return [name]
    idx: list[int] = []
    for part in m.group(2).split(","):
        lo, _, hi = part.partition("-")
        idx += range(int(lo), int(hi or lo) + 1)
    return [f"{m.group(1)}.{i}{m.group(3)}" for i in idx]


def _map(model: str, capsys) -> dict:
    capsys.readouterr()
    config = ROOT / "examples" / "model_configs" / model / "config.json"
    assert main(["plan", "--config", str(config), "--recipe", RECIPE, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


class TinyTokens(Dataset):
    """Random token ids below the tiny models' vocabulary (256)."""

    def __init__(self, n: int = 8, seq_len: int = 32, vocab: int = 256):
        g = torch.Generator().manual_seed(0)
        self.rows = torch.randint(0, vocab, (n, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


@pytest.mark.parametrize("model_name", MODELS)
def test_map_claims_hold_after_attaching(model_name, tmp_path, capsys):
    shown = _map(model_name, capsys)
    rows = {n: r for r in shown["modules"] for n in _expand(r["name"])}
    fp8_rows = {n for n, r in rows.items() if r["compute"].startswith("fp8")}
    planned_fp8 = {d["name"] for d in shown["fp8_layers"] if d["fp8"]}
    assert fp8_rows == planned_fp8 and planned_fp8
    fp32_rows = {n for n, r in rows.items() if r["compute"] == "fp32 (outside autocast)"}
    # and, to show autocast is on in the run, the Linears the map leaves in BF16 autocast (the output projection)
    bf16_rows = {n for n, r in rows.items() if r["compute"] == "bf16 (autocast)" and r["kind"] == "Linear"}
    if model_name == "tiny-mixtral":
        assert fp32_rows == {f"model.layers.{i}.mlp.gate" for i in range(4)}  # the routers (rule moe_router)

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ROOT / "examples/model_configs" / model_name))
    modules = dict(model.named_modules())
    assert set(rows) <= set(modules)
    outputs: dict[str, list[torch.dtype]] = {n: [] for n in fp32_rows | bf16_rows}
    for name in outputs:

        def hook(_mod, _args, out, name=name):
            outputs[name].append((out[0] if isinstance(out, tuple) else out).dtype)

        modules[name].register_forward_hook(hook)

    recipe = hf_mixedprec.load_recipe(RECIPE, rehearse=True)
    args = recipe.training_args(
        output_dir=str(tmp_path / "out"),
        max_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        per_device_train_batch_size=2,
    )
    trainer = Trainer(model=model, args=args, train_dataset=TinyTokens(), callbacks=recipe.callbacks())
    trainer.train()

    held = {name for name, _ in fp8_layers(trainer.model, fresh=True)} | set(converted_experts(trainer.model))
    assert held == planned_fp8
    for name in fp32_rows:
        assert outputs[name] and set(outputs[name]) == {torch.float32}, (name, outputs[name])
    for name in bf16_rows:
        assert outputs[name] and set(outputs[name]) == {torch.bfloat16}, (name, outputs[name])
