"""The on-disk format, version 1 (ARCHITECTURE §4): manifest encoding and the layout a real save leaves."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Iterator

import msgpack
import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierckpt import Checkpointer
from tierckpt.errors import CorruptCheckpointError, FormatVersionError
from tierckpt.format.lineage import KEY as LINEAGE
from tierckpt.format import (
    ALIGN,
    CHECKSUM_ALGORITHM,
    DATA_FILE,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_FILE,
    Chunk,
    Manifest,
    TensorRecord,
    checksum,
    parse_version_dirname,
    version_dirname,
)

from helpers import ram_fs

# -- strategies ---------------------------------------------------------------------------------------

_U64 = st.integers(min_value=0, max_value=2**64 - 1)
_SMALL = st.integers(min_value=0, max_value=2**40)


def _msgpack_values() -> st.SearchStrategy[Any]:
    scalars = st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=20) | st.binary(max_size=20)
    return st.recursive(
        scalars,
        lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
        max_leaves=20,
    )


@st.composite
def _records(draw: st.DrawFn, index: int) -> TensorRecord:
    nbytes = draw(st.integers(min_value=0, max_value=1 << 36))
    chunk_bytes = draw(st.integers(min_value=1, max_value=1 << 30))
    n = -(-nbytes // chunk_bytes)
    # The number of chunks is implied by nbytes and chunk_bytes; keep it small for the test's sake.
    if n > 8:
        chunk_bytes = -(-nbytes // 8)
        n = -(-nbytes // chunk_bytes)
    codec = draw(st.sampled_from(["none", "zstd", "zstd+shuffle"]))
    # A chunk names its codec only where it differs from its record's (a raw fallback).
    others = st.sampled_from([None, *({"none", "zstd"} - {codec})])
    chunks = tuple(Chunk(draw(_SMALL), draw(_SMALL), draw(_U64), draw(others)) for _ in range(n))
    return TensorRecord(
        index=index,
        key=draw(st.text(max_size=30)),
        kind=draw(st.sampled_from(["torch", "numpy"])),
        dtype=draw(st.sampled_from(["float32", "bfloat16", "<f4", "|b1"])),
        shape=tuple(draw(st.lists(st.integers(min_value=0, max_value=1 << 20), max_size=4))),
        nbytes=nbytes,
        file=draw(st.sampled_from(["data-r00000.bin", "data-r00001.bin", "x"])),
        codec=codec,
        chunk_bytes=chunk_bytes,
        chunks=chunks,
    )


@st.composite
def _manifests(draw: st.DrawFn) -> Manifest:
    n = draw(st.integers(min_value=0, max_value=5))
    return Manifest(
        step=draw(st.integers(min_value=0, max_value=10**12 - 1)),
        created=draw(st.floats(min_value=0, max_value=4e9)),
        skeleton=draw(_msgpack_values()),
        records=tuple(draw(_records(i)) for i in range(n)),
        metadata=draw(st.dictionaries(st.text(max_size=10), _msgpack_values(), max_size=5)),
        world_size=draw(st.integers(min_value=1, max_value=1 << 20)),
    )


def _record(index: int = 0, **changes: Any) -> TensorRecord:
    fields: dict[str, Any] = dict(
        index=index,
        key=f"['t{index}']",
        kind="torch",
        dtype="float32",
        shape=(1000,),
        nbytes=4000,
        file="data-r00000.bin",
        codec="none",
        chunk_bytes=16 << 20,
        chunks=(Chunk(index * 4096, 4000, 12345),),
    )
    fields.update(changes)
    return TensorRecord(**fields)


def _manifest(records: tuple[TensorRecord, ...] | None = None, step: int = 7) -> Manifest:
    return Manifest(
        step=step,
        created=1700000000.5,
        skeleton=["dict", [["w", ["leaf", 0]], ["b", ["leaf", 1]]]],
        records=records if records is not None else (_record(0), _record(1)),
        metadata={"lr": 0.1, "tag": "x"},
    )


def _body(data: bytes) -> dict[str, Any]:
    return msgpack.unpackb(msgpack.unpackb(data)["body"], strict_map_key=False)


def _rewrap(body: dict[str, Any]) -> bytes:
    """A manifest file around ``body`` with a valid checksum: only the field checks can refuse it."""
    raw = msgpack.packb(body, use_bin_type=True)
    return msgpack.packb({"body": raw, CHECKSUM_ALGORITHM: checksum(raw)}, use_bin_type=True)


# -- encode / decode ----------------------------------------------------------------------------------


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_manifests())
def test_manifest_round_trip(manifest: Manifest) -> None:
    decoded = Manifest.decode(manifest.encode())
    assert decoded == manifest
    assert isinstance(decoded.records, tuple)
    assert all(isinstance(r.shape, tuple) and isinstance(r.chunks, tuple) for r in decoded.records)
    # Encoding is deterministic: decode → encode gives the same bytes.
    assert decoded.encode() == manifest.encode()


def test_decode_accepts_the_expected_step_and_refuses_another() -> None:
    data = _manifest(step=7).encode()
    assert Manifest.decode(data, tier="nvme", step=7).step == 7
    with pytest.raises(CorruptCheckpointError, match="records step 7") as info:
        Manifest.decode(data, tier="nvme", step=8)
    assert (info.value.tier, info.value.step) == ("nvme", 8)


@pytest.mark.parametrize("keep", [0, 1, 2, 10, -1])
def test_decode_rejects_truncated_bytes(keep: int) -> None:
    data = _manifest().encode()
    cut = data[:keep] if keep >= 0 else data[:keep]
    with pytest.raises(CorruptCheckpointError):
        Manifest.decode(cut, tier="nvme", step=7)


def test_decode_rejects_every_truncation() -> None:
    data = _manifest().encode()
    for n in range(len(data)):
        with pytest.raises(CorruptCheckpointError):
            Manifest.decode(data[:n])


@pytest.mark.parametrize("mask", [0x01, 0x80, 0xFF])
def test_decode_rejects_a_flipped_byte_anywhere(mask: int) -> None:
    data = _manifest().encode()
    for i in range(len(data)):
        flipped = bytearray(data)
        flipped[i] ^= mask
        with pytest.raises(CorruptCheckpointError):
            Manifest.decode(bytes(flipped), tier="nvme", step=7)


def test_decode_names_a_checksum_mismatch() -> None:
    data = _manifest().encode()
    outer = msgpack.unpackb(data)
    body = bytearray(outer["body"])
    body[len(body) // 2] ^= 0x10
    bad = msgpack.packb({"body": bytes(body), CHECKSUM_ALGORITHM: outer[CHECKSUM_ALGORITHM]}, use_bin_type=True)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch") as info:
        Manifest.decode(bad, tier="pfs", step=7)
    assert not isinstance(info.value, FormatVersionError)
    assert (info.value.tier, info.value.step) == ("pfs", 7)


def test_decode_rejects_garbage() -> None:
    for data in (b"", b"\x00", b"not msgpack at all", msgpack.packb([1, 2, 3]), msgpack.packb({"body": "str"})):
        with pytest.raises(CorruptCheckpointError):
            Manifest.decode(data)


def test_decode_rejects_a_wrong_format_name() -> None:
    body = _body(_manifest().encode())
    body["format"] = "torchsnapshot"
    with pytest.raises(FormatVersionError, match=f"not a {FORMAT_NAME} manifest") as info:
        Manifest.decode(_rewrap(body), tier="nvme", step=7)
    assert (info.value.tier, info.value.step) == ("nvme", 7)


@pytest.mark.parametrize("version", [0, 5, 99, "1", None])
def test_decode_rejects_an_unknown_version(version: Any) -> None:
    body = _body(_manifest().encode())
    body["version"] = version
    with pytest.raises(FormatVersionError) as info:
        Manifest.decode(_rewrap(body), tier="nvme", step=7)
    message = str(info.value)
    assert f"format version {version!r}" in message
    assert "reads versions 1, 2, 3 and 4" in message
    assert isinstance(info.value, CorruptCheckpointError)  # so restore moves on to the next candidate


def test_version_1_manifests_are_still_read() -> None:
    body = _body(_manifest().encode())
    assert body["version"] == 2 and FORMAT_VERSION == 3  # one process writes what the previous release reads
    body["version"] = 1
    decoded = Manifest.decode(_rewrap(body), tier="nvme", step=7)
    assert decoded == _manifest()


def test_a_chunk_stored_in_another_codec_than_its_record_says_so() -> None:
    record = TensorRecord(
        index=0,
        key="['w']",
        kind="torch",
        dtype="float32",
        shape=(2, 1024),
        nbytes=8192,
        file="data-r00000.bin",
        codec="zstd+shuffle",
        chunk_bytes=4096,
        chunks=(Chunk(0, 900, 11), Chunk(900, 4096, 12, "none")),
    )
    manifest = Manifest(step=7, created=1.0, skeleton={"t": 0}, records=(record,))
    raw = _body(manifest.encode())["records"][0]["chunks"]
    assert raw == [[0, 900, 11], [900, 4096, 12, "none"]]  # the record's own codec is not repeated
    decoded = Manifest.decode(manifest.encode(), step=7).records[0]
    assert [decoded.chunk_codec(i) for i in range(2)] == ["zstd+shuffle", "none"]


def test_decode_rejects_an_unknown_checksum_algorithm() -> None:
    body = _body(_manifest().encode())
    body["checksum"] = "crc32"
    with pytest.raises(CorruptCheckpointError, match="checksum algorithm"):
        Manifest.decode(_rewrap(body))


@pytest.mark.parametrize("indexes", [[1, 2], [0, 0], [1, 0], [0, 2]])
def test_decode_rejects_records_not_numbered_in_order(indexes: list[int]) -> None:
    manifest = _manifest(records=tuple(_record(i) for i in indexes))
    with pytest.raises(CorruptCheckpointError, match=r"numbered 0\.\.n-1"):
        Manifest.decode(manifest.encode())


@pytest.mark.parametrize(
    "changes",
    [
        dict(nbytes=4000, chunk_bytes=1000, chunks=(Chunk(0, 1000, 1),) * 3),  # needs 4
        dict(nbytes=4000, chunk_bytes=1000, chunks=(Chunk(0, 1000, 1),) * 5),  # needs 4
        dict(nbytes=4001, chunk_bytes=1000, chunks=(Chunk(0, 1000, 1),) * 4),  # needs 5
        dict(nbytes=100, chunks=()),
        dict(nbytes=0, chunks=(Chunk(0, 0, 0),)),
        dict(chunk_bytes=0),
    ],
)
def test_decode_rejects_a_chunk_list_not_covering_nbytes(changes: dict[str, Any]) -> None:
    manifest = _manifest(records=(_record(0, **changes),))
    with pytest.raises(CorruptCheckpointError, match="malformed field"):
        Manifest.decode(manifest.encode())


def test_decode_accepts_an_empty_tensor_with_no_chunks() -> None:
    manifest = _manifest(records=(_record(0, shape=(0,), nbytes=0, chunks=()),))
    assert Manifest.decode(manifest.encode()) == manifest


@pytest.mark.parametrize("name", ["../data-r00000.bin", "sub/data.bin", "/etc/passwd", ".hidden", "..", "."])
def test_decode_rejects_file_names_escaping_the_version_directory(name: str) -> None:
    manifest = _manifest(records=(_record(0, file=name),))
    with pytest.raises(CorruptCheckpointError, match="escapes the version directory"):
        Manifest.decode(manifest.encode())


@pytest.mark.parametrize(
    "field, value",
    [("step", -1), ("step", "7"), ("step", 7.0), ("world_size", True), ("created", "now"), ("records", None), ("metadata", [1])],
)
def test_decode_rejects_malformed_fields(field: str, value: Any) -> None:
    body = _body(_manifest().encode())
    body[field] = value
    with pytest.raises(CorruptCheckpointError):
        Manifest.decode(_rewrap(body))


@pytest.mark.parametrize(
    "field, value",
    [
        ("index", -1),
        ("shape", [-1]),
        ("shape", "ab"),
        ("shape", 3),
        ("kind", "pickle"),
        ("key", 3),
        ("chunks", [[0, 1]]),
        ("chunks", [[0, 1, 2, 3]]),
        ("chunks", [5]),
        ("chunks", 5),
        ("chunks", [{"0": 1}]),
        ("nbytes", None),
        ("nbytes", "4000"),
    ],
)
def test_decode_rejects_malformed_records(field: str, value: Any) -> None:
    body = _body(_manifest().encode())
    body["records"][0][field] = value
    with pytest.raises(CorruptCheckpointError):
        Manifest.decode(_rewrap(body))


def test_decode_rejects_a_missing_field() -> None:
    for field in ("step", "created", "world_size", "metadata", "skeleton", "records"):
        body = _body(_manifest().encode())
        del body[field]
        with pytest.raises(CorruptCheckpointError):
            Manifest.decode(_rewrap(body))


# -- version directory names --------------------------------------------------------------------------


@pytest.mark.parametrize("step", [0, 1, 7, 123456789, 10**12 - 1])
def test_version_dirname_round_trip(step: int) -> None:
    name = version_dirname(step)
    assert name == "step-" + str(step).zfill(12)
    assert len(name) == len("step-") + 12
    assert parse_version_dirname(name) == step


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=0, max_value=10**12 - 1))
def test_version_dirname_round_trip_any_step(step: int) -> None:
    assert parse_version_dirname(version_dirname(step)) == step


@pytest.mark.parametrize(
    "name",
    ["step-7", "step-00000000007", "step-0000000000007", "step-00000000000a", ".tmp-step-000000000007-abc",
     ".trash-step-000000000007-abc", "step-000000000007-x", "xstep-000000000007", "step-000000000007/", "", "step-"],
)
def test_parse_version_dirname_refuses_other_names(name: str) -> None:
    assert parse_version_dirname(name) is None


# -- what a real save leaves on disk ------------------------------------------------------------------


def _config(root: Path) -> dict[str, Any]:
    return ram_fs(root / "nvme", capacity="16MiB")


@pytest.fixture
def ckpt(tmp_path: Path) -> Iterator[Checkpointer]:
    c = Checkpointer(_config(tmp_path))
    try:
        yield c
    finally:
        c.close_sync()


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "model": {
            "w": torch.randn(300, 301, generator=g),  # not a multiple of 4 KiB
            "b": torch.randn(17, generator=g).to(torch.bfloat16),
            "empty": torch.empty(0, 5),
            "big": torch.randint(0, 1000, (1 << 18,), generator=g, dtype=torch.int64),  # 2 MiB
        },
        "arr": np.arange(1000, dtype=np.int16),
        "step": 12,
        "name": "run-1",
    }


def test_a_real_save_lays_out_format_v1(ckpt: Checkpointer, tmp_path: Path) -> None:
    state = _state()
    handle = ckpt.save_sync(12, state, metadata={"lr": 0.5})
    assert handle.committed_sync("nvme", timeout=60) is True
    root = tmp_path / "nvme"
    assert sorted(os.listdir(root)) == ["step-000000000012"]
    version = root / "step-000000000012"
    assert sorted(os.listdir(version)) == sorted([MANIFEST_FILE, DATA_FILE.format(rank=0)])
    assert DATA_FILE.format(rank=0) == "data-r00000.bin"

    manifest = Manifest.decode((version / MANIFEST_FILE).read_bytes(), tier="nvme", step=12)
    assert manifest.step == 12
    assert manifest.world_size == 1
    # The save's lineage is kept in its record too: the first save of an empty tier, no cuts.
    assert manifest.metadata == {"lr": 0.5, LINEAGE: [1, []]}
    assert [r.index for r in manifest.records] == list(range(5))
    by_key = {r.key: r for r in manifest.records}
    assert set(by_key) == {"['model']['w']", "['model']['b']", "['model']['empty']", "['model']['big']", "['arr']"}
    assert (by_key["['model']['w']"].dtype, by_key["['model']['w']"].shape) == ("float32", (300, 301))
    assert (by_key["['model']['b']"].dtype, by_key["['model']['b']"].kind) == ("bfloat16", "torch")
    assert (by_key["['arr']"].kind, by_key["['arr']"].dtype, by_key["['arr']"].nbytes) == ("numpy", "<i2", 2000)

    data = (version / "data-r00000.bin").read_bytes()
    ends = []
    for record in manifest.records:
        assert record.file == "data-r00000.bin"
        assert record.codec == "none"
        assert record.stored == record.nbytes
        for c, chunk in enumerate(record.chunks):
            assert chunk.offset % ALIGN == 0, (record.key, chunk)
            start, length = record.chunk_span(c)
            assert chunk.stored == length
            stored = data[chunk.offset : chunk.offset + chunk.stored]
            assert len(stored) == chunk.stored
            assert xxhash.xxh3_64_intdigest(stored) == chunk.checksum, record.key
            ends.append((chunk.offset, chunk.offset + chunk.stored))
    ends.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ends, ends[1:])), "chunks overlap"

    # The stored bytes are the tensors' bytes.
    w = by_key["['model']['w']"]
    expected = state["model"]["w"].numpy().tobytes()
    assert data[w.chunks[0].offset : w.chunks[0].offset + w.nbytes] == expected
    arr = by_key["['arr']"]
    assert data[arr.chunks[0].offset : arr.chunks[0].offset + 2000] == state["arr"].tobytes()

    assert not [n for n in os.listdir(root) if n.startswith(".")]


def test_steps_are_separate_directories_and_nothing_temporary_is_left(ckpt: Checkpointer, tmp_path: Path) -> None:
    for step in (1, 20, 300):
        # Waiting for each commit: a newer save may otherwise replace a pending one (by design).
        assert ckpt.save_sync(step, {"x": torch.full((1000,), step)}).committed_sync("nvme", timeout=60)
    root = tmp_path / "nvme"
    assert sorted(os.listdir(root)) == ["step-000000000001", "step-000000000020", "step-000000000300"]
    for name in os.listdir(root):
        manifest = Manifest.decode((root / name / MANIFEST_FILE).read_bytes())
        assert version_dirname(manifest.step) == name


# -- damage, and messages that name the manifest file (issue 11) ----------------------------------------


def test_every_bit_flip_and_truncation_of_a_real_manifest_is_refused_naming_the_file(
    ckpt: Checkpointer, tmp_path: Path
) -> None:
    assert ckpt.save_sync(12, _state(), metadata={"lr": 0.5}).committed_sync("nvme", timeout=60)
    data = (tmp_path / "nvme" / version_dirname(12) / MANIFEST_FILE).read_bytes()
    prefix = f"step 12 on tier 'nvme': {MANIFEST_FILE}: "
    refused = 0
    for i in range(len(data)):
        for bit in range(8):
            flipped = bytearray(data)
            flipped[i] ^= 1 << bit
            try:
                Manifest.decode(bytes(flipped), tier="nvme", step=12)
            except CorruptCheckpointError as exc:
                assert str(exc).startswith(prefix), str(exc)
                refused += 1
    for n in range(len(data)):
        with pytest.raises(CorruptCheckpointError, match=f"^{prefix}"):
            Manifest.decode(data[:n], tier="nvme", step=12)
    assert refused == 8 * len(data)  # every single-bit flip: none slips past the checksum


def test_messages_leave_out_what_is_not_known() -> None:
    with pytest.raises(CorruptCheckpointError, match=f"^a version: {MANIFEST_FILE}: not msgpack"):
        Manifest.decode(b"\xc1")
    with pytest.raises(CorruptCheckpointError, match=f"^step 3: {MANIFEST_FILE}: checksum mismatch"):
        Manifest.decode(msgpack.packb({"body": b"x", CHECKSUM_ALGORITHM: 1}), step=3)


def test_a_manifest_past_the_size_limit_is_refused_by_its_length() -> None:
    from tierckpt.format.manifest import MAX_MANIFEST_BYTES

    with pytest.raises(CorruptCheckpointError, match=f"{MAX_MANIFEST_BYTES + 1} bytes, more than the {MAX_MANIFEST_BYTES}"):
        Manifest.decode(bytes(MAX_MANIFEST_BYTES + 1))


@pytest.mark.parametrize(
    "field, value",
    [
        ("created", True),
        ("created", "1700000000"),
        ("created", float("inf")),
        ("created", float("nan")),
        ("created", -1.0),
        ("metadata", [["lr", 0.1]]),
        ("records", "abc"),
        ("records", {"0": 1}),
    ],
)
def test_decode_checks_field_types_strictly(field: str, value: Any) -> None:
    body = _body(_manifest().encode())
    body[field] = value
    with pytest.raises(CorruptCheckpointError, match="malformed field"):
        Manifest.decode(_rewrap(body))


@pytest.mark.parametrize("version", [2.0, True, [2]])
def test_a_version_that_only_compares_equal_is_not_read(version: Any) -> None:
    body = _body(_manifest().encode())
    body["version"] = version
    with pytest.raises(FormatVersionError):
        Manifest.decode(_rewrap(body))


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("file", "", "escapes the version directory"),
        ("file", "a\x00b", "escapes the version directory"),
        ("file", "x" * 256, "escapes the version directory"),
        ("codec", "lz4", "unknown codec 'lz4'"),
        ("codec", None, "unknown codec None"),
        ("chunks", [[0, 4000, 1, "gzip"]], "unknown codec 'gzip'"),
        ("shape", {"0": 1000}, "expected a list"),
    ],
)
def test_decode_refuses_file_names_and_codecs_it_cannot_read(field: str, value: Any, message: str) -> None:
    body = _body(_manifest().encode())
    body["records"][0][field] = value
    with pytest.raises(CorruptCheckpointError, match=re.escape(message)):
        Manifest.decode(_rewrap(body))


def test_a_manifest_no_reader_would_take_is_not_written() -> None:
    from tierckpt.errors import UnsupportedStateError
    from tierckpt.format.manifest import MAX_MANIFEST_BYTES

    manifest = Manifest(step=3, created=1.0, skeleton=None, records=(), metadata={"blob": bytes(MAX_MANIFEST_BYTES)})
    with pytest.raises(UnsupportedStateError, match=f"step 3 would take .* more than the {MAX_MANIFEST_BYTES}"):
        manifest.encode()
