#!/usr/bin/env bash
# The CUDA checks of tierckpt in one command, for a lent GPU machine (docs/gpus.md; ../shared/gpu/README.md).
#
# Here, once:  bash ../shared/gpu/prepare-wheels.sh       (the wheels the GPU image lacks, into .whl/)
# Then one device `run`, carry [".whl"], command:  bash scripts/gpu_check.sh [all|smoke|tests|capture|save_call|restore|correctness]
#
# all (the default): every part below, each under its own `timeout`, so that one hang cannot eat the
# budget; expected ~5.5 minutes on an H200 (16 cores, disk ~1.2 GB/s), at most ~7.8 (the timeouts, the
# wheels and the machine's description add up to that):
#   tests        ~45 s (timeout  80 s): pytest -m cuda on the test files with CUDA-marked tests that the GPU
#                                       image can import (the whole folder imports torchtitan and others);
#                                       ~105 s (timeout 150 s) with tests/test_huggingface.py's FSDP2 test, run
#                                       where transformers and accelerate import (docs/gpus.md: their wheels)
#   capture      ~100 s (timeout 140 s): benchmarks/gpu_capture.py --every 1 10: 2 GiB state, batch 64,
#                                       3 rounds (DCP: 1 round), --budget-s 115 stops starting rounds in time
#   save_call    ~20 s (timeout  60 s): benchmarks/save_call.py --device cuda: the save() call for a model and
#                                       AdamW of 600 tensors, and a launch-bound thread's step beside the copies
#   restore      ~100 s (timeout 120 s): benchmarks/gpu_restore.py --parts restore gds dcp: 2 GiB saved to the
#                                       project's disk, 2 repeats of (restore at once, restore 3 s later, read
#                                       limits) each in a new process, GPUDirect probe, DCP load; --budget-s 70
#                                       (on the H200 the 2 GiB restores took 54 s, and DCP's save + load did not
#                                       end within the 36 s a 90 s limit left it)
#   correctness  ~35 s (timeout  55 s): benchmarks/gpu_restore.py --parts correctness: 2 GiB GPT + AdamW, a
#                                       reference before save(), optimizer.step() right after, 4 bitwise restores
# smoke: every benchmark part at --quick sizes, and the tests collected (imported) but not run: < 100 s,
#   to shake out GPU-only bugs before the long run.
# tests, capture, save_call, restore, correctness: that part alone, at the sizes of `all`.
#
# $OUT (./gpu-out without one) gets at most 7 files: gpu-summary.md (the parts' Markdown, ready for
# benchmarks/RESULTS.md, rewritten after each part), gpu-check.log (the machine, then every part's output),
# gpu_capture.json, gpu_capture.png (where matplotlib is installed), gpu_save_call.json, gpu_restore.json,
# gpu_correctness.json (7 files: the device tool brings back 8 at most).
# While a part runs, its own files are in $OUT/parts/ (left there only if the run is cut short).
# The exit status is 1 if any part failed or timed out.
set -uo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"
case "$what" in
  all | smoke | tests | capture | save_call | restore | correctness) ;;
  *) echo "usage: $0 [all|smoke|tests|capture|save_call|restore|correctness]" >&2; exit 2 ;;
esac
out="${OUT:-$PWD/gpu-out}"
parts="$out/parts"
log="$out/gpu-check.log"
summary="$out/gpu-summary.md"
rm -rf "$parts"
rm -f "$out"/gpu_capture.json "$out"/gpu_capture.png "$out"/gpu_save_call.json "$out"/gpu_restore.json "$out"/gpu_correctness.json  # an earlier run's
mkdir -p "$out" "$parts"
: > "$log"
# The restore measures the disk under the project (the machine's own disk), not /tmp (a tmpfs on some images).
work=$(mktemp -d "$PWD/.gpu-work.XXXXXX")
trap 'rm -rf "$work"' EXIT
export PYTHONPATH="$PWD"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$HOME/site" .whl/*.whl >> "$log" 2>&1
  export PYTHONPATH="$HOME/site:$PWD"
fi
# The files with CUDA-marked tests that import only what the GPU image has (a note in the log names any other).
cuda_tests=(tests/test_cuda.py tests/test_checkpointer.py)
tests_limit=80
# The Hugging Face Trainer under FSDP2 on the GPU, where transformers and accelerate import (carried as
# wheels: docs/gpus.md); two Trainer runs, ~60 s more.
if python3 -c "import transformers, accelerate" > /dev/null 2>&1; then
  cuda_tests+=(tests/test_huggingface.py)
  tests_limit=150
fi
# Lightning's FSDPStrategy (FSDP1) itself, where lightning imports (carried as wheels: docs/gpus.md; not by
# default, so `all` keeps to 8 minutes): two 1-rank-per-GPU Trainer runs, ~30 s more.
if python3 -c "import lightning" > /dev/null 2>&1; then
  cuda_tests+=(tests/test_lightning.py)
  tests_limit=$((tests_limit + 40))
fi

machine=$(
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1
  python3 -c "import sys, torch; print('Python', sys.version.split()[0], '| torch', torch.__version__, '| CUDA', torch.version.cuda, '| available:', torch.cuda.is_available())" 2>&1 | tail -1
  echo "$(nproc) cores | $(free -g | awk '/^Mem:/ {print $2 " GiB RAM"}') | uid $(id -u)"
  python3 -c "import matplotlib; print('matplotlib', matplotlib.__version__)" 2> /dev/null || echo "no matplotlib: no PNG"
)
{
  echo "== $what, $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "$machine"
  df -hT "$work" /dev/shm 2>&1
  for f in $(grep -l "mark.cuda" tests/test_*.py); do
    case " ${cuda_tests[*]} " in *" $f "*) ;; *) echo "note: $f has CUDA-marked tests but is not run here (it may import what the GPU image lacks)" ;; esac
  done
} >> "$log" 2>&1

status=0
rows=()
tests_line=""
tests_failed=""

write_summary() {
  {
    echo "## GPU check: \`scripts/gpu_check.sh $what\` ($(date -u '+%Y-%m-%d %H:%M UTC'))"
    echo
    echo "$machine" | sed 's/^/    /'
    echo
    echo "| part | exit | seconds | limit |"
    echo "| --- | ---: | ---: | ---: |"
    [ "${#rows[@]}" -gt 0 ] && printf '%s\n' "${rows[@]}"
    echo
    echo "Wall time so far: $SECONDS s."
    echo
    [ -n "$tests_line" ] && printf 'CUDA tests (%s): %s\n\n' "${cuda_tests[*]}" "$tests_line"
    [ -n "$tests_failed" ] && printf '%s\n\n' "$tests_failed"
    for name in gpu_capture gpu_save_call gpu_restore gpu_correctness; do
      [ -f "$parts/$name.md" ] && { cat "$parts/$name.md"; echo; }
    done
  } > "$summary"
}

# part NAME LIMIT COMMAND...: COMMAND under `timeout` (the whole process group: children too), its output
# appended to the log; a failure or a timeout fails the run. The part's JSON and PNG go up to $OUT either way.
part() {
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS rc
  echo "== $name: $* (timeout ${limit} s)" >> "$log"
  timeout -k 10 "$limit" "$@" >> "$log" 2>&1
  rc=$?
  local took=$((SECONDS - t0)) verdict=""
  case "$rc" in 0) ;; 124 | 137) verdict=" (timed out)"; status=1 ;; *) status=1 ;; esac
  echo "== $name: exit $rc$verdict after $took s" >> "$log"
  echo "$name: exit $rc$verdict after $took s"
  rows+=("| $name | $rc$verdict | $took | $limit |")
  cp -f "$parts"/*.json "$parts"/*.png "$out"/ 2> /dev/null
  write_summary
}

run_tests() {
  if [ "$what" = smoke ]; then
    part tests 60 python3 -m pytest -q -p no:cacheprovider -m cuda --collect-only "${cuda_tests[@]}"
  else
    part tests "$tests_limit" python3 -m pytest -q -p no:cacheprovider -rfE -m cuda "${cuda_tests[@]}"
  fi
  tests_line=$(awk '/^== tests: exit/ {print buf; exit} /^== tests: / {keep=1; next} keep && /(passed|failed|error|skipped|collected|no tests ran)/ {buf=$0}' "$log")
  tests_line="${tests_line//=/}"
  tests_line="${tests_line# }"
  tests_failed=$(sed -n '/^== tests: /,/^== tests: exit/p' "$log" | grep -E '^(FAILED|ERROR) ' | sed 's/^/- /')
  write_summary
}

run_capture() {
  if [ "$what" = smoke ]; then
    part capture 60 python3 benchmarks/gpu_capture.py --device cuda --quick --every 1 10 --dir "$work" --out "$parts" --name gpu_capture
  else
    part capture 140 python3 benchmarks/gpu_capture.py --device cuda --every 1 10 --repeats 3 --budget-s 115 --dir "$work" --out "$parts" --name gpu_capture
  fi
}

run_save_call() {
  local saves=60
  [ "$what" = smoke ] && saves=5
  part save_call 60 python3 benchmarks/save_call.py --device cuda --saves "$saves" --out "$parts" --name gpu_save_call
}

run_restore() {
  if [ "$what" = smoke ]; then
    part restore 60 python3 benchmarks/gpu_restore.py --device cuda --quick --parts restore gds dcp --dir "$work" --out "$parts" --name gpu_restore
  else
    part restore 120 python3 benchmarks/gpu_restore.py --device cuda --budget-s 70 --parts restore gds dcp --dir "$work" --out "$parts" --name gpu_restore
  fi
}

run_correctness() {
  if [ "$what" = smoke ]; then
    part correctness 40 python3 benchmarks/gpu_restore.py --device cuda --quick --parts correctness --dir "$work" --out "$parts" --name gpu_correctness
  else
    part correctness 55 python3 benchmarks/gpu_restore.py --device cuda --parts correctness --dir "$work" --out "$parts" --name gpu_correctness
  fi
}

if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)" >> "$log" 2>&1; then
  echo "CUDA is not available to python3 here ($(command -v python3); see $log): nothing to check. The CPU paths run in CI: pytest, and the benchmarks' --device cpu --quick." | tee -a "$log"
  rows+=("| (none) | CUDA unavailable | 0 | |")
  write_summary
  rm -rf "$parts"
  exit 1
fi

case "$what" in
  all | smoke) run_tests; run_capture; run_save_call; run_restore; run_correctness ;;
  tests) run_tests ;;
  capture) run_capture ;;
  save_call) run_save_call ;;
  restore) run_restore ;;
  correctness) run_correctness ;;
esac
rm -rf "$parts"
echo
cat "$summary"
echo "total: $SECONDS s; files in $out: $(ls "$out" | tr '\n' ' ')"
exit "$status"
