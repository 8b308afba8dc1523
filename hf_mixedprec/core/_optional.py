"""Optional dependencies: import one where it is needed, or say which extra installs it."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

__all__ = ["available", "require"]


def available(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (``importlib.util.find_spec``)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module with no spec
        return False


def require(module: str, extra: str, needed_for: str) -> ModuleType:
    """Import ``module``; if it is missing, raise an ImportError naming ``pip install 'hf_mixedprec[extra]'``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        raise ImportError(
            f"{needed_for} needs {top}, which is not installed: pip install 'hf_mixedprec[{extra}]'"
        ) from exc
