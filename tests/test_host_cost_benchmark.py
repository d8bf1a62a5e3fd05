"""benchmarks/host_cost.py on CPU, run as a user runs it: real jobs of 1 and 2 gloo ranks save a tiny
replicated state with tierckpt and DCP's process executor; the report is
complete and its numbers agree with the ranks' raw ones (never a timing target)."""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt.testing.ranks import run_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "host_cost.py"
# Two of the four, to keep the suite short: the other two differ from these by a setting each.
VARIANTS = ("tierckpt", "dcp process")
SAVES = 2
GIB = 2**30


def lock_ms_per_gib(rank: dict[str, Any]) -> float:
    """The method of issue 57, from a rank's raw figures: the window's time off the CPU and off the run
    queue, less the baseline's for as many steps, per GiB saved."""
    base, window = rank["baseline"], rank["window"]
    gib = rank["state_bytes"] * rank["saves"] / GIB
    return 1e3 * (window["off_s"] - window["steps"] * base["off_s"] / base["steps"]) / gib


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs: one for the main threads, one for the rest")
def test_a_short_run_reports_memory_copies_cpu_and_lock_wait_for_every_variant_and_job_size(tmp_path: Path) -> None:
    out, markdown = tmp_path / "results", tmp_path / "host_cost.md"
    cores = sorted(os.sched_getaffinity(0))[:2]
    command = [sys.executable, str(SCRIPT), "--ranks", "1", "2", "--mib", "8", "--width", "256", "--saves", str(SAVES),
               "--repeats", "1", "--variants", *VARIANTS, "--baseline-s", "0.3", "--step-ops", "5000", "--cores", *map(str, cores), "--timeout", "60",
               "--out", str(out), "--markdown", str(markdown)]
    done = run_script(command, cwd=tmp_path, timeout_s=900)
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    report = json.loads((out / "host_cost.json").read_text())
    rows = {(r["ranks"], r["variant"]): r for r in report["rows"]}
    assert sorted(rows) == sorted((n, v) for n in (1, 2) for v in VARIANTS)

    for (world, variant), row in rows.items():
        (job,) = row["jobs"]  # one repeat
        assert [r["rank"] for r in job] == list(range(world)) and all(r["world"] == world for r in job)
        state = job[0]["state_bytes"]
        assert 6 << 20 <= state <= 10 << 20 and all(r["state_bytes"] == state for r in job)  # the same replicated state
        for rank in job:
            window = rank["window"]
            assert len(window["calls_s"]) == SAVES and window["steps"] > 0 and rank["baseline"]["steps"] > 0
            assert window["off_s"] == pytest.approx(window["wall_s"] - window["run_s"] - window["queued_s"] - window["steal_s"])
            assert 0 < window["wall_s"] + sum(window["calls_s"]) <= window["window_s"] + 1e-6  # the steps and calls lie in the window
            assert "MainThread" in window["cpu_s"]
            copied = rank["copied_bytes"]
            assert len(copied) == SAVES
            if variant.startswith("tierckpt"):
                # Counted by tierckpt: today every rank copies the whole replicated state into its slots.
                assert all(state <= c <= state + (1 << 20) for c in copied), copied
                assert {"tierckpt-engine", "tierckpt-copy"} <= set(window["cpu_s"]), window["cpu_s"]
                host = rank["host"]
                assert host["slots"] == 2 and host["slot_bytes"] >= state and host["mapped_bytes"] == 2 * host["slot_bytes"]
                assert rank["rss"]["held_growth"] >= host["mapped_bytes"] // 2  # the slots were faulted in before the window
                if not torch.cuda.is_available():
                    assert host["pinned_bytes"] == 0
            else:
                assert copied == [state * (2 if variant == "dcp process" else 1)] * SAVES  # computed from the state
                assert rank["host"]["slot_bytes"] is None
            children = {g for g in window["cpu_s"] if g.startswith("[child] ")}
            assert bool(children) == (variant == "dcp process"), window["cpu_s"]
            assert (rank["rss"]["children_peak"] > 0) == (variant == "dcp process")

        # The row's figures are the median rank's of the ranks' raw numbers.
        assert row["lock_ms_per_gib"]["median"] == pytest.approx(statistics.median(lock_ms_per_gib(r) for r in job))
        backgrounds = [sum(s for g, s in r["window"]["cpu_s"].items() if g != "MainThread") for r in job]
        gib = state * SAVES / GIB
        assert row["background_s_per_gib"]["median"] == pytest.approx(statistics.median(b / gib for b in backgrounds))
        calls = [sum(r["window"]["calls_s"]) for r in job]
        assert row["call_ms_per_gib"]["median"] == pytest.approx(statistics.median(1e3 * c / gib for c in calls))
        assert row["peak_growth_mib"]["median"] == pytest.approx(statistics.median(r["rss"]["peak_growth"] / 2**20 for r in job))
        assert row["background_s_per_gib"]["median"] > 0 and row["call_ms_per_gib"]["median"] > 0

    for variant in VARIANTS:  # each job size's growth as a share of the 1-rank job's
        one, two = rows[(1, variant)], rows[(2, variant)]
        assert one["peak_growth_ratio"] == pytest.approx(1.0)
        assert two["peak_growth_ratio"] == pytest.approx(two["peak_growth_mib"]["median"] / one["peak_growth_mib"]["median"])
    floor = report["floor_s_per_gib"]
    assert floor["total"] == pytest.approx(floor["copy"] + floor["xxh3"] + floor["write"])

    text = markdown.read_text()
    assert "### Host memory and copies per rank" in text and "### The training thread and the background, per GiB saved" in text
    for label in ("tierckpt, raw", "DCP `async_save`, process"):
        assert f"| 1 | {label} |" in text and f"| 2 | {label} |" in text, label
    assert "RSS growth of a rank at 2 ranks ≤ 0.6× the 1-rank job's" in text
    assert "Lock wait per GiB, tierckpt, raw, 1 rank" in text and "the floor" in text
