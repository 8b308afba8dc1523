"""Training throughput and peak memory of a ~1.1B Llama in every precision, side by side in one run.

Model: a Llama with TinyLlama-1.1B's shapes (hidden 2048, 22 layers, 32 heads, 4 KV heads, intermediate 5632,
vocab 32000, untied embeddings; 1,100,048,384 parameters, counted and printed at run time), built from its
config with random weights (no download). Same batch, sequence length and data for every variant; AdamW
(fused on CUDA), gradient clipping at 1.0, ``--warmup`` steps excluded (they include torch.compile), then
``--steps`` timed steps (the device is synchronized after each). Variants:

- ``fp32``: no autocast (torch's default matmul precision, TF32 off);
- ``bf16``: ``torch.autocast(bfloat16)``, FP32 master weights; ``bf16-compile``: the same under torch.compile,
  the reference for the torchao FP8 rows, which are compiled too;
- ``fp16``: ``torch.autocast(float16)`` + ``torch.amp.GradScaler``;
- ``fp8-torchao-tensorwise`` / ``fp8-torchao-rowwise``: torchao float8 training
  (``convert_to_float8_training`` with ``Float8LinearConfig.from_recipe_name(...)``, lm_head kept in BF16),
  under BF16 autocast and torch.compile; needs CUDA with compute capability >= 8.9;
- ``fp8-emulated``: hf_mixedprec's emulated FP8 (``hf_mixedprec.fp8.convert(model, recipe, backend="emulated")``,
  recipe ``h100-fp8-current``): exact FP8 numerics with FP32 GEMMs, a reference for what rehearsal costs;
- ``accel-bf16`` / ``accel-bf16-hf_mixedprec``: the callback overhead: the same hand-written Accelerate loop
  (``accelerator.backward``, ``accelerator.clip_grad_norm_(params, 1.0)``, ``optimizer.step()``) with a plain
  ``accelerate.Accelerator(mixed_precision="bf16")`` and with ``hf_mixedprec``'s ``make_accelerator(recipe)``
  (``a100-bf16`` on CUDA, ``cpu-bf16`` otherwise: ZClip, health detectors, guard GradScaler). Its row shows
  ms/step relative to the plain Accelerator.

A variant that cannot run here is a ``skipped`` row with the reason; one that fails is an ``error`` row with
the exception (the exit status is then 1). Memory is freed between variants.

    python scripts/bench_gpu.py                                   # on a CUDA GPU
    python scripts/bench_gpu.py --variants bf16 fp8-torchao-tensorwise --steps 20 --out gpu.json
    python scripts/bench_gpu.py --dry-run                         # tiny config, few steps, CPU is fine
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import logging
import math
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

#: TinyLlama-1.1B's shapes.
LLAMA_1B: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
#: --dry-run: the test suite's tiny Llama (hf_mixedprec.demo.TINY_LLAMA; repeated so that the
#: plain variants run where hf_mixedprec itself is not installed, like stdout_to_stderr below).
TINY: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}

VARIANTS: dict[str, str] = {
    "fp32": "fp32",
    "bf16": "bf16 autocast",
    "bf16-compile": "bf16 autocast + compile",
    "fp16": "fp16 autocast + GradScaler",
    "fp8-torchao-tensorwise": "fp8 torchao tensorwise + compile",
    "fp8-torchao-rowwise": "fp8 torchao rowwise + compile",
    "fp8-emulated": "fp8 emulated (hf_mixedprec, current scaling)",
    "accel-bf16": "bf16 Accelerator (plain)",
    "accel-bf16-hf_mixedprec": "bf16 Accelerator + hf_mixedprec",
    "accel-bf16-compile": "bf16 Accelerator (plain) + compile",
    "accel-bf16-hf_mixedprec-compile": "bf16 Accelerator + hf_mixedprec (a100-bf16) + compile",
    "accel-fp8-hf_mixedprec-compile": "fp8 Accelerator + hf_mixedprec (h100-fp8-current, backend auto) + compile",
    "accel-fp8-ao-compile": "fp8 Accelerator's own torchao path (AORecipeKwargs) + compile",
    "fp8-native-delayed": "fp8 native delayed (hf_mixedprec quantizers, torch._scaled_mm) + compile",
    "fp8-native-current": "fp8 native current (hf_mixedprec quantizers, torch._scaled_mm) + compile",
    "accel-fp8-native-hf_mixedprec-compile": "fp8 Accelerator + hf_mixedprec (h100-fp8-delayed, backend native) + compile",
}
#: The row each variant is compared with.
REFERENCE: dict[str, str] = {
    "fp8-torchao-tensorwise": "bf16-compile",
    "fp8-torchao-rowwise": "bf16-compile",
    "accel-bf16-hf_mixedprec": "accel-bf16",
    "accel-bf16-compile": "bf16-compile",
    "accel-bf16-hf_mixedprec-compile": "accel-bf16-compile",
    "accel-fp8-hf_mixedprec-compile": "bf16-compile",
    "accel-fp8-ao-compile": "bf16-compile",
    "fp8-native-delayed": "bf16-compile",
    "fp8-native-current": "bf16-compile",
    "accel-fp8-native-hf_mixedprec-compile": "bf16-compile",
}


class Skip(Exception):
    """This variant cannot run here; the message says why."""


@dataclasses.dataclass
class Ctx:
    device: torch.device
    dry_run: bool
    config: dict[str, Any]
    batches: list[torch.Tensor]
    warmup: int
    steps: int
    lr: float = 1e-4

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


@contextlib.contextmanager
def stdout_to_stderr() -> Any:
    """Send everything printed while benchmarking (library banners and warnings, at the file descriptor level)
    to stderr, so stdout holds only the results (the table, or the JSON with --json)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


# -- building blocks ----------------------------------------------------------------------------------
def build_model(ctx: Ctx) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**ctx.config, attn_implementation="sdpa")
    with ctx.device:
        model = LlamaForCausalLM(cfg)
    model.config.use_cache = False
    return model.train()


def make_optimizer(model: nn.Module, ctx: Ctx) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=ctx.lr, fused=ctx.cuda)


def autocast(ctx: Ctx, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=ctx.device.type, dtype=dtype)


def maybe_compile(model: nn.Module, ctx: Ctx, row: dict[str, Any]) -> nn.Module:
    """Compile each decoder layer in place (regional compilation: the layers share one compiled graph, so compile
    time does not grow with depth); the embedding, final norm, lm_head and loss stay eager in every compiled row."""
    if ctx.dry_run and not ctx.cuda:
        note = "torch.compile skipped: --dry-run on CPU (eager; this row is not a compile measurement)"
        row["notes"].append(note)
        print(f"note: {row['variant']}: {note}", file=sys.stderr)
        return model
    row["compiled"] = True
    inner = getattr(model, "module", model)  # an Accelerate/DDP wrapper
    layers = inner.get_decoder().layers if hasattr(inner, "get_decoder") else None
    if layers is None:
        return torch.compile(model)
    for layer in layers:
        layer.compile()
    return model


def timed(ctx: Ctx, step: Callable[[torch.Tensor], None]) -> list[float]:
    """Run warm-up + timed steps over ``ctx.batches``; per-step seconds of the timed ones."""
    times = []
    for i in range(ctx.warmup + ctx.steps):
        batch = ctx.batches[i % len(ctx.batches)]
        ctx.sync()
        t0 = time.perf_counter()
        step(batch)
        ctx.sync()
        if i >= ctx.warmup:
            times.append(time.perf_counter() - t0)
    return times


def plain_loop(
    model: nn.Module, ctx: Ctx, *, dtype: torch.dtype | None, scaler: torch.amp.GradScaler | None = None, after=None
) -> list[float]:
    opt = make_optimizer(model, ctx)
    params = [p for p in model.parameters() if p.requires_grad]

    def step(batch: torch.Tensor) -> None:
        with autocast(ctx, dtype):
            loss = model(input_ids=batch, labels=batch).loss
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
        opt.zero_grad(set_to_none=True)
        if after is not None:
            after(model)

    return timed(ctx, step)


# -- variants -----------------------------------------------------------------------------------------
def v_fp32(ctx: Ctx, row: dict[str, Any]) -> list[float]:
    return plain_loop(build_model(ctx), ctx, dtype=None)


def v_bf16(ctx: Ctx, row: dict[str, Any]) -> list[float]:
    return plain_loop(build_model(ctx), ctx, dtype=torch.bfloat16)


def v_bf16_compile(ctx: Ctx, row: dict[str, Any]) -> list[float]:
    model = build_model(ctx)
    return plain_loop(maybe_compile(model, ctx, row), ctx, dtype=torch.bfloat16)


def v_fp16(ctx: Ctx, row: dict[str, Any]) -> list[float]:
    scaler = torch.amp.GradScaler(ctx.device.type)
    return plain_loop(build_model(ctx), ctx, dtype=torch.float16, scaler=scaler)


def _torchao(recipe_name: str) -> Callable[[Ctx, dict[str, Any]], list[float]]:
    def run(ctx: Ctx, row: dict[str, Any]) -> list[float]:
        try:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        except ImportError as exc:
            raise Skip(f"torchao is not installed ({exc}); pip install torchao") from exc
        capable = ctx.cuda and torch.cuda.get_device_capability(ctx.device) >= (8, 9)
        emulate = False
        if not capable:
            where = (
                f"compute capability {'.'.join(map(str, torch.cuda.get_device_capability(ctx.device)))}"
                if ctx.cuda
                else "no CUDA GPU"
            )
            if not ctx.dry_run:
                raise Skip(f"torchao float8 training needs CUDA with compute capability >= 8.9 ({where})")
            emulate = True
            note = f"emulate=True ({where}; --dry-run): FP8 casts with high-precision GEMMs, not an FP8 timing"
            row["notes"].append(note)
            print(f"note: {row['variant']}: {note}", file=sys.stderr)
        cfg = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe_name), emulate=emulate)
        model = build_model(ctx)

        def keep(mod: nn.Module, fqn: str) -> bool:
            return (
                isinstance(mod, nn.Linear)
                and fqn != "lm_head"
                and mod.in_features % 16 == 0
                and mod.out_features % 16 == 0
            )

        convert_to_float8_training(model, module_filter_fn=keep, config=cfg)
        return plain_loop(maybe_compile(model, ctx, row), ctx, dtype=torch.bfloat16)

    return run


def v_fp8_emulated(ctx: Ctx, row: dict[str, Any]) -> list[float]:
    import hf_mixedprec
    from hf_mixedprec.fp8 import convert, fp8_step

    recipe = hf_mixedprec.load_recipe("h100-fp8-current", check_hardware=False)
    model = build_model(ctx)
    report = convert(model, recipe, backend="emulated")
    row["notes"].append(
        f"{len(report.converted)} layers in emulated FP8, {len(report.kept)} kept (recipe h100-fp8-current)"
    )
    return plain_loop(model, ctx, dtype=torch.bfloat16, after=fp8_step)


def _native(name: str) -> Callable[[Ctx, dict[str, Any]], list[float]]:
    def run(ctx: Ctx, row: dict[str, Any]) -> list[float]:
        from hf_mixedprec.fp8 import convert, fp8_step
        from hf_mixedprec.fp8.native import native_available
        from hf_mixedprec.recipe import resolve_recipe

        ok, why = native_available(ctx.device)
        if not ok:
            raise Skip(f"torch's FP8 GEMM does not run here: {why}")
        recipe = resolve_recipe({"name": f"{name}-native", "extends": name, "fp8": {"backend": "native"}})
        model = build_model(ctx)
        report = convert(model, recipe, backend="native")
        row["notes"].append(f"{len(report.converted)} layers in FP8 (recipe {name}, backend native)")
        return plain_loop(maybe_compile(model, ctx, row), ctx, dtype=torch.bfloat16, after=fp8_step)

    return run


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def _accelerate_loop(accelerator: Any, ctx: Ctx, row: dict[str, Any] | None = None) -> list[float]:
    """``row`` given: the prepared model is compiled (:func:`maybe_compile`)."""
    model = build_model(ctx)
    opt = make_optimizer(model, ctx)
    model, opt = accelerator.prepare(model, opt)
    if row is not None:
        model = maybe_compile(model, ctx, row)

    def step(batch: torch.Tensor) -> None:
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    try:
        return timed(ctx, step)
    finally:
        accelerator.free_memory()


def v_accel_plain(ctx: Ctx, row: dict[str, Any]) -> list[float]:
    from accelerate import Accelerator

    _reset_accelerate()
    return _accelerate_loop(Accelerator(mixed_precision="bf16", cpu=not ctx.cuda), ctx)


def v_accel_ours(ctx: Ctx, row: dict[str, Any]) -> list[float]:
    import hf_mixedprec
    from hf_mixedprec.integrations.accelerate_plugin import make_accelerator

    _reset_accelerate()
    name = "a100-bf16" if ctx.cuda else "cpu-bf16"
    recipe = hf_mixedprec.load_recipe(name)
    row["notes"].append(f"recipe {name}")
    return _accelerate_loop(make_accelerator(recipe, cpu=not ctx.cuda), ctx)


def v_accel_plain_compile(ctx: Ctx, row: dict[str, Any]) -> list[float]:
    from accelerate import Accelerator

    _reset_accelerate()
    return _accelerate_loop(Accelerator(mixed_precision="bf16", cpu=not ctx.cuda), ctx, row)


def _ours(name: str, ctx: Ctx, row: dict[str, Any], backend: str | None = None) -> list[float]:
    import hf_mixedprec
    from hf_mixedprec.integrations.accelerate_plugin import make_accelerator
    from hf_mixedprec.recipe import resolve_recipe

    _reset_accelerate()
    rehearse = not ctx.cuda and name.startswith("h100-fp8")  # a CPU dry run rehearses it (emulated FP8 layers)
    if backend == "native":
        from hf_mixedprec.fp8.native import native_available

        ok, why = native_available(ctx.device)
        if not ok:
            raise Skip(f"torch's FP8 GEMM does not run here: {why}")
    if backend is not None:
        recipe = resolve_recipe({"name": f"{name}-{backend}", "extends": name, "fp8": {"backend": backend}})
        if rehearse:  # off FP8 hardware only the hardware check is skipped: native runs torch._scaled_mm on CPU
            recipe = recipe.rehearsed()
        rehearse = False
    else:
        recipe = hf_mixedprec.load_recipe(name, rehearse=rehearse)
    if rehearse:
        row["notes"].append("rehearsed on CPU (emulated FP8), not an FP8 timing")
    accelerator = make_accelerator(recipe, cpu=not ctx.cuda)
    times = _accelerate_loop(accelerator, ctx, row)
    runtime = getattr(accelerator, "mp", None)
    report = getattr(runtime, "fp8_report", None)
    backend = getattr(report, "backend", None)
    row["notes"].append(f"recipe {name}" + (f", FP8 backend {backend}" if backend else ""))
    return times


def v_accel_ours_compile(ctx: Ctx, row: dict[str, Any]) -> list[float]:
    return _ours("a100-bf16" if ctx.cuda else "cpu-bf16", ctx, row)


def v_accel_ours_fp8_compile(ctx: Ctx, row: dict[str, Any]) -> list[float]:
    return _ours("h100-fp8-current", ctx, row)


def v_accel_ours_native_compile(ctx: Ctx, row: dict[str, Any]) -> list[float]:
    return _ours("h100-fp8-delayed", ctx, row, backend="native")


def v_accel_ao_fp8_compile(ctx: Ctx, row: dict[str, Any]) -> list[float]:
    try:
        from accelerate import Accelerator
        from accelerate.utils import AORecipeKwargs
    except ImportError as exc:
        raise Skip(f"this Accelerate has no AORecipeKwargs ({exc})") from exc
    if not (ctx.cuda and torch.cuda.get_device_capability(ctx.device) >= (8, 9)):
        raise Skip("Accelerate's torchao FP8 path needs CUDA with compute capability >= 8.9")
    _reset_accelerate()
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs()])
    return _accelerate_loop(accelerator, ctx, row)


RUNNERS: dict[str, Callable[[Ctx, dict[str, Any]], list[float]]] = {
    "fp32": v_fp32,
    "bf16": v_bf16,
    "bf16-compile": v_bf16_compile,
    "fp16": v_fp16,
    "fp8-torchao-tensorwise": _torchao("tensorwise"),
    "fp8-torchao-rowwise": _torchao("rowwise"),
    "fp8-emulated": v_fp8_emulated,
    "accel-bf16": v_accel_plain,
    "accel-bf16-hf_mixedprec": v_accel_ours,
    "accel-bf16-compile": v_accel_plain_compile,
    "accel-bf16-hf_mixedprec-compile": v_accel_ours_compile,
    "accel-fp8-hf_mixedprec-compile": v_accel_ours_fp8_compile,
    "accel-fp8-ao-compile": v_accel_ao_fp8_compile,
    "fp8-native-delayed": _native("h100-fp8-delayed"),
    "fp8-native-current": _native("h100-fp8-current"),
    "accel-fp8-native-hf_mixedprec-compile": v_accel_ours_native_compile,
}


# -- driver -------------------------------------------------------------------------------------------
def free(ctx: Ctx) -> None:
    gc.collect()
    if ctx.cuda:
        torch.cuda.synchronize(ctx.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)
    with contextlib.suppress(Exception):
        torch._dynamo.reset()


def run_variant(key: str, ctx: Ctx, tokens_per_step: int) -> dict[str, Any]:
    row: dict[str, Any] = {
        "key": key,
        "variant": VARIANTS[key],
        "status": "ok",
        "reason": None,
        "compiled": False,
        "notes": [],
        "tokens_per_s": None,
        "ms_per_step_median": None,
        "ms_per_step_mean": None,
        "peak_mem_gib": None,
        "steps": 0,
    }
    free(ctx)
    t0 = time.perf_counter()
    try:
        times = RUNNERS[key](ctx, row)
        med = statistics.median(times)
        row.update(
            tokens_per_s=tokens_per_step / med,
            ms_per_step_median=med * 1e3,
            ms_per_step_mean=statistics.fmean(times) * 1e3,
            steps=len(times),
        )
        if ctx.cuda:
            row["peak_mem_gib"] = torch.cuda.max_memory_allocated(ctx.device) / 2**30
    except Skip as exc:
        row.update(status="skipped", reason=str(exc))
    except Exception as exc:  # a real failure must show in the table
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        row.update(status="error", reason=f"{type(exc).__name__}: {first}"[:400])
        traceback.print_exc(file=sys.stderr)
    row["wall_s"] = time.perf_counter() - t0
    free(ctx)
    print(f"  {key}: {row['status']} ({row['wall_s']:.1f} s)", file=sys.stderr)
    return row


def relative(rows: list[dict[str, Any]]) -> None:
    """Each row's speed relative to its reference row (bf16 autocast, or the row in REFERENCE)."""
    by_key = {r["key"]: r for r in rows}
    for r in rows:
        ref_key = REFERENCE.get(r["key"], "bf16")
        ref = by_key.get(ref_key)
        r["reference"] = ref_key
        r["speed_vs_reference"] = None
        if r["status"] == "ok" and ref is not None and ref["status"] == "ok":
            r["speed_vs_reference"] = r["tokens_per_s"] / ref["tokens_per_s"]


def cpu_name() -> str:
    """The CPU model as ``lscpu`` names it (``/proc/cpuinfo``), else what ``platform`` knows."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine(ctx: Ctx) -> dict[str, Any]:
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(ctx.device) if ctx.cuda else f"cpu ({cpu_name()})",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if ctx.cuda:
        out["capability"] = ".".join(map(str, torch.cuda.get_device_capability(ctx.device)))
    for mod in ("transformers", "accelerate", "torchao"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # not installed, or a broken install: say so
            out[mod] = None
    return out


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| variant | status | tokens/s | ms/step (median) | peak mem GiB | speed vs reference | notes |",
        "| --- | --- | ---: | ---: | ---: | --- | --- |",
    ]
    for r in rows:
        if r["status"] != "ok":
            out.append(f"| {r['variant']} | {r['status']} | – | – | – | – | {r['reason']} |")
            continue
        mem = f"{r['peak_mem_gib']:.2f}" if r["peak_mem_gib"] is not None else "n/a (CPU)"
        rel = (
            f"{r['speed_vs_reference']:.2f}x vs {VARIANTS[r['reference']]}"
            if r["speed_vs_reference"] is not None and r["reference"] != r["key"]
            else "–"
        )
        out.append(
            f"| {r['variant']} | ok | {r['tokens_per_s']:,.0f} | {r['ms_per_step_median']:.1f} | {mem} | {rel} "
            f"| {'; '.join(r['notes'])} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS), metavar="NAME")
    ap.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 8; dry run 2)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 1024; dry run 64)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per variant (default 10; dry run 3)")
    ap.add_argument(
        "--warmup", type=int, default=None, help="untimed steps first, compile included (default 3; dry run 1)"
    )
    ap.add_argument("--dry-run", action="store_true", help="tiny config, few steps, any device: checks the script only")
    ap.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default: cores; 1 for a dry run on CPU)"
    )
    ap.add_argument("--json", action="store_true", help="print the results as JSON on stdout instead of the table")
    ap.add_argument("--out", metavar="FILE", help="also write the results as JSON to FILE")
    opts = ap.parse_args(argv)
    dry = opts.dry_run
    batch = opts.batch_size or (2 if dry else 8)
    seq = opts.seq_len or (64 if dry else 1024)
    steps = opts.steps or (3 if dry else 10)
    warmup = opts.warmup if opts.warmup is not None else (1 if dry else 3)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # a tiny model gains nothing from more CPU threads, and on a shared machine OpenMP's waits between them
    # made dry-run steps up to 100x slower and erratic
    threads = opts.threads or (1 if dry and device.type == "cpu" else os.cpu_count() or 1)
    torch.set_num_threads(threads)
    if device.type != "cuda" and not dry:
        print(
            "bench_gpu.py: no CUDA GPU here; a ~1.1B model on CPU would take hours. Run it on a GPU, or use "
            "--dry-run to check the script on a tiny config",
            file=sys.stderr,
        )
        return 2
    logging.getLogger("hf_mixedprec").setLevel(logging.ERROR)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    with stdout_to_stderr():  # stdout carries the results only
        from hf_mixedprec.demo import builtin_text, byte_batches

        config = dict(TINY if dry else LLAMA_1B)
        if seq > config["max_position_embeddings"]:
            config["max_position_embeddings"] = seq
        data = byte_batches(builtin_text(), seq_len=seq, batch_size=batch, n_batches=min(warmup + steps, 8))
        ctx = Ctx(device, dry, config, [b.to(device) for b in data], warmup, steps)
        with torch.device("meta"):
            from transformers import LlamaConfig, LlamaForCausalLM

            n_params = sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**config)).parameters())
        label = "tiny dry-run config" if dry else "Llama ~1.1B (TinyLlama shapes)"
        head = (
            f"{label}: {n_params:,} parameters; batch {batch} x {seq} tokens; {warmup} warm-up + {steps} timed steps "
            f"per variant; device {device}"
        )
        print(head, file=sys.stderr)
        if dry:
            print("DRY RUN: tiny config, not a performance figure", file=sys.stderr)
        rows = [run_variant(k, ctx, batch * seq) for k in dict.fromkeys(opts.variants)]
        relative(rows)
        by_key = {r["key"]: r for r in rows}
        overhead = None
        plain, ours = by_key.get("accel-bf16"), by_key.get("accel-bf16-hf_mixedprec")
        if plain and ours and plain["status"] == ours["status"] == "ok":
            overhead = ours["ms_per_step_median"] / plain["ms_per_step_median"]
        doc = {
            "dry_run": dry,
            "machine": machine(ctx),
            "model": {"config": config, "parameters": n_params},
            "settings": {"batch_size": batch, "seq_len": seq, "steps": steps, "warmup": warmup},
            "callback_overhead_ratio": overhead,
            "rows": rows,
        }
    if opts.out:
        with open(opts.out, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
    if opts.json:
        print(json.dumps(doc, indent=2))
    else:
        m = doc["machine"]
        print(("DRY RUN (tiny config, not a performance figure). " if dry else "") + head)
        print(f"{m['device']}, torch {m['torch']}, torchao {m['torchao'] or 'not installed'}")
        print(table(rows))
        if overhead is not None:
            print(f"\nhf_mixedprec callback overhead (Accelerate loop, bf16): {overhead:.3f}x ms/step of plain")
    bad = [r for r in rows if r["status"] == "error"]
    if overhead is not None and not math.isfinite(overhead):
        bad.append(ours)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
