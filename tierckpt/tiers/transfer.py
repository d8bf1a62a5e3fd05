"""One rank sends another its part of a version, in a restore: what a peer tier's recovery
(:mod:`tierckpt.tiers.peer.recovery`, a copy a peer holds) and a node-local tier's fetch from another
node (:mod:`tierckpt.tiers.nodelocal.fetch`, a part on that node's disk) share.

The holder sends a header (the manifest's length and the data's; -1 when it cannot serve), the
manifest, then every chunk in record order (:mod:`tierckpt.tiers.wire`). The fetching rank
checks the header and the manifest against each other before it allocates anything for the chunks,
then receives each chunk into where the copy is kept and verifies it on the way in. Every rank knows
the plan (who fetches from whom) from the same exchange, so each transfer has exactly one sender and
one receiver.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Protocol, TypeVar

import torch

from tierckpt.config import TierConfig
from tierckpt.errors import CorruptCheckpointError
from tierckpt.format import Manifest
from tierckpt.format.manifest import MAX_MANIFEST_BYTES
from tierckpt.ranks.group import RankGroup
from tierckpt.tiers.stored.check import check_records
from tierckpt.tiers import wire

__all__ = ["Ranked", "announce", "exchange", "receive_announced", "refuse"]

log = logging.getLogger("tierckpt")

T = TypeVar("T")


class Ranked(Protocol):
    """What a transfer uses of the tier whose ranks send each other versions (named by what it does:
    the tiers make their recoveries from the modules that use this, and are not imported by them)."""

    @property
    def name(self) -> str: ...
    @property
    def config(self) -> TierConfig: ...
    @property
    def executor(self) -> Any: ...
    @property
    def group(self) -> RankGroup: ...


async def exchange(
    tier: Ranked, step: int, fetchers: dict[int, int], serve: Callable[[int, int], None], fetch: Callable[[int], T], *, what: str, source: Callable[[int], str]
) -> T | None:
    """Serve what this rank sends of ``step`` and fetch this rank's own part, at once (``fetchers``:
    rank -> the rank it fetches from, group positions; the same plan on every rank).

    ``serve(owner, dst)`` sends ``owner``'s part to global rank ``dst``; ``fetch(src)`` receives this
    rank's from global rank ``src`` and returns what it keeps. ``what`` names the thing in messages
    ("copy", "part"), ``source(server)`` the place it comes from ("rank 3", "node b (rank 3)").

    Returns what ``fetch`` returned, or None when this rank fetches nothing. A failure to serve is
    logged (its fetching rank raises on its side); what this rank serves is served all the same.

    Raises:
        CorruptCheckpointError: this rank's fetch failed (the holder could not serve it, or it did
            not arrive whole).
    """
    group = tier.group
    me = group.rank
    serving = [asyncio.to_thread(serve, owner, group.ranks[owner]) for owner, server in sorted(fetchers.items()) if server == me]
    fetching = asyncio.to_thread(fetch, group.ranks[fetchers[me]]) if me in fetchers else None
    fetched, failed = await wire.transfers(fetching, serving)
    for exc in failed:
        log.warning("tier %r: serving a %s of step %d failed: %s", tier.name, what, step, exc)
    if fetching is None:
        return None
    if isinstance(fetched, BaseException):
        if isinstance(fetched, CorruptCheckpointError):
            raise fetched
        raise CorruptCheckpointError(
            f"tier {tier.name!r}: fetching rank {me}'s {what} of step {step} from {source(fetchers[me])} failed: {fetched}",
            tier=tier.name,
            step=step,
        ) from fetched
    return fetched


def refuse(dst: int, bulk: Any, tag: int) -> None:
    """Tell the rank fetching from this one that nothing comes (it raises, and sends nothing back)."""
    wire.send(torch.tensor([-1, 0], dtype=torch.int64).numpy().data, dst, bulk, tag)


def announce(encoded: bytes, size: int, dst: int, bulk: Any, tag: int) -> None:
    """Send the header and the manifest (``encoded``) of a copy of ``size`` data bytes; its chunks follow."""
    wire.send(torch.tensor([len(encoded), size], dtype=torch.int64).numpy().data, dst, bulk, tag)
    wire.send(memoryview(bytearray(encoded)), dst, bulk, tag)


def receive_announced(src: int, bulk: Any, tag: int, *, tier: str, step: int, holder: str, what: str) -> tuple[bytes, Manifest, int]:
    """Receive a header and manifest :func:`announce` sent; returns the manifest's bytes, the manifest
    and the data's size, checked against each other (the chunks are not received yet).

    ``holder`` and ``what`` name the sender and the thing in messages ("rank", "copy"; "node", "part").

    Raises:
        CorruptCheckpointError: the holder refused, or the header and manifest do not describe one copy
            of ``step`` (a manifest of impossible size, another step, chunks outside the data).
    """
    header = torch.zeros(2, dtype=torch.int64)
    wire.receive(header.numpy().data, src, bulk, tag)
    length, size = (int(v) for v in header.tolist())
    if length < 0:
        raise CorruptCheckpointError(f"tier {tier!r}: the {holder} holding this rank's {what} of step {step} could not serve it (see its log)", tier=tier, step=step)
    if not 0 < length <= MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"tier {tier!r}: a {what} of step {step} came with a manifest of {length} bytes", tier=tier, step=step)
    encoded = bytearray(length)
    wire.receive(memoryview(encoded), src, bulk, tag)
    manifest = Manifest.decode(bytes(encoded), tier=tier, step=step)
    end = data_end(manifest)
    if manifest.step != step or size != end:
        raise CorruptCheckpointError(f"tier {tier!r}: the {what} sent for step {step} is not one (step {manifest.step}, {size} bytes for {end})", tier=tier, step=step)
    check_records(manifest.records, {wire.COPY_FILE: size}, tier=tier, step=step)
    return bytes(encoded), manifest, size


def data_end(manifest: Manifest) -> int:
    """Where a copy's data ends: the end of its last stored chunk."""
    return max((c.offset + c.stored for r in manifest.records for c in r.chunks if c is not None), default=0)
