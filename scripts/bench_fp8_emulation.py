"""Time forward+backward of one Linear: BF16 vs our emulated FP8 scalings vs torchao's emulate mode.

All variants run side by side in one process, interleaved round by round, and the median per variant is
reported with its ratio to the plain BF16 Linear. Emulation is for rehearsing numerics, not for speed;
this measures what a rehearsal costs.

Each block-scaled rule is also measured against the best CPU reference for the same rule, in the same rounds:
our ``mxfp8`` (E4M3 everywhere, as torchao) against torchao's MXFP8 training Linear with the emulated kernels
(``MXFP8Linear(kernel_preference=EMULATED)``, same RCEIL rule, block 32), and, if that cannot train here, our
``quantize_mxfp8``/``dequantize_mxfp8`` against torchao's ``to_mx`` + dequantize of the same tensors. torchao has
no emulation of TE's blockwise rule (1x128 / 128x128 tiles), so ``blockwise`` is set against our own current
scaling; ``nvfp4`` (TE's NVFP4BlockScaling) is set against our MXFP8 rehearsal, what a Blackwell user rehearses
otherwise. ``--torch-threads`` sets torch's thread count (default: torch's own).

    python scripts/bench_fp8_emulation.py [--tokens 2048] [--features 1024] [--rounds 7] [--torch-threads N]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import statistics

import bench_harness as bh
import torch
from torch import nn

from hf_mixedprec.fp8 import convert
from hf_mixedprec.integrations.recipe import resolve_recipe


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


def _variants(features: int) -> tuple[nn.Sequential, dict[str, nn.Module], str | None, str]:
    """The BF16 Linear, a copy of it per emulated scaling (and torchao's emulations); the base, the variants, the
    name of torchao's MXFP8 Linear where it trains here (else None) and what that reference is (or why not)."""
    bh.seed_all(0)
    base = nn.Sequential(nn.Linear(features, features))
    variants: dict[str, nn.Module] = {"bf16 nn.Linear (autocast)": copy.deepcopy(base)}
    for scaling in ("delayed", "current", "mxfp8", "blockwise", "nvfp4"):
        m = copy.deepcopy(base)
        convert(m, _recipe(scaling, fmt="E4M3" if scaling == "nvfp4" else None))
        variants[f"emulated {scaling}"] = m
    m = copy.deepcopy(base)
    convert(m, _recipe("current", backend="torchao"))
    variants["torchao tensorwise (emulate=True)"] = m
    # like-for-like MXFP8 pair: torchao's MX training is E4M3 for every operand, so ours is too here
    m = copy.deepcopy(base)
    convert(m, _recipe("mxfp8", fmt="E4M3"))
    variants["emulated mxfp8, E4M3 all operands"] = m
    ao_mx, ao_mx_note = _torchao_mx_linear(base[0])
    ao_name = None
    if ao_mx is not None:
        ao_name = "torchao MXFP8Linear (emulated kernels)"
        variants[ao_name] = ao_mx
    return base, variants, ao_name, ao_mx_note


def _reference_rows(ms: dict[str, float], ao_name: str | None) -> list[dict]:
    """Each block-scaled rule against the best CPU reference for the same rule, printed as a table."""
    refs = []
    if ao_name is not None:
        refs.append(("MXFP8 (E4M3, block 32, RCEIL)", "emulated mxfp8, E4M3 all operands", ao_name))
    refs.append(("blockwise (1x128 / 128x128)", "emulated blockwise", "emulated current"))
    # the NVFP4 rehearsal against the MXFP8 one: what 16-element E4M3 scales, the Hadamard transform and the
    # stochastic-rounding draws cost over 32-element E8M0 scales
    refs.append(
        ("NVFP4 (1x16 E4M3 scales, 16x16 weights, RHT, SR)", "emulated nvfp4", "emulated mxfp8, E4M3 all operands")
    )
    rows = []
    cells = []
    for rule, ours, ref in refs:
        ratio = ms[ours] / ms[ref]
        rows.append({"rule": rule, "ours": ours, "reference": ref, "ratio": round(ratio, 2)})
        cells.append([rule, ours, ref, f"{ms[ours]:.2f}", f"{ms[ref]:.2f}", f"{ratio:.2f}"])
    header = ["rule", "ours", "reference", "ours ms", "reference ms", "ours / reference"]
    print("\nBlock-scaled rules against the best CPU reference for the same rule (same rounds as above):")
    print(bh.md_table(header, "lllrrr", cells))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--features", type=int, default=1024, help="in = out features")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--torch-threads", type=int, help="torch.set_num_threads (default: torch's own)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args()
    bh.set_threads(args.torch_threads)
    base, variants, ao_name, ao_mx_note = _variants(args.features)
    x = torch.randn(args.tokens, args.features)
    gy = torch.randn(args.tokens, args.features)

    def step(mod: nn.Module) -> None:
        xr = x.detach().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = mod(xr)
        y.backward(gy.to(y.dtype))
        mod.zero_grad(set_to_none=True)

    times = bh.interleaved({name: (lambda m=mod: step(m)) for name, mod in variants.items()}, args.rounds)
    base_ms = statistics.median(times["bf16 nn.Linear (autocast)"]) * 1e3
    rows = []
    for name, ts in times.items():
        ms = statistics.median(ts) * 1e3
        rows.append({"variant": name, "median_ms": round(ms, 2), "vs_bf16": round(ms / base_ms, 2)})
    m = bh.machine(torch.device("cpu"))
    machine = f"{m['cpu']}, {m['torch_threads']} threads, torch {m['torch']}"
    print(
        f"fwd+bwd of a {args.features}x{args.features} Linear on {args.tokens} tokens, median of {args.rounds} rounds; {machine}"
    )
    cells = [[r["variant"], f"{r['median_ms']:.2f}", f"{r['vs_bf16']:.2f}"] for r in rows]
    print(bh.md_table(["variant", "median ms", "x BF16"], "lrr", cells))
    ref_rows = _reference_rows({r["variant"]: r["median_ms"] for r in rows}, ao_name)
    qdq_rows = []
    if ao_name is None:
        print(f"torchao's MX emulation cannot train a Linear here: {ao_mx_note}")
        print("Closest like-for-like reference: quantize-dequantize of the same tensors (E4M3, block 32, RCEIL).")
        qdq_rows = _qdq_rows(x, gy, base[0].weight.detach(), args.rounds)
    print(f"MXFP8 reference: {ao_mx_note}" if ao_name is not None else "")
    print(
        "blockwise: torchao has no emulation of TE's Float8BlockScaling rule (1x128 / 128x128 tiles); "
        "the reference is our own current (per-tensor) scaling"
    )
    if args.json:
        out = {"machine": machine, "args": vars(args), "rows": rows, "references": ref_rows, "qdq": qdq_rows}
        bh.write_json(args.json, out | {"mxfp8_reference": ao_mx_note})


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
    med = {k: statistics.median(v) * 1e3 for k, v in bh.interleaved(fns, rounds).items()}
    rows = []
    cells = []
    for name in ("x", "W", "dy"):
        a, b = med[f"ours {name}"], med[f"torchao {name}"]
        rows.append({"tensor": name, "ours_ms": round(a, 2), "torchao_ms": round(b, 2), "ratio": round(a / b, 2)})
        cells.append([name, f"{a:.2f}", f"{b:.2f}", f"{a / b:.2f}"])
    print(bh.md_table(["tensor", "ours ms", "torchao to_mx ms", "ours / torchao"], "lrrr", cells))
    return rows


if __name__ == "__main__":
    main()
