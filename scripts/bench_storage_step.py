"""The optimizer step alone: ``StorageAdamW`` in each storage choice beside torch's fused AdamW, by parameter count.

For each count of parameters (``--params``, each ``--rows`` x ``--cols``) every variant gets its own parameters
(FP32 for the reference and ``master: fp32``, BF16 for the BF16 masters), the same gradients, and steps in
lockstep: one step of each variant in turn, the order rotated every repeat, so load on a shared machine hits them
alike. A step's time is wall time (``time.perf_counter``) around ``optimizer.step()``; the first ``--warmup`` steps
are discarded. The table gives the median step and its ratio to torch's ``AdamW(fused=True)`` on FP32 parameters
(Trainer's ``adamw_torch_fused``), and the operations of one step that launch a kernel (aten operations seen by a
``TorchDispatchMode``, views not counted): what a GPU would launch. On a CPU, large BF16 parameters (2**16 elements
or more for ``bf16_remainder`` and ``bf16_kahan``, 2**18 for ``none``) take ``StorageAdamW``'s compiled single pass
(``hf_mixedprec/storage/single_pass.py``: one loop each), which ``torch.compile`` cannot run under that mode, so the
count is the multi-pass step's; the ", multi-pass" rows time that step (``single_pass="off"``) beside it and say
whether both end on the same bits, weights and optimizer states.

``--low-bit`` adds torchao's 8-bit AdamW over BF16 weights two ways, each handed a zero skip flag as a BF16 run's
scale-1 guard hands it every step: torchao's own class, which ``GradScaler.step`` steps after reading the flag on the
host (``found_inf.item()``), and hf_mixedprec's (``storage/lowbit.py``), which takes it inside ``step()`` and keeps a
copy of each parameter's weight and states to select from. On a CPU the host read costs nothing, so the ratio of
the two is the price of the device-side skip alone; its gain, a step without a sync, only shows on a GPU. Their
operations are not counted (torchao's compiled update refuses to run under the counting mode).

``--device cuda`` runs every variant on the GPU (the step timed between two ``torch.cuda.synchronize()``, so the
kernels it queued are counted), where each operation is a kernel launch: what "kernel ops/step" predicts there.

``--legacy FILE`` adds a row for another ``StorageAdamW`` implementation loaded from a file (for instance the
per-parameter one of an earlier commit: ``git show REV:hf_mixedprec/storage/optim.py > /tmp/old_optim.py``).

    python scripts/bench_storage_step.py                               # 10, 100, 1000 parameters of 256 x 256
    python scripts/bench_storage_step.py --params 100 --repeats 50 --out step.json
    python scripts/bench_storage_step.py --layers 12                  # the 111 tensors of bench_storage.py --layers 12
    python scripts/bench_storage_step.py --device cuda --params 100,1000 --low-bit   # on a GPU
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
import time
from typing import Any

import bench_harness as bh
import torch

from hf_mixedprec.core._private import found_inf_handed_to
from hf_mixedprec.storage import StorageAdamW
from hf_mixedprec.storage.lowbit import is_low_bit, low_bit_class

#: name -> (parameter dtype, StorageAdamW keyword arguments); None: torch's fused AdamW (the reference).
VARIANTS: dict[str, tuple[torch.dtype, dict[str, Any] | None]] = {
    "torch AdamW(fused=True)": (torch.float32, None),
    "fp32 master, fp32 states": (torch.float32, {"master": "fp32"}),
    "fp32 master, bf16 states": (torch.float32, {"master": "fp32", "state_dtype": torch.bfloat16}),
    "bf16_remainder": (torch.bfloat16, {"master": "bf16_remainder"}),
    "bf16_kahan": (torch.bfloat16, {"master": "bf16_kahan"}),
    "bf16_stochastic": (torch.bfloat16, {"master": "bf16_stochastic"}),
    "none": (torch.bfloat16, {"master": "none"}),
    "bf16_remainder, multi-pass": (torch.bfloat16, {"master": "bf16_remainder", "single_pass": "off"}),
    "bf16_kahan, multi-pass": (torch.bfloat16, {"master": "bf16_kahan", "single_pass": "off"}),
    "none, multi-pass": (torch.bfloat16, {"master": "none", "single_pass": "off"}),
}

#: the suffix of a variant with the single pass off (``StorageAdamW(single_pass="off")``)
MULTI = ", multi-pass"


CPU = torch.device("cpu")

#: --low-bit: name -> whether hf_mixedprec's class (flag inside step()) or torchao's (flag read on the host)
LOW_BIT = {"torchao AdamW8bit, flag read on the host": False, "AdamW8bit, flag on the device (hf_mixedprec)": True}


def kernel_ops(opt: torch.optim.Optimizer) -> int | None:
    """Kernel-launching aten operations of one ``opt.step()`` (None for torchao's compiled update)."""
    if is_low_bit(opt):
        return None
    with bh.OpCounter(views=False) as count:
        opt.step()
    return count.n


def stepper(name: str, opt: torch.optim.Optimizer, device: torch.device = CPU) -> Any:
    """What one timed step calls: ``opt.step``, or for the --low-bit rows the step as a scale-1 guard makes it."""
    if name not in LOW_BIT:
        return opt.step
    flag = torch.zeros((), device=device)
    if LOW_BIT[name]:

        def on_device() -> None:
            with found_inf_handed_to(opt, flag):
                opt.step()

        return on_device

    def on_host() -> None:  # torch/amp/grad_scaler.py _maybe_opt_step
        if not flag.item():
            opt.step()

    return on_host


def model_shapes(layers: int) -> list[tuple[int, ...]]:
    """The parameter shapes of ``finetune``'s default model with ``layers`` decoder layers (``bench_storage.py
    --layers``), read from a model built on the meta device (no memory, no values)."""
    from transformers import LlamaForCausalLM

    from hf_mixedprec.core.demo import default_model_config

    cfg = default_model_config()
    cfg.num_hidden_layers = layers
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return [tuple(p.shape) for p in model.parameters()]


def build(
    name: str, shapes: list[tuple[int, ...]], legacy: type | None, device: torch.device = CPU
) -> tuple[list[torch.Tensor], Any]:
    dtype, kwargs = VARIANTS.get(name, (torch.bfloat16, {"master": "bf16_remainder"}))
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen).to(device, dtype)) for shape in shapes]
    if name in LOW_BIT:
        import torchao.optim as ao

        cls = low_bit_class("8bit") if LOW_BIT[name] else ao.AdamW8bit
        return params, cls(params, lr=1e-4, weight_decay=0.01)
    if kwargs is None:
        return params, torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
    cls = legacy if name.startswith("legacy") else StorageAdamW
    return params, cls(params, lr=1e-4, weight_decay=0.01, **kwargs)


def attach_grads(params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """Give each parameter its gradient, on the parameter's device and in its dtype."""
    for p, g in zip(params, grads):
        p.grad = g.to(p.device, p.dtype)


def measure(
    shapes: list[tuple[int, ...]],
    repeats: int,
    warmup: int,
    legacy: type | None,
    low_bit: bool = False,
    device: torch.device = CPU,
) -> list[dict[str, Any]]:
    names = list(VARIANTS) + ([f"legacy {legacy.__module__}"] if legacy else []) + (list(LOW_BIT) if low_bit else [])
    runs = {name: build(name, shapes, legacy, device) for name in names}
    steps = {name: stepper(name, opt, device) for name, (_, opt) in runs.items()}
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(shape, generator=gen) * 1e-2 for shape in shapes]
    for params, _ in runs.values():
        attach_grads(params, grads)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(warmup + repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            sync()
            start = time.perf_counter()
            steps[name]()
            sync()
            took = time.perf_counter() - start
            if r >= warmup:
                times[name].append(took)
    ref = statistics.median(times[names[0]])
    rows_out = []
    for name in names:
        med = statistics.median(times[name])
        row = {
            "parameters": len(shapes),
            "elements": sum(math.prod(shape) for shape in shapes),
            "device": str(device),
            "variant": name,
            "ms_per_step": med * 1e3,
            "x_fused_adamw": med / ref,
            "kernel_ops_per_step": kernel_ops(runs[name][1]),
        }
        if name.startswith("legacy"):  # the same steps from the same start: are its weights ours, bit for bit?
            ours, theirs = runs["bf16_remainder"][0], runs[name][0]
            row["same_weights_as_bf16_remainder"] = all(torch.equal(a, b) for a, b in zip(ours, theirs))
        if name.endswith(MULTI):  # the single pass's weights and states after as many steps: the multi-pass step's?
            row["same_bits_as_single_pass"] = same_bits(runs[name.removesuffix(MULTI)], runs[name])
        rows_out.append(row)
    return rows_out


def same_bits(one: tuple[list[torch.Tensor], Any], other: tuple[list[torch.Tensor], Any]) -> bool:
    """Whether two (parameters, optimizer) pairs hold the same bits: every weight and every optimizer state tensor."""
    for a, b in zip(one[0], other[0]):
        pairs = [(a.detach(), b.detach())]
        pairs += [(v, other[1].state[b][k]) for k, v in one[1].state[a].items() if torch.is_tensor(v)]
        if not all(
            x.dtype == y.dtype and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
            for x, y in pairs
        ):
            return False
    return True


def load_legacy(path: str) -> type:
    spec = importlib.util.spec_from_file_location("legacy_optim", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--legacy {path!r}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.StorageAdamW


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="10,100,1000", help="parameter counts, comma-separated")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--cols", type=int, default=256)
    parser.add_argument(
        "--layers",
        type=int,
        metavar="N",
        help="instead of --params: the parameter shapes of finetune's default model with N decoder layers (9 tensors "
        "a layer, 3 besides; bench_storage.py --layers N)",
    )
    parser.add_argument("--repeats", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="steps discarded first")
    parser.add_argument("--legacy", metavar="FILE", help="a file defining another StorageAdamW, timed beside")
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda / cuda:N: where the parameters live")
    parser.add_argument(
        "--low-bit", action="store_true", help="add torchao's AdamW8bit: its own class and hf_mixedprec's (see above)"
    )
    args = parser.parse_args(argv)
    try:
        counts = [int(c) for c in args.params.split(",")]
    except ValueError:
        parser.error(f"--params {args.params!r}: comma-separated integers (e.g. 10,100,1000)")
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers {args.layers}: at least 1")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device {args.device!r}: not a device (allowed: cpu, cuda, cuda:N)")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device {args.device!r}: allowed: cpu, cuda, cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device!r}: this machine has no CUDA device (allowed here: cpu)")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        parser.error(f"--device {args.device!r}: this machine has {count} CUDA device(s) (allowed: cuda:0-{count - 1})")
    # every flag checked before anything is built (--layers builds a model to read its shapes)
    sets = [model_shapes(args.layers)] if args.layers else [[(args.rows, args.cols)] * n for n in counts]
    legacy = load_legacy(args.legacy) if args.legacy else None
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"torch {torch.__version__}, {where}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"{torch.get_num_threads()} threads",
        file=sys.stderr,
    )
    rows: list[dict[str, Any]] = []
    print("| parameters | variant | ms/step | x fused AdamW | kernel ops/step |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for shapes in sets:
        for row in measure(shapes, args.repeats, args.warmup, legacy, args.low_bit, device):
            rows.append(row)
            for key in ("same_weights_as_bf16_remainder", "same_bits_as_single_pass"):
                if key in row:
                    print(f"{row['variant']}: {key.replace('_', ' ')}: {row[key]}", file=sys.stderr)
            print(
                f"| {len(shapes)} | {row['variant']} | {row['ms_per_step']:.2f} | {row['x_fused_adamw']:.3f} | "
                f"{'-' if row['kernel_ops_per_step'] is None else row['kernel_ops_per_step']} |",
                flush=True,
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
