"""What every ``hf-mixedprec`` command module shares: the program name, the exit code of a stopped ``finetune``, the
variable ``launch`` exports its command line in, and reading a recipe by name, path or ``auto``.

Its own module so that :mod:`hf_mixedprec.cli` (the parser and ``main``) and the command modules
:mod:`hf_mixedprec.cli.run_cmds` and :mod:`hf_mixedprec.cli.inspect_cmds` all import it without importing each other.
"""

from __future__ import annotations

import sys

from hf_mixedprec.integrations.recipe import Recipe, load_recipe_file

__all__ = ["EXIT_DISK_FULL", "EXIT_STOPPED", "LAUNCH_COMMAND_ENV", "PROG"]

PROG = "hf-mixedprec"
#: Exit code of ``finetune`` when a health reaction stopped the run (2 is taken by user mistakes).
EXIT_STOPPED = 3
#: Exit code of a command whose disk filled up while it wrote (4 is compare's failed verdict).
EXIT_DISK_FULL = 5
#: ``launch`` exports its own command line (up to the script) to the script, for resume commands.
LAUNCH_COMMAND_ENV = "HF_MIXEDPREC_LAUNCH_COMMAND"


def _load(name_or_path: str) -> Recipe:
    if name_or_path == "auto":
        from hf_mixedprec.recipes.loader import resolve_auto

        name, notes = resolve_auto()
        for note in notes:
            print(f"{PROG}: {note}", file=sys.stderr)
        return load_recipe_file(name).chosen_by_auto(notes)
    return load_recipe_file(name_or_path)
