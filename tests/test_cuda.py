"""The CUDA capture stage on a real GPU: side stream, pinned pool, the lazy barrier, mixed devices.

Skipped without a CUDA device. Copies are held back deterministically: a long kernel
(``torch.cuda._sleep``) queued on the saving stream before ``save()`` keeps the copy stream waiting
(it waits on the event ``save()`` records there), so a test knows the copy is still pending while it
checks what the barrier did, and whether a write queued afterwards reached the snapshot.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tierckpt import Checkpointer, ConfigError, CorruptCheckpointError, FlushError
from tierckpt._buffers import address, aligned_buffer
from tierckpt.capture import pinning
from tierckpt.capture.copier import TornCaptureError
from tierckpt.testing.inspect import captured_done, device_copies_of, host_pool, pending_device_snapshots, wait_device_queued

from helpers import assert_bitwise, fs_tier, logged_warnings, tier_config

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SLEEP_CYCLES = 2_000_000_000  # ~1 s of GPU time: far longer than the host takes to reach its checks
DEADLINE_S = 120.0  # a deadlock guard only


def config(tmp_path: Path, *, capacity: str = "1GiB", snapshots: int = 2, **host: Any) -> dict[str, Any]:
    return tier_config(fs_tier("nvme", tmp_path / "nvme"), capacity=capacity, snapshots=snapshots, **host)


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], device: str = "cuda") -> torch.Tensor:
    """Random bits of any dtype (bools 0/1), made without a kernel of that dtype."""
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, device=device).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = int(np.prod(shape)) if shape else 1
    return torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, device=device).view(dtype).reshape(shape)


def every_dtype() -> list[torch.dtype]:
    names = [
        "float32", "float64", "float16", "bfloat16", "complex64", "complex128", "int8", "int16", "int32",
        "int64", "uint8", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2",
    ]
    return [getattr(torch, n) for n in names if hasattr(torch, n)]


# -- round trips ----------------------------------------------------------------------------------------


def cuda_state() -> dict[str, torch.Tensor]:
    state = {str(dtype): random_tensor(dtype, (257, 3)) for dtype in every_dtype()}
    state["transposed"] = random_tensor(torch.float32, (64, 48)).t()
    state["sliced"] = random_tensor(torch.float16, (100,))[7:91:2]
    state["conjugate"] = torch.randn(300, 2, dtype=torch.complex64, device="cuda").conj()  # a lazy conj bit
    state["scalar"] = random_tensor(torch.float64, ())
    state["empty"] = random_tensor(torch.int32, (0, 5))
    state["large"] = random_tensor(torch.bfloat16, (96 << 20,))  # bigger than a CPU copy piece
    return state


def test_cuda_tensors_of_every_dtype_round_trip_bitwise(tmp_path: Path) -> None:
    state = cuda_state()
    with Checkpointer(config(tmp_path)) as ckpt:
        handle = ckpt.save_sync(1, state)
        assert handle.committed_sync("nvme", timeout=DEADLINE_S)
        from_ram = ckpt.restore_latest_sync()
        template = {k: torch.empty_like(v) for k, v in state.items()}
        into_template = ckpt.restore_latest_sync(template)
    assert from_ram is not None and from_ram.tier == "ram"
    assert into_template is not None
    for key, want in state.items():
        assert from_ram.state[key].device.type == "cpu"  # no template: new CPU tensors
        assert_bitwise(from_ram.state[key], want, devices=False)
        assert into_template.state[key] is template[key]
        assert template[key].device == want.device
        assert_bitwise(template[key], want, devices=False)


@pytest.mark.parametrize("verify_first", [False, True], ids=["through the pinned ring", "staged, then copied"])
def test_restore_from_disk_into_cuda_templates(tmp_path: Path, verify_first: bool) -> None:
    state = cuda_state()
    with Checkpointer(config(tmp_path)) as ckpt:
        assert ckpt.save_sync(1, state).committed_sync("nvme", timeout=DEADLINE_S)
    template = {k: torch.empty_like(v) for k, v in state.items()}
    with Checkpointer(config(tmp_path)) as ckpt:  # a new process's RAM is empty: this reads the disk
        restored = ckpt.restore_latest_sync(template, verify_first=verify_first)
    assert restored is not None and restored.tier == "nvme"
    for key, want in state.items():
        assert restored.state[key] is template[key]
        assert_bitwise(template[key], want, devices=False)


def test_a_damaged_chunk_never_reaches_a_cuda_template(tmp_path: Path) -> None:
    from tierckpt.format import MANIFEST_FILE, Manifest, version_dirname
    from tierckpt.testing import flip_bits

    state = {"a": random_tensor(torch.float32, (1 << 20,)), "b": random_tensor(torch.float32, (1 << 20,))}
    with Checkpointer(config(tmp_path)) as ckpt:
        assert ckpt.save_sync(1, state).committed_sync("nvme", timeout=DEADLINE_S)
    version = tmp_path / "nvme" / version_dirname(1)
    record = next(r for r in Manifest.decode((version / MANIFEST_FILE).read_bytes()).records if r.key == "['b']")
    flip_bits(version / record.file, record.chunks[0].offset + 100, 0x01)
    template = {k: torch.zeros_like(v) for k, v in state.items()}
    with Checkpointer(config(tmp_path)) as ckpt, logged_warnings(match="does not verify"):
        with pytest.raises(CorruptCheckpointError, match="partly overwritten"):
            ckpt.restore_latest_sync(template)
    assert_bitwise(template["a"], state["a"], devices=False)  # verified, copied through the ring
    assert not template["b"].any()  # failed in the ring's host buffer: nothing of it was copied


def test_mixed_devices_round_trip_each_to_its_templates_device(tmp_path: Path) -> None:
    devices = [torch.device("cuda", i) for i in range(min(torch.cuda.device_count(), 2))]
    state: dict[str, Any] = {"cpu": torch.randn(1000), "array": np.arange(100, dtype=np.int16), "step": 7}
    for device in devices:
        state[f"on {device}"] = random_tensor(torch.float32, (4096, 33), device=str(device))
    with Checkpointer(config(tmp_path)) as ckpt:
        assert ckpt.save_sync(1, state).committed_sync("nvme", timeout=DEADLINE_S)
        template = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else np.zeros_like(v) if isinstance(v, np.ndarray) else v) for k, v in state.items()}
        restored = ckpt.restore_latest_sync(template)
    assert restored is not None and restored.state["step"] == 7
    assert np.array_equal(restored.state["array"], state["array"])
    for key, want in state.items():
        if isinstance(want, torch.Tensor):
            assert restored.state[key].device == want.device
            assert_bitwise(restored.state[key], want, devices=False)


# -- the lazy barrier ------------------------------------------------------------------------------------


def test_an_optimizer_step_right_after_save_does_not_change_the_checkpoint(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 2048)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    with Checkpointer(config(tmp_path)) as ckpt:
        ckpt.attach(optimizer)
        model(torch.randn(64, 2048, device="cuda")).square().sum().backward()
        optimizer.step()  # the moments exist from here on
        model(torch.randn(64, 2048, device="cuda")).square().sum().backward()
        before = {k: v.cpu() for k, v in model.state_dict().items()}
        torch.cuda._sleep(SLEEP_CYCLES)  # the copies cannot start before this kernel ends
        handle = ckpt.save_sync(1, {"model": model.state_dict(), "optim": optimizer.state_dict()})
        optimizer.step()  # its pre-hook is the barrier
        # The barrier ordered the streams; it did not wait for the copy on the host.
        assert not captured_done(handle)
        after = {k: v.cpu() for k, v in model.state_dict().items()}
        assert handle.captured_sync(DEADLINE_S) is True
        restored = ckpt.restore_latest_sync()
    assert restored is not None
    for key, want in before.items():
        assert_bitwise(restored.state["model"][key], want, devices=False)
        assert not torch.equal(after[key], want)  # the step did change the live weights


def test_a_kernel_after_wait_captured_writes_after_the_copy(tmp_path: Path) -> None:
    ema = torch.randn(32 << 20, device="cuda")
    expected = ema.cpu()
    with Checkpointer(config(tmp_path)) as ckpt:
        torch.cuda._sleep(SLEEP_CYCLES)
        handle = ckpt.save_sync(1, {"ema": ema})
        assert ckpt.wait_captured(timeout=DEADLINE_S)
        assert not captured_done(handle)
        ema.mul_(0.5).add_(1.0)  # queued behind the copy on this stream
        assert handle.captured_sync(DEADLINE_S) is True
        restored = ckpt.restore_latest_sync()
    assert restored is not None
    assert_bitwise(restored.state["ema"], expected, devices=False)
    assert not torch.equal(ema.cpu(), expected)


def test_wait_captured_host_blocks_until_the_device_copies_are_done(tmp_path: Path) -> None:
    x = torch.randn(16 << 20, device="cuda")
    with Checkpointer(config(tmp_path)) as ckpt:
        torch.cuda._sleep(SLEEP_CYCLES)
        ckpt.save_sync(1, {"x": x})
        assert ckpt.wait_captured(timeout=DEADLINE_S, host=True)
        devices = device_copies_of(ckpt)
        assert devices is not None and pending_device_snapshots(devices) == []


def test_a_write_without_the_barrier_fails_the_capture(tmp_path: Path) -> None:
    x = torch.zeros(32 << 20, device="cuda")
    with Checkpointer(config(tmp_path)) as ckpt:
        torch.cuda._sleep(SLEEP_CYCLES)
        handle = ckpt.save_sync(1, {"x": x})
        x.add_(1.0)  # no wait_captured(): this may land before the copy
        with pytest.raises(FlushError) as info:
            handle.captured_sync(DEADLINE_S)
        assert isinstance(info.value.__cause__, TornCaptureError)
        with pytest.raises(FlushError):
            ckpt.save_sync(2, {"x": x})  # reported once at the next save
        assert ckpt.save_sync(3, {"x": x}).committed_sync("nvme", timeout=DEADLINE_S)


def test_a_write_queued_before_the_barrier_fails_the_capture(tmp_path: Path) -> None:
    x = torch.zeros(32 << 20, device="cuda")
    with Checkpointer(config(tmp_path)) as ckpt:
        torch.cuda._sleep(SLEEP_CYCLES)
        handle = ckpt.save_sync(1, {"x": x})
        devices = device_copies_of(ckpt)
        assert devices is not None
        wait_device_queued(devices, DEADLINE_S)  # the copy is queued (behind the sleep)
        x.add_(1.0)  # unordered with the copy: the barrier comes only after it
        assert ckpt.wait_captured(timeout=DEADLINE_S)
        with pytest.raises(FlushError) as info:
            handle.captured_sync(DEADLINE_S)
        assert isinstance(info.value.__cause__, TornCaptureError)
        with pytest.raises(FlushError):
            ckpt.wait_sync()  # reported once more, by the next wait


def test_a_source_dropped_after_save_is_not_reused_before_its_copy(tmp_path: Path) -> None:
    n = 32 << 20
    with Checkpointer(config(tmp_path)) as ckpt:
        torch.cuda._sleep(SLEEP_CYCLES)
        x = torch.full((n,), 7.0, device="cuda")
        handle = ckpt.save_sync(1, {"x": x})
        del x
        y = torch.full((n,), 9.0, device="cuda")  # would take x's block, were it free
        assert handle.captured_sync(DEADLINE_S) is True
        restored = ckpt.restore_latest_sync()
    assert restored is not None and bool((restored.state["x"] == 7.0).all())
    assert bool((y == 9.0).all())


# -- the pinned pool ---------------------------------------------------------------------------------------


def test_the_pool_is_pinned_under_auto_and_pageable_under_false(tmp_path: Path) -> None:
    x = random_tensor(torch.float32, (1 << 20,))
    with Checkpointer(config(tmp_path / "auto")) as ckpt:
        assert ckpt.pinned is True
        assert host_pool(ckpt).memory.is_pinned()
    with Checkpointer(config(tmp_path / "off", pinned=False)) as ckpt:
        assert ckpt.pinned is False
        assert not host_pool(ckpt).memory.is_pinned()
        assert ckpt.save_sync(1, {"x": x}).captured_sync(DEADLINE_S)  # pageable copies still work
        restored = ckpt.restore_latest_sync()
    assert restored is not None
    assert_bitwise(restored.state["x"], x, devices=False)


def test_a_pool_sized_to_the_state_is_pinned_at_the_first_save_and_grows_for_a_larger_one(tmp_path: Path) -> None:
    small, large = random_tensor(torch.float32, (1 << 10,)), random_tensor(torch.float32, (1 << 20,))
    unset = {"tiers": [{"name": "ram", "type": "memory", "keep": {"last": 1}}, fs_tier("nvme", tmp_path / "nvme")]}
    with Checkpointer(unset) as ckpt:
        pool = host_pool(ckpt)
        assert pool.capacity_bytes == 0 and ckpt.pinned is False  # nothing mapped before the first save
        assert ckpt.save_sync(1, {"x": small}).committed_sync("nvme", DEADLINE_S)
        assert ckpt.pinned is True and pool.memory.is_pinned()
        assert ckpt.save_sync(2, {"x": large}).committed_sync("nvme", DEADLINE_S)  # new, larger slots, pinned too
        assert ckpt.pinned is True and pool.slots[0].size >= large.nbytes
        # Step 1's layout again: its copies go to the new slots, never to views kept of the old ones.
        assert ckpt.save_sync(3, {"x": small + 1}).committed_sync("nvme", DEADLINE_S)
        for step, want in ((1, small), (2, large), (3, small + 1)):
            assert_bitwise(ckpt.restore_sync(step).state["x"], want, devices=False)


def test_a_refused_registration_falls_back_and_leaves_no_cuda_error(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    buffer = aligned_buffer(1 << 20)
    view = memoryview(buffer)
    at = address(view)
    assert pinning.pin(at, 1 << 20, "auto") is True
    try:
        monkeypatch.setattr(pinning, "_warned", False)
        with caplog.at_level(logging.WARNING, logger="tierckpt"):
            assert pinning.pin(at, 1 << 20, "auto") is False  # already registered: a real CUDA error
        assert "pageable" in caplog.text
        # The error was cleared: the next kernel launch does not report it as its own.
        assert torch.ones(4, device="cuda").add_(1).sum().item() == 8
        with pytest.raises(ConfigError, match="host.pinned"):
            pinning.pin(at, 1 << 20, True)
        assert torch.ones(4, device="cuda").sum().item() == 4
    finally:
        pinning.unpin(at)
        view.release()
