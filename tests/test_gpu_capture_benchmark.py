"""benchmarks/gpu_capture.py --quick on CPU, run as a user runs it: every part measured, the report complete.

A smoke test of the script that measures the GPU→host capture stage on a GPU machine: the same code
paths but the CUDA calls. It checks that every number is there and sane, never a timing target.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_capture.py"


def test_quick_run_reports_every_part(tmp_path: Path) -> None:
    out = tmp_path / "results"
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--out", str(out), "--dir", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}\n{done.stdout}\n{done.stderr}"

    (json_path,) = out.glob("gpu_capture-*.json")
    (md_path,) = out.glob("gpu_capture-*.md")
    report = json.loads(json_path.read_text())
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
    variants = training["variants"]
    assert training["model"]["state_bytes"] > 0 and training["model"]["tensors"] > 0
    assert variants["none"]["step_s"] > 0
    tier = variants["tierckpt"]
    assert tier["step_s"] > 0 and isinstance(tier["slowdown_pct"], float)
    assert tier["stall_per_step_s"] > 0 and set(tier["spent_per_step_s"]) == {"call", "barrier"}
    assert tier["extra"]["capture_idle_s"] > 0 and tier["extra"]["capture_in_training_s"] > 0
    dcp = variants["dcp.async_save"]
    if "error" in dcp:  # a torch without DefaultStager, or a DCP failure: reported beside the others, not a crash
        assert dcp["error"] and isinstance(dcp["unavailable"], bool)
    else:
        assert dcp["step_s"] > 0 and isinstance(dcp["slowdown_pct"], float)
        assert {"call", "staging", "upload"} <= set(dcp["spent_per_step_s"])

    assert [t["what"] for t in report["targets"]] == [
        "capture throughput / peak",
        "save() call, 200 tensors (median)",
        "training-step slowdown, tierckpt every 1 step(s)",
    ]
    assert all(isinstance(t["met"], bool) for t in report["targets"])
    text = md_path.read_text()
    assert text.startswith("### GPU→host capture") and "Targets:" in text and text.strip() in done.stdout
    assert not list(tmp_path.glob("tierckpt-gpu-capture-*")), "the DCP directory was left behind"
