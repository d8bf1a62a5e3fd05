"""Lightning: ``Trainer(plugins=[TierckptCheckpointIO("tiers.yaml")])`` is all a user adds.

Lightning hands every checkpoint to its ``CheckpointIO`` plugin as a dict and a path. Here the dict
becomes a tierckpt save of step ``checkpoint["global_step"]``, and the path a pointer file naming that
step (:mod:`tierckpt.integrations.pointer`), so ``ModelCheckpoint`` (top-k by path, ``last.ckpt``
found by listing its directory) and ``trainer.fit(ckpt_path=...)`` work unchanged.

- ``save_checkpoint`` returns once the state is captured in host memory: the optimizer may then
  change the parameters that ``model.state_dict()`` put in the dict. The rest flows down the tiers
  in the background. With ``lazy=True`` it returns at once, the host copy going on while the next
  step's forward and backward run; the optimizers' update (and the forward of modules with persistent
  buffers) waits for it: the Checkpointer's lazy barrier. Lightning runs the forward and backward
  inside ``optimizer.step(closure)``, so the optimizers wait not in a step pre-hook but at
  ``on_before_optimizer_step``, after the closure (:mod:`~tierckpt.integrations.lightning_ranks`).
- The pointer is written once the step is durable on the first tier below host memory that takes it
  (then the next, if that one passes it over or fails), so after a crash every pointer, ``last.ckpt``
  included, names a step that can be restored. Until then, a load of that path in this process is
  served from whichever tier holds the step.
- ``teardown()`` (Lightning calls it at the end of ``fit``/``test``; under the sharded strategies,
  whose own teardown skips it, theirs calls it) waits until every save is durable and its pointer
  written, then closes the Checkpointer; the next use opens a new one.
- ``remove_checkpoint`` removes the pointer; the step stays on the tiers until their retention
  drops it. The tiers' retention decides what is stored; a pointer whose step it dropped loads as a
  ``NoCheckpointError`` naming what the tiers hold.
- After a rollback (``fit(ckpt_path=`` an earlier step's file``)``, then saves), ``last.ckpt`` and
  the other ``last*.ckpt`` files Lightning resolves ``ckpt_path="last"`` from (by their time) must
  not name the direction given up: once each save is durable, before its own pointer is written, a
  ``last*.ckpt`` pointer whose step that direction left
  (:class:`~tierckpt.integrations.saves.DurableSteps`) is rewritten to name the new step. So a job
  killed between the rollback's first durable save and its own ``last.ckpt`` (the last file is
  written after the top-k one), or a copy that reset the files' times, still resumes the new
  direction. The top-k files are left: each names its step, and loading one loads that step.

Under ``strategy="ddp"`` (and ``ddp_spawn``, ``ddp_fork``) every rank saves. Lightning hands a
checkpoint to its ``CheckpointIO`` on rank 0 only, while a Checkpointer of several ranks saves with
every rank (each writes its share, in parallel). So at ``setup`` a callback
(:mod:`tierckpt.integrations.lightning_ranks`, which Lightning loads for every Trainer through its
``lightning.pytorch.callbacks_factory`` entry point) routes the strategy's ``save_checkpoint`` to this
plugin on every rank. The model's and the optimizers' states are the same on every rank under DDP:
they are stored once (``replicated=``), each rank writing its share of every tensor. Rank 0 writes
the pointer once the step is committed on every rank; every rank loads a path (Lightning calls the
plugin's ``load_checkpoint`` on every rank) and gets the same step.

Under ``ModelParallelStrategy`` (FSDP2 and tensor parallelism, ``save_distributed_checkpoint=True``,
its default) the strategy's state dicts hold DTensors: each rank stores its shards (a shard held alike
by several ranks once), and the strategy's ``load_checkpoint`` is routed here too: the live sharded
model and optimizers are the template (``get_model_state_dict``/``get_optimizer_state_dict``), so a
job of another world size or layout reshards on load, then ``set_model_state_dict`` and
``set_optimizer_state_dict`` put the values in place, as the strategy's own DCP load does. Under the
older ``FSDPStrategy`` (FSDP1), whatever its ``state_dict_type``, the strategy's state dicts are
torch's sharded ones too (the same functions: its ``ShardedTensor``s as the DTensors of the same
pieces, :mod:`tierckpt.integrations.sharded_tensors`), saved and loaded the same way: a checkpoint of
either FSDP loads into the other, on any number of ranks. DeepSpeed saves through a format of its own
and is refused.

A dict without ``global_step`` is not a training checkpoint but Lightning handing weights from its
worker to the main process (``ddp_spawn``): it goes through Lightning's own ``TorchCheckpointIO``, and
a file that is not a pointer but a ``torch.save`` archive (that hand-off, or a checkpoint written
before switching to tierckpt) loads as Lightning loads it, through ``torch.load(weights_only=True)``,
whose restricted unpickler runs no code.
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
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy, Strategy

from tierckpt.checkpointer import Checkpointer
from tierckpt.config import Config
from tierckpt.errors import ConfigError, CorruptCheckpointError, NoCheckpointError, UnsupportedStateError
from tierckpt.integrations.pointer import read_pointer, restore_named, write_pointer
from tierckpt.integrations.saves import DurableSaves, DurableSteps, holding_tensors
from tierckpt.integrations.sharded_tensors import as_dtensors, with_originals

__all__ = ["TierckptCheckpointIO"]

log = logging.getLogger("tierckpt")

_EARLIER = "pass ckpt_path= the checkpoint of an earlier step"  # when the step a path names cannot be restored
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

    ``lazy``: a save returns before its host copy is done; the optimizers' next update (and the
    forward of modules that hold persistent buffers) waits for it, so the next step's forward and
    backward run beside the copy. Off by default: a callback that changes in place, before that
    update, a tensor it put in the checkpoint would change the saved step too; such a callback calls
    ``plugin.checkpointer.wait_captured()`` first. It takes effect once the plugin is attached to
    the strategy (:mod:`~tierckpt.integrations.lightning_ranks`'s callback does it at ``setup``, and
    makes the update wait); until then a save waits for its copy.
    """

    def __init__(self, config: Config | Mapping[str, Any] | str | os.PathLike[str], *, lazy: bool = False) -> None:
        super().__init__()
        self.config = Config.coerce(config)
        self.lazy = lazy
        # The Trainer's, once attached: a sharded one's loads restore into its live shards; with lazy, its model takes the barrier.
        self._strategy: Strategy | None = None
        self._saves = DurableSaves(self.config, "TierckptCheckpointIO")
        self._replicated: tuple[str, ...] = ()  # the checkpoint's keys whose values are the same on every rank (DDP)
        self._every_rank = False  # the strategy hands every rank's checkpoint to this plugin
        self._strategy_teardown: Any = None  # the sharded strategy's own teardown (which skips this plugin's)
        self._meshes: dict[str, Any] = {}  # FSDP1's DTensor meshes, kept from save to save (sharded_tensors says why)

    def attach(self, strategy: Strategy) -> None:
        """Have ``strategy`` hand its checkpoints to this plugin on every rank (called on every rank
        at ``setup`` by :class:`~tierckpt.integrations.lightning_ranks.EveryRankSaves`).

        Raises:
            ConfigError: a strategy of several processes that saves through a format of its own
                (DeepSpeed, XLA), or ``ModelParallelStrategy`` gathering whole states on rank 0
                (``save_distributed_checkpoint=False``).
        """
        self._strategy = strategy
        if isinstance(strategy, (ModelParallelStrategy, FSDPStrategy)):  # even on one process: their own loads read their own formats
            if isinstance(strategy, ModelParallelStrategy) and not getattr(strategy, "_save_distributed_checkpoint", True):
                raise ConfigError(
                    "TierckptCheckpointIO under ModelParallelStrategy stores each rank's shards: leave "
                    "save_distributed_checkpoint=True (the default); tierckpt's export gathers whole tensors offline"
                )
            if isinstance(strategy, FSDPStrategy) and vars(strategy).get("optimizer_state") != self._optimizer_shards:
                # Its own state dicts are gathered on rank 0 ("full") or ShardedTensors of FSDP's own
                # keys ("sharded"): torch's sharded ones instead, as ModelParallelStrategy's are.
                strategy.lightning_module_state_dict = self._model_shards  # type: ignore[method-assign]
                strategy.optimizer_state = self._optimizer_shards  # type: ignore[method-assign]
            self._replicated = ()  # DTensor shards held alike by several ranks are stored once without being named
            if vars(strategy).get("load_checkpoint") != self._load_sharded:
                strategy.load_checkpoint = self._load_sharded  # type: ignore[method-assign]
            if vars(strategy).get("teardown") != self._teardown_sharded:
                # Their teardown() never calls their checkpoint I/O's (Strategy.teardown does): without
                # this, a job that ends right after fit() would end before its last saves' pointers.
                self._strategy_teardown = strategy.teardown
                strategy.teardown = self._teardown_sharded  # type: ignore[method-assign]
        elif isinstance(strategy, SingleDeviceStrategy) or getattr(strategy, "world_size", 1) <= 1:
            return
        elif not isinstance(strategy, DDPStrategy) or isinstance(strategy, DeepSpeedStrategy) or type(strategy).save_checkpoint is not Strategy.save_checkpoint:
            outside = (" (or, for DeepSpeed outside Lightning, tierckpt.integrations.deepspeed.attach on the engine deepspeed.initialize returns)"
                       if isinstance(strategy, DeepSpeedStrategy) else "")
            raise ConfigError(
                f"TierckptCheckpointIO supports Lightning's DDP strategies (ddp, ddp_spawn, ddp_fork), FSDPStrategy and "
                f"ModelParallelStrategy (FSDP2, tensor parallelism) across processes; {type(strategy).__name__} saves sharded "
                f"states in a format of its own, which tierckpt does not replace. Use FSDPStrategy or ModelParallelStrategy, or strategy='ddp'{outside}"
            )
        else:
            self._replicated = ("state_dict", "optimizer_states")
        if vars(strategy).get("save_checkpoint") != self._save_on_this_rank:
            # Lightning's Strategy.save_checkpoint calls the CheckpointIO on rank 0 only (and
            # ModelParallelStrategy's writes DCP files): this one reaches the plugin on every rank
            # (Trainer.save_checkpoint runs on every rank).
            strategy.save_checkpoint = self._save_on_this_rank  # type: ignore[method-assign]
        self._every_rank = True

    def _teardown_sharded(self) -> None:
        """The sharded strategies' ``teardown``: this plugin's (every save durable, its pointer written,
        the Checkpointer closed), then the strategy's own."""
        try:
            self.teardown()
        finally:
            self._strategy_teardown()

    def _model_shards(self) -> dict[str, Any]:
        """FSDPStrategy's ``lightning_module_state_dict``: torch's sharded state dict of the model."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        assert self._strategy is not None and self._strategy.model is not None
        return as_dtensors(get_model_state_dict(self._strategy.model), meshes=self._meshes)

    def _optimizer_shards(self, optimizer: Any) -> dict[str, Any]:
        """FSDPStrategy's ``optimizer_state``: torch's sharded state dict of ``optimizer``, keyed by parameter name."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        assert self._strategy is not None and self._strategy.model is not None
        return as_dtensors(get_optimizer_state_dict(self._strategy.model, _bare(optimizer)), meshes=self._meshes)

    def _load_sharded(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """The sharded strategies' ``load_checkpoint``: the step restored into the live sharded model
        and optimizers (resharded when the saving job's layout differs), then set into them."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
        )

        strategy = self._strategy
        assert strategy is not None and strategy.model is not None and strategy.lightning_module is not None
        key = os.fspath(checkpoint_path)
        saved = self._saves.saved_step(key)
        step = read_pointer(key) if saved is None else saved
        model = strategy.model
        optimizers = [_bare(o) for o in strategy.optimizers]
        # get_optimizer_state_dict gives a fresh optimizer its states (zeros) first: every moment has a
        # sharded template to restore into. Under FSDP1 the restore writes into its ShardedTensors
        # through DTensors that share their shards; those are set (sharded_tensors says why).
        originals: dict[int, Any] = {}
        template = as_dtensors({"state_dict": get_model_state_dict(model), "optimizer_states": [get_optimizer_state_dict(model, o) for o in optimizers]}, originals, self._meshes)
        state = restore_named(self.checkpointer, key, step, template, instead=_EARLIER, strict=False).state
        sharded = with_originals({"state_dict": state["state_dict"], "optimizer_states": state.get("optimizer_states", [])}, originals)
        strict = strategy.lightning_module.strict_loading
        set_model_state_dict(model, sharded["state_dict"], options=StateDictOptions(strict=strict))
        for optimizer, optimizer_state in zip(optimizers, sharded["optimizer_states"]):
            set_optimizer_state_dict(model, optimizer, optimizer_state)
        return state

    def __getstate__(self) -> dict[str, Any]:
        # ddp_spawn pickles the Trainer, this plugin with it, into each worker: the config goes; the
        # worker opens its own Checkpointer.
        return {"config": self.config, "lazy": self.lazy}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["config"], lazy=state.get("lazy", False))  # type: ignore[misc]

    def _save_on_this_rank(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        self.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @property
    def checkpointer(self) -> Checkpointer:
        """The open Checkpointer (opened on first use)."""
        return self._saves.checkpointer

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` as step ``checkpoint["global_step"]``; returns once it is captured (with
        ``lazy``, at once: the strategy's optimizers and model wait for the copy)."""
        if storage_options is not None:
            raise TypeError(f"TierckptCheckpointIO.save_checkpoint takes no storage_options (got {storage_options!r}): the tier config says where and how")
        if "global_step" not in checkpoint:  # not a training checkpoint: ddp_spawn's hand-off of weights
            TorchCheckpointIO().save_checkpoint(checkpoint, path)
            return
        step = checkpoint["global_step"]
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"a Lightning checkpoint with global_step {step!r}: tierckpt stores it as that step, a whole number")
        if _world_size() > 1 and not self._every_rank:
            raise ConfigError(
                "TierckptCheckpointIO under several processes needs every rank to save, and Lightning called it on this "
                "rank only: its callback did not attach to the strategy. It is loaded through the "
                "lightning.pytorch.callbacks_factory entry point of an installed tierckpt (pip install -e .); without "
                "one, add callbacks=[tierckpt.integrations.lightning_ranks.EveryRankSaves()] to the Trainer"
            )
        key = os.fspath(path)
        strategy = self._strategy if self.lazy else None
        if strategy is not None and strategy.model is not None:  # before the save: the barrier must hold the next forward
            self._saves.guard(strategy.model)  # the optimizers wait in before_optimizer_step
        ckpt, durable = self.checkpointer, self._saves.durable_tiers  # kept: close() lets go of it before the last actions run

        def written(tier: str) -> None:  # rank 0, once the step is durable
            # The last files first: a kill between the two leaves them naming the new step.
            _repoint_left_last(Path(key), step, tier, DurableSteps.of(ckpt.versions(), durable))
            write_pointer(key, step, tier)

        try:
            saved = self._saves.save(key, step, _plain(checkpoint), written,
                                     metadata={"lightning_path": key}, replicated=holding_tensors(checkpoint, self._replicated),
                                     lazy=strategy is not None)
        except UnsupportedStateError as exc:
            raise UnsupportedStateError(f"{exc}. {NO_PICKLE_HINT}", key=exc.key) from exc
        if not saved:
            log.warning("tierckpt: Lightning checkpoint %s (step %d) was skipped: the host memory was full (host.on_full)", key, step)

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint saved at ``path``: ``restore(step)`` of the step its pointer names (or, while
        the pointer waits for durability, of the step saved there), as new CPU tensors. Under several
        processes every rank calls it (Lightning does) and gets the same step. A ``torch.save`` file
        (ddp_spawn's hand-off, a checkpoint from before tierckpt) loads with ``torch.load(weights_only=True)``.

        Raises:
            NoCheckpointError: nothing was saved at ``path``, or the tiers no longer hold its step.
            CorruptCheckpointError: ``path`` is neither a pointer file nor a ``torch.save`` file, or
                every copy of its step is damaged.
        """
        key = os.fspath(path)
        if map_location is not None and not isinstance(map_location, (str, torch.device)):
            raise TypeError(f"TierckptCheckpointIO.load_checkpoint: map_location must be a device or a device name, not {type(map_location).__name__}")
        if _is_torch_archive(key):  # written by Lightning's own I/O: loaded as Lightning does, without running code
            state = TorchCheckpointIO().load_checkpoint(key, weights_only=True)
        else:
            step = self._saves.saved_step(key)
            step = read_pointer(key) if step is None else step
            state = restore_named(self.checkpointer, key, step, instead=_EARLIER).state
        return _to(state, torch.device(map_location)) if map_location is not None else state

    def before_optimizer_step(self) -> None:
        """With ``lazy``, wait for the host copies of the saves made so far (Lightning's
        ``on_before_optimizer_step``: after the closure's forward and backward, before the update)."""
        if self.lazy:
            self._saves.wait_captured()

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the pointer at ``path`` (and cancel one waiting to be written). The step stays on the
        tiers until their retention drops it."""
        key = os.fspath(path)
        self._saves.cancel(key, lambda: Path(key).unlink(missing_ok=True))

    def teardown(self) -> None:
        """Wait until every save is durable and its pointer written; close the Checkpointer."""
        self._saves.close()


def _repoint_left_last(saved: Path, step: int, tier: str, steps: DurableSteps) -> None:
    """Beside ``saved`` (the path of a save of ``step``, now durable on ``tier``), rewrite each
    ``last*.ckpt`` pointer naming a step of a direction training left (``steps.left``) to name
    ``step``: Lightning resolves ``ckpt_path="last"`` to the newest such file by its time, and one
    left from before a rollback names the direction given up. ``saved`` itself is written by its own
    action; a symlink (``save_last="link"``) follows its target; files that are not pointers are left."""
    for other in saved.parent.iterdir() if saved.parent.is_dir() else ():
        if other.name == saved.name or not _names_last(other.name) or other.is_symlink():
            continue
        try:
            named = read_pointer(other)
        except (CorruptCheckpointError, NoCheckpointError):  # a torch.save file, a directory, or removed meanwhile
            continue
        if steps.left(named, step):
            write_pointer(other, step, tier)


def _names_last(name: str) -> bool:
    """Whether Lightning's ``ckpt_path="last"`` may resolve to a file of this name: ``last.ckpt``,
    ``last-v1.ckpt``, ... (its ``_find_last_checkpoints``; before Lightning 2.5 any name holding "last")."""
    return name.startswith(ModelCheckpoint.CHECKPOINT_NAME_LAST) and name.endswith(ModelCheckpoint.FILE_EXTENSION)


def _bare(optimizer: Any) -> Any:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _is_torch_archive(path: str) -> bool:
    """Whether ``path`` is a file ``torch.save`` wrote (a zip archive; a pointer is JSON)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"PK\x03\x04"
    except OSError:
        return False  # missing, or a directory: read_pointer says which


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
