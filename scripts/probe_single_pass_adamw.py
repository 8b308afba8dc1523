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
is compiled over ``--speed-elements`` elements. It is timed beside ``torch._fused_adamw_`` on as many FP32 elements
(called in turn, the order rotated), the floor any BF16 master could reach. The script also reports whether inductor's generated CPU loop is vectorised
(``at::vec``). The same for ``bf16_kahan``, whose master (a BF16 weight and a BF16 compensation) needs no int16:
its single pass is compared bit for bit with ``StorageAdamW``'s own step after two steps, and timed beside it.

The probe's remainder loop reads the int16 remainders as int16, which leaves it scalar. ``StorageAdamW``'s own
single pass (``hf_mixedprec/storage/single_pass.py``) reads them, and the BF16 weights, two to an int32 word, and
inductor vectorises that loop.

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


def adamw_update(p, g, m, v, h, contract_v: bool):
    """One AdamW update of FP32 ``p`` as torch's CPU source states it (lerp weight below 0.5, as for any beta1 above
    0.5): ``(weight, exp_avg, exp_avg_sq)``, the second moment as written or (``contract_v``) as a fused
    multiply-add."""
    from torch._inductor.inductor_prims import fma

    m1 = fma(h["lerp"].expand_as(m), g - m, m)
    if contract_v:
        v1 = fma(h["one_minus_beta2"] * g, g, v * h["beta2"])
    else:
        v1 = v * h["beta2"] + h["one_minus_beta2"] * g * g
    return p * h["decay"] + h["neg_step_size"] * m1 / (v1.sqrt() / h["bc2_sqrt"] + h["eps"]), m1, v1


def adamw_as_written(p, g, m, v, h):
    """:func:`adamw_update` with the second moment both ways, as written then as a fused multiply-add (one compiled
    graph for both)."""
    return [adamw_update(p, g, m, v, h, contract_v) for contract_v in (False, True)]


def _torch_fused(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: float, **hyper: float
) -> None:
    """torch's fused AdamW (``AdamW(fused=True)``'s kernel) on one FP32 tensor, in place."""
    torch._fused_adamw_([p], [g], [m], [v], [], [torch.tensor(float(step))], amsgrad=False, maximize=False, **hyper)


#: the hyperparameters of the timed kernels (:data:`SETTINGS`' first, the defaults)
TIMED = dict(zip(("lr", "beta1", "beta2", "weight_decay", "eps"), SETTINGS[0][:5], strict=True))


def _vectorised(code: list[str]) -> bool:
    """Whether inductor's generated CPU code loops over vectors (``at::vec``) rather than one element at a time."""
    source = "\n".join(code)
    return "at::vec" in source and "loadu" in source


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
        _torch_fused(*ref, step, lr=lr, beta1=b1, beta2=b2, weight_decay=wd, eps=eps)
        h = _hyper(lr, b1, b2, wd, eps, step)
        for contract_v, got in zip((False, True), compiled(p, g, m, v, h)):
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
    high = w.view(torch.int16).to(torch.int32) + (rem.to(torch.int32) >> 15)
    p = (high * 65536 + (rem.to(torch.int32) & 0xFFFF)).view(torch.float32)
    p, m1, v1 = adamw_update(p, g.float(), m, v, h, contract_v=True)
    bits = p.view(torch.int32)
    low = bits & 0xFFFF
    low = low - (low & 0x8000) * 2
    w.copy_(((bits - low) >> 16).to(torch.int16).view(torch.bfloat16))
    rem.copy_(low.to(torch.int16))
    m.copy_(m1)
    v.copy_(v1)


def kahan_update(w, comp, g, m, v, h, contract_v: bool = True):
    """The single pass of ``bf16_kahan``: the master is the BF16 weight plus its BF16 compensation, written back as
    the nearest BF16 weight and what rounding lost (``hf_mixedprec.storage.bits.kahan_store``). No int16 anywhere."""
    p, m1, v1 = adamw_update(w.float() + comp.float(), g.float(), m, v, h, contract_v)
    new_w = p.to(torch.bfloat16)
    w.copy_(new_w)
    comp.copy_((p - new_w.float()).to(torch.bfloat16))
    m.copy_(m1)
    v.copy_(v1)


def kahan(n: int, repeats: int, contract_v: bool) -> dict[str, Any]:
    """The single pass of ``bf16_kahan`` against ``StorageAdamW``'s own step on the same tensor (one parameter of
    ``n`` elements, two steps): the same bits?, and both timed beside torch's fused AdamW on as many FP32 elements.
    ``contract_v``: the second moment written as the exactness check found torch's build computes it."""
    from torch._inductor.utils import run_and_get_code

    from hf_mixedprec.storage import StorageAdamW

    gen = torch.Generator().manual_seed(2)
    w0 = torch.randn(n, generator=gen).to(torch.bfloat16)
    grads = [(torch.randn(n, generator=gen) * 1e-3).to(torch.bfloat16) for _ in range(2)]
    ref = torch.nn.Parameter(w0.clone())
    opt = StorageAdamW([ref], lr=TIMED["lr"], weight_decay=TIMED["weight_decay"], master="bf16_kahan")
    w, comp, m, v = w0.clone(), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n), torch.zeros(n)
    # without it inductor keeps the BF16 weight in FP32 inside the kernel, and the compensation comes out zero
    compiled = torch.compile(kahan_update, dynamic=False, options={"emulate_precision_casts": True})
    code: list[str] = []
    for step, g in enumerate(grads, 1):
        ref.grad = g
        opt.step()
        h = _hyper(*SETTINGS[0][:5], step)
        _, got = run_and_get_code(compiled, w, comp, g, m, v, h, contract_v)
        code = code or got
    st = opt.state[ref]
    same = all(
        torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a.view(torch.int32),
                    b.view(torch.int16) if b.dtype == torch.bfloat16 else b.view(torch.int32))
        for a, b in ((w, ref.detach()), (comp, st["compensation"]), (m, st["exp_avg"]), (v, st["exp_avg_sq"]))
    )  # fmt: skip
    h = _hyper(*SETTINGS[0][:5], 3)
    ref.grad = grads[0]
    fp32 = (torch.randn(n), torch.randn(n) * 1e-3, torch.zeros(n), torch.zeros(n))
    ms = _medians_ms(
        {
            "single": lambda: compiled(w, comp, grads[0], m, v, h, contract_v),
            "today": opt.step,
            "floor": lambda: _torch_fused(*fp32, 1, **TIMED),
        },
        repeats,
    )
    single, today, floor = ms["single"], ms["today"], ms["floor"]
    return {
        "elements": n,
        "same_bits_as_storage_adamw": same,
        "single_pass_ms": single,
        "storage_adamw_ms": today,
        "fused_adamw_fp32_ms": floor,
        "x_fused_adamw": single / floor,
        "vectorised": _vectorised(code),
    }


def _medians_ms(fns: dict[str, Any], repeats: int) -> dict[str, float]:
    """Each callable's median time in ms, called in turn (the order rotated every round), so that a machine's drift
    hits them alike."""
    names = list(fns)
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(repeats):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - start)
    return {k: statistics.median(t) * 1e3 for k, t in times.items()}


def speed(n: int, repeats: int) -> dict[str, Any]:
    """The compiled single pass against torch's fused AdamW on as many FP32 elements, and whether it is vectorised."""
    from torch._inductor.utils import run_and_get_code

    h = _hyper(*SETTINGS[0])
    w, g = torch.randn(n).to(torch.bfloat16), (torch.randn(n) * 1e-3).to(torch.bfloat16)
    rem, m, v = torch.zeros(n, dtype=torch.int16), torch.zeros(n), torch.zeros(n)
    compiled = torch.compile(remainder_update, dynamic=False)
    _, code = run_and_get_code(compiled, w, rem, g, m, v, h)
    fp32 = (torch.randn(n), torch.randn(n) * 1e-3, torch.zeros(n), torch.zeros(n))
    ms = _medians_ms(
        {"single": lambda: compiled(w, rem, g, m, v, h), "floor": lambda: _torch_fused(*fp32, 1, **TIMED)}, repeats
    )
    single, floor = ms["single"], ms["floor"]
    return {
        "elements": n,
        "single_pass_ms": single,
        "fused_adamw_fp32_ms": floor,
        "x_fused_adamw": single / floor,
        "vectorised": _vectorised(code),
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
    # the second moment as torch's build computes it here: the way every setting matched (as written if none did)
    fused = [r["fraction_differing"]["exp_avg_sq"] == 0.0 for r in doc["exactness"] if r["exp_avg_sq_as"] != "written"]
    doc["kahan"] = kahan(args.speed_elements, args.repeats, contract_v=all(fused))
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
    k = doc["kahan"]
    print(
        f"bf16_kahan single pass over {k['elements']:,} elements: {k['single_pass_ms']:.2f} ms "
        f"({'vectorised' if k['vectorised'] else 'scalar loop'}; {k['x_fused_adamw']:.2f}x fused AdamW), "
        f"StorageAdamW's step {k['storage_adamw_ms']:.2f} ms; same bits as StorageAdamW after 2 steps: "
        f"{k['same_bits_as_storage_adamw']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
