#!/usr/bin/env bash
# Creates .venv with a CPU build of torch (or reuses it) and installs tierckpt with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
# torch first, pinned to the CPU build: tierckpt's own `torch>=2.4` is then already satisfied and pip
# does not go fetching a multi-GB CUDA build on a machine without a GPU.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/pip install -q "torch==${TIERCKPT_TORCH_VERSION:-2.13.0}"
fi
# The extras (lightning, ...) depend on torch too: the installed build is a constraint, so that no
# resolver step swaps it for another one.
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
.venv/bin/python -c "import torch; print('torch==' + torch.__version__)" > "$constraints"
.venv/bin/pip install -q -c "$constraints" -e ".[test]"
