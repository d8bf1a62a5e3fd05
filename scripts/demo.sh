#!/usr/bin/env bash
# Sets up .venv (torch and tierckpt alone, no test extras) and trains the demo transformer,
# checkpointing every step through ram -> ./checkpoints/nvme -> ./checkpoints/pfs. Stopped (Ctrl-C,
# a kill), it resumes when run again; after it finished, `--steps N` trains on to step N. Extra
# arguments go to the demo (`bash scripts/demo.sh --help`, which also lists its exit statuses).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo
exec .venv/bin/python examples/train_demo.py "$@"
