"""Restore: choosing the candidate, loading into templates, falling back past damage, a new process."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import msgpack
import numpy as np
import pytest
import torch

from tierckpt import Checkpointer
from tierckpt.capture import HostPool
from tierckpt.config import TierConfig
from tierckpt.errors import ConfigError, CorruptCheckpointError, NoCheckpointError, RestoreError
from tierckpt.format.lineage import user_metadata
from tierckpt.format import CHECKSUM_ALGORITHM, MANIFEST_FILE, Manifest, checksum, version_dirname
from tierckpt.tiers.base import VersionSource
from tierckpt.tiers.filesystem import FilesystemTier
from tierckpt.tiers.memory.tier import MemoryTier
from tierckpt.testing import GatedTier, flip_bits
from tierckpt.testing.inspect import free_slots, host_slots, pipeline_of

from helpers import SHUFFLED_ZSTD, Opened, assert_bitwise, bitwise_equal, fs_tier, logged_warnings, tier_config, until


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(64, 65, generator=g), "b": torch.randn(65, generator=g).to(torch.bfloat16)},
        "opt": [torch.randint(0, 100, (1000,), generator=g), (torch.randn(3, 4, generator=g), step)],
        "np": np.random.default_rng(step).standard_normal(333).astype(np.float32),
        "step": step,
        "name": f"run-{step}",
    }


def _template() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(64, 65), "b": torch.zeros(65, dtype=torch.bfloat16)},
        "opt": [torch.zeros(1000, dtype=torch.int64), (torch.zeros(4, 3).t(), 0)],  # a non-contiguous view
        "np": np.zeros(333, dtype=np.float32),
        "step": -1,
        "name": "",
    }


def _tensors(state: Any) -> list[Any]:
    """The array leaves in a fixed order, with their paths."""
    return [
        ("model.w", state["model"]["w"]),
        ("model.b", state["model"]["b"]),
        ("opt.0", state["opt"][0]),
        ("opt.1.0", state["opt"][1][0]),
        ("np", state["np"]),
    ]


def _commit_all(ckpt: Checkpointer, steps: Any, tier: str) -> None:
    for step in steps:
        assert ckpt.save_sync(step, _state(step)).committed_sync(tier, timeout=60), step


def _flip(path: Path, offset: int) -> None:
    flip_bits(path, offset, 0x01)


def _manifest(root: Path, step: int) -> Manifest:
    return Manifest.decode((root / version_dirname(step) / MANIFEST_FILE).read_bytes())


def _corrupt_record(root: Path, step: int, key: str = "['model']['w']") -> None:
    record = next(r for r in _manifest(root, step).records if r.key == key)
    chunk = record.chunks[0]
    _flip(root / version_dirname(step) / record.file, chunk.offset + chunk.stored // 2)


# -- choosing a candidate -------------------------------------------------------------------------------


def test_nothing_stored_restores_none(opened: Opened, tmp_path: Path) -> None:
    ckpt = opened(tier_config(fs_tier("nvme", tmp_path / "nvme")))
    assert ckpt.restore_latest_sync() is None
    assert ckpt.restore_latest_sync(_template()) is None


def test_the_fastest_tier_wins_for_the_same_step(opened: Opened, tmp_path: Path) -> None:
    ckpt = opened(tier_config(fs_tier("nvme", tmp_path / "nvme"), fs_tier("pfs", tmp_path / "pfs")))
    _commit_all(ckpt, [1, 2], "pfs")
    restored = ckpt.restore_latest_sync()
    assert (restored.step, restored.tier) == (2, "ram")
    assert_bitwise(restored.state, _state(2))
    opened.close()

    ckpt = opened(tier_config(fs_tier("nvme", tmp_path / "nvme"), fs_tier("pfs", tmp_path / "pfs")))
    restored = ckpt.restore_latest_sync()
    assert (restored.step, restored.tier) == (2, "nvme")
    assert_bitwise(restored.state, _state(2))


def test_the_newest_step_wins_across_tiers(opened: Opened, tmp_path: Path) -> None:
    nvme, pfs = tmp_path / "nvme", tmp_path / "pfs"
    ckpt = opened(tier_config(fs_tier("nvme", nvme), fs_tier("pfs", pfs, flush={"every_steps": 2})))
    _commit_all(ckpt, [1], "nvme")
    _commit_all(ckpt, [2], "pfs")
    _commit_all(ckpt, [3], "nvme")
    ckpt.wait_sync()
    opened.close()
    assert sorted(os.listdir(pfs)) == [version_dirname(2)]

    def restore() -> Any:
        r = opened(tier_config(fs_tier("nvme", nvme), fs_tier("pfs", pfs))).restore_latest_sync()
        opened.close()
        return r

    r = restore()
    assert (r.step, r.tier) == (3, "nvme")
    assert_bitwise(r.state, _state(3))

    # pfs holds a newer step than nvme: it wins although it is slower.
    lone = opened(tier_config(fs_tier("pfs", pfs)))
    _commit_all(lone, [5], "pfs")
    opened.close()
    r = restore()
    assert (r.step, r.tier) == (5, "pfs")
    assert_bitwise(r.state, _state(5))

    # Step 2 on both: nvme, the faster, is read.
    for step in (3, 5):
        for root in (nvme, pfs):
            if (root / version_dirname(step)).exists():
                os.rename(root / version_dirname(step), root / f".trash-{version_dirname(step)}-x")
    r = restore()
    assert (r.step, r.tier) == (2, "nvme")
    assert_bitwise(r.state, _state(2))


# -- templates --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fresh", [False, True], ids=["from-ram", "from-disk"])
def test_a_template_is_filled_in_place(opened: Opened, tmp_path: Path, fresh: bool) -> None:
    config = tier_config(fs_tier("nvme", tmp_path / "nvme"))
    ckpt = opened(config)
    _commit_all(ckpt, [9], "nvme")
    if fresh:
        opened.close()
        ckpt = opened(config)
    template = _template()
    before = [(path, value, value.data_ptr() if isinstance(value, torch.Tensor) else value.ctypes.data) for path, value in _tensors(template)]
    restored = ckpt.restore_latest_sync(template)
    assert restored.step == 9
    assert restored.tier == ("nvme" if fresh else "ram")
    assert_bitwise(restored.state, _state(9))
    for (path, value, ptr), (_, now) in zip(before, _tensors(restored.state)):
        assert now is value, path  # the template's own objects, filled in place
        assert (now.data_ptr() if isinstance(now, torch.Tensor) else now.ctypes.data) == ptr, path
    assert not restored.state["opt"][1][0].is_contiguous()
    # The template itself now holds the values too.
    assert torch.equal(template["model"]["w"], _state(9)["model"]["w"])
    # Plain values come from the checkpoint, not the template.
    assert (restored.state["step"], restored.state["name"]) == (9, "run-9")


@pytest.mark.parametrize(
    "key, bad, key_text",
    [
        (("model", "w"), torch.zeros(64, 64), "['model']['w']"),
        (("model", "b"), torch.zeros(65, dtype=torch.float32), "['model']['b']"),
        (("opt", 0), torch.zeros(1000, dtype=torch.int32), "['opt'][0]"),
        (("np",), np.zeros(333, dtype=np.float64), "['np']"),
        (("np",), torch.zeros(333), "['np']"),
    ],
)
def test_a_template_mismatch_is_a_restore_error_naming_the_key(
    opened: Opened, tmp_path: Path, key: tuple[Any, ...], bad: Any, key_text: str
) -> None:
    ckpt = opened(tier_config(fs_tier("nvme", tmp_path / "nvme")))
    _commit_all(ckpt, [4], "nvme")
    opened.close()
    ckpt = opened(tier_config(fs_tier("nvme", tmp_path / "nvme")))
    template = _template()
    container = template
    for k in key[:-1]:
        container = container[k]
    container[key[-1]] = bad
    with pytest.raises(RestoreError) as info:
        ckpt.restore_latest_sync(template)
    assert info.value.key == key_text
    assert key_text in str(info.value)
    assert (info.value.tier, info.value.step) == ("nvme", 4)
    # Nothing was half-restored into the template (every array in it, the odd one included, is zeros).
    for path, value in _tensors(template):
        assert not value.any(), path


def test_without_a_template_new_cpu_tensors_are_returned(opened: Opened, tmp_path: Path) -> None:
    ckpt = opened(tier_config(fs_tier("nvme", tmp_path / "nvme")))
    state = _state(3)
    assert ckpt.save_sync(3, state).committed_sync("nvme", timeout=60)
    saved = _state(3)
    restored = ckpt.restore_latest_sync()
    assert restored.tier == "ram"
    assert_bitwise(restored.state, saved)
    for (path, new), (_, original) in zip(_tensors(restored.state), _tensors(state)):
        assert new is not original, path
        if isinstance(new, torch.Tensor):
            assert new.device == torch.device("cpu")
            assert new.data_ptr() != original.data_ptr(), path
    # Independent of the host slot and of the caller's tensors.
    state["model"]["w"].zero_()
    restored.state["opt"][0].fill_(-1)
    again = ckpt.restore_latest_sync()
    assert_bitwise(again.state, saved)


def test_metadata_comes_back(opened: Opened, tmp_path: Path) -> None:
    config = tier_config(fs_tier("nvme", tmp_path / "nvme"))
    ckpt = opened(config)
    metadata = {"lr": 0.001, "tokens": 123456789012, "tags": ["a", "b"], "nested": {"x": None, "y": b"\x00\x01"}}
    assert ckpt.save_sync(6, _state(6), metadata=metadata).committed_sync("nvme", timeout=60)
    assert ckpt.restore_latest_sync().metadata == metadata
    opened.close()
    restored = opened(config).restore_latest_sync()
    assert (restored.tier, restored.metadata) == ("nvme", metadata)
    assert user_metadata(_manifest(tmp_path / "nvme", 6).metadata) == metadata


def test_no_metadata_is_an_empty_dict(opened: Opened, tmp_path: Path) -> None:
    config = tier_config(fs_tier("nvme", tmp_path / "nvme"))
    _commit_all(opened(config), [1], "nvme")
    opened.close()
    assert opened(config).restore_latest_sync().metadata == {}


# -- falling back past damage -------------------------------------------------------------------------------


@pytest.fixture
def two_tiers(opened: Opened, tmp_path: Path) -> tuple[Path, Path, dict[str, Any]]:
    """Steps 1 and 2 committed on nvme and pfs, written by a Checkpointer already closed."""
    nvme, pfs = tmp_path / "nvme", tmp_path / "pfs"
    config = tier_config(fs_tier("nvme", nvme), fs_tier("pfs", pfs))
    _commit_all(opened(config), [1, 2], "pfs")
    opened.close()
    return nvme, pfs, config


def test_a_flipped_byte_on_nvme_falls_back_to_the_same_step_on_pfs(opened: Opened, two_tiers: Any) -> None:
    nvme, pfs, config = two_tiers
    _corrupt_record(nvme, 2)
    with logged_warnings() as record:
        restored = opened(config).restore_latest_sync()
    assert (restored.step, restored.tier) == (2, "pfs")
    assert_bitwise(restored.state, _state(2))
    messages = list(record)
    assert len(messages) == 1, messages
    assert "'nvme'" in messages[0] and "step 2" in messages[0] and "['model']['w']" in messages[0]
    assert "checksum mismatch" in messages[0]


def test_a_fallback_is_one_log_record_naming_its_tier_once_and_no_python_warning(
    opened: Opened, two_tiers: Any, caplog: pytest.LogCaptureFixture
) -> None:
    nvme, pfs, config = two_tiers
    _corrupt_record(nvme, 2)
    for attempt in range(2):  # the second one too: a log is not filtered once per place, as warnings are
        # A new Checkpointer each time: one that found a copy damaged does not read it again.
        ckpt = opened(config)
        caplog.clear()
        with warnings.catch_warnings(record=True) as warned, caplog.at_level(logging.INFO, logger="tierckpt"):
            warnings.simplefilter("always")
            restored = ckpt.restore_latest_sync()
        assert (restored.step, restored.tier) == (2, "pfs"), attempt
        assert [str(w.message) for w in warned] == []  # the log is the one channel
        records = [r for r in caplog.records if r.name == "tierckpt" and "step 2" in r.getMessage()]
        assert [r.levelno for r in records] == [logging.WARNING], [r.getMessage() for r in records]
        message = records[0].getMessage()
        assert message == (
            "tierckpt: step 2 on tier 'nvme' does not verify: data-r00000.bin: checksum mismatch in "
            f"['model']['w'] (chunk 0) at bytes {_chunk_bytes(nvme, 2)}; trying step 2 on tier 'pfs' next"
        ), message
        assert message.count("'nvme'") == 1 and message.count("step 2 on") == 2  # the failed copy, then the next
        ckpt.close_sync()


def test_the_last_candidate_says_none_is_left(opened: Opened, two_tiers: Any) -> None:
    nvme, pfs, config = two_tiers
    for root in (nvme, pfs):
        _corrupt_record(root, 2)
    ckpt = opened(config)
    with logged_warnings() as record, pytest.raises(CorruptCheckpointError) as caught:
        ckpt.restore_sync(2)
    assert len(record) == 2, record
    assert record[0].endswith("; trying step 2 on tier 'pfs' next"), record[0]
    assert record[1].startswith("tierckpt: step 2 on tier 'pfs' does not verify: ") and record[1].count("'pfs'") == 1, record[1]
    assert record[1].endswith("; no other copy of step 2 is left to try") and "next" not in record[1], record[1]
    assert [str(caught.value).count(f"'{tier}'") for tier in ("nvme", "pfs")] == [1, 1], str(caught.value)

    for root in (nvme, pfs):
        _corrupt_record(root, 1)
    ckpt.close_sync()
    ckpt = opened(config)  # a new one: this one knows the copies of step 2 are damaged, and skips them
    with logged_warnings() as record:
        assert ckpt.restore_latest_sync() is None
    assert [m.split(" does not verify")[0] for m in record] == [
        "tierckpt: step 2 on tier 'nvme'", "tierckpt: step 2 on tier 'pfs'", "tierckpt: step 1 on tier 'nvme'", "tierckpt: step 1 on tier 'pfs'",
    ]
    assert [m.rsplit("; ", 1)[1] for m in record] == [
        "trying step 2 on tier 'pfs' next", "trying step 1 on tier 'nvme' next", "trying step 1 on tier 'pfs' next",
        "no other version is left to try",
    ]


def _chunk_bytes(root: Path, step: int, key: str = "['model']['w']") -> str:
    chunk = next(r for r in _manifest(root, step).records if r.key == key).chunks[0]
    return f"{chunk.offset}..{chunk.offset + chunk.stored}"


def test_a_flipped_byte_in_every_copy_falls_back_to_an_older_step(opened: Opened, two_tiers: Any) -> None:
    nvme, pfs, config = two_tiers
    _corrupt_record(nvme, 2, "['opt'][0]")
    _corrupt_record(pfs, 2, "['np']")
    template = _template()
    with logged_warnings() as record:
        restored = opened(config).restore_latest_sync(template)
    assert (restored.step, restored.tier) == (1, "nvme")
    assert_bitwise(restored.state, _state(1))
    assert restored.state["model"]["w"] is template["model"]["w"]
    messages = list(record)
    assert len(messages) == 2, messages
    assert "'nvme'" in messages[0] and "['opt'][0]" in messages[0]
    assert "'pfs'" in messages[1] and "['np']" in messages[1]


# -- restore(step): one step, never another ---------------------------------------------------------------


def test_restore_of_a_step_loads_that_step_from_the_fastest_tier_holding_it(opened: Opened, tmp_path: Path) -> None:
    config = tier_config(fs_tier("nvme", tmp_path / "nvme"), fs_tier("pfs", tmp_path / "pfs"), snapshots=1)
    ckpt = opened(config)
    _commit_all(ckpt, [1, 2, 3], "pfs")
    held = {(v.tier, v.step) for v in ckpt.versions()}
    assert {("ram", 3), ("nvme", 1), ("nvme", 2), ("pfs", 1)} <= held  # enough to choose a step
    newest = ckpt.restore_sync(3)
    assert (newest.step, newest.tier) == (3, "ram")
    template = _template()
    older = ckpt.restore_sync(1, template)
    assert (older.step, older.tier) == (1, "nvme")  # not ram, which holds only step 3
    assert_bitwise(older.state, _state(1))
    assert older.state["model"]["w"] is template["model"]["w"]
    named = ckpt.restore_sync(2, tier="pfs")
    assert (named.step, named.tier) == (2, "pfs")
    assert_bitwise(named.state, _state(2))
    opened.close()

    restored = asyncio.run(_restore_async(opened(config), 2))  # the coroutine, in a new process' shape
    assert (restored.step, restored.tier) == (2, "nvme")
    assert_bitwise(restored.state, _state(2))


async def _restore_async(ckpt: Checkpointer, step: int) -> Any:
    return await ckpt.restore(step, _template())


def test_restore_of_a_step_no_tier_holds_names_what_each_tier_holds(opened: Opened, tmp_path: Path) -> None:
    ckpt = opened(tier_config(fs_tier("nvme", tmp_path / "nvme"), fs_tier("pfs", tmp_path / "pfs", flush={"every_steps": 2})))
    _commit_all(ckpt, [1, 2, 3], "nvme")
    ckpt.wait_sync()
    template = _template()
    with pytest.raises(NoCheckpointError, match=r"no tier holds step 5 \(ram: .*3; nvme: 1, 2, 3; pfs: 2\)") as caught:
        ckpt.restore_sync(5, template)
    assert isinstance(caught.value, FileNotFoundError) and caught.value.step == 5
    assert_bitwise(template, _template())  # untouched
    with pytest.raises(NoCheckpointError, match=r"no tier holds step 3 \(ram: .*; nvme: 1, 2, 3; pfs: 2\)"):
        ckpt.restore_sync(3, tier="pfs")  # on nvme, but not on the tier named
    with pytest.raises(ConfigError, match=r"restore\(tier='s3'\): there is no such tier \(the tiers are ram, nvme, pfs\)"):
        ckpt.restore_sync(2, tier="s3")
    with pytest.raises(ValueError, match="step must be an int from 0 to 999999999999, got -1"):
        ckpt.restore_sync(-1)
    with pytest.raises(TypeError, match="step must be an int from 0 to 999999999999, got '2'"):
        ckpt.restore_sync("2")  # type: ignore[arg-type]


def test_save_and_restore_check_a_step_alike(opened: Opened, tmp_path: Path) -> None:
    # One check for both (format.layout.checked_step): not an int is a TypeError, an int that no
    # version directory's 12 digits can name is a ValueError, and either names the range.
    ckpt = opened(tier_config(fs_tier("nvme", tmp_path / "nvme")))
    bad: list[tuple[Any, type[Exception]]] = [(-1, ValueError), (10**12, ValueError), ("2", TypeError), (True, TypeError), (2.0, TypeError)]
    for step, error in bad:
        with pytest.raises(error, match=rf"step must be an int from 0 to 999999999999, got {re.escape(repr(step))}$"):
            ckpt.save_sync(step, _state(1))
        with pytest.raises(error, match=rf"step must be an int from 0 to 999999999999, got {re.escape(repr(step))}$"):
            ckpt.restore_sync(step)
    assert ckpt.versions() == []  # nothing was saved


def test_restore_of_a_step_falls_back_across_tiers_but_never_to_another_step(opened: Opened, two_tiers: Any) -> None:
    nvme, pfs, config = two_tiers
    _corrupt_record(nvme, 2)
    ckpt = opened(config)
    with logged_warnings(match="step 2 on tier 'nvme' does not verify"):
        restored = ckpt.restore_sync(2)
    assert (restored.step, restored.tier) == (2, "pfs")
    assert_bitwise(restored.state, _state(2))

    _corrupt_record(pfs, 2, "['np']")
    template = _template()
    with logged_warnings() as warned, pytest.raises(CorruptCheckpointError) as caught:
        ckpt.restore_sync(2, template, verify_first=True)
    assert len(warned) == 2
    message = str(caught.value)
    assert message.startswith("step 2: no copy verifies (tier 'nvme': ") and "tier 'pfs': " in message and "['np']" in message, message
    assert "overwritten" not in message and caught.value.step == 2
    assert_bitwise(template, _template())  # step 1 verifies, but it was not asked for
    assert ckpt.restore_sync(1).step == 1

    # Without verify_first the copies that failed wrote what verified of theirs into the template: said so.
    with logged_warnings(match="does not verify"), pytest.raises(CorruptCheckpointError, match="template was partly overwritten") as caught:
        ckpt.restore_sync(2, template)
    assert "verify_first=True" in str(caught.value)


def test_a_missing_data_file_falls_back(opened: Opened, two_tiers: Any) -> None:
    nvme, pfs, config = two_tiers
    os.unlink(nvme / version_dirname(2) / "data-r00000.bin")
    with logged_warnings(match=r"step 2 on tier 'nvme'.*data file data-r00000\.bin is missing"):
        restored = opened(config).restore_latest_sync()
    assert (restored.step, restored.tier) == (2, "pfs")
    assert_bitwise(restored.state, _state(2))
    opened.close()

    os.unlink(pfs / version_dirname(2) / "data-r00000.bin")
    with logged_warnings(match="is missing"):
        restored = opened(config).restore_latest_sync()
    assert (restored.step, restored.tier) == (1, "nvme")
    assert_bitwise(restored.state, _state(1))


def test_a_truncated_data_file_falls_back(opened: Opened, two_tiers: Any) -> None:
    nvme, pfs, config = two_tiers
    data = nvme / version_dirname(2) / "data-r00000.bin"
    os.truncate(data, data.stat().st_size // 2)
    with logged_warnings(match=r"step 2 on tier 'nvme'"):
        restored = opened(config).restore_latest_sync()
    assert (restored.step, restored.tier) == (2, "pfs")
    assert_bitwise(restored.state, _state(2))


def _rewrite_version(root: Path, step: int, version: int) -> None:
    path = root / version_dirname(step) / MANIFEST_FILE
    body = msgpack.unpackb(msgpack.unpackb(path.read_bytes())["body"], strict_map_key=False)
    body["version"] = version
    raw = msgpack.packb(body, use_bin_type=True)
    path.write_bytes(msgpack.packb({"body": raw, CHECKSUM_ALGORITHM: checksum(raw)}, use_bin_type=True))


def test_an_unknown_format_version_is_skipped_with_a_warning(opened: Opened, two_tiers: Any) -> None:
    nvme, pfs, config = two_tiers
    _rewrite_version(nvme, 2, 1000)  # far past any version this code reads
    with logged_warnings(match=r"step 2 on tier 'nvme'.*format version 1000 is not supported"):
        restored = opened(config).restore_latest_sync()
    assert (restored.step, restored.tier) == (2, "pfs")
    opened.close()

    _rewrite_version(pfs, 2, 99)
    with logged_warnings() as record:
        restored = opened(config).restore_latest_sync()
    assert (restored.step, restored.tier) == (1, "nvme")
    assert_bitwise(restored.state, _state(1))
    assert any("format version 99" in m for m in record)
    assert (nvme / version_dirname(2)).is_dir() and (pfs / version_dirname(2)).is_dir()  # kept, not deleted


def _every_copy_damaged(two_tiers: Any) -> dict[str, Any]:
    """Steps 1 and 2 damaged (``['np']``) on both tiers; returns the config."""
    nvme, pfs, config = two_tiers
    for root in (nvme, pfs):
        for step in (1, 2):
            _corrupt_record(root, step, "['np']")
    return config


def test_with_verify_first_a_failed_candidate_leaves_the_template_untouched_until_one_verifies(opened: Opened, two_tiers: Any) -> None:
    config = _every_copy_damaged(two_tiers)
    template = _template()
    with logged_warnings(match="does not verify"):
        assert opened(config).restore_latest_sync(template, verify_first=True) is None
    for path, value in _tensors(template):
        assert not value.any(), path  # a failed attempt never leaves a half-restored model behind


def test_a_damaged_chunk_never_lands_in_the_template_and_no_version_verifying_is_an_error(opened: Opened, two_tiers: Any) -> None:
    config = _every_copy_damaged(two_tiers)
    template = _template()
    with logged_warnings(match="does not verify"), pytest.raises(CorruptCheckpointError, match="no version verifies") as caught:
        opened(config).restore_latest_sync(template)  # not None: the template is no longer the one passed in
    assert "template was partly overwritten" in str(caught.value) and "['model']['w']" in str(caught.value)
    assert not template["np"].any()  # each chunk is verified before it lands: the damaged one never did
    assert template["model"]["w"].any()  # what verified of the last candidate (step 1 on pfs) did


def test_a_fallback_overwrites_what_a_failed_candidate_wrote(opened: Opened, two_tiers: Any) -> None:
    nvme, pfs, config = two_tiers
    for root in (nvme, pfs):
        _corrupt_record(root, 2, "['np']")
    template = _template()
    with logged_warnings(match="does not verify"):
        restored = opened(config).restore_latest_sync(template)
    assert (restored.step, restored.tier) == (1, "nvme")
    assert_bitwise(restored.state, _state(1))
    assert restored.state["model"]["w"] is template["model"]["w"]
    for (path, got), (_, want) in zip(_tensors(template), _tensors(_state(1))):
        assert bitwise_equal(got, want), path  # every byte step 2 wrote was written again


def test_a_fallback_lacking_a_tensor_a_failed_candidate_wrote_is_an_error(opened: Opened, tmp_path: Path) -> None:
    nvme = tmp_path / "nvme"
    with Checkpointer(tier_config(fs_tier("nvme", nvme))) as ckpt:
        assert ckpt.save_sync(1, {"a": torch.ones(1000), "b": torch.ones(10)}).committed_sync("nvme", timeout=60)
        assert ckpt.save_sync(2, {"a": torch.full((1000,), 2.0), "b": torch.full((10,), 2.0), "x": torch.full((500,), 2.0)}).committed_sync("nvme", timeout=60)
    _corrupt_record(nvme, 2, "['b']")
    config = tier_config(fs_tier("nvme", nvme))
    template = {"a": torch.zeros(1000), "b": torch.zeros(10), "x": torch.zeros(500)}
    ckpt = opened(config)
    with logged_warnings(match="does not verify"), pytest.raises(RestoreError, match=r"lacks template tensors .*\['x'\]") as caught:
        ckpt.restore_latest_sync(template, strict=False)
    assert caught.value.step == 1
    # With verify_first, step 1 loads, and x is left as it was: a missing key, as strict=False allows.
    # (A new Checkpointer: this one does not read the copy it found damaged again.)
    ckpt.close_sync()
    ckpt = opened(config)
    template = {"a": torch.zeros(1000), "b": torch.zeros(10), "x": torch.zeros(500)}
    with logged_warnings(match="does not verify"):
        restored = ckpt.restore_latest_sync(template, strict=False, verify_first=True)
    assert restored.step == 1 and restored.missing_keys == ("['x']",)
    assert not template["x"].any() and torch.equal(template["a"], torch.ones(1000))


# -- staging in the host pool --------------------------------------------------------------------------------
# With verify_first, a template restore from a disk stages the bytes in free host slots when they fit,
# lent by MemoryTier.borrow for the load; else in a fresh mapping.

MiB = 1 << 20


class _GatedReads(FilesystemTier):
    """A filesystem tier whose restores wait at their first chunk until the test opens ``gate``."""

    def __init__(self, config: TierConfig) -> None:
        super().__init__(config)
        self.gate = threading.Event()
        self.reading = threading.Event()

    async def read(self, step: int) -> VersionSource:
        source = await super().read(step)
        read_logical = source.read_logical

        def gated(*args: Any, **kwargs: Any) -> None:
            self.reading.set()
            if not self.gate.wait(60):
                raise TimeoutError("the test never opened the gate")
            read_logical(*args, **kwargs)

        source.read_logical = gated  # type: ignore[method-assign]
        return source


def _host(capacity: str, snapshots: int, on_full: str = "block") -> dict[str, Any]:
    return {"capacity": capacity, "snapshots": snapshots, "on_full": on_full}


def _gated(opened: Opened, config: dict[str, Any]) -> tuple[Checkpointer, _GatedReads]:
    tiers: list[_GatedReads] = []

    def factory(cfg: TierConfig) -> _GatedReads | None:
        if cfg.name != "nvme":
            return None
        tiers.append(_GatedReads(cfg))
        return tiers[-1]

    ckpt = opened(config, tier_factory=factory)
    opened.gates.append(tiers[0].gate)
    return ckpt, tiers[0]


def _slots(ckpt: Checkpointer) -> tuple[list[int], list[int], int]:
    """(lent slot indices, free slot indices, loans so far), read on the engine thread."""
    slots = host_slots(ckpt)
    return slots.lent, slots.free, slots.loans


def _waiting_saves(ckpt: Checkpointer) -> int:
    """Saves waiting for a host slot now (on_full: block), read on the engine thread."""
    return host_slots(ckpt).waiting_saves


class _Background:
    """A call on a worker thread, for what blocks until the test opens a gate."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()

        def run() -> None:
            try:
                self.result = fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised by get()
                self.error = exc
            finally:
                self.done.set()

        threading.Thread(target=run, daemon=True).start()

    def get(self, timeout: float = 60) -> Any:
        assert self.done.wait(timeout)
        if self.error is not None:
            raise self.error
        return self.result


def _written(tmp_path: Path, steps: Any = (9,), host: dict[str, Any] | None = None, state: Callable[[int], Any] = _state) -> Path:
    """``steps`` committed on nvme by a Checkpointer that is closed again."""
    nvme = tmp_path / "nvme"
    with Checkpointer(tier_config(fs_tier("nvme", nvme), **(host or _host("8MiB", 2)))) as ckpt:
        for step in steps:
            assert ckpt.save_sync(step, state(step)).committed_sync("nvme", timeout=60)
    return nvme


def _restore_config(nvme: Path, host: dict[str, Any]) -> dict[str, Any]:
    return tier_config(fs_tier("nvme", nvme), **host)


def test_a_template_restore_stages_in_a_free_host_slot_and_gives_it_back(opened: Opened, tmp_path: Path) -> None:
    nvme = _written(tmp_path)
    ckpt, tier = _gated(opened, _restore_config(nvme, _host("8MiB", 2)))
    assert _slots(ckpt) == ([], [0, 1], 0)
    template = _template()
    restoring = _Background(lambda: ckpt.restore_latest_sync(template, verify_first=True))
    assert tier.reading.wait(30)
    lent, free, loans = _slots(ckpt)
    assert (len(lent), len(free), loans) == (1, 1, 1)  # one 4 MiB slot holds the whole staged state

    # A save meanwhile gets the other slot, and its bytes are its own.
    handle = ckpt.save_sync(10, _state(10))
    assert handle.captured_sync(timeout=30) and not handle.skipped
    assert _slots(ckpt)[:2] == (lent, [])
    assert not template["model"]["w"].any()  # nothing reaches the template before the version verified
    tier.gate.set()
    restored = restoring.get()
    assert (restored.step, restored.tier) == (9, "nvme")
    assert_bitwise(restored.state, _state(9))
    assert restored.state["model"]["w"] is template["model"]["w"]
    assert _slots(ckpt) == ([], lent, 1)  # the lent slot is free again; step 10 holds the other

    # The staged bytes went through that very slot (the first staged record sits at its start).
    memory = pipeline_of(ckpt).memory
    w = _state(9)["model"]["w"]
    slot = memory.pool.slots[lent[0]]
    assert bytes(memory.pool.view(slot, 0, w.numel() * 4)) == w.numpy().tobytes()

    # And the save made meanwhile restores from host memory, intact.
    again = ckpt.restore_latest_sync(_template())
    assert (again.step, again.tier) == (10, "ram")
    assert_bitwise(again.state, _state(10))


@pytest.mark.parametrize("on_full", ["block", "skip", "evict"])
def test_a_save_while_a_restore_borrows_the_only_slot_follows_on_full(opened: Opened, tmp_path: Path, on_full: str) -> None:
    nvme = _written(tmp_path)
    ckpt, tier = _gated(opened, _restore_config(nvme, _host("4MiB", 1, on_full)))
    template = _template()
    restoring = _Background(lambda: ckpt.restore_latest_sync(template, verify_first=True))
    assert tier.reading.wait(30)
    assert _slots(ckpt) == ([0], [], 1)
    if on_full == "block":
        saving = _Background(lambda: ckpt.save_sync(10, _state(10)))
        # Waits for the slot, as for a snapshot being read: counted as waiting, and so not done (a save
        # that took no slot or some other would end without ever being counted, however slow the machine).
        assert until(lambda: _waiting_saves(ckpt) or saving.done.is_set(), 30)
        assert _waiting_saves(ckpt) == 1 and not saving.done.is_set()
        tier.gate.set()
        handle = saving.get()
        assert handle.captured_sync(timeout=30) and not handle.skipped
    else:
        # skip, and evict, which never drops what is being read: the save is skipped.
        handle = ckpt.save_sync(10, _state(10))
        assert handle.skipped and not handle.captured_sync(timeout=30)
        assert ckpt.counters.skipped_saves == 1
        tier.gate.set()
    assert_bitwise(restoring.get().state, _state(9))
    assert template["model"]["w"] is restoring.get().state["model"]["w"]
    # The slot came back: the next save takes it.
    handle = ckpt.save_sync(11, _state(11))
    assert handle.captured_sync(timeout=30) and not handle.skipped
    restored = ckpt.restore_latest_sync()
    assert (restored.step, restored.tier) == (11, "ram")


def test_verification_failing_while_staged_in_the_pool_leaves_the_template_untouched(opened: Opened, two_tiers: Any) -> None:
    nvme, pfs, config = two_tiers
    for root in (nvme, pfs):
        _corrupt_record(root, 2, "['np']")
    ckpt = opened(config)
    template = _template()
    # Step 2 on nvme, then on pfs: both staged in the pool and failing; step 1 on nvme verifies.
    with logged_warnings(match="does not verify"):
        restored = ckpt.restore_latest_sync(template, verify_first=True)
    assert (restored.step, restored.tier) == (1, "nvme")
    assert_bitwise(restored.state, _state(1))
    assert _slots(ckpt) == ([], [0, 1], 3)

    for root in (nvme, pfs):
        _corrupt_record(root, 1, "['np']")
    template = _template()
    with logged_warnings(match="does not verify"):
        assert ckpt.restore_latest_sync(template, verify_first=True) is None
    # Every candidate was staged in the pool, and failed: step 1's two copies (this Checkpointer knows
    # step 2's are damaged, and did not read them again).
    assert _slots(ckpt) == ([], [0, 1], 3 + 2)
    for path, value in _tensors(template):
        assert not value.any(), path


def _big(step: int) -> dict[str, Any]:
    """2.5 MiB: more than a 1 MiB slot, less than three."""
    g = torch.Generator().manual_seed(step)
    return {"a": torch.randn(3 * MiB // 8, generator=g), "b": torch.randn(MiB // 2, generator=g).to(torch.float16), "step": step}


def _big_template() -> dict[str, Any]:
    return {"a": torch.zeros(3 * MiB // 8), "b": torch.zeros(MiB // 2, dtype=torch.float16), "step": -1}


def _assert_big(state: dict[str, Any], step: int) -> None:
    want = _big(step)
    assert state["step"] == step
    assert torch.equal(state["a"], want["a"]) and torch.equal(state["b"], want["b"])


def test_a_staged_state_larger_than_a_slot_spans_adjacent_free_slots(opened: Opened, tmp_path: Path) -> None:
    nvme = _written(tmp_path, host=_host("8MiB", 2), state=_big)
    ckpt, tier = _gated(opened, _restore_config(nvme, _host("4MiB", 4)))
    template = _big_template()
    restoring = _Background(lambda: ckpt.restore_latest_sync(template, verify_first=True))
    assert tier.reading.wait(30)
    lent, free, loans = _slots(ckpt)
    assert (lent, loans) == ([0, 1, 2], 1) and free == [3]
    tier.gate.set()
    restored = restoring.get()
    _assert_big(restored.state, 9)
    assert restored.state["a"] is template["a"]
    assert _slots(ckpt) == ([], [0, 1, 2, 3], 1)


def test_a_staged_state_that_fits_no_free_slots_falls_back_to_new_memory(opened: Opened, tmp_path: Path) -> None:
    nvme = _written(tmp_path, host=_host("8MiB", 2), state=_big)
    # Two 1 MiB slots: 2 MiB in all, too small for 2.5 MiB.
    ckpt, tier = _gated(opened, _restore_config(nvme, _host("2MiB", 2)))
    template = _big_template()
    restoring = _Background(lambda: ckpt.restore_latest_sync(template, verify_first=True))
    assert tier.reading.wait(30)
    assert _slots(ckpt) == ([], [0, 1], 0)  # nothing lent: staged in new memory
    tier.gate.set()
    restored = restoring.get()
    _assert_big(restored.state, 9)
    assert restored.state["a"] is template["a"]
    assert _slots(ckpt) == ([], [0, 1], 0)


def test_borrow_lends_the_fewest_adjacent_free_slots_and_takes_them_back() -> None:
    tier = MemoryTier(TierConfig(name="ram", type="memory"), HostPool(4 * MiB, 4))

    def lent() -> list[int]:
        return [s.index for s in tier.lent]

    try:
        with tier.borrow(MiB) as a:
            assert a is not None and a.nbytes == MiB and lent() == [0]
            with tier.borrow(MiB + 1) as b:  # two adjacent slots, as one view
                assert b is not None and b.nbytes == 2 * MiB and lent() == [0, 1, 2]
                b[-1] = 7  # writable, and really the pool's bytes
                assert tier.pool.view(tier.pool.slots[2], MiB - 1, 1)[0] == 7
                with tier.borrow(MiB) as c:
                    assert c is not None and lent() == [0, 1, 2, 3] and not free_slots(tier)
                    with tier.borrow(1) as d:
                        assert d is None  # nothing free: no loan
            assert lent() == [0]
        assert lent() == [] and len(free_slots(tier)) == 4

        # Slots 0 and 2 free, 1 and 3 lent: two free slots, but not adjacent.
        loans = [tier.borrow(MiB) for _ in range(4)]
        for loan in loans:
            loan.__enter__()
        loans[0].__exit__(None, None, None)
        loans[2].__exit__(None, None, None)
        assert lent() == [1, 3]
        with tier.borrow(MiB + 1) as e:
            assert e is None
        with tier.borrow(MiB) as f:
            assert f is not None and sorted(lent()) == [0, 1, 3]
        loans[1].__exit__(None, None, None)
        with tier.borrow(3 * MiB) as g:  # 0, 1, 2 now adjacent and free
            assert g is not None and sorted(lent()) == [0, 1, 2, 3]
        loans[3].__exit__(None, None, None)

        # Given back on an error too.
        with pytest.raises(ZeroDivisionError):
            with tier.borrow(4 * MiB) as h:
                assert h is not None and len(tier.lent) == 4
                1 / 0
        assert tier.lent == [] and len(free_slots(tier)) == 4
        assert tier.loans == 10  # a, b, c, the four, f, g, h: those that got slots
    finally:
        tier.pool.close()


async def test_a_cancelled_restore_keeps_the_slot_lent_until_its_reads_are_over(opened: Opened, tmp_path: Path) -> None:
    nvme = _written(tmp_path)
    ckpt, tier = _gated(opened, _restore_config(nvme, _host("8MiB", 2)))
    task = asyncio.ensure_future(ckpt.restore_latest(_template(), verify_first=True))
    assert await asyncio.to_thread(tier.reading.wait, 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The cancellation was handed to the engine's loop before this loop ended the task, so the engine
    # runs _slots' read after the restore took it (a restore that gave the slot back on the
    # cancellation would have given it back by then): the reader threads still write into it.
    assert len((await asyncio.to_thread(_slots, ckpt))[0]) == 1
    tier.gate.set()
    deadline = time.monotonic() + 30
    while (await asyncio.to_thread(_slots, ckpt))[0]:
        assert time.monotonic() < deadline, "the lent slot never came back"
        await asyncio.sleep(0.02)
    assert (await asyncio.to_thread(_slots, ckpt))[1:] == ([0, 1], 1)


# -- a new process ------------------------------------------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import sys, numpy as np, torch
    from tierckpt import Checkpointer
    root, expected = sys.argv[1], sys.argv[2]
    config = {"host": {"capacity": "8MiB", "snapshots": 2}, "tiers": [
        {"name": "ram", "type": "memory"},
        {"name": "nvme", "type": "filesystem", "path": root, "flush": {"every_steps": 2}}]}
    with Checkpointer(config) as ckpt:
        assert [v.step for v in ckpt.versions() if v.tier == "ram"] == [], ckpt.versions()
        r = ckpt.restore_latest_sync()
        assert r is not None and r.tier == "nvme", r
        for name in ("w", "b", "i"):
            want = np.load(f"{expected}/{name}.npy")
            got = r.state[name]
            assert got.device.type == "cpu" and got.numpy().dtype == want.dtype, name
            assert got.numpy().tobytes() == want.tobytes(), name
            assert tuple(got.shape) == want.shape, name
        assert r.state["np"].tobytes() == np.load(f"{expected}/np.npy").tobytes()
        assert r.state["step"] == r.step
        print("restored", r.step, r.tier, flush=True)
    """
)


def test_a_new_process_restores_the_newest_durable_version(opened: Opened, tmp_path: Path) -> None:
    root, expected = tmp_path / "nvme", tmp_path / "expected"
    expected.mkdir()
    ckpt = opened(tier_config(fs_tier("nvme", root, flush={"every_steps": 2})))

    def state(step: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(100 + step)
        return {
            "w": torch.randn(200, 301, generator=g),
            "b": torch.randn(77, generator=g).to(torch.float16),
            "i": torch.randint(-(2**40), 2**40, (999,), generator=g),
            "np": np.random.default_rng(step).integers(0, 255, 4097, dtype=np.uint8),
            "step": step,
        }

    for step in (1, 2, 3):
        s = state(step)
        ckpt.save_sync(step, s)
        if step == 2:
            for name in ("w", "b", "i"):
                np.save(expected / f"{name}.npy", s[name].numpy())
            np.save(expected / "np.npy", s["np"])
    ckpt.wait_sync()
    # This process still holds step 3 in memory; only step 2 reached the disk.
    assert (ckpt.restore_latest_sync().step, ckpt.restore_latest_sync().tier) == (3, "ram")
    assert sorted(os.listdir(root)) == [version_dirname(2)]
    ckpt.close_sync()  # one Checkpointer per directory: the new process takes it over

    result = subprocess.run(
        [sys.executable, "-c", _CHILD, str(root), str(expected)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "restored 2 nvme"


def test_a_step_saved_again_comes_back_as_its_newest_save_whichever_tier_holds_it(tmp_path: Path) -> None:
    """A job that went back saves a step again; the slower tier commits the new save first, and the
    process dies before the faster tier replaced its copy (found by the crash campaign: kill 363 of
    seed 21). The restart restores the new save, not the faster tier's earlier one."""
    root = tmp_path / "run"
    config = lambda at: tier_config(fs_tier("nvme", at / "nvme"), fs_tier("pfs", at / "pfs", compression=SHUFFLED_ZSTD))  # noqa: E731
    gated: dict[str, GatedTier] = {}

    def factory(cfg: TierConfig) -> GatedTier | None:
        if cfg.name != "nvme":
            return None
        gated[cfg.name] = GatedTier(cfg)
        return gated[cfg.name]

    first, again = _state(1), _state(2)
    with Checkpointer(config(root), tier_factory=factory) as ckpt:
        nvme = gated["nvme"]
        nvme.gate.set()
        handle = ckpt.save_sync(5, first, metadata={"save": 1})
        assert handle.committed_sync("nvme", timeout=60) and handle.committed_sync("pfs", timeout=60)
        nvme.gate.clear()
        handle = ckpt.save_sync(5, again, metadata={"save": 2})
        assert handle.committed_sync("pfs", timeout=60)
        assert nvme.parked() == 1  # its write of the new save waits at the gate
        killed = tmp_path / "killed"
        shutil.copytree(root, killed, copy_function=os.link)  # what a SIGKILL now would leave
        nvme.gate.set()
    with Checkpointer(config(killed)) as restarted:
        assert [(v.tier, v.step) for v in restarted.versions()] == [("nvme", 5), ("pfs", 5)]
        with logged_warnings() as warned:
            restored = restarted.restore_latest_sync()
        assert restored is not None and restored.tier == "pfs"
        assert_bitwise(restored.state, again)
        assert warned == []
        assert_bitwise(restarted.restore_sync(5).state, again)
        assert restarted.metadata_sync(5) == {"save": 2}
