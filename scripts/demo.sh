#!/usr/bin/env bash
# Sets up .venv and trains the demo transformer, checkpointing every step through
# ram -> ./checkpoints/nvme -> ./checkpoints/pfs. Run it again and it resumes. Extra arguments go to the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/train_demo.py "$@"
