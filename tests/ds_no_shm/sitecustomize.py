"""Loaded at start-up by every Python process whose ``PYTHONPATH`` holds this folder (the suite's DeepSpeed launches
put it there): DeepSpeed's CPU accelerator then offers no shared-memory all-reduce op, as
``tests.deepspeed_cpu.install_deepspeed_cpu_accelerator`` does in-process.

Why: DeepSpeed's ``TorchBackend`` JIT-compiles that op (``ShareMemCommBuilder``) in the first DeepSpeed process on a
machine, about 50 s of C++ on a 2-core CI machine, cached in ``~/.cache/torch_extensions`` afterwards, so a fresh
clone's suite paid it once in whichever launch test came first. Without the op DeepSpeed reduces through
torch.distributed (gloo), as it does where the op cannot be built. Nothing is imported until DeepSpeed itself imports
its CPU accelerator: the launcher processes stay as they are.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any

_TARGET = "deepspeed.accelerator.cpu_accelerator"


class _HideShmComm(importlib.abc.MetaPathFinder):
    """Finds nothing itself; when DeepSpeed's CPU accelerator module is loaded, patches it once it has run."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            builder = module.CPU_Accelerator.get_op_builder

            def get_op_builder(self: Any, class_name: str) -> Any:
                return None if class_name == "ShareMemCommBuilder" else builder(self, class_name)

            module.CPU_Accelerator.get_op_builder = get_op_builder

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _HideShmComm())
