"""Codecs: chunk round trips, corrupt frames, and compressed tiers end to end (promotion included)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from tierckpt import Checkpointer
from tierckpt.codecs import NoneCodec, ZstdCodec, decoder, get_codec
from tierckpt.errors import ConfigError, CorruptCheckpointError
from tierckpt.format import ALIGN, MANIFEST_FILE, Manifest, version_dirname

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


# -- compressed tiers end to end ------------------------------------------------------------------------


def _tier(name: str, path: Path, codec: str = "none") -> dict[str, Any]:
    tier: dict[str, Any] = {"name": name, "type": "filesystem", "path": str(path)}
    if codec != "none":
        tier["compression"] = {"codec": codec, "level": 3}
    return tier


def _config(*tiers: dict[str, Any], capacity: str = "16MiB") -> dict[str, Any]:
    return {"host": {"capacity": capacity, "snapshots": 2}, "tiers": [{"name": "ram", "type": "memory"}, *tiers]}


class _Opened:
    def __init__(self) -> None:
        self.all: list[Checkpointer] = []

    def __call__(self, config: dict[str, Any]) -> Checkpointer:
        c = Checkpointer(config)
        self.all.append(c)
        return c


@pytest.fixture
def opened() -> Iterator[_Opened]:
    o = _Opened()
    try:
        yield o
    finally:
        for c in o.all:
            c.close_sync()


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


def _assert_bitwise(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device)
        assert a.contiguous().view(torch.uint8).equal(b.contiguous().view(torch.uint8))
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray)
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        assert a.tobytes() == b.tobytes()
    elif isinstance(a, dict):
        assert type(b) is dict and list(a) == list(b)
        for k in a:
            _assert_bitwise(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_bitwise(x, y)
    else:
        assert type(a) is type(b) and a == b


def _restore_from(opened: _Opened, name: str, path: Path, codec: str = "none") -> Any:
    """Restore through a new Checkpointer that sees only this one filesystem tier."""
    restored = opened(_config(_tier(name, path, codec))).restore_latest_sync()
    assert restored is not None
    assert restored.tier == name
    return restored


def _manifest(path: Path, step: int) -> Manifest:
    return Manifest.decode((path / version_dirname(step) / MANIFEST_FILE).read_bytes(), step=step)


def _data_size(path: Path, step: int) -> int:
    return (path / version_dirname(step) / "data-r00000.bin").stat().st_size


def test_a_zstd_tier_stores_fewer_bytes_and_restores_bitwise(opened: _Opened, tmp_path: Path) -> None:
    raw, packed = tmp_path / "raw", tmp_path / "zstd"
    # Two independent filesystem tiers below ram: raw receives from ram, zstd from raw.
    ckpt = opened(_config(_tier("raw", raw), _tier("packed", packed, "zstd")))
    state = _state()
    handle = ckpt.save_sync(5, state)
    assert handle.committed_sync("packed", timeout=60)

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

    _assert_bitwise(state, _restore_from(opened, "packed", packed, "zstd").state)


def test_promotion_raw_to_zstd_to_raw_restores_bitwise_on_every_tier(opened: _Opened, tmp_path: Path) -> None:
    nvme, pfs, archive = tmp_path / "nvme", tmp_path / "pfs", tmp_path / "archive"
    ckpt = opened(_config(_tier("nvme", nvme), _tier("pfs", pfs, "zstd"), _tier("archive", archive)))
    states = {step: _state(step) for step in (1, 2)}
    for step, state in states.items():
        assert ckpt.save_sync(step, state).committed_sync("archive", timeout=60)
    ckpt.close_sync()

    # pfs (zstd) was written from nvme's raw files, archive (raw) from pfs's zstd frames.
    assert {r.codec for r in _manifest(pfs, 2).records} == {"zstd"}
    archived = _manifest(archive, 2)
    assert {r.codec for r in archived.records} == {"none"}
    assert all(c.offset % ALIGN == 0 for r in archived.records for c in r.chunks)
    assert archived.stored_bytes == sum(r.nbytes for r in archived.records)

    for name, path, codec in (("nvme", nvme, "none"), ("pfs", pfs, "zstd"), ("archive", archive, "none")):
        restored = _restore_from(opened, name, path, codec)
        assert restored.step == 2
        _assert_bitwise(states[2], restored.state)


def test_a_zstd_tier_with_a_multi_chunk_tensor(opened: _Opened, tmp_path: Path) -> None:
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
    _assert_bitwise(state, _restore_from(opened, "pfs", tmp_path / "pfs", "zstd").state)
    _assert_bitwise(state, _restore_from(opened, "nvme", tmp_path / "nvme").state)


def test_a_corrupted_zstd_chunk_is_detected(opened: _Opened, tmp_path: Path) -> None:
    pfs = tmp_path / "pfs"
    ckpt = opened(_config(_tier("pfs", pfs, "zstd")))
    assert ckpt.save_sync(1, {"a": torch.zeros(100_000)}).committed_sync("pfs", timeout=60)
    assert ckpt.save_sync(2, {"a": torch.ones(100_000)}).committed_sync("pfs", timeout=60)
    ckpt.close_sync()
    record = _manifest(pfs, 2).records[0]
    data_file = pfs / version_dirname(2) / "data-r00000.bin"
    with open(data_file, "r+b") as f:
        f.seek(record.chunks[0].offset + record.chunks[0].stored // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.warns(RuntimeWarning, match=r"step 2 on tier 'pfs'.*\['a'\]"):
        restored = opened(_config(_tier("pfs", pfs, "zstd"))).restore_latest_sync()
    assert restored is not None and restored.step == 1
    assert torch.equal(restored.state["a"], torch.zeros(100_000))
