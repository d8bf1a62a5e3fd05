"""``tierckpt timeline`` and :mod:`tierckpt.observe.timeline`: events files read (a killed writer's half
line left out, a bad line named), drawn as real PNG files, from a real run and from handwritten events
of every kind, through the command line's exit statuses and summary line."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tierckpt import Checkpointer
from tierckpt.cli import main
from tierckpt.errors import ConfigError
from tierckpt.observe.events import EVENTS
from tierckpt.observe.timeline import draw_timeline, read_events

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
T0 = 1_700_000_000.0
FAILED_RED = (0xD6, 0x27, 0x28)  # the failure marks' colour


def _event(t: float, event: str, step: int | None = None, tier: str | None = None, *, seconds: float | None = None,
           nbytes: int | None = None, error: str | None = None, rank: int = 0) -> dict[str, Any]:
    return {"time": T0 + t, "event": event, "step": step, "tier": tier, "bytes": nbytes, "seconds": seconds,
            "rank": rank, "error": error}


def _handwritten(rank: int = 0) -> list[dict[str, Any]]:
    """A run of three saves above ram, nvme and pfs, with one event of every other kind."""
    events = []
    for i, step in enumerate((10, 20, 30)):
        t = 2.0 * i
        events += [
            _event(t + 0.05, "save", step, seconds=0.05, nbytes=4096, rank=rank),
            _event(t + 0.3, "captured", step, seconds=0.3, nbytes=4096, rank=rank),
            _event(t + 1.0, "flushed", step, "nvme", seconds=0.7, nbytes=4096, rank=rank),
        ]
    events += [
        _event(2.0, "flushed", 10, "pfs", seconds=1.0, nbytes=4096, rank=rank),
        _event(2.4, "passed_over", 20, "pfs", rank=rank),
        _event(3.0, "save_skipped", 25, rank=rank),
        _event(3.1, "capture_failed", 26, "ram", error="torn snapshot", rank=rank),
        _event(4.5, "flush_failed", 30, "pfs", error="[Errno 28] No space left on device", rank=rank),
        _event(4.6, "evicted", 20, "ram", rank=rank),
        _event(5.1, "deleted", 10, "nvme", rank=rank),
        _event(5.2, "delete_failed", 10, "pfs", error="[Errno 13] Permission denied", rank=rank),
        _event(7.0, "restored", 30, "nvme", seconds=0.5, nbytes=4096, rank=rank),
        _event(7.5, "restore_failed", None, None, error="no checkpoint", rank=rank),
    ]
    return sorted(events, key=lambda e: e["time"])


def _write(path: Path, events: list[dict[str, Any]], tail: str = "") -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in events) + tail, encoding="utf-8")
    return path


def _png(path: Path) -> np.ndarray:
    """The image's pixels (RGB, 0-255), after checking it is a PNG of a plausible size."""
    import matplotlib.image

    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert 10_000 < len(data) < 2_000_000, len(data)
    pixels = (matplotlib.image.imread(path)[..., :3] * 255).round().astype(np.uint8)
    assert pixels.shape[1] > 1000 and pixels.shape[0] > 150, pixels.shape
    return pixels


def _has_colour(pixels: np.ndarray, rgb: tuple[int, int, int]) -> bool:
    return bool((np.abs(pixels.astype(int) - np.array(rgb)).sum(axis=-1) < 12).any())


# -- reading --------------------------------------------------------------------------------------


def test_handwritten_events_cover_every_kind() -> None:
    assert {e["event"] for e in _handwritten()} == set(EVENTS)


def test_read_events_leaves_out_a_half_written_last_line(tmp_path: Path) -> None:
    events = _handwritten()
    path = _write(tmp_path / "events.jsonl", events, tail='{"time": 1700000009.5, "event": "fl')
    assert read_events(path) == events


def test_read_events_keeps_a_whole_last_line_without_its_newline(tmp_path: Path) -> None:
    events = _handwritten()
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in events), encoding="utf-8")
    assert read_events(path) == events


@pytest.mark.parametrize("bad", ["{not json", "[1, 2]", '{"event": "save"}', '{"time": "now", "event": "save"}'])
def test_read_events_names_the_file_and_line_of_a_bad_line(tmp_path: Path, bad: str) -> None:
    events = _handwritten()
    path = tmp_path / "events.jsonl"
    lines = [json.dumps(e) for e in events]
    lines.insert(3, bad)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{path}, line 4: "):
        read_events(path)


def test_read_events_fills_absent_fields(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text('{"time": 5, "event": "deleted", "tier": "nvme", "new_field": 1}\n', encoding="utf-8")
    assert read_events(path) == [{"time": 5, "event": "deleted", "step": None, "tier": "nvme", "bytes": None,
                                  "seconds": None, "rank": 0, "error": None}]


# -- drawing --------------------------------------------------------------------------------------


def test_draw_every_kind(tmp_path: Path) -> None:
    out = tmp_path / "timeline.png"
    drawn = draw_timeline(_handwritten(), out, title="every kind")
    assert drawn.path == out and drawn.events == len(_handwritten()) and drawn.ranks == (0,)
    # training and capture first; tiers as their first flush began; ram (marks only) last.
    assert drawn.lanes == ("training", "capture", "nvme", "pfs", "ram")
    assert drawn.seconds == pytest.approx(7.5)  # from the first save call's start to the failed restore
    assert _has_colour(_png(out), FAILED_RED)


def test_a_run_without_failures_has_no_red(tmp_path: Path) -> None:
    out = tmp_path / "timeline.png"
    quiet = [e for e in _handwritten() if not e["event"].endswith("_failed")]
    draw_timeline(quiet, out)
    assert not _has_colour(_png(out), FAILED_RED)


def test_several_ranks_get_a_set_of_lanes_each(tmp_path: Path) -> None:
    out = tmp_path / "timeline.png"
    drawn = draw_timeline(_handwritten(1) + _handwritten(0), out)
    assert drawn.ranks == (0, 1)
    one = ("training", "capture", "nvme", "pfs", "ram")
    assert drawn.lanes == tuple(f"rank {r}: {lane}" for r in (0, 1) for lane in one)
    single = draw_timeline(_handwritten(), tmp_path / "single.png")
    assert _png(out).shape[0] > _png(tmp_path / "single.png").shape[0]  # twice the lanes, a taller image
    assert single.lanes == one


def test_draw_as_svg(tmp_path: Path) -> None:
    out = tmp_path / "timeline.svg"
    draw_timeline(_handwritten(), out)
    assert out.read_text(encoding="utf-8").lstrip().startswith("<?xml") and "<svg" in out.read_text(encoding="utf-8")


def test_nothing_to_draw(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no events to draw"):
        draw_timeline([{"time": T0, "event": "a_newer_kind"}], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_without_matplotlib_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # what an import finds missing
    with pytest.raises(ConfigError, match=r"pip install 'tierckpt\[plot\]'"):
        draw_timeline(_handwritten(), tmp_path / "x.png")


def test_cli_without_matplotlib_says_what_to_install_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    events = _write(tmp_path / "events.jsonl", _handwritten())
    assert main(["timeline", str(events), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err == (
        "tierckpt timeline: matplotlib (which draws the timeline) is not installed: pip install 'tierckpt[plot]' "
        "(in a clone of tierckpt: .venv/bin/pip install matplotlib)\n"
    )
    assert err.count("timeline:") == 1  # the prefix once (issue 55)
    assert not (tmp_path / "x.png").exists()


# -- a real run -----------------------------------------------------------------------------------


def test_a_real_run_writes_events_that_draw(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    events_file = tmp_path / "events.jsonl"
    config = {
        "tiers": [{"name": "ram", "type": "memory"}, {"name": "nvme", "type": "filesystem", "path": str(tmp_path / "nvme")}],
        "events": str(events_file),
    }
    steps = [1, 2, 3, 4]
    with Checkpointer(config) as ckpt:
        for step in steps:
            ckpt.save_sync(step, {"w": torch.arange(10.0)})
        ckpt.wait_sync()
    assert events_file.exists(), "the Checkpointer wrote no events file: is config events: wired in?"
    events = read_events(events_file)
    for kind in ("save", "captured"):
        assert [e["step"] for e in events if e["event"] == kind] == steps, kind
    on_nvme = {e["step"]: e["event"] for e in events if e["tier"] == "nvme"}
    assert set(on_nvme) == set(steps) and set(on_nvme.values()) <= {"flushed", "passed_over"}
    assert on_nvme[steps[-1]] == "flushed"  # wait() flushes the newest

    out = tmp_path / "real.png"
    assert main(["timeline", str(events_file), "-o", str(out)]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed.startswith(f"drew {len(events)} events of rank 0 over ")
    assert printed.endswith(f"(lanes training, capture, nvme) to {out}")
    _png(out)


# -- the command line -----------------------------------------------------------------------------


def test_cli_draws_several_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = _write(tmp_path / "events-0.jsonl", _handwritten(0), tail='{"time": 17')
    second = _write(tmp_path / "events-1.jsonl", _handwritten(1))
    out = tmp_path / "both.png"
    assert main(["timeline", str(first), str(second), "-o", str(out), "--title", "two ranks"]) == 0
    printed = capsys.readouterr()
    assert printed.err == ""
    n = 2 * len(_handwritten())
    assert printed.out == f"drew {n} events of ranks 0, 1 over 7.5 s (lanes training, capture, nvme, pfs, ram) to {out}\n"
    _png(out)


def test_cli_rank_keeps_one_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    both = _write(tmp_path / "events.jsonl", _handwritten(0) + _handwritten(1))
    out = tmp_path / "one.png"
    assert main(["timeline", str(both), "-o", str(out), "--rank", "1"]) == 0
    assert capsys.readouterr().out.startswith(f"drew {len(_handwritten())} events of rank 1 over 7.5 s (lanes training,")
    assert main(["timeline", str(both), "-o", str(tmp_path / "none.png"), "--rank", "7"]) == 2
    assert "no events of rank 7 (ranks there: 0, 1)" in capsys.readouterr().err
    assert not (tmp_path / "none.png").exists()


def test_cli_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = _write(tmp_path / "events.jsonl", _handwritten())
    missing = tmp_path / "missing.jsonl"
    assert main(["timeline", str(good), str(missing), "-o", str(tmp_path / "a.png")]) == 2
    assert capsys.readouterr().err == f"tierckpt timeline: {missing}: no such file\n"

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"time": 1, "event": "save"}\nnot json\n{"time": 2, "event": "save"}\n', encoding="utf-8")
    assert main(["timeline", str(bad), "-o", str(tmp_path / "a.png")]) == 2
    assert f"{bad}, line 2: not JSON" in capsys.readouterr().err

    assert main(["timeline", str(good), "-o", str(tmp_path / "a.nope")]) == 2
    assert "cannot draw this format" in capsys.readouterr().err

    empty = tmp_path / "empty.jsonl"
    empty.write_text("", encoding="utf-8")
    assert main(["timeline", str(empty), "-o", str(tmp_path / "a.png")]) == 2
    assert "no events to draw" in capsys.readouterr().err
    assert not (tmp_path / "a.png").exists()

    with pytest.raises(SystemExit) as exited:  # argparse: -o is required
        main(["timeline", str(good)])
    assert exited.value.code == 2


def test_cli_output_that_cannot_be_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = _write(tmp_path / "events.jsonl", _handwritten())
    out = tmp_path / "no-such-dir" / "a.png"
    assert main(["timeline", str(good), "-o", str(out)]) == 1
    assert capsys.readouterr().err.startswith(f"tierckpt timeline: cannot write {out}: ")
