"""Events (config ``events: PATH``): one JSON line per thing that happened, in the order it happened,
and never at the cost of a save or a committed checkpoint (tierckpt.observe)."""

from __future__ import annotations

import errno
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import Checkpointer, FlushError
from tierckpt.errors import ConfigError, NoCheckpointError
from tierckpt.observe import EVENTS, Event, Events
from tierckpt.observe.records import LOGGER
from tierckpt.testing import Gates, IOFaults

from helpers import Opened, fs_tier, held, memory_tier

DEADLINE_S = 30.0  # a deadlock guard only: every wait below ends on an event long before it
CLOSE_TOLERATES = (FlushError,)
FIELDS = ["time", "event", "step", "tier", "bytes", "seconds", "rank", "error"]


def config(*tiers: dict[str, Any], events: Path | str, snapshots: int = 2, on_full: str = "block") -> dict[str, Any]:
    return {"host": {"capacity": "1MiB", "snapshots": snapshots, "on_full": on_full}, "tiers": list(tiers), "events": str(events)}


def state_for(step: int) -> dict[str, Any]:
    return {"w": torch.full((64, 16), float(step)), "step": step}


def read(path: Path) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(list(e) == FIELDS and e["event"] in EVENTS and e["rank"] == 0 for e in lines), lines
    return lines


def brief(events: list[dict[str, Any]]) -> list[tuple[str, int | None, str | None]]:
    return [(e["event"], e["step"], e["tier"]) for e in events]


def test_a_failing_tier_a_deletion_and_restores_are_events_in_the_order_they_happened(tmp_path: Path, opened: Opened) -> None:
    path = tmp_path / "events-{rank}.jsonl"
    ckpt = opened(config(memory_tier("ram"), fs_tier("nvme", tmp_path / "nvme", keep={"last": 1}), events=path))
    ckpt.save_sync(1, state_for(1)).committed_sync("nvme", DEADLINE_S)
    with IOFaults(errno.EIO, "fsync", under=tmp_path / "nvme"):
        h2 = ckpt.save_sync(2, state_for(2))
        with pytest.raises(FlushError):
            h2.committed_sync("nvme", DEADLINE_S)
    assert ckpt.save_sync(3, state_for(3)).committed_sync("nvme", DEADLINE_S) is True
    ckpt.wait_sync()
    assert held(ckpt, "nvme") == [3]
    assert ckpt.restore_sync(3, tier="nvme").step == 3
    with pytest.raises(NoCheckpointError):
        ckpt.restore_sync(99)
    ckpt.close_sync()

    events = read(tmp_path / "events-0.jsonl")
    assert brief(events) == [
        ("save", 1, None), ("captured", 1, None), ("flushed", 1, "nvme"),
        ("save", 2, None), ("captured", 2, None), ("flush_failed", 2, "nvme"),
        ("save", 3, None), ("captured", 3, None), ("flushed", 3, "nvme"), ("deleted", 1, "nvme"),
        ("restored", 3, "nvme"), ("restore_failed", 99, None),
    ]
    assert [e["time"] for e in events] == sorted(e["time"] for e in events)
    by = {(e["event"], e["step"]): e for e in events}
    assert "Input/output error" in by["flush_failed", 2]["error"] and "step 2" in by["flush_failed", 2]["error"]
    assert "no tier holds step 99" in by["restore_failed", 99]["error"]
    stored = {v: by["flushed", v]["bytes"] for v in (1, 3)}
    assert stored[1] >= 64 * 16 * 4 and stored[1] == stored[3] == by["restored", 3]["bytes"]
    for e in events:
        assert (e["seconds"] is not None) == (e["event"] in ("save", "captured", "flushed", "restored")), e
        assert e["seconds"] is None or e["seconds"] >= 0
    # A capture is timed from the start of its save call: never shorter than that call.
    assert all(by["captured", s]["seconds"] >= by["save", s]["seconds"] for s in (1, 2, 3))


def test_passed_over_evicted_and_skipped_saves_are_events(tmp_path: Path, opened: Opened) -> None:
    """nvme is busy with step 2 and takes even steps only: step 4 waits for it and step 5 is passed
    over; step 5's save evicts 4 (both slots taken). With the only slot being read, a save is skipped."""
    gates = Gates("nvme", deadline_s=DEADLINE_S)
    opened.append(gates)
    ckpt = opened(
        config(memory_tier("ram"), fs_tier("nvme", tmp_path / "nvme", flush={"every_steps": 2}), events=tmp_path / "ev.jsonl", on_full="evict"),
        tier_factory=gates,
    )
    ckpt.save_sync(2, state_for(2))
    assert gates["nvme"].started.wait(DEADLINE_S)
    assert ckpt.save_sync(4, state_for(4)).captured_sync(DEADLINE_S) is True
    h5 = ckpt.save_sync(5, state_for(5))
    assert h5.committed_sync("nvme", DEADLINE_S) is False
    gates.open_all()
    ckpt.wait_sync()
    ckpt.close_sync()
    # Evicting 4 is also nvme passing it over; both happen inside the save() of step 5.
    assert brief(read(tmp_path / "ev.jsonl")) == [
        ("save", 2, None), ("captured", 2, None), ("save", 4, None), ("captured", 4, None),
        ("evicted", 4, "ram"), ("passed_over", 4, "nvme"), ("save", 5, None), ("captured", 5, None), ("passed_over", 5, "nvme"),
        ("flushed", 2, "nvme"),
    ]

    gates = Gates("nvme", deadline_s=DEADLINE_S)
    opened.append(gates)
    ckpt = opened(config(memory_tier("ram"), fs_tier("nvme", tmp_path / "nvme2"), events=tmp_path / "skip.jsonl", snapshots=1, on_full="evict"), tier_factory=gates)
    ckpt.save_sync(1, state_for(1))
    assert gates["nvme"].started.wait(DEADLINE_S)
    assert ckpt.save_sync(2, state_for(2)).skipped  # the only slot is being read
    gates.open_all()
    ckpt.close_sync()
    assert brief(read(tmp_path / "skip.jsonl")) == [
        ("save", 1, None), ("captured", 1, None), ("save_skipped", 2, None), ("save", 2, None), ("flushed", 1, "nvme"),
    ]


def test_an_events_file_that_fails_to_write_loses_no_checkpoint(tmp_path: Path, opened: Opened, caplog: pytest.LogCaptureFixture) -> None:
    """/dev/full: every write fails with ENOSPC, as on a full disk."""
    ckpt = opened(config(memory_tier("ram"), fs_tier("nvme", tmp_path / "nvme"), events="/dev/full"))
    for step in range(3):
        assert ckpt.save_sync(step, state_for(step)).committed_sync("nvme", DEADLINE_S) is True
    ckpt.close_sync()
    failures = [r.getMessage() for r in caplog.records if "events:" in r.getMessage()]
    assert len(failures) == 1 and "/dev/full" in failures[0] and "No space left on device" in failures[0], failures
    with Checkpointer({"tiers": [fs_tier("nvme", tmp_path / "nvme")]}) as again:
        assert [v.step for v in again.versions()] == [0, 1, 2]


def test_an_events_file_that_cannot_be_opened_is_a_config_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"events: cannot open .*file/events.jsonl for appending: (File exists|Not a directory)"):
        Checkpointer(config(memory_tier("ram"), events=tmp_path / "file" / "events.jsonl"))


def test_a_listener_that_raises_is_switched_off_and_the_others_go_on(caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        def handle(self, event: Event) -> None:
            raise RuntimeError("listener bug")

        def close(self) -> None:
            pass

    class Kept(Broken):
        seen: list[str] = []

        def handle(self, event: Event) -> None:
            self.seen.append(event.event)

    events = Events(3, [Broken(), kept := Kept()])
    events.emit("save", step=1, seconds=0.001)
    events.emit("captured", step=1)
    assert kept.seen == ["save", "captured"] and len(events.sinks) == 1
    assert [r.getMessage() for r in caplog.records] == ["observability: Broken failed and is switched off (checkpointing goes on): listener bug"]


def test_dotted_log_records_carry_each_events_numbers(tmp_path: Path, opened: Opened, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    ckpt = opened(config(memory_tier("ram"), fs_tier("nvme", tmp_path / "nvme"), events=tmp_path / "ev.jsonl"))
    ckpt.save_sync(7, state_for(7)).committed_sync("nvme", DEADLINE_S)
    ckpt.close_sync()
    records = {r.metric: r for r in caplog.records if r.name == LOGGER}  # type: ignore[attr-defined]
    assert set(records) == {
        "tierckpt.checkpoint.save.call_ms", "tierckpt.checkpoint.save.bytes", "tierckpt.checkpoint.capture.latency_ms",
        "tierckpt.checkpoint.capture.bytes", "tierckpt.checkpoint.flush.nvme.latency_ms", "tierckpt.checkpoint.flush.nvme.bytes",
    }
    flushed = next(e for e in read(tmp_path / "ev.jsonl") if e["event"] == "flushed")
    assert records["tierckpt.checkpoint.flush.nvme.bytes"].value == flushed["bytes"]  # type: ignore[attr-defined]
    assert records["tierckpt.checkpoint.flush.nvme.latency_ms"].value == round(flushed["seconds"] * 1000, 3)  # type: ignore[attr-defined]
    assert all(r.step == 7 and r.levelno == logging.DEBUG for r in records.values())  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"events": 3}, "events: 3 is not allowed; use the path of a file, e.g. events-{rank}.jsonl"),
        ({"metrics": {"port": 70000}}, "metrics.port: 70000 is not allowed; use an integer from 0 to 65535"),
        ({"metrics": {"port": 9400, "host": "localhost"}}, "metrics.host: 'localhost' is not allowed; use an IP address, e.g. 127.0.0.1 or 0.0.0.0"),
        ({"metrics": {"host": "127.0.0.1"}}, "metrics.port: missing; required here: port"),
    ],
)
def test_bad_observability_keys_are_config_errors_naming_them(extra: dict[str, Any], message: str) -> None:
    from tierckpt import Config

    with pytest.raises(ConfigError) as caught:
        Config.from_dict({"tiers": [memory_tier("ram")]} | extra)
    assert str(caught.value).startswith(message), str(caught.value)


def test_observability_keys_round_trip_and_are_left_out_when_unset() -> None:
    from tierckpt import Config

    plain = Config.from_dict({"tiers": [memory_tier("ram")]})
    assert "events" not in plain.to_dict() and "metrics" not in plain.to_dict()
    config = Config.from_dict({"tiers": [memory_tier("ram")], "events": "~/ev-{rank}.jsonl", "metrics": {"port": 9400}})
    assert config.events == str(Path.home() / "ev-{rank}.jsonl") and (config.metrics.port, config.metrics.host) == (9400, "127.0.0.1")  # type: ignore[union-attr]
    assert Config.from_dict(config.to_dict()) == config
