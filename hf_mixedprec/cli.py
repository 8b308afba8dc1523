"""The ``hf-mixedprec`` command.

Exit codes: 0 done; 1 a bug or crash (it keeps its traceback); 2 a user mistake or a refusal (bad flags, bad
recipes, missing files, hardware that cannot run a recipe), one line per problem and no traceback; 3 a run
stopped by a health reaction (``finetune``; the checkpoint and the resume command are printed); 130 Ctrl-C or
SIGTERM (``finetune`` saves a checkpoint first and prints the resume command).
``launch`` exits with the training script's own code (see :mod:`hf_mixedprec._launcher`).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from hf_mixedprec.errors import HardwareRefusal, MixedPrecisionError, Problem, RecipeError, UsageError
from hf_mixedprec.hardware import detect
from hf_mixedprec.recipe import Recipe, builtin_recipe_names, load_recipe_file

__all__ = ["EXIT_STOPPED", "UsageError", "main"]

PROG = "hf-mixedprec"
#: Exit code of ``finetune`` when a health reaction stopped the run (2 is taken by user mistakes).
EXIT_STOPPED = 3
#: ``launch`` exports its own command line (up to the script) to the script, for resume commands.
LAUNCH_COMMAND_ENV = "HF_MIXEDPREC_LAUNCH_COMMAND"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _load(name_or_path: str) -> Recipe:
    if name_or_path == "auto":
        from hf_mixedprec.loader import resolve_auto

        name, notes = resolve_auto()
        for note in notes:
            print(f"{PROG}: {note}", file=sys.stderr)
        return load_recipe_file(name)
    return load_recipe_file(name_or_path)


# -- commands --------------------------------------------------------------------------------------


def cmd_recipes(args: argparse.Namespace) -> int:
    rows = []
    for name in builtin_recipe_names():
        r = load_recipe_file(name)
        scaling = r.fp8.scaling if r.fp8 else ""
        rows.append(
            {
                "name": r.name,
                "precision": r.precision,
                "phases": list(r.precisions()) if r.phases is not None else None,
                "fp8_scaling": scaling or None,
                "hardware": list(r.hardware),
                "description": r.description,
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    width = max(len(r["name"]) for r in rows)
    print(f"{'name':<{width}}  {'precision':<9}  {'fp8':<9}  {'hardware':<28}  description")
    for r in rows:
        hw = ",".join(r["hardware"])
        precision = "->".join(r["phases"]) if r["phases"] else r["precision"]
        print(f"{r['name']:<{width}}  {precision:<9}  {r['fp8_scaling'] or '-':<9}  {hw:<28}  {r['description']}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    print(_load(args.recipe).to_yaml(), end="")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    bad = 0
    for path in args.paths:
        try:
            if not Path(path).is_file():
                raise RecipeError([_problem(path, "file not found")])
            recipe = load_recipe_file(path)
        except RecipeError as exc:
            bad += 1
            for p in exc.problems:
                # Problems found in a parent recipe keep the parent's name; the file named is what was asked for.
                print(p if p.source == path else f"{path}: {p}", file=sys.stderr)
        else:
            if not args.quiet:
                print(f"{path}: ok ({recipe.name}, {'->'.join(recipe.precisions())})")
    return 2 if bad else 0


def _problem(source: str, message: str):

    return Problem(source, "", message)


def cmd_schema(args: argparse.Namespace) -> int:
    print(json.dumps(Recipe.json_schema(), indent=2))
    return 0


def cmd_detect(args: argparse.Namespace) -> int:
    from hf_mixedprec.hardware import support_for
    from hf_mixedprec.loader import resolve_auto

    info = detect()
    name, notes = resolve_auto(info)
    sup = support_for(info.device_type, info.capability, info.cuda_version)
    out = {
        "device": info.device_type,
        "device_name": info.device_name,
        "generation": info.generation,
        "capability": info.to_dict()["capability"],
        "cuda_version": info.cuda_version,
        "torch_version": info.torch_version,
        "transformer_engine_version": info.te_version,
        "torchao_version": info.torchao_version,
        "precisions": list(sup.precisions),
        "fp8_scalings": list(sup.fp8_scalings),
        "recipe": name,
        "notes": notes,
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"device:      {info.describe()}")
    print(f"generation:  {info.generation}")
    print(f"precisions:  {', '.join(sup.precisions)}")
    print(f"fp8:         {', '.join(sup.fp8_scalings) or 'none'}")
    print(
        f"libraries:   torch {info.torch_version}, transformer_engine {info.te_version or 'not installed'}, "
        f"torchao {info.torchao_version or 'not installed'}"
    )
    print(f"recipe:      {name}")
    for note in notes:
        print(f"note:        {note}")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from hf_mixedprec.simulate import simulate

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
        from hf_mixedprec.model_dir import check_model_dir

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


def cmd_launch(args: argparse.Namespace) -> int:
    from hf_mixedprec.integrations.launch import child_env, plan_launch

    recipe = _load(args.recipe)
    if args.num_processes is not None and args.num_processes < 1:
        raise UsageError(f"--num-processes: {args.num_processes} is out of range (allowed: >= 1)")
    if not args.dry_run and not Path(args.script).is_file():
        raise UsageError(f"SCRIPT: {args.script!r} not found (allowed: a path to a Python training script)")
    config_dir = args.config_dir or (
        str(Path(tempfile.gettempdir()) / f"hf-mixedprec-launch-{recipe.name}")
        if args.dry_run
        else tempfile.mkdtemp(prefix=f"hf-mixedprec-launch-{recipe.name}-")
    )
    machines = args.num_machines if args.num_machines is not None else recipe.distributed.num_machines
    if machines < 1:
        raise UsageError(f"--num-machines: {machines} is out of range (allowed: >= 1)")
    if not 0 <= args.machine_rank < machines:
        raise UsageError(f"--machine-rank: {args.machine_rank} is out of range (allowed: 0 to {machines - 1})")
    if machines > 1 and not args.main_process_ip:
        raise UsageError(
            f"--main-process-ip: required for {machines} machines (allowed: the address of machine rank 0, "
            "reachable from every machine)"
        )
    if args.main_process_port is not None and not 1 <= args.main_process_port <= 65535:
        raise UsageError(f"--main-process-port: {args.main_process_port} is out of range (allowed: 1 to 65535)")
    if args.device is not None and not args.dry_run:
        raise UsageError("--device: only plans a launch for other hardware (allowed: with --dry-run)")
    plan = plan_launch(
        recipe,
        args.script,
        list(args.script_args),
        config_dir=config_dir,
        num_processes=args.num_processes,
        device_type=args.device,
        num_machines=args.num_machines,
        machine_rank=args.machine_rank,
        main_process_ip=args.main_process_ip,
        main_process_port=args.main_process_port,
    )
    if args.rehearse:
        from hf_mixedprec.loader import REHEARSE_ENV

        plan.env[REHEARSE_ENV] = "1"
        plan.notes.append(
            f"REHEARSAL: {REHEARSE_ENV}=1 is exported; the script's load_recipe() rehearses {recipe.name!r}"
        )
    if args.dry_run:
        print("# command")
        print(shlex.join(plan.command))
        print("# environment")
        for k, v in plan.env.items():
            print(f"{k}={v}")
        for path, text in plan.files.items():
            print(f"# file: {path}")
            print(text, end="" if text.endswith("\n") else "\n")
        return 0
    from hf_mixedprec.hardware import check_recipe

    if not args.rehearse:
        check_recipe(recipe, detect())
    _check_deepspeed(recipe)  # rehearsal does not change what DeepSpeed itself accepts
    if args.config_dir:
        _check_config_dir(Path(config_dir), list(plan.files))
    plan.write()
    if args.config_dir:
        _record_written(Path(config_dir), list(plan.files))
    for note in plan.notes:
        print(f"{PROG}: {note}", file=sys.stderr)
    print(f"{PROG}: {shlex.join(plan.command)}", file=sys.stderr)
    env = child_env(plan)
    argv = getattr(args, "argv", None)
    if argv:  # the user's launch command up to the script, so that `finetune` can print a resume command
        env[LAUNCH_COMMAND_ENV] = shlex.join([PROG, *argv[: len(argv) - len(args.script_args)]])
    try:
        code = subprocess.call(plan.command, env=env)
    finally:
        if not args.config_dir:  # our own temporary folder: nothing in it outlives the launch
            shutil.rmtree(config_dir, ignore_errors=True)
    return 128 - code if code < 0 else code  # the launcher itself killed by signal N: 128+N, as a shell says


#: In a ``--config-dir``, the list of files ``launch`` wrote there (and so may write again).
LAUNCH_MANIFEST = ".hf-mixedprec-launch"


def _check_config_dir(folder: Path, files: list[str]) -> None:
    """Refuse to write over a file in ``--config-dir`` that an earlier launch did not write (a user's own
    ``recipe.yaml``, say)."""
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"--config-dir: {str(folder)!r} is a file (allowed: a folder, new or existing)")
    ours = _written_before(folder)
    for path in files:
        p = Path(path)
        if p.exists() and p.name not in ours:
            raise UsageError(
                f"--config-dir: {str(folder)!r} already has {p.name}, which hf-mixedprec launch did not write "
                "(allowed: a new or empty folder, or one an earlier launch wrote; nothing was overwritten)"
            )


def _written_before(folder: Path) -> set[str]:
    """The names of the files earlier launches wrote in ``folder`` (its manifest)."""
    manifest = folder / LAUNCH_MANIFEST
    return set(manifest.read_text(encoding="utf-8").split()) if manifest.is_file() else set()


def _record_written(folder: Path, files: list[str]) -> None:
    ours = _written_before(folder) | {Path(p).name for p in files}
    (folder / LAUNCH_MANIFEST).write_text("\n".join(sorted(ours)) + "\n", encoding="utf-8")


def _check_deepspeed(recipe: Recipe) -> None:
    """Refuse, before any process starts, a DeepSpeed recipe whose precision DeepSpeed refuses on this machine."""
    if recipe.distributed.strategy != "deepspeed":
        return
    from hf_mixedprec.integrations.deepspeed import deepspeed_device, deepspeed_fp16_supported, deepspeed_refusal

    device = deepspeed_device()
    why = deepspeed_refusal(recipe, device, fp16_supported=deepspeed_fp16_supported(device))
    if why is not None:
        raise HardwareRefusal(why)


def cmd_finetune(args: argparse.Namespace) -> int:
    from hf_mixedprec._stdio import quiet_progress_bars, stdout_to_stderr
    from hf_mixedprec.finetune import format_summary, run_finetune

    quiet_progress_bars()

    # stdout carries only the summary (--json is parsed by scripts); libraries imported during the run
    # (DeepSpeed's logger, for one) print to stdout, so the run's own output goes to stderr
    with stdout_to_stderr():
        summary = run_finetune(
            command=_finetune_command(getattr(args, "argv", None)),
            recipe=args.recipe,
            rehearse=True if args.rehearse else None,
            model=args.model,
            data=args.data,
            text_field=args.text_field,
            output_dir=args.output_dir,
            max_steps=args.max_steps,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            lr=args.lr,
            seed=args.seed,
            logging_steps=args.logging_steps,
            save=not args.no_save,
            resume=args.resume,
            save_steps=args.save_steps,
            save_total_limit=args.save_total_limit,
            overwrite=args.overwrite,
            eval_split=args.eval_split,
        )
    main_process = "files" in summary  # the main process (rank 0) prints; other ranks stay quiet
    if main_process:
        print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    if summary.get("interrupted"):
        it = summary["interrupted"]
        if main_process:
            _print_halt(summary, f"interrupted by {it['signal']} at step {it['at_step']} (exit code 130)")
        return 130
    if not summary.get("stopped"):
        return 0  # finished, possibly under a fallback recipe that took over after a stop
    if main_process:
        _print_halt(summary, f"STOPPED by a health reaction at step {summary['steps']} (exit code {EXIT_STOPPED})")
    return EXIT_STOPPED


def _print_halt(summary: dict, headline: str) -> None:
    """Why ``finetune`` ended early, where its checkpoint is, and the command that resumes it (stderr)."""
    where = f"checkpoint {summary['resume_from']}" if summary.get("resume_from") else "no checkpoint was saved"
    print(f"{PROG}: {headline}; {where}", file=sys.stderr)
    if summary.get("resume_command"):
        print(f"{PROG}: resume with: {summary['resume_command']}", file=sys.stderr)


def _finetune_command(argv: Sequence[str] | None) -> list[str] | None:
    """The command that started this ``finetune`` run, without any ``--resume``: the base of its resume command.

    Under ``hf-mixedprec launch`` it is the launch command (exported by ``launch``) followed by the script's
    arguments; otherwise ``hf-mixedprec finetune`` and the arguments given. None when not known.
    """
    if argv is None or "finetune" not in argv:
        return None
    tokens = list(argv[argv.index("finetune") + 1 :])
    kept: list[str] = []
    skip = False
    for tok in tokens:
        if skip:
            skip = False
        elif tok == "--resume":
            skip = True
        elif not tok.startswith("--resume="):
            kept.append(tok)
    launch = os.environ.get(LAUNCH_COMMAND_ENV)
    if launch and ("LOCAL_RANK" in os.environ or "RANK" in os.environ):
        return [*shlex.split(launch), *kept]
    return [PROG, "finetune", *kept]


#: ``report`` reads at most this much of ``health.json`` (a 1M-step run logged every step is about 100 MiB).
MAX_HEALTH_BYTES = 256 * 2**20


def cmd_report(args: argparse.Namespace) -> int:
    from hf_mixedprec.run_report import HEALTH_FILE, build_plots, check_document, summarize

    run = Path(args.run_dir)
    if not run.is_dir():
        raise UsageError(f"RUN_DIR: {args.run_dir!r} is not a directory (allowed: a run's output directory)")
    path = run / HEALTH_FILE
    if not path.is_file():
        raise UsageError(
            f"RUN_DIR: {args.run_dir!r} has no {HEALTH_FILE} (allowed: a directory written by `{PROG} finetune` or "
            "hf_mixedprec.run_report.write_run_report)"
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
            from hf_mixedprec.finetune import format_summary

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


# -- parser ----------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: one sub-parser per command, each added by its ``_add_<command>``."""
    p = _Parser(
        prog=PROG,
        description="Mixed-precision fine-tuning recipes (FP16, BF16, FP8, MXFP8) for Hugging Face Transformers "
        "and Accelerate.",
        epilog="Recipes: `hf-mixedprec recipes`. Exit status: 0 done, 1 a crash, 2 a mistake in the input or a "
        "refusal (explained in one line), 3 a run stopped by a health reaction, 130 interrupted; `launch` exits with "
        "the script's own status.",
    )
    from hf_mixedprec import __version__

    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    _add_recipes(sub)
    _add_show(sub)
    _add_validate(sub)
    _add_schema(sub)
    _add_detect(sub)
    _add_launch(sub)
    _add_simulate(sub)
    _add_finetune(sub)
    _add_compare(sub)
    _add_estimate(sub)
    _add_plan(sub)
    _add_report(sub)
    return p


def _add_recipes(sub: Any) -> None:
    s = sub.add_parser("recipes", help="list the built-in recipes", description="List the built-in recipes.")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.set_defaults(func=cmd_recipes)


def _add_show(sub: Any) -> None:
    s = sub.add_parser(
        "show",
        help="print a recipe, resolved after extends",
        description="Print a recipe as YAML, with every value resolved (extends followed, defaults filled in).",
    )
    s.add_argument("recipe", metavar="NAME|PATH", help="a built-in recipe name, `auto`, or a YAML file")
    s.set_defaults(func=cmd_show)


def _add_validate(sub: Any) -> None:
    s = sub.add_parser(
        "validate",
        help="check recipe files",
        description="Check recipe YAML files. Exit 0 when all "
        "are valid, else 2 with one line per problem: `file: dotted.key: what is wrong (allowed: ...)`.",
    )
    s.add_argument("paths", metavar="PATH", nargs="+", help="recipe YAML files")
    s.add_argument("-q", "--quiet", action="store_true", help="print only problems")
    s.set_defaults(func=cmd_validate)


def _add_schema(sub: Any) -> None:
    s = sub.add_parser("schema", help="print the recipe JSON Schema", description="Print the recipe JSON Schema.")
    s.set_defaults(func=cmd_schema)


def _add_detect(sub: Any) -> None:
    s = sub.add_parser(
        "detect",
        help="show this machine and the recipe `auto` picks",
        description="Show the device, its GPU generation, what it supports and the `auto` recipe.",
    )
    s.add_argument("--json", action="store_true", help="print JSON (keys include device, generation, recipe)")
    s.set_defaults(func=cmd_detect)


def _add_launch(sub: Any) -> None:
    s = sub.add_parser(
        "launch",
        help="run a training script under a recipe (accelerate launch; torch.distributed.run for multi-process CPU)",
        description="Write an `accelerate launch` config (and a DeepSpeed config when the recipe uses DeepSpeed) "
        "for the recipe, export the recipe to the child in HF_MIXEDPREC_RECIPE so that `load_recipe()` picks it "
        "up, and run `accelerate launch` (no shell). Without a CUDA GPU and with several processes it runs "
        "`python -m torch.distributed.run` instead, because `accelerate launch --cpu` starts only one process.",
    )
    s.add_argument(
        "--rehearse",
        action="store_true",
        help="rehearse a recipe this machine cannot run natively (exports HF_MIXEDPREC_REHEARSE=1 to the script)",
    )
    s.add_argument(
        "--recipe", required=True, metavar="NAME|PATH", help="a built-in recipe name, `auto`, or a YAML file"
    )
    s.add_argument("--num-processes", type=int, metavar="N", help="processes in total (default: the recipe's)")
    s.add_argument(
        "--num-machines", type=int, metavar="N", help="machines in the job (default: distributed.num_machines)"
    )
    s.add_argument("--machine-rank", type=int, default=0, metavar="R", help="this machine's rank, 0 to N-1 (default 0)")
    s.add_argument("--main-process-ip", metavar="HOST", help="address of machine rank 0 (required for N > 1)")
    s.add_argument(
        "--main-process-port", type=int, metavar="PORT", help="port on machine rank 0 (default: Accelerate's)"
    )
    s.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        help="with --dry-run: plan for this device type instead of this machine's (e.g. a GPU launch from a laptop)",
    )
    s.add_argument("--config-dir", metavar="DIR", help="where to write the configs (default: a new temporary folder)")
    s.add_argument("--dry-run", action="store_true", help="print the command, environment and configs; run nothing")
    s.add_argument("script", metavar="SCRIPT", help="the training script")
    s.add_argument("script_args", metavar="ARGS", nargs=argparse.REMAINDER, help="arguments for the script")
    s.set_defaults(func=cmd_launch)


def _add_simulate(sub: Any) -> None:
    s = sub.add_parser(
        "simulate",
        help="rehearse an FP8 recipe on any hardware and get per-layer advice",
        description="Train a few steps with the emulated FP8 backend (the recipe's scaling, exact quantization) and "
        "the same steps in BF16; print per-layer amax, saturation, underflow, SQNR (and MX clamp), and which layers "
        "to keep in BF16 and why. Runs on CPU in well under a minute with the default model.",
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


def _add_finetune(sub: Any) -> None:
    s = sub.add_parser(
        "finetune",
        help="fine-tune a causal LM with Trainer and a recipe; write a summary, health report and plots",
        description="Fine-tune a causal LM with Hugging Face Trainer and the recipe's callbacks. Without --model "
        "and --data it trains a small Llama built from a config on prose from Python's docstrings, with a tokenizer "
        "trained on the spot (nothing is downloaded; about a minute on 2 CPU cores). Writes summary.json, "
        "health.json, PNG plots, conversion_report.json (FP8) and the model + tokenizer into --output-dir, and "
        "prints a short summary.",
    )
    s.add_argument(
        "--recipe",
        metavar="NAME|PATH",
        help="a built-in recipe name, `auto`, or a YAML file (default: the recipe `hf-mixedprec launch` exported, "
        "else auto)",
    )
    s.add_argument(
        "--rehearse", action="store_true", help="rehearse a recipe this machine cannot run natively (emulation)"
    )
    s.add_argument(
        "--model",
        metavar="DIR",
        help="a local save_pretrained causal-LM folder; its tokenizer is used if it has one, else one is trained on "
        "the data (default: a small Llama built from a config)",
    )
    s.add_argument(
        "--data",
        metavar="PATH",
        help="a .txt file (one example per blank-line-separated paragraph), a .jsonl/.json/.csv/.parquet file with "
        "a text column, or a datasets save_to_disk folder (its train split) (default: built-in prose)",
    )
    s.add_argument("--text-field", metavar="NAME", help="the column holding the text in --data (default: text)")
    s.add_argument(
        "--output-dir", default="runs/finetune", metavar="DIR", help="where the run's files go (default runs/finetune)"
    )
    s.add_argument("--max-steps", type=int, default=200, metavar="N", help="optimizer steps (default 200)")
    s.add_argument("--seq-len", type=int, default=128, metavar="N", help="tokens per packed block (default 128)")
    s.add_argument("--batch-size", type=int, default=8, metavar="N", help="blocks per step and process (default 8)")
    s.add_argument("--lr", type=float, help="AdamW learning rate, linear decay (default 1e-3; 5e-5 with --model)")
    s.add_argument("--seed", type=int, default=0, help="random seed for the model and data order (default 0)")
    s.add_argument(
        "--logging-steps",
        type=int,
        metavar="N",
        help="log every N steps, and always step 1 (default: max-steps/10, between 1 and 10)",
    )
    s.add_argument("--no-save", action="store_true", help="do not save the trained model and tokenizer")
    s.add_argument(
        "--resume",
        metavar="CHECKPOINT",
        help="continue from a checkpoint folder (any checkpoint-N of the run), or `latest` for the newest in "
        "--output-dir",
    )
    s.add_argument(
        "--save-steps",
        type=int,
        metavar="N",
        help="save a checkpoint every N steps (default: max-steps/4, between 1 and 500); Ctrl-C (SIGINT) or SIGTERM "
        "also saves one and prints the resume command",
    )
    s.add_argument(
        "--save-total-limit", type=int, default=2, metavar="N", help="keep the newest N checkpoints (default 2)"
    )
    s.add_argument(
        "--eval-split",
        type=float,
        metavar="F",
        help="hold out this fraction of the blocks for evaluation every --save-steps and at the end (default 0.05 "
        "with the built-in data, 0 with --data)",
    )
    s.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run already in --output-dir (its files are removed first; without it such a folder is "
        "refused)",
    )
    s.add_argument("--json", action="store_true", help="print the summary as JSON (the content of summary.json)")
    s.set_defaults(func=cmd_finetune)


def cmd_compare(args: argparse.Namespace) -> int:
    from hf_mixedprec._stdio import quiet_progress_bars, stdout_to_stderr
    from hf_mixedprec.compare import EXIT_FAILED, Criteria, run_compare

    quiet_progress_bars()
    crit = Criteria(
        max_skip_rate=args.max_skip_rate, max_loss_delta_pct=args.max_loss_delta, allow_stop=args.allow_stop
    )
    with stdout_to_stderr():
        result = run_compare(
            [r for r in args.recipes.split(",")],
            baseline=args.baseline,
            model=args.model,
            data=args.data,
            text_field=args.text_field,
            max_steps=args.max_steps,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            lr=args.lr,
            seed=args.seed,
            eval_split=args.eval_split,
            output_dir=args.output_dir,
            criteria=crit,
            overwrite=args.overwrite,
            memory_check=not args.no_memory_check,
        )
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.markdown(), end="" if not args.json else "\n")
    if not args.json:
        print(f"\nwritten: {', '.join(result.files)}")
    return 0 if result.passed else EXIT_FAILED


def _add_compare(sub: Any) -> None:
    from hf_mixedprec.compare import EXIT_FAILED, Criteria

    d = Criteria()
    s = sub.add_parser(
        "compare",
        help="train each recipe and an FP32 baseline from the same weights on the same batches; judge each recipe",
        description="Train the baseline and each recipe from the same initial weights on the same batches in the same "
        "order (recipes this machine cannot run are rehearsed), then compare: the loss gap per step and at the end, "
        "per-layer gradient cosine and SQNR against FP32 on identical weights at sampled steps, skip rate, loss "
        "scale, FP8 saturation/underflow, health events. Writes compare.json, compare.md, compare_loss.png and "
        "compare_grad_sqnr.png into --output-dir and prints the table. Exit code 0 when every recipe passes, "
        f"{EXIT_FAILED} when one fails (the reasons and what to change are printed), 2 for a mistake in the input.",
    )
    s.add_argument(
        "--recipes", required=True, metavar="R1,R2,...", help="comma-separated built-in recipe names or YAML paths"
    )
    s.add_argument(
        "--baseline", default="fp32", metavar="NAME|PATH", help="what each recipe is judged against (default fp32)"
    )
    s.add_argument("--model", metavar="DIR", help="a local save_pretrained causal-LM folder (default: a small Llama)")
    s.add_argument("--data", metavar="PATH", help="training text, as for finetune (default: built-in prose)")
    s.add_argument("--text-field", metavar="NAME", help="the column holding the text in --data (default: text)")
    s.add_argument("--max-steps", type=int, default=40, metavar="N", help="optimizer steps per run (default 40)")
    s.add_argument("--seq-len", type=int, default=128, metavar="N", help="tokens per packed block (default 128)")
    s.add_argument("--batch-size", type=int, default=8, metavar="N", help="blocks per step (default 8)")
    s.add_argument("--lr", type=float, help="AdamW learning rate, linear decay (default 1e-3; 5e-5 with --model)")
    s.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the data order (default 0)")
    s.add_argument(
        "--eval-split",
        type=float,
        metavar="F",
        help="fraction of blocks held out for the final eval loss (default 0.05 with the built-in data, 0 with --data:"
        " then the mean train loss of the last tenth of the steps)",
    )
    s.add_argument(
        "--output-dir", default="runs/compare", metavar="DIR", help="where the files go (default runs/compare)"
    )
    s.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the comparison an earlier run left in --output-dir (default: refuse, before training anything)",
    )
    s.add_argument(
        "--max-skip-rate",
        type=float,
        default=d.max_skip_rate,
        metavar="F",
        help=f"fail a recipe that skips more than this fraction of its steps (default {d.max_skip_rate:g})",
    )
    s.add_argument(
        "--max-loss-delta",
        type=float,
        default=d.max_loss_delta_pct,
        metavar="PCT",
        help=f"fail a recipe whose final loss is more than PCT %% above the baseline's (default {d.max_loss_delta_pct:g})",
    )
    s.add_argument("--allow-stop", action="store_true", help="do not fail a recipe whose run a health reaction stopped")
    s.add_argument(
        "--no-memory-check",
        action="store_true",
        help="train even a run whose estimated memory (hf-mixedprec estimate) exceeds what the device has free "
        "(default: refuse it before training anything)",
    )
    s.add_argument("--json", action="store_true", help="print compare.json instead of the table")
    s.set_defaults(func=cmd_compare)


def cmd_estimate(args: argparse.Namespace) -> int:
    from hf_mixedprec.estimate import estimate_memory, format_estimate

    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    if not recipes:
        raise UsageError(
            f"--recipes: {args.recipes!r} names no recipe (allowed: comma-separated recipe names or paths)"
        )
    model: Any = None
    if args.model is not None or args.config is not None:
        from hf_mixedprec.estimate import load_model_config

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


def cmd_plan(args: argparse.Namespace) -> int:
    from hf_mixedprec._stdio import stdout_to_stderr
    from hf_mixedprec.estimate import load_model_config
    from hf_mixedprec.plan_map import format_map, meta_model, plan_notes, precision_map

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


def _add_estimate(sub: Any) -> None:
    from hf_mixedprec.estimate import GPUS, OPTIMIZERS

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


def _add_report(sub: Any) -> None:
    s = sub.add_parser(
        "report",
        help="summarise a run's health.json and rebuild its PNG plots",
        description="Read RUN_DIR/health.json (written at the end of `finetune`, or by "
        "hf_mixedprec.run_report.write_run_report), print the run's health events and notes, and rebuild the plots "
        "(loss_scale.png, grad_norm.png, skipped_steps.png, fp8_saturation.png; each only when the run has that "
        "series) in RUN_DIR.",
    )
    s.add_argument("run_dir", metavar="RUN_DIR", help="a run's output directory")
    s.add_argument("--json", action="store_true", help="print the summary as JSON")
    s.set_defaults(func=cmd_report)


def main(argv: Sequence[str] | None = None) -> int:
    from hf_mixedprec._stdio import quiet_known_noise

    quiet_known_noise()
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        from hf_mixedprec.loader import check_process_env

        check_process_env()
        return int(args.func(args) or 0)
    except RecipeError as exc:
        for p in exc.problems:
            print(p, file=sys.stderr)
        return 2
    except MixedPrecisionError as exc:  # a user mistake (flag, environment, hardware asked for): one line
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        _close_process_group()


def _close_process_group() -> None:
    """Tear down the process group a distributed run (``launch``) initialised, before the interpreter exits: left to
    interpreter teardown, its communication threads can abort the process (``terminate called without an active
    exception``) after the run has finished."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
