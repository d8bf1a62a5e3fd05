"""benchmarks/replicated_restore.py on CPU, run as a user runs it: a real job of 2 ranks saves a
replicated value, new jobs restore it both ways; the report's byte counts say what each way read
(never a timing target)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tierckpt.testing.ranks import run_script
from tierckpt.testing.simrestore import simulate_restore

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "replicated_restore.py"


@pytest.mark.slow
def test_a_short_run_reads_the_replicated_value_once_between_the_ranks_against_once_a_rank(tmp_path: Path) -> None:
    out = tmp_path / "results"
    command = [sys.executable, str(SCRIPT), "--ranks", "2", "--mib", "8", "--repeats", "1", "--timeout", "60", "--out", str(out)]
    done = run_script(command, cwd=tmp_path, timeout_s=600)
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    (row,) = json.loads((out / "replicated_restore.json").read_text())["rows"]
    stored = row["stored_bytes"]
    assert 8 << 20 <= stored < (8 << 20) + (1 << 20)
    # Once between the two ranks: each chunk read by the rank that stored it. Every rank: twice.
    assert (8 << 20) <= row["once"]["read_bytes"] <= stored
    assert 2 * (8 << 20) <= row["every_rank"]["read_bytes"] <= 2 * stored
    assert row["once"]["restore_s"] > 0 and row["limit_s"] > 0
    assert "| 2 | 8 MiB | `once` |" in done.stdout
    # The simulated agreement (tierckpt.testing.simrestore) makes the real restore's exchanges, and
    # rank 0 sends what it does (one version held, on the second tier, and its lineage: 22 bytes).
    simulated = simulate_restore(2, steps=1)
    assert (row["once"]["exchanges"], row["once"]["exchange_sent"]) == (simulated.exchanges, simulated.sent) == (3, 22)
    assert row["every_rank"]["exchanges"] == 2  # nothing to say about reading replicated chunks
