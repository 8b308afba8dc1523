"""Keep stdout for results: what libraries print while we work goes to stderr."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator


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
