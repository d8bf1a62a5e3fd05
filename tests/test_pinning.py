"""Page-locking the host pool (``host.pinned``) on any machine: the CUDA runtime's answer is injected.

The real registration runs in tests/test_cuda.py on a GPU; here the decisions around it are checked:
when it is tried, what a refusal does under auto/true/false, that it is undone before the pool is
unmapped, and that a RAM tier's directory is free again after a refused start.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import Checkpointer, ConfigError
from tierckpt.capture import pinning
from tierckpt.testing.inspect import host_pool

from helpers import fs_tier, memory_tier, tier_config

_EMEM = 2  # cudaErrorMemoryAllocation


def config(tmp_path: Path, pinned: Any = "auto", ram_path: Path | None = None) -> dict[str, Any]:
    ram = memory_tier() if ram_path is None else memory_tier(path=str(ram_path))
    return tier_config(fs_tier("nvme", tmp_path / "nvme"), pinned=pinned, ram=ram)


class FakeRuntime:
    """Stands in for cudaHostRegister/Unregister and the error reset; records every call."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, result: int) -> None:
        self.result = result
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.cleared = 0
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(pinning, "_register", self._register)
        monkeypatch.setattr(pinning, "_unregister", self._unregister)
        monkeypatch.setattr(pinning, "clear_error", self._clear)
        monkeypatch.setattr(pinning, "_warned", False)

    def _register(self, address: int, nbytes: int) -> int:
        self.registered.append((address, nbytes))
        return self.result

    def _unregister(self, address: int) -> int:
        self.unregistered.append(address)
        return 0

    def _clear(self) -> None:
        self.cleared += 1


def test_without_cuda_auto_and_false_stay_pageable_and_true_is_a_config_error(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks a machine without CUDA")
    for pinned in ("auto", False):
        with Checkpointer(config(tmp_path, pinned)) as ckpt:
            assert ckpt.pinned is False
            assert ckpt.save_sync(1, {"x": torch.arange(10)}).committed_sync("nvme", timeout=30)
    with pytest.raises(ConfigError, match="host.pinned is true but CUDA is not available") as info:
        Checkpointer(config(tmp_path, True))
    assert info.value.key == "host.pinned"


def test_each_slot_is_pinned_in_the_background_and_unpinned_at_close(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = FakeRuntime(monkeypatch, result=0)
    ckpt = Checkpointer(config(tmp_path))
    try:
        assert ckpt.pinned is True  # waits for the background preparation (tierckpt.capture.prepare)
        pool = host_pool(ckpt)
        base, slot = pool.memory.data_ptr(), pool.slot_size
        assert runtime.registered == [(base, slot), (base + slot, slot)]  # one registration per slot
        assert ckpt.save_sync(1, {"x": torch.arange(10)}).committed_sync("nvme", timeout=30)
        assert runtime.unregistered == []
    finally:
        ckpt.close_sync()
    assert sorted(runtime.unregistered) == [base, base + slot]
    assert runtime.cleared == 0


def test_a_refused_registration_under_auto_falls_back_clears_the_error_and_warns_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    runtime = FakeRuntime(monkeypatch, result=_EMEM)
    with caplog.at_level(logging.WARNING, logger="tierckpt"):
        for attempt in range(2):
            with Checkpointer(config(tmp_path / str(attempt))) as ckpt:
                assert ckpt.pinned is False
                assert ckpt.save_sync(1, {"x": torch.arange(10)}).committed_sync("nvme", timeout=30)
                restored = ckpt.restore_latest_sync()
                assert restored is not None and torch.equal(restored.state["x"], torch.arange(10))
    assert len(runtime.registered) == 2 and runtime.cleared == 2
    assert runtime.unregistered == []  # nothing was pinned: nothing to undo
    warnings = [r.getMessage() for r in caplog.records if "page-locking" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "slot 0 (4MiB) of the host pool failed" in warnings[0] and f"cudaError {_EMEM}" in warnings[0] and "pageable" in warnings[0]


def test_a_refused_registration_under_true_is_raised_by_save_and_restore_still_works(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ram = tmp_path / "shm"
    with Checkpointer(config(tmp_path, ram_path=ram)) as ckpt:
        assert ckpt.save_sync(1, {"x": torch.arange(10)}).committed_sync("nvme", timeout=30)
    runtime = FakeRuntime(monkeypatch, result=_EMEM)
    with Checkpointer(config(tmp_path, True, ram_path=ram)) as ckpt:
        restored = ckpt.restore_latest_sync()  # the pool is pinned in the background: restores go on
        assert restored is not None and torch.equal(restored.state["x"], torch.arange(10))
        assert ckpt.pinned is False  # waits for the preparation, which was refused
        for step in (2, 3):  # every save says why, and saves nothing
            with pytest.raises(ConfigError, match=f"cudaError {_EMEM}.*host.pinned: auto") as info:
                ckpt.save_sync(step, {"x": torch.arange(10)})
            assert info.value.key == "host.pinned"
        assert runtime.cleared == 1 and runtime.unregistered == []
    assert [v.step for v in ckpt_versions(tmp_path, ram)] == [1]
    runtime.result = 0
    with Checkpointer(config(tmp_path, True, ram_path=ram)) as ckpt:  # the directory's lock was let go
        assert ckpt.pinned is True
        assert ckpt.save_sync(2, {"x": torch.arange(10)}).committed_sync("nvme", timeout=30)


def ckpt_versions(tmp_path: Path, ram: Path) -> list:
    with Checkpointer(config(tmp_path, False, ram_path=ram)) as ckpt:
        return [v for v in ckpt.versions() if v.tier == "nvme"]


def test_pinned_false_never_asks_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = FakeRuntime(monkeypatch, result=0)
    with Checkpointer(config(tmp_path, False)) as ckpt:
        assert ckpt.pinned is False
    assert runtime.registered == [] and runtime.unregistered == []


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_the_anonymous_pool_is_left_out_of_forked_children(tmp_path: Path) -> None:
    with Checkpointer(config(tmp_path)) as ckpt:
        # "dc": do not copy on fork; a pinned pool would otherwise be copied into every DataLoader worker.
        assert "dc" in _vm_flags(host_pool(ckpt).memory.data_ptr())
    with Checkpointer(config(tmp_path, ram_path=tmp_path / "shm")) as ckpt:
        assert "dc" not in _vm_flags(host_pool(ckpt).memory.data_ptr())  # shared: a fork shares it, never copies

