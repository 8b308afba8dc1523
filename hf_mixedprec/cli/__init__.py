"""The ``hf-mixedprec`` command: the parser and small commands (``app``), what the command modules share
(``common``), the commands that train (``run_cmds``: launch, finetune, compare) and those that inspect
(``inspect_cmds``: simulate, estimate, plan, report), and the script ``launch`` runs on every rank for ``finetune``
(``finetune``).

May import: every folder (the top layer).
"""

from hf_mixedprec.cli.app import main

__all__ = ["main"]
