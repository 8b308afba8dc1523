"""MoE experts' load: tokens per expert counted as routed, the dead_expert and routing_collapse detectors naming the
module and expert, one host read per logging step, and a resume that judges as the uninterrupted run does."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import hf_mixedprec
from hf_mixedprec.core import metrics as M
from hf_mixedprec.integrations.recipe import Recipe, resolve_recipe
from hf_mixedprec.recipes.files import parse_recipe_yaml
from hf_mixedprec.training.runtime import MixedPrecisionRuntime
from tests.moe import tiny_qwen3_moe

EXPERTS = ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")
N_EXPERTS, TOP_K = 8, 2


def _model(seed: int = 0) -> nn.Module:
    return tiny_qwen3_moe(seed, num_experts=N_EXPERTS, num_experts_per_tok=TOP_K)


def _recipe(**detectors: dict) -> Recipe:
    return resolve_recipe({"name": "cpu-moe", "extends": "cpu-fp32", "health": {"detectors": detectors}})


class _Routes:
    """What each experts module was sent, seen by a hook of the test's own (bincount of the routed ids)."""

    def __init__(self, model: nn.Module) -> None:
        self.counts = {n: torch.zeros(N_EXPERTS) for n in EXPERTS}
        for n in EXPERTS:
            model.get_submodule(n).register_forward_pre_hook(self._count(n))

    def _count(self, name: str):
        def hook(mod, args):
            if mod.training and torch._C._current_graph_task_id() == -1:
                self.counts[name] += torch.bincount(args[1].reshape(-1), minlength=N_EXPERTS).float()

        return hook


def _force_routes(model: nn.Module, experts: list[int]) -> None:
    """Every token of every MoE layer goes to ``experts`` (the routers' outputs rewritten)."""
    for layer in model.model.layers:

        def hook(mod, args, out):
            logits, weights, idx = out
            return logits, weights, torch.tensor(experts).expand_as(idx).contiguous()

        layer.mlp.gate.register_forward_hook(hook)


def _steps(
    rt: MixedPrecisionRuntime, model: nn.Module, opt, n: int, seed: int = 0, log_at=(), shape=(2, 16)
) -> list[dict]:
    logs = []
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        rt.begin_step(model, opt)
        ids = torch.randint(0, 200, shape, generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        rt.after_optimizer_step(model, opt)
        if rt.steps in log_at:
            events = rt.check(model, opt)
            logs.append({"events": [e.to_dict() for e in events], "metrics": rt.metrics()})
    return logs


def test_tokens_per_expert_are_the_routed_ones_and_gradient_checkpointing_counts_them_once():
    model = _model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    routes = _Routes(model)
    rt = MixedPrecisionRuntime(_recipe())
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    (first,) = _steps(rt, model, opt, 3, log_at={3})
    m = first["metrics"]
    for name in EXPERTS:
        seen = routes.counts[name]
        assert seen.sum() == 3 * 2 * 16 * TOP_K  # one count per token and expert it went to
        assert m[M.moe_module_key(name, "tokens")] == seen.sum()
        assert m[M.moe_module_key(name, "load_max")] == pytest.approx(float(seen.max() * N_EXPERTS / seen.sum()))
        assert m[M.moe_module_key(name, "idle_steps")] == 0 if (seen > 0).all() else 1
    assert m[M.MOE_LOAD_MAX] == max(m[M.moe_module_key(n, "load_max")] for n in EXPERTS)
    for c in routes.counts.values():
        c.zero_()
    (second,) = _steps(rt, model, opt, 2, seed=1, log_at={5})  # counted from the last log on
    assert second["metrics"][M.moe_module_key(EXPERTS[0], "tokens")] == routes.counts[EXPERTS[0]].sum() == 128


def test_dead_experts_and_collapsed_routing_fire_naming_the_module_and_the_expert():
    model = _model().train()
    _force_routes(model, [5, 1])
    recipe = _recipe(dead_expert={"threshold": 6}, routing_collapse={"threshold": 0.5, "window": 4})
    rt = MixedPrecisionRuntime(recipe)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    (tiny,) = _steps(rt, model, opt, 1, log_at={1}, shape=(1, 4))
    # 8 routed tokens are too few to judge a balance over 8 experts; no expert idle 6 steps yet
    assert tiny["events"] == [] and math.isnan(tiny["metrics"][M.moe_module_key(EXPERTS[0], "load_entropy")])
    early, late = _steps(rt, model, opt, 7, log_at={2, 8})
    assert {(e["detector"], e["layer"]) for e in early["events"]} == {("routing_collapse", n) for n in EXPERTS}
    by = {(e["detector"], e["layer"]): e for e in late["events"]}
    assert set(by) == {(d, n) for d in ("dead_expert", "routing_collapse") for n in EXPERTS}
    dead = by["dead_expert", EXPERTS[1]]
    assert dead["value"] == 8 and dead["step"] == 8 and dead["reaction"] == "warn"
    assert dead["message"].startswith(f"{EXPERTS[1]}: expert 0 received no token for 8 optimizer steps")
    assert "6 of its experts did" in dead["message"]
    collapse = by["routing_collapse", EXPERTS[0]]
    assert collapse["value"] == pytest.approx(math.log(2) / math.log(N_EXPERTS), rel=1e-5)  # even over 2 of 8
    assert "busiest expert is 1" in collapse["message"] or "busiest expert is 5" in collapse["message"]
    assert late["metrics"][M.MOE_DEAD_EXPERTS] == 12 and late["metrics"][M.MOE_LOAD_MAX] == 4.0


def test_the_expert_load_resumes_as_the_uninterrupted_run_judges():
    recipe = _recipe(dead_expert={"threshold": 5}, routing_collapse={"threshold": 0.9, "window": 3})

    def run(split: bool) -> list[dict]:
        model = _model().train()
        _force_routes(model, [2, 3])
        opt = torch.optim.AdamW(model.parameters(), 1e-3)
        rt = MixedPrecisionRuntime(recipe)
        logs = _steps(rt, model, opt, 3, log_at={2})
        if split:  # a checkpoint between logs: a new runtime takes the saved state before it sees the model
            state = json.loads(json.dumps(rt.state_dict()))
            rt = MixedPrecisionRuntime(recipe)
            rt.load_state_dict(state)
        return logs + _steps(rt, model, opt, 4, seed=3, log_at={4, 7})

    straight, resumed = run(False), run(True)
    assert straight == resumed
    assert [e["detector"] for e in straight[2]["events"]].count("dead_expert") == 2  # it fired after the resume
    assert straight[2]["metrics"][M.moe_module_key(EXPERTS[0], "idle_steps")] == 7


def test_a_model_without_experts_reports_no_moe_metrics():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, vocab_size=256))  # fmt: skip
    rt = MixedPrecisionRuntime(hf_mixedprec.load_recipe("cpu-fp32"))
    (log,) = _steps(rt, model, torch.optim.AdamW(model.parameters(), 1e-3), 1, log_at={1})
    assert rt.experts.load is None and not any(k.startswith(M.MOE_PREFIX) for k in log["metrics"])


@pytest.mark.parametrize("reaction", ["fallback", "skip_step"])
def test_an_experts_detector_refuses_a_reaction_that_cannot_change_routing(reaction):
    with pytest.raises(hf_mixedprec.RecipeError) as err:
        parse_recipe_yaml(f"extends: cpu-fp32\nhealth:\n  detectors:\n    dead_expert: {{reaction: {reaction}}}\n")
    text = str(err.value)
    assert "health.detectors.dead_expert.reaction" in text and repr(reaction) in text and "log | warn" in text


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_trainer_run_logs_the_experts_load_on_its_logging_steps(tmp_path):
    """Through the one-line Trainer callback: each log row carries the experts' tokens since the row before."""
    from transformers import Trainer

    from tests.integrations.test_integration import Bytes

    model = _model()
    routes = _Routes(model)
    recipe = hf_mixedprec.load_recipe("cpu-fp32")
    args = recipe.training_args(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2,
                                logging_steps=2, report_to=[], save_strategy="no", disable_tqdm=True)  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=Bytes(n=8, seq_len=16), callbacks=recipe.callbacks())
    trainer.train()
    rows = [r for r in trainer.state.log_history if M.MOE_LOAD_MAX in r]
    assert [r["step"] for r in rows] == [2, 4]
    assert sum(r[M.moe_module_key(EXPERTS[1], "tokens")] for r in rows) == routes.counts[EXPERTS[1]].sum() == 256
