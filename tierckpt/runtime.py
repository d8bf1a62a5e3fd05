"""Assembling a Checkpointer's parts from its config, and stopping them exactly once.

:func:`assemble` makes, in order: the host pool (on a RAM file system when the memory tier has a
``path``; without ``host.capacity`` an empty one, sized to the state at the first save), the copy
threads, every tier (an implicit host-memory tier first when the config names none), the pipeline
and the engine thread, and opens the tiers. :class:`Runtime` holds what must be
drained and stopped, and is what the exit hook holds. :func:`construct` is the Checkpointer's way in:
it finds the ranks that save together, and has them all assemble or all fail.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from tierckpt.capture import Copier, HostPool
from tierckpt.capture.pool import FILE_POOL_BYTES
from tierckpt.config import Config, TierConfig, check_disjoint_paths
from tierckpt.errors import ConfigError
from tierckpt.format.lineage import decoded
from tierckpt.observe import Events, open_events
from tierckpt.pipeline import Engine, Pipeline
from tierckpt.pipeline.flusher import Flusher
from tierckpt.ranks import RankGroup
from tierckpt.ranks.nodes import node_identity
from tierckpt.ranks.nodestore import link_nodes
from tierckpt.pipeline.ranked import FollowerFlusher, LeaderFlusher
from tierckpt.tiers.base import Tier
from tierckpt.tiers.memory.tier import MemoryHooks, MemoryTier
from tierckpt.tiers.peer import check_peer
from tierckpt.tiers.registry import Placement, make_tier
from tierckpt.tiers.memory.shm import ShmStore

log = logging.getLogger("tierckpt")

# Builds a tier below host memory from its config; None: the default for its type.
TierFactory = Callable[[TierConfig], "Tier | None"]


class Runtime:
    """The parts of a Checkpointer that must be drained and stopped exactly once.

    Held strongly by the exit hook: a Checkpointer dropped without ``close()`` keeps flushing in the
    background and is drained at interpreter exit, instead of dying with the daemon engine thread.
    """

    def __init__(
        self, engine: Engine, pipeline: Pipeline, copier: Copier, pool: HostPool, group: RankGroup | None = None, events: Events | None = None
    ) -> None:
        self.engine: Engine | None = engine
        self.pipeline: Pipeline | None = pipeline
        self.copier: Copier | None = copier
        self.pool: HostPool | None = pool
        self.group = group
        self.events = events
        # The metrics endpoint's address (config `metrics`): the sink that serves one has a url.
        self.metrics_url: str | None = next((u for s in events.sinks if isinstance(u := getattr(s, "url", None), str)), None) if events else None
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
        engine, copier, pool, group, events = self.engine, self.copier, self.pool, self.group, self.events
        self.engine = self.pipeline = self.copier = self.pool = self.group = self.events = None
        if group is not None:
            group.close()
        if engine is not None:
            engine.stop()
        if copier is not None:
            copier.close()
        if pool is not None:
            pool.close()
        if events is not None:
            events.close()  # last: the drain's events are written

    def holdings(self) -> list[Any]:
        """What each tier of this rank tells the others after construction (:meth:`Tier.holdings`)."""
        assert self.pipeline is not None
        return [t.holdings() for t in self.pipeline.tiers]

    def held_head(self) -> list[Any]:
        """What this rank's tiers hold of the saves' order (:meth:`Pipeline.held_head`), to send: the
        newest save's step, its lineage (encoded, or None), the highest serial."""
        assert self.pipeline is not None and self.engine is not None
        pipeline = self.pipeline

        async def held() -> list[Any]:  # on the engine's thread, which owns the tiers
            step, lineage, highest = pipeline.held_head()
            return [step, None if lineage is None else lineage.encode(), highest]

        return self.engine.run_sync(held())

    def learn(self, replies: Sequence[Sequence[Any]], heads: Sequence[Sequence[Any]] = ()) -> None:
        """Every tier learns from every rank's :meth:`holdings` (rank order) what the group holds after
        a restart (:meth:`Tier.learn`: a peer tier's copies, a node-local tier's directories), and the
        pipeline every rank's :meth:`held_head`: every rank then numbers its saves alike."""
        assert self.pipeline is not None and self.engine is not None
        pipeline = self.pipeline
        tiers = pipeline.tiers

        async def learn() -> None:  # on the engine's thread, which owns the tiers
            for i, tier in enumerate(tiers):
                await tier.learn([reply[i] for reply in replies])
            for step, lineage, highest in heads:
                pipeline.direction.held(step, decoded(lineage), highest)
            # What the tiers learned (a node-local tier's versions across the nodes) counts too.
            pipeline.direction.held(*pipeline.held_head())

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
            created or locked, an events file that cannot be opened or a metrics port that is taken.
    """
    pipeline: Pipeline | None = None  # the metrics endpoint asks it how many host slots are busy
    names = [cfg.name for cfg in config.tiers]
    events = open_events(config, group, names, lambda: pipeline.memory.busy_slots() if pipeline is not None else 0)
    try:
        runtime = _assemble(config, group, tier_factory, clock, events)
    except BaseException:
        events.close()
        raise
    pipeline = runtime.pipeline
    return runtime


def _assemble(config: Config, group: RankGroup | None, tier_factory: TierFactory | None, clock: Callable[[], float], events: Events) -> Runtime:
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
        below.append(made if made is not None else make_tier(cfg, Placement(group, functools.partial(_node_name, config, group), first)))

    def memory(hooks: MemoryHooks) -> MemoryTier:
        return MemoryTier(first, pool, store, hooks=hooks)

    # Of several ranks, the leader's flushers decide and the others follow.
    flusher: Callable[..., Flusher] = Flusher
    if group is not None:
        flusher = functools.partial(LeaderFlusher if group.leader else FollowerFlusher, group=group)
    pipeline = Pipeline(config, copier, memory, below, clock=clock, flusher=flusher, several_ranks=group is not None, events=events)
    engine = Engine()
    runtime = Runtime(engine, pipeline, copier, pool, group, events)
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


def construct(
    config: Config, group: Any, tier_factory: TierFactory | None, clock: Callable[[], float]
) -> tuple[RankGroup | None, Runtime]:
    """Find the ranks that save together (None for one process) and :func:`assemble` this rank's parts, collectively.

    Under ``torch.distributed`` every rank of ``group`` calls this at the same point. Every rank then
    says how its construction went, and one rank's failure fails all of them: a rank left running
    alone would wait for the others at its first save. The ranks then learn which peer and node-local
    versions survive a restart, which needs all of them too. Without ``torch.distributed``, this is
    :func:`assemble` of one process.

    Raises:
        ConfigError: a bad setting, or a tier directory that cannot be created (on any rank: that rank
            raises its own error, and every other rank a ConfigError naming it).
    """
    peer = any(t.type == "peer" for t in config.tiers)
    local = any(t.scope == "node" for t in config.tiers)
    ranks = RankGroup.discover(group, config.distributed.timeout_s, bulk=peer or local, find_nodes=local, nodes=config.distributed.nodes)
    if ranks is None:
        return None, assemble(config, None, tier_factory, clock)
    runtime: Runtime | None = None
    failure: BaseException | None = None
    try:
        # Collective: a rank that cannot reach its node's store fails it on every rank alike.
        link_nodes(ranks, config.distributed.relay, config.distributed.nodes)
        runtime = assemble(config, ranks, tier_factory, clock)
    except BaseException as exc:
        failure = exc
    # One exchange: how construction went, and what each tier holds, for the tiers that learn from it.
    # And the newest save each rank holds: every rank numbers its saves from the same one.
    said = ranks.all_gather([f"{type(failure).__name__}: {failure}", None, None] if runtime is None else [None, runtime.holdings(), runtime.held_head()])
    if failure is not None:
        ranks.close()
        raise failure
    assert runtime is not None
    failed = [(r, why) for r, (why, _, _) in enumerate(said) if why]
    if failed:
        runtime.abandon()
        rank, why = failed[0]
        raise ConfigError(f"rank {rank} could not construct its Checkpointer: {why}")
    runtime.learn([held for _, held, _ in said], [head for _, _, head in said])
    return ranks, runtime
