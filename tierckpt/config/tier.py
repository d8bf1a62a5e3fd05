"""A tier of the config: :class:`TierConfig`, the keys a type of tier does not take, and the ``tiers`` list.

:class:`TierConfig` holds the sections of :mod:`tierckpt.config.sections`; its table of YAML keys, and
the readers and the writer of the ``tiers`` list that :mod:`tierckpt.config.document` uses, are here
with it because its validation needs the table (which keys are set) and the reading needs the rules
(which keys a type of tier may not set).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tierckpt.config.schema import (
    Key,
    Site,
    build,
    check_choice,
    check_int,
    check_mapping,
    check_path,
    check_seconds,
    read_duration,
    is_default,
    optional,
    read,
    read_size,
    section,
    site,
    write,
)
from tierckpt.config.sections import (
    _COMPRESSION_KEYS,
    _DELTA_KEYS,
    _FLUSH_KEYS,
    _KEEP_KEYS,
    CompressionConfig,
    DeltaConfig,
    FlushPolicy,
    KeepPolicy,
)
from tierckpt.errors import ConfigError

__all__ = ["TierConfig"]

_TIER_TYPES = ("memory", "filesystem", "peer", "object")
_SCOPES = ("shared", "node")
_NODE = "{node}"
_PLACEHOLDER = re.compile(r"\{[A-Za-z_][A-Za-z0-9_]*\}")
_TIER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_MAX_COPIES = 2
_PER_SECOND = re.compile(r"\s*/\s*s\s*$", re.IGNORECASE)
_BANDWIDTH_HINT = "use a size per second > 0, e.g. 500MiB/s or 1GB/s, or leave bandwidth out for no limit"
# Keys a tier of a type does not take, and why; a tier may not set them, not even to their default.
_PEER_ONLY = {
    "copies": "copies applies to peer tiers: how many other nodes hold a copy of each rank's snapshot",
    "bandwidth": "bandwidth applies to peer tiers: it limits the copying of snapshots to other nodes",
}
_SCOPE_FS = "scope applies to filesystem tiers: whether every node sees one directory (shared) or its own (node)"
_OBJECT_ONLY = {
    "url": "url applies to object tiers (s3://bucket/prefix); a filesystem tier has a path",
    "endpoint": "endpoint applies to object tiers: the S3-compatible server's address",
    "region": "region applies to object tiers",
    "concurrency": "concurrency applies to object tiers (requests in flight); a filesystem tier has io_threads",
    "part_size": "part_size applies to object tiers: the size of a multipart upload's parts",
    "retries": "retries applies to object tiers: how often a failed request is tried again",
    "timeout": "timeout applies to object tiers: how long a request may take, retries included",
}
_S3_URL = re.compile(r"s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(/[^\x00]*)?")
_MIN_PART = 5 << 20  # S3 refuses smaller parts, but for the last
_MAX_PART = 5 << 30
_NOT_FOR_TYPE: dict[str, dict[str, str]] = {
    "memory": {
        "scope": _SCOPE_FS,
        "flush": "a memory tier is the first tier and receives every save",
        "compression": "a memory tier holds snapshots uncompressed; compress on a filesystem tier",
        "delta": "a memory tier holds whole snapshots; differential versions are for filesystem and object tiers",
        "io_threads": "a memory tier does no file I/O; io_threads applies to filesystem tiers",
        **_PEER_ONLY,
        **_OBJECT_ONLY,
    },
    "filesystem": {**_PEER_ONLY, **_OBJECT_ONLY},
    "peer": {
        "scope": _SCOPE_FS,
        "path": "a peer tier's copies live in the memory tier's directory, or in process memory",
        "compression": "a peer tier holds snapshots uncompressed in other nodes' memory",
        "delta": "a peer tier holds whole snapshots; differential versions are for filesystem and object tiers",
        "io_threads": "a peer tier does no file I/O; io_threads applies to filesystem tiers",
        **_OBJECT_ONLY,
    },
    "object": {
        **_PEER_ONLY,
        "scope": "an object tier is one bucket every node sees; scope applies to filesystem tiers",
        "path": "an object tier lives at url: s3://bucket/prefix, not at a path",
        "io_threads": "an object tier's requests in flight are its concurrency",
    },
}


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
        compression: how tensor bytes are compressed; filesystem and object tiers.
        delta: differential versions (:class:`~tierckpt.config.DeltaConfig`), or ``None`` (every version
            whole); filesystem and object tiers.
        io_threads: writer and reader threads of a filesystem tier (1..64); filesystem tiers only.
        scope: ``"shared"`` (default): one directory that every rank sees (a parallel file system, or one
            node's disk for all its ranks); ``"node"``: each node's own directory at ``path`` (its local
            NVMe). Only with ``"node"`` may ``path`` contain ``{node}``, replaced by the node's name
            (``GROUP_RANK``, else the host name; the node's index under ``distributed.nodes``), so that
            nodes simulated on one host get directories of their own. Filesystem tiers only.
        copies: how many other nodes hold a copy of each rank's snapshot (1 or 2); peer tiers only.
        bandwidth_bytes: at most this many bytes per second copied to other nodes (YAML ``bandwidth``:
            bytes or ``"500MiB/s"``, the ``/s`` optional; > 0), or ``None`` for no limit; peer tiers only.
        url: ``s3://bucket/prefix`` of an object tier, required there; object tiers only.
        endpoint: an S3-compatible server's address (``http://127.0.0.1:8333``, ``https://...``), or
            None for AWS; object tiers only.
        region: the bucket's region (None: ``AWS_REGION``/``AWS_DEFAULT_REGION``, else us-east-1);
            object tiers only.
        concurrency: requests in flight (upload parts, ranged reads; 1..256); object tiers only.
        part_size: bytes per part of a multipart upload (5 MiB..5 GiB; YAML accepts ``"32MiB"``);
            object tiers only.
        retries: how often a request that failed in a way worth retrying (throttled, 5xx, timed out,
            reset) is sent again, with exponential backoff and jitter (0..50); object tiers only.
        timeout_s: how long one request may take, its retries included (YAML ``timeout``: ``"2m"``);
            object tiers only.

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
    delta: DeltaConfig | None = None
    io_threads: int = 2
    scope: str = "shared"
    copies: int = 1
    bandwidth_bytes: int | None = None
    url: str | None = None
    endpoint: str | None = None
    region: str | None = None
    concurrency: int = 8
    part_size: int = 16 << 20
    retries: int = 6
    timeout_s: float = 120.0

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
        if self.delta is not None and not isinstance(self.delta, DeltaConfig):
            raise at.error("delta", problem=f"{self.delta!r} is not allowed", hint="use a DeltaConfig, e.g. delta: {full_every: 10}")
        check_int(at, "io_threads", self.io_threads, low=1, high=64)
        check_choice(at, "scope", self.scope, _SCOPES)
        if self.path is not None:
            _check_placeholders(at, str(self.path), self.scope)
        check_int(at, "copies", self.copies, low=1, high=_MAX_COPIES)
        _check_object(at, self)
        bandwidth = self.bandwidth_bytes
        if bandwidth is not None and (isinstance(bandwidth, bool) or not isinstance(bandwidth, int) or bandwidth < 1):
            raise at.error("bandwidth", problem=f"{bandwidth!r} is not allowed", hint=_BANDWIDTH_HINT)

    def on_node(self, node: str) -> TierConfig:
        """This tier as the node ``node`` uses it: ``{node}`` in ``path`` replaced by ``node``."""
        if self.path is None or _NODE not in str(self.path):
            return self
        return replace(self, path=Path(str(self.path).replace(_NODE, node)))


def _check_object(at: Site, tier: TierConfig) -> None:
    if tier.type == "object" and tier.url is None:
        raise at.error("url", problem="missing", hint="an object tier needs url: s3://bucket/prefix")
    if tier.url is not None and (not isinstance(tier.url, str) or not _S3_URL.fullmatch(tier.url)):
        raise at.error("url", problem=f"{tier.url!r} is not allowed", hint="use s3://bucket/prefix (a bucket name of 3-63 lowercase letters, digits, '.' and '-')")
    if tier.endpoint is not None and (not isinstance(tier.endpoint, str) or not re.fullmatch(r"https?://[^/\s]+/?", tier.endpoint)):
        raise at.error("endpoint", problem=f"{tier.endpoint!r} is not allowed", hint="use http://host:port or https://host[:port]")
    if tier.region is not None and (not isinstance(tier.region, str) or not tier.region):
        raise at.error("region", problem=f"{tier.region!r} is not allowed", hint="use a region name, e.g. us-east-1")
    check_int(at, "concurrency", tier.concurrency, low=1, high=256)
    check_int(at, "part_size", tier.part_size, low=_MIN_PART, high=_MAX_PART)
    check_int(at, "retries", tier.retries, low=0, high=50)
    check_seconds(at, "timeout", tier.timeout_s, positive=True)


def _check_placeholders(at: Site, path: str, scope: str) -> None:
    # A {name} in a path is only ever the {node} placeholder of a node-local tier: any other is a typo
    # that would otherwise become a directory named after it. Lone braces are plain characters.
    for found in _PLACEHOLDER.findall(path):
        if found != _NODE:
            raise at.error("path", problem=f"{found!r} is not a placeholder", hint="the only one is {node}, on a tier with scope: node")
        if scope != "node":
            raise at.error("path", problem="{node} needs scope: node", hint="set scope: node (each node's own directory), or remove {node}")


def _check_keys_for_type(at: Site, tier_type: str, keys: Collection[str]) -> None:
    for key, reason in _NOT_FOR_TYPE[tier_type].items():
        if key in keys:
            raise at.error(key, problem=f"not allowed on {'an' if tier_type[0] in 'aeiou' else 'a'} {tier_type} tier", hint=reason)


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
            | ({"keep"} if tier.keep.keeps_all and tier.keep.abandoned is None else set())
            | ({"path"} if tier.path is None else set())
            | ({"delta"} if tier.delta is None else set())
            | {k for k in ("url", "endpoint", "region") if getattr(tier, k) is None},
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
    if keep.keeps_all and keep.abandoned is None:
        hint = "set last, every_steps, within, max_bytes or abandoned; leave keep out to keep every version"
        raise at.error(problem="sets no rule", hint=hint)
    return keep


# One row per YAML key: a new key is a row here, plus its field and its check in the dataclass.
_read_keep_section, _write_keep_section = section(KeepPolicy, _KEEP_KEYS)
_read_delta_section, _write_delta_section = section(DeltaConfig, _DELTA_KEYS)
_TIER_KEYS = (
    Key("name", "name"),
    Key("type", "type"),
    Key("path", "path", write=str),
    Key("flush", "flush", *section(FlushPolicy, _FLUSH_KEYS)),
    Key("keep", "keep", _read_keep, _write_keep_section),
    Key("compression", "compression", *section(CompressionConfig, _COMPRESSION_KEYS)),
    Key("delta", "delta", optional(_read_delta_section), lambda value: None if value is None else _write_delta_section(value)),
    Key("io_threads", "io_threads"),
    Key("scope", "scope"),
    Key("copies", "copies"),
    Key("bandwidth", "bandwidth_bytes", optional(_read_bandwidth)),
    Key("url", "url"),
    Key("endpoint", "endpoint"),
    Key("region", "region"),
    Key("concurrency", "concurrency"),
    Key("part_size", "part_size", read_size),
    Key("retries", "retries"),
    Key("timeout", "timeout_s", read_duration),
)
