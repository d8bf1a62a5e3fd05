"""The object tier's settings, credentials and read grouping, without a server (the tier itself: test_object_tier.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tierckpt.errors import ConfigError

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
    assert inner.reads == 1 and not reader._held  # one GET for the three; nothing kept after the last
    out = memoryview(bytearray(10))
    reader.read_into(out, 600_000, scratch, what="x")  # outside any group: its own read
    assert bytes(out) == data[600_000:600_010] and inner.reads == 2
    # Asked for again once let go (a restore falling back to it), a group is fetched again.
    assert bytes(reader.read_span(1000, 3000, scratch, what="x")) == data[1000:4000] and inner.reads == 3


def test_the_readmes_cloud_example_loads_as_written(tmp_path: Path) -> None:
    import re

    from tierckpt.config import Config

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Object storage"):]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block is not None
    (tmp_path / "tiers.yaml").write_text(block.group(1))
    ram, nvme, s3 = Config.from_yaml(tmp_path / "tiers.yaml").tiers
    assert (s3.type, s3.url, s3.concurrency, s3.part_size) == ("object", "s3://my-bucket/runs/myjob", 8, 16 << 20)
    assert s3.compression.codec == "zstd" and s3.keep.last == 5 and nvme.type == "filesystem"
