"""Lightning: ``Trainer(plugins=[TierckptCheckpointIO("tiers.yaml")])`` is all a user adds.

Lightning hands every checkpoint to its ``CheckpointIO`` plugin as a dict and a path. Here the dict
becomes a tierckpt save of step ``checkpoint["global_step"]``, and the path a pointer file naming that
step (:mod:`tierckpt.integrations.pointer`), so ``ModelCheckpoint`` (top-k by path, ``last.ckpt``
found by listing its directory) and ``trainer.fit(ckpt_path=...)`` work unchanged.

- ``save_checkpoint`` returns once the state is captured in host memory: the optimizer may then
  change the parameters that ``model.state_dict()`` put in the dict. The rest flows down the tiers
  in the background.
- The pointer is written once the step is durable on the first tier below host memory that takes it
  (then the next, if that one passes it over or fails), so after a crash every pointer, ``last.ckpt``
  included, names a step that can be restored. Until then, a load of that path in this process is
  served from whichever tier holds the step.
- ``teardown()`` (Lightning calls it at the end of ``fit``/``test``) waits until every save is
  durable and its pointer written, then closes the Checkpointer; the next use opens a new one.
- ``remove_checkpoint`` removes the pointer; the step stays on the tiers until their retention
  drops it. The tiers' retention decides what is stored; a pointer whose step it dropped loads as a
  ``NoCheckpointError`` naming what the tiers hold.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from tierckpt.checkpointer import Checkpointer, SaveHandle
from tierckpt.config import Config
from tierckpt.errors import ConfigError, FlushError, UnsupportedStateError
from tierckpt.integrations.pointer import read_pointer, write_pointer

__all__ = ["TierckptCheckpointIO"]

log = logging.getLogger("tierckpt")

_DURABLE = ("filesystem", "object")  # tier types whose copy outlives the process


@dataclass
class _Pending:
    path: str
    step: int
    handle: SaveHandle
    seq: int


class TierckptCheckpointIO(CheckpointIO):
    """Lightning's checkpoint I/O through tierckpt's tiers.

    ``config``: a tier config (a YAML path, a dict or a :class:`~tierckpt.config.Config`), checked
    here, so a wrong one fails when the Trainer is built. The Checkpointer itself is opened on the
    first save or load, in the process that trains.
    """

    def __init__(self, config: Config | Mapping[str, Any] | str | os.PathLike[str]) -> None:
        super().__init__()
        self.config = Config.coerce(config)
        self._durable = [t.name for t in self.config.tiers if t.type in _DURABLE]
        self._ckpt: Checkpointer | None = None
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}  # path -> its newest save whose pointer is not written yet
        self._removed: dict[str, int] = {}  # path -> seq of the last save before remove_checkpoint(path)
        # step -> its newest save. Lightning saves one step under several paths (a top-k file, then
        # last.ckpt): each save replaces the version, so only the newest one commits, for every path.
        self._newest: dict[int, SaveHandle] = {}
        self._seq = itertools.count()

    @property
    def checkpointer(self) -> Checkpointer:
        """The open Checkpointer (opened on first use)."""
        if self._ckpt is None:
            if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
                raise ConfigError(
                    "TierckptCheckpointIO runs in a single process for now: Lightning saves from rank 0 only, "
                    "while a Checkpointer under torch.distributed saves with every rank. Use tierckpt's "
                    "Checkpointer directly in multi-process jobs"
                )
            self._ckpt = Checkpointer(self.config)
            self._thread = threading.Thread(target=self._write_pointers, name="tierckpt-lightning-pointers", daemon=True)
            self._thread.start()
        return self._ckpt

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` as step ``checkpoint["global_step"]``; returns once it is captured."""
        if storage_options is not None:
            raise TypeError(f"TierckptCheckpointIO.save_checkpoint takes no storage_options (got {storage_options!r}): the tier config says where and how")
        step = checkpoint.get("global_step")
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"a Lightning checkpoint without a global_step (got {step!r}): tierckpt stores it as that step")
        ckpt = self.checkpointer
        key = os.fspath(path)
        state = _plain(checkpoint)
        try:
            # Under the lock: a save of a step replaces the one before it at once, and the pointer
            # thread, finding that one passed over, must then see this one as the step's newest.
            with self._lock:
                handle = ckpt.save_sync(step, state, metadata={"lightning_path": key})
                if not handle.skipped:
                    self._newest[step] = handle
        except UnsupportedStateError as exc:
            raise UnsupportedStateError(
                f"{exc}. tierckpt stores checkpoints without pickle; for Lightning's hyper_parameters, pass "
                "save_hyperparameters() values that are numbers, strings, lists, dicts or tensors, or leave the "
                "others out with save_hyperparameters(ignore=[...]); for callback state, return such values "
                "from the callback's state_dict()",
                key=exc.key,
            ) from exc
        if handle.skipped:
            log.warning("tierckpt: Lightning checkpoint %s (step %d) was skipped: the host memory was full (host.on_full)", key, step)
            return
        handle.captured_sync()  # the training loop may change the live tensors from here on
        item = _Pending(key, step, handle, next(self._seq))
        with self._lock:
            self._pending[key] = item
        self._queue.put(item)

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint saved at ``path``: ``restore(step)`` of the step its pointer names (or, while
        the pointer waits for durability, of the step saved there), as new CPU tensors.

        Raises:
            NoCheckpointError: nothing was saved at ``path``, or the tiers no longer hold its step.
            CorruptCheckpointError: ``path`` is not a pointer file, or every copy of its step is damaged.
        """
        key = os.fspath(path)
        with self._lock:
            item = self._pending.get(key)
        step = item.step if item is not None else read_pointer(key)
        state = self.checkpointer.restore_sync(step).state
        if map_location is not None and not isinstance(map_location, (str, torch.device)):
            raise TypeError(f"TierckptCheckpointIO.load_checkpoint: map_location must be a device or a device name, not {type(map_location).__name__}")
        return _to(state, torch.device(map_location)) if map_location is not None else state

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the pointer at ``path`` (and cancel one waiting to be written). The step stays on the
        tiers until their retention drops it."""
        key = os.fspath(path)
        with self._lock:
            item = self._pending.pop(key, None)
            if item is not None:
                self._removed[key] = item.seq
            Path(key).unlink(missing_ok=True)

    def teardown(self) -> None:
        """Wait until every save is durable and its pointer written; close the Checkpointer."""
        ckpt, thread = self._ckpt, self._thread
        if ckpt is None:
            return
        self._ckpt = self._thread = None
        self._queue.put(None)
        try:
            if thread is not None:
                thread.join()
        finally:
            ckpt.close_sync()

    def _write_pointers(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                tier, handle = self._durable_on(item)
                with self._lock:
                    if self._newest.get(item.step) is handle:
                        del self._newest[item.step]
                    if tier is not None and item.seq > self._removed.get(item.path, -1):
                        write_pointer(item.path, item.step, tier)
                    if self._pending.get(item.path) is item:
                        del self._pending[item.path]
            except Exception:  # a pointer that cannot be written must not stop the ones after it
                log.exception("tierckpt: writing the Lightning checkpoint pointer %s (step %d) failed", item.path, item.step)

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
                    log.warning("tierckpt: Lightning checkpoint %s (step %d) did not reach tier %r: %s", item.path, item.step, tier, exc)
            with self._lock:
                newer = self._newest.get(item.step, handle)
            if newer is handle:
                break
            handle = newer  # a newer save of the same step replaced this one: its commit counts
        log.warning("tierckpt: Lightning checkpoint %s (step %d) reached no durable tier; its pointer is not written", item.path, item.step)
        return None, handle


def _plain(value: Any) -> Any:
    """``value`` with mappings of other types (Lightning's ``AttributeDict`` of hyperparameters) as
    plain dicts; OrderedDicts (state dicts) stay OrderedDicts."""
    if isinstance(value, OrderedDict):
        return OrderedDict((k, _plain(v)) for k, v in value.items())
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(_plain(v) for v in value)
    return value


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, OrderedDict):
        return OrderedDict((k, _to(v, device)) for k, v in value.items())
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [_to(v, device) for v in value]
    if isinstance(value, tuple):
        return tuple(_to(v, device) for v in value)
    return value
