"""The fence: every private name of torch, Accelerate and transformers that the package touches is still where it
was in the installed versions (one test per name, failing with its name on an upgrade that moves it), and no module
but hf_mixedprec/core/_private.py touches one."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from hf_mixedprec.core._private import PRIVATES, Private

PKG = Path(__file__).resolve().parents[2] / "hf_mixedprec"
FENCE = PKG / "core" / "_private.py"
#: Private names of our own objects, read across our own modules (not a library's).
OURS = {"_mp_next_step", "_mp_step_pending", "_mp_model", "_legacy_notes", "_rehearse", "_unsupported_kind_notes"}


@pytest.mark.parametrize("private", PRIVATES, ids=[p.where for p in PRIVATES])
def test_each_private_name_is_still_there(private: Private):
    private.check()


def test_a_moved_private_fails_its_check_by_name():
    gone = Private("transformers:Trainer._save_checkpoint_renamed", "transformers 5.23", "writes checkpoint-N")
    with pytest.raises(
        AssertionError, match=r"transformers:Trainer\._save_checkpoint_renamed: gone from the installed"
    ):
        gone.check()


def test_the_training_loop_still_holds_the_resumed_checkpoint_under_that_name():
    """``resumed_from`` reads ``resume_from_checkpoint`` among ``Trainer._inner_training_loop``'s locals."""
    from transformers import Trainer

    assert "resume_from_checkpoint" in inspect.signature(Trainer._inner_training_loop).parameters


def _third_party_private_uses(path: Path) -> list[str]:
    names = {p.name for p in PRIVATES}
    found = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in names:
            found.append(f"{path.name}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
            found.append(f"{path.name}:{node.lineno}: {node.value!r}")  # getattr(obj, "_name")
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module
            and ".".join(node.module.split(".")[:2])
            in (
                "torch._subclasses",
                "torch._dynamo",
                "torch._C",
            )
        ):
            found.append(f"{path.name}:{node.lineno}: from {node.module}")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = ast.unparse(node.value)
            if base.split(".")[0] in ("torch", "accelerate", "transformers") and node.attr not in OURS:
                found.append(f"{path.name}:{node.lineno}: {base}.{node.attr}")
    return found


def test_no_module_but_the_fence_touches_a_library_private():
    outside = [u for f in sorted(PKG.rglob("*.py")) if f != FENCE for u in _third_party_private_uses(f)]
    assert outside == []


def test_the_scan_sees_what_it_looks_for(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import torch\n"
        "def f(trainer, scaler, opt):\n"
        "    trainer._save_checkpoint = None\n"
        "    getattr(opt, '_step_supports_amp_scaling', False)\n"
        "    torch._foreach_norm([])\n"
        "    from torch._subclasses.fake_tensor import FakeTensorMode\n"
    )
    assert len(_third_party_private_uses(sample)) == 4
