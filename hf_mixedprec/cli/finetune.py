"""The script ``hf-mixedprec launch`` runs on every rank for ``finetune``: ``hf-mixedprec launch --recipe R
hf_mixedprec/cli/finetune.py ARGS`` (run there as ``-m hf_mixedprec.cli.finetune``), the same as
``hf-mixedprec finetune ARGS`` in each process. Its own module, so that no module of the commands imports the CLI back.
"""

from __future__ import annotations

import logging
import os
import sys

from hf_mixedprec.cli.app import main


def run(argv: list[str] | None = None) -> int:
    """``hf-mixedprec finetune`` with ``argv`` (default: this process's arguments)."""
    return main(["finetune", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    code = run()
    if "LOCAL_RANK" in os.environ:
        # A rank of a launched run, its work written and its process group closed: end here. Interpreter teardown
        # can abort the process afterwards (a native thread of the communication libraries still joinable:
        # "terminate called without an active exception"), which the launcher would report as a failed rank.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
