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

A record of a DTensor also has a ``region``: the global shape of the whole tensor and the offset of the
stored piece (the record's ``shape``) in it, so that a job with another parallel layout can find the
bytes it needs (:mod:`tierckpt.reshard`). A reader that ignores it reads the same local shards it wrote.

Decoding checks types and structure only (every message names the manifest file): whether the records
fit the data files on disk, their dtypes and their shapes is checked by the reader that has the files
(:func:`tierckpt.tiers.fsread.check_records`), before anything is allocated or read.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import msgpack

from tierckpt.codecs import CODECS
from tierckpt.errors import CorruptCheckpointError, FormatVersionError, UnsupportedStateError
from tierckpt.format.checksum import CHECKSUM_ALGORITHM, checksum

FORMAT_NAME = "tierckpt"
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
MANIFEST_FILE = "manifest.msgpack"  # a single process's manifest, or the commit marker of several ranks'
RANK_MANIFEST_FILE = "manifest-r{rank:05d}.msgpack"
DATA_FILE = "data-r{rank:05d}.bin"
ALIGN = 4096
# Independent units of hashing, compression and I/O; a multiple of ALIGN so uncompressed chunks stay
# aligned for O_DIRECT, and large enough that per-chunk overhead is noise next to the copy.
CHUNK_BYTES = 16 << 20

_DIR_RE = re.compile(r"^step-(\d{12})$")
# A manifest is read whole and unpacked into Python objects, which can take 8-70 times its size (70 for
# a file of nothing but empty lists: 64 MiB became 4.5 GB here). A real record takes ~250 bytes, so
# this holds ~250,000 tensors per rank (a 100,000-tensor MoE shard: 24 MiB); a larger file is refused
# by its size, before it is read.
MAX_MANIFEST_BYTES = 64 << 20
_MAX_NAME_BYTES = 255  # NAME_MAX: a longer file name cannot exist


def where(tier: str | None, step: int | None) -> str:
    """``"step 7 on tier 'nvme'"``, leaving out what is not known, for messages."""
    text = f"step {step}" if step is not None else "a version"
    return f"{text} on tier {tier!r}" if tier is not None else text


def version_dirname(step: int) -> str:
    return f"step-{step:012d}"


def parse_version_dirname(name: str) -> int | None:
    match = _DIR_RE.match(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class Chunk:
    """One independently stored piece of a tensor's bytes."""

    offset: int  # in the record's file
    stored: int  # bytes on disk (after the codec)
    checksum: int  # of the stored bytes
    codec: str | None = None  # how this chunk is stored, when not in its record's codec (e.g. raw)
    # The data file holding it when not its record's: a shared chunk another rank stored, resolved at
    # restore (never written: on disk, a rank manifest holds None for a chunk another rank stored).
    file: str | None = None


@dataclass(frozen=True)
class Region:
    """Where a stored piece of a DTensor lies: the whole tensor's shape and the piece's offset in it."""

    global_shape: tuple[int, ...]
    offset: tuple[int, ...]


@dataclass(frozen=True)
class TensorRecord:
    """Where one array leaf of the state lives and how to check and decode it."""

    index: int  # the leaf index the skeleton refers to
    key: str  # readable key path, for messages
    kind: str  # "torch" | "numpy"
    dtype: str
    shape: tuple[int, ...]
    nbytes: int  # logical (decoded) length
    file: str
    codec: str
    chunk_bytes: int  # logical bytes per chunk; the last one may be shorter
    chunks: tuple[Chunk | None, ...]  # None: a shared chunk another rank stores
    shared: tuple[int, ...] | None = None  # the ranks storing this value's chunks in turn (replicated)
    region: Region | None = None  # a DTensor's local piece: where it lies in the global tensor

    @property
    def stored(self) -> int:
        """Bytes of this record in its own file (chunks other ranks store are theirs)."""
        return sum(c.stored for c in self.chunks if c is not None and c.file is None)

    def owner(self, i: int) -> int | None:
        """The rank storing chunk ``i`` of a shared record; None for a record of one rank's own."""
        return None if self.shared is None else self.shared[i % len(self.shared)]

    def chunk(self, i: int) -> Chunk:
        """Chunk ``i``, which this record must hold (a shared chunk is resolved before it is read)."""
        c = self.chunks[i]
        if c is None:
            raise ValueError(f"{self.key}: chunk {i} is stored by rank {self.owner(i)} and was not resolved")
        return c

    def all_chunks(self) -> tuple[Chunk, ...]:
        """Every chunk, each of which this record must hold (as :meth:`chunk`)."""
        return tuple(self.chunk(i) for i in range(len(self.chunks)))

    def chunk_file(self, i: int) -> str:
        chunk = self.chunks[i]
        return self.file if chunk is None or chunk.file is None else chunk.file

    def chunk_codec(self, i: int) -> str:
        """The codec chunk ``i`` is stored with."""
        return self.chunk(i).codec or self.codec

    def chunk_span(self, i: int) -> tuple[int, int]:
        """Logical (start, length) of chunk ``i`` in the decoded tensor bytes."""
        start = i * self.chunk_bytes
        return start, min(self.chunk_bytes, self.nbytes - start)


def chunk_count(nbytes: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    return -(-nbytes // chunk_bytes)


@dataclass(frozen=True)
class Manifest:
    step: int
    created: float
    skeleton: Any
    records: tuple[TensorRecord, ...]
    metadata: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1
    rank: int = 0

    @property
    def stored_bytes(self) -> int:
        return sum(r.stored for r in self.records)

    def encode(self) -> bytes:
        """The manifest file's bytes.

        Raises:
            UnsupportedStateError: they would be more than MAX_MANIFEST_BYTES, which no reader takes
                (too many tensors, or too much metadata): refused here rather than written unreadable.
        """
        fields = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION if self.world_size > 1 else 2,  # what one process writes, older readers read
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
    """

    step: int
    created: float
    world_size: int
    ranks: tuple[tuple[str, int, int], ...]
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def stored_bytes(self) -> int:
        return sum(r[2] for r in self.ranks)

    def encode(self) -> bytes:
        return _seal(
            {
                "format": FORMAT_NAME,
                "version": FORMAT_VERSION,
                "kind": "commit",
                "step": self.step,
                "created": self.created,
                "world_size": self.world_size,
                "checksum": CHECKSUM_ALGORITHM,
                "metadata": self.metadata,
                "ranks": [list(r) for r in self.ranks],
            }
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
            )
            if not 1 < marker.world_size == len(marker.ranks):
                raise ValueError(f"{len(marker.ranks)} rank entries for a world of {marker.world_size}")
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
        if manifest.world_size < 1 or manifest.rank >= manifest.world_size:
            raise ValueError(f"rank {manifest.rank} of a world of {manifest.world_size}")
        for r in records:
            if r.shared is not None and any(q >= manifest.world_size for q in r.shared):
                raise ValueError(f"{_short(r.key)}: shared by a rank outside the world of {manifest.world_size}")
    except KeyError as exc:
        raise bad(f"malformed field (missing {_short(exc.args[0] if exc.args else None)})") from exc
    except (TypeError, ValueError, OverflowError) as exc:
        raise bad(f"malformed field ({_short(str(exc), 200)})") from exc
    if step is not None and manifest.step != step:
        raise bad(f"records step {manifest.step}")
    if [r.index for r in records] != list(range(len(records))):
        raise bad("tensor records are not numbered 0..n-1")
    return manifest


def _rank_entry(value: Any) -> tuple[str, int, int]:
    if type(value) is not list or len(value) != 3:
        raise ValueError(f"a rank entry is [manifest file, checksum, stored bytes], got {_short(value)}")
    return _file_name(value[0]), _int(value[1]), _int(value[2])


def _encode_record(r: TensorRecord) -> dict[str, Any]:
    extra: dict[str, Any] = {} if r.shared is None else {"shared": list(r.shared)}
    if r.region is not None:
        extra["region"] = [list(r.region.global_shape), list(r.region.offset)]
    return extra | {
        "index": r.index,
        "key": r.key,
        "kind": r.kind,
        "dtype": r.dtype,
        "shape": list(r.shape),
        "nbytes": r.nbytes,
        "file": r.file,
        "codec": r.codec,
        "chunk_bytes": r.chunk_bytes,
        "chunks": [_encode_chunk(c, r.codec) for c in r.chunks],
    }


def _encode_chunk(c: Chunk | None, record_codec: str) -> list[Any] | None:
    if c is None:
        return None
    if c.codec is None or c.codec == record_codec:
        return [c.offset, c.stored, c.checksum]
    return [c.offset, c.stored, c.checksum, c.codec]


def _decode_chunk(value: Any) -> Chunk:
    if type(value) is not list or len(value) not in (3, 4):
        raise ValueError(f"a chunk is [offset, stored, checksum(, codec)], got {_short(value)}")
    offset, stored, digest = (_int(v) for v in value[:3])
    return Chunk(offset, stored, digest, _codec(value[3]) if len(value) == 4 else None)


def _int(value: Any) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"expected a non-negative int, got {_short(value)}")
    return value


def _str(value: Any) -> str:
    if type(value) is not str:
        raise ValueError(f"expected a string, got {_short(value)}")
    return value


def _list(value: Any) -> list[Any]:
    if type(value) is not list:
        raise ValueError(f"expected a list, got {_short(value)}")
    return value


def _map(value: Any) -> dict[Any, Any]:
    if type(value) is not dict:
        raise ValueError(f"expected a map, got {_short(value)}")
    return value


def _time(value: Any) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"expected a unix time, got {_short(value)}")
    return float(value)


def _codec(value: Any) -> str:
    if type(value) is not str or value not in CODECS:
        raise ValueError(f"unknown codec {_short(value)} (this release reads {', '.join(CODECS)})")
    return value


def _file_name(value: Any) -> str:
    """A data file's name: a plain name inside the version directory, nothing that leads out of it."""
    name = _str(value)
    if not name or "/" in name or "\0" in name or name.startswith(".") or len(name.encode()) > _MAX_NAME_BYTES:
        raise ValueError(f"file name {_short(name)} escapes the version directory or is not a file name")
    return name


def _short(value: Any, limit: int = 60) -> str:
    """A bounded repr of an untrusted value, for messages."""
    try:
        text = repr(value) if type(value) in (type(None), bool, int, float, str, bytes) else f"<{type(value).__name__}>"
    except ValueError:  # an int past sys.get_int_max_str_digits()
        text = "<huge int>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _decode_record(raw: Any) -> TensorRecord:
    if type(raw) is not dict:
        raise ValueError("record is not a map")
    shape = tuple(_int(d) for d in _list(raw["shape"]))
    shared = None
    if "shared" in raw:
        shared = tuple(_int(q) for q in _list(raw["shared"]))
        if not shared or len(set(shared)) != len(shared):
            raise ValueError(f"{_short(raw.get('key'))}: shared by {_short(len(shared))} ranks, some twice or none")
    chunks = tuple(None if c is None and shared is not None else _decode_chunk(c) for c in _list(raw["chunks"]))
    record = TensorRecord(
        index=_int(raw["index"]),
        key=_str(raw["key"]),
        kind=_str(raw["kind"]),
        dtype=_str(raw["dtype"]),
        shape=shape,
        nbytes=_int(raw["nbytes"]),
        file=_file_name(raw["file"]),
        codec=_codec(raw["codec"]),
        chunk_bytes=_int(raw["chunk_bytes"]),
        chunks=chunks,
        shared=shared,
        region=_region(raw["region"], shape) if "region" in raw else None,
    )
    if record.kind not in ("torch", "numpy"):
        raise ValueError(f"unknown kind {_short(record.kind)}")
    if record.chunk_bytes <= 0 or len(chunks) != chunk_count(record.nbytes, record.chunk_bytes):
        raise ValueError(f"{_short(record.key)}: {len(chunks)} chunks do not cover {record.nbytes} bytes")
    return record


def _region(value: Any, shape: tuple[int, ...]) -> Region:
    if type(value) is not list or len(value) != 2:
        raise ValueError(f"a region is [global shape, offset], got {_short(value)}")
    global_shape = tuple(_int(d) for d in _list(value[0]))
    offset = tuple(_int(d) for d in _list(value[1]))
    if not len(global_shape) == len(offset) == len(shape):
        raise ValueError(f"a region of {len(global_shape)} dimensions for a piece of {len(shape)}")
    if any(o + n > g for o, n, g in zip(offset, shape, global_shape)):
        raise ValueError(f"a piece {list(shape)} at {list(offset)} lies outside its tensor {list(global_shape)}")
    return Region(global_shape, offset)
