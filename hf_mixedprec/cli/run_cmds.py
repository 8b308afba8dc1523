"""The ``hf-mixedprec`` commands that run training: ``launch`` (a script under a recipe, through ``accelerate
launch``), ``finetune`` and ``compare``; each command's function and the ``_add_<command>`` that adds its
sub-parser.

Split from :mod:`hf_mixedprec.cli` (which builds the parser from these and re-exports the commands) to keep each
module short. Libraries that are heavy to import are imported inside the commands, so ``hf-mixedprec --help``
stays fast.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from hf_mixedprec.cli.common import EXIT_STOPPED, LAUNCH_COMMAND_ENV, PROG, _load
from hf_mixedprec.core._launcher import run_stoppable
from hf_mixedprec.core.errors import HardwareRefusal, UsageError
from hf_mixedprec.integrations.recipe import Recipe
from hf_mixedprec.recipes.hardware import detect

__all__ = ["cmd_compare", "cmd_finetune", "cmd_launch"]


# -- launch ----------------------------------------------------------------------------------------


def _take_moved_script(args: argparse.Namespace, moved_script: Any) -> None:
    """A script of the package given by the path it had before it moved: launch it where it is now, said once."""
    args.script, moved = moved_script(args.script)
    if moved is not None:
        print(f"{PROG}: {moved}", file=sys.stderr)


def cmd_launch(args: argparse.Namespace) -> int:
    from hf_mixedprec.integrations.launch import child_env, moved_script, plan_launch, stop_env

    recipe = _load(args.recipe)
    _take_moved_script(args, moved_script)
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
    plan.env.update(stop_env(args.grace_s))
    if args.rehearse:
        from hf_mixedprec.recipes.loader import REHEARSE_ENV

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
    from hf_mixedprec.recipes.hardware import check_recipe

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
        return run_stoppable(plan.command, env, args.grace_s)  # 128+N for a launcher killed by signal N
    finally:
        if not args.config_dir:  # our own temporary folder: nothing in it outlives the launch
            shutil.rmtree(config_dir, ignore_errors=True)


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
    s.add_argument(
        "--grace-s",
        type=float,
        default=120.0,
        metavar="S",
        help="after a SIGINT/SIGTERM (forwarded once to the training processes, which save a checkpoint and stop): "
        "seconds the job may take to end before it is stopped at once (default 120; keep it under your scheduler's "
        "kill wait)",
    )
    s.add_argument("script", metavar="SCRIPT", help="the training script")
    s.add_argument("script_args", metavar="ARGS", nargs=argparse.REMAINDER, help="arguments for the script")
    s.set_defaults(func=cmd_launch)


# -- finetune --------------------------------------------------------------------------------------


@contextlib.contextmanager
def _resume_said(command: list[str] | None) -> Iterator[None]:
    """A full disk's one line, ending with the command that resumes the run."""
    from hf_mixedprec.core.disk import DiskFull

    try:
        yield
    except DiskFull as exc:
        how = f"{shlex.join(command)} --resume latest" if command else "--resume latest"
        raise DiskFull(f"{exc}: {how}") from None


def cmd_finetune(args: argparse.Namespace) -> int:
    from hf_mixedprec.commands.finetune import format_summary, run_finetune
    from hf_mixedprec.core._stdio import quiet_progress_bars, stdout_to_stderr

    quiet_progress_bars()

    # stdout carries only the summary (--json is parsed by scripts); libraries imported during the run
    # (DeepSpeed's logger, for one) print to stdout, so the run's own output goes to stderr
    command = _finetune_command(getattr(args, "argv", None))
    with stdout_to_stderr(), _resume_said(command):
        summary = run_finetune(
            command=command,
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
            allow_recipe_change=args.allow_recipe_change,
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


#: ``finetune --allow-recipe-change``'s help.
_ALLOW_RECIPE_CHANGE = (
    "with --resume: continue under a recipe whose numerics differ from the checkpoint's (another precision than a step "
    "down such as fp8 -> bf16, other FP8 numerics, another clipping method) instead of refusing; a storage change is "
    "refused anyway"
)


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
    s.add_argument("--allow-recipe-change", action="store_true", help=_ALLOW_RECIPE_CHANGE)
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


# -- compare ---------------------------------------------------------------------------------------


def cmd_compare(args: argparse.Namespace) -> int:
    from hf_mixedprec.commands.compare import EXIT_FAILED, Criteria, run_compare
    from hf_mixedprec.core._stdio import quiet_progress_bars, stdout_to_stderr

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
    from hf_mixedprec.commands.compare import EXIT_FAILED, Criteria

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
