#!/usr/bin/env bash
# Creates .venv (or reuses it) with torch and tierckpt installed editable.
#   bash scripts/setup.sh        tierckpt with its test extras (what scripts/test.sh needs)
#   bash scripts/setup.sh demo   tierckpt alone (what scripts/demo.sh needs)
# A second run with the same pyproject.toml and mode does nothing (a stamp in .venv says so).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mode=${1:-test}
case "$mode" in
    test) target=".[test]" ;;
    demo) target="." ;;
    *) echo "usage: bash scripts/setup.sh [test|demo]" >&2; exit 2 ;;
esac
say() { echo "setup: $*" >&2; }
stamp=".venv/.tierckpt-setup-$mode"
fingerprint=$(cat pyproject.toml scripts/setup.sh | cksum)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$fingerprint" ] && .venv/bin/python -c "import importlib.metadata as m; m.version('tierckpt')" 2>/dev/null; then
    exit 0
fi
if [ ! -x .venv/bin/python ]; then
    say "creating .venv with $("$PY" --version 2>&1)"
    "$PY" -m venv .venv
fi
# torch first, so that tierckpt's own `torch>=2.4` is already met. TIERCKPT_TORCH_VERSION pins it
# (2.13.0 by default). Which build `torch==2.13.0` gives depends on the package index pip uses:
# PyPI's Linux wheel is the CUDA build (several GB with its nvidia-* wheels); PyTorch's CPU index
# gives the CPU build: TIERCKPT_TORCH_INDEX=https://download.pytorch.org/whl/cpu. (This
# repository's CI machine resolves it to a CPU wheel through its own pip configuration.) numpy comes
# in the same step: torch imported without it warns "Failed to initialize NumPy".
if ! .venv/bin/python -c "import importlib.metadata as m; m.version('torch')" 2>/dev/null; then
    torch_spec="torch==${TIERCKPT_TORCH_VERSION:-2.13.0}"
    say "installing $torch_spec${TIERCKPT_TORCH_INDEX:+ from $TIERCKPT_TORCH_INDEX} and numpy (the largest download: a few hundred MB for the CPU build, more for CUDA)"
    .venv/bin/pip install --progress-bar on ${TIERCKPT_TORCH_INDEX:+--index-url "$TIERCKPT_TORCH_INDEX"} "$torch_spec" numpy 2>&1 \
        | grep -v "^Requirement already satisfied" >&2 || true
    .venv/bin/python -c "import importlib.metadata as m; m.version('torch')" >/dev/null
fi
# The extras (lightning, ...) depend on torch too: the installed build is a constraint, so that no
# resolver step swaps it for another one. Read from the package metadata: importing torch is slow.
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
.venv/bin/python -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" > "$constraints"
if [ "$mode" = test ]; then
    say "installing tierckpt editable with its test extras (Lightning, transformers, torchtitan, SeaweedFS, mkdocs, mypy...): a few minutes the first time"
else
    say "installing tierckpt editable (msgpack, PyYAML, zstandard, xxhash, aiofiles, uvloop)"
fi
.venv/bin/pip install -q -c "$constraints" -e "$target"
echo "$fingerprint" > "$stamp"
say "done ($(.venv/bin/python -c "import importlib.metadata as m; print('torch', m.version('torch'), '/ tierckpt', m.version('tierckpt'))"))"
