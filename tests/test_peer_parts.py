"""The peer tier's parts that need no second process: pacing, the copy's layout, the replica directory."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tierckpt.format import ALIGN, Chunk, Manifest, TensorRecord, checksum
from tierckpt.tiers import wire
from tierckpt.tiers.peer.recovery import fetch_plan, holders_of
from tierckpt.tiers.peer.replicas import _PRIVATE, ReplicaId, ReplicaStore


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_the_throttle_keeps_the_average_rate_under_the_cap_from_the_first_byte() -> None:
    clock = FakeClock()
    throttle = wire.Throttle(1000, clock=clock, sleep=clock.sleep)
    for _ in range(10):
        throttle.spent(500)  # sent instantly: the throttle alone sets the pace
    assert clock.now - 100.0 == pytest.approx(5.0)  # 5000 bytes at 1000 B/s
    assert throttle.slept_s == pytest.approx(5.0)
    clock.now += 60  # idle, then a new copy: the idle minute is no credit for a burst
    throttle.begin()
    before = clock.now
    throttle.spent(2000)
    assert clock.now - before == pytest.approx(2.0)


def test_no_cap_never_sleeps() -> None:
    clock = FakeClock()
    throttle = wire.Throttle(None, clock=clock, sleep=clock.sleep)
    throttle.spent(1 << 40)
    assert clock.slept == [] and throttle.slept_s == 0


def _record(index: int, sizes: list[int], codec: str = "none") -> TensorRecord:
    return TensorRecord(
        index=index,
        key=f"k{index}",
        kind="torch",
        dtype="uint8",
        shape=(sum(sizes),),
        nbytes=sum(sizes),
        file="data-r00003.bin",
        codec=codec,
        chunk_bytes=max(sizes, default=1),
        chunks=tuple(Chunk(999, s, 7) for s in sizes),
        shared=(0, 1),
    )


def test_a_copy_lays_each_record_out_from_a_page_boundary_in_one_file() -> None:
    records, size = wire.relocate([_record(0, [5000, 3]), _record(1, []), _record(2, [10])])
    assert [[(c.offset, c.stored, c.checksum) for c in r.chunks] for r in records] == [
        [(0, 5000, -1), (5000, 3, -1)],
        [],
        [(2 * ALIGN, 10, -1)],
    ]
    assert size == 2 * ALIGN + 10
    assert all(r.file == wire.COPY_FILE and r.shared is None for r in records)  # the whole part, one file
    summed = wire.with_checksums(records, [11, 12, 13])
    assert [c.checksum for r in summed for c in r.chunks] == [11, 12, 13]


def test_a_damaged_chunk_is_named() -> None:
    records, size = wire.relocate([_record(0, [100, 50])])
    data = bytearray(os.urandom(size))
    sums = [checksum(memoryview(data)[c.offset : c.offset + c.stored]) for r in records for c in r.chunks]
    records = wire.with_checksums(records, sums)
    assert wire.first_mismatch(memoryview(data), records) is None
    data[120] ^= 1
    assert wire.first_mismatch(memoryview(data), records) == "k0 chunk 1 (bytes 100..150)"


class _Source:
    """Three chunks of one record; reading chunk 2 fails when ``fail`` is set."""

    def __init__(self, fail: bool) -> None:
        self.records = (_record(0, [4, 4, 4]),)
        self.fail = fail
        self.data = [b"aaaa", b"bbbb", b"cccc"]

    def read_stored(self, record: TensorRecord, chunk: int, scratch: memoryview) -> memoryview:
        if self.fail and chunk == 2:
            raise OSError(errno.EIO, "bad sector")
        return memoryview(self.data[chunk])

    def checksum_of(self, record: TensorRecord, chunk: int) -> None:
        return None


def test_every_destination_still_there_gets_every_chunk_whatever_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[tuple[int, bytes]] = []

    def send(view: memoryview, dst: int, group: object, tag: int) -> None:
        if dst == 5 and len([s for s in sent if s[0] == 5]) == 1:
            raise wire.TransferError(5, RuntimeError("Connection closed by peer\nadvice"))
        sent.append((dst, bytes(view)))

    monkeypatch.setattr(wire, "send", send)
    throttle = wire.Throttle(None)
    assert wire.send_copy(_Source(fail=False), [4], None, wire.TAG_COPY, throttle) == [checksum(d) for d in (b"aaaa", b"bbbb", b"cccc")]
    sent.clear()
    with pytest.raises(wire.CopyFailed) as raised:
        wire.send_copy(_Source(fail=True), [4, 5], None, wire.TAG_COPY, throttle)
    # Rank 5 broke off after its first chunk and got no more; rank 4 got all three, the unreadable
    # one as zeros (which no checksum matches), so it never waits for a chunk that does not come.
    assert sent == [(4, b"aaaa"), (5, b"aaaa"), (4, b"bbbb"), (4, bytes(4))]
    failed = raised.value.failed
    assert sorted(failed) == [4, 5]
    assert "bad sector" in str(failed[4]) and str(failed[5]) == "the transfer with rank 5 broke off: Connection closed by peer"


def _manifest(step: int) -> bytes:
    return Manifest(step=step, created=1234.5, skeleton=None, records=()).encode()


def test_the_replica_directory_commits_whole_copies_and_a_new_process_finds_them(tmp_path: Path) -> None:
    store = ReplicaStore(tmp_path / "copies", "peer")
    store.open()
    held = ReplicaId(4, 2, 7)
    incoming = store.stage(held, 8192)
    incoming.data[:5] = b"hello"
    store.commit(incoming, _manifest(7), 1234.5)
    assert store.held() == {held: 8192} and store.created(held) == 1234.5
    assert (store.path(held) / wire.COPY_FILE).read_bytes()[:5] == b"hello"
    left = store.stage(ReplicaId(4, 2, 8), 4096)  # a copy cut off by a kill: never committed
    store.commit(store.stage(ReplicaId(4, 3, 7), 4096), b"not a manifest")  # damaged while this process was gone
    store.close()
    again = ReplicaStore(tmp_path / "copies", "peer")
    again.open()
    assert again.held() == {held: 8192} and again.created(held) == 1234.5  # from its manifest
    assert not left.path.exists()  # swept
    assert not again.path(ReplicaId(4, 3, 7)).exists()  # removed, with a warning
    again.delete(held)
    assert again.held() == {} and not again.path(held).exists()
    again.close()


def test_a_deleted_copy_s_memory_receives_the_next_copy_and_spares_are_bounded(tmp_path: Path) -> None:
    store = ReplicaStore(tmp_path / "copies", "peer")
    store.spares = 1
    store.open()
    for step, size in ((1, 8192), (2, 16384)):
        store.commit(store.stage(ReplicaId(2, 1, step), size), b"m")
    inodes = {step: os.stat(store.path(ReplicaId(2, 1, step)) / wire.COPY_FILE).st_ino for step in (1, 2)}
    store.delete(ReplicaId(2, 1, 1))
    store.delete(ReplicaId(2, 1, 2))  # one spare at most: this one's file goes
    assert len(list((tmp_path / "copies").glob(".spare-*"))) == 1
    incoming = store.stage(ReplicaId(2, 1, 3), 12288)  # larger than the spare: it grows
    assert os.stat(incoming.path / wire.COPY_FILE).st_ino == inodes[1]
    assert os.stat(incoming.path / wire.COPY_FILE).st_size == 12288 and incoming.data.nbytes == 12288
    assert list((tmp_path / "copies").glob(".spare-*")) == []
    store.discard(incoming)  # a discarded copy's file becomes the spare again
    smaller = store.stage(ReplicaId(2, 1, 4), 4096)
    assert os.stat(smaller.path / wire.COPY_FILE).st_ino == inodes[1] and os.stat(smaller.path / wire.COPY_FILE).st_size == 4096
    store.commit(smaller, b"m")
    store.delete(ReplicaId(2, 1, 4))
    store.close()
    again = ReplicaStore(tmp_path / "copies", "peer")
    again.open()  # a new process does not know the spares: they are removed
    assert list((tmp_path / "copies").glob(".spare-*")) == [] and again.held() == {}
    again.close()


def test_a_replica_directory_in_use_is_refused(tmp_path: Path) -> None:
    store = ReplicaStore(tmp_path / "copies", "peer")
    store.open()
    other = ReplicaStore(tmp_path / "copies", "peer")
    with pytest.raises(Exception, match="in use by another Checkpointer"):
        other.open()
    store.close()


def test_a_full_ram_file_system_refuses_a_copy_with_enospc_and_keeps_the_others(tmp_path: Path) -> None:
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        store = ReplicaStore(mount / "copies", "peer")
        store.open()
        kept = store.stage(ReplicaId(2, 1, 1), 512 << 10)
        store.commit(kept, b"m")
        with pytest.raises(OSError) as raised:
            store.stage(ReplicaId(2, 1, 2), 4 << 20)
        assert raised.value.errno == errno.ENOSPC and "rank 1's step 2" in str(raised.value)
        assert store.held() == {ReplicaId(2, 1, 1): 512 << 10}
        assert [p.name for p in (mount / "copies").iterdir() if p.name.startswith(".tmp-")] == []
        store.close()
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_private_directories_of_dead_processes_are_swept_and_live_ones_kept(tmp_path: Path) -> None:
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else None
    if base is None:
        pytest.skip("no /dev/shm")
    dead = base / f"{_PRIVATE}test-dead-{os.getpid()}"
    live = base / f"{_PRIVATE}test-live-{os.getpid()}"
    dead.mkdir()
    live.mkdir()
    fd = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    # Held by another process: flock is per open file, so this process could take it again.
    holder = subprocess.Popen([sys.executable, "-c", f"import fcntl, os, sys, time; fd = os.open({str(live)!r}, os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX); print(1, flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    os.close(fd)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"1"
        store = ReplicaStore(None, "peer")
        store.open()
        assert not dead.exists() and live.exists()
        root = store.root
        assert root.parent == base and root.name.startswith(_PRIVATE)
        store.close()
        assert not root.exists()  # private: gone with the Checkpointer
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
        shutil.rmtree(dead, ignore_errors=True)
        shutil.rmtree(live, ignore_errors=True)


def test_ranks_still_wanting_their_part_fetch_it_from_a_holder_spread_over_the_holders() -> None:
    copies = [[[2, 5], [3, 5]], [[2, 5]], [], [[0, 5], [0, 4]]]  # what ranks 0..3 hold: [owner, step]
    holders = holders_of(copies)
    assert holders == {(2, 5): [0, 1], (3, 5): [0], (0, 5): [3], (0, 4): [3]}
    assert fetch_plan(5, [2, 3], holders) == {2: 0, 3: 0}  # rank 2: holders [0, 1], 2 % 2 -> 0
    assert fetch_plan(5, [0, 1], holders) == {0: 3}  # nobody holds rank 1's copy: it reads its disks
    assert fetch_plan(4, [0], holders) == {0: 3}
