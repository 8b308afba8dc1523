"""GPU acceptance in one command: host syncs per recipe, throughput and peak memory at two model sizes (with the
peers: torchao applied by hand and Accelerate's own torchao FP8 path), ``estimate`` against each measured peak, and
a short ``compare``, written as one JSON and one markdown table.

Sections, in this order (the ones that matter most first; each is written to disk as soon as it is done, so a run
cut short keeps what it finished; ``--budget-s`` skips a section that would start past the budget):

1. ``machine``: GPU, driver, CUDA, torch / torchao / transformers / accelerate versions.
2. ``sync``: ``scripts/gpu_sync_check.py``'s Trainer run per recipe (a100-bf16, v100-fp16, h100-fp8-current through
   its real backend, and h100-fp8-delayed, h100-fp8-current, b200-mxfp8, b200-nvfp4 rehearsed): host syncs per step from
   hf_mixedprec on steps that do not log, and where they come from. The promise: 0 for every recipe.
3. ``throughput``: ``scripts/bench_gpu.py``'s variants at Llama-3-8B layer shapes (hidden 4096, intermediate
   14336, 32/8 heads, vocab 128256, ``--layers-8b`` layers, 4 x 2048 tokens) and at TinyLlama-1.1B shapes
   (8 x 1024 tokens): plain BF16 (eager and compiled), hf_mixedprec's BF16 and FP8 recipes through the Accelerate
   plugin, torchao FP8 tensorwise by hand and Accelerate's ``AORecipeKwargs`` path, all compiled per decoder layer;
   each row with ``estimate``'s figure for it.
4. ``moe``: ``scripts/bench_moe.py``: one Qwen3-30B-A3B MoE layer's experts (128 experts of 768, top-8, 4 x 2048
   tokens), forward + backward: BF16 ``grouped_mm``, hf_mixedprec's FP8 experts per scaling (emulated) and torchao's
   ``moe_training`` FP8 rowwise / MXFP8 grouped GEMMs where the GPU runs them, each against BF16.
5. ``compare``: ``hf-mixedprec compare`` of a100-bf16 and h100-fp8-current against the FP32 baseline.

    python scripts/gpu_acceptance.py --out runs/gpu_acceptance       # on one CUDA GPU, about 8 minutes
    python scripts/gpu_acceptance.py --cpu-smoke --out /tmp/smoke    # tiny shapes anywhere: checks the kit only

Then, to see where an FP8 step spends its time: ``python scripts/profile_fp8_step.py --out runs/profile``.

Exit status: 0 when every promise checked holds, 1 when one does not (a sync from hf_mixedprec, an error row),
2 for a mistake in the input (or no GPU without ``--cpu-smoke``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_gpu  # noqa: E402
import bench_harness as bh  # noqa: E402
import bench_moe  # noqa: E402
import gpu_sync_check  # noqa: E402

#: Llama-3-8B's layer shapes (the layer count is set per run: as many as the time and memory allow)
LLAMA3_8B_LAYERS: dict[str, Any] = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 4,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}
SYNC_CASES: list[tuple[str, bool]] = [  # (recipe, rehearsed)
    ("a100-bf16", False),
    ("v100-fp16", False),
    ("h100-fp8-current", False),
    ("h100-fp8-delayed", False),  # without TE: the native backend, real FP8 GEMMs
    ("h100-fp8-current", True),
    ("h100-fp8-delayed", True),
    ("b200-mxfp8", True),
    ("b200-nvfp4", True),
]
VARIANTS_8B = [
    "bf16-compile",
    "accel-bf16-hf_mixedprec-compile",
    "fp8-torchao-tensorwise",
    "accel-fp8-hf_mixedprec-compile",
    "accel-fp8-ao-compile",
    "fp8-native-delayed",
    "fp8-native-current",
    "accel-fp8-native-hf_mixedprec-compile",
    "accel-fp4-hf_mixedprec-compile",
]
VARIANTS_1B = [
    "bf16",
    "bf16-compile",
    "accel-bf16",
    "accel-bf16-hf_mixedprec",
    "accel-bf16-compile",
    "accel-bf16-hf_mixedprec-compile",
    "fp8-torchao-tensorwise",
    "accel-fp8-hf_mixedprec-compile",
    "accel-fp8-ao-compile",
    "fp8-native-delayed",
    "accel-fp8-native-hf_mixedprec-compile",
]
#: the recipe whose ``estimate`` each variant's measured peak is set against (the same storage and compute;
#: "torchao" / "native": h100-fp8-current / h100-fp8-delayed on that backend, "native-current": current on native)
ESTIMATE_RECIPE = {
    "bf16": "a100-bf16",
    "bf16-compile": "a100-bf16",
    "accel-bf16": "a100-bf16",
    "accel-bf16-hf_mixedprec": "a100-bf16",
    "accel-bf16-compile": "a100-bf16",
    "accel-bf16-hf_mixedprec-compile": "a100-bf16",
    "fp8-torchao-tensorwise": "torchao",
    "accel-fp8-hf_mixedprec-compile": "torchao",
    "accel-fp8-ao-compile": "torchao",
    "fp8-native-delayed": "native",
    "fp8-native-current": "native-current",
    "accel-fp8-native-hf_mixedprec-compile": "native",
}
#: what the kit keeps of each ``compare`` run
COMPARE_KEYS = ("recipe", "verdict", "final_loss", "final_delta_pct", "skip_rate", "tokens_per_s", "peak_memory_bytes")
#: the top-level fields of the JSON (the test suite checks them on the CPU smoke run)
FIELDS = ("kit", "cpu_smoke", "machine", "sync", "throughput", "moe", "compare", "verdict", "skipped_sections")
SECTIONS = ("sync", "8b", "moe", "compare", "1b")


def machine() -> dict[str, Any]:
    """``bench_gpu.py``'s machine description, with the NVIDIA driver and the GPU's memory."""
    out = bench_gpu.machine(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    out["driver"] = None
    if torch.cuda.is_available():
        with contextlib.suppress(Exception):
            q = ["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"]
            out["driver"] = subprocess.run(q, capture_output=True, text=True, timeout=20).stdout.strip()
    return out


def sync_section(smoke: bool) -> list[dict[str, Any]]:
    if not torch.cuda.is_available():
        why = "needs CUDA (torch.cuda.set_sync_debug_mode); on CPU tests/training/test_no_host_sync_device.py guards it"
        return [{"recipe": r, "rehearsed": h, "status": "skipped", "reason": why} for r, h in SYNC_CASES]
    rows = []
    plain_done = set()
    for name, rehearse in SYNC_CASES:
        for use in (False, True):
            key = (name.split("-")[1] if "-" in name else name, use)
            if not use and key in plain_done:
                continue  # one plain Trainer per precision is the baseline
            plain_done.add(key)
            try:
                r = gpu_sync_check.run_one(name, use, 12, 6, 4, 256, rehearse=rehearse if use else None)
                r["status"] = "ok"
            except Exception as exc:  # a failure is a row, not the end of the kit
                r = {"recipe": name, "side": "hf_mixedprec" if use else "plain", "status": "error", "reason": repr(exc)}
            r["rehearsed"] = rehearse
            nl = r.get("non_logging", {})
            r["hf_mixedprec_syncs_per_step"] = nl.get("hf_mixedprec", 0) / max(r.get("steps_non_logging", 1), 1)
            rows.append(r)
            print(f"  sync {r.get('recipe')} {r.get('side')}: {r['status']}", file=sys.stderr)
    return rows


def _estimate(config: dict[str, Any], key: str, batch: int, seq: int) -> dict[str, Any]:
    from transformers import LlamaConfig

    from hf_mixedprec.commands.estimate import estimate_memory
    from hf_mixedprec.integrations.recipe import resolve_recipe

    which = ESTIMATE_RECIPE.get(key)
    if which is None:
        return {}
    recipe: Any = which
    if which in ("torchao", "native", "native-current"):
        base = "h100-fp8-delayed" if which == "native" else "h100-fp8-current"
        backend = which.split("-")[0]
        recipe = resolve_recipe({"name": f"{base}-{backend}", "extends": base, "fp8": {"backend": backend}})
    cfg = LlamaConfig(**config)
    try:
        est = estimate_memory(cfg, [recipe], batch_size=batch, seq_len=seq)
        return {"estimate_recipe": which, "estimate_gib": est.recipes[0].memory.total / 2**30}
    except Exception as exc:  # estimate's limits are part of the answer
        return {"estimate_recipe": which, "estimate_error": repr(exc)[:300]}


def throughput_size(label: str, config: dict[str, Any], variants: list[str], o: argparse.Namespace) -> dict[str, Any]:
    smoke = o.cpu_smoke
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batch, seq = (2, 64) if smoke else ((4, 2048) if label.startswith("llama3-8b") else (8, 1024))
    if smoke:
        config = dict(bench_gpu.TINY)
    from hf_mixedprec.core.demo import builtin_text, byte_batches

    warmup, steps = (1, 2) if smoke else (3, o.steps)
    data = byte_batches(builtin_text(), seq_len=seq, batch_size=batch, n_batches=min(warmup + steps, 8))
    data = [d.remainder(config["vocab_size"]).to(device) for d in data]
    ctx = bench_gpu.Ctx(device, smoke, config, data, warmup, steps)
    params = bench_gpu.count_parameters(config)
    rows = []
    variants = [v for v in variants if not o.variants or v in o.variants]
    for key in variants:
        if time.monotonic() > o.deadline:
            rows.append({"key": key, "variant": bench_gpu.VARIANTS[key], "status": "skipped", "reason": "budget"})
            continue
        row = bench_gpu.run_variant(key, ctx, batch * seq)
        row.update(_estimate(config, key, batch, seq))
        if row.get("peak_mem_gib") and row.get("estimate_gib"):
            row["estimate_over_measured"] = row["estimate_gib"] / row["peak_mem_gib"]
        rows.append(row)
    bench_gpu.relative(rows)
    by = {r["key"]: r for r in rows}

    def ratio(a: str, b: str, field: str = "tokens_per_s") -> float | None:
        ra, rb = by.get(a), by.get(b)
        if ra and rb and ra.get("status") == rb.get("status") == "ok":
            return ra[field] / rb[field]
        return None

    return {
        "label": label,
        "parameters": params,
        "config": config,
        "batch_size": batch,
        "seq_len": seq,
        "warmup": warmup,
        "steps": steps,
        "rows": rows,
        "ratios": {
            "fp8_ours_vs_bf16_compile": ratio("accel-fp8-hf_mixedprec-compile", "bf16-compile"),
            "fp8_ours_vs_accelerate_ao": ratio("accel-fp8-hf_mixedprec-compile", "accel-fp8-ao-compile"),
            "fp8_ours_vs_torchao_by_hand": ratio("accel-fp8-hf_mixedprec-compile", "fp8-torchao-tensorwise"),
            "torchao_by_hand_vs_bf16_compile": ratio("fp8-torchao-tensorwise", "bf16-compile"),
            "fp8_native_delayed_vs_bf16_compile": ratio("fp8-native-delayed", "bf16-compile"),
            "fp8_native_delayed_vs_torchao_by_hand": ratio("fp8-native-delayed", "fp8-torchao-tensorwise"),
            "fp8_native_ours_vs_bf16_compile": ratio("accel-fp8-native-hf_mixedprec-compile", "bf16-compile"),
            "callbacks_overhead_eager": ratio("accel-bf16-hf_mixedprec", "accel-bf16", "ms_per_step_median"),
            "callbacks_overhead_compiled": ratio(
                "accel-bf16-hf_mixedprec-compile", "accel-bf16-compile", "ms_per_step_median"
            ),
        },
    }


def compare_section(o: argparse.Namespace) -> dict[str, Any]:
    out_dir = Path(o.out) / "compare"
    smoke = ["--max-steps", "2", "--seq-len", "32", "--batch-size", "2", "--eval-split", "0.01"]
    steps = smoke if o.cpu_smoke else ["--max-steps", "40"]
    recipes = "cpu-bf16" if o.cpu_smoke else "a100-bf16,h100-fp8-current"
    cmd = [sys.executable, "-m", "hf_mixedprec.cli", "compare", "--recipes", recipes, *steps]
    cmd += ["--output-dir", str(out_dir), "--overwrite", "--json"]
    t0 = time.monotonic()
    doc: dict[str, Any] = {"command": " ".join(cmd[1:])}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(60, o.deadline - time.monotonic()))
    except subprocess.TimeoutExpired as exc:
        doc.update(exit_code=None, wall_s=time.monotonic() - t0, error=f"timed out after {exc.timeout:.0f} s")
        return doc
    doc.update(exit_code=p.returncode, wall_s=time.monotonic() - t0)
    try:
        res = json.loads((out_dir / "compare.json").read_text(encoding="utf-8"))
        doc["runs"] = [{k: r.get(k) for k in COMPARE_KEYS} for r in res.get("runs", [])]
    except (OSError, ValueError) as exc:
        doc["error"] = f"{exc!r}; stderr: {p.stderr[-800:]}"
    return doc


def verdict(doc: dict[str, Any]) -> dict[str, Any]:
    syncs = [r for r in doc["sync"] if r.get("side") == "hf_mixedprec" and r.get("status") == "ok"]
    errors = [
        f"{s['label']}: {r['key']}: {r.get('reason')}"
        for s in doc["throughput"]
        for r in s["rows"]
        if r.get("status") == "error"
    ]
    errors += [f"sync {r.get('recipe')}: {r.get('reason')}" for r in doc["sync"] if r.get("status") == "error"]
    moe_rows = (doc.get("moe") or {}).get("rows", [])
    errors += [f"moe {r['key']}: {r.get('reason')}" for r in moe_rows if r.get("status") == "error"]
    c = doc.get("compare") or {}
    if c and (c.get("error") or c.get("exit_code") not in (0, 4)):  # 4: a recipe failed its criteria (a finding)
        errors.append(f"compare: exit {c.get('exit_code')}: {c.get('error', '')}")
    return {
        "zero_syncs_from_hf_mixedprec": all(r["hf_mixedprec_syncs_per_step"] == 0 for r in syncs) if syncs else None,
        "errors": errors,
    }


def _fmt(v: Any, spec: str = ".2f") -> str:
    return "–" if v is None else format(v, spec)


def _sync_table(rows: list[dict[str, Any]]) -> str:
    header = ["recipe", "side", "hf_mixedprec syncs/step", "others/step", "where (hf_mixedprec)"]
    cells = []
    for r in rows:
        if r.get("status") != "ok":
            cells.append([r.get("recipe"), r.get("side", ""), "–", "–", f"{r['status']}: {r.get('reason')}"])
            continue
        nl, n = r["non_logging"], max(r["steps_non_logging"], 1)
        others = (sum(nl.values()) - nl.get("hf_mixedprec", 0)) / n
        sites = ", ".join(f"{k} x{v}" for k, v in r["hf_mixedprec_non_logging_sites"].items()) or "–"
        cells.append([r["recipe"], r["side"], f"{r['hf_mixedprec_syncs_per_step']:.2f}", f"{others:.2f}", sites])
    return bh.md_table(header, "llrrl", cells)


def _throughput_table(rows: list[dict[str, Any]]) -> str:
    header = ["variant", "status", "tokens/s", "ms/step", "peak GiB", "estimate GiB", "est/measured"]
    header += ["vs reference", "notes"]
    cells = []
    for r in rows:
        if r.get("status") != "ok":
            cells.append([r["variant"], r["status"], *["–"] * 6, r.get("reason")])
            continue
        ref = r.get("reference")
        rel = (
            f"{r['speed_vs_reference']:.3f}x {ref}"
            if r.get("speed_vs_reference") is not None and ref != r["key"]
            else "–"
        )
        speed = [f"{r['tokens_per_s']:,.0f}", f"{r['ms_per_step_median']:.1f}"]
        memory = [
            _fmt(r.get("peak_mem_gib")),
            _fmt(r.get("estimate_gib")),
            _fmt(r.get("estimate_over_measured"), ".3f"),
        ]
        cells.append([r["variant"], "ok", *speed, *memory, rel, "; ".join(r.get("notes", []))])
    return bh.md_table(header, "llrrrrrll", cells)


def markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    lines = [
        f"Machine: {m.get('device')} (driver {m.get('driver')}), torch {m.get('torch')} (CUDA {m.get('cuda')}), "
        f"torchao {m.get('torchao')}, transformers {m.get('transformers')}, accelerate {m.get('accelerate')}.",
        f"Command: `python scripts/gpu_acceptance.py{' --cpu-smoke' if doc['cpu_smoke'] else ''}`",
        "",
        "Host syncs per step on steps that do not log (Trainer, small Llama, 12 steps, logging every 6):",
        "",
        _sync_table(doc["sync"]),
    ]
    for s in doc["throughput"]:
        lines += [
            "",
            f"Throughput, {s['label']}: {s['parameters']:,} parameters, batch {s['batch_size']} x {s['seq_len']} "
            f"tokens, {s['warmup']} warm-up + {s['steps']} timed steps per row:",
            "",
            _throughput_table(s["rows"]),
            "",
        ]
        lines += [f"- {k}: {_fmt(v, '.3f')}" for k, v in s["ratios"].items()]
    if doc.get("moe"):
        lines += ["", bench_moe.markdown(doc["moe"]), ""]
    c = doc.get("compare") or {}
    if c:
        lines += ["", f"compare (`{c.get('command')}`): exit {c.get('exit_code')}, {c.get('wall_s', 0):.0f} s"]
        for r in c.get("runs", []):
            lines.append(f"- {r}")
        if c.get("error"):
            lines.append(f"- error: {c['error']}")
    v = doc["verdict"]
    lines += [
        "",
        f"Verdict: 0 syncs from hf_mixedprec: {v['zero_syncs_from_hf_mixedprec']}; errors: {v['errors'] or 'none'}",
    ]
    if doc["skipped_sections"]:
        lines.append(f"Sections skipped (budget): {', '.join(doc['skipped_sections'])}")
    return "\n".join(lines) + "\n"


def write(doc: dict[str, Any], out: Path) -> None:
    doc["verdict"] = verdict(doc)
    bh.write_json(out / "acceptance.json", doc, indent=1, default=str)
    (out / "acceptance.md").write_text(markdown(doc), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/gpu_acceptance", help="folder for acceptance.json / acceptance.md")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, any device: checks the kit, no figures")
    ap.add_argument("--budget-s", type=float, default=480.0, help="start no section past this many seconds")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per throughput row (default 8)")
    ap.add_argument("--layers-8b", type=int, default=4, help="decoder layers at Llama-3-8B shapes (default 4)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="which sections, comma-separated (default all)")
    ap.add_argument(
        "--variants", default="", help="only these throughput rows (bench_gpu.py keys, comma-separated; default all)"
    )
    o = ap.parse_args(argv)
    o.variants = [v.strip() for v in o.variants.split(",") if v.strip()]
    bad_variants = sorted(set(o.variants) - set(bench_gpu.VARIANTS))
    if bad_variants:
        print(
            f"gpu_acceptance: --variants: unknown {bad_variants}; allowed: {', '.join(bench_gpu.VARIANTS)}",
            file=sys.stderr,
        )
        return 2
    if o.steps < 1 or o.layers_8b < 1 or o.budget_s <= 0:
        print("gpu_acceptance: --steps, --layers-8b and --budget-s must be positive", file=sys.stderr)
        return 2
    if not torch.cuda.is_available() and not o.cpu_smoke:
        print("gpu_acceptance: no CUDA GPU here; use --cpu-smoke to check the kit on tiny shapes", file=sys.stderr)
        return 2
    sections = [s.strip() for s in o.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        print(f"gpu_acceptance: --sections: unknown {unknown}; allowed: {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    out = Path(o.out)
    out.mkdir(parents=True, exist_ok=True)
    o.deadline = time.monotonic() + o.budget_s
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    doc: dict[str, Any] = {
        "kit": "gpu_acceptance/1",
        "cpu_smoke": o.cpu_smoke,
        "machine": machine(),
        "sync": [],
        "throughput": [],
        "moe": {},
        "compare": {},
        "skipped_sections": [],
    }
    write(doc, out)
    config_8b = {**LLAMA3_8B_LAYERS, "num_hidden_layers": o.layers_8b}
    plan = {
        "sync": lambda: doc.__setitem__("sync", sync_section(o.cpu_smoke)),
        "8b": lambda: doc["throughput"].append(
            throughput_size(f"llama3-8b layer shapes, {o.layers_8b} layers", config_8b, VARIANTS_8B, o)
        ),
        "1b": lambda: doc["throughput"].append(throughput_size("llama 1.1B", dict(bench_gpu.LLAMA_1B), VARIANTS_1B, o)),
        "moe": lambda: doc.__setitem__(
            "moe", bench_moe.moe_section(cpu_smoke=o.cpu_smoke, steps=o.steps, deadline=o.deadline)
        ),
        "compare": lambda: doc.__setitem__("compare", compare_section(o)),
    }
    with bh.stdout_to_stderr():
        for name in sections:
            if time.monotonic() > o.deadline:
                doc["skipped_sections"].append(name)
                continue
            t0 = time.monotonic()
            print(f"gpu_acceptance: {name}...", file=sys.stderr)
            plan[name]()
            print(f"gpu_acceptance: {name} done in {time.monotonic() - t0:.0f} s", file=sys.stderr)
            write(doc, out)
    write(doc, out)
    print(markdown(doc))
    v = doc["verdict"]
    return 1 if v["errors"] or v["zero_syncs_from_hf_mixedprec"] is False else 0


if __name__ == "__main__":
    sys.exit(main())
