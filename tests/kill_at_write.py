"""SIGKILL runs of ``hf-mixedprec finetune`` (or a Trainer script) at chosen moments of a checkpoint save, then
resume them (a test harness).

    python tests/kill_at_write.py jobs.json results.json

One interpreter imports torch, transformers and hf_mixedprec once and runs nothing; each step of each chain is then
a ``fork`` of it (a fresh process that pays no start-up: about 1.5 s per tiny run instead of 8). ``jobs.json``
holds chains, run two at a time (the machine has 2 cores), the steps of one chain one after the other::

    [[{"cmd": ["finetune", "--output-dir", "run", ...], "kill_in": "run/checkpoint-4", "at": 3, "log": "k3.log"},
      {"cmd": ["finetune", "--output-dir", "run", ..., "--resume", "latest"], "log": "k3.resume.log"}], ...]

A step with ``at: K`` is killed the moment the folder ``kill_in`` holds K entries, whoever writes them (Python,
safetensors' or tokenizers' own writers; a thread polls every 0.2 ms): the K-th file is then being written or just
done, and every later one is missing. On a loaded machine the polling thread can wait for the GIL while the save
goes on; it is then killed at the latest as the manifest is to be written, so the checkpoint is never complete. ``at: "manifest"`` kills it as the manifest is about to be written (every other
file is). ``at: 0`` kills nothing and writes the most entries the folder ever held into the file ``count``. A ``cmd`` whose first word
ends in ``.py`` is a training script run as ``__main__``; otherwise it is ``hf_mixedprec.cli.main``'s arguments.
``results.json`` gets, per chain, each step's exit status (``-9`` for a kill).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import hf_mixedprec.core.checkpoints as checkpoints
import hf_mixedprec.integrations.checkpointing as managed
from hf_mixedprec.cli.app import main as cli_main


def _import_everything() -> None:
    """What a run imports on its way (the package, Trainer, peft, the generation mixin, the plots' matplotlib), so
    that no child pays for it; nothing is computed, so a fork shares no thread pool."""
    import importlib
    import pkgutil

    import matplotlib

    import hf_mixedprec

    matplotlib.use("Agg")
    for mod in pkgutil.walk_packages(hf_mixedprec.__path__, "hf_mixedprec."):
        if not mod.name.startswith(("hf_mixedprec.fp8.transformer_engine",)):
            importlib.import_module(mod.name)
    for name in ("transformers.trainer", "transformers.generation.utils", "peft", "matplotlib.pyplot",
                 "transformers.models.llama.modeling_llama", "safetensors.torch"):  # fmt: skip
        importlib.import_module(name)
    import matplotlib.pyplot as plt

    plt.close(plt.figure())  # the font cache, loaded once (pure Python: no thread pool is started)


MANIFEST_MOMENT = "manifest"


def _child(step: dict) -> None:
    """One step, in a forked process: never returns. One torch thread: two runs share the 2 cores."""
    import torch

    torch.set_num_threads(1)
    log = os.open(step["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    at = step.get("at")
    folder = Path(step["kill_in"]) if "kill_in" in step else None
    most = 0
    if folder is not None and isinstance(at, int):

        def watch() -> None:
            nonlocal most
            while True:
                try:
                    n = len(os.listdir(folder))
                except OSError:
                    n = 0
                most = max(most, n)
                if at and n >= at:
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(0.0002)

        threading.Thread(target=watch, daemon=True).start()
        if at:  # a watcher starved of the GIL on a loaded machine must still kill before the checkpoint completes
            write_late = managed.write_manifest

            def kill_if_due(target):
                if Path(target).resolve() == folder.resolve() and len(os.listdir(folder)) >= at:
                    os.kill(os.getpid(), signal.SIGKILL)
                return write_late(target)

            managed.write_manifest = kill_if_due
            # the last entry a save makes is the manifest's temporary file (an atomic write), right before the run
            # ends: killed as it appears, in the writing thread, rather than by a watcher that may not run in time
            write_atomic = checkpoints.atomic_write

            def half_written_if_due(path, data):
                target = Path(path)
                if target.parent.resolve() == folder.resolve() and len(os.listdir(folder)) + 1 >= at:
                    target.with_name(target.name + ".tmp").write_bytes(data[: len(data) // 2])
                    os.kill(os.getpid(), signal.SIGKILL)
                return write_atomic(path, data)

            checkpoints.atomic_write = half_written_if_due
    if folder is not None and at == MANIFEST_MOMENT:
        write = managed.write_manifest

        def die_before(target):
            if Path(target).resolve() == folder.resolve():
                os.kill(os.getpid(), signal.SIGKILL)
            return write(target)

        managed.write_manifest = die_before
    code = 1
    try:
        cmd = step["cmd"]
        if cmd[0].endswith(".py"):
            import runpy

            sys.argv = list(cmd)
            runpy.run_path(cmd[0], run_name="__main__")
            code = 0
        else:
            code = cli_main(list(cmd))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        if at == 0 and "count" in step:
            Path(step["count"]).write_text(str(most))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run(chains: list[list[dict]], slots: int = 2) -> list[list[int]]:
    """Every chain's steps, ``slots`` chains at a time; each step's exit status (negative: killed by that signal)."""
    results: list[list[int]] = [[] for _ in chains]
    waiting = list(range(len(chains)))
    running: dict[int, int] = {}  # pid -> chain

    def start(c: int) -> None:
        step = chains[c][len(results[c])]
        pid = os.fork()
        if pid == 0:
            _child(step)
        running[pid] = c

    while waiting or running:
        while waiting and len(running) < slots:
            start(waiting.pop(0))
        pid, status = os.wait()
        c = running.pop(pid)
        results[c].append(os.waitstatus_to_exitcode(status))
        if len(results[c]) < len(chains[c]):
            start(c)
    return results


if __name__ == "__main__":
    _import_everything()
    jobs, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.write_text(json.dumps(run(json.loads(jobs.read_text()))))
