"""Restore: find the newest committed version across tiers, verify it, load it.

Candidates are every tier's committed versions, newest step first and, for one step, the fastest
tier first. A version that fails verification (damaged manifest, missing file, checksum mismatch)
gives a warning naming tier, step and key, and the next candidate is tried: the same step on a slower
tier, then older steps. Bytes are read in the tier's threads straight into freshly allocated CPU
tensors and verified as they land; a template's tensors are overwritten only after the whole
version has verified, so a failed attempt never leaves a half-restored model behind.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from tierckpt._buffers import tensor_bytes
from tierckpt.errors import CorruptCheckpointError, RestoreError
from tierckpt.state import Leaf, flatten, numpy_dtype, torch_dtype, unflatten
from tierckpt.format import TensorRecord
from tierckpt.tiers.base import Tier, VersionSource
from tierckpt.tiers.fsio import scratch
from tierckpt.tiers.fswrite import scratch_bytes

log = logging.getLogger("tierckpt")


@dataclass(frozen=True)
class Restored:
    """What :meth:`Checkpointer.restore_latest` returns."""

    step: int
    state: Any
    tier: str  # the tier it was read from
    metadata: dict[str, Any] = field(default_factory=dict)


def template_leaves(template: Any) -> dict[str, Leaf]:
    from tierckpt.state import format_path

    if template is None:
        return {}
    return {format_path(leaf.path): leaf for leaf in flatten(template)[1]}


async def restore_latest(tiers: Sequence[Tier], template: Any) -> Restored | None:
    by_path = template_leaves(template)
    candidates = sorted(
        ((info.step, i) for i, tier in enumerate(tiers) for info in tier.versions()),
        key=lambda c: (-c[0], c[1]),
    )
    for step, i in candidates:
        tier = tiers[i]
        try:
            lease = tier.lease(step)
        except KeyError:
            continue  # evicted from memory since the list was made
        try:
            source = await tier.read(step)
            try:
                executor = getattr(tier, "executor")
                state = await asyncio.to_thread(load, source, by_path, executor)
            finally:
                source.close()
        except CorruptCheckpointError as exc:
            message = f"tierckpt: step {step} on tier {tier.name!r} does not verify ({exc}); trying the next candidate"
            log.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
            continue
        finally:
            lease.release()
        return Restored(step, state, tier.name, dict(source.metadata))
    return None


def _destination(record: TensorRecord, source: VersionSource, template: Leaf | None) -> tuple[Any, memoryview]:
    where = f"step {source.step} on tier {source.tier!r}"
    if record.kind == "torch":
        dtype = torch_dtype(record.dtype)
        if template is not None:
            value = template.value
            if template.kind != "torch" or value.dtype != dtype or tuple(value.shape) != record.shape:
                raise RestoreError(
                    f"{record.key}: {where} holds {record.dtype}{list(record.shape)}, the template has "
                    f"{str(getattr(value, 'dtype', type(value).__name__)).removeprefix('torch.')}"
                    f"{list(getattr(value, 'shape', ()))}",
                    tier=source.tier,
                    step=source.step,
                    key=record.key,
                )
        tensor = torch.empty(record.shape, dtype=dtype)
        return tensor, tensor_bytes(tensor)
    import numpy as np

    dtype = numpy_dtype(record.dtype)
    if template is not None:
        value = template.value
        if template.kind != "numpy" or value.dtype != dtype or tuple(value.shape) != record.shape:
            raise RestoreError(
                f"{record.key}: {where} holds {record.dtype}{list(record.shape)}, the template does not match",
                tier=source.tier,
                step=source.step,
                key=record.key,
            )
    array = np.empty(record.shape, dtype=dtype)
    return array, memoryview(array.reshape(-1).view(np.uint8))


def load(source: VersionSource, templates: dict[str, Leaf], executor: concurrent.futures.Executor) -> Any:
    """Read, verify and decode every record of ``source``; returns the rebuilt state (blocking)."""
    destinations = []
    jobs = []
    for record in source.records:
        value, out = _destination(record, source, templates.get(record.key))
        if out.nbytes != record.nbytes:
            raise CorruptCheckpointError(
                f"{record.key}: {record.nbytes} stored bytes for {record.dtype}{list(record.shape)}",
                tier=source.tier,
                step=source.step,
                key=record.key,
            )
        destinations.append(value)
        for c in range(len(record.chunks)):
            start, length = record.chunk_span(c)
            jobs.append(executor.submit(_read_chunk, source, record, c, out[start : start + length]))
    errors = [f.exception() for f in jobs]
    first = next((e for e in errors if e is not None), None)
    if isinstance(first, CorruptCheckpointError) and first.key is None:
        raise CorruptCheckpointError(str(first), tier=source.tier, step=source.step) from first
    if first is not None:
        raise first
    arrays = []
    for record, value in zip(source.records, destinations):
        template = templates.get(record.key)
        if template is None:
            arrays.append(value)
        elif record.kind == "torch":
            with torch.no_grad():
                template.value.copy_(value)
            arrays.append(template.value)
        else:
            template.value[...] = value
            arrays.append(template.value)
    return unflatten(source.skeleton, arrays)


def _read_chunk(source: VersionSource, record: TensorRecord, chunk: int, out: memoryview) -> None:
    source.read_logical(record, chunk, out, scratch(scratch_bytes(record.chunk_bytes)))
