"""Could one compiled kernel do ``StorageAdamW``'s BF16-remainder update in one pass, bit for bit as today's?

``StorageAdamW`` keeps a BF16 master's FP32 value as the BF16 weight plus an int16 remainder, and updates it with
torch's fused AdamW kernel (``torch._fused_adamw_``) on FP32 buffers: the weights, remainders and gradients are
gathered into a run's buffers before the kernel and written back after it, a few passes over the data on either
side of the one the kernel makes. One kernel reading everything once and writing it once would remove them, but it
must give the bits torch's kernel gives, or every BF16-master result changes. This script answers the two questions
on the machine it runs on.

**Exactness.** Random FP32 weights, gradients and moments are updated by ``torch._fused_adamw_`` and by the same
update written as torch's source states it (``aten/src/ATen/native/cpu/FusedAdamKernel.cpp``: a fused multiply-add
for the first moment's lerp, the weight decay as a product, ``denom = sqrt(v) / sqrt(bias_correction2) + eps``),
compiled by ``torch.compile``. The second moment is tried two ways: as written (``v * beta2 + (1 - beta2) * g * g``)
and as the fused multiply-add a compiler may contract it into. The script reports the fraction of elements whose
bits differ, for each of the first moment, second moment and weight. Every intermediate is float32, the
hyperparameters are float32 tensors, and ``torch._inductor.inductor_prims.fma`` gives one rounding.

**Speed.** The single-pass remainder update (BF16 weight, int16 remainder, BF16 gradient, FP32 moments in and out)
is compiled over ``--speed-elements`` elements. It is timed beside ``torch._fused_adamw_`` on as many FP32 elements,
the floor any BF16 master could reach. The script also reports whether inductor's generated CPU loop is vectorised
(``at::vec``).

    python scripts/probe_single_pass_adamw.py                       # 1M elements checked, 10M timed
    python scripts/probe_single_pass_adamw.py --json --out probe.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from typing import Any

import torch

#: (lr, beta1, beta2, weight_decay, eps, step): the defaults, a large-beta2 run late in training, and no decay
SETTINGS = [(1e-3, 0.9, 0.999, 0.01, 1e-8, 1), (3e-4, 0.9, 0.95, 0.1, 1e-8, 7), (1e-2, 0.8, 0.99, 0.0, 1e-6, 100)]


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def _hyper(lr: float, b1: float, b2: float, wd: float, eps: float, step: int) -> dict[str, torch.Tensor]:
    """The scalars torch's kernel computes in double and uses as float32."""
    bc1, bc2 = 1 - b1**step, 1 - b2**step
    return {
        "decay": _f32(1 - lr * wd),
        "lerp": _f32(1 - b1),
        "beta2": _f32(b2),
        "one_minus_beta2": _f32(1 - b2),
        "bc2_sqrt": _f32(math.sqrt(bc2)),
        "eps": _f32(eps),
        "neg_step_size": _f32(-lr / bc1),
    }


def adamw_as_written(p, g, m, v, h, contract_v: bool):
    """One AdamW update as torch's CPU source states it (lerp weight below 0.5, as for any beta1 above 0.5)."""
    from torch._inductor.inductor_prims import fma

    p = p * h["decay"]
    m1 = fma(h["lerp"].expand_as(m), g - m, m)
    if contract_v:
        v1 = fma(h["one_minus_beta2"] * g, g, v * h["beta2"])
    else:
        v1 = v * h["beta2"] + h["one_minus_beta2"] * g * g
    denom = v1.sqrt() / h["bc2_sqrt"] + h["eps"]
    return p + h["neg_step_size"] * m1 / denom, m1, v1


def exactness(n: int, seed: int) -> list[dict[str, Any]]:
    """Per setting and way of writing the second moment: the fraction of elements whose bits differ from torch's."""
    compiled = torch.compile(adamw_as_written, dynamic=False)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for lr, b1, b2, wd, eps, step in SETTINGS:
        scale = 10.0 ** torch.randint(-6, 2, (n,), generator=gen).float()
        p = torch.randn(n, generator=gen) * scale
        g = torch.randn(n, generator=gen) * scale * 0.1
        m = torch.randn(n, generator=gen) * scale * 0.01
        v = (torch.randn(n, generator=gen) * scale * 0.01) ** 2
        ref = [t.clone() for t in (p, g, m, v)]
        torch._fused_adamw_(
            [ref[0]], [ref[1]], [ref[2]], [ref[3]], [], [torch.tensor(float(step))],
            lr=lr, beta1=b1, beta2=b2, weight_decay=wd, eps=eps, amsgrad=False, maximize=False,
        )  # fmt: skip
        h = _hyper(lr, b1, b2, wd, eps, step)
        for contract_v in (False, True):
            got = compiled(p, g, m, v, h, contract_v)
            differ = {
                name: (a.view(torch.int32) != b.view(torch.int32)).float().mean().item()
                for name, a, b in zip(("weight", "exp_avg", "exp_avg_sq"), got, (ref[0], ref[2], ref[3]))
            }
            out.append(
                {
                    "setting": {"lr": lr, "beta1": b1, "beta2": b2, "weight_decay": wd, "eps": eps, "step": step},
                    "exp_avg_sq_as": "fused multiply-add" if contract_v else "written",
                    "fraction_differing": differ,
                }
            )
    return out


def remainder_update(w, rem, g, m, v, h):
    """The single pass: the FP32 master from the BF16 weight and int16 remainder, the update, the split back."""
    from torch._inductor.inductor_prims import fma

    high = w.view(torch.int16).to(torch.int32) + (rem.to(torch.int32) >> 15)
    p = (high * 65536 + (rem.to(torch.int32) & 0xFFFF)).view(torch.float32)
    gf = g.float()
    p, m1, v1 = (
        p * h["decay"],
        fma(h["lerp"].expand_as(m), gf - m, m),
        fma(h["one_minus_beta2"] * gf, gf, v * h["beta2"]),
    )
    p = p + h["neg_step_size"] * m1 / (v1.sqrt() / h["bc2_sqrt"] + h["eps"])
    bits = p.view(torch.int32)
    low = bits & 0xFFFF
    low = low - (low & 0x8000) * 2
    w.copy_(((bits - low) >> 16).to(torch.int16).view(torch.bfloat16))
    rem.copy_(low.to(torch.int16))
    m.copy_(m1)
    v.copy_(v1)


def _median_ms(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def speed(n: int, repeats: int) -> dict[str, Any]:
    """The compiled single pass against torch's fused AdamW on as many FP32 elements, and whether it is vectorised."""
    from torch._inductor.utils import run_and_get_code

    h = _hyper(*SETTINGS[0])
    w, g = torch.randn(n).to(torch.bfloat16), (torch.randn(n) * 1e-3).to(torch.bfloat16)
    rem, m, v = torch.zeros(n, dtype=torch.int16), torch.zeros(n), torch.zeros(n)
    compiled = torch.compile(remainder_update, dynamic=False)
    _, code = run_and_get_code(compiled, w, rem, g, m, v, h)
    source = "\n".join(code)
    p32, g32, m32, v32 = torch.randn(n), torch.randn(n) * 1e-3, torch.zeros(n), torch.zeros(n)
    step = torch.tensor(1.0)

    def fused() -> None:
        torch._fused_adamw_(
            [p32], [g32], [m32], [v32], [], [step],
            lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False,
        )  # fmt: skip

    single = _median_ms(lambda: compiled(w, rem, g, m, v, h), repeats)
    floor = _median_ms(fused, repeats)
    return {
        "elements": n,
        "single_pass_ms": single,
        "fused_adamw_fp32_ms": floor,
        "x_fused_adamw": single / floor,
        "vectorised": "at::vec" in source and "loadu" in source,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", type=int, default=1 << 20, help="elements per exactness check (default 2**20)")
    parser.add_argument("--speed-elements", type=int, default=10_000_000, help="elements timed (default 10M)")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per kernel, the median kept (default 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of the tables")
    parser.add_argument("--out", metavar="FILE", help="also write the results as JSON to FILE")
    args = parser.parse_args(argv)
    for flag, value in (("--elements", args.elements), ("--speed-elements", args.speed_elements)):
        if value < 16:
            parser.error(f"{flag} {value}: at least 16 (one vector of the kernel)")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: at least 1")
    doc = {
        "machine": {
            "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(),
        },
        "exactness": exactness(args.elements, args.seed),
        "speed": speed(args.speed_elements, args.repeats),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    mc = doc["machine"]
    print(f"torch {mc['torch']}, CPU capability {mc['cpu_capability']}, {mc['threads']} threads", file=sys.stderr)
    print(
        "| lr, beta1, beta2, wd, eps, step | second moment as | exp_avg differs | exp_avg_sq differs | weight differs |"
    )
    print("| --- | --- | ---: | ---: | ---: |")
    for row in doc["exactness"]:
        s, d = row["setting"], row["fraction_differing"]
        hyper = ", ".join(str(s[k]) for k in ("lr", "beta1", "beta2", "weight_decay", "eps", "step"))
        cells = " | ".join(f"{100 * d[k]:.2f}%" for k in ("exp_avg", "exp_avg_sq", "weight"))
        print(f"| {hyper} | {row['exp_avg_sq_as']} | {cells} |")
    sp = doc["speed"]
    print(
        f"\nsingle pass over {sp['elements']:,} elements: {sp['single_pass_ms']:.2f} ms "
        f"({'vectorised' if sp['vectorised'] else 'scalar loop'}), torch's fused AdamW on as many FP32 elements: "
        f"{sp['fused_adamw_fp32_ms']:.2f} ms ({sp['x_fused_adamw']:.2f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
