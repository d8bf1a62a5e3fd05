"""The filesystem tier on real directories: sweeping on open, O_DIRECT fallback, replacement, full disks."""

from __future__ import annotations

import concurrent.futures
import errno
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from tierckpt import Checkpointer
from tierckpt.config import CompressionConfig
from tierckpt.tiers.stored.encoding import TierEncoding
from tierckpt.errors import ConfigError, FlushError
from tierckpt.format import MANIFEST_FILE, Chunk, Manifest, TensorRecord, checksum, version_dirname
from tierckpt.storage import local
from tierckpt.tiers.stored import write as fswrite
from tierckpt.tiers.stored.read import version_files
from tierckpt.storage.posix import probe_direct_io

from helpers import Opened, assert_bitwise, fs_tier_of, leftovers, logged_warnings, mount, ram_fs, unmount


CLOSE_TOLERATES = (FlushError,)  # for the opened fixture: closing raises again what a test provoked


def _state(step: int, numel: int = 50_000) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(numel, generator=g), "i": torch.arange(1001) * step, "step": step}


def _hidden(path: Path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.startswith("."))


def _save_committed(ckpt: Checkpointer, step: int, state: Any, tier: str = "nvme") -> None:
    assert ckpt.save_sync(step, state).committed_sync(tier, timeout=60) is True


def _restore_fresh(opened: Opened, path: Path, **tier: Any) -> Any:
    """Restore through a new Checkpointer: its memory tier is empty, so this reads the disk."""
    restored = opened(ram_fs(path, **tier)).restore_latest_sync()
    assert restored is None or restored.tier == tier.get("name", "nvme")
    return restored


# -- sweeping on open ---------------------------------------------------------------------------------


def test_leftovers_are_swept_on_open(opened: Opened, tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    _save_committed(opened(ram_fs(root)), 3, _state(3))
    opened.close()

    leftovers = [
        root / ".tmp-step-000000000007-abc",
        root / ".trash-step-000000000002-def",
        root / ".trash-step-000000000003-0123456789ab",
        root / "step-000000000009",  # no manifest: never committed
    ]
    for d in leftovers:
        d.mkdir()
        (d / "data-r00000.bin").write_bytes(b"\x01" * 5000)
    (leftovers[0] / "sub").mkdir()
    (leftovers[0] / "sub" / "x").write_bytes(b"x")
    # Not ours: left alone.
    (root / "notes.txt").write_text("mine")
    (root / "other-dir").mkdir()
    (root / "step-12").mkdir()

    ckpt = opened(ram_fs(root))
    for d in leftovers:
        assert not d.exists(), d.name
    assert sorted(os.listdir(root)) == ["notes.txt", "other-dir", "step-000000000003", "step-12"]
    assert [(v.tier, v.step) for v in ckpt.versions()] == [("nvme", 3)]
    restored = ckpt.restore_latest_sync()
    assert restored is not None and (restored.step, restored.tier) == (3, "nvme")
    assert_bitwise(restored.state, _state(3))


def test_a_version_with_a_corrupted_manifest_is_kept_but_skipped(opened: Opened, tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    first = opened(ram_fs(root))
    _save_committed(first, 4, _state(4))
    _save_committed(first, 8, _state(8))
    opened.close()
    manifest = root / version_dirname(8) / MANIFEST_FILE
    data = bytearray(manifest.read_bytes())
    data[len(data) // 2] ^= 0x55
    manifest.write_bytes(bytes(data))

    with logged_warnings() as said:
        ckpt = opened(ram_fs(root))
    # Said once at open, naming the tier once (issue 55: "tier 'nvme': step 8 on tier 'nvme': ...").
    [message] = [m for m in said if "step 8" in m]
    assert message.startswith("step 8 on tier 'nvme': ") and message.count("nvme") == 1, message
    assert message.endswith("; the version is kept, not deleted, and restores skip it"), message
    assert (root / version_dirname(8)).is_dir()  # maybe someone's only copy: never deleted
    assert manifest.read_bytes() == bytes(data)
    assert [v.step for v in ckpt.versions()] == [4, 8]
    with logged_warnings(match=r"step 8 on tier 'nvme' does not verify.*checksum mismatch"):
        restored = ckpt.restore_latest_sync()
    assert restored is not None and restored.step == 4
    assert_bitwise(restored.state, _state(4))
    assert (root / version_dirname(8)).is_dir()


def test_a_version_with_a_garbage_manifest_is_kept_and_skipped(opened: Opened, tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    root.mkdir()
    version = root / version_dirname(10)
    version.mkdir()
    (version / MANIFEST_FILE).write_bytes(b"\xc1 garbage")
    ckpt = opened(ram_fs(root))
    assert version.is_dir()
    with logged_warnings(match="step 10 on tier 'nvme'"):
        assert ckpt.restore_latest_sync() is None


# -- O_DIRECT and its fallback ------------------------------------------------------------------------


def test_direct_io_on_the_regular_disk_matches_the_probe(opened: Opened, tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    root.mkdir()
    probed = probe_direct_io(root)
    assert isinstance(probed, bool)
    assert not [n for n in os.listdir(root)], "the probe leaves no file behind"
    ckpt = opened(ram_fs(root))
    assert fs_tier_of(ckpt).direct is probed
    _save_committed(ckpt, 1, _state(1, 123_457))
    opened.close()
    restored = _restore_fresh(opened, root)
    assert_bitwise(restored.state, _state(1, 123_457))


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    path = Path(tempfile.mkdtemp(prefix="tierckpt-test-", dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_a_tier_on_dev_shm_writes_and_restores(opened: Opened, shm_dir: Path) -> None:
    # tmpfs refused O_DIRECT before Linux 6.6 and accepts it since: the tier follows the probe.
    ckpt = opened(ram_fs(shm_dir))
    assert fs_tier_of(ckpt).direct is probe_direct_io(shm_dir)
    _save_committed(ckpt, 2, _state(2, 77_777))
    opened.close()
    assert_bitwise(_restore_fresh(opened, shm_dir).state, _state(2, 77_777))


@pytest.fixture
def ramfs(tmp_path: Path) -> Iterator[Path]:
    target = tmp_path / "ramfs"
    mount("ramfs", target)
    try:
        yield target
    finally:
        unmount(target)


def test_a_file_system_refusing_o_direct_falls_back_to_buffered_io(opened: Opened, ramfs: Path) -> None:
    assert probe_direct_io(ramfs) is False  # ramfs has no direct I/O at all
    assert os.listdir(ramfs) == []
    ckpt = opened(ram_fs(ramfs / "nvme", capacity="16MiB"))
    assert fs_tier_of(ckpt).direct is False
    state = {"a": torch.randn(1_000_001), "b": torch.arange(3), "c": torch.empty(0)}
    assert ckpt.save_sync(1, state).committed_sync("nvme", timeout=60)
    opened.close()
    restored = _restore_fresh(opened, ramfs / "nvme")
    for key, value in state.items():
        assert torch.equal(restored.state[key], value)


def test_buffered_and_direct_writes_store_the_same_bytes(opened: Opened, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"a": torch.randn(100_003), "b": torch.arange(5000, dtype=torch.int16)}
    direct = opened(ram_fs(tmp_path / "direct"))
    _save_committed(direct, 1, state)
    monkeypatch.setattr("tierckpt.storage.local.probe_direct_io", lambda path: False)
    buffered = opened(ram_fs(tmp_path / "buffered"))
    assert fs_tier_of(buffered).direct is False
    _save_committed(buffered, 1, state)
    opened.close()
    payloads = []
    for name in ("direct", "buffered"):
        version = tmp_path / name / version_dirname(1)
        manifest = Manifest.decode((version / MANIFEST_FILE).read_bytes())
        data = (version / "data-r00000.bin").read_bytes()
        payloads.append([(r.key, [data[c.offset : c.offset + c.stored] for c in r.chunks]) for r in manifest.records])
        restored = _restore_fresh(opened, tmp_path / name)
        for key, value in state.items():
            assert torch.equal(restored.state[key], value)
    assert payloads[0] == payloads[1]


def test_packed_raw_chunks_are_not_clobbered_by_direct_io_padding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks whose size is not a multiple of 4 KiB are packed back to back; with O_DIRECT, the
    zero-padded tail page of one would overwrite the head of the next if that one was written first."""
    if not probe_direct_io(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    src = tmp_path / "src"
    src.mkdir()
    chunk_bytes = 5000  # as a version written with another chunk size might have
    payload = bytes(range(1, 251)) * 40
    (src / "data-r00000.bin").write_bytes(payload)
    chunks = tuple(Chunk(i * chunk_bytes, chunk_bytes, checksum(payload[i * chunk_bytes : (i + 1) * chunk_bytes])) for i in range(2))
    record = TensorRecord(0, "['x']", "numpy", "|u1", (10_000,), 10_000, "data-r00000.bin", "none", chunk_bytes, chunks)
    source = version_files(src).open_source("src", Manifest(step=1, created=0.0, skeleton=["leaf", 0], records=(record,)), direct=False)

    # A legal schedule on two threads: the chunk given the page-aligned offset writes last.
    write, other_wrote = local.pwrite_all, threading.Event()

    def ordered(data: memoryview, offset: int, fd: int, direct_fd: int | None) -> None:
        if offset % 4096 == 0:
            assert other_wrote.wait(30)
        write(data, offset, fd, direct_fd)
        if offset % 4096:
            other_wrote.set()

    monkeypatch.setattr(local, "pwrite_all", ordered)
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as executor:
            records = fswrite.write_data_file(source, tmp_path / "out.bin", _raw(), executor, direct=True)
    finally:
        source.close()
    data = (tmp_path / "out.bin").read_bytes()
    stored = b"".join(data[c.offset : c.offset + c.stored] for c in records[0].chunks)
    assert stored == payload
    assert [checksum(data[c.offset : c.offset + c.stored]) for c in records[0].chunks] == [c.checksum for c in chunks]


# -- replacing a committed step -----------------------------------------------------------------------


def test_saving_a_committed_step_again_replaces_it(opened: Opened, tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    _save_committed(opened(ram_fs(root)), 5, _state(5))
    opened.close()
    _save_committed(opened(ram_fs(root)), 5, _state(55))
    opened.close()
    assert sorted(os.listdir(root)) == [version_dirname(5)]
    restored = _restore_fresh(opened, root)
    assert restored.step == 5
    assert torch.equal(restored.state["w"], _state(55)["w"])
    assert restored.state["step"] == 55


def test_replacing_within_one_checkpointer(opened: Opened, tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    ckpt = opened(ram_fs(root))
    for seed in (1, 2, 3):
        _save_committed(ckpt, 7, _state(seed))
    assert [(v.tier, v.step) for v in ckpt.versions() if v.tier == "nvme"] == [("nvme", 7)]
    opened.close()
    assert sorted(os.listdir(root)) == [version_dirname(7)]
    assert_bitwise(_restore_fresh(opened, root).state, _state(3))


def test_an_interrupted_replacement_puts_the_old_version_back(opened: Opened, tmp_path: Path) -> None:
    # What a crash between the two renames of a replacement leaves: the committed version moved aside
    # (``.replaced-<dir>-<random>``), the new one still staged. tests/test_crash.py provokes it for real.
    root = tmp_path / "nvme"
    ckpt = opened(ram_fs(root))
    _save_committed(ckpt, 5, _state(5))
    _save_committed(ckpt, 6, _state(6))
    opened.close()
    os.rename(root / version_dirname(5), root / ".replaced-step-000000000005-0123456789ab")
    staged = root / ".tmp-step-000000000005-ba9876543210"
    shutil.copytree(root / version_dirname(6), staged)

    ckpt = opened(ram_fs(root))
    assert sorted(os.listdir(root)) == [version_dirname(5), version_dirname(6)]
    assert [v.step for v in ckpt.versions()] == [5, 6]
    os.rename(root / version_dirname(6), root / ".trash-step-000000000006-x")  # read step 5 from disk
    opened.close()
    restored = _restore_fresh(opened, root)
    assert restored.step == 5
    assert_bitwise(restored.state, _state(5))


def test_a_moved_aside_version_is_swept_once_its_replacement_is_committed(opened: Opened, tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    _save_committed(opened(ram_fs(root)), 5, _state(5))
    opened.close()
    shutil.copytree(root / version_dirname(5), root / ".replaced-step-000000000005-0123456789ab")
    (root / ".replaced-step-000000000007-0123456789ab").mkdir()  # no manifest: nothing to put back
    (root / ".replaced-garbage").mkdir()
    opened(ram_fs(root))
    assert sorted(os.listdir(root)) == [version_dirname(5)]


# -- a full disk ----------------------------------------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    target = tmp_path / "small"
    mount("tmpfs", target, "size=8m")
    try:
        yield target
    finally:
        unmount(target)


@pytest.fixture
def small_ext4(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB ext4 file system in a loop-mounted image (with a journal, no blocks reserved for root)."""
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("no mkfs.ext4")
    image = tmp_path / "ext4.img"
    with open(image, "wb") as f:
        f.truncate(16 << 20)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], capture_output=True, text=True, timeout=60)
    if made.returncode != 0:
        pytest.skip(f"mkfs.ext4 failed: {made.stderr.strip()}")
    target = tmp_path / "small"
    mount("ext4", target, "loop", source=image)
    try:
        yield target
    finally:
        unmount(target)


@pytest.fixture(params=["tmpfs", "ext4"])
def small_fs(request: pytest.FixtureRequest) -> Path:
    """A small real file system that can be filled up: a size-limited tmpfs, or a loop-mounted ext4."""
    return request.getfixturevalue("small_tmpfs" if request.param == "tmpfs" else "small_ext4")


def _errnos(exc: BaseException | None) -> list[int | None]:
    seen = []
    while exc is not None:
        seen.append(getattr(exc, "errno", None))
        exc = exc.__cause__ or exc.__context__
    return seen


def _free_bytes(path: Path) -> int:
    os.sync()  # ext4 counts freed blocks once their transaction commits
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _fill(path: Path, leave: int) -> Path:
    """Fill the file system of ``path`` with one file until the kernel says ENOSPC, then give back ``leave`` bytes."""
    filler = path / "filler"
    block = b"\xa5" * (1 << 20)
    with open(filler, "wb", buffering=0) as f:
        for size in (1 << 20, 1 << 16, 1 << 12):
            try:
                while True:
                    f.write(block[:size])
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
        os.fsync(f.fileno())
        f.truncate(max(0, os.fstat(f.fileno()).st_size - leave))
        os.fsync(f.fileno())
    return filler


def _random_state(step: int) -> dict[str, Any]:
    # Random bytes: no codec shrinks them, so a version takes its full 2 MB whatever the compression.
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randint(-(2**31), 2**31 - 1, (500_000,), dtype=torch.int32, generator=g), "step": step}


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_a_disk_that_fills_up_fails_flushes_until_space_is_freed(
    opened: Opened, small_fs: Path, tmp_path: Path, codec: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A real ENOSPC from the kernel: raw versions hit it in fallocate, compressed ones (packed chunks,
    nothing reserved) in pwritev. The saves go on, retention keeps the last good version, the failed
    attempts give their space back, and once space is freed the next save commits."""
    root = small_fs / "nvme"
    ckpt = opened(ram_fs(root, capacity="16MiB", keep={"last": 1}, compression={"codec": codec}))
    _save_committed(ckpt, 1, _random_state(1))
    filler = _fill(small_fs, leave=256 << 10)  # room for a directory and a manifest, not for 2 MB of data

    free = _free_bytes(small_fs)
    failures = []
    for step in (2, 3):  # still full at the second attempt: it fails the same way, and save() never raises
        handle = ckpt.save_sync(step, _random_state(step))
        assert not handle.skipped
        with pytest.raises(FlushError) as info:
            handle.committed_sync("nvme", timeout=60)
        failure = info.value
        failures.append(failure)
        assert (failure.tier, failure.step, failure.errno) == ("nvme", step, errno.ENOSPC)
        assert failure.filename is not None and failure.filename.startswith(str(root / ".tmp-step-")), failure.filename
        assert failure.filename in str(failure) and "ENOSPC" in str(failure) and f"step {step}" in str(failure)
        assert errno.ENOSPC in _errnos(failure.__cause__)
        # What the tier needs and has, at the end of the message: its one version as the disk counts it
        # (blocks in use), keep's versions with the one being written, and what is free.
        space = failure.space
        assert space is not None and (space.path, space.estimated) == (str(root), False), space
        in_use = sum(p.stat().st_blocks * 512 for p in (root / version_dirname(1)).iterdir())
        assert space.version_bytes == in_use >= 2_000_000, space
        assert (space.keep, space.kept, space.open_ended, space.keep_bytes) == ("{last: 1}", 1, False, 2 * in_use), space
        assert abs(space.free_bytes - _free_bytes(small_fs)) <= 64 << 10, space
        assert str(failure).endswith(f"({space})") and "MiB free in" in str(space), failure
        assert handle.committed_sync("ram", timeout=1) is True
        # The failed attempt gave its space back, and left nothing behind.
        assert leftovers(root) == []
        assert _free_bytes(small_fs) >= free - (64 << 10)
        # Retention never ran: the last good version is still there, and still the tier's only one.
        assert [v.step for v in ckpt.versions() if v.tier == "nvme"] == [1]

    counters = ckpt.counters
    assert (counters.flush_errors, counters.failed, counters.flushed["nvme"]) == (2, {"nvme": 2}, 1)
    assert counters.last_error["nvme"] is failures[-1]
    logged = [r.getMessage() for r in caplog.records if r.name == "tierckpt" and r.levelname == "ERROR"]
    for step in (2, 3):
        assert any(f"flushing step {step} failed with ENOSPC" in m and "MiB free in" in m and "holds steps [1]" in m for m in logged), logged

    # Step 1 as it was before the disk filled up, bit for bit (copied out: the tier is still open).
    shutil.copytree(root / version_dirname(1), tmp_path / "copy" / version_dirname(1))

    filler.unlink()
    handle = ckpt.save_sync(4, _random_state(4))
    assert handle.committed_sync("nvme", timeout=60) is True
    ckpt.wait_sync()  # the tier has committed since its failures: wait() has nothing to raise
    assert [v.step for v in ckpt.versions() if v.tier == "nvme"] == [4]  # step 1 goes only now
    assert leftovers(root) == []
    opened.close()

    restored = _restore_fresh(opened, root, capacity="16MiB")
    assert restored.step == 4 and torch.equal(restored.state["w"], _random_state(4)["w"])
    first = _restore_fresh(opened, tmp_path / "copy", capacity="16MiB")
    assert first.step == 1 and torch.equal(first.state["w"], _random_state(1)["w"]) and first.state["step"] == 1


# -- bad paths ------------------------------------------------------------------------------------------


def test_a_tier_path_that_is_a_regular_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "not-a-dir"
    path.write_text("x")
    with pytest.raises(ConfigError) as info:
        Checkpointer(ram_fs(path, name="pfs"))
    message = str(info.value)
    assert "'pfs'" in message and str(path) in message
    assert info.value.tier == "pfs"
    assert path.read_text() == "x"


def test_a_tier_path_below_a_regular_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(ConfigError, match="'nvme'") as info:
        Checkpointer(ram_fs(path / "sub"))
    assert str(path / "sub") in str(info.value)


def _raw() -> Any:
    """How an uncompressed tier writes one version."""
    return TierEncoding(CompressionConfig(), "out").begin()
