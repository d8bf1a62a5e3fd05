"""Where one leaf's copy comes from and goes to: a view of the live value, a view of its slot bytes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from tierckpt.capture.pool import HostPool
from tierckpt.snapshot import Entry, Snapshot
from tierckpt.state import Survey


class TornCaptureError(RuntimeError):
    """A tensor changed while it was being copied into the host slot."""


def tensor_pair(pool: HostPool, snapshot: Snapshot, value: torch.Tensor, entry: Entry, first: int = 0, stop: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slot view, source view)`` for ``dest.copy_(src)``: elements ``[first, stop)`` of a torch leaf's
    value (all of it when ``stop`` is None)."""
    dest, src = slot_tensor(pool, snapshot, entry), source_tensor(value.detach())
    if stop is not None:
        src, dest = src.reshape(-1)[first:stop], dest.reshape(-1)[first:stop]
    return dest, src


def slot_tensor(pool: HostPool, snapshot: Snapshot, entry: Entry) -> torch.Tensor:
    """The slot bytes of ``entry`` as the tensor a copy goes into (see :func:`source_tensor`)."""
    return _as_copied(pool.tensor(snapshot.slot, entry.offset, entry.nbytes, entry.dtype, entry.shape))


def source_tensor(value: torch.Tensor) -> torch.Tensor:
    """``value`` as a copy reads it: sub-byte dtypes (uint1..7, int1..7) have no copy kernel, and every
    1-byte dtype copies bitwise as uint8, at any strides."""
    return _as_copied(value)


def _as_copied(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.element_size() == 1 and tensor.dtype is not torch.uint8 else tensor


@dataclass(frozen=True)
class SaveMoment:
    """What ``save()`` saw on the caller's thread, before it returned: what the copies are checked against.

    ``versions``: each leaf's in-place version counter (-1 where it has none); ``ready``: per CUDA
    device holding a leaf, an event on the caller's current stream there (streams are per thread: the
    copies must wait for what the caller queued before ``save()``); ``on_device``: the indices of the
    leaves on a CUDA device.
    """

    versions: Sequence[int]
    ready: Mapping[torch.device, Any]
    on_device: tuple[int, ...] = ()


def moment(found: Survey) -> SaveMoment:
    """The :class:`SaveMoment` of a state ``save()`` surveyed (on the saving thread, before it returns):
    the version counters the survey read, and an event on each CUDA device's current stream."""
    ready = {}
    for index in found.on_device:
        device = found.values[index].device
        if device not in ready:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            ready[device] = event
    return SaveMoment(found.versions, ready, tuple(found.on_device))


def check_unchanged(snapshot: Snapshot, key: str, value: Any, version: int) -> None:
    """Raise if ``value`` was modified in place since ``save()`` read its version counter ``version``.

    Such a snapshot may mix two steps: fail loudly rather than store it.
    """
    if version >= 0 and value._version != version:
        raise TornCaptureError(
            f"step {snapshot.step}: {key} was modified in place while its host copy was running; "
            "call ckpt.wait_captured() before changing state outside optimizer.step(), or "
            "ckpt.attach(module) for modules whose forward updates buffers (e.g. BatchNorm statistics)"
        )
