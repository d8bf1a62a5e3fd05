"""The manifest of one stored version (format version 2) and its msgpack encoding.

A version is a directory ``step-<12 digits>/`` holding ``manifest.msgpack`` and the data files. The
manifest file is ``msgpack({"body": <msgpack bytes>, "xxh3_64": <checksum of body>})``, so a torn or
bit-flipped manifest is detected before any field is trusted. Decoding validates every field: the
bytes come from disk and are treated as untrusted (no pickle, no eval, bounded sizes).

Version 2 added a per-chunk codec: a chunk of a compressed tensor that did not compress is stored
raw, and its entry says so. Version 1 manifests (every chunk in its tensor's codec) are still read.

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
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST_FILE = "manifest.msgpack"
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
    chunks: tuple[Chunk, ...]

    @property
    def stored(self) -> int:
        return sum(c.stored for c in self.chunks)

    def chunk_codec(self, i: int) -> str:
        """The codec chunk ``i`` is stored with."""
        return self.chunks[i].codec or self.codec

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

    @property
    def stored_bytes(self) -> int:
        return sum(r.stored for r in self.records)

    def encode(self) -> bytes:
        """The manifest file's bytes.

        Raises:
            UnsupportedStateError: they would be more than MAX_MANIFEST_BYTES, which no reader takes
                (too many tensors, or too much metadata): refused here rather than written unreadable.
        """
        body = msgpack.packb(
            {
                "format": FORMAT_NAME,
                "version": FORMAT_VERSION,
                "step": self.step,
                "created": self.created,
                "world_size": self.world_size,
                "checksum": CHECKSUM_ALGORITHM,
                "metadata": self.metadata,
                "skeleton": self.skeleton,
                "records": [_encode_record(r) for r in self.records],
            },
            use_bin_type=True,
        )
        data = msgpack.packb({"body": body, CHECKSUM_ALGORITHM: checksum(body)}, use_bin_type=True)
        if len(data) > MAX_MANIFEST_BYTES:
            raise UnsupportedStateError(
                f"the manifest of step {self.step} would take {len(data)} bytes, more than the {MAX_MANIFEST_BYTES} "
                f"a restore reads ({len(self.records)} tensors; metadata and non-tensor values count too)"
            )
        return data

    @classmethod
    def decode(cls, data: bytes, *, tier: str | None = None, step: int | None = None) -> Manifest:
        """Parse and validate manifest bytes; raises CorruptCheckpointError / FormatVersionError."""

        def bad(why: str) -> CorruptCheckpointError:
            return CorruptCheckpointError(f"{where(tier, step)}: {MANIFEST_FILE}: {why}", tier=tier, step=step)

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
            raise FormatVersionError(
                f"{where(tier, step)}: {MANIFEST_FILE}: not a {FORMAT_NAME} manifest", tier=tier, step=step
            )
        version = body.get("version")
        if type(version) is not int or version not in READABLE_VERSIONS:
            raise FormatVersionError(
                f"{where(tier, step)}: {MANIFEST_FILE}: format version {_short(version)} is not supported "
                f"(this release reads versions {' and '.join(map(str, READABLE_VERSIONS))})",
                tier=tier,
                step=step,
            )
        if body.get("checksum") != CHECKSUM_ALGORITHM:
            raise bad(f"unknown checksum algorithm {body.get('checksum')!r}")
        try:
            records = tuple(_decode_record(r) for r in _list(body["records"]))
            manifest = cls(
                step=_int(body["step"]),
                created=_time(body["created"]),
                skeleton=body["skeleton"],
                records=records,
                metadata=_map(body["metadata"]),
                world_size=_int(body["world_size"]),
            )
        except KeyError as exc:
            raise bad(f"malformed field (missing {_short(exc.args[0] if exc.args else None)})") from exc
        except (TypeError, ValueError, OverflowError) as exc:
            raise bad(f"malformed field ({_short(str(exc), 200)})") from exc
        if step is not None and manifest.step != step:
            raise bad(f"records step {manifest.step}")
        if [r.index for r in records] != list(range(len(records))):
            raise bad("tensor records are not numbered 0..n-1")
        return manifest


def _encode_record(r: TensorRecord) -> dict[str, Any]:
    return {
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


def _encode_chunk(c: Chunk, record_codec: str) -> list[Any]:
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
    chunks = tuple(_decode_chunk(c) for c in _list(raw["chunks"]))
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
    )
    if record.kind not in ("torch", "numpy"):
        raise ValueError(f"unknown kind {_short(record.kind)}")
    if record.chunk_bytes <= 0 or len(chunks) != chunk_count(record.nbytes, record.chunk_bytes):
        raise ValueError(f"{_short(record.key)}: {len(chunks)} chunks do not cover {record.nbytes} bytes")
    return record
