"""Packaging: what the one-line integration needs is a core dependency; a missing optional backend names
the extra that installs it."""

from __future__ import annotations

import re
import sys
from importlib.metadata import metadata, requires

import pytest

import hf_mixedprec


def test_the_trainer_callback_and_the_plugin_need_only_core_dependencies():
    """The installed package's metadata: requirements without an ``extra ==`` marker are core."""
    core = {re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0] for r in requires("hf_mixedprec") or [] if "extra ==" not in r}
    assert {"torch", "transformers", "accelerate"} <= core


def test_every_extra_named_in_an_install_hint_exists():
    extras = set(metadata("hf_mixedprec").get_all("Provides-Extra") or [])
    assert {"finetune", "torchao", "transformer-engine", "deepspeed", "peft", "all", "test"} <= extras


def test_missing_matplotlib_names_the_extra(monkeypatch, tmp_path):
    from hf_mixedprec.training.run_report import build_plots

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    with pytest.raises(
        ImportError, match=r"needs matplotlib, which is not installed: pip install 'hf_mixedprec\[finetune\]'"
    ):
        build_plots(tmp_path, {"version": 1, "series": {}, "events": [], "notes": []})


def test_missing_torchao_names_the_extra(monkeypatch):
    from hf_mixedprec.core.demo import tiny_llama
    from hf_mixedprec.fp8 import convert

    model, recipe = tiny_llama(), hf_mixedprec.load_recipe("h100-fp8-current", rehearse=True)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ImportError, match=r"pip install 'hf_mixedprec\[torchao\]'"):
        convert(model, recipe, backend="torchao")


def test_missing_transformer_engine_names_the_extra(monkeypatch):
    from hf_mixedprec.core.demo import tiny_llama
    from hf_mixedprec.fp8 import convert

    model, recipe = tiny_llama(), hf_mixedprec.load_recipe("h100-fp8-delayed", rehearse=True)
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    with pytest.raises(ImportError, match=r"pip install 'hf_mixedprec\[transformer-engine\]'"):
        convert(model, recipe, backend="transformer_engine")
