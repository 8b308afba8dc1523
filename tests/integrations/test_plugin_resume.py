"""An own Accelerate loop resumed with ``accelerator.save_state`` / ``load_state`` continues exactly as the
uninterrupted run: hf_mixedprec's runtime state (clipper statistics, detector windows, skipped-step counts, events,
FP8 fallbacks) rides in Accelerate's checkpoint as a registered object, beside the model, optimizer, scheduler and
scaler Accelerate saves itself.
"""

from __future__ import annotations

import pytest
import torch

from hf_mixedprec.core.demo import tiny_llama
from hf_mixedprec.integrations.recipe import resolve_recipe
from tests.integrations.test_integration import Bytes

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_accelerate_state")]

STEPS, SAVE_AT = 12, 6


def _batches() -> list[torch.Tensor]:
    data = Bytes(n=2 * STEPS, seq_len=32)
    return [torch.stack([data[2 * i]["input_ids"], data[2 * i + 1]["input_ids"]]) for i in range(STEPS)]


def _setup(recipe):
    acc = recipe.accelerator(max_steps=STEPS)  # a phased recipe's fractional starts need the run's length
    model = tiny_llama(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / (2 * STEPS))
    model, opt, sched = acc.prepare(model, opt, sched)
    return acc, model, opt, sched


def _train(acc, model, opt, sched, batches, start: int, stop: int, overflow_at: int | None = None):
    """Steps ``start..stop-1``; ``overflow_at``: that step's gradients are made inf (a skipped step)."""
    rows = []
    for i in range(start, stop):
        loss = model(input_ids=batches[i], labels=batches[i]).loss
        acc.backward(loss * (float("inf") if i == overflow_at else 1.0))
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        rows.append({"loss": loss.item(), **acc.mp_metrics()})
    return rows


def _exact(rows: list[dict]) -> list[dict]:
    return [{k: float(v).hex() for k, v in r.items()} for r in rows]


def _recipes():
    zclip = {"clipping": {"method": "zclip", "warmup_steps": 3}}  # past its warm-up before the save
    return {
        "cpu-bf16": resolve_recipe({"name": "b", "extends": "cpu-bf16", **zclip}),
        "v100-fp16": resolve_recipe({"name": "f", "extends": "v100-fp16", **zclip}).rehearsed(),
        "h100-fp8-delayed": resolve_recipe({"name": "d", "extends": "h100-fp8-delayed", **zclip}).rehearsed(),
        "fp8-current": resolve_recipe(
            {"name": "c", "extends": "h100-fp8-current", "fp8": {"backend": "emulated"}, **zclip}
        ).rehearsed(),
        "torchao": resolve_recipe(
            {"name": "t", "extends": "h100-fp8-current", "fp8": {"backend": "torchao"}, **zclip}
        ).rehearsed(),
        # FP8 then BF16 from step 4 (before the save) or step 9 (after the resume): the phase in force is restored
        "phases-switched": resolve_recipe(
            {"name": "p1", "extends": "h100-fp8-anneal-bf16", "phases": _phases(4), **zclip}
        ).rehearsed(),
        "phases-ahead": resolve_recipe(
            {"name": "p2", "extends": "h100-fp8-anneal-bf16", "phases": _phases(9), **zclip}
        ).rehearsed(),
        # BF16, then FP16 from step 2 (the scaler grows every 2 steps and backs off at the overflow of step 3; saved
        # inside the phase), then BF16 from step 9 (the scaler retired after the resume)
        "phases-fp16": resolve_recipe(
            {"name": "p3", "extends": "cpu-bf16", "phases": _fp16_phases(2, 9), **zclip}
        ).rehearsed(),
        # FP16 from step 0, retired at step 4 before the save
        "phases-fp16-retired": resolve_recipe(
            {"name": "p4", "extends": "v100-fp16", "phases": _fp16_phases(0, 4, first="fp16"), **zclip}
        ).rehearsed(),
    }


def _fp16_phases(fp16_at: int, bf16_at: int, first: str = "bf16") -> list[dict]:
    ls = {"init_scale": 256.0, "growth_interval": 2}
    out = [{"start": 0, "precision": first}] if fp16_at else []
    out += [{"start": fp16_at, "precision": "fp16", "loss_scale": ls}, {"start": bf16_at, "precision": "bf16"}]
    return out


def _phases(anneal_at: int) -> list[dict]:
    return [
        {"name": "fp8", "start": 0, "precision": "fp8"},
        {"name": "anneal", "start": anneal_at, "precision": "bf16"},
    ]


@pytest.mark.parametrize(
    "name",
    [
        "cpu-bf16",
        "v100-fp16",
        "h100-fp8-delayed",
        "fp8-current",
        "torchao",
        "phases-switched",
        "phases-ahead",
        "phases-fp16",
        "phases-fp16-retired",
    ],
)
def test_save_state_load_state_resumes_bitwise(name, tmp_path):
    from accelerate.state import AcceleratorState

    recipe = _recipes()[name]
    batches = _batches()
    overflow = 3  # a skipped step before the save: the count and the clipper's statistics must carry over
    whole = _train(*_setup(recipe), batches, 0, STEPS, overflow_at=overflow)

    AcceleratorState._reset_state(reset_partial_state=True)
    acc, model, opt, sched = _setup(recipe)
    first = _train(acc, model, opt, sched, batches, 0, SAVE_AT, overflow_at=overflow)
    acc.save_state(str(tmp_path / "ckpt"))
    del acc, model, opt, sched

    AcceleratorState._reset_state(reset_partial_state=True)
    acc, model, opt, sched = _setup(recipe)
    acc.load_state(str(tmp_path / "ckpt"))
    rest = _train(acc, model, opt, sched, batches, SAVE_AT, STEPS)

    assert _exact(first + rest) == _exact(whole)  # every loss and mp/ metric, bit for bit (NaN included)
    assert whole[-1]["mp/skipped_steps"] == 1.0 and "mp/clip_threshold" in whole[-1]
    assert acc.mp.steps == STEPS
    if name == "phases-fp16":  # the loss scale exists in the FP16 phase only: grown, backed off, grown again
        assert [r.get("mp/loss_scale") for r in whole] == [None, None, 256, 128, 128, 256, 256, 512, 512] + [None] * 3
        assert [r["mp/phase"] for r in whole] == [0] * 2 + [1] * 7 + [2] * 3  # each row is its own step's phase


def test_fp8_fallback_moves_the_same_layer_again_before_the_weights_load(tmp_path):
    """A layer a fallback moved to high precision has other state-dict keys: it is moved again before Accelerate
    loads the weights, so load_state neither fails nor loads into the wrong module type."""
    from accelerate.state import AcceleratorState
    from torch import nn

    from hf_mixedprec.fp8 import fp8_layers
    from hf_mixedprec.training.health import layers_to_bf16

    recipe = _recipes()["h100-fp8-delayed"]
    acc, model, opt, sched = _setup(recipe)
    layer = "model.layers.1.mlp.down_proj"
    acc.mp.moved_layers = layers_to_bf16(acc.unwrap_model(model), [layer])  # what a fallback reaction does
    _train(acc, model, opt, sched, _batches(), 0, 2)
    acc.save_state(str(tmp_path / "ckpt"))

    AcceleratorState._reset_state(reset_partial_state=True)
    acc, model, opt, sched = _setup(recipe)
    acc.load_state(str(tmp_path / "ckpt"))
    inner = acc.unwrap_model(model)
    assert type(inner.get_submodule(layer)) is nn.Linear
    assert layer not in {n for n, _ in fp8_layers(inner, fresh=True)} and acc.mp.moved_layers == [layer]
