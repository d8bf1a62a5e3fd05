"""The simulated commit protocol (tierckpt.testing.simranks) against a real job of 4 ranks: the
requests whose number the protocol fixes must be the same in both, so that the simulation cannot
drift from the code that it drives; and what it says about growth."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from tierckpt.testing.ranks import run_script
from tierckpt.testing.simranks import leader_seconds, simulate_saves

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "scale.py"
# The requests a save makes a fixed number of times: the round that decides it, every report, the
# outcome, written once each and read once by each rank that needs them (each read answered when its
# key is set: no look before). A follower's read of the next round is counted when it is made, which
# may come just before or just after a rank's tally is taken at a commit: within one read a follower
# over the job's saves.
FIXED = ("compare_set tier/*/round/#", "set tier/*/report/#/#", "set tier/*/outcome/#", "multi_get tier/*/report/#/#",
         "get tier/*/outcome/#")
SAVES = 4


def family(key: str) -> str:
    return re.sub(r"tier/[^/]+/", "tier/*/", key)


@pytest.mark.slow
def test_a_real_job_of_4_ranks_makes_the_requests_the_simulation_counts(tmp_path: Path) -> None:
    command = [sys.executable, str(SCRIPT), "--ranks", "4", "--saves", str(SAVES), "--kib", "16", "--timeout", "60",
               "--simulate", "4", "--sim-saves", "3", "--out", str(tmp_path)]
    done = run_script(command, cwd=ROOT, timeout_s=600)
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    report = json.loads((tmp_path / "scale.json").read_text())
    real = {family(k): v for k, v in report["rows"][0]["requests_per_save"].items()}
    simulated = {family(k): v for k, v in report["simulated"][0]["by_key"].items()}
    assert {k: real.get(k) for k in FIXED} == {k: simulated.get(k) for k in FIXED}
    assert simulated["get tier/*/round/#"] == 3 and abs(real["get tier/*/round/#"] - 3) <= 3 / SAVES
    assert simulated["set tier/*/report/#/#"] == 3 and simulated["multi_get tier/*/report/#/#"] == 1
    # Nothing else appears in one and not the other (a new kind of request must be simulated too).
    assert set(real) == set(simulated), (sorted(real), sorted(simulated))
    assert sum(simulated.values()) == 3 * 4  # 3 requests a rank: the leader's round, reports, outcome; a follower's reads and report
    assert "| 4 |" in done.stdout and "Fitted: requests" in done.stdout


@pytest.mark.slow
def test_a_real_job_of_4_ranks_on_2_relaying_nodes_makes_the_requests_the_simulation_counts(tmp_path: Path) -> None:
    """The same with node relays (distributed.relay: nodes, 2 ranks a node): the leader's store and
    the node's store, each request family of each. A request recorded when it is answered (a read
    that a commit ends, the head's forwarding of an outcome) may fall on either side of a tally taken
    at that commit: within one request of each rank over the job's saves."""
    command = [sys.executable, str(SCRIPT), "--ranks", "4", "--saves", str(SAVES), "--kib", "16", "--timeout", "60",
               "--simulate", "4", "--sim-saves", "3", "--per-node", "2", "--out", str(tmp_path)]
    done = run_script(command, cwd=ROOT, timeout_s=600)
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    report = json.loads((tmp_path / "scale.json").read_text())
    row, sim = report["rows"][0], report["simulated"][0]
    for real_key, sim_key in (("requests_per_save", "by_key"), ("node_requests_per_save", "node_by_key")):
        real = {family(k): v for k, v in row[real_key].items()}
        simulated = {family(k): v for k, v in sim[sim_key].items()}
        assert set(real) == set(simulated), (real_key, sorted(real), sorted(simulated))
        assert all(abs(real[k] - simulated[k]) <= 4 / SAVES for k in real), (real_key, real, simulated)
    leader = {family(k): v for k, v in row["requests_per_save"].items()}
    assert leader["set tier/*/report/#/node/#"] == 1 and leader["multi_get tier/*/report/#/#"] == 1
    assert leader["set tier/*/report/#/#"] == 1  # rank 1, on the leader's node; ranks 2 and 3 report to their node
    assert sum(sim["by_key"].values()) == 3 + 3 + 3  # the leader's, rank 1's, node 1's head relaying


def test_a_rank_asks_the_same_of_the_store_whatever_the_job_size_and_the_leader_too() -> None:
    small, large = simulate_saves(50, 3)[-1], simulate_saves(400, 3)[-1]
    assert small.leader_requests == large.leader_requests  # one request for all the reports, one for all the bells
    assert small.per_rank == pytest.approx(large.per_rank, rel=0.05)
    assert large.largest > 7 * small.largest  # the reports' one message grows with the ranks, as it must
    assert large.marker_bytes > 7 * small.marker_bytes
    assert all(s > 0 for s in leader_seconds(400, 2))
