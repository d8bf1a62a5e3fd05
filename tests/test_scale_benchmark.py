"""benchmarks/scale.py on CPU, run as a user runs it: a real job of 2 ranks and one process, the
report complete and its numbers consistent (never a timing target)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

from tierckpt.testing.ranks import run_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "scale.py"


@pytest.mark.slow
def test_a_short_run_reports_the_commit_against_the_floor(tmp_path: Path) -> None:
    out = tmp_path / "results"
    command = [sys.executable, str(SCRIPT), "--ranks", "1", "2", "--saves", "3", "--kib", "16", "--timeout", "60", "--out", str(out)]
    done = run_script(command, cwd=ROOT, timeout_s=600)
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


@pytest.mark.slow
def test_the_phases_of_a_commit_come_in_the_protocols_order_on_every_save(tmp_path: Path) -> None:
    """--phases: each save's stamps on both ranks, in the order the protocol makes them happen (a rank's
    part is written before the leader has every report in, the version is committed before rank 1 adopts it)."""
    out = tmp_path / "results"
    command = [sys.executable, str(SCRIPT), "--ranks", "1", "2", "--saves", "3", "--kib", "16", "--timeout", "60", "--phases", "--out", str(out)]
    done = run_script(command, cwd=ROOT, timeout_s=600)
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    alone, two = json.loads((out / "scale.json").read_text())["rows"]
    assert [what for what, _ in alone["phases_by_rank"]["0"][0]] == ["save", "part write starts", "part written", "committed (renamed)", "handle resolved"]
    leader_order = ["save", "round published", "part write starts", "part written", "reports in", "marker sealed", "committed (renamed)",
                    "outcome set", "handle resolved"]
    # Rank 1 may read a round before its own save() begins (its training a little behind): "save" floats.
    follower_order = ["round read", "part write starts", "part written", "report set", "adopted", "handle resolved"]
    assert len(two["phases_by_rank"]["0"]) == len(two["phases_by_rank"]["1"]) == 3
    for leader, follower in zip(two["phases_by_rank"]["0"], two["phases_by_rank"]["1"]):
        at, fat = dict(leader), dict(follower)
        assert [what for what, _ in leader] == leader_order and [what for what, _ in follower if what != "save"] == follower_order
        assert [at[w] for w in leader_order] == sorted(at[w] for w in leader_order)
        assert [fat[w] for w in follower_order] == sorted(fat[w] for w in follower_order) and fat["save"] < fat["part write starts"]
        # Each stamp marks the end of a request, after the store's reply: the other rank may act on a
        # key before the rank that set it has the reply. What must come first is what a key waits for.
        assert at["save"] <= fat["round read"] and fat["part written"] <= at["reports in"]
        assert at["committed (renamed)"] <= fat["adopted"]
    assert "where a commit's time goes" in done.stdout
