#!/usr/bin/env bash
# The CUDA checks of the capture stage in one command, for a lent GPU machine (README, "GPUs").
#
# Here, once:  bash ../shared/gpu/prepare-wheels.sh       (the wheels the GPU image lacks, into .whl/)
# Then one device `run`, carry [".whl"], command:  bash scripts/gpu_check.sh [tests|bench|all]
# Logs and results land in $OUT (./gpu-out without one): gpu.txt, cuda-tests.log, gpu-capture.log and
# the benchmark's gpu_capture-*.json/.md, to paste into benchmarks/RESULTS.md and the issue note.
set -uo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"
out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$HOME/site" .whl/*.whl
  export PYTHONPATH="$HOME/site:$PWD"
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(0))"
  nproc; free -g | head -2
} > "$out/gpu.txt" 2>&1
status=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout 180 python3 -m pytest -q -p no:cacheprovider -m cuda tests > "$out/cuda-tests.log" 2>&1
  rc=$?; echo "rc=$rc" >> "$out/cuda-tests.log"; [ "$rc" = 0 ] || status=1
  tail -5 "$out/cuda-tests.log"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout 380 python3 benchmarks/gpu_capture.py --device cuda --out "$out" > "$out/gpu-capture.log" 2>&1
  rc=$?; echo "rc=$rc" >> "$out/gpu-capture.log"; [ "$rc" = 0 ] || status=1
  tail -25 "$out/gpu-capture.log"
fi
exit "$status"
