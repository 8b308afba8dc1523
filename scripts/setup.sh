#!/usr/bin/env bash
# Create .venv and install hf_mixedprec with everything the tests and the main job need.
# torch is installed FIRST and pinned (default: the CPU build torch==2.13.0) so that the package's
# `torch>=2.4,<3` range is already satisfied and pip never pulls a multi-GB CUDA build.
# Override with HF_MIXEDPREC_TORCH="torch==X.Y.Z" (e.g. on a GPU machine) and HF_MIXEDPREC_EXTRAS.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${HF_MIXEDPREC_TORCH:-torch==2.13.0}
EXTRAS=${HF_MIXEDPREC_EXTRAS:-test}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
.venv/bin/python -m pip install -q --no-compile "$TORCH_SPEC"
# DeepSpeed builds no CUDA ops at install time (DS_BUILD_OPS=0): its ZeRO + fp16/bf16 paths run on CPU.
DS_BUILD_OPS=0 .venv/bin/python -m pip install -q --no-compile -e ".[$EXTRAS]"
# bytecode for everything installed, and this package, compiled on every core at once (pip compiles file by file:
# 95 s of setup became 67 s on 2 cores). A third-party file that does not compile (old test data, other Python
# versions' syntax) is skipped, as pip skips it; it is never imported.
SITE=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
.venv/bin/python -m compileall -q -j 0 "$SITE" hf_mixedprec > /dev/null 2>&1 || true
.venv/bin/python - <<'PYCHECK'
import torch, hf_mixedprec
print(f"hf_mixedprec {hf_mixedprec.__version__} ready (torch {torch.__version__}) in .venv")
PYCHECK
