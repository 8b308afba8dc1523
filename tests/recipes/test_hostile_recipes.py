"""Hostile recipe input: every case is refused with one line naming the limit or key, quickly and in bounded
memory (checked in-process), and by ``hf-mixedprec validate`` with exit code 2 and no traceback."""

from __future__ import annotations

import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from hf_mixedprec.integrations.recipe import RecipeError, load_recipe_file
from hf_mixedprec.recipes.safe_yaml import MAX_BYTES, MAX_DEPTH
from hf_mixedprec.training.health import threshold_of

CLI = [sys.executable, "-m", "hf_mixedprec.cli"]
BASE = "name: hostile\nextends: v100-fp16\n"

# 581 bytes: nine levels of nine aliases each would expand to 9**9 strings under yaml.safe_load
LAUGHS = "description: &a0 [lol,lol,lol,lol,lol,lol,lol,lol,lol]\n" + "".join(
    f"x{i}: &a{i} [{','.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 9)
)
MAPPING_BOMB = "hardware: &m0 {a: 1, b: 2, c: 3}\n" + "".join(
    f"m{i}: &m{i} {{a: *m{i - 1}, b: *m{i - 1}, c: *m{i - 1}}}\n" for i in range(1, 20)
)

CASES: dict[str, tuple[str, str]] = {
    # name: (file text, what the one line must contain)
    "alias_bomb": (BASE + LAUGHS, "YAML anchors (&a0) are not allowed"),
    "mapping_bomb": (BASE + MAPPING_BOMB, "YAML anchors (&m0) are not allowed"),
    "bare_alias": (BASE + "description: *nothing\n", "YAML aliases (*nothing) are not allowed"),
    "deep_flow": (BASE + "description: " + "[" * 20_000 + "]" * 20_000 + "\n", f"nested deeper than {MAX_DEPTH}"),
    "deep_mapping": (
        BASE + "health: " + "{a: " * 20_000 + "1" + "}" * 20_000 + "\n",
        f"nested deeper than {MAX_DEPTH}",
    ),
    "huge": (BASE + "# " + "x" * (14 * 2**20) + "\n", f"over the {MAX_BYTES}-byte limit"),
    "duplicate_top": (BASE + "precision: fp16\nprecision: bf16\n", "key 'precision' is given twice (lines 3 and 4)"),
    "duplicate_nested": (
        BASE + "loss_scale:\n  init_scale: 1024\n  init_scale: 2048\n",
        "key 'init_scale' is given twice (lines 4 and 5)",
    ),
    "merge_key": (BASE + "loss_scale:\n  <<: {init_scale: 1024}\n", "YAML merge keys (<<) are not allowed"),
    "bool_as_string": (BASE + 'tf32: "yes"\n', "tf32: input should be a valid boolean, got 'yes'"),
    "int_as_string": (
        BASE + 'loss_scale: {growth_interval: "2000"}\n',
        "loss_scale.growth_interval: input should be a valid integer, got '2000'",
    ),
    "inf_init_scale": (BASE + "loss_scale: {init_scale: .inf}\n", "loss_scale.init_scale: input should be a finite"),
    "nan_threshold": (
        BASE + "health: {detectors: {loss_spike: {threshold: .nan}}}\n",
        "health.detectors.loss_spike.threshold: input should be a finite number",
    ),
    "window_float": (
        BASE + "health: {detectors: {loss_spike: {window: 1e12}}}\n",
        "health.detectors.loss_spike.window: input should be a valid integer",
    ),
    "window_huge": (
        BASE + "health: {detectors: {loss_spike: {window: 1000000000000}}}\n",
        "health.detectors.loss_spike.window: 1000000000000 is out of range (allowed: <= 100000)",
    ),
    "history_huge": (
        "name: hostile\nextends: h100-fp8-delayed\nfp8: {amax_history_len: 100000000000}\n",
        "fp8.amax_history_len: 100000000000 is out of range (allowed: <= 65536)",
    ),
    "interval_huge": (
        BASE + "loss_scale: {growth_interval: 100000000000000000000000}\n",
        "loss_scale.growth_interval: 100000000000000000000000 is out of range (allowed: <= 1000000000)",
    ),
    "not_a_mapping": ("- just\n- a list\n", "expected a mapping at the top level, got list"),
    "long_unknown_keys": (
        BASE + "".join(f"{'k' * 500}{i}: 1\n" for i in range(200)),
        "... and 180 more problems",
    ),
}


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_in_process_quickly_and_in_bounded_memory(tmp_path, case):
    text, expected = CASES[case]
    path = _write(tmp_path, case, text)
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(RecipeError) as exc:
            load_recipe_file(path)
        elapsed = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(exc.value)
    assert expected in message, message[:500]
    assert elapsed < 2.0 and peak < 200 * 2**20, (elapsed, peak)
    assert len(message) <= 21 * (RecipeError.MAX_LINE + len(str(path)) + 4)


@pytest.mark.slow
def test_validate_refuses_each_with_exit_2_and_one_line(tmp_path):
    """One process per case would take minutes; one `validate` call checks every file (one line per file)."""
    paths = [_write(tmp_path, case, CASES[case][0]) for case in sorted(CASES) if case != "long_unknown_keys"]
    r = subprocess.run([*CLI, "validate", *map(str, paths)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    for path in paths:
        mine = [ln for ln in lines if ln.startswith(str(path))]
        assert len(mine) == 1, (path.name, mine)
        assert CASES[path.stem][1] in mine[0], mine[0]


def test_zero_is_a_threshold_not_unset():
    recipe = load_recipe_file  # noqa: F841 - readability: the next lines build one from a dict
    from hf_mixedprec.integrations.recipe import resolve_recipe

    r = resolve_recipe({"name": "z", "extends": "v100-fp16", "health": {"detectors": {"skip_rate": {"threshold": 0}}}})
    cfg = r.health.detectors.skip_rate
    assert cfg.threshold == 0 and threshold_of(cfg, float("inf")) == 0
    unset = resolve_recipe(
        {"name": "z", "extends": "v100-fp16", "health": {"detectors": {"loss_spike": {"threshold": None}}}}
    )
    assert threshold_of(unset.health.detectors.loss_spike, float("inf")) == float("inf")


def test_a_file_named_like_a_built_in_is_refused_with_both_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cpu-bf16").write_text("name: mine\nprecision: fp32\n")
    with pytest.raises(RecipeError, match=r"is both the built-in recipe 'cpu-bf16' and the file '.*cpu-bf16'"):
        load_recipe_file("cpu-bf16")
    (tmp_path / "cpu-bf16").unlink()
    (tmp_path / "cpu-bf16.yaml").write_text("name: mine\nprecision: fp32\n")
    assert load_recipe_file("cpu-bf16").precision == "bf16"  # a name is a built-in
    assert load_recipe_file("cpu-bf16.yaml").precision == "fp32"  # a path is a path


def test_relative_extends_is_read_next_to_the_recipe_only(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    (tmp_path / "base.yaml").write_text("name: base\nprecision: bf16\n")  # in the current directory only
    child = tmp_path / "sub" / "child.yaml"
    child.write_text("name: child\nextends: base.yaml\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        RecipeError, match=r"extends: 'base.yaml': file not found next to the recipe that names it \(.*sub/base.yaml\)"
    ):
        load_recipe_file(child)
    (tmp_path / "sub" / "base.yaml").write_text("name: base\nprecision: fp32\n")
    assert load_recipe_file(child).precision == "fp32"


def test_files_that_are_not_recipes_are_refused_unread(tmp_path, monkeypatch):
    secret = tmp_path / "secrets.txt"
    secret.write_text("root:$6$very-secret-hash:19000:0:99999:7:::\n")
    for target in (str(secret), "/etc/passwd"):
        with pytest.raises(RecipeError) as exc:
            load_recipe_file(target)
        assert "is not a .yaml/.yml file" in str(exc.value) and "root:" not in str(exc.value).split(target)[-1]
    from hf_mixedprec import load_recipe

    monkeypatch.setenv("HF_MIXEDPREC_RECIPE", str(secret))
    with pytest.raises(RecipeError, match=r"is not a .yaml/.yml file") as exc:
        load_recipe()
    assert "very-secret-hash" not in str(exc.value)
