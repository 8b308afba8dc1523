"""``estimate`` for FSDP2 against what each of 2 gloo ranks holds in a real sharded Trainer step: the rank's shards of
the weights, gradients and optimizer states, counted from the tensors, and the peak of what autograd saves for
backward, recorded by the same hook as tests/commands/test_estimate.py. The ranks' side (:func:`measured_per_rank`)
runs as a scenario of tests/integrations/test_fsdp2_ranks.py's shared processes, which also holds the test
(:func:`check_estimate_per_rank`)."""

from __future__ import annotations

import pytest
import torch

from tests.commands.test_estimate import BATCH, SEQ, _Box, _Ids, _Peak, small_llama_cfg
from tests.commands.test_estimate_storage import _nbytes

RECIPES = (
    "cpu-bf16", "h100-fp8-delayed", "cpu-bf16+bf16_remainder", "cpu-bf16+bf16_kahan", "cpu-bf16+none",
    "cpu-bf16+bf16_stochastic+bf16", "cpu-bf16+fp32+8bit",
)  # fmt: skip


def _recipe(name: str):
    """The recipe a name of :data:`RECIPES` stands for under FSDP2 (``base+master[+states]``: that storage.master and
    optimizer_states)."""
    from hf_mixedprec.integrations.recipe import resolve_recipe

    base, *choice = name.split("+")
    storage = {"storage": {"master": choice[0], "optimizer_states": (choice[1:] or ["fp32"])[0]}} if choice else {}
    recipe = resolve_recipe({"name": f"{base}-fsdp2", "extends": base, "distributed": {"strategy": "fsdp2"}, **storage})
    return recipe.rehearsed(True) if base != "cpu-bf16" else recipe


def _local_bytes(tensors) -> int:
    """Bytes of the distinct storages behind this rank's part of each tensor (a DTensor's local shard; a tensor
    subclass inside, torchao's optimizer states, by its inner tensors: tests/commands/test_estimate_storage.py)."""
    return _nbytes(t.to_local() if hasattr(t, "to_local") else t for t in tensors)


class _GatheredNotCounted(_Peak):
    """:class:`_Peak` that also leaves out the weights FSDP2 gathered for a block while it runs. A BF16 weight under
    BF16 autocast is saved for backward as it is (no cast copy), and under FSDP2 that is the gathered weight, which
    FSDP2 frees after the block's forward (resharding; it gathers it again for the backward): no activation memory,
    whatever was saved. During the forward the modules hold them as their parameters."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        super().__init__([_local(p) for p in model.parameters()])

    def pack(self, t):
        if t.untyped_storage().data_ptr() in {_local(p).untyped_storage().data_ptr() for p in self.model.parameters()}:
            return _Box([t])
        return super().pack(t)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def measured_per_rank(rank: int, out: str) -> dict:
    """On each of 2 ranks: one sharded Trainer step per recipe of :data:`RECIPES`, and what this rank held then."""
    from accelerate.state import AcceleratorState
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback

    from hf_mixedprec.fp8.emulated import EmulatedFP8GEMM

    class Measuring(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            self.peak = _GatheredNotCounted(model)
            with torch.autograd.graph.saved_tensors_hooks(self.peak.pack, _Peak.unpack):
                return super().training_step(model, inputs, num_items_in_batch)

    class Counts(TrainerCallback):
        def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
            params = list(model.parameters())
            opt = getattr(optimizer, "optimizer", optimizer)
            layers = [m for m in model.modules() if isinstance(m, EmulatedFP8GEMM)]
            self.row = {
                "weights": _local_bytes(params),
                "gradients": _local_bytes(p.grad for p in params if p.grad is not None),
                "optimizer": _local_bytes(v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)),
                "fp8_extras": _local_bytes(b for m in layers for b in m.buffers()),
                "sharded": all(hasattr(p, "to_local") for p in params),
            }

    seen = {}
    for name in RECIPES:
        recipe = _recipe(name)
        torch.manual_seed(0)
        cfg = small_llama_cfg()
        args = recipe.training_args(
            output_dir=f"{out}-{name}", max_steps=1, per_device_train_batch_size=BATCH, report_to=[],
            save_strategy="no", disable_tqdm=True, use_cpu=True,
        )  # fmt: skip
        counts = Counts()
        tr = Measuring(
            model=AutoModelForCausalLM.from_config(cfg),
            args=args,
            train_dataset=_Ids(cfg.vocab_size, 2 * BATCH),
            callbacks=[*recipe.callbacks(), counts],
        )
        tr.train()
        seen[name] = {**counts.row, "activations": tr.peak.peak}
        AcceleratorState._reset_state(reset_partial_state=False)
    return seen


def check_estimate_per_rank(per_rank: list[dict], recipe: str) -> None:
    """Weights, gradients, optimizer states and FP8 buffers per rank within 1% of the rank's own tensors (FSDP2
    pads each parameter's first dimension to a multiple of the ranks, so a shard may hold a row more than half);
    activations within 10% (the rule tests/commands/test_estimate.py holds one process to); the total within 10%.
    A BF16 master's remainder or compensation is optimizer state on the rank and ``master_weights`` in the estimate:
    2 bytes per parameter of the rank's shard (none for ``none``), whose weights and gradients are BF16."""
    from hf_mixedprec.commands.estimate import estimate_memory

    est = estimate_memory(small_llama_cfg(), [_recipe(recipe)], batch_size=BATCH, seq_len=SEQ, num_gpus=2, target="cpu")
    mem = est.recipes[0].memory
    assert est.recipes[0].strategy.startswith("fsdp2")
    for rank, seen in enumerate(per_rank):
        got = seen[recipe]
        assert got["sharded"], rank
        for part in ("weights", "gradients", "optimizer", "fp8_extras"):
            want = getattr(mem, part) + (mem.master_weights if part == "optimizer" else 0)
            assert abs(got[part] - want) <= 0.01 * max(want, 1), (rank, part, got[part], want)
        assert got["activations"] > 0
        assert abs(mem.activations - got["activations"]) <= 0.10 * got["activations"], (rank, mem.activations, got)
        if "+bf16_" in recipe or "+none" in recipe:
            bf16 = got["weights"] // 2  # the rank's parameters: its weights are BF16
            assert got["gradients"] == got["weights"]
            kept = "+bf16_remainder" in recipe or "+bf16_kahan" in recipe  # 2 bytes beside each BF16 weight
            assert mem.master_weights == (pytest.approx(2 * bf16, rel=0.01) if kept else 0)
            moments = 2 * (2 if recipe.endswith("+bf16") else 4) * bf16
            assert got["optimizer"] - mem.master_weights == pytest.approx(moments, rel=0.01)
        held = sum(got[p] for p in ("weights", "gradients", "optimizer", "fp8_extras", "activations"))
        assert abs(mem.total - held) <= 0.10 * held, (rank, mem.total, held)
