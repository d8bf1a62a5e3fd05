"""``tierckpt status CONFIG|DIR --events FILE``: each tier's last flush and last failure, from a
handwritten events file, from a config's own ``events:`` file, and from a real run's; a missing or bad
``--events`` file is a usage error."""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tierckpt import Checkpointer
from tierckpt.cli import main

T0 = 1_700_000_000.0
EVENTS_HEADER = ["TIER", "LAST FLUSHED", "LAST FAILURE"]


def _local(t: float) -> str:
    return datetime.fromtimestamp(T0 + t).astimezone().isoformat(timespec="seconds")


def _event(t: float, event: str, step: int | None, tier: str | None, error: str | None = None, rank: int = 0) -> dict[str, Any]:
    return {"time": T0 + t, "event": event, "step": step, "tier": tier, "bytes": None, "seconds": None,
            "rank": rank, "error": error}


# nvme: failed at step 6, then flushed step 7 (the failure stays the last one recorded);
# pfs: a flush failure, then a later delete failure (the last); ram: nothing but a capture.
EVENTS = [
    _event(10, "flushed", 5, "nvme"),
    _event(20, "flush_failed", 6, "nvme", "[Errno 28] No space left on device"),
    _event(30, "flushed", 7, "nvme"),
    _event(31, "flushed", 5, "pfs"),
    _event(40, "flush_failed", 7, "pfs", "timed out"),
    _event(50, "delete_failed", 5, "pfs", "[Errno 13] Permission denied:\n'/pfs/step-000000000005'"),
    _event(55, "captured", 8, None),
    _event(60, "deleted", 5, "nvme"),  # neither a flush nor a failure: not shown
]


def _write_events(path: Path, events: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in events) + '{"time": 17000', encoding="utf-8")  # a killed writer's tail
    return path


def _config(tmp_path: Path, **top: Any) -> Path:
    path = tmp_path / "tierckpt.yaml"
    config = {"tiers": [{"name": "ram", "type": "memory"},
                        {"name": "nvme", "type": "filesystem", "path": str(tmp_path / "nvme")},
                        {"name": "pfs", "type": "filesystem", "path": str(tmp_path / "pfs")}], **top}
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def _events_table(out: str) -> list[list[str]]:
    """The rows after the ``events: FILE`` line, split on runs of two spaces or more."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("events: "))
    return [re.split(r"\s{2,}", line.rstrip(), maxsplit=2) for line in lines[start + 1:]]


def test_status_prints_each_tiers_last_failure_and_flush(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    events = _write_events(tmp_path / "events.jsonl", EVENTS)
    assert main(["status", str(_config(tmp_path)), "--events", str(events)]) == 0  # failures recorded: still 0
    out = capsys.readouterr().out
    assert f"\nevents: {events}\n" in out
    assert _events_table(out) == [
        EVENTS_HEADER,
        ["ram", "-", "-"],
        ["nvme", f"{_local(30)} step 7", f"{_local(20)} step 6 flush_failed: [Errno 28] No space left on device"],
        ["pfs", f"{_local(31)} step 5", f"{_local(50)} step 5 delete_failed: [Errno 13] Permission denied: '/pfs/step-000000000005'"],
    ]


def test_tiers_of_several_ranks_and_of_no_table_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    events = _write_events(tmp_path / "events.jsonl", [
        _event(1, "flushed", 3, "nvme", rank=1),
        _event(2, "flush_failed", None, "nvme", "the flusher stopped", rank=0),
        _event(3, "flushed", 3, "ssd", rank=1),  # a tier the config does not name (any more)
    ])
    assert main(["status", str(_config(tmp_path)), "--events", str(events)]) == 0
    assert _events_table(capsys.readouterr().out) == [
        EVENTS_HEADER,
        ["ram", "-", "-"],
        ["nvme", f"{_local(1)} step 3 (rank 1)", f"{_local(2)} step - (rank 0) flush_failed: the flusher stopped"],
        ["pfs", "-", "-"],
        ["ssd", f"{_local(3)} step 3 (rank 1)", "-"],
    ]


def test_a_configs_events_file_of_rank_0_is_read_when_it_exists(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(tmp_path, events=str(tmp_path / "events-{rank}.jsonl"))
    assert main(["status", str(config)]) == 0
    assert "events:" not in capsys.readouterr().out  # no file yet: nothing about events

    _write_events(tmp_path / "events-1.jsonl", [_event(1, "flush_failed", 1, "nvme", "rank 1's")])
    _write_events(tmp_path / "events-0.jsonl", EVENTS)
    assert main(["status", str(config)]) == 0
    out = capsys.readouterr().out
    assert f"events: {tmp_path / 'events-0.jsonl'}\n" in out
    assert _events_table(out)[2][2].endswith("flush_failed: [Errno 28] No space left on device")

    other = _write_events(tmp_path / "other.jsonl", [_event(99, "flushed", 9, "pfs")])
    assert main(["status", str(config), "--events", str(other)]) == 0  # --events wins over the config's
    assert _events_table(capsys.readouterr().out)[3] == ["pfs", f"{_local(99)} step 9", "-"]


def test_a_configs_events_file_that_does_not_read_is_reported_not_fatal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(tmp_path, events=str(tmp_path / "events.jsonl"))
    (tmp_path / "events.jsonl").write_text("garbage\n{}\n", encoding="utf-8")
    assert main(["status", str(config)]) == 0
    assert f"events: {tmp_path / 'events.jsonl'} cannot be read: {tmp_path / 'events.jsonl'}, line 1: not JSON" in capsys.readouterr().out


def test_a_missing_events_file_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.jsonl"
    assert main(["status", str(_config(tmp_path)), "--events", str(missing)]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # refused before the table
    assert err == f"tierckpt status: --events {missing}: no such file\n"


def test_a_bad_events_file_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(EVENTS[0]) + "\n[1]\n", encoding="utf-8")
    assert main(["status", str(_config(tmp_path)), "--events", str(bad)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and f"{bad}, line 2: not an event" in err


def test_status_of_a_real_run_shows_its_newest_flush(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(tmp_path, events=str(tmp_path / "events-{rank}.jsonl"))
    with Checkpointer.from_yaml(config) as ckpt:
        for step in (1, 2, 3):
            ckpt.save_sync(step, {"w": torch.arange(10.0)})
        ckpt.wait_sync()
    assert (tmp_path / "events-0.jsonl").exists(), "the Checkpointer wrote no events file: is config events: wired in?"
    assert main(["status", str(config)]) == 0
    rows = {row[0]: row for row in _events_table(capsys.readouterr().out)}
    for tier in ("nvme", "pfs"):
        assert re.fullmatch(r"\S+ step 3", rows[tier][1]), rows[tier]  # wait() flushed the newest to both
        assert rows[tier][2] == "-"
