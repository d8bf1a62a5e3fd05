"""The write plan: which chunks of a version one rank writes, with which codec, and where (pure).

Deciding is kept apart from writing (as DCP's planner is from its storage writer): :func:`plan_write`
looks only at the records, the codec each record gets on the tier and the writing rank, does no I/O,
and returns frozen :class:`WriteItem` s that a byte store's :class:`~tierckpt.storage.store.DataWriter`
executes (:mod:`tierckpt.tiers.stored.write` reads, encodes and hashes each item's bytes; the store moves them).

Two layouts:

- raw (every record uncompressed): the host slot's layout is kept. A record's owned chunks lie back to
  back from a 4 KiB-aligned start, so slot bytes and O_DIRECT scratch go to disk as they are; the
  aligned area ``[0, fixed_bytes)`` is reserved in one piece before any write. A record whose chunk
  size is not a multiple of 4 KiB cannot be written with O_DIRECT at those offsets (a padded tail
  would overwrite the next chunk's head): its chunks are packed after ``fixed_bytes``.
- compressed: a chunk's stored size is known only once it is encoded, so every chunk is packed, from
  offset 0 (a file starting with a hole would waste the space of the raw layout).

Items come in record order, then chunk order: the order the writer threads take them (the file is
written roughly front to back), and the order packed items take in an object written in parts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tierckpt._buffers import align_up
from tierckpt.format import ALIGN, TensorRecord

__all__ = ["WriteItem", "WritePlan", "owned_chunks", "plan_write"]


@dataclass(frozen=True)
class WriteItem:
    """One chunk to store: chunk ``chunk`` of record ``record`` (an index into the plan's records)."""

    index: int  # this item's position in the plan (and in the offsets a DataWriter returns)
    record: int
    chunk: int
    codec: str  # the record's codec on this tier (a chunk that does not compress is still stored raw)
    # Where the stored bytes go in the data object: a 4 KiB-aligned place of the raw layout, or None
    # for an item packed after the previous packed one once its size is known.
    offset: int | None

    @property
    def packed(self) -> bool:
        return self.offset is None


@dataclass(frozen=True)
class WritePlan:
    """Every item one rank writes of one version into one data object, and the object's shape."""

    items: tuple[WriteItem, ...]
    codecs: tuple[str, ...]  # per record: what its manifest record says
    raw_layout: bool  # every record uncompressed: fixed items may be written with O_DIRECT
    fixed_bytes: int  # the raw layout's extent, reserved before the first write (0 when compressed)

    @property
    def packed_start(self) -> int:
        """Where the first packed item goes: after the raw layout, or at 0 in a compressed version."""
        return self.fixed_bytes


def owned_chunks(record: TensorRecord, rank: int) -> list[int]:
    """The chunks of ``record`` that ``rank`` stores: all of its own records, its turn of a shared one."""
    return [c for c in range(len(record.chunks)) if record.owner(c) in (None, rank)]


def plan_write(
    records: Sequence[TensorRecord], codecs: Sequence[str], *, rank: int = 0, raw_layout: bool | None = None
) -> WritePlan:
    """What ``rank`` writes of ``records``, each stored with the codec at the same index of ``codecs``.

    ``raw_layout``: whether the version keeps the host slot's layout (the tier's encoding decides);
    None: when every codec is ``"none"``.

    Example::

        plan = plan_write(source.records, [encoding.codec_for(r) for r in source.records], rank=0)
        for item in plan.items: ...  # read, encode, hash, then writer.write(item, data)

    Raises:
        ValueError: ``codecs`` does not give one codec per record.
    """
    if len(codecs) != len(records):
        raise ValueError(f"{len(codecs)} codecs for {len(records)} records")
    if raw_layout is None:
        raw_layout = all(codec == "none" for codec in codecs)
    items: list[WriteItem] = []
    end = 0
    for ri, record in enumerate(records):
        owned = owned_chunks(record, rank)
        fixed = raw_layout and record.chunk_bytes % ALIGN == 0
        for k, c in enumerate(owned):
            # A record's owned chunks back to back: the chunks other ranks store take no room here.
            offset = end + k * record.chunk_bytes if fixed else None
            items.append(WriteItem(len(items), ri, c, codecs[ri], offset))
        # Room is kept for every record in the raw layout, packed ones included: offsets stay those
        # of the host slot's layout whatever a record's chunk size.
        end += align_up(sum(record.chunk_span(c)[1] for c in owned), ALIGN)
    return WritePlan(tuple(items), tuple(codecs), raw_layout, end if raw_layout else 0)
