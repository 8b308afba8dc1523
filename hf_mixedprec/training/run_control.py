"""What a long ``finetune`` run needs around Trainer: its output folder, checkpoints to resume, Ctrl-C, progress.

- The output folder of one run holds one run: a folder with another run's files is refused unless the user
  says ``--overwrite`` (then exactly those files are removed) or continues it with ``--resume``.
- ``--resume latest`` is the newest ``checkpoint-N`` of the output folder.
- SIGINT / SIGTERM during training ask Trainer to save a checkpoint at the end of the current step and stop
  (``control.should_save`` / ``should_training_stop``, as ``TrainerControl`` documents); a second signal stops
  at once, unless it is the same request (within :data:`DUPLICATE_S` of the first: a scheduler signals every
  process of a job and the launcher forwards the signal too; under a launcher always, which itself stops the job at
  once when asked again) or the checkpoint is being saved (then only a third one does). The handler stays installed
  through the stopped run's report (:func:`release_signals`), so that torch.distributed.run stopping the other
  ranks when one has ended cuts nothing short. Under several processes the request is agreed
  over the ranks at logging steps, where Trainer synchronises anyway, so every rank saves the same step.
- Progress lines carry the elapsed time, the ETA and tokens/s, so a slow run does not look like a hung one.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from hf_mixedprec.core import metrics as M
from hf_mixedprec.core._launcher import DUPLICATE_S  # the launcher's rule for a signal delivered twice
from hf_mixedprec.core._stdio import say_in_handler
from hf_mixedprec.core.checkpoints import newest_verified
from hf_mixedprec.core.errors import UsageError

__all__ = ["Interrupt", "Progress", "clear_previous_run", "latest_checkpoint", "previous_run_files", "release_signals"]

#: What a ``finetune`` run writes into its output folder (the model files too: ``save_pretrained`` and the
#: tokenizer's), matched by name; nothing else there is ever touched.
RUN_FILES = (
    "summary.json",
    "health.json",
    "conversion_report.json",
    "loss.png",
    "loss_scale.png",
    "grad_norm.png",
    "skipped_steps.png",
    "fp8_saturation.png",
    "model.safetensors",
    "config.json",
    "generation_config.json",
    "training_args.bin",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def _checkpoints(out: Path) -> list[tuple[int, Path]]:
    if not out.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out.iterdir() if p.is_dir() and (m := _CHECKPOINT.match(p.name))]
    return sorted(found)


def previous_run_files(out: Path) -> list[str]:
    """Names of another run's files in ``out`` (empty for a missing or fresh folder)."""
    if not out.is_dir():
        return []
    names = [name for name in RUN_FILES if (out / name).exists()]
    return names + [p.name for _, p in _checkpoints(out)]


def clear_previous_run(out: Path) -> list[str]:
    """Remove another run's files from ``out`` (``--overwrite``); returns what was removed."""
    removed = previous_run_files(out)
    for name in removed:
        target = out / name
        if target.is_dir():
            shutil.rmtree(target)
        else:
            target.unlink()
    return removed


def latest_checkpoint(out: Path, note: Callable[[str], None] | None = None) -> Path:
    """The newest complete ``checkpoint-N`` folder of a run (``--resume latest``): its manifest verifies
    (:mod:`hf_mixedprec.core.checkpoints`); ``note`` hears about each newer folder passed over, and why."""
    choice = newest_verified(out)
    if choice.path is not None:
        if choice.note() and note is not None:
            note(f"CHECKPOINT: {choice.note()}")
        return choice.path
    elif choice.skipped:
        raise UsageError(f"--resume: latest: {choice.note()} in {str(out)!r} (allowed: --overwrite to start afresh)")
    raise UsageError(
        f"--resume: latest: {str(out)!r} has no checkpoint-N folder (allowed: a checkpoint folder, or latest "
        "with the --output-dir of a run that saved checkpoints)"
    )


def check_not_dangling(flag: str, path: str | Path) -> None:
    """Refuse ``path`` when it is a symbolic link to nothing: every later ``mkdir`` of it fails ("File exists")."""
    p = Path(path)
    if p.is_symlink() and not p.exists():
        raise UsageError(
            f"{flag}: {str(path)!r} is a symbolic link to {os.readlink(p)!r}, which does not exist (allowed: create "
            "the folder it points to first, or give another folder)"
        )


def check_run_folder(out: Path, *, overwrite: bool, resume: str | None) -> None:
    """Refuse an output folder that holds another run (unless ``overwrite``, or ``resume`` continues it)."""
    found = previous_run_files(out)
    if not found or overwrite:
        return
    if resume is not None and (resume == "latest" or Path(resume).resolve().parent == out.resolve()):
        return
    shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    raise UsageError(
        f"--output-dir: {str(out)!r} already holds a run ({shown}) (allowed: a new or empty folder, --overwrite "
        "to replace that run's files, or --resume latest to continue it)"
    )


#: The interrupt handlers installed and not yet released (see :func:`release_signals`).
_INSTALLED: list[Interrupt] = []


def release_signals() -> None:
    """Give SIGINT/SIGTERM back to the handlers they had before every :class:`Interrupt` still installed (a run
    stopped by a signal keeps its handler through its report, so that a repeat does not cut it short)."""
    for interrupt in list(_INSTALLED):
        interrupt.uninstall()


class Interrupt(TrainerCallback):
    """SIGINT/SIGTERM -> save a checkpoint at the end of this step and stop; a second request stops at once (see the
    module docs for what is not a second request)."""

    def __init__(self, world_size: int = 1) -> None:
        self.world_size = world_size
        self.requested: str | None = None
        self.at_step: int | None = None
        self._previous: dict[int, Any] = {}
        self._first_at = 0.0
        self._later = 0  # signals after the duplicate window

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        _INSTALLED.append(self)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        if self in _INSTALLED:
            _INSTALLED.remove(self)

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        rank0 = os.environ.get("RANK", "0") == "0"  # every rank of a launch gets it: rank 0 says it
        if self.requested is None:
            self.requested, self._first_at = name, time.monotonic()
            if rank0:
                say_in_handler(
                    f"finetune: {name} received: saving a checkpoint at the end of this step, then stopping (send it "
                    f"again, after {DUPLICATE_S:g} s, to stop at once without a checkpoint)"
                )
            return
        # a rank of a launch (torch.distributed.run sets TORCHELASTIC_RUN_ID): the launcher, asked again, stops the
        # job at once itself (SIGKILL), so a repeat here is always the first signal delivered again
        launched = self.world_size > 1 or "TORCHELASTIC_RUN_ID" in os.environ
        if launched or time.monotonic() - self._first_at < DUPLICATE_S:
            return  # the first signal delivered again (by the scheduler and by the launcher)
        self._later += 1
        if self.at_step is not None and self._later == 1:
            if rank0:
                say_in_handler(
                    f"finetune: {name} received again: the checkpoint of step {self.at_step} is saved first, then "
                    "the run stops (send it once more to stop at once)"
                )
            return
        self.uninstall()  # a second request: stop now, without a checkpoint
        raise KeyboardInterrupt

    def _agreed(self, control: Any) -> bool:
        if self.world_size == 1:
            return self.requested is not None
        if not control.should_log:  # ranks agree where they synchronise anyway
            return False
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1.0 if self.requested is not None else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.at_step is None and self._agreed(control):
            self.at_step = state.global_step
            control.should_save = True
            control.should_training_stop = True


class Progress(TrainerCallback):
    """One line per logging step on stderr (stdout is left to the summary): step, loss, lr, grad norm, loss
    scale, skips, and the elapsed time, ETA and tokens/s."""

    def __init__(self, max_steps: int, tokens_per_step: int, *, bar: bool | None = None) -> None:
        self.max_steps, self.tokens_per_step = max_steps, tokens_per_step
        self.pending: dict[str, Any] = {}
        self.t0: float | None = None
        self.step0 = 0
        #: on a terminal, a bar redrawn in place every step between the log lines (a log file gets lines only)
        self.bar = sys.stderr.isatty() if bar is None else bar
        self._drawn = False

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if not self.bar or not state.is_world_process_zero:
            return
        done = state.global_step / max(self.max_steps, 1)
        filled = int(30 * done)
        line = f"[{'#' * filled}{'.' * (30 - filled)}] {state.global_step}/{self.max_steps}  {self._timing(state.global_step)}"
        print(f"\r{line}\x1b[K", end="", file=sys.stderr, flush=True)
        self._drawn = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self._drawn:
            print(file=sys.stderr, flush=True)
            self._drawn = False

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.t0, self.step0 = time.perf_counter(), state.global_step

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
        if not state.is_world_process_zero or not logs:
            return
        if "loss" not in logs:  # metrics that come as their own log entry, just before
            self.pending = {k: v for k, v in logs.items() if k.startswith(M.PREFIX)}
            return
        logs = {**self.pending, **logs}
        self.pending = {}
        parts = [f"step {state.global_step}/{self.max_steps}", f"loss {logs['loss']:.4f}"]
        if "learning_rate" in logs:
            parts.append(f"lr {logs['learning_rate']:.2e}")
        norm = logs.get(M.GRAD_NORM, logs.get("grad_norm"))
        if norm is not None:
            parts.append(f"grad_norm {norm:.3g}")
        if M.LOSS_SCALE in logs:
            parts.append(f"loss_scale {logs[M.LOSS_SCALE]:g}")
        if logs.get(M.SKIPPED_STEPS):
            parts.append(f"skipped {logs[M.SKIPPED_STEPS]:g}")
        parts.append(self._timing(state.global_step))
        prefix = "\r\x1b[K" if self._drawn else ""  # the log line replaces the bar; the next step redraws it
        self._drawn = False
        print(prefix + "finetune: " + "  ".join(parts), file=sys.stderr, flush=True)

    def _timing(self, step: int) -> str:
        elapsed = time.perf_counter() - (self.t0 or time.perf_counter())
        done = max(step - self.step0, 0)
        if done == 0 or elapsed <= 0:
            return f"elapsed {_clock(elapsed)}"
        per_step = elapsed / done
        eta = per_step * max(self.max_steps - step, 0)
        return f"elapsed {_clock(elapsed)}  eta {_clock(eta)}  {done * self.tokens_per_step / elapsed:,.0f} tok/s"


def _clock(seconds: float) -> str:
    s = round(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
