"""``fp8.scaling: nvfp4`` end to end below the trainer: the recipe section and its refusals, the emulated layer's
three GEMMs against Transformer Engine's NVFP4 recipe written out here (1x16 activation and gradient blocks, 16x16
weight blocks, the Hadamard transform on the weight-gradient GEMM's inputs, stochastic rounding of gradients), each
switch, the rounding draws replayed from a checkpoint, the FP4 health statistics, the hardware rules, TE's recipe
mapping and the memory bytes. Every test breaks when one rule changes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_mixedprec.core.formats import E2M1
from hf_mixedprec.fp8.emulated import EmulatedFP8Conv1D, EmulatedFP8Linear, EmulationSpec
from hf_mixedprec.fp8.memory import te_saved_input_bytes, te_weight_bytes
from hf_mixedprec.fp8.transformer_engine import accelerate_fp8_config, te_recipe_spec
from hf_mixedprec.integrations.recipe import resolve_recipe
from hf_mixedprec.recipes.hardware import HardwareInfo, check_recipe, support_for
from hf_mixedprec.recipes.loader import load_recipe
from hf_mixedprec.recipes.schema import FP8Config, NVFP4Config
from hf_mixedprec.scaling.nvfp4 import draw_stream, e2m1_values, hashed_uniform, nvfp4_quantize
from hf_mixedprec.scaling.stats import finish_operand_stats, raw_operand_stats

#: TE's sign vector (``get_wgrad_sign_vector``), written out again here rather than imported
SIGNS = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]


def _sylvester16() -> torch.Tensor:
    h = torch.tensor([[1.0]])
    for _ in range(4):
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _rht(t: torch.Tensor) -> torch.Tensor:
    """TE's ``_apply_rht``: every 16 consecutive values of the last dim times ``diag(signs) @ H16 / sqrt(16)``."""
    m = torch.diag(torch.tensor(SIGNS, dtype=torch.float32)) @ _sylvester16() / 4.0
    return (t.reshape(-1, 16) @ m).reshape(t.shape)


def _pad_tokens(t: torch.Tensor) -> torch.Tensor:
    """``[features, tokens]`` with the tokens padded with zeros to a multiple of 16, as TE pads."""
    return nn.functional.pad(t, (0, (-t.shape[1]) % 16))


def _layer(**opts) -> tuple[EmulatedFP8Linear, nn.Linear]:
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=False)
    spec = EmulationSpec.from_config(FP8Config(scaling="nvfp4", **opts))
    layer = EmulatedFP8Linear(lin, spec)
    layer.sr_stream = 12345
    return layer, lin


def _draws(layer: EmulatedFP8Linear, shape: tuple[int, int], call: int) -> torch.Tensor:
    return hashed_uniform(shape, torch.tensor(call), draw_stream(layer.sr_stream, layer.spec.sr_seed))


def _run(layer: EmulatedFP8Linear, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    layer.weight.grad = None
    torch.manual_seed(seed)
    x = (torch.randn(3, 7, 64) * torch.logspace(-1, 1, 64)).requires_grad_()  # 21 tokens: padded to 32
    y = layer(x)
    g = torch.randn_like(y)
    y.backward(g)
    return x, y, g, layer.weight.grad


def test_each_gemm_sees_what_tes_nvfp4_recipe_quantizes():
    layer, lin = _layer()
    x, y, g, gw = _run(layer)
    x2, g2, w = x.detach().reshape(21, 64), g.reshape(21, 48), lin.weight.detach()
    # forward: the input in 1x16 blocks along in_features, the weight in 16x16 blocks, both rounded to nearest
    xq = nvfp4_quantize(x2).dequantize()
    wq = nvfp4_quantize(w, tile=(16, 16)).dequantize()
    assert torch.equal(y.detach().reshape(21, 48), xq @ wq.t())
    # dgrad: the output gradient in 1x16 blocks along out_features, rounded stochastically with the layer's first
    # draws; the weight as the forward quantized it (16x16 blocks quantize the same transposed)
    gq = nvfp4_quantize(g2, noise=_draws(layer, (21, 48), 0)).dequantize()
    assert torch.equal(x.grad.reshape(21, 64), gq @ wq)
    # wgrad: both operands along the tokens, padded to 32 and Hadamard-transformed; the gradient with the second draws
    gt = _rht(_pad_tokens(g2.t().contiguous()))
    xt = _rht(_pad_tokens(x2.t().contiguous()))
    want = nvfp4_quantize(gt, noise=_draws(layer, (48, 32), 1)).dequantize() @ nvfp4_quantize(xt).dequantize().t()
    assert torch.equal(gw, want)
    assert int(layer.nvfp4_sr_calls) == 2
    # 4-bit operands: the GEMMs are near the exact ones, not equal
    exact = g2.t() @ x2
    assert 0.02 < float((gw - exact).norm() / exact.norm()) < 0.4


def test_a_bf16_operand_is_transformed_then_rounded_to_bf16_as_te_transforms_it():
    """TE's reference ``_apply_rht`` multiplies a BF16 operand by a BF16 Hadamard matrix: the transformed values are
    BF16 before their amax and codes are taken. The layer's weight gradient is the product of those."""
    layer, _ = _layer(stochastic_rounding=False)
    layer.to(torch.bfloat16)
    torch.manual_seed(1)
    x = (torch.randn(3, 7, 64) * torch.logspace(-1, 1, 64)).to(torch.bfloat16).requires_grad_()
    y = layer(x)
    g = torch.randn_like(y)
    y.backward(g)
    x2, g2 = x.detach().reshape(21, 64).float(), g.reshape(21, 48).float()

    def wgrad(rounded: bool) -> torch.Tensor:
        gt, xt = _rht(_pad_tokens(g2.t().contiguous())), _rht(_pad_tokens(x2.t().contiguous()))
        if rounded:
            gt, xt = gt.to(torch.bfloat16).float(), xt.to(torch.bfloat16).float()
        return nvfp4_quantize(gt).dequantize() @ nvfp4_quantize(xt).dequantize().t()

    assert layer.weight.grad.dtype == torch.bfloat16
    assert torch.equal(layer.weight.grad, wgrad(rounded=True).to(torch.bfloat16))
    assert not torch.equal(layer.weight.grad, wgrad(rounded=False).to(torch.bfloat16))  # the rounding shows


def test_another_seed_or_layer_draws_afresh_not_shifted_draws():
    """``sr_seed`` and the layer's stream are hashed before they meet the call counter: seed 1 is not seed 0 a few
    calls later, and two layers do not share draws (an XOR of the raw seed into the stream gave both)."""
    shape = (4, 64)
    draws = {
        (layer, seed, call): hashed_uniform(shape, torch.tensor(call), draw_stream(layer, seed))
        for layer in (12345, 12346)
        for seed in (0, 1, 2)
        for call in range(8)
    }
    firsts = {k: float(v[0, 0]) for k, v in draws.items()}
    assert len(set(firsts.values())) == len(firsts)  # 48 streams x counters, no two alike
    for k, v in draws.items():
        assert float(v.min()) >= 0.0 and float(v.max()) < 1.0 and abs(float(v.mean()) - 0.5) < 0.1, k
    layer, _ = _layer()
    other, _ = _layer(sr_seed=1)
    _, _, _, gw = _run(layer)
    _, _, _, gw_other = _run(other)
    assert not torch.equal(gw, gw_other)
    assert torch.equal(gw_other, _run(_layer(sr_seed=1)[0])[3])  # the same seed replays


def test_each_switch_turns_off_its_technique_alone():
    layer, lin = _layer(rht=False, stochastic_rounding=False, weight_2d=False)
    x, y, g, gw = _run(layer)
    x2, g2, w = x.detach().reshape(21, 64), g.reshape(21, 48), lin.weight.detach()
    wq = nvfp4_quantize(w).dequantize()  # 1x16 along in_features
    assert torch.equal(y.detach().reshape(21, 48), nvfp4_quantize(x2).dequantize() @ wq.t())
    w_dgrad = nvfp4_quantize(w.t().contiguous()).dequantize().t()  # 1x16 along out_features, from high precision
    assert not torch.equal(w_dgrad, wq)
    assert torch.equal(x.grad.reshape(21, 64), nvfp4_quantize(g2).dequantize() @ w_dgrad)
    gt, xt = _pad_tokens(g2.t().contiguous()), _pad_tokens(x2.t().contiguous())
    assert torch.equal(gw, nvfp4_quantize(gt).dequantize() @ nvfp4_quantize(xt).dequantize().t())
    assert int(layer.nvfp4_sr_calls) == 0  # no draws without stochastic rounding
    # with the transform back on, only the weight gradient changes
    on, _ = _layer(rht=True, stochastic_rounding=False, weight_2d=False)
    x_on, y_on, _, gw_on = _run(on)
    assert torch.equal(y_on, y) and torch.equal(x_on.grad, x.grad) and not torch.equal(gw_on, gw)


def test_a_conv1d_quantizes_as_a_linear_holding_its_transpose():
    from transformers.pytorch_utils import Conv1D

    layer, lin = _layer()
    conv = Conv1D(48, 64)
    with torch.no_grad():
        conv.weight.copy_(lin.weight.t())
    twin = EmulatedFP8Conv1D(conv, layer.spec)
    twin.sr_stream = layer.sr_stream
    _, y, _, gw = _run(layer)
    _, y2, _, gw2 = _run(twin)
    assert torch.equal(y, y2) and torch.equal(gw, gw2.t())


def test_stochastic_rounding_is_unbiased_and_replays_from_a_checkpoint():
    layer, _ = _layer()
    _run(layer)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    assert int(state["nvfp4_sr_calls"]) == 2  # a persistent buffer: the FP8 state file of a checkpoint keeps it
    _, _, _, after = _run(layer, seed=2)
    after = after.clone()
    resumed, _ = _layer()
    resumed.load_state_dict(state)
    _, _, _, again = _run(resumed, seed=2)
    assert torch.equal(after, again)
    fresh, _ = _layer()
    fresh.load_state_dict(state)
    fresh.nvfp4_sr_calls.zero_()  # the counter lost: other draws, another gradient
    _, _, _, other = _run(fresh, seed=2)
    assert not torch.equal(after, other)
    # unbiased: each block [6, 2.6, 2.6, ...] keeps its scale exact, so 2.6 lies between the E2M1 values 2 and 3: round
    # to nearest gives 3 every time, the draws give 3 six times in ten
    x = torch.full((64, 256), 2.6)
    x[:, ::16] = 6.0
    sr = nvfp4_quantize(x, noise=hashed_uniform(x.shape, torch.tensor(7))).dequantize()
    inner = torch.ones_like(x, dtype=torch.bool)
    inner[:, ::16] = False
    up = (sr[inner] - 3.0).abs() < 1e-5
    assert bool((up | ((sr[inner] - 2.0).abs() < 1e-5)).all())  # 2 or 3 (times the tensor scale's float32 ulp)
    assert float(up.float().mean()) == pytest.approx(0.6, abs=0.01)
    assert float(nvfp4_quantize(x).dequantize()[inner].mean()) == pytest.approx(3.0, abs=1e-5)


def test_fp4_statistics_count_flushed_blocks_and_not_the_block_maxima():
    torch.manual_seed(4)
    x = torch.randn(16, 64)
    x[0, :16] *= 1e-9  # one block 1e-9 below the tensor's amax: its E4M3 scale flushes to zero
    q = nvfp4_quantize(x)
    assert float(q.block_scales[0, 0].float()) == 0.0
    raw = raw_operand_stats(x, e2m1_values(q.codes), q.dequantize(), E2M1, block_clamp=torch.tensor(1 / 64))
    amax, saturation, underflow, _, clamp = finish_operand_stats(raw).tolist()
    assert amax == float(x.abs().max())
    # the flushed block's 16 values underflow, like every value under 1/24 of its block's largest (not more than that)
    small = (x.abs() < x.reshape(16, 4, 16).abs().amax(-1).repeat_interleave(16, -1) / 24).float().mean()
    assert 16 / x.numel() <= underflow <= float(small) + 16 / x.numel()
    # each block's largest value is clipped by at most the E4M3 scale's rounding: not saturation
    assert saturation == 0.0 and clamp == pytest.approx(1 / 64)
    # a layer on a sampled step measures the share of blocks whose scale flushed, per operand
    layer, _ = _layer()
    layer.record_stats = True
    layer(x.reshape(1, 16, 64))
    got = layer.stats.to_floats()
    assert got["input"]["mx_clamp"] == pytest.approx(1 / 64) and got["weight"]["mx_clamp"] == 0.0
    assert got["input"]["underflow"] >= 16 / x.numel() and got["input"]["saturation"] == 0.0
    assert 10 < got["input"]["sqnr_db"] < 25  # FP4: about 17 dB on Gaussian values


def test_the_section_refuses_what_nvfp4_cannot_mean_in_one_line(tmp_path):
    cfg = FP8Config(scaling="nvfp4")
    assert isinstance(cfg, NVFP4Config) and cfg.format == "E4M3"
    assert cfg.options() == {
        "block_size": 16,
        "weight_2d": True,
        "rht": True,
        "rht_signs": None,
        "stochastic_rounding": True,
        "sr_seed": 0,
    }
    for bad, words in (
        ({"format": "HYBRID"}, "format: 'HYBRID' does not apply to scaling 'nvfp4'"),
        ({"block_size": 32}, "block_size: 32 is not supported for nvfp4 (allowed: 16)"),
        ({"margin": 1}, "margin: does not apply to scaling 'nvfp4'"),
        ({"backend": "native"}, "native has no NVFP4 GEMM yet"),
        ({"backend": "torchao"}, "'nvfp4' is not available with backend torchao"),
        ({"rht_signs": [1] * 15}, "rht_signs"),
        ({"rht_signs": [1] * 15 + [2]}, "rht_signs"),
    ):
        with pytest.raises(ValueError, match=r"nvfp4|rht_signs") as err:
            FP8Config(scaling="nvfp4", **bad)
        assert words in str(err.value)
    with pytest.raises(ValueError, match="rht: does not apply to scaling 'delayed'"):
        FP8Config(scaling="delayed", rht=True)
    # a recipe that switches an FP8 recipe to nvfp4 drops the FP8 format it inherits, and back
    child = resolve_recipe({"name": "c", "extends": "h100-fp8-delayed", "fp8": {"scaling": "nvfp4"}})
    assert child.fp8.scaling == "nvfp4" and child.fp8.format == "E4M3"
    back = resolve_recipe({"name": "d", "extends": "b200-nvfp4", "fp8": {"scaling": "delayed"}})
    assert back.fp8.scaling == "delayed" and back.fp8.format == "HYBRID"
    # ... and the FP4 health thresholds of b200-nvfp4: FP8's own defaults apply again, or the child's
    fp4 = load_recipe("b200-nvfp4", check_hardware=False).health.detectors
    assert fp4.fp8_sqnr.threshold == 15.0 and fp4.fp8_underflow.threshold == 0.4
    assert back.health.detectors.fp8_sqnr.threshold == 20.0 and back.health.detectors.fp8_underflow.threshold == 0.1
    assert back.health.detectors.mx_clamp.threshold == 0.01
    own = resolve_recipe(
        {
            "name": "e",
            "extends": "b200-nvfp4",
            "fp8": {"scaling": "mxfp8"},
            "health": {"detectors": {"fp8_sqnr": {"threshold": 18.0, "reaction": "warn"}}},
        }
    )
    assert own.health.detectors.fp8_sqnr.threshold == 18.0 and own.health.detectors.fp8_sqnr.reaction == "warn"
    assert own.health.detectors.fp8_saturation.threshold == 0.001
    same = resolve_recipe({"name": "f", "extends": "b200-nvfp4", "fp8": {"rht": False}})
    assert same.health.detectors.fp8_sqnr.threshold == 15.0  # nvfp4 still: its thresholds stay
    # an nvfp4 recipe's per-layer thresholds default to FP4's own, whether written from scratch or switched to from
    # an FP8 parent whose thresholds were its own; b200-nvfp4 writes the same values out
    table = {"fp8_saturation": 0.01, "fp8_underflow": 0.4, "fp8_sqnr": 15.0, "mx_clamp": 0.05}
    scratch = resolve_recipe({"name": "g", "precision": "fp8", "fp8": {"scaling": "nvfp4"}})
    parent = tmp_path / "p.yaml"
    parent.write_text("name: p\nextends: h100-fp8-delayed\nhealth: {detectors: {fp8_sqnr: {threshold: 25}}}\n")
    switched = resolve_recipe({"name": "h", "extends": str(parent), "fp8": {"scaling": "nvfp4"}})
    for recipe in (scratch, switched, load_recipe("b200-nvfp4", check_hardware=False)):
        assert {k: getattr(recipe.health.detectors, k).threshold for k in table} == table, recipe.name
    assert resolve_recipe({"name": "k", "extends": str(parent)}).health.detectors.fp8_sqnr.threshold == 25
    # an unset scaling is delayed: a child that writes scaling: delayed switches nothing and keeps the history length
    (tmp_path / "i.yaml").write_text("name: i\nprecision: fp8\nfp8: {amax_history_len: 16}\n")
    child = resolve_recipe({"name": "j", "extends": str(tmp_path / "i.yaml"), "fp8": {"scaling": "delayed"}})
    assert child.fp8.amax_history_len == 16

    # a phase that switches to or from nvfp4 drops the format the same way
    def phases(base: str, scaling: str) -> tuple:
        second = {"start": 0.5, "precision": "fp8", "fp8": {"scaling": scaling}}
        spec = {"name": "p", "extends": base, "phases": [{"start": 0, "precision": "fp8"}, second]}
        return resolve_recipe(spec).phase_specs()

    first, second = phases("h100-fp8-delayed", "nvfp4")
    assert first.fp8.format == "HYBRID" and second.fp8.scaling == "nvfp4" and second.fp8.format == "E4M3"
    assert phases("b200-nvfp4", "current")[1].fp8.format == "HYBRID"


def test_blackwell_runs_nvfp4_and_hopper_refuses_it_naming_the_rehearsal():
    assert "nvfp4" in support_for("cuda", (10, 0), "12.8").fp8_scalings
    assert "nvfp4" in support_for("cuda", (12, 0), "12.8").fp8_scalings  # TE: compute capability >= 10.0
    hopper = support_for("cuda", (9, 0), "12.8")
    assert "nvfp4" not in hopper.fp8_scalings and "compute capability >= 10.0" in hopper.lacks["nvfp4"]
    info = HardwareInfo(device_type="cuda", device_name="NVIDIA H100", capability=(9, 0), cuda_version="12.8")
    with pytest.raises(Exception, match="NVFP4") as err:
        check_recipe(load_recipe("b200-nvfp4", check_hardware=False), info)
    assert "--rehearse" in str(err.value) and "\n" not in str(err.value)
    # on a CPU the refusal names what NVFP4 needs, not FP8's compute capability 8.9 (an H100 has that)
    with pytest.raises(Exception, match=r"needs NVFP4 \(FP4 tensor cores: needs compute capability >= 10\.0"):
        check_recipe(load_recipe("b200-nvfp4", check_hardware=False), HardwareInfo(device_type="cpu"))
    # a B200 with a Transformer Engine older than NVFP4BlockScaling: refused before any work, naming the version
    blackwell = {"device_type": "cuda", "device_name": "NVIDIA B200", "capability": (10, 0), "cuda_version": "12.8"}
    with pytest.raises(Exception, match=r"Transformer Engine 2\.8\.0 has no NVFP4BlockScaling \(it needs >= 2\.9"):
        check_recipe(load_recipe("b200-nvfp4", check_hardware=False), HardwareInfo(**blackwell, te_version="2.8.0"))
    check_recipe(load_recipe("b200-nvfp4", check_hardware=False), HardwareInfo(**blackwell, te_version="2.9.0"))
    # the same old TE does not stop a recipe whose backend is the rehearsal
    rehearsal = resolve_recipe({"name": "r", "extends": "b200-nvfp4", "fp8": {"backend": "emulated"}})
    check_recipe(rehearsal, HardwareInfo(**blackwell, te_version="2.8.0"))


def test_transformer_engines_recipe_follows_each_switch():
    rec = load_recipe("b200-nvfp4", check_hardware=False)
    name, kwargs = te_recipe_spec(rec)
    assert name == "NVFP4BlockScaling"
    assert kwargs == {
        "disable_rht": False,
        "disable_stochastic_rounding": False,
        "disable_2d_quantization": False,
        "fp8_dpa": False,
        "fp8_mha": False,
    }
    off = resolve_recipe(
        {"name": "o", "extends": "b200-nvfp4", "fp8": {"rht": False, "stochastic_rounding": False, "weight_2d": False}}
    )
    assert te_recipe_spec(off)[1]["disable_rht"] and te_recipe_spec(off)[1]["disable_2d_quantization"]
    assert te_recipe_spec(off)[1]["disable_stochastic_rounding"]
    assert accelerate_fp8_config(rec) is None  # Accelerate's TERecipeKwargs cannot build it: ours applies it
    signs = resolve_recipe({"name": "s", "extends": "b200-nvfp4", "fp8": {"rht_signs": [1] * 16}})
    with pytest.raises(ValueError, match=r"fp8\.rht_signs: Transformer Engine applies its own"):
        te_recipe_spec(signs)


def test_memory_counts_half_a_byte_a_value_and_a_scale_byte_per_16():
    # two FP4 copies of a 4096 x 4096 weight (rows and columns) with one E4M3 byte per 16 values and a tensor scale
    assert te_weight_bytes(4096, 4096, "nvfp4") == 2 * (4096 * 4096 // 2) + 2 * (4096 * 4096 // 16 + 4)
    assert te_weight_bytes(4096, 4096, "mxfp8") == 2 * 4096 * 4096 + 2 * 4096 * 4096 // 32
    assert te_saved_input_bytes(2048, 4096, "nvfp4") == 2048 * 4096 // 2 + 4096 * 2048 // 16 + 4


def test_plan_and_estimate_show_nvfp4_layers_and_their_bytes(capsys):
    from hf_mixedprec.cli.app import main
    from hf_mixedprec.commands.estimate import estimate_memory

    assert main(["plan", "--recipe", "b200-nvfp4"]) == 0
    out = capsys.readouterr().out
    assert "| model.layers.[0-2].mlp.up_proj | Linear |" in out
    assert "nvfp4 (emulated, E2M1 values, E4M3 scale per 16) | converted |" in out
    assert "rule last_blocks (last_blocks_share 0.16: fp8 off)" in out  # block 3 of 4
    # on a GPU (Transformer Engine) the FP4 weight copies: half a byte a value (te_weight_bytes, tested above), over
    # 3 blocks where b200-mxfp8 has 4
    est = estimate_memory(None, ["b200-mxfp8", "b200-nvfp4"], seq_len=256)
    mx, nv = (r.memory.fp8_extras for r in est.recipes)
    assert 0 < nv < mx


def test_a_health_fallback_moves_an_nvfp4_layer_to_bf16_holding_the_same_weights():
    """The per-layer fallback reaction under NVFP4 goes to BF16, as Transformer Engine can do per layer (its recipe
    is set per autocast region, not per layer): the rehearsal does what the run would do."""
    from hf_mixedprec.fp8 import to_high_precision
    from hf_mixedprec.training.health import layers_to_bf16

    layer, lin = _layer()
    high = to_high_precision(layer)
    assert type(high) is nn.Linear and high.weight is lin.weight
    model = nn.Sequential(layer)
    assert layers_to_bf16(model, ["0"]) == ["0"] and type(model[0]) is nn.Linear
    assert "0.nvfp4_sr_calls" not in model.state_dict()
