"""Keep stdout for results: what libraries print while we work goes to stderr."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator


def say_in_handler(text: str) -> None:
    """One line on stderr from a signal handler: a single ``write`` that never raises (a closed pipe, or a write the
    signal interrupted, where ``print`` would raise a reentrant-call error)."""
    with contextlib.suppress(OSError):
        os.write(2, (text + "\n").encode())


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send everything printed inside the block to stderr, at the Python and the file-descriptor level
    (DeepSpeed's import banner, Trainer's log lines), so that stdout holds only what is printed after it
    (a table, or JSON that scripts parse)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


class _DropMessages(logging.Filter):
    def __init__(self, *fragments: str) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(f in text for f in self.fragments)


#: Third-party messages every CPU run printed that say nothing about the user's run (checked 2026-11-24 with
#: torch 2.13, torchao 0.18, DeepSpeed 0.19.8): torchao's optional CUDA kernels that cannot load on CPU, the
#: torch.compile deprecation notes torchao's enums trigger in ``torch.utils._pytree``, and DeepSpeed's
#: "Setting accelerator to CPU" when there is no GPU.
_NOISE = {
    "torchao": ("Failed to load", "Detected no triton"),
    "torchao.kernel.intmm": ("Detected no triton",),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported",),
    "DeepSpeed": ("Setting accelerator to CPU",),
    # checkpoint rotation (save_total_limit) on filesystems with coarse mtimes: it then orders by step number
    "transformers.trainer_utils": ("mtime may not be reliable",),
}


def quiet_known_noise() -> None:
    """Drop the known third-party messages above (only those; everything else those loggers say still shows).
    ``import hf_mixedprec`` calls it (the command line too); idempotent."""
    for name, fragments in _NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(*fragments))


def quiet_progress_bars() -> None:
    """transformers' "Writing model shards" bar at every checkpoint: a training run has its own progress lines."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
