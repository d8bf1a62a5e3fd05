"""examples/train_demo.py, run as a user runs it: a real subprocess writing real tiers under tmp_path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tierckpt import Config

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "train_demo.py"
PFS_EVERY = 4


@pytest.fixture
def config(tmp_path: Path) -> Path:
    """examples/tiers.yaml, with the PFS tier taking every 4th step so that a 12-step run reaches it."""
    data = Config.from_yaml(ROOT / "examples" / "tiers.yaml").to_dict()
    (pfs,) = [tier for tier in data["tiers"] if tier["name"] == "pfs"]
    pfs["flush"]["every_steps"] = PFS_EVERY
    pfs["keep"]["every_steps"] = 2 * PFS_EVERY
    path = tmp_path / "tiers.yaml"
    path.write_text(Config.from_dict(data).to_yaml())
    return path


def run_demo(tmp_path: Path, config: Path, *args: str) -> str:
    command = [sys.executable, str(DEMO), "--tiny", "--config", str(config), "--dir", str(tmp_path / "ck"), *args]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def steps_on(directory: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in directory.glob("step-*") if p.is_dir())


def assert_tiers_hold(nvme: Path, pfs: Path, *, newest: int) -> None:
    # A busy tier passes over all but the newest version waiting for it, so which older steps made it
    # down depends on timing (the tiny model trains faster than the first fsyncs). The newest always
    # does (close() drains), and each tier's keep policy bounds the rest.
    on_nvme, on_pfs = steps_on(nvme), steps_on(pfs)
    assert on_nvme[-1] == newest and len(on_nvme) <= 3, on_nvme  # keep: {last: 3}
    assert on_pfs[-1] == newest and all(s % PFS_EVERY == 0 for s in on_pfs), on_pfs  # flush: every 4th step
    assert all(s % (2 * PFS_EVERY) == 0 for s in on_pfs[:-2]), on_pfs  # keep: the newest 2, and every 8th


@pytest.mark.slow
def test_trains_saves_through_the_tiers_and_resumes(tmp_path: Path, config: Path) -> None:
    out = run_demo(tmp_path, config, "--steps", "12", "--log-every", "4")
    assert "starting from scratch" in out
    assert sum(line.startswith("step ") for line in out.splitlines()) == 3  # steps 4, 8, 12
    nvme, pfs = tmp_path / "ck" / "nvme", tmp_path / "ck" / "pfs"
    assert_tiers_hold(nvme, pfs, newest=12)
    assert not list(tmp_path.glob("checkpoints")), "--dir must move the tiers away from ./checkpoints"

    out = run_demo(tmp_path, config, "--steps", "20", "--log-every", "4")
    assert "resumed from step 12 (tier nvme" in out
    assert_tiers_hold(nvme, pfs, newest=20)

    out = run_demo(tmp_path, config, "--steps", "20")  # exits 0 (run_demo checks), and says how to go on
    assert "resumed from step 20 (tier nvme" in out
    assert "training is complete at step 20 (--steps 20)" in out, out
    assert f"bash scripts/demo.sh --steps 40 --dir {tmp_path / 'ck'} --config {config} --tiny\n" in out, out
    assert "every line:" not in out  # nothing trained


@pytest.mark.slow
def test_resumed_run_ends_with_the_same_weights(tmp_path: Path, config: Path) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    straight.mkdir()
    resumed.mkdir()
    run_demo(straight, config, "--steps", "16", "--report", str(straight / "report.json"))
    run_demo(resumed, config, "--steps", "8", "--report", str(resumed / "first.json"))
    run_demo(resumed, config, "--steps", "16", "--report", str(resumed / "report.json"))
    first = json.loads((resumed / "first.json").read_text())
    a = json.loads((straight / "report.json").read_text())
    b = json.loads((resumed / "report.json").read_text())
    assert (first["step"], first["resumed_from"]) == (8, None)
    assert (a["step"], a["resumed_from"], b["step"], b["resumed_from"]) == (16, None, 16, 8)
    # Bitwise: the same batches, the same dropout masks, the same optimizer moments after the restart.
    assert b["final_loss"] == a["final_loss"]
    assert b["weights_sha256"] == a["weights_sha256"]
