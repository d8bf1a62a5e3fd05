"""What ``tierckpt verify`` finds damaged is known to every later process (tierckpt.format.damage): a
mark beside the version, read when a tier opens. A marked version is passed over by restore_latest(),
neither counted nor deleted by retention, listed as damaged by versions(), ls and status; verify takes
its mark back once the version verifies. Also: restore_latest() never starts over silently while a
rollback's abandoned versions are held."""

from __future__ import annotations

import contextlib
import errno
import io
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import logged_warnings
from tierckpt import Checkpointer, CorruptCheckpointError, NoCheckpointError
from tierckpt.cli import main as cli
from tierckpt.cliversions import _passing
from tierckpt.format import DATA_FILE, version_dirname
from tierckpt.format.damage import decode, mark_name
from tierckpt.testing import flip_bits


def _config(root: Path, keep: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "host": {"capacity": "1MiB", "snapshots": 2},
        "tiers": [{"name": "disk", "type": "filesystem", "path": str(root / "disk"), **({"keep": keep} if keep else {})}],
    }


def _save(config: dict[str, Any], steps: range | list[int], offset: float = 0.0) -> None:
    with Checkpointer(config) as ckpt:
        for step in steps:
            ckpt.save_sync(step, {"w": torch.full((4096,), step + offset)})
            ckpt.wait_sync()


def _run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli(list(argv))
    return code, out.getvalue()


def _data(root: Path, step: int) -> Path:
    return root / "disk" / version_dirname(step) / DATA_FILE.format(rank=0)


def test_a_version_verify_found_damaged_is_known_to_later_processes_until_it_verifies(tmp_path: Path) -> None:
    config = _config(tmp_path, keep={"last": 2})
    _save(config, range(1, 4))  # disk: 2, 3
    flip_bits(_data(tmp_path, 3), 8)
    code, out = _run("verify", str(tmp_path / "disk"))
    assert code == 1 and "DAMAGED" in out
    mark = decode((tmp_path / "disk" / mark_name(3)).read_bytes())
    assert mark is not None and "checksum mismatch" in mark.why
    code, out = _run("ls", str(tmp_path / "disk"))
    assert code == 1
    line = next(row for row in out.splitlines() if row.startswith(version_dirname(3)))
    assert "DAMAGED (tierckpt verify" in line and "checksum mismatch" in line
    code, out = _run("status", str(tmp_path / "disk"))
    assert code == 1 and f"{version_dirname(3)}  DAMAGED  found damaged by tierckpt verify" in out

    with Checkpointer(config) as ckpt:  # a new process's tier reads the mark at open
        assert [(v.step, (v.damaged or "")[:32]) for v in ckpt.versions()] == [(2, ""), (3, "found damaged by tierckpt verify")]
        with logged_warnings("does not verify") as said:
            restored = ckpt.restore_latest_sync()
        # Passed over without a read, and said so once, naming what verify found.
        assert restored is not None and restored.step == 2
        assert len(said) == 1 and "step 3 on tier 'disk'" in said[0] and "found damaged by tierckpt verify" in said[0]
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
            ckpt.restore_sync(3)  # asked for outright: read again, and the damage named
        for step in (4, 5):
            ckpt.save_sync(step, {"w": torch.full((4096,), float(step))})
            ckpt.wait_sync()
        # keep: {last: 2} counts 4 and 5; the marked 3 is neither counted nor deleted.
        assert [(v.step, v.damaged is not None) for v in ckpt.versions() if v.tier == "disk"] == [(3, True), (4, False), (5, False)]

    flip_bits(_data(tmp_path, 3), 8)  # the same bits again: the bytes are as saved
    code, out = _run("verify", str(tmp_path / "disk"))
    assert code == 0 and not (tmp_path / "disk" / mark_name(3)).exists()
    with Checkpointer(config) as ckpt:
        assert [v.damaged for v in ckpt.versions()] == [None, None, None]
        restored = ckpt.restore_sync(3)
        assert torch.equal(restored.state["w"], torch.full((4096,), 3.0))


def test_a_mark_of_an_earlier_save_of_the_step_says_nothing_of_the_new_one(tmp_path: Path) -> None:
    config = _config(tmp_path)
    _save(config, [1, 2])
    flip_bits(_data(tmp_path, 2), 8)
    assert _run("verify", str(tmp_path / "disk"))[0] == 1
    with Checkpointer(config) as ckpt:
        ckpt.restore_sync(1)
        ckpt.save_sync(2, {"w": torch.full((4096,), 20.0)})  # step 2 saved again: another save
        ckpt.wait_sync()
    with Checkpointer(config) as ckpt:  # its keeper removes the mark of the earlier save at open
        assert [v.damaged for v in ckpt.versions()] == [None, None]
        assert not (tmp_path / "disk" / mark_name(2)).exists()
        restored = ckpt.restore_latest_sync()
        assert restored is not None and restored.step == 2 and torch.equal(restored.state["w"], torch.full((4096,), 20.0))


def test_verify_marks_wrong_bytes_but_not_a_read_that_failed() -> None:
    wrong = CorruptCheckpointError("checksum mismatch")
    failed = CorruptCheckpointError("cannot be read")
    failed.__cause__ = OSError(errno.EIO, "Input/output error")
    missing = CorruptCheckpointError("is missing")
    missing.__cause__ = FileNotFoundError(errno.ENOENT, "gone")
    assert [_passing(e) for e in (wrong, failed, missing)] == [False, True, False]


def test_restore_latest_does_not_start_over_while_abandoned_versions_are_held(tmp_path: Path) -> None:
    config = _config(tmp_path)
    _save(config, range(1, 6))  # 1..5
    with Checkpointer(config) as ckpt:
        ckpt.restore_sync(2)
        ckpt.save_sync(3, {"w": torch.full((4096,), 1003.0)})  # 4 and 5 are abandoned
        ckpt.wait_sync()
    for step in (1, 2, 3):  # every version of the direction being trained damaged
        flip_bits(_data(tmp_path, step), 8)
    with Checkpointer(config) as ckpt:
        with logged_warnings("does not verify"), pytest.raises(NoCheckpointError) as raised:
            ckpt.restore_latest_sync()
        text = str(raised.value)
        assert "abandoned" in text and "step(s) 5, 4" in text and "restore(step)" in text
        restored = ckpt.restore_sync(5)  # loaded explicitly
        assert torch.equal(restored.state["w"], torch.full((4096,), 5.0))
