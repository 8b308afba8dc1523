#!/usr/bin/env bash
# The README's main-job command: set up from nothing, then show this machine and the recipe it gets.
set -euo pipefail
cd "$(dirname "$0")/.."
HF_MIXEDPREC_EXTRAS=${HF_MIXEDPREC_EXTRAS:-all} bash scripts/setup.sh
.venv/bin/hf-mixedprec detect
.venv/bin/hf-mixedprec show auto
