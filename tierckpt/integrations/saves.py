"""What every trainer integration needs: one Checkpointer, and an action once each save is durable.

A trainer names a checkpoint by a path (Lightning's ``ModelCheckpoint`` file, Hugging Face's
``checkpoint-N`` directory). The integrations write what stands at that path (a pointer naming the
step, :mod:`tierckpt.integrations.pointer`) only once the step is durable on the first tier below
host memory that takes it, in the order the saves were made, from one background thread: after a
crash, every path a trainer finds names a step that can be restored.

Under torch.distributed every rank saves through its own DurableSaves (one Checkpointer per rank,
the same steps on every rank: the Checkpointer's save is collective). A step counts as durable once
it is committed on every rank, and only rank 0 runs the action: the paths are the job's, written
once.

After a rollback (docs/index.md, "Rolling back") the paths of the direction given up still name
their steps, higher than the new saves': :class:`DurableSteps` tells an integration which of them
to set aside once a save of the new direction is durable.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from dataclasses import dataclass
from collections.abc import Collection, Mapping
from typing import Any, Callable, Sequence

import torch

from tierckpt.checkpointer import Checkpointer, SaveHandle
from tierckpt.config import Config
from tierckpt.errors import FlushError
from tierckpt.tiers.base import VersionInfo

__all__ = ["DurableSaves", "DurableSteps", "holding_tensors", "newest_live"]

log = logging.getLogger("tierckpt")

_DURABLE = ("filesystem", "object")  # tier types whose copy outlives the process


@dataclass
class _Pending:
    key: str
    step: int
    handle: SaveHandle
    seq: int
    then: Callable[[str], None]


class DurableSaves:
    """Saves through one Checkpointer (opened on first use, in the process that trains), each with an
    action run once the step is durable: ``then(tier)``, on a background thread, in save order, on
    rank 0 only.

    Under torch.distributed the first use opens the Checkpointer, which is collective: every rank
    must make its first save (or load) at the same point, as trainers do.

    ``who``: the integration's name, for error messages.
    """

    def __init__(self, config: Config, who: str) -> None:
        self.config, self.who = config, who
        self._durable = [t.name for t in config.tiers if t.type in _DURABLE]
        self._ckpt: Checkpointer | None = None
        self._leads = True  # rank 0 of the Checkpointer's ranks (a single process is): it runs the actions
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}  # key -> its newest save whose action has not run yet
        self._removed: dict[str, int] = {}  # key -> seq of the newest save before cancel(key)
        # key -> the step of its newest save by this process, its action run or not: on a rank that does
        # not run the actions, a save can be durable before the lead rank has written its pointer.
        self._saved: dict[str, int] = {}
        # step -> its newest save. A trainer may save one step under several keys (a top-k file,
        # then last.ckpt): each save replaces the version, so only the newest one commits, for every key.
        self._newest: dict[int, SaveHandle] = {}
        self._seq = itertools.count()
        self._guarded: dict[int, tuple[Any, Any]] = {}  # id(target) -> (target, its barrier hooks) on the open Checkpointer

    @property
    def checkpointer(self) -> Checkpointer:
        """The open Checkpointer (opened on first use)."""
        if self._ckpt is None:
            self._ckpt = Checkpointer(self.config)
            self._leads = self._ckpt.rank == 0
            self._thread = threading.Thread(target=self._run, name="tierckpt-durable-actions", daemon=True)
            self._thread.start()
        return self._ckpt

    @property
    def durable_tiers(self) -> list[str]:
        """The tiers whose copy of a step counts as durable: those below host memory that outlive the
        process (the first tier when the config has none), as the actions are run for."""
        return list(self._durable) or [self.config.tiers[0].name]

    def guard(self, *targets: Any) -> None:
        """Put the Checkpointer's lazy barrier on ``targets`` (optimizers: their step waits for a save's
        host copy; modules: the forward of those holding saved buffers), once while it is open; close()
        takes it off. Saves may then return before their copy is done (``save(lazy=True)``)."""
        ckpt = self.checkpointer
        for target in targets:
            if id(target) not in self._guarded:
                self._guarded[id(target)] = (target, ckpt.attach(target))

    def wait_captured(self) -> None:
        """The lazy barrier as a call, for a trainer that runs its forward and backward inside the
        optimizer's step (a closure): before the update, not before the step. Nothing when no
        Checkpointer is open."""
        if self._ckpt is not None:
            self._ckpt.wait_captured()

    def save(self, key: str, step: int, state: Any, then: Callable[[str], None], metadata: dict[str, Any] | None = None,
             replicated: Sequence[Any] = (), lazy: bool = False) -> bool:
        """Save ``state`` as ``step``; return once it is captured (the trainer may then change the
        live tensors), or with ``lazy`` at once, the copy going on while the trainer computes: only for
        a state that nothing but the :meth:`guard`-ed targets changes in place. False when the save
        was skipped (``host.on_full: skip``). ``replicated``: the values the same on every rank
        (``Checkpointer.save``), stored once."""
        ckpt = self.checkpointer
        # Under the lock: a save of a step replaces the one before it at once, and the thread, finding
        # that one passed over, must then see this one as the step's newest.
        with self._lock:
            handle = ckpt.save_sync(step, state, metadata=metadata, replicated=replicated)
            if handle.skipped:
                return False
            self._newest[step] = handle
        if not lazy:
            handle.captured_sync()
        item = _Pending(key, step, handle, next(self._seq), then)
        with self._lock:
            self._pending[key] = item
            self._saved[key] = step
        self._queue.put(item)
        return True

    def saved_step(self, key: str) -> int | None:
        """The step of ``key``'s newest save by this process (durable or not yet, its pointer written
        or not yet), unless cancelled since; None when this process has saved none under ``key``."""
        with self._lock:
            return self._saved.get(key)

    def cancel(self, key: str, also: Callable[[], None] = lambda: None) -> None:
        """No action for the saves of ``key`` made so far; ``also()`` under the same lock (removing
        what an earlier action wrote, so that none can run in between)."""
        with self._lock:
            item = self._pending.pop(key, None)
            if item is not None:
                self._removed[key] = item.seq
            self._saved.pop(key, None)
            also()

    def close(self) -> None:
        """Wait until every save is durable and its action ran; close the Checkpointer (the next
        use opens a new one)."""
        ckpt, thread = self._ckpt, self._thread
        if ckpt is None:
            return
        self._ckpt = self._thread = None
        self._queue.put(None)
        failed: Exception | None = None
        try:
            # Every due flush now, min_interval waived (as close() waives it): the waits for durability
            # below end once the tiers have the saves, not once a held-back flush is due (up to
            # min_interval later, at every trainer's teardown).
            ckpt.wait_sync()
        except Exception as exc:  # raised after the actions of what did become durable
            failed = exc
        try:
            if thread is not None:
                thread.join()
        finally:
            guarded, self._guarded = self._guarded, {}
            for _, hooks in guarded.values():
                hooks.remove()
            ckpt.close_sync()
        if failed is not None:
            raise failed

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                tier, handle = self._durable_on(item)
                with self._lock:
                    if self._newest.get(item.step) is handle:
                        del self._newest[item.step]
                    if tier is not None and item.seq > self._removed.get(item.key, -1) and self._leads:
                        item.then(tier)
                    if self._pending.get(item.key) is item:
                        del self._pending[item.key]
            except Exception:  # one failed action must not stop the ones after it
                log.exception("tierckpt: %s: finishing checkpoint %s (step %d) failed", self.who, item.key, item.step)

    def _durable_on(self, item: _Pending) -> tuple[str | None, SaveHandle]:
        """The first tier below host memory that commits ``item``'s step (the memory tier's name when
        the config has none below it), None when none does; and the save that got there."""
        handle = item.handle
        if not self._durable:
            return self.config.tiers[0].name, handle
        while True:
            for tier in self._durable:
                try:
                    if handle.committed_sync(tier):
                        return tier, handle
                except FlushError as exc:
                    log.warning("tierckpt: %s: checkpoint %s (step %d) did not reach tier %r: %s", self.who, item.key, item.step, tier, exc)
            with self._lock:
                newer = self._newest.get(item.step, handle)
            if newer is handle:
                break
            handle = newer  # a newer save of the same step replaced this one: its commit counts
        log.warning("tierckpt: %s: checkpoint %s (step %d) reached no durable tier; nothing is written at its path", self.who, item.key, item.step)
        return None, handle


@dataclass(frozen=True)
class DurableSteps:
    """Which steps the durable tiers hold live and which only abandoned (the rule:
    :mod:`tierckpt.format.lineage`), from one ``Checkpointer.versions()``: what decides whether a
    trainer's path (a pointer naming a step) belongs to a direction training left."""

    live: frozenset[int]
    abandoned: frozenset[int]

    @classmethod
    def of(cls, versions: Sequence[VersionInfo], durable: Collection[str]) -> DurableSteps:
        """From ``versions`` (``Checkpointer.versions()``: its verdicts look at every tier), those on the ``durable`` tiers."""
        held = [v for v in versions if v.tier in durable]
        return cls(frozenset(v.step for v in held if not v.abandoned), frozenset(v.step for v in held if v.abandoned))

    def left(self, step: int, newest: int) -> bool:
        """Whether a path naming ``step`` is of a direction training left, seen once the live step
        ``newest`` (a save just made durable, or the newest live one) is durable: no durable tier
        holds a live version of ``step``, and one holds an abandoned one, or none holds it and it
        lies above ``newest``. (A live direction's steps grow with its saves, so a step above the
        newest live one was saved before it and is not its ancestor; the tiers' retention keeps
        ``keep.abandoned`` abandoned versions only, and may have deleted it.)"""
        return step not in self.live and (step in self.abandoned or step > newest)


def newest_live(versions: Sequence[VersionInfo], durable: Collection[str]) -> VersionInfo | None:
    """The newest live version on the ``durable`` tiers (the highest serial, then step, whose record
    verified and that is not abandoned): what a restart resumes, whatever higher steps an abandoned
    direction left; None when they hold none."""
    live = [v for v in versions if v.tier in durable and v.valid and not v.abandoned]
    return max(live, key=lambda v: (v.serial, v.step), default=None)


def holding_tensors(state: Mapping[str, Any], keys: Sequence[str]) -> list[str]:
    """The ``keys`` of ``state`` under which a tensor lies: what a trainer may pass as ``replicated=``,
    which must name no value without tensors (an optimizer without state yet, an LR scheduler)."""
    return [k for k in keys if _has_tensor(state.get(k))]


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, Mapping):
        return any(_has_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_tensor(v) for v in value)
    return False
