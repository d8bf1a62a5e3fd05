"""Capture on CPU: lazy copies behind the optimizer's pre-hook, exact round trips, slot capacity.

Copies are made deterministic by holding the copy threads (``tierckpt.testing.copies.HeldCopies``): with
``host.copy_threads: 1``, a job that waits at its gate holds the only copy thread, so a save's copies cannot
start until the test lets them.
"""

from __future__ import annotations

import collections
import threading
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch

from tierckpt import CapacityError, Checkpointer
from tierckpt.testing.copies import COPY_PIECE_BYTES, HeldCopies
from tierckpt.testing.inspect import captured_done

from helpers import assert_bitwise, clone, fs_tier, parked, tier_config

DEADLINE_S = 30.0  # a deadlock guard only: every wait below ends on an event long before it


def make_config(tmp_path: Path, *, capacity: str = "8MiB", snapshots: int = 2, copy_threads: int = 2, compressed: bool = False) -> dict[str, Any]:
    tiers = [fs_tier("nvme", tmp_path / "nvme")]
    if compressed:
        tiers.append(fs_tier("pfs", tmp_path / "pfs", compression={"codec": "zstd", "level": 3}))
    return tier_config(*tiers, capacity=capacity, snapshots=snapshots, copy_threads=copy_threads)


def fs_only_config(path: Path) -> dict[str, Any]:
    return {"host": {"capacity": "8MiB", "snapshots": 1}, "tiers": [{"name": "disk", "type": "filesystem", "path": str(path)}]}


@pytest.fixture
def checkpointers() -> Iterator[list[Checkpointer]]:
    """Checkpointers made by a test, closed at its end even when it fails."""
    made: list[Checkpointer] = []
    yield made
    for ckpt in made:
        ckpt.close_sync()


# -- lazy capture --------------------------------------------------------------------------------------


def test_lazy_capture_blocks_the_optimizer_step_until_the_copy_is_done(tmp_path: Path, checkpointers: list[Checkpointer]) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    x = torch.randn(8, 16)

    def forward_backward() -> None:
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()

    forward_backward()
    optimizer.step()  # Adam now has exp_avg / exp_avg_sq to capture too
    ckpt = Checkpointer(make_config(tmp_path, copy_threads=1))
    checkpointers.append(ckpt)
    reached, passed = threading.Event(), threading.Event()
    optimizer.register_step_pre_hook(lambda *_: reached.set())  # runs before the barrier
    ckpt.attach(optimizer)
    optimizer.register_step_pre_hook(lambda *_: passed.set())  # runs after it
    forward_backward()
    before = clone({"model": model.state_dict(), "optim": optimizer.state_dict()})

    with HeldCopies(ckpt, deadline_s=DEADLINE_S) as occupied:
        handle = ckpt.save_sync(1, {"model": model.state_dict(), "optim": optimizer.state_dict()})
        assert captured_done(handle) is False  # save() returned with the copy still to do
        stepper = threading.Thread(target=optimizer.step)
        stepper.start()
        assert reached.wait(DEADLINE_S)
        # Held inside the barrier (a barrier that let it through never parks it: it runs on and ends).
        assert parked(stepper, DEADLINE_S), "optimizer.step() ran past the lazy barrier before the copy"
        assert not passed.is_set()
        assert_bitwise(model.state_dict(), before["model"])  # nothing overwritten yet
        occupied.release()
        stepper.join(DEADLINE_S)
    assert not stepper.is_alive() and passed.is_set()
    assert handle.captured_sync(DEADLINE_S) is True

    live = model.state_dict()
    assert all(not torch.equal(live[k], before["model"][k]) for k in live), "the step did not change the parameters"
    restored = ckpt.restore_latest_sync()
    assert restored is not None and (restored.step, restored.tier) == (1, "ram")
    assert_bitwise(restored.state["model"], before["model"])
    assert_bitwise(restored.state["optim"], before["optim"])
    moments = [s[name] for s in restored.state["optim"]["state"].values() for name in ("exp_avg", "exp_avg_sq")]
    assert len(moments) == 8
    # The flushed copy holds the pre-step values too.
    assert handle.committed_sync("nvme", DEADLINE_S) is True
    ckpt.close_sync()
    with Checkpointer(fs_only_config(tmp_path / "nvme")) as disk:
        on_disk = disk.restore_latest_sync()
    assert on_disk is not None and on_disk.step == 1
    assert_bitwise(on_disk.state, before)


def test_wait_captured_is_the_barrier_for_state_outside_an_optimizer(tmp_path: Path, checkpointers: list[Checkpointer]) -> None:
    ckpt = Checkpointer(make_config(tmp_path, copy_threads=1))
    checkpointers.append(ckpt)
    assert ckpt.wait_captured(timeout=0) is True  # nothing in flight
    ema = torch.arange(1000, dtype=torch.float32)
    expected = ema.clone()
    mutated = threading.Event()

    def update_ema() -> None:
        assert ckpt.wait_captured(DEADLINE_S)
        ema.mul_(0.5).add_(1.0)
        mutated.set()

    with HeldCopies(ckpt, deadline_s=DEADLINE_S) as occupied:
        handle = ckpt.save_sync(1, {"ema": ema})
        assert ckpt.wait_captured(timeout=0.05) is False
        assert not captured_done(handle)
        updater = threading.Thread(target=update_ema)
        updater.start()
        assert parked(updater, DEADLINE_S), "wait_captured() returned before the copy"
        assert not mutated.is_set()
        occupied.release()
        updater.join(DEADLINE_S)
    assert mutated.is_set()
    assert ckpt.wait_captured(timeout=DEADLINE_S) is True
    assert handle.captured_sync(DEADLINE_S) is True
    restored = ckpt.restore_latest_sync()
    assert restored is not None
    assert_bitwise(restored.state["ema"], expected)
    assert not torch.equal(ema, expected)


# -- exact round trips ----------------------------------------------------------------------------------


def rich_state() -> dict[Any, Any]:
    g = torch.Generator().manual_seed(1234)
    base = torch.randn(10, 12, generator=g)
    return {
        "f32": torch.randn(5, 7, generator=g),
        "f64": torch.randn(3, 2, generator=g, dtype=torch.float64),
        "f16_transposed": torch.randn(6, 4, generator=g).half().t(),
        "bf16": torch.randn(33, generator=g).bfloat16(),
        "c64": torch.randn(4, 3, generator=g, dtype=torch.complex64),
        "c64_conj_view": torch.randn(5, generator=g, dtype=torch.complex64).conj(),
        "bool": torch.rand(17, generator=g) > 0.5,
        "i8": torch.randint(-128, 128, (9,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 256, (3, 3), generator=g, dtype=torch.uint8),
        "i16": torch.randint(-1000, 1000, (7,), generator=g, dtype=torch.int16),
        "i32": torch.randint(-(2**31), 2**31 - 1, (5,), generator=g, dtype=torch.int32),
        "i64": torch.tensor([-(2**63), 2**63 - 1, 0, 42]),
        "f32_special": torch.tensor([float("inf"), float("-inf"), -0.0, 1e-45]),
        "zero_d": torch.tensor(3.25),
        "zero_d_int": torch.tensor(-7),
        "empty": torch.empty(0, 3),
        "slice_view": base[2:5, 3:9],  # non-contiguous, with a storage offset
        "row_view": base[4],  # contiguous, with a storage offset
        "expanded": torch.arange(3.0).expand(4, 3),  # stride 0
        "param": torch.nn.Parameter(torch.randn(3, generator=g)),
        "np_f32": np.arange(12, dtype=np.float32).reshape(3, 4),
        "np_i16_transposed": np.arange(20, dtype=np.int16).reshape(4, 5).T,
        "np_bool": np.array([True, False, True]),
        "np_c128": np.array([1 + 2j, -3.5j]),
        "np_u64": np.array([2**64 - 1, 0], dtype=np.uint64),
        "np_big_endian": np.arange(4, dtype=">i4"),
        "np_0d": np.array(7.5),
        "np_scalar_f32": np.float32(2.5),
        "np_scalar_i64": np.int64(-3),
        "int_keys": {1: "one", -2: (3, 4.5, None), 2**40: [b"\x00\xff", True]},
        "tuple": (1, "two", None, (torch.ones(2, dtype=torch.int16),)),
        "str": "h\u00e9llo \u2603",
        "bytes": b"\x00\x01\xfe",
        "none": None,
        "bool_scalar": False,
        "float": 1.5e-300,
        "big_int": 2**70,
        "negative_big_int": -(2**80),
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "ordered": collections.OrderedDict([("z", 1), ("a", torch.zeros(2))]),
        "nested": [{"a": torch.full((2,), 5, dtype=torch.int16)}, [], {}],
        7: "an int key at the root",
    }


def test_rich_state_round_trips_exactly_through_memory_and_filesystem_tiers(tmp_path: Path, checkpointers: list[Checkpointer]) -> None:
    state = rich_state()
    expected = clone(state)
    ckpt = Checkpointer(make_config(tmp_path, compressed=True))
    checkpointers.append(ckpt)
    handle = ckpt.save_sync(11, state, metadata={"note": "rich"})
    assert handle.captured_sync(DEADLINE_S) is True
    from_memory = ckpt.restore_latest_sync()
    assert from_memory is not None and (from_memory.step, from_memory.tier) == (11, "ram")
    assert from_memory.metadata == {"note": "rich"}
    assert_bitwise(from_memory.state, expected)
    ckpt.wait_sync()
    assert handle.committed_sync("nvme", 0) is True and handle.committed_sync("pfs", 0) is True
    ckpt.close_sync()

    # A second Checkpointer on the same directories: its memory tier is empty, so nvme serves it.
    again = Checkpointer(make_config(tmp_path, compressed=True))
    checkpointers.append(again)
    from_disk = again.restore_latest_sync()
    assert from_disk is not None and (from_disk.step, from_disk.tier) == (11, "nvme")
    assert from_disk.metadata == {"note": "rich"}
    assert_bitwise(from_disk.state, expected)
    again.close_sync()
    # ... and the zstd-compressed copy on pfs restores to the same bytes.
    with Checkpointer(fs_only_config(tmp_path / "pfs")) as pfs:
        from_pfs = pfs.restore_latest_sync()
    assert from_pfs is not None and from_pfs.step == 11
    assert_bitwise(from_pfs.state, expected)
    # The live state was read, never modified.
    assert_bitwise(clone(state), expected)


def test_restore_into_a_template_keeps_its_tensors(tmp_path: Path, checkpointers: list[Checkpointer]) -> None:
    state = {"w": torch.randn(4, 5), "n": np.arange(3.0), "step": 3}
    ckpt = Checkpointer(make_config(tmp_path))
    checkpointers.append(ckpt)
    ckpt.save_sync(3, state).captured_sync(DEADLINE_S)
    template = {"w": torch.zeros(4, 5), "n": np.zeros(3), "step": 0}
    w, n = template["w"], template["n"]
    restored = ckpt.restore_latest_sync(template)
    assert restored is not None
    assert restored.state["w"] is w and restored.state["n"] is n
    assert_bitwise(restored.state, state)


# -- capacity -------------------------------------------------------------------------------------------


async def test_a_state_larger_than_a_slot_raises_capacity_error(tmp_path: Path) -> None:
    async with Checkpointer(make_config(tmp_path, capacity="64KiB", snapshots=2)) as ckpt:
        too_big = {"w": torch.zeros(40 * 1024 // 4)}  # 40 KiB > one 32 KiB slot
        for attempt in range(2):
            with pytest.raises(CapacityError) as info:
                if attempt == 0:
                    ckpt.save_sync(5, too_big)
                else:
                    await ckpt.save(5, too_big)
            error = info.value
            assert isinstance(error, ValueError)
            assert "host.capacity" in str(error)
            assert (error.step, error.key) == (5, "host.capacity")
        assert ckpt.versions() == [] and ckpt.counters.saves == 0
        # Nothing was reserved: a state that fits still saves.
        handle = await ckpt.save(6, {"w": torch.ones(1024)})
        assert await handle.committed("nvme") is True


def test_a_state_filling_a_slot_exactly_fits(tmp_path: Path, checkpointers: list[Checkpointer]) -> None:
    ckpt = Checkpointer(make_config(tmp_path, capacity="64KiB", snapshots=2))
    checkpointers.append(ckpt)
    state = {"a": torch.arange(4 * 1024, dtype=torch.int32), "b": torch.arange(4 * 1024, dtype=torch.int32) * -1}
    handle = ckpt.save_sync(1, state)  # 2 x 16 KiB = 32 KiB, exactly one slot
    assert handle.captured_sync(DEADLINE_S) is True
    restored = ckpt.restore_latest_sync()
    assert restored is not None
    assert_bitwise(restored.state, state)


# -- big tensors split across copy threads -------------------------------------------------------------


def test_a_tensor_bigger_than_a_copy_piece_is_captured_bitwise(tmp_path: Path, checkpointers: list[Checkpointer]) -> None:
    n = 70 * 2**20 // 8 + 3  # ~70 MB of int64: more than one 64 MiB piece, and not a whole number of pieces
    base = torch.arange(n + 5, dtype=torch.int64)
    big = base[5:]  # a contiguous view with a storage offset: the pieces must start at the right place
    assert big.numel() * 8 > COPY_PIECE_BYTES
    tail = torch.arange(1000, dtype=torch.float32)
    config = make_config(tmp_path, capacity="80MiB", snapshots=1, copy_threads=2)
    config["tiers"] = config["tiers"][:1]  # memory only: this test is about capture
    ckpt = Checkpointer(config)
    checkpointers.append(ckpt)
    handle = ckpt.save_sync(1, {"big": big, "tail": tail})
    assert handle.captured_sync(DEADLINE_S) is True
    restored = ckpt.restore_latest_sync()
    assert restored is not None
    got = restored.state["big"]
    assert got.dtype == torch.int64 and got.shape == big.shape
    assert torch.equal(got, big)
    assert torch.equal(restored.state["tail"], tail)


def test_inference_tensors_have_no_version_counter_and_round_trip(tmp_path: Path, checkpointers: list[Checkpointer]) -> None:
    with torch.inference_mode():
        ema = torch.arange(1000, dtype=torch.float32) * 0.5  # e.g. weights averaged under inference_mode
    assert ema.is_inference()
    ckpt = Checkpointer(make_config(tmp_path))
    checkpointers.append(ckpt)
    handle = ckpt.save_sync(1, {"ema": ema, "w": torch.ones(3)})
    assert handle.committed_sync("nvme", timeout=DEADLINE_S) is True
    restored = ckpt.restore_latest_sync()
    assert restored is not None and restored.tier == "ram"
    assert_bitwise(restored.state["ema"], ema.clone())


def test_a_state_whose_layout_changes_between_saves_is_laid_out_anew(tmp_path: Path, checkpointers: list[Checkpointer]) -> None:
    # save() reuses the previous slot layout while the state keeps it: every change must be seen.
    ckpt = Checkpointer(make_config(tmp_path))
    checkpointers.append(ckpt)
    states = [
        {"a": torch.arange(4.0), "b": torch.ones(3, dtype=torch.int8)},
        {"a": torch.arange(4.0), "b": torch.ones(3, dtype=torch.int8)},  # same layout, new tensors
        {"a": torch.arange(8.0), "b": torch.ones(3, dtype=torch.int8)},  # a shape changed
        {"a": torch.arange(8.0), "b": torch.ones(3, dtype=torch.int16)},  # a dtype changed
        {"b": torch.ones(3, dtype=torch.int16), "a": torch.arange(8.0)},  # the order changed
        {"a": torch.arange(8.0), "c": torch.ones(3, dtype=torch.int16)},  # a key changed
        {"a": torch.arange(8.0).reshape(2, 4), "c": torch.ones(3, dtype=torch.int16)},  # same bytes, new shape
        {"x": {"a": torch.arange(8.0)}, "c": torch.ones(3, dtype=torch.int16)},  # a tensor moved down a level
        {"y": {"a": torch.arange(8.0)}, "c": torch.ones(3, dtype=torch.int16)},  # ...under another key, its own key kept
        {"y": [torch.arange(8.0)], "c": torch.ones(3, dtype=torch.int16)},  # into a list
        {"y": [np.arange(8.0)], "c": torch.ones(3, dtype=torch.int16)},  # a numpy array of the same bytes
        {"y": [torch.arange(8.0, dtype=torch.float64)], "c": torch.ones(3, dtype=torch.int16)},  # back to torch
    ]
    for step, state in enumerate(states, start=1):
        assert ckpt.save_sync(step, state).captured_sync(DEADLINE_S) is True
        restored = ckpt.restore_latest_sync()
        assert restored is not None and restored.step == step
        assert_bitwise(restored.state, state)


def every_storable_dtype_state(seed: int) -> dict[str, torch.Tensor]:
    """Random bits in a tensor of each storable dtype (sub-byte and float8 ones too), some of them views."""
    from tierckpt.state.dtypes import _STORABLE_TORCH_DTYPES

    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, dtype in sorted(_STORABLE_TORCH_DTYPES.items()):
        raw = torch.randint(0, 256, (7 * 5 * dtype.itemsize,), dtype=torch.uint8, generator=g)
        if dtype is torch.bool:
            raw = raw % 2
        value = raw.view(dtype).reshape(7, 5)
        state[name] = value if len(state) % 3 else value.t()  # every third one transposed: not contiguous
    state["zero_d"] = torch.tensor(float(seed))
    state["empty"] = torch.empty(0, 4)
    return state


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")  # torch warns on complex32; storing it is meant
def test_every_storable_dtype_round_trips_save_after_save(tmp_path: Path, checkpointers: list[Checkpointer]) -> None:
    # The copy threads copy a state's whole tensors in one call, into slot views made once per slot
    # and layout: several saves of one layout, through every slot, each with new values.
    ckpt = Checkpointer(make_config(tmp_path, snapshots=2))
    checkpointers.append(ckpt)
    for step in range(1, 6):
        state = every_storable_dtype_state(step)
        expected = every_storable_dtype_state(step)  # the same bits (clone() has no kernel for sub-byte dtypes)
        assert ckpt.save_sync(step, state).captured_sync(DEADLINE_S) is True
        restored = ckpt.restore_latest_sync()
        assert restored is not None and restored.step == step
        assert_bitwise(restored.state, expected)
    ckpt.wait_sync()
    ckpt.close_sync()
    again = Checkpointer(make_config(tmp_path))
    checkpointers.append(again)
    from_disk = again.restore_latest_sync()
    assert from_disk is not None and (from_disk.step, from_disk.tier) == (5, "nvme")
    assert_bitwise(from_disk.state, every_storable_dtype_state(5))


def test_the_layout_is_planned_again_when_replicated_changes_and_reused_while_it_stays() -> None:
    from tierckpt.snapshot import LayoutCache
    from tierckpt.state import survey

    layouts = LayoutCache((0, 1))  # two ranks: replicated values are shared between them
    state = {"model": {"w": torch.ones(1024)}, "rng": torch.zeros(8, dtype=torch.uint8)}
    first = layouts.entries(survey(state), ["model"])
    assert first is layouts.entries(survey(state), ["model"])  # the same layout: the same plan
    assert [e.shared for e in first[0]][0] is not None and first[0][1].shared is None
    unshared = layouts.entries(survey(state), [])
    assert all(e.shared is None for e in unshared[0])
    again = layouts.entries(survey(state), ["model"])
    assert again[0][0].shared == first[0][0].shared
    with pytest.raises(ValueError, match="replicated"):  # still checked: a typo names no tensor
        layouts.entries(survey(state), ["modle"])


def test_keys_that_compare_equal_but_name_arrays_differently_are_laid_out_anew(tmp_path: Path, checkpointers: list[Checkpointer]) -> None:
    # True == 1 == 1.0: a layout reused on that equality would store the second state's array under
    # the first's key, and a restore into a template (matched by key) would not find it.
    ckpt = Checkpointer(make_config(tmp_path))
    checkpointers.append(ckpt)
    for step, state in enumerate([{True: torch.arange(8.0)}, {1.0: torch.arange(8.0) + 1}], start=1):
        assert ckpt.save_sync(step, state).captured_sync(DEADLINE_S) is True
        template = {key: torch.zeros(8) for key in state}
        restored = ckpt.restore_latest_sync(template)
        assert restored is not None and restored.step == step
        assert_bitwise(restored.state, state)
