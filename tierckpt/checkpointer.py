"""The public entry point: :class:`Checkpointer` and the :class:`SaveHandle` each save returns."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import msgpack
import torch

from tierckpt.capture import Copier, HostPool
from tierckpt.capture.views import moment
from tierckpt.config import Config, TierConfig
from tierckpt.ranks import RankGroup
from tierckpt.errors import CapacityError, ClosedError, ConfigError
from tierckpt.pipeline import Counters, Engine, Pipeline, SaveTracker
from tierckpt.restore import Restored, restore_agreed, restore_latest
from tierckpt.snapshot import plan_entries
from tierckpt.state import flatten, format_path
from tierckpt.tiers.base import Tier, VersionInfo
from tierckpt.tiers.filesystem import FilesystemTier
from tierckpt.tiers.memory import MemoryTier
from tierckpt.tiers.peer import PeerTier, check_peer
from tierckpt.tiers.shm import ShmStore
from tierckpt.units import format_size

log = logging.getLogger("tierckpt")

_MAX_STEP = 10**12 - 1  # directory names carry 12 digits

TierFactory = Callable[[TierConfig], "Tier | None"]


class SaveHandle:
    """What :meth:`Checkpointer.save` returns: lets the caller wait for the copy or for a tier.

    Example::

        handle = await ckpt.save(step, state)
        await handle.committed("nvme")   # True once durable there; False if that tier will not get it
    """

    def __init__(self, tracker: SaveTracker) -> None:
        self._tracker = tracker

    @property
    def step(self) -> int:
        return self._tracker.step

    @property
    def skipped(self) -> bool:
        """True when the save did not happen: every host slot was busy under ``on_full: skip`` (or, under
        ``evict``, every slot was being read)."""
        return self._tracker.token == 0

    async def captured(self) -> bool:
        """Wait for the host copy; True when done, False for a skipped save; raises FlushError if it failed."""
        return await asyncio.wrap_future(self._tracker.captured)

    async def committed(self, tier: str) -> bool:
        """Wait until the version is committed on ``tier`` (True) or will never be (False).

        False means the tier's flush policy passed it over, a newer version it selected (or a newer
        save of the same step) replaced it, it was evicted from host memory before the tier could
        take it (``host.on_full: evict``), or the Checkpointer closed before it was due.

        Raises:
            FlushError: writing it to ``tier`` failed (a full disk, a quota, EIO, EACCES, ...): names
                the tier, the step, and the ``errno`` and path (``filename``) of the failed call. The
                tier keeps its earlier versions, gives back the space of this attempt, and its next
                flush tries again; a later ``save()`` does not raise it. Also raised when the capture
                itself failed.
        """
        return await asyncio.wrap_future(self._future(tier))

    def captured_sync(self, timeout: float | None = None) -> bool:
        return self._tracker.captured.result(timeout)

    def committed_sync(self, tier: str, timeout: float | None = None) -> bool:
        return self._future(tier).result(timeout)

    def _future(self, tier: str) -> concurrent.futures.Future[bool]:
        try:
            return self._tracker.committed[tier]
        except KeyError:
            raise KeyError(f"no tier named {tier!r}; tiers are {sorted(self._tracker.committed)}") from None

    def __repr__(self) -> str:
        return f"SaveHandle(step={self.step}{', skipped' if self.skipped else ''})"


class Checkpointer:
    """Asynchronous, multi-tier checkpointing of a training state.

    ``save()`` returns once the host copy is enqueued; the copy runs on copy threads (CUDA tensors: on
    a side stream per device, into the pinned pool) while training goes on, and :meth:`attach` makes
    ``optimizer.step()`` wait for it (for CUDA tensors, its stream waits; the host does not). Captured
    snapshots flow from host memory down the configured tiers on the library's own thread.

    Args:
        config: a :class:`Config`, a mapping in the YAML's shape, or the path of a YAML file.
        group: under ``torch.distributed``, the process group whose ranks save together (default:
            the world). Construction is then collective: every rank of the group constructs its
            Checkpointer at the same point, and so are ``restore_latest`` and ``close`` (README,
            "Distributed training"). Without ``torch.distributed`` initialized, this is one process.
        tier_factory: builds a tier from its config (return None for the default); for tests and
            custom storage (see :mod:`tierckpt.testing`).

    Raises:
        ConfigError: a bad setting, or a tier directory that cannot be created (on any rank: every
            rank raises it).

    Example::

        with Checkpointer.from_yaml("tiers.yaml") as ckpt:
            ckpt.attach(optimizer)
            for step in range(steps):
                train_step()
                ckpt.save_sync(step, {"model": model.state_dict(), "optim": optimizer.state_dict()})
    """

    def __init__(
        self,
        config: Config | Mapping[str, Any] | str | os.PathLike[str],
        *,
        group: Any = None,
        tier_factory: TierFactory | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = Config.coerce(config)
        self._last_layout: tuple[tuple[Any, ...], tuple[tuple[Any, ...], int]] | None = None
        peer = any(t.type == "peer" for t in self.config.tiers)
        self._group = RankGroup.discover(group, self.config.distributed.timeout_s, bulk=peer, nodes=self.config.distributed.nodes)
        try:
            self._build(tier_factory, clock)
        except BaseException as exc:
            if self._group is None:
                raise
            failure: BaseException | None = exc
        else:
            if self._group is None:
                return
            failure = None
        # Every rank says how its construction went: one rank's failure fails all of them.
        said = self._group.all_gather(None if failure is None else f"{type(failure).__name__}: {failure}")
        failed = [(r, why) for r, why in enumerate(said) if why]
        if failure is not None:
            self._group.close()
            raise failure
        if failed:
            self._runtime.abandon()
            rank, why = failed[0]
            raise ConfigError(f"rank {rank} could not construct its Checkpointer: {why}")
        if peer:
            self._learn_peer_versions()

    def _learn_peer_versions(self) -> None:
        """After a restart, the versions of the peer tier every rank's part of which is still held somewhere."""
        assert self._group is not None
        tier = next(t for t in self._pipeline.tiers if isinstance(t, PeerTier))
        world = self._group.world
        held = [[h.owner, h.step, nbytes, tier.replicas.created(h)] for h, nbytes in tier.replicas.held().items() if h.world == world]
        by_step: dict[int, dict[int, tuple[int, float]]] = {}
        for reply in self._group.all_gather(held):
            for owner, step, nbytes, created in reply:
                by_step.setdefault(step, {})[owner] = (nbytes, created)
        complete = [
            (step, max(c for _, c in parts.values()), sum(n for n, _ in parts.values()))
            for step, parts in sorted(by_step.items())
            if len(parts) == world
        ]

        async def learn() -> None:
            tier.learn(complete)

        self._engine.run_sync(learn())

    def _build(self, tier_factory: TierFactory | None, clock: Callable[[], float]) -> None:
        host = self.config.host
        tier_configs = list(self.config.tiers)
        _check_disjoint_paths(tier_configs)
        for cfg in tier_configs:
            if cfg.type == "peer":  # before anything is allocated or locked
                check_peer(cfg, self._group)
        if tier_configs[0].type != "memory":
            names = {t.name for t in tier_configs}
            implicit = next(n for n in ("host", "host-memory", "tierckpt-host") if n not in names)
            tier_configs.insert(0, TierConfig(name=implicit, type="memory"))
        store = None
        if tier_configs[0].path is not None:
            # A RAM tier that outlives the process: the pool is its shared file, mapped (and locked) first.
            # Each rank has its own pool, in a directory of its own under the configured one.
            ram = Path(tier_configs[0].path).expanduser().absolute()
            if self._group is not None:
                ram = ram / f"rank-{self._group.rank:05d}"
            store = ShmStore(
                ram,
                tier_configs[0].name,
                HostPool.slot_bytes(host.capacity_bytes, host.snapshots),
                host.snapshots,
            )
        try:
            self._pool = HostPool(host.capacity_bytes, host.snapshots, memory=store and (lambda size, slots: store.open()), pinned=host.pinned)
        except BaseException:
            if store is not None:
                store.close()
            raise
        self._copier = Copier(self._pool, host.copy_threads)
        tiers: list[Tier] = []
        for cfg in tier_configs:
            tier = tier_factory(cfg) if tier_factory else None
            if tier is None:
                tier = self._tier(cfg, tier_configs[0], store)
            tiers.append(tier)
        self._pipeline = Pipeline(self.config, self._pool, self._copier, tiers, clock=clock, group=self._group)
        self._engine = Engine()
        self._runtime = _Runtime(self._engine, self._pipeline, self._copier, self._pool, self._group)
        try:
            self._engine.run_sync(self._pipeline.start())
        except BaseException:
            try:
                self._engine.run_sync(self._pipeline.shutdown())
            finally:
                self._runtime.teardown()
            raise
        _register_exit(self._runtime)

    def _tier(self, cfg: TierConfig, first: TierConfig, store: ShmStore | None) -> Tier:
        if cfg.type == "memory":
            return MemoryTier(cfg, self._pool, store if cfg is first else None)
        if cfg.type == "filesystem":
            return FilesystemTier(cfg, self._group)
        assert self._group is not None and self._group.nodes is not None  # check_peer made sure
        # Copies live beside the memory tier's pool, so that they too outlive the process.
        root = None if first.path is None else Path(first.path).expanduser().absolute() / f"{cfg.name}-rank-{self._group.rank:05d}"
        return PeerTier(cfg, self._group, root)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], **kwargs: Any) -> Checkpointer:
        """Build a Checkpointer from a YAML file (see README for every key)."""
        return cls(Config.from_yaml(path), **kwargs)

    @property
    def rank(self) -> int:
        """This process's rank among the ranks saving together (0 for a single process)."""
        return self._group.rank if self._group else 0

    @property
    def world_size(self) -> int:
        """How many ranks save together (1 for a single process)."""
        return self._group.world if self._group else 1

    @property
    def pinned(self) -> bool:
        """Whether the host pool is page-locked for CUDA copies (``host.pinned``; False without CUDA)."""
        return self._pool.pinned

    @property
    def tiers(self) -> tuple[str, ...]:
        """Tier names, fastest first (an implicit host-memory tier first if the config has none)."""
        return tuple(t.name for t in self._pipeline.tiers)

    @property
    def counters(self) -> Counters:
        """Save, skip, flush and error counts, and each filesystem tier's compression, so far (a copy).

        ``flush_errors`` counts failed flushes and deletions; ``failed[tier]`` per tier, and
        ``last_error[tier]`` is the latest such :class:`FlushError` (tier, step, errno, path).
        """
        compression = {t.name: t.encoding.stats for t in self._pipeline.tiers if isinstance(t, FilesystemTier)}
        return dataclasses.replace(self._pipeline.counters, compression=compression)

    # -- capture ---------------------------------------------------------------------------------

    def attach(self, target: torch.optim.Optimizer | torch.nn.Module) -> Any:
        """Install the lazy barrier: wait for pending host copies before state is overwritten.

        An optimizer gets a step pre-hook (``optimizer.step()`` waits). A module gets a forward
        pre-hook on itself and on every submodule that owns buffers, since forward may update those
        in place (BatchNorm running statistics, DDP's buffer broadcast); modules without buffers keep
        running during the copy.
        Returns a handle; ``handle.remove()`` detaches. Other state modified in place outside these
        (a GradScaler, EMA weights) needs :meth:`wait_captured` before it is modified; a copy that
        sees its tensor change fails with :class:`FlushError` instead of storing a torn snapshot.

        Raises:
            TypeError: ``target`` is neither an optimizer nor a module.
        """
        if isinstance(target, torch.optim.Optimizer):

            def step_barrier(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
                self.wait_captured()

            return target.register_step_pre_hook(step_barrier)
        if isinstance(target, torch.nn.Module):

            def forward_barrier(_module: Any, _args: Any) -> None:
                self.wait_captured()

            # The root too, buffers or not: a wrapper may write its children's buffers before their
            # own hooks run (DistributedDataParallel broadcasts them in place at the top of forward).
            return _Handles(
                [
                    module.register_forward_pre_hook(forward_barrier)
                    for module in target.modules()
                    if module is target or next(module.buffers(recurse=False), None) is not None
                ]
            )
        raise TypeError(f"attach() takes a torch optimizer or module, not {type(target).__name__}")

    def wait_captured(self, timeout: float | None = None, *, host: bool = False) -> bool:
        """The lazy barrier, for state changed in place outside ``optimizer.step()``.

        Call it before such a change (a GradScaler's ``update()``, an EMA update, a manual
        ``tensor.add_``). Copies of CPU tensors: blocks until they are done. Copies of CUDA tensors:
        blocks only until they are queued, then makes the current stream of each device wait for
        them, so that work queued on that stream afterwards runs after them; call it under each
        stream that will write (``with torch.cuda.stream(s):``). ``host=True`` blocks until the
        CUDA copies are done too (for writes from other streams or processes).

        Returns False if ``timeout`` ran out first (nothing is ordered then).
        """
        return self._copier.wait_captured(timeout, host=host)

    # -- save ------------------------------------------------------------------------------------

    async def save(
        self, step: int, state: Any, *, metadata: Mapping[str, Any] | None = None, replicated: Sequence[Any] = ()
    ) -> SaveHandle:
        """Snapshot ``state`` as version ``step``; returns once the host copy is under way.

        Of several ranks, every rank saves the same steps (its own part of the state), and
        ``replicated`` names the values that are the same on every rank (the model and optimizer of
        plain data parallelism): a top-level key (``"model"``), a dotted path (``"optim.state"``) or
        a tuple of keys. Their bytes are stored once per tier, each rank writing about
        ``1/world_size`` of each, and every rank gets them back whole from ``restore_latest``.

        Never waits on disk. Under ``host.on_full: block`` it waits for a free host slot; under
        ``evict`` only while another slot is still being copied into; under ``skip`` not at all.
        Never fails because an earlier flush failed: that raises from the earlier save's
        ``handle.committed(tier)``, and shows in ``counters.flush_errors``/``failed``/``last_error``
        and the log; this save is flushed as usual, so a tier that works again catches up.

        Raises:
            UnsupportedStateError: a value in ``state`` cannot be stored (names its key path).
            CapacityError: the state is larger than one host slot.
            ValueError: an entry of ``replicated`` names no value of ``state``.
            FlushError: an earlier capture failed (a torn snapshot: state changed during its copy;
                reported once). This save did not happen.
        """
        args = self._prepare(step, state, metadata, replicated)
        return SaveHandle(await self._engine.run(self._pipeline.save(*args)))

    def save_sync(
        self, step: int, state: Any, *, metadata: Mapping[str, Any] | None = None, replicated: Sequence[Any] = ()
    ) -> SaveHandle:
        """Synchronous twin of :meth:`save`."""
        args = self._prepare(step, state, metadata, replicated)
        return SaveHandle(self._engine.run_sync(self._pipeline.save(*args)))

    def _prepare(self, step: int, state: Any, metadata: Mapping[str, Any] | None, replicated: Sequence[Any] = ()) -> tuple[Any, ...]:
        self._check_open()
        if type(step) is not int or not 0 <= step <= _MAX_STEP:
            raise ValueError(f"step must be an int from 0 to {_MAX_STEP}, got {step!r}")
        meta = dict(metadata or {})
        try:
            msgpack.packb(meta, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as exc:
            raise TypeError(f"metadata must hold only msgpack types (str, int, float, bool, None, bytes, lists, dicts): {exc}") from exc
        skeleton, leaves = flatten(state)
        entries, nbytes = self._layout(leaves, replicated)
        slot = self._pool.slot_size
        if nbytes > slot:
            host = self.config.host
            raise CapacityError(
                f"step {step}: the state needs {format_size(nbytes)} of host memory but one slot holds "
                f"{format_size(slot)} (host.capacity {format_size(host.capacity_bytes)} / host.snapshots "
                f"{host.snapshots}); raise host.capacity to at least {format_size(nbytes * host.snapshots)} "
                f"or lower host.snapshots",
                step=step,
                key="host.capacity",
            )
        return step, leaves, entries, nbytes, skeleton, meta, moment(leaves)

    def _layout(self, leaves: list[Any], replicated: Sequence[Any]) -> tuple[tuple[Any, ...], int]:
        """Where each leaf goes in a slot: :func:`plan_entries`, reused while the state keeps its
        layout, as a training loop's does (~2 µs a tensor saved; the comparison costs ~0.4)."""
        ranks = self._group.ranks if self._group else (0,)
        if replicated:
            return plan_entries(leaves, _sharing(replicated, leaves, ranks))
        signature = tuple((leaf.path, leaf.dtype, leaf.shape, leaf.region, leaf.replicas) for leaf in leaves)
        last = self._last_layout
        if last is not None and last[0] == signature:
            return last[1]
        planned = plan_entries(leaves, _sharing((), leaves, ranks))
        self._last_layout = (signature, planned)
        return planned

    # -- wait, restore, list -----------------------------------------------------------------------

    async def wait(self) -> None:
        """Wait until every capture and every due flush is done (``min_interval`` is waived).

        Raises:
            FlushError: a capture failed, or a tier's latest flush failed and nothing was committed to
                that tier since (each reported once; earlier failures of a tier that has recovered
                are only in ``counters`` and the log).
        """
        self._check_open()
        await self._engine.run(self._pipeline.wait())

    def wait_sync(self) -> None:
        self._check_open()
        self._engine.run_sync(self._pipeline.wait())

    async def restore_latest(self, template: Any = None, *, strict: bool = True, cast: bool = False) -> Restored | None:
        """Load the newest committed version that verifies, from whichever tier holds it.

        With ``template`` (a state of the same structure), tensors are copied into the template's
        tensors in place, keeping their device; otherwise new CPU tensors are returned. The template
        is written only once the whole version has verified; until then the bytes are staged in free
        host slots when they fit (a save meanwhile finds those slots busy), else in new memory.
        Returns None when no tier holds a version.

        The version may have been saved with another parallel layout: a DTensor of the template gets
        its own piece, whatever mesh and placements saved it and whatever mesh it has now, read from
        just the stored pieces that overlap it; a plain tensor of the template, or any tensor without
        a template, gets the whole global tensor. Values that are not DTensors come from the same rank
        of the saved job (rank 0's where it had fewer ranks). Under torch.distributed this is
        collective: every rank calls it.

        ``strict``: a template tensor the version lacks is an error (else it is left as it is; see
        :attr:`Restored.missing_keys`). Tensors the version has and the template lacks come back as
        new tensors (:attr:`Restored.unexpected_keys`). ``cast``: convert a saved dtype to the
        template's (else a differing dtype is an error naming the key).

        Raises:
            RestoreError: the template's tensors do not match the stored ones (global shape, dtype,
                kind), or ``strict`` and template keys are missing from the version.
        """
        self._check_open()
        return await self._engine.run(self._restore(template, strict, cast))

    def restore_latest_sync(self, template: Any = None, *, strict: bool = True, cast: bool = False) -> Restored | None:
        self._check_open()
        return self._engine.run_sync(self._restore(template, strict, cast))

    def _restore(self, template: Any, strict: bool, cast: bool) -> Any:
        if self._group is not None:
            return restore_agreed(self._group, self._pipeline.tiers, template, self._pipeline.memory, strict=strict, cast=cast)
        return restore_latest(self._pipeline.tiers, template, self._pipeline.memory, strict=strict, cast=cast)

    def versions(self) -> list[VersionInfo]:
        """What each tier holds now: one :class:`VersionInfo` per committed version, per tier."""
        self._check_open()

        async def collect() -> list[VersionInfo]:
            return self._pipeline.versions()

        return self._engine.run_sync(collect())

    # -- close -------------------------------------------------------------------------------------

    async def close(self) -> None:
        """Drain every pending flush, stop the engine and release host memory.

        Raises:
            FlushError: as :meth:`wait`; the Checkpointer is closed all the same.
        """
        await self._runtime.close()

    def close_sync(self) -> None:
        self._runtime.close_sync()

    @property
    def _closed(self) -> bool:
        return self._runtime.closed

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("this Checkpointer is closed")

    async def __aenter__(self) -> Checkpointer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_sync()


class _Handles:
    """Several hook handles removed as one."""

    def __init__(self, handles: list[Any]) -> None:
        self._handles = handles

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _sharing(replicated: Sequence[Any], leaves: list[Any], ranks: Sequence[int]) -> Callable[[str], tuple[int, ...] | None]:
    """Which leaves are stored once between ranks, as :func:`plan_entries` asks: by key, those ranks.

    ``ranks`` are the global ranks of the group, in group order. A DTensor piece is shared by its
    replicas (the ranks holding the same piece), named or not; ``replicated`` names other values that
    every rank holds alike.

    Raises:
        ValueError: an entry names no leaf (a typo would otherwise store every rank's copy).
        TypeError: an entry is not a str or a tuple.
    """
    if isinstance(replicated, (str, tuple)) and replicated and not isinstance(replicated, list):
        replicated = [replicated]
    prefixes = []
    for entry in replicated:
        if isinstance(entry, str):
            prefixes.append(tuple(entry.split(".")))
        elif isinstance(entry, tuple):
            prefixes.append(tuple(str(k) for k in entry))
        else:
            raise TypeError(f"replicated entries are key paths (a str like 'model' or 'optim.state', or a tuple), not {entry!r}")
    unused = [".".join(p) for p in prefixes if not any(tuple(str(k) for k in leaf.path)[: len(p)] == p for leaf in leaves)]
    if unused:
        raise ValueError(f"replicated={unused!r}: no tensor of the state is under {'these keys' if len(unused) > 1 else 'this key'}")
    if len(ranks) <= 1:
        return lambda key: None
    position = {r: i for i, r in enumerate(ranks)}
    everyone = tuple(range(len(ranks)))
    holders: dict[str, tuple[int, ...]] = {}
    for leaf in leaves:
        key = format_path(leaf.path)
        if leaf.region is not None:  # a DTensor: its placements say who holds the same piece
            if len(leaf.replicas) > 1 and all(r in position for r in leaf.replicas):
                holders[key] = tuple(position[r] for r in leaf.replicas)
            continue
        path = tuple(str(k) for k in leaf.path)
        if any(path[: len(p)] == p for p in prefixes):
            holders[key] = everyone
    if not holders:
        return lambda key: None

    def sharing(key: str) -> tuple[int, ...] | None:
        group = holders.get(key)
        if group is None:
            return None
        # Each value's chunks start at a rank of their own (the same on every holder: from the key),
        # so that the odd chunks of many values do not all land on one rank.
        first = zlib.crc32(key.encode()) % len(group)
        return group[first:] + group[:first]

    return sharing


def _check_disjoint_paths(tiers: list[TierConfig]) -> None:
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


class _Runtime:
    """The parts of a Checkpointer that must be drained and stopped exactly once.

    Held strongly by the exit hook: a Checkpointer dropped without ``close()`` keeps flushing in the
    background and is drained at interpreter exit, instead of dying with the daemon engine thread.
    """

    def __init__(self, engine: Engine, pipeline: Pipeline, copier: Copier, pool: HostPool, group: RankGroup | None = None) -> None:
        self.engine: Engine | None = engine
        self.pipeline: Pipeline | None = pipeline
        self.copier: Copier | None = copier
        self.pool: HostPool | None = pool
        self.group = group
        self.closed = False

    async def _close(self) -> None:
        assert self.pipeline is not None
        try:
            await self.pipeline.close()
        finally:
            if self.group is not None:
                await self.group.leave()

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            assert self.engine is not None
            await self.engine.run(self._close())
        finally:
            self.teardown()

    def close_sync(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            assert self.engine is not None
            self.engine.run_sync(self._close())
        finally:
            self.teardown()

    def abandon(self) -> None:
        """Stop without draining or waiting for other ranks (another rank failed to construct)."""
        if self.closed:
            return
        self.closed = True
        try:
            assert self.engine is not None and self.pipeline is not None
            self.engine.run_sync(self.pipeline.shutdown())
        finally:
            self.teardown()

    def teardown(self) -> None:
        self.closed = True
        engine, copier, pool, group = self.engine, self.copier, self.pool, self.group
        self.engine = self.pipeline = self.copier = self.pool = self.group = None
        if group is not None:
            group.close()
        if engine is not None:
            engine.stop()
        if copier is not None:
            copier.close()
        if pool is not None:
            pool.close()

    def close_at_exit(self) -> None:
        if self.closed:
            return
        try:
            self.close_sync()
        except Exception as exc:  # at interpreter exit there is nobody left to raise to
            log.error("tierckpt: closing at exit failed: %s", exc)


def _register_exit(runtime: _Runtime) -> None:
    """Drain at interpreter exit if the user never closed.

    It must run before concurrent.futures refuses new work at shutdown, which happens in threading's
    own exit hooks (run newest first), before ``atexit``; so register there when that exists.
    """
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is not None:
            register(runtime.close_at_exit)
            return
    except RuntimeError:  # already shutting down
        return
    atexit.register(runtime.close_at_exit)
