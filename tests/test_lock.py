"""One Checkpointer per tier directory: a second one gets a clear error, a killed holder frees it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import Checkpointer, ConfigError
from tierckpt.format import version_dirname

from helpers import ram_fs


def _config(root: Path, name: str = "nvme") -> dict[str, Any]:
    return ram_fs(root, name=name, capacity="4MiB")


def test_a_second_checkpointer_on_a_directory_in_use_is_refused_and_touches_nothing(tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    with Checkpointer(_config(root)) as first:
        assert first.save_sync(1, {"w": torch.ones(10)}).committed_sync("nvme", timeout=60)
        # What an open must not sweep while its owner is alive: a write in progress.
        in_flight = root / f".tmp-{version_dirname(2)}-0123456789ab"
        in_flight.mkdir()
        with pytest.raises(ConfigError) as info:
            Checkpointer(_config(root, name="other"))
        message = str(info.value)
        assert "tier 'other'" in message and str(root) in message
        assert f"in use by another Checkpointer (pid {os.getpid()})" in message
        assert info.value.key == "tiers.other.path"
        assert in_flight.is_dir()
        assert first.save_sync(2, {"w": torch.full((10,), 2.0)}).committed_sync("nvme", timeout=60)
    in_flight.rmdir()
    with Checkpointer(_config(root)) as again:  # released at close
        restored = again.restore_latest_sync()
        assert restored is not None and restored.step == 2


_HOLDER = textwrap.dedent(
    """
    import sys, torch
    from tierckpt import Checkpointer
    config = {"host": {"capacity": "4MiB"}, "tiers": [{"name": "ram", "type": "memory"},
              {"name": "nvme", "type": "filesystem", "path": sys.argv[1]}]}
    ckpt = Checkpointer(config)
    assert ckpt.save_sync(1, {"w": torch.ones(10)}).committed_sync("nvme", timeout=60)
    print("holding", flush=True)
    sys.stdin.read()  # until killed
    """
)


def test_a_killed_holder_frees_the_directory(tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    with subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(root)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
            with pytest.raises(ConfigError, match=rf"in use by another Checkpointer \(pid {holder.pid}\)"):
                Checkpointer(_config(root))
        finally:
            holder.send_signal(signal.SIGKILL)
            holder.wait(timeout=60)
    with Checkpointer(_config(root)) as ckpt:  # no stale lock survives the process
        restored = ckpt.restore_latest_sync()
        assert restored is not None and restored.step == 1
