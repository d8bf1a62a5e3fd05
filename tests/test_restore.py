"""Restore: choosing the candidate, loading into templates, falling back past damage, a new process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Iterator

import msgpack
import numpy as np
import pytest
import torch

from tierckpt import Checkpointer
from tierckpt.errors import RestoreError
from tierckpt.format import CHECKSUM_ALGORITHM, MANIFEST_FILE, Manifest, checksum, version_dirname


def _tier(name: str, path: Path, **extra: Any) -> dict[str, Any]:
    return {"name": name, "type": "filesystem", "path": str(path), **extra}


def _config(*tiers: dict[str, Any]) -> dict[str, Any]:
    return {"host": {"capacity": "8MiB", "snapshots": 2}, "tiers": [{"name": "ram", "type": "memory"}, *tiers]}


class _Opened:
    def __init__(self) -> None:
        self.all: list[Checkpointer] = []

    def __call__(self, config: dict[str, Any]) -> Checkpointer:
        c = Checkpointer(config)
        self.all.append(c)
        return c

    def close(self) -> None:
        for c in self.all:
            c.close_sync()


@pytest.fixture
def opened() -> Iterator[_Opened]:
    o = _Opened()
    try:
        yield o
    finally:
        o.close()


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


def _assert_equal_state(actual: Any, expected: Any) -> None:
    assert list(actual) == list(expected)
    assert list(actual["model"]) == ["w", "b"]
    assert type(actual["opt"]) is list and type(actual["opt"][1]) is tuple
    assert actual["opt"][1][1] == expected["opt"][1][1]
    assert (actual["step"], actual["name"]) == (expected["step"], expected["name"])
    for (path, a), (_, e) in zip(_tensors(actual), _tensors(expected)):
        assert type(a) is type(e), path
        assert (a.dtype, a.shape) == (e.dtype, e.shape), path
        if isinstance(a, torch.Tensor):
            assert a.device.type == "cpu"
            assert torch.equal(a, e), path
        else:
            assert a.tobytes() == e.tobytes(), path


def _commit_all(ckpt: Checkpointer, steps: Any, tier: str) -> None:
    for step in steps:
        assert ckpt.save_sync(step, _state(step)).committed_sync(tier, timeout=60), step


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))


def _manifest(root: Path, step: int) -> Manifest:
    return Manifest.decode((root / version_dirname(step) / MANIFEST_FILE).read_bytes())


def _corrupt_record(root: Path, step: int, key: str = "['model']['w']") -> None:
    record = next(r for r in _manifest(root, step).records if r.key == key)
    chunk = record.chunks[0]
    _flip(root / version_dirname(step) / record.file, chunk.offset + chunk.stored // 2)


# -- choosing a candidate -------------------------------------------------------------------------------


def test_nothing_stored_restores_none(opened: _Opened, tmp_path: Path) -> None:
    ckpt = opened(_config(_tier("nvme", tmp_path / "nvme")))
    assert ckpt.restore_latest_sync() is None
    assert ckpt.restore_latest_sync(_template()) is None


def test_the_fastest_tier_wins_for_the_same_step(opened: _Opened, tmp_path: Path) -> None:
    ckpt = opened(_config(_tier("nvme", tmp_path / "nvme"), _tier("pfs", tmp_path / "pfs")))
    _commit_all(ckpt, [1, 2], "pfs")
    restored = ckpt.restore_latest_sync()
    assert (restored.step, restored.tier) == (2, "ram")
    _assert_equal_state(restored.state, _state(2))
    opened.close()

    ckpt = opened(_config(_tier("nvme", tmp_path / "nvme"), _tier("pfs", tmp_path / "pfs")))
    restored = ckpt.restore_latest_sync()
    assert (restored.step, restored.tier) == (2, "nvme")
    _assert_equal_state(restored.state, _state(2))


def test_the_newest_step_wins_across_tiers(opened: _Opened, tmp_path: Path) -> None:
    nvme, pfs = tmp_path / "nvme", tmp_path / "pfs"
    ckpt = opened(_config(_tier("nvme", nvme), _tier("pfs", pfs, flush={"every_steps": 2})))
    _commit_all(ckpt, [1], "nvme")
    _commit_all(ckpt, [2], "pfs")
    _commit_all(ckpt, [3], "nvme")
    ckpt.wait_sync()
    opened.close()
    assert sorted(os.listdir(pfs)) == [version_dirname(2)]

    def restore() -> Any:
        r = opened(_config(_tier("nvme", nvme), _tier("pfs", pfs))).restore_latest_sync()
        opened.close()
        return r

    r = restore()
    assert (r.step, r.tier) == (3, "nvme")
    _assert_equal_state(r.state, _state(3))

    # pfs holds a newer step than nvme: it wins although it is slower.
    lone = opened(_config(_tier("pfs", pfs)))
    _commit_all(lone, [5], "pfs")
    opened.close()
    r = restore()
    assert (r.step, r.tier) == (5, "pfs")
    _assert_equal_state(r.state, _state(5))

    # Step 2 on both: nvme, the faster, is read.
    for step in (3, 5):
        for root in (nvme, pfs):
            if (root / version_dirname(step)).exists():
                os.rename(root / version_dirname(step), root / f".trash-{version_dirname(step)}-x")
    r = restore()
    assert (r.step, r.tier) == (2, "nvme")
    _assert_equal_state(r.state, _state(2))


# -- templates --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fresh", [False, True], ids=["from-ram", "from-disk"])
def test_a_template_is_filled_in_place(opened: _Opened, tmp_path: Path, fresh: bool) -> None:
    config = _config(_tier("nvme", tmp_path / "nvme"))
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
    _assert_equal_state(restored.state, _state(9))
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
    opened: _Opened, tmp_path: Path, key: tuple[Any, ...], bad: Any, key_text: str
) -> None:
    ckpt = opened(_config(_tier("nvme", tmp_path / "nvme")))
    _commit_all(ckpt, [4], "nvme")
    opened.close()
    ckpt = opened(_config(_tier("nvme", tmp_path / "nvme")))
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


def test_without_a_template_new_cpu_tensors_are_returned(opened: _Opened, tmp_path: Path) -> None:
    ckpt = opened(_config(_tier("nvme", tmp_path / "nvme")))
    state = _state(3)
    assert ckpt.save_sync(3, state).committed_sync("nvme", timeout=60)
    saved = _state(3)
    restored = ckpt.restore_latest_sync()
    assert restored.tier == "ram"
    _assert_equal_state(restored.state, saved)
    for (path, new), (_, original) in zip(_tensors(restored.state), _tensors(state)):
        assert new is not original, path
        if isinstance(new, torch.Tensor):
            assert new.device == torch.device("cpu")
            assert new.data_ptr() != original.data_ptr(), path
    # Independent of the host slot and of the caller's tensors.
    state["model"]["w"].zero_()
    restored.state["opt"][0].fill_(-1)
    again = ckpt.restore_latest_sync()
    _assert_equal_state(again.state, saved)


def test_metadata_comes_back(opened: _Opened, tmp_path: Path) -> None:
    config = _config(_tier("nvme", tmp_path / "nvme"))
    ckpt = opened(config)
    metadata = {"lr": 0.001, "tokens": 123456789012, "tags": ["a", "b"], "nested": {"x": None, "y": b"\x00\x01"}}
    assert ckpt.save_sync(6, _state(6), metadata=metadata).committed_sync("nvme", timeout=60)
    assert ckpt.restore_latest_sync().metadata == metadata
    opened.close()
    restored = opened(config).restore_latest_sync()
    assert (restored.tier, restored.metadata) == ("nvme", metadata)
    assert _manifest(tmp_path / "nvme", 6).metadata == metadata


def test_no_metadata_is_an_empty_dict(opened: _Opened, tmp_path: Path) -> None:
    config = _config(_tier("nvme", tmp_path / "nvme"))
    _commit_all(opened(config), [1], "nvme")
    opened.close()
    assert opened(config).restore_latest_sync().metadata == {}


# -- falling back past damage -------------------------------------------------------------------------------


@pytest.fixture
def two_tiers(opened: _Opened, tmp_path: Path) -> tuple[Path, Path, dict[str, Any]]:
    """Steps 1 and 2 committed on nvme and pfs, written by a Checkpointer already closed."""
    nvme, pfs = tmp_path / "nvme", tmp_path / "pfs"
    config = _config(_tier("nvme", nvme), _tier("pfs", pfs))
    _commit_all(opened(config), [1, 2], "pfs")
    opened.close()
    return nvme, pfs, config


def test_a_flipped_byte_on_nvme_falls_back_to_the_same_step_on_pfs(opened: _Opened, two_tiers: Any) -> None:
    nvme, pfs, config = two_tiers
    _corrupt_record(nvme, 2)
    with pytest.warns(RuntimeWarning) as record:
        restored = opened(config).restore_latest_sync()
    assert (restored.step, restored.tier) == (2, "pfs")
    _assert_equal_state(restored.state, _state(2))
    messages = [str(w.message) for w in record]
    assert len(messages) == 1, messages
    assert "'nvme'" in messages[0] and "step 2" in messages[0] and "['model']['w']" in messages[0]
    assert "checksum mismatch" in messages[0]


def test_a_flipped_byte_in_every_copy_falls_back_to_an_older_step(opened: _Opened, two_tiers: Any) -> None:
    nvme, pfs, config = two_tiers
    _corrupt_record(nvme, 2, "['opt'][0]")
    _corrupt_record(pfs, 2, "['np']")
    template = _template()
    with pytest.warns(RuntimeWarning) as record:
        restored = opened(config).restore_latest_sync(template)
    assert (restored.step, restored.tier) == (1, "nvme")
    _assert_equal_state(restored.state, _state(1))
    assert restored.state["model"]["w"] is template["model"]["w"]
    messages = [str(w.message) for w in record]
    assert len(messages) == 2, messages
    assert "'nvme'" in messages[0] and "['opt'][0]" in messages[0]
    assert "'pfs'" in messages[1] and "['np']" in messages[1]


def test_a_missing_data_file_falls_back(opened: _Opened, two_tiers: Any) -> None:
    nvme, pfs, config = two_tiers
    os.unlink(nvme / version_dirname(2) / "data-r00000.bin")
    with pytest.warns(RuntimeWarning, match=r"step 2 on tier 'nvme'.*data file data-r00000\.bin is missing"):
        restored = opened(config).restore_latest_sync()
    assert (restored.step, restored.tier) == (2, "pfs")
    _assert_equal_state(restored.state, _state(2))
    opened.close()

    os.unlink(pfs / version_dirname(2) / "data-r00000.bin")
    with pytest.warns(RuntimeWarning, match="is missing"):
        restored = opened(config).restore_latest_sync()
    assert (restored.step, restored.tier) == (1, "nvme")
    _assert_equal_state(restored.state, _state(1))


def test_a_truncated_data_file_falls_back(opened: _Opened, two_tiers: Any) -> None:
    nvme, pfs, config = two_tiers
    data = nvme / version_dirname(2) / "data-r00000.bin"
    os.truncate(data, data.stat().st_size // 2)
    with pytest.warns(RuntimeWarning, match=r"step 2 on tier 'nvme'"):
        restored = opened(config).restore_latest_sync()
    assert (restored.step, restored.tier) == (2, "pfs")
    _assert_equal_state(restored.state, _state(2))


def _rewrite_version(root: Path, step: int, version: int) -> None:
    path = root / version_dirname(step) / MANIFEST_FILE
    body = msgpack.unpackb(msgpack.unpackb(path.read_bytes())["body"], strict_map_key=False)
    body["version"] = version
    raw = msgpack.packb(body, use_bin_type=True)
    path.write_bytes(msgpack.packb({"body": raw, CHECKSUM_ALGORITHM: checksum(raw)}, use_bin_type=True))


def test_an_unknown_format_version_is_skipped_with_a_warning(opened: _Opened, two_tiers: Any) -> None:
    nvme, pfs, config = two_tiers
    _rewrite_version(nvme, 2, 1000)  # far past any version this code reads
    with pytest.warns(RuntimeWarning, match=r"step 2 on tier 'nvme'.*format version 1000 is not supported"):
        restored = opened(config).restore_latest_sync()
    assert (restored.step, restored.tier) == (2, "pfs")
    opened.close()

    _rewrite_version(pfs, 2, 99)
    with pytest.warns(RuntimeWarning) as record:
        restored = opened(config).restore_latest_sync()
    assert (restored.step, restored.tier) == (1, "nvme")
    _assert_equal_state(restored.state, _state(1))
    assert any("format version 99" in str(w.message) for w in record)
    assert (nvme / version_dirname(2)).is_dir() and (pfs / version_dirname(2)).is_dir()  # kept, not deleted


def test_a_failed_candidate_leaves_the_template_untouched_until_one_verifies(opened: _Opened, two_tiers: Any) -> None:
    nvme, pfs, config = two_tiers
    for root in (nvme, pfs):
        for step in (1, 2):
            _corrupt_record(root, step, "['np']")
    template = _template()
    with pytest.warns(RuntimeWarning):
        assert opened(config).restore_latest_sync(template) is None
    for path, value in _tensors(template):
        assert not value.any(), path  # a failed attempt never leaves a half-restored model behind


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


def test_a_new_process_restores_the_newest_durable_version(opened: _Opened, tmp_path: Path) -> None:
    root, expected = tmp_path / "nvme", tmp_path / "expected"
    expected.mkdir()
    ckpt = opened(_config(_tier("nvme", root, flush={"every_steps": 2})))

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
