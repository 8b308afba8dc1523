"""Module names of earlier releases, before the package was arranged in folders by layer: ``import
hf_mixedprec.schema`` (or ``from hf_mixedprec import hardware``) still works and gives the module that now lives at
``hf_mixedprec.recipes.schema``, the same object, with one ``DeprecationWarning`` per old name that says where it went.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

__all__ = ["MOVED", "install"]

#: old name (relative to ``hf_mixedprec``) -> where the module lives now
MOVED: dict[str, str] = {
    "errors": "core.errors",
    "metrics": "core.metrics",
    "formats": "core.formats",
    "demo": "core.demo",
    "model_dir": "core.model_dir",
    "checkpoints": "core.checkpoints",
    "_text": "core._text",
    "_optional": "core._optional",
    "_device": "core._device",
    "_stdio": "core._stdio",
    "_launcher": "core._launcher",
    "_private": "core._private",
    "safe_yaml": "recipes.safe_yaml",
    "storage_config": "recipes.storage_config",
    "modules_config": "recipes.modules_config",
    "detectors": "recipes.detectors",
    "schema_sections": "recipes.sections",
    "schema_kinds": "recipes.kinds",
    "schema": "recipes.schema",
    "recipe_files": "recipes.files",
    "hardware": "recipes.hardware",
    "loader": "recipes.loader",
    "module_policy": "recipes.module_rules",
    "plan": "precision.plan",
    "plan_map": "precision.plan_map",
    "amp": "training.amp",
    "clipping": "training.clipping",
    "clipping_base": "training.clipping_base",
    "health": "training.health",
    "reactions": "training.reactions",
    "phases": "training.phases",
    "runtime": "training.runtime",
    "runtime_stats": "training.runtime_stats",
    "run_control": "training.run_control",
    "run_report": "training.run_report",
    "recipe": "integrations.recipe",
    "finetune": "commands.finetune",
    "finetune_summary": "commands.finetune_summary",
    "compare": "commands.compare",
    "compare_measure": "commands.compare_measure",
    "compare_report": "commands.compare_report",
    "estimate": "commands.estimate",
    "estimate_step": "commands.estimate_step",
    "simulate": "commands.simulate",
    "workload": "commands.workload",
    "cli_common": "cli.common",
    "cli_run": "cli.run_cmds",
    "cli_inspect": "cli.inspect_cmds",
}

_PREFIX = "hf_mixedprec."


def _caller_stacklevel() -> int:
    """The ``stacklevel`` of the user's import line for a warning raised in :meth:`_MovedNames.create_module`:
    ``warnings.warn`` does not count the import system's own frames, so only this module's are stepped over."""
    frame, level = sys._getframe(2), 1  # 2: create_module's caller, level 1: create_module itself
    while frame is not None and (frame.f_code.co_filename == __file__ or "importlib" in frame.f_code.co_filename):
        if "importlib" not in frame.f_code.co_filename:
            level += 1
        frame = frame.f_back
    return level + 1


class _MovedNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``hf_mixedprec.<old name>`` and loads it as the module it moved to."""

    def __init__(self) -> None:
        self.warned: set[str] = set()
        self._real: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(_PREFIX) or fullname[len(_PREFIX) :] not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = _PREFIX + MOVED[spec.name[len(_PREFIX) :]]
        if spec.name not in self.warned:
            self.warned.add(spec.name)
            warnings.warn(
                f"{spec.name} moved to {new}; import it from there (the old name is an alias that a later release "
                "drops)",
                DeprecationWarning,
                stacklevel=_caller_stacklevel(),
            )
        module = importlib.import_module(new)
        self._real[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system set the alias's spec on the module; it keeps its own
        module.__spec__ = self._real.pop(module.__spec__.name, module.__spec__)  # type: ignore[union-attr]


_FINDER = _MovedNames()


def install() -> None:
    """Answer the old names from now on in this process (idempotent)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)
