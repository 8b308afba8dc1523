"""FP8 under DeepSpeed ZeRO-1 and ZeRO-2 on 2 CPU ranks (gloo): our emulated delayed scaling and torchao's current
scaling train as one DeepSpeed process does on the same global batches. DeepSpeed runs FP32 (its bf16 mode would cast
the FP8 layers' scaling state); the FP8 layers and the BF16 autocast are hf_mixedprec's. A tiny Qwen3-MoE runs its experts'
grouped GEMMs in FP8 under ZeRO-2 the same way."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from tests.ranks import Scenario, free_port, leave_group, run_ranks, run_scenarios, scenario_results

STEPS = 6
#: kind -> (base recipe, extra recipe keys, ZeRO stage)
KINDS = {
    "emulated-delayed-zero1": ("h100-fp8-delayed", {}, 1),
    "torchao-current-zero2": ("h100-fp8-current", {"fp8": {"backend": "torchao"}}, 2),
    "moe-delayed-zero2": ("h100-fp8-delayed", {}, 2),  # a tiny Qwen3-MoE: its experts in FP8 too
    "emulated-delayed-zero3": ("h100-fp8-delayed", {}, 3),
    "torchao-current-zero3": ("h100-fp8-current", {"fp8": {"backend": "torchao"}}, 3),
    "moe-delayed-zero3": ("h100-fp8-delayed", {}, 3),
}
#: the kinds whose one-process run saves after step 3 and is resumed from there
RESUMED = ("emulated-delayed-zero1", "emulated-delayed-zero3")


def _model(kind: str):
    from hf_mixedprec.core.demo import tiny_llama

    if not kind.startswith("moe"):
        return tiny_llama(0)
    from tests.moe import tiny_qwen3_moe

    return tiny_qwen3_moe()


def _fp8_run(rank: int, world: int, kind: str, out: str, save_every: int = 0, resume: str | None = None) -> dict:
    """One of ``world`` DeepSpeed ranks training an FP8 recipe (rehearsed) for 6 steps on 4 // world rows a step:
    its losses, norms, FP8 metrics, layer types and FP8 scaling state."""
    from transformers import Trainer

    from hf_mixedprec.fp8.experts import converted_experts
    from hf_mixedprec.integrations.deepspeed import deepspeed_config
    from hf_mixedprec.integrations.recipe import resolve_recipe
    from hf_mixedprec.integrations.trainer import runtime_of
    from tests.integrations.test_integration import Bytes

    base, extra, stage = KINDS[kind]
    recipe = resolve_recipe(
        {"name": f"ds-{kind}", "extends": base, **extra, "health": {"fp8_sample_every": 1},
         "distributed": {"strategy": "deepspeed", "zero_stage": stage}}
    ).rehearsed(True)  # fmt: skip
    cfg, config_notes = deepspeed_config(recipe)
    args = recipe.training_args(
        output_dir=f"{out}-run", deepspeed=cfg, max_steps=STEPS, per_device_train_batch_size=4 // world,
        learning_rate=1e-3, logging_steps=1, save_strategy="steps" if save_every else "no", save_steps=save_every or 1,
        report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = Trainer(
        model=_model(kind), args=args, train_dataset=Bytes(n=40, seq_len=16), callbacks=recipe.callbacks()
    )
    trainer.train(resume_from_checkpoint=resume)
    rows = [h for h in trainer.state.log_history if "loss" in h]
    state = {
        k: v.tolist() for k, v in trainer.model.state_dict().items() if k.endswith(("fp8_amax_history", "fp8_scale"))
    }
    return {
        "loss": [h["loss"] for h in rows],
        "norm": [h["grad_norm"] for h in rows],
        "amax": [{k: v for k, v in h.items() if k.endswith("/input_amax")} for h in rows],
        "types": sorted({type(m).__name__ for m in trainer.model.modules()}),
        "fp8_state": state,
        "engine_bf16": bool(trainer.model_wrapped.bfloat16_enabled()),
        "zero_stage": int(trainer.model_wrapped.zero_optimization_stage()),
        "world": int(trainer.model_wrapped.dp_world_size),
        "weight_dtypes": sorted({str(p.dtype) for p in trainer.model.parameters()}),
        # ZeRO-3's partitioned parameters: each holds 1/world of its elements between gathers (ds_tensor)
        "partitioned": [p.ds_tensor.numel() for p in trainer.model.parameters() if hasattr(p, "ds_tensor")][:1],
        "experts": converted_experts(trainer.model),
        "notes": [*config_notes, *runtime_of(trainer).notes],
    }


def _runs(rank: int, world: int, port: int, out: str, runs: list[Scenario]) -> None:
    """One of ``world`` DeepSpeed ranks running ``runs`` in turn (:func:`tests.ranks.run_scenarios`: they share the
    process's imports; Accelerate's state is reset after each, so that the next Trainer takes its own DeepSpeed
    config, and the tests check the engine's ZeRO stage)."""
    from tests.deepspeed_cpu import join_as_deepspeed_rank

    join_as_deepspeed_rank(rank, world, port)
    run_scenarios(rank, out, runs)
    leave_group()


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> Callable[..., dict]:
    """Every run once: both kinds on 2 ranks (one pair of processes), and in one process both kinds, the resumed
    run and the late callback. ``ran(name, rank)`` is what that rank wrote (see :func:`tests.ranks.scenario_results`
    for how a test fails where its run did not get that far)."""
    out = str(tmp_path_factory.mktemp("ds-fp8"))
    delayed = "emulated-delayed-zero1"
    # the delayed kind saves after step 3 on 2 ranks too: the layout test resumes it on one
    two = [(f"two-{kind}", _fp8_run, (2, kind, f"{out}/two-{kind}", 3 if kind == delayed else 0)) for kind in KINDS]
    alone = [
        # saves after step 3: the straight run of the resume test too (saving changes no figure)
        *[(f"one-{kind}", _fp8_run, (1, kind, f"{out}/one-{kind}", 3 if kind in RESUMED else 0)) for kind in KINDS],
        *[
            (f"resumed-{k}", _fp8_run, (1, k, f"{out}/resumed-{k}", 3, f"{out}/one-{k}-run/checkpoint-3"))
            for k in RESUMED
        ],
        ("late", _late_run, (f"{out}/late",)),
        ("zero3-pretrained", _zero3_pretrained, (f"{out}/zero3-pretrained",)),
        (
            "layouts",
            _layout_refusals,
            (f"{out}/one-{delayed}-run/checkpoint-3", f"{out}/plain", f"{out}/two-{delayed}-run/checkpoint-3"),
        ),
    ]
    ports = [free_port(), free_port()]
    return scenario_results(
        out,
        [
            lambda: run_ranks(_runs, [(r, 2, ports[0], out, two) for r in (0, 1)]),
            lambda: run_ranks(_runs, [(0, 1, ports[1], out, alone)]),
        ],
    )


@pytest.fixture(params=list(KINDS))
def fp8_runs(request, ran):
    kind = request.param
    return kind, [ran(f"two-{kind}", r) for r in (0, 1)], ran(f"one-{kind}")


@pytest.mark.slow
def test_fp8_under_deepspeed_trains_as_one_process_on_the_same_global_batches(fp8_runs):
    """Both kinds: FP8 layers in the engine's model, DeepSpeed in FP32 (FP32 weights), every rank's figures equal,
    and against one process on the same global batches: the first step's loss to 1e-6 (same weights; torchao 1e-4,
    measured 2.3e-5, its current scaling takes each rank's own amax), losses within
    1e-3 and gradient norms within 2% over 6 steps (measured: 2.1e-4 and 0.7% delayed, 5.2e-4 and 1.3% torchao; each
    rank quantizes its own half of the batch, and torchao's current scaling takes each half's own amax)."""
    kind, (two, other), one = fp8_runs
    assert two["zero_stage"] == one["zero_stage"] == KINDS[kind][2] and (two["world"], one["world"]) == (2, 1)
    layer = "Float8Linear" if kind.startswith("torchao") else "EmulatedFP8Linear"
    assert layer in two["types"] and layer in one["types"]
    moe = ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"] if kind.startswith("moe") else []
    assert two["experts"] == other["experts"] == one["experts"] == moe  # the experts' grouped GEMMs in FP8
    assert not two["engine_bf16"] and two["weight_dtypes"] == ["torch.float32"]
    if KINDS[kind][2] == 3:  # the first parameter (the embedding) split over the ranks: each holds half of it
        assert one["partitioned"] and two["partitioned"] == [one["partitioned"][0] // 2], two["partitioned"]
    else:
        assert two["partitioned"] == [] == one["partitioned"]
    assert any("FP8 under DeepSpeed ZeRO-" in n for n in two["notes"]), two["notes"]
    assert not any("FALLBACK" in n for n in two["notes"]), two["notes"]
    assert other["loss"] == two["loss"] and other["amax"] == two["amax"]  # both ranks saw the same figures
    first = 1e-4 if kind.startswith("torchao") else 1e-6  # torchao scales each rank's half by its own amax
    assert two["loss"][0] == pytest.approx(one["loss"][0], rel=first)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-3)
    assert two["norm"] == pytest.approx(one["norm"], rel=2e-2)


@pytest.mark.slow
def test_fp8_statistics_and_delayed_scaling_state_are_global_under_deepspeed(fp8_runs):
    """The sampled FP8 statistics are combined over the ranks (step 1's first-block input amaxes are one process's on
    the global batch), and delayed scaling's amax histories and scales, reduced with MAX at every step, are the same
    tensors on both ranks."""
    kind, (two, other), one = fp8_runs
    first = {k: v for k, v in one["amax"][0].items() if "model.layers.0." in k}
    assert len(first) >= 5
    assert {k: two["amax"][0][k] for k in first} == pytest.approx(first, rel=1e-5)
    if not kind.startswith("torchao"):  # the MoE's: its experts' per-expert histories too
        assert two["fp8_state"] and two["fp8_state"] == other["fp8_state"]
        assert any("experts" in k for k in two["fp8_state"]) == kind.startswith("moe")


def test_fp8_under_deepspeed_refuses_stage_0_and_what_zero3_cannot_do_naming_the_key():
    """Stage 0 is refused (DeepSpeed without ZeRO); under ZeRO-3, a per-layer health fallback (a new module DeepSpeed
    never hooked) and zero3_init (the model built partitioned before the FP8 conversion reads it) are refused, each
    in one line naming its key; ZeRO-3 with neither is accepted."""
    from hf_mixedprec.integrations.recipe import RecipeError, resolve_recipe

    def recipe(stage: int, **extra: object) -> object:
        ds = {"strategy": "deepspeed", "zero_stage": stage, **extra.pop("distributed", {})}
        return resolve_recipe({"name": "x", "extends": "h100-fp8-delayed", "distributed": ds, **extra})

    for kwargs, words in (
        ({"stage": 0}, "distributed.zero_stage: 0 with precision fp8: stage 0 is DeepSpeed without ZeRO"),
        (
            {"stage": 3, "health": {"detectors": {"fp8_underflow": {"reaction": "fallback"}}}},
            "health.detectors.fp8_underflow.reaction: 'fallback' with precision fp8 under deepspeed zero_stage 3",
        ),
        (  # a step detector's fallback moves every FP8 layer
            {"stage": 3, "health": {"detectors": {"loss_spike": {"reaction": "fallback"}}}},
            "health.detectors.loss_spike.reaction: 'fallback' with precision fp8 under deepspeed zero_stage 3",
        ),
        (
            {"stage": 3, "distributed": {"zero3_init": True}},
            "distributed.zero3_init: true with precision fp8: the model would be built already partitioned",
        ),
    ):
        with pytest.raises(RecipeError) as err:
            recipe(**kwargs)
        assert words in str(err.value) and "\n" not in str(err.value).strip(), str(err.value)
    assert recipe(3).distributed.zero_stage == 3
    assert recipe(3, health={"detectors": {"fp8_underflow": {"reaction": "warn"}}}).distributed.zero_stage == 3


@pytest.mark.slow
@pytest.mark.parametrize("kind", RESUMED)
def test_an_fp8_deepspeed_run_resumes_to_the_straight_run(ran, kind):
    """Delayed scaling's amax histories and scales come back with a DeepSpeed checkpoint (ZeRO-1, and ZeRO-3 with
    its partitioned weights and optimizer state; one process): resumed from step 3, steps 4-6 give the straight run's
    losses and FP8 state bit for bit. (The resumed run comes after another kind's run in the straight run's process:
    every Trainer builds its model afresh, and what is compared comes back from the checkpoint.)"""
    a, b = ran(f"one-{kind}"), ran(f"resumed-{kind}")
    assert b["zero_stage"] == KINDS[kind][2]
    assert b["loss"][-3:] == a["loss"][-3:]
    assert b["fp8_state"] == a["fp8_state"] and a["fp8_state"]


def _late_run(rank: int, out: str) -> dict:
    """One DeepSpeed process (ZeRO-1) whose FP8 callback is added after the Trainer was built: what train() said."""
    from transformers import Trainer

    from hf_mixedprec.core.demo import tiny_llama
    from hf_mixedprec.fp8.emulated import EmulatedFP8GEMM
    from hf_mixedprec.integrations.deepspeed import deepspeed_config
    from hf_mixedprec.integrations.recipe import resolve_recipe
    from tests.integrations.test_integration import Bytes

    recipe = resolve_recipe(
        {"name": "late", "extends": "h100-fp8-delayed", "distributed": {"strategy": "deepspeed", "zero_stage": 1}}
    ).rehearsed(True)
    args = recipe.training_args(
        output_dir=f"{out}-run", deepspeed=deepspeed_config(recipe)[0], max_steps=2, per_device_train_batch_size=2,
        report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no",
    )  # fmt: skip
    trainer = Trainer(model=tiny_llama(0), args=args, train_dataset=Bytes(n=8, seq_len=16))
    trainer.add_callback(recipe.callbacks()[0])
    try:
        trainer.train()
        seen = "trained"
    except ValueError as exc:
        seen = str(exc)
    fp8 = any(isinstance(m, EmulatedFP8GEMM) for m in trainer.model.modules())
    return {"seen": seen, "fp8_layers": fp8, "step": trainer.state.global_step}


def _zero3_pretrained(rank: int, out: str) -> dict:
    """An FP8 recipe under ZeRO-3 with a model loaded by ``from_pretrained``: after the TrainingArguments (which make
    transformers load it already partitioned) and before them (whole, as ``finetune --model`` loads it for FP8):
    what each ``train()`` did."""
    from accelerate.state import AcceleratorState
    from transformers import AutoModelForCausalLM, Trainer
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from hf_mixedprec.core.demo import tiny_llama
    from hf_mixedprec.fp8.emulated import EmulatedFP8GEMM
    from hf_mixedprec.integrations.deepspeed import deepspeed_config
    from hf_mixedprec.integrations.recipe import resolve_recipe
    from tests.integrations.test_integration import Bytes

    tiny_llama(0).save_pretrained(f"{out}-model")
    recipe = resolve_recipe(
        {"name": "z3", "extends": "h100-fp8-delayed", "distributed": {"strategy": "deepspeed", "zero_stage": 3}}
    ).rehearsed(True)
    seen: dict = {}
    for order in ("args_first", "model_first"):
        AcceleratorState._reset_state(reset_partial_state=True)
        # what a fresh process (finetune) starts from: no TrainingArguments yet, so from_pretrained loads whole (the
        # runs before this one in the process left theirs registered with transformers)
        unset_hf_deepspeed_config()
        model = None if order == "args_first" else AutoModelForCausalLM.from_pretrained(f"{out}-model")
        args = recipe.training_args(
            output_dir=f"{out}-{order}", deepspeed=deepspeed_config(recipe)[0], max_steps=2,
            per_device_train_batch_size=2, report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no",
        )  # fmt: skip
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(f"{out}-model")
        trainer = None
        try:  # the refusal comes when the callback sets up, as the Trainer is built
            trainer = Trainer(
                model=model, args=args, train_dataset=Bytes(n=8, seq_len=16), callbacks=recipe.callbacks()
            )
            trainer.train()
            seen[order] = "trained"
        except ValueError as exc:
            seen[order] = str(exc)
        seen[f"{order}_fp8"] = any(isinstance(m, EmulatedFP8GEMM) for m in model.modules())
        seen[f"{order}_step"] = trainer.state.global_step if trainer is not None else 0
    return seen


def _layout_refusals(rank: int, ds_checkpoint: str, plain: str, two_rank_checkpoint: str) -> dict:
    """Resumes across engines in one process: the DeepSpeed checkpoint of the run above by a Trainer without DeepSpeed,
    and a checkpoint written without DeepSpeed (``model.safetensors``, ``optimizer.pt``) by a DeepSpeed (ZeRO-1)
    Trainer, and the 2-rank ZeRO-1 checkpoint by a 1-rank DeepSpeed Trainer: what each ``train()`` raised, and the
    step it reached."""
    import torch
    from safetensors.torch import save_file
    from transformers import Trainer, TrainerState

    from hf_mixedprec.core.demo import tiny_llama
    from hf_mixedprec.integrations.deepspeed import deepspeed_config
    from hf_mixedprec.integrations.recipe import resolve_recipe
    from tests.integrations.test_integration import Bytes

    seen = {}
    for name, strategy, checkpoint in (
        ("plain_run", "none", ds_checkpoint),
        ("deepspeed_run", "deepspeed", None),
        ("one_of_two", "deepspeed", two_rank_checkpoint),
    ):
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
        # TrainingArguments(deepspeed=...) of the runs before set ACCELERATE_USE_DEEPSPEED in this process's
        # environment, which would make any later Trainer a DeepSpeed one; the plain run is built without it
        os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
        distributed = {"strategy": "deepspeed", "zero_stage": 1} if strategy == "deepspeed" else {"strategy": "none"}
        recipe = resolve_recipe({"name": name, "extends": "cpu-fp32", "distributed": distributed})
        model = tiny_llama(0)
        if checkpoint is None:  # what a run without DeepSpeed leaves: model.safetensors and optimizer.pt
            checkpoint = f"{plain}/checkpoint-3"
            os.makedirs(checkpoint, exist_ok=True)
            save_file({k: v.contiguous() for k, v in model.state_dict().items()}, f"{checkpoint}/model.safetensors")
            torch.save({"state": {}, "param_groups": []}, f"{checkpoint}/optimizer.pt")
            TrainerState(global_step=3, max_steps=6).save_to_json(f"{checkpoint}/trainer_state.json")
        ds = {"deepspeed": deepspeed_config(recipe)[0]} if strategy == "deepspeed" else {}
        args = recipe.training_args(
            output_dir=f"{plain}-{name}", max_steps=2, per_device_train_batch_size=2, report_to=[], use_cpu=True,
            disable_tqdm=True, save_strategy="no", **ds,
        )  # fmt: skip
        trainer = Trainer(model=model, args=args, train_dataset=Bytes(n=8, seq_len=16), callbacks=recipe.callbacks())
        try:
            trainer.train(resume_from_checkpoint=checkpoint)
            seen[name] = ("trained", "")
        except Exception as exc:
            seen[name] = (type(exc).__name__, str(exc))
        seen[f"{name}_step"] = trainer.state.global_step
        seen[f"{name}_deepspeed"] = bool(trainer.is_deepspeed_enabled)
    return seen


@pytest.mark.slow
def test_an_fp8_model_loaded_partitioned_by_zero3_is_refused_and_one_loaded_whole_trains(ran):
    """``from_pretrained`` after TrainingArguments with a ZeRO-3 config loads the model partitioned (each rank 1/N of
    every weight): the callback, which converts from whole weights, refuses it in one line naming the fix as the
    Trainer is built;
    loaded before the arguments (as ``finetune --model`` does for an FP8 recipe), it converts and trains."""
    seen = ran("zero3-pretrained")
    message = seen["args_first"]
    assert "the model was built already partitioned over the ranks" in message and "\n" not in message, message
    assert "load the model before building the TrainingArguments" in message
    assert seen["args_first_step"] == 0 and not seen["args_first_fp8"]
    assert seen["model_first"] == "trained" and seen["model_first_fp8"] and seen["model_first_step"] == 2


@pytest.mark.slow
def test_a_checkpoint_of_another_engine_is_refused_in_one_line_before_anything_loads(ran):
    """DeepSpeed resumes only its own checkpoints, and a run without it would resume a DeepSpeed checkpoint's weights
    with a fresh optimizer (its state is partitioned in DeepSpeed's files): each direction is refused in one line
    that names the checkpoint, what wrote it and what to do, before a step; so is a ZeRO checkpoint of 2 ranks
    resumed on 1 (each rank loads its own partition; DeepSpeed's universal checkpoint is the way across)."""
    seen = ran("layouts")
    assert (
        seen["plain_run_deepspeed"] is False and seen["deepspeed_run_deepspeed"] is seen["one_of_two_deepspeed"] is True
    )
    kind, message = seen["plain_run"]
    assert kind == "CheckpointLayoutRefusal" and "\n" not in message, message
    assert message.startswith("resume: checkpoint-3 was written by DeepSpeed (its optimizer state is partitioned in ")
    assert "global_step3/" in message and "distributed.strategy deepspeed" in message
    kind, message = seen["deepspeed_run"]
    assert kind == "CheckpointLayoutRefusal" and "\n" not in message, message
    assert "written by a run without DeepSpeed and this run uses DeepSpeed" in message
    kind, message = seen["one_of_two"]
    assert kind == "CheckpointLayoutRefusal" and "\n" not in message, message
    assert "partitioned over 2 rank(s) and this run has 1" in message and "ds_to_universal" in message
    assert seen["plain_run_step"] == seen["deepspeed_run_step"] == seen["one_of_two_step"] == 0


@pytest.mark.slow
def test_an_fp8_callback_added_after_deepspeed_took_the_model_is_refused_before_a_step(ran):
    """``trainer.add_callback(...)`` after construction: the callback sets up at ``on_train_begin``, once the
    DeepSpeed engine holds the model, too late to convert layers; it says so before any step, and no layer moved."""
    seen = ran("late")
    assert "the callback was added after the DeepSpeed engine took the model" in seen["seen"]
    assert seen["step"] == 0 and not seen["fp8_layers"]


@pytest.mark.parametrize("how", ["plugin", "env"])
def test_an_fp8_recipe_with_deepspeed_on_a_loop_of_ones_own_is_refused_before_anything_is_built(how, monkeypatch):
    """``recipe.accelerator()`` under DeepSpeed: Accelerate's DeepSpeed preparation never reaches our FP8 conversion
    and autocast, so the loop would train plain FP32 and say nothing; it is refused first, naming what runs it."""
    from hf_mixedprec.integrations.recipe import resolve_recipe

    recipe = resolve_recipe(
        {"name": "ds-fp8", "extends": "h100-fp8-delayed", "distributed": {"strategy": "deepspeed", "zero_stage": 1}}
    ).rehearsed(True)
    kwargs = {}
    if how == "plugin":
        kwargs["deepspeed_plugin"] = object()  # refused before Accelerate reads it
    else:
        monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # what accelerate launch with a DeepSpeed config sets
    with pytest.raises(ValueError, match=r"'ds-fp8' \(precision fp8\) with DeepSpeed on recipe.accelerator\(\)"):
        recipe.accelerator(cpu=True, **kwargs)
