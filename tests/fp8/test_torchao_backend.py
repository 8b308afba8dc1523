"""The torchao backend on CPU (``emulate=True``): every recipe the schema accepts with ``backend: torchao`` converts a
tiny Llama and trains, every other one is refused by ``hf-mixedprec validate`` (exit 2, one line), and the config
built for it is the one torchao would build for the same rule."""

from __future__ import annotations

import itertools

import pytest
import torch
import yaml

from hf_mixedprec.cli.app import main
from hf_mixedprec.core.demo import builtin_text, byte_batches, tiny_llama
from hf_mixedprec.core.errors import MixedPrecisionError
from hf_mixedprec.fp8 import convert
from hf_mixedprec.integrations.recipe import resolve_recipe

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
    assert refused == 144 - 78  # accepted: 54 tensorwise (or unnamed) and 24 rowwise combinations
    assert len(_accepted()) == 12 and accepted  # 6 torchao configs, each with epsilon 1e-12 or 0


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


# -- per-layer FP8 health from torchao layers --------------------------------------------------------


def test_probe_statistics_equal_torchaos_own_cast_of_the_same_tensors():
    """The probe measures what torchao quantizes: its scale and saturated cast of the input, weight and gradient."""
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    from hf_mixedprec.fp8 import fp8_layers
    from hf_mixedprec.scaling.stats import operand_stats

    model = tiny_llama(seed=0)
    recipe = resolve_recipe({"name": "t", "precision": "fp8", "fp8": {"backend": "torchao", "scaling": "current"}})
    convert(model, recipe)
    layer = model.model.layers[0].mlp.down_proj
    seen = {}
    layer.register_forward_hook(lambda m, a, o: seen.update(x=a[0].detach().clone()))
    layer.register_full_backward_hook(lambda m, gi, go: seen.update(g=go[0].detach().clone()))
    probes = dict(fp8_layers(model, fresh=True))
    assert len(probes) == 14
    probes["model.layers.0.mlp.down_proj"].record_stats = True
    b = byte_batches(builtin_text(), batch_size=2, seq_len=16, n_batches=1)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=b, labels=b).loss.backward()
    st = probes["model.layers.0.mlp.down_proj"].stats
    for role, t, dtype, fmt in (
        ("input", seen["x"], torch.float8_e4m3fn, "e4m3"),
        ("weight", layer.weight.detach(), torch.float8_e4m3fn, "e4m3"),
        ("grad", seen["g"], torch.float8_e5m2, "e5m2"),
    ):
        t2 = t.reshape(-1, t.shape[-1]).float()
        scale = tensor_to_scale(t2, dtype)
        data = to_fp8_saturated(t2 * scale, dtype)
        want = operand_stats(t2, data, data.float() / scale, fmt)
        got = st.role(role)
        for k in ("amax", "saturation", "underflow"):
            assert torch.equal(getattr(got, k), getattr(want, k)), (role, k)
        # the probe keeps raw sums (float64 norms, combinable over ranks): the SQNR agrees to float32 rounding
        assert float(got.sqnr_db) == pytest.approx(float(want.sqnr_db), rel=1e-6), role
    assert seen["x"].dtype == torch.bfloat16  # what torchao casts on CPU autocast, as on CUDA
    # unsampled layers measured nothing
    assert not probes["model.layers.0.mlp.up_proj"].stats


def test_a_sampled_step_lets_the_model_modify_a_torchao_layers_output_in_place():
    """An inplace activation right after a torchao layer (``nn.ReLU(inplace=True)``) on a step that samples FP8
    statistics: the probe's gradient measurement leaves the output a plain tensor, so the step trains and the
    gradient's statistics are recorded."""
    from hf_mixedprec.fp8 import fp8_layers

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(inplace=True), torch.nn.Linear(64, 32))
    recipe = resolve_recipe({"name": "t", "precision": "fp8", "fp8": {"backend": "torchao", "scaling": "current"}})
    assert len(convert(model, recipe).converted) == 2
    probe = dict(fp8_layers(model, fresh=True))["0"]
    probe.record_stats = True
    model(torch.randn(8, 64)).square().sum().backward()
    assert probe.measured == (True, True, True)
    assert float(probe.stats.role("grad").amax) > 0 and model[0].weight.grad.abs().sum() > 0


class Outlier:
    """From optimizer step ``at`` on, 8 of one layer's input features become huge (an activation outlier)."""

    def __new__(cls, layer: str, at: int):
        from transformers import TrainerCallback

        class _Outlier(TrainerCallback):
            on = False

            def on_train_begin(self, args, state, control, model=None, **kw):
                def pre(mod, a):
                    if not self.on:
                        return None
                    x = a[0].clone()
                    x[..., :8] = 3e4
                    return (x,)

                # prepended: the outlier is part of the input torchao's forward receives
                dict(model.named_modules())[layer].register_forward_pre_hook(pre, prepend=True)

            def on_step_begin(self, args, state, control, **kw):
                self.on = state.global_step + 1 >= at

        return _Outlier()


@pytest.mark.slow
def test_outlier_on_torchao_is_seen_fires_and_moves_only_that_layer_and_resume_keeps_it(tmp_path):
    """Under current scaling (torchao's only scaling) an outlier sets the scale, so the rest of the tensor loses its
    low bits: the layer's underflow jumps. Saturation and underflow are logged per layer from torchao's own cast;
    the underflow detector fires for that layer alone, the fallback moves it alone to nn.Linear, and a resume
    from the checkpoint written after the move keeps it there (and the others in torchao FP8)."""
    from accelerate.state import AcceleratorState
    from torch import nn

    from hf_mixedprec.integrations.trainer import runtime_of
    from tests.integrations.test_integration import _logs, _trainer

    data = {
        "name": "ao",
        "extends": "h100-fp8-current",
        "fp8": {"backend": "torchao"},
        "health": {"fp8_sample_every": 1, "detectors": {"fp8_underflow": {"threshold": 0.2, "reaction": "fallback"}}},
    }
    recipe = resolve_recipe(data).rehearsed()  # on CPU: torchao itself with emulate=True
    layer = "model.layers.1.mlp.down_proj"
    tr = _trainer(
        recipe, tmp_path, steps=8, extra_callbacks=[Outlier(layer, at=5)], save_strategy="steps", save_steps=6
    )
    tr.train()
    under = _logs(tr, f"mp/fp8/{layer}/underflow")
    sat = _logs(tr, f"mp/fp8/{layer}/saturation")
    assert len(under) == 5 and len(sat) == 5  # steps 1-5; then the layer is no longer FP8
    assert max(under[:4]) < 0.01 and under[4] > 0.5, under
    # current scaling maps the amax to the format's max: only an amax element rounded past it is clamped
    assert max(sat) < 0.01, sat
    other = _logs(tr, "mp/fp8/model.layers.1.mlp.up_proj/underflow")
    assert max(other) < 0.2, other
    rt = runtime_of(tr)
    fired = {e["layer"] for e in rt.events if e["detector"] == "fp8_underflow"}
    assert fired == {layer}
    assert rt.moved_layers == [layer]
    kinds = {n: type(m) for n, m in tr.model.named_modules() if n.startswith("model.layers") and n.endswith("_proj")}
    assert len(kinds) == 14 and kinds[layer] is nn.Linear
    assert all(t is Float8Linear for n, t in kinds.items() if n != layer)
    # the moved layer stopped reporting FP8 statistics; its weights trained on
    assert f"mp/fp8/{layer}/underflow" not in tr.state.log_history[-2]

    AcceleratorState._reset_state(reset_partial_state=True)
    resumed = _trainer(recipe, tmp_path, steps=8)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-6"))
    kinds = {
        n: type(m) for n, m in resumed.model.named_modules() if n.startswith("model.layers") and n.endswith("_proj")
    }
    assert kinds[layer] is nn.Linear
    assert all(t is Float8Linear for n, t in kinds.items() if n != layer)
    assert runtime_of(resumed).moved_layers == [layer]
