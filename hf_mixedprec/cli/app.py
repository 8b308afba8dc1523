"""The ``hf-mixedprec`` command.

Exit codes: 0 done; 1 a bug or crash (it keeps its traceback); 2 a user mistake or a refusal (bad flags, bad
recipes, missing files, hardware that cannot run a recipe), one line per problem and no traceback; 3 a run
stopped by a health reaction (``finetune``; the checkpoint and the resume command are printed); 130 Ctrl-C or
SIGTERM (``finetune`` saves a checkpoint first and prints the resume command).
``launch`` exits with the training script's own code (see :mod:`hf_mixedprec.core._launcher`).

This module builds the parser, holds ``main`` and the small commands (``recipes``, ``show``, ``validate``,
``schema``, ``detect``); the commands that train are in :mod:`hf_mixedprec.cli.run_cmds` (``launch``, ``finetune``,
``compare``), those that inspect a recipe, a model or a run in :mod:`hf_mixedprec.cli.inspect_cmds` (``simulate``,
``estimate``, ``plan``, ``report``), what they share in :mod:`hf_mixedprec.cli.common`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from hf_mixedprec.cli.common import EXIT_DISK_FULL, EXIT_STOPPED, LAUNCH_COMMAND_ENV, PROG, _load
from hf_mixedprec.cli.inspect_cmds import (
    _add_estimate,
    _add_plan,
    _add_report,
    _add_simulate,
    cmd_estimate,
    cmd_plan,
    cmd_report,
    cmd_simulate,
)
from hf_mixedprec.cli.run_cmds import _add_compare, _add_finetune, _add_launch, cmd_compare, cmd_finetune, cmd_launch
from hf_mixedprec.cli.run_cmds import _finetune_command as _finetune_command
from hf_mixedprec.core.disk import DiskFull
from hf_mixedprec.core.errors import HardwareRefusal, MixedPrecisionError, Problem, RecipeError, UsageError
from hf_mixedprec.integrations.recipe import Recipe, builtin_recipe_names, load_recipe_file
from hf_mixedprec.recipes.hardware import detect

__all__ = [
    "EXIT_STOPPED",
    "LAUNCH_COMMAND_ENV",
    "PROG",
    "UsageError",
    "cmd_compare",
    "cmd_estimate",
    "cmd_finetune",
    "cmd_launch",
    "cmd_plan",
    "cmd_report",
    "cmd_simulate",
    "main",
]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


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
    from hf_mixedprec.recipes.hardware import support_for
    from hf_mixedprec.recipes.loader import resolve_auto

    info = detect()
    name, notes = resolve_auto(info)
    sup = support_for(info.device_type, info.capability, info.cuda_version)
    also = _also_runs(info, name)
    as_dict = info.to_dict()
    out = {
        "device": info.device_type,
        "device_name": info.device_name,
        "generation": info.generation,
        "capability": as_dict["capability"],
        "cuda_version": info.cuda_version,
        "torch_version": info.torch_version,
        "transformer_engine_version": info.te_version,
        "torchao_version": info.torchao_version,
        "precisions": list(sup.precisions),
        "fp8_scalings": list(sup.fp8_scalings),
        "cpu_capability": info.cpu_capability,
        "cpu_bf16": as_dict["cpu_bf16"],
        "recipe": name,
        "also_runs": also,
        "notes": notes,
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"device:      {info.describe()}")
    print(f"generation:  {info.generation}")
    print(f"precisions:  {', '.join(sup.precisions)}")
    print(f"fp8:         {', '.join(sup.fp8_scalings) or 'none'}")
    if info.cpu_bf16 is not None:
        answer = "native" if info.cpu_bf16.native else "emulated (slow)"
        print(f"cpu bf16:    {answer}: {info.cpu_bf16.describe()} [{info.cpu_bf16.how}]")
    print(
        f"libraries:   torch {info.torch_version}, transformer_engine {info.te_version or 'not installed'}, "
        f"torchao {info.torchao_version or 'not installed'}"
    )
    print(f"recipe:      {name}")
    print(f"also runs:   {', '.join(also) or 'none'} (--recipe NAME; auto picks the one above)")
    for note in notes:
        print(f"note:        {note}")
    return 0


def _also_runs(info: Any, chosen: str) -> list[str]:
    """The other built-in recipes this machine runs natively (no rehearsal): the opt-in ones such as b200-nvfp4,
    which ``auto`` never picks, are offered here."""
    from hf_mixedprec.recipes.hardware import check_recipe

    out = []
    for n in builtin_recipe_names():
        if n == chosen:
            continue
        try:
            check_recipe(load_recipe_file(n), info)
        except HardwareRefusal:
            continue
        out.append(n)
    return out


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


def main(argv: Sequence[str] | None = None) -> int:
    from hf_mixedprec.core._stdio import quiet_known_noise

    quiet_known_noise()
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        from hf_mixedprec.recipes.loader import check_process_env

        check_process_env()
        return int(args.func(args) or 0)
    except RecipeError as exc:
        for p in exc.problems:
            print(p, file=sys.stderr)
        return 2
    except DiskFull as exc:  # not a mistake in the input, and no traceback either: what was kept, how to go on
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_DISK_FULL
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
