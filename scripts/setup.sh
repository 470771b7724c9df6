#!/usr/bin/env bash
# Create .venv and install lightning-sp into it, from scratch if needed.
# torch is installed first and pinned, so nothing that depends on it pulls CUDA wheels
# (on a CPU machine 2.13.0 resolves to the CPU wheel). Set PYTHON to choose the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
. .venv/bin/activate
pip install --quiet "torch==${TORCH_VERSION:-2.13.0}"
pip install --quiet -e ".[test]"
python -c "import torch, lightning, lightning_sp; print(f'torch {torch.__version__}, lightning {lightning.__version__}, lightning_sp ready')"
