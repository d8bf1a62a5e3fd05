"""The write plan (tierckpt.storage.plan): pure decisions of what a rank writes where, no I/O."""

from __future__ import annotations

import dataclasses

import pytest

from tierckpt.format import ALIGN, Chunk, TensorRecord
from tierckpt.storage.plan import WriteItem, WritePlan, owned_chunks, plan_write

_NONE = Chunk(0, 0, -1)


def _record(index: int, nbytes: int, chunk_bytes: int, *, shared: tuple[int, ...] | None = None, dtype: str = "<f4") -> TensorRecord:
    chunks = -(-nbytes // chunk_bytes)
    return TensorRecord(index, f"['t{index}']", "numpy", dtype, (nbytes // 4,), nbytes, "data", "none", chunk_bytes, (_NONE,) * chunks, shared=shared)


def test_raw_layout_keeps_the_slot_offsets_each_record_aligned() -> None:
    records = [_record(0, 3 * 8192, 8192), _record(1, 100, 8192), _record(2, 20_000, 8192)]
    plan = plan_write(records, ["none"] * 3)
    assert plan.raw_layout
    placed = [(i.record, i.chunk, i.offset) for i in plan.items]
    # Record 0: three chunks back to back; record 1 (100 bytes) starts at the next page; record 2
    # after it, one page further.
    assert placed == [(0, 0, 0), (0, 1, 8192), (0, 2, 16384), (1, 0, 24576), (2, 0, 28672), (2, 1, 36864), (2, 2, 45056)]
    assert all(i.offset is not None and i.offset % ALIGN == 0 for i in plan.items)
    assert plan.fixed_bytes == 24576 + ALIGN + 20480 == plan.packed_start
    assert plan.fixed_bytes % ALIGN == 0


def test_raw_layout_packs_records_whose_chunks_are_not_page_multiples_after_the_fixed_area() -> None:
    records = [_record(0, 10_000, 5000), _record(1, 4096, 4096)]
    plan = plan_write(records, ["none", "none"])
    assert [(i.record, i.chunk, i.offset) for i in plan.items] == [(0, 0, None), (0, 1, None), (1, 0, 12288)]
    # Room for record 0 is kept in the layout all the same: record 1 lies where the slot has it.
    assert plan.fixed_bytes == 12288 + 4096
    assert [i.packed for i in plan.items] == [True, True, False]


def test_compressed_items_are_all_packed_in_record_then_chunk_order_from_zero() -> None:
    records = [_record(0, 3 * 8192, 8192), _record(1, 100, 8192, dtype="|u1")]
    plan = plan_write(records, ["zstd+shuffle", "zstd"])
    assert not plan.raw_layout and plan.fixed_bytes == 0 == plan.packed_start
    assert all(i.packed for i in plan.items)
    assert [(i.record, i.chunk) for i in plan.items] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    assert [i.index for i in plan.items] == list(range(4))


def test_each_record_gets_its_codec() -> None:
    records = [_record(0, 8192, 4096), _record(1, 4096, 4096), _record(2, 4096, 4096)]
    plan = plan_write(records, ["zstd+shuffle", "zstd", "zstd"])
    assert plan.codecs == ("zstd+shuffle", "zstd", "zstd")
    assert [i.codec for i in plan.items] == ["zstd+shuffle", "zstd+shuffle", "zstd", "zstd"]


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_a_rank_writes_only_its_chunks_of_a_shared_record(rank: int) -> None:
    shared = _record(0, 7 * 4096, 4096, shared=(0, 1, 2))
    own = _record(1, 4096, 4096)
    plan = plan_write([shared, own], ["none", "none"], rank=rank)
    mine = [c for c in range(7) if c % 3 == rank]
    assert owned_chunks(shared, rank) == mine
    assert [(i.record, i.chunk) for i in plan.items] == [(0, c) for c in mine] + [(1, 0)]
    # A rank's owned chunks lie back to back: the others' take no room in its file.
    assert [i.offset for i in plan.items if i.record == 0] == [k * 4096 for k in range(len(mine))]
    assert plan.fixed_bytes == len(mine) * 4096 + 4096


def test_every_rank_together_writes_each_shared_chunk_once() -> None:
    shared = _record(0, 10 * 4096 + 17, 4096, shared=(2, 0))
    written = sorted(c for rank in range(3) for i in plan_write([shared], ["zstd"], rank=rank).items for c in [i.chunk])
    assert written == list(range(11))


def test_the_plan_is_frozen_and_pure() -> None:
    records = [_record(0, 8192, 4096)]
    plan = plan_write(records, ["none"])
    assert plan == plan_write(records, ["none"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.items[0].offset = 4  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.fixed_bytes = 0  # type: ignore[misc]
    assert isinstance(plan, WritePlan) and isinstance(plan.items[0], WriteItem)


def test_the_tier_can_keep_a_compressing_version_out_of_the_raw_layout() -> None:
    # A compressing version of only empty records: nothing to lay out, and nothing written with O_DIRECT.
    assert plan_write([], [], raw_layout=False) == WritePlan((), (), False, 0)
    assert plan_write([], []).raw_layout


def test_one_codec_per_record() -> None:
    with pytest.raises(ValueError, match="1 codecs for 2 records"):
        plan_write([_record(0, 4096, 4096), _record(1, 4096, 4096)], ["none"])
