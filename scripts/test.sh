#!/usr/bin/env bash
# The README's test command: set up from nothing, lint, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# the suite starts hundreds of Python processes, each importing hf_mixedprec (an editable install pip never
# byte-compiles) and the tests: let them cache their bytecode (some machines set PYTHONDONTWRITEBYTECODE)
unset PYTHONDONTWRITEBYTECODE
# two workers, each file's tests in one of them (its module fixtures run once): the suite's many subprocess and
# 2-rank tests wait on process start-up and gloo, so two at a time keep the 2 cores busy (11 min instead of 16);
# files in tests/conftest.py's order, the longest first, so that no long file ends the run with one worker idle
.venv/bin/python -m pytest -q -n "${HF_MIXEDPREC_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
