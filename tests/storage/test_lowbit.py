"""torchao's low-bit AdamW as hf_mixedprec builds it (``storage/lowbit.py``): torchao's update bit for bit, a flagged
step skipped on the device (weights, states and step count unchanged), and no host read to decide it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torchao.optim as ao

import hf_mixedprec
from hf_mixedprec.core._private import found_inf_handed_to
from hf_mixedprec.recipes.storage_config import StorageConfig
from hf_mixedprec.storage.lowbit import _parts, _without_flagged, low_bit_class
from hf_mixedprec.storage.setup import matches_storage, optimizer_class, replace_optimizer
from hf_mixedprec.training.runtime import MixedPrecisionRuntime

TORCHAO = {"8bit": ao.AdamW8bit, "4bit": ao.AdamW4bit, "fp8": ao.AdamWFp8}


def _params(dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    # 4-bit states need 128-element blocks and torchao leaves tensors under 4096 elements in FP32: 64 x 256 is low-bit
    return [torch.nn.Parameter(torch.randn(64, 256, generator=gen).to(dtype)) for _ in range(3)]


def _state_parts(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [part.clone() for p in params for key in sorted(opt.state[p]) for part in _parts(opt.state[p][key])]


@pytest.mark.parametrize(
    ("states", "dtype"),
    # each state class once and each weight dtype twice (every case compiles torchao's update afresh)
    [("8bit", torch.float32), ("8bit", torch.bfloat16), ("4bit", torch.bfloat16), ("fp8", torch.float32)],
    ids=["8bit-fp32", "8bit-bf16", "4bit-bf16", "fp8-fp32"],
)
def test_unflagged_steps_are_torchaos_and_a_flagged_one_changes_nothing(states, dtype):
    """The same weights and gradients through torchao's class and ours: torchao steps at steps 1, 2 and 4, ours
    at 1-4 with step 3 flagged (an inf in its gradient). Ours leaves every weight, state tensor (codes, scales) and
    the step count of the flagged step as they were, leaves the gradient alone, and ends bit for bit on torchao's."""
    theirs, ours = _params(dtype), _params(dtype)
    ref = TORCHAO[states](theirs, lr=1e-2, weight_decay=0.1)
    opt = low_bit_class(states)(ours, lr=1e-2, weight_decay=0.1)
    assert type(opt).__name__ == TORCHAO[states].__name__ and opt._step_supports_amp_scaling
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 5):
        grads = [torch.randn(p.shape, generator=gen).to(dtype) for p in ours]
        for a, b, g in zip(theirs, ours, grads):
            a.grad, b.grad = g.clone(), g.clone()
        if step == 3:
            ours[1].grad[5, 7] = float("inf")
            grad = ours[1].grad.clone()
            weights, held = [p.detach().clone() for p in ours], _state_parts(opt, ours)
            with found_inf_handed_to(opt, torch.ones(())):
                opt.step()
            assert all(torch.equal(w, p) for w, p in zip(weights, ours))
            assert all(torch.equal(x, y) for x, y in zip(held, _state_parts(opt, ours)))
            assert torch.equal(grad, ours[1].grad)
            continue
        ref.step()
        with found_inf_handed_to(opt, torch.zeros(())):
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(theirs, ours)), step
    assert {float(opt.state[p]["step"]) for p in ours} == {3.0}
    assert all(torch.equal(x, y) for x, y in zip(_state_parts(ref, theirs), _state_parts(opt, ours)))


def test_a_loss_scale_handed_to_the_step_divides_the_gradient():
    """Under an FP16 scaler that did not unscale, ``grad_scale`` comes with the flag: the update is torchao's on the
    gradient divided by it."""
    theirs, ours = _params(torch.float32), _params(torch.float32)
    ref, opt = ao.AdamW8bit(theirs, lr=1e-2), low_bit_class("8bit")(ours, lr=1e-2)
    for a, b in zip(theirs, ours):
        g = torch.randn_like(a)
        a.grad, b.grad = g / 1024.0, g.clone()
    ref.step()
    with found_inf_handed_to(opt, torch.zeros(())):
        opt.grad_scale = torch.tensor(1024.0)  # as GradScaler.step sets it for an AMP-aware optimizer
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(theirs, ours))


def test_the_loss_scale_is_divided_out_in_fp32():
    """Where the scaler did not unscale, the update takes the gradient divided by the scale in FP32, as torch's fused
    AdamW divides it: a BF16 gradient divided in BF16 would be rounded once more."""
    g = torch.randn(64, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    scale = torch.tensor(3.0)
    got = _without_flagged(g, None, scale)
    assert got.dtype == torch.float32 and torch.equal(got, g.float() / 3.0)
    assert not torch.equal(got, (g / scale).float())  # the BF16 division rounds: this test can tell them apart
    flagged = _without_flagged(g, torch.tensor(True), scale)
    assert torch.equal(flagged, torch.zeros_like(got))


@pytest.mark.parametrize("flag", [None, 0.0], ids=["no-flag", "flag"])
def test_step_hooks_run_once(flag):
    """torch wraps each optimizer class's step with the step hooks once a first instance is built; ours calls
    torchao's step without its wrapper, so a hook runs once per step even after torchao's own class was built."""
    ao.AdamW8bit(_params(torch.float32), lr=1e-2)  # torchao's class now carries the wrapper too
    params = _params(torch.float32)
    opt = low_bit_class("8bit")(params, lr=1e-2)
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    opt.register_step_post_hook(lambda *a: calls.append("post"))
    for p in params:
        p.grad = torch.randn_like(p)
    if flag is None:
        opt.step()
    else:
        with found_inf_handed_to(opt, torch.tensor(flag)):
            opt.step()
    assert calls == ["pre", "post"]


def test_an_own_loop_keeps_the_low_bit_optimizer_it_was_handed():
    """``prepare()`` in an own Accelerate loop hands over the optimizer built with ``storage_optimizer``: ours is kept
    as it is, and so is torchao's own class."""
    storage = StorageConfig(master="fp32", optimizer_states="8bit")
    for opt in (low_bit_class("8bit")(_params(torch.float32), lr=1e-3), ao.AdamW8bit(_params(torch.float32), lr=1e-3)):
        assert replace_optimizer(storage, opt) is opt


@contextlib.contextmanager
def host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Records every read of a tensor's value on the host (``.item()``, ``bool()``, ``float()``, ``int()``,
    ``.tolist()``: a sync on a GPU). A method patch, not a dispatch mode: torchao's update is compiled with
    ``fullgraph=True``, which refuses to run under one."""
    seen: list[str] = []
    with monkeypatch.context() as m:
        for name in ("item", "__bool__", "__float__", "__int__", "tolist"):
            real = getattr(torch.Tensor, name)

            def counted(self, *a, _real=real, _name=name, **k):
                seen.append(_name)
                return _real(self, *a, **k)

            m.setattr(torch.Tensor, name, counted)
        yield seen


@pytest.mark.parametrize("ours", [True, False], ids=["hf_mixedprec", "torchao"])
def test_the_guard_skips_without_a_host_read(ours, monkeypatch):
    """Through the scale-1 guard of a BF16 run, as the runtime hands it the step's flag: ours takes the flag inside
    ``step()`` and reads nothing on the host; torchao's own class goes through ``GradScaler.step``'s host check, one
    read a step (which is what this test sees, so it can fail). Both skip the flagged step."""
    params = _params(torch.bfloat16)
    opt = (low_bit_class("8bit") if ours else ao.AdamW8bit)(params, lr=1e-2)
    rt = MixedPrecisionRuntime(hf_mixedprec.load_recipe("cpu-bf16"))
    scaler = rt.make_guard_scaler()
    for p in params:
        p.grad = torch.randn_like(p)
    rt.amp.mark_skip(opt, torch.tensor(0.0))
    scaler.step(opt)  # compiles torchao's update outside the counting mode
    scaler.update()
    reads, changed = [], []
    for flag in (1.0, 0.0):
        before = [p.detach().clone() for p in params]
        rt.amp.mark_skip(opt, torch.tensor(flag))
        with host_reads(monkeypatch) as seen:
            scaler.step(opt)
        scaler.update()
        reads.append(len(seen))
        changed.append(not all(torch.equal(b, p) for b, p in zip(before, params)))
    assert changed == [False, True]
    assert reads == ([0, 0] if ours else [1, 1])


def test_the_storage_setup_builds_ours_and_accepts_torchaos_own():
    storage = StorageConfig(master="fp32", optimizer_states="8bit")
    cls, kwargs = optimizer_class(storage, lr=1e-3)
    assert cls is low_bit_class("8bit") and issubclass(cls, ao.AdamW8bit)
    assert kwargs == {"lr": 1e-3, "bf16_stochastic_round": False}
    params = _params(torch.float32)
    assert matches_storage(storage, cls(params, lr=1e-3))
    assert matches_storage(storage, ao.AdamW8bit(params, lr=1e-3))  # a user's own torchao optimizer still fits
    assert not matches_storage(storage, ao.AdamW4bit(params, lr=1e-3))
