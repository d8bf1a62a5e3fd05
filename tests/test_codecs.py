"""Codecs: chunk round trips, corrupt frames, and compressed tiers end to end (promotion included)."""

from __future__ import annotations

import dataclasses
import os
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from tierckpt import Checkpointer
from tierckpt.codecs import NoneCodec, ShuffleCodec, ZstdCodec, decoder, get_codec
from tierckpt.config import CompressionConfig
from tierckpt.errors import ConfigError, CorruptCheckpointError
from tierckpt.format import ALIGN, MANIFEST_FILE, Manifest, checksum, version_dirname
from tierckpt.testing import Gates, flip_bits

from helpers import Opened, assert_bitwise, fs_tier, logged_warnings, tier_config

# -- chunk codecs -------------------------------------------------------------------------------------


def _decode(codec: Any, stored: bytes | memoryview, length: int) -> bytes:
    out = bytearray(length)
    codec.decode_into(memoryview(stored), memoryview(out))
    return bytes(out)


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=50_000), name=st.sampled_from(["none", "zstd"]))
def test_codecs_round_trip_bitwise(data: bytes, name: str) -> None:
    codec = get_codec(name)
    stored = bytes(codec.encode(memoryview(data)))
    assert _decode(codec, stored, len(data)) == data
    assert _decode(decoder(name), stored, len(data)) == data


@pytest.mark.parametrize("level", [-7, -1, 1, 3, 19])
def test_zstd_levels_round_trip(level: int) -> None:
    data = np.random.default_rng(0).integers(0, 4, 300_000, dtype=np.uint8).tobytes()
    codec = ZstdCodec(level)
    stored = codec.encode(memoryview(data))
    assert len(stored) < len(data)
    assert _decode(codec, stored, len(data)) == data


def test_none_encode_is_zero_copy() -> None:
    data = memoryview(bytearray(b"abc" * 1000))
    assert NoneCodec().encode(data) is data


def test_none_decode_of_the_wrong_length_is_corrupt() -> None:
    with pytest.raises(CorruptCheckpointError, match="expected 10"):
        _decode(NoneCodec(), b"123456789", 10)
    with pytest.raises(CorruptCheckpointError):
        _decode(NoneCodec(), b"12345678901", 10)


@pytest.fixture
def frame() -> tuple[bytes, bytes]:
    data = bytes(range(256)) * 400
    return data, ZstdCodec(3).encode(memoryview(data))


def test_zstd_decode_of_garbage_is_corrupt() -> None:
    for garbage in (b"", b"\x00" * 100, os.urandom(4096), b"not a zstd frame at all"):
        with pytest.raises(CorruptCheckpointError):
            _decode(ZstdCodec(), garbage, 1000)


def test_zstd_decode_of_a_truncated_frame_is_corrupt(frame: tuple[bytes, bytes]) -> None:
    data, stored = frame
    for cut in (1, 4, len(stored) // 2, len(stored) - 1):
        with pytest.raises(CorruptCheckpointError):
            _decode(ZstdCodec(), stored[:cut], len(data))


def test_zstd_decode_of_the_wrong_length_is_corrupt(frame: tuple[bytes, bytes]) -> None:
    data, stored = frame
    with pytest.raises(CorruptCheckpointError, match="wrong length"):
        _decode(ZstdCodec(), stored, len(data) + 1)  # frame too short for the destination
    with pytest.raises(CorruptCheckpointError, match="wrong length"):
        _decode(ZstdCodec(), stored, len(data) - 1)  # frame longer than the destination
    with pytest.raises(CorruptCheckpointError):
        _decode(ZstdCodec(), stored + stored, len(data))  # a second frame after the first


def test_zstd_decode_of_a_damaged_frame_does_not_pass_silently(frame: tuple[bytes, bytes]) -> None:
    data, stored = frame
    # Without a checksum in the frame, a flipped literal byte may decode to other bytes: that is what
    # the per-chunk xxh3 checksum of the stored bytes is for. Here: it either raises or differs.
    damaged = bytearray(stored)
    damaged[len(damaged) // 2] ^= 0xFF
    try:
        out = _decode(ZstdCodec(), bytes(damaged), len(data))
    except CorruptCheckpointError:
        return
    assert out != data


def test_zstd_errors_are_not_leaked_as_zstd_errors(frame: tuple[bytes, bytes]) -> None:
    data, stored = frame
    try:
        _decode(ZstdCodec(), stored[: len(stored) // 3], len(data))
    except CorruptCheckpointError:
        pass
    except zstandard.ZstdError as exc:  # pragma: no cover - the failure this test guards against
        pytest.fail(f"raw zstd error escaped: {exc!r}")


def test_unknown_codec_names() -> None:
    with pytest.raises(ConfigError, match="unknown codec 'lz4'"):
        get_codec("lz4")
    with pytest.raises(CorruptCheckpointError, match="unknown codec 'lz4'"):
        decoder("lz4")


def test_a_zstd_codec_is_usable_from_many_threads() -> None:
    import concurrent.futures

    codec = ZstdCodec(3)
    chunks = [bytes([i]) * 50_000 + os.urandom(1000) for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        stored = list(pool.map(lambda c: codec.encode(memoryview(c)), chunks))
        back = list(pool.map(lambda p: _decode(codec, p[0], len(p[1])), zip(stored, chunks)))
    assert back == chunks


# -- byte-shuffle ------------------------------------------------------------------------------------

_FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128]


def _weights(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Values shaped like trained weights: small, centred, so the exponent byte takes few values."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_complex:
        return torch.complex(torch.randn(n, generator=g), torch.randn(n, generator=g)).mul(0.02).to(dtype)
    return (torch.randn(n, generator=g) * 0.02).to(dtype)


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy())


def _planes(frame: bytes | memoryview) -> tuple[int, int, list[int], list[int]]:
    """(planes, tail, modes, lengths) from a byte-shuffle frame's header."""
    k, tail = frame[4], frame[5]
    fields = struct.unpack_from(f"<4sBBH{k}B{k}Q", frame, 0)
    return k, tail, list(fields[4 : 4 + k]), list(fields[4 + k :])


@pytest.mark.parametrize("dtype", _FLOATS, ids=str)
def test_shuffle_round_trips_every_float_dtype_bitwise(dtype: torch.dtype) -> None:
    t = _weights(50_001, dtype)
    t.view(-1)[::97] = float("nan")
    t.view(-1)[1::89] = float("-inf")
    t.view(-1)[2::83] = -0.0
    data = _raw(t)
    codec = ShuffleCodec(1)
    stored = bytes(codec.encode(data, t.element_size()))
    assert len(stored) < data.nbytes  # the exponent plane compresses
    assert _planes(stored)[0] == t.element_size()
    assert _decode(decoder("zstd+shuffle"), stored, data.nbytes) == bytes(data)


def test_shuffle_compresses_only_the_planes_that_pay() -> None:
    data = _raw(_weights(1 << 20, torch.float32))  # 4 MiB: planes of 1 MiB, sampled first
    stored = ShuffleCodec(1).encode(data, 4)
    k, tail, modes, lengths = _planes(stored)
    assert (k, tail) == (4, 0)
    assert modes == [0, 0, 0, 1]  # mantissa planes raw, the sign/exponent plane zstd
    assert lengths[:3] == [1 << 20] * 3 and lengths[3] < (1 << 20) // 2
    plain = len(ZstdCodec(1).encode(data))
    assert len(stored) < plain  # and it beats zstd on the interleaved bytes


def test_level_1_planes_are_smaller_than_zstd_level_1_makes_them_and_old_frames_still_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    data = _raw(_weights(1 << 20, torch.float32))
    tuned = bytes(ShuffleCodec(1).encode(data, 4))
    # Frames as tierckpt wrote them before the plane parameters: zstd's own level 1.
    monkeypatch.setattr("tierckpt.codecs._plane_parameters", lambda level: None)
    old = bytes(ShuffleCodec(1).encode(data, 4))
    monkeypatch.undo()
    assert old != tuned and len(tuned) < len(old)  # the exponent plane packs smaller, not only faster
    for frame in (old, tuned):
        assert _decode(decoder("zstd+shuffle"), frame, data.nbytes) == bytes(data)


@settings(max_examples=80, deadline=None)
@given(
    data=st.binary(max_size=3000),
    itemsize=st.sampled_from([2, 4, 8, 16]),
    repeat=st.integers(min_value=1, max_value=40),
)
def test_shuffle_round_trips_any_bytes_and_lengths(data: bytes, itemsize: int, repeat: int) -> None:
    # Repeats make planes compressible; lengths that are no multiple of itemsize leave a tail.
    blob = memoryview(data * repeat)
    codec = ShuffleCodec(1)
    stored = codec.encode(blob, itemsize)
    if stored is blob:
        return  # not worth a frame: the tier stores the chunk raw, as codec "none"
    assert len(stored) < len(blob)
    assert _planes(stored)[1] == len(blob) % itemsize
    assert _decode(codec, bytes(stored), len(blob)) == bytes(blob)


def test_shuffle_hands_back_data_that_does_not_compress() -> None:
    data = memoryview(os.urandom(1 << 20))
    assert ShuffleCodec(1).encode(data, 4) is data
    empty = memoryview(b"")
    assert ShuffleCodec(1).encode(empty, 4) is empty
    one = memoryview(bytes(1000))
    assert ShuffleCodec(1).encode(one, 1) is one  # one-byte items: nothing to shuffle


def test_min_ratio_decides_per_plane() -> None:
    # Plane 1 saves about a third; plane 0 is noise. A strict min_ratio keeps plane 1 raw too.
    rng = np.random.default_rng(0)
    items = np.empty((200_000, 2), np.uint8)
    items[:, 0] = rng.integers(0, 256, 200_000)
    items[:, 1] = rng.integers(0, 32, 200_000)
    data = memoryview(items.tobytes())
    assert _planes(ShuffleCodec(1, min_ratio=1.05).encode(data, 2))[2] == [0, 1]
    assert ShuffleCodec(1, min_ratio=3.0).encode(data, 2) is data


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda f: b"XXXX" + f[4:], "no valid header"),
        (lambda f: f[:4] + bytes([1]) + f[5:], "declares 1 planes"),
        (lambda f: f[:5] + bytes([7]) + f[6:], "declares 4 planes and a 7-byte tail"),
        (lambda f: f[:8] + bytes([2]) + f[9:], "invalid plane table"),
        (lambda f: f[:-1], "do not add up"),
        (lambda f: f + b"\x00", "do not add up"),
        (lambda f: f[:6], "no valid header"),
        (lambda f: f[:12], "shorter than its header"),
    ],
)
def test_a_damaged_shuffle_frame_is_corrupt(damage: Any, message: str) -> None:
    data = _raw(_weights(10_000, torch.float32))
    frame = bytes(ShuffleCodec(1).encode(data, 4))
    with pytest.raises(CorruptCheckpointError, match=message):
        _decode(decoder("zstd+shuffle"), damage(frame), data.nbytes)


def test_a_shuffle_frame_for_the_wrong_length_is_corrupt() -> None:
    data = _raw(_weights(10_000, torch.float32))
    frame = bytes(ShuffleCodec(1).encode(data, 4))
    with pytest.raises(CorruptCheckpointError, match="cannot fill|invalid plane table"):
        _decode(decoder("zstd+shuffle"), frame, data.nbytes + 4)
    with pytest.raises(CorruptCheckpointError, match="zstd frame"):
        k, _, modes, lengths = _planes(frame)
        packed = 8 + 9 * k + sum(lengths[:3])  # the zstd plane's first byte
        _decode(decoder("zstd+shuffle"), frame[:packed] + bytes([frame[packed] ^ 0xFF]) + frame[packed + 1 :], data.nbytes)


def test_a_shuffle_codec_is_usable_from_many_threads() -> None:
    import concurrent.futures

    codec = ShuffleCodec(1)
    chunks = [bytes(_raw(_weights(30_000 + i, torch.bfloat16, seed=i))) for i in range(12)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        stored = list(pool.map(lambda c: bytes(codec.encode(memoryview(c), 2)), chunks))
        back = list(pool.map(lambda p: _decode(codec, p[0], len(p[1])), zip(stored, chunks)))
    assert back == chunks
    assert all(len(s) < len(c) for s, c in zip(stored, chunks))


# -- compressed tiers end to end ------------------------------------------------------------------------


def _tier(name: str, path: Path, codec: str = "none", **compression: Any) -> dict[str, Any]:
    if codec == "none":
        return fs_tier(name, path)
    return fs_tier(name, path, compression={"codec": codec, "level": 3, **compression})


def _config(*tiers: dict[str, Any], capacity: str = "16MiB") -> dict[str, Any]:
    return tier_config(*tiers, capacity=capacity)


def _state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "zeros": torch.zeros(256, 1024),  # 1 MiB of zeros
        "small_ints": torch.randint(0, 8, (300_001,), generator=g, dtype=torch.int32),  # compressible, odd length
        "noise": torch.randn(10_000, generator=g),  # barely compressible
        "half": torch.randn(999, generator=g).to(torch.bfloat16),
        "np": np.arange(5000, dtype=np.float64) % 7,
        "meta": {"epoch": 3, "names": ["a", "b"], "t": (1, 2.5, None)},
    }


def _restore_from(opened: Opened, name: str, path: Path, codec: str = "none") -> Any:
    """Restore through a new Checkpointer that sees only this one filesystem tier (the others closed: one per directory)."""
    for c in opened.all:
        c.close_sync()
    restored = opened(_config(_tier(name, path, codec))).restore_latest_sync()
    assert restored is not None
    assert restored.tier == name
    return restored


def _manifest(path: Path, step: int) -> Manifest:
    return Manifest.decode((path / version_dirname(step) / MANIFEST_FILE).read_bytes(), step=step)


def _data_size(path: Path, step: int) -> int:
    return (path / version_dirname(step) / "data-r00000.bin").stat().st_size


def test_a_zstd_tier_stores_fewer_bytes_and_restores_bitwise(opened: Opened, tmp_path: Path) -> None:
    raw, packed = tmp_path / "raw", tmp_path / "zstd"
    # Two filesystem tiers below ram, each taking the save from host memory (different codecs).
    ckpt = opened(_config(_tier("raw", raw), _tier("packed", packed, "zstd")))
    state = _state()
    handle = ckpt.save_sync(5, state)
    assert handle.committed_sync("raw", timeout=60) and handle.committed_sync("packed", timeout=60)

    raw_manifest, zstd_manifest = _manifest(raw, 5), _manifest(packed, 5)
    assert {r.codec for r in raw_manifest.records} == {"none"}
    assert {r.codec for r in zstd_manifest.records} == {"zstd"}
    by_key = {r.key: r for r in zstd_manifest.records}
    assert by_key["['zeros']"].stored < by_key["['zeros']"].nbytes // 100
    assert by_key["['small_ints']"].stored < by_key["['small_ints']"].nbytes // 2
    assert zstd_manifest.stored_bytes < raw_manifest.stored_bytes // 2
    assert _data_size(packed, 5) == zstd_manifest.stored_bytes  # packed back to back, no hole
    assert _data_size(packed, 5) < _data_size(raw, 5) // 2
    infos = {(i.tier, i.step): i for i in ckpt.versions()}
    assert infos[("packed", 5)].nbytes == zstd_manifest.stored_bytes < infos[("raw", 5)].nbytes

    assert_bitwise(_restore_from(opened, "packed", packed, "zstd").state, state)


def test_promotion_raw_to_zstd_to_raw_restores_bitwise_on_every_tier(opened: Opened, tmp_path: Path) -> None:
    nvme, pfs, archive = tmp_path / "nvme", tmp_path / "pfs", tmp_path / "archive"
    ckpt = opened(_config(_tier("nvme", nvme), _tier("pfs", pfs, "zstd"), _tier("archive", archive)))
    states = {step: _state(step) for step in (1, 2)}
    for step, state in states.items():
        assert ckpt.save_sync(step, state).committed_sync("archive", timeout=60)
    ckpt.close_sync()

    # Each tier took the saves from host memory (raw); pfs compressed them, archive did not.
    assert {r.codec for r in _manifest(pfs, 2).records} == {"zstd"}
    archived = _manifest(archive, 2)
    assert {r.codec for r in archived.records} == {"none"}
    assert all(c.offset % ALIGN == 0 for r in archived.records for c in r.chunks)
    assert archived.stored_bytes == sum(r.nbytes for r in archived.records)

    for name, path, codec in (("nvme", nvme, "none"), ("pfs", pfs, "zstd"), ("archive", archive, "none")):
        restored = _restore_from(opened, name, path, codec)
        assert restored.step == 2
        assert_bitwise(restored.state, states[2])


def test_a_zstd_tier_with_a_multi_chunk_tensor(opened: Opened, tmp_path: Path) -> None:
    # 17 MiB: more than one 16 MiB chunk, so the chunks are compressed and packed independently.
    big = torch.zeros(17 << 18, dtype=torch.float32)
    big[:: 1 << 12] = torch.arange(big.numel() >> 12, dtype=torch.float32)
    state = {"big": big, "tail": torch.arange(10)}
    ckpt = opened(_config(_tier("nvme", tmp_path / "nvme"), _tier("pfs", tmp_path / "pfs", "zstd"), capacity="40MiB"))
    assert ckpt.save_sync(1, state).committed_sync("pfs", timeout=60)
    ckpt.close_sync()
    for name in ("nvme", "pfs"):
        record = next(r for r in _manifest(tmp_path / name, 1).records if r.key == "['big']")
        assert len(record.chunks) == 2
    assert _manifest(tmp_path / "pfs", 1).stored_bytes < 1 << 20
    assert_bitwise(_restore_from(opened, "pfs", tmp_path / "pfs", "zstd").state, state)
    assert_bitwise(_restore_from(opened, "nvme", tmp_path / "nvme").state, state)


def test_a_corrupted_zstd_chunk_is_detected(opened: Opened, tmp_path: Path) -> None:
    pfs = tmp_path / "pfs"
    ckpt = opened(_config(_tier("pfs", pfs, "zstd")))
    assert ckpt.save_sync(1, {"a": torch.zeros(100_000)}).committed_sync("pfs", timeout=60)
    assert ckpt.save_sync(2, {"a": torch.ones(100_000)}).committed_sync("pfs", timeout=60)
    ckpt.close_sync()
    record = _manifest(pfs, 2).records[0]
    data_file = pfs / version_dirname(2) / "data-r00000.bin"
    flip_bits(data_file, record.chunks[0].offset + record.chunks[0].stored // 2, 0x40)
    with logged_warnings(match=r"step 2 on tier 'pfs'.*\['a'\]"):
        restored = opened(_config(_tier("pfs", pfs, "zstd"))).restore_latest_sync()
    assert restored is not None and restored.step == 1
    assert torch.equal(restored.state["a"], torch.zeros(100_000))


# -- shuffle tiers, min_ratio, when: faster ------------------------------------------------------------


def _model_state() -> dict[str, Any]:
    """Every storable kind of tensor a training state holds, weights-like floats, odd sizes."""
    state: dict[str, Any] = {f"w_{str(d).removeprefix('torch.')}": _weights(70_001, d, seed=i) for i, d in enumerate(_FLOATS)}
    state["fp8"] = _weights(5000, torch.float32).to(torch.float8_e4m3fn)  # one-byte floats: plain zstd
    state["ids"] = torch.arange(100_003, dtype=torch.int64) % 1000
    state["mask"] = torch.arange(4099) % 3 == 0
    state["noise"] = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    state["empty"] = torch.empty(0, 3)
    state["one"] = torch.tensor([1.5], dtype=torch.float64)
    state["np"] = np.random.default_rng(0).standard_normal(30_001).astype(np.float32) * 0.01
    state["step"] = 7
    return state


def test_a_shuffle_tier_picks_a_codec_per_dtype_and_restores_bitwise(opened: Opened, tmp_path: Path) -> None:
    pfs = tmp_path / "pfs"
    ckpt = opened(_config(_tier("pfs", pfs, "zstd", level=1, shuffle=True), capacity="24MiB"))
    state = _model_state()
    assert ckpt.save_sync(3, state).committed_sync("pfs", timeout=60)
    records = {r.key: r for r in _manifest(pfs, 3).records}
    for d in _FLOATS:
        record = records[f"['w_{str(d).removeprefix('torch.')}']"]
        assert record.codec == "zstd+shuffle"
        assert record.stored < record.nbytes
    assert records["['np']"].codec == "zstd+shuffle"
    assert {records[k].codec for k in ("['fp8']", "['ids']", "['mask']", "['noise']")} == {"zstd"}
    # Random bytes do not compress: stored raw, and the chunk says so.
    assert records["['noise']"].chunk_codec(0) == "none"
    assert records["['noise']"].stored == records["['noise']"].nbytes
    stats = ckpt.counters.compression["pfs"]
    assert stats.chunks_raw >= 1 and stats.chunks_compressed >= len(_FLOATS)
    assert stats.logical_bytes == sum(r.nbytes for r in records.values())
    assert stats.stored_bytes == _manifest(pfs, 3).stored_bytes < stats.logical_bytes
    assert stats.ratio > 1.0 and stats.compress_bytes_per_s > 0
    assert_bitwise(_restore_from(opened, "pfs", pfs, "zstd").state, state)


def test_a_raw_tier_decodes_a_compressed_tier_above_once_host_memory_let_the_save_go(tmp_path: Path) -> None:
    """archive (raw, every 3rd step) is busy with step 3 when step 9, its next pick, arrives; pfs (zstd)
    commits step 9, nvme (even steps) never takes it. Step 10 needs step 9's host slot (2 slots, step
    3's being read): pfs holds step 9, so host memory lets it go, and archive reads pfs's zstd frames,
    decodes them and stores them raw, bitwise."""
    gates = Gates("archive", deadline_s=60)
    config = _config(
        _tier("nvme", tmp_path / "nvme") | {"flush": {"every_steps": 2}},
        _tier("pfs", tmp_path / "pfs", "zstd"),
        _tier("archive", tmp_path / "archive") | {"flush": {"every_steps": 3}},
        capacity="40MiB",
    )
    states = {step: _state(step) for step in (3, 9, 10)}
    ckpt = Checkpointer(config, tier_factory=gates)
    try:
        ckpt.save_sync(3, states[3])
        assert gates["archive"].started.wait(60)
        h9 = ckpt.save_sync(9, states[9])
        assert h9.committed_sync("pfs", timeout=60) is True
        h10 = ckpt.save_sync(10, states[10])
        assert not h10.skipped and h10.committed_sync("nvme", timeout=60) is True
        gates.open_all()
        assert h9.committed_sync("archive", timeout=60) is True
        assert gates["archive"].sources == ["ram", "pfs"]
    finally:
        gates.open_all()
        ckpt.close_sync()
    archived = _manifest(tmp_path / "archive", 9)
    assert {r.codec for r in archived.records} == {"none"}
    assert archived.stored_bytes == sum(r.nbytes for r in archived.records)
    with Checkpointer(_config(_tier("archive", tmp_path / "archive"), capacity="40MiB")) as reader:
        restored = reader.restore_latest_sync()
    assert restored is not None and restored.step == 9
    assert_bitwise(restored.state, states[9])


def test_promotion_copies_chunks_between_tiers_with_the_same_codec(opened: Opened, tmp_path: Path) -> None:
    nvme, pfs, archive = tmp_path / "nvme", tmp_path / "pfs", tmp_path / "archive"
    shuffle = {"level": 1, "shuffle": True}
    ckpt = opened(
        _config(_tier("nvme", nvme, "zstd", **shuffle), _tier("pfs", pfs, "zstd", **shuffle), _tier("archive", archive), capacity="24MiB")
    )
    state = _model_state()
    handle = ckpt.save_sync(1, state)
    assert all(handle.committed_sync(name, timeout=60) for name in ("nvme", "pfs", "archive"))
    stats = ckpt.counters.compression
    ckpt.close_sync()
    first, second = _manifest(nvme, 1), _manifest(pfs, 1)
    # Same codecs: pfs waited for nvme's write of the same save and copied its stored chunks as they
    # are (raw fallbacks included), rather than compress the bytes in host memory a second time.
    assert [(r.codec, [(c.stored, c.checksum, c.codec) for c in r.chunks]) for r in first.records] == [
        (r.codec, [(c.stored, c.checksum, c.codec) for c in r.chunks]) for r in second.records
    ]
    assert stats["pfs"].compress_bytes_per_s == 0.0 and stats["nvme"].compress_bytes_per_s > 0
    assert stats["pfs"].stored_bytes == stats["nvme"].stored_bytes
    # An uncompressed tier copies host memory as it is (had it read a compressed tier, it would decode).
    assert {r.codec for r in _manifest(archive, 1).records} == {"none"}
    for name, path, codec in (("pfs", pfs, "zstd"), ("archive", archive, "none")):
        assert_bitwise(_restore_from(opened, name, path, codec).state, state)


def test_min_ratio_keeps_chunks_raw_that_do_not_save_enough(opened: Opened, tmp_path: Path) -> None:
    pfs = tmp_path / "pfs"
    ckpt = opened(_config(_tier("pfs", pfs, "zstd", level=1, shuffle=True, min_ratio=50.0), capacity="24MiB"))
    state = _model_state()
    assert ckpt.save_sync(1, state).committed_sync("pfs", timeout=60)
    manifest = _manifest(pfs, 1)
    by_key = {r.key: r for r in manifest.records}
    # Weights save ~15-30%: far from 50-fold, so they are stored raw; a repeating pattern of ids is kept compressed.
    for d in _FLOATS:
        assert by_key[f"['w_{str(d).removeprefix('torch.')}']"].chunk_codec(0) == "none"
    assert by_key["['ids']"].chunk_codec(0) == "zstd"
    for record in manifest.records:
        for i, chunk in enumerate(record.chunks):
            if record.chunk_codec(i) == "none":
                assert chunk.stored == record.chunk_span(i)[1]
            else:
                assert chunk.stored * 50 <= record.chunk_span(i)[1]
    stats = ckpt.counters.compression["pfs"]
    assert stats.chunks_raw >= len(_FLOATS) and stats.chunks_compressed >= 1
    assert_bitwise(_restore_from(opened, "pfs", pfs, "zstd").state, state)


def test_when_faster_bypasses_a_compressor_slower_than_the_disk(
    opened: Opened, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # zstd level 19 runs at a few MB/s here, far below any disk: after measuring both, the tier
    # writes raw. The first version is written raw (measuring the disk), the second compressed.
    pfs = tmp_path / "pfs"
    ckpt = opened(_config(_tier("pfs", pfs, "zstd", level=19, when="faster"), capacity="8MiB"))
    state = {"w": _weights(400_000, torch.float32), "ids": torch.arange(100_000) % 7}
    with caplog.at_level("INFO", logger="tierckpt"):
        for step in (1, 2, 3, 4):
            assert ckpt.save_sync(step, state).committed_sync("pfs", timeout=120)
    codecs = [{r.chunk_codec(0) for r in _manifest(pfs, step).records} for step in (1, 2, 3, 4)]
    assert codecs == [{"none"}, {"zstd"}, {"none"}, {"none"}]
    stats = ckpt.counters.compression["pfs"]
    assert stats.bypassing and stats.versions_bypassed == 3 and stats.versions_compressed == 1
    assert 0 < stats.compress_bytes_per_s < stats.write_bytes_per_s
    assert "slower than writing raw" in caplog.text
    assert_bitwise(_restore_from(opened, "pfs", pfs, "zstd").state, state)


def test_when_faster_keeps_compressing_a_compressor_faster_than_the_disk(
    opened: Opened, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A 5 MB/s disk: every write takes its bytes' time first (inside the timed write, as a slow
    # disk would). zstd level 1 (hundreds of MB/s) keeps up with that.
    from tierckpt.storage import local

    write = local.pwrite_all

    def slow_disk(data: memoryview, offset: int, fd: int, direct_fd: int | None) -> None:
        time.sleep(data.nbytes / 5e6)
        write(data, offset, fd, direct_fd)

    monkeypatch.setattr(local, "pwrite_all", slow_disk)
    pfs = tmp_path / "pfs"
    ckpt = opened(_config(_tier("pfs", pfs, "zstd", level=1, shuffle=True, when="faster"), capacity="8MiB"))
    state = {"w": _weights(250_000, torch.float32)}
    for step in (1, 2, 3):
        assert ckpt.save_sync(step, state).committed_sync("pfs", timeout=120)
    codecs = [_manifest(pfs, step).records[0].codec for step in (1, 2, 3)]
    assert codecs == ["none", "zstd+shuffle", "zstd+shuffle"]
    stats = ckpt.counters.compression["pfs"]
    assert not stats.bypassing and stats.versions_bypassed == 1 and stats.versions_compressed == 2
    assert stats.compress_bytes_per_s > stats.write_bytes_per_s > 0


def test_a_damaged_chunk_of_a_shuffle_tier_names_the_key_and_chunk(opened: Opened, tmp_path: Path) -> None:
    pfs = tmp_path / "pfs"
    ckpt = opened(_config(_tier("pfs", pfs, "zstd", level=1, shuffle=True), capacity="40MiB"))
    old = {"w": _weights(5 << 20, torch.float32, seed=1)}  # 20 MiB: two chunks
    new = {"w": _weights(5 << 20, torch.float32, seed=2)}
    assert ckpt.save_sync(1, old).committed_sync("pfs", timeout=60)
    assert ckpt.save_sync(2, new).committed_sync("pfs", timeout=60)
    ckpt.close_sync()
    record = _manifest(pfs, 2).records[0]
    assert len(record.chunks) == 2 and record.chunk_codec(1) == "zstd+shuffle"
    chunk = record.chunks[1]
    data_file = pfs / version_dirname(2) / "data-r00000.bin"
    flip_bits(data_file, chunk.offset + chunk.stored - 100, 0x01)  # inside the compressed exponent plane
    with logged_warnings(match=r"step 2 on tier 'pfs'.*checksum mismatch in \['w'\] \(chunk 1\)"):
        restored = opened(_config(_tier("pfs", pfs, "zstd"), capacity="40MiB")).restore_latest_sync()
    assert restored is not None and restored.step == 1
    assert_bitwise(restored.state, old)


def test_a_frame_that_matches_its_checksum_but_does_not_decode_names_the_chunk(opened: Opened, tmp_path: Path) -> None:
    # A writer bug, not a disk error: the checksum holds, the frame does not decode.
    pfs = tmp_path / "pfs"
    ckpt = opened(_config(_tier("pfs", pfs, "zstd", level=1, shuffle=True)))
    assert ckpt.save_sync(1, {"w": _weights(100_000, torch.float32)}).committed_sync("pfs", timeout=60)
    ckpt.close_sync()
    version = pfs / version_dirname(1)
    manifest = _manifest(pfs, 1)
    chunk = manifest.records[0].chunks[0]
    data = bytearray((version / "data-r00000.bin").read_bytes())
    data[chunk.offset + 5] = 3  # a 3-byte tail in a frame of 4 planes: the lengths no longer add up
    (version / "data-r00000.bin").write_bytes(bytes(data))
    stored = bytes(data[chunk.offset : chunk.offset + chunk.stored])
    records = (dataclasses.replace(manifest.records[0], chunks=(dataclasses.replace(chunk, checksum=checksum(stored)),)),)
    (version / MANIFEST_FILE).write_bytes(dataclasses.replace(manifest, records=records).encode())
    with logged_warnings(match=r"\['w'\] chunk 0 does not decode"):
        assert opened(_config(_tier("pfs", pfs, "zstd"))).restore_latest_sync() is None


def test_compressor_throughput_counts_the_threads_that_compressed(opened: Opened, tmp_path: Path) -> None:
    # One chunk per version: one thread compresses, whatever io_threads says. The reported throughput
    # is that thread's, not eight times it.
    from tierckpt.tiers.stored.encoding import TierEncoding

    rates = {}
    for threads in (1, 8):
        pfs = tmp_path / f"pfs{threads}"
        tier = _tier("pfs", pfs, "zstd", level=1, shuffle=True)
        tier["io_threads"] = threads
        ckpt = opened(_config(tier, capacity="24MiB"))
        state = {"w": _weights(1 << 20, torch.float32)}  # 4 MiB: one chunk
        for step in (1, 2):
            assert ckpt.save_sync(step, state).committed_sync("pfs", timeout=60)
        rates[threads] = ckpt.counters.compression["pfs"].compress_bytes_per_s
        ckpt.close_sync()
    assert rates[1] > 0 and rates[8] < 3 * rates[1]  # not inflated by the idle threads
    encoding = TierEncoding(CompressionConfig(codec="zstd", shuffle=True), "t").begin()
    data = memoryview(bytes(_raw(_weights(1 << 20, torch.float32))))
    encoding.encode("zstd+shuffle", data[: 2 << 20], 4)
    encoding.encode("zstd+shuffle", data[2 << 20 :], 4)
    assert len(encoding.encoders) == 1  # the same thread twice
