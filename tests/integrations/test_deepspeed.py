"""DeepSpeed ZeRO-1 FP16 (dynamic loss scale) through a plain ``transformers.Trainer`` on CPU, and
``read_deepspeed_scaler`` checked against DeepSpeed's own engine and scaler state.

The runs happen in one subprocess (this file run as a script): a DeepSpeed Trainer leaves process-wide state
behind (torch.distributed group, Accelerate's ``AcceleratorState`` singleton and ``ACCELERATE_USE_DEEPSPEED``,
DeepSpeed's global accelerator), and a plain Trainer built later in the same process silently runs through
DeepSpeed. The tests assert on the JSON the subprocess writes.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

INIT = 2.0**16  # DeepSpeed initial_scale_power 16 (the v100-fp16 recipe's init_scale)


# --- the subprocess side --------------------------------------------------------------------------------------------


def _scenarios() -> dict[str, Any]:  # pragma: no cover - runs in the subprocess
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from hf_mixedprec.core.demo import builtin_text, byte_batches, tiny_llama
    from hf_mixedprec.integrations.deepspeed import deepspeed_config, read_deepspeed_scaler
    from hf_mixedprec.integrations.recipe import load_recipe_file
    from hf_mixedprec.integrations.trainer import runtime_of
    from tests.deepspeed_cpu import deepspeed_cpu_env, install_deepspeed_cpu_accelerator

    os.environ.update(deepspeed_cpu_env())
    from deepspeed.accelerator import get_accelerator

    # DeepSpeed's own CPU accelerator (DS_ACCELERATOR=cpu), asked before the test one below replaces it
    fp16_supported = bool(get_accelerator().is_fp16_supported())
    install_deepspeed_cpu_accelerator()

    rows = [r for b in byte_batches(builtin_text(40_000), seq_len=64, batch_size=4, n_batches=12) for r in b]

    class Rows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(rows)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": rows[i], "labels": rows[i]}

    class Probe(TrainerCallback):
        """Poisons lm_head's gradient with inf on chosen steps; reads the scaler after every step."""

        def __init__(self, inject: set[int]) -> None:
            self.inject, self.handle, self.trainer, self.records = inject, None, None, []
            self.initial: dict[str, Any] | None = None

        def on_train_begin(self, args, state, control, optimizer=None, **kw):
            self.initial = read_deepspeed_scaler(optimizer)

        def on_step_begin(self, args, state, control, model=None, **kw):
            self.weight_before = model.lm_head.weight.detach().float().clone()
            if state.global_step in self.inject:
                self.handle = model.lm_head.weight.register_hook(lambda g: torch.full_like(g, math.inf))

        def on_step_end(self, args, state, control, model=None, optimizer=None, **kw):
            if self.handle is not None:
                self.handle.remove()
                self.handle = None
            engine = self.trainer.model_wrapped
            zero = engine.optimizer
            self.records.append(
                {
                    "step": state.global_step - 1,
                    "from_optimizer": read_deepspeed_scaler(optimizer),
                    "from_engine": read_deepspeed_scaler(engine),
                    "from_zero_optimizer": read_deepspeed_scaler(zero),
                    "from_scaler": read_deepspeed_scaler(zero.loss_scaler),
                    # DeepSpeed's and Accelerate's own views
                    "ds_cur_scale": float(zero.cur_scale),
                    "ds_loss_scaler_cur_scale": float(zero.loss_scaler.cur_scale),
                    "ds_cur_hysteresis": getattr(zero.loss_scaler, "cur_hysteresis", None),
                    "ds_overflow": bool(zero.overflow),
                    "ds_grad_norm": float(engine.get_global_grad_norm() or 0.0),
                    "ds_skipped_steps": int(engine.skipped_steps),
                    "ds_global_steps": int(engine.global_steps),
                    "accelerate_step_was_skipped": bool(optimizer.step_was_skipped),
                    "weight_unchanged": bool(torch.equal(self.weight_before, model.lm_head.weight.detach().float())),
                }
            )

    def run(
        cfg: dict[str, Any],
        *,
        steps: int,
        inject: set[int] = frozenset(),
        bf16: bool = False,
        fp32: bool = False,
        extra: Any = (),
    ) -> dict[str, Any]:
        probe = Probe(set(inject))
        args = TrainingArguments(
            output_dir=os.environ["DS_TEST_OUT"],
            deepspeed=cfg,
            fp16=not (bf16 or fp32),
            bf16=bf16,
            use_cpu=True,
            max_steps=steps,
            per_device_train_batch_size=4,
            learning_rate=2e-3,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
        )
        trainer = Trainer(model=tiny_llama(), args=args, train_dataset=Rows(), callbacks=[probe, *extra])
        probe.trainer = trainer
        trainer.train()
        engine = trainer.model_wrapped
        return {
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "grad_norms": [h.get("grad_norm") for h in trainer.state.log_history if "loss" in h],
            "initial": probe.initial,
            "records": probe.records,
            "engine": type(engine).__name__,
            "zero_optimizer": type(engine.optimizer).__name__,
            "base_optimizer": type(engine.optimizer.optimizer).__name__,
            "callback_optimizer": type(trainer.optimizer).__name__,
            "param_dtype": str(next(engine.module.parameters()).dtype),
            "master_dtype": str(
                getattr(engine.optimizer, "single_partition_of_fp32_groups", [torch.zeros(())])[0].dtype
            ),
            "state_dtypes": sorted(
                {str(v.dtype) for st in engine.optimizer.optimizer.state.values() for v in st.values() if v.dim()}
            ),
            "device": str(engine.device),
            "zero_stage": int(engine.zero_optimization_stage()),
            "after_train": read_deepspeed_scaler(trainer.optimizer),
            "torch_optimizer": read_deepspeed_scaler(engine.optimizer.optimizer),
            "mp_events": list(getattr(runtime_of(trainer), "events", [])),
            "mp_logs": [
                {k: v for k, v in h.items() if k.startswith("mp/") or k == "step"}
                for h in trainer.state.log_history
                if any(k.startswith("mp/") for k in h)
            ],
        }

    fp16_cfg, notes = deepspeed_config(load_recipe_file("v100-fp16"), zero_stage=1)
    out: dict[str, Any] = {"config": fp16_cfg, "notes": notes, "ds_cpu_fp16_supported": fp16_supported}
    out["clean"] = run(fp16_cfg, steps=12)
    out["overflow_h1"] = run(fp16_cfg, steps=8, inject={4})
    # the same run with the recipe's one-line callbacks: they must read DeepSpeed's scaler into the logs

    from hf_mixedprec.integrations.recipe import resolve_recipe

    recipe = resolve_recipe(
        {"name": "ds-drill", "extends": "v100-fp16", "health": {"detectors": {"consecutive_skips": {"threshold": 1}}}}
    ).rehearsed()
    out["with_recipe_callbacks"] = run(fp16_cfg, steps=8, inject={4}, extra=recipe.callbacks())
    h2 = json.loads(json.dumps(fp16_cfg))
    h2["fp16"]["hysteresis"] = 2
    out["overflow_h2"] = run(h2, steps=8, inject={2, 3})
    bf16_cfg, _ = deepspeed_config(load_recipe_file("v100-fp16"), zero_stage=1)
    bf16_cfg["fp16"], bf16_cfg["bf16"] = {"enabled": False}, {"enabled": True}
    out["bf16"] = run(bf16_cfg, steps=2, bf16=True)
    # storage: master none + bf16 optimizer states -> DeepSpeed's bf16 master/optimizer-state keys
    low = resolve_recipe(
        {
            "name": "ds-bf16-storage",
            "extends": "a100-bf16",
            "storage": {"master": "none", "optimizer_states": "bf16"},
            "distributed": {"strategy": "deepspeed", "zero_stage": 1},
        }
    )
    low_cfg, _ = deepspeed_config(low)
    out["bf16_storage_config"] = low_cfg["bf16"]
    out["bf16_storage"] = run(low_cfg, steps=2, bf16=True)
    out["bf16_default_zero1"] = run(
        deepspeed_config(resolve_recipe({**low.to_dict(), "storage": {}}))[0], steps=2, bf16=True
    )

    # an fp32 recipe's callbacks under Trainer(deepspeed=...): accepted, as under `launch`
    fp32 = resolve_recipe({"name": "ds-fp32", "extends": "cpu-bf16", "precision": "fp32"})
    out["fp32_with_recipe_callbacks"] = run(
        deepspeed_config(fp32, zero_stage=1)[0], steps=2, fp32=True, extra=fp32.callbacks()
    )

    # DeepSpeed's scaler on its own (needs the process group the runs above initialised)
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    scaler = DynamicLossScaler(
        init_scale=4.0, scale_window=2, min_scale=1.0, delayed_shift=2, consecutive_hysteresis=False
    )
    seq: list[Any] = []
    for overflow in [True, True, False, False, False, True, True, True, True]:
        try:
            scaler.update_scale(overflow)
            seq.append(read_deepspeed_scaler(scaler))
        except Exception as e:  # DeepSpeed raises a bare Exception at the minimum
            seq.append(str(e))
    out["scaler_unit"] = seq
    return out


if __name__ == "__main__":  # pragma: no cover
    result = _scenarios()
    Path(sys.argv[1]).write_text(json.dumps(result))
    sys.exit(0)


# --- the tests ------------------------------------------------------------------------------------------------------

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("deepspeed")
    out = tmp / "runs.json"
    env = {**os.environ, "DS_TEST_OUT": str(tmp / "trainer"), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return json.loads(out.read_text())


def test_config_is_zero1_fp16_dynamic(runs: dict[str, Any]) -> None:
    cfg = runs["config"]
    assert cfg["zero_optimization"] == {"stage": 1}
    assert cfg["fp16"] == {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 16,
        "loss_scale_window": 2000,
        "hysteresis": 1,
        "min_loss_scale": 1.0,
    }
    assert not any("FALLBACK" in n for n in runs["notes"])  # ZeRO-1: zclip decides DeepSpeed's clipping
    assert cfg["gradient_clipping"] == 1.0  # > 0, so DeepSpeed clips; the threshold comes from the clipper


@pytest.mark.parametrize(
    ("method", "stage", "why"),
    [("zclip", 0, "ZeRO stage 0 clips with torch's clip_grad_norm_"), ("agc", 2, "AGC clips each weight row")],
)
def test_deepspeed_config_says_where_adaptive_clipping_falls_back(method: str, stage: int, why: str) -> None:
    from hf_mixedprec.integrations.deepspeed import deepspeed_config
    from hf_mixedprec.integrations.recipe import resolve_recipe

    recipe = resolve_recipe(
        {"name": "c", "extends": "cpu-bf16", "clipping": {"method": method},
         "distributed": {"strategy": "deepspeed", "zero_stage": stage}}
    )  # fmt: skip
    cfg, notes = deepspeed_config(recipe)
    assert [n for n in notes if n.startswith("FALLBACK")] == [
        next(n for n in notes if why in n and "using a fixed gradient_clipping of 1" in n)
    ]
    assert cfg["gradient_clipping"] == 1.0


def test_trainer_runs_zero1_fp16_on_cpu(runs: dict[str, Any]) -> None:
    run = runs["clean"]
    assert run["engine"] == "DeepSpeedEngine"
    assert run["zero_stage"] == 1
    assert run["zero_optimizer"] == "DeepSpeedZeroOptimizer"
    assert run["base_optimizer"] == "AdamW"  # Trainer's own torch AdamW; no DeepSpeed CPU op needed
    assert run["callback_optimizer"] == "DeepSpeedOptimizerWrapper"
    assert run["param_dtype"] == "torch.float16" and run["device"] == "cpu"
    losses = run["losses"]
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses)
    assert losses[0] > 5.0  # ~ln(256) for a fresh byte-level model
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3
    assert all(g is not None and math.isfinite(g) for g in run["grad_norms"])


def test_scaler_clean_run_matches_engine(runs: dict[str, Any]) -> None:
    run = runs["clean"]
    expected = {"loss_scale": INIT, "overflow": False, "skipped_steps": None, "hysteresis": 1, "dynamic": True}
    assert run["initial"] == expected
    assert run["after_train"] == expected
    assert [r["step"] for r in run["records"]] == list(range(12))
    for r in run["records"]:
        assert r["from_optimizer"] == expected
        assert r["from_zero_optimizer"] == expected
        assert r["from_engine"] == {**expected, "skipped_steps": 0}
        assert r["ds_cur_scale"] == r["ds_loss_scaler_cur_scale"] == INIT
        assert r["ds_skipped_steps"] == 0 and not r["accelerate_step_was_skipped"]
        assert not r["weight_unchanged"]
    assert run["torch_optimizer"] is None  # the torch AdamW under ZeRO has no scaler


def _check_consistent(r: dict[str, Any]) -> None:
    opt, eng = r["from_optimizer"], r["from_engine"]
    assert opt == r["from_zero_optimizer"]
    assert eng == {**opt, "skipped_steps": r["ds_skipped_steps"]}
    assert opt["loss_scale"] == r["ds_cur_scale"] == r["ds_loss_scaler_cur_scale"]
    assert opt["hysteresis"] == r["ds_cur_hysteresis"]
    assert opt["overflow"] == r["ds_overflow"] == r["accelerate_step_was_skipped"]
    assert r["from_scaler"]["loss_scale"] == opt["loss_scale"]
    assert r["from_scaler"]["overflow"] == opt["overflow"]


def test_overflow_halves_scale_with_hysteresis_1(runs: dict[str, Any]) -> None:
    """hysteresis 1 (the recipe's): the overflowing step is skipped and the scale halves at once."""
    run = runs["overflow_h1"]
    assert run["initial"] == {
        "loss_scale": INIT,
        "overflow": False,
        "skipped_steps": None,
        "hysteresis": 1,
        "dynamic": True,
    }
    got = [
        (r["from_engine"]["loss_scale"], r["from_engine"]["overflow"], r["from_engine"]["skipped_steps"])
        for r in run["records"]
    ]
    assert got == [(INIT, False, 0)] * 4 + [(INIT / 2, True, 1)] + [(INIT / 2, False, 1)] * 3
    for r in run["records"]:
        _check_consistent(r)
        assert r["from_engine"]["hysteresis"] == 1
        assert r["weight_unchanged"] == (r["step"] == 4)  # only the skipped step leaves the weights alone
    assert run["records"][-1]["ds_global_steps"] == 8
    assert all(math.isfinite(x) for x in run["losses"])  # the poison was on gradients, not on the loss
    assert math.isinf(run["grad_norms"][4]) or math.isnan(run["grad_norms"][4])


def test_overflow_hysteresis_2_delays_backoff(runs: dict[str, Any]) -> None:
    """hysteresis 2 (DeepSpeed's default): 1st overflow only uses up hysteresis, the 2nd halves the scale."""
    run = runs["overflow_h2"]
    assert run["initial"]["hysteresis"] == 2 and run["initial"]["loss_scale"] == INIT
    got = [
        (
            r["from_engine"]["loss_scale"],
            r["from_engine"]["overflow"],
            r["from_engine"]["skipped_steps"],
            r["from_engine"]["hysteresis"],
        )
        for r in run["records"]
    ]
    assert got == [
        (INIT, False, 0, 2),
        (INIT, False, 0, 2),
        (INIT, True, 1, 1),  # skipped, scale kept, hysteresis 2 -> 1
        (INIT / 2, True, 2, 1),  # skipped, hysteresis exhausted: halve
        # hysteresis only refills after loss_scale_window clean steps (consecutive_hysteresis is false)
        (INIT / 2, False, 2, 1),
        (INIT / 2, False, 2, 1),
        (INIT / 2, False, 2, 1),
        (INIT / 2, False, 2, 1),
    ]
    for r in run["records"]:
        _check_consistent(r)
        assert r["weight_unchanged"] == (r["step"] in (2, 3))


def test_an_fp32_recipe_runs_under_trainers_deepspeed_argument(runs: dict[str, Any]) -> None:
    run = runs["fp32_with_recipe_callbacks"]
    assert len(run["losses"]) == 2 and all(math.isfinite(x) for x in run["losses"])
    assert run["param_dtype"] == "torch.float32" and run["after_train"] is None  # no loss scaler in FP32


def test_bf16_has_no_scaler(runs: dict[str, Any]) -> None:
    run = runs["bf16"]
    assert run["param_dtype"] == "torch.bfloat16" and run["zero_stage"] == 1
    assert run["initial"] is None and run["after_train"] is None
    assert all(r["from_optimizer"] is None and r["from_engine"] is None for r in run["records"])
    # handed the scaler object itself, it reports it as is: ZeRO's fixed LossScaler(1.0) under bf16
    assert run["records"][-1]["from_scaler"] == {
        "loss_scale": 1.0,
        "overflow": False,
        "skipped_steps": None,
        "hysteresis": None,
        "dynamic": False,
    }
    assert all(math.isfinite(x) for x in run["losses"])


def test_storage_maps_to_deepspeeds_bf16_master_and_state_keys(runs: dict[str, Any]) -> None:
    """storage.master none + optimizer_states bf16 is DeepSpeed's bf16_master_weights_and_grads +
    bf16_optimizer_states: the engine's master partition and Adam moments are BF16 (FP32 with the default)."""
    assert runs["bf16_storage_config"] == {
        "enabled": True,
        "bf16_master_weights_and_grads": True,
        "bf16_optimizer_states": True,
    }
    low, default = runs["bf16_storage"], runs["bf16_default_zero1"]
    assert low["master_dtype"] == "torch.bfloat16" and low["state_dtypes"] == ["torch.bfloat16"]
    assert default["master_dtype"] == "torch.float32" and default["state_dtypes"] == ["torch.float32"]
    assert len(low["losses"]) == 2 and all(math.isfinite(x) for x in low["losses"])


def test_storage_without_a_deepspeed_equivalent_is_refused() -> None:
    from hf_mixedprec.core.errors import RecipeError
    from hf_mixedprec.integrations.recipe import resolve_recipe

    base = {"name": "x", "extends": "a100-bf16", "distributed": {"strategy": "deepspeed", "zero_stage": 1}}
    with pytest.raises(RecipeError, match="has no DeepSpeed equivalent"):
        resolve_recipe({**base, "storage": {"master": "bf16_remainder"}})
    with pytest.raises(RecipeError, match="needs ZeRO stage 1, 2 or 3"):
        resolve_recipe(
            {
                **base,
                "distributed": {"strategy": "deepspeed", "zero_stage": 0},
                "storage": {"master": "none", "optimizer_states": "bf16"},
            }
        )
    with pytest.raises(RecipeError, match="has no DeepSpeed equivalent"):  # FP32 states by a BF16 master: offload only
        resolve_recipe({**base, "storage": {"master": "none"}})


def test_non_deepspeed_objects_give_none() -> None:
    import torch

    from hf_mixedprec.integrations.deepspeed import read_deepspeed_scaler

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    assert read_deepspeed_scaler(opt) is None
    assert read_deepspeed_scaler(None) is None
    assert read_deepspeed_scaler(object()) is None


def test_dynamic_loss_scaler_semantics(runs: dict[str, Any]) -> None:
    """DeepSpeed's DynamicLossScaler as the docstring of read_deepspeed_scaler states it: window 2, hysteresis 2."""
    got = [x if isinstance(x, str) else (x["loss_scale"], x["overflow"], x["hysteresis"]) for x in runs["scaler_unit"]]
    assert got[:8] == [
        (4.0, True, 1),  # 1st overflow: hysteresis 2 -> 1, scale kept
        (2.0, True, 1),  # 2nd: halve; hysteresis stays 1
        (2.0, False, 1),
        (2.0, False, 1),
        (4.0, False, 2),  # 3rd clean step = loss_scale_window + 1: double, refill hysteresis
        (4.0, True, 1),
        (2.0, True, 1),
        (1.0, True, 1),  # min_loss_scale reached
    ]
    assert got[8].startswith("Current loss scale already at minimum")
    assert all(x["dynamic"] and x["skipped_steps"] is None for x in runs["scaler_unit"][:8])


def test_recipe_callbacks_log_deepspeeds_loss_scale(runs: dict[str, Any]) -> None:
    r = runs["with_recipe_callbacks"]
    logs = r["mp_logs"]
    assert [h["step"] for h in logs] == list(range(1, 9))
    assert [h["mp/loss_scale"] for h in logs] == [65536.0] * 4 + [32768.0] * 4
    assert [h["mp/skipped_steps"] for h in logs] == [0.0] * 4 + [1.0] * 4
    assert [h["mp/overflow"] for h in logs] == [0.0] * 4 + [1.0] + [0.0] * 3
    # and they agree with DeepSpeed's engine, step by step
    assert [rec["ds_cur_scale"] for rec in r["records"]] == [h["mp/loss_scale"] for h in logs]
    # the recipe's ZClip decides DeepSpeed's clipping (tests/integrations/test_deepspeed_clipping.py): its norm is logged
    assert [h["mp/grad_norm"] for h in logs] == pytest.approx([rec["ds_grad_norm"] for rec in r["records"]])
    # the health monitor is fed from DeepSpeed's step state: its skipped step 5 had a non-finite gradient
    # (nonfinite_grad) and is seen by consecutive_skips
    events = [(e["detector"], e["step"], e["value"]) for e in r["mp_events"]]
    assert events == [("nonfinite_grad", 5, math.inf), ("consecutive_skips", 5, 1.0)]


def test_training_args_agree_with_the_generated_deepspeed_config() -> None:
    """Trainer refuses a max_grad_norm (or fp16 flag) that differs from the DeepSpeed JSON's."""
    from hf_mixedprec.integrations.deepspeed import deepspeed_config
    from hf_mixedprec.integrations.recipe import resolve_recipe

    for base, clipping, clip, fp16 in (
        ("cpu-bf16", {}, 1.0, False),  # zclip without a cap -> DeepSpeed's fixed 1.0
        ("v100-fp16", {"clipping": {"method": "norm", "max_norm": 0.5}}, 0.5, True),
        ("v100-fp16", {"clipping": {"method": "none"}}, 0.0, True),
    ):
        recipe = resolve_recipe(
            {"name": "z", "extends": base, "distributed": {"strategy": "deepspeed", "zero_stage": 2}, **clipping}
        )
        cfg, _ = deepspeed_config(recipe)
        args = recipe.training_args(output_dir="/tmp/unused", use_cpu=True)
        assert args.max_grad_norm == cfg["gradient_clipping"] == clip
        assert args.fp16 is fp16 and cfg["fp16"]["enabled"] is fp16


# --- ZeRO-3 saving and what DeepSpeed refuses ---------------------------------------------------------------------


def _ds_recipe(base: str, stage: int) -> Any:
    from hf_mixedprec.integrations.recipe import resolve_recipe

    return resolve_recipe(
        {"name": f"{base}-z{stage}", "extends": base, "distributed": {"strategy": "deepspeed", "zero_stage": stage}}
    )


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_only_zero3_gathers_weights_on_save(stage: int) -> None:
    from hf_mixedprec.integrations.deepspeed import deepspeed_config

    cfg, _ = deepspeed_config(_ds_recipe("cpu-bf16", stage))
    expected = {"stage": stage} | ({"stage3_gather_16bit_weights_on_model_save": True} if stage == 3 else {})
    assert cfg["zero_optimization"] == expected


def test_refusal_rule_per_precision_and_stage() -> None:
    """fp16 is refused at every ZeRO stage where the accelerator has no FP16; bf16 and fp32 never (measured on a
    2-core AMD EPYC without AVX512-FP16: bf16 and fp32 trained at stages 0-3 on 2 ranks, fp16 died at each)."""
    from hf_mixedprec.integrations.deepspeed import deepspeed_refusal
    from hf_mixedprec.integrations.recipe import resolve_recipe

    fp32 = {"name": "f32", "precision": "fp32"}
    for stage in (0, 1, 2, 3):
        fp16 = _ds_recipe("v100-fp16", stage)
        why = deepspeed_refusal(fp16, "cpu", fp16_supported=False)
        assert why is not None and f"(zero_stage {stage}) cannot run on this CPU" in why
        assert "precision fp16 with distributed.strategy deepspeed" in why and "\n" not in why
        assert deepspeed_refusal(fp16, "cpu", fp16_supported=True) is None
        assert deepspeed_refusal(fp16, "xpu", fp16_supported=None) is None  # not judged
        assert deepspeed_refusal(_ds_recipe("cpu-bf16", stage), "cpu", fp16_supported=False) is None
        f32 = resolve_recipe({**fp32, "distributed": {"strategy": "deepspeed", "zero_stage": stage}})
        assert deepspeed_refusal(f32, "cpu", fp16_supported=False) is None
    cuda = deepspeed_refusal(_ds_recipe("v100-fp16", 2), "cuda", fp16_supported=False)
    assert cuda is not None and "compute capability below 7.0" in cuda and "(allowed: precision fp32" in cuda
    ddp = resolve_recipe({"name": "d", "extends": "v100-fp16", "distributed": {"strategy": "ddp"}})
    assert deepspeed_refusal(ddp, "cpu", fp16_supported=False) is None  # not DeepSpeed: rehearsal handles it


def test_fp16_rule_agrees_with_deepspeeds_own_accelerator(runs: dict[str, Any]) -> None:
    """What we predict without importing DeepSpeed is what DeepSpeed's CPU accelerator answers on this machine (asked
    in the subprocess of the runs, before it installs the test accelerator)."""
    from hf_mixedprec.integrations.deepspeed import deepspeed_fp16_supported

    assert runs["ds_cpu_fp16_supported"] is deepspeed_fp16_supported("cpu")


def test_deepspeed_device_follows_ds_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from hf_mixedprec.integrations.deepspeed import deepspeed_device

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert deepspeed_device() == "cpu"
    monkeypatch.delenv("DS_ACCELERATOR")
    assert deepspeed_device() == ("cuda" if torch.cuda.is_available() else "cpu")
