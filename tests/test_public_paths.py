"""Every import path the README and docs show works, from its folder and without a warning; every module name of the
releases before the folders still imports, as the same module, with one DeprecationWarning naming where it went."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import hf_mixedprec
from hf_mixedprec.core._moved import MOVED

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FROM = re.compile(r"^\s*from (hf_mixedprec(?:\.\w+)*) import ([\w, ()]+?)\s*(?:#.*)?$", re.M)
IMPORT = re.compile(r"^\s*import (hf_mixedprec(?:\.\w+)*)(?: as \w+)?\s*(?:#.*)?$", re.M)
DOTTED = re.compile(r"`(hf_mixedprec(?:\.\w+)+)")


def _documented() -> dict[str, set[str]]:
    """module -> the names the docs import from it (empty: the module itself)."""
    found: dict[str, set[str]] = {}
    for doc in DOCS:
        text = doc.read_text()
        for module, names in FROM.findall(text):
            found.setdefault(module, set()).update(n.strip() for n in names.strip("()").split(",") if n.strip())
        for module in IMPORT.findall(text):
            found.setdefault(module, set())
    return found


def _named() -> list[str]:
    """Every dotted name the docs write in backticks (``hf_mixedprec.integrations.trainer.attach``)."""
    return sorted({name for doc in DOCS for name in DOTTED.findall(doc.read_text())})


def _resolve(dotted: str) -> object:
    """The module or attribute ``dotted`` names: the longest prefix that imports, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_the_docs_show_import_paths_at_all():
    found = _documented()
    assert len(found) >= 7 and len(_named()) >= 10, (sorted(found), _named())
    assert "hf_mixedprec" in found and "hf_mixedprec.integrations.trainer" in found


@pytest.mark.parametrize("dotted", _named())
def test_each_dotted_name_in_the_docs_resolves_without_a_warning(dotted):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert _resolve(dotted) is not None


@pytest.mark.parametrize("module", sorted(_documented()))
def test_each_documented_import_works_without_a_warning(module):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # a documented path is never a moved-name alias
        mod = importlib.import_module(module)
        for name in sorted(_documented()[module]):
            assert hasattr(mod, name) or importlib.import_module(f"{module}.{name}"), f"from {module} import {name}"
    old = module.removeprefix("hf_mixedprec.")
    assert old not in MOVED, f"the docs show {module}, an old name; it lives at hf_mixedprec.{MOVED.get(old)}"


@pytest.mark.slow
def test_every_old_module_name_is_the_moved_module_with_one_warning():
    """In a fresh interpreter, so that each old name is imported for the first time."""
    code = """
import importlib, warnings
import hf_mixedprec
from hf_mixedprec.core._moved import MOVED
bad = []
for old, new in sorted(MOVED.items()):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = importlib.import_module("hf_mixedprec." + old)
        b = importlib.import_module("hf_mixedprec." + old)  # a second import warns no more
    mine = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning) and "moved to" in str(w.message)]
    if a is not b or a is not importlib.import_module("hf_mixedprec." + new) or a.__name__ != "hf_mixedprec." + new:
        bad.append(f"{old}: not the module at {new}")
    if mine != [f"hf_mixedprec.{old} moved to hf_mixedprec.{new}; import it from there (the old name is an alias that a later release drops)"]:
        bad.append(f"{old}: warnings {mine}")
    if a.__spec__.name != "hf_mixedprec." + new:
        bad.append(f"{old}: spec {a.__spec__.name}")
print(len(MOVED), bad)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == f"{len(MOVED)} []", r.stdout


def test_an_old_name_from_the_package_and_its_attributes():
    with pytest.warns(DeprecationWarning, match=r"hf_mixedprec\.hardware moved to hf_mixedprec\.recipes\.hardware"):
        sys.modules.pop("hf_mixedprec.hardware", None)
        hf_mixedprec.core._moved._FINDER.warned.discard("hf_mixedprec.hardware")
        from hf_mixedprec import hardware
    from hf_mixedprec.recipes import hardware as now

    assert hardware is now and hardware.detect is now.detect


def test_no_old_name_is_a_module_of_its_own():
    """An alias only: no file at the old place, and none of the new places is an old name."""
    pkg = Path(hf_mixedprec.__file__).parent
    for old, new in MOVED.items():
        assert not (pkg / f"{old}.py").exists(), old
        assert (pkg / (new.replace(".", "/") + ".py")).is_file(), new
    assert not set(MOVED) & {p.stem for p in pkg.glob("*.py")}


def test_launch_takes_the_old_finetune_path_and_runs_the_script_as_a_module(tmp_path):
    from hf_mixedprec.integrations.launch import moved_script, script_argv

    new, note = moved_script("hf_mixedprec/finetune.py")
    assert new == "hf_mixedprec/cli/finetune.py"
    assert (
        note
        == "hf_mixedprec/finetune.py moved to hf_mixedprec/cli/finetune.py: launching that (change the command to it)"
    )
    assert moved_script(str(ROOT / "hf_mixedprec" / "finetune.py"))[0] == str(
        ROOT / "hf_mixedprec" / "cli" / "finetune.py"
    )
    mine = tmp_path / "train.py"
    mine.write_text("")
    assert moved_script(str(mine)) == (str(mine), None)
    assert script_argv(str(ROOT / "hf_mixedprec" / "cli" / "finetune.py")) == ["--module", "hf_mixedprec.cli.finetune"]
    assert script_argv(str(mine)) == [str(mine)]
