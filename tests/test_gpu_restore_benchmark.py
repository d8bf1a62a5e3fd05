"""benchmarks/gpu_restore.py --device cpu --quick, run as a user runs it: every part reported, the report complete.

The script measures the GPU restore against the disk's read limit and checks the lazy capture bit for bit
on a GPU machine; on CPU tensors the same code paths run (the GPUDirect probe excepted). This checks that
every number is there and sane and that the bitwise check passes, never a timing target.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tierckpt.testing.ranks import run_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_restore.py"


@pytest.mark.slow
def test_quick_run_reports_every_part(tmp_path: Path) -> None:
    out = tmp_path / "results"
    # --cache fadvise: the version's files leave the page cache, the rest of a shared machine's cache stays.
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--cache", "fadvise", "--out", str(out), "--dir", str(tmp_path), "--name", "quick"]
    done = run_script(command, cwd=ROOT, timeout_s=300)
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}\n{done.stdout}\n{done.stderr}"

    report = json.loads((out / "quick.json").read_text())
    assert report["device"] == "cpu" and "errors" not in report and "findings" not in report
    assert report["machine"]["torch"] == __import__("torch").__version__

    restore = report["restore"]
    assert restore["tensors"] == 1024 and restore["bytes"] > 0 and restore["file_bytes"] >= restore["bytes"]
    assert restore["uncached"]["how"] == "posix_fadvise(DONTNEED)" and restore["uncached"]["files"] >= 2
    (sample,) = restore["samples"]  # --quick: one repeat
    for kind in ("at_once", "later"):
        assert sample[kind]["construct_s"] > 0 and sample[kind]["restore_s"] > 0
    med = restore["median"]
    assert med["construct_and_restore_s"] == pytest.approx(med["construct_s"] + med["at_once_s"])
    if restore["o_direct"]:
        assert set(med["limit_s"]) == {str(n) for n in restore["thread_counts"]} and restore["thread_counts"][0] == restore["io_threads"]
        assert med["best_limit_s"] == min(med["limit_s"].values()) > 0
        assert med["share_at_once"] == pytest.approx(med["best_limit_s"] / med["at_once_s"])

    assert report["gds"] == {"ok": False, "skipped": "needs CUDA"}
    assert report["dcp"]["load_s"] > 0 and report["dcp"]["save_s"] > 0

    correctness = report["correctness"]
    assert correctness["failed"] == [] and correctness["changed_by_step"] == correctness["tensors"] > 0
    assert list(correctness["restores"]) == ["ram", "disk", "disk, verify_first", "disk, new Checkpointer"]
    assert [r["tier"] for r in correctness["restores"].values()] == ["ram", "nvme", "nvme", "nvme"]
    assert all(r["pass"] and r["in_place"] and not r["mismatches"] for r in correctness["restores"].values())

    text = (out / "quick.md").read_text()
    assert text.startswith("### GPU restore against the disk's read limit") and text.strip() in done.stdout
    assert "| restore right after `Checkpointer()` |" in text and "DCP `load`" in text and "GPUDirect Storage: not probed" in text
    assert text.count("| PASS |") == 4 and "Targets:" in text
    assert not list(tmp_path.glob("tierckpt-gpu-restore-*")), "the work directory was left behind"


def test_a_restore_that_differs_is_a_fail_naming_the_tensor() -> None:
    """The comparison the correctness part rests on: bytes, not values (-0.0, NaN payloads), and structure."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import torch
        from gpu_restore import cloned, mismatches, poisoned, raw

        reference = {"model": {"w": torch.tensor([0.0, float("nan"), 1.0]), "b": torch.ones(())}, "optim": {"param_groups": [{"lr": 0.1}]}}
        assert mismatches(cloned(reference), reference) == []
        template = poisoned(reference)
        assert all(bool((raw(t) == 0xA5).all()) for t in (template["model"]["w"], template["model"]["b"]))
        assert mismatches(template, reference) == ["/model/w: bytes differ", "/model/b: bytes differ"]
        negative = cloned(reference)
        negative["model"]["w"][0] = -0.0  # equal as a value, not as bytes
        assert mismatches(negative, reference) == ["/model/w: bytes differ"]
        other = cloned(reference)
        other["optim"]["param_groups"][0]["lr"] = 0.2
        assert mismatches(other, reference) == ["/optim/param_groups/0/lr: 0.2 != 0.1"]
        assert mismatches({"model": {}}, reference)[0].startswith("structure:")
    finally:
        sys.path.remove(str(SCRIPT.parent))
