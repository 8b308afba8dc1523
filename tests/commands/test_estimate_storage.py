"""``estimate`` reads the precision plan: every ``storage:`` choice, against one real CPU Trainer step.

For each choice a recipe ``extends: a100-bf16`` with its ``storage:`` is estimated, and the same recipe trains one
real step of the same model under ``recipe.callbacks()``. At ``on_optimizer_step`` (after the step, before
``zero_grad``) the test counts the real tensors: the Parameters, their ``.grad``, and ``optimizer.state`` by name
(torchao's low-bit states through their inner tensors, ``__tensor_flatten__``; StorageAdamW's ``remainder`` and
``compensation`` as master). Weights, master, gradients and each optimizer state must be equal to the byte;
activations (the test's own saved-tensors record) within 5%.
"""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
import torch
from transformers import AutoModelForCausalLM, TrainerCallback

from hf_mixedprec.commands.estimate import OPTIMIZERS, estimate_memory, format_estimate
from hf_mixedprec.core.demo import tiny_llama_config
from hf_mixedprec.core.errors import RecipeError
from hf_mixedprec.integrations.recipe import resolve_recipe
from tests.commands.test_estimate import BATCH, ROOT, _Ids, _MeasuringTrainer

#: (master, optimizer_states): every master with FP32 states, BF16 states, and torchao's three low-bit layouts
CHOICES = [
    ("fp32", "fp32"),
    ("bf16_remainder", "fp32"),
    ("bf16_kahan", "fp32"),
    ("bf16_stochastic", "fp32"),
    ("none", "fp32"),
    ("fp32", "bf16"),
    ("bf16_kahan", "bf16"),
    ("fp32", "8bit"),
    ("fp32", "4bit"),
    ("fp32", "fp8"),
]
LOW_BIT = ("8bit", "4bit", "fp8")
STATE_PARTS = ("weights", "master", "gradients", "exp_avg", "exp_avg_sq", "step")


def _config(states: str):
    """The tiny Llama; for torchao's low-bit states hidden 256, so that its tensors reach the 4096 values (and the
    multiple of the block size) below which torchao keeps plain states (``torchao/optim/adam.py``)."""
    return tiny_llama_config(hidden_size=256, intermediate_size=512) if states in LOW_BIT else tiny_llama_config()


def _recipe(master: str, states: str, **extra):
    name = f"storage-{master}-{states}".replace("_", "-")
    return resolve_recipe(
        {"name": name, "extends": "a100-bf16", "storage": {"master": master, "optimizer_states": states}, **extra}
    ).rehearsed()


def _nbytes(tensors) -> int:
    """Bytes of the distinct storages behind real tensors; a tensor subclass (torchao's optimizer states) counts its
    inner tensors."""
    seen: dict[int, int] = {}
    todo = list(tensors)
    while todo:
        t = todo.pop()
        if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
            names, _ = t.__tensor_flatten__()
            todo += [getattr(t, n) for n in names]
            continue
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


class _Parts(TrainerCallback):
    """After the optimizer step, before zero_grad: the real model states, by part."""

    def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
        opt = getattr(optimizer, "optimizer", optimizer)
        self.optimizer = type(opt).__name__
        by_name = defaultdict(list)
        for st in opt.state.values():
            for key, v in st.items():
                if torch.is_tensor(v):
                    by_name[key].append(v)
        params = list(model.parameters())
        master = by_name.pop("remainder", []) + by_name.pop("compensation", [])
        self.parts = {
            "weights": _nbytes(params),
            "master": _nbytes(master),
            "gradients": _nbytes(p.grad for p in params if p.grad is not None),
            **{key: _nbytes(ts) for key, ts in by_name.items()},
        }
        self.dtypes = {p.dtype for p in params}


def _real_step(cfg, recipe, tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)  # float32, as finetune builds it
    args = recipe.training_args(
        output_dir=str(tmp_path / "run"),
        max_steps=1,
        per_device_train_batch_size=BATCH,
        optim=OPTIMIZERS["adamw"],
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
    )
    parts = _Parts()
    tr = _MeasuringTrainer(
        model=model, args=args, train_dataset=_Ids(cfg.vocab_size, BATCH), callbacks=[*recipe.callbacks(), parts]
    )
    tr.train()
    return parts, tr.peak.peak


@pytest.fixture(scope="module")
def estimates():
    """Every choice estimated once (two calls: one per model), by (master, states)."""
    from tests.commands.test_estimate import SEQ

    out = {}
    for low in (False, True):
        rows = [c for c in CHOICES if (c[1] in LOW_BIT) == low]
        cfg = _config(rows[0][1])
        est = estimate_memory(cfg, [_recipe(*c) for c in rows], batch_size=BATCH, seq_len=SEQ, target="cpu")
        out.update(zip(rows, est.recipes, strict=True))
    return out


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize(("master", "states"), CHOICES, ids=[f"{m}-{s}" for m, s in CHOICES])
def test_estimate_equals_a_real_trainer_step_for_each_storage_choice(estimates, master, states, tmp_path):
    est = estimates[(master, states)]
    real, activations = _real_step(_config(states), _recipe(master, states), tmp_path)
    assert real.optimizer == (est.storage["optimizer"] if est.storage["optimizer"] != "unchanged" else "AdamW")
    assert est.components == {k: real.parts.get(k, 0) for k in STATE_PARTS}, (est.components, real.parts)
    assert set(real.parts) <= set(STATE_PARTS)
    mem = est.memory
    assert mem.weights == real.parts["weights"] and mem.master_weights == real.parts["master"]
    assert mem.gradients == real.parts["gradients"]
    assert mem.optimizer == real.parts["exp_avg"] + real.parts["exp_avg_sq"] + real.parts["step"]
    assert real.dtypes == {torch.float32 if master == "fp32" else torch.bfloat16}
    assert abs(mem.activations - activations) <= 0.05 * activations, (mem.activations, activations)
    n = est.memory.weights // (4 if master == "fp32" else 2)
    assert est.bytes_per_param == round((mem.weights + mem.master_weights + mem.gradients + mem.optimizer) / n, 4)


def test_bytes_per_param_by_choice(estimates):
    """The ZeRO paper's 16 bytes per parameter (Sec. 3.1: 2 + 2 + 12 for fp16 weights, gradients and fp32 master,
    momentum and variance; here 4 + 4 + 8 with autocast's float32 weights), and what each choice takes off it."""
    got = {c: e.bytes_per_param for c, e in estimates.items()}
    want = {
        ("fp32", "fp32"): 16,
        ("bf16_remainder", "fp32"): 14,
        ("bf16_kahan", "fp32"): 14,
        ("bf16_stochastic", "fp32"): 12,
        ("none", "fp32"): 12,
        ("fp32", "bf16"): 12,
        ("bf16_kahan", "bf16"): 10,
    }
    for choice, b in want.items():
        assert b < got[choice] < b + 0.001, (choice, got[choice])  # + a float32 step per tensor
    # torchao: 1 byte (8bit, fp8) or half a byte (4bit) per value and a float32 scale per block, per state
    assert 10.0 < got[("fp32", "fp8")] < got[("fp32", "8bit")] < 10.1
    assert 9.0 < got[("fp32", "4bit")] < 9.1


def test_deepspeed_maps_master_none_and_bf16_states_to_two_bytes():
    cfg = tiny_llama_config()
    psi = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    ds = {"distributed": {"strategy": "deepspeed", "zero_stage": 1, "num_processes": 8}}
    kw = {"batch_size": 1, "seq_len": 32}
    classic, low = (
        estimate_memory(cfg, [_recipe(*c, **ds)], **kw).recipes[0] for c in (("fp32", "fp32"), ("none", "bf16"))
    )
    tensors = len(list(AutoModelForCausalLM.from_config(cfg).parameters()))
    for r, master, state in ((classic, 4, 4), (low, 2, 2)):
        assert r.strategy == "deepspeed ZeRO-1 x8"
        assert r.memory.weights == r.memory.gradients == 2 * psi  # DeepSpeed's BF16 module, not sharded at stage 1
        assert r.memory.master_weights == -(-master * psi // 8)
        assert r.components["exp_avg"] == r.components["exp_avg_sq"] == -(-state * psi // 8)
        assert r.memory.optimizer == -(-(2 * state * psi + 4 * tensors) // 8)
    assert classic.memory.activations == low.memory.activations  # DeepSpeed's own BF16 module either way
    with pytest.raises(RecipeError, match="has no DeepSpeed equivalent"):  # FP32 states by a BF16 master: offload only
        _recipe("none", "fp32", **ds)


@pytest.mark.parametrize(
    ("master", "states"), [("fp32", "fp32"), ("bf16_remainder", "fp32"), ("bf16_stochastic", "bf16")]
)
def test_fsdp2_shards_every_component_of_every_storage_choice_and_refuses_4bit_states(master, states):
    """FSDP2 shards weights, master, gradients and optimizer states of every StorageAdamW choice (each rank's shard
    of each, tests/fsdp2_estimate.py measures them); torchao's 4-bit states are refused with it."""
    cfg = tiny_llama_config()
    one = estimate_memory(cfg, [_recipe(master, states)], batch_size=1, seq_len=32).recipes[0]
    fsdp = {"distributed": {"strategy": "fsdp2", "num_processes": 4}}
    four = estimate_memory(cfg, [_recipe(master, states, **fsdp)], batch_size=1, seq_len=32).recipes[0]
    assert four.strategy == "fsdp2 x4"
    for key, value in one.components.items():
        assert four.components[key] == -(-value // 4), key
    assert four.bytes_per_param == pytest.approx(one.bytes_per_param / 4, abs=1e-3)
    with pytest.raises(RecipeError, match=r"4bit with master fp32 is not supported with distributed\.strategy fsdp2"):
        _recipe("fp32", "4bit", **fsdp)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--optimizer", "sgd"], "--optimizer sgd: recipe 'storage-bf16-kahan-bf16' keeps storage.master bf16_kahan"),
        (["--zero", "2"], "--zero 2: recipe 'storage-bf16-kahan-bf16': storage.master: master bf16_kahan"),
    ],
)
def test_what_a_run_would_refuse_is_refused_in_one_line(tmp_path, capsys, args, message):
    from hf_mixedprec.cli.app import main

    path = tmp_path / "kahan.yaml"
    body = {"name": "storage-bf16-kahan-bf16", "extends": "a100-bf16"}
    body["storage"] = {"master": "bf16_kahan", "optimizer_states": "bf16"}
    path.write_text(json.dumps(body))
    assert main(["estimate", "--recipes", str(path), "--batch-size", "1", "--seq-len", "32", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_json_and_table_carry_the_parts_and_bytes_per_param(capsys):
    from hf_mixedprec.cli.app import main

    recipes = ",".join(str(ROOT / "examples" / "recipes" / f"storage-{c}.yaml") for c in ("fp32", "bf16_remainder"))
    assert main(["estimate", "--recipes", recipes, "--batch-size", "1", "--seq-len", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    fp32, rem = out["recipes"]
    assert set(fp32["components"]) == set(STATE_PARTS)
    assert rem["storage"] == {"master": "bf16_remainder", "optimizer_states": "fp32", "optimizer": "StorageAdamW"}
    assert rem["components"]["master"] == rem["components"]["weights"] == rem["memory"]["master_weights"]
    assert 16 <= fp32["bytes_per_param"] < 16.001 and 14 <= rem["bytes_per_param"] < 14.001
    est = estimate_memory(None, [str(ROOT / "examples" / "recipes" / "storage-fp32.yaml")], seq_len=64)
    text = format_estimate(est)
    assert "| B/param |" in text and "| 16.00 |" in text


def test_sgd_and_adafactor_keep_the_measured_state_by_name():
    cfg = tiny_llama_config()
    sgd, ada = (
        estimate_memory(cfg, ["a100-bf16"], batch_size=1, seq_len=32, optimizer=o).recipes[0]
        for o in ("sgd", "adafactor")
    )
    assert set(sgd.components) == {"weights", "master", "gradients"} and sgd.memory.optimizer == 0
    assert {"exp_avg_sq_row", "exp_avg_sq_col"} <= set(ada.components)
    assert sum(v for k, v in ada.components.items() if k not in ("weights", "master", "gradients")) == (
        ada.memory.optimizer
    )


def test_the_docs_storage_table_is_what_its_command_prints(capsys):
    """docs/estimate.md's "Storage precision" table is the real output of the command above it, run here."""
    import shlex

    from hf_mixedprec.cli.app import main

    text = (ROOT / "docs" / "estimate.md").read_text()
    section = text[text.index("## Storage precision") :]
    command = section.split("```bash\n", 1)[1].split("```", 1)[0].strip()
    shown = section.split("```", 2)[2].split("\n\n", 2)[1]
    tokens = shlex.split(command)
    assert tokens[:2] == ["hf-mixedprec", "estimate"] and "--model" not in tokens  # finetune's default model
    assert main(tokens[1:]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert printed == shown.splitlines()
    assert len(printed) == 2 + 11


def test_the_example_storage_recipes_validate(capsys):
    from hf_mixedprec.cli.app import main

    files = sorted(str(p) for p in (ROOT / "examples" / "recipes").glob("storage-*.yaml"))
    assert len(files) >= 11
    assert main(["validate", *files]) == 0
    assert capsys.readouterr().out.count(": ok (") == len(files)
