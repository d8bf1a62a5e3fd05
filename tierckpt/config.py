"""Configuration: frozen dataclasses for the host pool and the tiers, read from YAML or a mapping.

YAML is only a serialisation of the dataclasses. Keys are spelled as in YAML (``capacity``,
``min_interval``) and fill fields that carry their unit in their name (``capacity_bytes``,
``min_interval_s``); sizes and durations may be written with units (:mod:`tierckpt.units`). The
example file is in ARCHITECTURE.md, section 6.

Every section validates itself in ``__post_init__`` and raises :class:`~tierckpt.errors.ConfigError`
naming the key as written in YAML (``tiers[2].flush.every``), the value and what is allowed, and, when
the value came from a file, the file and the line. Unknown keys are errors too.

Tier paths are kept as given, with ``~`` expanded; relative paths are resolved by the user of the config,
against the working directory.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import yaml

from tierckpt._config_schema import (
    Key,
    Site,
    build,
    check_bool,
    check_choice,
    check_int,
    check_mapping,
    check_path,
    check_seconds,
    is_default,
    optional,
    read,
    read_duration,
    read_size,
    read_yaml,
    section,
    site,
    write,
)
from tierckpt.errors import ConfigError
from tierckpt.units import format_size

__all__ = ["Config", "HostConfig", "TierConfig", "FlushPolicy", "KeepPolicy", "CompressionConfig", "DistributedConfig", "check_disjoint_paths"]

_ON_FULL = ("block", "skip", "evict")
_TIER_TYPES = ("memory", "filesystem", "peer")
_CODECS = ("none", "zstd")
_WHEN = ("always", "faster")
_TIER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
# A slot must hold at least one 4 KiB block: tensor data is laid out in 4 KiB-aligned extents.
_MIN_SLOT_BYTES = 4096
_MAX_COPIES = 2
_PER_SECOND = re.compile(r"\s*/\s*s\s*$", re.IGNORECASE)
_BANDWIDTH_HINT = "use a size per second > 0, e.g. 500MiB/s or 1GB/s, or leave bandwidth out for no limit"
# Keys a tier of a type does not take, and why; a tier may not set them, not even to their default.
_PEER_ONLY = {
    "copies": "copies applies to peer tiers: how many other nodes hold a copy of each rank's snapshot",
    "bandwidth": "bandwidth applies to peer tiers: it limits the copying of snapshots to other nodes",
}
_NOT_FOR_TYPE: dict[str, dict[str, str]] = {
    "memory": {
        "flush": "a memory tier is the first tier and receives every save",
        "compression": "a memory tier holds snapshots uncompressed; compress on a filesystem tier",
        "io_threads": "a memory tier does no file I/O; io_threads applies to filesystem tiers",
        **_PEER_ONLY,
    },
    "filesystem": dict(_PEER_ONLY),
    "peer": {
        "path": "a peer tier's copies live in the memory tier's directory, or in process memory",
        "compression": "a peer tier holds snapshots uncompressed in other nodes' memory",
        "io_threads": "a peer tier does no file I/O; io_threads applies to filesystem tiers",
    },
}


@dataclass(frozen=True, kw_only=True, slots=True)
class HostConfig:
    """The host memory that snapshots are captured into (YAML section ``host``).

    Attributes:
        capacity_bytes: host memory for snapshots in flight (YAML ``capacity``: bytes or ``"4GiB"``),
            pinned when CUDA is present, split evenly into ``snapshots`` slots of at least 4 KiB each.
        snapshots: at most this many snapshots are held at once (>= 1).
        on_full: what ``save()`` does when every slot is busy: ``"block"`` waits for a free slot,
            ``"skip"`` drops that save, ``"evict"`` drops the oldest snapshot that is neither being
            copied nor read, even one a tier was still waiting to take (see the README).
        copy_threads: threads that copy tensors into host slots (1..64).
        pinned: page-lock the pool for CUDA copies: ``"auto"`` when CUDA is available, falling back to
            pageable memory (logged once) if the system refuses; ``True`` requires it (refusal is a
            ConfigError); ``False`` never.

    Raises:
        ConfigError: a value is of the wrong type or out of range, or a slot would be under 4 KiB.

    Example:
        >>> HostConfig(capacity_bytes=8 << 30, snapshots=4).slot_bytes == 2 << 30
        True
    """

    capacity_bytes: int = 1 << 30
    snapshots: int = 2
    on_full: str = "block"
    copy_threads: int = 2
    pinned: str | bool = "auto"

    def __post_init__(self) -> None:
        at = site("host")
        check_int(at, "capacity", self.capacity_bytes, low=0)
        check_int(at, "snapshots", self.snapshots, low=1)
        check_choice(at, "on_full", self.on_full, _ON_FULL)
        check_int(at, "copy_threads", self.copy_threads, low=1, high=64)
        if not isinstance(self.pinned, bool) and self.pinned != "auto":
            raise at.error("pinned", problem=f"{self.pinned!r} is not allowed", hint="use auto, true or false")
        if self.slot_bytes < _MIN_SLOT_BYTES:
            capacity, slot = format_size(self.capacity_bytes), format_size(self.slot_bytes)
            problem = f"{capacity} over {self.snapshots} snapshots leaves {slot} per snapshot"
            hint = "a snapshot needs at least 4KiB; raise host.capacity or lower host.snapshots"
            raise at.error("capacity", problem=problem, hint=hint)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one host slot: ``capacity_bytes // snapshots``."""
        return self.capacity_bytes // self.snapshots


@dataclass(frozen=True, kw_only=True, slots=True)
class DistributedConfig:
    """How the ranks of a multi-process job coordinate (YAML section ``distributed``).

    Attributes:
        timeout_s: how long the ranks wait for each other (YAML ``timeout``, e.g. ``60s``): for every
            rank's part of a version before it is abandoned, and for each other at construction,
            restore and close. A rank that died or hangs fails the versions in flight after this long.
        nodes: how many nodes the job's ranks are on, overriding what the ranks find out themselves
            (:mod:`tierckpt.ranks.nodes`), for tests and trials on one host: the ranks are split into
            this many nodes of consecutive ranks (>= 1), which a peer tier places its copies across.
            The world size must be divisible by it; that is checked when the ranks start, not here.
            ``None`` (the default): ranks on the same node are those with the same ``GROUP_RANK``
            (set by torchrun), or else the same host name.

    Raises:
        ConfigError: the timeout is not a positive duration, or ``nodes`` is not an integer >= 1.

    Example:
        >>> DistributedConfig(nodes=2).nodes
        2
    """

    timeout_s: float = 60.0
    nodes: int | None = None

    def __post_init__(self) -> None:
        at = site("distributed")
        object.__setattr__(self, "timeout_s", check_seconds(at, "timeout", self.timeout_s, positive=True))
        check_int(at, "nodes", self.nodes, low=1, optional=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class FlushPolicy:
    """Which saves a tier writes (YAML section ``flush``): every tier selects on the stream of saves,
    whatever the other tiers take.

    A version is eligible when it meets ``every`` and ``every_steps``; ``min_interval`` spaces the
    starts of flushes; ``max_staleness`` sends the newest version down when the tier has gone that
    long without a successful flush, eligible or not. :mod:`tierckpt.policy` applies these rules.

    Attributes:
        every: flush every N-th save (>= 1), counted over the saves that took a host slot.
        every_steps: flush only versions whose step is divisible by N (>= 1), or ``None``.
        min_interval_s: at least this many seconds between the starts of two flushes to this tier
            (YAML ``min_interval``: seconds or ``"500ms"``, ``"30s"``, ``"10m"``, ``"2h"``, ``"1d"``).
        max_staleness_s: when this many seconds have passed since the start of the tier's last
            successful flush, the newest version offered goes down even if ``every``/``every_steps``
            pass it over, and even beside a running host copy (YAML ``max_staleness``); > 0 and not
            shorter than ``min_interval_s``, or ``None`` for no limit.
        newest_only: ``True`` (PCheck): a version waiting while the tier is busy is replaced by a newer
            eligible one; ``False``: every eligible version is queued and goes down, oldest first, and
            host memory (or a filesystem tier above that holds it) keeps each until it is taken.

    Raises:
        ConfigError: a value is of the wrong type or out of range, or ``max_staleness`` is shorter
            than ``min_interval``.

    Example:
        >>> FlushPolicy(every_steps=100, min_interval_s=30, max_staleness_s=600).max_staleness_s
        600.0
    """

    every: int = 1
    every_steps: int | None = None
    min_interval_s: float = 0.0
    max_staleness_s: float | None = None
    newest_only: bool = True

    def __post_init__(self) -> None:
        at = site("flush")
        check_int(at, "every", self.every, low=1)
        check_int(at, "every_steps", self.every_steps, low=1, optional=True)
        object.__setattr__(self, "min_interval_s", check_seconds(at, "min_interval", self.min_interval_s))
        staleness = check_seconds(at, "max_staleness", self.max_staleness_s, positive=True, optional=True)
        object.__setattr__(self, "max_staleness_s", staleness)
        check_bool(at, "newest_only", self.newest_only)
        if staleness is not None and staleness < self.min_interval_s:
            problem = f"{staleness:g}s is shorter than min_interval, {self.min_interval_s:g}s"
            hint = "flushes start at most once per min_interval; raise max_staleness or lower min_interval"
            raise at.error("max_staleness", problem=problem, hint=hint)


@dataclass(frozen=True, kw_only=True, slots=True)
class KeepPolicy:
    """Which committed versions a tier keeps (YAML section ``keep``).

    A tier keeps the union of what the set rules keep, and always its newest version; with no rule set
    it keeps everything (:func:`tierckpt.policy.retain` applies it). In YAML, a ``keep`` section must
    set a rule: leave ``keep`` out to keep everything.

    Attributes:
        last: keep the newest N versions (>= 1), or ``None``.
        every_steps: keep versions whose step is divisible by N forever (>= 1), or ``None``.
        within_s: keep versions saved less than this many seconds ago (> 0; YAML ``within``: ``"2h"``),
            or ``None``.
        max_bytes: keep the newest versions whose stored bytes add up to at most this (>= 1; YAML
            ``max_bytes``: ``"50GiB"``), and always the newest even if it alone is larger, or ``None``.

    Raises:
        ConfigError: a value is of the wrong type or out of range.

    Example:
        >>> KeepPolicy(last=2, every_steps=1000).keeps_all
        False
    """

    last: int | None = None
    every_steps: int | None = None
    within_s: float | None = None
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        at = site("keep")
        check_int(at, "last", self.last, low=1, optional=True)
        check_int(at, "every_steps", self.every_steps, low=1, optional=True)
        object.__setattr__(self, "within_s", check_seconds(at, "within", self.within_s, positive=True, optional=True))
        check_int(at, "max_bytes", self.max_bytes, low=1, optional=True)

    @property
    def keeps_all(self) -> bool:
        """True when no rule is set: the tier keeps every version."""
        return self.last is None and self.every_steps is None and self.within_s is None and self.max_bytes is None


@dataclass(frozen=True, kw_only=True, slots=True)
class CompressionConfig:
    """How a filesystem tier compresses tensor bytes (YAML section ``compression``).

    Attributes:
        codec: ``"none"`` or ``"zstd"``.
        level: the zstd level: 1..22, or -7..-1 for zstd's fast levels (ignored by ``"none"``). 1 by
            default: on checkpoints, higher levels cost much speed for little or no size (with
            ``shuffle``, level 3 even stores the exponent plane larger than level 1 does).
        shuffle: split floating-point tensors into byte planes and compress each plane only where it
            pays (the sign/exponent plane, typically); integer and bool tensors get plain zstd.
        min_ratio: a chunk (or plane) is stored raw unless compressing makes it at least this many
            times smaller: 1.05 keeps compression only where it saves about 5% or more.
        when: ``"always"`` compresses every version; ``"faster"`` only while the tier's measured
            compressor throughput is at least its measured write throughput, and writes raw otherwise.

    Raises:
        ConfigError: a value is of the wrong type or out of range.

    Example:
        >>> CompressionConfig(codec="zstd", level=9).level
        9
    """

    codec: str = "none"
    level: int = 1
    shuffle: bool = False
    min_ratio: float = 1.05
    when: str = "always"

    def __post_init__(self) -> None:
        at = site("compression")
        check_choice(at, "codec", self.codec, _CODECS)
        level = self.level
        if isinstance(level, bool) or not isinstance(level, int) or not -7 <= level <= 22 or level == 0:
            hint = "use an integer from 1 to 22, or from -7 to -1 for zstd's fast levels"
            raise at.error("level", problem=f"{level!r} is not allowed", hint=hint)
        check_bool(at, "shuffle", self.shuffle)
        if self.shuffle and self.codec == "none":
            raise at.error("shuffle", problem="byte-shuffle needs a compressor", hint="set codec: zstd, or shuffle: false")
        ratio = self.min_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 1.0 <= ratio <= 100.0:
            raise at.error("min_ratio", problem=f"{ratio!r} is not allowed", hint="use a number from 1.0 to 100, e.g. 1.05")
        object.__setattr__(self, "min_ratio", float(ratio))
        check_choice(at, "when", self.when, _WHEN)

    @property
    def codec_name(self) -> str:
        """The codec floating-point tensors are stored with: ``none``, ``zstd`` or ``zstd+shuffle``."""
        return "zstd+shuffle" if self.shuffle else self.codec


@dataclass(frozen=True, kw_only=True, slots=True)
class TierConfig:
    """One storage tier (an item of the YAML list ``tiers``).

    Attributes:
        name: unique name: letters, digits, ``_ . -``, starting with a letter or a digit.
        type: ``"memory"`` (host slots; only as the first tier), ``"filesystem"``, or ``"peer"``
            (in-memory redundancy: each rank's snapshot is copied into the memory of ranks on other
            nodes; never the first tier, at most one).
        path: the directory of a filesystem tier, required there; a ``str`` or ``os.PathLike`` is stored
            as a ``Path`` with ``~`` expanded, a relative path stays relative. On a memory tier (optional):
            a directory on a RAM-backed file system (``/dev/shm/...``) holding the host pool, so that
            its snapshots outlive the process. Not on a peer tier.
        flush: which saves this tier writes. Not on a memory tier: it is first
            and receives every save. (A filesystem tier listed first is fed by the host tier that the
            Checkpointer puts in front of it, so it may have one.)
        keep: which committed versions this tier keeps.
        compression: how tensor bytes are compressed; filesystem tiers only.
        io_threads: writer and reader threads of a filesystem tier (1..64); filesystem tiers only.
        copies: how many other nodes hold a copy of each rank's snapshot (1 or 2); peer tiers only.
        bandwidth_bytes: at most this many bytes per second copied to other nodes (YAML ``bandwidth``:
            bytes or ``"500MiB/s"``, the ``/s`` optional; > 0), or ``None`` for no limit; peer tiers only.

    Raises:
        ConfigError: a value is missing, of the wrong type or out of range, or a key does not apply to
            this type of tier.

    Example:
        >>> TierConfig(name="nvme", type="filesystem", path="/local/ckpt").path
        PosixPath('/local/ckpt')
    """

    name: str
    type: str
    path: Path | None = None
    flush: FlushPolicy = FlushPolicy()
    keep: KeepPolicy = KeepPolicy()
    compression: CompressionConfig = CompressionConfig()
    io_threads: int = 2
    copies: int = 1
    bandwidth_bytes: int | None = None

    def __post_init__(self) -> None:
        at = site("tier")
        if isinstance(self.name, str) and _TIER_NAME.fullmatch(self.name):
            at = at.of_tier(self.name)
        else:
            hint = "use letters, digits, '_', '.' and '-', starting with a letter or a digit"
            raise at.error("name", problem=f"{self.name!r} is not allowed", hint=hint)
        check_choice(at, "type", self.type, _TIER_TYPES)
        _check_keys_for_type(at, self.type, [key.name for key in _TIER_KEYS if not is_default(self, key)])
        if self.path is not None:
            object.__setattr__(self, "path", check_path(at, "path", self.path))
        elif self.type == "filesystem":
            hint = "a filesystem tier needs a directory, e.g. path: ./checkpoints"
            raise at.error("path", problem="missing", hint=hint)
        for key, kind in (("flush", FlushPolicy), ("keep", KeepPolicy), ("compression", CompressionConfig)):
            if not isinstance(value := getattr(self, key), kind):
                raise at.error(key, problem=f"{value!r} is not allowed", hint=f"use a {kind.__name__}")
        check_int(at, "io_threads", self.io_threads, low=1, high=64)
        check_int(at, "copies", self.copies, low=1, high=_MAX_COPIES)
        bandwidth = self.bandwidth_bytes
        if bandwidth is not None and (isinstance(bandwidth, bool) or not isinstance(bandwidth, int) or bandwidth < 1):
            raise at.error("bandwidth", problem=f"{bandwidth!r} is not allowed", hint=_BANDWIDTH_HINT)


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """A whole configuration: the host pool and the tiers, fastest first.

    Attributes:
        host: the host memory that snapshots are captured into.
        distributed: how ranks coordinate when ``torch.distributed`` is initialized.
        tiers: at least one tier, names unique; a memory tier may only be the first; a peer tier may
            not be the first, and there is at most one. A list is stored as a tuple.

    Raises:
        ConfigError: a value is missing, of the wrong type or out of range, or the tiers break a rule above.

    Example:
        >>> config = Config(tiers=(TierConfig(name="nvme", type="filesystem", path="ckpt"),))
        >>> Config.from_dict(config.to_dict()) == config
        True
    """

    host: HostConfig = HostConfig()
    tiers: tuple[TierConfig, ...]
    distributed: DistributedConfig = DistributedConfig()

    def __post_init__(self) -> None:
        at = site()
        if not isinstance(self.host, HostConfig):
            raise at.error("host", problem=f"{self.host!r} is not allowed", hint="use a HostConfig")
        if isinstance(self.tiers, list):
            object.__setattr__(self, "tiers", tuple(self.tiers))
        if not isinstance(self.tiers, tuple):
            raise at.error("tiers", problem=f"{self.tiers!r} is not a list", hint="use a list of tiers")
        if not self.tiers:
            raise at.error("tiers", problem="no tier is given", hint="a config needs at least one tier")
        index_of: dict[str, int] = {}
        peer: int | None = None
        for index, tier in enumerate(self.tiers):
            if not isinstance(tier, TierConfig):
                raise at.error("tiers", index, problem=f"{tier!r} is not allowed", hint="use a TierConfig")
            if tier.name in index_of:
                problem = f"{tier.name!r} is already the name of tiers[{index_of[tier.name]}]"
                raise at.error("tiers", index, "name", problem=problem, hint="tier names must be unique")
            index_of[tier.name] = index
            if tier.type == "memory" and index > 0:
                hint = "a memory tier can only be the first tier"
                raise at.of_tier(tier.name).error("tiers", index, "type", problem="'memory' is not allowed here", hint=hint)
            if tier.type == "peer" and index == 0:
                hint = "a peer tier copies what the host memory tier captured; put a memory tier first"
                raise at.of_tier(tier.name).error("tiers", index, "type", problem="'peer' is not allowed first", hint=hint)
            if tier.type == "peer" and peer is not None:
                problem = f"'peer' is not allowed twice; tiers[{peer}] is a peer tier already"
                raise at.of_tier(tier.name).error("tiers", index, "type", problem=problem, hint="use at most one peer tier")
            if tier.type == "peer":
                peer = index

    def tier(self, name: str) -> TierConfig:
        """The tier called ``name``.

        Raises:
            KeyError: no tier has that name; the message lists the names there are.

        Example:
            >>> Config(tiers=(TierConfig(name="ram", type="memory"),)).tier("ram").type
            'memory'
        """
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise KeyError(f"no tier named {name!r}; the tiers are: {', '.join(t.name for t in self.tiers)}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str | None = None) -> Config:
        """Build a config from a mapping spelled as the YAML file (``capacity``, ``min_interval``, ...).

        ``tiers`` may be a list or a tuple; ``source``, where the mapping came from, is named in errors.

        Raises:
            ConfigError: a key is unknown or missing, or a value is not allowed.

        Example:
            >>> Config.from_dict({"tiers": [{"name": "ram", "type": "memory"}]}).host.on_full
            'block'
        """
        return _read_config(data, Site(source=source))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> Config:
        """Read a config from a YAML file (safe loading; errors name the file and the line of the key).

        Raises:
            ConfigError: the file cannot be read, is empty or is not valid YAML, or the config in it is
                not valid (see :meth:`from_dict`).

        Example:
            >>> Config.from_yaml("tiers.yaml")  # doctest: +SKIP
        """
        source = os.fspath(path)
        try:
            text = Path(source).read_bytes()
        except OSError as exc:
            raise ConfigError(f"{source}: cannot read the config file: {exc.strerror or exc}") from exc
        data, lines = read_yaml(text, source)
        return _read_config(data, Site(source=source, lines=lines))

    @classmethod
    def coerce(cls, value: Config | Mapping[str, Any] | str | os.PathLike[str]) -> Config:
        """A ``Config`` as is, a mapping through :meth:`from_dict`, a path through :meth:`from_yaml`.

        Raises:
            ConfigError: the value is none of these, or what it holds is not a valid config.

        Example:
            >>> Config.coerce({"tiers": [{"name": "ram", "type": "memory"}]}).tiers[0].name
            'ram'
        """
        if isinstance(value, Config):
            return value
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        if isinstance(value, (str, os.PathLike)):
            return cls.from_yaml(value)
        hint = "use a Config, a mapping, or the path of a YAML file"
        raise ConfigError(f"config: {value!r} is not allowed; {hint}")

    def to_dict(self) -> dict[str, Any]:
        """The config as a mapping spelled as the YAML file: sizes in bytes, durations in seconds, paths
        as ``str``; ``Config.from_dict(config.to_dict()) == config``."""
        return write(self, _CONFIG_KEYS)

    def to_yaml(self) -> str:
        """The config as YAML text; ``Config.from_yaml`` of a file holding it gives an equal config."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def check_disjoint_paths(tiers: Sequence[TierConfig]) -> None:
    """Two tiers in one directory (or one inside the other) would prune each other's versions."""
    seen: list[tuple[str, Path]] = []
    for tier in tiers:
        if tier.path is None:
            continue
        path = Path(tier.path).expanduser().absolute().resolve()
        for name, other in seen:
            if path == other or path in other.parents or other in path.parents:
                raise ConfigError(
                    f"tiers {name!r} and {tier.name!r} share a directory ({other} and {path}); "
                    "each tier needs a directory of its own",
                    tier=tier.name,
                    key=f"tiers.{tier.name}.path",
                )
        seen.append((tier.name, path))


def _check_keys_for_type(at: Site, tier_type: str, keys: Collection[str]) -> None:
    for key, reason in _NOT_FOR_TYPE[tier_type].items():
        if key in keys:
            raise at.error(key, problem=f"not allowed on a {tier_type} tier", hint=reason)


def _read_tier(data: Any, at: Site) -> TierConfig:
    if isinstance(data, Mapping):
        at = at.of_tier(data.get("name"))
    check_mapping(TierConfig, _TIER_KEYS, data, at)
    check_choice(at, "type", data["type"], _TIER_TYPES)
    _check_keys_for_type(at, data["type"], data.keys())
    return build(TierConfig, at, read(_TIER_KEYS, data, at))


def _read_tiers(data: Any, at: Site) -> tuple[TierConfig, ...]:
    if not isinstance(data, (list, tuple)):
        raise at.error(problem=f"{data!r} is not a list", hint="use a list of tiers, fastest first")
    return tuple(_read_tier(item, at.at(index)) for index, item in enumerate(data))


def _write_tiers(tiers: tuple[TierConfig, ...]) -> list[dict[str, Any]]:
    # Leave out the keys the loader would refuse for the tier's type, and a keep section without a rule
    # (the loader refuses an empty one; no keep section means keep everything).
    return [
        write(
            tier,
            _TIER_KEYS,
            skip=frozenset(_NOT_FOR_TYPE[tier.type])
            | ({"keep"} if tier.keep.keeps_all else set())
            | ({"path"} if tier.path is None else set()),
        )
        for tier in tiers
    ]


def _read_bandwidth(value: Any, at: Site) -> int:
    # A rate reads as a size: "500MiB/s" and "500MiB" are the same.
    try:
        return read_size(_PER_SECOND.sub("", value) if isinstance(value, str) else value, at)
    except ConfigError as exc:
        raise at.error(problem=f"{value!r} is not a size per second", hint=_BANDWIDTH_HINT) from exc


def _read_keep(data: Any, at: Site) -> KeepPolicy:
    keep: KeepPolicy = _read_keep_section(data, at)
    if keep.keeps_all:
        hint = "set last, every_steps, within or max_bytes; leave keep out to keep every version"
        raise at.error(problem="sets no rule", hint=hint)
    return keep


def _read_config(data: Any, at: Site) -> Config:
    check_mapping(Config, _CONFIG_KEYS, data, at)
    return build(Config, at, read(_CONFIG_KEYS, data, at))


# One row per YAML key: a new key is a row here, plus its field and its check in the dataclass.
_HOST_KEYS = (
    Key("capacity", "capacity_bytes", read_size),
    Key("snapshots", "snapshots"),
    Key("on_full", "on_full"),
    Key("copy_threads", "copy_threads"),
    Key("pinned", "pinned"),
)
_FLUSH_KEYS = (
    Key("every", "every"),
    Key("every_steps", "every_steps"),
    Key("min_interval", "min_interval_s", read_duration),
    Key("max_staleness", "max_staleness_s", optional(read_duration)),
    Key("newest_only", "newest_only"),
)
_KEEP_KEYS = (
    Key("last", "last"),
    Key("every_steps", "every_steps"),
    Key("within", "within_s", optional(read_duration)),
    Key("max_bytes", "max_bytes", optional(read_size)),
)
_read_keep_section, _write_keep_section = section(KeepPolicy, _KEEP_KEYS)
_COMPRESSION_KEYS = (
    Key("codec", "codec"),
    Key("level", "level"),
    Key("shuffle", "shuffle"),
    Key("min_ratio", "min_ratio"),
    Key("when", "when"),
)
_TIER_KEYS = (
    Key("name", "name"),
    Key("type", "type"),
    Key("path", "path", write=str),
    Key("flush", "flush", *section(FlushPolicy, _FLUSH_KEYS)),
    Key("keep", "keep", _read_keep, _write_keep_section),
    Key("compression", "compression", *section(CompressionConfig, _COMPRESSION_KEYS)),
    Key("io_threads", "io_threads"),
    Key("copies", "copies"),
    Key("bandwidth", "bandwidth_bytes", optional(_read_bandwidth)),
)
_DISTRIBUTED_KEYS = (Key("timeout", "timeout_s", read_duration), Key("nodes", "nodes"))
_CONFIG_KEYS = (
    Key("host", "host", *section(HostConfig, _HOST_KEYS)),
    Key("tiers", "tiers", _read_tiers, _write_tiers),
    Key("distributed", "distributed", *section(DistributedConfig, _DISTRIBUTED_KEYS)),
)
