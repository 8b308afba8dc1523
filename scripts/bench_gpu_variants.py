"""The variants ``bench_gpu.py`` times: the models' shapes, one training loop per variant (plain PyTorch, torchao,
hf_mixedprec's FP8, Accelerate with and without hf_mixedprec) and what each row is compared with. Every loop is timed
by ``bench_harness.time_steps`` (warm-up, then timed steps with the device synchronized around each)."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import bench_harness as bh
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
#: --dry-run: the test suite's tiny Llama (hf_mixedprec.core.demo.TINY_LLAMA; repeated so that the
#: plain variants run where hf_mixedprec itself is not installed).
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
    "accel-fp4-hf_mixedprec-compile": "nvfp4 Accelerator + hf_mixedprec (b200-nvfp4, Transformer Engine) + compile",
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
    "accel-fp4-hf_mixedprec-compile": "bf16-compile",
}


Skip = bh.Skip  # a variant that cannot run here; the message says why


@dataclasses.dataclass
class Ctx:
    """What every variant shares: the device, the model's shapes, the batches and how many steps to time."""

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
        bh.sync(self.device)


# -- building blocks ----------------------------------------------------------------------------------
def build_model(ctx: Ctx) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    bh.seed_all(0)
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
    """Warm-up + timed steps over ``ctx.batches``, the device synchronized around each; seconds of the timed ones."""
    return bh.time_steps(step, ctx.batches, warmup=ctx.warmup, steps=ctx.steps, sync=ctx.sync)


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
        from hf_mixedprec.integrations.recipe import resolve_recipe

        ok, why = native_available(ctx.device)
        if not ok:
            raise Skip(f"torch's FP8 GEMM does not run here: {why}")
        recipe = resolve_recipe({"name": f"{name}-native", "extends": name, "fp8": {"backend": "native"}})
        model = build_model(ctx)
        report = convert(model, recipe, backend="native")
        row["notes"].append(f"{len(report.converted)} layers in FP8 (recipe {name}, backend native)")
        return plain_loop(maybe_compile(model, ctx, row), ctx, dtype=torch.bfloat16, after=fp8_step)

    return run


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

    bh.reset_accelerate()
    return _accelerate_loop(Accelerator(mixed_precision="bf16", cpu=not ctx.cuda), ctx)


def v_accel_ours(ctx: Ctx, row: dict[str, Any]) -> list[float]:
    import hf_mixedprec
    from hf_mixedprec.integrations.accelerate_plugin import make_accelerator

    bh.reset_accelerate()
    name = "a100-bf16" if ctx.cuda else "cpu-bf16"
    recipe = hf_mixedprec.load_recipe(name)
    row["notes"].append(f"recipe {name}")
    return _accelerate_loop(make_accelerator(recipe, cpu=not ctx.cuda), ctx)


def v_accel_plain_compile(ctx: Ctx, row: dict[str, Any]) -> list[float]:
    from accelerate import Accelerator

    bh.reset_accelerate()
    return _accelerate_loop(Accelerator(mixed_precision="bf16", cpu=not ctx.cuda), ctx, row)


def _ours(name: str, ctx: Ctx, row: dict[str, Any], backend: str | None = None) -> list[float]:
    import hf_mixedprec
    from hf_mixedprec.integrations.accelerate_plugin import make_accelerator
    from hf_mixedprec.integrations.recipe import resolve_recipe

    bh.reset_accelerate()
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


def v_accel_ours_nvfp4_compile(ctx: Ctx, row: dict[str, Any]) -> list[float]:
    """b200-nvfp4 on its real backend: Transformer Engine's NVFP4BlockScaling, where TE runs NVFP4 (compute
    capability >= 10.0); hf_mixedprec has no other NVFP4 GEMM (the rehearsal is the sync row's)."""
    import importlib.util

    if not (ctx.cuda and torch.cuda.get_device_capability(ctx.device) >= (10, 0)):
        raise Skip("NVFP4 GEMMs need a CUDA GPU with compute capability >= 10.0 (Blackwell)")
    if importlib.util.find_spec("transformer_engine") is None:
        raise Skip("NVFP4 runs on Transformer Engine's NVFP4BlockScaling here, and it is not installed")
    return _ours("b200-nvfp4", ctx, row, backend="transformer_engine")


def v_accel_ao_fp8_compile(ctx: Ctx, row: dict[str, Any]) -> list[float]:
    try:
        from accelerate import Accelerator
        from accelerate.utils import AORecipeKwargs
    except ImportError as exc:
        raise Skip(f"this Accelerate has no AORecipeKwargs ({exc})") from exc
    if not (ctx.cuda and torch.cuda.get_device_capability(ctx.device) >= (8, 9)):
        raise Skip("Accelerate's torchao FP8 path needs CUDA with compute capability >= 8.9")
    bh.reset_accelerate()
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
    "accel-fp4-hf_mixedprec-compile": v_accel_ours_nvfp4_compile,
}
