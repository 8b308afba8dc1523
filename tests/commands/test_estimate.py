"""``hf-mixedprec estimate`` against measurement: one real Trainer step on CPU, tensors counted by hand.

Weights, gradients, optimizer states and FP8 buffers must equal the real tensors exactly; activations (the
peak of what autograd saves for backward, recorded here by the test's own hook) within 10%.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, Trainer, TrainerCallback

from hf_mixedprec import load_recipe
from hf_mixedprec.commands.estimate import GIB, estimate_memory, format_estimate
from hf_mixedprec.core.demo import SMALL_LLAMA, TINY_LLAMA

SEQ, BATCH = 64, 2
ROOT = Path(__file__).resolve().parents[2]


def tiny_llama_cfg() -> LlamaConfig:
    return LlamaConfig(**{**TINY_LLAMA, "attn_implementation": "sdpa"})


def small_llama_cfg() -> LlamaConfig:
    return LlamaConfig(**{**TINY_LLAMA, **SMALL_LLAMA, "attn_implementation": "eager"})


def gpt2_cfg() -> GPT2Config:
    return GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128, attn_implementation="eager")


def mixtral_cfg():
    from transformers import MixtralConfig

    dims = {k: v for k, v in TINY_LLAMA.items() if k != "tie_word_embeddings"}
    return MixtralConfig(**dims, num_local_experts=4, num_experts_per_tok=2, attn_implementation="eager")


def _distinct(tensors) -> int:
    """Bytes of the distinct storages (by address) behind real tensors."""
    seen = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


class _Box(list):
    """A list that can be weakly referenced (to see when autograd frees a saved tensor)."""


class _Peak:
    """The test's own record of saved-for-backward bytes: live storages by address, their peak."""

    def __init__(self, params):
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.live, self.now, self.peak = {}, 0, 0

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        box = _Box([t])
        if ptr in self.skip:
            return box
        if ptr not in self.live:
            self.live[ptr] = [0, t.untyped_storage().nbytes()]
            self.now += self.live[ptr][1]
            self.peak = max(self.peak, self.now)
        self.live[ptr][0] += 1

        def drop(ptr=ptr):
            self.live[ptr][0] -= 1
            if not self.live[ptr][0]:
                self.now -= self.live.pop(ptr)[1]

        weakref.finalize(box, drop)
        return box

    @staticmethod
    def unpack(box):
        return box[0]


class _MeasuringTrainer(Trainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        self.peak = _Peak(list(model.parameters()))
        with torch.autograd.graph.saved_tensors_hooks(self.peak.pack, _Peak.unpack):
            return super().training_step(model, inputs, num_items_in_batch)


class _Counts(TrainerCallback):
    """After the optimizer step, before zero_grad: the real tensors, counted."""

    def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
        from hf_mixedprec.fp8.emulated import EmulatedFP8GEMM

        params = list(model.parameters())
        self.weights = _distinct(params)
        self.grads = _distinct(p.grad for p in params if p.grad is not None)
        opt = getattr(optimizer, "optimizer", optimizer)
        self.optimizer = _distinct(v for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
        from hf_mixedprec.fp8.experts import ExpertsDelayedState, converted_experts

        layers = [m for m in model.modules() if isinstance(m, (EmulatedFP8GEMM, ExpertsDelayedState))]
        self.fp8 = _distinct(b for m in layers for b in m.buffers())
        # FP8 Linears and MoE experts modules in FP8 (a delayed-scaling experts state is no layer of its own)
        self.fp8_layers = sum(isinstance(m, EmulatedFP8GEMM) for m in layers) + len(converted_experts(model))


class _Ids(torch.utils.data.Dataset):
    def __init__(self, vocab: int, n: int):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _real_step(cfg, recipe_name, tmp_path, *, optimizer="adamw", checkpointing=False):
    from transformers import AutoModelForCausalLM

    from hf_mixedprec.commands.estimate import OPTIMIZERS

    rec = load_recipe(recipe_name, rehearse=True) if recipe_name != "fp32" else None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    common = dict(
        output_dir=str(tmp_path / "run"),
        max_steps=1,
        per_device_train_batch_size=BATCH,
        optim=OPTIMIZERS[optimizer],
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        gradient_checkpointing=checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": True} if checkpointing else None,
    )
    if rec is None:
        from transformers import TrainingArguments

        args, callbacks = TrainingArguments(**common), []
    else:
        args, callbacks = rec.training_args(**common), rec.callbacks()
    counts = _Counts()
    tr = _MeasuringTrainer(
        model=model, args=args, train_dataset=_Ids(cfg.vocab_size, BATCH), callbacks=[*callbacks, counts]
    )
    tr.train()
    return counts, tr.peak.peak


CASES = [
    ("tiny-llama", tiny_llama_cfg, "fp32", "adamw", False),
    ("tiny-llama", tiny_llama_cfg, "cpu-bf16", "adamw", False),
    ("tiny-llama", tiny_llama_cfg, "cpu-bf16", "sgd", False),
    ("tiny-llama", tiny_llama_cfg, "cpu-bf16", "adafactor", False),
    ("tiny-llama", tiny_llama_cfg, "b200-mxfp8", "adamw", False),
    ("small-llama", small_llama_cfg, "cpu-bf16", "adamw", False),
    ("small-llama", small_llama_cfg, "v100-fp16", "adamw", False),
    ("small-llama", small_llama_cfg, "h100-fp8-delayed", "adamw", False),
    ("small-llama", small_llama_cfg, "cpu-bf16", "adamw", True),
    ("gpt2", gpt2_cfg, "cpu-bf16", "adamw", False),
    ("gpt2", gpt2_cfg, "v100-fp16", "adamw", False),
    ("gpt2", gpt2_cfg, "h100-fp8-current", "adamw", False),
    ("gpt2", gpt2_cfg, "cpu-bf16", "adamw", True),
    # MoE: experts as 3-D weights through torch._grouped_mm (its fake kernel takes BF16 only)
    ("tiny-mixtral", mixtral_cfg, "cpu-bf16", "adamw", False),
    ("tiny-mixtral", mixtral_cfg, "h100-fp8-current", "adamw", False),
]


@pytest.mark.parametrize(
    ("model", "make_cfg", "recipe", "optimizer", "checkpointing"),
    CASES,
    ids=[f"{c[0]}-{c[2]}-{c[3]}{'-gc' if c[4] else ''}" for c in CASES],
)
def test_estimate_equals_one_real_trainer_step(model, make_cfg, recipe, optimizer, checkpointing, tmp_path):
    est = estimate_memory(
        make_cfg(),
        [recipe],
        batch_size=BATCH,
        seq_len=SEQ,
        optimizer=optimizer,
        gradient_checkpointing=checkpointing,
        target="cpu",
    )
    mem = est.recipes[0].memory
    counts, activations = _real_step(make_cfg(), recipe, tmp_path, optimizer=optimizer, checkpointing=checkpointing)
    assert mem.weights == counts.weights
    assert mem.gradients == counts.grads
    assert mem.optimizer == counts.optimizer
    assert mem.fp8_extras == counts.fp8
    assert est.recipes[0].fp8_layers == counts.fp8_layers
    assert mem.master_weights == 0 and mem.ddp_buckets == 0
    if recipe == "h100-fp8-delayed":
        assert counts.fp8 > 0  # the amax histories and scales are there, and counted
    if optimizer == "sgd":
        assert counts.optimizer == 0
    assert activations > 0
    assert abs(mem.activations - activations) <= 0.10 * activations, (mem.activations, activations)


def test_checkpointing_and_precision_move_activations_the_right_way():
    cfg = small_llama_cfg()
    plain, gc = (
        estimate_memory(cfg, ["cpu-bf16", "fp32"], batch_size=4, seq_len=128, gradient_checkpointing=g, target="cpu")
        for g in (False, True)
    )
    bf16, fp32 = plain.recipes
    assert gc.recipes[0].memory.activations < 0.6 * bf16.memory.activations
    assert bf16.memory.activations < fp32.memory.activations
    assert fp32.percent_of_fp32 == 100.0
    assert bf16.memory.weights == fp32.memory.weights  # autocast keeps float32 weights


def _llama8b(tmp_path) -> str:
    cfg = LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )
    path = tmp_path / "llama8b"
    cfg.save_pretrained(path)
    return str(path)


def _llama_params(h=4096, i=14336, layers=32, heads=32, kv=8, vocab=128256) -> int:
    head = h // heads
    attn = h * h * 2 + 2 * h * kv * head
    return 2 * vocab * h + layers * (attn + 3 * h * i + 2 * h) + h


@pytest.mark.slow
def test_cli_estimates_an_8b_config_in_seconds_without_its_weights(tmp_path):
    model = _llama8b(tmp_path)
    code = (
        "import resource, sys, time; from hf_mixedprec.cli.app import main; t = time.time(); rc = main(sys.argv[1:]); "
        "sys.stderr.write(f'ELAPSED {time.time() - t} RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}\\n'); "
        "sys.exit(rc)"
    )
    args = ["estimate", "--model", model, "--recipes", "a100-bf16,h100-fp8-delayed", "--batch-size", "1"]
    args += ["--seq-len", "4096", "--gpu", "h100-80gb", "--gpu", "h200-141gb", "--json"]
    # a fresh process (its peak RSS is what is measured), on one thread as a test worker computes
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    elapsed, rss_kib = (float(x) for x in proc.stderr.rsplit("ELAPSED ", 1)[1].split(" RSS "))
    psi = _llama_params()
    assert out["parameters"] == psi
    bf16, fp8 = out["recipes"]
    assert bf16["memory"]["weights"] == 4 * psi and bf16["memory"]["gradients"] == 4 * psi
    assert bf16["memory"]["optimizer"] == 8 * psi + 4 * 291  # exp_avg, exp_avg_sq and a float32 step per tensor
    linear = psi - 2 * 128256 * 4096 - 65 * 4096  # embeddings, lm_head (kept) and the norms are not FP8
    assert fp8["memory"]["fp8_extras"] == 2 * linear + 224 * 4 * 5 * (1024 + 1) + 224 * 2 * 4
    assert [f["verdict"] for f in bf16["fits"]] == ["does not fit", "does not fit"]
    assert elapsed < 60, elapsed
    assert rss_kib * 1024 < 2 * GIB  # the 30 GiB of float32 weights were never allocated


def test_zero_sharding_follows_the_zero_paper():
    cfg = tiny_llama_cfg()
    psi = sum(p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_config(cfg).parameters())
    one = estimate_memory(cfg, ["a100-bf16"], batch_size=1, seq_len=32).recipes[0].memory
    for stage in (1, 2, 3):
        m = estimate_memory(cfg, ["a100-bf16"], batch_size=1, seq_len=32, zero=stage, num_gpus=8).recipes[0].memory
        assert m.weights == (-(-2 * psi // 8) if stage == 3 else 2 * psi)
        assert m.gradients == (-(-2 * psi // 8) if stage >= 2 else 2 * psi)
        assert m.master_weights == -(-4 * psi // 8)
        assert m.optimizer == -(-one.optimizer // 8)
    ddp = estimate_memory(cfg, ["a100-bf16"], batch_size=1, seq_len=32, num_gpus=4).recipes[0]
    assert ddp.strategy == "ddp x4" and ddp.memory.ddp_buckets == one.gradients


def test_fit_verdicts_and_table(tmp_path):
    cfg = tiny_llama_cfg()
    est = estimate_memory(cfg, ["a100-bf16"], batch_size=1, seq_len=32, gpus=["h100-80gb", "tiny=0.0001GiB"])
    fit_big, fit_tiny = est.recipes[0].fits
    assert fit_big.verdict == "fits" and fit_big.headroom == 80 * GIB - est.recipes[0].memory.total
    assert fit_tiny.verdict == "does not fit" and fit_tiny.headroom < 0
    text = format_estimate(est)
    assert "| a100-bf16 |" in text and "h100-80gb" in text and "tiny" in text


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--batch-size", "0"], "--batch-size"),
        (["--seq-len", "-3"], "--seq-len"),
        (["--model", str(ROOT / "examples" / "model_configs" / "gpt2"), "--seq-len", "100000"], "--seq-len"),
        (["--zero", "4"], "--zero"),
        (["--num-gpus", "0"], "--num-gpus"),
        (["--optimizer", "lion"], "--optimizer"),
        (["--gpu", "h900-1tb"], "--gpu"),
        (["--recipes", "no-such-recipe"], "no-such-recipe"),
        (["--model", "/nonexistent/dir"], "--model"),
        (["--config", "/nonexistent/config.json"], "--config"),
    ],
)
def test_cli_refuses_bad_flags_with_one_line_and_exit_2(args, names, capsys):
    from hf_mixedprec.cli.app import main

    rc = main(["estimate", "--recipes", "cpu-bf16", "--batch-size", "1", "--seq-len", "64", *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert names in err and "Traceback" not in err
    assert len(err.splitlines()) == 1, err


def test_config_file_without_model_type_is_refused(tmp_path, capsys):
    from hf_mixedprec.cli.app import main

    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"hidden_size": 8}))
    assert main(["estimate", "--config", str(bad), "--recipes", "cpu-bf16"]) == 2
    assert "model_type" in capsys.readouterr().err


def test_a_model_whose_step_cannot_run_on_fake_tensors_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    from transformers import AutoConfig

    import hf_mixedprec.commands.estimate_step as estimate_step
    from hf_mixedprec.cli.app import main

    AutoConfig.for_model("llama", **TINY_LLAMA).save_pretrained(tmp_path)

    def unsupported(*args, **kwargs):  # what an op without a fake-tensor kernel raises
        raise NotImplementedError("aten::made_up_op: no fake implementation")

    monkeypatch.setattr(estimate_step, "_fake_step", unsupported)  # _run_fake_step looks it up there
    assert main(["estimate", "--model", str(tmp_path), "--recipes", "a100-bf16", "--seq-len", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'llama'" in err and "a100-bf16" in err and "made_up_op" in err, err


def test_estimating_leaves_a_live_accelerator_working():
    # TrainingArguments (built to find Trainer's optimizer) resets Accelerate's shared state; finetune estimates
    # after training, before it saves the model through that same Accelerator
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    acc = Accelerator(cpu=True)
    estimate_memory(tiny_llama_cfg(), ["cpu-bf16"], batch_size=1, seq_len=16, target="cpu")
    assert acc.distributed_type == DistributedType.NO and acc.state.initialized


def test_the_default_model_is_the_one_finetune_builds():
    from hf_mixedprec.core.demo import TRAINED_VOCAB

    est = estimate_memory(None, ["cpu-bf16"], batch_size=1, seq_len=1024, target="cpu")
    from hf_mixedprec.core.demo import small_llama

    model = small_llama(vocab_size=TRAINED_VOCAB, max_position_embeddings=1024)
    assert est.parameters == sum(p.numel() for p in model.parameters())
    assert est.recipes[0].memory.weights == 4 * est.parameters  # a seq_len above 512 grows the positions, as finetune


def test_estimate_with_the_torchao_backend():
    """A recipe naming fp8.backend torchao is estimated with torchao's layers (sampled by probes beside them)."""
    from hf_mixedprec.commands.estimate import estimate_memory
    from hf_mixedprec.core.demo import tiny_llama_config
    from hf_mixedprec.integrations.recipe import resolve_recipe

    ao = resolve_recipe({"name": "ao", "extends": "h100-fp8-current", "fp8": {"backend": "torchao"}})
    est = estimate_memory(tiny_llama_config(), [ao, "a100-bf16"], batch_size=2, seq_len=64)
    fp8, bf16 = est.recipes
    assert fp8.fp8_backend == "torchao" and fp8.fp8_layers == 14
    assert fp8.memory.weights == bf16.memory.weights and fp8.memory.optimizer == bf16.memory.optimizer
    assert 0 < fp8.memory.activations < bf16.memory.activations  # torchao saves FP8 casts of the inputs
