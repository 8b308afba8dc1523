"""Every error that is the user's to fix derives from :class:`MixedPrecisionError`.

The command line prints such an error as one line (a :class:`RecipeError` as one line per problem) and exits
with status 2; anything else is a bug and keeps its traceback. This module is at the bottom of the package:
it imports nothing from it but text helpers, so every layer can raise these.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from hf_mixedprec.core._text import shorten

__all__ = [
    "EnvValueError",
    "HardwareRefusal",
    "MixedPrecisionError",
    "ModuleRuleError",
    "Problem",
    "RecipeError",
    "StorageRefusal",
    "UsageError",
]


class MixedPrecisionError(Exception):
    """A mistake in what the user gave us (a flag, a recipe, an environment variable, the hardware asked for)."""


class UsageError(MixedPrecisionError):
    """A wrong command-line flag or argument: printed as one line, exit status 2."""


class EnvValueError(MixedPrecisionError, ValueError):
    """An environment variable hf_mixedprec reads has a value it does not accept."""


class StorageRefusal(MixedPrecisionError):
    """A ``storage:`` choice that cannot be put into effect on this model, optimizer or checkpoint (the message says
    the fix)."""


class ModuleRuleError(MixedPrecisionError, ValueError):
    """A ``modules:`` rule that does not fit the model it is attached to (matches nothing, or lowers a module the
    model declares must stay in FP32); the message names the rule's dotted key and the closest module names."""


class HardwareRefusal(MixedPrecisionError, RuntimeError):
    """The recipe cannot run on this hardware; the message says why and what to use instead."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a recipe: where (file, dotted key) and what."""

    source: str
    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.source}: {self.key}: {self.message}" if self.key else f"{self.source}: {self.message}"


class RecipeError(MixedPrecisionError, ValueError):
    """A recipe could not be loaded; ``problems`` lists every problem found, one line each."""

    #: At most this many problems are kept (then one line says how many more), each cut to :data:`MAX_LINE`
    #: characters, so a huge or hostile file cannot flood the terminal.
    MAX_PROBLEMS = 20
    MAX_LINE = 300

    def __init__(self, problems: Iterable[Problem]):
        found = list(problems)
        kept = [
            p
            if len(str(p)) <= self.MAX_LINE
            else Problem(p.source, shorten(p.key, self.MAX_LINE // 3), shorten(p.message, self.MAX_LINE // 2))
            for p in found[: self.MAX_PROBLEMS]
        ]
        if len(found) > self.MAX_PROBLEMS:
            kept.append(Problem(found[0].source, "", f"... and {len(found) - self.MAX_PROBLEMS} more problems"))
        self.problems = kept
        super().__init__("\n".join(str(p) for p in self.problems))
