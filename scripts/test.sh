#!/usr/bin/env bash
# Sets up .venv, type-checks the package (mypy, configured in pyproject.toml), and runs the test
# suite. Extra arguments go to pytest. The whole suite takes about 15 minutes of pytest on 2 cores; the
# quick subset (about 3 minutes) leaves out the tests marked slow (docs/contributing.md: measured times):
#   bash scripts/test.sh -m "not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
echo "test: mypy, then pytest ${*:-(the whole suite: about 15 minutes on 2 cores; -m \"not slow\" for the 3-minute subset)}" >&2
.venv/bin/python -m mypy
set +e
# TIERCKPT_TEST_WORKERS=N runs the suite on N pytest-xdist workers, each taking a whole test file at
# a time (a file's module fixtures run once). The default, 0, runs it in this one process: -n 2 was
# about a third faster on 2 cores, but exposed a hang that is open (docs/contributing.md).
.venv/bin/python -m pytest -q -n "${TIERCKPT_TEST_WORKERS:-0}" --dist loadfile "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: that is a failure here" >&2
    exit 1
fi
exit "$rc"
