"""benchmarks/scale.py on CPU, run as a user runs it: a real job of 2 ranks and one process, the
report complete and its numbers consistent (never a timing target)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "scale.py"


def test_a_short_run_reports_the_commit_against_the_floor(tmp_path: Path) -> None:
    out = tmp_path / "results"
    command = [sys.executable, str(SCRIPT), "--ranks", "1", "2", "--saves", "3", "--kib", "16", "--timeout", "60", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    report = json.loads((out / "scale.json").read_text())
    alone, two = report["rows"]
    assert (alone["ranks"], two["ranks"]) == (1, 2)
    assert alone["floor_ms"] is None and alone["commit_per_floor"] is None  # one process has no floor
    for row in (alone, two):
        assert len(row["commits_ms"]) == 3 and all(ms > 0 for ms in row["commits_ms"])
        assert row["commit_ms"] == pytest.approx(statistics.median(row["commits_ms"]))
    assert two["floor_ms"] > 0 and two["commit_per_floor"] == pytest.approx(two["commit_ms"] / two["floor_ms"])
    assert "| 2 |" in done.stdout
