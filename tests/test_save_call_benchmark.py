"""benchmarks/save_call.py on CPU, run as a user runs it: the report complete and its numbers consistent.

It measures what ``save()`` costs the training thread (the call, a launch-bound thread's step beside
the copies, and the garbage collections over the saves); this checks that the numbers are there and agree with each other, never a timing target.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

from tierckpt.testing.ranks import run_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "save_call.py"


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [False, True], ids=["plain", "fsdp2"])
def test_a_short_run_reports_the_call_and_the_launch_bound_step(tmp_path: Path, fsdp: bool) -> None:
    out = tmp_path / "results"
    command = [sys.executable, str(SCRIPT), "--layers", "10", "--saves", "4", "--warmup", "1", "--ops", "20", "--out", str(out)]
    command += ["--fsdp"] if fsdp else []
    done = run_script(command, cwd=ROOT, timeout_s=300)
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    (path,) = out.glob("save_call-*.json")
    report = json.loads(path.read_text())
    result = report["result"]
    assert result["tensors"] == 80 and result["saves"] == 4  # 8 state tensors a layer
    call = result["call_ms"]
    assert len(call["samples"]) == 4 and call["median"] == pytest.approx(statistics.median(call["samples"]))
    assert 0 < call["median"] <= call["p90"] <= max(call["samples"])
    step = result["launch_step_ms"]
    assert step["alone"] > 0 and step["slowdown_pct"] == pytest.approx(100 * (step["after_save"] / step["alone"] - 1))
    collector = result["collector"]  # JSON: the generations as strings
    assert sorted(collector["runs"]) == sorted(collector["ms_per_save"]) == ["0", "1", "2"]
    assert all(collector["ms_per_save"][g] >= 0 and (collector["runs"][g] > 0 or collector["ms_per_save"][g] == 0) for g in "012")
    assert report["library"] == str(ROOT / "tierckpt")
    text = path.with_suffix(".md").read_text()
    assert "| `save_sync` call" in text and "| Python's collector, a save" in text
    assert ("FSDP2 over 1 rank (DTensors): 80 tensors" in text) == fsdp, text
