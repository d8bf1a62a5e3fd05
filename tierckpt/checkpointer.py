"""The public entry point: :class:`Checkpointer`, the facade over the parts :mod:`tierckpt.runtime` assembles."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

from tierckpt.capture.barrier import LazyBarrier
from tierckpt.config import Config
from tierckpt.errors import ClosedError
from tierckpt.format.lineage import marked
from tierckpt.handle import SaveHandle
from tierckpt.pipeline import Counters, Engine
from tierckpt.pipeline.engine import sync_twin
from tierckpt.pipeline.request import save_request
from tierckpt.pipeline.saves import SaveRequest
from tierckpt.restore import Restored
from tierckpt.restore.dispatch import prepare_restore
from tierckpt.restore.metadata import read_metadata
from tierckpt.runtime import TierFactory, construct
from tierckpt.snapshot import LayoutCache
from tierckpt.tiers.base import VersionInfo

__all__ = ["Checkpointer", "SaveHandle", "TierFactory"]


class Checkpointer(LazyBarrier):
    """Asynchronous, multi-tier checkpointing of a training state.

    ``save()`` returns once the host copy is enqueued; the copy runs on copy threads (CUDA tensors: on a side stream per
    device, into the pinned pool) while training goes on, and :meth:`attach` makes ``optimizer.step()`` wait for it (for
    CUDA tensors, its stream waits; the host does not). Captured snapshots flow from host memory down the configured tiers
    on the library's own thread.

    Args:
        config: a :class:`Config`, a mapping in the YAML's shape, or the path of a YAML file.
        group: under ``torch.distributed``, the process group whose ranks save together (default: the world). Construction,
            ``restore_latest`` and ``close`` are then collective: every rank of the group calls them at the same point
            (docs/distributed.md, "Distributed training"). Without ``torch.distributed`` initialized, this is one process.
        tier_factory: builds a tier below host memory from its config (None for the default); for tests and custom storage
            (see :mod:`tierckpt.testing`).

    Raises:
        ConfigError: a bad setting, or a tier directory that cannot be created (on any rank: every rank raises it).

    Example::

        with Checkpointer.from_yaml("tiers.yaml") as ckpt:
            ckpt.attach(optimizer)
            for step in range(steps):
                train_step()
                ckpt.save_sync(step, {"model": model.state_dict(), "optim": optimizer.state_dict()})
    """

    def __init__(
        self, config: Config | Mapping[str, Any] | str | os.PathLike[str], *, group: Any = None,
        tier_factory: TierFactory | None = None, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = Config.coerce(config)
        self._group, runtime = construct(self.config, group, tier_factory, clock)
        self._runtime = runtime
        assert runtime.pool is not None and runtime.copier is not None and runtime.pipeline is not None and runtime.engine is not None
        self._pool, self._copier, self._pipeline, self._engine = runtime.pool, runtime.copier, runtime.pipeline, runtime.engine
        self._layouts = LayoutCache(self._group.ranks if self._group else (0,))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], **kwargs: Any) -> Checkpointer:
        """Build a Checkpointer from a YAML file (every key: docs/configuration.md)."""
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
        """Whether the host pool is page-locked for CUDA copies (``host.pinned``; False without CUDA). The pool is pinned
        slot by slot in the background after construction: this waits until that is over."""
        return self._pool.pinned

    @property
    def tiers(self) -> tuple[str, ...]:
        """Tier names, fastest first (an implicit host-memory tier first if the config has none)."""
        return tuple(t.name for t in self._pipeline.tiers)

    @property
    def metrics_url(self) -> str | None:
        """Where this rank serves its Prometheus metrics (config ``metrics``), or None."""
        return self._runtime.metrics_url

    @property
    def counters(self) -> Counters:
        """Save, skip, flush and error counts, and each filesystem tier's compression, so far (a copy). ``flush_errors``
        counts failed flushes and deletions; ``failed[tier]`` per tier, and ``last_error[tier]`` is the latest such
        :class:`FlushError` (tier, step, errno, path)."""
        return self._pipeline.counters.with_compression(self._pipeline.tiers)

    # Not a sync_twin: the caller's thread starts the copies, once it has its handle (pipeline.saves.Handoff says why).
    async def save(self, step: int, state: Any, *, metadata: Mapping[str, Any] | None = None, replicated: Sequence[Any] = ()) -> SaveHandle:
        """Snapshot ``state`` as version ``step``; returns once the host copy is under way.

        Of several ranks, every rank saves the same steps (its own part of the state), and ``replicated`` names the values
        that are the same on every rank (the model and optimizer of plain data parallelism): a top-level key
        (``"model"``), a dotted path (``"optim.state"``) or a tuple of keys. Their bytes are stored once per tier, each
        rank writing about ``1/world_size`` of each, and every rank gets them back whole from ``restore_latest``.

        Never waits on disk. Under ``host.on_full: block`` it waits for a free host slot; under ``evict`` only while
        another slot is still being copied into; under ``skip`` not at all. Never fails because an earlier flush failed:
        that raises from the earlier save's ``handle.committed(tier)``, and shows in ``counters.flush_errors``/``failed``/
        ``last_error`` and the log; this save is flushed as usual, so a tier that works again catches up.

        Raises:
            TypeError: ``step`` is not an int, or ``metadata`` holds a value msgpack cannot encode.
            ValueError: ``step`` is outside 0 to 10**12 - 1, or an entry of ``replicated`` names no value of ``state``.
            UnsupportedStateError: a value in ``state`` cannot be stored (names its key path).
            CapacityError: the state is larger than one host slot.
            FlushError: an earlier capture failed (torn: state changed during its copy; reported once); this save did not happen.
        """
        with self._saving(step, state, metadata, replicated) as (engine, request):
            return SaveHandle(await engine.run(self._pipeline.save(request)))

    def save_sync(self, step: int, state: Any, *, metadata: Mapping[str, Any] | None = None, replicated: Sequence[Any] = ()) -> SaveHandle:
        """Synchronous twin of :meth:`save`."""
        with self._saving(step, state, metadata, replicated) as (engine, request):
            return SaveHandle(engine.run_sync(self._pipeline.save(request)))

    @contextlib.contextmanager
    def _saving(self, step: int, state: Any, metadata: Mapping[str, Any] | None, replicated: Sequence[Any]) -> Iterator[tuple[Engine, SaveRequest]]:
        """The engine and the request of a save call, around the call's handing it to the pipeline."""
        began, engine = time.monotonic(), self._open_engine()
        request = save_request(step, state, metadata, replicated, self._layouts, began=began)
        try:
            yield engine, request
            # Before the copies start (Handoff), so the `captured` event always comes after its `save`.
            self._pipeline.events.emit("save", step=request.step, bytes=request.nbytes, seconds=time.monotonic() - request.began)
        finally:
            request.handoff.caller_done()  # starts the copies, off the engine (Handoff says why)

    def _open_engine(self) -> Engine:
        """The engine, for a call that needs this Checkpointer open (every call but ``close``)."""
        if self._closed:
            raise ClosedError("this Checkpointer is closed")
        return self._engine

    async def wait(self) -> None:
        """Wait until every capture and every due flush is done (``min_interval`` is waived).

        Raises:
            FlushError: a capture failed, or a tier's latest flush failed and nothing was committed to that tier since (each
                reported once; earlier failures of a tier that has recovered are only in ``counters`` and the log).
        """
        await self._open_engine().run(self._pipeline.wait())

    wait_sync = sync_twin(wait, _open_engine)

    async def restore_latest(self, template: Any = None, *, strict: bool = True, cast: bool = False, verify_first: bool = False) -> Restored | None:
        """Load the newest committed version that verifies, from whichever tier holds it; None when no tier holds one.

        With ``template`` (a state of the same structure), tensors are copied into its tensors in place, keeping their
        device; without, new CPU tensors are returned. Each chunk lands in the template as soon as it verified (no staging
        copy), so a version that fails half-way has written part of it: the next candidate overwrites that, and if none
        verifies this raises instead of returning None. ``verify_first=True`` keeps the template as it was until the whole
        version verified, staging every byte once more (docs/performance.md, "Restoring and resuming").

        The version may have been saved with another parallel layout: a template DTensor gets its own piece, whatever mesh
        and placements saved it and whatever mesh it has now, read from just the stored pieces that overlap it; a plain
        template tensor, or any tensor without a template, gets the whole global tensor. Values that are not DTensors come
        from the same rank of the saved job (rank 0's where it had fewer ranks). Collective under torch.distributed.

        ``strict``: a template tensor the version lacks is an error (else it is left as it is: :attr:`Restored.missing_keys`);
        tensors the version has and the template lacks come back as new ones (:attr:`Restored.unexpected_keys`). ``cast``:
        convert a saved dtype to the template's (else a differing dtype is an error naming the key).

        Raises:
            RestoreError: the template's tensors do not match the stored ones (global shape, dtype, kind), or ``strict``
                and template keys are missing; or a version verified that lacks template tensors a failed candidate wrote.
            CorruptCheckpointError: no version verifies and a failed one wrote into the template (never with ``verify_first``).
            NoCheckpointError: no version of the direction being trained can be restored while versions a rollback abandoned
                are held (they are not loaded in its place, nor left for retention to delete as a job starting over saves):
                names them; :meth:`restore` loads one.
        """
        return await self._restore(template, strict, cast, verify_first)

    restore_latest_sync = sync_twin(restore_latest, _open_engine)

    async def restore(
        self, step: int, template: Any = None, *, tier: str | None = None, strict: bool = True, cast: bool = False, verify_first: bool = False
    ) -> Restored:
        """Load step ``step``, exactly: from the fastest tier holding a copy that verifies, or from tier ``tier`` only.

        A copy that does not verify is logged as a warning (``tierckpt`` logger) and the next tier holding the step is
        tried; never another step. Otherwise as :meth:`restore_latest` (``template``, ``strict``, ``cast``,
        ``verify_first``; collective under torch.distributed). :meth:`versions` lists the steps there are to choose from.

        Raises:
            TypeError: ``step`` is not an int.
            ValueError: ``step`` is outside 0 to 10**12 - 1 (:meth:`restore_latest` loads the newest).
            NoCheckpointError: no tier (or not tier ``tier``) holds the step (under torch.distributed: for some rank);
                names the step and what each tier holds.
            CorruptCheckpointError: every copy of the step failed verification; names each failure.
            ConfigError: there is no tier named ``tier``.
            RestoreError: as :meth:`restore_latest`.
        """
        return await self._restore(template, strict, cast, verify_first, step, tier)

    restore_sync = sync_twin(restore, _open_engine)

    async def _restore(self, template: Any, strict: bool, cast: bool, verify_first: bool, step: int | None = None, tier: str | None = None) -> Any:
        engine, p = self._open_engine(), self._pipeline
        work = prepare_restore(
            self._group, p.tiers, p.memory, p.events, template, strict=strict, cast=cast, verify_first=verify_first, step=step, tier=tier,
            replicas_once=self.config.distributed.read_replicated == "once", direction=p.direction,
        )
        return await engine.run(work)

    async def metadata(self, step: int, *, tier: str | None = None) -> dict[str, Any]:
        """The metadata saved with step ``step`` (``save(metadata=...)``), read from this rank's copy's manifest on the
        fastest tier holding it (or on tier ``tier`` only), without reading a tensor. Not collective.

        Raises:
            TypeError: ``step`` is not an int.
            ValueError: ``step`` is outside 0 to 10**12 - 1.
            NoCheckpointError: no tier (or not tier ``tier``) holds this rank's copy of the step.
            CorruptCheckpointError: no copy's manifest verifies; names each.
            ConfigError: there is no tier named ``tier``.
        """
        return await self._open_engine().run(read_metadata(self._pipeline.tiers, step, tier, rank=self.rank, world=self.world_size))

    metadata_sync = sync_twin(metadata, _open_engine)

    def versions(self) -> list[VersionInfo]:
        """What each tier holds now: one :class:`VersionInfo` per committed version, per tier. ``abandoned``: saved in
        a direction that a save after a rollback left (docs/index.md, "Rolling back"); ``serial``: the number of the
        ``save()`` call that made it."""
        return self._open_engine().run_sync(self._versions())

    async def _versions(self) -> list[VersionInfo]:  # on the engine's thread, which changes what the tiers hold
        return marked(self._pipeline.versions())

    async def close(self) -> None:
        """Drain every pending flush, stop the engine and release host memory.

        Raises:
            FlushError: as :meth:`wait`; the Checkpointer is closed all the same.
        """
        await self._runtime.close()

    def close_sync(self) -> None:
        """Synchronous twin of :meth:`close`."""
        self._runtime.close_sync()

    @property
    def _closed(self) -> bool:
        return self._runtime.closed

    async def __aenter__(self) -> Checkpointer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_sync()

