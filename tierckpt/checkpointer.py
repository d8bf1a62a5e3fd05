"""The public entry point: :class:`Checkpointer`, the facade over the parts :mod:`tierckpt.runtime` assembles."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Callable, Mapping, Sequence

import msgpack
import torch

from tierckpt.capture.barrier import attach
from tierckpt.capture.views import moment
from tierckpt.config import Config
from tierckpt.errors import ClosedError, ConfigError
from tierckpt.handle import SaveHandle
from tierckpt.pipeline import Counters, SaveRequest
from tierckpt.ranks import RankGroup
from tierckpt.restore import Restored, restore_agreed, restore_latest, restore_step
from tierckpt.runtime import TierFactory, assemble
from tierckpt.snapshot import LayoutCache
from tierckpt.state import survey
from tierckpt.tiers.base import Tier, VersionInfo
from tierckpt.tiers.encoding import TierEncoding

__all__ = ["Checkpointer", "SaveHandle", "TierFactory"]

log = logging.getLogger("tierckpt")

_MAX_STEP = 10**12 - 1  # directory names carry 12 digits


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
            Checkpointer at the same point, and so are ``restore_latest`` and ``close`` (docs/distributed.md,
            "Distributed training"). Without ``torch.distributed`` initialized, this is one process.
        tier_factory: builds a tier below host memory from its config (return None for the default); for tests and
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
        peer = any(t.type == "peer" for t in self.config.tiers)
        local = any(t.scope == "node" for t in self.config.tiers)
        self._group = RankGroup.discover(
            group, self.config.distributed.timeout_s, bulk=peer or local, find_nodes=local, nodes=self.config.distributed.nodes
        )
        self._layouts = LayoutCache(self._group.ranks if self._group else (0,))
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
            self._runtime.learn_peer_versions()
        if local:
            self._runtime.learn_node_versions()

    def _build(self, tier_factory: TierFactory | None, clock: Callable[[], float]) -> None:
        self._runtime = runtime = assemble(self.config, self._group, tier_factory, clock)
        assert runtime.pool is not None and runtime.copier is not None and runtime.pipeline is not None and runtime.engine is not None
        self._pool, self._copier, self._pipeline, self._engine = runtime.pool, runtime.copier, runtime.pipeline, runtime.engine

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
        """Whether the host pool is page-locked for CUDA copies (``host.pinned``; False without CUDA).

        The pool is pinned slot by slot in the background after construction: this waits until that
        is over.
        """
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
        compression = {t.name: e.stats for t in self._pipeline.tiers if isinstance(e := getattr(t, "encoding", None), TierEncoding)}
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
        return attach(target, self.wait_captured)

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
        request = self._prepare(step, state, metadata, replicated)
        try:
            tracker = await self._engine.run(self._pipeline.save(request))
        finally:
            request.handoff.caller_done()  # starts the copies, off the engine (Handoff says why)
        return SaveHandle(tracker)

    def save_sync(
        self, step: int, state: Any, *, metadata: Mapping[str, Any] | None = None, replicated: Sequence[Any] = ()
    ) -> SaveHandle:
        """Synchronous twin of :meth:`save`."""
        request = self._prepare(step, state, metadata, replicated)
        try:
            tracker = self._engine.run_sync(self._pipeline.save(request))
        finally:
            request.handoff.caller_done()
        return SaveHandle(tracker)

    def _prepare(self, step: int, state: Any, metadata: Mapping[str, Any] | None, replicated: Sequence[Any] = ()) -> SaveRequest:
        self._check_open()
        if type(step) is not int or not 0 <= step <= _MAX_STEP:
            raise ValueError(f"step must be an int from 0 to {_MAX_STEP}, got {step!r}")
        meta = dict(metadata or {})
        try:
            msgpack.packb(meta, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as exc:
            raise TypeError(f"metadata must hold only msgpack types (str, int, float, bool, None, bytes, lists, dicts): {exc}") from exc
        found = survey(state)
        entries, nbytes = self._layouts.entries(found, replicated)
        return SaveRequest(step, found.values, entries, nbytes, found.skeleton, meta, moment(found))

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

    async def restore_latest(
        self, template: Any = None, *, strict: bool = True, cast: bool = False, verify_first: bool = False
    ) -> Restored | None:
        """Load the newest committed version that verifies, from whichever tier holds it.

        With ``template`` (a state of the same structure), tensors are copied into the template's
        tensors in place, keeping their device; otherwise new CPU tensors are returned. Each chunk
        lands in the template as soon as it verified (read into the tier threads' reused buffers,
        checked, copied). A version that fails verification half-way has then written part of the
        template: the next candidate overwrites it, and if none verifies this raises instead of
        returning None. ``verify_first=True`` keeps the template as it was until the whole version
        verified, at the cost of staging every byte once more (docs/performance.md, "Restoring and resuming"). Returns None
        when no tier holds a version.

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
                kind), or ``strict`` and template keys are missing from the version; or a version
                verified that lacks template tensors which a failed candidate had partly written.
            CorruptCheckpointError: no version verifies, and a failed one had written into the
                template (never with ``verify_first``).
        """
        self._check_open()
        return await self._engine.run(self._restore(template, strict, cast, verify_first))

    def restore_latest_sync(
        self, template: Any = None, *, strict: bool = True, cast: bool = False, verify_first: bool = False
    ) -> Restored | None:
        self._check_open()
        return self._engine.run_sync(self._restore(template, strict, cast, verify_first))

    async def restore(
        self, step: int, template: Any = None, *, tier: str | None = None, strict: bool = True, cast: bool = False, verify_first: bool = False
    ) -> Restored:
        """Load step ``step``, exactly: from the fastest tier holding a copy that verifies, or from
        tier ``tier`` only. A copy that does not verify is logged as a warning (``tierckpt`` logger)
        and the next tier holding the step is tried; never another step. Otherwise as :meth:`restore_latest` (``template``,
        ``strict``, ``cast``, ``verify_first``; collective under torch.distributed). :meth:`versions`
        lists the steps there are to choose from.

        Raises:
            NoCheckpointError: no tier (or not tier ``tier``) holds the step (under
                torch.distributed: for some rank); names the step and what each tier holds.
            CorruptCheckpointError: every copy of the step failed verification; names each failure.
            ConfigError: there is no tier named ``tier``.
            RestoreError: as :meth:`restore_latest`.
        """
        self._check_open()
        return await self._engine.run(self._restore(template, strict, cast, verify_first, self._checked_step(step), self._named(tier)))

    def restore_sync(
        self, step: int, template: Any = None, *, tier: str | None = None, strict: bool = True, cast: bool = False, verify_first: bool = False
    ) -> Restored:
        self._check_open()
        return self._engine.run_sync(self._restore(template, strict, cast, verify_first, self._checked_step(step), self._named(tier)))

    @staticmethod
    def _checked_step(step: Any) -> int:
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"restore(step): step must be an int, not {type(step).__name__}")
        if step < 0:
            raise ValueError(f"restore(step): step must be >= 0, not {step} (restore_latest() loads the newest)")
        return step

    def _named(self, tier: str | None) -> list[Tier] | None:
        if tier is None:
            return None
        found = [t for t in self._pipeline.tiers if t.name == tier]
        if not found:
            raise ConfigError(f"restore(tier={tier!r}): there is no such tier (the tiers are {', '.join(t.name for t in self._pipeline.tiers)})")
        return found

    async def _restore(
        self, template: Any, strict: bool, cast: bool, verify_first: bool, step: int | None = None, only: list[Tier] | None = None
    ) -> Any:
        tiers = self._pipeline.tiers if only is None else only
        listed = self._pipeline.tiers
        memory = self._pipeline.memory
        if self._group is not None:
            work = restore_agreed(
                self._group, tiers, template, memory, strict=strict, cast=cast, verify_first=verify_first, only=step, listed=listed
            )
        elif step is not None:
            work = restore_step(tiers, step, template, memory, strict=strict, cast=cast, verify_first=verify_first, listed=listed)
        else:
            work = restore_latest(tiers, template, memory, strict=strict, cast=cast, verify_first=verify_first)
        # Faulting the host pool in the background would take cores from the restore, which every
        # rank of the job waits for: it waits until the restore is over.
        with self._pool.paused():
            return await work

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
