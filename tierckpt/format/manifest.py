"""The manifest of one stored version (format version 2) and its msgpack encoding.

A version is a directory ``step-<12 digits>/`` holding ``manifest.msgpack`` and the data files. The
manifest file is ``msgpack({"body": <msgpack bytes>, "xxh3_64": <checksum of body>})``, so a torn or
bit-flipped manifest is detected before any field is trusted. Decoding validates every field: the
bytes come from disk and are treated as untrusted (no pickle, no eval, bounded sizes).

Version 2 added a per-chunk codec: a chunk of a compressed tensor that did not compress is stored
raw, and its entry says so. Version 1 manifests (every chunk in its tensor's codec) are still read.

Version 3 is a version saved by several ranks (:mod:`tierckpt.ranks`): each rank writes its data file and
its rank manifest ``manifest-r<rank>.msgpack`` (a :class:`Manifest` with ``rank`` and ``world_size``),
and ``manifest.msgpack`` is the :class:`CommitMarker`, written last, once every rank's part was durable:
it names each rank manifest with its checksum. A record of a value every rank holds alike (saved with
``replicated=``) is ``shared`` by a list of ranks: its chunk ``i`` is stored once, by rank
``shared[i % len(shared)]``, and the other ranks' manifests hold ``None`` in its place. A version saved
by one process is still written as version 2.

Version 4 is a version of a tier with ``delta`` (:mod:`tierckpt.xordelta`): a whole one keeps each
chunk's logical digest; a differential one names its ``base`` (the base version's step, and the
checksum of the base's manifest of the same rank: ``manifest.msgpack`` of one process, else its rank
manifest), and its chunks stored against the base (codec ``ref`` or ``delta``) say where their base
chunk lies (:class:`~tierckpt.format.records.BaseChunk`). The commit marker of a differential version
of several ranks names the base's step.

A record of a DTensor also has a ``region``: the global shape of the whole tensor and the offset of the
stored piece (the record's ``shape``) in it, so that a job with another parallel layout can find the
bytes it needs (:mod:`tierckpt.restore.reshard`). A reader that ignores it reads the same local shards it wrote.

Decoding checks types and structure only (every message names the manifest file): whether the records
fit the data files on disk, their dtypes and their shapes is checked by the reader that has the files
(:func:`tierckpt.tiers.stored.read.check_records`), before anything is allocated or read.

This module holds the documents of a version (:class:`Manifest`, :class:`CommitMarker`) and their
encoding; the layout constants are in :mod:`tierckpt.format.layout` and the tensor records in
:mod:`tierckpt.format.records`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgpack

from tierckpt.errors import CorruptCheckpointError, FormatVersionError, UnsupportedStateError
from tierckpt.format.checksum import CHECKSUM_ALGORITHM, checksum
from tierckpt.format.layout import DELTA_VERSION, FORMAT_NAME, FORMAT_VERSION, MANIFEST_FILE, READABLE_VERSIONS, where
from tierckpt.format.records import (
    TensorRecord,
    differential,
    _decode_record,
    _encode_record,
    _file_name,
    _int,
    _list,
    _map,
    _short,
    _str,
    _time,
)

__all__ = ["MAX_MANIFEST_BYTES", "CommitMarker", "Manifest", "decode_document"]

# A manifest is read whole and unpacked into Python objects, which can take 8-70 times its size (70 for
# a file of nothing but empty lists: 64 MiB became 4.5 GB here). A real record takes ~250 bytes, so
# this holds ~250,000 tensors per rank (a 100,000-tensor MoE shard: 24 MiB); a larger file is refused
# by its size, before it is read.
MAX_MANIFEST_BYTES = 64 << 20


@dataclass(frozen=True)
class Manifest:
    step: int
    created: float
    skeleton: Any
    records: tuple[TensorRecord, ...]
    metadata: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1
    rank: int = 0
    # A differential version's base: its step, and the checksum of its manifest of this rank; and
    # which version after that base this one is (1..full_every - 1; 0: a whole version).
    base: tuple[int, int] | None = None
    chain: int = 0

    @property
    def stored_bytes(self) -> int:
        return sum(r.stored for r in self.records)

    @property
    def base_step(self) -> int | None:
        """The step of the version this one is written against; None for a whole version."""
        return self.base[0] if self.base is not None else None

    @property
    def format_version(self) -> int:
        if self.base is not None or any(differential(c) for r in self.records for c in r.chunks):
            return DELTA_VERSION
        return FORMAT_VERSION if self.world_size > 1 else 2  # what one process writes, older readers read

    def encode(self) -> bytes:
        """The manifest file's bytes.

        Raises:
            UnsupportedStateError: they would be more than MAX_MANIFEST_BYTES, which no reader takes
                (too many tensors, or too much metadata): refused here rather than written unreadable.
        """
        fields = {
            "format": FORMAT_NAME,
            "version": self.format_version,
            "step": self.step,
            "created": self.created,
            "world_size": self.world_size,
            "checksum": CHECKSUM_ALGORITHM,
            "metadata": self.metadata,
            "skeleton": self.skeleton,
            "records": [_encode_record(r) for r in self.records],
        }
        if self.world_size > 1:
            fields["rank"] = self.rank
        if self.base is not None:
            fields["base"] = [*self.base, self.chain]
        data = _seal(fields)
        if len(data) > MAX_MANIFEST_BYTES:
            raise UnsupportedStateError(
                f"the manifest of step {self.step} would take {len(data)} bytes, more than the {MAX_MANIFEST_BYTES} "
                f"a restore reads ({len(self.records)} tensors; metadata and non-tensor values count too)"
            )
        return data

    @classmethod
    def decode(cls, data: bytes, *, tier: str | None = None, step: int | None = None, name: str = MANIFEST_FILE) -> Manifest:
        """Parse and validate manifest bytes; raises CorruptCheckpointError / FormatVersionError.

        ``name`` is the file named in errors. A commit marker is refused here: see :func:`decode_document`.
        """
        document = decode_document(data, tier=tier, step=step, name=name)
        if isinstance(document, CommitMarker):
            raise CorruptCheckpointError(
                f"{where(tier, step)}: {name}: a commit marker of {document.world_size} ranks, not a manifest",
                tier=tier,
                step=step,
            )
        return document


def _seal(fields: dict[str, Any]) -> bytes:
    """A document's file bytes: its msgpack body and the body's checksum."""
    body = msgpack.packb(fields, use_bin_type=True)
    return msgpack.packb({"body": body, CHECKSUM_ALGORITHM: checksum(body)}, use_bin_type=True)


@dataclass(frozen=True)
class CommitMarker:
    """``manifest.msgpack`` of a version saved by several ranks: written once all their parts were durable.

    ``ranks[r]`` is rank r's manifest file name, the checksum of that file's bytes and the bytes its
    data file holds; a rank manifest that does not match its checksum is not part of this version.
    ``holds``: the ranks whose parts this directory holds, on a node-local tier (each node's directory
    holds its own ranks' parts; its marker names every rank's, so that the nodes' markers can be
    compared); None: every rank's (a shared directory). ``node``: the name of that directory's node.
    """

    step: int
    created: float
    world_size: int
    ranks: tuple[tuple[str, int, int], ...]
    metadata: dict[str, Any] = field(default_factory=dict)
    holds: tuple[int, ...] | None = None
    node: str | None = None
    base: int | None = None  # a differential version's base step
    chain: int = 0  # which version after its base this one is

    @property
    def base_step(self) -> int | None:
        """As :attr:`Manifest.base_step`."""
        return self.base

    @property
    def held_bytes(self) -> int:
        """Stored bytes of the parts this directory holds."""
        return self.stored_bytes if self.holds is None else sum(self.ranks[r][2] for r in self.holds)

    @property
    def stored_bytes(self) -> int:
        return sum(r[2] for r in self.ranks)

    def encode(self) -> bytes:
        return _seal(
            {
                "format": FORMAT_NAME,
                "version": FORMAT_VERSION if self.base is None else DELTA_VERSION,
                "kind": "commit",
                "step": self.step,
                "created": self.created,
                "world_size": self.world_size,
                "checksum": CHECKSUM_ALGORITHM,
                "metadata": self.metadata,
                "ranks": [list(r) for r in self.ranks],
            }
            | ({} if self.holds is None else {"holds": list(self.holds)})
            | ({} if self.node is None else {"node": self.node})
            | ({} if self.base is None else {"base": [self.base, self.chain]})
        )


def decode_document(
    data: bytes, *, tier: str | None = None, step: int | None = None, name: str = MANIFEST_FILE
) -> Manifest | CommitMarker:
    """Parse and validate a manifest or a commit marker (untrusted bytes: every field is checked)."""
    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where(tier, step)}: {name}: {why}", tier=tier, step=step)

    if len(data) > MAX_MANIFEST_BYTES:
        raise bad(f"{len(data)} bytes, more than the {MAX_MANIFEST_BYTES} a manifest may have")
    try:
        outer = msgpack.unpackb(data, raw=False)
    except Exception as exc:
        raise bad(f"not msgpack ({exc})") from exc
    if not isinstance(outer, dict) or not isinstance(outer.get("body"), bytes):
        raise bad("missing body")
    body_bytes = outer["body"]
    if outer.get(CHECKSUM_ALGORITHM) != checksum(body_bytes):
        raise bad("checksum mismatch (torn or corrupted write)")
    try:
        body = msgpack.unpackb(body_bytes, raw=False, strict_map_key=False)
    except Exception as exc:
        raise bad(f"body is not msgpack ({exc})") from exc
    if not isinstance(body, dict):
        raise bad("body is not a map")
    if body.get("format") != FORMAT_NAME:
        raise FormatVersionError(f"{where(tier, step)}: {name}: not a {FORMAT_NAME} manifest", tier=tier, step=step)
    version = body.get("version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise FormatVersionError(
            f"{where(tier, step)}: {name}: format version {_short(version)} is not supported "
            f"(this release reads versions {', '.join(map(str, READABLE_VERSIONS[:-1]))} and {READABLE_VERSIONS[-1]})",
            tier=tier,
            step=step,
        )
    if body.get("checksum") != CHECKSUM_ALGORITHM:
        raise bad(f"unknown checksum algorithm {body.get('checksum')!r}")
    try:
        if body.get("kind") == "commit":
            marker = CommitMarker(
                step=_int(body["step"]),
                created=_time(body["created"]),
                world_size=_int(body["world_size"]),
                ranks=tuple(_rank_entry(r) for r in _list(body["ranks"])),
                metadata=_map(body["metadata"]),
                holds=tuple(_int(r) for r in _list(body["holds"])) if "holds" in body else None,
                node=_str(body["node"]) if "node" in body else None,
            )
            if "base" in body:
                base, chain = _base(body["base"], 2)
                marker = dataclasses.replace(marker, base=base, chain=chain)
            if not 1 < marker.world_size == len(marker.ranks):
                raise ValueError(f"{len(marker.ranks)} rank entries for a world of {marker.world_size}")
            held = marker.holds
            if held is not None and (not held or len(set(held)) != len(held) or max(held) >= marker.world_size):
                raise ValueError(f"holds ranks {_short(list(held), 200)} of a world of {marker.world_size}")
            if step is not None and marker.step != step:
                raise bad(f"records step {marker.step}")
            return marker
        records = tuple(_decode_record(r) for r in _list(body["records"]))
        manifest = Manifest(
            step=_int(body["step"]),
            created=_time(body["created"]),
            skeleton=body["skeleton"],
            records=records,
            metadata=_map(body["metadata"]),
            world_size=_int(body["world_size"]),
            rank=_int(body.get("rank", 0)),
        )
        if "base" in body:
            step_, digest, chain = _base(body["base"], 3)
            manifest = dataclasses.replace(manifest, base=(step_, digest), chain=chain)
        if manifest.world_size < 1 or manifest.rank >= manifest.world_size:
            raise ValueError(f"rank {manifest.rank} of a world of {manifest.world_size}")
        for r in records:
            if any(q >= manifest.world_size for q in (r.shared or ()) + (r.saved_shared or ())):
                raise ValueError(f"{_short(r.key)}: shared by a rank outside the world of {manifest.world_size}")
            if manifest.base is None and any(c is not None and c.base is not None for c in r.chunks):
                raise ValueError(f"{_short(r.key)}: chunks stored against a base, in a version that names none")
        if manifest.base is not None and manifest.base[0] == manifest.step:
            raise ValueError(f"step {manifest.step} names itself as its base")
    except KeyError as exc:
        raise bad(f"malformed field (missing {_short(exc.args[0] if exc.args else None)})") from exc
    except (TypeError, ValueError, OverflowError) as exc:
        raise bad(f"malformed field ({_short(str(exc), 200)})") from exc
    if step is not None and manifest.step != step:
        raise bad(f"records step {manifest.step}")
    if [r.index for r in records] != list(range(len(records))):
        raise bad("tensor records are not numbered 0..n-1")
    return manifest


def _base(value: Any, fields: int) -> tuple[int, ...]:
    """A differential version's base: [step, checksum of its manifest, chain] in a manifest (3
    fields), [step, chain] in a commit marker (2)."""
    if type(value) is not list or len(value) != fields:
        raise ValueError(f"a base is {'[step, checksum, chain]' if fields == 3 else '[step, chain]'}, got {_short(value)}")
    values = tuple(_int(v) for v in value)
    if not values[-1]:
        raise ValueError("a differential version is version 1 or later after its base, not 0")
    return values


def _rank_entry(value: Any) -> tuple[str, int, int]:
    if type(value) is not list or len(value) != 3:
        raise ValueError(f"a rank entry is [manifest file, checksum, stored bytes], got {_short(value)}")
    return _file_name(value[0]), _int(value[1]), _int(value[2])
