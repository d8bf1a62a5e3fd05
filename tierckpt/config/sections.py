"""The sections of a config that are not tiers: frozen dataclasses that validate themselves.

:class:`HostConfig` (YAML ``host``), :class:`DistributedConfig` (``distributed``), and the sections a tier
holds: :class:`FlushPolicy` (``flush``), :class:`KeepPolicy` (``keep``) and :class:`CompressionConfig`
(``compression``). Their tables of YAML keys (:class:`~tierckpt.config.schema.Key` rows) close the
module; :mod:`tierckpt.config.tier` and :mod:`tierckpt.config.document` turn them into readers and
writers. They live apart from the tier and the whole document so that each module stays small, and
import only :mod:`tierckpt.config.schema` (schema <- sections <- tier <- document).
"""

from __future__ import annotations

from dataclasses import dataclass

from tierckpt.config.schema import (
    Key,
    check_bool,
    check_choice,
    check_int,
    check_seconds,
    optional,
    read_duration,
    read_size,
    site,
)
from tierckpt.units import format_size

__all__ = ["HostConfig", "DistributedConfig", "FlushPolicy", "KeepPolicy", "CompressionConfig", "DeltaConfig"]

_ON_FULL = ("block", "skip", "evict")
_CODECS = ("none", "zstd")
_WHEN = ("always", "faster")
# A slot must hold at least one 4 KiB block: tensor data is laid out in 4 KiB-aligned extents.
_MIN_SLOT_BYTES = 4096


@dataclass(frozen=True, kw_only=True, slots=True)
class HostConfig:
    """The host memory that snapshots are captured into (YAML section ``host``).

    Attributes:
        capacity_bytes: host memory for snapshots in flight (YAML ``capacity``: bytes or ``"4GiB"``),
            pinned when CUDA is present, split evenly into ``snapshots`` slots of at least 4 KiB each,
            mapped at construction. ``None`` (the default): sized to the state at the first save,
            ``snapshots`` slots of its laid-out size and an eighth more, and mapped again, larger, for
            a save that does not fit; at most half of the host's memory (see
            :mod:`tierckpt.capture.pool`). A memory tier with a ``path`` then has a pool of 1 GiB.
        snapshots: at most this many snapshots are held at once (>= 1).
        on_full: what ``save()`` does when every slot is busy: ``"block"`` waits for a free slot,
            ``"skip"`` drops that save, ``"evict"`` drops the oldest snapshot that is neither being
            copied nor read, even one a tier was still waiting to take (see docs/configuration.md).
        copy_threads: threads that copy tensors into host slots (1..64).
        pinned: page-lock the pool for CUDA copies: ``"auto"`` when CUDA is available, falling back to
            pageable memory (logged once) if the system refuses; ``True`` requires it (refusal is a
            ConfigError); ``False`` never.

    Raises:
        ConfigError: a value is of the wrong type or out of range, or a slot would be under 4 KiB.

    Example:
        >>> HostConfig(capacity_bytes=8 << 30, snapshots=4).slot_bytes == 2 << 30
        True
        >>> HostConfig().slot_bytes is None  # sized to the state at the first save
        True
    """

    capacity_bytes: int | None = None
    snapshots: int = 2
    on_full: str = "block"
    copy_threads: int = 2
    pinned: str | bool = "auto"

    def __post_init__(self) -> None:
        at = site("host")
        check_int(at, "capacity", self.capacity_bytes, low=0, optional=True)
        check_int(at, "snapshots", self.snapshots, low=1)
        check_choice(at, "on_full", self.on_full, _ON_FULL)
        check_int(at, "copy_threads", self.copy_threads, low=1, high=64)
        if not isinstance(self.pinned, bool) and self.pinned != "auto":
            raise at.error("pinned", problem=f"{self.pinned!r} is not allowed", hint="use auto, true or false")
        if self.capacity_bytes is not None and self.slot_bytes is not None and self.slot_bytes < _MIN_SLOT_BYTES:
            capacity, slot = format_size(self.capacity_bytes), format_size(self.slot_bytes)
            problem = f"{capacity} over {self.snapshots} snapshots leaves {slot} per snapshot"
            hint = "a snapshot needs at least 4KiB; raise host.capacity or lower host.snapshots"
            raise at.error("capacity", problem=problem, hint=hint)

    @property
    def slot_bytes(self) -> int | None:
        """Bytes of one host slot: ``capacity_bytes // snapshots``; None when the pool is sized to the state."""
        return None if self.capacity_bytes is None else self.capacity_bytes // self.snapshots


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
        read_replicated: how a restore reads a value stored once between ranks (``replicated=``)
            from a shared filesystem or object tier: ``once`` (the default), each rank reads the
            chunks it stored and sends them to the other ranks of the value over the group's gloo
            group, so shared storage serves each byte once (:mod:`tierckpt.restore.replicas`);
            ``every_rank``, each rank reads the whole value from storage (where storage is faster
            than the network between ranks, or ranks share one page cache).
        relay: whether each node's ranks commit through their node's first rank
            (:mod:`tierckpt.ranks.nodestore`): ``nodes``, every node but the leader's has a store of
            its own and only its first rank asks the leader's store, 3 requests a node a save instead
            of 3 a rank; ``off``, every rank asks the leader's store; ``auto`` (the default), ``nodes``
            from 64 ranks on (below that the relay's extra hop costs more than it saves).

    Raises:
        ConfigError: the timeout is not a positive duration, ``nodes`` is not an integer >= 1,
            ``read_replicated`` is neither ``once`` nor ``every_rank``, or ``relay`` is none of
            ``auto``, ``nodes`` and ``off``.

    Example:
        >>> DistributedConfig(nodes=2).nodes
        2
    """

    timeout_s: float = 60.0
    nodes: int | None = None
    read_replicated: str = "once"
    relay: str = "auto"

    def __post_init__(self) -> None:
        at = site("distributed")
        object.__setattr__(self, "timeout_s", check_seconds(at, "timeout", self.timeout_s, positive=True))
        check_int(at, "nodes", self.nodes, low=1, optional=True)
        check_choice(at, "read_replicated", self.read_replicated, ("once", "every_rank"))
        check_choice(at, "relay", self.relay, ("auto", "nodes", "off"))


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
    it keeps everything (:func:`tierckpt.policy.retain` applies it). The rules count the versions of
    the direction being trained; versions of a direction a rollback left (:mod:`tierckpt.format.lineage`)
    never displace them, and ``abandoned`` of them are kept for inspection. In YAML, a ``keep`` section
    must set a rule: leave ``keep`` out to keep everything.

    Attributes:
        last: keep the newest N versions (>= 1), or ``None``.
        every_steps: keep versions whose step is divisible by N forever (>= 1), or ``None``.
        within_s: keep versions saved less than this many seconds ago (> 0; YAML ``within``: ``"2h"``),
            or ``None``.
        max_bytes: keep the newest versions whose stored bytes add up to at most this (>= 1; YAML
            ``max_bytes``: ``"50GiB"``), and always the newest even if it alone is larger, or ``None``.
        abandoned: how many versions of abandoned directions to keep, the most recently saved (>= 0);
            ``None``: every one where no other rule is set (the tier keeps everything), else 1.

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
    abandoned: int | None = None

    def __post_init__(self) -> None:
        at = site("keep")
        check_int(at, "abandoned", self.abandoned, low=0, optional=True)
        check_int(at, "last", self.last, low=1, optional=True)
        check_int(at, "every_steps", self.every_steps, low=1, optional=True)
        object.__setattr__(self, "within_s", check_seconds(at, "within", self.within_s, positive=True, optional=True))
        check_int(at, "max_bytes", self.max_bytes, low=1, optional=True)

    @property
    def keeps_all(self) -> bool:
        """True when no rule is set: the tier keeps every version."""
        return self.last is None and self.every_steps is None and self.within_s is None and self.max_bytes is None

    @property
    def abandoned_kept(self) -> int | None:
        """How many abandoned versions the tier keeps (None: every one)."""
        if self.abandoned is not None:
            return self.abandoned
        return None if self.keeps_all else 1


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
class DeltaConfig:
    """Differential versions on a filesystem or object tier (YAML section ``delta``).

    Every ``full_every``-th version the tier stores is whole; each other one stores only what changed
    against the last whole version before it (its *base*): a chunk whose bytes equal the base's is a
    reference to it, and a floating-point chunk that changed is stored as its XOR against the base's,
    in byte planes, zstd-compressed, where that is ``min_ratio`` times smaller than the chunk stored
    whole (:mod:`tierckpt.xordelta`).

    Attributes:
        full_every: N >= 2: one whole version, then up to N - 1 versions that depend on it.
        min_ratio: a changed chunk is stored as a delta only when that makes it at least this many
            times smaller than stored whole (its base chunk's stored size) (1.0..100); else as the
            tier's compression stores it.

    Raises:
        ConfigError: a value is of the wrong type or out of range.

    Example:
        >>> DeltaConfig(full_every=10).full_every
        10
    """

    full_every: int
    min_ratio: float = 1.05

    def __post_init__(self) -> None:
        at = site("delta")
        check_int(at, "full_every", self.full_every, low=2)
        ratio = self.min_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 1.0 <= ratio <= 100.0:
            raise at.error("min_ratio", problem=f"{ratio!r} is not allowed", hint="use a number from 1.0 to 100, e.g. 1.05")
        object.__setattr__(self, "min_ratio", float(ratio))


# One row per YAML key: a new key is a row here, plus its field and its check in the dataclass.
_HOST_KEYS = (
    Key("capacity", "capacity_bytes", optional(read_size)),
    Key("snapshots", "snapshots"),
    Key("on_full", "on_full"),
    Key("copy_threads", "copy_threads"),
    Key("pinned", "pinned"),
)
_DISTRIBUTED_KEYS = (Key("timeout", "timeout_s", read_duration), Key("nodes", "nodes"), Key("read_replicated", "read_replicated"), Key("relay", "relay"))
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
    Key("abandoned", "abandoned"),
)
_DELTA_KEYS = (Key("full_every", "full_every"), Key("min_ratio", "min_ratio"))
_COMPRESSION_KEYS = (
    Key("codec", "codec"),
    Key("level", "level"),
    Key("shuffle", "shuffle"),
    Key("min_ratio", "min_ratio"),
    Key("when", "when"),
)
