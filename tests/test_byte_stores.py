"""One commit protocol over both byte stores: the local file system and an S3 bucket (the real
SeaweedFS server) answer the same calls the same way, and the stored tier over either keeps an
earlier version of a step saved again while it is still read."""

from __future__ import annotations

import asyncio
import concurrent.futures
from pathlib import Path
from typing import Any, Iterator

import obstore
import pytest
import torch

from tierckpt import Checkpointer
from tierckpt.config import TierConfig
from tierckpt.storage.local import LocalStore
from tierckpt.storage.store import ByteStore
from tierckpt.testing.inspect import call_on_engine, tier_of
from tierckpt.tiers.stored.commit import place

from helpers import ram_fs, tier_config

FINAL = "step-000000000001"
FIRST, SECOND = f".tmp-{FINAL}-first01", f".tmp-{FINAL}-second2"


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ByteStore]:
    """A byte store of each kind, opened as a tier's keeper opens it."""
    with concurrent.futures.ThreadPoolExecutor(2) as executor:
        made: ByteStore
        if request.param == "local":
            made = LocalStore(tmp_path / "tier", executor, tier="t")
        else:
            from tierckpt.storage.s3store import BucketStore

            s3 = request.getfixturevalue("s3")
            config = TierConfig(**s3.tier("t", prefix=s3.prefix))
            made = BucketStore(config, lambda head: {head.decode().rpartition(":")[2]}, tier="t")
        asyncio.run(made.open(exclusive=True))
        try:
            yield made
        finally:
            asyncio.run(made.close())


def _write(store: ByteStore, staging: str, commit: bytes) -> str:
    """Stage a version holding one data object; returns the object's name once published."""
    name = store.named(staging, "data-r00000.bin")

    async def go() -> None:
        await store.stage(staging)
        await store.write_small(f"{staging}/{name}", b"data of " + staging.encode())
        await store.write_small(f"{staging}/manifest.msgpack", commit)
        await store.sync(staging)

    asyncio.run(go())
    return name


def _missing(store: ByteStore, key: str) -> bool:
    try:
        store.read_small(key, 1 << 20)
    except FileNotFoundError:
        return True
    return False


def test_a_version_is_invisible_until_published_replaced_at_once_and_withdrawn_before_it_is_removed(store: ByteStore) -> None:
    # The commit objects name their write the way this test's writes_of reads them (the S3 store's sweep).
    first = _write(store, FIRST, b"commit:first01")
    assert _missing(store, f"{FINAL}/manifest.msgpack")  # staged: no reader finds it
    assert not any(e.name == FINAL and e.committed for e in asyncio.run(store.list()))
    assert asyncio.run(place(store, FIRST, FINAL, tier="t")) is None  # nothing to replace
    assert store.read_small(f"{FINAL}/manifest.msgpack", 1 << 20) == b"commit:first01"
    assert store.read_small(f"{FINAL}/{first}", 1 << 20) == b"data of " + FIRST.encode()

    second = _write(store, SECOND, b"commit:second2")
    assert first != second or not store.replaces_in_place  # two writes of a step side by side in a bucket
    old = asyncio.run(place(store, SECOND, FINAL, tier="t"))
    assert old is not None and old.startswith(f".replaced-{FINAL}-")
    assert store.read_small(f"{FINAL}/manifest.msgpack", 1 << 20) == b"commit:second2"
    assert store.read_small(f"{FINAL}/{second}", 1 << 20) == b"data of " + SECOND.encode()
    assert store.read_small(f"{old}/{first}", 1 << 20) == b"data of " + FIRST.encode()  # the older write waits
    # ... a version still, readable whole under its own name: its commit object too, which a bucket
    # copied aside before the newer one went over it; listed as such, and found by its step.
    assert store.read_small(f"{old}/manifest.msgpack", 1 << 20) == b"commit:first01"
    assert old in {e.name for e in asyncio.run(store.list())}
    assert store.containers_named(f".replaced-{FINAL}-") == [old]
    assert asyncio.run(store.remove(old)) is None
    assert _missing(store, f"{old}/{first}") and _missing(store, f"{old}/manifest.msgpack")
    assert store.containers_named(f".replaced-{FINAL}-") == []
    assert store.read_small(f"{FINAL}/{second}", 1 << 20) == b"data of " + SECOND.encode()  # the version in place stays

    trash = f".trash-{FINAL}-x"
    asyncio.run(store.withdraw(FINAL, trash))
    assert _missing(store, f"{FINAL}/manifest.msgpack")  # no longer a version, its data not yet removed
    assert asyncio.run(store.remove(trash)) is None
    assert not [e for e in asyncio.run(store.list()) if FINAL in e.name]


def test_a_write_no_commit_object_names_is_listed_as_a_leftover_for_the_sweep(store: ByteStore) -> None:
    _write(store, FIRST, b"commit:first01")
    asyncio.run(place(store, FIRST, FINAL, tier="t"))
    stray = _write(store, SECOND, b"commit:second2")  # written, never published (a crash before its commit)
    names = {e.name for e in asyncio.run(store.list())}
    assert FINAL in names and SECOND in names  # a directory on disk; a write id in a bucket: the same name
    assert asyncio.run(store.remove(SECOND)) is None
    assert _missing(store, f"{SECOND}/{stray}")
    assert store.read_small(f"{FINAL}/manifest.msgpack", 1 << 20) == b"commit:first01"


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.randn(20_000, generator=torch.Generator().manual_seed(step)), "step": step}


def _earlier_copies(kind: str, root: Path, s3: Any) -> int:
    """How many earlier writes of step 5 the tier's store still holds."""
    if kind == "filesystem":
        return len([n for n in (p.name for p in root.iterdir()) if n.startswith(".replaced-step-000000000005-")])
    keys = [m["path"] for batch in obstore.list(s3.client(), f"{s3.prefix}/step-000000000005/") for m in batch]
    return len([k for k in keys if k.rpartition("/")[2].startswith("data-")]) - 1


@pytest.mark.parametrize("kind", ["filesystem", "object"])
def test_the_earlier_version_of_a_step_saved_again_stays_while_it_is_read_and_goes_after(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    s3 = request.getfixturevalue("s3") if kind == "object" else None
    config = ram_fs(tmp_path / "disk", name="low") if s3 is None else tier_config(s3.tier("low", prefix=s3.prefix), capacity="8MiB")
    with Checkpointer(config) as ckpt:
        assert ckpt.save_sync(5, _state(5)).committed_sync("low", timeout=60)
        tier = tier_of(ckpt, "low")
        lease = call_on_engine(ckpt, lambda: tier.lease(5))  # a restore or a flush reading step 5
        assert ckpt.save_sync(5, _state(50)).committed_sync("low", timeout=60)
        assert _earlier_copies(kind, tmp_path / "disk", s3) == 1  # still read: kept
        call_on_engine(ckpt, lease.release)
        assert ckpt.save_sync(6, _state(6)).committed_sync("low", timeout=60)  # the next write removes it
        assert _earlier_copies(kind, tmp_path / "disk", s3) == 0
        restored = ckpt.restore_sync(5, tier="low")
        assert torch.equal(restored.state["w"], _state(50)["w"])


def test_a_data_object_holds_the_bytes_given_even_when_their_buffer_is_reused_right_after(tmp_path: Path, s3: Any) -> None:
    """The S3 client keeps a reference to a buffer it is given and uploads it later; a writer hands
    it its chunk from a reused scratch buffer (a compressed chunk), which the next chunk overwrites.
    The object must hold the bytes as they were when given (before, the next chunk's were uploaded:
    a committed version that failed its checksums on restore)."""
    from tierckpt.storage.plan import WriteItem, WritePlan
    from tierckpt.storage.s3store import BucketStore

    config = TierConfig(**s3.tier("t", prefix=s3.prefix))
    store = BucketStore(config, lambda head: set(), tier="t")
    items = tuple(WriteItem(i, 0, i, "zstd", None) for i in range(2))
    scratch = bytearray(1 << 20)
    writer = store.open_data("data.bin", WritePlan(items, ("zstd",), False, 0))
    for item, fill in zip(items, (b"A", b"B")):
        scratch[:] = fill * len(scratch)  # the chunk, in the buffer every chunk of this thread goes through
        writer.write(item, memoryview(scratch))
    scratch[:] = b"C" * len(scratch)  # the thread's next chunk, before the upload is done
    assert writer.finish() == (0, 1 << 20)
    writer.close()
    got = bytes(obstore.get(s3.client(), f"{s3.prefix}/data.bin").bytes())
    assert got == b"A" * (1 << 20) + b"B" * (1 << 20)
