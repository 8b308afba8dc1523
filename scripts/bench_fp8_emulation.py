"""Time forward+backward of one Linear: BF16 vs our emulated FP8 scalings vs torchao's emulate mode.

All variants run side by side in one process, interleaved round by round, and the median per variant is
reported with its ratio to the plain BF16 Linear. Emulation is for rehearsing numerics, not for speed;
this measures what a rehearsal costs.

    python scripts/bench_fp8_emulation.py [--tokens 2048] [--features 1024] [--rounds 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time

import torch
from torch import nn

from hf_mixedprec.fp8 import convert
from hf_mixedprec.recipe import resolve_recipe


def _recipe(scaling: str, backend: str = "emulated"):
    return resolve_recipe(
        {"name": f"bench-{scaling}", "precision": "fp8", "fp8": {"scaling": scaling, "backend": backend}}
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--features", type=int, default=1024, help="in = out features")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args()
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(args.features, args.features))
    variants: dict[str, nn.Module] = {"bf16 nn.Linear (autocast)": copy.deepcopy(base)}
    for scaling in ("delayed", "current", "mxfp8", "blockwise"):
        m = copy.deepcopy(base)
        convert(m, _recipe(scaling))
        variants[f"emulated {scaling}"] = m
    m = copy.deepcopy(base)
    convert(m, _recipe("current", backend="torchao"))
    variants["torchao tensorwise (emulate=True)"] = m
    x = torch.randn(args.tokens, args.features)
    gy = torch.randn(args.tokens, args.features)

    def step(mod: nn.Module) -> None:
        xr = x.detach().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = mod(xr)
        y.backward(gy.to(y.dtype))
        mod.zero_grad(set_to_none=True)

    for mod in variants.values():  # warm-up
        step(mod)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.rounds):
        for name, mod in variants.items():
            t0 = time.perf_counter()
            step(mod)
            times[name].append(time.perf_counter() - t0)
    base_ms = statistics.median(times["bf16 nn.Linear (autocast)"]) * 1e3
    rows = []
    for name, ts in times.items():
        ms = statistics.median(ts) * 1e3
        rows.append({"variant": name, "median_ms": round(ms, 2), "vs_bf16": round(ms / base_ms, 2)})
    machine = (
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    print(
        f"fwd+bwd of a {args.features}x{args.features} Linear on {args.tokens} tokens, median of {args.rounds} rounds; {machine}"
    )
    print("| variant | median ms | x BF16 |\n| --- | ---: | ---: |")
    for r in rows:
        print(f"| {r['variant']} | {r['median_ms']:.2f} | {r['vs_bf16']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
