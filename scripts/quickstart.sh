#!/usr/bin/env bash
# The README's main-job command: set up from nothing, then fine-tune the embedded default (a small Llama
# built from a config, a tokenizer trained on the spot on prose from Python's docstrings; nothing is
# downloaded) with the recipe `auto` picks for this machine, and print the run's health report.
# Extra arguments go to `hf-mixedprec finetune` (e.g. --recipe v100-fp16 --rehearse --max-steps 50).
set -euo pipefail
cd "$(dirname "$0")/.."
HF_MIXEDPREC_EXTRAS=${HF_MIXEDPREC_EXTRAS:-all} bash scripts/setup.sh
# the report reads the folder the run trained into: --output-dir when given, else runs/quickstart, which a
# re-run of this demo replaces (--overwrite); a folder you name is never overwritten unless you say so
OUT=""
prev=""
for arg in "$@"; do
  case "$arg" in
    --output-dir=*) OUT="${arg#--output-dir=}" ;;
  esac
  if [ "$prev" = "--output-dir" ]; then OUT="$arg"; fi
  prev="$arg"
done
.venv/bin/hf-mixedprec detect
if [ -z "$OUT" ]; then
  OUT=${HF_MIXEDPREC_OUT:-runs/quickstart}
  .venv/bin/hf-mixedprec finetune --output-dir "$OUT" --overwrite "$@"
else
  .venv/bin/hf-mixedprec finetune "$@"
fi
.venv/bin/hf-mixedprec report "$OUT"
