"""Differential versions (``delta: {full_every: N}``): round trips, references, retention of bases,
damage, promotion, and the frame codec."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import obstore
import pytest
import torch

from tierckpt import Checkpointer, ConfigError
from tierckpt._buffers import aligned_buffer
from tierckpt.codecs import decoder
from tierckpt.config import CompressionConfig, Config
from tierckpt.errors import CorruptCheckpointError
from tierckpt.format import MANIFEST_FILE, Manifest, checksum, version_dirname
from tierckpt.format.manifest import decode_document
from tierckpt.storage.scratch import scratch_bytes
from tierckpt.testing.faults import flip_bits
from tierckpt.testing.ranks import run_script
from tierckpt.tiers.stored import write as fswrite
from tierckpt.tiers.stored.encoding import TierEncoding
from tierckpt.tiers.stored.read import open_source, read_manifest
from tierckpt.tiers.stored.standalone import standalone
from tierckpt.xordelta import SKIP_AFTER_MISS, DeltaCodec, XorHistory, digest

from helpers import SHUFFLED_ZSTD, Opened, assert_bitwise, held, logged_warnings, ram_fs, tierckpt_cli

MiB = 1 << 20


class Training:
    """A state that moves as training moves it: a frozen tensor (4 MiB, never changes), a trained one
    (4 MiB, a small step each save), a bf16 copy of it, an integer counter and a plain value."""

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.g = g
        self.frozen = torch.randn(MiB, generator=g)
        self.weight = torch.randn(MiB, generator=g)
        self.counts = torch.zeros(1000, dtype=torch.int64)

    def step(self, step: int) -> dict[str, Any]:
        self.weight.add_(torch.randn(MiB, generator=self.g), alpha=1e-3)
        self.counts += step
        state = {
            "frozen": self.frozen,
            "weight": self.weight,
            "half": self.weight.to(torch.bfloat16),
            "counts": self.counts,
            "step": step,
        }
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _config(root: Path, *, every: int = 3, compression: dict[str, Any] | None = None, **tier: Any) -> dict[str, Any]:
    settings: dict[str, Any] = {"delta": {"full_every": every}, **tier}
    if compression is not None:
        settings["compression"] = compression
    return ram_fs(root, capacity="48MiB", **settings)


def _manifest(root: Path, step: int) -> Manifest:
    return Manifest.decode((root / version_dirname(step) / MANIFEST_FILE).read_bytes())


def _codecs(manifest: Manifest, key: str) -> list[str]:
    record = next(r for r in manifest.records if r.key == key)
    return [record.chunk_codec(i) for i in range(len(record.chunks))]


def _save_all(opened: Opened, config: dict[str, Any], steps: range, training: Training) -> dict[int, dict[str, Any]]:
    ckpt = opened(config)
    states = {}
    for step in steps:
        states[step] = training.step(step)
        assert ckpt.save_sync(step, states[step]).committed_sync("nvme", timeout=60)
    ckpt.close_sync()
    return states


@pytest.mark.parametrize("compression", [None, SHUFFLED_ZSTD], ids=["raw", "zstd+shuffle"])
def test_every_version_restores_bitwise_and_says_what_it_depends_on(opened: Opened, tmp_path: Path, compression: Any) -> None:
    root = tmp_path / "nvme"
    config = _config(root, every=3, compression=compression)
    states = _save_all(opened, config, range(1, 8), Training())

    ckpt = opened(config)
    infos = {v.step: v for v in ckpt.versions() if v.tier == "nvme"}
    assert {s: (v.base, v.chain) for s, v in infos.items()} == {
        1: (None, 0), 2: (1, 1), 3: (1, 2), 4: (None, 0), 5: (4, 1), 6: (4, 2), 7: (None, 0)
    }
    assert (infos[1].needed_by, infos[4].needed_by, infos[7].needed_by) == ((2, 3), (5, 6), ())
    for step, state in states.items():
        restored = ckpt.restore_sync(step)
        assert restored.tier == "nvme"
        assert_bitwise(restored.state, state)

    whole, delta = _manifest(root, 4), _manifest(root, 5)
    assert whole.base is None and all(c.digest is not None for r in whole.records for c in r.chunks)
    assert delta.base is not None and delta.base[0] == 4 and delta.chain == 1
    assert _codecs(delta, "['frozen']") == ["ref"]  # unchanged: nothing stored
    assert _codecs(delta, "['weight']") == ["delta"]  # trained: its XOR against step 4's
    assert _codecs(delta, "['counts']") != ["delta"]  # integers are stored as they are
    frozen = next(r for r in delta.records if r.key == "['frozen']")
    assert frozen.stored == 0
    assert delta.stored_bytes < whole.stored_bytes * 0.75


def test_a_version_that_changed_wholesale_is_stored_as_the_tier_stores_it(opened: Opened, tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    config = _config(root, every=4)
    ckpt = opened(config)
    g = torch.Generator().manual_seed(1)
    # Random bits as floats: no byte of one save tells anything of the next.
    states = {step: {"w": torch.randint(-(2**31), 2**31 - 1, (MiB,), generator=g, dtype=torch.int32).view(torch.float32)} for step in (1, 2)}
    for step, state in states.items():
        assert ckpt.save_sync(step, state).committed_sync("nvme", timeout=60)
    second = _manifest(root, 2)
    assert second.base is not None  # a differential version ...
    assert _codecs(second, "['w']") == ["none"]  # ... whose noise gained nothing from its base
    assert second.stored_bytes == MiB * 4
    assert_bitwise(ckpt.restore_sync(2).state, states[2])


def test_retention_keeps_the_base_of_every_kept_version_and_frees_it_after(opened: Opened, tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    config = _config(root, every=4, keep={"last": 2})
    training = Training()
    ckpt = opened(config)
    states = {}
    on_disk = {}
    for step in range(1, 10):
        states[step] = training.step(step)
        ckpt.save_sync(step, states[step])
        ckpt.wait_sync()  # flushed and pruned
        on_disk[step] = held(ckpt, "nvme")
    # 1 whole, 2-4 against 1, 5 whole, 6-8 against 5, 9 whole: the last two, and their base.
    assert on_disk[3] == [1, 2, 3]
    assert on_disk[4] == [1, 3, 4]
    assert on_disk[5] == [1, 4, 5]  # 4 still needs 1
    assert on_disk[6] == [5, 6]  # 1 is free once 4 went
    assert on_disk[8] == [5, 7, 8]
    assert on_disk[9] == [5, 8, 9]
    assert sorted(int(p.name[5:]) for p in root.glob("step-*")) == [5, 8, 9]
    ckpt.close_sync()
    fresh = opened(config)
    assert [(v.step, v.base, v.needed_by) for v in fresh.versions() if v.tier == "nvme"] == [(5, None, (8,)), (8, 5, ()), (9, None, ())]
    assert_bitwise(fresh.restore_sync(8).state, states[8])


def _flip_chunk(root: Path, step: int, key: str) -> None:
    version = root / version_dirname(step)
    record = next(r for r in _manifest(root, step).records if r.key == key)
    chunk = record.chunks[0]
    flip_bits(version / record.file, chunk.offset + chunk.stored // 2, 0x10)


def test_a_damaged_base_fails_its_dependents_and_restore_falls_back(opened: Opened, tmp_path: Path) -> None:
    nvme, pfs = tmp_path / "nvme", tmp_path / "pfs"
    config = _config(nvme, every=4)
    config["tiers"].append({"name": "pfs", "type": "filesystem", "path": str(pfs)})
    training = Training()
    ckpt = opened(config)
    states = {}
    for step in (1, 2, 3):
        states[step] = training.step(step)
        assert ckpt.save_sync(step, states[step]).committed_sync("pfs", timeout=60)
    ckpt.close_sync()
    _flip_chunk(nvme, 1, "['frozen']")  # step 3 refers to it

    fresh = opened(config)
    with pytest.raises(CorruptCheckpointError, match=r"step 3: no copy verifies \(tier 'nvme': its base, step 1: data-r00000.bin: \['frozen'\] chunk 0: checksum mismatch") as info:
        fresh.restore_sync(3, tier="nvme")
    assert info.value.step == 3
    with logged_warnings() as warned:
        restored = fresh.restore_latest_sync()
    assert (restored.step, restored.tier) == (3, "pfs")  # never wrong data: the next copy
    # nvme's copy of step 3 was found damaged by the restore above: not read again in this process.
    assert not [w for w in warned if "does not verify" in w]
    assert_bitwise(restored.state, states[3])
    fresh.close_sync()
    with logged_warnings(r"its base, step 1"):  # a new process reads it again, and says so
        restored = opened(config).restore_latest_sync()
    assert (restored.step, restored.tier) == (3, "pfs")


def test_a_missing_base_is_named(opened: Opened, tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    config = _config(root, every=4)
    _save_all(opened, config, range(1, 3), Training())
    shutil.rmtree(root / version_dirname(1))
    with pytest.raises(CorruptCheckpointError, match=r"tier 'nvme': its base, step 1: the version directory step-000000000001 is missing"):
        opened(config).restore_sync(2)


def test_a_base_saved_again_is_not_taken_for_the_one_a_delta_was_written_against(opened: Opened, tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    config = _config(root, every=4)
    _save_all(opened, config, range(1, 3), Training())
    kept = tmp_path / "kept"
    shutil.copytree(root / version_dirname(2), kept)
    _save_all(opened, config, range(1, 2), Training(seed=5))  # step 1 saved again, its earlier version kept aside for 2
    for aside in root.glob(".replaced-*"):
        shutil.rmtree(aside)  # as a hand that cleans up would
    shutil.rmtree(root / version_dirname(2))
    shutil.copytree(kept, root / version_dirname(2))
    with pytest.raises(CorruptCheckpointError, match=r"its base, step 1, is not the version it was written against"):
        opened(config).restore_sync(2)


def test_a_tier_below_reading_a_differential_version_gets_the_logical_state(opened: Opened, tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    states = _save_all(opened, _config(root, every=4, compression=SHUFFLED_ZSTD), range(1, 4), Training())
    version = root / version_dirname(3)
    manifest = read_manifest(version, tier="nvme", step=3)
    assert manifest.base is not None
    source = open_source("nvme", version, manifest)
    out = tmp_path / "below" / version_dirname(3)
    out.mkdir(parents=True)
    raw = TierEncoding(CompressionConfig(), "below").begin()
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as executor:
            records = fswrite.write_data_file(source, out / "data-r00000.bin", raw, executor)
    finally:
        source.close()
    copy = Manifest(3, manifest.created, manifest.skeleton, records, manifest.metadata)
    assert copy.base is None and all(c.base is None for r in copy.records for c in r.chunks)
    (out / MANIFEST_FILE).write_bytes(copy.encode())
    restored = opened(ram_fs(tmp_path / "below", name="below")).restore_sync(3)
    assert_bitwise(restored.state, states[3])


def test_a_whole_version_of_an_older_tier_is_no_base(opened: Opened, tmp_path: Path) -> None:
    # Versions written before delta was set keep no digests: the first one after is whole.
    root = tmp_path / "nvme"
    training = Training()
    states = _save_all(opened, ram_fs(root, capacity="48MiB"), range(1, 3), training)
    states.update(_save_all(opened, _config(root, every=4), range(3, 5), training))
    ckpt = opened(_config(root, every=4))
    # 3 is written whole (step 2 has no digests to refer to), and keeps digests: 4 refers to it.
    assert [(v.step, v.base) for v in ckpt.versions() if v.tier == "nvme"] == [(1, None), (2, None), (3, None), (4, 3)]
    assert all(c.digest is not None for r in _manifest(root, 3).records for c in r.chunks)
    for step in (3, 4):
        assert_bitwise(ckpt.restore_sync(step).state, states[step])


def test_a_manifest_with_a_delta_frame_of_no_bytes_is_corrupt(tmp_path: Path) -> None:
    import msgpack

    from tierckpt.format import decode_document
    from tierckpt.format.checksum import checksum

    root = tmp_path / "nvme"
    with Checkpointer(_config(root, every=4)) as ckpt:
        training = Training()
        for step in (1, 2):
            assert ckpt.save_sync(step, training.step(step)).committed_sync("nvme", timeout=60)
    path = root / version_dirname(2) / MANIFEST_FILE
    outer = msgpack.unpackb(path.read_bytes())
    body = msgpack.unpackb(outer["body"], strict_map_key=False)
    record = next(r for r in body["records"] if r["key"] == "['weight']")
    assert record["chunks"][0][3] == "delta"
    record["chunks"][0][1] = 0  # a frame of no bytes: would read nothing and decode nothing
    outer["body"] = msgpack.packb(body, use_bin_type=True)
    outer["xxh3_64"] = checksum(outer["body"])
    with pytest.raises(CorruptCheckpointError, match="a delta frame of 0 bytes"):
        decode_document(msgpack.packb(outer, use_bin_type=True))


# -- the frame codec ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_a_frame_applied_to_its_base_gives_the_chunk(dtype: Any) -> None:
    rng = np.random.default_rng(0)
    base = rng.standard_normal(100_003).astype(dtype)  # an odd length: planes and a tail
    moved = (base + (rng.standard_normal(base.size) * 1e-3).astype(dtype)).astype(dtype)
    codec = DeltaCodec(level=1, min_ratio=1.05)
    frame = codec.encode(memoryview(moved).cast("B"), memoryview(base).cast("B"), base.itemsize)
    assert frame is not None and frame.nbytes < moved.nbytes * 0.9
    out = base.copy()
    codec.apply(memoryview(bytes(frame)), memoryview(out).cast("B"))
    assert out.tobytes() == moved.tobytes()


def test_noise_against_noise_is_no_frame() -> None:
    rng = np.random.default_rng(1)
    a, b = (rng.integers(0, 2**32, 50_000, dtype=np.uint32).view(np.float32) for _ in range(2))
    assert DeltaCodec().encode(memoryview(a).cast("B"), memoryview(b).cast("B"), 4) is None


def test_a_damaged_frame_is_corrupt_not_wrong() -> None:
    rng = np.random.default_rng(2)
    base = rng.standard_normal(50_000).astype(np.float32)
    moved = base + np.float32(1e-4)
    frame = bytearray(DeltaCodec().encode(memoryview(moved).cast("B"), memoryview(base).cast("B"), 4) or b"")
    frame[10] ^= 0xFF  # the plane table
    with pytest.raises(CorruptCheckpointError):
        DeltaCodec().apply(memoryview(bytes(frame)), memoryview(base.copy()).cast("B"))


def test_digests_tell_equal_chunks() -> None:
    a = np.arange(1000, dtype=np.float32)
    b = a.copy()
    assert digest(memoryview(a).cast("B")) == digest(memoryview(b).cast("B"))
    b[500] = np.nextafter(b[500], np.float32(np.inf))
    assert digest(memoryview(a).cast("B")) != digest(memoryview(b).cast("B"))


@pytest.mark.slow
def test_the_command_line_says_what_depends_on_what(opened: Opened, tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    _save_all(opened, _config(root, every=3), range(1, 5), Training())
    listed = tierckpt_cli("ls", str(root))
    assert listed.returncode == 0, listed.stderr
    lines = {line.split()[1]: line for line in listed.stdout.splitlines()[1:]}
    assert lines["1"].endswith("yes, base of 2, 3")
    assert lines["2"].endswith("yes, delta of step 1") and lines["3"].endswith("yes, delta of step 1")
    assert lines["4"].endswith("yes")
    status = tierckpt_cli("status", str(root))
    assert status.returncode == 0, status.stderr
    assert "4 (2 deltas)" in status.stdout

    _flip_chunk(root, 1, "['frozen']")
    verified = tierckpt_cli("verify", str(root))
    assert verified.returncode == 1
    damaged = [line.split()[0] for line in verified.stdout.splitlines() if "DAMAGED" in line]
    assert damaged == [version_dirname(s) for s in (1, 2, 3)]
    assert "its base, step 1: data-r00000.bin: ['frozen'] chunk 0: checksum mismatch" in verified.stdout


# -- several ranks ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_ranks_write_their_parts_against_their_parts_of_the_base_and_restore_in_any_layout(tmp_path: Path) -> None:
    from test_distributed import run_ranks

    env = {"DELTA": "3", "REPLICATED": "1"}
    saved = run_ranks(2, "save", tmp_path, env | {"STEPS": "1,2,3,4,5"})
    assert [r["committed"] for r in saved] == [[True] * 5] * 2
    disk = tmp_path / "disk"
    # keep: {last: 3} keeps 3, 4, 5, and 1, the base of 3.
    assert sorted(int(p.name[5:]) for p in disk.glob("step-*")) == [1, 3, 4, 5]
    marker = decode_document((disk / version_dirname(5) / MANIFEST_FILE).read_bytes())
    assert (marker.base, marker.chain) == (4, 1)
    for rank in (0, 1):
        part = decode_document((disk / version_dirname(5) / f"manifest-r{rank:05d}.msgpack").read_bytes())
        assert part.base is not None and part.base[0] == 4
        own = [r.chunk_codec(i) for r in part.records for i, c in enumerate(r.chunks) if c is not None]
        assert "ref" in own and "delta" in own  # the frozen part referenced, the weights' XOR: each rank its own turn
    for step in ("3", "5"):
        restored = run_ranks(2, "restore", tmp_path, env | {"RESTORE_STEP": step})
        assert [(r["step"], r["bitwise"]) for r in restored] == [(int(step), True)] * 2, restored
    # Another layout: one rank reads both parts, each against its own part of the base.
    restored = run_ranks(1, "restore", tmp_path, env | {"RESTORE_STEP": "5"})
    assert [(r["step"], r["bitwise"]) for r in restored] == [(5, True)], restored


# -- an object tier ---------------------------------------------------------------------------------------


def test_an_object_tier_stores_deltas_keeps_their_bases_and_restores_bitwise(s3: Any) -> None:
    section = s3.tier("s3", prefix=s3.prefix, delta={"full_every": 3}, keep={"last": 1}, compression=SHUFFLED_ZSTD)
    config = {"host": {"capacity": "48MiB", "snapshots": 2}, "tiers": [{"name": "ram", "type": "memory"}, section]}
    training = Training()
    states = {}
    with Checkpointer(config) as ckpt:
        for step in (1, 2, 3):
            states[step] = training.step(step)
            ckpt.save_sync(step, states[step])
            ckpt.wait_sync()
        assert [(v.step, v.base, v.needed_by) for v in ckpt.versions() if v.tier == "s3"] == [(1, None, (3,)), (3, 1, ())]
        stats = ckpt.counters.compression["s3"]
        assert (stats.versions_delta, stats.chunks_referenced) == (2, 2)
    store = s3.client()
    names = {m["path"].split("/")[1] for batch in obstore.list(store, s3.prefix + "/") for m in batch}
    assert names == {version_dirname(1), version_dirname(3)}  # 2 went; 1 stays for 3
    with Checkpointer(config) as ckpt:
        restored = ckpt.restore_latest_sync()
        assert (restored.step, restored.tier) == (3, "s3")
        assert_bitwise(restored.state, states[3])


def test_saving_a_base_again_keeps_its_earlier_version_aside_for_the_versions_written_against_it(opened: Opened, tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    # abandoned: 2: saving step 1 again leaves 2 and 3 in an abandoned direction, kept here.
    config = _config(root, every=4, keep={"last": 3, "abandoned": 2})
    training = Training()
    states = _save_all(opened, config, range(1, 4), training)  # 1 whole, 2 and 3 against it
    # The job goes back to step 1 (another run: another state) and saves it again.
    again = Training(seed=9).step(1)
    ckpt = opened(config)
    ckpt.save_sync(1, again)
    ckpt.wait_sync()
    # 2 and 3 depend on the earlier step 1, not on this one: no version depends on the step 1 in place.
    assert [(v.step, v.base, v.needed_by) for v in ckpt.versions() if v.tier == "nvme"] == [(1, None, ()), (2, 1, ()), (3, 1, ())]
    listed = tierckpt_cli("ls", str(root))
    assert [line.split(maxsplit=1)[0] for line in listed.stdout.splitlines() if line.endswith(" yes")] == [version_dirname(1)]
    aside = [p.name for p in root.glob(f".replaced-{version_dirname(1)}-*")]
    assert len(aside) == 1  # the earlier step 1, which 2 and 3 were written against
    assert_bitwise(ckpt.restore_sync(1).state, again)
    for step in (2, 3):  # still whole: nothing committed was lost
        assert_bitwise(ckpt.restore_sync(step).state, states[step])
    ckpt.close_sync()
    plain = opened(ram_fs(root, capacity="48MiB"))  # delta no longer set: the copy aside stays all the same
    assert [p.name for p in root.glob(f".replaced-{version_dirname(1)}-*")] == aside
    assert_bitwise(plain.restore_sync(3).state, states[3])
    plain.close_sync()
    again_open = opened(config)  # the copy aside survives an open while 2 and 3 need it
    assert [p.name for p in root.glob(f".replaced-{version_dirname(1)}-*")] == aside
    assert_bitwise(again_open.restore_sync(3).state, states[3])
    # Once 2 and 3 are pruned, the copy aside goes too (keep last 3: 4, 5, 6, and their base, the new 1).
    for step in (4, 5, 6):
        again_open.save_sync(step, Training(seed=9).step(step))
        again_open.wait_sync()
    assert [(v.step, v.base, v.chain) for v in again_open.versions() if v.tier == "nvme"] == [(1, None, 0), (4, 1, 1), (5, 1, 2), (6, 1, 3)]
    assert list(root.glob(".replaced-*")) == []


def test_an_object_tier_keeps_the_earlier_version_of_a_base_saved_again_for_the_versions_written_against_it(s3: Any) -> None:
    # abandoned: 2: saving step 1 again leaves 2 and 3 in an abandoned direction, kept here.
    section = s3.tier("s3", prefix=s3.prefix, delta={"full_every": 4}, keep={"last": 3, "abandoned": 2}, compression=SHUFFLED_ZSTD)
    saving = {"host": {"capacity": "48MiB", "snapshots": 2}, "tiers": [{"name": "ram", "type": "memory"}, section]}
    reading = {"host": {"capacity": "48MiB", "snapshots": 1}, "tiers": [section]}  # the bucket alone
    training, states = Training(), {}
    with Checkpointer(saving) as ckpt:
        for step in (1, 2, 3):  # 1 whole, 2 and 3 against it
            states[step] = training.step(step)
            ckpt.save_sync(step, states[step])
            ckpt.wait_sync()
    again = Training(seed=9).step(1)  # the job went back to step 1 (another run: another state)
    with Checkpointer(saving) as ckpt:
        ckpt.save_sync(1, again)
        ckpt.wait_sync()
        assert [(v.step, v.base, v.needed_by) for v in ckpt.versions() if v.tier == "s3"] == [(1, None, ()), (2, 1, ()), (3, 1, ())]
    store = s3.client()

    def objects(step: int) -> list[str]:
        return sorted(m["path"].rpartition("/")[2] for batch in obstore.list(store, f"{s3.prefix}/{version_dirname(step)}/") for m in batch)

    assert len([n for n in objects(1) if n.startswith("head.")]) == 1  # the earlier commit object, copied aside
    with Checkpointer(reading) as ckpt:  # a new process: the earlier step 1 is found and read
        assert_bitwise(ckpt.restore_sync(1).state, again)
        for step in (2, 3):  # nothing committed was lost
            assert_bitwise(ckpt.restore_sync(step).state, states[step])
    # Once the abandoned 2 and 3 are pruned (abandoned: 0 now), the earlier step 1 goes too.
    later = {**saving, "tiers": [saving["tiers"][0], {**section, "keep": {"last": 3, "abandoned": 0}}]}
    with Checkpointer(later) as ckpt:
        for step in (4, 5, 6):
            ckpt.save_sync(step, Training(seed=9).step(step))
            ckpt.wait_sync()
        assert [(v.step, v.base, v.chain) for v in ckpt.versions() if v.tier == "s3"] == [(1, None, 0), (4, 1, 1), (5, 1, 2), (6, 1, 3)]
    assert [n for n in objects(1) if not n.startswith("data-")] == ["manifest.msgpack"]
    assert len([n for n in objects(1) if n.startswith("data-")]) == 1


@pytest.mark.parametrize("point", ["aside", "put"])
def test_a_sigkill_while_an_object_tier_saves_a_base_again_loses_no_version(s3: Any, point: str) -> None:
    import sys

    from s3_resave_child import again

    section = s3.tier("s3", prefix=s3.prefix, delta={"full_every": 4}, keep={"last": 3})
    config = {"host": {"capacity": "48MiB", "snapshots": 1}, "tiers": [section]}
    training, states = Training(), {}
    with Checkpointer(config) as ckpt:
        for step in (1, 2, 3):  # 1 whole, 2 and 3 against it
            states[step] = {"weight": training.step(step)["weight"]}
            assert ckpt.save_sync(step, states[step]).committed_sync("s3", timeout=60)
    child = Path(__file__).with_name("s3_resave_child.py")
    done = run_script([sys.executable, str(child), json.dumps(config), point])
    assert done.returncode == -9, f"not killed at {point}: {done.returncode}\n{done.stdout}\n{done.stderr}"
    with Checkpointer(config) as ckpt:  # opens, sweeps what the kill left, and finds every version
        assert [(v.step, v.base) for v in ckpt.versions() if v.tier == "s3"] == [(1, None), (2, 1), (3, 1)]
        # Killed before its commit object was put, the second save of step 1 never happened; after, it did.
        assert_bitwise(ckpt.restore_sync(1).state, states[1] if point == "aside" else again())
        for step in (2, 3):
            assert_bitwise(ckpt.restore_sync(step).state, states[step])
        for step in (4, 5, 6):  # 2 and 3 pruned: whatever step 1 kept aside goes with them
            assert ckpt.save_sync(step, {"weight": training.step(step)["weight"]}).committed_sync("s3", timeout=60)
    names = sorted(m["path"].rpartition("/")[2] for batch in obstore.list(s3.client(), f"{s3.prefix}/{version_dirname(1)}/") for m in batch)
    # One write's objects only: the earlier one went. (Killed at "aside", that write's own commit
    # object copied aside stays with it: one small object, which goes with that write.)
    assert "manifest.msgpack" in names and len({n.split(".")[1] for n in names if n != "manifest.msgpack"}) == 1, names
    assert len([n for n in names if n.startswith("data-")]) == 1, names


def test_a_base_found_damaged_while_writing_against_it_makes_that_version_whole(opened: Opened, tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    config = _config(root, every=4)
    training = Training()
    _save_all(opened, config, range(1, 2), training)
    _flip_chunk(root, 1, "['weight']")  # read to encode step 2's weights against it
    ckpt = opened(config)
    states = {}
    with logged_warnings(r"writing step 2 again, whole: its base is damaged .*checksum mismatch") :
        for step in (2, 3):
            states[step] = training.step(step)
            assert ckpt.save_sync(step, states[step]).committed_sync("nvme", timeout=60)
    infos = {v.step: v for v in ckpt.versions() if v.tier == "nvme"}
    assert (infos[1].valid, infos[2].base, infos[3].base) == (False, None, 2)  # no more versions against step 1
    assert _manifest(root, 2).base is None
    for step in (2, 3):
        assert_bitwise(ckpt.restore_sync(step).state, states[step])


def test_under_when_faster_a_version_written_raw_still_refers_but_does_not_xor() -> None:
    tier = TierEncoding(CompressionConfig(codec="zstd", shuffle=True, when="faster"), "pfs")
    base: Any = object()  # what the writer would read the base through; begin() only keeps it
    first = tier.begin(delta=base)  # no measurement yet: written raw
    assert (first.compress, first.digests, first.xor, first.raw_layout) == (False, True, False, False)
    always = TierEncoding(CompressionConfig(codec="zstd"), "pfs").begin(delta=base)
    assert (always.compress, always.xor) == (True, True)
    plain = TierEncoding(CompressionConfig(), "nvme")
    assert (plain.begin(delta=base).xor, plain.begin(digests=True).raw_layout) == (True, True)


def test_a_value_whose_frames_did_not_pay_is_skipped_for_a_while_then_tried_again() -> None:
    history = XorHistory(skip=2)
    assert history.worth_trying("m") and history.worth_trying("v")
    history.finish({"m": False, "v": True})  # version 1: m's frames did not pay
    tries = []
    for _ in range(5):  # versions 2..6
        tries.append(history.worth_trying("m"))
        assert history.worth_trying("v")
        history.finish({"m": False} if tries[-1] else {})
    assert tries == [False, False, True, False, False]  # two versions skipped, a try, two skipped
    history.finish({"m": True})  # a version that tried m (a test's liberty) and kept a frame of it
    assert history.worth_trying("m")


def test_a_tier_stops_trying_frames_of_a_value_that_changes_wholesale(opened: Opened, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tried: list[tuple[int, int]] = []  # (save, bytes) of each frame tried
    real = DeltaCodec.encode
    saving = [0]

    def spy(self: DeltaCodec, data: memoryview, base: memoryview, itemsize: int, **kw: Any) -> Any:
        tried.append((saving[0], data.nbytes))
        return real(self, data, base, itemsize, **kw)

    monkeypatch.setattr(DeltaCodec, "encode", spy)
    root = tmp_path / "nvme"
    ckpt = opened(_config(root, every=8, compression=SHUFFLED_ZSTD))
    training, g = Training(), torch.Generator().manual_seed(2)
    states = {}
    for step in range(1, 9):  # one whole version, then 7 against it
        saving[0] = step
        # "noise": a float tensor whose every bit changes from save to save; "weight" moves a little.
        noise = torch.randint(-(2**31), 2**31 - 1, (MiB // 4,), generator=g, dtype=torch.int32).view(torch.float32)
        states[step] = {"weight": training.step(step)["weight"], "noise": noise}
        assert ckpt.save_sync(step, states[step]).committed_sync("nvme", timeout=60)
    weight, noise = MiB * 4, MiB
    by_save = {s: sorted(n for t, n in tried if t == s) for s in range(2, 9)}
    skip = SKIP_AFTER_MISS
    expected = {s: sorted([weight] + ([noise] if (s - 2) % (skip + 1) == 0 else [])) for s in range(2, 9)}
    assert by_save == expected  # noise: tried at save 2, skipped 3 versions, tried again at 6
    assert _codecs(_manifest(root, 7), "['weight']") == ["delta"]
    for step, state in states.items():
        assert_bitwise(ckpt.restore_sync(step).state, state)


def test_a_differential_version_stands_alone_for_a_copy_sent_where_its_base_is_not(opened: Opened, tmp_path: Path) -> None:
    """What a node-local tier sends a rank on another node (tests/test_node_local_delta.py runs it across
    ranks): references as the base chunk's stored bytes, frames decoded, every chunk verified."""
    root = tmp_path / "nvme"
    _save_all(opened, _config(root, every=3, compression=SHUFFLED_ZSTD), range(1, 3), Training())
    source = open_source("nvme", root / version_dirname(2), _manifest(root, 2))
    alone = standalone(source)
    try:
        assert not any(c.base is not None or c.codec in ("ref", "delta") for r in alone.records for c in r.all_chunks())
        by_key = {r.key: r for r in alone.records}
        base = {r.key: r for r in _manifest(root, 1).records}
        # A reference goes as its base chunk is stored (compressed alike); a frame, decoded.
        frozen, based = by_key["['frozen']"], base["['frozen']"]
        assert (frozen.chunks[0].stored, frozen.chunks[0].checksum, frozen.chunk_codec(0)) == (based.chunks[0].stored, based.chunks[0].checksum, "zstd+shuffle")
        assert by_key["['weight']"].chunk_codec(0) == "none" and alone.checksum_of(by_key["['weight']"], 0) is None  # hashed as sent
        room = scratch_bytes(max(r.chunk_bytes for r in source.records))
        scratch, out = memoryview(aligned_buffer(room)), memoryview(bytearray(room))
        for stood, record in zip(alone.records, source.records):
            for i in range(len(stood.chunks)):
                sent = bytes(alone.read_stored(stood, i, scratch))
                known = alone.checksum_of(stood, i)
                assert known is None or checksum(sent) == known  # a checksum the copy's manifest gives matches what goes out
                start, length = record.chunk_span(i)
                source.read_logical(record, i, out[:length], scratch)
                decoded = bytearray(length)
                decoder(stood.chunk_codec(i)).decode_into(memoryview(sent), memoryview(decoded))
                assert decoded == out[:length], (record.key, i)
        # A damaged base chunk under a reference is not sent as if it were whole.
        chunk = base["['frozen']"].chunks[0]
        flip_bits(root / version_dirname(1) / base["['frozen']"].file, chunk.offset + 10, 1)
        with pytest.raises(CorruptCheckpointError, match=r"its base, step 1: .*\['frozen'\] chunk 0: checksum mismatch"):
            alone.read_stored(by_key["['frozen']"], 0, scratch)
    finally:
        alone.close()
    whole = open_source("nvme", root / version_dirname(1), _manifest(root, 1))
    assert standalone(whole) is whole  # a whole version is sent as it is
    whole.close()


@pytest.mark.parametrize(
    ("tier", "key", "says"),
    [
        ({"delta": {"full_every": 1}}, "tiers[1].delta.full_every", "1 is not allowed (tier 'nvme'); use an integer >= 2"),
        ({"delta": {"full_every": 3, "min_ratio": 0.5}}, "tiers[1].delta.min_ratio", "0.5 is not allowed (tier 'nvme')"),
        ({"delta": {"every": 3}}, "tiers[1].delta.every", "unknown key (tier 'nvme'); allowed: full_every, min_ratio"),
        ({"type": "peer", "path": None, "delta": {"full_every": 3}}, "tiers[1].delta", "not allowed on a peer tier (tier 'nvme'); a peer tier holds whole snapshots"),
    ],
)
def test_a_bad_delta_setting_names_its_key(tier: dict[str, Any], key: str, says: str) -> None:
    section = {k: v for k, v in ({"name": "nvme", "type": "filesystem", "path": "/tmp/nvme"} | tier).items() if v is not None}
    with pytest.raises(ConfigError) as caught:
        Config.from_dict({"tiers": [{"name": "ram", "type": "memory"}, section]})
    assert caught.value.key == key and str(caught.value).startswith(f"{key}: {says}"), str(caught.value)


def test_delta_is_allowed_on_a_node_local_tier() -> None:
    config = Config.from_dict({"tiers": [{"name": "ram", "type": "memory"}, {"name": "nvme", "type": "filesystem", "path": "/tmp/{node}", "scope": "node", "delta": {"full_every": 3}}]})
    assert config.tiers[1].delta is not None and config.tiers[1].delta.full_every == 3 and config.tiers[1].scope == "node"
