"""The torchao backend on CPU (``emulate=True``): every recipe the schema accepts with ``backend: torchao`` converts a
tiny Llama and trains, every other one is refused by ``hf-mixedprec validate`` (exit 2, one line), and the config
built for it is the one torchao would build for the same rule."""

from __future__ import annotations

import itertools

import pytest
import torch
import yaml

from hf_mixedprec.cli import main
from hf_mixedprec.demo import builtin_text, byte_batches, tiny_llama
from hf_mixedprec.errors import MixedPrecisionError
from hf_mixedprec.fp8 import convert
from hf_mixedprec.recipe import resolve_recipe

pytest.importorskip("torchao.float8")
from torchao.float8.float8_linear import Float8Linear

#: every value of each key that changes what torchao is asked to do (None: the key is left out)
SPACE = {
    "torchao_recipe": [None, "tensorwise", "rowwise", "rowwise_with_gw_hp"],
    "format": [None, "HYBRID", "E4M3"],
    "power_2_scales": [None, False, True],
    "epsilon": [None, 0.0, 1e-12, 1e-6],
}


def _fp8_section(combo: dict) -> dict:
    return {"backend": "torchao", "scaling": "current", **{k: v for k, v in combo.items() if v is not None}}


def _combos() -> list[dict]:
    return [dict(zip(SPACE, vals, strict=True)) for vals in itertools.product(*SPACE.values())]


def _accepted() -> dict[tuple, dict]:
    """The distinct resolved torchao settings among the accepted combinations, with one combination for each."""
    out: dict[tuple, dict] = {}
    for combo in _combos():
        try:
            r = resolve_recipe({"name": "t", "precision": "fp8", "fp8": _fp8_section(combo)})
        except MixedPrecisionError:
            continue
        f = r.fp8
        out.setdefault((f.torchao_recipe, f.format, f.power_2_scales, f.epsilon), combo)
    return out


def test_validate_accepts_or_refuses_every_torchao_combination(tmp_path, capsys):
    accepted = {tuple(sorted(c.items(), key=str)) for c in _accepted().values()}
    refused = 0
    for i, combo in enumerate(_combos()):
        path = tmp_path / f"r{i}.yaml"
        path.write_text(yaml.safe_dump({"name": f"r{i}", "precision": "fp8", "fp8": _fp8_section(combo)}))
        code = main(["validate", str(path)])
        err = capsys.readouterr().err.strip()
        if code == 2:
            refused += 1
            assert len(err.splitlines()) == 1 and "Traceback" not in err, err
            assert err.startswith(f"{path}: fp8.") and "allowed:" in err, err
        else:
            assert code == 0, (combo, err)
    # what is refused: a HYBRID or non-power-of-2 rowwise recipe, and an amax floor torchao does not have
    assert refused == 144 - 52  # accepted: 36 tensorwise (or unnamed) and 16 rowwise combinations
    assert len(_accepted()) == 6 and accepted


def test_validate_names_the_key_the_value_and_the_alternative(tmp_path, capsys):
    path = tmp_path / "rowwise-hybrid.yaml"
    path.write_text(
        "name: x\nprecision: fp8\nfp8: {backend: torchao, scaling: current, torchao_recipe: rowwise, format: HYBRID}\n"
    )
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"{path}: fp8.format: 'HYBRID' does not match torchao's rowwise recipe, which casts every tensor to E4M3 "
        "(allowed: E4M3 with torchao_recipe rowwise; or torchao_recipe tensorwise for HYBRID)"
    )


@pytest.fixture(scope="module")
def batches():
    return byte_batches(builtin_text(), batch_size=4, seq_len=32, n_batches=6, seed=0)


@pytest.mark.slow
@pytest.mark.parametrize("settings", sorted(_accepted(), key=str), ids=str)
def test_every_accepted_torchao_recipe_converts_and_trains(settings, batches):
    combo = _accepted()[settings]
    recipe = resolve_recipe({"name": "t", "precision": "fp8", "fp8": _fp8_section(combo)})
    torch.manual_seed(0)
    model = tiny_llama(seed=0)
    rep = convert(model, recipe)
    assert rep.backend == "torchao" and len(rep.converted) == 14
    assert sum(isinstance(m, Float8Linear) for m in model.modules()) == 14
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for b in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=b, labels=b).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0] - 0.3, losses


def test_tensorwise_e4m3_casts_both_gradient_operands_to_e4m3():
    """torchao refuses a config whose dgrad and wgrad grad-output casts differ ("grad_output must be cast to the
    same dtype in both matmuls"): format E4M3 sets both."""
    from hf_mixedprec.fp8.torchao_backend import torchao_config

    r = resolve_recipe(
        {"name": "t", "precision": "fp8", "fp8": {"backend": "torchao", "scaling": "current", "format": "E4M3"}}
    )
    cfg = torchao_config(r, emulate=True)
    assert cfg.cast_config_grad_output.target_dtype == torch.float8_e4m3fn
    assert cfg.cast_config_grad_output_for_grad_weight.target_dtype == torch.float8_e4m3fn
    hybrid = torchao_config(
        resolve_recipe({"name": "t", "precision": "fp8", "fp8": {"backend": "torchao", "scaling": "current"}}),
        emulate=True,
    )
    assert hybrid.cast_config_grad_output.target_dtype == torch.float8_e5m2
    assert hybrid.cast_config_grad_output_for_grad_weight.target_dtype == torch.float8_e5m2
