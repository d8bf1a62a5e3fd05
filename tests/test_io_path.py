"""The filesystem tier's data path: O_DIRECT and its fallback, unaligned tails, zero-size tensors,
checksums verified on read, promotion from one filesystem tier to another, and the helpers under them."""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import os
import shutil
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch

from tierckpt import Checkpointer
from tierckpt._buffers import PAGE, address, aligned_buffer, copy_bytes, owned_tensor, prefault
from tierckpt.config import CompressionConfig
from tierckpt.tiers.stored.encoding import TierEncoding
from tierckpt.errors import CorruptCheckpointError
from tierckpt.format import CHUNK_BYTES, MANIFEST_FILE, Manifest, checksum, version_dirname
from tierckpt.storage import posix
from tierckpt.tiers.stored import write as fswrite
from tierckpt.tiers.stored.read import version_files
from tierckpt.storage.posix import preallocate, probe_direct_io, pwrite_all, read_into, read_span
from tierckpt.storage.scratch import ChunkJobs
from tierckpt.testing import flip_bits

from helpers import Opened, assert_bitwise, fs_tier_of, logged_warnings, mount, ram_fs, unmount


def _config(path: Path, **tier: Any) -> dict[str, Any]:
    return ram_fs(path, capacity="160MiB", **tier)


def _state() -> dict[str, Any]:
    """Tensors with every kind of awkward size: several chunks, unaligned tails, tiny, empty, 0-d."""
    g = torch.Generator().manual_seed(7)
    return {
        "big": torch.randn(CHUNK_BYTES // 4 * 2 + 1001, generator=g),  # 3 chunks, the last one unaligned
        "bf16": torch.randn(1_000_003, generator=g).to(torch.bfloat16),  # one chunk, unaligned tail
        "small": torch.randn(777, generator=g),  # below 1 MiB: through the scratch buffer
        "empty": torch.empty(0),
        "empty2d": torch.empty(0, 5, dtype=torch.bfloat16),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "np": np.random.default_rng(3).standard_normal(300_001).astype(np.float32),
        "step": 12,
    }


def _saved(opened: Opened, root: Path, state: dict[str, Any], step: int = 1, **tier: Any) -> None:
    ckpt = opened(_config(root, **tier))
    assert ckpt.save_sync(step, state).committed_sync("nvme", timeout=120)
    ckpt.close_sync()


def _flip(root: Path, step: int, key: str, chunk: int) -> None:
    version = root / version_dirname(step)
    record = next(r for r in Manifest.decode((version / MANIFEST_FILE).read_bytes()).records if r.key == key)
    offset = record.chunks[chunk].offset + record.chunks[chunk].stored - 1  # the chunk's last byte
    flip_bits(version / record.file, offset, 0x40)


# -- end to end ------------------------------------------------------------------------------------------


def test_restore_reads_with_o_direct_into_page_aligned_tensors(opened: Opened, tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    state = _state()
    _saved(opened, root, state)
    ckpt = opened(_config(root))
    direct = fs_tier_of(ckpt).direct
    assert direct is probe_direct_io(root)
    restored = ckpt.restore_latest_sync()
    assert restored.tier == "nvme"
    assert_bitwise(restored.state, state)
    for key in ("big", "bf16"):
        tensor = restored.state[key]
        # Large new tensors own page-aligned memory, exactly their size: the disk DMAs into them.
        assert tensor.data_ptr() % PAGE == 0, key
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size(), key
        assert tensor.is_contiguous()
    assert restored.state["np"].ctypes.data % PAGE == 0
    # They are ordinary, independent tensors.
    restored.state["big"].add_(1)
    again = ckpt.restore_latest_sync()
    assert_bitwise(again.state, state)


def test_restore_into_a_template_from_disk(opened: Opened, tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    state = _state()
    _saved(opened, root, state)
    template = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else np.zeros_like(v) if isinstance(v, np.ndarray) else 0) for k, v in state.items()}
    template["big"] = torch.zeros(state["big"].numel() * 2)[::2]  # a strided view: staged, then copied
    pointers = {k: v.data_ptr() for k, v in template.items() if isinstance(v, torch.Tensor)}
    restored = opened(_config(root)).restore_latest_sync(template)
    assert_bitwise(restored.state, state)
    for key, pointer in pointers.items():
        assert restored.state[key] is template[key] and template[key].data_ptr() == pointer, key


def test_a_checksum_mismatch_on_read_is_caught_and_the_template_is_untouched(opened: Opened, tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    state = _state()
    _saved(opened, root, state)
    _flip(root, 1, "['big']", 2)  # the last chunk of a large tensor: read with O_DIRECT, tail through the bounce page
    template = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else np.zeros_like(v) if isinstance(v, np.ndarray) else 0) for k, v in state.items()}
    ckpt = opened(_config(root))
    with logged_warnings(match=r"checksum mismatch in \['big'\] \(chunk 2\)"):
        assert ckpt.restore_latest_sync(template, verify_first=True) is None
    for key, value in template.items():
        if isinstance(value, (torch.Tensor, np.ndarray)):
            assert not value.any(), key  # nothing landed in the template
    # The copy is known damaged now: this process does not read it again (docs/index.md, "Rolling back").
    with logged_warnings() as said:
        assert ckpt.restore_latest_sync() is None
    assert not [m for m in said if "checksum mismatch" in m]
    ckpt.close_sync()
    ckpt = opened(_config(root))  # a new Checkpointer reads it again
    with logged_warnings(match="checksum mismatch"):
        assert ckpt.restore_latest_sync() is None
    ckpt.close_sync()
    # Landing as chunks verify: the others did, the damaged one did not, and the call says so.
    ckpt = opened(_config(root))
    with logged_warnings(match="checksum mismatch"), pytest.raises(CorruptCheckpointError, match="partly overwritten"):
        ckpt.restore_latest_sync(template)
    per_chunk = CHUNK_BYTES // 4
    assert torch.equal(template["big"][: 2 * per_chunk], state["big"][: 2 * per_chunk])
    assert not template["big"][2 * per_chunk :].any()


def test_a_damaged_small_tensor_falls_back_to_the_previous_step(opened: Opened, tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    old, new = _state(), _state()
    new["small"] = new["small"] + 1
    new["step"] = 13
    _saved(opened, root, old, step=1)
    _saved(opened, root, new, step=2)
    _flip(root, 2, "['small']", 0)  # unaligned destination: read through the aligned scratch buffer
    with logged_warnings(match=r"step 2 on tier 'nvme' does not verify: .*\['small'\]"):
        restored = opened(_config(root)).restore_latest_sync()
    assert restored.step == 1
    assert_bitwise(restored.state, old)


@pytest.fixture
def no_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tierckpt.storage.local.probe_direct_io", lambda path: False)


def test_the_buffered_path_stores_and_restores_the_same(opened: Opened, tmp_path: Path, no_direct: None) -> None:
    root = tmp_path / "nvme"
    state = _state()
    _saved(opened, root, state)
    ckpt = opened(_config(root))
    assert fs_tier_of(ckpt).direct is False
    assert_bitwise(ckpt.restore_latest_sync().state, state)
    ckpt.close_sync()
    _flip(root, 1, "['bf16']", 0)
    with logged_warnings(match=r"checksum mismatch in \['bf16'\]"):
        assert opened(_config(root)).restore_latest_sync() is None


@pytest.fixture
def ramfs(tmp_path: Path) -> Iterator[Path]:
    """A file system without O_DIRECT at all (tmpfs accepts it since Linux 6.6)."""
    target = tmp_path / "ramfs"
    mount("ramfs", target)
    try:
        yield target
    finally:
        unmount(target)


def test_a_file_system_refusing_o_direct_says_so_once_and_works(
    opened: Opened, ramfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = ramfs / "nvme"
    state = _state()
    with caplog.at_level(logging.INFO, logger="tierckpt"):
        _saved(opened, root, state)
    assert [r.message for r in caplog.records if "O_DIRECT" in r.message] == [
        f"tier 'nvme': {root} refuses O_DIRECT; writing through the page cache"
    ]
    ckpt = opened(_config(root))
    assert fs_tier_of(ckpt).direct is False
    assert_bitwise(ckpt.restore_latest_sync().state, state)


def test_promotion_to_a_slower_tier_streams_with_o_direct_and_reuses_checksums(opened: Opened, tmp_path: Path) -> None:
    nvme, pfs = tmp_path / "nvme", tmp_path / "pfs"
    config = _config(nvme)
    config["tiers"].append({"name": "pfs", "type": "filesystem", "path": str(pfs)})
    state = _state()
    ckpt = opened(config)
    assert ckpt.save_sync(1, state).committed_sync("pfs", timeout=120)
    ckpt.close_sync()
    source_manifest = Manifest.decode((nvme / version_dirname(1) / MANIFEST_FILE).read_bytes())
    target_manifest = Manifest.decode((pfs / version_dirname(1) / MANIFEST_FILE).read_bytes())
    assert [[c.checksum for c in r.chunks] for r in target_manifest.records] == [
        [c.checksum for c in r.chunks] for r in source_manifest.records
    ]
    shutil.rmtree(nvme / version_dirname(1))
    restored = opened(config).restore_latest_sync()
    assert restored.tier == "pfs"
    assert_bitwise(restored.state, state)


def test_promotion_verifies_what_it_reads(tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    with Checkpointer(_config(root)) as ckpt:
        assert ckpt.save_sync(1, _state()).committed_sync("nvme", timeout=120)
    _flip(root, 1, "['bf16']", 0)
    version = root / version_dirname(1)
    manifest = Manifest.decode((version / MANIFEST_FILE).read_bytes())
    source = version_files(version).open_source("nvme", manifest, direct=probe_direct_io(root))
    assert source.direct is probe_direct_io(root)
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as executor:
            with pytest.raises(CorruptCheckpointError, match=r"checksum mismatch in \['bf16'\]"):
                fswrite.write_data_file(source, tmp_path / "out.bin", _raw(), executor, direct=True)
    finally:
        source.close()


# -- the helpers ------------------------------------------------------------------------------------------


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[Path, bytes]:
    """A file whose length is not a multiple of the page (as a buffered write leaves it)."""
    payload = os.urandom(5 * PAGE + 1234)
    path = tmp_path / "data.bin"
    path.write_bytes(payload)
    return path, payload


def _fds(path: Path) -> tuple[int, int | None]:
    fd = os.open(path, os.O_RDONLY)
    direct = os.open(path, os.O_RDONLY | posix.O_DIRECT) if probe_direct_io(path.parent) else None
    return fd, direct


@pytest.mark.parametrize(
    "offset, length, shift",
    [
        (0, 5 * PAGE + 1234, 0),  # aligned body, the tail ends inside the file's last page
        (PAGE, 2 * PAGE, 0),  # all aligned
        (PAGE, 7, 0),  # a tail only
        (100, 3 * PAGE, 0),  # an unaligned offset
        (PAGE, 3 * PAGE + 5, 64),  # an unaligned destination (torch.empty memory sits 64 bytes in)
        (0, 0, 0),
    ],
)
def test_read_into_fills_exactly_the_destination(data_file: tuple[Path, bytes], offset: int, length: int, shift: int) -> None:
    path, payload = data_file
    fd, direct = _fds(path)
    buf = aligned_buffer(length + shift + PAGE)
    view = memoryview(buf)
    try:
        view[:] = b"\xee" * len(view)
        out = view[shift : shift + length]
        read_into(out, offset, fd, direct, memoryview(aligned_buffer(64 * PAGE)), what="test")
        assert bytes(out) == payload[offset : offset + length]
        assert bytes(view[shift + length :]) == b"\xee" * (len(view) - shift - length)  # nothing past the end
    finally:
        out.release()
        os.close(fd)
        if direct is not None:
            os.close(direct)


@pytest.mark.parametrize("use_direct", [True, False])
def test_reading_past_the_end_is_corruption(data_file: tuple[Path, bytes], use_direct: bool) -> None:
    path, payload = data_file
    fd, direct = _fds(path)
    try:
        out = memoryview(aligned_buffer(len(payload) + PAGE))[: len(payload) + 10]
        with pytest.raises(CorruptCheckpointError, match="file ends 10 bytes early"):
            read_into(out, 0, fd, direct if use_direct else None, memoryview(aligned_buffer(4 * PAGE)), what="test")
        with pytest.raises(CorruptCheckpointError, match="ends 10 bytes early"):
            read_span(0, len(payload) + 10, memoryview(aligned_buffer(8 * PAGE)), fd, direct if use_direct else None, what="test")
    finally:
        os.close(fd)
        if direct is not None:
            os.close(direct)


def test_read_span_returns_a_view_of_scratch_or_a_new_buffer(data_file: tuple[Path, bytes]) -> None:
    path, payload = data_file
    fd, direct = _fds(path)
    try:
        scratch = memoryview(aligned_buffer(8 * PAGE))
        span = read_span(PAGE + 10, 3000, scratch, fd, direct, what="test")
        assert bytes(span) == payload[PAGE + 10 : PAGE + 3010]
        assert span.obj is scratch.obj
        big = read_span(0, len(payload), memoryview(aligned_buffer(PAGE)), fd, direct, what="test")
        assert bytes(big) == payload
    finally:
        os.close(fd)
        if direct is not None:
            os.close(direct)


def test_an_unaligned_tail_is_written_with_the_body_in_one_vectored_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not probe_direct_io(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    path = tmp_path / "out.bin"
    data = os.urandom(3 * PAGE + 100)
    src = aligned_buffer(len(data))
    src[: len(data)] = data
    calls = []
    pwritev = os.pwritev
    monkeypatch.setattr(os, "pwritev", lambda fd, buffers, offset: calls.append(len(buffers)) or pwritev(fd, buffers, offset))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    direct = os.open(path, os.O_WRONLY | posix.O_DIRECT)
    try:
        pwrite_all(memoryview(src)[: len(data)], PAGE, fd, direct)
    finally:
        os.close(direct)
        os.close(fd)
    assert calls == [2]
    assert path.read_bytes() == bytes(PAGE) + data + bytes(PAGE - 100)  # the tail page zero-padded


def test_preallocate_reserves_the_file_in_one_go(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        preallocate(fd, 10 * PAGE + 1)
        preallocate(fd, 0)
    finally:
        os.close(fd)
    st = os.stat(path)
    assert st.st_size == 10 * PAGE + 1
    assert st.st_blocks * 512 >= 10 * PAGE or st.st_blocks == 0  # 0: a file system without fallocate


def test_chunk_jobs_run_in_order_on_the_tier_threads_and_the_caller() -> None:
    seen: list[tuple[int, int]] = []
    barrier = threading.Barrier(3)

    def job(i: int) -> int:
        if i < 3:
            barrier.wait(timeout=10)  # the first three run at once: two tier threads and the caller
        seen.append((i, threading.get_ident()))
        return i * i

    with concurrent.futures.ThreadPoolExecutor(2) as executor:
        jobs = ChunkJobs([lambda i=i: job(i) for i in range(20)], executor, threads=2)
        assert jobs.join() == [i * i for i in range(20)]
    assert threading.get_ident() in {t for _, t in seen}
    assert len({t for _, t in seen}) == 3


def test_chunk_jobs_stop_at_the_first_error_and_join_after_the_running_ones() -> None:
    release = threading.Event()
    running_done = threading.Event()
    started = []

    def slow() -> None:
        release.wait(timeout=10)
        running_done.set()

    def fail() -> None:
        release.set()
        raise ValueError("boom")

    calls = [slow, fail] + [lambda i=i: started.append(i) for i in range(50)]
    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        jobs = ChunkJobs(calls, executor, threads=1)
        with pytest.raises(ValueError, match="boom"):
            jobs.join()
        assert running_done.is_set()  # join waited for the job that was running
    assert len(started) < 50


def test_owned_tensors_are_aligned_exact_and_give_their_memory_back() -> None:
    tensor, buf = owned_tensor(torch.bfloat16, (3, 1001), 3 * 1001 * 2)
    assert tensor.data_ptr() % PAGE == 0 and tensor.shape == (3, 1001) and tensor.dtype == torch.bfloat16
    assert tensor.untyped_storage().nbytes() == 3 * 1001 * 2
    assert not tensor.any()  # fresh anonymous memory is zeros
    view = memoryview(buf)
    assert prefault(view[: PAGE * 2]) in (True, False)
    view.release()
    gone = weakref.ref(buf)
    del buf
    gc.collect()
    assert gone() is not None  # the tensor keeps its memory alive
    tensor.fill_(2)
    del tensor
    gc.collect()
    assert gone() is None


def _resident_pages(view: memoryview) -> int:
    """How many pages of ``view`` are in memory (mincore(2))."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pages = -(-view.nbytes // PAGE)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(address(view)), ctypes.c_size_t(view.nbytes), vec) == 0
    return sum(b & 1 for b in vec)


def test_prefaulting_faults_a_mapping_in_beside_the_writer_and_stops_with_the_block() -> None:
    from tierckpt._buffers import prefaulting

    probe = aligned_buffer(PAGE)
    if not prefault(memoryview(probe)):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14): nothing is faulted ahead")
    buf = aligned_buffer(64 << 20)
    view = memoryview(buf)
    try:
        assert _resident_pages(view) == 0  # mapped, nothing faulted: nothing waits before the first byte
        with prefaulting(view, piece=1 << 20):
            view[: 4 << 20] = bytes(range(256)) * (16 << 10)  # the transfer's first bytes, at once
        # The thread is done when the block is, whatever it reached; every byte written is there.
        assert not any(t.name == "tierckpt-prefault" for t in threading.enumerate())
        assert bytes(view[: 4 << 20]) == bytes(range(256)) * (16 << 10)
        # A block that outlasts the thread: it faults every page in, front to back, on its own.
        fresh = aligned_buffer(8 << 20)
        whole = memoryview(fresh)
        assert _resident_pages(whole) == 0
        with prefaulting(whole, piece=1 << 20):
            deadline = time.monotonic() + 30
            while _resident_pages(whole) < whole.nbytes // PAGE and time.monotonic() < deadline:
                threading.Event().wait(0.01)
            assert _resident_pages(whole) == whole.nbytes // PAGE
        assert not whole.tobytes().strip(b"\0")  # faulted, not written: still zeros
        whole.release()
        fresh.close()
    finally:
        view.release()
        buf.close()


def test_copy_bytes_copies_exactly() -> None:
    src = memoryview(bytearray(os.urandom(3 * PAGE + 5)))
    dst = memoryview(aligned_buffer(4 * PAGE))
    copy_bytes(dst[7 : 7 + src.nbytes], src)
    assert bytes(dst[7 : 7 + src.nbytes]) == bytes(src) and bytes(dst[:7]) == bytes(7)
    copy_bytes(dst[:4], memoryview(b"abcd"))  # read-only sources too
    assert bytes(dst[:4]) == b"abcd"
    with pytest.raises(ValueError):
        copy_bytes(dst[:3], src)


def test_aligned_buffers_populated_or_not_are_zeroed_and_aligned() -> None:
    for populate in (False, True):
        buf = aligned_buffer(3 << 20, populate=populate)
        view = memoryview(buf)
        assert len(buf) == 3 << 20
        assert torch.frombuffer(buf, dtype=torch.uint8).sum().item() == 0
        assert address(view) % PAGE == 0
        view.release()
        buf.close()


def test_hashes_are_computed_on_the_bytes_stored(tmp_path: Path, opened: Opened) -> None:
    root = tmp_path / "nvme"
    state = _state()
    _saved(opened, root, state)
    version = root / version_dirname(1)
    data = (version / "data-r00000.bin").read_bytes()
    for record in Manifest.decode((version / MANIFEST_FILE).read_bytes()).records:
        for c in record.chunks:
            assert checksum(data[c.offset : c.offset + c.stored]) == c.checksum, record.key


def _raw() -> Any:
    """How an uncompressed tier writes one version."""
    return TierEncoding(CompressionConfig(), "out").begin()
