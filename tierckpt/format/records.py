"""Tensor records: where one array leaf of a version lives (:class:`TensorRecord`, its chunks
(:class:`Chunk`), a DTensor piece's :class:`Region`), and their msgpack encoding and validating decoding.

The field checks here (``_int``, ``_file_name``, ...) treat every value as untrusted, as it comes from
disk; :mod:`tierckpt.format.manifest` uses them for the rest of a manifest too.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from tierckpt.codecs import CODECS
from tierckpt.format.layout import CHUNK_BYTES

# Chunk codecs of a differential version (:mod:`tierckpt.xordelta`): "ref", the base chunk's bytes as
# they are (nothing stored); "delta", the XOR against the base chunk's bytes, in byte planes.
DELTA_CODECS = ("ref", "delta")
DIGEST_BYTES = 16  # a chunk's logical digest: xxh3-128 of its decoded bytes

_MAX_NAME_BYTES = 255  # NAME_MAX: a longer file name cannot exist


@dataclass(frozen=True)
class BaseChunk:
    """Where the base of a differential chunk lies: a chunk of the base version's data file, as stored
    there (the base is a whole version: ``codec`` is one of :data:`~tierckpt.codecs.CODECS`)."""

    file: str
    offset: int
    stored: int
    checksum: int  # of its stored bytes, verified when read
    codec: str


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
    # A chunk of a differential version stored against its base (codec "ref" or "delta"): the base chunk.
    base: BaseChunk | None = None
    # xxh3-128 of the chunk's logical bytes, kept by a whole version on a tier with ``delta``: a later
    # version's chunk with the same digest is a reference to this one.
    digest: bytes | None = None


@dataclass(frozen=True)
class Region:
    """Where a stored piece of a DTensor lies: the whole tensor's shape and the piece's offset in it."""

    global_shape: tuple[int, ...]
    offset: tuple[int, ...]


@dataclass(frozen=True)
class TensorInfo:
    """What one array leaf of the state is, wherever it is held. A host slot's
    :class:`~tierckpt.snapshot.Entry` adds where in the slot; a stored :class:`TensorRecord` adds its
    file, codec and chunks. Both derive from this, so no field is declared twice."""

    index: int  # the leaf index the skeleton refers to
    key: str  # readable key path, for messages
    kind: str  # "torch" | "numpy"
    dtype: str
    shape: tuple[int, ...]
    nbytes: int  # logical (decoded) length
    # Keyword-only, so that each subclass's own fields follow ``nbytes`` positionally.
    shared: tuple[int, ...] | None = field(default=None, kw_only=True)  # the ranks storing this value's chunks in turn (replicated)
    region: Region | None = field(default=None, kw_only=True)  # a DTensor's local piece: where it lies in the global tensor

    def identity(self) -> dict[str, Any]:
        """index, key, kind, dtype, shape and nbytes: what one kind of record takes from the other."""
        return {"index": self.index, "key": self.key, "kind": self.kind, "dtype": self.dtype, "shape": self.shape, "nbytes": self.nbytes}


@dataclass(frozen=True)
class TensorRecord(TensorInfo):
    """Where one array leaf of the state lives and how to check and decode it."""

    file: str
    codec: str
    chunk_bytes: int  # logical bytes per chunk; the last one may be shorter
    chunks: tuple[Chunk | None, ...]  # None: a shared chunk another rank stores
    # On a tier that shares a value among fewer ranks than saved it (a node-local tier: among the
    # node's ranks), ``shared`` as saved, for a flush further down; None: ``shared`` is that.
    saved_shared: tuple[int, ...] | None = field(default=None, kw_only=True)

    def as_saved(self) -> TensorRecord:
        """This record shared as it was saved (see ``saved_shared``)."""
        return self if self.saved_shared is None else dataclasses.replace(self, shared=self.saved_shared, saved_shared=None)

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


def _encode_record(r: TensorRecord) -> dict[str, Any]:
    extra: dict[str, Any] = {} if r.shared is None else {"shared": list(r.shared)}
    if r.saved_shared is not None:
        extra["saved_shared"] = list(r.saved_shared)
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
    codec = None if c.codec is None or c.codec == record_codec else c.codec
    if c.base is not None or c.digest is not None:  # format version 4
        extra: dict[str, Any] = {} if c.digest is None else {"digest": c.digest}
        if c.base is not None:
            b = c.base
            extra["base"] = [b.file, b.offset, b.stored, b.checksum, b.codec]
        return [c.offset, c.stored, c.checksum, codec, extra]
    return [c.offset, c.stored, c.checksum] if codec is None else [c.offset, c.stored, c.checksum, codec]


def differential(c: Chunk | None) -> bool:
    """Whether chunk ``c`` is written in format version 4 (a base or a digest)."""
    return c is not None and (c.base is not None or c.digest is not None)


def _decode_chunk(value: Any) -> Chunk:
    if type(value) is not list or len(value) not in (3, 4, 5):
        raise ValueError(f"a chunk is [offset, stored, checksum(, codec(, extra))], got {_short(value)}")
    offset, stored, digest = (_int(v) for v in value[:3])
    if len(value) < 5:
        return Chunk(offset, stored, digest, _codec(value[3]) if len(value) == 4 else None)
    extra = _map(value[4])
    if not set(extra) <= {"base", "digest"}:
        raise ValueError(f"a chunk's extra fields are base and digest, got {_short(sorted(map(str, extra)))}")
    logical = extra.get("digest")
    if logical is not None and (type(logical) is not bytes or len(logical) != DIGEST_BYTES):
        raise ValueError(f"a chunk's digest is {DIGEST_BYTES} bytes, got {_short(logical)}")
    base = _base_chunk(extra["base"]) if "base" in extra else None
    codec = None if value[3] is None else (_codec(value[3]) if base is None else _str(value[3]))
    if (base is not None) != (codec in DELTA_CODECS):
        raise ValueError(f"a chunk stored {codec or 'as its record'} {'has' if base else 'without'} a base chunk")
    if codec == "ref" and stored:
        raise ValueError(f"a reference to its base chunk stores {stored} bytes, not 0")
    if codec == "delta" and not stored:
        raise ValueError("a delta frame of 0 bytes")
    return Chunk(offset, stored, digest, codec, base=base, digest=logical)


def _base_chunk(value: Any) -> BaseChunk:
    if type(value) is not list or len(value) != 5:
        raise ValueError(f"a base chunk is [file, offset, stored, checksum, codec], got {_short(value)}")
    return BaseChunk(_file_name(value[0]), _int(value[1]), _int(value[2]), _int(value[3]), _codec(value[4]))


def _decode_record(raw: Any) -> TensorRecord:
    if type(raw) is not dict:
        raise ValueError("record is not a map")
    shape = tuple(_int(d) for d in _list(raw["shape"]))
    shared, saved_shared = (_ranks(raw, name) for name in ("shared", "saved_shared"))
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
        saved_shared=saved_shared,
    )
    if record.kind not in ("torch", "numpy"):
        raise ValueError(f"unknown kind {_short(record.kind)}")
    if record.chunk_bytes <= 0 or len(chunks) != chunk_count(record.nbytes, record.chunk_bytes):
        raise ValueError(f"{_short(record.key)}: {len(chunks)} chunks do not cover {record.nbytes} bytes")
    return record


def _ranks(raw: dict[str, Any], name: str) -> tuple[int, ...] | None:
    """A record's ``shared`` or ``saved_shared``: distinct ranks, at least one; None when absent."""
    if name not in raw:
        return None
    ranks = tuple(_int(q) for q in _list(raw[name]))
    if not ranks or len(set(ranks)) != len(ranks):
        raise ValueError(f"{_short(raw.get('key'))}: {name} by {_short(len(ranks))} ranks, some twice or none")
    return ranks


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
