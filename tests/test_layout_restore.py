"""Restoring into a template that differs from the saved state: keys, dtypes, shapes (one process),
the box arithmetic resharding rests on, and the region a DTensor record carries in the format."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierckpt import Checkpointer, CorruptCheckpointError, RestoreError
from tierckpt.format import Chunk, Manifest, Region, TensorRecord
from tierckpt.restore.boxes import copy_boxes, linear_boxes

from helpers import ram_fs


def _config(root: Path) -> dict[str, Any]:
    return ram_fs(root / "disk", name="disk", capacity="16MiB", snapshots=1)


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {"model": {"w": torch.randn(6, 5, generator=g), "b": torch.randn(5, generator=g)}, "step": 4}


def _saved(root: Path) -> None:
    with Checkpointer(_config(root)) as ckpt:
        assert ckpt.save_sync(4, _state()).committed_sync("disk", timeout=60)


def _restore(root: Path, template: Any, **kwargs: Any) -> Any:
    with Checkpointer(_config(root)) as ckpt:  # a new process's view: host memory is empty, the disk holds step 4
        return ckpt.restore_latest_sync(template, **kwargs)


def test_a_template_key_the_checkpoint_lacks_is_an_error_unless_not_strict(tmp_path: Path) -> None:
    _saved(tmp_path)
    template = {"model": {"w": torch.zeros(6, 5), "b": torch.zeros(5), "extra": torch.ones(3)}, "step": 0}
    with pytest.raises(RestoreError, match=r"lacks 1 array\(s\) of the template: \['model'\]\['extra'\].*strict=False"):
        _restore(tmp_path, template)
    assert torch.equal(template["model"]["w"], torch.zeros(6, 5))  # nothing written
    restored = _restore(tmp_path, template, strict=False)
    assert restored.missing_keys == ("['model']['extra']",)
    assert torch.equal(template["model"]["w"], _state()["model"]["w"])
    assert torch.equal(template["model"]["extra"], torch.ones(3))  # left as it was


def test_checkpoint_keys_the_template_lacks_come_back_as_new_tensors(tmp_path: Path) -> None:
    _saved(tmp_path)
    template = {"model": {"w": torch.zeros(6, 5)}, "step": 0}  # like a fresh optimizer: state not there yet
    restored = _restore(tmp_path, template)
    assert restored.unexpected_keys == ("['model']['b']",)
    assert restored.state["model"]["w"] is template["model"]["w"]
    assert torch.equal(restored.state["model"]["b"], _state()["model"]["b"])


def test_a_dtype_differing_from_the_template_is_an_error_naming_the_key_unless_cast(tmp_path: Path) -> None:
    _saved(tmp_path)
    template = {"model": {"w": torch.zeros(6, 5, dtype=torch.bfloat16), "b": torch.zeros(5)}, "step": 0}
    with pytest.raises(RestoreError, match=r"\['model'\]\['w'\].*float32\[6, 5\].*bfloat16.*cast=True"):
        _restore(tmp_path, template)
    assert not template["model"]["w"].any()
    restored = _restore(tmp_path, template, cast=True)
    assert restored.state["model"]["w"] is template["model"]["w"]
    assert torch.equal(template["model"]["w"], _state()["model"]["w"].to(torch.bfloat16))
    assert torch.equal(template["model"]["b"], _state()["model"]["b"])


def test_cast_from_host_memory_in_the_same_process(tmp_path: Path) -> None:
    with Checkpointer(_config(tmp_path)) as ckpt:
        ckpt.save_sync(4, _state()).captured_sync()
        template = {"model": {"w": torch.zeros(6, 5, dtype=torch.float64), "b": torch.zeros(5)}, "step": 0}
        restored = ckpt.restore_latest_sync(template, cast=True)
    assert restored.tier == "ram"
    assert torch.equal(template["model"]["w"], _state()["model"]["w"].to(torch.float64))


def test_a_global_shape_differing_from_the_template_is_an_error_naming_the_key(tmp_path: Path) -> None:
    _saved(tmp_path)
    template = {"model": {"w": torch.zeros(5, 6), "b": torch.zeros(5)}, "step": 0}
    with pytest.raises(RestoreError, match=r"\['model'\]\['w'\].*float32\[6, 5\].*float32\[5, 6\]"):
        _restore(tmp_path, template, cast=True)
    assert not template["model"]["w"].any()


def test_a_region_round_trips_and_one_outside_its_tensor_is_refused() -> None:
    record = TensorRecord(0, "['w']", "torch", "float32", (3, 4), 48, "data-r00001.bin", "none", 48, (Chunk(0, 48, 7),), region=Region((10, 4), (6, 0)))
    manifest = Manifest(4, 1.0, ["d", [["w", ["T", 0]]]], (record,), world_size=2, rank=1)
    assert Manifest.decode(manifest.encode()).records[0].region == Region((10, 4), (6, 0))
    bad = Manifest(4, 1.0, manifest.skeleton, (TensorRecord(**{**record.__dict__, "region": Region((8, 4), (6, 0))}),), world_size=2, rank=1)
    with pytest.raises(CorruptCheckpointError, match="lies outside its tensor"):
        Manifest.decode(bad.encode())


@st.composite
def _boxes(draw: Any) -> tuple[tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]], int, int]:
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=0, max_size=4)))

    def box() -> tuple[tuple[int, ...], tuple[int, ...]]:
        start = tuple(draw(st.integers(0, d - 1)) for d in shape)
        return start, tuple(draw(st.integers(1, d - s)) for d, s in zip(shape, start))

    piece, target = box(), box()
    itemsize = draw(st.sampled_from([1, 2, 4, 8, 16]))
    chunk = draw(st.integers(1, max(1, math.prod(piece[1]))))
    return shape, piece, target, itemsize, chunk


@settings(max_examples=300, deadline=None)
@given(_boxes())
def test_copying_chunk_by_chunk_gives_the_overlap_of_piece_and_target(case: Any) -> None:
    shape, (p0, pn), (t0, tn), itemsize, chunk = case
    whole = torch.randint(0, 256, (*shape, itemsize), dtype=torch.uint8)
    cut = lambda start, size: tuple(slice(s, s + n) for s, n in zip(start, size))  # noqa: E731
    piece = whole[cut(p0, pn)].contiguous()
    out = torch.zeros((*tn, itemsize), dtype=torch.uint8)
    expected = out.clone()
    lo = [max(a, b) for a, b in zip(p0, t0)]
    hi = [min(a + n, b + m) for a, n, b, m in zip(p0, pn, t0, tn)]
    if all(h > low for low, h in zip(lo, hi)):
        expected[tuple(slice(low - t, h - t) for low, h, t in zip(lo, hi, t0))] = whole[tuple(slice(low, h) for low, h in zip(lo, hi))]
    data, count = piece.reshape(-1).numpy().tobytes(), math.prod(pn)
    for first in range(0, count, chunk):
        stop = min(count, first + chunk)
        copy_boxes(memoryview(bytearray(data[first * itemsize : stop * itemsize])), first, (p0, pn), (t0, tn), memoryview(out.reshape(-1).numpy()), itemsize)
    assert torch.equal(out, expected)
    assert sum(math.prod(size) for _, size in linear_boxes(pn, 0, count)) == count
