"""Another ``storage.master`` at resume (hf_mixedprec.storage.convert): remainder <-> fp32 converted bit for bit,
Kahan / stochastic -> fp32 from the stored BF16 weights, every other pair refused in the recipe's words, and no
optimizer state ever loaded as it is into another optimizer class; under the Trainer, finetune's path, and an own
Accelerate loop."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, TrainerCallback

from hf_mixedprec.core.demo import tiny_llama
from hf_mixedprec.core.errors import MixedPrecisionError, StorageRefusal
from hf_mixedprec.integrations.recipe import resolve_recipe
from hf_mixedprec.integrations.trainer import runtime_of
from hf_mixedprec.storage import StorageAdamW, combine_remainder, split_remainder
from hf_mixedprec.storage.convert import TRANSITIONS, convert_next_load, convert_without_state, storage_transition
from hf_mixedprec.training.recipe_change import RecipeChangeRefused, decide, recipe_record
from tests.integrations.test_integration import Bytes
from tests.storage.test_storage import _train


def _recipe(master: str, states: str = "fp32", name: str | None = None):
    return resolve_recipe(
        {"name": name or master, "extends": "a100-bf16", "storage": {"master": master, "optimizer_states": states}}
    ).rehearsed()


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("bf16-model")
    tiny_llama(0).to(torch.bfloat16).save_pretrained(d)
    return d


# -- the decision ----------------------------------------------------------------------------------------------------
MASTERS = ("fp32", "bf16_remainder", "bf16_kahan", "bf16_stochastic", "none")


@pytest.mark.parametrize("saved", MASTERS)
@pytest.mark.parametrize("now", MASTERS)
def test_the_four_documented_storage_changes_convert_and_every_other_pair_is_refused_in_the_recipes_words(saved, now):
    if saved == now:
        return
    a, b = recipe_record(_recipe(saved)), recipe_record(_recipe(now))
    for allow in (False, True):  # the flag for other numerics never allows a storage change
        if (saved, now) in TRANSITIONS:
            got = decide(a, b, checkpoint="checkpoint-4", allow=allow)
            assert got.storage == (saved, now) and got.switched and not got.converted
            assert got.notes == [
                f"resume: checkpoint-4 was written under storage.master {saved}; this run keeps storage.master "
                f"{now}: {TRANSITIONS[(saved, now)]}, before the first step"
            ]
            continue
        with pytest.raises(RecipeChangeRefused) as info:
            decide(a, b, checkpoint="checkpoint-4", allow=allow)
        msg = str(info.value)
        assert isinstance(info.value, MixedPrecisionError) and "\n" not in msg
        assert f"changes storage.master {saved} -> {now}, which a resume cannot convert" in msg
        assert "float32" not in msg and f"or resume with storage.master {saved}, storage.optimizer_states fp32" in msg
        assert "converted: storage.master bf16_remainder -> fp32, fp32 -> bf16_remainder" in msg


def test_a_conversion_keeps_the_optimizer_states_and_refuses_low_bit_ones():
    base = {"optimizer_states": "fp32", "optimizer": "auto"}
    assert storage_transition({**base, "master": "fp32"}, {**base, "master": "bf16_remainder"}) is not None
    bf16 = {"optimizer_states": "bf16", "optimizer": "auto"}
    assert storage_transition({**bf16, "master": "bf16_kahan"}, {**bf16, "master": "fp32"}) == ("bf16_kahan", "fp32")
    assert storage_transition({**base, "master": "bf16_remainder"}, {**bf16, "master": "fp32"}) is None
    low = {"optimizer_states": "8bit", "optimizer": "auto"}
    assert storage_transition({**low, "master": "bf16_stochastic"}, {**low, "master": "fp32"}) is None
    a = recipe_record(_recipe("bf16_remainder"))
    b = recipe_record(_recipe("fp32", states="bf16"))
    with pytest.raises(RecipeChangeRefused, match=r"storage.master bf16_remainder -> fp32, storage.optimizer_states "):
        decide(a, b, checkpoint="c", allow=True)


# -- the conversion on an optimizer --------------------------------------------------------------------------------
def _stepped(master: str, steps: int = 3) -> tuple[torch.nn.Parameter, StorageAdamW]:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(16, 8).to(torch.bfloat16))
    opt = StorageAdamW([p], lr=1e-2, master=master, weight_decay=0.1)
    for _ in range(steps):
        p.grad = torch.randn(16, 8).to(torch.bfloat16)
        opt.step()
    return p, opt


@pytest.mark.parametrize("master", ["bf16_remainder", "bf16_kahan", "bf16_stochastic"])
def test_a_bf16_master_into_torch_adamw_gives_the_documented_fp32_value_and_adamws_own_flags(master):
    p, opt = _stepped(master)
    saved = opt.state_dict()
    st = opt.state[p]
    want = {
        "bf16_remainder": combine_remainder(p.detach(), st.get("remainder", torch.zeros_like(p, dtype=torch.int16))),
        "bf16_kahan": p.detach().float() + st.get("compensation", torch.zeros_like(p)).float(),
        "bf16_stochastic": p.detach().float(),
    }[master]
    q = torch.nn.Parameter(p.detach().float())  # what Trainer's load leaves in the FP32 parameter: the BF16 weight
    adamw = torch.optim.AdamW([q], lr=5.0, weight_decay=0.0)
    finish = convert_next_load(adamw, (master, "fp32"))
    adamw.load_state_dict(saved)
    assert "load_state_dict" not in adamw.__dict__ and finish()
    assert torch.equal(q.detach().view(torch.int32), want.view(torch.int32))
    if master == "bf16_remainder":
        assert not torch.equal(q.detach(), p.detach().float())  # the remainders carried bits the weight lacks
    got = adamw.state[q]
    assert set(got) == {"step", "exp_avg", "exp_avg_sq"}
    assert torch.equal(got["exp_avg"], st["exp_avg"]) and float(got["step"]) == 3.0
    group = adamw.param_groups[0]
    assert group["lr"] == 1e-2 and group["weight_decay"] == 0.1  # the checkpoint's hyperparameters
    assert group["decoupled_weight_decay"] is True  # AdamW's decay, not L2 (a missing flag defaults to False)


def test_fp32_into_a_remainder_master_splits_bit_for_bit_and_a_never_stepped_weight_gets_its_remainder_later():
    torch.manual_seed(0)
    fp32 = [torch.nn.Parameter(torch.randn(16, 8)), torch.nn.Parameter(torch.randn(4))]
    adamw = torch.optim.AdamW(fp32, lr=1e-2)
    fp32[0].grad = torch.randn(16, 8)  # the second never steps: no state in the checkpoint
    adamw.step()
    values = [p.detach().clone() for p in fp32]
    bf16 = [torch.nn.Parameter(v.to(torch.bfloat16)) for v in values]  # Trainer's load: rounded to nearest even
    opt = StorageAdamW(bf16, lr=1e-2, master="bf16_remainder")
    weights = {id(p): v for p, v in zip(bf16, values, strict=True)}
    finish = convert_next_load(opt, ("fp32", "bf16_remainder"), lambda: weights)
    opt.load_state_dict(adamw.state_dict())
    assert finish()
    assert torch.equal(combine_remainder(bf16[0].detach(), opt.state[bf16[0]]["remainder"]), values[0])
    assert torch.equal(bf16[0].detach(), split_remainder(values[0])[0])
    assert torch.equal(opt.state[bf16[0]]["exp_avg"], adamw.state[fp32[0]]["exp_avg"])
    assert not opt.state[bf16[1]]
    bf16[1].grad = torch.zeros(4, dtype=torch.bfloat16)
    opt.param_groups[0]["lr"] = 0.0
    opt.step()  # its first step takes the remainder the conversion handed over
    assert torch.equal(combine_remainder(bf16[1].detach(), opt.state[bf16[1]]["remainder"]), values[1])
    # a checkpoint without optimizer state: the weights alone, the remainder at the first step
    fresh = [torch.nn.Parameter(v.to(torch.bfloat16)) for v in values]
    opt2 = StorageAdamW(fresh, lr=0.0, master="bf16_remainder")
    convert_without_state(opt2, ("fp32", "bf16_remainder"), {id(p): v for p, v in zip(fresh, values, strict=True)})
    for p in fresh:
        p.grad = torch.zeros_like(p)
    opt2.step()
    assert all(torch.equal(combine_remainder(p.detach(), opt2.state[p]["remainder"]), v)
               for p, v in zip(fresh, values, strict=True))  # fmt: skip


def test_a_storage_adamw_state_is_never_loaded_into_another_class_unconverted():
    p, opt = _stepped("bf16_remainder")
    adamw = torch.optim.AdamW([torch.nn.Parameter(p.detach().float())])
    finish = convert_next_load(adamw, None)
    with pytest.raises(StorageRefusal, match=r"written by hf_mixedprec's StorageAdamW \(storage.master bf16_remainder"):
        adamw.load_state_dict(opt.state_dict())
    assert finish() and not adamw.state and "load_state_dict" not in adamw.__dict__
    plain = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])
    finish = convert_next_load(plain, None)
    plain.load_state_dict(torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))]).state_dict())  # its own: loads
    assert finish()
    assert not convert_next_load(plain, None)() and "load_state_dict" not in plain.__dict__  # no load: removed


def _by_name(state_dict: dict) -> dict:
    """``state_dict`` as Distributed Checkpoint hands it to ``load_state_dict``: "state" and "param_groups" only,
    each parameter named."""
    names = [f"p{i}" for g in state_dict["param_groups"] for i in g["params"]]
    return {
        "state": {names[i]: st for i, st in state_dict["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state_dict["param_groups"]],
    }


def test_a_sharded_checkpoint_is_refused_a_storage_change_and_never_loaded_into_another_class():
    """A Distributed Checkpoint (FSDP2) names its parameters and keeps no entry but "state" and "param_groups": the
    conversion, which reads whole tensors by index, refuses it in one line rather than find no state; and the
    storage choice the groups carry still stops a StorageAdamW state from loading into torch's AdamW."""
    p, opt = _stepped("bf16_remainder")
    sharded = _by_name(opt.state_dict())
    fp32 = StorageAdamW([torch.nn.Parameter(p.detach().float())], master="fp32")
    finish = convert_next_load(fp32, ("bf16_remainder", "fp32"))
    with pytest.raises(StorageRefusal) as err:
        fp32.load_state_dict(sharded)
    assert str(err.value) == (
        "storage.master bf16_remainder -> fp32 is not converted at resume for a sharded (FSDP2) checkpoint "
        "(allowed: storage.master bf16_remainder, the checkpoint's)"
    )
    assert finish() and not fp32.state
    adamw = torch.optim.AdamW([torch.nn.Parameter(p.detach().float())])
    convert_next_load(adamw, None)
    with pytest.raises(StorageRefusal, match=r"written by hf_mixedprec's StorageAdamW \(storage.master bf16_remainder"):
        adamw.load_state_dict(sharded)
    assert not adamw.state


# -- under the Trainer -----------------------------------------------------------------------------------------------
class _AtBegin(TrainerCallback):
    """The parameters and optimizer right after Trainer loaded the checkpoint (on_train_begin)."""

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kw):
        self.model = model
        self.values = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.optimizer = getattr(optimizer, "optimizer", optimizer)
        self.remainders = {
            id(p): st["remainder"].clone() for p, st in self.optimizer.state.items() if "remainder" in st
        }


def _checkpoint(tmp_path, bf16_dir, master: str, states: str = "fp32"):
    first = _train(_recipe(master, states), AutoModelForCausalLM.from_pretrained(bf16_dir), tmp_path / "a", steps=3,
                   lr=1e-3, save_strategy="steps", save_steps=3, logging_steps=1)  # fmt: skip
    first.train()
    return tmp_path / "a" / "checkpoint-3"


def _by_index(optimizer, model) -> list[tuple[str, torch.nn.Parameter]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [(names[id(p)], p) for g in optimizer.param_groups for p in g["params"]]


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize(("saved", "now"), list(TRANSITIONS))
def test_the_trainer_resumes_under_another_master_with_the_documented_weights(bf16_dir, tmp_path, saved, now):
    from accelerate.state import AcceleratorState

    ckpt = _checkpoint(tmp_path, bf16_dir, saved)
    weights = load_file(str(ckpt / "model.safetensors"))
    state = torch.load(ckpt / "optimizer.pt", weights_only=True)["state"]
    AcceleratorState._reset_state(reset_partial_state=True)
    grab = _AtBegin()
    tr = _train(_recipe(now), AutoModelForCausalLM.from_pretrained(bf16_dir), tmp_path / "b", steps=4, lr=1e-3,
                save_strategy="steps", save_steps=4, logging_steps=1)  # fmt: skip
    tr.add_callback(grab)
    tr.train(resume_from_checkpoint=str(ckpt))
    kind = type(grab.optimizer).__name__
    assert kind == ("StorageAdamW" if now == "bf16_remainder" else "AdamW")
    checked = 0
    for i, (name, p) in enumerate(_by_index(grab.optimizer, grab.model)):
        got, saved_p = grab.values[name], state.get(i, {})
        if now == "bf16_remainder":
            if got.dtype != torch.bfloat16:
                continue
            rem = grab.remainders[id(p)]
            assert torch.equal(combine_remainder(got, rem).view(torch.int32), weights[name].view(torch.int32)), name
        else:
            base = weights[name].float()
            want = {
                "bf16_remainder": combine_remainder(weights[name], saved_p["remainder"]) if "remainder" in saved_p
                else base,
                "bf16_kahan": base + saved_p["compensation"].float() if "compensation" in saved_p else base,
                "bf16_stochastic": base,
            }[saved]  # fmt: skip
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), name
            assert grab.optimizer.param_groups[0]["decoupled_weight_decay"] is True
        checked += 1
    assert checked >= 10
    rt = runtime_of(tr)
    assert [e["name"] for e in rt.history.entries] == [saved, now]
    assert any(n.startswith(f"resume: checkpoint-3 was written under storage.master {saved};") for n in rt.notes)
    assert rt.history.decision.converted
    losses = [h["loss"] for h in tr.state.log_history if "loss" in h]
    assert len(losses) == 4 and all(x == x for x in losses)  # the 4th step trained
    record = json.loads((tmp_path / "b" / "checkpoint-4" / "trainer_state.json").read_text())
    payload = record["stateful_callbacks"]["MixedPrecisionCallback"]["attributes"]["restored"]
    assert payload["recipe"]["storage"]["master"] == now


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_callback_added_after_the_trainer_loaded_the_checkpoint_refuses_a_storage_change(bf16_dir, tmp_path):
    """add_callback: the callback is set up when train() began, after Trainer loaded the StorageAdamW state into its
    AdamW: that is refused, never trained on."""
    from accelerate.state import AcceleratorState

    ckpt = _checkpoint(tmp_path, bf16_dir, "bf16_remainder")
    AcceleratorState._reset_state(reset_partial_state=True)
    tr = _train(_recipe("fp32"), AutoModelForCausalLM.from_pretrained(bf16_dir), tmp_path / "b", steps=4,
                attach_late=True)  # fmt: skip
    with pytest.raises(RecipeChangeRefused, match=r"loaded it before hf_mixedprec's callback was set up"):
        tr.train(resume_from_checkpoint=str(ckpt))
    assert tr.state.global_step == 3


# -- an own Accelerate loop ------------------------------------------------------------------------------------------
def _loop(recipe, bf16_dir, batches, *, save=None, load=None):
    from hf_mixedprec.core._private import reset_accelerate_state
    from hf_mixedprec.integrations.accelerate_plugin import make_accelerator

    reset_accelerate_state()
    acc = make_accelerator(recipe, cpu=True)
    model = AutoModelForCausalLM.from_pretrained(bf16_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    if load is not None:
        acc.load_state(str(load))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    before.update({(n, "remainder"): opt.optimizer.state[p]["remainder"].clone() for n, p in model.named_parameters()
                   if "remainder" in opt.optimizer.state.get(p, {})})  # fmt: skip
    for x in batches:
        acc.backward(model(input_ids=x, labels=x).loss)
        opt.step()
        opt.zero_grad()
    if save is not None:
        acc.save_state(str(save))
    return acc, model, opt.optimizer, before


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize(("saved", "now"), [("bf16_remainder", "fp32"), ("fp32", "bf16_remainder")])
def test_an_own_accelerate_loop_converts_at_load_state(bf16_dir, tmp_path, saved, now):
    data = Bytes(n=8, seq_len=16)
    batches = [torch.stack([data[2 * i]["input_ids"], data[2 * i + 1]["input_ids"]]) for i in range(4)]
    _loop(_recipe(saved), bf16_dir, batches[:2], save=tmp_path / "state")
    weights = load_file(str(tmp_path / "state" / "model.safetensors"))
    state = torch.load(tmp_path / "state" / "optimizer.bin", weights_only=True)["state"]
    acc, model, opt, at_load = _loop(_recipe(now), bf16_dir, batches[2:], load=tmp_path / "state")
    assert type(opt).__name__ == ("StorageAdamW" if now == "bf16_remainder" else "AdamW")
    assert acc.mp.history.decision.converted
    for i, (name, _) in enumerate(_by_index(opt, model)):
        got = at_load[name]
        if now == "fp32":
            want = combine_remainder(weights[name], state[i]["remainder"])
        else:
            want = weights[name]
            got = combine_remainder(got, at_load[(name, "remainder")])
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), name
    assert all(torch.isfinite(p).all() for p in model.parameters())


# -- finetune ----------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_finetune_resumes_a_remainder_checkpoint_under_an_fp32_master_and_reports_both(tmp_path, capsys):
    """The issue's run: a checkpoint written under storage.master bf16_remainder, resumed with a recipe of master
    fp32. It trains on from the exact masters (the crash and the silently rounded weights are gone) and health.json
    lists both recipes; a pair that cannot be converted exits 2 in one line."""
    import yaml

    from tests.training.test_recipe_change import ARGS, _main

    remainder = tmp_path / "remainder.yaml"
    remainder.write_text(
        yaml.safe_dump({"name": "rem", "extends": "cpu-bf16", "storage": {"master": "bf16_remainder"}})
    )
    kahan = tmp_path / "kahan.yaml"
    kahan.write_text(yaml.safe_dump({"name": "kahan", "extends": "cpu-bf16", "storage": {"master": "bf16_kahan"}}))
    code, err = _main(capsys, "--recipe", str(remainder), "--output-dir", str(tmp_path / "a"), *ARGS)
    assert code == 0, err[-3000:]
    ckpt = tmp_path / "a" / "checkpoint-2"
    code, err = _main(capsys, "--recipe", "cpu-bf16", "--output-dir", str(tmp_path / "b"), "--resume", str(ckpt), *ARGS)
    assert code == 0, err[-3000:]
    doc = json.loads((tmp_path / "b" / "health.json").read_text())
    assert [(r["name"], r["from_step"]) for r in doc["recipes"]] == [("rem", 1), ("cpu-bf16", 3)]
    assert any("written under storage.master bf16_remainder; this run keeps storage.master fp32" in n
               for n in doc["notes"])  # fmt: skip
    assert sorted(int(s) for s in doc["series"]["loss"]) == [1, 2, 3, 4]
    code, err = _main(capsys, "--recipe", str(kahan), "--output-dir", str(tmp_path / "c"), "--resume", str(ckpt), *ARGS)
    lines = [line for line in err.strip().splitlines() if line.startswith("hf-mixedprec: error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert "changes storage.master bf16_remainder -> bf16_kahan, which a resume cannot convert" in lines[0]


# -- a second load in the same run, and Trainer's retry ------------------------------------------------------------
class _OutOfMemoryOnce(TrainerCallback):
    """The first step raises what accelerate's ``find_executable_batch_size`` takes for an out-of-memory error: the
    Trainer retries its inner loop with a smaller batch and loads the checkpoint's optimizer state again."""

    def __init__(self) -> None:
        self.fired = False
        self.states: list[tuple[set[str], list[object], dict[str, torch.Tensor]]] = []

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kw):
        o = getattr(optimizer, "optimizer", optimizer)
        keys = {k for s in o.state.values() for k in s}
        self.states.append((keys, [g.get("decoupled_weight_decay") for g in o.param_groups],
                            {n: p.detach().clone() for n, p in model.named_parameters()}))  # fmt: skip

    def on_step_begin(self, args, state, control, **kw):
        if not self.fired:
            self.fired = True
            raise RuntimeError("CUDA out of memory. (simulated)")


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate_state")
def test_trainers_retry_under_auto_find_batch_size_loads_the_converted_state_again(bf16_dir, tmp_path):
    from accelerate.state import AcceleratorState

    ckpt = _checkpoint(tmp_path, bf16_dir, "bf16_remainder")
    AcceleratorState._reset_state(reset_partial_state=True)
    oom = _OutOfMemoryOnce()
    tr = _train(_recipe("fp32"), AutoModelForCausalLM.from_pretrained(bf16_dir), tmp_path / "b", steps=4, lr=1e-3,
                auto_find_batch_size=True)  # fmt: skip
    tr.add_callback(oom)
    tr.train(resume_from_checkpoint=str(ckpt))
    assert oom.fired and len(oom.states) == 2 and tr.state.global_step == 4
    (first_keys, first_flags, first_values), (keys, flags, values) = oom.states
    assert first_keys == keys == {"step", "exp_avg", "exp_avg_sq"}  # no remainder in torch's AdamW, twice
    assert first_flags == flags and set(flags) == {True}
    assert all(torch.equal(first_values[n], values[n]) for n in values)  # the exact masters, not converted twice


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_later_resume_from_the_runs_own_checkpoint_converts_nothing(bf16_dir, tmp_path):
    """fp32 -> bf16_remainder at the first resume; the same Trainer resumed from its own checkpoint-4 (written under
    bf16_remainder) takes that checkpoint's remainders as they are (the first decision must not split again)."""
    from accelerate.state import AcceleratorState

    ckpt = _checkpoint(tmp_path, bf16_dir, "fp32")
    AcceleratorState._reset_state(reset_partial_state=True)
    grab = _AtBegin()
    tr = _train(_recipe("bf16_remainder"), AutoModelForCausalLM.from_pretrained(bf16_dir), tmp_path / "b", steps=4,
                lr=1e-3, save_strategy="steps", save_steps=4)  # fmt: skip
    tr.add_callback(grab)
    tr.train(resume_from_checkpoint=str(ckpt))
    own = tmp_path / "b" / "checkpoint-4"
    saved = torch.load(own / "optimizer.pt", weights_only=True)["state"]
    tr.args.max_steps = 5
    tr.train(resume_from_checkpoint=str(own))
    nonzero = 0
    for i, (_, p) in enumerate(_by_index(grab.optimizer, grab.model)):
        if "remainder" in saved.get(i, {}):
            assert torch.equal(grab.remainders[id(p)], saved[i]["remainder"])
            nonzero += int(saved[i]["remainder"].count_nonzero())
    assert nonzero > 1000


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_an_own_loop_loading_its_own_state_after_a_conversion_keeps_its_remainders(bf16_dir, tmp_path):
    data = Bytes(n=8, seq_len=16)
    batches = [torch.stack([data[2 * i]["input_ids"], data[2 * i + 1]["input_ids"]]) for i in range(3)]
    _loop(_recipe("fp32"), bf16_dir, batches[:1], save=tmp_path / "fp32")
    from hf_mixedprec.core._private import reset_accelerate_state
    from hf_mixedprec.integrations.accelerate_plugin import make_accelerator

    reset_accelerate_state()
    acc = make_accelerator(_recipe("bf16_remainder"), cpu=True)
    model = AutoModelForCausalLM.from_pretrained(bf16_dir)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    acc.load_state(str(tmp_path / "fp32"))
    for x in batches[1:]:
        acc.backward(model(input_ids=x, labels=x).loss)
        opt.step()
        opt.zero_grad()
    acc.save_state(str(tmp_path / "own"))
    want = {id(p): st["remainder"].clone() for p, st in opt.optimizer.state.items()}
    assert sum(int(r.count_nonzero()) for r in want.values()) > 1000
    acc.load_state(str(tmp_path / "own"))
    assert all(torch.equal(st["remainder"], want[id(p)]) for p, st in opt.optimizer.state.items())
    assert "load_state_dict" not in opt.optimizer.__dict__  # no wrapper outlives a load_state


def test_a_checkpoint_without_a_trainable_weight_under_its_name_is_refused_before_anything_loads(tmp_path):
    """transformers 5 saves MoE experts one tensor per expert, which Trainer's load skips: the parameter would hold
    its initial weight when the conversion reads it, so the change is refused, naming the weight."""
    from safetensors.torch import save_file

    from hf_mixedprec.storage.convert import checkpoint_weight_keys

    model = tiny_llama(0)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untied: its own key
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    keys = checkpoint_weight_keys(tmp_path, model, ("bf16_remainder", "fp32"))
    assert len(keys) == len({id(p) for p in model.parameters()})
    del state["model.layers.0.mlp.up_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(StorageRefusal) as info:
        checkpoint_weight_keys(tmp_path, model, ("bf16_remainder", "fp32"))
    msg = str(info.value)
    assert "storage.master bf16_remainder -> fp32 at resume" in msg and "model.layers.0.mlp.up_proj.weight" in msg
    assert "(allowed: storage.master bf16_remainder, the checkpoint's)" in msg and "\n" not in msg
    with pytest.raises(StorageRefusal, match=r"no model.safetensors"):
        checkpoint_weight_keys(tmp_path / "nothing", model, ("fp32", "bf16_remainder"))
