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


def test_small_chunks_are_grouped_only_with_close_neighbours_and_up_to_the_group_size() -> None:
    from tierckpt.storage.coalesce import GAP, GROUP, SMALL, group_spans

    k = 4096
    # Neighbours within GAP join; a chunk further away starts a group; a group of one is not one.
    assert group_spans([(0, k), (k, k), (2 * k + GAP, k), (10 * GAP, k)]) == [(0, 3 * k + GAP)]
    # A large chunk is read on its own, and does not join or split the small ones around it.
    assert group_spans([(0, k), (k, SMALL), (k + SMALL, k)]) == []
    # Groups stop at GROUP bytes.
    many = [(i * (SMALL // 2), SMALL // 2 - 1) for i in range(40)]
    groups = group_spans(many)
    assert all(end - start <= GROUP for start, end in groups) and len(groups) == 3
    assert groups[0][0] == 0 and groups[-1][1] == many[-1][0] + many[-1][1]


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
