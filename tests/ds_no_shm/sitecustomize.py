"""Loaded at start-up by every Python process whose ``PYTHONPATH`` holds this folder (the suite's DeepSpeed launches
put it there): DeepSpeed's CPU accelerator then offers no shared-memory all-reduce op, as
``tests.deepspeed_cpu.install_deepspeed_cpu_accelerator`` does in-process.

Why: DeepSpeed's ``TorchBackend`` JIT-compiles that op (``ShareMemCommBuilder``) in the first DeepSpeed process on a
machine, about 50 s of C++ on a 2-core CI machine, cached in ``~/.cache/torch_extensions`` afterwards, so a fresh
clone's suite paid it once in whichever launch test came first. Without the op DeepSpeed reduces through
torch.distributed (gloo), as it does where the op cannot be built. Nothing is imported until DeepSpeed itself imports
its CPU accelerator: the launcher processes stay as they are. A ``sitecustomize`` further down ``sys.path`` (a
distribution's, a coverage hook's), which this one shadows, is run afterwards.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from typing import Any

_TARGET = "deepspeed.accelerator.cpu_accelerator"
_HERE = os.path.dirname(os.path.abspath(__file__))


class _HideShmComm(importlib.abc.MetaPathFinder):
    """Finds nothing itself; the first time DeepSpeed's CPU accelerator module is loaded, patches it once it has
    run (later lookups pass through: it is not taken off ``sys.meta_path`` while the import system walks it)."""

    done = False

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != _TARGET or self.done:
            return None
        self.done = True
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader

        class _Patching(importlib.abc.Loader):  # this module's own loader: a shared one is left as it is
            def __getattr__(self, attr: str) -> Any:  # get_source, resource readers, ...: the real loader's
                return getattr(loader, attr)

            def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)
                builder = module.CPU_Accelerator.get_op_builder

                def get_op_builder(self: Any, class_name: str) -> Any:
                    return None if class_name == "ShareMemCommBuilder" else builder(self, class_name)

                module.CPU_Accelerator.get_op_builder = get_op_builder

        spec.loader = _Patching()
        return spec


sys.meta_path.insert(0, _HideShmComm())

_others = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
_next = importlib.machinery.PathFinder.find_spec("sitecustomize", _others)
if _next is not None and _next.loader is not None:
    _module = importlib.util.module_from_spec(_next)
    _next.loader.exec_module(_module)
