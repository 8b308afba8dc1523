"""Resume restores the decisions a run made: FP8 layers a fallback moved stay moved, and events the detectors
latched before a checkpoint (but after the last logging step) still act after resuming from it."""

from __future__ import annotations

import pytest
import torch
import yaml
from torch import nn
from transformers import Trainer, TrainerCallback

from hf_mixedprec.core.demo import tiny_llama
from hf_mixedprec.fp8 import EmulatedFP8Linear
from hf_mixedprec.integrations.recipe import resolve_recipe
from hf_mixedprec.integrations.trainer import runtime_of
from tests.integrations.test_integration import Bytes

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_accelerate_state")]


def _recipe(base: str, extra: str):
    return resolve_recipe({"name": "resume", "extends": base, **yaml.safe_load(extra)}).rehearsed()


def _trainer(recipe, out, *, steps, callbacks=(), after=(), **targs):
    """A Trainer of the tiny Llama on bytes; ``callbacks`` run before the recipe's callback, ``after`` after it (they
    see what it did at the same event)."""
    args = recipe.training_args(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=2e-3,
        report_to=[],
        disable_tqdm=True,
        seed=0,
        **targs,
    )
    return Trainer(
        model=tiny_llama(), args=args, train_dataset=Bytes(), callbacks=[*callbacks, *recipe.callbacks(), *after]
    )


class InfGradAt(TrainerCallback):
    """Makes one weight's gradient inf on optimizer step ``at`` (an FP16 overflow the scaler skips)."""

    def __init__(self, at: int):
        self.at, self.armed = at, False

    def on_train_begin(self, args, state, control, model=None, **kw):
        w = model.model.layers[0].mlp.down_proj.weight
        w.register_hook(lambda g: torch.full_like(g, float("inf")) if self.armed else g)

    def on_step_begin(self, args, state, control, **kw):
        self.armed = state.global_step + 1 == self.at


def test_an_event_latched_before_a_checkpoint_stops_the_resumed_run_at_the_same_step(tmp_path):
    # the overflow at step 2 is read when checkpoint-3 is written; its stop reaction acts at the log of step 5
    recipe = _recipe("v100-fp16", "{health: {detectors: {nonfinite_grad: {reaction: stop}}}}")
    common = {"logging_steps": 5, "save_strategy": "steps", "save_steps": 3}
    straight = _trainer(recipe, tmp_path / "straight", steps=12, callbacks=[InfGradAt(2)], **common)
    straight.train()
    assert straight.state.global_step == 5
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    resumed = _trainer(recipe, tmp_path / "resumed", steps=12, **common)
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-3"))
    assert resumed.state.global_step == 5, "the event latched before checkpoint-3 was lost on resume"
    events = [[(e["step"], e["detector"]) for e in runtime_of(t).events] for t in (straight, resumed)]
    assert events[0] == events[1] and (2, "nonfinite_grad") in events[0]


def _types(model: nn.Module) -> dict[str, str]:
    return {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, (nn.Linear, EmulatedFP8Linear))}


def test_fp8_layers_a_fallback_moved_stay_moved_after_resume(tmp_path):
    # an SQNR floor no FP8 layer can meet: the check after the step-4 sample moves every FP8 layer to BF16
    recipe = _recipe(
        "h100-fp8-delayed",
        "{health: {fp8_sample_every: 4, detectors: {fp8_sqnr: {threshold: 1000, reaction: fallback}}}}",
    )
    common = {"logging_steps": 2, "save_strategy": "steps", "save_steps": 6}
    straight = _trainer(recipe, tmp_path / "straight", steps=10, **common)
    straight.train()
    moved = runtime_of(straight).moved_layers
    assert len(moved) == 14 and not any(isinstance(m, EmulatedFP8Linear) for m in straight.model.modules())
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    resumed = _trainer(recipe, tmp_path / "resumed", steps=10, **common)
    assert isinstance(resumed.model.model.layers[0].self_attn.q_proj, EmulatedFP8Linear)  # before resuming
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-6"))
    assert _types(resumed.model) == _types(straight.model)
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a), "the resumed run diverged from the straight one"
    assert runtime_of(resumed).moved_layers == moved


class InfGradOn(InfGradAt):
    """:class:`InfGradAt` on several optimizer steps."""

    def __init__(self, steps: set[int]):
        super().__init__(0)
        self.steps = steps

    def on_step_begin(self, args, state, control, **kw):
        self.armed = state.global_step + 1 in self.steps


@pytest.mark.parametrize("base", ["v100-fp16", "h100-fp8-delayed"])
def test_a_run_resumed_from_any_checkpoint_ends_as_the_straight_run(tmp_path, base):
    """Skips at steps 2 and 5, a log every 4 steps, a checkpoint after every step: resumed from each checkpoint,
    the run ends bit for bit where the straight run ends (weights, loss scale or FP8 histories, skip count, LR,
    events)."""
    from accelerate.state import AcceleratorState

    recipe = _recipe(base, "{health: {detectors: {nonfinite_grad: {reaction: warn}}}}")
    common = {"logging_steps": 4, "save_strategy": "steps", "save_steps": 1}
    faults = {2, 5}
    straight = _trainer(recipe, tmp_path / "straight", steps=8, callbacks=[InfGradOn(faults)], **common)
    straight.train()
    want = straight.model.state_dict()
    rt = runtime_of(straight)
    want_events = [(e["step"], e["detector"]) for e in rt.events]
    assert (2, "nonfinite_grad") in want_events and (5, "nonfinite_grad") in want_events
    assert int(rt._skipped.item()) == 2
    for k in range(1, 8):
        AcceleratorState._reset_state(reset_partial_state=True)
        resumed = _trainer(recipe, tmp_path / f"resumed-{k}", steps=8, callbacks=[InfGradOn(faults)], **common)
        resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / f"checkpoint-{k}"))
        got = resumed.model.state_dict()
        assert list(got) == list(want)
        diff = [n for n in want if not torch.equal(want[n], got[n])]
        assert diff == [], f"resumed from checkpoint-{k}: {diff[:3]} differ"
        rr = runtime_of(resumed)
        assert int(rr._skipped.item()) == 2, k
        assert resumed.lr_scheduler.get_last_lr() == straight.lr_scheduler.get_last_lr(), k
        assert [(e["step"], e["detector"]) for e in rr.events] == want_events, k
        if base == "v100-fp16":
            assert resumed.accelerator.scaler.get_scale() == straight.accelerator.scaler.get_scale(), k
