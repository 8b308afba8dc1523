"""One installer for every entry point: a recipe put on a Trainer (callback, ``attach``, a callback added after
construction) and on the Accelerate plugin's Accelerator installs the same loss scaler, the same autocast and the
same notes about them, for every built-in recipe; observed on one real training step of each."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from accelerate.state import AcceleratorState
from transformers import Trainer

from hf_mixedprec.core.demo import tiny_llama
from hf_mixedprec.integrations.install import GUARD_NOTE, accelerate_scaler_matches
from hf_mixedprec.integrations.recipe import load_recipe
from hf_mixedprec.integrations.trainer import attach, runtime_of
from hf_mixedprec.recipes.files import builtin_recipe_names

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

RECIPES = builtin_recipe_names()
SEQ = 16
#: note fragments about who scales the loss and who autocasts: what the installer decides, the same at every door
INSTALLER_NOTES = ("GradScaler", "autocast", "hysteresis", "phased recipe")


def _reset() -> None:
    AcceleratorState._reset_state(reset_partial_state=True)


def _hysteresis_recipe(tmp_path: Any) -> Any:
    """v100-fp16 asking for DeepSpeed's hysteresis 2, which torch's GradScaler cannot apply."""
    path = tmp_path / "hysteresis.yaml"
    path.write_text("name: hysteresis\nextends: v100-fp16\nloss_scale:\n  hysteresis: 2\n")
    return load_recipe(str(path), rehearse=True)


def _fp16_accelerator_like_a_gpu(scaler: torch.amp.GradScaler, handler: Any) -> Any:
    """A CPU Accelerator in the state Accelerate builds for fp16 on a GPU: native AMP, ``scaler`` made from
    ``handler`` (its GradScalerKwargs)."""
    from accelerate import Accelerator

    from hf_mixedprec.core._private import set_mixed_precision

    _reset()
    acc = Accelerator(cpu=True)
    acc.native_amp, acc.scaler, acc.scaler_handler = True, scaler, handler
    set_mixed_precision(acc, "fp16")
    return acc


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.arange(2 * SEQ).reshape(2, SEQ) % 97
    return {"input_ids": ids, "labels": ids.clone()}


class _Seen:
    """What the forward of the first decoder layer's q_proj ran under (autocast on CPU and its dtype)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.autocast: list[str] = []
        target = dict(model.named_modules())["model.layers.0.mlp"]
        target.register_forward_pre_hook(self._hook)

    def _hook(self, module: torch.nn.Module, args: Any) -> None:
        if module.training:
            on = torch.is_autocast_enabled("cpu")
            self.autocast.append(str(torch.get_autocast_dtype("cpu")).removeprefix("torch.") if on else "off")


def _observed(rt: Any, seen: _Seen) -> dict[str, Any]:
    scaler = rt.scaler
    return {
        "scaler": type(scaler).__name__,
        "guard": rt.guard,
        "settings": None
        if rt.guard
        else (
            scaler.get_scale(),
            scaler.get_growth_factor(),
            scaler.get_backoff_factor(),
            scaler.get_growth_interval(),
        ),
        "autocast": seen.autocast,
        "notes": sorted(n for n in rt.notes if any(k in n for k in INSTALLER_NOTES)),
    }


def _through_plugin(recipe: Any) -> dict[str, Any]:
    _reset()
    acc = recipe.accelerator(cpu=True, max_steps=2)
    model = tiny_llama(0)
    seen = _Seen(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    model.train()
    loss = model(**_batch()).loss
    acc.backward(loss)
    acc.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return _observed(acc.mp, seen)


class _Data(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[0] for k, v in _batch().items()}


def _through_trainer(recipe: Any, tmp_path: Any, how: str) -> dict[str, Any]:
    _reset()
    model = tiny_llama(0)
    seen = _Seen(model)
    args = recipe.training_args(
        output_dir=str(tmp_path / how),
        max_steps=1,
        per_device_train_batch_size=2,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
    )
    callbacks = recipe.callbacks() if how == "callbacks" else []
    trainer = Trainer(model=model, args=args, train_dataset=_Data(), callbacks=callbacks)
    if how == "attach":
        attach(trainer, recipe)
    elif how == "add_callback":
        trainer.add_callback(recipe.callbacks()[0])
    trainer.train()
    rt = runtime_of(trainer)
    assert rt is not None
    return _observed(rt, seen)


@pytest.mark.parametrize("name", RECIPES)
def test_the_trainer_and_the_plugin_install_the_same_scaler_autocast_and_notes(name, tmp_path):
    recipe = load_recipe(name, rehearse=True)
    plugin = _through_plugin(recipe)
    trainer = _through_trainer(recipe, tmp_path, "callbacks")
    assert trainer == plugin
    # and what it is, by precision
    want = {"fp16": "float16", "bf16": "bfloat16", "fp8": "bfloat16", "fp32": "off"}[recipe.precisions()[0]]
    assert plugin["autocast"] == [want]
    if recipe.precision == "fp16" and recipe.phases is None:
        ls = recipe.loss_scale
        assert plugin["scaler"] == "GradScaler" and not plugin["guard"]
        assert plugin["settings"][1:] == (ls.growth_factor, ls.backoff_factor, ls.growth_interval)
    else:
        assert plugin["guard"] and plugin["scaler"] in ("GuardScaler", "PhaseScaler")
        assert GUARD_NOTE in plugin["notes"]


@pytest.mark.parametrize("how", ["attach", "add_callback"])
@pytest.mark.parametrize("name", ["v100-fp16", "h100-fp8-delayed"])
def test_attach_and_a_late_callback_install_what_the_callback_does(name, how, tmp_path):
    """``attach`` installs before the model is prepared, as the callback does; a callback added after construction
    finds the model prepared without the recipe's autocast (FP16 on CPU: Accelerate runs none), wraps it itself and
    says so, with the same scaler and the same autocast inside the forward."""
    recipe = load_recipe(name, rehearse=True)
    got, want = _through_trainer(recipe, tmp_path, how), _through_trainer(recipe, tmp_path, "callbacks")
    if how == "add_callback" and recipe.precision == "fp16":
        assert want["notes"][-1].endswith("native-AMP path (Accelerate runs no fp16 on cpu)")
        late = (
            "fp16 autocast installed by hf_mixedprec (Accelerate's mixed_precision is 'fp16', callback added after "
            "the model was prepared)"
        )
        want["notes"] = sorted([*want["notes"], late])
    assert got == want


def test_a_loss_scale_hysteresis_is_said_at_every_door(tmp_path):
    """torch's GradScaler backs off on every overflow: a recipe asking for DeepSpeed's hysteresis 2 is told so, once,
    through the plugin and the Trainer alike."""
    recipe = _hysteresis_recipe(tmp_path)
    plugin = _through_plugin(recipe)
    said = [n for n in plugin["notes"] if "hysteresis 2 is applied by DeepSpeed only" in n]
    assert len(said) == 1, plugin["notes"]
    assert _through_trainer(recipe, tmp_path, "callbacks") == plugin


def test_the_plugin_adopts_accelerates_scaler_only_with_the_recipes_settings(tmp_path):
    """On a GPU Accelerate builds its GradScaler from the plugin's GradScalerKwargs (the recipe's settings, merged with
    the user's), so the runtime adopts it; an Accelerator built with other settings (a Trainer's: torch's defaults)
    gets the recipe's in its place. Either way the hysteresis the GradScaler cannot apply is said once (the plugin's
    adoption said nothing before the installer was shared)."""
    from accelerate.utils import GradScalerKwargs

    from hf_mixedprec.integrations.install import grad_scaler_kwargs, install_loss_scaling
    from hf_mixedprec.training.runtime import MixedPrecisionRuntime

    recipe = _hysteresis_recipe(tmp_path)

    def hysteresis_notes(rt: MixedPrecisionRuntime) -> int:
        return sum("hysteresis 2 is applied by DeepSpeed only" in n for n in rt.notes)

    acc = _fp16_accelerator_like_a_gpu(
        torch.amp.GradScaler("cpu", init_scale=2.0**10), GradScalerKwargs(init_scale=2.0**10)
    )
    assert not accelerate_scaler_matches(acc, recipe)
    theirs = acc.scaler
    rt = MixedPrecisionRuntime(recipe, rehearse=True)
    assert install_loss_scaling(acc, rt) is acc.scaler is rt.scaler is not theirs
    assert acc.scaler.get_scale() == recipe.loss_scale.init_scale
    assert hysteresis_notes(rt) == 1
    acc.scaler_handler, acc.scaler = grad_scaler_kwargs(recipe), theirs
    assert accelerate_scaler_matches(acc, recipe)
    rt = MixedPrecisionRuntime(recipe, rehearse=True)
    assert install_loss_scaling(acc, rt) is theirs is rt.scaler
    assert hysteresis_notes(rt) == 1 and not rt.guard


def test_a_replaced_scaler_keeps_the_class_accelerate_chose():
    """Under FSDP1 Accelerate builds a ``ShardedGradScaler`` (its found-inf flag is reduced over ranks); a recipe with
    other loss-scale settings replaces it with one of the same class, not with a plain GradScaler."""
    from accelerate.utils import GradScalerKwargs
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from hf_mixedprec.integrations.install import install_loss_scaling
    from hf_mixedprec.training.runtime import MixedPrecisionRuntime

    recipe = load_recipe("v100-fp16", rehearse=True)
    # as FSDP1 on a GPU would build it
    acc = _fp16_accelerator_like_a_gpu(
        ShardedGradScaler("cpu", init_scale=2.0**10), GradScalerKwargs(init_scale=2.0**10)
    )
    theirs = acc.scaler
    rt = MixedPrecisionRuntime(recipe, rehearse=True)
    got = install_loss_scaling(acc, rt)
    assert got is acc.scaler is rt.scaler is not theirs
    assert type(got) is ShardedGradScaler and got.get_scale() == recipe.loss_scale.init_scale


@pytest.mark.parametrize(
    "recipe_yaml",
    [
        "precision: fp32\n",
        "phases:\n  - {name: warm, start: 0, precision: fp32}\n  - {name: main, start: 0.5, precision: bf16}\n",
    ],
)
def test_a_late_callback_cannot_turn_accelerates_autocast_off_so_fp32_is_refused_before_anything(recipe_yaml, tmp_path):
    """TRL's ``SFTConfig`` turns bf16 on by default, so the Trainer's Accelerator autocasts in bf16 from its
    construction. A callback added after construction cannot unwrap a prepared model: an fp32 recipe (or phase) would
    train in bf16 unsaid. It is refused at ``train()``, before the runtime, the scaler or the storage is installed."""
    from trl import SFTConfig

    path = tmp_path / "r.yaml"
    path.write_text(f"name: late-fp32\nextends: cpu-bf16\n{recipe_yaml}")
    recipe = load_recipe(str(path), rehearse=True)
    _reset()
    args = SFTConfig(output_dir=str(tmp_path / "o"), use_cpu=True, report_to=[], max_steps=1, save_strategy="no")
    assert args.bf16  # TRL's default
    model = tiny_llama(0)
    trainer = Trainer(model=model, args=args, train_dataset=_Data())
    scaler_before = trainer.accelerator.scaler
    trainer.add_callback(recipe.callbacks()[0])
    with pytest.raises(
        ValueError,
        match="this callback was added after the Trainer prepared the model under "
        "mixed_precision='bf16', whose autocast cannot be turned off then",
    ):
        trainer.train()
    assert runtime_of(trainer) is None and trainer.accelerator.scaler is scaler_before
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_an_fsdp2_accelerator_leaves_the_autocast_to_hf_mixedprec():
    """Accelerate's FSDP2 preparation (``Accelerator._prepare_fsdp2``) never reaches ``prepare_model``, so it autocasts
    nothing: the compute dtype would be the FSDP2 policy's, as stored under the recipe's ``param_dtype: auto``, i.e.
    FP32 for a bf16 recipe. Under any FSDP2 Accelerator (on a GPU Accelerate builds it itself) hf_mixedprec owns it."""
    from types import SimpleNamespace

    from accelerate import Accelerator

    from hf_mixedprec.integrations.install import autocast_owner
    from hf_mixedprec.training.runtime import MixedPrecisionRuntime

    _reset()
    acc = Accelerator(cpu=True, mixed_precision="bf16")
    rt = MixedPrecisionRuntime(load_recipe("a100-bf16", rehearse=True), rehearse=True)
    assert autocast_owner(acc, rt, late=False, accelerate_wrapped=False) == "accelerate"
    acc.state.fsdp_plugin = SimpleNamespace(fsdp_version=2)  # what an FSDP2 launch config gives Accelerate's state
    try:
        assert autocast_owner(acc, rt, late=False, accelerate_wrapped=False) == "hf_mixedprec"
    finally:
        acc.state.fsdp_plugin = None


def test_preparing_a_model_again_notes_its_autocast_once():
    recipe = load_recipe("h100-fp8-anneal-bf16", rehearse=True)
    _reset()
    acc = recipe.accelerator(cpu=True, max_steps=4)
    model = tiny_llama(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    acc.prepare(model)
    assert sum(n.startswith("phased recipe: hf_mixedprec sets the autocast") for n in acc.mp.notes) == 1
