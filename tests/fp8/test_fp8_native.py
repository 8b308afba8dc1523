"""The native FP8 backend (torch._scaled_mm) against the emulated rehearsal: the same FP8 operands and scales bit for
bit, losses equal up to GEMM accumulation, checkpoints that move both ways; refusals for what it cannot run."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_mixedprec
from hf_mixedprec.core.demo import builtin_text, byte_batches, tiny_llama
from hf_mixedprec.fp8 import convert, fp8_layers, fp8_step
from hf_mixedprec.fp8.emulated import EmulatedFP8GEMM
from hf_mixedprec.fp8.native import NativeFP8Linear, fp8_mm, native_available
from hf_mixedprec.integrations.recipe import load_recipe_file, resolve_recipe

SCALINGS = ["h100-fp8-delayed", "h100-fp8-current"]


def _recipe(name: str, backend: str):
    return resolve_recipe({"name": f"{name}-{backend}", "extends": name, "fp8": {"backend": backend}})


class _Operands:
    """Every (layer, role, gemm) quantization as (FP8 bytes, scale), in call order."""

    def __init__(self, monkeypatch):
        self.seen: list[tuple[str, int, str, torch.Tensor, torch.Tensor]] = []
        real = EmulatedFP8GEMM.quantize_for

        def spy(mod, t, role, *, gemm, src_dtype=None):
            q = real(mod, t, role, gemm=gemm, src_dtype=src_dtype)
            self.seen.append((type(mod).__name__, role, gemm, q.data.view(torch.uint8).clone(), q.scale.clone()))
            return q

        monkeypatch.setattr(EmulatedFP8GEMM, "quantize_for", spy)


def _train(recipe_name: str, backend: str, steps: int = 4, model=None):
    torch.manual_seed(0)
    model = model if model is not None else tiny_llama()
    convert(model, _recipe(recipe_name, backend), backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for batch in byte_batches(builtin_text(), seq_len=32, batch_size=4, n_batches=steps, seed=1):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        fp8_step(model)
        losses.append(loss.item())
    return model, losses


@pytest.mark.parametrize("name", SCALINGS)
def test_native_feeds_the_gemms_the_emulated_operands_bit_for_bit(name, monkeypatch):
    """One step from the same weights and batch: every FP8 operand (input, weight, output gradient) and its scale,
    forward and backward, is the emulated backend's byte for byte; the GEMMs alone differ."""
    spy = _Operands(monkeypatch)
    batch = next(iter(byte_batches(builtin_text(), seq_len=32, batch_size=4, n_batches=1, seed=3)))
    grads = {}
    for backend in ("emulated", "native"):
        model = tiny_llama()
        convert(model, _recipe(name, backend), backend=backend)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=batch, labels=batch).loss.backward()
        grads[backend] = {n: p.grad for n, p in model.named_parameters()}
    half = len(spy.seen) // 2
    emulated, native = spy.seen[:half], spy.seen[half:]
    assert len(emulated) == len(native) == 14 * 3  # 14 FP8 layers x (input, weight, output gradient)
    assert {e[0] for e in emulated} == {"EmulatedFP8Linear"} and {n[0] for n in native} == {"NativeFP8Linear"}
    for e, n in zip(emulated, native, strict=True):
        assert e[1:3] == n[1:3]
        assert torch.equal(e[3], n[3]) and torch.equal(e[4], n[4]), e[1:3]
    # gradients agree up to the GEMMs' accumulation order (both accumulate in float32; see the loss test)
    for key, g in grads["emulated"].items():
        torch.testing.assert_close(grads["native"][key], g, rtol=2e-2, atol=1e-5)


@pytest.mark.parametrize("name", SCALINGS)
def test_operands_stay_equal_over_several_steps(name, monkeypatch):
    """Over 4 training steps, each started by the native model from the emulated model's state (weights and
    delayed-scaling buffers: scales other than 1 from step 2 on), every FP8 operand and scale of both backends
    is equal byte for byte: the rehearsal's quantization is the native run's, whatever the scaling state."""
    spy = _Operands(monkeypatch)
    emu, nat = tiny_llama(), tiny_llama()
    convert(emu, _recipe(name, "emulated"), backend="emulated")
    convert(nat, _recipe(name, "native"), backend="native")
    opt = torch.optim.AdamW(emu.parameters(), lr=1e-2)
    scales_seen = set()
    for batch in byte_batches(builtin_text(), seq_len=32, batch_size=4, n_batches=4, seed=2):
        nat.load_state_dict(emu.state_dict())
        spy.seen.clear()
        for model in (emu, nat):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(input_ids=batch, labels=batch).loss.backward()
        half = len(spy.seen) // 2
        assert half == 14 * 3
        for e, n in zip(spy.seen[:half], spy.seen[half:], strict=True):
            assert e[1:3] == n[1:3] and torch.equal(e[3], n[3]) and torch.equal(e[4], n[4]), e[1:3]
            scales_seen.add(float(e[4]))
        opt.step()
        opt.zero_grad(set_to_none=True)
        nat.zero_grad(set_to_none=True)
        fp8_step(emu)
    assert len(scales_seen) > 10  # real, varied scales were compared, not only the delayed start at 1.0


@pytest.mark.parametrize("name", SCALINGS)
def test_native_trains_as_the_emulated_backend(name):
    """Over several steps the losses match to GEMM-accumulation tolerance, and delayed scaling's state (amax
    history, scales) comes out equal: the quantization is shared, only float32 summation order differs."""
    emu, emu_losses = _train(name, "emulated", steps=5)
    nat, nat_losses = _train(name, "native", steps=5)
    # 1e-3 relative: the FP8 products are exact in float32 either way (two 4-bit mantissas), so only the order
    # of ~100-term float32 sums differs (a few ulp each), and bf16 outputs round that further
    for a, b in zip(emu_losses, nat_losses, strict=True):
        assert abs(a - b) <= 1e-3 * abs(a), (emu_losses, nat_losses)
    assert emu_losses[-1] < emu_losses[0]
    if name == "h100-fp8-delayed":
        for (n1, m1), (n2, m2) in zip(fp8_layers(emu), fp8_layers(nat), strict=True):
            assert n1 == n2
            torch.testing.assert_close(m2.fp8_amax_history, m1.fp8_amax_history, rtol=2e-2, atol=0)
            assert m2.fp8_amax_history.count_nonzero() == m1.fp8_amax_history.count_nonzero() > 0


@pytest.mark.parametrize(("first", "second"), [("emulated", "native"), ("native", "emulated")])
def test_a_checkpoint_moves_between_emulated_and_native(first, second):
    """Rehearse on one, resume on the other: the state_dict (weights and delayed-scaling buffers) loads as it is."""
    model, _ = _train("h100-fp8-delayed", first, steps=3)
    state = copy.deepcopy(model.state_dict())
    assert any(k.endswith("fp8_amax_history") for k in state)
    other = tiny_llama(seed=5)
    convert(other, _recipe("h100-fp8-delayed", second), backend=second)
    other.load_state_dict(state)
    for k, v in other.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert isinstance(dict(other.named_modules())["model.layers.0.mlp.up_proj"], EmulatedFP8GEMM)


def test_fp8_mm_pads_dims_that_are_not_multiples_of_16():
    a = torch.randn(19, 40).to(torch.float8_e4m3fn)
    b = torch.randn(40, 7).to(torch.float8_e5m2)
    ia, ib = torch.tensor(0.5), torch.tensor(0.25)
    got = fp8_mm(a, b, ia, ib, torch.float32)
    assert got.shape == (19, 7)
    torch.testing.assert_close(got, (a.float() * 0.5) @ (b.float() * 0.25), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scaling", ["mxfp8", "blockwise"])
def test_block_scalings_are_refused_by_name(scaling):
    """In a recipe: a validation error at fp8.backend; asked for directly: a ValueError naming both choices."""
    base = "b200-mxfp8" if scaling == "mxfp8" else "h100-fp8-blockwise"
    with pytest.raises(hf_mixedprec.RecipeError, match=rf"fp8.backend.*native runs delayed and current .*'{scaling}'"):
        _recipe(base, "native")
    with pytest.raises(ValueError, match=rf"native runs scaling delayed/current .* not '{scaling}'"):
        convert(tiny_llama(), hf_mixedprec.load_recipe(base, rehearse=True), backend="native")


def test_a_recipe_names_the_native_backend_and_its_gemms_are_fp8(monkeypatch):
    """``fp8.backend: native`` converts every FP8 layer (Linear and GPT-2's Conv1D) and each step runs the three
    GEMMs of each layer through torch._scaled_mm."""
    assert native_available(torch.device("cpu"))[0]  # its one probe GEMM, once per process, before the count
    calls = []
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(a[0].dtype) or real(*a, **k))
    recipe = _recipe("h100-fp8-delayed", "native")
    assert recipe.fp8.backend == "native"
    model = tiny_llama()
    report = convert(model, recipe)
    assert report.backend == "native" and len(report.converted) == 14
    assert all(isinstance(m, NativeFP8Linear) for _, m in fp8_layers(model))
    batch = torch.randint(0, 256, (2, 32))
    model(input_ids=batch, labels=batch).loss.backward()
    assert len(calls) == 14 * 3
    assert set(calls) == {torch.float8_e4m3fn, torch.float8_e5m2}  # E4M3 forward, E5M2 gradients (HYBRID)


def test_gpt2_conv1d_runs_native_as_emulated():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64)
    batch = torch.randint(0, 256, (2, 32))
    losses = {}
    for backend in ("emulated", "native"):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(cfg)
        report = convert(model, _recipe("h100-fp8-current", backend), backend=backend)
        assert len(report.converted) == 8  # c_attn, c_proj, c_fc, mlp.c_proj per block
        losses[backend] = model(input_ids=batch, labels=batch).loss.item()
    assert abs(losses["native"] - losses["emulated"]) <= 1e-4 * losses["emulated"]


@pytest.mark.slow
def test_compiled_native_delayed_trains_as_eager_with_no_graph_breaks():
    """Under torch.compile the native layers' quantizers, FP8 GEMMs and delayed-scaling state trace into the graph
    (no graph break) and the compiled run equals the eager one: losses and every amax history."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    runs = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = tiny_llama()
        convert(model, _recipe("h100-fp8-delayed", "native"), backend="native")
        step_model = torch.compile(model, backend="aot_eager") if compiled else model
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        losses = []
        for batch in byte_batches(builtin_text(), seq_len=32, batch_size=4, n_batches=3, seed=1):
            loss = step_model(input_ids=batch, labels=batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            fp8_step(model)
            losses.append(loss.item())
        runs[compiled] = (losses, [m.fp8_amax_history.clone() for _, m in fp8_layers(model)])
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0, torch._dynamo.utils.counters["graph_break"]
    assert runs[True][0] == runs[False][0]
    for compiled_hist, eager_hist in zip(runs[True][1], runs[False][1], strict=True):
        assert torch.equal(compiled_hist, eager_hist)
        assert compiled_hist[-3:, 2].min() > 0  # the gradients' amaxes (recorded in backward) reached the history


@pytest.mark.parametrize(
    ("recipe", "installed", "expected"),
    [
        ("h100-fp8-delayed", set(), "native"),  # delayed scaling runs without TE now, as the recipe says
        ("h100-fp8-delayed", {"torchao"}, "native"),  # torchao has no delayed scaling
        ("h100-fp8-current", {"torchao"}, "torchao"),  # measured faster than native for current (benchmarks.md)
        ("h100-fp8-current", set(), "native"),
        ("h100-fp8-delayed", {"transformer_engine", "torchao"}, "transformer_engine"),
    ],
)
def test_auto_on_an_fp8_gpu_without_transformer_engine(monkeypatch, recipe, installed, expected):
    """``fp8.backend: auto`` on a CUDA GPU with FP8 tensor cores (stood in for: no GPU here)."""
    from hf_mixedprec import fp8
    from hf_mixedprec.fp8 import native

    monkeypatch.setattr(fp8, "_has", lambda mod: mod in installed)
    monkeypatch.setattr(native, "native_available", lambda device: (True, ""))
    backend, notes = fp8.resolve_backend(load_recipe_file(recipe), torch.device("cuda"))
    assert backend == expected
    assert notes and f"-> {'torchao tensorwise' if expected == 'torchao' else expected}" in notes[0]


def test_auto_names_every_backend_when_none_runs(monkeypatch):
    from hf_mixedprec import fp8
    from hf_mixedprec.fp8 import native

    monkeypatch.setattr(fp8, "_has", lambda mod: False)
    monkeypatch.setattr(native, "native_available", lambda device: (False, "compute capability 8.0 has no FP8"))
    with pytest.raises(fp8.FP8BackendUnavailable, match=r"native: compute capability 8\.0 has no FP8"):
        fp8.resolve_backend(load_recipe_file("h100-fp8-delayed"), torch.device("cuda"))


def test_sampled_statistics_are_the_emulated_ones():
    """On a sampled step the native layers dequantize for the statistics only, and report what the emulated layers
    report for the same weights and batch (the statistics come from the shared quantizers, not from the GEMM)."""
    batch = torch.randint(0, 256, (2, 32))
    tables = {}
    for backend in ("emulated", "native"):
        model = tiny_llama()
        convert(model, _recipe("h100-fp8-current", backend), backend=backend)
        for _, m in fp8_layers(model):
            m.record_stats = True
        model(input_ids=batch, labels=batch).loss.backward()
        tables[backend] = torch.stack([m.raw_stats for _, m in fp8_layers(model)])
    assert tables["native"].shape == (14, 3, tables["native"].shape[-1])
    assert torch.equal(tables["native"].nan_to_num(-1.0), tables["emulated"].nan_to_num(-1.0))
    assert torch.isfinite(tables["native"][:, :, 0]).all()  # every role measured


@pytest.mark.parametrize("native", [False, True], ids=["emulated", "native"])
@pytest.mark.parametrize("dims", [(64, 64), (40, 24)], ids=["aligned", "padded"])
def test_an_inplace_activation_after_an_fp8_layer_trains_as_the_out_of_place_one(native, dims):
    """``nn.ReLU(inplace=True)`` right after an FP8 layer, on sampled and unsampled steps: the layer's output was a
    view its autograd function returned, which autograd refuses to modify in place. Now the step runs, and the
    gradients equal those of the out-of-place ReLU."""
    from hf_mixedprec.fp8 import EmulatedFP8Linear
    from hf_mixedprec.fp8.emulated import EmulationSpec

    cls = NativeFP8Linear if native else EmulatedFP8Linear
    grads = {}
    for inplace in (True, False):
        torch.manual_seed(0)
        layer = cls(torch.nn.Linear(*dims, bias=False), EmulationSpec(scaling="current"))
        model = torch.nn.Sequential(layer, torch.nn.ReLU(inplace=inplace))
        x = torch.randn(2, 4, dims[0], generator=torch.Generator().manual_seed(1), requires_grad=True)
        for sampled in (False, True):
            layer.record_stats = sampled
            model(x).square().sum().backward()
        assert layer.measured == (True, True, True)
        grads[inplace] = (x.grad, layer.weight.grad)
    for a, b in zip(grads[True], grads[False], strict=True):
        assert a.abs().sum() > 0 and torch.equal(a, b)
