"""examples/train_demo.py, run as a user runs it: a real subprocess writing real tiers under tmp_path."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterator

import pytest

from helpers import mount, unmount
from tierckpt import Config, cli
from tierckpt.testing.ranks import run_script

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
    done = run_script(command, cwd=tmp_path)  # forked from the suite's fork server: torch is imported there
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


@pytest.fixture
def demo(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """examples/train_demo.py imported in this process (its dataclasses need it in sys.modules)."""
    spec = importlib.util.spec_from_file_location("train_demo", DEMO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "train_demo", module)
    spec.loader.exec_module(module)
    return module


def test_help_names_the_command_users_run_and_the_exit_statuses(demo: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        demo.parse_args(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: bash scripts/demo.sh"), out
    assert f"\n  {demo.EXIT_DISK_FULL}    a tier's file system is full" in out and "\n  130  interrupted" in out, out


def test_the_timeline_hint_works_as_printed(demo: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The command is this interpreter's own tierckpt (.venv/bin/tierckpt: not on PATH unless activated),
    and without matplotlib (the demo's setup leaves it out) the hint says how to add it."""
    monkeypatch.chdir(tmp_path)
    hint = demo.timeline_hint("ck/events.jsonl")
    command = hint.split("draw them: ")[1].split(" timeline ck/events.jsonl -o timeline.png)")[0]
    assert Path(command) == Path(sys.executable).parent / "tierckpt" and os.access(command, os.X_OK), hint
    assert "matplotlib" not in hint  # the test extras have it
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    lacking = demo.timeline_hint("ck/events.jsonl")
    assert lacking.startswith(hint) and lacking.endswith(f"lacks: {Path(sys.executable).parent / 'pip'} install matplotlib"), lacking


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 20 MiB tmpfs, mounted for the test and unmounted after it (root only)."""
    target = tmp_path / "disk"
    mount("tmpfs", target, "size=20m")
    try:
        yield target
    finally:
        unmount(target)


@pytest.mark.slow
def test_a_full_disk_ends_the_demo_with_what_to_do_and_its_exit_status(small_disk: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Other files fill the disk but for room for two versions of the tiny model (0.7 MiB each): the
    third flush to nvme (keep: {last: 3}) finds it full. The demo stops there and says why, with no
    traceback; the two committed versions verify."""
    fd = os.open(small_disk / "other-files", os.O_CREAT | os.O_WRONLY)
    try:
        os.posix_fallocate(fd, 0, shutil.disk_usage(small_disk).free - (1800 << 10))
    finally:
        os.close(fd)
    ck = small_disk / "ck"
    command = [sys.executable, str(DEMO), "--tiny", "--steps", "40", "--dir", str(ck)]
    done = run_script(command, cwd=ROOT)
    output = done.stdout + done.stderr
    assert done.returncode == 3, output
    assert "Traceback" not in output, output
    # The library's one line per failed flush carries the sizes.
    assert "failed with ENOSPC" in done.stderr and "(a version needs 0.7 MiB; keep {last: 3} needs 2.7 MiB for 3 versions" in done.stderr, output
    assert "no space left on the disk of tier 'nvme'" in done.stderr and str(ck / "nvme" / ".tmp-step-") in done.stderr, output
    for said in ("a version needs 0.7 MiB", "keep {last: 3} needs 2.7 MiB", "free: 0.", "safe: the committed versions stay whole"):
        assert said in done.stderr, output
    assert "lower the tier's keep in examples/tiers.yaml" in done.stderr and "--dir on a file system with room" in done.stderr, output
    held = steps_on(ck / "nvme")
    assert len(held) >= 1 and f"the newest on disk is step {held[-1]} (tier nvme)" in done.stderr, output
    assert cli.main(["verify", str(ck)]) == 0  # `python -m tierckpt verify DIR`, in this process (no second torch import)
    verified = capsys.readouterr().out
    assert f"{len(held)} versions: {len(held)} OK, 0 damaged" in verified, verified
