"""``python -m hf_mixedprec.cli ...``: the ``hf-mixedprec`` command."""

import sys

from hf_mixedprec.cli.app import main

if __name__ == "__main__":
    sys.exit(main())
