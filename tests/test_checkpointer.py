"""Checkpointer-level guarantees: barriers, torn-capture detection, tier paths, drain at exit."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tierckpt import Checkpointer, ConfigError, FlushError
from tierckpt.capture.copier import TornCaptureError
from tierckpt.testing.copies import HeldCopies, stopped_copy_threads
from tierckpt.testing.inspect import captured_done

from helpers import fs_tier, parked, tier_config


def _config(tmp_path: Path) -> dict:
    return tier_config(fs_tier("nvme", tmp_path / "nvme"), capacity="300MiB", snapshots=1, copy_threads=1)


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    # Big layers first so the copy of the small BatchNorm buffers is still queued when forward runs.
    return torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(6)], torch.nn.BatchNorm1d(2048))


def _gate(ckpt: Checkpointer) -> HeldCopies:
    """Hold the only copy thread until ``release()``, so the copy is certainly still pending."""
    return HeldCopies(ckpt, deadline_s=30)


def test_a_buffer_changed_by_forward_during_the_copy_fails_the_capture_loudly(tmp_path: Path) -> None:
    model = _model()
    with Checkpointer(_config(tmp_path)) as ckpt:
        gate = _gate(ckpt)
        handle = ckpt.save_sync(1, model.state_dict())
        model[-1](torch.randn(8, 2048))  # updates running_mean/var in place: no barrier attached
        gate.release()
        with pytest.raises(FlushError) as info:
            handle.captured_sync(timeout=30)
        assert isinstance(info.value.__cause__, TornCaptureError)
        assert "['6." in str(info.value) and "attach(module)" in str(info.value)
        # In words: the step named once, the key path as the package writes it, no nested repr.
        assert str(info.value).startswith("capturing step 1 into host memory failed: ['6."), str(info.value)
        assert str(info.value).count("step 1") == 1 and "TornCaptureError(" not in str(info.value) and "\\'" not in str(info.value)
        with pytest.raises(FlushError):
            handle.committed_sync("nvme", timeout=30)  # a failed capture never reaches a tier
        with pytest.raises(FlushError):
            ckpt.save_sync(2, {"x": torch.zeros(1)})  # reported once at the next save
        ckpt.save_sync(3, {"x": torch.zeros(1)})


def test_attach_module_makes_forward_wait_so_the_snapshot_is_consistent(tmp_path: Path) -> None:
    import threading

    model = _model()
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    with Checkpointer(_config(tmp_path)) as ckpt:
        hooks = ckpt.attach(model)
        gate = _gate(ckpt)
        handle = ckpt.save_sync(1, model.state_dict())
        forward = threading.Thread(target=model[-1], args=(torch.randn(8, 2048),))
        forward.start()
        assert parked(forward), "forward of a module with buffers must wait for the copy"
        gate.release()
        forward.join(timeout=30)
        assert handle.committed_sync("nvme", timeout=30)
        restored = ckpt.restore_latest_sync()
        assert restored is not None
        for key, value in at_save.items():
            assert torch.equal(restored.state[key], value), key
        assert not torch.equal(model[-1].running_mean, at_save["6.running_mean"])
        hooks.remove()
        # Modules without buffers got no hook: only the BatchNorm holds one.
        assert all(not m._forward_pre_hooks for m in model.modules())


class _Wrapper(torch.nn.Module):
    """Writes its child's buffers before the child's forward runs, as DistributedDataParallel does."""

    def __init__(self, child: torch.nn.Module) -> None:
        super().__init__()
        self.child = child

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for buffer in self.child.buffers():
                buffer.add_(1)
        return self.child(x)


def test_attach_holds_a_wrapper_without_buffers_that_writes_its_childrens(tmp_path: Path) -> None:
    import threading

    wrapper = _Wrapper(_model())
    at_save = {k: v.clone() for k, v in wrapper.state_dict().items()}
    with Checkpointer(_config(tmp_path)) as ckpt:
        hooks = ckpt.attach(wrapper)
        assert wrapper._forward_pre_hooks, "the root is held even without buffers of its own"
        gate = _gate(ckpt)
        handle = ckpt.save_sync(1, wrapper.state_dict())
        forward = threading.Thread(target=wrapper, args=(torch.randn(8, 2048),))
        forward.start()
        assert parked(forward), "the wrapper's forward must wait for the copy"
        gate.release()
        forward.join(timeout=30)
        assert handle.captured_sync(timeout=30)  # not torn
        restored = ckpt.restore_latest_sync()
        hooks.remove()
    assert restored is not None
    for key, value in at_save.items():
        assert torch.equal(restored.state[key], value), key
    assert not torch.equal(wrapper.child[-1].running_mean, at_save["child.6.running_mean"])


class _Rotary(torch.nn.Module):
    """A layer with a buffer its state_dict() leaves out (as a rotary embedding's ``inv_freq``)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(2048, 2048)
        self.register_buffer("inv_freq", torch.linspace(0.5, 1.5, 2048), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.inv_freq


def test_attach_holds_no_forward_whose_module_saves_no_buffer(tmp_path: Path) -> None:
    """Only persistent buffers are in the snapshot: a model whose buffers are all non-persistent gets
    no forward hook, not even on its root, and its forward runs while the copy is still held."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(6)], _Rotary())
    assert "6.inv_freq" not in model.state_dict()
    with Checkpointer(_config(tmp_path)) as ckpt:
        hooks = ckpt.attach(model)
        assert all(not m._forward_pre_hooks for m in model.modules())
        gate = _gate(ckpt)
        handle = ckpt.save_sync(1, model.state_dict())
        model(torch.randn(8, 2048))  # on this thread: a hook that waited would hold it until the gate's deadline
        assert not captured_done(handle), "forward waited for the copy"
        gate.release()
        assert handle.captured_sync(timeout=30)
        hooks.remove()


def test_attach_rejects_other_objects(tmp_path: Path) -> None:
    with Checkpointer(_config(tmp_path)) as ckpt:
        with pytest.raises(TypeError, match="optimizer or module"):
            ckpt.attach(object())  # type: ignore[arg-type]


@pytest.mark.parametrize("second", ["nvme", "nvme/inner", "."])
def test_tiers_sharing_a_directory_are_a_config_error(tmp_path: Path, second: str) -> None:
    config = {
        "tiers": [
            {"name": "nvme", "type": "filesystem", "path": str(tmp_path / "nvme")},
            {"name": "pfs", "type": "filesystem", "path": str(tmp_path / second)},
        ]
    }
    with pytest.raises(ConfigError, match="share a directory") as info:
        Checkpointer(config)
    assert info.value.tier == "pfs"


def test_a_checkpointer_dropped_without_close_is_drained_at_exit(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import gc, torch
        from tierckpt import Checkpointer
        from tierckpt.testing import slow

        def train():
            ckpt = Checkpointer({{"host": {{"capacity": "64MiB"}}, "tiers": [
                {{"name": "ram", "type": "memory"}},
                {{"name": "nvme", "type": "filesystem", "path": {str(tmp_path / "nvme")!r}}}]}},
                tier_factory=slow({{"nvme": 0.5}}))
            ckpt.save_sync(7, {{"w": torch.arange(1000)}}).captured_sync()

        train()
        gc.collect()
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert (tmp_path / "nvme" / "step-000000000007" / "manifest.msgpack").exists()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_written_on_a_side_stream_are_captured_after_their_kernels(tmp_path: Path) -> None:
    stream = torch.cuda.Stream()
    with Checkpointer(_config(tmp_path)) as ckpt, torch.cuda.stream(stream):
        x = torch.zeros(64 << 20, device="cuda")
        torch.cuda._sleep(50_000_000)  # a long kernel queued on this stream before the fill
        x.fill_(3.0)
        handle = ckpt.save_sync(1, {"x": x})
        assert handle.committed_sync("nvme", timeout=60)
        restored = ckpt.restore_latest_sync()
        assert restored is not None and bool((restored.state["x"] == 3.0).all())


def test_a_capture_that_cannot_start_is_raised_once_by_save(tmp_path: Path) -> None:
    with Checkpointer(_config(tmp_path)) as ckpt:
        with stopped_copy_threads(ckpt):  # the copy threads are gone: nothing can be enqueued
            with pytest.raises(RuntimeError, match="cannot schedule"):
                ckpt.save_sync(1, {"x": torch.zeros(4)})
        ckpt.wait_sync()  # the failure was raised by save() already: not reported a second time
        assert ckpt.save_sync(2, {"x": torch.ones(4)}).committed_sync("nvme", timeout=30)
