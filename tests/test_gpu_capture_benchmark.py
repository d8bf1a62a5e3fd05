"""benchmarks/gpu_capture.py --quick on CPU, run as a user runs it: every part measured, the report complete.

A smoke test of the script that measures the GPU→host capture stage on a GPU machine: the same code
paths but the CUDA calls. It checks that every number is there and sane, never a timing target.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tierckpt.testing.ranks import run_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_capture.py"
DCP = ("dcp.async_save+stager", "dcp.async_save")


@pytest.mark.slow
def test_quick_run_reports_every_part(tmp_path: Path) -> None:
    out = tmp_path / "results"
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--every", "1", "2", "--out", str(out), "--dir", str(tmp_path), "--name", "quick"]
    done = run_script(command, cwd=ROOT, timeout_s=300)
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}\n{done.stdout}\n{done.stderr}"

    report = json.loads((out / "quick.json").read_text())
    assert report["device"] == "cpu" and "errors" not in report
    assert report["machine"]["torch"] == __import__("torch").__version__

    peak, capture, call = report["peak"], report["capture"], report["save_call"]
    assert peak["gbps"] > 0 and peak["pinned"] is False  # no page-locked memory without CUDA
    assert capture["gbps"] > 0 and capture["bytes"] == peak["bytes"] > 0
    assert capture["counters"]["captures_failed"] == 0 and capture["counters"]["skipped_saves"] == 0
    assert call["tensors"] == 200
    assert 0 < call["median_ms"] <= call["p90_ms"]
    assert len(call["samples_ms"]) >= 10

    training = report["training"]
    assert training["model"]["state_bytes"] > 0 and training["model"]["tensors"] > 0
    assert training["every"] == [1, 2] and "cut" not in training
    baseline = training["baseline"]
    assert baseline["step_s"] > 0 and baseline["timed_steps"] == [3, 3]  # --quick: 2 rounds of 3 timed steps
    assert [run["every"] for run in training["runs"]] == [1, 2]
    for run in training["runs"]:
        variants = run["variants"]
        assert set(variants) == {"tierckpt", *DCP}
        tier = variants["tierckpt"]
        assert tier["step_s"] > 0 and isinstance(tier["slowdown_pct"], float)
        assert all(n % run["every"] == 0 for n in tier["timed_steps"])  # whole periods of K steps
        assert tier["stall_per_step_s"] > 0 and set(tier["spent_per_step_s"]) == {"call", "barrier"}
        assert tier["extra"]["capture_idle_s"] > 0 and tier["extra"]["capture_in_training_s"] > 0
        assert tier["extra"]["save_call_ms"] > 0
        for name in DCP:
            dcp = variants[name]
            if "error" in dcp:  # a torch without DefaultStager, or a DCP failure: reported beside the others, not a crash
                assert dcp["error"] and isinstance(dcp["unavailable"], bool)
                continue
            assert dcp["step_s"] > 0 and isinstance(dcp["slowdown_pct"], float)
            assert len(dcp["timed_steps"]) == 1  # --quick: DCP runs one round
            assert {"call", "upload"} <= set(dcp["spent_per_step_s"])
            assert dcp["extra"]["staging"] and dcp["extra"]["directory"]
        assert "staging" in variants["dcp.async_save+stager"].get("spent_per_step_s", {"staging": 0})

    assert [t["what"] for t in report["targets"]] == [
        "capture throughput / peak",
        "save() call, 200 tensors (median)",
        "training-step slowdown, tierckpt every 1 step(s)",
        "training-step slowdown, tierckpt every 2 step(s)",
    ]
    for target in report["targets"]:
        assert isinstance(target["met"], bool) or (target["met"] is None and target["note"].startswith("not applicable"))
    text = (out / "quick.md").read_text()
    assert text.startswith("### GPU→host capture") and "Targets:" in text and text.strip() in done.stdout
    assert "**A checkpoint every 1 step(s)**" in text and "**A checkpoint every 2 step(s)**" in text
    assert "DCP `async_save` + `DefaultStager` (a new one per save)" in text and "DCP `async_save`, no stager (classic)" in text
    png = out / "quick.png"
    if report["plot"].startswith("none"):  # without matplotlib: said, not failed
        assert "matplotlib" in report["plot"] and not png.exists()
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "Plot: `quick.png`" in text
    assert not list(tmp_path.glob("tierckpt-gpu-capture-*")), "the DCP directory was left behind"


def test_the_plot_is_skipped_with_a_note_without_matplotlib(tmp_path: Path) -> None:
    """No matplotlib (the GPU image may lack it): the report says so and nothing fails."""
    code = (
        "import sys; sys.modules['matplotlib'] = None; sys.path.insert(0, sys.argv[1]); import gpu_capture; "
        "report = {'training': {'baseline': {'step_s': 0.1}}}; print(gpu_capture.plot(report, __import__('pathlib').Path(sys.argv[2])))"
    )
    png = tmp_path / "x.png"
    done = subprocess.run([sys.executable, "-c", code, str(SCRIPT.parent), str(png)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith("none: matplotlib is not installed") and not png.exists()
