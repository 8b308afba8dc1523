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
from hf_mixedprec.demo import builtin_text, byte_batches, tiny_llama
from hf_mixedprec.fp8 import (
    EmulatedFP8GEMM,
    convert,
    emulated_layers,
    fp8_step,
    iter_emulated,
    monitored_layers,
)
from hf_mixedprec.health import layers_to_bf16
from hf_mixedprec.recipe import resolve_recipe
from hf_mixedprec.runtime import MixedPrecisionRuntime
from hf_mixedprec.scaling import delayed_update


def _recipe(**fp8):
    spec = {"scaling": "delayed", "backend": "emulated", "amax_history_len": 4, **fp8}
    return resolve_recipe({"name": "t", "precision": "fp8", "fp8": spec})


@torch.no_grad()
def _per_layer_reference(model: nn.Module) -> None:
    """The update ``fp8_step`` made before it was batched: one ``delayed_update`` per layer per role."""
    mods = [m for _, m in iter_emulated(model) if m.spec.scaling == "delayed"]
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
        pend = {n: m.fp8_amax_pending for n, m in iter_emulated(model)}
        ref_pend = {n: m.fp8_amax_pending for n, m in iter_emulated(ref)}
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
        assert all(not m.fp8_amax_pending.any() for _, m in iter_emulated(model))
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
    scales = torch.stack([m.fp8_scale for _, m in iter_emulated(model)])
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
    assert any(torch.ne(m.fp8_scale, 1).any() for _, m in emulated_layers(model))
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
    first = emulated_layers(model)
    assert emulated_layers(model) is first and monitored_layers(model) is monitored_layers(model)
    assert [n for n, _ in first] == [n for n, _ in iter_emulated(model)] and len(first) == 14
    name = first[3][0]
    assert layers_to_bf16(model, [name]) == [name]
    now = emulated_layers(model)
    assert now is not first and name not in dict(now) and len(now) == 13
    assert name not in dict(monitored_layers(model))
    assert not isinstance(model.get_submodule(name), EmulatedFP8GEMM)
    # the swapped layer's state is no longer advanced
    moved = dict(first)[name]
    moved.fp8_amax_pending.fill_(2.0)
    fp8_step(model)
    assert torch.equal(moved.fp8_scale, torch.ones(3))
