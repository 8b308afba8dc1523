"""Storage precision (``storage:``): master weights, optimizer-state dtypes, the plan that says them, and every entry
point putting them into effect on a model loaded in BF16 (what transformers 5 does with most published configs)."""

from __future__ import annotations

import math

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, Trainer

from hf_mixedprec.core.demo import tiny_llama
from hf_mixedprec.integrations.recipe import load_recipe, resolve_recipe
from hf_mixedprec.integrations.trainer import attach, runtime_of
from hf_mixedprec.precision.plan import build_plan
from hf_mixedprec.storage import (
    StorageAdamW,
    StorageRefusal,
    bits,
    combine_remainder,
    split_remainder,
    stochastic_round_bf16,
)
from hf_mixedprec.storage.bits import hash_seed
from hf_mixedprec.storage.optim import pending_state
from tests.integrations.test_integration import Bytes

CHOICES = [
    ("fp32", "fp32"),
    ("bf16_remainder", "fp32"),
    ("bf16_kahan", "bf16"),
    ("bf16_stochastic", "fp32"),
    ("none", "fp32"),
]


def _recipe(base: str = "a100-bf16", **storage: str):
    return resolve_recipe({"name": "storage", "extends": base, "storage": storage}).rehearsed()


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    """A tiny Llama saved in bfloat16: ``from_pretrained`` loads it in bfloat16, as most published models load."""
    d = tmp_path_factory.mktemp("bf16-model")
    tiny_llama(0).to(torch.bfloat16).save_pretrained(d)
    return d


# -- bits --------------------------------------------------------------------------------------------------------


def test_remainder_gives_back_every_fp32_bit_and_a_nearest_bf16_weight():
    torch.manual_seed(0)
    x = torch.randn(200_000) * torch.logspace(-38, 37, 200_000)
    edges = torch.tensor([0x7F7FFFFF, 0x00007FFF, 0x00008000, -(2**31), -(2**31) + 0x7FFF], dtype=torch.int32)
    x = torch.cat([x, torch.tensor([0.0, -0.0, float("inf"), -float("inf")]), edges.view(torch.float32)])
    upper, rem = split_remainder(x)
    assert upper.dtype == torch.bfloat16 and rem.dtype == torch.int16
    assert torch.equal(combine_remainder(upper, rem).view(torch.int32), x.view(torch.int32))
    finite = torch.isfinite(x) & (x.abs() < 3e38)
    # round to nearest: only exact ties may differ from torch's ties-to-even
    off = upper[finite].float() != x[finite].to(torch.bfloat16).float()
    low = x[finite].view(torch.int32) & 0xFFFF
    assert bool((low[off] == 0x8000).all()) and int(off.sum()) < 20


def test_the_int16_split_is_the_int32_formula_on_every_kind_of_pattern():
    """The split works on the int16 halves of each pattern; it must give what the defining int32 arithmetic gives
    (``rem`` = the low half read signed, ``upper`` = ``(bits - rem) >> 16``) on 4M random patterns and every
    pattern whose halves sit at the borrow and carry edges (NaN patterns aside: they become the quiet NaN)."""
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 22,), generator=gen, dtype=torch.int64).to(torch.int32)
    highs = torch.tensor([0, 1, 0x7F7F, 0x7F80, 0x8000, 0x8001, 0xFF7F, 0xFF80], dtype=torch.int64)
    lows = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    edges = ((highs[:, None] << 16) | lows[None, :]).reshape(-1)
    bits = torch.cat([bits, (edges - ((edges >> 31) << 32)).to(torch.int32)])
    x = bits.view(torch.float32)
    x = x[~torch.isnan(x)]
    b = x.view(torch.int32)
    low = b & 0xFFFF
    rem = low - ((low & 0x8000) << 1)
    upper = (b - rem) >> 16
    got_upper, got_rem = split_remainder(x)
    assert torch.equal(got_rem, rem.to(torch.int16))
    assert torch.equal(got_upper.view(torch.int16), upper.to(torch.int16))
    back = (upper * 65536 + rem).view(torch.float32)
    assert torch.equal(combine_remainder(got_upper, got_rem).view(torch.int32), back.view(torch.int32))
    # any shape and layout: a scalar parameter, a transposed or channels-last weight
    grid = x[: 6 * 8 * 4 * 3].reshape(6, 8, 4, 3)
    for t in (x[7].clone(), grid[0, 0].t(), grid.permute(0, 2, 3, 1), grid.to(memory_format=torch.channels_last)):
        u, r = split_remainder(t)
        assert u.shape == t.shape and r.shape == t.shape
        assert torch.equal(combine_remainder(u, r).view(torch.int32), t.contiguous().view(torch.int32))


def test_a_nan_master_is_a_nan_weight():
    """CUDA's canonical NaN (0x7FFFFFFF), x86's (0xFFC00000) and a low-half-only payload: the BF16 weight the forward
    reads is NaN (never a zero or an inf that would hide it from the detectors), and NaN comes back."""
    nans = torch.tensor([0x7FFFFFFF, -0x400000, 0x7F800001, -1], dtype=torch.int32).view(torch.float32)
    upper, rem = split_remainder(nans)
    assert torch.isnan(upper).all() and torch.isnan(combine_remainder(upper, rem)).all()
    assert torch.isnan(stochastic_round_bf16(nans, torch.Generator().manual_seed(0))).all()


def test_the_cpu_fast_path_splits_and_rounds_as_the_nan_safe_one(monkeypatch):
    """On a CPU a run with no NaN is split and stochastically rounded from its own memory (no NaN select): the same
    bits as the NaN-safe path, for every kind of pattern and layout, the tensor left as it was (a one-element
    tensor's half is contiguous already, so only a copy keeps the carry of a negative remainder out of it); a run
    with a NaN, or infinities that cancel in the probe's sum, takes the safe path."""
    gen = torch.Generator().manual_seed(1)
    pats = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = pats.view(torch.float32)
    x = x[x.abs() < 1e30]  # every sign, zeros and subnormals; no sum of them overflows
    grid = x[: 5 * 7 * 4 * 3].reshape(5, 7, 4, 3)
    inf = torch.tensor([1.0, float("inf"), -0.0])
    both = torch.tensor([1.0, float("inf"), -float("inf")])
    carry = torch.tensor(0x3F808000, dtype=torch.int32).view(torch.float32)  # a negative remainder: a carry
    cases = [x, carry.clone(), carry.reshape(1).clone(), grid[0, 0].t(), grid.permute(0, 2, 3, 1), inf, both]
    fast = [bits._nan_free_on_host(t) for t in cases]
    assert fast == [True] * 6 + [False]
    assert not bits._nan_free_on_host(torch.tensor([0.0, float("nan")]))
    for t in cases:
        before = t.clone()
        got = [*split_remainder(t), stochastic_round_bf16(t, torch.Generator().manual_seed(5))]
        assert torch.equal(t.view(torch.int32), before.view(torch.int32))  # read, never written
        with monkeypatch.context() as m:
            m.setattr(bits, "_nan_free_on_host", lambda _: False)
            want = [*split_remainder(t), stochastic_round_bf16(t, torch.Generator().manual_seed(5))]
        for a, b in zip(got, want):
            assert a.shape == t.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_the_nan_probe_reads_only_cpu_tensors(monkeypatch):
    """The probe is a host read: it runs on real CPU tensors only, never on a device tensor (a sync on a GPU; meta
    stands in here), a fake one (``estimate``) or under ``torch.compile``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    reads = []
    real = torch.Tensor.__bool__
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda self: reads.append(self.device) or real(self))
    assert not bits._nan_free_on_host(torch.ones(4, device="meta"))
    with FakeTensorMode() as mode:
        assert not bits._nan_free_on_host(mode.from_tensor(torch.ones(4)))
    assert torch.compile(bits._nan_free_on_host, backend="eager", fullgraph=True)(torch.ones(4)) is False
    assert reads == []
    rows = torch.randn(3, 4)  # under vmap each row is split as on its own (a batched tensor has no value to read)
    batched = torch.vmap(lambda r: split_remainder(r)[1])(rows)
    assert torch.equal(batched, torch.stack([split_remainder(r)[1] for r in rows]))
    reads.clear()
    assert bits._nan_free_on_host(torch.ones(4)) and reads == [torch.device("cpu")]


def test_stochastic_rounding_is_unbiased_and_repeats_with_its_generator():
    v = torch.full((100_000,), 1.0 + 2**-10)  # 1/8 of the way between two BF16 neighbours
    a = stochastic_round_bf16(v, torch.Generator().manual_seed(3)).float()
    b = stochastic_round_bf16(v, torch.Generator().manual_seed(3)).float()
    assert torch.equal(a, b)
    assert set(a.unique().tolist()) == {1.0, 1.0078125}
    assert abs(a.mean().item() - (1.0 + 2**-10)) < 2e-5
    for value in (-(1.0 + 2**-10), 3e-39, -3e-39, 1e30):  # negative, subnormal, large
        got = stochastic_round_bf16(torch.full((200_000,), value), torch.Generator().manual_seed(1)).float()
        assert abs(got.mean().item() - value) < 2e-4 * abs(value), value
        assert len(got.unique()) == 2, value
    exact = torch.tensor([1.0, -2.5, 0.0, float("inf")])
    assert torch.equal(stochastic_round_bf16(exact, torch.Generator().manual_seed(0)).float(), exact)
    assert torch.isnan(stochastic_round_bf16(torch.tensor([float("nan")]))).all()


# -- StorageAdamW --------------------------------------------------------------------------------------------------


def _twins(master: str, steps: int, lr: float = 1e-5, state_dtype=torch.float32, shape=(64, 48)):
    """An FP32-master StorageAdamW and one keeping ``master`` for the same BF16 start, fed the same BF16 gradients."""
    torch.manual_seed(0)
    w0 = torch.randn(*shape)
    if master != "bf16_remainder":  # the others start from the BF16 weight itself
        w0 = w0.to(torch.bfloat16).float()
    ref = torch.nn.Parameter(w0.clone())
    upper, rem = split_remainder(w0.clone())
    low = torch.nn.Parameter(upper.clone() if master == "bf16_remainder" else w0.to(torch.bfloat16))
    if master == "bf16_remainder":
        pending_state([(low, "remainder", rem)])
    o_ref = StorageAdamW([ref], lr=lr, weight_decay=0.01)
    o_low = StorageAdamW([low], lr=lr, weight_decay=0.01, master=master, state_dtype=state_dtype, seed=1)
    for _ in range(steps):
        g = (torch.randn(*shape) * 1e-2).to(torch.bfloat16)
        low.grad = g
        ref.grad = g.float()
        o_ref.step()
        o_low.step()
    return ref, low, o_low, w0


def test_remainder_master_equals_the_fp32_master_bit_for_bit_after_many_steps():
    ref, low, opt, w0 = _twins("bf16_remainder", 300)
    master = combine_remainder(low.data, opt.state[low]["remainder"])
    assert torch.equal(master.view(torch.int32), ref.data.view(torch.int32))
    assert not torch.equal(ref.data, w0)  # it trained


def test_fp32_mode_is_torch_fused_adamw_bit_for_bit():
    """FP32 weights and moments: the same kernel as ``AdamW(fused=True)`` (Trainer's ``adamw_torch_fused``)."""
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(32, 16)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    ours = StorageAdamW(a, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    theirs = torch.optim.AdamW(b, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    for _ in range(50):
        for p, q in zip(a, b):
            p.grad = torch.randn(32, 16)
            q.grad = p.grad.clone()
        ours.step()
        theirs.step()
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert all(torch.equal(ours.state[p]["exp_avg_sq"], theirs.state[q]["exp_avg_sq"]) for p, q in zip(a, b))


def _fused_twin(shapes, masters, steps, chunk):
    """BF16 parameters of ``shapes`` under StorageAdamW (``chunk`` elements a run, so they split into several runs)
    beside FP32 copies under torch's fused AdamW; a parameter without a gradient every third step."""
    torch.manual_seed(3)
    w0 = [torch.randn(s) for s in shapes]
    ref = [torch.nn.Parameter(w.clone()) for w in w0]
    low = []
    for w in w0:
        upper, rem = split_remainder(w.clone())
        p = torch.nn.Parameter(upper)
        pending_state([(p, "remainder", rem)]) if masters == "bf16_remainder" else None
        low.append(p)
    o_ref = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.01, fused=True)
    o_low = StorageAdamW(low, lr=1e-3, weight_decay=0.01, master=masters, chunk_elements=chunk)
    for i in range(steps):
        for j, (r, q) in enumerate(zip(ref, low)):
            g = None if (i + j) % 3 == 2 else (torch.randn(r.shape) * 1e-2).to(torch.bfloat16)
            q.grad = g
            r.grad = None if g is None else g.float()
        o_ref.step()
        o_low.step()
    return ref, low, o_low


def test_remainder_masters_end_on_torch_fused_adamw_bit_for_bit_across_runs():
    """Runs of several parameters, a parameter larger than a run, parameters skipped on some steps: every FP32
    master rebuilt from its BF16 weight and remainder equals torch's fused AdamW on FP32 weights, bit for bit."""
    ref, low, opt = _fused_twin([(64, 48), (7,), (300, 11), (5, 5), (2, 3, 4)], "bf16_remainder", 40, chunk=3000)
    for j, (r, q) in enumerate(zip(ref, low)):
        master = combine_remainder(q.data, opt.state[q]["remainder"])
        assert torch.equal(master.view(torch.int32), r.data.view(torch.int32))
        assert float(opt.state[q]["step"]) == sum((i + j) % 3 != 2 for i in range(40))
    for q in low:
        q.grad = torch.zeros_like(q)
    assert [len(run.params) for run in opt._chunks(opt.param_groups[0])] == [1, 1, 1, 2]  # 3072 | 7 | 3300 | 25 + 24


@pytest.mark.parametrize("master", ["bf16_kahan", "bf16_stochastic", "none"])
def test_each_bf16_master_is_its_rule_applied_to_the_fused_update(master):
    """One step of one run written out: torch's fused AdamW on the FP32 master, then the rule of ``master`` (Kahan:
    nearest BF16 and the BF16 compensation; stochastic: noise drawn for the whole run from a generator seeded with
    ``hash_seed(seed, step count, run, shard, stream)``: 7, the first step, run 0, whole tensors (-1), the weights (2);
    none: nearest BF16)."""
    from hf_mixedprec.storage.bits import kahan_store

    torch.manual_seed(1)
    shapes = [(16, 8), (33,), (4, 4, 2)]
    low = [torch.nn.Parameter(torch.randn(s).to(torch.bfloat16)) for s in shapes]
    opt = StorageAdamW(low, lr=1e-2, weight_decay=0.1, master=master, seed=7)
    grads = [torch.randn(s).to(torch.bfloat16) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().float()) for p in low]
    for p, r, g in zip(low, ref, grads):
        p.grad, r.grad = g, g.float()
    torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, fused=True).step()
    opt.step()
    flat = torch.cat([r.detach().reshape(-1) for r in ref])
    if master == "bf16_kahan":
        want, comp = kahan_store(flat)
        got_comp = torch.cat([opt.state[p]["compensation"].reshape(-1) for p in low])
        assert torch.equal(got_comp.view(torch.int16), comp.view(torch.int16))
    elif master == "bf16_stochastic":
        want = stochastic_round_bf16(flat, torch.Generator().manual_seed(hash_seed(7, 1, 0, -1, 2)))
    else:
        want = flat.to(torch.bfloat16)
    got = torch.cat([p.detach().reshape(-1) for p in low])
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert not torch.equal(got, torch.cat([r.detach().reshape(-1) for r in ref]).to(torch.bfloat16)) or (
        master != "bf16_stochastic"
    )


def _kernel_ops(opt: torch.optim.Optimizer) -> int:
    """Operations of one ``opt.step()`` that run a kernel (views, which only describe memory, are not counted)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        opt.step()
    return Count.n


@pytest.mark.parametrize(
    ("master", "states"),
    [("fp32", torch.float32), ("fp32", torch.bfloat16), ("bf16_remainder", torch.float32)]
    + [(m, torch.bfloat16) for m in ("bf16_remainder", "bf16_kahan", "bf16_stochastic", "none")],
)
def test_operations_per_step_do_not_grow_with_the_number_of_parameters(master, states):
    """10, 100 and 1000 parameters (one run): the same number of kernel-launching operations per step, where the
    per-parameter loop took ~20 per parameter."""
    counts = []
    for n in (10, 100, 1000):
        dtype = torch.float32 if master == "fp32" else torch.bfloat16
        params = [torch.nn.Parameter(torch.randn(8, 4).to(dtype)) for _ in range(n)]
        opt = StorageAdamW(params, lr=1e-3, master=master, state_dtype=states)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()  # the first step makes the state
        counts.append(_kernel_ops(opt))
    assert counts[0] == counts[1] == counts[2], counts
    assert counts[0] < 60, counts


def test_chunk_elements_is_checked():
    with pytest.raises(ValueError, match=r"chunk_elements 0 \(allowed: >= 1\)"):
        StorageAdamW([torch.nn.Parameter(torch.ones(2))], chunk_elements=0)


@pytest.mark.parametrize("master", ["bf16_kahan", "bf16_stochastic", "none"])
def test_bf16_masters_track_the_fp32_master_and_none_stalls(master):
    """Same BF16 start and gradients at lr 1e-5, where an update is a fraction of a BF16 ulp: Kahan follows the FP32
    master element by element, stochastic rounding on average (its movement along the FP32 master's is ~1), plain
    BF16 (none) loses most of it. 256 x 192 elements: the stochastic gain is a mean over them, and over seeds 0-11 of
    the rounding it spread 0.91-1.07 (std ~0.045; 0.72-1.23 with the 64 x 48 it had, where the bound held by the
    seed's luck)."""
    ref, low, opt, w0 = _twins(master, 200, shape=(256, 192))
    state = opt.state[low]
    got = low.data.float() + (state["compensation"].float() if "compensation" in state else 0)
    want = ref.data - w0
    gain = float(((got - w0) * want).sum() / want.pow(2).sum())
    if master == "none":
        assert gain < 0.5
    else:
        assert abs(gain - 1) < 0.2, gain
    if master == "bf16_kahan":
        assert float((got - ref.data).norm() / want.norm()) < 0.05


def test_a_flagged_step_changes_nothing_on_the_device():
    _, low, opt, _ = _twins("bf16_remainder", 3)
    before = {k: v.clone() for k, v in opt.state[low].items()}
    weight = low.data.clone()
    low.grad = torch.ones_like(low)
    opt.found_inf, opt.grad_scale = torch.ones(()), None
    opt.step()
    del opt.found_inf, opt.grad_scale
    assert torch.equal(low.data, weight)
    assert all(torch.equal(before[k], opt.state[low][k]) for k in before)


def test_state_dict_round_trip_keeps_dtypes_and_the_rounding_generator():
    _, low, opt, _ = _twins("bf16_stochastic", 5, state_dtype=torch.bfloat16)
    sd = opt.state_dict()
    twin = torch.nn.Parameter(low.data.clone())
    again = StorageAdamW([twin], lr=1e-5, weight_decay=0.01, master="bf16_stochastic", state_dtype=torch.bfloat16)
    again.load_state_dict(sd)
    assert again.state[twin]["exp_avg"].dtype == torch.bfloat16
    for p, o in ((low, opt), (twin, again)):
        p.grad = torch.full_like(p, 1e-3)
        o.step()
    assert torch.equal(low.data, twin.data)  # the same random numbers after the load
    with pytest.raises(StorageRefusal, match=r"storage\.master: .*'bf16_stochastic', this run has 'none'"):
        StorageAdamW([torch.nn.Parameter(low.data.clone())], master="none", state_dtype=torch.bfloat16).load_state_dict(
            sd
        )


# -- validation ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("storage", "message"),
    [
        ({"master": "bf16"}, "storage.master: 'bf16' is not allowed (allowed: fp32, bf16_remainder"),
        ({"optimizer_states": "int8"}, "storage.optimizer_states: 'int8' is not allowed (allowed: fp32, bf16, 8bit"),
        ({"master": "bf16_kahan", "optimizer_states": "8bit"}, "storage.optimizer_states: 8bit (torchao's"),
        (
            {"optimizer": "sgd", "optimizer_states": "8bit"},
            "storage.optimizer: 'sgd' cannot keep optimizer_states 8bit",
        ),
        ({"seed": 1}, "storage.seed: only applies to master bf16_stochastic"),
    ],
)
def test_validate_names_the_key_the_value_and_what_is_allowed(tmp_path, capsys, storage, message):
    from hf_mixedprec.cli.app import main

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"name": "bad", "extends": "a100-bf16", "storage": storage}))
    code = main(["validate", str(path)])  # `hf-mixedprec validate`, in this process
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert message in out + err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("base", "storage", "message"),
    [
        ("v100-fp16", {"master": "none"}, "FP16 weights trained under a loss scaler are refused"),
        ("v100-fp16", {"master": "bf16_remainder"}, "precision is fp16; allowed: fp32"),
        ("cpu-bf16", {"master": "bf16_kahan"}, None),
    ],
)
def test_precision_rules(base, storage, message):
    from hf_mixedprec.core.errors import RecipeError

    if message is None:
        assert _recipe(base, **storage).storage.master == storage["master"]
        return
    with pytest.raises(RecipeError, match=message):
        _recipe(base, **storage)


def test_every_builtin_recipe_states_an_fp32_master():
    from hf_mixedprec.recipes.files import builtin_recipe_names, builtin_recipe_path

    for name in builtin_recipe_names():
        raw = yaml.safe_load(builtin_recipe_path(name).read_text())
        assert raw.get("storage", {}).get("master") == "fp32", name
        assert load_recipe(name, check_hardware=False).storage.is_default, name


# -- the plan ------------------------------------------------------------------------------------------------------


def test_plan_bytes_per_param_by_choice(bf16_dir):
    model = AutoModelForCausalLM.from_pretrained(bf16_dir)
    got = {}
    for master, states in [*CHOICES, ("fp32", "bf16")]:
        got[(master, states)] = build_plan(_recipe(master=master, optimizer_states=states), model).bytes_per_param()
    n = sum(p.numel() for p in model.parameters())
    tensors = len(list(model.parameters()))
    step = 4 * tensors / n  # AdamW's float32 step counter per tensor
    assert got[("fp32", "fp32")] == pytest.approx(16 + step)
    assert got[("bf16_remainder", "fp32")] == pytest.approx(14 + step)
    assert got[("bf16_kahan", "bf16")] == pytest.approx(10 + step)
    assert got[("bf16_stochastic", "fp32")] == pytest.approx(12 + step)
    assert got[("fp32", "bf16")] == pytest.approx(12 + step)


def test_plan_keeps_a_models_strict_fp32_modules_in_fp32():
    model = tiny_llama(0)
    model._keep_in_fp32_modules_strict = {"norm"}
    plan = build_plan(_recipe(master="bf16_remainder"), model)
    assert plan.param("model.norm.weight").weight == "fp32"
    assert plan.param("model.layers.0.mlp.up_proj.weight").weight == "bf16"


# -- Trainer -------------------------------------------------------------------------------------------------------


def _train(recipe, model, out, *, steps=12, lr=1e-5, attach_late=False, **targs):
    args = recipe.training_args(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        report_to=[],
        disable_tqdm=True,
        seed=0,
        **{"save_strategy": "no", **targs},
    )
    kw = {} if attach_late else {"callbacks": recipe.callbacks()}
    tr = Trainer(model=model, args=args, train_dataset=Bytes(n=64, seq_len=32), **kw)
    if attach_late:
        tr.add_callback(recipe.callbacks()[0])
    return tr


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("late", [False, True])
def test_a_bf16_loaded_model_under_a100_bf16_trains_with_an_fp32_master(bf16_dir, tmp_path, caplog, late):
    model = AutoModelForCausalLM.from_pretrained(bf16_dir)
    assert next(model.parameters()).dtype == torch.bfloat16
    start = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    tr = _train(load_recipe("a100-bf16", rehearse=True), model, tmp_path, attach_late=late)
    with caplog.at_level("WARNING", logger="hf_mixedprec"):
        tr.train()
    assert "upcast to FP32" in caplog.text
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    rt = runtime_of(tr)
    groups = rt.plan.groups()
    assert [(g["loaded"], g["weight"], g["master"]) for g in groups] == [("bf16", "fp32", "fp32 weight")]
    changed = sum(int((p.detach() != start[n]).sum()) for n, p in model.named_parameters() if p.dim() == 2)
    total = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    assert changed / total > 0.5  # at lr 1e-5, pure BF16 changes about 15% of entries


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize(("master", "states"), [*CHOICES[1:], ("fp32", "bf16")])
def test_each_choice_trains_under_the_trainer_in_the_dtypes_the_plan_says(bf16_dir, tmp_path, master, states):
    model = AutoModelForCausalLM.from_pretrained(bf16_dir)
    tr = _train(_recipe(master=master, optimizer_states=states), model, tmp_path)
    tr.train()
    rt = runtime_of(tr)
    (group,) = rt.plan.groups()
    assert {
        str(p.dtype).removeprefix("torch.").replace("bfloat16", "bf16").replace("float32", "fp32")
        for p in model.parameters()
    } == {group["weight"]}
    opt = tr.optimizer.optimizer
    assert type(opt).__name__ == rt.plan.optimizer == "StorageAdamW"
    st = next(iter(opt.state.values()))
    assert st["exp_avg"].dtype == (torch.bfloat16 if states == "bf16" else torch.float32)
    assert ("remainder" in st) == (master == "bf16_remainder")
    assert ("compensation" in st) == (master == "bf16_kahan")


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_storage_optimizer_cannot_be_chosen_after_the_trainer_built_its_own(bf16_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(bf16_dir)
    tr = _train(_recipe(master="bf16_remainder"), model, tmp_path, attach_late=True)
    with pytest.raises(StorageRefusal, match="attach\\(trainer, recipe\\) before train\\(\\)"):
        tr.train()


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_attach_before_train_builds_the_storage_optimizer(bf16_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(bf16_dir)
    recipe = _recipe(master="bf16_remainder")
    args = recipe.training_args(output_dir=str(tmp_path), max_steps=2, report_to=[], disable_tqdm=True)
    tr = Trainer(model=model, args=args, train_dataset=Bytes(n=16, seq_len=32))
    attach(tr, recipe)
    tr.train()
    assert type(tr.optimizer.optimizer) is StorageAdamW


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_frozen_lora_base_stays_bf16_and_costs_no_master(bf16_dir, tmp_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(bf16_dir), LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    )
    tr = _train(load_recipe("a100-bf16", rehearse=True), model, tmp_path, steps=2)
    tr.train()
    for name, p in model.named_parameters():
        assert p.dtype == (torch.float32 if p.requires_grad else torch.bfloat16), name
    frozen = [g for g in runtime_of(tr).plan.groups() if not g["trainable"]]
    assert frozen and all(set(g["bytes"]) == {"weights"} for g in frozen)


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize(("master", "states"), [*CHOICES, ("fp32", "8bit")])
def test_resume_is_bitwise_under_the_trainer(bf16_dir, tmp_path, master, states):
    """A checkpoint after step 3 of 6, resumed: every parameter and optimizer state ends bit for bit as the
    straight run's (remainders, Kahan buffers and the rounding generator travel with the optimizer)."""
    from accelerate.state import AcceleratorState

    recipe = _recipe(master=master, optimizer_states=states)
    common = {"save_strategy": "steps", "save_steps": 3, "logging_steps": 1}
    straight = _train(
        recipe, AutoModelForCausalLM.from_pretrained(bf16_dir), tmp_path / "a", steps=6, lr=1e-4, **common
    )
    straight.train()
    want = {k: v.clone() for k, v in straight.model.state_dict().items()}
    losses = [h["loss"] for h in straight.state.log_history if "loss" in h]
    AcceleratorState._reset_state(reset_partial_state=True)
    resumed = _train(recipe, AutoModelForCausalLM.from_pretrained(bf16_dir), tmp_path / "b", steps=6, lr=1e-4, **common)
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-3"))
    got = resumed.model.state_dict()
    assert [n for n in want if not torch.equal(want[n], got[n])] == []
    again = [h["loss"] for h in resumed.state.log_history if "loss" in h]
    assert again == losses  # the checkpoint's log history, then the same losses


# -- the Accelerate plugin (an own loop) ---------------------------------------------------------------------------


def _own_loop(recipe, bf16_dir, out, *, steps, save_at=None, load_from=None):
    """A hand-written Accelerate loop: the user's AdamW and LambdaLR over a BF16-loaded model; returns the losses
    and the model. ``save_at``: ``accelerator.save_state`` after that step; ``load_from``: ``load_state`` first."""
    from accelerate.utils import set_seed

    from hf_mixedprec.integrations.accelerate_plugin import make_accelerator

    set_seed(0)
    acc = make_accelerator(recipe, cpu=True)
    model = AutoModelForCausalLM.from_pretrained(bf16_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    data = torch.utils.data.DataLoader(Bytes(n=32, seq_len=32), batch_size=4, shuffle=False)
    model, opt, data, sched = acc.prepare(model, opt, data, sched)
    done = 0
    if load_from is not None:
        acc.load_state(str(load_from))
        done = save_at
        data = acc.skip_first_batches(data, done)
    losses = []
    for batch in data:
        loss = model(**batch).loss
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
        done += 1
        if load_from is None and save_at is not None and done == save_at:
            acc.save_state(str(out))
        if done == steps:
            break
    return losses, acc.unwrap_model(model), acc, opt, sched


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize(("master", "states"), [*CHOICES, ("bf16_stochastic", "bf16"), ("fp32", "8bit")])
def test_own_accelerate_loop_keeps_the_storage_and_resumes_bit_for_bit(bf16_dir, tmp_path, master, states):
    from accelerate.state import AcceleratorState

    recipe = resolve_recipe(
        {
            "name": "own",
            "extends": "a100-bf16",
            "clipping": {"method": "none"},
            "storage": {"master": master, "optimizer_states": states},
        }
    ).rehearsed()
    straight, model, acc, opt, _ = _own_loop(recipe, bf16_dir, tmp_path / "ckpt", steps=6, save_at=3)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    kept = {"fp32": torch.float32}.get(master, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {kept}
    if master == "fp32":
        assert any("upcast to FP32" in n for n in acc.mp.notes)
    inner = opt.optimizer
    assert type(inner).__name__ == acc.mp.plan.optimizer.replace("unchanged", "AdamW")
    assert inner.param_groups[0]["lr"] == pytest.approx(
        1e-4 / 7
    )  # 6 steps: the user's scheduler drives the replacement
    AcceleratorState._reset_state(reset_partial_state=True)
    resumed, model2, *_ = _own_loop(recipe, bf16_dir, None, steps=6, save_at=3, load_from=tmp_path / "ckpt")
    assert resumed == straight[3:]
    got = model2.state_dict()
    assert [n for n in want if not torch.equal(want[n], got[n])] == []


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_an_optimizer_family_the_recipe_does_not_name_is_refused(bf16_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(bf16_dir)
    recipe = _recipe(optimizer="sgd")
    with pytest.raises(StorageRefusal, match=r"storage\.optimizer is 'sgd', but TrainingArguments\.optim"):
        _train(recipe, model, tmp_path, steps=1)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # a refusal changes nothing
    from hf_mixedprec.integrations.accelerate_plugin import make_accelerator

    acc = make_accelerator(recipe, cpu=True)
    with pytest.raises(StorageRefusal, match="the optimizer passed to prepare\\(\\) is AdamW"):
        acc.prepare(model, torch.optim.AdamW(model.parameters()))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


# -- finetune ------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate_state")
def test_finetune_loads_a_bf16_checkpoint_as_saved_and_the_report_says_what_training_kept(
    tmp_path, capsys, monkeypatch
):
    """``finetune --model`` of a BF16 checkpoint: the FP32 master is made (and said) by the recipe's storage; the
    saved model and health.json agree on the dtypes."""
    import json

    from hf_mixedprec.cli.app import main

    tiny_llama(vocab_size=512).to(torch.bfloat16).save_pretrained(tmp_path / "base")
    monkeypatch.chdir(tmp_path)  # `hf-mixedprec finetune` in this process, from the folder holding the model
    for recipe, kept in (("a100-bf16", "fp32"),):
        out = f"run-{kept}"
        args = ["--recipe", recipe, "--rehearse", "--model", "base", "--lr", "1e-5", "--max-steps", "4"]
        args += ["--seq-len", "32", "--batch-size", "2", "--logging-steps", "2", "--output-dir", out]
        code = main(["finetune", *args])
        err = capsys.readouterr().err
        assert code == 0, err[-3000:]
        assert "(loaded in bfloat16)" in err
        health = json.loads((tmp_path / out / "health.json").read_text())
        (group,) = health["storage"]["groups"]
        assert (group["loaded"], group["weight"]) == ("bf16", kept)
        if kept == "fp32":
            assert any("upcast to FP32" in n for n in health["notes"])
        saved = AutoModelForCausalLM.from_pretrained(tmp_path / out, dtype="auto")
        assert {p.dtype for p in saved.parameters()} == {torch.float32 if kept == "fp32" else torch.bfloat16}


# -- health: tiny_update -------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize(
    ("master", "fires"),
    [("none", True), ("bf16_remainder", False), ("bf16_kahan", False), ("bf16_stochastic", False), ("fp32", False)],
)
def test_tiny_update_fires_for_plain_bf16_only(bf16_dir, tmp_path, master, fires):
    """At lr 1e-5 updates are a fraction of a BF16 ulp: stored as plain BF16 (none) they round away and tiny_update
    says so; every master that keeps them (FP32, remainder, Kahan, stochastic rounding) is not flagged."""
    recipe = resolve_recipe(
        {"name": "t", "extends": "a100-bf16", "storage": {"master": master}, "health": {"fp8_sample_every": 2}}
    ).rehearsed()
    tr = _train(recipe, AutoModelForCausalLM.from_pretrained(bf16_dir), tmp_path, steps=8, logging_steps=2)
    tr.train()
    events = [e for e in runtime_of(tr).events if e["detector"] == "tiny_update"]
    assert bool(events) == fires, events


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_gpt2_conv1d_fp8_with_a_remainder_master_from_fp16_weights(tmp_path):
    """A GPT-2 (transformers' Conv1D) loaded in FP16, under an emulated FP8 recipe keeping BF16 weights with
    remainders: the FP16 values survive exactly in the master, the Conv1D layers run FP8 on BF16 weights, it learns."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_mixedprec.fp8 import fp8_layers
    from hf_mixedprec.storage.optim import _take_pending
    from hf_mixedprec.training.runtime import MixedPrecisionRuntime

    def gpt2():
        torch.manual_seed(0)
        cfg = GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64)
        return GPT2LMHeadModel(cfg).to(torch.float16)

    recipe = _recipe("h100-fp8-delayed", master="bf16_remainder")
    model = gpt2()
    start = model.transformer.h[0].mlp.c_fc.weight.detach().float().clone()
    MixedPrecisionRuntime(recipe, rehearse=True).prepare_storage(model)
    w = model.transformer.h[0].mlp.c_fc.weight
    assert w.dtype == torch.bfloat16
    assert torch.equal(combine_remainder(w.detach(), _take_pending(w, "remainder")), start)

    model = gpt2()
    tr = _train(recipe, model, tmp_path, steps=10, lr=1e-3, logging_steps=1)
    tr.train()
    assert sum(1 for _ in fp8_layers(model, fresh=True)) == 8  # c_attn, c_proj, c_fc, mlp.c_proj in both blocks
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    losses = [h["loss"] for h in tr.state.log_history if "loss" in h]
    assert losses[-1] < losses[0]


# -- no host read ----------------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("master", ["bf16_remainder", "bf16_kahan", "bf16_stochastic"])
def test_storage_steps_read_nothing_on_the_host_between_logs(tmp_path, monkeypatch, master):
    """StorageAdamW's step (remainder split, Kahan, stochastic rounding, the skip flag) reads no device value: the
    only host read of a run is the one copy per logging step."""
    import collections

    from tests.training.test_health import _recipe as health_recipe
    from tests.training.test_health import _run, _StepTracker, _SyncCounter

    recipe = health_recipe(f"{{storage: {{master: {master}, optimizer_states: bf16}}}}", base="cpu-bf16")
    # on a CPU the split asks the host whether a run holds a NaN (a read that is no sync there); on a GPU it never
    # asks (test_the_nan_probe_reads_only_cpu_tensors): this holds the path a GPU takes to its promise
    monkeypatch.setattr(bits, "_nan_free_on_host", lambda x: False)
    counter = _SyncCounter(monkeypatch)
    tr = _run(recipe, tmp_path, steps=6, callbacks=[_StepTracker(counter)], logging_steps=3)
    assert type(tr.optimizer.optimizer) is StorageAdamW
    hits = [h for h in counter.hits if h[0] > 0]
    assert collections.Counter(h[0] for h in hits) == {3: 1, 6: 1}, hits


# -- review findings: each a shape a stranger's code takes ---------------------------------------------------------


def test_bf16_moments_still_decay():
    """With beta2 = 0.999 the second moment decays 0.1% a step, under half a BF16 ulp: stored by round-to-nearest it
    would stay at its peak. Stochastically rounded it follows the FP32 moment."""
    for dtype in (torch.float32, torch.bfloat16):
        p = torch.nn.Parameter(torch.zeros(4096))
        opt = StorageAdamW([p], lr=1e-3, weight_decay=0.0, state_dtype=dtype)
        for i in range(600):
            p.grad = torch.full_like(p, 0.1 if i < 10 else 0.0)
            opt.step()
        v = opt.state[p]["exp_avg_sq"].float().mean().item()
        if dtype == torch.float32:
            want = v
        else:
            assert v == pytest.approx(want, rel=0.05), (v, want)


def test_an_optimizer_checkpoint_of_another_storage_is_refused():
    from hf_mixedprec.core.errors import StorageRefusal as Refusal

    p = torch.nn.Parameter(torch.randn(8, 8).to(torch.bfloat16))
    plain = torch.optim.AdamW([torch.nn.Parameter(p.detach().float())])
    plain.param_groups[0]["params"][0].grad = torch.ones(8, 8)
    plain.step()
    with pytest.raises(Refusal, match="not written by StorageAdamW"):
        StorageAdamW([p], master="bf16_remainder").load_state_dict(plain.state_dict())
    ours = StorageAdamW([p], master="bf16_remainder", state_dtype=torch.bfloat16)
    p.grad = torch.ones_like(p)
    ours.step()
    with pytest.raises(Refusal, match=r"storage\.optimizer_states: .*'bfloat16', this run has 'float32'"):
        StorageAdamW([p], master="bf16_remainder").load_state_dict(ours.state_dict())


def test_a_scaled_gradient_is_unscaled_by_the_grad_scale_a_gradscaler_hands_over():
    """torch's GradScaler hands ``grad_scale`` to an AMP-aware optimizer that was not unscaled first."""
    a, b = (torch.nn.Parameter(torch.ones(16, 16)) for _ in range(2))
    oa, ob = StorageAdamW([a], lr=1e-2), StorageAdamW([b], lr=1e-2)
    g = torch.randn(16, 16)
    a.grad, b.grad = g.clone(), g * 1024.0
    oa.step()
    ob.grad_scale, ob.found_inf = torch.tensor(1024.0), torch.zeros(())
    ob.step()
    assert torch.equal(a, b)


def test_adamw_parity_where_eps_dominates():
    """Gradients of 1e-9: the update is governed by eps (outside the square root, as torch's AdamW)."""
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(32, 16))
    b = torch.nn.Parameter(a.detach().clone())
    start = a.detach().clone()
    ours = StorageAdamW([a], lr=1e-3, eps=1e-8, weight_decay=0.0)
    theirs = torch.optim.AdamW([b], lr=1e-3, eps=1e-8, weight_decay=0.0, fused=True)
    for _ in range(20):
        g = torch.randn(32, 16) * 1e-9
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    assert (b.detach() - start).abs().max().item() > 1e-4  # it moved (about lr * g / (|g| + eps) a step)
    assert torch.equal(a, b)  # without eps, or inside the sqrt, ~1e-2 apart


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_an_optimizer_the_user_built_must_keep_the_recipes_storage(bf16_dir, tmp_path):
    """A StorageAdamW keeping another master, passed as Trainer(optimizers=...) or optimizer_cls_and_kwargs, is
    refused: the recipe's remainders would otherwise be dropped."""
    recipe = _recipe(master="bf16_remainder")
    model = AutoModelForCausalLM.from_pretrained(bf16_dir)
    args = recipe.training_args(output_dir=str(tmp_path), max_steps=1, report_to=[], disable_tqdm=True)
    data = Bytes(n=8, seq_len=32)
    wrong = StorageAdamW(model.parameters(), master="none")
    with pytest.raises(StorageRefusal, match="passed in"):
        Trainer(model=model, args=args, train_dataset=data, optimizers=(wrong, None), callbacks=recipe.callbacks())
    with pytest.raises(StorageRefusal, match="optimizer_cls_and_kwargs"):
        Trainer(
            model=model,
            args=args,
            train_dataset=data,
            optimizer_cls_and_kwargs=(StorageAdamW, {"lr": 1e-4}),
            callbacks=recipe.callbacks(),
        )
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    right = StorageAdamW(model.parameters(), master="bf16_remainder")
    tr = Trainer(model=model, args=args, train_dataset=data, optimizers=(right, None), callbacks=recipe.callbacks())
    tr.train()
    assert tr.optimizer.optimizer is right and "remainder" in next(iter(right.state.values()))


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_low_bit_class_named_in_optimizer_cls_and_kwargs_is_taken(tmp_path):
    """``optimizer_cls_and_kwargs`` naming the low-bit class the recipe needs is kept: hf_mixedprec's, or torchao's
    own (it keeps GradScaler's host check of the skip flag); another low-bit class is refused."""
    import torchao.optim as ao

    from hf_mixedprec.storage.lowbit import low_bit_class

    recipe = _recipe(master="fp32", optimizer_states="8bit")
    args = recipe.training_args(output_dir=str(tmp_path), max_steps=1, report_to=[], disable_tqdm=True)
    for cls in (low_bit_class("8bit"), ao.AdamW8bit):
        tr = Trainer(
            model=tiny_llama(0),
            args=args,
            train_dataset=Bytes(n=8, seq_len=32),
            optimizer_cls_and_kwargs=(cls, {"lr": 1e-4, "bf16_stochastic_round": False}),
            callbacks=recipe.callbacks(),
        )
        assert tr.optimizer_cls_and_kwargs[0] is cls
    with pytest.raises(StorageRefusal, match="optimizer_cls_and_kwargs"):
        Trainer(
            model=tiny_llama(0),
            args=args,
            train_dataset=Bytes(n=8, seq_len=32),
            optimizer_cls_and_kwargs=(ao.AdamW4bit, {"lr": 1e-4, "bf16_stochastic_round": False}),
            callbacks=recipe.callbacks(),
        )


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_refused_trainer_keeps_its_model_forward_and_registry(bf16_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(bf16_dir)
    forward = model.forward
    recipe = _recipe(master="bf16_remainder")
    args = recipe.training_args(output_dir=str(tmp_path), max_steps=1, report_to=[], optim="sgd")
    with pytest.raises(StorageRefusal, match="needs AdamW"):
        Trainer(model=model, args=args, train_dataset=Bytes(n=8, seq_len=32), callbacks=recipe.callbacks())
    assert model.forward == forward and runtime_of(model) is None
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("order", ["optimizer-first", "separate"])
def test_the_plugin_keeps_the_storage_whatever_the_order_of_prepare(bf16_dir, order):
    from hf_mixedprec.integrations.accelerate_plugin import make_accelerator

    acc = make_accelerator(_recipe(master="bf16_remainder"), cpu=True)
    model = AutoModelForCausalLM.from_pretrained(bf16_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if order == "optimizer-first":
        opt, model = acc.prepare(opt, model)
        assert type(opt.optimizer) is StorageAdamW
    else:
        with pytest.raises(StorageRefusal, match="prepared before its model"):
            acc.prepare(opt)


@pytest.mark.parametrize(
    ("states", "master", "why"),
    [("4bit", "fp32", "torchao's compiled 4-bit step fails a shape check"),
     ("fp8", "fp32", "torchao's FP8 state has no qmap"),
     ("8bit", "bf16_stochastic", "torchao's 8-bit state lacks aten.view.dtype over BF16 weights")],
)  # fmt: skip
def test_fsdp2_refuses_the_torchao_states_that_fail_on_shards_when_the_recipe_is_read(states, master, why):
    """Under FSDP2 every StorageAdamW choice is accepted, and torchao's 8-bit states over FP32 weights
    (tests/integrations/test_fsdp2_ranks.py trains them all); what torchao 0.18 fails on sharded parameters is refused
    in one line naming the key, the failure and what is allowed."""
    from hf_mixedprec.core.errors import RecipeError

    fsdp2 = {"strategy": "fsdp2"}
    storage = {"master": master, "optimizer_states": states}
    with pytest.raises(RecipeError) as err:
        resolve_recipe({"name": "x", "extends": "a100-bf16", "storage": storage, "distributed": fsdp2})
    assert str(err.value) == (
        f"<dict>: storage.optimizer_states: {states} with master {master} is not supported with distributed.strategy "
        f"fsdp2 ({why} on sharded parameters; allowed under fsdp2: fp32, bf16, or 8bit with master fp32)"
    )
    choices = [(m, st) for m in ("bf16_remainder", "bf16_kahan", "bf16_stochastic", "none") for st in ("fp32", "bf16")]
    for master, states in [*choices, ("fp32", "bf16"), ("fp32", "8bit")]:
        storage = {"master": master, "optimizer_states": states}
        ok = resolve_recipe({"name": "x", "extends": "a100-bf16", "storage": storage, "distributed": fsdp2})
        assert (ok.storage.master, ok.storage.optimizer_states) == (master, states)


def test_a_state_dict_keyed_by_parameter_name_loads_its_fp32_moments_and_the_storage_check():
    """Distributed Checkpoint hands ``load_state_dict`` the state and the groups' parameters keyed by qualified name
    (torch pairs them with the optimizer's parameters by position), and keeps no entry but "state" and
    "param_groups": the FP32 moments of a BF16 parameter come back FP32 (torch alone casts them to BF16), the
    remainder as it was, and the storage choice, carried in the groups, is still checked."""
    p = torch.nn.Parameter(torch.randn(16, 8).to(torch.bfloat16))
    opt = StorageAdamW([p], lr=1e-3, master="bf16_remainder")
    for _ in range(3):
        p.grad = torch.randn_like(p)
        opt.step()
    sd = opt.state_dict()
    by_name = {
        "state": {"layer.weight": sd["state"][0]},
        "param_groups": [{**g, "params": ["layer.weight"]} for g in sd["param_groups"]],
    }
    twin = torch.nn.Parameter(p.detach().clone())
    again = StorageAdamW([twin], lr=1e-3, master="bf16_remainder")
    again.load_state_dict(by_name)
    for key in ("exp_avg", "exp_avg_sq", "remainder", "step"):
        assert again.state[twin][key].dtype == opt.state[p][key].dtype, key
        assert torch.equal(again.state[twin][key], opt.state[p][key]), key
    with pytest.raises(StorageRefusal, match=r"storage\.master: .*'bf16_remainder', this run has 'bf16_kahan'"):
        StorageAdamW([torch.nn.Parameter(p.detach().clone())], master="bf16_kahan").load_state_dict(by_name)


def test_a_step_at_lr_0_leaves_a_kahan_weight_and_its_compensation_as_they_were():
    """Distributed Checkpoint builds a resumed optimizer's state with one step at lr 0 on the checkpoint's weights
    before it loads the states, so the compensation is then not the weight's own. Rounding weight + compensation
    back would move the weight; the step leaves both as they were (and the moments take the zero gradient)."""
    w = torch.tensor([1.0, 1.0, 2.0**-7, -3.0], dtype=torch.bfloat16)
    p = torch.nn.Parameter(w.clone())
    opt = StorageAdamW([p], lr=0.0, master="bf16_kahan")
    opt.state[p].update(opt._init_state(p))
    comp = torch.tensor([2.0**-9, -(2.0**-8), 2.0**-15, 2.0**-7], dtype=torch.bfloat16)  # not w's own
    opt.state[p]["compensation"] = comp.clone()
    p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.equal(p.detach(), w) and torch.equal(opt.state[p]["compensation"], comp)
    opt.param_groups[0]["lr"] = 1e-9  # a real step does store the rounded master
    opt.step()
    assert not torch.equal(p.detach(), w)


def test_deepspeed_config_of_the_users_must_say_what_storage_says():
    """Through the Trainer a DeepSpeed JSON of the user's is checked against the recipe, never silently followed."""
    from types import SimpleNamespace

    from hf_mixedprec.integrations.deepspeed import deepspeed_config
    from hf_mixedprec.integrations.trainer_storage import check_deepspeed_storage

    def trainer_with(config):
        plugin = SimpleNamespace(deepspeed_config=config)
        state = SimpleNamespace(deepspeed_plugin=plugin)
        return SimpleNamespace(accelerator=SimpleNamespace(state=state), model=tiny_llama(0))  # module rules read it

    low = _recipe(master="none", optimizer_states="bf16")
    ds_low = {
        "zero_optimization": {"stage": 1},
        **deepspeed_config(
            resolve_recipe({**low.to_dict(), "distributed": {"strategy": "deepspeed", "zero_stage": 1}})
        )[0],
    }
    check_deepspeed_storage(trainer_with(ds_low), low)  # the config hf_mixedprec writes agrees
    plain = {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}}
    with pytest.raises(StorageRefusal, match=r"bf16\.bf16_master_weights_and_grads=False"):
        check_deepspeed_storage(trainer_with(plain), low)
    with pytest.raises(StorageRefusal, match="has no DeepSpeed equivalent"):
        check_deepspeed_storage(trainer_with(plain), _recipe(master="bf16_remainder"))
    check_deepspeed_storage(trainer_with(plain), load_recipe("a100-bf16", rehearse=True))


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_the_plan_reports_no_adamw_states_for_a_trainer_running_sgd(bf16_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(bf16_dir)
    tr = _train(load_recipe("a100-bf16", rehearse=True), model, tmp_path, steps=1, optim="sgd")
    tr.train()
    plan = runtime_of(tr).plan
    assert {p.states for p in plan.params} == {None}
    assert set(plan.bytes_by_component()) == {"weights", "gradients"}  # Trainer's SGD keeps no momentum


@pytest.fixture
def bench(monkeypatch):
    """``scripts/bench_storage_step.py``, imported afresh from the scripts folder."""
    import pathlib
    import sys

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[2] / "scripts"))
    sys.modules.pop("bench_storage_step", None)
    import bench_storage_step

    return bench_storage_step


def test_the_step_benchmark_counts_what_the_step_launches(bench):
    """``scripts/bench_storage_step.py`` on a few tiny parameters: the reference row is 1.0x, FP32 weights and moments
    launch what torch's fused AdamW launches, and each storage choice the same count for 3 and 30 parameters."""
    small, large = (
        {r["variant"]: r for r in bench.measure([(4, 4)] * n, repeats=1, warmup=0, legacy=None)} for n in (3, 30)
    )
    assert small["torch AdamW(fused=True)"]["x_fused_adamw"] == 1.0
    assert (
        small["fp32 master, fp32 states"]["kernel_ops_per_step"]
        == small["torch AdamW(fused=True)"]["kernel_ops_per_step"]
    )
    for name in bench.VARIANTS:
        assert small[name]["kernel_ops_per_step"] == large[name]["kernel_ops_per_step"], name
    assert large["bf16_remainder"]["kernel_ops_per_step"] > large["none"]["kernel_ops_per_step"]
    # --layers: bench_storage.py's model's shapes (111 tensors at 12 layers); --legacy: a row that says whether
    # another implementation ends on the same weights (this one, loaded from its file, must)
    shapes = bench.model_shapes(12)
    assert len(shapes) == 111 and sum(math.prod(s) for s in shapes) == 9_902_336
    from hf_mixedprec.storage import optim as storage_optim

    same = bench.load_legacy(storage_optim.__file__)
    rows = bench.measure(bench.model_shapes(1)[:5], repeats=2, warmup=0, legacy=same)
    (legacy,) = [r for r in rows if r["variant"].startswith("legacy")]
    assert legacy["same_weights_as_bf16_remainder"] is True and legacy["parameters"] == 5

    class OtherLr(StorageAdamW):  # another update: its weights must be told apart
        def __init__(self, params, **kw):
            super().__init__(params, **{**kw, "lr": 1e-2})

    rows = bench.measure(bench.model_shapes(1)[:5], repeats=2, warmup=0, legacy=OtherLr)
    assert [r["same_weights_as_bf16_remainder"] for r in rows if r["variant"].startswith("legacy")] == [False]


def test_the_step_benchmark_refuses_a_device_it_cannot_use(bench, monkeypatch, capsys):
    """``--device`` names the flag, the value and what is allowed, exit 2 (argparse), before anything is built."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for value, says in (("cuda", "this machine has no CUDA device"), ("meta", "allowed: cpu, cuda, cuda:N"),
                        ("gpu0", "not a device")):  # fmt: skip
        with pytest.raises(SystemExit) as exit_:
            bench.main(["--device", value, "--params", "1"])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and f"--device {value!r}" in err and says in err, err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--device", "cuda:2", "--params", "1"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "has 2 CUDA device(s) (allowed: cuda:0-1)" in err, err
    # every tensor of a step lives on the device asked for (meta stands in for a GPU: a CPU gradient on a device
    # parameter is refused by torch)
    meta = torch.device("meta")
    for name in ("torch AdamW(fused=True)", "none", "AdamW8bit, flag on the device (hf_mixedprec)"):
        params, _ = bench.build(name, [(4, 4), (3,)], None, meta)
        bench.attach_grads(params, [torch.randn(4, 4), torch.randn(3)])
        assert {p.device for p in params} == {p.grad.device for p in params} == {meta}
    (row,) = [r for r in bench.measure([(4, 4)] * 2, repeats=1, warmup=0, legacy=None) if r["variant"] == "none"]
    assert row["device"] == "cpu"


def test_a_flag_summed_over_two_devices_still_skips_the_step():
    """GradScaler hands the sum of every device's found-inf flag (2 with gradients on two GPUs); torch's fused kernel
    skips on exactly 1, so the flag is made 0/1 first: nothing moves and the step count stays."""
    for master, dtype in (("fp32", torch.float32), ("bf16_remainder", torch.bfloat16)):
        p = torch.nn.Parameter(torch.randn(8, 8).to(dtype))
        opt = StorageAdamW([p], lr=1e-2, master=master)
        p.grad = torch.ones_like(p)
        opt.step()
        before = p.detach().clone()
        p.grad = torch.full_like(p, float("inf"))
        opt.found_inf, opt.grad_scale = torch.tensor(2.0), None
        opt.step()
        del opt.found_inf, opt.grad_scale
        assert torch.equal(p.detach(), before), master
        assert float(opt.state[p]["step"]) == 1.0, master


def test_layouts_the_kernel_cannot_walk_in_place_are_gathered():
    """A transposed FP32 weight with a contiguous gradient, and a strided view of a larger tensor: each ends where
    torch's per-parameter AdamW ends, and the storage around the view is untouched (the kernel walks memory from the
    data pointer: handed either in place, it would update the wrong elements)."""
    torch.manual_seed(4)
    base = torch.randn(6, 10)
    cases = [torch.nn.Parameter(torch.randn(12, 5).t()), torch.nn.Parameter(base[:, ::2])]
    twins = [torch.nn.Parameter(p.detach().clone().contiguous()) for p in cases]
    grads = [torch.randn(p.shape) for p in cases]
    untouched = base[:, 1::2].clone()
    ours = StorageAdamW(cases, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(twins, lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(3):
        for p, q, g in zip(cases, twins, grads):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    for p, q in zip(cases, twins):
        assert torch.allclose(p.detach(), q.detach(), atol=1e-6)
    assert torch.equal(base[:, 1::2], untouched)


def test_a_gradient_is_not_changed_by_the_step_whatever_its_path():
    """With a GradScaler's ``grad_scale`` the kernel would divide a gradient it is handed in place; every path hands
    it a copy then, so what the caller reads after the step is what backward wrote."""
    a = torch.nn.Parameter(torch.ones(4, 4))
    b = torch.nn.Parameter(torch.ones(4, 4).to(torch.bfloat16))
    opt = StorageAdamW([a, b], lr=1e-2, master="bf16_remainder")
    a.grad, b.grad = torch.full((4, 4), 8.0), torch.full((4, 4), 8.0).to(torch.bfloat16)
    opt.grad_scale, opt.found_inf = torch.tensor(4.0), torch.zeros(())
    opt.step()
    assert float(a.grad.max()) == 8.0 and float(b.grad.float().max()) == 8.0


def test_a_bf16_parameter_without_its_remainder_is_refused_not_rounded():
    p = torch.nn.Parameter(torch.randn(4, 4))
    opt = StorageAdamW([p], lr=1e-2, master="bf16_remainder")
    p.grad = torch.ones_like(p)
    opt.step()  # its state made while FP32: no remainder
    p.data = p.data.to(torch.bfloat16)
    p.grad = torch.ones_like(p)
    with pytest.raises(StorageRefusal, match=r"storage.master bf16_remainder: 1 BF16 parameter\(s\) .* no remainder"):
        opt.step()
