"""Adaptive clipping under DeepSpeed ZeRO 1-3 on 2 CPU ranks (gloo): the recipe's ZClip takes the global gradient
norm DeepSpeed computes over its partitions, and DeepSpeed's own clipping applies the threshold. Checked against
one DeepSpeed process on the same global batches, against a replay of ZClip on DeepSpeed's norms, and against the
norm of the gradients DeepSpeed's torch optimizer finally steps with."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from tests.ranks import Scenario, free_port, leave_group, run_ranks, run_scenarios, scenario_results

STEPS = 6
SPIKE_AT = 4
ZCLIP = {"method": "zclip", "warmup_steps": 2, "z_thresh": 1.5}


def _ds_run(
    rank: int, world: int, stage: int, method: str, out: str, save_every: int = 0, resume: str | None = None
) -> dict:
    """One of ``world`` DeepSpeed ranks training cpu-bf16 under ZeRO ``stage`` with the recipe's clipping, on
    4 // world rows a step; per step: DeepSpeed's global norm, the norm of the gradients its torch optimizer stepped
    with, the callback's logged threshold and clip flag, the loss; and the run's notes and the engine's ZeRO stage."""
    import torch.distributed as dist
    from transformers import Trainer, TrainerCallback

    from hf_mixedprec.core.demo import tiny_llama
    from hf_mixedprec.integrations.deepspeed import deepspeed_config
    from hf_mixedprec.integrations.recipe import resolve_recipe
    from hf_mixedprec.integrations.trainer import runtime_of
    from tests.integrations.test_integration import Bytes

    clipping = ZCLIP if method == "zclip" else {"method": method}
    recipe = resolve_recipe(
        {"name": f"ds-{method}", "extends": "cpu-bf16", "clipping": clipping,
         "distributed": {"strategy": "deepspeed", "zero_stage": stage}}
    )  # fmt: skip
    cfg, config_notes = deepspeed_config(recipe)
    stepped: list[float] = []

    class Probe(TrainerCallback):
        wrapped = False
        squares: list[float] = []  # noqa: RUF012 - one probe per process

        def on_step_begin(self, args, state, control, **kw):
            if self.wrapped:
                return
            self.wrapped = True
            base = trainer.model_wrapped.optimizer.optimizer  # the torch AdamW over this rank's partition
            real = base.step

            def step(*a, **k):  # ZeRO steps one parameter group per call
                sq = sum(float(p.grad.double().square().sum()) for g in base.param_groups for p in g["params"])
                self.squares.append(sq)
                return real(*a, **k)

            base.step = step

        def on_step_end(self, args, state, control, **kw):
            total = torch.tensor([sum(self.squares)], dtype=torch.float64)
            dist.all_reduce(total)  # the partitions of all ranks: the norm of what was stepped with
            stepped.append(math.sqrt(float(total)))
            self.squares = []

    args = recipe.training_args(
        output_dir=f"{out}-run", deepspeed=cfg, max_steps=STEPS, per_device_train_batch_size=4 // world,
        learning_rate=1e-3, logging_steps=1, save_strategy="steps" if save_every else "no", save_steps=save_every or 1,
        report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
    )  # fmt: skip

    class Spike(Trainer):  # a loss of the user's own: step 4's is 30 times larger, so its gradient norm spikes
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            return loss * 30 if self.state.global_step == SPIKE_AT - 1 else loss

    trainer = Spike(
        model=tiny_llama(0), args=args, train_dataset=Bytes(n=40, seq_len=16), callbacks=[*recipe.callbacks(), Probe()]
    )
    trainer.train(resume_from_checkpoint=resume)
    rows = [h for h in trainer.state.log_history if "loss" in h]
    return {
        "ds_norm": [h["grad_norm"] for h in rows],
        "stepped": stepped,
        "threshold": [h.get("mp/clip_threshold") for h in rows],
        "clipped": [h.get("mp/clipped") for h in rows],
        "loss": [h["loss"] for h in rows],
        "notes": [*config_notes, *runtime_of(trainer).notes],
        "clipper": runtime_of(trainer).clipper is not None,
        "zero_stage": int(trainer.model_wrapped.zero_optimization_stage()),
        "world": int(trainer.model_wrapped.dp_world_size),
    }


def _runs(rank: int, world: int, port: int, out: str, runs: list[Scenario]) -> None:
    """One of ``world`` DeepSpeed ranks running ``runs`` in turn (:func:`tests.ranks.run_scenarios`: they share the
    process's imports; Accelerate's state is reset after each, so that the next Trainer takes its own DeepSpeed
    config, and the tests check the engine's ZeRO stage)."""
    from tests.deepspeed_cpu import join_as_deepspeed_rank

    join_as_deepspeed_rank(rank, world, port)
    run_scenarios(rank, out, runs)
    leave_group()


def _replay_zclip(norms: list[float]) -> tuple[list[float], list[bool], list[float | None]]:
    """ZClip run on ``norms``: per step the threshold it clips to (inf: none), whether it clips, and what the
    callback logs as ``mp/clip_threshold`` (that threshold, else the boundary for the next step; None in warm-up)."""
    from hf_mixedprec.training.clipping import make_clipper

    clipper = make_clipper("zclip", **{k: v for k, v in ZCLIP.items() if k != "method"})
    thresholds, clipped, logged = [], [], []
    for n in norms:
        r = clipper.clip_grads_([], [], total_norm=torch.tensor(n))
        thresholds.append(float(r.threshold))
        clipped.append(bool(r.clipped))
        shown = float(r.threshold) if math.isfinite(float(r.threshold)) else float(clipper.boundary())
        logged.append(shown if math.isfinite(shown) else None)
    return thresholds, clipped, logged


# ZeRO-1 runs the same optimizer class and clipping code as ZeRO-2 (deepspeed/runtime/zero/stage_1_and_2.py)
STAGES = (2, 3)


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> Callable[..., dict]:
    """Every run once: ZClip at both stages on 2 ranks (one pair of processes), and in one process ZClip at both
    stages and the run resumed from the ZeRO-2 one's step-3 checkpoint. ``ran(name)`` is what rank 0 wrote (see
    :func:`tests.ranks.scenario_results` for how a test fails where its run did not get that far)."""
    out = str(tmp_path_factory.mktemp("ds-clip"))
    two = [(f"two-zero{stage}", _ds_run, (2, stage, "zclip", f"{out}/two-zero{stage}")) for stage in STAGES]
    alone = [
        # the ZeRO-2 one saves after step 3: the straight run of the resume test too (saving changes no figure)
        *[(f"one-zero{s}", _ds_run, (1, s, "zclip", f"{out}/one-zero{s}", 3 if s == 2 else 0)) for s in STAGES],
        ("resumed", _ds_run, (1, 2, "zclip", f"{out}/resumed", 3, f"{out}/one-zero2-run/checkpoint-3")),
    ]
    ports = [free_port(), free_port()]
    return scenario_results(
        out,
        [
            lambda: run_ranks(_runs, [(r, 2, ports[0], out, two) for r in (0, 1)]),
            lambda: run_ranks(_runs, [(0, 1, ports[1], out, alone)]),
        ],
    )


@pytest.fixture(params=STAGES, ids=lambda s: f"zero{s}")
def zclip_runs(request, ran):
    stage = request.param
    two, one = ran(f"two-zero{stage}"), ran(f"one-zero{stage}")
    assert two["zero_stage"] == one["zero_stage"] == stage and (two["world"], one["world"]) == (2, 1)
    return two, one


@pytest.mark.slow
def test_zclip_decides_deepspeeds_clipping_from_the_norm_deepspeed_computes(zclip_runs):
    """On 2 ranks: every logged threshold is ZClip's on DeepSpeed's own global norms (a replay of the rule gives
    the same figures), the steps ZClip flags are the ones clipped, and DeepSpeed's torch optimizer then steps with
    gradients whose global norm is the threshold there and DeepSpeed's norm elsewhere."""
    two, _ = zclip_runs
    assert two["clipper"] and not any("FALLBACK" in n for n in two["notes"]), two["notes"]
    assert any("DeepSpeed's own clipping applies it" in n for n in two["notes"])
    thresholds, clipped, logged = _replay_zclip(two["ds_norm"])
    assert [t is None for t in two["threshold"]] == [t is None for t in logged]
    assert [t for t in two["threshold"] if t is not None] == pytest.approx(
        [t for t in logged if t is not None], rel=1e-6
    )
    assert [bool(c) for c in two["clipped"]] == clipped
    assert clipped[SPIKE_AT - 1], "the spike was not clipped: the test would not see the clipping"
    assert len(two["stepped"]) == STEPS
    for norm, thr, was_clipped, got in zip(two["ds_norm"], thresholds, clipped, two["stepped"], strict=True):
        assert got == pytest.approx(thr if was_clipped else norm, rel=1e-4), (norm, thr, got)


@pytest.mark.slow
def test_two_deepspeed_ranks_clip_as_one_process_on_the_same_global_batches(zclip_runs):
    """2 ranks and 1 DeepSpeed process on the same global batches of 4 rows: the same steps clipped, thresholds and
    losses within BF16's summation-order noise (each rank's backward sums its own 2 rows in BF16)."""
    two, one = zclip_runs
    assert [bool(c) for c in two["clipped"]] == [bool(c) for c in one["clipped"]]
    assert two["ds_norm"] == pytest.approx(one["ds_norm"], rel=5e-3)
    assert [t is None for t in two["threshold"]] == [t is None for t in one["threshold"]]
    shown = [(a, b) for a, b in zip(two["threshold"], one["threshold"], strict=True) if a is not None]
    assert shown and all(a == pytest.approx(b, rel=5e-3) for a, b in shown)
    assert two["loss"] == pytest.approx(one["loss"], rel=5e-3)


@pytest.mark.parametrize(
    ("method", "config", "why"),
    [
        ("agc", {"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0}, "AGC clips each weight row by its own"),
        ("zclip", {"zero_optimization": {"stage": 0}, "gradient_clipping": 1.0}, "ZeRO stage 0 clips with torch's"),
        ("zclip", {"gradient_clipping": 1.0}, "ZeRO stage 0 clips with torch's"),  # no zero_optimization: stage 0
        ("zclip", {"zero_optimization": {"stage": 2}, "gradient_clipping": 0.0}, "gradient_clipping is 0.0"),
        ("norm", {"zero_optimization": {"stage": 3}, "gradient_clipping": "auto"}, None),  # auto: max_grad_norm 1.0
        ("zclip", {"zero_optimization": {"stage": 2}, "gradient_clipping": "auto"}, None),
        ("none", {"zero_optimization": {"stage": 2}, "gradient_clipping": 0.0}, None),
    ],
)
def test_the_deepspeed_config_decides_where_the_recipes_clipper_cannot_run(method, config, why):
    """Decided at setup from the DeepSpeed config (before any checkpoint loads, so a resumed run expects the clipper
    state its checkpoint holds): AGC, stage 0 and a gradient_clipping of 0 keep DeepSpeed's fixed clipping, each with
    its reason in the FALLBACK note; the Trainer callback then drops the clipper (tests/integrations/test_faults_deepspeed.py sees
    it do so at stage 0)."""
    from hf_mixedprec.integrations.deepspeed import clipping_refusal

    got = clipping_refusal(method, config, max_grad_norm=1.0)
    assert (got is None) == (why is None), got
    if why is not None:
        assert why in got


@pytest.mark.slow
def test_a_deepspeed_run_resumed_from_a_checkpoint_clips_as_the_straight_run(ran):
    """ZClip's statistics travel with the checkpoint under DeepSpeed too: resumed from step 3 (before the spike),
    the run clips step 4 to the same threshold and logs the same thresholds and losses as the straight run. (The
    resumed run comes after the ZeRO-3 run in the straight run's process: every Trainer builds its model, clipper
    and engine afresh, and what is compared comes back from the checkpoint.)"""
    a, b = ran("one-zero2"), ran("resumed")
    assert a["zero_stage"] == b["zero_stage"] == 2
    assert a["clipped"][SPIKE_AT - 1] == 1.0
    assert b["threshold"][-3:] == a["threshold"][-3:] and b["clipped"][-3:] == a["clipped"][-3:]
    assert b["loss"][-3:] == a["loss"][-3:]
