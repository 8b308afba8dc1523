"""StorageAdamW's single pass on a CPU (``hf_mixedprec.storage.single_pass``): the multi-pass step's bits for every
master it keeps, the parameters it leaves to the multi-pass step, and a failed check said loudly."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from hf_mixedprec.core.demo import tiny_llama
from hf_mixedprec.integrations.trainer import runtime_of
from hf_mixedprec.storage import StorageAdamW, single_pass
from hf_mixedprec.storage.optim import _multi_pass_reference
from tests.storage.test_storage import _recipe, _train

REPO = Path(__file__).resolve().parents[2]
BIG = max(single_pass.MIN_ELEMENTS.values())  # the size from which every master takes it


def _params(seed: int, grad_dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """BF16 parameters: large contiguous ones (at the threshold; of odd length; of a length whose int32 words end in
    a part vector, inductor's masked last iteration), two large ones at a storage offset (2 elements in, and 1:
    ``bf16_remainder``'s words need an even one), one transposed, one small."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(BIG + 2, generator=gen)
    made = [
        torch.randn(512, 1024, generator=gen),
        torch.randn(BIG, generator=gen),
        torch.randn(BIG + 1, generator=gen),
        torch.randn(BIG + 16 + 5, generator=gen),
        torch.randn(1024, 512, generator=gen).t(),
        torch.randn(64, 64, generator=gen),
    ]
    params = [torch.nn.Parameter((t * 0.02).to(torch.bfloat16)) for t in made]
    shared = (base * 0.02).to(torch.bfloat16)  # one storage, two parameters at offsets 2 and 1 into it
    params += [torch.nn.Parameter(shared[2:]), torch.nn.Parameter((base * 0.02).to(torch.bfloat16)[1:-1])]
    assert [p.storage_offset() for p in params[-2:]] == [2, 1]
    for p in params:
        p.grad_dtype = grad_dtype  # an FP32 gradient on a BF16 parameter is refused unless the parameter allows it
    return params


def _taking(mode: str, params: list[torch.nn.Parameter]) -> list[int]:
    """The sizes of the parameters of :func:`_params` that take the single pass."""
    taking = [p for i, p in enumerate(params) if i in (0, 1, 2, 3, 6) or (i == 7 and mode != "bf16_remainder")]
    return sorted(p.numel() for p in taking)


def _passes(mode: str, grad_dtype: torch.dtype = torch.bfloat16, **group) -> bool:
    """Whether the check passes on this machine for this setting: where it does not (a torch build that rounds
    otherwise), the single pass is rightly off, and the tests expect the multi-pass step everywhere."""
    group = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, **group}
    return single_pass.check(mode, grad_dtype, group, _multi_pass_reference) is None


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _same(a: torch.Tensor, b: torch.Tensor, nan_payloads: bool) -> bool:
    differ = _bits(a) != _bits(b)
    if nan_payloads and a.is_floating_point():
        differ &= ~(torch.isnan(a) & torch.isnan(b))
    return not bool(differ.any())


@pytest.fixture
def updates(monkeypatch):
    """The sizes of the tensors the single pass updated, in order (the check's probe is smaller than any parameter that
    takes the single pass: it runs at a process's first use, so only in some tests' processes)."""
    calls = []
    real = single_pass.update
    monkeypatch.setattr(single_pass, "update", lambda p, *a: calls.append(p.numel()) or real(p, *a))
    return calls


def _lockstep(mode, grad_dtype=torch.bfloat16, lrs=(1e-3,), around=contextlib.nullcontext, nan_at=None, skip_at=None,
              grad_scale=None, **hyper):  # fmt: skip
    """:func:`_params` stepped by StorageAdamW (single pass on) and by the same with it off, in lockstep, ``around``
    each step; ``nan_at``: a step whose gradients hold a NaN; ``skip_at``: a step GradScaler flags; ``grad_scale``: the
    scale GradScaler hands every step when the gradients were not unscaled before. Asserts that both
    end on the same bits (a NaN's payload aside where the master keeps none); returns the single-pass optimizer."""
    ours, ref = _params(0, grad_dtype), _params(0, grad_dtype)
    hyper = {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "master": mode, **hyper}
    opt = StorageAdamW(ours, lr=lrs[0], **hyper)
    multi = StorageAdamW(ref, lr=lrs[0], single_pass="off", **hyper)
    gen = torch.Generator().manual_seed(1)
    for step, lr in enumerate(lrs):
        for a, b in zip(ours, ref):
            g = torch.randn(a.shape, generator=gen) * 10.0 ** torch.randint(-6, 1, a.shape, generator=gen)
            g = g.to(grad_dtype)
            if step == nan_at:
                g.view(-1)[7] = float("nan")
            a.grad, b.grad = g.clone(), g.clone()
        for o in (opt, multi):
            o.param_groups[0]["lr"] = lr
            if step == skip_at:
                o.found_inf = torch.tensor(1.0)  # as GradScaler hands a fused optimizer its flag
            if grad_scale is not None:
                o.grad_scale = torch.tensor(grad_scale)
            with around():
                o.step()
            o.__dict__.pop("found_inf", None)
            o.__dict__.pop("grad_scale", None)
    nan_payloads = mode != "bf16_remainder"  # a remainder master stores a NaN as the quiet NaN, both ways
    for a, b in zip(ours, ref):
        assert _same(a.detach(), b.detach(), nan_payloads), (tuple(a.shape), a.storage_offset())
        for key, value in opt.state[a].items():
            assert _same(value, multi.state[b][key], nan_payloads or key.startswith("exp_")), (tuple(a.shape), key)
    return opt


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", single_pass.MODES)
def test_the_single_pass_ends_where_the_multi_pass_step_ends(mode, grad_dtype, updates):
    """Four steps under a changing learning rate, a NaN gradient element and a step GradScaler flags: every weight,
    remainder or compensation, moment and step count as the multi-pass step leaves it, and the large parameters it
    can update where they are took the single pass, three times each (the flagged step changed nothing)."""
    opt = _lockstep(mode, grad_dtype, lrs=(1e-3, 5e-4, 2e-3, 1e-3), nan_at=1, skip_at=2)
    params = opt.param_groups[0]["params"]
    taking = _taking(mode, params) if _passes(mode, grad_dtype) else []
    assert sorted(n for n in updates if n >= BIG) == sorted(taking * 3)
    for p in params:
        assert float(opt.state[p]["step"]) == 3.0
        assert torch.isnan(p.float()).any()  # the NaN gradient reached the weights, as in torch's kernel
    assert (opt.take_notes() == []) is bool(taking)


@pytest.mark.parametrize(
    ("case", "taken"),
    [
        ("no weight decay", True),
        ("lr as a tensor", True),
        ("torch.compile forced eager", True),  # the loop is compiled whatever the stance: eagerly its bits differ
        ("lr 0", False),  # a stored master is kept as it is
        ("beta1 0.5", False),  # torch's lerp takes its other formula
        ("grad_scale to divide by", False),
        ("inference mode", False),  # another compiled loop, which no check compared
        ("CPU autocast", False),
    ],
)
def test_steps_the_single_pass_takes_or_leaves_end_alike(case, taken, updates):
    """Each of these ends on the multi-pass step's bits, through the single pass where ``taken``, else without it."""
    kw: dict = {"lrs": (1e-3, 2e-3)}
    if case == "no weight decay":
        kw["weight_decay"] = 0.0
    elif case == "lr as a tensor":
        kw["lrs"] = (torch.tensor(1e-3), torch.tensor(2e-3))
    elif case == "torch.compile forced eager":
        kw["around"] = lambda: torch.compiler.set_stance("force_eager")
    elif case == "lr 0":
        kw["lrs"] = (0.0, 0.0)
    elif case == "beta1 0.5":
        kw["betas"] = (0.5, 0.95)
    elif case == "inference mode":
        kw["around"] = torch.inference_mode
    elif case == "CPU autocast":
        kw["around"] = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    elif case == "grad_scale to divide by":
        kw["grad_scale"] = 2.0
    _lockstep("bf16_remainder", **kw)
    passes = _passes("bf16_remainder", weight_decay=kw.get("weight_decay", 0.1))
    assert bool([n for n in updates if n >= BIG]) is (taken and passes)


def test_a_failed_check_keeps_the_multi_pass_step_and_says_so(monkeypatch, caplog, updates):
    """The check compares the compiled loop with the multi-pass step for real: a loop fed other scalars (here eps
    made ten times larger, as a build that computes one of them otherwise would) fails it; the optimizer then logs
    one warning, records it in ``notes`` for the run report, and updates every parameter as the multi-pass step."""
    monkeypatch.setattr(single_pass, "_checked", {})
    real = single_pass.hyper
    monkeypatch.setattr(single_pass, "hyper", lambda **k: real(**{**k, "eps": k["eps"] * 10}))
    ours, ref = _params(0, torch.bfloat16), _params(0, torch.bfloat16)
    opt = StorageAdamW(ours, lr=1e-3, master="bf16_kahan")
    multi = StorageAdamW(ref, lr=1e-3, master="bf16_kahan", single_pass="off")
    with caplog.at_level(logging.WARNING, logger="hf_mixedprec"):
        for _ in range(2):
            for a, b in zip(ours, ref):
                a.grad = b.grad = torch.full_like(a, 1e-3)
            opt.step()
            multi.step()
    assert len(updates) == 3 and max(updates) < BIG  # the check's own probe, three steps; no parameter of the run
    notes = opt.take_notes()
    assert len(notes) == 1 and opt.take_notes() == []  # each note taken once
    note = notes[0]
    assert note.startswith("StorageAdamW: the single-pass update of storage.master bf16_kahan is off on this machine:")
    assert "values differ after 3 steps" in note and "take the multi-pass step" in note
    assert [r.getMessage() for r in caplog.records] == [f"hf_mixedprec: {note}"]
    for a, b in zip(ours, ref):
        assert torch.equal(_bits(a.detach()), _bits(b.detach()))


def test_single_pass_takes_auto_or_off():
    with pytest.raises(ValueError, match=r"single_pass 'on' \(allowed: auto, off\)"):
        StorageAdamW([torch.nn.Parameter(torch.zeros(2))], single_pass="on")


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_under_a_dispatch_mode_the_step_is_the_multi_pass_one(updates):
    """``torch.compile`` refuses to trace under a ``TorchDispatchMode`` (``estimate``'s fake tensors, an operation
    counter): there the step is the multi-pass one, with its bits."""
    ours, ref = _params(0, torch.bfloat16), _params(0, torch.bfloat16)
    opt = StorageAdamW(ours, lr=1e-3, master="bf16_remainder")
    multi = StorageAdamW(ref, lr=1e-3, master="bf16_remainder", single_pass="off")
    for a, b in zip(ours, ref):
        a.grad = b.grad = torch.full_like(a, 1e-3)
    with _Count() as counted:
        opt.step()
    multi.step()
    assert counted.ops > 0 and [n for n in updates if n >= BIG] == []
    for a, b in zip(ours, ref):
        assert torch.equal(_bits(a.detach()), _bits(b.detach()))
        assert torch.equal(opt.state[a]["remainder"], multi.state[b]["remainder"])


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_trainer_run_resumes_bit_for_bit_through_the_single_pass(tmp_path, updates):
    """A BF16-loaded Llama whose embedding and head have 2**18 elements each, ``bf16_remainder`` under Trainer: the
    two take the single pass, and a checkpoint after step 2 of 4, resumed through it, ends bit for bit as the straight
    run: weights, moments, remainders and step counts."""
    from accelerate.state import AcceleratorState

    model_dir = tmp_path / "model"
    tiny_llama(0, vocab_size=BIG // 64).to(torch.bfloat16).save_pretrained(model_dir)
    recipe = _recipe(master="bf16_remainder")
    common = {"save_strategy": "steps", "save_steps": 2, "logging_steps": 1}
    straight = _train(
        recipe, AutoModelForCausalLM.from_pretrained(model_dir), tmp_path / "a", steps=4, lr=1e-4, **common
    )
    straight.train()
    runs = _passes("bf16_remainder", betas=(0.9, 0.999), weight_decay=0.0)  # Trainer's AdamW, _train's settings
    assert [n for n in updates if n >= BIG] == [BIG] * 2 * 4 * runs
    want = {k: v.clone() for k, v in straight.model.state_dict().items()}
    want_state = straight.optimizer.optimizer.state_dict()["state"]
    assert not [n for n in runtime_of(straight).notes if "single-pass" in n]
    updates.clear()
    AcceleratorState._reset_state(reset_partial_state=True)
    resumed = _train(
        recipe, AutoModelForCausalLM.from_pretrained(model_dir), tmp_path / "b", steps=4, lr=1e-4, **common
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    got = resumed.model.state_dict()
    assert [n for n in want if not torch.equal(want[n], got[n])] == []
    assert [n for n in updates if n >= BIG] == [BIG] * 2 * 2 * runs  # the resumed steps 3 and 4 took it too
    got_state = resumed.optimizer.optimizer.state_dict()["state"]
    assert want_state.keys() == got_state.keys()
    for i, entries in want_state.items():  # moments, remainders and step counts, bit for bit
        assert [k for k, v in entries.items() if not torch.equal(v, got_state[i][k])] == [], i


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_failed_check_reaches_the_run_report(tmp_path, monkeypatch):
    """The optimizer's note, made inside Trainer's step, ends in the runtime's notes (the run report's)."""
    monkeypatch.setattr(single_pass, "_checked", {("bf16_kahan", torch.bfloat16, (0.9, 0.999), 1e-08, 0.0): "why"})
    model = tiny_llama(0, vocab_size=BIG // 64).to(torch.bfloat16)
    tr = _train(_recipe(master="bf16_kahan"), model, tmp_path, steps=2, lr=1e-4)
    tr.train()
    notes = [n for n in runtime_of(tr).notes if "single-pass" in n]
    assert len(notes) == 1 and "is off on this machine: why;" in notes[0]


_OTHER_BUILD = """
import json, torch
from hf_mixedprec.storage import StorageAdamW
made = [torch.nn.Parameter((torch.randn(512, 512, generator=torch.Generator().manual_seed(0)) * .02).bfloat16())
        for _ in range(2)]
opts = [StorageAdamW([p], lr=1e-3, master="bf16_remainder", single_pass=s) for p, s in zip(made, ("auto", "off"))]
for step in range(3):
    g = torch.randn(512, 512, generator=torch.Generator().manual_seed(step)).bfloat16()
    for p, o in zip(made, opts):
        p.grad = g.clone()
        o.step()
a, b = (o.state[p] for p, o in zip(made, opts))
same = torch.equal(made[0].view(torch.int16), made[1].view(torch.int16)) and all(
    torch.equal(a[k], b[k]) for k in ("remainder", "exp_avg", "exp_avg_sq", "step"))
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "notes": opts[0].take_notes(),
                  "same": same}))
"""


@pytest.mark.slow
def test_a_build_that_rounds_otherwise_is_caught_for_real(tmp_path):
    """torch with its vector kernels off (``ATEN_CPU_CAPABILITY=default``) rounds its fused AdamW otherwise than the
    compiled loop (which follows the vector kernels): the check finds it on its own (no test hook), the optimizer
    says so, and the step it keeps ends where the multi-pass one does. Inductor's cache is a folder of its
    own: its graph cache does not tell a forced capability from the machine's."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p)
    done = subprocess.run([sys.executable, "-c", _OTHER_BUILD], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["capability"] == "DEFAULT" and got["same"] is True
    assert len(got["notes"]) == 1, got["notes"]
    note = got["notes"][0]
    assert note.startswith("StorageAdamW: the single-pass update of storage.master bf16_remainder is off on this")
    assert "values differ after 3 steps" in note
