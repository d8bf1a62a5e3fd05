"""Hugging Face ``transformers.Trainer`` through tierckpt: ``TierckptTrainer(..., tierckpt="tiers.yaml")``.

The seam is the Trainer's own checkpoint methods, overridden in a mixin (:class:`TierckptMixin`, put
before ``Trainer`` or a subclass of it such as TRL's ``SFTTrainer``): ``_save_checkpoint`` and the
four loaders ``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``, ``_load_scaler`` and
``_load_rng_state``. A ``TrainerCallback`` cannot replace a save (``on_save`` runs after the Trainer
wrote its files) and the Trainer does not save through accelerate's ``save_state`` hooks, so these
methods are the narrowest seam there is; each override keeps the parent's signature, and a
directory written by the stock Trainer still loads through the parent's code.

One save is one tierckpt step (``state.global_step``): the model's state dict, the optimizer, the LR
scheduler, the gradient scaler and the RNG states (Python, numpy, torch CPU and CUDA). Once it is
durable on the first tier below RAM that takes it, ``<output_dir>/checkpoint-N/`` appears, made
atomically (written aside, then renamed), holding ``trainer_state.json`` (the Trainer reads it
itself: global step, log history, callback states; the data position follows from the step) and
``tierckpt.json`` (the pointer naming the step). ``resume_from_checkpoint=True`` finds the newest such
directory, so after a crash it is one whose step can be restored; ``save_total_limit`` then prunes
the directories, and the tiers' ``keep`` rules prune the stored steps.

After a rollback (``resume_from_checkpoint=`` an earlier ``checkpoint-N``, then a save), the Trainer
would take the abandoned direction's higher ``checkpoint-M`` for the newest: once a save of the new
direction is durable and its directory written, each ``checkpoint-M`` whose step that direction left
(:class:`~tierckpt.integrations.saves.DurableSteps`) is renamed ``abandoned-checkpoint-M``, which
neither the Trainer's resume nor its rotation takes; ``resume_from_checkpoint=True`` does the same
first, and resumes the newest live step (docs/index.md, "Rolling back").

Under ``torchrun`` or ``accelerate launch`` (DDP), the Trainer calls these methods on every rank, and
every rank saves its part: the model, optimizer, scheduler and scaler states are the same on every
rank and stored once (``replicated=``, each rank writing its share); the RNG states are each rank's
own. Rank 0 writes ``checkpoint-N/`` once the step is committed on every rank; every rank loads the
step its pointer names and gets its own RNG states back.

A save returns before its host copy is done: the next step's forward and backward run beside the
copy, and only the optimizer's step (and the forward of a module holding saved buffers, such as
BatchNorm's) waits for it: the Checkpointer's lazy barrier, put on the optimizer and the model at
the first save. A callback that changes the saved tensors in place elsewhere (an EMA of the
weights) must call ``trainer.tierckpt_checkpointer.wait_captured()`` first.

Under FSDP (``fsdp=True``; ``fsdp_config={"version": 2}`` for FSDP2, else FSDP1), the model's and
the optimizer's state dicts are torch's sharded ones (``get_model_state_dict``,
``get_optimizer_state_dict``: DTensors, FSDP1's ``ShardedTensor``s as the DTensors of the same pieces,
the optimizer's keyed by parameter name): every rank stores its shards, and a resume restores into
the live sharded model and optimizer, resharded when the saving job had another number of ranks or
the other FSDP, then sets them (``set_model_state_dict``, ``set_optimizer_state_dict``). DeepSpeed
saves through accelerate's own code, and is refused.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from transformers import Trainer
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from tierckpt.config import Config
from tierckpt.errors import ConfigError, CorruptCheckpointError, NoCheckpointError, UnsupportedStateError
from tierckpt.integrations.pointer import aside_name, read_pointer, remove_leftovers, restore_named, write_pointer
from tierckpt.integrations.saves import DurableSaves, DurableSteps, holding_tensors, newest_live
from tierckpt.integrations.sharded_tensors import as_dtensors, with_originals

__all__ = ["ABANDONED_PREFIX", "POINTER_NAME", "TierckptMixin", "TierckptTrainer"]

POINTER_NAME = "tierckpt.json"
_REPLICATED = ("model", "optimizer", "scheduler", "scaler")  # the same on every rank under DDP
_CHECKPOINT_DIR = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
TRAINER_STATE_NAME = "trainer_state.json"
_ASIDE_PREFIX = ".tierckpt-dir-"  # a checkpoint-N being written, before its rename
# A checkpoint-N of a direction training left, renamed: neither the Trainer's resume (the regex
# _CHECKPOINT_DIR) nor its rotation (the glob "checkpoint-*") takes it.
ABANDONED_PREFIX = "abandoned-"
_EARLIER = "pass resume_from_checkpoint= the checkpoint-N directory of an earlier step"


class TierckptMixin:
    """Checkpoints of a ``transformers.Trainer`` through tierckpt's tiers (see the module docstring).

    ``tierckpt``: a tier config (a YAML path, a dict or a :class:`~tierckpt.config.Config`).
    """

    def __init__(self, *args: Any, tierckpt: Config | Mapping[str, Any] | str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        args_ = self.args  # type: ignore[attr-defined]
        if args_.load_best_model_at_end:
            raise ConfigError("TierckptTrainer does not support load_best_model_at_end yet: restore the step you want with Checkpointer.restore(step)")
        if args_.save_only_model:
            raise ConfigError("TierckptTrainer saves the whole training state; set save_only_model=False (or use save_model() for the weights)")
        # FSDP's sharded state dicts are DTensors (FSDP1's made so), which tierckpt stores and reshards itself.
        self._sharded = bool(getattr(self, "is_fsdp_enabled", False))
        if getattr(self, "is_deepspeed_enabled", False):
            raise ConfigError(
                "TierckptTrainer supports DDP (torchrun, accelerate launch) and FSDP across processes; DeepSpeed saves sharded "
                "states through accelerate's own code, which tierckpt does not replace. Use FSDP (fsdp=True) or DDP, or "
                "tierckpt's Checkpointer directly (it stores DTensor shards and reshards on load), or, for DeepSpeed outside the "
                "Trainer, tierckpt.integrations.deepspeed.attach on the engine deepspeed.initialize returns"
            )
        self.tierckpt_config = Config.coerce(tierckpt)
        self._tierckpt = DurableSaves(self.tierckpt_config, "TierckptTrainer")
        self._tierckpt_loaded: tuple[str, dict[str, Any]] | None = None
        self._meshes: dict[str, Any] = {}  # FSDP1's DTensor meshes, kept from save to save (sharded_tensors says why)

    @property
    def tierckpt_checkpointer(self) -> Any:
        """The open :class:`~tierckpt.Checkpointer` (opened on first use; collective under DDP/FSDP)."""
        return self._tierckpt.checkpointer

    # -- saving --------------------------------------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        trainer: Any = self
        step = trainer.state.global_step
        if trainer.hp_search_backend is None and trial is None:
            trainer.store_flos()
        run_dir = trainer._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        best_step = getattr(trainer.state, "best_global_step", None)  # recorded by evaluations (transformers >= 4.50)
        if best_step:
            trainer.state.best_model_checkpoint = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best_step}")
        # As the Trainer does: the stateful callbacks' and TrainerControl's state go into trainer_state.json.
        for cb in [cb for cb in trainer.callback_handler.callbacks + [trainer.control] if isinstance(cb, ExportableState)]:
            name = cb.__class__.__name__
            if isinstance(trainer.state.stateful_callbacks.get(name), list):
                trainer.state.stateful_callbacks[name].append(cb.state())
            else:
                trainer.state.stateful_callbacks[name] = cb.state()
        trainer_state = json.dumps(dataclasses.asdict(trainer.state), indent=2, sort_keys=True) + "\n"
        scaler = getattr(trainer.accelerator, "scaler", None)
        model_state, optimizer_state = as_dtensors(self._sharded_states(), meshes=self._meshes) if self._sharded else (
            trainer.accelerator.unwrap_model(trainer.model).state_dict(), trainer.optimizer.state_dict()
        )
        state = {
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": trainer.lr_scheduler.state_dict() if trainer.lr_scheduler is not None else None,
            "scaler": scaler.state_dict() if scaler is not None else None,
            "rng": _rng_states(),
        }
        limit, best = trainer.args.save_total_limit, trainer.state.best_model_checkpoint
        # The directory's contents also go with the step, so that a step that became durable but
        # whose directory a crash kept from being written is published at the next resume.
        metadata = {"hf_checkpoint": output_dir, "hf_trainer_state": trainer_state}
        try:
            # Under FSDP each rank's shards are its own: only the scheduler and the scaler are replicated.
            replicated = holding_tensors(state, _REPLICATED[2:] if self._sharded else _REPLICATED)
            # The lazy barrier: the next step's forward and backward run while the copy goes on; the
            # optimizer's step (and a forward that writes saved buffers) waits for it. The rest of
            # the state is the Trainer's own Python values, or tensors made for this save (RNG).
            # (It opens the Checkpointer at the first save, on every rank at once.)
            self._tierckpt.guard(_bare(trainer.optimizer), trainer.model_wrapped)
            ckpt, durable = self._tierckpt.checkpointer, self._tierckpt.durable_tiers  # kept: close() lets go of it before the last actions run

            def publish(tier: str) -> None:  # rank 0, once the step is durable
                _publish(output_dir, step, tier, trainer_state)
                # Before the rotation: it keeps the highest checkpoint-N, and would otherwise count an
                # abandoned direction's higher ones as the newest and delete the new direction's.
                _set_aside_abandoned(run_dir, step, DurableSteps.of(ckpt.versions(), durable))
                rotate_checkpoints(output_dir=run_dir, save_total_limit=limit, best_model_checkpoint=best, use_mtime=False)

            self._tierckpt.save(output_dir, step, state, publish, metadata=metadata, replicated=replicated, lazy=True)
        except UnsupportedStateError as exc:
            raise UnsupportedStateError(f"{exc}. tierckpt stores checkpoints without pickle: the optimizer, scheduler or scaler state must hold only numbers, strings, lists, dicts and tensors", key=exc.key) from exc

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's ``train``; once it ends, every checkpoint is durable and its directory written.

        With ``resume_from_checkpoint=True``, the newest live step a durable tier holds gets its
        directory first when it has none (saved by a job that died before writing it), and the
        directories of a direction a rollback left are set aside, so the Trainer resumes from it.
        """
        try:
            if resume_from_checkpoint is True:
                self._publish_newer(getattr(self, "args").output_dir)
                # Every rank then lists the same checkpoint-N directories (rank 0 published).
                getattr(self, "accelerator").wait_for_everyone()
            return super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]
        finally:
            self._tierckpt_loaded = None
            self._tierckpt.close()

    def _publish_newer(self, run_dir: str) -> None:
        """Before the Trainer takes the highest ``checkpoint-N`` of ``run_dir``: make that the newest
        live durable version's (rank 0; every rank opens the Checkpointer).

        The newest live version, not the highest step: after a rollback the new direction's steps
        are below the abandoned one's, and a job killed between a durable save and its directory (or
        the renames after it) left those higher directories in place. Its directory is written when
        missing, or when the one there holds another save's trainer state (the abandoned direction's
        save of the same step, whose save the tiers replaced); then the abandoned directories are
        renamed aside (:func:`_set_aside_abandoned`), as ``publish`` would have done."""
        ckpt = self._tierckpt.checkpointer
        if ckpt.rank != 0:  # the job's directory, written once; the metadata read below is not collective
            return
        versions, durable = ckpt.versions(), self._tierckpt.durable_tiers
        newest = newest_live(versions, durable)
        if newest is None:
            return
        # Its metadata alone, from its own tier's copy: its tensors are restored when the Trainer loads
        # (under FSDP, into shards that do not exist yet; a whole restore here would allocate the whole state).
        metadata = ckpt.metadata_sync(newest.step, tier=newest.tier)
        path, trainer_state = metadata.get("hf_checkpoint"), metadata.get("hf_trainer_state")
        if not isinstance(path, str) or not isinstance(trainer_state, str) or os.path.normpath(os.path.dirname(path)) != os.path.normpath(run_dir):
            return  # not a checkpoint of this output directory
        if _read_text(os.path.join(path, TRAINER_STATE_NAME)) != trainer_state:
            _publish(path, newest.step, newest.tier, trainer_state)
        _set_aside_abandoned(run_dir, newest.step, DurableSteps.of(versions, durable))

    def _sharded_states(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Under FSDP: the model's and the optimizer's state dicts as torch's distributed checkpointing
        gives them (FSDP2: DTensor shards, FSDP1: ShardedTensors; the optimizer's keyed by parameter
        name). For a fresh optimizer, that first gives it its states (zeros): a template to restore into."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        trainer: Any = self
        return get_model_state_dict(trainer.model_wrapped), get_optimizer_state_dict(trainer.model_wrapped, _bare(trainer.optimizer))

    # -- loading -------------------------------------------------------------------------------------

    def _stored(self, checkpoint: str) -> dict[str, Any] | None:
        """The tierckpt state that ``checkpoint`` (a directory) names, restored once per directory;
        None for a directory the stock Trainer wrote."""
        if not os.path.isfile(os.path.join(checkpoint, POINTER_NAME)):
            return None
        if self._tierckpt_loaded is None or self._tierckpt_loaded[0] != checkpoint:
            step = read_pointer(os.path.join(checkpoint, POINTER_NAME))
            ckpt = self._tierckpt.checkpointer
            if self._sharded:  # into the live shards (the model is wrapped and the optimizer made by now)
                # Under FSDP1, into its ShardedTensors through DTensors that share their shards, which
                # the state then holds again, for set_*_state_dict (sharded_tensors says why).
                originals: dict[int, Any] = {}
                model_state, optimizer_state = as_dtensors(self._sharded_states(), originals, self._meshes)
                template = {"model": model_state, "optimizer": optimizer_state}
                state = restore_named(ckpt, checkpoint, step, template, instead=_EARLIER).state
                state = state | with_originals({"model": state["model"], "optimizer": state["optimizer"]}, originals)
            else:
                state = restore_named(ckpt, checkpoint, step, instead=_EARLIER).state
            self._tierckpt_loaded = (checkpoint, state)
        return self._tierckpt_loaded[1]

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        stored = self._stored(resume_from_checkpoint)
        if stored is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        trainer: Any = self
        if self._sharded:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            set_model_state_dict(trainer.model_wrapped, stored["model"])
            return
        target = trainer.accelerator.unwrap_model(model if model is not None else trainer.model)
        target.load_state_dict(stored["model"])

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        stored = self._stored(checkpoint) if checkpoint is not None else None
        if stored is None:
            return super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        trainer: Any = self
        if self._sharded:
            from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

            set_optimizer_state_dict(trainer.model_wrapped, _bare(trainer.optimizer), stored["optimizer"])
        else:
            trainer.optimizer.load_state_dict(stored["optimizer"])
        if stored["scheduler"] is not None and trainer.lr_scheduler is not None:
            trainer.lr_scheduler.load_state_dict(stored["scheduler"])

    def _load_scaler(self, checkpoint: str | None) -> None:
        stored = self._stored(checkpoint) if checkpoint is not None else None
        if stored is None:
            return super()._load_scaler(checkpoint)  # type: ignore[misc]
        scaler = getattr(getattr(self, "accelerator"), "scaler", None)
        if stored["scaler"] is not None and scaler is not None:
            scaler.load_state_dict(stored["scaler"])

    def _load_rng_state(self, checkpoint: str | None) -> None:
        stored = self._stored(checkpoint) if checkpoint is not None else None
        if stored is None:
            return super()._load_rng_state(checkpoint)  # type: ignore[misc]
        _set_rng_states(stored["rng"])


class TierckptTrainer(TierckptMixin, Trainer):
    """``transformers.Trainer`` with its checkpoints through tierckpt: ``tierckpt=`` the tier config."""


def _publish(output_dir: str, step: int, tier: str, trainer_state: str) -> None:
    """Make ``output_dir`` (``checkpoint-N``) appear whole: written aside, then renamed into place.
    A directory already there (the same step saved again) is replaced. What a killed job left
    aside is removed."""
    parent, name = os.path.split(output_dir)
    os.makedirs(parent, exist_ok=True)
    remove_leftovers(parent, _ASIDE_PREFIX)
    aside = os.path.join(parent, aside_name(_ASIDE_PREFIX, name))
    shutil.rmtree(aside, ignore_errors=True)
    os.mkdir(aside)
    with open(os.path.join(aside, TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
        f.write(trainer_state)
        f.flush()
        os.fsync(f.fileno())
    write_pointer(os.path.join(aside, POINTER_NAME), step, tier)  # fsyncs its directory: aside
    if os.path.exists(output_dir):
        old = f"{aside}.old"
        os.rename(output_dir, old)
        os.rename(aside, output_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(aside, output_dir)
    _fsync_dir(parent)


def _set_aside_abandoned(run_dir: str, newest: int, steps: DurableSteps) -> None:
    """Rename each ``checkpoint-M`` of ``run_dir`` whose pointer names a step of a direction training
    left (``steps.left(M, newest)``; ``newest``: the live step just published) to
    ``abandoned-checkpoint-M``, replacing an older one of that name: the Trainer takes the highest
    ``checkpoint-M`` to resume from (and its rotation keeps the highest), and after a rollback the
    highest are the abandoned direction's. Renamed, not deleted: what it was stays to be looked at.
    Each rename is atomic (then the directory is fsynced): a crash leaves the directory in its place
    or under its new name. A directory the stock Trainer wrote (no pointer) is left alone."""
    for name, step in _pointer_dirs(run_dir):
        if steps.left(step, newest):
            _rename_aside(run_dir, name)


def _pointer_dirs(run_dir: str) -> list[tuple[str, int]]:
    """The ``checkpoint-M`` directories of ``run_dir`` holding a pointer, with the step it names (a
    damaged pointer is passed over: loading it names the damage)."""
    found = []
    for name in os.listdir(run_dir) if os.path.isdir(run_dir) else []:
        pointer = os.path.join(run_dir, name, POINTER_NAME)
        if _CHECKPOINT_DIR.match(name) and os.path.isfile(pointer):
            try:
                found.append((name, read_pointer(pointer)))
            except (CorruptCheckpointError, NoCheckpointError):  # damaged, or removed meanwhile
                continue
    return found


def _rename_aside(run_dir: str, name: str) -> None:
    target = os.path.join(run_dir, ABANDONED_PREFIX + name)
    old = None
    if os.path.lexists(target):  # a direction left at this step before: the newer one replaces it
        old = os.path.join(run_dir, aside_name(_ASIDE_PREFIX, f"{ABANDONED_PREFIX}{name}.old"))
        os.rename(target, old)
    os.rename(os.path.join(run_dir, name), target)
    _fsync_dir(run_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _bare(optimizer: Any) -> Any:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (torch's state-dict helpers
    step a fresh one to make its states, which must not go through accelerate's wrapper)."""
    return getattr(optimizer, "optimizer", optimizer)


def _rng_states() -> dict[str, Any]:
    python = random.getstate()
    numpy = np.random.get_state()
    assert isinstance(numpy, tuple)
    states: dict[str, Any] = {"python": python, "numpy": numpy, "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.random.get_rng_state_all()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    try:
        random.setstate(states["python"])
        np.random.set_state(states["numpy"])
        torch.random.set_rng_state(states["cpu"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"the stored RNG states cannot be set ({exc})") from exc
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.random.set_rng_state_all(states["cuda"])
