"""tierckpt.config and tierckpt.units: the example file, every error a config can make, round trips."""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
import re
import string
import types
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierckpt.config import (
    CompressionConfig,
    Config,
    DistributedConfig,
    FlushPolicy,
    HostConfig,
    KeepPolicy,
    TierConfig,
)
from tierckpt.config.sections import _COMPRESSION_KEYS, _DISTRIBUTED_KEYS, _FLUSH_KEYS, _HOST_KEYS, _KEEP_KEYS
from tierckpt.config.tier import _TIER_KEYS
from tierckpt.errors import ConfigError
from tierckpt.units import format_size, parse_duration, parse_size

# ARCHITECTURE.md, section 6, as written.
EXAMPLE = """\
host:
  capacity: 4GiB        # host memory for snapshots in flight (pinned when CUDA is present)
  snapshots: 2          # at most this many snapshots held at once (PCheck)
  on_full: block        # block | skip : what save() does when every slot is busy
tiers:
  - name: ram
    type: memory
    keep: {last: 2}
  - name: nvme
    type: filesystem
    path: ./checkpoints/nvme
    flush: {every: 1}                      # every version that reaches the tier above
    keep: {last: 3}
  - name: pfs
    type: filesystem
    path: ./checkpoints/pfs
    flush: {every_steps: 100, min_interval: 30s}
    keep: {last: 2, every_steps: 1000}     # keep the newest 2, and every 1000th step forever
    compression: {codec: zstd, level: 3}
"""


def load(tmp_path: Path, text: str) -> Config:
    path = tmp_path / "tiers.yaml"
    path.write_text(text)
    return Config.from_yaml(path)


def load_error(tmp_path: Path, text: str) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, text)
    return caught.value


def small(host: str = "  capacity: 1GiB\n", nvme: str = "") -> str:
    """A two-tier config; with one host line, the lines in ``nvme`` start at line 9."""
    return (
        "host:\n" + host + "tiers:\n"
        "  - name: ram\n"
        "    type: memory\n"
        "  - name: nvme\n"
        "    type: filesystem\n"
        "    path: /tmp/nvme\n" + nvme
    )


# --- the example ----------------------------------------------------------------------------------


def test_example_loads_as_written(tmp_path: Path) -> None:
    config = load(tmp_path, EXAMPLE)

    assert config.host.capacity_bytes == 4 * 2**30
    assert config.host.snapshots == 2
    assert config.host.on_full == "block"
    assert config.host.copy_threads == 2
    assert config.host.slot_bytes == 2 * 2**30
    assert [tier.name for tier in config.tiers] == ["ram", "nvme", "pfs"]

    ram, nvme, pfs = config.tiers
    assert ram.type == "memory"
    assert ram.path is None
    assert ram.keep == KeepPolicy(last=2, every_steps=None, within_s=None, max_bytes=None)
    assert ram.flush == FlushPolicy()
    assert ram.compression == CompressionConfig(codec="none", level=1)

    assert nvme.type == "filesystem"
    assert nvme.path == Path("./checkpoints/nvme")
    assert not nvme.path.is_absolute()
    assert nvme.flush == FlushPolicy(every=1, every_steps=None, min_interval_s=0.0, max_staleness_s=None, newest_only=True)
    assert nvme.keep == KeepPolicy(last=3, every_steps=None)
    assert nvme.compression.codec == "none"
    assert nvme.io_threads == 2

    assert pfs.path == Path("checkpoints/pfs")
    assert pfs.flush.every == 1
    assert pfs.flush.every_steps == 100
    assert pfs.flush.min_interval_s == 30.0
    assert isinstance(pfs.flush.min_interval_s, float)
    assert pfs.keep == KeepPolicy(last=2, every_steps=1000)
    assert pfs.compression == CompressionConfig(codec="zstd", level=3)
    assert config.tier("pfs") is pfs


def test_example_as_dict(tmp_path: Path) -> None:
    assert load(tmp_path, EXAMPLE).to_dict() == {
        "host": {"capacity": 4 * 2**30, "snapshots": 2, "on_full": "block", "copy_threads": 2, "pinned": "auto"},
        "tiers": [
            {"name": "ram", "type": "memory", "keep": {"last": 2, "every_steps": None, "within": None, "max_bytes": None, "abandoned": None}},
            {
                "name": "nvme",
                "type": "filesystem",
                "path": "checkpoints/nvme",
                "flush": {"every": 1, "every_steps": None, "min_interval": 0.0, "max_staleness": None, "newest_only": True},
                "keep": {"last": 3, "every_steps": None, "within": None, "max_bytes": None, "abandoned": None},
                "compression": {"codec": "none", "level": 1, "shuffle": False, "min_ratio": 1.05, "when": "always"},
                "io_threads": 2,
                "scope": "shared",
            },
            {
                "name": "pfs",
                "type": "filesystem",
                "path": "checkpoints/pfs",
                "flush": {"every": 1, "every_steps": 100, "min_interval": 30.0, "max_staleness": None, "newest_only": True},
                "keep": {"last": 2, "every_steps": 1000, "within": None, "max_bytes": None, "abandoned": None},
                "compression": {"codec": "zstd", "level": 3, "shuffle": False, "min_ratio": 1.05, "when": "always"},
                "io_threads": 2,
                "scope": "shared",
            },
        ],
        "distributed": {"timeout": 60.0, "nodes": None, "read_replicated": "once", "relay": "auto"},
    }


def test_defaults() -> None:
    config = Config.from_dict({"tiers": [{"name": "disk", "type": "filesystem", "path": "ckpt"}]})
    assert config.host == HostConfig(capacity_bytes=None, snapshots=2, on_full="block", copy_threads=2)  # sized to the state
    assert config.tiers == (TierConfig(name="disk", type="filesystem", path=Path("ckpt")),)


# --- docs/configuration.md: its examples load, and it documents every key --------------------------

CONFIGURATION_PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def configuration_page() -> str:
    return CONFIGURATION_PAGE.read_text(encoding="utf-8")


def test_configuration_page_examples_load_as_written(tmp_path: Path) -> None:
    blocks = re.findall(r"```yaml\n(.*?)```", configuration_page(), re.S)
    assert len(blocks) == 2
    assert load(tmp_path, blocks[0]) == load(tmp_path, EXAMPLE)
    realistic = load(tmp_path, blocks[1])
    ram, nvme, pfs = realistic.tiers
    assert (realistic.host.snapshots, realistic.host.on_full) == (5, "evict")  # 2 tiers below host memory: 2 × 2 + 1
    assert ram.keep == KeepPolicy(last=1)
    assert (nvme.flush, nvme.keep) == (FlushPolicy(every_steps=10), KeepPolicy(last=3))
    assert pfs.flush == FlushPolicy(every_steps=500, max_staleness_s=1800.0)
    assert pfs.keep == KeepPolicy(last=2, every_steps=5000)


def test_configuration_page_documents_every_key() -> None:
    rows = set(re.findall(r"^\| `([a-z_.\[\]]+)` \|", configuration_page(), re.M))
    sections = {"flush": _FLUSH_KEYS, "keep": _KEEP_KEYS, "compression": _COMPRESSION_KEYS}
    expected = {f"host.{key.name}" for key in _HOST_KEYS}
    expected |= {f"tiers[].{key.name}" for key in _TIER_KEYS if key.name not in sections}
    expected |= {f"tiers[].{name}.{key.name}" for name, keys in sections.items() for key in keys}
    expected |= {f"distributed.{key.name}" for key in _DISTRIBUTED_KEYS}
    assert expected <= rows, f"keys without a row in docs/configuration.md's table: {sorted(expected - rows)}"


# --- errors through YAML: key path, line, value, what is allowed ---------------------------------------


def test_unknown_key_message(tmp_path: Path) -> None:
    error = load_error(tmp_path, small(nvme="    flush: {evry: 1}\n"))
    assert str(error) == (
        f"tiers[1].flush.evry: unknown key (tier 'nvme', in {tmp_path / 'tiers.yaml'}, line 9); "
        "allowed: every, every_steps, min_interval, max_staleness, newest_only"
    )
    assert error.key == "tiers[1].flush.evry"
    assert error.tier == "nvme"


def test_wrong_choice_message(tmp_path: Path) -> None:
    error = load_error(tmp_path, small(host="  capacity: 1GiB\n  on_full: wait\n"))
    assert str(error) == f"host.on_full: 'wait' is not allowed (in {tmp_path / 'tiers.yaml'}, line 3); use one of: block, skip, evict"
    assert error.tier is None


@pytest.mark.parametrize(
    ("text", "key", "line", "allowed"),
    [
        (small() + "logging: {level: info}\n", "logging", 9, "host, tiers, distributed, events, metrics"),
        (small() + "distributed: {timout: 60s}\n", "distributed.timout", 9, "timeout, nodes, read_replicated, relay"),
        (small(host="  capacity: 1GiB\n  snapshot: 2\n"), "host.snapshot", 3, "capacity, snapshots, on_full, copy_threads, pinned"),
        (small(nvme="    replicas: 2\n"), "tiers[1].replicas", 9, "name, type, path, flush, keep, compression, delta, io_threads, scope, copies, bandwidth, url, endpoint, region, concurrency, part_size, retries, timeout"),
        (small(nvme="    flush:\n      every: 2\n      max_stale: 1m\n"), "tiers[1].flush.max_stale", 11, "every, every_steps, min_interval, max_staleness, newest_only"),
        (small(nvme="    keep: {last: 2, newer_than: 1h}\n"), "tiers[1].keep.newer_than", 9, "last, every_steps, within, max_bytes, abandoned"),
        (small(nvme="    compression: {codec: zstd, planes: 4}\n"), "tiers[1].compression.planes", 9, "codec, level, shuffle, min_ratio, when"),
    ],
)
def test_unknown_keys(tmp_path: Path, text: str, key: str, line: int, allowed: str) -> None:
    error = load_error(tmp_path, text)
    assert error.key == key
    tier = "tier 'nvme', " if key.startswith("tiers[1]") else ""
    assert str(error) == f"{key}: unknown key ({tier}in {tmp_path / 'tiers.yaml'}, line {line}); allowed: {allowed}"
    assert error.tier == ("nvme" if tier else None)


@pytest.mark.parametrize(
    ("host", "nvme", "key", "line", "says"),
    [
        ("  snapshots: two\n", "", "host.snapshots", 2, ["'two' is not an integer", "integer >= 1"]),
        ("  snapshots: true\n", "", "host.snapshots", 2, ["True is not an integer"]),
        ("  snapshots: 0\n", "", "host.snapshots", 2, ["0 is not allowed", "integer >= 1"]),
        ("  capacity: true\n", "", "host.capacity", 2, ["True is not a size", "4GiB"]),
        ("  capacity: 1.5\n", "", "host.capacity", 2, ["1.5 is not a size", "512MiB"]),
        ("  capacity: 4 GB and more\n", "", "host.capacity", 2, ["'4 GB and more' is not a size"]),
        ("  capacity: 4XB\n", "", "host.capacity", 2, ["unknown unit 'XB'"]),
        ("  capacity: -1GiB\n", "", "host.capacity", 2, ["'-1GiB' is negative"]),
        ("  on_full: drop\n", "", "host.on_full", 2, ["'drop' is not allowed", "block, skip, evict"]),
        ("  on_full: true\n", "", "host.on_full", 2, ["True is not allowed"]),
        ("  copy_threads: 65\n", "", "host.copy_threads", 2, ["65 is not allowed", "from 1 to 64"]),
        ("  pinned: yes please\n", "", "host.pinned", 2, ["'yes please' is not allowed", "auto, true or false"]),
        ("  pinned: 1\n", "", "host.pinned", 2, ["1 is not allowed", "auto, true or false"]),
        ("", "    flush: {every: 0}\n", "tiers[1].flush.every", 9, ["0 is not allowed", ">= 1"]),
        ("", "    flush: {every: '1'}\n", "tiers[1].flush.every", 9, ["'1' is not an integer"]),
        ("", "    flush: {every_steps: 2.5}\n", "tiers[1].flush.every_steps", 9, ["2.5 is not an integer", "or null"]),
        ("", "    flush: {min_interval: soon}\n", "tiers[1].flush.min_interval", 9, ["'soon' is not a duration", "30s"]),
        ("", "    flush: {min_interval: -5}\n", "tiers[1].flush.min_interval", 9, ["-5 is negative"]),
        ("", "    flush: {min_interval: 5w}\n", "tiers[1].flush.min_interval", 9, ["unknown unit 'w'"]),
        ("", "    flush: {min_interval: .inf}\n", "tiers[1].flush.min_interval", 9, ["inf is not a finite duration"]),
        ("", "    flush: 3\n", "tiers[1].flush", 9, ["3 is not a mapping", "every, every_steps, min_interval, max_staleness"]),
        ("", "    flush: {max_staleness: 0}\n", "tiers[1].flush.max_staleness", 9, ["0 is not allowed", "> 0", "leave max_staleness out"]),
        ("", "    flush: {max_staleness: 0s}\n", "tiers[1].flush.max_staleness", 9, ["0 is not allowed"]),
        ("", "    flush: {max_staleness: -10m}\n", "tiers[1].flush.max_staleness", 9, ["'-10m' is negative"]),
        ("", "    flush: {max_staleness: never}\n", "tiers[1].flush.max_staleness", 9, ["'never' is not a duration"]),
        ("", "    flush: {min_interval: 1m, max_staleness: 30s}\n", "tiers[1].flush.max_staleness", 9,
         ["30s is shorter than min_interval, 60s", "raise max_staleness or lower min_interval"]),
        ("", "    flush: {newest_only: 'no'}\n", "tiers[1].flush.newest_only", 9, ["'no' is not allowed", "true or false"]),
        ("", "    flush: {newest_only: 0}\n", "tiers[1].flush.newest_only", 9, ["0 is not allowed"]),
        ("", "    keep: {last: 0}\n", "tiers[1].keep.last", 9, ["0 is not allowed"]),
        ("", "    keep: {every_steps: false}\n", "tiers[1].keep.every_steps", 9, ["False is not an integer"]),
        ("", "    keep:\n", "tiers[1].keep", 9, ["None is not a mapping"]),
        ("", "    keep: {}\n", "tiers[1].keep", 9, ["sets no rule", "last, every_steps, within, max_bytes or abandoned", "leave keep out"]),
        ("", "    keep: {last: null}\n", "tiers[1].keep", 9, ["sets no rule"]),
        ("", "    keep: {within: 0}\n", "tiers[1].keep.within", 9, ["0 is not allowed", "> 0"]),
        ("", "    keep: {within: -2h}\n", "tiers[1].keep.within", 9, ["'-2h' is negative"]),
        ("", "    keep: {within: .nan}\n", "tiers[1].keep.within", 9, ["nan"]),
        ("", "    keep: {max_bytes: 0}\n", "tiers[1].keep.max_bytes", 9, ["0 is not allowed"]),
        ("", "    keep: {max_bytes: -1GiB}\n", "tiers[1].keep.max_bytes", 9, ["'-1GiB' is negative"]),
        ("", "    keep: {max_bytes: lots}\n", "tiers[1].keep.max_bytes", 9, ["'lots' is not a size"]),
        ("", "    compression: {codec: gzip}\n", "tiers[1].compression.codec", 9, ["'gzip' is not allowed", "none, zstd"]),
        ("", "    compression: {codec: zstd, level: 0}\n", "tiers[1].compression.level", 9, ["0 is not allowed", "1 to 22"]),
        ("", "    compression: {level: 23}\n", "tiers[1].compression.level", 9, ["23 is not allowed"]),
        ("", "    compression: {level: -8}\n", "tiers[1].compression.level", 9, ["-8 is not allowed", "-7 to -1"]),
        ("", "    compression: {shuffle: true}\n", "tiers[1].compression.shuffle", 9, ["needs a compressor", "codec: zstd"]),
        ("", "    compression: {codec: zstd, shuffle: yes please}\n", "tiers[1].compression.shuffle", 9, ["'yes please' is not allowed", "true or false"]),
        ("", "    compression: {codec: zstd, min_ratio: 0.9}\n", "tiers[1].compression.min_ratio", 9, ["0.9 is not allowed", "1.0 to 100"]),
        ("", "    compression: {codec: zstd, min_ratio: '5%'}\n", "tiers[1].compression.min_ratio", 9, ["'5%' is not allowed"]),
        ("", "    compression: {codec: zstd, when: sometimes}\n", "tiers[1].compression.when", 9, ["'sometimes' is not allowed", "always, faster"]),
        ("", "    io_threads: 0\n", "tiers[1].io_threads", 9, ["0 is not allowed", "from 1 to 64"]),
        ("", "    io_threads: '4'\n", "tiers[1].io_threads", 9, ["'4' is not an integer"]),
    ],
)
def test_bad_values(tmp_path: Path, host: str, nvme: str, key: str, line: int, says: list[str]) -> None:
    error = load_error(tmp_path, small(host=host or "  capacity: 1GiB\n", nvme=nvme))
    assert error.key == key
    assert str(error).startswith(f"{key}: ")
    tier = "nvme" if nvme else None  # an error inside a tier names it
    assert error.tier == tier
    assert f"({f'tier {tier!r}, ' if tier else ''}in {tmp_path / 'tiers.yaml'}, line {line})" in str(error)
    for text in says:
        assert text in str(error)


@pytest.mark.parametrize(
    ("text", "key", "line", "says"),
    [
        ("host:\n  capacity: 1GiB\n", "tiers", None, "missing"),
        ("tiers:\n  - type: memory\n", "tiers[0].name", 2, "required here: name, type"),
        ("tiers:\n  - name: ram\n", "tiers[0].type", 2, "required here: name, type"),
        ("tiers:\n  - name: disk\n    type: filesystem\n", "tiers[0].path", 2, "a filesystem tier needs a directory"),
        ("tiers:\n  - name: disk\n    type: filesystem\n    path: ''\n", "tiers[0].path", 4, "'' is not allowed"),
        ("tiers:\n  - name: disk\n    type: filesystem\n    path: 7\n", "tiers[0].path", 4, "7 is not allowed"),
        ("tiers:\n  - name: disk\n    type: filesystem\n    path:\n", "tiers[0].path", 4, "missing"),
        ("tiers:\n  - name: my disk\n    type: memory\n", "tiers[0].name", 2, "use letters, digits"),
        ("tiers:\n  - name: 7\n    type: memory\n", "tiers[0].name", 2, "7 is not allowed"),
        ("tiers:\n  - name: _ram\n    type: memory\n", "tiers[0].name", 2, "'_ram' is not allowed"),
        ("tiers:\n  - name: ram\n    type: tape\n", "tiers[0].type", 3, "use one of: memory, filesystem, peer"),
        ("tiers: []\n", "tiers", 1, "no tier is given"),
        ("tiers: {name: ram, type: memory}\n", "tiers", 1, "is not a list"),
        ("tiers:\n  - ram\n", "tiers[0]", 2, "'ram' is not a mapping"),
        ("host: 4GiB\ntiers: [{name: ram, type: memory}]\n", "host", 1, "'4GiB' is not a mapping"),
    ],
)
def test_missing_and_malformed(tmp_path: Path, text: str, key: str, line: int | None, says: str) -> None:
    error = load_error(tmp_path, text)
    assert error.key == key
    where = f"in {tmp_path / 'tiers.yaml'}" + (f", line {line}" if line else "")
    if error.tier is not None:
        where = f"tier {error.tier!r}, {where}"
    assert str(error).startswith(f"{key}: ")
    assert f"({where})" in str(error)
    assert says in str(error)


@pytest.mark.parametrize(
    ("text", "key", "line", "says"),
    [
        (small(nvme="  - name: ram\n    type: filesystem\n    path: /tmp/x\n"), "tiers[2].name", 9,
         "'ram' is already the name of tiers[0]"),
        ("tiers:\n  - {name: disk, type: filesystem, path: /tmp/d}\n  - {name: ram, type: memory}\n",
         "tiers[1].type", 3, "a memory tier can only be the first tier"),
        ("tiers:\n  - {name: ram, type: memory}\n  - {name: ram2, type: memory}\n",
         "tiers[1].type", 3, "a memory tier can only be the first tier"),
        ("tiers:\n  - name: ram\n    type: memory\n    flush: {every: 1}\n", "tiers[0].flush", 4,
         "not allowed on a memory tier"),
        ("tiers:\n  - name: ram\n    type: memory\n    flush: {}\n", "tiers[0].flush", 4,
         "a memory tier is the first tier and receives every save"),
        ("tiers:\n  - name: ram\n    type: memory\n    compression: {codec: zstd}\n", "tiers[0].compression", 4,
         "not allowed on a memory tier"),
        ("tiers:\n  - name: ram\n    type: memory\n    compression: {}\n", "tiers[0].compression", 4,
         "not allowed on a memory tier"),
        ("tiers:\n  - name: ram\n    type: memory\n    io_threads: 4\n", "tiers[0].io_threads", 4,
         "io_threads applies to filesystem tiers"),
        ("host:\n  capacity: 4096\n  snapshots: 2\ntiers: [{name: ram, type: memory}]\n", "host.capacity", 2,
         "4KiB over 2 snapshots leaves 2KiB per snapshot"),
    ],
)
def test_tier_rules(tmp_path: Path, text: str, key: str, line: int, says: str) -> None:
    error = load_error(tmp_path, text)
    assert error.key == key
    # An error inside a tier names it; a clash between two tiers names neither.
    assert (error.tier is None) == (not key.startswith("tiers[") or "already the name" in says)
    tier = f"tier {error.tier!r}, " if error.tier else ""
    assert f"({tier}in {tmp_path / 'tiers.yaml'}, line {line})" in str(error)
    assert says in str(error)


def test_a_filesystem_tier_listed_first_may_have_flush(tmp_path: Path) -> None:
    # The Checkpointer puts a host memory tier in front of it, which feeds it.
    config = load(tmp_path, "tiers:\n  - {name: pfs, type: filesystem, path: /p, flush: {every_steps: 100}}\n")
    assert config.tiers[0].flush == FlushPolicy(every_steps=100)
    assert Config.from_dict(config.to_dict()) == config


def test_smallest_slot_is_allowed() -> None:
    assert HostConfig(capacity_bytes=8192, snapshots=2).slot_bytes == 4096
    assert HostConfig(capacity_bytes=3 * 4096 + 2, snapshots=3).slot_bytes == 4096
    with pytest.raises(ConfigError, match=r"^host\.capacity: 12KiB over 4 snapshots leaves 3KiB per snapshot; "):
        HostConfig(capacity_bytes=12 * 1024, snapshots=4)


# --- errors about the file itself -----------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.yaml"
    with pytest.raises(ConfigError, match="nowhere.yaml: cannot read the config file") as caught:
        Config.from_yaml(path)
    assert isinstance(caught.value.__cause__, FileNotFoundError)
    assert str(path) in str(caught.value)


def test_yaml_syntax_error(tmp_path: Path) -> None:
    error = load_error(tmp_path, "host:\n  capacity: 4GiB\ntiers: [{name: ram, type: memory}\n")
    assert str(error).startswith(f"{tmp_path / 'tiers.yaml'}: not valid YAML: ")
    assert "line 4" in str(error)
    assert error.__cause__ is not None


@pytest.mark.parametrize("text", ["", "\n\n", "# nothing here\n"])
def test_empty_file(tmp_path: Path, text: str) -> None:
    assert "the file is empty" in str(load_error(tmp_path, text))


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    error = load_error(tmp_path, "- name: ram\n  type: memory\n")
    assert str(error).startswith(f"{tmp_path / 'tiers.yaml'}: [")
    assert "is not a mapping; use a mapping with keys: host, tiers" in str(error)


def test_repeated_key_is_an_error(tmp_path: Path) -> None:
    error = load_error(tmp_path, small(nvme="    keep: {last: 2}\n    keep: {last: 3}\n"))
    assert error.key == "tiers[1].keep"
    assert "given twice, first on line 9" in str(error)
    assert "line 10)" in str(error)


def test_merge_keys_and_anchors(tmp_path: Path) -> None:
    text = (
        "tiers:\n"
        "  - &disk {name: nvme, type: filesystem, path: /tmp/nvme, io_threads: 4}\n"
        "  - <<: *disk\n"
        "    name: pfs\n"
        "    path: /tmp/pfs\n"
    )
    nvme, pfs = load(tmp_path, text).tiers
    assert (pfs.name, pfs.path, pfs.io_threads) == ("pfs", Path("/tmp/pfs"), 4)
    assert nvme.path == Path("/tmp/nvme")


# --- from_dict, coerce, built in code ------------------------------------------------------------------


def test_from_dict_errors_name_the_source() -> None:
    data = {"tiers": [{"name": "ram", "type": "memory", "bogus": 1}]}
    with pytest.raises(ConfigError) as caught:
        Config.from_dict(data)
    assert str(caught.value) == "tiers[0].bogus: unknown key (tier 'ram'); allowed: name, type, path, flush, keep, compression, delta, io_threads, scope, copies, bandwidth, url, endpoint, region, concurrency, part_size, retries, timeout"
    with pytest.raises(ConfigError, match=r"^tiers\[0\]\.bogus: unknown key \(tier 'ram', in job\.json\); allowed: "):
        Config.from_dict(data, source="job.json")
    with pytest.raises(ConfigError, match=r"^config: \[\] is not a mapping; use a mapping with keys: host, tiers, distributed, events, metrics$"):
        Config.from_dict([])  # type: ignore[arg-type]


def test_from_dict_takes_tuples_and_read_only_mappings() -> None:
    data = types.MappingProxyType({"tiers": ({"name": "ram", "type": "memory", "keep": {"last": 1}},)})
    assert Config.from_dict(data).tiers == (TierConfig(name="ram", type="memory", keep=KeepPolicy(last=1)),)


def test_explicit_nulls_mean_the_default() -> None:
    flush = {"every_steps": None, "max_staleness": None}
    keep = {"last": 2, "every_steps": None, "within": None, "max_bytes": None}
    tier = {"name": "d", "type": "filesystem", "path": "d", "flush": flush, "keep": keep}
    config = Config.from_dict({"tiers": [{"name": "ram", "type": "memory"}, tier]})
    assert config.tiers[1].flush == FlushPolicy()
    assert config.tiers[1].keep == KeepPolicy(last=2)


def test_policy_keys_load_with_units(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        small(
            host="  capacity: 1GiB\n  on_full: evict\n",
            nvme="    flush: {every_steps: 500, min_interval: 30s, max_staleness: 10m, newest_only: false}\n"
            "    keep: {last: 2, every_steps: 5000, within: 2h, max_bytes: 50GiB}\n",
        ),
    )
    assert config.host.on_full == "evict"
    nvme = config.tiers[1]
    assert nvme.flush == FlushPolicy(every_steps=500, min_interval_s=30.0, max_staleness_s=600.0, newest_only=False)
    assert isinstance(nvme.flush.max_staleness_s, float)
    assert nvme.keep == KeepPolicy(last=2, every_steps=5000, within_s=7200.0, max_bytes=50 << 30)
    assert isinstance(nvme.keep.within_s, float)
    assert Config.from_dict(config.to_dict()) == config
    # max_staleness may equal min_interval: every flush then starts as soon as it may.
    assert FlushPolicy(min_interval_s=30, max_staleness_s=30).max_staleness_s == 30.0


def test_keep_without_rules_keeps_all_and_is_left_out_when_written() -> None:
    assert KeepPolicy().keeps_all
    assert not KeepPolicy(within_s=1).keeps_all and not KeepPolicy(max_bytes=1).keeps_all
    config = Config.from_dict({"tiers": [{"name": "ram", "type": "memory"}, {"name": "d", "type": "filesystem", "path": "d"}]})
    written = config.to_dict()
    assert all("keep" not in tier for tier in written["tiers"])
    assert Config.from_dict(written) == config


def test_coerce(tmp_path: Path) -> None:
    config = load(tmp_path, EXAMPLE)
    assert Config.coerce(config) is config
    assert Config.coerce(config.to_dict()) == config
    assert Config.coerce(tmp_path / "tiers.yaml") == config
    assert Config.coerce(str(tmp_path / "tiers.yaml")) == config
    with pytest.raises(ConfigError, match="^config: 42 is not allowed; use a Config, a mapping, or the path"):
        Config.coerce(42)  # type: ignore[arg-type]


def test_tier_lookup(tmp_path: Path) -> None:
    config = load(tmp_path, EXAMPLE)
    assert config.tier("nvme").path == Path("checkpoints/nvme")
    with pytest.raises(KeyError, match="no tier named 'ssd'; the tiers are: ram, nvme, pfs"):
        config.tier("ssd")


def test_built_in_code_names_keys_by_section() -> None:
    with pytest.raises(ConfigError, match=r"^flush\.every: 0 is not allowed; use an integer >= 1$") as caught:
        FlushPolicy(every=0)
    assert caught.value.key == "flush.every"
    with pytest.raises(ConfigError, match=r"^host\.snapshots: True is not an integer"):
        HostConfig(snapshots=True)
    with pytest.raises(ConfigError, match=r"^host\.capacity: '4GiB' is not an integer"):
        HostConfig(capacity_bytes="4GiB")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^flush\.min_interval: '30s' is not allowed"):
        FlushPolicy(min_interval_s="30s")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^keep\.last: -1 is not allowed"):
        KeepPolicy(last=-1)
    with pytest.raises(ConfigError, match=r"^keep\.within: -1 is not allowed; use a number of seconds > 0, or null$"):
        KeepPolicy(within_s=-1)
    with pytest.raises(ConfigError, match=r"^keep\.max_bytes: '1GiB' is not an integer"):
        KeepPolicy(max_bytes="1GiB")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^flush\.max_staleness: inf is not allowed"):
        FlushPolicy(max_staleness_s=math.inf)
    with pytest.raises(ConfigError, match=r"^flush\.max_staleness: 5s is shorter than min_interval, 10s; ") as short:
        FlushPolicy(min_interval_s=10, max_staleness_s=5)
    assert (short.value.key, short.value.tier) == ("flush.max_staleness", None)
    with pytest.raises(ConfigError, match=r"^flush\.newest_only: 1 is not allowed; use true or false$"):
        FlushPolicy(newest_only=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^tier\.path: missing"):
        TierConfig(name="disk", type="filesystem")
    with pytest.raises(ConfigError, match=r"^tier\.flush: \{'every': 2\} is not allowed \(tier 'disk'\); use a FlushPolicy"):
        TierConfig(name="disk", type="filesystem", path="d", flush={"every": 2})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^tiers: no tier is given"):
        Config(tiers=())
    ram = TierConfig(name="ram", type="memory")
    with pytest.raises(ConfigError, match=r"^tiers\[1\]\.name: 'ram' is already the name of tiers\[0\]"):
        Config(tiers=(ram, ram))
    with pytest.raises(ConfigError, match=r"^tier\.flush: not allowed on a memory tier \(tier 'ram'\); a memory tier is the first") as named:
        TierConfig(name="ram", type="memory", flush=FlushPolicy(every=2))
    assert (named.value.key, named.value.tier) == ("tier.flush", "ram")
    assert TierConfig(name="ram", type="memory", path="/dev/shm/ckpt").path == Path("/dev/shm/ckpt")


def test_built_in_code_normalises_types(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    tier = TierConfig(name="disk", type="filesystem", path="~/ckpt")
    assert tier.path == tmp_path / "ckpt"
    assert TierConfig(name="disk", type="filesystem", path=Path("rel/dir")).path == Path("rel/dir")
    assert FlushPolicy(min_interval_s=30).min_interval_s == 30.0
    config = Config(tiers=[TierConfig(name="ram", type="memory")])  # type: ignore[arg-type]
    assert isinstance(config.tiers, tuple)


def test_tilde_in_yaml_is_expanded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    config = load(tmp_path, "tiers:\n  - {name: disk, type: filesystem, path: ~/ckpt}\n")
    assert config.tiers[0].path == tmp_path / "ckpt"


@pytest.mark.parametrize(
    "section",
    [
        HostConfig(),
        FlushPolicy(),
        KeepPolicy(),
        CompressionConfig(),
        TierConfig(name="ram", type="memory"),
        Config(tiers=(TierConfig(name="ram", type="memory"),)),
    ],
)
def test_frozen(section: object) -> None:
    name = dataclasses.fields(section)[0].name  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(section, name, getattr(section, name))
    assert hash(section) == hash(pickle.loads(pickle.dumps(section)))
    assert pickle.loads(pickle.dumps(section)) == section


# --- peer tiers and distributed.nodes ------------------------------------------------------------------

PEER = "  - name: peer\n    type: peer\n"  # tiers[1], after a memory tier; its keys start at line 6


def peer_config(keys: str = "", *, after: str = "") -> str:
    return "tiers:\n  - name: ram\n    type: memory\n" + PEER + keys + after


@pytest.mark.parametrize(("written", "rate"), [("500MiB", 500 << 20), ("500MiB/s", 500 << 20), ("1.5 GB / s", 1_500_000_000), (4096, 4096)])
def test_peer_tier_loads(tmp_path: Path, written: object, rate: int) -> None:
    text = peer_config(f"    copies: 2\n    bandwidth: {written}\n    flush: {{every_steps: 10}}\n    keep: {{last: 1}}\n")
    peer = load(tmp_path, text).tiers[1]
    assert peer == TierConfig(
        name="peer", type="peer", copies=2, bandwidth_bytes=rate, flush=FlushPolicy(every_steps=10), keep=KeepPolicy(last=1)
    )
    assert isinstance(peer.bandwidth_bytes, int)


def test_peer_tier_defaults_and_round_trip(tmp_path: Path) -> None:
    config = load(tmp_path, peer_config(after="  - {name: nvme, type: filesystem, path: /tmp/nvme}\n"))
    peer = config.tier("peer")
    assert (peer.copies, peer.bandwidth_bytes, peer.path) == (1, None, None)
    written = config.to_dict()
    assert written["tiers"][0] == {"name": "ram", "type": "memory"}
    assert written["tiers"][1] == {
        "name": "peer",
        "type": "peer",
        "flush": {"every": 1, "every_steps": None, "min_interval": 0.0, "max_staleness": None, "newest_only": True},
        "copies": 1,
        "bandwidth": None,
    }
    assert "copies" not in written["tiers"][2] and "bandwidth" not in written["tiers"][2]
    assert Config.from_dict(written) == config
    limited = dataclasses.replace(config, tiers=(config.tiers[0], dataclasses.replace(peer, copies=2, bandwidth_bytes=500 << 20)))
    assert limited.to_dict()["tiers"][1]["bandwidth"] == 500 << 20
    assert Config.from_dict(limited.to_dict()) == limited
    (tmp_path / "out.yaml").write_text(limited.to_yaml())
    assert Config.from_yaml(tmp_path / "out.yaml") == limited


@pytest.mark.parametrize(
    ("text", "key", "line", "says"),
    [
        (small(nvme="    copies: 2\n"), "tiers[1].copies", 9, "not allowed on a filesystem tier"),
        (small(nvme="    copies: 1\n"), "tiers[1].copies", 9, "copies applies to peer tiers"),
        (small(nvme="    bandwidth: 1GiB\n"), "tiers[1].bandwidth", 9, "bandwidth applies to peer tiers"),
        ("tiers:\n  - name: ram\n    type: memory\n    copies: 2\n", "tiers[0].copies", 4, "not allowed on a memory tier"),
        ("tiers:\n  - name: ram\n    type: memory\n    bandwidth: 1GiB/s\n", "tiers[0].bandwidth", 4, "not allowed on a memory tier"),
        (peer_config("    path: /dev/shm/peer\n"), "tiers[1].path", 6, "copies live in the memory tier's directory, or in process memory"),
        (peer_config("    compression: {codec: zstd}\n"), "tiers[1].compression", 6, "not allowed on a peer tier"),
        (peer_config("    io_threads: 4\n"), "tiers[1].io_threads", 6, "io_threads applies to filesystem tiers"),
        (peer_config("    copies: 3\n"), "tiers[1].copies", 6, "use an integer from 1 to 2"),
        (peer_config("    copies: 0\n"), "tiers[1].copies", 6, "0 is not allowed"),
        (peer_config("    copies: two\n"), "tiers[1].copies", 6, "'two' is not an integer"),
        (peer_config("    bandwidth: 0\n"), "tiers[1].bandwidth", 6, "use a size per second > 0, e.g. 500MiB/s"),
        (peer_config("    bandwidth: 0MiB/s\n"), "tiers[1].bandwidth", 6, "0 is not allowed"),
        (peer_config("    bandwidth: -1MiB/s\n"), "tiers[1].bandwidth", 6, "'-1MiB/s' is not a size per second"),
        (peer_config("    bandwidth: fast\n"), "tiers[1].bandwidth", 6, "'fast' is not a size per second"),
        (peer_config("    bandwidth: 500MiB/h\n"), "tiers[1].bandwidth", 6, "'500MiB/h' is not a size per second"),
        (peer_config("    bandwidth: true\n"), "tiers[1].bandwidth", 6, "True is not a size per second"),
    ],
)
def test_peer_keys_refused(tmp_path: Path, text: str, key: str, line: int, says: str) -> None:
    error = load_error(tmp_path, text)
    assert error.key == key
    assert str(error).startswith(f"{key}: ")
    assert error.tier == ("ram" if key.startswith("tiers[0]") else "peer" if "type: peer" in text else "nvme")
    assert f"(tier {error.tier!r}, in {tmp_path / 'tiers.yaml'}, line {line})" in str(error)
    assert says in str(error)


@pytest.mark.parametrize(
    ("text", "key", "line", "tier", "says"),
    [
        ("tiers:\n  - {name: peer, type: peer}\n", "tiers[0].type", 2, "peer",
         "'peer' is not allowed first (tier 'peer', in {file}, line 2); a peer tier copies what the host memory tier captured; put a memory tier first"),
        (peer_config(after="  - {name: peer2, type: peer}\n"), "tiers[2].type", 6, "peer2",
         "'peer' is not allowed twice; tiers[1] is a peer tier already (tier 'peer2', in {file}, line 6); use at most one peer tier"),
    ],
)
def test_peer_tier_rules(tmp_path: Path, text: str, key: str, line: int, tier: str, says: str) -> None:
    error = load_error(tmp_path, text)
    assert (error.key, error.tier) == (key, tier)
    assert str(error) == f"{key}: " + says.format(file=tmp_path / "tiers.yaml")


def test_peer_tier_in_code() -> None:
    ram = TierConfig(name="ram", type="memory")
    peer = TierConfig(name="peer", type="peer", copies=2, bandwidth_bytes=1 << 30)
    assert Config(tiers=(ram, peer)).tiers[1] is peer
    # A filesystem tier listed first is fed by a host tier the Checkpointer puts in front of it.
    Config(tiers=(TierConfig(name="nvme", type="filesystem", path="n"), peer))
    with pytest.raises(ConfigError, match=r"^tiers\[0\]\.type: 'peer' is not allowed first \(tier 'peer'\)"):
        Config(tiers=(peer,))
    with pytest.raises(ConfigError, match=r"^tiers\[2\]\.type: 'peer' is not allowed twice; tiers\[1\] is a peer tier already"):
        Config(tiers=(ram, peer, dataclasses.replace(peer, name="peer2")))
    with pytest.raises(ConfigError, match=r"^tier\.copies: not allowed on a memory tier \(tier 'ram'\); copies applies to peer tiers"):
        TierConfig(name="ram", type="memory", copies=2)
    with pytest.raises(ConfigError, match=r"^tier\.bandwidth: not allowed on a filesystem tier \(tier 'd'\); bandwidth applies"):
        TierConfig(name="d", type="filesystem", path="d", bandwidth_bytes=1)
    with pytest.raises(ConfigError, match=r"^tier\.path: not allowed on a peer tier \(tier 'peer'\); a peer tier's copies live"):
        TierConfig(name="peer", type="peer", path="/dev/shm/p")
    with pytest.raises(ConfigError, match=r"^tier\.io_threads: not allowed on a peer tier"):
        TierConfig(name="peer", type="peer", io_threads=4)
    with pytest.raises(ConfigError, match=r"^tier\.compression: not allowed on a peer tier"):
        TierConfig(name="peer", type="peer", compression=CompressionConfig(codec="zstd"))
    with pytest.raises(ConfigError, match=r"^tier\.copies: 3 is not allowed \(tier 'peer'\); use an integer from 1 to 2$"):
        TierConfig(name="peer", type="peer", copies=3)
    for bad in (0, -1, True, 1.5, "1GiB"):
        with pytest.raises(ConfigError, match=r"^tier\.bandwidth: .* is not allowed \(tier 'peer'\); use a size per second > 0"):
            TierConfig(name="peer", type="peer", bandwidth_bytes=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("nodes", [1, 2, 8])
def test_distributed_nodes(tmp_path: Path, nodes: int) -> None:
    config = load(tmp_path, small() + f"distributed:\n  timeout: 30s\n  nodes: {nodes}\n")
    assert config.distributed == DistributedConfig(timeout_s=30.0, nodes=nodes)
    assert config.to_dict()["distributed"] == {"timeout": 30.0, "nodes": nodes, "read_replicated": "once", "relay": "auto"}
    assert Config.from_dict(config.to_dict()) == config
    assert load(tmp_path, small()).distributed.nodes is None
    assert load(tmp_path, small() + "distributed: {nodes: null}\n").distributed.nodes is None


def test_distributed_read_replicated(tmp_path: Path) -> None:
    config = load(tmp_path, small() + "distributed:\n  read_replicated: every_rank\n")
    assert config.distributed.read_replicated == "every_rank"
    assert Config.from_dict(config.to_dict()) == config
    assert load(tmp_path, small()).distributed.read_replicated == "once"
    error = load_error(tmp_path, small() + "distributed:\n  read_replicated: twice\n")
    assert (error.key, error.tier) == ("distributed.read_replicated", None)
    assert str(error).startswith("distributed.read_replicated: 'twice' is not allowed (in ")
    assert str(error).endswith("use one of: once, every_rank")


@pytest.mark.parametrize(
    ("value", "says"),
    [("0", "0 is not allowed"), ("-2", "-2 is not allowed"), ("two", "'two' is not an integer"),
     ("1.5", "1.5 is not an integer"), ("true", "True is not an integer")],
)
def test_distributed_nodes_refused(tmp_path: Path, value: str, says: str) -> None:
    error = load_error(tmp_path, small() + f"distributed:\n  nodes: {value}\n")
    assert (error.key, error.tier) == ("distributed.nodes", None)
    assert str(error).startswith(f"distributed.nodes: {says} (in {tmp_path / 'tiers.yaml'}, line 10); use an integer >= 1, or null")
    with pytest.raises(ConfigError, match=r"^distributed\.nodes: 0 is not allowed; use an integer >= 1, or null$"):
        DistributedConfig(nodes=0)


# --- units ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "size"),
    [
        (4096, 4096),
        (0, 0),
        ("4096", 4096),
        (" 7 ", 7),
        ("10B", 10),
        ("4GiB", 4 * 2**30),
        ("4gib", 4 * 2**30),
        ("4 GiB", 4 * 2**30),
        ("4Gi", 4 * 2**30),
        ("512MiB", 512 * 2**20),
        ("64KiB", 64 * 1024),
        ("1TiB", 2**40),
        ("1.5GiB", 3 * 2**29),
        (".5KiB", 512),
        ("1.1KiB", 1126),  # 1126.4 bytes: rounded down
        ("1.5GB", 1_500_000_000),
        ("3KB", 3000),
        ("2k", 2000),
        ("2K", 2000),
        ("5M", 5_000_000),
        ("1TB", 10**12),
    ],
)
def test_parse_size(text: object, size: int) -> None:
    assert parse_size(text, key="host.capacity") == size


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (-1, "-1 is negative"),
        ("-1GiB", "'-1GiB' is negative"),
        ("4 XB", "'4 XB' has an unknown unit 'XB'"),
        ("4GiBs", "'4GiBs' has an unknown unit 'GiBs'"),
        ("GiB", "'GiB' is not a size"),
        ("", "'' is not a size"),
        ("1e9", "'1e9' is not a size"),
        ("4,096", "'4,096' is not a size"),
        (1.5, "1.5 is not a size"),
        (True, "True is not a size"),
        (None, "None is not a size"),
    ],
)
def test_parse_size_errors(value: object, problem: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_size(value, key="host.capacity", where="in t.yaml, line 2")
    assert str(caught.value).startswith(f"host.capacity: {problem}")
    assert "(in t.yaml, line 2); use a whole number of bytes or a number with a unit, e.g. 4096, 64KiB" in str(caught.value)
    assert caught.value.key == "host.capacity"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        (30, 30.0),
        (0, 0.0),
        (0.5, 0.5),
        ("30", 30.0),
        ("500ms", 0.5),
        ("30s", 30.0),
        ("30S", 30.0),
        ("10m", 600.0),
        (" 2 m ", 120.0),
        ("1.5h", 5400.0),
        ("2h", 7200.0),
        ("1d", 86400.0),
    ],
)
def test_parse_duration(text: object, seconds: float) -> None:
    result = parse_duration(text, key="flush.min_interval")
    assert result == seconds
    assert isinstance(result, float)


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (-1, "-1 is negative"),
        ("-5s", "'-5s' is negative"),
        ("5 weeks", "'5 weeks' has an unknown unit 'weeks'"),
        ("soon", "'soon' is not a duration"),
        ("", "'' is not a duration"),
        (True, "True is not a duration"),
        (None, "None is not a duration"),
        (math.nan, "nan is not a finite duration"),
        (math.inf, "inf is not a finite duration"),
    ],
)
def test_parse_duration_errors(value: object, problem: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_duration(value, key="flush.min_interval")
    assert str(caught.value).startswith(f"flush.min_interval: {problem}; use a number of seconds or a number")
    assert "500ms, 30s, 10m, 2h, 1d" in str(caught.value)


@pytest.mark.parametrize(
    ("size", "text"),
    [
        (0, "0B"),
        (1, "1B"),
        (4097, "4097B"),
        (1000, "1KB"),
        (1024, "1KiB"),
        (1536, "1.5KiB"),
        (1_500_000, "1.5MB"),
        (4 * 2**30, "4GiB"),
        (10**12, "1TB"),
        (2**40, "1TiB"),
        (3 * 2**50, "3072TiB"),
    ],
)
def test_format_size(size: int, text: str) -> None:
    assert format_size(size) == text


def test_format_size_errors() -> None:
    with pytest.raises(ValueError, match="size >= 0"):
        format_size(-1)
    with pytest.raises(TypeError):
        format_size(1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        format_size(True)


@given(st.integers(min_value=0, max_value=2**70))
def test_size_format_parse_round_trip(size: int) -> None:
    assert parse_size(format_size(size), key="k") == size


UNITS = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "k": 10**3,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "Ki": 2**10,
}  # fmt: skip


@given(st.integers(min_value=0, max_value=10**6), st.sampled_from(sorted(UNITS)), st.booleans(), st.booleans())
def test_size_units(number: int, unit: str, space: bool, lower: bool) -> None:
    text = f"{number}{' ' if space else ''}{unit.lower() if lower else unit}"
    assert parse_size(text, key="k") == number * UNITS[unit]


# --- round trips of random valid configs --------------------------------------------------------------

names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,12}", fullmatch=True)
path_parts = st.one_of(
    st.text(string.ascii_letters + string.digits + "_-. ", min_size=1, max_size=8),
    st.text(st.characters(codec="utf-8", exclude_characters="/\x00"), min_size=1, max_size=4),
    st.sampled_from(["yes", "null", "1.5", "~", "..", "#x", "- a", "a: b", "'q'", "0x1F"]),
).filter(lambda part: part == "~" or not part.startswith("~"))  # "~name" expands to a user's home
paths = st.builds(
    lambda root, parts: Path(root + "/".join(parts)),
    st.sampled_from(["", "/", "./"]),
    st.lists(path_parts, min_size=1, max_size=4),
)
flushes = st.builds(
    FlushPolicy,
    every=st.integers(1, 10**6),
    every_steps=st.none() | st.integers(1, 10**9),
    min_interval_s=st.just(0.0) | st.floats(0, 1e9, allow_nan=False, allow_infinity=False),
    newest_only=st.booleans(),
).flatmap(
    # max_staleness, when set, is never shorter than min_interval
    lambda f: st.builds(
        dataclasses.replace,
        st.just(f),
        max_staleness_s=st.none() | st.floats(max(f.min_interval_s, 1e-3), 2e9, allow_nan=False, allow_infinity=False),
    )
)
keeps = st.builds(
    KeepPolicy,
    last=st.none() | st.integers(1, 1000),
    every_steps=st.none() | st.integers(1, 10**9),
    within_s=st.none() | st.floats(1e-3, 1e9, allow_nan=False, allow_infinity=False),
    max_bytes=st.none() | st.integers(1, 2**60),
)
compressions = st.builds(
    CompressionConfig,
    codec=st.just("zstd"),
    level=st.integers(-7, 22).filter(bool),
    shuffle=st.booleans(),
    min_ratio=st.floats(1.0, 100.0),
    when=st.sampled_from(["always", "faster"]),
) | st.builds(CompressionConfig, codec=st.just("none"), level=st.integers(-7, 22).filter(bool))


@st.composite
def hosts(draw: st.DrawFn) -> HostConfig:
    snapshots = draw(st.integers(1, 16))
    return HostConfig(
        capacity_bytes=draw(st.none() | st.integers(4096 * snapshots, 2**50)),
        snapshots=snapshots,
        on_full=draw(st.sampled_from(["block", "skip", "evict"])),
        copy_threads=draw(st.integers(1, 64)),
        pinned=draw(st.sampled_from(["auto", True, False])),
    )


@st.composite
def configs(draw: st.DrawFn) -> Config:
    with_memory = draw(st.booleans())
    count = draw(st.integers(0 if with_memory else 1, 3))
    tier_names = draw(st.lists(names, min_size=count + with_memory, max_size=count + with_memory, unique=True))
    tiers = [TierConfig(name=tier_names.pop(), type="memory", keep=draw(keeps))] if with_memory else []
    for name in tier_names:
        scope = draw(st.sampled_from(["shared", "node"]))
        path = draw(paths.filter(lambda p: not re.search(r"\{[A-Za-z_]\w*\}", str(p))))
        if scope == "node" and draw(st.booleans()):
            path = path / "{node}"
        tiers.append(
            TierConfig(
                name=name,
                type="filesystem",
                path=path,
                flush=draw(flushes),
                keep=draw(keeps),
                compression=draw(compressions),
                io_threads=draw(st.integers(1, 64)),
                scope=scope,
            )
        )
    if tiers and draw(st.booleans()):
        # A peer tier anywhere but first; its name is not one of the others' (they are at most 13 long).
        peer = TierConfig(
            name="peer-tier-of-the-job",
            type="peer",
            flush=draw(flushes),
            keep=draw(keeps),
            copies=draw(st.integers(1, 2)),
            bandwidth_bytes=draw(st.none() | st.integers(1, 2**50)),
        )
        tiers.insert(draw(st.integers(1, len(tiers))), peer)
    distributed = DistributedConfig(
        timeout_s=draw(st.floats(1e-3, 1e9, allow_nan=False, allow_infinity=False)), nodes=draw(st.none() | st.integers(1, 4096))
    )
    return Config(host=draw(hosts()), tiers=tuple(tiers), distributed=distributed)


@given(configs())
def test_dict_round_trip(config: Config) -> None:
    data = config.to_dict()
    assert Config.from_dict(data) == config
    assert Config.from_dict(json.loads(json.dumps(data))) == config


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(config=configs())
def test_yaml_round_trip(tmp_path: Path, config: Config) -> None:
    path = tmp_path / "tiers.yaml"
    path.write_text(config.to_yaml(), encoding="utf-8")
    assert Config.from_yaml(path) == config
