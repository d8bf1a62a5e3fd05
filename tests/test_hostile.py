"""Hostile manifests (issue 11, item 4): whatever a manifest says, reading it either loads a sane
version or raises CorruptCheckpointError (so restore moves on), before any large allocation and
without opening anything outside the version directory.

The fuzz test takes the manifest of a real saved version (uncompressed, and compressed), mutates its
fields and structure, and wraps it again with a correct checksum, so that only the checks behind the
checksum can refuse it. Then it reads it as restore does: :func:`read_manifest`, :func:`open_source`
(the skeleton, the files, the records against the files), :func:`tierckpt.restore.plan.load` (allocate,
read, verify, decode, rebuild). Meanwhile ``os.open`` is watched (every file opened must be the
version directory or a plain name inside it, and must turn out to be inside it once open: a followed
symlink would show), and so are the allocation helpers (no buffer larger than the bytes on disk can
justify; tracemalloc for everything allocated through Python).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import math
import os
import shutil
import threading
import tracemalloc
from pathlib import Path
from typing import Any, Callable, Iterator

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, reject, settings
from hypothesis import strategies as st

import tierckpt._buffers
import tierckpt.restore.landing
import tierckpt.restore.plan
import tierckpt.state.leaves
import tierckpt.state.skeleton
import tierckpt.state.walk
import tierckpt.storage.posix
import tierckpt.storage.scratch
from tierckpt import Checkpointer
from tierckpt.errors import CorruptCheckpointError, UnsupportedStateError
from tierckpt.format import CHECKSUM_ALGORITHM, CHUNK_BYTES, DATA_FILE, MANIFEST_FILE, checksum, version_dirname
from tierckpt.format.manifest import MAX_MANIFEST_BYTES
from tierckpt.state import MAX_SKELETON_DEPTH, MAX_SKELETON_NODES, flatten, skeleton_leaf_count, unflatten
from tierckpt.tiers.stored.check import MAX_CHUNK_BYTES, ZSTD_MAX_EXPANSION
from tierckpt.tiers.stored.read import open_source, read_manifest
from tierckpt.storage.scratch import scratch_bytes

from helpers import SHUFFLED_ZSTD, logged_warnings, ram_fs

STEP = 5
DATA = DATA_FILE.format(rank=0)


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {
        "model": {
            "w": torch.randn(64, 33, generator=g),
            "b": torch.zeros(1000, dtype=torch.bfloat16),
            "i": torch.arange(300),
            "m": torch.arange(77) % 3 == 0,
            "h": torch.ones(5000, dtype=torch.float16),  # a chunk zstd shrinks a lot
        },
        "np": np.arange(50, dtype="<f8"),
        "s": np.float32(1.5),
        "nested": {"a": [1, (2, "x")], "t": torch.tensor(3), 7: None},
        "step": STEP,
    }


def _config(root: Path, compressed: bool) -> dict[str, Any]:
    return ram_fs(root, capacity="4MiB", snapshots=1, **({"compression": SHUFFLED_ZSTD} if compressed else {}))


class _Version:
    """A saved version with decoys around it, and the manifest body to mutate."""

    def __init__(self, root: Path, compressed: bool) -> None:
        tier = root / ("pfs" if compressed else "nvme")
        with Checkpointer(_config(tier, compressed)) as ckpt:
            assert ckpt.save_sync(STEP, _state()).committed_sync("nvme", timeout=60)
        self.dir = tier / version_dirname(STEP)
        self.original = (self.dir / MANIFEST_FILE).read_bytes()
        self.body = msgpack.unpackb(msgpack.unpackb(self.original)["body"], strict_map_key=False)
        assert {r["codec"] for r in self.body["records"]} == ({"zstd", "zstd+shuffle"} if compressed else {"none"})
        data_size = (self.dir / DATA).stat().st_size
        # What a reader may allocate at once: a scratch buffer for the largest chunk it takes, or what
        # the data file can back (zstd expands at most ZSTD_MAX_EXPANSION times).
        self.limit = max(scratch_bytes(MAX_CHUNK_BYTES), data_size * (ZSTD_MAX_EXPANSION if compressed else 1))
        # Decoys: a copy of the data outside the version directory, and ways to reach it from inside.
        self.secret = tier / "secret.bin"
        shutil.copyfile(self.dir / DATA, self.secret)
        os.symlink("../secret.bin", self.dir / "link.bin")
        os.symlink(self.secret, self.dir / "abs.bin")
        os.mkfifo(self.dir / "fifo.bin")
        (self.dir / "sub").mkdir()

    def write(self, body: Any) -> None:
        raw = msgpack.packb(body, use_bin_type=True)
        (self.dir / MANIFEST_FILE).write_bytes(
            msgpack.packb({"body": raw, CHECKSUM_ALGORITHM: checksum(raw)}, use_bin_type=True)
        )


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, _Version]]:
    root = tmp_path_factory.mktemp("hostile")
    made = {"raw": _Version(root, compressed=False), "compressed": _Version(root, compressed=True)}
    yield made


@pytest.fixture(scope="module")
def executor() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        yield pool


# -- the guards --------------------------------------------------------------------------------------


class _Guards:
    """Watches os.open and the allocation helpers while a manifest is read; records what went wrong."""

    def __init__(self, version: _Version) -> None:
        self.version = version
        self.dir = os.path.realpath(version.dir)
        self.problems: list[str] = []
        self.opened: list[str] = []
        self.largest = 0

    def _open(self, real: Callable[..., int]) -> Callable[..., int]:
        def watched(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
            name = os.fsdecode(path)
            if dir_fd is None:
                if os.path.realpath(name) != self.dir:
                    self.problems.append(f"opened {name!r}, not the version directory")
            else:
                parent = os.readlink(f"/proc/self/fd/{dir_fd}")
                if parent != self.dir or "/" in name or name in (".", ".."):
                    self.problems.append(f"opened {name!r} in {parent!r}")
            fd = real(path, flags, mode, dir_fd=dir_fd)
            target = os.readlink(f"/proc/self/fd/{fd}")
            self.opened.append(target)
            if target != self.dir and os.path.dirname(target) != self.dir:
                self.problems.append(f"{name!r} led to {target!r}, outside the version directory")
            return fd

        return watched

    def _sized(self, real: Callable[..., Any], size_of: Callable[..., int], what: str) -> Callable[..., Any]:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                n = size_of(*args, **kwargs)
            except Exception:  # noqa: BLE001 - arguments the real function will refuse itself
                n = 0
            self.largest = max(self.largest, n)
            if n > self.version.limit:
                self.problems.append(f"{what} of {n} bytes (more than {self.version.limit})")
                raise MemoryError(f"test guard: {what} of {n} bytes")
            return real(*args, **kwargs)

        return guarded

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        def numel_bytes(shape: Any, *rest: Any, dtype: Any = None, **_: Any) -> int:
            dims = (shape,) if isinstance(shape, int) else tuple(shape)
            if dtype is None and rest and not isinstance(rest[0], int):
                dtype = rest[0]  # np.empty(n, np.uint8)
            if isinstance(dtype, torch.dtype):
                itemsize = dtype.itemsize
            else:
                itemsize = np.dtype(dtype if dtype is not None else "f8").itemsize
            return math.prod(dims) * itemsize

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(os, "open", self._open(os.open))
            for module in (tierckpt._buffers, tierckpt.restore.landing, tierckpt.storage.scratch, tierckpt.storage.posix):
                patch.setattr(module, "aligned_buffer", self._sized(module.aligned_buffer, lambda n, **_: n, "aligned_buffer"))
            patch.setattr(
                tierckpt.restore.landing,
                "owned_tensor",
                self._sized(tierckpt.restore.landing.owned_tensor, lambda dtype, shape, n: n, "owned_tensor"),
            )
            patch.setattr(torch, "empty", self._sized(torch.empty, numel_bytes, "torch.empty"))
            patch.setattr(np, "empty", self._sized(np.empty, numel_bytes, "np.empty"))
            patch.setattr(
                tierckpt.storage.posix, "bytearray", self._sized(bytearray, lambda n=0: n if isinstance(n, int) else 0, "bytearray"), raising=False
            )
            tracemalloc.start()
            try:
                yield
            finally:
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
            if peak > self.version.limit:
                self.problems.append(f"tracemalloc peak of {peak} bytes")


def _read(version: _Version, executor: concurrent.futures.Executor) -> Any:
    """Read the version as restore does: manifest, source, load (no template)."""
    manifest = read_manifest(version.dir, tier="fuzz", step=STEP)
    source = open_source("fuzz", version.dir, manifest)
    try:
        return tierckpt.restore.plan.load(source, {}, executor, threads=1)
    finally:
        source.close()


def _attempt(version: _Version, executor: concurrent.futures.Executor) -> tuple[str, _Guards]:
    guards = _Guards(version)
    outcome = "loaded"
    with guards.watching():
        try:
            _read(version, executor)
        except CorruptCheckpointError:  # FormatVersionError included
            outcome = "refused"
    return outcome, guards


# -- mutations ----------------------------------------------------------------------------------------

_INTS = [0, 1, 2, 3, 7, 4095, 4096, 4097, CHUNK_BYTES - 1, CHUNK_BYTES, CHUNK_BYTES + 1, MAX_CHUNK_BYTES + 1,
         2**31 - 1, 2**31, 2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1, -1, -(2**63)]
_STRS = ["", ".", "..", "../secret.bin", "../" + DATA, "/etc/passwd", "link.bin", "abs.bin", "fifo.bin", "sub",
         DATA, "data-r00001.bin", MANIFEST_FILE, "a\x00b", "x" * 300, "float32", "bfloat16", "float128", "qint8",
         "<f4", ">f8", "|b1", "<O8", "|V0", "<U3", "<M8[ns]", "float", "zstd", "zstd+shuffle", "none", "lz4",
         "torch", "numpy", "pickle", "T", "N", "n", "d", "l", "t", "od", "i", "dt", "dev", "cuda:0", "meta",
         "xxh3_64", "crc32", "tierckpt"]
_VALUES = st.one_of(
    st.sampled_from(_INTS),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.sampled_from(_STRS),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.floats(),
    st.none(),
    st.booleans(),
    st.lists(st.sampled_from(_INTS), max_size=4),
    st.lists(st.sampled_from(_STRS[:20]), max_size=3),
    st.dictionaries(st.text(max_size=3), st.sampled_from(_INTS), max_size=2),
)


def _paths(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _paths(value, (*path, i))


def _get(node: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        node = node[key]
    return node


def _scale(body: dict[str, Any], data: st.DataObject) -> None:
    """Make one record claim k times its bytes, consistently: shape, nbytes, chunk size and count."""
    records = body.get("records")
    if not isinstance(records, list) or not records or not all(isinstance(r, dict) for r in records):
        return
    record = data.draw(st.sampled_from(records), label="record")
    k = data.draw(st.sampled_from([2, 3, 1000, 2**20, 2**40, 2**62]), label="k")
    shape, nbytes, chunk_bytes = record.get("shape"), record.get("nbytes"), record.get("chunk_bytes")
    if not (isinstance(shape, list) and all(type(d) is int for d in shape) and type(nbytes) is int and nbytes >= 0):
        return  # only a well-formed record can be scaled consistently ("0" * 2**40 is a test bug)
    if type(chunk_bytes) is not int or chunk_bytes <= 0:
        return
    try:
        record["shape"] = [record["shape"][0] * k, *record["shape"][1:]] if record["shape"] else [k]
        record["nbytes"] = record["nbytes"] * k
        if data.draw(st.booleans(), label="one chunk"):
            record["chunk_bytes"] = min(max(record["chunk_bytes"], record["nbytes"]), 2**64 - 1)
        n = -(-record["nbytes"] // record["chunk_bytes"])
        chunks = record["chunks"]
        if isinstance(chunks, list) and chunks and 0 < n <= 64:
            record["chunks"] = (chunks * n)[:n]
    except (KeyError, TypeError, IndexError, ZeroDivisionError):
        pass


def _mutate(body: dict[str, Any], data: st.DataObject) -> None:
    op = data.draw(st.sampled_from(["set", "set", "set", "delete", "dup", "tweak", "swap", "scale", "file"]), label="op")
    if op == "scale":
        _scale(body, data)
        return
    if op == "file":
        records = body.get("records")
        records = [r for r in records if isinstance(r, dict)] if isinstance(records, list) else []
        if records:
            data.draw(st.sampled_from(records), label="record")["file"] = data.draw(st.sampled_from(_STRS[:14]), label="file")
        return
    paths = list(_paths(body))[1:]
    path = data.draw(st.sampled_from(paths), label="path")
    parent, key = _get(body, path[:-1]), path[-1]
    if op == "set":
        parent[key] = data.draw(_VALUES, label="value")
    elif op == "delete":
        del parent[key]
    elif op == "dup" and isinstance(parent, list):
        parent.insert(key, copy.deepcopy(parent[key]))
    elif op == "tweak" and type(parent[key]) is int:
        f = data.draw(
            st.sampled_from([lambda v: v + 1, lambda v: v - 1, lambda v: v * 2, lambda v: v * 4096, lambda v: v // 2,
                             lambda v: v ^ (1 << 40), lambda v: -v, lambda v: 2**64 - 1 - v]),
            label="tweak",
        )
        parent[key] = f(parent[key])
    elif op == "swap":
        other = data.draw(st.sampled_from(paths), label="other")
        if other[: len(path)] != path and path[: len(other)] != other:
            other_parent = _get(body, other[:-1])
            parent[key], other_parent[other[-1]] = other_parent[other[-1]], parent[key]


@pytest.mark.parametrize("kind", ["raw", "compressed"])
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_a_mutated_manifest_loads_sanely_or_is_refused_as_corrupt(
    versions: dict[str, _Version], executor: concurrent.futures.Executor, kind: str, data: st.DataObject
) -> None:
    version = versions[kind]
    body = copy.deepcopy(version.body)
    for _ in range(data.draw(st.integers(min_value=1, max_value=4), label="mutations")):
        _mutate(body, data)
    try:
        version.write(body)
    except (OverflowError, TypeError, ValueError):  # not msgpack-able: no such file can exist
        reject()
    try:
        outcome, guards = _attempt(version, executor)  # anything but CorruptCheckpointError fails the test
    finally:
        (version.dir / MANIFEST_FILE).write_bytes(version.original)
    event(outcome)
    assert not guards.problems, (outcome, guards.problems)


def test_the_unmutated_manifests_load_under_the_guards(versions: dict[str, _Version], executor: concurrent.futures.Executor) -> None:
    for version in versions.values():
        version.write(version.body)
        guards = _Guards(version)
        with guards.watching():
            state = _read(version, executor)
        assert not guards.problems, guards.problems
        assert torch.equal(state["model"]["w"], _state()["model"]["w"])
        assert state["nested"] == {"a": [1, (2, "x")], "t": torch.tensor(3), 7: None}
        assert guards.opened and all(p == guards.dir or os.path.dirname(p) == guards.dir for p in guards.opened)


@pytest.mark.parametrize(
    "change",
    [
        lambda b: b["metadata"].update(note="x" * 1000),
        lambda b: b.update(created=0),
        lambda b: b.update(world_size=8),
        lambda b: b["records"][0].update(key="renamed"),  # a key is only a label: the skeleton places leaves
    ],
)
def test_harmless_changes_still_load(versions: dict[str, _Version], executor: concurrent.futures.Executor, change: Callable[[Any], None]) -> None:
    version = versions["raw"]
    body = copy.deepcopy(version.body)
    change(body)
    version.write(body)
    try:
        state = _read(version, executor)
    finally:
        version.write(version.body)
    assert torch.equal(state["model"]["i"], torch.arange(300))


# -- each hostile field, by itself ----------------------------------------------------------------------


def _record(body: dict[str, Any], key: str) -> dict[str, Any]:
    return next(r for r in body["records"] if r["key"] == key)


def _set_chunk(key: str, i: int, field: int, value: int) -> Callable[[Any], None]:
    def change(body: Any) -> None:
        _record(body, key)["chunks"][i][field] = value

    return change


_CASES: list[tuple[str, Callable[[Any], None], str]] = [
    ("dot-dot", lambda b: _record(b, "['model']['w']").update(file="../secret.bin"), "escapes the version directory"),
    ("absolute", lambda b: _record(b, "['model']['w']").update(file="/etc/passwd"), "escapes the version directory"),
    ("nul", lambda b: _record(b, "['model']['w']").update(file="data\x00.bin"), "escapes the version directory"),
    ("empty name", lambda b: _record(b, "['model']['w']").update(file=""), "escapes the version directory"),
    ("symlink out", lambda b: _record(b, "['model']['w']").update(file="link.bin"), "data file link.bin is a symlink"),
    ("absolute symlink", lambda b: _record(b, "['model']['w']").update(file="abs.bin"), "data file abs.bin is a symlink"),
    ("fifo", lambda b: _record(b, "['model']['w']").update(file="fifo.bin"), "data file fifo.bin is not a regular file"),
    ("directory", lambda b: _record(b, "['model']['w']").update(file="sub"), "data file sub is not a regular file"),
    ("missing file", lambda b: _record(b, "['model']['w']").update(file="data-r00001.bin"), "data file data-r00001.bin is missing"),
    ("stride overflow", lambda b: _record(b, "['model']['w']").update(shape=[2**62, 2**62, 0], nbytes=0, chunks=[]), "64-bit strides"),
    ("zero dim overflow", lambda b: _record(b, "['model']['w']").update(shape=[0, 2**63 - 1, 2], nbytes=0, chunks=[]), "64-bit strides"),
    ("shape past length", lambda b: _record(b, "['model']['w']").update(shape=[64, 66]), "cannot hold float32[64, 66]"),
    ("length past file", lambda b: _record(b, "['model']['w']").update(shape=[64 * 1000, 33], nbytes=64 * 33 * 4 * 1000, chunk_bytes=2**26), "stored raw in"),
    ("offset past file", _set_chunk("['model']['w']", 0, 0, 2**40), "lies past the end of the file"),
    ("offset at u64 max", _set_chunk("['model']['w']", 0, 0, 2**64 - 1), "lies past the end of the file"),
    ("stored past chunk", _set_chunk("['model']['w']", 0, 1, 2**33), "stored raw in"),
    ("overlap", lambda b: _record(b, "['model']['i']")["chunks"][0].__setitem__(0, _record(b, "['model']['w']")["chunks"][0][0]), "overlap in data-r00000.bin"),
    ("unknown torch dtype", lambda b: _record(b, "['model']['w']").update(dtype="float128"), "unknown or unstorable torch dtype"),
    ("quantized dtype", lambda b: _record(b, "['model']['w']").update(dtype="qint8"), "unknown or unstorable torch dtype"),
    ("numpy object dtype", lambda b: _record(b, "['np']").update(dtype="|O8"), "invalid numpy dtype string"),
    ("numpy dtype on a tensor", lambda b: _record(b, "['model']['w']").update(dtype="<f4"), "unknown or unstorable torch dtype"),
    ("unknown codec", lambda b: _record(b, "['model']['w']").update(codec="lz4"), "unknown codec 'lz4'"),
    ("unknown chunk codec", lambda b: _record(b, "['model']['w']")["chunks"][0].append("gzip"), "unknown codec 'gzip'"),
    ("unknown kind", lambda b: _record(b, "['model']['w']").update(kind="pickle"), "unknown kind 'pickle'"),
    ("huge chunks", lambda b: _record(b, "['model']['w']").update(chunk_bytes=2**40), "more than the"),
    ("records not a list", lambda b: b.update(records={"0": 1}), "expected a list"),
    ("created not finite", lambda b: b.update(created=float("inf")), "expected a unix time"),
    ("created a string", lambda b: b.update(created="1e400"), "expected a unix time"),
    ("metadata a list", lambda b: b.update(metadata=[["a", 1]]), "expected a map"),
    ("version a float", lambda b: b.update(version=2.0), "format version 2.0 is not supported"),
    ("skeleton leaf twice", lambda b: b.update(skeleton=["l", [["T", 0], ["T", 0]]]), "used twice"),
    ("skeleton short", lambda b: b.update(skeleton=["l", [["T", 0]]]), "the skeleton refers to 1 arrays"),
    ("skeleton deep", lambda b: b.update(skeleton=_nested(MAX_SKELETON_DEPTH // 2 + 1)), "nests deeper than"),
    ("skeleton huge", lambda b: b.update(skeleton=["l", [0] * (MAX_SKELETON_NODES + 1)]), f"more than {MAX_SKELETON_NODES} nodes"),
]


def _nested(levels: int) -> Any:
    node: Any = 0
    for _ in range(levels):
        node = ["l", [node]]
    return node


@pytest.mark.parametrize("name, change, message", _CASES, ids=[c[0] for c in _CASES])
def test_each_hostile_field_is_refused_before_any_read_or_allocation(
    versions: dict[str, _Version], executor: concurrent.futures.Executor, name: str, change: Callable[[Any], None], message: str
) -> None:
    version = versions["raw"]
    body = copy.deepcopy(version.body)
    change(body)
    version.write(body)
    try:
        with pytest.raises(CorruptCheckpointError, match="^step 5 on tier 'fuzz': ") as info:
            _timed(lambda: _read(version, executor))
    finally:
        version.write(version.body)
    text = str(info.value)
    assert message in text, text
    assert MANIFEST_FILE in text or "data file" in text or DATA in text, text  # names the file
    assert (info.value.tier, info.value.step) == ("fuzz", STEP)


def _timed(call: Callable[[], Any], seconds: float = 30) -> Any:
    """Run ``call`` in a thread and fail rather than hang (a FIFO opened for reading would block)."""
    result: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the read blocked"
    if errors:
        raise errors[0]
    return result[0]


def test_msgpack_nested_past_its_own_limit_is_refused(versions: dict[str, _Version]) -> None:
    version = versions["raw"]
    raw = b"\x81\xa8skeleton" + b"\x91" * 5000 + b"\xc0"  # {"skeleton": [[[...]]]}, 5000 deep
    (version.dir / MANIFEST_FILE).write_bytes(msgpack.packb({"body": raw, CHECKSUM_ALGORITHM: checksum(raw)}))
    try:
        with pytest.raises(CorruptCheckpointError, match=f"{MANIFEST_FILE}: body is not msgpack"):
            read_manifest(version.dir, tier="fuzz", step=STEP)
    finally:
        version.write(version.body)


def test_an_oversized_manifest_is_refused_by_its_size_before_it_is_read(versions: dict[str, _Version]) -> None:
    version = versions["raw"]
    path = version.dir / MANIFEST_FILE
    with open(path, "wb") as f:
        f.truncate(MAX_MANIFEST_BYTES + 1)  # sparse: no disk used
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError, match=f"{MANIFEST_FILE}: {MAX_MANIFEST_BYTES + 1} bytes, more than"):
            read_manifest(version.dir, tier="fuzz", step=STEP)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        version.write(version.body)
    assert peak < 1 << 20


def test_a_symlinked_manifest_or_version_directory_is_refused(versions: dict[str, _Version], tmp_path: Path) -> None:
    version = versions["raw"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name in (MANIFEST_FILE, DATA):
        shutil.copyfile(version.dir / name, elsewhere / name)
    manifest = version.dir / MANIFEST_FILE
    manifest.unlink()
    manifest.symlink_to(elsewhere / MANIFEST_FILE)
    try:
        with pytest.raises(CorruptCheckpointError, match=f"{MANIFEST_FILE} is a symlink"):
            read_manifest(version.dir, tier="fuzz", step=STEP)
    finally:
        manifest.unlink()
        version.write(version.body)
    linked = tmp_path / version_dirname(STEP)
    linked.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(CorruptCheckpointError, match=f"the version directory {version_dirname(STEP)} is a symlink"):
        read_manifest(linked, tier="fuzz", step=STEP)


# -- end to end: restore moves on ------------------------------------------------------------------------


def test_restore_moves_on_past_a_symlinked_or_fifo_data_file(tmp_path: Path) -> None:
    """A data file swapped for a symlink to a perfectly good copy is still refused, and so is a FIFO
    (without blocking); restore takes the same step from the next tier."""
    config = {
        "host": {"capacity": "4MiB", "snapshots": 1},
        "tiers": [
            {"name": "ram", "type": "memory"},
            {"name": "nvme", "type": "filesystem", "path": str(tmp_path / "nvme")},
            {"name": "pfs", "type": "filesystem", "path": str(tmp_path / "pfs")},
        ],
    }
    with Checkpointer(config) as ckpt:
        assert ckpt.save_sync(STEP, _state()).committed_sync("pfs", timeout=60)
    data = tmp_path / "nvme" / version_dirname(STEP) / DATA
    for replace in ("symlink", "fifo"):
        data.unlink()
        if replace == "symlink":
            data.symlink_to(tmp_path / "pfs" / version_dirname(STEP) / DATA)
        else:
            os.mkfifo(data)
        with logged_warnings() as messages, Checkpointer(config) as ckpt:
            restored = _timed(ckpt.restore_latest_sync)
        assert (restored.step, restored.tier) == (STEP, "pfs")
        assert torch.equal(restored.state["model"]["w"], _state()["model"]["w"])
        expected = "is a symlink" if replace == "symlink" else "is not a regular file"
        assert any(f"step {STEP} on tier 'nvme'" in m and f"data file {DATA} {expected}" in m for m in messages), messages


# -- the skeleton node limit, on both sides -----------------------------------------------------------


def test_the_skeleton_node_limit_holds_for_saving_and_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    # flattening (both walks: state.walk's and state.leaves') and decoding (state.skeleton) each hold the limit
    monkeypatch.setattr(tierckpt.state.walk, "MAX_SKELETON_NODES", 100)
    monkeypatch.setattr(tierckpt.state.leaves, "MAX_SKELETON_NODES", 100)
    monkeypatch.setattr(tierckpt.state.skeleton, "MAX_SKELETON_NODES", 100)
    fits = {"xs": list(range(97))}  # root dict 1 + key and value 2 + 97 items = 100
    skeleton, leaves = flatten(fits)
    assert unflatten(skeleton, []) == fits and skeleton_leaf_count(skeleton) == 0
    with pytest.raises(UnsupportedStateError, match="more than 100 values outside arrays") as info:
        flatten({"xs": list(range(98))})
    assert info.value.key == "['xs']"
    with pytest.raises(CorruptCheckpointError, match="more than 100 nodes"):
        skeleton_leaf_count(["d", [["xs", ["l", list(range(98))]]]])
    with pytest.raises(CorruptCheckpointError, match="more than 100 nodes"):
        unflatten(["l", [["T", i] for i in range(100)]], [torch.zeros(1)] * 100)
