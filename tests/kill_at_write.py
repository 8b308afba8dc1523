"""Run ``hf-mixedprec finetune`` and SIGKILL it as the K-th file appears in one checkpoint folder (a test harness).

    KILL_IN=run/checkpoint-4 KILL_AT_WRITE=3 python tests/kill_at_write.py finetune --output-dir run ...
    KILL_IN=run/checkpoint-4 KILL_AT_WRITE=3 python tests/kill_at_write.py scripts/finetune_trainer.py ...

A thread watches the folder ``KILL_IN`` (polling every 0.2 ms) and kills the process the moment the folder holds K
entries, whoever writes them (Python, safetensors' or tokenizers' own writers): the K-th file is then being written
or just done, and every later one is missing. ``KILL_AT_NAME=manifest`` kills instead the moment the manifest is to be
written (every other file is). ``KILL_AT_WRITE=0`` alone kills nothing and writes the most entries the folder ever
held into the file ``KILL_COUNT``.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
from pathlib import Path

AT = int(os.environ.get("KILL_AT_WRITE", "0"))
#: or ``manifest``: kill as the manifest is about to be written, every other file of the checkpoint written
BEFORE_MANIFEST = os.environ.get("KILL_AT_NAME", "") == "manifest"
FOLDER = Path(os.environ["KILL_IN"])
most = 0


def _watch() -> None:
    global most
    while True:
        try:
            names = os.listdir(FOLDER)
        except OSError:
            names = []
        most = max(most, len(names))
        if AT and len(names) >= AT:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.0002)


threading.Thread(target=_watch, daemon=True).start()
if BEFORE_MANIFEST:
    import hf_mixedprec.integrations.checkpointing as managed

    def _die(folder):
        if Path(folder).resolve() == FOLDER.resolve():
            os.kill(os.getpid(), signal.SIGKILL)
        return write(folder)

    write, managed.write_manifest = managed.write_manifest, _die
elif AT == 0:
    atexit.register(lambda: Path(os.environ["KILL_COUNT"]).write_text(str(most)))

if sys.argv[1].endswith(".py"):  # a training script (a plain Trainer with the recipe's callbacks)
    import runpy

    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
else:
    from hf_mixedprec.cli import main

    sys.exit(main(sys.argv[1:]))
