"""The `hf-mixedprec` command: in this process (``main``, what the entry points call) for what it prints and returns,
as a real subprocess where the process is the point (`python -m hf_mixedprec`, exit codes and stderr of the
executable)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hf_mixedprec.cli.app import main
from hf_mixedprec.integrations.recipe import builtin_recipe_names, builtin_recipe_path, load_recipe_file


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread, as a test worker computes


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The real executable (``python -m hf_mixedprec.cli``)."""
    return subprocess.run(
        [sys.executable, "-m", "hf_mixedprec.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=120,
        env=_env(),
    )  # fmt: skip


def call(capsys, *args: str) -> tuple[int, str, str]:
    """``hf-mixedprec ARGS`` in this process: exit code (argparse's exits included), stdout, stderr."""
    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exc:  # --help, --version and argparse's errors exit from inside the parser
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_recipes_json_lists_all_twelve(capsys):
    assert main(["recipes", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted(r["name"] for r in rows) == builtin_recipe_names()
    assert len(rows) == 12
    by = {r["name"]: r for r in rows}
    assert by["b200-mxfp8"]["fp8_scaling"] == "mxfp8" and by["v100-fp16"]["precision"] == "fp16"
    assert by["h100-fp8-anneal-bf16"]["phases"] == ["fp8", "bf16"] and by["v100-fp16"]["phases"] is None
    assert main(["recipes"]) == 0
    assert "h100-fp8-anneal-bf16  fp8->bf16" in capsys.readouterr().out


def test_show_prints_resolved_recipe(capsys):
    assert main(["show", "h100-fp8-delayed"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown == load_recipe_file("h100-fp8-delayed").to_dict()
    assert shown["fp8"]["amax_history_len"] == 1024 and "extends" not in shown
    assert main(["show", "t4-fp16"]) == 0
    t4 = yaml.safe_load(capsys.readouterr().out)
    assert t4["loss_scale"]["init_scale"] == 65536.0 and "extends" not in t4


def test_detect_json_here_is_cpu(capsys):
    code, stdout, stderr = call(capsys, "detect", "--json")
    assert code == 0, stderr
    out = json.loads(stdout)
    assert out["device"] == "cpu" and out["generation"] == "cpu"
    # cpu-bf16 where the CPU computes BF16 natively, cpu-fp32 where it emulates it (tests/recipes/test_cpu_bf16.py)
    assert out["recipe"] == ("cpu-bf16" if out["cpu_bf16"]["native"] else "cpu-fp32")
    # the other built-in recipes that run here without a rehearsal: no FP8 or FP16 one on a CPU
    other = "cpu-fp32" if out["recipe"] == "cpu-bf16" else "cpu-bf16"
    assert other in out["also_runs"] and out["recipe"] not in out["also_runs"]
    assert not [n for n in out["also_runs"] if "fp8" in n or "fp16" in n or "fp4" in n]


def test_detect_offers_the_opt_in_nvfp4_recipe_on_blackwell_where_a_backend_runs_it():
    from hf_mixedprec.cli.app import _also_runs
    from hf_mixedprec.recipes.hardware import HardwareInfo

    b200 = HardwareInfo(device_type="cuda", capability=(10, 0), device_name="NVIDIA B200", cuda_version="12.9")
    with_te = HardwareInfo(**{**b200.__dict__, "te_version": "2.9.0"})
    assert "b200-nvfp4" in _also_runs(with_te, "b200-mxfp8") and "b200-mxfp8" not in _also_runs(with_te, "b200-mxfp8")
    assert "b200-nvfp4" not in _also_runs(b200, "b200-mxfp8")  # auto: TE only for NVFP4; none installed
    h100 = HardwareInfo(**{**with_te.__dict__, "capability": (9, 0), "device_name": "NVIDIA H100"})
    assert "b200-nvfp4" not in _also_runs(h100, "h100-fp8-delayed")


def test_validate_passes_every_shipped_recipe(capsys):
    paths = [str(builtin_recipe_path(n)) for n in builtin_recipe_names()]
    assert main(["validate", *paths]) == 0
    assert capsys.readouterr().out.count(": ok (") == 12


BROKEN = {
    "syntax.yaml": ("name: [x\nprecision: bf16\n", "invalid YAML"),
    "empty.yaml": ("", "the document is empty"),
    "list.yaml": ("- 1\n- 2\n", "expected a mapping at the top level"),
    "tag.yaml": ("name: t\nprecision: !!python/object/apply:os.system ['touch {marker}']\n", "refused YAML tag"),
    "unknown.yaml": (
        "name: t\nprecision: bf16\nclipping: {method: norm, max_nrom: 1}\n",
        "clipping.max_nrom: unknown key",
    ),
    "type.yaml": ("name: t\nprecision: bf16\ntf32: sometimes\n", "tf32: input should be a valid boolean"),
    "range.yaml": (
        "name: t\nprecision: fp16\nloss_scale: {backoff_factor: 2.0}\n",
        "loss_scale.backoff_factor: 2.0 is out of range (allowed: < 1)",
    ),
    "enum.yaml": (
        "name: t\nprecision: fp8\nfp8: {scaling: current, format: E2M5}\n",
        "fp8.format: 'E2M5' is not allowed (allowed: HYBRID, E4M3)",
    ),
    "e5m2.yaml": (
        "name: t\nprecision: fp8\nfp8: {scaling: current, format: E5M2}\n",
        "fp8.format: pure E5M2 training is refused",
    ),
    "mxhist.yaml": (
        "name: t\nprecision: fp8\nfp8: {scaling: mxfp8, amax_history_len: 16}\n",
        "fp8.amax_history_len: does not apply to scaling 'mxfp8'",
    ),
    "missing.yaml": ("name: t\nextends: nowhere.yaml\n", "extends: 'nowhere.yaml': file not found"),
    "cycle_a.yaml": ("name: a\nextends: cycle_b.yaml\nprecision: bf16\n", "extends: cycle: "),
    "cycle_b.yaml": ("name: b\nextends: cycle_a.yaml\nprecision: bf16\n", "extends: cycle: "),
}


def test_validate_reports_each_broken_file_in_one_line(tmp_path, capsys, monkeypatch):
    marker = tmp_path / "executed"
    paths = []
    for fname, (text, _) in BROKEN.items():
        (tmp_path / fname).write_text(text.replace("{marker}", str(marker)))
        paths.append(fname)
    good = tmp_path / "good.yaml"
    good.write_text("name: good\nextends: cpu-bf16\n")
    monkeypatch.chdir(tmp_path)
    code, stdout, stderr = call(capsys, "validate", *paths, "good.yaml")
    assert code == 2
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == len(BROKEN), lines
    for fname, (_, expected) in BROKEN.items():
        (line,) = [ln for ln in lines if ln.startswith(f"{fname}: ")]
        assert expected in line, line
    assert "good.yaml: ok (good, bf16)" in stdout
    assert not marker.exists(), "a YAML tag was executed"


def test_validate_all_good_exits_zero(tmp_path, capsys, monkeypatch):
    (tmp_path / "mine.yaml").write_text("name: mine\nextends: h100-fp8-delayed\nfp8: {margin: 1}\n")
    monkeypatch.chdir(tmp_path)
    code, stdout, _ = call(capsys, "validate", "mine.yaml")
    assert code == 0 and "mine.yaml: ok (mine, fp8)" in stdout


@pytest.mark.parametrize(
    "args, expected",
    [
        (["show", "no-such"], "no-such: no such recipe (allowed: a YAML path or one of: auto, a100-bf16"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["launch", "--recipe", "cpu-bf16"], "the following arguments are required: SCRIPT"),
        (
            ["launch", "--recipe", "cpu-bf16", "--num-processes", "two", "x.py"],
            "argument --num-processes: invalid int value: 'two'",
        ),
        (
            ["launch", "--recipe", "cpu-bf16", "--num-processes", "0", "--dry-run", "x.py"],
            "--num-processes: 0 is out of range (allowed: >= 1)",
        ),
        (["launch", "--recipe", "cpu-bf16", "missing_script.py"], "SCRIPT: 'missing_script.py' not found"),
        (["launch", "--recipe", "h100-fp8-delayed", __file__], "recipe 'h100-fp8-delayed' needs FP8"),
    ],
)
def test_user_mistakes_exit_2_with_one_line(args, expected, capsys):
    code, stdout, stderr = call(capsys, *args)
    assert code == 2, (stdout, stderr)
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert expected in lines[0]


def test_the_executable_exits_2_with_one_line_for_a_parser_error_and_a_refusal():
    """The same, from the real executable: a parser error (argparse exits from inside ``main``) and a refusal
    ``main`` returns 2 for; nothing else on stderr (no import noise)."""
    for args, expected in (
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["launch", "--recipe", "cpu-bf16", "missing_script.py"], "SCRIPT: 'missing_script.py' not found"),
    ):
        r = run(*args)
        assert r.returncode == 2, (r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0], lines


def test_schema_is_json(capsys):
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["title"] == "Recipe"


@pytest.mark.slow
def test_help_everywhere(capsys):
    for sub in ("recipes", "show", "validate", "schema", "detect", "launch"):
        code, stdout, _ = call(capsys, sub, "--help")
        assert code == 0 and "usage:" in stdout, sub


def test_version(capsys):
    import hf_mixedprec

    code, stdout, stderr = call(capsys, "--version")
    assert code == 0 and stdout == f"hf-mixedprec {hf_mixedprec.__version__}\n", (stdout, stderr)


@pytest.mark.slow
def test_python_dash_m_hf_mixedprec(tmp_path):
    """`python -m hf_mixedprec` is the same command, exit codes included."""
    import hf_mixedprec

    def pym(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "hf_mixedprec", *args], capture_output=True, text=True, cwd=tmp_path, timeout=120,
            env=_env(),
        )  # fmt: skip

    r = pym("--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: hf-mixedprec ") and "finetune" in r.stdout
    assert "3 a run stopped by a health reaction" in r.stdout.replace("\n", " ").replace("  ", " ")
    r = pym("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"hf-mixedprec {hf_mixedprec.__version__}"
    (tmp_path / "bad.yaml").write_text("name: bad\nprecision: fp12\n")
    r = pym("validate", "bad.yaml")
    assert r.returncode == 2 and r.stderr.startswith("bad.yaml: precision: 'fp12' is not allowed"), r.stderr


def test_finetune_resume_command_base(monkeypatch):
    """The command a stopped `finetune` prints to resume: the one given, without --resume; under `launch`, the
    launch command followed by the script's arguments."""
    from hf_mixedprec.cli.app import LAUNCH_COMMAND_ENV, _finetune_command

    for name in (LAUNCH_COMMAND_ENV, "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    argv = ["finetune", "--recipe", "my recipe.yaml", "--resume", "old/checkpoint-3", "--max-steps", "9", "--resume=x"]
    assert _finetune_command(argv) == ["hf-mixedprec", "finetune", "--recipe", "my recipe.yaml", "--max-steps", "9"]
    assert _finetune_command(["recipes"]) is None and _finetune_command(None) is None
    monkeypatch.setenv(LAUNCH_COMMAND_ENV, "hf-mixedprec launch --recipe z.yaml hf_mixedprec/cli/finetune.py")
    assert _finetune_command(argv)[:2] == ["hf-mixedprec", "finetune"]  # not a launched process
    monkeypatch.setenv("RANK", "0")
    assert _finetune_command(argv) == [
        "hf-mixedprec", "launch", "--recipe", "z.yaml", "hf_mixedprec/cli/finetune.py",
        "--recipe", "my recipe.yaml", "--max-steps", "9",
    ]  # fmt: skip


# -- user mistakes: one line, exit 2, nothing lost ----------------------------------------------------------


def _one_line_exit_2(argv, capsys, expected):
    from hf_mixedprec.cli.app import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert expected in lines[0], lines[0]


def test_finetune_output_dir_that_is_a_file_or_unwritable(tmp_path, capsys):
    f = tmp_path / "a-file"
    f.write_text("keep me")
    _one_line_exit_2(["finetune", "--output-dir", str(f)], capsys, f"--output-dir: {str(f)!r} is a file")
    assert f.read_text() == "keep me"
    _one_line_exit_2(["finetune", "--output-dir", str(f / "sub")], capsys, "cannot be written (Not a directory)")
    _one_line_exit_2(["finetune", "--output-dir", "/proc/1/hf-out"], capsys, "--output-dir: '/proc/1/hf-out' cannot")


def test_a_bad_rehearse_variable_is_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_MIXEDPREC_REHEARSE", "maybe")
    _one_line_exit_2(
        ["finetune", "--output-dir", str(tmp_path / "o")], capsys, "HF_MIXEDPREC_REHEARSE='maybe' is not a boolean"
    )


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        ({"version": 1, "series": [], "events": "x"}, "field 'series' is a list"),
        ({"version": 1, "series": {"loss": [1, 2]}}, "field 'series.loss' is not a mapping of step -> value"),
        ({"version": 1, "events": [1]}, "field 'events' is not a list of mappings"),
        ({"version": 1, "notes": [5]}, "field 'notes' is not a list of strings"),
        ({"version": 2}, "is not a health report of version 1"),
    ],
)
def test_report_on_a_malformed_health_json_is_one_line(tmp_path, capsys, doc, expected):
    (tmp_path / "health.json").write_text(json.dumps(doc))
    _one_line_exit_2(["report", str(tmp_path)], capsys, expected)


@pytest.mark.slow
def test_launch_never_writes_over_a_users_file_and_cleans_its_temp_folder(tmp_path, capfd, monkeypatch):
    import tempfile

    script = tmp_path / "ok.py"
    script.write_text("import sys\nsys.exit(0)\n")
    mine = tmp_path / "cfg" / "recipe.yaml"
    mine.parent.mkdir()
    mine.write_text("name: mine\n")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # for the launched processes
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # for this one (tempfile read TMPDIR once, long ago)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cmd = ["launch", "--recipe", "cpu-bf16"]
    code, _, stderr = call(capfd, *cmd, "--config-dir", str(mine.parent), str(script))
    assert code == 2 and "already has recipe.yaml, which hf-mixedprec launch did not write" in stderr
    assert mine.read_text() == "name: mine\n"
    code, _, stderr = call(capfd, *cmd, str(script))  # the launcher and the script: real processes
    assert code == 0, stderr[-2000:]
    assert "hf-mixedprec-launch-cpu-bf16-" in stderr  # it did use a temporary folder ...
    assert not list(tmp_path.glob("hf-mixedprec-launch-*"))  # ... and removed it
