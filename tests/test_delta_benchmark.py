"""benchmarks/delta.py --quick on CPU, run as a user runs it: it exits 0, prints its tables, and what it
encoded in memory equals what the tiers stored (never a size or timing target)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tierckpt.testing.ranks import run_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "delta.py"


@pytest.mark.slow
def test_a_quick_run_prints_its_tables_and_matches_the_tiers(tmp_path: Path) -> None:
    results = sorted((ROOT / "benchmarks" / "results").glob("delta-*"))
    command = [sys.executable, str(SCRIPT), "--quick", "--dir", str(tmp_path)]
    done = run_script(command, cwd=ROOT)
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    for heading in ("| state | k | versions: whole + delta", "| state | k | saves | N = 10, against the last whole", "| goal (issue) | measured | verdict |"):
        assert heading in done.stdout
    report = json.loads((tmp_path / "delta.json").read_text())
    assert set(report["runs"]) == {f"{s} k={k}" for s in ("fp32", "bf16", "fine-tune") for k in (1, 10, 100)}
    for name, run in report["runs"].items():
        tier = {t: sum(g["stored"] for g in run[t].values()) for t in ("alone", "delta")}
        implemented = next(s for s in run["memory"]["schemes"] if (s["n"], s["against"], s["smaller"]) == (10, "whole", False))
        assert (run["memory"]["whole"], implemented["stored"]) == (tier["alone"], tier["delta"]), name
        assert [chain for _, _, chain in run["schedule"]][:11] == [0, *range(1, 10), 0][: len(run["schedule"])], name
    assert report["runs"]["fine-tune k=1"]["delta"]["frozen parameters"]["stored"] < report["runs"]["fine-tune k=1"]["alone"]["frozen parameters"]["stored"]
    assert sorted((ROOT / "benchmarks" / "results").glob("delta-*")) == results  # --quick writes under --dir only
