"""``python -m hf_mixedprec ...``: the ``hf-mixedprec`` command, for environments without the console script."""

import sys

from hf_mixedprec.cli.app import main

if __name__ == "__main__":
    sys.exit(main())
