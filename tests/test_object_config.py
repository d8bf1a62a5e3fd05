"""The object tier's settings, credentials and read grouping, without a server (the tier itself: test_object_tier.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tierckpt.errors import ConfigError
from tierckpt.testing.inspect import held_windows

from helpers import tier_config


@pytest.mark.parametrize(
    ("section", "says"),
    [
        ({}, r"tiers\[1\]\.url.*missing.*s3://bucket/prefix"),
        ({"url": "https://bucket/x"}, r"tiers\[1\]\.url.*not allowed"),
        ({"url": "s3://B/x"}, r"tiers\[1\]\.url.*not allowed"),
        ({"url": "s3://bk1/x", "endpoint": "127.0.0.1:9000"}, r"tiers\[1\]\.endpoint.*http://host:port"),
        ({"url": "s3://bk1/x", "part_size": "1MiB"}, r"tiers\[1\]\.part_size.*5242880"),
        ({"url": "s3://bk1/x", "concurrency": 0}, r"tiers\[1\]\.concurrency"),
        ({"url": "s3://bk1/x", "io_threads": 4}, r"io_threads.*not allowed on an object tier.*concurrency"),
        ({"url": "s3://bk1/x", "path": "/tmp/x"}, r"path.*not allowed on an object tier"),
    ],
)
def test_object_tier_settings_are_checked_when_the_config_is_read(section: dict[str, Any], says: str) -> None:
    from tierckpt.config import Config

    with pytest.raises(ConfigError, match=says):
        Config.from_dict(tier_config({"name": "s3", "type": "object", **section}))


def test_a_filesystem_tier_refuses_object_keys() -> None:
    from tierckpt.config import Config

    with pytest.raises(ConfigError, match=r"url.*not allowed on a filesystem tier.*s3://bucket/prefix"):
        Config.from_dict(tier_config({"name": "nvme", "type": "filesystem", "path": "/tmp/x", "url": "s3://bk1/x"}))


def test_credentials_come_from_the_environment_then_the_profile_files_and_never_the_metadata_service_when_disabled(tmp_path: Path) -> None:
    from tierckpt.storage.s3 import credentials

    assert credentials({"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b"}) == {"access_key_id": "a", "secret_access_key": "b"}
    (tmp_path / "credentials").write_text("[default]\naws_access_key_id = c\naws_secret_access_key = d\n[dev]\naws_access_key_id = e\naws_secret_access_key = f\naws_session_token = t\n")
    files = {"AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "credentials"), "AWS_CONFIG_FILE": str(tmp_path / "none")}
    assert credentials(files) == {"access_key_id": "c", "secret_access_key": "d"}
    assert credentials(files | {"AWS_PROFILE": "dev"}) == {"access_key_id": "e", "secret_access_key": "f", "session_token": "t"}
    empty = {"AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"), "AWS_CONFIG_FILE": str(tmp_path / "none")}
    assert credentials(empty | {"AWS_EC2_METADATA_DISABLED": "true"}) == {"skip_signature": True}  # anonymous
    assert credentials(empty) == {}  # the client's own chain (instance metadata) where it is allowed


def test_neighbouring_chunks_are_grouped_only_when_close_and_up_to_the_group_size() -> None:
    from tierckpt.storage.coalesce import GAP, GROUP, SMALL, Group, group_spans

    k = 4096
    # Neighbours within GAP join; a chunk further away starts a group; a group of one is not one.
    assert group_spans([(0, k), (k, k), (2 * k + GAP, k), (10 * GAP, k)]) == [Group(0, 3 * k + GAP, 3)]
    # Medium chunks join their neighbours too (a round trip each is what grouping saves), up to
    # GROUP bytes; a chunk of GROUP bytes is a GET of its own and neither joins nor splits the others.
    mib = 1 << 20
    assert group_spans([(0, k), (k, 9 * mib), (k + 9 * mib, 3 * mib)]) == [Group(0, k + 12 * mib, 3)]
    assert group_spans([(0, k), (k, GROUP), (k + GROUP, k)]) == []
    # Where only some chunks will be read (a reshard), only chunks under SMALL join: a GET fetches
    # little that nothing reads.
    assert group_spans([(0, k), (k, 9 * mib), (k + 9 * mib, k), (2 * k + 9 * mib, k)], below=SMALL) == [Group(k + 9 * mib, 3 * k + 9 * mib, 2)]
    # Groups stop at GROUP bytes.
    many = [(i * (mib // 2), mib // 2 - 1) for i in range(80)]
    groups = group_spans(many)
    assert all(g.end - g.start <= GROUP for g in groups) and len(groups) == 3
    assert groups[0].start == 0 and groups[-1].end == many[-1][0] + many[-1][1]
    assert sum(g.members for g in groups) == len(many)


class _CountingReader:
    """An in-memory object whose ranged reads are counted (what the coalescing reader asks of a store)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.size, self.direct, self.reads = data, len(data), False, 0

    def read_span(self, offset: int, length: int, scratch: memoryview, *, what: str) -> memoryview:
        self.reads += 1
        return memoryview(self.data)[offset:offset + length]

    def read_into(self, out: memoryview, offset: int, scratch: memoryview, *, what: str) -> None:
        out[:] = self.read_span(offset, out.nbytes, scratch, what=what)

    def close(self) -> None:
        pass


def test_a_group_is_fetched_once_for_its_chunks_and_let_go_after_the_last() -> None:
    import os

    from tierckpt.storage.coalesce import CoalescingReader, group_spans

    data = os.urandom(1 << 20)
    spans = [(0, 1000), (1000, 3000), (8192, 50_000), (600_000, 10)]
    inner = _CountingReader(data)
    reader = CoalescingReader(inner, group_spans(spans))  # type: ignore[arg-type]
    scratch = memoryview(bytearray(0))
    for offset, length in spans[:3]:
        assert bytes(reader.read_span(offset, length, scratch, what="x")) == data[offset:offset + length]
    assert inner.reads == 1 and not held_windows(reader)  # one GET for the three; nothing kept after the last
    out = memoryview(bytearray(10))
    reader.read_into(out, 600_000, scratch, what="x")  # outside any group: its own read
    assert bytes(out) == data[600_000:600_010] and inner.reads == 2
    # Asked for again once let go (a restore falling back to it), a group is fetched again.
    assert bytes(reader.read_span(1000, 3000, scratch, what="x")) == data[1000:4000] and inner.reads == 3


def test_where_every_chunk_is_read_the_object_is_fetched_in_fixed_windows_cut_to_the_chunks() -> None:
    from tierckpt.storage.coalesce import GROUP, Group, window_spans

    mib = 1 << 20
    # The raw client's GETs: [0, 16 MiB), [16, 32 MiB)... whatever the chunk boundaries; a chunk across
    # an edge counts in both windows, one longer than a window in each it touches; each window ends
    # where its last chunk byte does.
    spans = [(0, 14 * mib), (14 * mib, 5 * mib), (19 * mib, 40 * mib), (59 * mib, 100)]
    assert window_spans(spans) == [
        Group(0, GROUP, 2), Group(GROUP, 2 * GROUP, 2), Group(2 * GROUP, 3 * GROUP, 1), Group(3 * GROUP, 59 * mib + 100, 2),
    ]
    # Bytes no chunk holds (the object's tail) are not fetched; an empty chunk is in no window.
    assert window_spans([(4096, 4096), (100, 0)]) == [Group(4096, 8192, 1)]


def test_a_chunk_across_a_window_edge_comes_in_two_pieces_and_each_window_is_fetched_once() -> None:
    import os

    from tierckpt.storage.coalesce import CoalescingReader, window_spans

    window = 1 << 16
    data = os.urandom(4 * window)
    spans = [(0, 40_000), (40_000, 40_000), (80_000, 100_000), (180_000, 20_000)]  # the 2nd and 3rd cross edges
    inner = _CountingReader(data)
    reader = CoalescingReader(inner, window_spans(spans, window), ahead=True)  # type: ignore[arg-type]
    scratch = memoryview(bytearray(200_000))
    pieces = reader.read_pieces(40_000, 40_000, scratch, what="x")
    assert [p.nbytes for p in pieces] == [window - 40_000, 80_000 - window]  # not joined
    assert b"".join(pieces) == data[40_000:80_000]
    # Joined only where one buffer is asked for: in the caller's scratch, or in the destination.
    joined = reader.read_span(80_000, 100_000, scratch, what="x")
    assert bytes(joined) == data[80_000:180_000] and joined.obj is scratch.obj
    out = memoryview(bytearray(40_000))
    reader.read_into(out, 0, scratch, what="x")
    assert bytes(out) == data[:40_000]
    assert bytes(reader.read_span(180_000, 20_000, scratch, what="x")) == data[180_000:200_000]
    assert inner.reads == 4  # one GET per window, for chunks that came in seven pieces between them
    assert not held_windows(reader)  # each window let go after the last piece it held


class _GatedReader(_CountingReader):
    """Ranged reads recorded by start; the first waits until ``gate`` is set (a GET still in flight)."""

    def __init__(self, data: bytes) -> None:
        import threading

        super().__init__(data)
        self.gate, self.first, self.second = threading.Event(), threading.Event(), threading.Event()
        self.starts: list[int] = []

    def read_span(self, offset: int, length: int, scratch: memoryview, *, what: str) -> memoryview:
        self.starts.append(offset)
        (self.first if len(self.starts) == 1 else self.second).set()
        if len(self.starts) == 1:
            assert self.gate.wait(30)
        return super().read_span(offset, length, scratch, what=what)


@pytest.mark.parametrize("ahead", [True, False])
def test_a_thread_waiting_for_a_window_in_flight_fetches_the_next_one_meanwhile(ahead: bool) -> None:
    import os
    import threading

    from tierckpt.storage.coalesce import CoalescingReader, window_spans

    window = 1 << 16
    data = os.urandom(3 * window)
    spans = [(0, window // 2), (window // 2, window // 2), (window, window), (2 * window, window)]
    inner = _GatedReader(data)
    reader = CoalescingReader(inner, window_spans(spans, window), ahead=ahead)  # type: ignore[arg-type]
    scratch = memoryview(bytearray(0))
    got: dict[int, bytes] = {}

    def read(offset: int) -> None:
        got[offset] = bytes(reader.read_span(offset, window // 2, scratch, what="x"))

    first = threading.Thread(target=read, args=(0,))
    first.start()
    assert inner.first.wait(30)  # window 0's GET is in flight, held at the gate
    second = threading.Thread(target=read, args=(window // 2,))
    second.start()
    if ahead:
        # Rather than wait idle for window 0, the second thread fetches window 1, which nobody
        # asked for yet, while window 0 is still in flight.
        assert inner.second.wait(30)
        assert inner.starts == [0, window] and not inner.gate.is_set()
    inner.gate.set()
    first.join(30)
    second.join(30)
    assert got == {0: data[:window // 2], window // 2: data[window // 2:window]}
    # Without ``ahead`` (a reshard, where not every group will be read) it only waited.
    assert inner.starts == ([0, window] if ahead else [0])
    assert bytes(reader.read_span(window, window, scratch, what="x")) == data[window:2 * window]
    assert bytes(reader.read_span(2 * window, window, scratch, what="x")) == data[2 * window:]
    assert inner.starts == [0, window, 2 * window]  # window 1, fetched ahead, was not fetched again


def test_the_object_storage_pages_cloud_example_loads_as_written(tmp_path: Path) -> None:
    import re

    from tierckpt.config import Config

    section = (Path(__file__).resolve().parents[1] / "docs" / "object-storage.md").read_text(encoding="utf-8")
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block is not None
    (tmp_path / "tiers.yaml").write_text(block.group(1))
    ram, nvme, s3 = Config.from_yaml(tmp_path / "tiers.yaml").tiers
    assert (s3.type, s3.url, s3.concurrency, s3.part_size) == ("object", "s3://my-bucket/runs/myjob", 8, 16 << 20)
    assert s3.compression.codec == "zstd" and s3.keep.last == 5 and nvme.type == "filesystem"
