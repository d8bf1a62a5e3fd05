"""torchtitan: a checkpoint manager backed by tierckpt (torchtitan >= 0.3's pluggable ``BaseCheckpointManager``).

``TierckptCheckpointManager.Config(enable=True, interval=500, tiers="tiers.yaml")`` in place of the
trainer's ``checkpoint`` config. Every rank saves its own part: FSDP2/TP parameters and optimizer
moments as DTensor shards, replicated values once, the dataloader's position per rank. A restore
into another mesh reshards (see "Changing the parallel layout" in docs/distributed.md).

- ``save(curr_step, last_step)`` saves on ``interval``, the last step and, with
  ``enable_first_step_checkpoint``, step 1 (as torchtitan's DCP manager does). It returns at once:
  the host copy runs beside the next forward and backward.
- ``maybe_wait_for_staging()``, which torchtitan calls before ``optimizers.step()``, is the lazy
  barrier: it waits only for the copies the optimizer would overwrite (on CUDA, a stream wait).
- ``load(step)``: ``-1`` the newest step that verifies, else exactly that step, into the live model,
  optimizers, LR schedulers, dataloader and train state.
- Retention is the tiers' ``keep`` rules; ``keep_latest_k`` is not used.
- The dataloader's state is stored as its plain ``StatefulDataLoader`` state dict, not torchtitan's
  pickled bytes: nothing is unpickled on restore.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn
from torchdata.stateful_dataloader import StatefulDataLoader
from torchtitan.components.checkpointer.base import DATALOADER, LR_SCHEDULER, MODEL, OPTIMIZER, BaseCheckpointManager, ModelWrapper

from tierckpt.checkpointer import Checkpointer
from tierckpt.config import Config
from tierckpt.errors import ConfigError, RestoreError

__all__ = ["TierckptCheckpointManager"]

log = logging.getLogger("tierckpt")


class TierckptCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager, saving through tierckpt's tiers."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        tiers: str = ""
        """The tier config: a YAML file (docs/configuration.md)."""

        tiers_inline: dict[str, Any] = field(default_factory=dict)
        """The tier config inline (the YAML's mapping), instead of ``tiers``."""

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.save_future = None
        if bool(config.tiers) == bool(config.tiers_inline):
            raise ConfigError("TierckptCheckpointManager: give the tier config as exactly one of tiers (a YAML path) and tiers_inline")
        if config.initial_load_path or config.create_seed_checkpoint or config.last_save_in_hf:
            raise ConfigError(
                "TierckptCheckpointManager does not support initial_load_path, create_seed_checkpoint or last_save_in_hf "
                "yet: use torchtitan's DCP checkpoint manager for those"
            )
        self.interval, self.load_only = config.interval, config.load_only
        self.enable_first_step_checkpoint = config.enable_first_step_checkpoint
        self.last_save_model_only = config.last_save_model_only
        self.exclude_from_loading = list(config.exclude_from_loading)
        self.load_step = config.load_step
        self.states = dict(states)
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers, LR_SCHEDULER: lr_schedulers, DATALOADER: dataloader})
        self.states = {k: v for k, v in self.states.items() if v is not None}
        tiers: Any = config.tiers_inline or config.tiers  # a relative YAML path is relative to the working directory
        self.checkpointer = Checkpointer(Config.coerce(tiers))  # collective under torch.distributed

    def __del__(self) -> None:
        self.close()

    # -- the state --------------------------------------------------------------------------------------

    def _state(self, keys: list[str] | None = None) -> dict[str, Any]:
        return {k: _state_dict(v) for k, v in self.states.items() if keys is None or k in keys}

    # -- BaseCheckpointManager ------------------------------------------------------------------------

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if self.load_only:
            return False
        due = (curr_step == 1 and self.enable_first_step_checkpoint) or last_step or curr_step % self.interval == 0
        if not due:
            return False
        state = self._state([MODEL] if last_step and self.last_save_model_only else None)
        self.checkpointer.save_sync(curr_step, state)
        return True

    def _maybe_wait_for_staging(self) -> None:
        self.checkpointer.wait_captured()

    def _wait_for_saving(self) -> None:  # save_future is never set: saves are tracked by the Checkpointer
        self.save_future = None

    def _load(self, step: int = -1) -> bool:
        """Restore ``step`` (-1: the newest that verifies; the config's ``load_step`` when -1 is
        passed and it names one) into the live objects; False when there is nothing to restore."""
        step = self.load_step if step == -1 else step
        keys = [k for k in self.states if k not in self.exclude_from_loading]
        template = self._state(keys)
        # strict=False: a last step saved model-only lacks the rest, which is then left as it is.
        if step == -1:
            restored = self.checkpointer.restore_latest_sync(template, strict=False)
            if restored is None:
                return False
        else:
            restored = self.checkpointer.restore_sync(step, template, strict=False)
        missing_model = [k for k in restored.missing_keys if k.startswith(f"['{MODEL}']")]
        if missing_model:
            raise RestoreError(f"step {restored.step} lacks model keys the model has: {', '.join(missing_model[:5])}", step=restored.step)
        state = restored.state
        for key in keys:
            if key in state and isinstance(state[key], dict):
                _load_state_dict(self.states[key], state[key])
            else:
                log.info("tierckpt: step %d holds no %s (a model-only checkpoint): left as it is", restored.step, key)
        return True

    def _close(self) -> None:
        ckpt = getattr(self, "checkpointer", None)
        if ckpt is not None:
            ckpt.close_sync()  # drains every flush; a second close does nothing


def _state_dict(value: Any) -> Any:
    # torchtitan's dataloader pickles its StatefulDataLoader state into bytes; store the plain dict.
    if isinstance(value, StatefulDataLoader):
        return StatefulDataLoader.state_dict(value)
    return value.state_dict()


def _load_state_dict(value: Any, state: dict[str, Any]) -> None:
    if isinstance(value, StatefulDataLoader):
        StatefulDataLoader.load_state_dict(value, state)
    else:
        value.load_state_dict(state)
