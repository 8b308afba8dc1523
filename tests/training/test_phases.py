"""Precision phases: a recipe's ``phases:`` validated, switched in place at the exact steps in the Trainer callback
and the Accelerate plugin, with weights untouched by a switch and resume across boundaries bit for bit."""

from __future__ import annotations

import pytest
import torch
import yaml
from accelerate.state import AcceleratorState
from torch import nn
from transformers import TrainerCallback

from hf_mixedprec.core import metrics as M
from hf_mixedprec.core.demo import tiny_llama
from hf_mixedprec.core.errors import RecipeError
from hf_mixedprec.fp8 import EmulatedFP8Linear
from hf_mixedprec.fp8.state import fp8_state_tensors
from hf_mixedprec.integrations.recipe import load_recipe_file, resolve_recipe
from hf_mixedprec.integrations.trainer import runtime_of
from hf_mixedprec.training.phases import PhaseSchedule
from tests.integrations.test_integration import Bytes
from tests.training.test_resume_decisions import _trainer

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

BF16_FP8_BF16 = """
phases:
  - {start: 0, precision: bf16, name: warmup}
  - {start: 3, precision: fp8}
  - {start: 6, precision: bf16, name: anneal}
"""


def _recipe(phases: str, base: str = "h100-fp8-delayed", **extra):
    return resolve_recipe({"name": "phased", "extends": base, **yaml.safe_load(phases), **extra}).rehearsed()


def _q_proj(model: nn.Module) -> nn.Module:
    return model.model.layers[0].self_attn.q_proj


class Watch(TrainerCallback):
    """Per optimizer step (after the recipe's callback set the phase): the q_proj type, the autocast dtype its
    forward ran under and the dtype of its output; and the weights right before and right after each switch."""

    def __init__(self):
        self.types: dict[int, str] = {}
        self.autocast: dict[int, str] = {}
        self.out_dtype: dict[int, torch.dtype] = {}
        self.before: dict[int, dict[str, torch.Tensor]] = {}
        self.after: dict[int, dict[str, torch.Tensor]] = {}
        self.ptrs: dict[int, dict[str, int]] = {}
        self.step = 0
        self.hooked: set[int] = set()

    def _hook(self, model):
        mod = _q_proj(model)
        if id(mod) in self.hooked:
            return
        self.hooked.add(id(mod))

        def record(m, args, out):
            on = torch.is_autocast_enabled("cpu")
            self.autocast.setdefault(
                self.step, str(torch.get_autocast_dtype("cpu")).removeprefix("torch.") if on else "off"
            )
            self.out_dtype.setdefault(self.step, out.dtype)

        mod.register_forward_hook(record)

    def on_step_begin(self, args, state, control, model=None, **kw):
        self.step = state.global_step + 1
        self.types[self.step] = type(_q_proj(model)).__name__
        self._hook(model)
        self.after[state.global_step] = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.ptrs.setdefault(state.global_step, {})["after"] = {n: p.data_ptr() for n, p in model.named_parameters()}

    def on_step_end(self, args, state, control, model=None, **kw):
        self.before[state.global_step] = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.ptrs.setdefault(state.global_step, {})["before"] = {n: p.data_ptr() for n, p in model.named_parameters()}


# -- validation -----------------------------------------------------------------------------------------------------
def test_a_phased_recipe_resolves_each_phase_as_a_recipe_of_its_own():
    r = _recipe(
        """
phases:
  - {start: 0, precision: bf16}
  - {start: 0.1, precision: fp8, fp8: {scaling: current, keep_lm_head: false}}
  - {start: 0.5, precision: fp8}
  - {start: 0.9, precision: fp32}
"""
    )
    specs = r.phase_specs()
    assert [s.precision for s in specs] == ["bf16", "fp8", "fp8", "fp32"]
    # the phase's fp8 keys override the recipe's; delayed-only options are dropped with the scaling they belong to
    assert specs[1].fp8.scaling == "current" and specs[1].fp8.amax_history_len is None
    # the phase's old keep_lm_head key is read as a module rule of that phase, before the recipe's own rules
    assert specs[1].modules[0].select == "lm_head" and specs[1].modules[0].fp8 is True
    assert specs[1].modules[1:] == r.modules
    assert specs[2].fp8 == r.fp8 and specs[0].fp8 is None and specs[3].fp8 is None
    assert all(s.rehearse for s in specs) and r.autocast_precision() == "bf16"
    assert resolve_recipe(r.to_dict()).rehearsed() == r  # the YAML it shows is the recipe it runs
    sched = PhaseSchedule(r)
    assert sched.set_max_steps(40) == [] and sched.resolved() == [0, 4, 20, 36]
    assert [sched.index_at(s) for s in (0, 3, 4, 19, 20, 35, 36, 39)] == [0, 0, 1, 1, 2, 2, 3, 3]
    notes = sched.set_max_steps(3)  # round(0.1 * 3) = 0: the first phase is empty
    assert sched.resolved() == [0, 0, 2, 3] and any("phase 0" in n and "no steps" in n for n in notes)
    assert any("phase 3" in n and "never runs" in n for n in notes)


BAD_PHASES = [
    ("phases: [{start: 0, precision: bf16}]", "phases: 1 phase(s) given (allowed: 2 to 32"),
    (
        "phases: [{start: 2, precision: bf16}, {start: 5, precision: fp8}]",
        "phases.0.start: 2: the first phase must start at 0",
    ),
    (
        "phases: [{start: 0, precision: bf16}, {start: 5, precision: fp8}, {start: 5, precision: bf16}]",
        "phases.2.start: 5 is not after phases.1.start 5 (phases overlap",
    ),
    (
        "phases: [{start: 0, precision: bf16}, {start: 5, precision: fp8}, {start: 0.5, precision: bf16}]",
        "phases.2.start: 0.5 mixes a fraction with phases.1.start 5",
    ),
    ("phases: [{start: 0, precision: bf16}, {start: 1.5, precision: fp8}]", "phases.1.start: 1.5 is out of range"),
    ("phases: [{start: 0, precision: bf16}, {start: '3', precision: fp8}]", "phases.1.start: '3' is not a step count"),
    ("phases: [{start: 0, precision: bf16}, {start: 3, precision: fp9}]", "phases.1.precision: 'fp9' is not allowed"),
    (
        "phases: [{start: 0, precision: bf16, fp8: {scaling: current}}, {start: 3, precision: fp8}]",
        "phases.0.fp8: only applies to an fp8 phase",
    ),
    (
        "phases: [{start: 0, precision: bf16}, {start: 3, precision: fp8, fp8: {scaling: bogus}}]",
        "phases.1.fp8.scaling: 'bogus' is not allowed (allowed: delayed, current, mxfp8, blockwise, nvfp4)",
    ),
    (
        "phases: [{start: 0, precision: bf16}, {start: 3, precision: fp8, fp8: {backend: torchao}}]",
        "phases.1.fp8.scaling: 'delayed' is not available with backend torchao",
    ),
    (
        "phases: [{start: 0, precision: bf16}, {start: 3, precision: fp8, loss_scale: {}}]",
        "phases.1.loss_scale: only applies to an fp16 phase (precision is fp8)",
    ),
    (
        "phases: [{start: 0, precision: bf16}, {start: 3, precision: fp16, loss_scale: {init_scale: -1}}]",
        "phases.1.loss_scale.init_scale: -1",
    ),
    (
        "phases: [{start: 0, precision: bf16}, {start: 3, precision: fp16, loss_scale: {grow: 2}}]",
        "phases.1.loss_scale.grow: unknown key",
    ),
    (
        "{precision: bf16, fp8: null, distributed: {strategy: deepspeed, zero_stage: 2}, "
        "phases: [{start: 0, precision: bf16}, "
        "{start: 3, precision: fp32}]}",
        "phases: not supported with distributed.strategy deepspeed (allowed: none, ddp, fsdp2): DeepSpeed's engine",
    ),
    (
        "{distributed: {strategy: fsdp2}, phases: [{start: 0, precision: bf16}, "
        "{start: 3, precision: fp8, fp8: {backend: transformer_engine}}]}",
        "phases.1.fp8.backend: transformer_engine cannot enter at a phase boundary under distributed.strategy fsdp2",
    ),
    (
        "{distributed: {strategy: fsdp2, fp8_all_gather: true}, precision: fp8, "
        "fp8: {backend: torchao, scaling: current}, "
        "phases: [{start: 0, precision: fp8, fp8: {backend: torchao, scaling: current}}, {start: 3, precision: bf16}]}",
        "distributed.fp8_all_gather: not with phases",
    ),
]


@pytest.mark.parametrize(
    "text,message", BAD_PHASES, ids=[m.split(":")[0] + str(i) for i, (_, m) in enumerate(BAD_PHASES)]
)
def test_an_invalid_phase_list_is_refused_with_its_key(text, message):
    with pytest.raises(RecipeError) as err:
        _recipe(text)
    assert message in str(err.value)


def test_the_cli_refuses_an_invalid_phase_list_with_exit_2_and_one_line(tmp_path, capsys):
    from hf_mixedprec.cli.app import main

    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: bad\nextends: h100-fp8-delayed\n"
        "phases: [{start: 0, precision: bf16}, {start: 0.9, precision: fp8}, {start: 0.5, precision: bf16}]\n"
    )
    code = main(["validate", str(bad)])  # `hf-mixedprec validate`, in this process
    err = capsys.readouterr().err
    assert code == 2, err
    assert "phases.2.start: 0.5 is not after phases.1.start 0.9" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


# -- the Trainer callback -------------------------------------------------------------------------------------------
def test_bf16_fp8_bf16_switches_at_the_exact_steps_with_weights_untouched(tmp_path):
    watch = Watch()
    trainer = _trainer(_recipe(BF16_FP8_BF16), tmp_path, steps=8, after=[watch], logging_steps=1)
    trainer.train()
    assert watch.types == {
        **dict.fromkeys((1, 2, 3), "Linear"),
        **dict.fromkeys((4, 5, 6), "EmulatedFP8Linear"),
        **dict.fromkeys((7, 8), "Linear"),
    }
    assert set(watch.autocast.values()) == {"bfloat16"}  # FP8 layers sit inside BF16 autocast too
    assert watch.out_dtype == dict.fromkeys(range(1, 9), torch.bfloat16)
    for boundary in (3, 6):  # steps done when the switch happened
        before, after = watch.before[boundary], watch.after[boundary]
        assert list(before) == list(after)
        assert all(torch.equal(before[n], after[n]) for n in before), (
            f"the switch after step {boundary} changed weights"
        )
        assert watch.ptrs[boundary]["before"] == watch.ptrs[boundary]["after"]  # the same tensors, not copies
    rt = runtime_of(trainer)
    assert [(c["step"], c["name"], c["precision"]) for c in rt.phases.changes] == [
        (3, "phase 1", "fp8"),
        (6, "anneal", "bf16"),
    ]
    assert rt.phases.changes[0]["to_fp8"] == 14 and rt.phases.changes[1]["to_high_precision"] == 14
    assert any("phase 'anneal' (bf16) begins after step 6: 14 FP8 layers back to high precision" in n for n in rt.notes)
    rows = [r for r in trainer.state.log_history if "loss" in r]
    assert [r[M.PHASE] for r in rows] == [0, 0, 0, 1, 1, 1, 2, 2]
    # the saved model is a plain checkpoint whatever phase it was in
    assert not any(isinstance(m, EmulatedFP8Linear) for m in trainer.model.modules())


class Capture(TrainerCallback):
    """The FP8 layers' state when a phase is about to end (``at``: steps done)."""

    def __init__(self, at: int):
        self.at, self.state = at, None

    def on_step_end(self, args, state, control, model=None, **kw):
        if state.global_step == self.at:
            self.state = {k: t.clone() for k, t in fp8_state_tensors(model).items()}


FOUR_PHASES = """
phases:
  - {start: 0, precision: bf16}
  - {start: 2, precision: fp8}
  - {start: 4, precision: fp32}
  - {start: 6, precision: fp8, fp8_history: restore}
"""


def test_fp8_history_restore_brings_back_the_last_fp8_phase_state(tmp_path):
    recipe = _recipe(FOUR_PHASES)
    cap, watch = Capture(4), Watch()
    trainer = _trainer(recipe, tmp_path, steps=6, after=[cap, watch], logging_steps=3)
    trainer.train()  # ends when the restoring phase would start: run one more step by hand below
    assert watch.autocast[5] == "off" and watch.out_dtype[5] == torch.float32  # the FP32 phase
    rt = runtime_of(trainer)
    rt.begin_step(trainer.model)
    live = fp8_state_tensors(trainer.model)
    assert set(live) == set(cap.state) and all(torch.equal(live[k], cap.state[k]) for k in live)
    # a fresh FP8 phase starts from zeroed histories instead
    fresh = _recipe(FOUR_PHASES.replace(", fp8_history: restore", ""))
    AcceleratorState._reset_state(reset_partial_state=True)
    t2 = _trainer(fresh, tmp_path / "fresh", steps=6, logging_steps=3)
    t2.train()
    runtime_of(t2).begin_step(t2.model)
    assert all(not t.any() for k, t in fp8_state_tensors(t2.model).items() if "history" in k)


@pytest.mark.slow
def test_a_run_resumed_in_any_phase_ends_as_the_straight_run(tmp_path):
    """BF16 -> FP8 -> FP32 -> FP8 (restoring the first FP8 phase's histories), a checkpoint after every step:
    resumed from each, inside a phase or right at a boundary, the run ends bit for bit as the straight one."""
    recipe = _recipe(FOUR_PHASES)
    common = {"logging_steps": 3, "save_strategy": "steps", "save_steps": 1}
    straight = _trainer(recipe, tmp_path / "straight", steps=8, **common)
    straight.train()
    want = straight.model.state_dict()
    want_fp8 = {k: t.clone() for k, t in fp8_state_tensors(straight.model).items()}
    assert want_fp8 and isinstance(_q_proj(straight.model), EmulatedFP8Linear)
    for k in range(1, 8):
        AcceleratorState._reset_state(reset_partial_state=True)
        resumed = _trainer(recipe, tmp_path / f"resumed-{k}", steps=8, **common)
        resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / f"checkpoint-{k}"))
        got = resumed.model.state_dict()
        assert list(got) == list(want), k
        diff = [n for n in want if not torch.equal(want[n], got[n])]
        assert diff == [], f"resumed from checkpoint-{k}: {diff[:3]} differ"
        fp8 = fp8_state_tensors(resumed.model)
        assert all(torch.equal(fp8[n], want_fp8[n]) for n in want_fp8), k
        rr = runtime_of(resumed)
        assert rr.phases.index == 3 and rr.phases.changes == runtime_of(straight).phases.changes, k


def test_phases_by_fraction_take_the_trainers_max_steps(tmp_path):
    watch = Watch()
    recipe = _recipe("phases: [{start: 0, precision: fp32}, {start: 0.5, precision: bf16}]", base="cpu-bf16")
    _trainer(recipe, tmp_path, steps=4, after=[watch]).train()
    assert watch.autocast == {1: "off", 2: "off", 3: "bfloat16", 4: "bfloat16"}
    assert watch.out_dtype == {1: torch.float32, 2: torch.float32, 3: torch.bfloat16, 4: torch.bfloat16}


# -- the Accelerate plugin ------------------------------------------------------------------------------------------
def _loop(acc, model, steps: int):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    data = Bytes(n=steps * 2)
    seen: list[tuple] = []
    # lm_head stays a Linear in every phase: its output dtype is the autocast in force (Accelerate casts logits back)
    acc.unwrap_model(model).lm_head.register_forward_hook(
        lambda m, a, out: seen.__setitem__(-1, (*seen[-1], out.dtype))
    )
    # the step's layers as its forward meets them (the plugin begins a step at its first training forward)
    acc.unwrap_model(model).register_forward_pre_hook(
        lambda m, a: seen.append((type(_q_proj(m)).__name__, torch.is_autocast_enabled("cpu")))
    )
    for i in range(steps):
        batch = {k: torch.stack([data[2 * i][k], data[2 * i + 1][k]]) for k in ("input_ids", "labels")}
        out = model(**batch)
        acc.backward(out.loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return model, seen


def test_the_accelerate_plugin_switches_phases_in_a_hand_written_loop():
    from hf_mixedprec.integrations.accelerate_plugin import make_accelerator

    recipe = _recipe(
        "phases: [{start: 0, precision: fp32}, {start: 0.4, precision: fp8}, {start: 0.8, precision: bf16}]"
    )
    acc = make_accelerator(recipe, cpu=True, max_steps=5)
    _, seen = _loop(acc, tiny_llama(), 5)
    assert [s[0] for s in seen] == ["Linear", "Linear", "EmulatedFP8Linear", "EmulatedFP8Linear", "Linear"]
    # logits come from the lm_head, kept in BF16 autocast (FP32 in the FP32 phase)
    assert [s[2] for s in seen] == [torch.float32, torch.float32, torch.bfloat16, torch.bfloat16, torch.bfloat16]
    assert [c["step"] for c in acc.mp.phases.changes] == [2, 4]


def test_the_plugin_refuses_fractional_phases_without_a_run_length():
    from hf_mixedprec.integrations.accelerate_plugin import make_accelerator

    acc = make_accelerator(
        _recipe(BF16_FP8_BF16.replace("start: 3,", "start: 0.3,").replace("start: 6,", "start: 0.6,")), cpu=True
    )
    with pytest.raises(Exception, match="run length is not known: give it"):
        acc.prepare(tiny_llama())


# -- what reports and other commands make of phases ------------------------------------------------------------------
def test_estimate_lists_each_phase_with_its_own_memory():
    from hf_mixedprec.commands.estimate import estimate_memory
    from hf_mixedprec.core.demo import tiny_llama_config

    est = estimate_memory(tiny_llama_config(), [_recipe(BF16_FP8_BF16)], batch_size=2, seq_len=32, target="cpu")
    names = [r.recipe for r in est.recipes]
    assert names == ["phased [warmup]", "phased [phase 1]", "phased [anneal]"]
    fp8 = [r.memory.fp8_extras for r in est.recipes]
    assert fp8[0] == fp8[2] == 0 and fp8[1] > 0  # delayed scaling's histories exist only in the FP8 phase
    assert est.recipes[0].memory == est.recipes[2].memory and [r.precision for r in est.recipes] == [
        "bf16",
        "fp8",
        "bf16",
    ]


def test_launch_never_hands_a_phased_recipe_to_accelerates_own_fp8():
    from hf_mixedprec.integrations.launch import accelerate_config, fp8_via_accelerate

    anneal = load_recipe_file("h100-fp8-anneal-bf16")
    te = resolve_recipe({"name": "te", "extends": "h100-fp8-delayed", "fp8": {"backend": "transformer_engine"}})
    assert fp8_via_accelerate(te) and not fp8_via_accelerate(anneal)
    cfg, _ = accelerate_config(anneal)
    assert cfg["mixed_precision"] == "bf16" and "fp8_config" not in cfg


def test_the_run_report_marks_the_switches(tmp_path):
    from hf_mixedprec.training.run_report import build_plots, check_document, health_document, summarize

    trainer = _trainer(_recipe(BF16_FP8_BF16), tmp_path, steps=8, logging_steps=2)
    trainer.train()
    doc = health_document(trainer.state.log_history, runtime_of(trainer))
    assert check_document(doc) is None and doc["precision"] == "bf16->fp8->bf16"
    assert [(c["step"], c["name"]) for c in doc["phases"]] == [(3, "phase 1"), (6, "anneal")]
    assert "phases: phase 1 (fp8) after step 3, anneal (bf16) after step 6" in summarize(doc)["lines"]
    assert doc["series"][M.PHASE] == {"2": 0.0, "4": 1.0, "6": 1.0, "8": 2.0}
    assert {p.name for p in build_plots(tmp_path, doc)} >= {"loss.png", "grad_norm.png"}


# -- FP16 phases: the loss scaler starts and retires at the boundaries ---------------------------------------------
FP16_THEN_BF16 = "phases: [{start: 0, precision: fp16}, {start: 3, precision: bf16}]"
BF16_FP16_BF16 = """
phases:
  - {start: 0, precision: bf16}
  - {start: 2, precision: fp16, loss_scale: {init_scale: 256, growth_interval: 2}}
  - {start: 5, precision: bf16}
"""


def test_an_fp16_phase_trains_bit_for_bit_as_the_fp16_recipe_then_hands_over_to_bf16(tmp_path):
    plain = _trainer(load_recipe_file("v100-fp16").rehearsed(), tmp_path / "plain", steps=3, logging_steps=1)
    plain.train()
    AcceleratorState._reset_state(reset_partial_state=True)
    phased = _recipe(FP16_THEN_BF16, base="v100-fp16")  # the fp16 phase takes the recipe's own loss_scale
    assert phased.phase_specs()[0].loss_scale == load_recipe_file("v100-fp16").loss_scale
    short = _trainer(phased, tmp_path / "short", steps=3, logging_steps=1)
    short.train()
    want, got = plain.model.state_dict(), short.model.state_dict()
    assert [n for n in want if not torch.equal(want[n], got[n])] == []
    rows = lambda t: [(r["loss"], r[M.LOSS_SCALE]) for r in t.state.log_history if "loss" in r]  # noqa: E731
    assert rows(short) == rows(plain)

    AcceleratorState._reset_state(reset_partial_state=True)
    watch = Watch()
    longer = _trainer(phased, tmp_path / "longer", steps=5, after=[watch], logging_steps=1)
    longer.train()
    assert watch.autocast == {**dict.fromkeys((1, 2, 3), "float16"), **dict.fromkeys((4, 5), "bfloat16")}
    logged = [r for r in longer.state.log_history if "loss" in r]
    assert [M.LOSS_SCALE in r for r in logged] == [True] * 3 + [False] * 2  # no loss scale once it is retired
    notes = runtime_of(longer).notes
    assert "fp16 loss scaler started at scale 65536" in notes
    assert "fp16 loss scaler retired (scale 1 guard from here on)" in notes


def test_an_overflow_in_an_fp16_phase_backs_the_scale_off_and_one_in_bf16_is_skipped_at_scale_1(tmp_path):
    from tests.training.test_resume_decisions import InfGradAt

    trainer = _trainer(
        _recipe(BF16_FP16_BF16, base="cpu-bf16"),
        tmp_path,
        steps=6,
        callbacks=[InfGradAt(1), InfGradAt(4)],
        logging_steps=1,
    )
    trainer.train()
    rows = [r for r in trainer.state.log_history if "loss" in r]
    # steps 3-5 are FP16 (growth every 2 clean steps): 256 after step 3, halved by the overflow of step 4
    assert [r.get(M.LOSS_SCALE) for r in rows] == [None, None, 256.0, 128.0, 128.0, None]
    assert [r[M.SKIPPED_STEPS] for r in rows] == [1.0, 1.0, 1.0, 2.0, 2.0, 2.0]


@pytest.mark.slow
def test_a_run_resumed_in_or_around_an_fp16_phase_ends_as_the_straight_run(tmp_path):
    recipe = _recipe(BF16_FP16_BF16, base="cpu-bf16")
    common = {"logging_steps": 1, "save_strategy": "steps", "save_steps": 1}
    straight = _trainer(recipe, tmp_path / "straight", steps=7, **common)
    straight.train()
    want = straight.model.state_dict()
    scales = [r.get(M.LOSS_SCALE) for r in straight.state.log_history if "loss" in r]
    assert scales == [None, None, 256.0, 512.0, 512.0, None, None]
    for k in (2, 3, 4, 5):  # at the boundary into FP16, inside it (before and after growth), at the boundary out
        AcceleratorState._reset_state(reset_partial_state=True)
        resumed = _trainer(recipe, tmp_path / f"resumed-{k}", steps=7, **common)
        resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / f"checkpoint-{k}"))
        got = resumed.model.state_dict()
        assert [n for n in want if not torch.equal(want[n], got[n])] == [], k
        again = [r.get(M.LOSS_SCALE) for r in resumed.state.log_history if "loss" in r]
        assert again == scales, k  # the checkpoint's rows, then the resumed ones


def test_a_second_fp16_phase_starts_its_own_scaler_with_its_own_settings(tmp_path):
    recipe = _recipe(
        """
phases:
  - {start: 0, precision: fp16, loss_scale: {init_scale: 256, growth_interval: 1}}
  - {start: 2, precision: fp16, loss_scale: {init_scale: 64, growth_interval: 1, max_scale: 128}}
""",
        base="v100-fp16",
    )
    trainer = _trainer(recipe, tmp_path, steps=4, logging_steps=1)
    trainer.train()
    scales = [r[M.LOSS_SCALE] for r in trainer.state.log_history if "loss" in r]
    assert scales == [512.0, 1024.0, 128.0, 128.0]  # 256 grown twice; then 64 grown to the new phase's ceiling
