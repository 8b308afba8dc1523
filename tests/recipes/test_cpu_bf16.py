"""`auto` on a CPU picks by what the CPU computes fast: cpu-bf16 with native BF16, cpu-fp32 without; an explicit
16-bit recipe on such a CPU runs and says, once, how much slower its GEMMs are."""

from __future__ import annotations

import json
import math

import pytest

from hf_mixedprec.cli.app import main
from hf_mixedprec.core.errors import EnvValueError
from hf_mixedprec.integrations.recipe import load_recipe, load_recipe_file
from hf_mixedprec.recipes import hardware
from hf_mixedprec.recipes.hardware import (
    CPU_BF16_ENV,
    SLOW_GEMM_RATIO,
    CpuGemmSpeed,
    auto_recipe_name,
    cpu_speed_note,
    decide_cpu_gemm,
)


@pytest.fixture(autouse=True)
def fresh_answer(monkeypatch):
    """Each test asks the machine again (the answer is cached per process and variable value)."""
    monkeypatch.delenv(CPU_BF16_ENV, raising=False)
    hardware._cpu_gemm_speed.cache_clear()
    yield
    hardware._cpu_gemm_speed.cache_clear()


def _no_measure():
    raise AssertionError("measured although torch's CPU query answered yes")


# -- the decision -------------------------------------------------------------------------------------------------
def test_torch_query_yes_is_native_without_timing_anything():
    s = decide_cpu_gemm("bf16", env=None, isa=(True, "AVX512 with AMX"), measure=_no_measure)
    assert (s.native, s.how, s.slowdown) == (True, "torch", None)
    assert s.describe() == "bf16 native on this CPU (AVX512 with AMX)"


def test_torch_query_no_is_emulated_and_says_how_much_slower():
    s = decide_cpu_gemm("bf16", env=None, isa=(False, "AVX2: no AVX512-BF16, no AMX"), measure=lambda: 5.123)
    assert (s.native, s.how, s.slowdown) == (False, "torch", 5.12)
    assert s.describe() == "bf16 GEMM 5.1x slower than fp32 on this CPU (AVX2: no AVX512-BF16, no AMX)"


@pytest.mark.parametrize(
    ("ratio", "native"), [(0.6, True), (SLOW_GEMM_RATIO - 0.01, True), (SLOW_GEMM_RATIO, False), (5.1, False)]
)
def test_where_torch_cannot_answer_a_measured_gemm_decides(ratio, native):
    s = decide_cpu_gemm("bf16", env=None, isa=(None, "aarch64, cpu capability DEFAULT"), measure=lambda: ratio)
    assert (s.native, s.how, s.slowdown) == (native, "measured", round(ratio, 2))
    assert s.evidence == "aarch64, cpu capability DEFAULT; measured"


@pytest.mark.parametrize("value", ["native", "emulated", " Native "])
def test_the_variable_overrides_torch_and_the_timing(value):
    s = decide_cpu_gemm("bf16", env=value, isa=(value.strip().lower() != "native", "x"), measure=_no_measure)
    assert s.native == (value.strip().lower() == "native") and s.how == "env"
    assert s.evidence == f"{CPU_BF16_ENV}={value.strip().lower()}"


@pytest.mark.parametrize("value", ["yes", "", "bf16", "emulated!"])
def test_a_bad_variable_value_names_it_and_the_choices(value):
    with pytest.raises(EnvValueError) as err:
        decide_cpu_gemm("bf16", env=value, isa=(True, "x"), measure=_no_measure)
    assert str(err.value) == (
        f"{CPU_BF16_ENV}={value!r} is not a CPU BF16 answer (allowed: native, emulated; or unset, and torch's CPU "
        "queries or a measured GEMM decide)"
    )


def test_the_measurement_is_a_real_ratio_and_cached():
    first = hardware.measure_gemm_slowdown("bf16")
    assert math.isfinite(first) and first > 0
    assert hardware.measure_gemm_slowdown("bf16") == first  # once per process


# -- auto -----------------------------------------------------------------------------------------------------------
def test_auto_on_a_cpu_without_native_bf16_is_cpu_fp32_with_the_reason():
    slow = CpuGemmSpeed("bf16", False, "torch", "AVX2: no AVX512-BF16, no AMX", 5.1)
    name, notes = auto_recipe_name("cpu", cpu_bf16=slow)
    assert name == "cpu-fp32"
    assert notes == [
        "cpu-fp32, not cpu-bf16: this CPU has no native BF16: bf16 GEMM 5.1x slower than fp32 on this CPU (AVX2: no "
        "AVX512-BF16, no AMX). FP32 trains faster here; ask for --recipe cpu-bf16 to rehearse BF16 numerics anyway"
    ]
    assert auto_recipe_name("cpu", cpu_bf16=CpuGemmSpeed("bf16", True, "torch", "AVX512 with AMX")) == ("cpu-bf16", [])
    assert auto_recipe_name("mps", cpu_bf16=slow) == ("cpu-bf16", [])  # Apple silicon: the GPU decides, not the CPU


def test_cpu_fp32_is_cpu_bf16_in_fp32():
    fp32, bf16 = load_recipe_file("cpu-fp32"), load_recipe_file("cpu-bf16")
    assert fp32.precision == "fp32" and fp32.loss_scale is None and fp32.fp8 is None
    assert fp32.clipping == bf16.clipping and fp32.health == bf16.health and fp32.storage == bf16.storage
    assert fp32.modules == bf16.modules and fp32.distributed == bf16.distributed


def _detect_json(capsys) -> dict:
    assert main(["detect", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _pretend_x86(monkeypatch, **isa: bool) -> None:
    answers = {"avx512_bf16": False, "amx_tile": False, "amx_fp16": False, **isa}
    monkeypatch.setattr(hardware.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(hardware, "cpu_native_16bit", lambda: dict(answers))


def test_detect_json_names_cpu_fp32_without_native_bf16(capsys, monkeypatch):
    _pretend_x86(monkeypatch)
    monkeypatch.setattr(hardware, "measure_gemm_slowdown", lambda dtype="bf16": 5.1)
    out = _detect_json(capsys)
    assert out["recipe"] == "cpu-fp32"
    assert out["cpu_bf16"] == {
        "dtype": "bf16",
        "native": False,
        "how": "torch",
        "evidence": f"{out['cpu_capability']}: no AVX512-BF16, no AMX",
        "slowdown": 5.1,
    }
    assert len(out["notes"]) == 1 and "bf16 GEMM 5.1x slower than fp32 on this CPU" in out["notes"][0]


@pytest.mark.parametrize("isa", ["avx512_bf16", "amx_tile"])
def test_detect_json_names_cpu_bf16_with_native_bf16(capsys, monkeypatch, isa):
    _pretend_x86(monkeypatch, **{isa: True})
    monkeypatch.setattr(hardware, "measure_gemm_slowdown", lambda dtype="bf16": _no_measure())
    out = _detect_json(capsys)
    assert out["recipe"] == "cpu-bf16" and out["notes"] == []
    assert out["cpu_bf16"]["native"] is True and out["cpu_bf16"]["how"] == "torch"
    assert ("AVX512-BF16" if isa == "avx512_bf16" else "AMX") in out["cpu_bf16"]["evidence"]


@pytest.mark.parametrize(("ratio", "recipe"), [(6.0, "cpu-fp32"), (0.7, "cpu-bf16")])
def test_detect_measures_where_torch_cannot_answer(capsys, monkeypatch, ratio, recipe):
    monkeypatch.setattr(hardware.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(hardware, "measure_gemm_slowdown", lambda dtype="bf16": ratio)
    out = _detect_json(capsys)
    assert out["recipe"] == recipe
    assert out["cpu_bf16"]["how"] == "measured" and out["cpu_bf16"]["slowdown"] == ratio


@pytest.mark.parametrize(("value", "recipe"), [("emulated", "cpu-fp32"), ("native", "cpu-bf16")])
def test_detect_follows_the_variable(capsys, monkeypatch, value, recipe):
    monkeypatch.setenv(CPU_BF16_ENV, value)
    out = _detect_json(capsys)
    assert out["recipe"] == recipe and out["cpu_bf16"]["how"] == "env"
    assert main(["detect"]) == 0
    text = capsys.readouterr().out
    assert f"recipe:      {recipe}\n" in text and "[env]" in text


def test_a_bad_variable_exits_2_in_one_line(capsys, monkeypatch):
    monkeypatch.setenv(CPU_BF16_ENV, "fast")
    assert main(["detect"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{CPU_BF16_ENV}='fast' is not a CPU BF16 answer" in err


def test_this_machine_answers_as_its_cpu_is(capsys):
    """No pretending: on x86 torch's own queries decide (a measured number is only the evidence)."""
    out = _detect_json(capsys)
    isa = hardware.cpu_native_16bit()
    if hardware.platform.machine().lower() in ("x86_64", "amd64"):
        native = isa["avx512_bf16"] or isa["amx_tile"]
        assert out["cpu_bf16"]["native"] is native and out["cpu_bf16"]["how"] == "torch"
        assert out["recipe"] == ("cpu-bf16" if native else "cpu-fp32")


# -- an explicit slow recipe: one line, in the notes and the summary ---------------------------------------------------
def _speed(native: dict[str, bool]):
    return lambda dtype: CpuGemmSpeed(dtype, native[dtype], "torch", "AVX2", None if native[dtype] else 5.0)


@pytest.mark.parametrize(
    ("recipe", "rehearse", "fmt"),
    [("cpu-bf16", False, "BF16"), ("v100-fp16", True, "FP16"), ("h100-fp8-delayed", True, "BF16")],
)
def test_the_slow_line_names_the_recipe_the_format_and_the_slowdown(recipe, rehearse, fmt):
    spec = load_recipe(recipe, rehearse=rehearse)
    note = cpu_speed_note(spec, speed=_speed({"bf16": False, "fp16": False}))
    assert note == (
        f"SLOW ON THIS CPU: recipe {recipe!r} computes in {fmt} without native instructions here: "
        f"{fmt.lower()} GEMM 5.0x slower than fp32 on this CPU (AVX2). On such a CPU a 16-bit recipe shows its "
        "numerics, not its speed; cpu-fp32 (what auto picks here) trains at this CPU's full speed"
    )
    assert cpu_speed_note(spec, speed=_speed({"bf16": True, "fp16": True})) is None
    assert cpu_speed_note(load_recipe("cpu-fp32"), speed=_speed({"bf16": False, "fp16": False})) is None


def test_fp16_slow_on_a_cpu_with_native_bf16_points_at_cpu_bf16():
    note = cpu_speed_note(load_recipe("v100-fp16", rehearse=True), speed=_speed({"bf16": True, "fp16": False}))
    assert note is not None and note.endswith("cpu-bf16 (what auto picks here) trains at this CPU's full speed")


def test_the_runtime_records_the_line_once(monkeypatch):
    from hf_mixedprec.training.runtime import MixedPrecisionRuntime

    monkeypatch.setenv(CPU_BF16_ENV, "emulated")
    rt = MixedPrecisionRuntime(load_recipe("cpu-bf16"), device="cpu")
    slow = [n for n in rt.notes if n.startswith("SLOW ON THIS CPU")]
    assert slow == [rt.cpu_speed] and f"({CPU_BF16_ENV}=emulated)" in rt.cpu_speed
    monkeypatch.setenv(CPU_BF16_ENV, "native")
    rt = MixedPrecisionRuntime(load_recipe("cpu-bf16"), device="cpu")
    assert rt.cpu_speed is None and not any(n.startswith("SLOW") for n in rt.notes)
    # not on a CPU device: nothing to say about the CPU (meta stands for an accelerator here)
    monkeypatch.setenv(CPU_BF16_ENV, "emulated")
    assert MixedPrecisionRuntime(load_recipe("cpu-bf16"), device="meta").cpu_speed is None


def test_auto_notes_reach_the_runtime_notes(monkeypatch):
    from hf_mixedprec.training.runtime import MixedPrecisionRuntime

    monkeypatch.setenv(CPU_BF16_ENV, "emulated")
    recipe = load_recipe()
    assert recipe.name == "cpu-fp32" and recipe.auto_notes and recipe.auto_notes[0].startswith("cpu-fp32, not cpu-bf16")
    assert recipe.rehearsed(False).auto_notes == recipe.auto_notes  # copies keep them
    rt = MixedPrecisionRuntime(recipe, device="cpu")
    assert rt.notes == list(recipe.auto_notes) and rt.cpu_speed is None
    assert load_recipe("cpu-fp32").auto_notes == ()  # named, not chosen


def test_finetune_says_it_once_and_the_summary_repeats_it(tmp_path, monkeypatch, capsys, caplog):
    monkeypatch.setenv(CPU_BF16_ENV, "emulated")
    out = tmp_path / "run"
    args = ["--max-steps", "2", "--seq-len", "16", "--batch-size", "2", "--no-save", "--eval-split", "0"]
    assert main(["finetune", "--recipe", "cpu-bf16", "--output-dir", str(out), *args]) == 0
    printed = capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    line = summary["cpu_speed"]
    assert line.startswith("SLOW ON THIS CPU: recipe 'cpu-bf16' computes in BF16")
    assert summary["notes"].count(line) == 1
    assert printed.out.count(line) == 1 and f"speed:        {line}" in printed.out
    logged = [r.getMessage() for r in caplog.records if "SLOW ON THIS CPU" in r.getMessage()]
    assert logged == [f"hf_mixedprec: {line}"]
    health = json.loads((out / "health.json").read_text())
    assert health["notes"].count(line) == 1


@pytest.mark.parametrize(("value", "count"), [("emulated", 1), ("native", 0)])
def test_simulate_says_it_too_on_such_a_cpu(capsys, caplog, monkeypatch, value, count):
    """simulate trains the FP8 recipe and its BF16 twin on the CPU: where the CPU emulates BF16 it logs so once and
    keeps the line in its result's notes (the Python API and the command alike)."""
    monkeypatch.setenv(CPU_BF16_ENV, value)
    argv = [
        "simulate",
        "--recipe",
        "h100-fp8-delayed",
        "--steps",
        "2",
        "--seq-len",
        "16",
        "--batch-size",
        "1",
        "--json",
    ]
    assert main(argv) == 0
    want = "SLOW ON THIS CPU: recipe 'h100-fp8-delayed' computes in BF16"
    logged = [r.getMessage() for r in caplog.records if want in r.getMessage()]
    assert len(logged) == count, logged
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert [n for n in notes if n.startswith(want)] == [m.removeprefix("hf_mixedprec: ") for m in logged]
