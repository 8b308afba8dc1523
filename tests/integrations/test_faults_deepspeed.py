"""Fault injection under DeepSpeed BF16 (ZeRO 0-3) on CPU: a NaN loss or an inf gradient never changes the weights
or the optimizer state, the health monitor sees the skip, a ``stop`` reaction stops there with a finite checkpoint.

DeepSpeed skips such a step itself (its optimizers check gradients for inf/NaN under BF16 too); the callback reads
``engine.skipped_steps``. One subprocess runs every scenario (a DeepSpeed Trainer leaves process-wide state
behind, see ``tests/integrations/test_deepspeed.py``); the tests assert on the JSON it writes.
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

FAULT_AT = 3  # the optimizer step (1-based) made non-finite
STEPS = 5
SCENARIOS = [  # (zero stage, fault, reaction of both non-finite detectors)
    (0, "inf_grad", "warn"),
    (1, "nan_loss", "stop"),
    (1, "inf_grad", "warn"),
    (2, "inf_grad", "stop"),
    (2, "nan_loss", "warn"),
    (3, "inf_grad", "warn"),
]


def _scenarios(out_dir: Path) -> dict[str, Any]:  # pragma: no cover - runs in the subprocess
    import torch
    from safetensors.torch import load_file
    from transformers import Trainer, TrainerCallback

    from hf_mixedprec.core.demo import builtin_text, byte_batches, tiny_llama
    from hf_mixedprec.integrations.deepspeed import deepspeed_config
    from hf_mixedprec.integrations.recipe import resolve_recipe
    from hf_mixedprec.integrations.trainer import runtime_of
    from tests.deepspeed_cpu import deepspeed_cpu_env, install_deepspeed_cpu_accelerator

    os.environ.update(deepspeed_cpu_env())
    install_deepspeed_cpu_accelerator()
    rows = [r for b in byte_batches(builtin_text(20_000), seq_len=32, batch_size=4, n_batches=8) for r in b]

    class Rows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(rows)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": rows[i], "labels": rows[i]}

    class Fault(TrainerCallback):
        def __init__(self, kind: str, stage: int) -> None:
            self.kind, self.stage, self.armed, self.before, self.after = kind, stage, False, None, None

        def on_train_begin(self, args, state, control, model=None, **kw):
            w = model.model.layers[0].mlp.down_proj.weight
            w.register_hook(lambda g: torch.full_like(g, math.inf) if self.armed and self.kind == "inf_grad" else g)

        def _snapshot(self, model):
            """The master weights and the state DeepSpeed's torch optimizer steps (flat ZeRO partitions or the
            stage-0 FP32 copies), and the model's own weights where they are not partitioned (stages 0-2)."""
            base = self.trainer.model_wrapped.optimizer.optimizer
            params = [p.detach().clone() for g in base.param_groups for p in g["params"]]
            if self.stage < 3:
                params += [p.detach().clone() for p in model.parameters()]
            states = [t.clone() for st in base.state.values() for t in st.values() if torch.is_tensor(t) and t.dim()]
            return params, states

        def on_step_begin(self, args, state, control, model=None, **kw):
            self.armed = state.global_step + 1 == FAULT_AT
            if self.armed:
                self.before = self._snapshot(model)

        def on_step_end(self, args, state, control, model=None, **kw):
            if self.armed:
                self.after = self._snapshot(model)
                self.armed = False

    class NanLoss(Trainer):
        fault: Fault

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            return loss * math.nan if self.fault.armed and self.fault.kind == "nan_loss" else loss

    results: dict[str, Any] = {}
    for stage, kind, reaction in SCENARIOS:
        det = {"reaction": reaction}
        recipe = resolve_recipe(
            {
                "name": f"ds-fault-{stage}",
                "extends": "cpu-bf16",
                "distributed": {"strategy": "deepspeed", "zero_stage": stage},
                "health": {"detectors": {"nonfinite_loss": det, "nonfinite_grad": det}},
            }
        )
        cfg, _ = deepspeed_config(recipe, zero_stage=stage)
        out = out_dir / f"z{stage}-{kind}-{reaction}"
        args = recipe.training_args(
            output_dir=str(out),
            deepspeed=cfg,
            max_steps=STEPS,
            per_device_train_batch_size=4,
            learning_rate=2e-3,
            logging_steps=1,
            save_strategy="steps",
            save_steps=2,
            report_to=[],
            disable_tqdm=True,
            seed=0,
        )
        fault = Fault(kind, stage)
        NanLoss.fault = fault
        tr = NanLoss(model=tiny_llama(), args=args, train_dataset=Rows(), callbacks=[fault, *recipe.callbacks()])
        fault.trainer = tr
        tr.train()
        (p0, o0), (p1, o1) = fault.before, fault.after
        checkpoints = {}
        for ckpt in sorted(out.glob("checkpoint-*")):
            files = list(ckpt.glob("*.safetensors"))
            bad = [
                k
                for f in files
                for k, t in load_file(str(f)).items()
                if t.is_floating_point() and not torch.isfinite(t).all()
            ]
            checkpoints[ckpt.name] = {"files": len(files), "non_finite": bad[:3]}
        results[f"{stage}-{kind}-{reaction}"] = {
            "weights_equal": all(torch.equal(a, b) for a, b in zip(p0, p1)),
            "weights_finite": all(bool(torch.isfinite(a).all()) for a in p1),
            "optimizer_equal": len(o0) == len(o1) and all(torch.equal(a, b) for a, b in zip(o0, o1)),
            "optimizer_tensors": len(o0),
            "skipped": [r["mp/skipped_steps"] for r in tr.state.log_history if "mp/skipped_steps" in r],
            "events": [e["detector"] for e in runtime_of(tr).events],
            "global_step": tr.state.global_step,
            "checkpoints": checkpoints,
            "engine_skipped": int(tr.model_wrapped.skipped_steps),
            "clipper": runtime_of(tr).clipper is not None,
            "clip_fallback": [n for n in runtime_of(tr).notes if n.startswith("FALLBACK: clipping.method")],
        }
    return results


if __name__ == "__main__":  # pragma: no cover
    Path(sys.argv[1]).write_text(json.dumps(_scenarios(Path(sys.argv[2]))))
    sys.exit(0)


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("ds_faults")
    out = tmp / "runs.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH")]))
    r = subprocess.run(
        [sys.executable, __file__, str(out), str(tmp)], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize(("stage", "kind", "reaction"), SCENARIOS)
def test_deepspeed_skips_the_non_finite_step_and_the_monitor_sees_it(runs, stage, kind, reaction):
    r = runs[f"{stage}-{kind}-{reaction}"]
    assert r["weights_equal"], "the faulty step changed a weight"
    assert r["weights_finite"]
    assert r["optimizer_equal"], "the faulty step changed the optimizer state"
    assert r["optimizer_tensors"] > 0
    assert r["engine_skipped"] == 1
    assert r["skipped"][FAULT_AT - 2 : FAULT_AT] == [0.0, 1.0]  # seen at the faulty step, not before
    assert "nonfinite_grad" in r["events"]
    assert ("nonfinite_loss" in r["events"]) == (kind == "nan_loss")
    assert r["checkpoints"], "no checkpoint was written"
    for name, ck in r["checkpoints"].items():
        assert ck["non_finite"] == [], f"{name} holds non-finite tensors"
    if reaction == "stop":
        assert r["global_step"] == FAULT_AT
        assert f"checkpoint-{FAULT_AT}" in r["checkpoints"]
    else:
        assert r["global_step"] == STEPS


@pytest.mark.parametrize(("stage", "kind", "reaction"), SCENARIOS)
def test_the_recipes_clipper_runs_under_zero_1_to_3_and_stage_0_says_why_not(runs, stage, kind, reaction):
    """cpu-bf16's ZClip decides DeepSpeed's clipping at ZeRO 1-3 (tests/integrations/test_deepspeed_clipping.py checks the
    numbers); at stage 0 the callback drops it at setup with a FALLBACK note naming why."""
    r = runs[f"{stage}-{kind}-{reaction}"]
    assert r["clipper"] == (stage > 0)
    if stage == 0:
        assert (
            len(r["clip_fallback"]) == 1 and "ZeRO stage 0 clips with torch's clip_grad_norm_" in r["clip_fallback"][0]
        )
    else:
        assert r["clip_fallback"] == []
