"""FSDP2 on 2 CPU ranks (gloo): an inf on one rank, FP8 statistics combined over the ranks, health fallbacks inside
sharded blocks, a loop of one's own on the Accelerate plugin (against one process, and resumed from a sharded
``save_state``), the gather and reduce dtypes the recipe names, and what is refused. The runs of ``hf-mixedprec
launch`` against one process are in tests/integrations/test_fsdp2.py.

The scenarios share their processes (each spawned process costs seconds of imports): one pair of ranks runs every
straight scenario one after the other (Accelerate's state reset between them), a fresh pair resumes from the
checkpoints the first wrote (nothing of the straight runs is left in its memory), and one process runs what one
process does on its own (tests/ranks.py ``run_scenarios``: each scenario writes what each rank saw, one that
raises writes its traceback and ends its process at once, and the tests of the scenarios after it fail with it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.fsdp2_estimate import RECIPES as ESTIMATE_RECIPES
from tests.fsdp2_estimate import check_estimate_per_rank, measured_per_rank
from tests.integrations.test_fsdp2 import BOUNDS
from tests.integrations.test_fsdp2_clipping import (
    METHODS,
    check_clipping_as_one_process,
    check_one_all_reduce_and_no_gather,
    sharded_clipping,
)
from tests.ranks import (
    Scenario,
    free_port,
    join_as_rank,
    leave_group,
    run_ranks,
    run_scenarios,
    run_two_ranks,
    scenario_results,
)


def _pair(rank: int, port: int, out: str, scenarios: list[Scenario]) -> None:
    """One of 2 gloo ranks running ``scenarios`` in turn (:func:`tests.ranks.run_scenarios`)."""
    join_as_rank(rank, 2, port)
    run_scenarios(rank, out, scenarios)
    leave_group()


def _alone(out: str, scenarios: list[Scenario], last: Scenario) -> None:
    """One process, no process group, running ``scenarios``, then ``last`` (which makes a group of its own)."""
    torch.set_num_threads(1)  # as the ranks have
    run_scenarios(0, out, [*scenarios, last])
    leave_group()


PLUGIN_BASES = ("cpu-bf16", "h100-fp8-delayed", "cpu-bf16+bf16_remainder")

#: The storage choices other than the default trained under FSDP2 here: ``master`` (FP32 states) or ``master+states``.
STORAGE_CHOICES = ("bf16_remainder", "bf16_kahan", "bf16_stochastic", "none", "fp32+bf16", "fp32+8bit")


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> Callable[..., Any]:
    """Runs every scenario once; ``result(name, rank)`` is what that rank wrote for it (see
    :func:`tests.ranks.scenario_results` for how a test fails where its scenario did not get that far)."""
    out = str(tmp_path_factory.mktemp("fsdp2-ranks"))
    alone = [(f"plugin-one-{base}", _plugin_loop, (1, base)) for base in PLUGIN_BASES]
    alone += [("moe-one", _moe_trainer, (1, f"{out}/moe-one"))]
    alone += [("unsharded-one", _across_layouts, (1, f"{out}/unsharded-one"))]
    alone += [(f"storage-one-{m}", _storage_run, (1, m, f"{out}/storage-one-{m}")) for m in STORAGE_CHOICES]
    # the 2 ranks' remainder checkpoint (written by the straight pair, which runs first) resumed by one process
    remainder_ckpt = f"{out}/storage-two-bf16_remainder/checkpoint-3"
    alone += [("storage-one-from-two", _storage_run, (1, "bf16_remainder", f"{out}/storage-12", remainder_ckpt))]
    straight = [
        ("inf", _inf_on_one_rank, (f"{out}/inf",)),
        ("raw", _reduce_raw, ()),  # needs the process group the Trainer above set up
        ("fallback", _fallback_on_two_ranks, (f"{out}/fallback",)),
        *[(f"plugin-two-{base}", _plugin_loop, (2, base)) for base in PLUGIN_BASES],
        *[(f"policy-{p}-{r}", _policy_loop, (p, r)) for p, r in (("auto", "fp32"), ("bf16", "bf16"))],
        ("plugin-resume", _plugin_resume, (f"{out}/ckpt", False)),
        ("moe-two", _moe_trainer, (2, f"{out}/moe-two")),
        *[(f"storage-two-{m}", _storage_run, (2, m, f"{out}/storage-two-{m}")) for m in STORAGE_CHOICES],
        ("estimate", measured_per_rank, (f"{out}/estimate",)),
        ("clipping", sharded_clipping, ()),
    ]
    resumed = [  # a fresh pair: what comes back, comes back from the checkpoints
        ("fallback-resumed", _fallback_on_two_ranks, (f"{out}/fallback-again", f"{out}/fallback-run/checkpoint-3")),
        ("plugin-resumed", _plugin_resume, (f"{out}/ckpt", True)),
        # the one process's checkpoint, resumed by 2 FSDP2 ranks
        ("unsharded-resumed", _across_layouts, (2, f"{out}/unsharded-two", f"{out}/unsharded-one/checkpoint-3")),
        *[(f"storage-resumed-{m}", _storage_run, (2, m, f"{out}/storage-re-{m}", f"{out}/storage-two-{m}/checkpoint-3"))
          for m in STORAGE_CHOICES],
    ]  # fmt: skip
    te = ("te", _te_into_sharded, (free_port(),))
    ports = [free_port(), free_port()]
    return scenario_results(
        out,
        [
            lambda: run_two_ranks(_pair, [(r, ports[0], out, straight) for r in (0, 1)]),
            lambda: run_ranks(_alone, [(out, alone, te)]),
            lambda: run_two_ranks(_pair, [(r, ports[1], out, resumed) for r in (0, 1)]),
        ],
    )


def _moe_trainer(rank: int, world: int, out: str) -> dict:
    """A tiny Qwen3-MoE under h100-fp8-current (rehearsed) through the Trainer, 4 steps on a global batch of 4: in
    one process, or on 2 FSDP2 ranks (2 rows each). What the rank saw: losses, how its experts are held, which
    experts modules compute in FP8, and the last log row's experts load and FP8 statistics."""
    from transformers import Trainer

    from hf_mixedprec.core import metrics as M
    from hf_mixedprec.fp8.experts import converted_experts
    from hf_mixedprec.integrations.recipe import resolve_recipe
    from tests.integrations.test_integration import Bytes
    from tests.moe import tiny_qwen3_moe

    model = tiny_qwen3_moe()
    dist = {"strategy": "fsdp2"} if world == 2 else {}
    health = {"fp8_sample_every": 2}
    recipe = resolve_recipe({"name": "moe", "extends": "h100-fp8-current", "distributed": dist, "health": health})
    recipe = recipe.rehearsed(True)
    args = recipe.training_args(
        output_dir=out, max_steps=4, per_device_train_batch_size=4 // world, report_to=[], use_cpu=True,
        save_strategy="no", logging_steps=2, disable_tqdm=True, learning_rate=1e-3, seed=0, data_seed=0,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=Bytes(n=16, seq_len=16), callbacks=recipe.callbacks())
    trainer.train()
    down = trainer.model.model.layers[0].mlp.experts.down_proj
    local = down.to_local() if hasattr(down, "to_local") else down
    rows = [r for r in trainer.state.log_history if "loss" in r]
    keys = [M.moe_module_key("model.layers.0.mlp.experts", "tokens"), M.MOE_LOAD_MAX,
            M.fp8_layer_key("model.layers.0.mlp.experts.down_proj", "sqnr_db")]  # fmt: skip
    return {
        "losses": [r["loss"] for r in rows],
        "fsdp": trainer.is_fsdp_enabled,
        "experts_shape": list(down.shape),
        "local_shape": list(local.shape),
        "converted": converted_experts(trainer.model),
        "last_row": {k: rows[-1].get(k) for k in keys},
    }


def _inf_on_one_rank(rank: int, out: str) -> list:
    """One of 2 gloo ranks training v100-fp16 (rehearsed) under FSDP2 for 5 steps; on rank 1 alone the backward of
    step 3 carries an inf. What the rank saw after every step."""
    from transformers import Trainer, TrainerCallback

    from hf_mixedprec.core.demo import tiny_llama
    from hf_mixedprec.integrations.recipe import resolve_recipe
    from hf_mixedprec.integrations.trainer import runtime_of
    from tests.integrations.test_integration import Bytes

    class InfOnRankOne(TrainerCallback):
        def __init__(self) -> None:
            self.armed, self.rows = False, []

        def on_train_begin(self, args, state, control, model=None, **kw):
            def grad_to_inf(module, inputs, output):
                if self.armed:
                    output.register_hook(lambda g: torch.full_like(g, float("inf")))

            model.model.layers[1].mlp.down_proj.register_forward_hook(grad_to_inf)

        def on_step_begin(self, args, state, control, **kw):
            self.armed = rank == 1 and state.global_step + 1 == 3

        def on_step_end(self, args, state, control, model=None, **kw):
            rt = runtime_of(trainer)
            local = sum(float(p.to_local().double().sum()) for p in model.parameters())  # this rank's shards
            scale = float(trainer.accelerator.scaler.get_scale())
            self.rows.append({"scale": scale, "skipped": float(rt.amp.skipped), "shards": local})

    recipe = resolve_recipe(
        {"name": "fp16-fsdp2", "extends": "v100-fp16", "distributed": {"strategy": "fsdp2"}}
    ).rehearsed(True)
    args = recipe.training_args(
        output_dir=f"{out}-run", max_steps=5, per_device_train_batch_size=2, report_to=[], use_cpu=True,
        save_strategy="no", logging_steps=1, disable_tqdm=True,
    )  # fmt: skip
    probe = InfOnRankOne()
    trainer = Trainer(
        model=tiny_llama(0), args=args, train_dataset=Bytes(n=40, seq_len=16), callbacks=[probe, *recipe.callbacks()]
    )
    assert trainer.is_fsdp_enabled
    trainer.train()
    return probe.rows


@pytest.mark.slow
def test_fp8_experts_train_sharded_along_the_experts_under_fsdp2_as_one_process_does(result):
    """MoE experts in FP8 on 2 FSDP2 ranks: each rank holds half of the experts (dim 0), both run every experts
    module in FP8, their losses follow the one process on the global batch (BOUNDS' FP8 tolerance), and the log rows
    hold the experts' load and FP8 statistics of the global batch, the same on both ranks."""
    one, ranks = result("moe-one"), [result("moe-two", r) for r in (0, 1)]
    converted = ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert not one["fsdp"] and one["converted"] == converted
    for got in ranks:
        assert got["fsdp"] and got["converted"] == converted
        assert got["experts_shape"] == [8, 64, 32] and got["local_shape"] == [4, 64, 32]
        assert got["last_row"] == ranks[0]["last_row"]
    tokens = one["last_row"]["mp/moe/model.layers.0.mlp.experts/tokens"]
    assert tokens == 2 * 4 * 16 * 2  # 2 steps since the last log, 4 rows of 16 tokens, top-2
    assert ranks[0]["last_row"]["mp/moe/model.layers.0.mlp.experts/tokens"] == tokens  # summed over the ranks
    assert all(v is not None for v in ranks[0]["last_row"].values())
    rel = BOUNDS["fp8-delayed"][1][1]
    for a, b in zip(one["losses"], ranks[0]["losses"], strict=True):
        assert abs(a - b) <= rel * abs(a), (one["losses"], ranks[0]["losses"])


@pytest.mark.slow
def test_an_inf_on_one_rank_makes_both_skip_the_same_step_with_equal_loss_scales(result):
    """FP16 under FSDP2: rank 1 alone back-propagates an inf at step 3. torch's GradScaler finds infs on the
    sharded gradients and reduces its found-inf over the ranks; both skip step 3 (their shards keep their
    values), both halve the scale, and both go on updating at steps 4 and 5."""
    ranks = [result("inf", r) for r in (0, 1)]
    for rows in ranks:
        assert [r["skipped"] for r in rows] == [0, 0, 1, 1, 1]
        assert rows[2]["scale"] == rows[1]["scale"] / 2 and rows[3]["scale"] == rows[2]["scale"]
        assert rows[2]["shards"] == rows[1]["shards"]  # step 3 changed no weight of this rank's shard
        assert rows[3]["shards"] != rows[2]["shards"] and rows[1]["shards"] != rows[0]["shards"]
    assert [r["scale"] for r in ranks[0]] == [r["scale"] for r in ranks[1]]


@pytest.mark.parametrize(
    ("recipe", "problem"),
    [
        ({"extends": "cpu-bf16", "distributed": {"strategy": "ddp", "fp8_all_gather": True}},
         "distributed.fp8_all_gather: only applies to strategy fsdp2 (strategy is 'ddp'); remove it"),
        ({"extends": "cpu-bf16", "distributed": {"strategy": "fsdp2", "fp8_all_gather": True}},
         "distributed.fp8_all_gather: needs fp8.backend torchao with torchao_recipe tensorwise (this recipe has no fp8 section)"),
        ({"extends": "h100-fp8-delayed", "distributed": {"strategy": "fsdp2", "fp8_all_gather": True}},
         "(this recipe has fp8.backend 'auto'):"),
        ({"extends": "h100-fp8-current", "fp8": {"backend": "torchao", "torchao_recipe": "rowwise", "format": "E4M3",
          "power_2_scales": True}, "distributed": {"strategy": "fsdp2", "fp8_all_gather": True}},
         "(this recipe has fp8.backend 'torchao', torchao_recipe 'rowwise'):"),
    ],
)  # fmt: skip
def test_fp8_all_gather_is_refused_where_torchao_cannot_do_it_naming_the_key(recipe, problem):
    from hf_mixedprec.integrations.recipe import RecipeError, resolve_recipe

    with pytest.raises(RecipeError) as err:
        resolve_recipe({"name": "x", **recipe})
    assert problem in str(err.value)
    ok = resolve_recipe(
        {"name": "x", "extends": "h100-fp8-current", "fp8": {"backend": "torchao"},
         "distributed": {"strategy": "fsdp2", "fp8_all_gather": True}}
    )  # fmt: skip
    assert ok.distributed.fp8_all_gather


def _raw_rows(rank: int | None) -> list:
    """Raw statistics rows of three operands (E4M3 at scale 1, so small values underflow and large ones clip), of
    the whole batch (``rank`` None) or of one rank's half of it."""
    from hf_mixedprec.scaling.fp8 import dequantize_fp8, quantize_fp8
    from hf_mixedprec.scaling.stats import raw_operand_stats

    g = torch.Generator().manual_seed(3)
    rows = []
    for spread in (1e-4, 1.0, 900.0):
        x = torch.randn(8, 64, generator=g) * torch.logspace(-9, 3, 64) * spread
        x[5, 7] = 3000.0 * spread  # the largest value lies in rank 1's half
        part = x if rank is None else x[rank * 4 : (rank + 1) * 4]
        q = quantize_fp8(part, 1.0, "e4m3")
        rows.append(raw_operand_stats(part, q.float(), dequantize_fp8(q, 1.0), "e4m3"))
    return rows


def _reduce_raw(rank: int) -> list:
    """This rank's raw statistics combined over the 2 ranks' process group."""
    from hf_mixedprec.fp8.stats import raw_over_ranks

    return raw_over_ranks(torch.stack(_raw_rows(rank))).tolist()


@pytest.mark.slow
def test_fp8_statistics_of_two_ranks_combine_into_the_global_batchs(result):
    """Every rank ends with the statistics one process measures on the whole batch: amax (the largest value is
    on rank 1 only), saturation, underflow and SQNR, equal on both ranks; one rank's own differ."""
    from hf_mixedprec.scaling.stats import finish_operand_stats

    got = [torch.tensor(result("raw", r), dtype=torch.float64) for r in (0, 1)]
    assert torch.allclose(got[0], got[1], rtol=0, atol=0, equal_nan=True)  # the same on both ranks
    whole = finish_operand_stats(torch.stack(_raw_rows(None)))
    combined = finish_operand_stats(got[0])
    assert torch.allclose(combined, whole, rtol=1e-6, equal_nan=True), (combined, whole)
    alone = finish_operand_stats(torch.stack(_raw_rows(0)))
    assert not torch.allclose(alone, whole, rtol=1e-3, equal_nan=True)
    assert (alone[:, 0] < whole[:, 0]).all()  # rank 0 alone never saw the largest value


def _across_layouts(rank: int, world: int, out: str, resume: str | None = None) -> dict:
    """v100-fp16 rehearsed (ZClip) with the Trainer for 6 steps on a global batch of 2, a checkpoint after step 3: in
    one process (unsharded: ``model.safetensors``, ``optimizer.pt``), or on 2 FSDP2 ranks resuming the one
    process's checkpoint. The losses, gradient norms and loss scales logged, the notes, the final weights' sums."""
    import os
    import shutil

    from transformers import Trainer

    from hf_mixedprec.core.demo import tiny_llama
    from hf_mixedprec.integrations.recipe import resolve_recipe
    from hf_mixedprec.integrations.trainer import runtime_of
    from tests.integrations.test_integration import Bytes

    distributed = {"strategy": "fsdp2"} if world == 2 else {"strategy": "none"}
    recipe = resolve_recipe(
        {"name": f"fp16-{world}", "extends": "v100-fp16", "clipping": {"method": "zclip", "warmup_steps": 2},
         "distributed": distributed}
    ).rehearsed(True)  # fmt: skip
    if resume is not None and rank == 0:  # the checkpoint copied into this run's folder, as a user resumes it
        os.makedirs(out, exist_ok=True)
        shutil.copytree(resume, f"{out}/checkpoint-3", dirs_exist_ok=True)
    args = recipe.training_args(
        output_dir=out, max_steps=6, per_device_train_batch_size=2 // world, report_to=[], use_cpu=True,
        save_strategy="steps", save_steps=3, logging_steps=1, disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = Trainer(
        model=tiny_llama(0), args=args, train_dataset=Bytes(n=40, seq_len=16), callbacks=recipe.callbacks()
    )
    trainer.train(resume_from_checkpoint=None if resume is None else f"{out}/checkpoint-3")
    rows = [h for h in trainer.state.log_history if "loss" in h]
    full = {n: float(p.full_tensor().double().sum()) if hasattr(p, "full_tensor") else float(p.double().sum())
            for n, p in trainer.model.named_parameters()}  # fmt: skip
    return {
        "loss": {int(h["step"]): h["loss"] for h in rows},
        "grad_norm": {int(h["step"]): h["grad_norm"] for h in rows},
        "notes": list(runtime_of(trainer).notes),
        "sums": full,
        "left": sorted(n for n in os.listdir(out) if n.startswith(".resume-")),
    }


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole of a tensor or DTensor (gloo gathers no int16: it travels as int32, which holds it exactly)."""
    if not hasattr(t, "full_tensor"):
        return t.detach()
    return t.to(torch.int32).full_tensor().to(t.dtype) if t.dtype == torch.int16 else t.detach().full_tensor()


def _masters(model: torch.nn.Module, optimizer: Any) -> dict:
    """Each parameter's FP32 master as the optimizer keeps it (weight + remainder, weight + compensation, or the
    weight), whole: its float64 sum and a digest of its bytes."""
    import hashlib

    from hf_mixedprec.storage.bits import combine_remainder

    opt = getattr(optimizer, "optimizer", optimizer)
    out = {}
    for name, p in model.named_parameters():
        st, w = opt.state.get(p, {}), _full(p)
        if "remainder" in st:
            w = combine_remainder(w, _full(st["remainder"]))
        elif "compensation" in st:
            w = w.float() + _full(st["compensation"]).float()
        w = w.float().contiguous()
        out[name] = [float(w.double().sum()), hashlib.sha1(w.numpy().tobytes()).hexdigest()]
    return out


def _storage_run(rank: int, world: int, choice: str, out: str, resume: str | None = None) -> dict:
    """a100-bf16 (rehearsed) with the storage ``choice`` (``master`` or ``master+states``, :data:`STORAGE_CHOICES`)
    through the Trainer for 5 steps on a global batch of 2: in one process, or on 2 FSDP2 ranks (a checkpoint after
    step 3, the straight run's only); or resuming ``resume``. The losses and gradient
    norms, the masters after step 3 (or, resumed, before its first step) and at the end, the weights' dtype and how
    the first weight's storage state is held on this rank, the notes."""
    from transformers import Trainer, TrainerCallback

    from hf_mixedprec.core.demo import tiny_llama
    from hf_mixedprec.integrations.recipe import resolve_recipe
    from hf_mixedprec.integrations.trainer import runtime_of
    from tests.integrations.test_integration import Bytes

    class Masters(TrainerCallback):
        def __init__(self) -> None:
            self.at: dict = {}

        def on_step_begin(self, args, state, control, model=None, optimizer=None, **kw):
            if resume is not None and "resumed" not in self.at:
                self.at["resumed"] = _masters(model, optimizer)

        def on_step_end(self, args, state, control, model=None, optimizer=None, **kw):
            if state.global_step == 3:
                self.at["step3"] = _masters(model, optimizer)

    distributed = {"strategy": "fsdp2"} if world == 2 else {"strategy": "none"}
    master, _, states = choice.partition("+")
    storage = {"master": master, "optimizer_states": states or "fp32"}
    recipe = resolve_recipe(
        {"name": f"{master}-{world}", "extends": "a100-bf16", "storage": storage, "distributed": distributed}
    ).rehearsed(True)
    saves = world == 2 and resume is None  # the checkpoint the others resume
    args = recipe.training_args(
        output_dir=out, max_steps=5, per_device_train_batch_size=2 // world, report_to=[], use_cpu=True,
        save_strategy="steps" if saves else "no", save_steps=3, logging_steps=1, disable_tqdm=True, seed=0,
    )  # fmt: skip
    seen = Masters()
    trainer = Trainer(
        model=tiny_llama(0), args=args, train_dataset=Bytes(n=40, seq_len=16), callbacks=[seen, *recipe.callbacks()]
    )
    trainer.train(resume_from_checkpoint=resume)
    rows = [h for h in trainer.state.log_history if "loss" in h]
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    weight = trainer.model.model.layers[0].mlp.up_proj.weight
    held = {k: [str(v.dtype), type(v).__name__, v.numel(), _local_numel(v)]
            for k, v in opt.state[weight].items() if k in ("remainder", "compensation", "exp_avg")}  # fmt: skip
    return {
        "loss": {int(h["step"]): h["loss"] for h in rows},
        "grad_norm": {int(h["step"]): h["grad_norm"] for h in rows},
        "optimizer": type(opt).__name__,
        "dtypes": sorted({str(p.dtype) for p in trainer.model.parameters() if p.requires_grad}),
        "weight": [type(weight).__name__, weight.numel(), _local_numel(weight)],
        "held": held,
        "masters": {**seen.at, "end": _masters(trainer.model, trainer.optimizer)},
        "notes": list(runtime_of(trainer).notes),
    }


def _local_numel(t: torch.Tensor) -> int:
    return (t.to_local() if hasattr(t, "to_local") else t).numel()


def _fallback_on_two_ranks(rank: int, out: str, resume: str | None = None) -> dict:
    """One of 2 gloo ranks training h100-fp8-delayed (rehearsed) under FSDP2 with the Trainer callback for 6 steps
    (logging every 2, FP8 sampled every step, a checkpoint after step 3), whose FP8 saturation detector moves a layer
    to BF16 (threshold 1e-4); or resuming from ``resume``. What the rank saw."""
    from transformers import Trainer, TrainerCallback

    from hf_mixedprec.core.demo import tiny_llama
    from hf_mixedprec.fp8.emulated import EmulatedFP8GEMM
    from hf_mixedprec.integrations.recipe import resolve_recipe
    from hf_mixedprec.integrations.trainer import runtime_of
    from tests.integrations.test_integration import Bytes

    class Shards(TrainerCallback):
        def __init__(self) -> None:
            self.rows: list = []

        def on_step_end(self, args, state, control, model=None, **kw):
            moved = list(runtime_of(trainer).reactions.moved_layers)
            local = {n: float(p.to_local().double().sum()) for n, p in model.named_parameters()}
            fp8 = sorted(n for n, m in model.named_modules() if isinstance(m, EmulatedFP8GEMM))
            self.rows.append({"moved": moved, "shards": local, "fp8": fp8})

    recipe = resolve_recipe(
        {"name": "fp8-fsdp2", "extends": "h100-fp8-delayed", "distributed": {"strategy": "fsdp2"},
         "health": {"fp8_sample_every": 1, "detectors": {"fp8_saturation": {"threshold": 1e-4, "reaction": "fallback"}}}}
    ).rehearsed(True)  # fmt: skip
    args = recipe.training_args(
        output_dir=f"{out}-run", max_steps=6, per_device_train_batch_size=2, report_to=[], use_cpu=True,
        save_strategy="steps", save_steps=3, logging_steps=2, disable_tqdm=True,
    )  # fmt: skip
    probe = Shards()
    trainer = Trainer(
        model=tiny_llama(0), args=args, train_dataset=Bytes(n=40, seq_len=16), callbacks=[*recipe.callbacks(), probe]
    )
    trainer.train(resume_from_checkpoint=resume)
    stop = runtime_of(trainer).reactions.stop_requested
    return {"rows": probe.rows, "steps": trainer.state.global_step, "stop": stop}


@pytest.mark.slow
def test_a_health_fallback_under_fsdp2_moves_the_same_layers_to_bf16_on_every_rank(result):
    """Under the Trainer callback every rank checks the combined FP8 statistics at the same steps, so a fallback
    moves the same layers to BF16 on both ranks, inside the sharded blocks, and the run goes on: the moved layers'
    shards keep being updated (FSDP2 now sets their gathered weights on the new BF16 module; before, the run died
    in the next forward). The checkpoint after step 3 comes after a sampled step that no log checked: its statistics
    are combined on every rank before the save (Trainer asks the callback for its state on rank 0 only; the
    collective there hung). Resumed from it, the model gets the moved layers back before Distributed Checkpoint
    loads it (a model with every layer in FP8 has keys that checkpoint lacks) and ends on the straight run's shards
    bit for bit."""
    ranks = [result("fallback", r) for r in (0, 1)]
    resumed = [result("fallback-resumed", r) for r in (0, 1)]
    for seen in ranks:
        assert seen["steps"] == 6 and seen["stop"] is None
    moved = ranks[0]["rows"][-1]["moved"]
    assert moved and [r["moved"] for r in ranks[0]["rows"]] == [r["moved"] for r in ranks[1]["rows"]]
    first = next(i for i, r in enumerate(ranks[0]["rows"]) if r["moved"])
    assert first < 2, "the fallback came after the checkpoint: its resume would not need the moved layers"
    for seen in ranks:
        rows = seen["rows"]
        assert not set(moved) & set(rows[-1]["fp8"])  # no longer FP8 layers
        for layer in moved:
            w = f"{layer}.weight"
            assert all(rows[i]["shards"][w] != rows[i + 1]["shards"][w] for i in range(first, 5)), layer
    for straight, seen in zip(ranks, resumed, strict=True):
        assert seen["steps"] == 6 and len(seen["rows"]) == 3  # steps 4-6
        assert seen["rows"][-1]["moved"] == moved and seen["rows"][-1]["fp8"] == straight["rows"][-1]["fp8"]
        assert seen["rows"][-1]["shards"] == straight["rows"][-1]["shards"]


def test_a_health_fallback_under_fsdp2_stops_where_the_ranks_may_decide_differently():
    """A loop of one's own may check on rank 0 alone: moving layers on one rank would leave the ranks' FP8 amax
    reductions unmatched, so under FSDP2 there the fallback asks to stop (the integration saves a checkpoint
    first) and names what to resume with; nothing moves."""
    from hf_mixedprec.core.demo import tiny_llama
    from hf_mixedprec.integrations.recipe import load_recipe
    from hf_mixedprec.training.health import HealthEvent
    from hf_mixedprec.training.runtime import MixedPrecisionRuntime

    recipe = load_recipe("h100-fp8-delayed", rehearse=True)
    rt = MixedPrecisionRuntime(recipe, rehearse=True)
    model = tiny_llama(0)
    rt.convert_model(model)
    layer = "model.layers.0.mlp.down_proj"
    before = type(model.get_submodule(layer))
    event = HealthEvent(3, "fp8_saturation", "fallback", 0.2, 0.01, "20% of the input saturates", layer=layer)
    rt.reactions.sharded = True
    rt.reactions.apply([event], model, step=3)
    assert rt.reactions.moved_layers == [] and type(model.get_submodule(layer)) is before
    assert "only under FSDP2 without distributed.fp8_all_gather, where every rank checks" in rt.reactions.stop_requested
    assert f"resume it with {layer} kept in BF16" in rt.reactions.stop_requested
    rt.reactions.sharded, rt.reactions.stop_requested = False, None  # one process: the layer moves as before
    rt.reactions.apply([event], model, step=3)
    assert rt.reactions.moved_layers == [layer] and type(model.get_submodule(layer)) is not before


def _plugin_loop(rank: int, world: int, base: str) -> dict:
    """A training loop of one's own on ``recipe.accelerator()``: 4 steps on the same global batches of 4 rows, in
    one process or split over 2 ranks (``world``), with the recipe's FSDP2 strategy."""
    from hf_mixedprec.core.demo import tiny_llama
    from hf_mixedprec.fp8.emulated import EmulatedFP8GEMM
    from hf_mixedprec.integrations.recipe import resolve_recipe

    base, _, master = base.partition("+")  # base+master: that storage.master
    recipe = resolve_recipe(
        {"name": f"{base}-fsdp2", "extends": base, "clipping": {"method": "zclip", "warmup_steps": 2},
         "distributed": {"strategy": "fsdp2"}, "storage": {"master": master or "fp32"}}
    )  # fmt: skip
    acc = (recipe.rehearsed(True) if base != "cpu-bf16" else recipe).accelerator(cpu=True)
    torch.manual_seed(0)
    model = tiny_llama(0)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(4):
        x = torch.randint(0, 100, (4, 16), generator=g)
        x = x if world == 1 else x[rank * 2 : (rank + 1) * 2]
        loss = model(input_ids=x, labels=x).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        rows.append({**acc.mp_metrics(), "loss": float(acc.reduce(loss.detach(), "mean"))})  # every rank checks
    seen = {
        "distributed": str(acc.distributed_type),
        "sharded": all(hasattr(p, "to_local") for p in model.parameters()),
        "fp8_layers": sum(isinstance(m, EmulatedFP8GEMM) for m in model.modules()),
        "optimizer": type(getattr(opt, "optimizer", opt)).__name__,
        "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "notes": acc.mp.notes,
        "rows": rows,
    }
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("base", PLUGIN_BASES)
def test_a_loop_of_ones_own_on_the_accelerate_plugin_shards_with_fsdp2_as_the_trainer_does(base, result):
    """``recipe.accelerator()`` under a recipe with strategy fsdp2 on 2 CPU ranks shards for real (Accelerate alone
    would train as DDP there), converts the FP8 layers before sharding, autocasts, and trains as one process does on
    the same global batches (bounds and their reasons: see the Trainer comparison above)."""
    a, b = result(f"plugin-one-{base}"), result(f"plugin-two-{base}")
    assert b["distributed"] == "DistributedType.FSDP" and b["sharded"] and not a["sharded"]
    assert any(n.startswith("FSDP2 on 2 CPU processes (gloo)") for n in b["notes"])
    assert any("autocast installed by hf_mixedprec (FSDP2 on CPU)" in n for n in b["notes"])
    assert a["fp8_layers"] == b["fp8_layers"] and (a["fp8_layers"] > 0) == base.startswith("h100")  # 14 Linears
    # a BF16 master: the user's AdamW becomes StorageAdamW over the sharded BF16 weights, as in one process
    remainder = base.endswith("+bf16_remainder")
    assert a["optimizer"] == b["optimizer"] == ("StorageAdamW" if remainder else "AdamW")
    assert a["dtypes"] == b["dtypes"] == (["torch.bfloat16"] if remainder else ["torch.float32"])
    kind = "fp8-delayed" if base.startswith("h100") else "bf16"
    (loss_rel, norm_rel, _), _ = BOUNDS[kind]
    for step, (r1, r2) in enumerate(zip(a["rows"], b["rows"], strict=True), start=1):
        assert r2["loss"] == pytest.approx(r1["loss"], rel=loss_rel), step
        assert r2["mp/grad_norm"] == pytest.approx(r1["mp/grad_norm"], rel=norm_rel), step
        assert r2["mp/clipped"] == r1["mp/clipped"], step


def _te_into_sharded(rank: int, port: int) -> str:
    """In a process group of one: what ``refuse_sharded`` says of a model ``fully_shard`` sharded."""
    join_as_rank(rank, 1, port)
    from torch.distributed.fsdp import fully_shard

    from hf_mixedprec.core.demo import tiny_llama
    from hf_mixedprec.fp8.transformer_engine import refuse_sharded

    model = tiny_llama(0)
    refuse_sharded(model)  # not sharded: nothing to refuse
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    try:
        refuse_sharded(model)
        return "accepted"
    except RuntimeError as exc:
        return str(exc)


@pytest.mark.slow
def test_transformer_engine_layers_are_refused_into_a_model_fsdp2_has_sharded(result):
    """A phase entering FP8 under fsdp2 whose ``fp8.backend: auto`` resolves to Transformer Engine (installed on that
    GPU) is refused in one sentence before any layer moves: TE layers own new parameters, which the sharded model and
    optimizer have never seen (an explicit transformer_engine phase is refused by the schema already)."""
    assert result("te").startswith("fp8.backend transformer_engine cannot convert a model FSDP2 has already sharded")


def _policy_loop(rank: int, param_dtype: str, reduce_dtype: str) -> dict:
    """2 ranks of a cpu-bf16 loop on ``recipe.accelerator()`` under FSDP2 with the recipe's gather and reduce dtypes:
    the dtypes FSDP2's all-gathers and reduce-scatters carried, and the losses."""
    import torch.distributed as dist

    carried: dict[str, set[str]] = {"all_gather": set(), "reduce_scatter": set()}
    reals = {name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single")}
    for name, key in (("all_gather_single", "all_gather"), ("reduce_scatter_single", "reduce_scatter")):

        def spy(output, input, *a, _real=reals[name], _key=key, **k):
            carried[_key].add(str(input.dtype))
            return _real(output, input, *a, **k)

        setattr(dist, name, spy)
    try:
        return _policy_steps(rank, param_dtype, reduce_dtype, carried)
    finally:
        for name, real in reals.items():  # the next scenario in this process collects as usual
            setattr(dist, name, real)


def _policy_steps(rank: int, param_dtype: str, reduce_dtype: str, carried: dict[str, set[str]]) -> dict:
    from hf_mixedprec.core.demo import tiny_llama
    from hf_mixedprec.integrations.recipe import resolve_recipe

    recipe = resolve_recipe(
        {"name": "bf16-fsdp2", "extends": "cpu-bf16",
         "distributed": {"strategy": "fsdp2", "param_dtype": param_dtype, "reduce_dtype": reduce_dtype}}
    )  # fmt: skip
    acc = recipe.accelerator(cpu=True)
    model = tiny_llama(0)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x = torch.randint(0, 100, (4, 16), generator=g)[rank * 2 : (rank + 1) * 2]
        loss = model(input_ids=x, labels=x).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(acc.reduce(loss.detach(), "mean")))
    stored = sorted({str(p.dtype) for p in model.parameters()})
    seen = {k: sorted(v) for k, v in carried.items()}
    return {"carried": seen, "losses": losses, "stored": stored, "notes": acc.mp.notes}


@pytest.mark.slow
def test_fsdp2_gathers_and_reduces_in_the_dtypes_the_recipe_names(result):
    """``distributed.param_dtype`` / ``reduce_dtype`` become FSDP2's MixedPrecisionPolicy: by default the FP32 shards
    are gathered as stored and gradients reduced in FP32 (the one-process math); with bf16/bf16 both collectives
    carry BF16 (half the bytes) while the shards, the master, stay FP32, and training stays close to the default
    (norm weights then enter the forward in BF16 too)."""
    default, half = result("policy-auto-fp32"), result("policy-bf16-bf16")
    assert default["carried"] == {"all_gather": ["torch.float32"], "reduce_scatter": ["torch.float32"]}
    assert half["carried"] == {"all_gather": ["torch.bfloat16"], "reduce_scatter": ["torch.bfloat16"]}
    assert default["stored"] == half["stored"] == ["torch.float32"]
    assert any("weights all-gathered as stored, gradients reduced in fp32" in n for n in default["notes"])
    assert any("weights all-gathered in bf16, gradients reduced in bf16" in n for n in half["notes"])
    assert half["losses"][0] == pytest.approx(default["losses"][0], rel=5e-3)
    assert half["losses"] != default["losses"]  # the policy changed the math: it is in effect
    assert half["losses"] == pytest.approx(default["losses"], rel=2e-2)


def _plugin_resume(rank: int, ckpt: str, resume: bool) -> dict:
    """2 ranks of a loop of one's own on ``recipe.accelerator()`` under FSDP2 (v100-fp16 rehearsed, ZClip): 6 steps
    straight with ``save_state`` after step 3, or ``load_state`` of that checkpoint then steps 4-6. The losses and
    metrics of the steps it ran, and the sum of the rank's shards at the end."""
    from hf_mixedprec.core.demo import tiny_llama
    from hf_mixedprec.integrations.recipe import resolve_recipe

    recipe = resolve_recipe(
        {"name": "fp16-fsdp2", "extends": "v100-fp16", "clipping": {"method": "zclip", "warmup_steps": 2},
         "distributed": {"strategy": "fsdp2"}}
    ).rehearsed(True)  # fmt: skip
    acc = recipe.accelerator(cpu=True)
    model = tiny_llama(0)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 100, (4, 16), generator=g)[rank * 2 : (rank + 1) * 2] for _ in range(6)]
    start = 3 if resume else 0
    if resume:
        acc.load_state(ckpt)
    rows = []
    for i in range(start, 6):
        loss = model(input_ids=batches[i], labels=batches[i]).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        rows.append({**acc.mp_metrics(), "loss": float(acc.reduce(loss.detach(), "mean"))})
        if i == 2 and not resume:
            acc.save_state(ckpt)
    local = sum(float(p.to_local().double().sum()) for p in model.parameters())
    return {"rows": rows, "shards": local}


@pytest.mark.slow
def test_a_loop_of_ones_own_resumes_from_a_sharded_save_state_to_the_straight_run(result):
    """``accelerator.save_state`` under FSDP2 writes the sharded model and optimizer (Distributed Checkpoint) with
    our state beside them (loss scaler, clipper, detector windows); ``load_state`` in a fresh pair of ranks brings
    all of it back, and steps 4-6 equal the straight run's bit for bit (losses, norms, thresholds, loss scale, the
    shards)."""
    a, b = result("plugin-resume"), result("plugin-resumed")
    assert len(a["rows"]) == 6 and len(b["rows"]) == 3
    assert {"mp/loss_scale", "mp/clip_threshold", "mp/grad_norm"} <= set(a["rows"][-1]), sorted(a["rows"][-1])
    assert b["rows"] == a["rows"][3:]
    assert b["shards"] == a["shards"]


@pytest.mark.slow
def test_a_one_process_checkpoint_resumes_on_two_fsdp2_ranks_sharded_on_load(result):
    """The one process's step-3 checkpoint (``model.safetensors``, ``optimizer.pt``) resumed by 2 FSDP2 ranks on the
    same global batches: written again as Distributed Checkpoints of whole tensors in a hidden folder of the run's
    output dir, which each rank's load cuts into its shards (a note says so, the folder is gone at the end), and the
    run goes on as the one process did: steps 1-3 are the checkpoint's history, step 4's loss on the restored weights
    is the one process's to 1e-5 (summation order only), steps 4-6 within the FSDP2-against-one-process bounds, and
    so are the final weights (their sums per tensor). Leaving the optimizer state out moved step 5's loss by 1.3%."""
    (loss_rel, norm_rel, _), _ = BOUNDS["fp16"]

    def steps(run: dict) -> dict:  # JSON keys are text
        return {**run, **{k: {int(s): v for s, v in run[k].items()} for k in ("loss", "grad_norm")}}

    one = steps(result("unsharded-one"))
    for rank in (0, 1):
        two = steps(result("unsharded-resumed", rank))
        assert any("written by an unsharded run; this run shards with FSDP" in n for n in two["notes"]), two["notes"]
        assert two["left"] == []
        assert sorted(two["loss"]) == sorted(one["loss"]) == list(range(1, 7))
        assert all(two["loss"][s] == one["loss"][s] for s in (1, 2, 3))
        assert two["loss"][4] == pytest.approx(one["loss"][4], rel=1e-5)
        for step in (4, 5, 6):
            assert two["loss"][step] == pytest.approx(one["loss"][step], rel=loss_rel), step
            assert two["grad_norm"][step] == pytest.approx(one["grad_norm"][step], rel=norm_rel), step
        assert two["sums"].keys() == one["sums"].keys()
        for name, total in one["sums"].items():
            assert two["sums"][name] == pytest.approx(total, rel=1e-3, abs=1e-2), name


def _steps(run: dict) -> dict:
    """A scenario's result with its per-step series keyed by int (JSON keys are text)."""
    return {**run, **{k: {int(s): v for s, v in run[k].items()} for k in ("loss", "grad_norm")}}


@pytest.mark.slow
@pytest.mark.parametrize("choice", STORAGE_CHOICES)
def test_a_storage_choice_trains_on_two_fsdp2_ranks_as_one_process_does(choice, result):
    """BF16 masters (remainder, Kahan, stochastic rounding, none), BF16 optimizer states and torchao's 8-bit states on
    2 FSDP2 ranks (a100-bf16, the Trainer, a global batch of 2) against one process: the weights stay in the storage dtype (a BF16
    master's are not upcast by Accelerate, and a note says so), each rank holds half of every weight, of its moments
    and of its remainder or compensation (DTensor shards that StorageAdamW updates locally), and the losses, gradient
    norms and FP32 masters follow the one process within what a 2-rank reduction allows: BF16 gradients reduced over
    2 ranks round differently from one process's (and a rank's shard draws its own stochastic rounding), so losses
    agree to 5e-4 and norms to 1e-2 (the FSDP2-against-one-process bounds of tests/integrations/test_fsdp2.py), the
    masters' sums to 1e-4 (stochastic rounding: see below)."""
    (loss_rel, norm_rel, _), _ = BOUNDS["bf16"]
    master, _, states = choice.partition("+")
    one = _steps(result(f"storage-one-{choice}"))
    dtype = "torch.float32" if master == "fp32" else "torch.bfloat16"
    optimizer = "AdamW8bit" if states == "8bit" else "StorageAdamW"
    assert one["optimizer"] == optimizer and one["dtypes"] == [dtype]
    key = {"bf16_remainder": "remainder", "bf16_kahan": "compensation"}.get(master)
    shards = ["DTensor", 64 * 32 * 4, 64 * 32 * 2]  # up_proj [128, 64]: half on each rank
    for rank in (0, 1):
        two = _steps(result(f"storage-two-{choice}", rank))
        assert two["optimizer"] == optimizer and two["dtypes"] == [dtype], two["dtypes"]
        assert any("mixed_precision 'bf16' made 'no'" in n for n in two["notes"]) == (master != "fp32"), two["notes"]
        assert two["weight"] == shards
        assert sorted(two["held"]) == sorted(["exp_avg", *([key] if key else [])])
        # torchao's 8-bit state reports the dtype it stands for
        moments = "torch.bfloat16" if states == "bf16" else "torch.float32"
        assert two["held"]["exp_avg"] == [moments, *shards], two["held"]
        if key:
            assert two["held"][key][1:] == shards
        assert sorted(two["loss"]) == sorted(one["loss"]) == list(range(1, 6))
        assert two["loss"][1] == pytest.approx(one["loss"][1], rel=1e-5)
        for step in range(1, 6):
            assert two["loss"][step] == pytest.approx(one["loss"][step], rel=loss_rel), step
            assert two["grad_norm"][step] == pytest.approx(one["grad_norm"][step], rel=norm_rel), step
        # stochastic rounding: the two layouts draw independently, so each element may round to the other BF16
        # neighbour at each step and a tensor's sum walks by about sqrt(elements * steps) * ulp / 2 (2e-2 for the
        # 16,384 embedding weights, ulp 2**-13, over 5 steps): 0.1 is five times that
        tol = {"rel": 1e-4, "abs": 0.1 if master == "bf16_stochastic" else 1e-3}
        for name, (total, _digest) in one["masters"]["end"].items():
            assert two["masters"]["end"][name][0] == pytest.approx(total, **tol), name
        assert two["masters"]["end"] == result(f"storage-two-{choice}", 0)["masters"]["end"]  # whole: alike


@pytest.mark.slow
@pytest.mark.parametrize("choice", STORAGE_CHOICES)
def test_a_storage_choice_resumed_mid_run_on_two_fsdp2_ranks_ends_bit_for_bit_on_the_straight_run(choice, result):
    """A fresh pair of ranks resumes the straight run's step-3 Distributed Checkpoint: the weights, their moments and
    their remainders or compensations come back shard by shard (the optimizer state keyed by parameter name; a first
    step at lr 0 that Distributed Checkpoint runs to build the state leaves the weights as they were), stochastic
    rounding draws on from the step count the parameter groups carry, and steps 4-5 and every master at the end are
    the straight run's bit for bit."""
    straight = _steps(result(f"storage-two-{choice}"))
    for rank in (0, 1):
        again = _steps(result(f"storage-resumed-{choice}", rank))
        assert again["masters"]["resumed"] == straight["masters"]["step3"]
        assert {s: again["loss"][s] for s in (4, 5)} == {s: straight["loss"][s] for s in (4, 5)}
        assert {s: again["grad_norm"][s] for s in (4, 5)} == {s: straight["grad_norm"][s] for s in (4, 5)}
        assert again["masters"]["end"] == straight["masters"]["end"]


@pytest.mark.slow
def test_a_remainder_master_from_two_fsdp2_ranks_resumes_in_one_process_as_the_same_fp32_master(result):
    """The 2 ranks' bf16_remainder checkpoint after step 3, gathered whole for one process (Distributed Checkpoint
    resharding): before its first step, every parameter's FP32 master (BF16 weight + int16 remainder) is the one the
    2 ranks held after step 3, bit for bit, and it trains on to step 5."""
    two = result("storage-two-bf16_remainder")
    one = _steps(result("storage-one-from-two"))
    assert any("written sharded by 2 FSDP rank(s)" in n for n in one["notes"]), one["notes"]
    assert one["masters"]["resumed"] == two["masters"]["step3"]
    assert sorted(one["loss"]) == list(range(1, 6))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ESTIMATE_RECIPES)
def test_fsdp2_estimate_per_rank_matches_what_each_rank_holds(recipe, result):
    """``estimate`` for 2 FSDP2 ranks against what each rank held in a real sharded Trainer step
    (tests/fsdp2_estimate.py says what is compared, and to what tolerance)."""
    check_estimate_per_rank([result("estimate", r) for r in (0, 1)], recipe)


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))
def test_two_sharded_ranks_clip_as_one_process_on_the_global_batch(method, result):
    """Each clipping method on FSDP2-sharded gradients against one process on the global batch
    (tests/integrations/test_fsdp2_clipping.py says to what tolerance)."""
    check_clipping_as_one_process(result("clipping"), method)


@pytest.mark.slow
def test_the_global_norm_of_shards_costs_one_all_reduce_and_no_gather(result):
    check_one_all_reduce_and_no_gather(result("clipping"))
