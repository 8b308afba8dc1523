"""Client shapes: the package used the way a stranger's training code uses it (CPU, real libraries, no mocks).

Each test writes what a user would write with transformers / accelerate / TRL / PEFT and applies one recipe:
``cpu-bf16`` (native), ``v100-fp16`` (rehearsed: a real torch GradScaler under autocast(float16)) and
``h100-fp8-delayed`` (rehearsed: emulated FP8 Linears). The shapes:

1. the stock model loss (the shape the package was built against; the reference)
2. ``TrainingArguments(label_smoothing_factor=0.1)``: Trainer computes the loss from the logits
3. ``Trainer(compute_loss_func=...)``
4. a ``Trainer`` subclass overriding ``compute_loss`` (the labels never reach the model)
5. gradient accumulation (2) with a loss computed outside the model
6. attaching after construction: ``trainer.add_callback`` with the instances, with the class (recipe from the
   environment), and ``attach(trainer, recipe)``
7. TRL ``SFTTrainer`` with a plain ``SFTConfig`` and with ``recipe.training_args(args_class=SFTConfig)``
8. a PEFT LoRA model with a loss computed outside the model
9. a hand-written Accelerate loop with its own loss, gradient accumulation 2 and ``clip_grad_norm_``

Every run must meet one contract, checked by :func:`check`: every trainable weight moves, frozen weights do not,
the runtime saw every optimizer step, ``mp/skipped_steps`` ends at 0 on finite losses, and ``log_history`` has no
``mp/`` row without ``loss``. With ``inject=True`` the loss of one optimizer step (:data:`INJECT_AT`) is made
inf (``loss + inf``: its gradients stay finite, so only a runtime that sees the back-propagated loss can tell);
that step must be skipped exactly: every parameter bitwise unchanged across it and ``mp/skipped_steps`` ends at 1.

Then the errors: two MixedPrecisionCallbacks on one Trainer, one callback given to two Trainers, and an
explicit ``bf16=True`` that contradicts an fp16 recipe.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments

import hf_mixedprec
from hf_mixedprec.core.demo import builtin_text, byte_batches, tiny_llama, train_tokenizer
from hf_mixedprec.integrations.trainer import MixedPrecisionCallback, attach

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_accelerate_state")]

THREE = ["cpu-bf16", "v100-fp16", "h100-fp8-delayed"]
STEPS = 6  # optimizer steps per run
SEQ = 32  # tokens per row
BATCH = 4  # rows per micro-batch
INJECT_AT = 3  # the optimizer step (1-based) whose loss is made inf when a test injects
#: What the first decoder block's MLP computes in under each recipe (FP8 Linears sit inside BF16 autocast).
COMPUTE_DTYPE = {"cpu-bf16": torch.bfloat16, "v100-fp16": torch.float16, "h100-fp8-delayed": torch.bfloat16}


# -- what every client needs -------------------------------------------------------------------------------


def load(name: str) -> hf_mixedprec.Recipe:
    """The recipe as a user on this CPU machine loads it (rehearsed where the hardware is missing)."""
    return hf_mixedprec.load_recipe(name, rehearse=name != "cpu-bf16")


class ByteRows(Dataset):
    """Rows of UTF-8 bytes from the standard library's docstrings (vocabulary 256, the tiny Llama's)."""

    def __init__(self, n: int = 96):
        self.rows = [b[0] for b in byte_batches(builtin_text(), seq_len=SEQ, batch_size=1, n_batches=n, seed=0)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def settings(tmp_path, **overrides: Any) -> dict[str, Any]:
    """The TrainingArguments every Trainer case shares (small, one log row per optimizer step)."""
    return {
        "output_dir": str(tmp_path / "out"),
        "max_steps": STEPS,
        "per_device_train_batch_size": BATCH,
        "learning_rate": 2e-3,
        "logging_steps": 1,
        "report_to": [],
        "save_strategy": "no",
        "disable_tqdm": True,
        "seed": 0,
        **overrides,
    }


def shifted_ce(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, computed by the client outside the model."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class StepWatch(TrainerCallback):
    """Follows optimizer steps. With ``inject``, :attr:`spike` is inf during step :data:`INJECT_AT` (0 otherwise)
    and every parameter is copied just before that step's forwards and just after its optimizer step. It also
    records the dtype the first decoder block's MLP computes in (:attr:`dtypes`).

    The Accelerate loop drives it by hand through :meth:`begin` and :meth:`end`.
    """

    def __init__(self, inject: bool = False):
        self.inject = inject
        self.step = 0  # the optimizer step under way (1-based)
        self.optimizer_steps = 0
        self.before: dict[str, torch.Tensor] | None = None
        self.after: dict[str, torch.Tensor] | None = None
        self.dtypes: set[torch.dtype] = set()

    @property
    def spike(self) -> float:
        return float("inf") if self.inject and self.step == INJECT_AT else 0.0

    def begin(self, step: int, model: torch.nn.Module) -> None:
        if step == 1 and self.step == 0:
            mlp = next(m for n, m in model.named_modules() if n.endswith("layers.0.mlp"))
            mlp.register_forward_hook(lambda module, args, out: self.dtypes.add(out.dtype))
        self.step = step
        if self.spike and self.before is None:
            self.before = snapshot(model)

    def end(self, model: torch.nn.Module) -> None:
        self.optimizer_steps += 1
        if self.spike:
            self.after = snapshot(model)

    def on_step_begin(self, args, state, control, model=None, **kw):
        self.begin(state.global_step + 1, model)

    def on_optimizer_step(self, args, state, control, model=None, **kw):
        self.end(model)


def check(name: str, model, before, *, metrics, runtime, watch, rows=None) -> None:
    """The contract of every client shape (see the module docstring).

    ``name`` is the recipe, ``before`` every parameter before training, ``metrics`` the last ``mp/`` dict the
    run reported, ``runtime`` the MixedPrecisionRuntime that ran, ``rows`` Trainer's ``log_history`` (None for
    the Accelerate loop).
    """
    assert runtime.recipe.name == name
    assert watch.dtypes == {COMPUTE_DTYPE[name]}, f"computed in {watch.dtypes}, not as {name} says"
    assert watch.optimizer_steps == STEPS
    assert runtime.steps == STEPS, f"the runtime saw {runtime.steps} of {STEPS} optimizer steps"
    expected = 1.0 if watch.inject else 0.0
    assert metrics["mp/skipped_steps"] == expected, (
        f"mp/skipped_steps={metrics['mp/skipped_steps']} after {STEPS} steps (expected {expected}); "
        f"notes: {runtime.notes}"
    )
    after = dict(model.named_parameters())
    assert set(after) == set(before)
    frozen = [n for n, p in after.items() if not p.requires_grad]
    trainable = [n for n, p in after.items() if p.requires_grad]
    assert all(torch.equal(before[n], after[n]) for n in frozen), "a frozen weight moved"
    still = [n for n in trainable if torch.equal(before[n], after[n])]
    assert not still, f"{len(still)} of {len(trainable)} trainable weights never moved, e.g. {still[:3]}"
    if watch.inject:
        assert watch.before is not None and watch.after is not None
        changed = [n for n in watch.before if not torch.equal(watch.before[n], watch.after[n])]
        assert not changed, f"the inf-loss step {INJECT_AT} changed {len(changed)} weights, e.g. {changed[:3]}"
    if rows is not None:
        orphans = [r for r in rows if any(k.startswith("mp/") for k in r) and "loss" not in r]
        assert not orphans, f"{len(orphans)} log rows have mp/ metrics but no loss, e.g. {orphans[0]}"
        losses = [r for r in rows if "loss" in r]
        assert [r["step"] for r in losses] == list(range(1, STEPS + 1)), "one loss row per logging step"
        assert all(math.isfinite(r["loss"]) and "mp/skipped_steps" in r for r in losses)


def train_and_check(name: str, trainer: Trainer, watch: StepWatch, cb: MixedPrecisionCallback | None = None) -> None:
    """``trainer.train()``, then :func:`check` on what the run logged. ``cb`` defaults to the one attached."""
    before = snapshot(trainer.model)
    trainer.train()
    if cb is None:
        (cb,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, MixedPrecisionCallback)]
    rows = trainer.state.log_history
    last = [r for r in rows if "mp/skipped_steps" in r][-1]  # cumulative: the run's total
    check(name, trainer.model, before, metrics=last, runtime=cb.runtime, watch=watch, rows=rows)


# -- the Trainer shapes -------------------------------------------------------------------------------------


class OwnLossTrainer(Trainer):
    """A user's Trainer: the loss comes from the logits; the labels never reach the model."""

    watch: StepWatch

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        loss = shifted_ce(outputs.logits, labels) + self.watch.spike
        return (loss, outputs) if return_outputs else loss


def build_trainer(
    shape: str, name: str, tmp_path, watch: StepWatch, *, how: str = "callbacks", model=None, **targs: Any
) -> Trainer:
    """A Trainer of ``shape`` with recipe ``name`` attached ``how``:

    - ``callbacks``: ``Trainer(..., callbacks=recipe.callbacks())``, arguments from ``recipe.training_args``;
    - ``add_instances``: ``trainer.add_callback(cb)`` for each of ``recipe.callbacks()`` after construction;
    - ``add_class``: ``trainer.add_callback(MixedPrecisionCallback)``, the recipe named only in the environment
      and the arguments a plain ``TrainingArguments`` (no precision flags at all);
    - ``attach``: ``hf_mixedprec.integrations.trainer.attach(trainer, recipe)``.
    """
    recipe = load(name)
    model = model if model is not None else tiny_llama()
    kw: dict[str, Any] = {}
    if shape == "model_loss" and watch.inject:

        def spike(module, args, output):
            output.loss = output.loss + watch.spike
            return output

        model.register_forward_hook(spike)
    if shape == "label_smoothing":
        targs["label_smoothing_factor"] = 0.1
    if shape == "compute_loss_func":

        def fn(outputs, labels, num_items_in_batch=None):
            return shifted_ce(outputs.logits, labels) + watch.spike

        kw["compute_loss_func"] = fn
    cls = OwnLossTrainer if shape == "compute_loss" else Trainer
    if how == "add_class":
        args = TrainingArguments(**settings(tmp_path, **targs))
    else:
        args = recipe.training_args(**settings(tmp_path, **targs))
    callbacks = [watch, *recipe.callbacks()] if how == "callbacks" else [watch]
    trainer = cls(model=model, args=args, train_dataset=ByteRows(), callbacks=callbacks, **kw)
    if isinstance(trainer, OwnLossTrainer):
        trainer.watch = watch
    if how == "add_instances":
        for cb in recipe.callbacks():
            trainer.add_callback(cb)
    elif how == "add_class":
        trainer.add_callback(MixedPrecisionCallback)
    elif how == "attach":
        attach(trainer, recipe)
    return trainer


@pytest.mark.parametrize("name", THREE)
@pytest.mark.parametrize("shape", ["model_loss", "label_smoothing", "compute_loss_func", "compute_loss"])
def test_trainer_shape(tmp_path, shape, name):
    watch = StepWatch()
    train_and_check(name, build_trainer(shape, name, tmp_path, watch), watch)


@pytest.mark.parametrize("name", THREE)
@pytest.mark.parametrize("shape", ["model_loss", "compute_loss_func", "compute_loss"])
def test_trainer_shape_skips_an_inf_loss(tmp_path, shape, name):
    watch = StepWatch(inject=True)
    train_and_check(name, build_trainer(shape, name, tmp_path, watch), watch)


@pytest.mark.parametrize("name", THREE)
def test_gradient_accumulation_with_own_loss(tmp_path, name):
    watch = StepWatch()
    tr = build_trainer("compute_loss_func", name, tmp_path, watch, gradient_accumulation_steps=2)
    train_and_check(name, tr, watch)


def test_gradient_accumulation_skips_an_inf_loss(tmp_path):
    """Both micro-batches of step INJECT_AT carry the inf; under FP16 the GradScaler sees finite gradients."""
    name, watch = "v100-fp16", StepWatch(inject=True)
    tr = build_trainer("compute_loss", name, tmp_path, watch, gradient_accumulation_steps=2)
    train_and_check(name, tr, watch)


# -- attaching after construction ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", THREE)
@pytest.mark.parametrize("how", ["add_instances", "add_class", "attach"])
def test_attached_after_construction(tmp_path, monkeypatch, how, name):
    """An inf loss is injected too: ``mp/skipped_steps`` must end at exactly 1 (the finite steps all taken)."""
    if how == "add_class":  # the callback loads its recipe with hf_mixedprec.load_recipe(): from the environment
        monkeypatch.setenv("HF_MIXEDPREC_RECIPE", name)
        monkeypatch.setenv("HF_MIXEDPREC_REHEARSE", "0" if name == "cpu-bf16" else "1")
    watch = StepWatch(inject=True)
    train_and_check(name, build_trainer("compute_loss_func", name, tmp_path, watch, how=how), watch)


# -- TRL ----------------------------------------------------------------------------------------------------

TRL_METRICS = ("entropy", "mean_token_accuracy", "num_tokens")  # what SFTTrainer logs next to its loss


@pytest.fixture(scope="module")
def sft_data():
    """A tokenizer trained on the spot and a small text dataset (no hub)."""
    from datasets import Dataset as HFDataset

    text = builtin_text()
    tok = train_tokenizer(text, vocab_size=512)
    ds = HFDataset.from_dict({"text": [text[i : i + 300] for i in range(0, 300 * 2 * BATCH * STEPS, 300)]})
    return tok, ds


@pytest.mark.parametrize("name", THREE)
@pytest.mark.parametrize("config", ["plain", "training_args"])
def test_sft_trainer(tmp_path, sft_data, config, name):
    """``SFTConfig`` as a TRL user writes it (``bf16`` left unset, which TRL turns into True; ``use_cpu`` because
    this is a CPU machine), and as ``recipe.training_args(args_class=SFTConfig)`` builds it."""
    from trl import SFTConfig, SFTTrainer

    tok, ds = sft_data
    recipe, watch = load(name), StepWatch()
    kw = settings(tmp_path, max_length=SEQ)
    cfg = SFTConfig(**kw, use_cpu=True) if config == "plain" else recipe.training_args(args_class=SFTConfig, **kw)
    cb = recipe.callbacks()[0]
    tr = SFTTrainer(
        model=tiny_llama(vocab_size=len(tok)), args=cfg, train_dataset=ds, processing_class=tok, callbacks=[watch, cb]
    )
    train_and_check(name, tr, watch, cb)
    rows = [r for r in tr.state.log_history if "loss" in r]
    assert all(set(TRL_METRICS) <= set(r) for r in rows), f"TRL's metrics left the loss row: {rows[0]}"
    if config == "plain" and name == "v100-fp16":
        assert any("bf16" in n for n in cb.runtime.notes), cb.runtime.notes  # TRL's default, fixed and said


# -- PEFT ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", THREE)
def test_peft_lora_with_own_loss(tmp_path, name):
    """LoRA adapters train, the frozen base does not (checked for every parameter by :func:`check`)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    watch = StepWatch()
    train_and_check(name, build_trainer("compute_loss_func", name, tmp_path, watch, model=model), watch)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names and all(".lora_" in n for n in names)


# -- a hand-written Accelerate loop ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", THREE)
@pytest.mark.parametrize("inject", [False, True], ids=["finite", "inf_loss"])
def test_accelerate_loop_with_own_loss(name, inject):
    """The loop from Accelerate's gradient-accumulation guide, the loss computed outside the model."""
    recipe, watch = load(name), StepWatch(inject=inject)
    accelerator = recipe.accelerator(gradient_accumulation_steps=2)
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    loader = DataLoader(ByteRows(n=2 * BATCH * STEPS), batch_size=BATCH)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    before = snapshot(model)
    model.train()
    for i, batch in enumerate(loader):
        if i % 2 == 0:
            watch.begin(i // 2 + 1, model)
        with accelerator.accumulate(model):
            ids = batch["input_ids"]
            logits = model(input_ids=ids).logits
            loss = shifted_ce(logits, ids) + watch.spike
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        if accelerator.sync_gradients:
            watch.end(model)
    metrics = accelerator.mp_metrics()
    check(name, accelerator.unwrap_model(model), before, metrics=metrics, runtime=accelerator.mp, watch=watch)


# -- errors ---------------------------------------------------------------------------------------------------


def untouched(model, before, watch) -> None:
    """Nothing trained: no optimizer step, every weight bitwise as it was."""
    assert watch.optimizer_steps == 0
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


@pytest.mark.parametrize("how", ["callbacks_twice", "callbacks_then_add_callback"])
def test_two_callbacks_on_one_trainer_are_refused(tmp_path, how):
    recipe, watch, model = load("cpu-bf16"), StepWatch(), tiny_llama()
    before = snapshot(model)
    args = recipe.training_args(**settings(tmp_path))
    first = [*recipe.callbacks(), *recipe.callbacks()] if how == "callbacks_twice" else recipe.callbacks()
    with pytest.raises(RuntimeError, match="more than one MixedPrecisionCallback"):
        tr = Trainer(model=model, args=args, train_dataset=ByteRows(), callbacks=[watch, *first])
        if how == "callbacks_then_add_callback":
            tr.add_callback(recipe.callbacks()[0])
        tr.train()
    untouched(model, before, watch)


def test_one_callback_on_two_trainers_is_refused(tmp_path):
    recipe = load("cpu-bf16")
    cbs = recipe.callbacks()
    args = recipe.training_args(**settings(tmp_path))
    Trainer(model=tiny_llama(), args=args, train_dataset=ByteRows(), callbacks=cbs)
    watch, model = StepWatch(), tiny_llama(seed=1)
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="already attached"):
        Trainer(model=model, args=args, train_dataset=ByteRows(), callbacks=[watch, *cbs]).train()
    untouched(model, before, watch)


def test_explicit_bf16_contradicting_an_fp16_recipe_is_refused(tmp_path):
    """The user wrote ``bf16=True`` (not a library default): still an error naming the key."""
    recipe, watch, model = load("v100-fp16"), StepWatch(), tiny_llama()
    before = snapshot(model)
    args = TrainingArguments(**settings(tmp_path), bf16=True, use_cpu=True)
    with pytest.raises(ValueError, match=r"TrainingArguments\.bf16=True"):
        Trainer(model=model, args=args, train_dataset=ByteRows(), callbacks=[watch, *recipe.callbacks()]).train()
    untouched(model, before, watch)
