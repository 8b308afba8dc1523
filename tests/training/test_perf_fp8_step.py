"""FP8 per-step state in O(1) tensor operations: ``fp8_step`` updates every delayed-scaling layer in one batched
call, bit-identical to the per-layer, per-role update it replaced; the runtime's per-step hooks issue the same
number of tensor operations for a 2-block and an 8-block Llama; the layer lists are collected once and forgotten
when a layer is swapped."""

from __future__ import annotations

import collections
import copy
import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import hf_mixedprec
from hf_mixedprec.core import metrics as M
from hf_mixedprec.core.demo import builtin_text, byte_batches, tiny_llama
from hf_mixedprec.fp8 import (
    EmulatedFP8GEMM,
    convert,
    fp8_layers,
    fp8_step,
)
from hf_mixedprec.integrations.recipe import resolve_recipe
from hf_mixedprec.scaling import delayed_update
from hf_mixedprec.training.health import layers_to_bf16
from hf_mixedprec.training.runtime import MixedPrecisionRuntime


def _recipe(**fp8):
    spec = {"scaling": "delayed", "backend": "emulated", "amax_history_len": 4, **fp8}
    return resolve_recipe({"name": "t", "precision": "fp8", "fp8": spec})


@torch.no_grad()
def _per_layer_reference(model: nn.Module) -> None:
    """The update ``fp8_step`` made before it was batched: one ``delayed_update`` per layer per role."""
    mods = [m for _, m in fp8_layers(model, emulated_only=True, fresh=True) if m.spec.scaling == "delayed"]
    pending = torch.stack([m.fp8_amax_pending for m in mods])
    for i, m in enumerate(mods):
        for role, fmt in enumerate((m.fwd_fmt, m.fwd_fmt, m.bwd_fmt)):
            hist, scale = delayed_update(
                m.fp8_amax_history[:, role : role + 1],
                m.fp8_scale[role : role + 1],
                pending[i, role : role + 1],
                fmt=fmt,
                margin=m.spec.margin,
                algo=m.spec.amax_compute_algo,
            )
            m.fp8_amax_history[:, role : role + 1] = hist
            m.fp8_scale[role : role + 1] = scale
        m.fp8_amax_pending.zero_()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if ".fp8_" in k}


SPECIAL = (0.0, math.nan, math.inf, 1e-30, 3e38, 1e-45, 448.0, 57344.0)


@pytest.mark.parametrize(
    "fp8",
    [
        {},
        {"margin": 3, "amax_compute_algo": "most_recent"},
        {"format": "E4M3", "margin": 64, "amax_history_len": 1},
    ],
)
def test_fp8_step_is_bit_identical_to_the_per_layer_update(fp8):
    """A recorded sequence: real training steps of a tiny Llama (the amaxes its forward and backward saw), and steps
    whose pending amaxes are set to zero, NaN, inf, subnormal and format-maximum values layer by layer."""
    recipe = _recipe(**fp8)
    model = tiny_llama()
    convert(model, recipe)
    ref = copy.deepcopy(model)
    batches = byte_batches(builtin_text(), seq_len=32, batch_size=2, n_batches=6, seed=0)
    gen = torch.Generator().manual_seed(1)
    for step, batch in enumerate(batches):
        for m in (model, ref):
            m(input_ids=batch, labels=batch).loss.backward()
        pend = {n: m.fp8_amax_pending for n, m in fp8_layers(model, emulated_only=True, fresh=True)}
        ref_pend = {n: m.fp8_amax_pending for n, m in fp8_layers(ref, emulated_only=True, fresh=True)}
        assert all(torch.equal(_bits(pend[n]), _bits(ref_pend[n])) for n in pend)
        if step % 2:  # special values, a different one per layer and role
            for i, name in enumerate(pend):
                picks = torch.randint(len(SPECIAL), (3,), generator=gen).tolist()
                vals = torch.tensor([SPECIAL[(p + i) % len(SPECIAL)] for p in picks])
                pend[name].copy_(vals)
                ref_pend[name].copy_(vals)
        fp8_step(model)
        _per_layer_reference(ref)
        got, want = _state(model), _state(ref)
        assert got.keys() == want.keys() and len(got) == 2 * len(pend)
        for k in got:
            assert torch.equal(_bits(got[k]), _bits(want[k])), (step, k, got[k], want[k])
        assert all(not m.fp8_amax_pending.any() for _, m in fp8_layers(model, emulated_only=True, fresh=True))
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
    scales = torch.stack([m.fp8_scale for _, m in fp8_layers(model, emulated_only=True, fresh=True)])
    assert (scales != 1).any()  # the sequence did move the scales


class _OpCounter(TorchDispatchMode):
    """Counts the aten operations run inside it (one per dispatched call, a foreach op counting once)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _hook_ops(layers: int, steps: int = 4) -> list[collections.Counter[str]]:
    """Tensor operations of the runtime's hooks (begin_step, before and after the optimizer step) per step of a
    Llama with ``layers`` blocks under the rehearsed h100-fp8-delayed recipe; no step logs or samples."""
    recipe = hf_mixedprec.load_recipe("h100-fp8-delayed", rehearse=True)
    rt = MixedPrecisionRuntime(recipe, device="cpu")
    model = tiny_llama(num_hidden_layers=layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    report = rt.convert_model(model, opt)
    assert report is not None and len(report.converted) == 7 * layers
    scaler = rt.make_guard_scaler()
    batches = byte_batches(builtin_text(), seq_len=32, batch_size=2, n_batches=steps, seed=0)
    per_step = []
    for batch in batches:
        counter = _OpCounter()
        with counter:
            rt.begin_step(model)
        assert not rt._sampling
        with rt.autocast():
            loss = model(input_ids=batch, labels=batch).loss
        rt.record_loss(loss)
        loss.backward()
        with counter:
            rt.before_optimizer_step(model.parameters(), opt)
        scaler.step(opt)
        scaler.update()
        with counter:
            rt.after_optimizer_step(model, opt)
        opt.zero_grad(set_to_none=True)
        per_step.append(counter.ops)
    assert any(torch.ne(m.fp8_scale, 1).any() for _, m in fp8_layers(model, emulated_only=True))
    return per_step


def test_hook_tensor_ops_per_step_do_not_grow_with_the_number_of_fp8_layers():
    small, large = _hook_ops(2), _hook_ops(8)
    for a, b in zip(small[1:], large[1:]):  # after the first step (the clipper's warm-up branch is the same)
        assert a == b, (a - b, b - a)
    total = sum(small[-1].values())
    assert 0 < total < 150, small[-1]
    assert small[-1]["_foreach_copy_"] == 2 and small[-1]["_foreach_zero_"] == 1


def test_layer_lists_are_collected_once_and_forgotten_when_a_layer_is_swapped():
    model = tiny_llama()
    convert(model, _recipe())
    first = fp8_layers(model, emulated_only=True)
    assert fp8_layers(model, emulated_only=True) is first and fp8_layers(model) is fp8_layers(model)
    assert [n for n, _ in first] == [n for n, _ in fp8_layers(model, emulated_only=True, fresh=True)] and len(
        first
    ) == 14
    name = first[3][0]
    assert layers_to_bf16(model, [name]) == [name]
    now = fp8_layers(model, emulated_only=True)
    assert now is not first and name not in dict(now) and len(now) == 13
    assert name not in dict(fp8_layers(model))
    assert not isinstance(model.get_submodule(name), EmulatedFP8GEMM)
    # the swapped layer's state is no longer advanced
    moved = dict(first)[name]
    moved.fp8_amax_pending.fill_(2.0)
    fp8_step(model)
    assert torch.equal(moved.fp8_scale, torch.ones(3))


def _logging_ops(layers: int) -> tuple[collections.Counter[str], dict[str, float], dict[str, dict]]:
    """Tensor operations of a logging step's ``check`` + ``metrics`` after an FP8-sampled step, the metrics logged,
    and each layer's statistics as the layer itself reports them."""
    from hf_mixedprec.fp8 import fp8_layers

    spec = {"name": "sampled", "extends": "h100-fp8-delayed", "health": {"fp8_sample_every": 2}}
    rt = MixedPrecisionRuntime(resolve_recipe(spec).rehearsed(), device="cpu")
    model = tiny_llama(num_hidden_layers=layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    rt.convert_model(model, opt)
    scaler = rt.make_guard_scaler()
    counter = _OpCounter()
    for step, batch in enumerate(byte_batches(builtin_text(), seq_len=32, batch_size=2, n_batches=4, seed=0), 1):
        rt.begin_step(model)
        with rt.autocast():
            loss = model(input_ids=batch, labels=batch).loss
        rt.record_loss(loss)
        loss.backward()
        rt.before_optimizer_step(model.parameters(), opt)
        scaler.step(opt)
        scaler.update()
        rt.after_optimizer_step(model, opt)
        opt.zero_grad(set_to_none=True)
        if step == 4:  # step 4 sampled (every 2nd); it logs now
            with counter:
                rt.check(model, opt)
                metrics = rt.metrics()
    layers_now = {name: m.stats.to_floats() for name, m in fp8_layers(model)}
    return counter.ops, metrics, layers_now


def test_a_logging_steps_fp8_work_does_not_grow_with_the_number_of_fp8_layers():
    """The sampled statistics of every emulated layer are finished, handed to the detectors and read as one table:
    the same tensor operations for 14 and 56 FP8 layers (it was about 65 more per layer), and the values logged
    are each layer's own."""
    small, _, _ = _logging_ops(2)
    large, metrics, layers_now = _logging_ops(8)
    assert small == large, (small - large, large - small)
    assert sum(large.values()) < 200, large
    assert len(layers_now) == 56
    for name, roles in layers_now.items():
        assert metrics[M.fp8_layer_key(name, "input_amax")] == roles["input"]["amax"] > 0
        assert metrics[M.fp8_layer_key(name, "saturation")] == max(r["saturation"] for r in roles.values())
        assert metrics[M.fp8_layer_key(name, "sqnr_db")] == min(r["sqnr_db"] for r in roles.values())


def test_tables_merge_as_the_layers_do():
    """Two samples of one model's layers, merged table to table, equal the per-layer worst (NaN wins, lower SQNR)."""
    from hf_mixedprec.scaling.stats import layer_stats_from_table
    from hf_mixedprec.training.health import _worst_of_tables

    g = torch.Generator().manual_seed(0)
    a, b = torch.rand(4, 3, 5, generator=g), torch.rand(4, 3, 5, generator=g)
    a[1, 2, 0], b[2, 0, 3] = math.nan, math.nan
    flags = [
        ((True, True, True), False),
        ((True, True, False), False),
        ((True, True, True), True),
        ((True,) * 3, False),
    ]
    names = [f"l{i}" for i in range(4)]
    held = dict(zip(names, layer_stats_from_table(a, flags)))
    new = dict(zip(names, layer_stats_from_table(b, flags)))
    merged = _worst_of_tables(held, new)
    assert merged is not None and list(merged) == names
    for name in names:
        want, got = held[name].worst(new[name]).to_floats(), merged[name].to_floats()
        assert got.keys() == want.keys()
        for role in want:
            assert got[role].keys() == want[role].keys()
            for metric, v in want[role].items():
                assert math.isnan(v) == math.isnan(got[role][metric]) and (math.isnan(v) or v == got[role][metric])
    # a layer set that does not match (another model, a probe among them) is merged per layer
    assert _worst_of_tables(held, dict(list(new.items())[:2])) is None


def _moe_step_ops(experts: int, recipe_name: str) -> collections.Counter[str]:
    """Every tensor operation of a training step (forward, backward, the runtime's hooks, the optimizer aside) of a
    tiny Qwen3-MoE with ``experts`` experts per layer whose experts run in FP8; a step that neither logs nor samples."""
    from tests.moe import tiny_qwen3_moe

    model = tiny_qwen3_moe(num_experts=experts)
    rt = MixedPrecisionRuntime(hf_mixedprec.load_recipe(recipe_name, rehearse=True), device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    report = rt.convert_model(model, opt)
    assert report is not None and {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts"} <= set(report.converted)
    batches = byte_batches(builtin_text(), seq_len=32, batch_size=2, n_batches=3, seed=0)
    counter = _OpCounter()
    for i, batch in enumerate(batches):
        counter = _OpCounter() if i == len(batches) - 1 else counter  # the last step (past the first's warm-ups)
        with counter:
            rt.begin_step(model)
            with rt.autocast():
                loss = model(input_ids=batch.remainder(256), labels=batch.remainder(256)).loss
            rt.record_loss(loss)
            loss.backward()
            rt.before_optimizer_step(model.parameters(), opt)
        opt.step()
        with counter:
            rt.after_optimizer_step(model, opt)
        opt.zero_grad(set_to_none=True)
        assert not rt._sampling
    return counter.ops


@pytest.mark.slow
@pytest.mark.parametrize("recipe_name", ["h100-fp8-delayed", "b200-mxfp8"])
def test_a_moe_steps_tensor_operations_do_not_grow_with_the_number_of_experts(recipe_name):
    """4 or 32 experts per layer: the same operations, as many of each (the experts' GEMMs are grouped, their
    per-expert scales, histories and token counts are tensors over the experts, not loops)."""
    few, many = _moe_step_ops(4, recipe_name), _moe_step_ops(32, recipe_name)
    assert few == many, (few - many, many - few)
    assert few["_grouped_mm"] == 2 * 2 * 3  # 2 layers x 2 projections x (forward, input and weight gradient)
