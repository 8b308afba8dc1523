"""The ``hf-mixedprec`` commands that look at a recipe, a model or a run without training it for real:
``simulate`` (an FP8 recipe rehearsed for a few steps), ``estimate`` (memory per GPU), ``plan`` (the precision
map) and ``report`` (a run's ``health.json`` and plots); each command's function and the ``_add_<command>`` that
adds its sub-parser.

Split from :mod:`hf_mixedprec.cli` (which builds the parser from these and re-exports the commands) to keep each
module short. Libraries that are heavy to import are imported inside the commands, so ``hf-mixedprec --help``
stays fast.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from hf_mixedprec.cli.common import PROG, _load
from hf_mixedprec.core.errors import UsageError
from hf_mixedprec.integrations.recipe import builtin_recipe_names, load_recipe_file

__all__ = ["MAX_HEALTH_BYTES", "cmd_estimate", "cmd_plan", "cmd_report", "cmd_simulate"]


# -- simulate --------------------------------------------------------------------------------------


def cmd_simulate(args: argparse.Namespace) -> int:
    from hf_mixedprec.commands.simulate import simulate

    recipe = _load(args.recipe)
    if recipe.precision != "fp8":
        fp8 = ", ".join(n for n in builtin_recipe_names() if load_recipe_file(n).precision == "fp8")
        raise UsageError(
            f"--recipe: {recipe.name!r} has precision {recipe.precision}; simulate rehearses FP8 recipes (allowed: "
            f"an fp8 recipe, e.g. {fp8})"
        )
    for flag, value, low in (
        ("--steps", args.steps, 2),
        ("--seq-len", args.seq_len, 2),
        ("--batch-size", args.batch_size, 1),
    ):
        if value < low:
            raise UsageError(f"{flag}: {value} is out of range (allowed: >= {low})")
    if not args.lr > 0:
        raise UsageError(f"--lr: {args.lr} is out of range (allowed: > 0)")
    if args.model is not None:
        from hf_mixedprec.core.model_dir import check_model_dir

        check_model_dir(args.model)
    result = simulate(
        recipe,
        model_dir=args.model,
        steps=args.steps,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
    )
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.table())
    return 0


def _add_simulate(sub: Any) -> None:
    s = sub.add_parser(
        "simulate",
        help="rehearse an FP8 recipe on any hardware and get per-layer advice",
        description="Train a few steps with the emulated FP8 backend (the recipe's scaling, exact quantization) and "
        "the same steps in BF16; print per-layer amax, saturation, underflow, SQNR (and MX clamp), and which layers "
        "to keep in BF16 and why. Runs on CPU in well under a minute with the default model where the CPU computes BF16 natively, about 2 minutes on one core of a CPU without (AVX2 only).",
    )
    s.add_argument("--recipe", required=True, metavar="NAME|PATH", help="an fp8 recipe name or YAML file")
    s.add_argument(
        "--model",
        metavar="DIR",
        help="a local save_pretrained causal-LM directory (default: a small Llama built from a config)",
    )
    s.add_argument("--steps", type=int, default=20, metavar="N", help="training steps (default 20, at least 2)")
    s.add_argument("--seq-len", type=int, default=128, metavar="N", help="tokens per sequence (default 128)")
    s.add_argument("--batch-size", type=int, default=8, metavar="N", help="sequences per step (default 8)")
    s.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    s.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.set_defaults(func=cmd_simulate)


# -- estimate --------------------------------------------------------------------------------------


def cmd_estimate(args: argparse.Namespace) -> int:
    from hf_mixedprec.commands.estimate import estimate_memory, format_estimate

    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    if not recipes:
        raise UsageError(
            f"--recipes: {args.recipes!r} names no recipe (allowed: comma-separated recipe names or paths)"
        )
    model: Any = None
    if args.model is not None or args.config is not None:
        from hf_mixedprec.commands.estimate import load_model_config

        model = load_model_config(args.model, config=args.config)
    est = estimate_memory(
        model,
        recipes,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        gradient_checkpointing=args.gradient_checkpointing,
        optimizer=args.optimizer,
        zero=args.zero,
        num_gpus=args.num_gpus,
        gpus=args.gpu or ["h100-80gb"],
        target=args.target,
    )
    print(json.dumps(est.to_dict(), indent=2) if args.json else format_estimate(est))
    return 0


def _add_estimate(sub: Any) -> None:
    from hf_mixedprec.commands.estimate import GPUS, OPTIMIZERS

    s = sub.add_parser(
        "estimate",
        help="memory per GPU of each recipe, by component, without allocating the model",
        description="Build the model from its config.json on fake tensors (nothing is allocated: an 8B config takes "
        "seconds), run one training step under each recipe and count what it holds per GPU: weights (and the FP32 "
        "master copy DeepSpeed keeps), gradients, optimizer states, activations saved for backward, FP8 extras "
        "(amax histories, scales, Transformer Engine's FP8 weight copies), with ZeRO / FSDP2 / DDP sharding; the "
        "total, its share of FP32 training, and whether it fits each --gpu.",
    )
    s.add_argument(
        "--recipes", required=True, metavar="R1,R2,...", help="comma-separated built-in recipe names or YAML paths"
    )
    s.add_argument("--model", metavar="DIR", help="a model folder with a config.json (weights are not read)")
    s.add_argument("--config", metavar="FILE", help="a model's config.json (default: finetune's small Llama)")
    s.add_argument("--batch-size", type=int, default=1, metavar="N", help="sequences per GPU per step (default 1)")
    s.add_argument("--seq-len", type=int, default=2048, metavar="N", help="tokens per sequence (default 2048)")
    s.add_argument("--gradient-checkpointing", action="store_true", help="recompute each block in backward")
    s.add_argument(
        "--optimizer",
        default="adamw",
        metavar="NAME",
        help=f"{' | '.join(OPTIMIZERS)}, as Trainer builds it (default adamw: {OPTIMIZERS['adamw']})",
    )
    s.add_argument(
        "--zero",
        type=int,
        metavar="STAGE",
        help="DeepSpeed ZeRO stage 0-3 (default: the recipe's distributed section; 0 = no sharding)",
    )
    s.add_argument("--num-gpus", type=int, metavar="N", help="world size (default: the recipe's num_processes)")
    s.add_argument(
        "--gpu",
        action="append",
        metavar="NAME|SIZE",
        help=f"a GPU to fit (repeat for several): {', '.join(GPUS)}, a size such as 24GiB, or NAME=SIZE "
        "(default h100-80gb)",
    )
    s.add_argument(
        "--target",
        default="gpu",
        metavar="gpu|cpu",
        help="gpu: FP8 on the recipe's GPU backend (auto = Transformer Engine); cpu: as rehearsed on this machine",
    )
    s.add_argument("--json", action="store_true", help="print the estimate as JSON")
    s.set_defaults(func=cmd_estimate)


# -- plan ------------------------------------------------------------------------------------------


def cmd_plan(args: argparse.Namespace) -> int:
    from hf_mixedprec.commands.estimate import load_model_config
    from hf_mixedprec.core._stdio import stdout_to_stderr
    from hf_mixedprec.precision.plan_map import format_map, meta_model, plan_notes, precision_map

    recipe = _load(args.recipe).rehearsed(not args.native)
    name = args.model or args.config or "finetune's default model"
    with stdout_to_stderr():  # libraries' banners: stdout holds the map (or JSON) only
        model = meta_model(load_model_config(args.model, config=args.config))
        plan, rows = precision_map(recipe, model, rehearse=not args.native)
    if args.json:
        rows_json = [r.to_dict() for r in rows]
        print(json.dumps({**plan.to_dict(), "model": name, "modules": rows_json, "notes": plan_notes(plan)}, indent=2))
    else:
        print(format_map(plan, rows, name))
    return 0


def _add_plan(sub: Any) -> None:
    s = sub.add_parser(
        "plan",
        help="the precision map: what each module computes in and each parameter is stored in",
        description="Build the model from its config.json on the meta device, in the dtype the config names (what "
        "from_pretrained loads; nothing is allocated), and print the recipe's precision plan for it: per module, the "
        "dtype its parameters are loaded in and kept in, what keeps their master, what its GEMM computes in (FP8 "
        "with the recipe's scaling, or autocast) and the rule that decided; repeated transformer blocks collapse "
        "into one row. Then the storage per parameter group and the bytes per trainable parameter.",
    )
    s.add_argument("--recipe", required=True, metavar="R", help="a built-in recipe name or a YAML path")
    s.add_argument("--model", metavar="DIR", help="a model folder with a config.json (weights are not read)")
    s.add_argument("--config", metavar="FILE", help="a model's config.json (default: finetune's small Llama)")
    s.add_argument(
        "--native",
        action="store_true",
        help="FP8 decisions for the recipe's own backend on this machine (default: the rehearsed, emulated one)",
    )
    s.add_argument("--json", action="store_true", help="print the plan and the map as JSON")
    s.set_defaults(func=cmd_plan)


# -- report ----------------------------------------------------------------------------------------


#: ``report`` reads at most this much of ``health.json`` (a 1M-step run logged every step is about 100 MiB).
MAX_HEALTH_BYTES = 256 * 2**20


def cmd_report(args: argparse.Namespace) -> int:
    from hf_mixedprec.training.run_report import HEALTH_FILE, build_plots, check_document, summarize

    run = Path(args.run_dir)
    if not run.is_dir():
        raise UsageError(f"RUN_DIR: {args.run_dir!r} is not a directory (allowed: a run's output directory)")
    path = run / HEALTH_FILE
    if not path.is_file():
        raise UsageError(
            f"RUN_DIR: {args.run_dir!r} has no {HEALTH_FILE} (allowed: a directory written by `{PROG} finetune` or "
            "hf_mixedprec.training.run_report.write_run_report)"
        )
    size = path.stat().st_size
    if size > MAX_HEALTH_BYTES:
        raise UsageError(
            f"RUN_DIR: {path} is {size / 2**20:,.0f} MiB (allowed: at most {MAX_HEALTH_BYTES // 2**20} MiB; a run's "
            "report is a few MiB at most)"
        )
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UsageError(f"RUN_DIR: {path} is not valid JSON ({exc})") from None
    except RecursionError:
        raise UsageError(f"RUN_DIR: {path} is nested too deeply to be a health report") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"RUN_DIR: {path} is not UTF-8 text (byte {exc.start})") from None
    problem = check_document(doc)
    if problem is not None:
        raise UsageError(f"RUN_DIR: {path} {problem}")
    files = build_plots(run, doc)
    info = summarize(doc)
    info["plots"] = [str(f) for f in files]
    summary = _run_summary(run)
    if summary is not None:
        info["summary"] = summary
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        if summary is not None:  # what `finetune` printed at the end of the run: loss, throughput, memory
            from hf_mixedprec.commands.finetune import format_summary

            print(format_summary(summary))
        for line in info["lines"]:
            print(line)
        for f in files:
            print(f"plot: {f}")
    return 0


def _run_summary(run: Path) -> dict | None:
    """The run's ``summary.json`` (written by ``finetune``), or None when there is none or it is unreadable."""
    try:
        summary = json.loads((run / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    required = ("recipe", "precision", "rehearsed", "precision_used", "steps", "skipped_steps", "loss_first")
    return summary if isinstance(summary, dict) and all(k in summary for k in required) else None


def _add_report(sub: Any) -> None:
    s = sub.add_parser(
        "report",
        help="summarise a run's health.json and rebuild its PNG plots",
        description="Read RUN_DIR/health.json (written at the end of `finetune`, or by "
        "hf_mixedprec.training.run_report.write_run_report), print the run's health events and notes, and rebuild the plots "
        "(loss_scale.png, grad_norm.png, skipped_steps.png, fp8_saturation.png; each only when the run has that "
        "series) in RUN_DIR.",
    )
    s.add_argument("run_dir", metavar="RUN_DIR", help="a run's output directory")
    s.add_argument("--json", action="store_true", help="print the summary as JSON")
    s.set_defaults(func=cmd_report)
