"""The benchmark scripts run end to end with tiny settings and report every row (no timing thresholds)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

GPU_VARIANTS = {
    "fp32",
    "bf16",
    "bf16-compile",
    "fp16",
    "fp8-torchao-tensorwise",
    "fp8-torchao-rowwise",
    "fp8-emulated",
    "accel-bf16",
    "accel-bf16-hf_mixedprec",
    "accel-bf16-compile",
    "accel-bf16-hf_mixedprec-compile",
    "accel-fp8-hf_mixedprec-compile",
    "accel-fp8-ao-compile",
    "fp8-native-delayed",
    "fp8-native-current",
    "accel-fp8-native-hf_mixedprec-compile",
    "accel-fp4-hf_mixedprec-compile",
}


def _env() -> dict[str, str]:
    """The scripts compute on one thread, as a test worker does: on a CPU shared with other workers, torch's threads
    mostly wait on each other (no figure is checked here, only what the scripts report)."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def _run(args: list[str], timeout: int = 240) -> dict:
    env = _env()
    env.pop("HF_MIXEDPREC_RECIPE", None)
    env.pop("HF_MIXEDPREC_REHEARSE", None)
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, f"rc {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout)


def test_bench_gpu_dry_run(tmp_path):
    out = tmp_path / "gpu.json"
    doc = _run(["scripts/bench_gpu.py", "--dry-run", "--json", "--out", str(out)])
    assert json.loads(out.read_text()) == doc
    assert doc["dry_run"] is True
    assert doc["model"]["parameters"] > 0
    rows = {r["key"]: r for r in doc["rows"]}
    assert set(rows) == GPU_VARIANTS
    for key, r in rows.items():
        assert r["status"] in ("ok", "skipped"), f"{key}: {r['status']}: {r['reason']}"
        if r["status"] == "skipped":
            assert r["reason"], f"{key} skipped without a reason"
            continue
        assert r["tokens_per_s"] > 0 and math.isfinite(r["tokens_per_s"]), key
        assert r["ms_per_step_median"] > 0 and r["steps"] == doc["settings"]["steps"], key
    # on CPU, compile is skipped with a note and torchao runs emulated (said in the row), never silently
    if doc["machine"]["device"].startswith("cpu"):
        assert any("torch.compile skipped" in n for n in rows["bf16-compile"]["notes"])
        assert not rows["bf16-compile"]["compiled"]
        assert all(r["graph_breaks"] is None for r in rows.values())  # counted in compiled rows only (on a GPU)
        for key in ("fp8-torchao-tensorwise", "fp8-torchao-rowwise"):
            r = rows[key]
            assert r["status"] == "skipped" or any("emulate=True" in n for n in r["notes"]), key
        nvfp4 = rows["accel-fp4-hf_mixedprec-compile"]  # NVFP4 GEMMs run on Blackwell only: said, never faked
        assert nvfp4["status"] == "skipped" and "compute capability >= 10.0" in nvfp4["reason"]
    ratio = doc["callback_overhead_ratio"]
    assert ratio is not None and math.isfinite(ratio) and ratio > 0


def test_gpu_acceptance_cpu_smoke(tmp_path):
    """The GPU kit runs end to end on tiny shapes and writes every field it promises (its figures need a GPU)."""
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/gpu_acceptance.py",
            "--cpu-smoke",
            "--out",
            str(tmp_path),
            "--sections",
            "sync,8b,moe,compare",
        ],
        cwd=ROOT,
        env=_env(),  # compare's own process inherits it
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "acceptance.json").read_text())
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_acceptance
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert set(gpu_acceptance.FIELDS) <= set(doc)
    assert doc["cpu_smoke"] is True and doc["machine"]["torch"]
    # no CUDA: every sync case is a skipped row that says why (the meta-device test guards it here)
    assert {(r["recipe"], r["rehearsed"]) for r in doc["sync"]} == set(gpu_acceptance.SYNC_CASES)
    assert all(r["status"] == "skipped" and "test_no_host_sync_device" in r["reason"] for r in doc["sync"])
    (size,) = doc["throughput"]
    rows = {r["key"]: r for r in size["rows"]}
    assert list(rows) == gpu_acceptance.VARIANTS_8B
    for key, r in rows.items():
        assert r["status"] in ("ok", "skipped"), (key, r.get("reason"))
        if r["status"] == "ok":
            assert r["tokens_per_s"] > 0 and r["steps"] == size["steps"], key
            assert r["estimate_gib"] > 0, (key, r.get("estimate_error"))  # estimate ran for the same shapes
    assert rows["accel-fp8-ao-compile"]["status"] == "skipped"  # Accelerate's torchao path needs an FP8 GPU
    assert "FP8 backend emulated" in "; ".join(rows["accel-fp8-hf_mixedprec-compile"]["notes"])
    assert set(size["ratios"]) >= {"fp8_ours_vs_bf16_compile", "fp8_ours_vs_accelerate_ao"}
    assert size["ratios"]["fp8_ours_vs_bf16_compile"] > 0
    moe = {r["key"]: r for r in doc["moe"]["rows"]}
    assert tuple(moe) == gpu_acceptance.bench_moe.ROWS and doc["moe"]["device"] == "cpu"
    for key, r in moe.items():
        if key.startswith("fp8-torchao-"):  # torchao's scaled grouped GEMMs need a GPU: said, not an error
            assert r["status"] == "skipped" and "CUDA" in r["reason"], (key, r)
        else:
            assert r["status"] == "ok" and r["ms_per_step_median"] > 0 and r["speed_vs_bf16"] > 0, (key, r)
    assert moe["bf16-grouped_mm"]["speed_vs_bf16"] == 1.0
    (run,) = doc["compare"]["runs"]
    assert doc["compare"]["exit_code"] == 0 and run["recipe"] == "cpu-bf16" and run["verdict"] == "pass"
    assert doc["verdict"] == {"zero_syncs_from_hf_mixedprec": None, "errors": []}
    md = (tmp_path / "acceptance.md").read_text()
    assert "| variant | status | tokens/s" in md and "fp8_ours_vs_accelerate_ao" in md
    assert "| fp8-ours-emulated-mxfp8 | ok |" in md


def test_bench_gpu_without_gpu_refuses_full_run():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: the full run would start")
    proc = subprocess.run(
        [sys.executable, "scripts/bench_gpu.py", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert proc.returncode == 2
    assert "--dry-run" in proc.stderr and proc.stdout == ""


@pytest.mark.parametrize("interleave", ["step", "run"])
def test_bench_overhead_tiny(tmp_path, interleave):
    out = tmp_path / "overhead.json"
    extra = ["--control"] if interleave == "step" else []
    doc = _run(
        [
            "scripts/bench_overhead.py",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--repeats",
            "2",
            "--threads",
            "1",
            "--interleave",
            interleave,
            "--json",
            "--out",
            str(out),
            *extra,
        ]
    )
    assert json.loads(out.read_text()) == doc
    rows = [(r["recipe"], r["model"], r["log_every"], r["control"]) for r in doc["rows"]]
    expected = [("cpu-bf16", "tiny", 0, False)]
    assert rows == ([("cpu-bf16", "tiny", 0, True)] if extra else []) + expected
    for r in doc["rows"]:
        for side in ("baseline", "ours"):
            assert r[side]["n"] == 3 * 2  # steps x repeats
            assert r[side]["median_ms"] > 0 and math.isfinite(r[side]["mean_ms"])
        assert math.isfinite(r["ratio_median"]) and r["ratio_median"] > 0
        assert math.isfinite(r["ratio_mean"]) and r["ratio_mean"] > 0
        assert len(r["round_ratios"]) == 2 and all(math.isfinite(x) for x in r["round_ratios"])
        assert len(r["round_ratios_wall"]) == 2 and all(math.isfinite(x) for x in r["round_ratios_wall"])
        assert r["ratio_rounds_median"] == pytest.approx(
            sorted(r["round_ratios"])[0] / 2 + sorted(r["round_ratios"])[1] / 2
        )
    assert doc["machine"]["torch_threads"] == 1
    assert doc["settings"]["interleave"] == interleave


def test_bench_overhead_hooks_reports_us_and_ops_per_hook():
    doc = _run(
        [
            "scripts/bench_overhead.py",
            "--hooks",
            "--recipe",
            "cpu-bf16",
            "h100-fp8-delayed",
            "--layers",
            "2",
            "4",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--cpu",
            "-2",
            "--json",
        ]
    )
    rows = {(r["recipe"], r["layers"], r["step"]): r for r in doc["hook_rows"]}
    assert set(rows) == {
        *(("cpu-bf16", n, k) for n in (2, 4) for k in ("non-logging", "logging")),
        *(("h100-fp8-delayed", n, k) for n in (2, 4) for k in ("non-logging", "logging", "fp8-sampled")),
    }
    for r in rows.values():
        assert all(v >= 0 for v in r["us"].values()) and r["us_total"] > 0
        assert r["ops_total"] == sum(r["ops"].values()) > 0
    for kind in ("non-logging", "fp8-sampled"):  # FP8 state and hooks: as many operations for 14 as for 28 Linears
        assert rows[("h100-fp8-delayed", 2, kind)]["ops"] == rows[("h100-fp8-delayed", 4, kind)]["ops"]
    assert rows[("h100-fp8-delayed", 4, "non-logging")]["fp8_layers"] == 28


def test_profile_fp8_step_cpu_smoke(tmp_path, monkeypatch):
    """The profiling command issue 49 prepares for a GPU session runs here on tiny shapes: every default variant
    profiled, its operations ranked by time with shares that add up, and the native FP8 row's GEMMs are torch's FP8
    ``_scaled_mm`` (three per linear layer and step: forward, input gradient, weight gradient), the others' are not."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    sys.modules.pop("profile_fp8_step", None)
    import bench_gpu_variants
    import bench_harness
    import profile_fp8_step

    monkeypatch.setattr(bench_gpu_variants, "timed", bench_gpu_variants.timed)  # the script swaps it; put it back
    monkeypatch.setattr(bench_harness, "quiet", lambda *a, **k: None)  # it would silence our logger in this worker
    args = ["--cpu-smoke", "--warmup", "1", "--steps", "2", "--top", "1000", "--out", str(tmp_path), "--memory"]
    assert profile_fp8_step.main(args) == 0
    doc = json.loads((tmp_path / "profile.json").read_text())
    rows = {r["key"]: r for r in doc["variants"]}
    assert tuple(rows) == profile_fp8_step.DEFAULT_VARIANTS
    linears = 7 * bench_gpu_variants.TINY["num_hidden_layers"]  # q, k, v, o, gate, up, down per layer
    for key, row in rows.items():
        assert row["status"] == "ok", (key, row.get("reason"))
        assert "peak_gib" not in row and "--memory: no allocator history off CUDA" in row["notes"]
        ms = [r["ms_per_step"] for r in row["top"]]
        assert ms == sorted(ms, reverse=True) and ms[0] > 0
        assert math.isclose(sum(r["share"] for r in row["top"]), 1.0, rel_tol=1e-6)
        scaled = [r for r in row["top"] if r["name"] == "aten::_scaled_mm"]
        if key == "fp8-native-delayed":
            assert len(scaled) == 1 and scaled[0]["calls_per_step"] == 3 * linears, scaled
        else:
            assert scaled == [], key
    md = (tmp_path / "profile.md").read_text()
    assert "### fp8 native delayed" in md and "| operation | calls/step | ms/step | share |" in md
    with pytest.raises(SystemExit) as bad:
        profile_fp8_step.main(["--cpu-smoke", "--steps", "0"])
    assert bad.value.code == 2
    with pytest.raises(SystemExit) as bad:
        profile_fp8_step.main(["--cpu-smoke", "--memory"])  # a snapshot per variant needs a folder
    assert bad.value.code == 2


def test_the_single_pass_adamw_probe_tells_which_second_moment_torch_computes(tmp_path, monkeypatch):
    """``scripts/probe_single_pass_adamw.py`` on a few thousand elements: the first moment, a fused multiply-add in
    torch's source, comes out bit for bit; of the two ways of writing the second moment exactly one is torch's on
    this machine (which one depends on how torch was compiled); the speed row compares the single pass with torch's
    fused AdamW and says whether inductor vectorised it; the bf16_kahan single pass gives StorageAdamW's bits."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    sys.modules.pop("probe_single_pass_adamw", None)
    import probe_single_pass_adamw as probe

    out = tmp_path / "probe.json"
    args = ["--elements", "4096", "--speed-elements", "4096", "--repeats", "1", "--json", "--out", str(out)]
    assert probe.main(args) == 0
    doc = json.loads(out.read_text())
    rows = doc["exactness"]
    assert len(rows) == 2 * len(probe.SETTINGS)
    assert all(r["fraction_differing"]["exp_avg"] == 0.0 for r in rows)
    for i in range(len(probe.SETTINGS)):
        written, fused = rows[2 * i], rows[2 * i + 1]
        assert (written["exp_avg_sq_as"], fused["exp_avg_sq_as"]) == ("written", "fused multiply-add")
        exact = [r["fraction_differing"]["exp_avg_sq"] == 0.0 for r in (written, fused)]
        assert exact.count(True) == 1, rows
    speed = doc["speed"]
    assert speed["elements"] == 4096 and speed["single_pass_ms"] > 0 and speed["fused_adamw_fp32_ms"] > 0
    assert isinstance(speed["vectorised"], bool)
    # bf16_kahan needs no int16: its single pass, compiled as the exactness check says torch computes, ends where
    # StorageAdamW's own step ends, bit for bit
    assert doc["kahan"]["same_bits_as_storage_adamw"] is True and doc["kahan"]["elements"] == 4096
    with pytest.raises(SystemExit) as exit_:
        probe.main(["--elements", "8"])
    assert exit_.value.code == 2
