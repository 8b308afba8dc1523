"""Promises that held on the callback's main path but not on the others (each test failed before its fix)."""

from __future__ import annotations

import math

import pytest
from transformers import Trainer, TrainingArguments

from hf_mixedprec.demo import tiny_llama
from hf_mixedprec.recipe import load_recipe, resolve_recipe
from tests.test_integration import Bytes

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


# -- max_grad_norm=0: the user's "no clipping" is never silently overridden by the recipe's clipper ----------------
def test_training_args_refuses_an_explicit_max_grad_norm_under_a_clipping_recipe():
    recipe = load_recipe("cpu-bf16")  # ZClip
    with pytest.raises(ValueError, match=r"max_grad_norm=0 \(Trainer's 'no clipping'\) contradicts recipe 'cpu-bf16'"):
        recipe.training_args(output_dir="/tmp/x", max_grad_norm=0)
    with pytest.raises(ValueError, match=r"max_grad_norm=0\.5 contradicts"):
        recipe.training_args(output_dir="/tmp/x", max_grad_norm=0.5)


def test_a_users_own_max_grad_norm_zero_is_refused_at_attach_and_the_packages_zero_is_not(tmp_path):
    recipe = load_recipe("cpu-bf16")
    args = TrainingArguments(output_dir=str(tmp_path), max_grad_norm=0.0, use_cpu=True, bf16=True, report_to=[])
    with pytest.raises(ValueError, match=r"max_grad_norm=0 \(Trainer's 'no clipping'\) contradicts"):
        Trainer(model=tiny_llama(0), args=args, train_dataset=Bytes(n=4), callbacks=recipe.callbacks())
    # the package's own zero survives a round trip through to_dict() (TRL converts configs that way)
    ours = recipe.training_args(output_dir=str(tmp_path), report_to=[])
    assert ours.max_grad_norm == 0 and math.copysign(1.0, ours.max_grad_norm) < 0
    again = TrainingArguments(**{k: v for k, v in ours.to_dict().items() if not k.startswith("_")})
    tr = Trainer(model=tiny_llama(0), args=again, train_dataset=Bytes(n=4), callbacks=recipe.callbacks())
    assert tr.args.max_grad_norm == 0


def test_max_grad_norm_zero_is_honoured_under_a_recipe_without_clipping(tmp_path):
    recipe = resolve_recipe({"name": "n", "extends": "cpu-bf16", "clipping": {"method": "none"}})
    args = recipe.training_args(output_dir=str(tmp_path), max_grad_norm=0, max_steps=1, report_to=[])
    Trainer(model=tiny_llama(0), args=args, train_dataset=Bytes(n=4), callbacks=recipe.callbacks())
    assert args.max_grad_norm == 0
