"""Progress bars (:mod:`tierckpt.observe.progress`): when one is drawn, what it counts, and the
counts a restore and ``verify_version`` hand to it."""

from __future__ import annotations

import concurrent.futures
import io
import re
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tierckpt import Checkpointer
from tierckpt.cliversions import ListedVersion, held_bytes, verify_bytes, verify_version
from tierckpt.format import DATA_FILE, MANIFEST_FILE, Manifest, version_dirname
from tierckpt.observe import progress
from tierckpt.observe.progress import ENV, _Drawn, format_size, progress_bar
from tierckpt.restore.dispatch import prepare_restore
from tierckpt.restore.plan import plan
from tierckpt.testing import flip_bits
from tierckpt.testing.inspect import pipeline_of, run_on_engine, tier_of, tiers_of

from helpers import SHUFFLED_ZSTD, fs_tier, tier_config

STEP = 5
# The final text of a bar: "<desc>: 100%|<bar>| <done>/<size> [<elapsed><<remaining>, <speed>]".
FINAL = re.compile(r"^(?P<desc>.+): +(?P<percent>\d+)%\|.*\| (?P<done>[^/]+)/(?P<size>[^ ]+ [KMGT]?i?B) \[.*/s\]$")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _small_state() -> dict[str, Any]:
    # 512 bytes in all: under 1 KiB a bar prints the exact count ("512 B"); an empty array counts nothing.
    return {"w": torch.arange(96, dtype=torch.float32), "b": torch.ones(64, dtype=torch.int16), "np": np.arange(0), "step": STEP}


def _final_line(err: str) -> re.Match[str]:
    """The bar's last drawing: what it showed once closed."""
    last = err.rstrip("\n").split("\r")[-1]
    found = FINAL.match(last)
    assert found is not None, repr(err)
    return found


def _saved(nvme: Path, state: dict[str, Any], **nvme_settings: Any) -> None:
    config = {"tiers": [{"name": "ram", "type": "memory"}, fs_tier("nvme", nvme, **nvme_settings)]}
    with Checkpointer(config) as ckpt:
        ckpt.save_sync(STEP, state)
        ckpt.wait_sync()


# -- the bar ------------------------------------------------------------------------------------------


def test_no_bar_when_stderr_is_not_a_terminal(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert not sys.stderr.isatty()
    with progress_bar(1000, "quiet") as bar:
        bar.update(1000)
    assert not bar.enabled
    assert progress_bar(1000, "other") is bar  # one shared no-op, nothing made per call
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("said", [None, "yes"])  # "yes" is no setting: as if unset
def test_a_terminal_gets_a_bar(monkeypatch: pytest.MonkeyPatch, said: str | None) -> None:
    if said is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, said)
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with progress_bar(3 << 20, "copy") as bar:
        bar.update(1 << 20)
        bar.update(2 << 20)
    assert bar.enabled
    final = _final_line(terminal.getvalue())
    assert (final["desc"], final["percent"], final["done"], final["size"]) == ("copy", "100", "3.0 MiB", "3.0 MiB")


def test_a_line_printed_above_a_bar_does_not_run_into_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    terminal, out = Terminal(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", terminal)
    with progress_bar(2048, "verify") as bar:
        bar.update(1024)
        drawn = terminal.getvalue()
        bar.print_above("step-000000000001  OK", file=out)
        # Cleared (spaces over the bar, back to the line's start), then drawn again after the line.
        cleared = terminal.getvalue()[len(drawn):]
        assert cleared.startswith("\r") and cleared.split("\r")[1].strip() == ""
        assert "1.0 KiB/2.0 KiB" in cleared.split("\r")[-1]
    assert out.getvalue() == "step-000000000001  OK\n"
    quiet = progress_bar(2048, "verify", enabled=False)
    quiet.print_above("printed all the same", file=out)
    assert out.getvalue().endswith("printed all the same\n")


def test_TIERCKPT_PROGRESS_0_turns_a_terminal_bar_off_and_1_cannot_turn_a_refused_one_on(monkeypatch: pytest.MonkeyPatch) -> None:
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setenv(ENV, "0")
    assert not progress_bar(100, "off").enabled
    assert not progress_bar(100, "asked for, still off", enabled=True).enabled
    monkeypatch.setenv(ENV, "1")
    assert not progress_bar(100, "another rank's", enabled=False).enabled
    assert not progress_bar(0, "nothing to count").enabled
    assert terminal.getvalue() == ""


def _from_threads(update: Any, threads: int, each: int) -> None:
    """``update(3)`` ``each`` times from each of ``threads`` threads, started together, switching often."""
    start = threading.Barrier(threads)

    def add() -> None:
        start.wait()
        for _ in range(each):
            update(3)

    workers = [threading.Thread(target=add) for _ in range(threads)]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        sys.setswitchinterval(switch)


def test_no_bar_without_tqdm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "1")
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm raises ImportError
    progress._bar_class.cache_clear()
    try:
        bar = progress_bar(100, "no tqdm")
        assert not bar.enabled
    finally:
        progress._bar_class.cache_clear()


def test_updates_from_several_threads_all_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "1")
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    bar: Any = progress_bar(8 * 2000 * 3, "threads")
    _from_threads(bar.update, 8, 2000)
    bar.close()
    assert bar.done == 8 * 2000 * 3


def test_tqdm_is_never_entered_by_two_threads_at_once() -> None:
    class Watching:
        """Stands for tqdm's bar (whose counter and redraw are not guarded): notes any overlap."""

        def __init__(self) -> None:
            self.n, self.inside, self.overlapped = 0, 0, False

        def update(self, n: int) -> None:
            self.inside += 1
            self.overlapped |= self.inside > 1
            for _ in range(20):  # room for another thread to switch in, were it let in
                self.n = int(str(self.n))
            self.n += n
            self.inside -= 1

        def close(self) -> None:
            pass

    watching = Watching()
    bar = _Drawn(watching)
    _from_threads(bar.update, 4, 500)
    assert (watching.overlapped, watching.n) == (False, 4 * 500 * 3)


def test_sizes_are_binary() -> None:
    assert [format_size(n) for n in (0, 1023, 1024, 1536, 5 << 20, 3 << 30, 2 << 40)] == [
        "0 B", "1023 B", "1.0 KiB", "1.5 KiB", "5.0 MiB", "3.0 GiB", "2.0 TiB"
    ]


# -- restore ------------------------------------------------------------------------------------------


def test_a_forced_bar_counts_every_byte_a_restore_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _saved(tmp_path / "nvme", _small_state())
    capsys.readouterr()
    monkeypatch.setenv(ENV, "1")
    with Checkpointer({"tiers": [fs_tier("nvme", tmp_path / "nvme")]}) as ckpt:
        (stored,) = [v.nbytes for v in ckpt.versions() if v.tier == "nvme"]
        restored = ckpt.restore_latest_sync()
    assert restored is not None and restored.step == STEP
    read = sum(t.numel() * t.element_size() for t in (restored.state["w"], restored.state["b"]))
    assert read == stored == 512
    final = _final_line(capsys.readouterr().err)
    assert (final["desc"], final["percent"], final["done"], final["size"]) == (f"restore step {STEP} from nvme", "100", "512 B", "512 B")


@pytest.mark.parametrize("said", [None, "0"])
def test_no_bar_without_a_terminal_or_with_TIERCKPT_PROGRESS_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], said: str | None
) -> None:
    _saved(tmp_path / "nvme", _small_state())
    if said is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, said)
    capsys.readouterr()
    with Checkpointer({"tiers": [fs_tier("nvme", tmp_path / "nvme")]}) as ckpt:
        restored = ckpt.restore_latest_sync()
    assert restored is not None and restored.step == STEP
    assert capsys.readouterr().err == ""


def test_only_rank_0_draws_a_restore_bar(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    class Rank:
        world = 1  # exchanges nothing: only the rank number differs

        def __init__(self, rank: int) -> None:
            self.rank = rank

        def all_gather(self, value: Any) -> list[Any]:
            return [value]

    _saved(tmp_path / "nvme", _small_state())
    monkeypatch.setenv(ENV, "1")
    capsys.readouterr()
    with Checkpointer({"tiers": [fs_tier("nvme", tmp_path / "nvme")]}) as ckpt:
        tiers, memory, events = tiers_of(ckpt), pipeline_of(ckpt).memory, pipeline_of(ckpt).events
        for rank in (1, 0):
            work = prepare_restore(Rank(rank), tiers, memory, events, None, strict=True, cast=False, verify_first=False)
            assert run_on_engine(ckpt, work).step == STEP
            drawn = capsys.readouterr().err
            assert (drawn == "") == (rank == 1), (rank, drawn)


def test_each_chunk_read_is_counted_once_in_stored_bytes(tmp_path: Path) -> None:
    # 33 MiB of a compressible tensor: three chunks, each stored smaller than its 16 MiB.
    state = {"big": torch.zeros(33 << 18, dtype=torch.float32), "small": torch.arange(10), "step": STEP}
    nvme = tmp_path / "nvme"
    with Checkpointer(tier_config(fs_tier("nvme", nvme, compression=SHUFFLED_ZSTD), capacity="80MiB")) as ckpt:
        ckpt.save_sync(STEP, state)
        ckpt.wait_sync()
    manifest = Manifest.decode((nvme / version_dirname(STEP) / MANIFEST_FILE).read_bytes())
    stored = [c.stored for r in manifest.records for c in r.all_chunks()]
    assert len(stored) == 4 and sum(stored) < (33 << 20)
    with Checkpointer({"tiers": [fs_tier("nvme", nvme)]}) as ckpt, concurrent.futures.ThreadPoolExecutor(3) as pool:
        source = run_on_engine(ckpt, tier_of(ckpt, "nvme").read_whole(STEP))
        try:
            planned = plan(source, {})
            seen: list[int] = []
            lock = threading.Lock()

            def count(nbytes: int) -> None:
                with lock:
                    seen.append(nbytes)

            targets = planned.run(source, pool, 3, count)
        finally:
            source.close()
    assert sorted(seen) == sorted(stored)
    assert planned.read_bytes == sum(stored) == manifest.stored_bytes
    assert {t.record.key: t.value.numel() for t in targets}["['big']"] == 33 << 18


# -- verify -------------------------------------------------------------------------------------------


def _two_versions(root: Path) -> list[ListedVersion]:
    nvme = root / "nvme"
    config = tier_config(fs_tier("nvme", nvme, compression=SHUFFLED_ZSTD), capacity="16MiB")
    with Checkpointer(config) as ckpt:
        for step in (1, 2):
            g = torch.Generator().manual_seed(step)
            state = {"w": torch.randn(300, 301, generator=g), "h": torch.ones(20_000, dtype=torch.bfloat16), "i": torch.arange(5000)}
            # Each committed before the next save: else a flush may pass step 1 over for step 2.
            assert ckpt.save_sync(step, state).committed_sync("nvme", timeout=60)
    return [ListedVersion.local(nvme / version_dirname(step), step) for step in (1, 2)]


def test_verify_counts_the_stored_bytes_of_every_version_it_checks(tmp_path: Path) -> None:
    versions = _two_versions(tmp_path)
    totals = []
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for version in versions:
            seen: list[int] = []
            opened, damage = verify_version(version, pool, seen.append)
            assert damage is None and opened is not None
            assert len(seen) == sum(len(r.chunks) for r in opened.logical_records())
            assert sum(seen) == held_bytes(opened.head) > 0
            totals.append(sum(seen))
        # Damaged chunks are read too, and counted.
        assert versions[1].path is not None
        manifest = Manifest.decode((versions[1].path / MANIFEST_FILE).read_bytes())
        flip_bits(versions[1].path / DATA_FILE.format(rank=0), manifest.records[0].chunks[0].offset + 3)
        seen = []
        _, damage = verify_version(versions[1], pool, seen.append)
        assert damage is not None and sum(seen) == totals[1]
    assert verify_bytes(versions) == sum(totals)


def test_a_version_that_does_not_open_counts_nothing(tmp_path: Path) -> None:
    versions = _two_versions(tmp_path)
    assert versions[0].path is not None
    (versions[0].path / MANIFEST_FILE).write_bytes(b"not a manifest")
    seen: list[int] = []
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        opened, damage = verify_version(versions[0], pool, seen.append)
        assert opened is None and damage is not None and seen == []
        opened, _ = verify_version(versions[1], pool, seen.append)
    assert opened is not None
    assert verify_bytes(versions) == sum(seen) == held_bytes(opened.head)
