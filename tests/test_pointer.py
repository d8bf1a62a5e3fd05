"""Pointer files (tierckpt.integrations.pointer): atomic, and no pile of temporaries after crashes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tierckpt.errors import CorruptCheckpointError
from tierckpt.integrations.pointer import aside_name, read_pointer, remove_leftovers, write_pointer

HOST = socket.gethostname().replace("-", "_")


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: the pid names no process any more
    return child.pid


def test_a_pointer_names_its_step_and_replaces_the_one_before(tmp_path: Path) -> None:
    write_pointer(tmp_path / "last.ckpt", 8, "nvme")
    write_pointer(tmp_path / "last.ckpt", 16, "nvme")
    assert read_pointer(tmp_path / "last.ckpt") == 16
    assert os.listdir(tmp_path) == ["last.ckpt"]


def test_a_killed_writers_temporary_file_is_removed_by_the_next_write_and_a_live_ones_is_kept(tmp_path: Path) -> None:
    dead = tmp_path / f".tierckpt-pointer-{HOST}-{_dead_pid()}-1.tmp"
    live = tmp_path / f".tierckpt-pointer-{HOST}-{os.getpid()}-999.tmp"  # a thread of ours, mid-write
    elsewhere = tmp_path / ".tierckpt-pointer-otherhost-1-1.tmp"  # its writer's fate is unknown here
    for leftover in (dead, live, elsewhere):
        leftover.write_bytes(b"")  # what a SIGKILL between open() and write() leaves
    write_pointer(tmp_path / "epoch=0-step=8.ckpt", 8, "nvme")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, elsewhere.name, "epoch=0-step=8.ckpt"])


def test_a_killed_writers_directory_is_removed_and_only_its_own_prefix_is_judged(tmp_path: Path) -> None:
    """What the Hugging Face integration leaves when killed while writing checkpoint-N aside: a whole
    directory, removed by the next writer; a live writer's, and another prefix's, are kept."""
    dead = tmp_path / f".tierckpt-dir-{HOST}-{_dead_pid()}-checkpoint-4"
    (dead / "inner").mkdir(parents=True)
    (dead / "inner" / "trainer_state.json").write_text("{")
    old = tmp_path / f"{dead.name}.old"  # killed between its two renames
    old.mkdir()
    live = tmp_path / aside_name(".tierckpt-dir-", "checkpoint-8")
    live.mkdir()
    other = tmp_path / f".tierckpt-pointer-{HOST}-{_dead_pid()}-1.tmp"
    other.write_bytes(b"")
    remove_leftovers(tmp_path, ".tierckpt-dir-")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name])


def test_an_empty_file_is_not_a_pointer(tmp_path: Path) -> None:
    (tmp_path / "last.ckpt").write_bytes(b"")
    with pytest.raises(CorruptCheckpointError, match="not a checkpoint written through tierckpt"):
        read_pointer(tmp_path / "last.ckpt")
