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

import logging
import os
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from tierckpt.checkpointer import Checkpointer
from tierckpt.config import Config
from tierckpt.errors import UnsupportedStateError
from tierckpt.integrations.pointer import read_pointer, write_pointer
from tierckpt.integrations.saves import DurableSaves

__all__ = ["TierckptCheckpointIO"]

log = logging.getLogger("tierckpt")

NO_PICKLE_HINT = (
    "tierckpt stores checkpoints without pickle; for Lightning's hyper_parameters, pass save_hyperparameters() "
    "values that are numbers, strings, lists, dicts or tensors, or leave the others out with "
    "save_hyperparameters(ignore=[...]); for callback state, return such values from the callback's state_dict()"
)


class TierckptCheckpointIO(CheckpointIO):
    """Lightning's checkpoint I/O through tierckpt's tiers.

    ``config``: a tier config (a YAML path, a dict or a :class:`~tierckpt.config.Config`), checked
    here, so a wrong one fails when the Trainer is built. The Checkpointer itself is opened on the
    first save or load, in the process that trains.
    """

    def __init__(self, config: Config | Mapping[str, Any] | str | os.PathLike[str]) -> None:
        super().__init__()
        self.config = Config.coerce(config)
        self._saves = DurableSaves(self.config, "TierckptCheckpointIO")

    @property
    def checkpointer(self) -> Checkpointer:
        """The open Checkpointer (opened on first use)."""
        return self._saves.checkpointer

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` as step ``checkpoint["global_step"]``; returns once it is captured."""
        if storage_options is not None:
            raise TypeError(f"TierckptCheckpointIO.save_checkpoint takes no storage_options (got {storage_options!r}): the tier config says where and how")
        step = checkpoint.get("global_step")
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"a Lightning checkpoint without a global_step (got {step!r}): tierckpt stores it as that step")
        key = os.fspath(path)
        try:
            saved = self._saves.save(key, step, _plain(checkpoint), lambda tier: write_pointer(key, step, tier), metadata={"lightning_path": key})
        except UnsupportedStateError as exc:
            raise UnsupportedStateError(f"{exc}. {NO_PICKLE_HINT}", key=exc.key) from exc
        if not saved:
            log.warning("tierckpt: Lightning checkpoint %s (step %d) was skipped: the host memory was full (host.on_full)", key, step)

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint saved at ``path``: ``restore(step)`` of the step its pointer names (or, while
        the pointer waits for durability, of the step saved there), as new CPU tensors.

        Raises:
            NoCheckpointError: nothing was saved at ``path``, or the tiers no longer hold its step.
            CorruptCheckpointError: ``path`` is not a pointer file, or every copy of its step is damaged.
        """
        key = os.fspath(path)
        if map_location is not None and not isinstance(map_location, (str, torch.device)):
            raise TypeError(f"TierckptCheckpointIO.load_checkpoint: map_location must be a device or a device name, not {type(map_location).__name__}")
        step = self._saves.pending_step(key)
        state = self.checkpointer.restore_sync(read_pointer(key) if step is None else step).state
        return _to(state, torch.device(map_location)) if map_location is not None else state

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the pointer at ``path`` (and cancel one waiting to be written). The step stays on the
        tiers until their retention drops it."""
        key = os.fspath(path)
        self._saves.cancel(key, lambda: Path(key).unlink(missing_ok=True))

    def teardown(self) -> None:
        """Wait until every save is durable and its pointer written; close the Checkpointer."""
        self._saves.close()


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
