"""Where an FP8 training step spends its time: ``torch.profiler`` over a few steps of each variant, the top kernels.

The variants are ``bench_gpu.py``'s own (``bench_gpu_variants.py``), run unchanged: by default hf_mixedprec's native
FP8 (``fp8-native-delayed``: our quantizers on ``torch._scaled_mm``), torchao's tensorwise FP8 by hand
(``fp8-torchao-tensorwise``) and the BF16 reference (``bf16-compile``), each compiled per decoder layer, on
Llama-3-8B's layer shapes (hidden 4096, intermediate 14336, 32/8 heads, vocab 128256; ``--layers`` layers, 4 x 2048
tokens). After ``--warmup`` steps (compilation included) ``--steps`` steps run under the profiler, the device
synchronized after each; per variant the table lists the ``--top`` operations by self device time (CUDA kernels on
a GPU, CPU time on a CPU): calls and milliseconds per step and their share of the step, so the next change to the
FP8 path is aimed at what costs most.

    python scripts/profile_fp8_step.py --out runs/profile            # one CUDA GPU (H100/H200), ~2 minutes
    python scripts/profile_fp8_step.py --cpu-smoke --out /tmp/prof    # tiny shapes on any machine: checks the script

``--memory`` (CUDA) also records the caching allocator's history over the profiled steps of each variant and writes
it to ``<out>/memory-<variant>.pickle`` (open it at https://pytorch.org/memory_viz), with each variant's peak
allocated GiB over those steps in the table (recording stack traces slows the profiled steps: read their times
from a run without ``--memory``): the GPU kit measured hf_mixedprec's torchao row 6.3 GiB above
Accelerate's own torchao path at Llama-3-8B shapes, and this is how to see which tensors make the difference:

    python scripts/profile_fp8_step.py --memory --out runs/memory \
        --variants accel-fp8-hf_mixedprec-compile accel-fp8-ao-compile fp8-torchao-tensorwise bf16-compile

``--cpu-smoke`` runs the test suite's tiny Llama on the CPU (torchao emulated, compilation skipped): its numbers
are no measurement. Exit status 0, 1 when a variant failed, 2 for a mistake in the input (or no GPU without
``--cpu-smoke``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_gpu_variants as variants  # noqa: E402
import bench_harness as bh  # noqa: E402

DEFAULT_VARIANTS = ("fp8-native-delayed", "fp8-torchao-tensorwise", "bf16-compile")
#: Llama-3-8B's layer shapes (as scripts/gpu_acceptance.py runs them)
LLAMA3_8B_LAYERS: dict[str, Any] = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 2,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}


class _Profiled:
    """Stands in for ``bench_gpu_variants.timed``: the warm-up steps as they are, then the timed steps under
    ``torch.profiler``; the profile of the last variant run is kept in :attr:`events`."""

    def __init__(self, memory_to: Path | None = None) -> None:
        self.events: Any = None
        self.memory_to = memory_to  # --memory: where the allocator history of the variant run next goes (CUDA)
        self.peak_gib: float | None = None

    def __call__(self, ctx: variants.Ctx, step: Any) -> list[float]:
        for i in range(ctx.warmup):
            step(ctx.batches[i % len(ctx.batches)])
        ctx.sync()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if ctx.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        recording = self.memory_to is not None and ctx.cuda  # the history runs since before the model was built
        if recording:
            torch.cuda.reset_peak_memory_stats(ctx.device)  # the peak of the profiled steps, not of compilation
        with torch.profiler.profile(activities=activities) as prof:
            for i in range(ctx.steps):
                step(ctx.batches[(ctx.warmup + i) % len(ctx.batches)])
                ctx.sync()
        if recording:
            assert self.memory_to is not None
            self.peak_gib = torch.cuda.max_memory_allocated(ctx.device) / 2**30
            torch.cuda.memory._dump_snapshot(str(self.memory_to))
        self.events = prof.key_averages()
        return []


def top_ops(events: Any, steps: int, top: int, cuda: bool) -> dict[str, Any]:
    """The ``top`` operations by self device time (CPU time without CUDA), per step."""
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    if cuda:  # the kernels themselves: a CPU op and a user annotation also report the device time they launched
        rows = [
            e
            for e in events
            if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation and getattr(e, key) > 0
        ]
    else:
        rows = [e for e in events if getattr(e, key, 0) > 0]
    total = sum(getattr(e, key) for e in rows)
    rows.sort(key=lambda e: getattr(e, key), reverse=True)
    return {
        "time": "device (CUDA kernels)" if cuda else "CPU",
        "ms_per_step": total / 1e3 / steps,
        "top": [
            {
                "name": e.key,
                "calls_per_step": e.count / steps,
                "ms_per_step": getattr(e, key) / 1e3 / steps,
                "share": getattr(e, key) / total if total else 0.0,
            }
            for e in rows[:top]
        ],
    }


def profile(names: list[str], ctx: variants.Ctx, top: int, memory_dir: Path | None = None) -> list[dict[str, Any]]:
    hook = _Profiled()
    variants.timed = hook  # the runners look it up at call time
    out = []
    for name in names:
        row: dict[str, Any] = {"key": name, "variant": variants.VARIANTS[name], "notes": []}
        hook.events, hook.peak_gib = None, None
        hook.memory_to = None if memory_dir is None else memory_dir / f"memory-{name}.pickle"
        if memory_dir is not None and not ctx.cuda:
            row["notes"].append("--memory: no allocator history off CUDA")
        recording = hook.memory_to is not None and ctx.cuda
        if recording:  # from before the runner builds the model: weights and optimizer states get their stacks too
            torch.cuda.memory._record_memory_history(max_entries=500_000)
        try:
            variants.RUNNERS[name](ctx, row)
            row.update(status="ok", **top_ops(hook.events, ctx.steps, top, ctx.cuda))
            if hook.peak_gib is not None:
                row.update(peak_gib=hook.peak_gib, memory_snapshot=str(hook.memory_to))
        except bh.Skip as exc:
            row.update(status="skipped", reason=str(exc))
        except Exception as exc:  # a failed variant is a row, the others still run
            row.update(status="error", reason=repr(exc)[:400])
        finally:
            if recording:
                torch.cuda.memory._record_memory_history(enabled=None)
        print(f"  {name}: {row['status']}", file=sys.stderr)
        out.append(row)
        bh.release_memory(ctx.device)
    return out


def render(doc: dict[str, Any]) -> str:
    parts = [f"Machine: {bh.machine_line(doc['machine'])}; {doc['shapes']}", ""]
    for row in doc["variants"]:
        parts.append(f"### {row['variant']}")
        if row["status"] != "ok":
            parts += [f"{row['status']}: {row.get('reason', '')}", ""]
            continue
        peak = f"; peak {row['peak_gib']:.2f} GiB allocated ({row['memory_snapshot']})" if "peak_gib" in row else ""
        parts.append(f"{row['ms_per_step']:.2f} ms of {row['time']} time per step{peak}; the top operations:")
        parts.append("")
        cells = [
            [f"`{r['name'][:90]}`", f"{r['calls_per_step']:g}", f"{r['ms_per_step']:.3f}", f"{100 * r['share']:.1f}%"]
            for r in row["top"]
        ]
        parts += [bh.md_table(["operation", "calls/step", "ms/step", "share"], "lrrr", cells), ""]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", nargs="+", choices=list(variants.VARIANTS), default=list(DEFAULT_VARIANTS))
    ap.add_argument("--layers", type=int, default=2, help="decoder layers at Llama-3-8B shapes (default 2)")
    ap.add_argument("--warmup", type=int, default=3, help="steps before profiling, compilation included")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps")
    ap.add_argument("--top", type=int, default=15, help="operations listed per variant")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU: checks the script only")
    ap.add_argument("--out", help="folder for profile.json and profile.md")
    ap.add_argument(
        "--memory", action="store_true", help="also the allocator history and peak of each variant (CUDA; needs --out)"
    )
    o = ap.parse_args(argv)
    if o.memory and not o.out:
        ap.error("--memory writes a snapshot per variant: give --out FOLDER")
    for flag in ("layers", "warmup", "steps", "top"):
        if getattr(o, flag) < (0 if flag == "warmup" else 1):
            ap.error(f"--{flag} {getattr(o, flag)} (allowed: >= {0 if flag == 'warmup' else 1})")
    if not o.cpu_smoke and not torch.cuda.is_available():
        ap.error("no CUDA GPU here (allowed: a CUDA machine, or --cpu-smoke to check the script on tiny shapes)")
    device = torch.device("cuda" if torch.cuda.is_available() and not o.cpu_smoke else "cpu")
    config = dict(variants.TINY) if o.cpu_smoke else {**LLAMA3_8B_LAYERS, "num_hidden_layers": o.layers}
    batch, seq = (2, 64) if o.cpu_smoke else (4, 2048)
    from hf_mixedprec.core.demo import builtin_text, byte_batches

    if o.out:
        Path(o.out).mkdir(parents=True, exist_ok=True)
    data = byte_batches(builtin_text(), seq_len=seq, batch_size=batch, n_batches=min(o.warmup + o.steps, 8))
    data = [d.remainder(config["vocab_size"]).to(device) for d in data]
    ctx = variants.Ctx(device, o.cpu_smoke, config, data, o.warmup, o.steps)
    bh.quiet()
    doc = {
        "machine": bh.machine(device, libraries=("torchao", "transformers")),
        "cpu_smoke": o.cpu_smoke,
        "shapes": (
            f"{'tiny Llama (--cpu-smoke)' if o.cpu_smoke else 'Llama-3-8B layer shapes'}, "
            f"{config['num_hidden_layers']} layers, batch {batch} x {seq}, {o.steps} profiled steps after {o.warmup}"
        ),
        "variants": profile(o.variants, ctx, o.top, Path(o.out) if o.memory else None),
    }
    text = render(doc)
    if o.out:
        bh.write_json(Path(o.out) / "profile.json", doc)
        (Path(o.out) / "profile.md").write_text(text + "\n")
    print(text)
    return 1 if any(r["status"] == "error" for r in doc["variants"]) else 0


if __name__ == "__main__":
    sys.exit(main())
