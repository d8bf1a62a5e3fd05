"""Assembling a Checkpointer's parts from its config, and stopping them exactly once.

:func:`assemble` makes, in order: the host pool (on a RAM file system when the memory tier has a
``path``; without ``host.capacity`` an empty one, sized to the state at the first save), the copy
threads, every tier (an implicit host-memory tier first when the config names none), the pipeline
and the engine thread, and opens the tiers. :class:`Runtime` holds what must be
drained and stopped, and is what the exit hook holds.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import threading
from pathlib import Path
from typing import Callable, Iterator

from tierckpt.capture import Copier, HostPool
from tierckpt.capture.pool import FILE_POOL_BYTES
from tierckpt.config import Config, TierConfig, check_disjoint_paths
from tierckpt.pipeline import Engine, Pipeline
from tierckpt.pipeline.flusher import Flusher
from tierckpt.ranks import RankGroup
from tierckpt.ranks.nodes import node_identity
from tierckpt.pipeline.ranked import FollowerFlusher, LeaderFlusher
from tierckpt.tiers.base import Tier
from tierckpt.tiers.filesystem import FilesystemTier
from tierckpt.tiers.memory import MemoryHooks, MemoryTier
from tierckpt.tiers.nodelocal import NodeLocalTier
from tierckpt.tiers.peer import PeerTier, check_peer
from tierckpt.tiers.shm import ShmStore

log = logging.getLogger("tierckpt")

# Builds a tier below host memory from its config; None: the default for its type.
TierFactory = Callable[[TierConfig], "Tier | None"]


class Runtime:
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

    @contextlib.contextmanager
    def _stopping(self) -> Iterator[Engine]:
        """Closed from here on, whatever the stop raises; torn down after it."""
        self.closed = True
        try:
            assert self.engine is not None
            yield self.engine
        finally:
            self.teardown()

    async def close(self) -> None:
        if not self.closed:
            with self._stopping() as engine:
                await engine.run(self._close())

    def close_sync(self) -> None:
        if not self.closed:
            with self._stopping() as engine:
                engine.run_sync(self._close())

    def abandon(self) -> None:
        """Stop without draining or waiting for other ranks (another rank failed to construct)."""
        if not self.closed:
            with self._stopping() as engine:
                assert self.pipeline is not None
                engine.run_sync(self.pipeline.shutdown())

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

    def learn_peer_versions(self) -> None:
        """After a restart, the versions of the peer tier every rank's part of which is still held somewhere."""
        assert self.group is not None and self.pipeline is not None and self.engine is not None
        group = self.group
        tier = next(t for t in self.pipeline.tiers if isinstance(t, PeerTier))
        world = group.world
        held = [[h.owner, h.step, nbytes, tier.replicas.created(h)] for h, nbytes in tier.replicas.held().items() if h.world == world]
        by_step: dict[int, dict[int, tuple[int, float]]] = {}
        for reply in group.all_gather(held):
            for owner, step, nbytes, created in reply:
                by_step.setdefault(step, {})[owner] = (nbytes, created)
        complete = [
            (step, max(c for _, c in parts.values()), sum(n for n, _ in parts.values()))
            for step, parts in sorted(by_step.items())
            if len(parts) == world
        ]

        async def learn() -> None:
            tier.learn(complete)

        self.engine.run_sync(learn())

    def learn_node_versions(self) -> None:
        """After a restart, the versions of each node-local tier that every node's directory commits
        (collective: each node's keeper reports what its directory holds)."""
        assert self.group is not None and self.pipeline is not None and self.engine is not None
        tiers = [t for t in self.pipeline.tiers if isinstance(t, NodeLocalTier)]
        replies = self.group.all_gather([t.holdings() for t in tiers])

        async def learn() -> None:
            for i, tier in enumerate(tiers):
                await tier.learn([reply[i] for reply in replies])

        self.engine.run_sync(learn())

    def close_at_exit(self) -> None:
        if self.closed:
            return
        try:
            self.close_sync()
        except Exception as exc:  # at interpreter exit there is nobody left to raise to
            log.error("tierckpt: closing at exit failed: %s", exc)


def assemble(config: Config, group: RankGroup | None, tier_factory: TierFactory | None, clock: Callable[[], float]) -> Runtime:
    """Build and start every part ``config`` names; on failure, what was made is closed again.

    Raises:
        ConfigError: a bad setting, two tiers in one directory, a tier directory that cannot be
            created or locked.
    """
    host = config.host
    tier_configs = [_on_this_node(cfg, config, group) for cfg in config.tiers]
    check_disjoint_paths(tier_configs)
    for cfg in tier_configs:
        if cfg.type == "peer":  # before anything is allocated or locked
            check_peer(cfg, group)
    if tier_configs[0].type != "memory":
        names = {t.name for t in tier_configs}
        implicit = next(n for n in ("host", "host-memory", "tierckpt-host") if n not in names)
        tier_configs.insert(0, TierConfig(name=implicit, type="memory"))
    first = tier_configs[0]
    store = None
    # Without host.capacity the pool is sized to the state at the first save (tierckpt.capture.pool),
    # unless it lives in a file that the next process maps again: that one keeps a fixed size.
    capacity = host.capacity_bytes
    if first.path is not None:
        # A RAM tier that outlives the process: the pool is its shared file, mapped (and locked) first.
        # Each rank has its own pool, in a directory of its own under the configured one.
        ram = Path(first.path).expanduser().absolute()
        if group is not None:
            ram = ram / f"rank-{group.rank:05d}"
        capacity = FILE_POOL_BYTES if capacity is None else capacity
        store = ShmStore(ram, first.name, HostPool.slot_bytes(capacity, host.snapshots), host.snapshots)
    try:
        opened = store
        pool = HostPool(
            capacity,
            host.snapshots,
            memory=None if opened is None else (lambda size, slots: opened.open()),
            pinned=host.pinned,
            configured=host.capacity_bytes is not None,
        )
    except BaseException:
        if store is not None:
            store.close()
        raise
    copier = Copier(pool, host.copy_threads)
    below: list[Tier] = []
    for cfg in tier_configs[1:]:
        made = tier_factory(cfg) if tier_factory else None
        below.append(made if made is not None else _tier(cfg, first, group, config))

    def memory(hooks: MemoryHooks) -> MemoryTier:
        return MemoryTier(first, pool, store, hooks=hooks)

    # Of several ranks, the leader's flushers decide and the others follow.
    flusher: Callable[..., Flusher] = Flusher
    if group is not None:
        flusher = functools.partial(LeaderFlusher if group.leader else FollowerFlusher, group=group)
    pipeline = Pipeline(config, copier, memory, below, clock=clock, flusher=flusher, several_ranks=group is not None)
    engine = Engine()
    runtime = Runtime(engine, pipeline, copier, pool, group)
    try:
        engine.run_sync(pipeline.start())
    except BaseException:
        try:
            engine.run_sync(pipeline.shutdown())
        finally:
            runtime.teardown()
        raise
    _register_exit(runtime)
    return runtime


def _on_this_node(cfg: TierConfig, config: Config, group: RankGroup | None) -> TierConfig:
    """A node-local tier (``scope: node``) with ``{node}`` in its path replaced by this node's name:
    :func:`~tierckpt.ranks.nodes.node_identity`, or the node's index when ``distributed.nodes``
    simulates nodes on one host."""
    if cfg.scope != "node":
        return cfg
    return cfg.on_node(_node_name(config, group))


def _node_name(config: Config, group: RankGroup | None) -> str:
    if group is None or config.distributed.nodes is None:
        return node_identity()
    assert group.nodes is not None  # discovered: the config has a node-local tier
    return str(next(i for i, node in enumerate(group.nodes) if group.rank in node))


def _tier(cfg: TierConfig, first: TierConfig, group: RankGroup | None, config: Config) -> Tier:
    if cfg.type == "memory":
        raise AssertionError("config validation allows a memory tier only first")
    if cfg.type == "filesystem":
        if cfg.scope == "node" and group is not None and group.nodes is not None and len(group.nodes) > 1:
            return NodeLocalTier(cfg, group, group.nodes, _node_name(config, group))
        return FilesystemTier(cfg, group)  # of one node, its ranks share its directory as they do a shared one
    if cfg.type == "object":
        from tierckpt.tiers.objecttier import ObjectTier  # obstore is imported only by a config that has one

        return ObjectTier(cfg, group)
    assert group is not None and group.nodes is not None  # check_peer made sure
    # Copies live beside the memory tier's pool, so that they too outlive the process.
    root = None if first.path is None else Path(first.path).expanduser().absolute() / f"{cfg.name}-rank-{group.rank:05d}"
    return PeerTier(cfg, group, root)


def _register_exit(runtime: Runtime) -> None:
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
