"""The MoE experts' GEMMs, forward and backward, side by side in one run: BF16 through transformers' ``grouped_mm``
experts implementation, hf_mixedprec's FP8 experts per scaling (the emulated backend: the exact rehearsal, what it
costs), and torchao's ``prototype.moe_training`` FP8 rowwise and MXFP8 grouped GEMMs where they run (CUDA; MXFP8 on
SM100).

Shapes: one Qwen3-30B-A3B MoE layer (hidden 2048, 128 experts of 768, top-8) on 4 x 2048 tokens routed at random
(seeded, so every row sees the same groups); ``--cpu-smoke`` shrinks it to run anywhere. Every row runs the same
experts module (``Qwen3MoeExperts`` from transformers, BF16 parameters) on the same inputs; the figure is the median
milliseconds of forward + backward per step and its speed against the BF16 row.

    python scripts/bench_moe.py --json                 # on one CUDA GPU
    python scripts/bench_moe.py --cpu-smoke --json     # tiny shapes anywhere: checks the kit only

``scripts/gpu_acceptance.py`` runs it as its ``moe`` section.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_harness as bh

#: one Qwen3-30B-A3B MoE layer (its published config: hidden 2048, moe_intermediate 768, 128 experts, top-8)
QWEN3_30B_A3B_MOE: dict[str, int] = {
    "hidden_size": 2048,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
}
TINY_MOE: dict[str, int] = {"hidden_size": 64, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2}
#: the built-in recipe whose FP8 settings each of our rows takes
RECIPE_OF = {"current": "h100-fp8-current", "delayed": "h100-fp8-delayed", "blockwise": "h100-fp8-blockwise",
             "mxfp8": "b200-mxfp8"}  # fmt: skip
SCALINGS = tuple(RECIPE_OF)
ROWS = ("bf16-grouped_mm", *(f"fp8-ours-emulated-{s}" for s in SCALINGS), "fp8-torchao-rowwise", "fp8-torchao-mxfp8")
TORCHAO_IMPL = "bench_torchao_moe"


def experts_module(shape: dict[str, int], device: torch.device) -> torch.nn.Module:
    """Qwen3-MoE's experts module at ``shape`` in BF16, seeded."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(**shape, intermediate_size=shape["moe_intermediate_size"], num_hidden_layers=1)
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    mod = Qwen3MoeExperts(cfg)
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_(0.0, 0.02)
    return mod.to(device=device, dtype=torch.bfloat16)


def routed_inputs(shape: dict[str, int], tokens: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Hidden states, each token's top-k experts (distinct, uniform at random) and softmaxed weights, seeded."""
    g = torch.Generator().manual_seed(1)
    e, k = shape["num_experts"], shape["num_experts_per_tok"]
    x = torch.randn(tokens, shape["hidden_size"], generator=g).to(device, torch.bfloat16)
    idx = torch.rand(tokens, e, generator=g).topk(k, dim=-1).indices
    w = torch.rand(tokens, k, generator=g).softmax(-1)
    return x, idx.to(device), w.to(device, torch.bfloat16)


def _torchao_experts(rowwise: bool) -> Callable[..., torch.Tensor]:
    """An experts function for transformers' interface whose two GEMMs run through torchao's moe_training (rows
    sorted by expert as transformers' ``grouped_mm`` sorts them; torchao pads the groups)."""
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm, _to_mxfp8_then_scaled_grouped_mm

    from hf_mixedprec.fp8.experts import tokens_per_expert

    def gemm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        b_t = w.transpose(-2, -1)  # [E, in, out], per-group column-major as both functions require
        if rowwise:
            return _to_fp8_rowwise_then_scaled_grouped_mm(a, b_t, offs, out_dtype=torch.bfloat16)
        return _to_mxfp8_then_scaled_grouped_mm(
            a, b_t, offs, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=True
        )

    def forward(self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        n, k = top_k_index.shape
        ids, order = torch.sort(top_k_index.reshape(-1), stable=True)
        rows = hidden_states[order // k]
        offs = torch.cumsum(tokens_per_expert(ids, self.num_experts), 0, dtype=torch.int32)
        h = self._apply_gate(gemm(rows, self.gate_up_proj, offs))
        out = gemm(h, self.down_proj, offs) * top_k_weights.reshape(-1)[order].unsqueeze(-1)
        unsorted = torch.empty_like(out).index_copy_(0, order, out)
        return unsorted.view(n, k, -1).float().sum(1).to(hidden_states.dtype)

    return forward


def prepare(key: str, mod: torch.nn.Module, device: torch.device) -> None:
    """Switch ``mod`` to the row's experts implementation (raises :class:`Skip` where it cannot run here)."""
    if key == "bf16-grouped_mm":
        return
    if key.startswith("fp8-ours-emulated-"):
        from hf_mixedprec import load_recipe
        from hf_mixedprec.fp8.emulated import EmulationSpec
        from hf_mixedprec.fp8.experts import ExpertsFP8, convert_experts

        recipe = load_recipe(RECIPE_OF[key.rsplit("-", 1)[1]], rehearse=True)
        spec = ExpertsFP8.from_spec(EmulationSpec.from_config(recipe.fp8), previous="grouped_mm")
        holder = torch.nn.Module()
        holder.add_module("experts", mod)
        convert_experts(holder, ["experts"], spec)
        return
    if device.type != "cuda":
        raise bh.Skip("torchao's scaled grouped GEMMs need a CUDA GPU")
    cap = torch.cuda.get_device_capability(device)
    if key == "fp8-torchao-rowwise" and cap < (9, 0):
        raise bh.Skip(f"FP8 rowwise grouped GEMM needs SM90 or newer; this GPU is SM{cap[0]}{cap[1]}")
    if key == "fp8-torchao-mxfp8" and cap < (10, 0):
        raise bh.Skip(f"MXFP8 grouped GEMM needs SM100 or newer; this GPU is SM{cap[0]}{cap[1]}")
    try:
        forward = _torchao_experts(rowwise=key == "fp8-torchao-rowwise")
    except ImportError as exc:
        raise bh.Skip(f"torchao.prototype.moe_training is not importable: {exc}") from exc
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(f"{TORCHAO_IMPL}-{key}", forward)
    mod.config._experts_implementation = f"{TORCHAO_IMPL}-{key}"


def run_row(key: str, shape: dict[str, int], tokens: int, device: torch.device, warmup: int, steps: int) -> dict:
    row: dict[str, Any] = {"key": key, "status": "ok", "reason": None, "ms_per_step_median": None,
                           "tokens_per_s": None, "peak_mem_gib": None}  # fmt: skip
    bh.release_memory(device)
    t0 = time.perf_counter()
    with bh.row_outcome(row):
        mod = experts_module(shape, device)
        prepare(key, mod, device)
        x, idx, w = routed_inputs(shape, tokens, device)
        x.requires_grad_(True)
        grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(device, x.dtype)

        def step(_: object) -> None:
            mod(x, idx, w).backward(grad)
            x.grad = None
            for p in mod.parameters():
                p.grad = None

        times = bh.time_steps(step, [None], warmup=warmup, steps=steps, sync=lambda: bh.sync(device))
        med = statistics.median(times)
        row.update(ms_per_step_median=med * 1e3, tokens_per_s=tokens / med, peak_mem_gib=bh.cuda_peak_gib(device))
    row["wall_s"] = time.perf_counter() - t0
    bh.release_memory(device)
    print(f"  moe {key}: {row['status']} ({row['wall_s']:.1f} s)", file=sys.stderr)
    return row


def moe_section(*, cpu_smoke: bool, steps: int, rows: tuple[str, ...] = ROWS, deadline: float | None = None) -> dict:
    """Every row at the section's shapes, with each row's speed against ``bf16-grouped_mm`` (see the module docs)."""
    device = torch.device("cuda" if torch.cuda.is_available() and not cpu_smoke else "cpu")
    shape = TINY_MOE if cpu_smoke else QWEN3_30B_A3B_MOE
    tokens = 64 if cpu_smoke else 4 * 2048
    warmup, steps = (1, 2) if cpu_smoke else (3, steps)
    out = []
    for key in rows:
        if deadline is not None and time.monotonic() > deadline:
            out.append({"key": key, "status": "skipped", "reason": "budget"})
            continue
        out.append(run_row(key, shape, tokens, device, warmup, steps))
    ref = next((r for r in out if r["key"] == "bf16-grouped_mm" and r["status"] == "ok"), None)
    for r in out:
        ok = ref is not None and r["status"] == "ok"
        r["speed_vs_bf16"] = ref["ms_per_step_median"] / r["ms_per_step_median"] if ok else None
    macs = 3 * shape["hidden_size"] * shape["moe_intermediate_size"] * shape["num_experts_per_tok"] * tokens
    return {"label": "Qwen3-30B-A3B MoE layer" if not cpu_smoke else "tiny MoE layer", "shape": shape,
            "tokens": tokens, "device": str(device), "gemm_flops_per_step": 3 * 2 * macs, "rows": out}  # fmt: skip


def markdown(doc: dict[str, Any]) -> str:
    head = f"{doc['label']} ({doc['tokens']} tokens, {doc['shape']}, {doc['device']}): experts forward + backward"
    rows = [[r["key"], r["status"], bh_fmt(r.get("ms_per_step_median")), bh_fmt(r.get("speed_vs_bf16"), ".3f") + ("x" if r.get("speed_vs_bf16") is not None else ""),
             bh_fmt(r.get("peak_mem_gib")), r.get("reason") or ""] for r in doc["rows"]]  # fmt: skip
    return head + "\n\n" + bh.md_table(["row", "status", "ms/step", "vs BF16", "peak GiB", "note"], "llrrrl", rows)


def bh_fmt(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU: checks the kit, no figures")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per row (default 10)")
    ap.add_argument("--rows", default="", help=f"only these rows, comma-separated (default all: {', '.join(ROWS)})")
    ap.add_argument("--json", action="store_true", help="print the JSON document instead of the table")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    o = ap.parse_args(argv)
    rows = tuple(r.strip() for r in o.rows.split(",") if r.strip()) or ROWS
    bad = sorted(set(rows) - set(ROWS))
    if bad or o.steps < 1:
        what = f"--rows: unknown {bad}; allowed: {', '.join(ROWS)}" if bad else f"--steps: {o.steps} (must be >= 1)"
        print(f"bench_moe: {what}", file=sys.stderr)
        return 2
    with bh.stdout_to_stderr():
        doc = moe_section(cpu_smoke=o.cpu_smoke, steps=o.steps, rows=rows)
    doc["machine"] = bh.machine(torch.device(doc["device"]), libraries=("transformers", "torchao"))
    bh.report(doc, out=o.out, as_json=o.json, render=lambda: markdown(doc))
    return 1 if any(r["status"] == "error" for r in doc["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
