"""Time forward+backward of one Linear: BF16 vs our emulated FP8 scalings vs torchao's emulate mode.

All variants run side by side in one process, interleaved round by round, and the median per variant is
reported with its ratio to the plain BF16 Linear. Emulation is for rehearsing numerics, not for speed;
this measures what a rehearsal costs.

Each block-scaled rule is also measured against the best CPU reference for the same rule, in the same rounds:
our ``mxfp8`` (E4M3 everywhere, as torchao) against torchao's MXFP8 training Linear with the emulated kernels
(``MXFP8Linear(kernel_preference=EMULATED)``, same RCEIL rule, block 32), and, if that cannot train here, our
``quantize_mxfp8``/``dequantize_mxfp8`` against torchao's ``to_mx`` + dequantize of the same tensors. torchao has
no emulation of TE's blockwise rule (1x128 / 128x128 tiles), so ``blockwise`` is set against our own current
scaling. ``--torch-threads`` sets torch's thread count (default: torch's own).

    python scripts/bench_fp8_emulation.py [--tokens 2048] [--features 1024] [--rounds 7] [--torch-threads N]
        [--json out.json]
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


def _recipe(scaling: str, backend: str = "emulated", fmt: str | None = None):
    fp8 = {"scaling": scaling, "backend": backend} | ({"format": fmt} if fmt else {})
    return resolve_recipe({"name": f"bench-{scaling}", "precision": "fp8", "fp8": fp8})


def _torchao_mx_linear(base: nn.Linear) -> tuple[nn.Module | None, str]:
    """torchao's MXFP8 training Linear (emulated kernels, RCEIL, E4M3, block 32) holding ``base``'s weights, or
    None and why not."""
    try:
        from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

        m = MXFP8Linear(
            base.in_features,
            base.out_features,
            bias=base.bias is not None,
            kernel_preference=KernelPreference.EMULATED,
            scale_calculation_mode=ScaleCalculationMode.RCEIL,
        )
        m.load_state_dict(base.state_dict())
        probe = copy.deepcopy(m)  # one training step on CPU, so an exception is torchao's own and shown
        xp = torch.randn(32, base.in_features, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            yp = probe(xp)
        yp.float().sum().backward()
        return nn.Sequential(m), "torchao.prototype.moe_training.mxfp8_linear.MXFP8Linear(kernel_preference=EMULATED)"
    except Exception as e:  # report torchao's own exception
        return None, f"{type(e).__name__}: {e}"


def _torchao_to_mx_qdq():
    """torchao's ``to_mx`` + dequantize (RCEIL, E4M3, block 32) along the last dim of a contiguous tensor."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    def qdq(t: torch.Tensor) -> torch.Tensor:
        mx = MXTensor.to_mx(t, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL, KernelPreference.EMULATED)
        return mx.dequantize(torch.float32)

    return qdq


def _interleaved(fns: dict[str, object], rounds: int) -> dict[str, float]:
    """Median ms of each callable, one warm-up call each, then ``rounds`` rounds in turn."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--features", type=int, default=1024, help="in = out features")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--torch-threads", type=int, help="torch.set_num_threads (default: torch's own)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
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
    # like-for-like MXFP8 pair: torchao's MX training is E4M3 for every operand, so ours is too here
    m = copy.deepcopy(base)
    convert(m, _recipe("mxfp8", fmt="E4M3"))
    variants["emulated mxfp8, E4M3 all operands"] = m
    ao_mx, ao_mx_note = _torchao_mx_linear(base[0])
    if ao_mx is not None:
        variants["torchao MXFP8Linear (emulated kernels)"] = ao_mx
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
    ms = {r["variant"]: r["median_ms"] for r in rows}
    refs = []
    print("\nBlock-scaled rules against the best CPU reference for the same rule (same rounds as above):")
    print(
        "| rule | ours | reference | ours ms | reference ms | ours / reference |\n| --- | --- | --- | ---: | ---: | ---: |"
    )
    if ao_mx is not None:
        refs.append(
            (
                "MXFP8 (E4M3, block 32, RCEIL)",
                "emulated mxfp8, E4M3 all operands",
                "torchao MXFP8Linear (emulated kernels)",
            )
        )
    refs.append(("blockwise (1x128 / 128x128)", "emulated blockwise", "emulated current"))
    ref_rows = []
    for rule, ours, ref in refs:
        ratio = ms[ours] / ms[ref]
        ref_rows.append({"rule": rule, "ours": ours, "reference": ref, "ratio": round(ratio, 2)})
        print(f"| {rule} | {ours} | {ref} | {ms[ours]:.2f} | {ms[ref]:.2f} | {ratio:.2f} |")
    qdq_rows = []
    if ao_mx is None:
        print(f"torchao's MX emulation cannot train a Linear here: {ao_mx_note}")
        print("Closest like-for-like reference: quantize-dequantize of the same tensors (E4M3, block 32, RCEIL).")
        qdq_rows = _qdq_rows(x, gy, base[0].weight.detach(), args.rounds)
    print(f"MXFP8 reference: {ao_mx_note}" if ao_mx is not None else "")
    print(
        "blockwise: torchao has no emulation of TE's Float8BlockScaling rule (1x128 / 128x128 tiles); "
        "the reference is our own current (per-tensor) scaling"
    )
    if args.json:
        with open(args.json, "w") as f:
            out = {"machine": machine, "args": vars(args), "rows": rows, "references": ref_rows, "qdq": qdq_rows}
            json.dump(out | {"mxfp8_reference": ao_mx_note}, f, indent=2)


def _qdq_rows(x: torch.Tensor, gy: torch.Tensor, w: torch.Tensor, rounds: int) -> list[dict]:
    """Our quantize_mxfp8 + dequantize_mxfp8 against torchao's to_mx + dequantize, per tensor, interleaved."""
    from hf_mixedprec.scaling.mx import dequantize_mxfp8, quantize_mxfp8

    ao = _torchao_to_mx_qdq()

    def ours(t: torch.Tensor) -> torch.Tensor:
        data, codes = quantize_mxfp8(t, fmt="e4m3", block_size=32, rounding="rceil")
        return dequantize_mxfp8(data, codes, block_size=32)

    fns = {}
    for name, t in (("x", x), ("W", w), ("dy", gy)):
        fns[f"ours {name}"] = lambda t=t: ours(t)
        fns[f"torchao {name}"] = lambda t=t: ao(t)
    med = _interleaved(fns, rounds)
    rows = []
    print("| tensor | ours ms | torchao to_mx ms | ours / torchao |\n| --- | ---: | ---: | ---: |")
    for name in ("x", "W", "dy"):
        a, b = med[f"ours {name}"], med[f"torchao {name}"]
        rows.append({"tensor": name, "ours_ms": round(a, 2), "torchao_ms": round(b, 2), "ratio": round(a / b, 2)})
        print(f"| {name} | {a:.2f} | {b:.2f} | {a / b:.2f} |")
    return rows


if __name__ == "__main__":
    main()
