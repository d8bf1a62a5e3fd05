"""The callback that makes every rank of a Lightning DDP job save through :class:`TierckptCheckpointIO`.

Lightning hands a checkpoint to its ``CheckpointIO`` plugin on rank 0 only; a Checkpointer of several
ranks saves with every rank. A plugin cannot reach the other ranks by itself (Lightning gives it no
handle on the strategy), so this callback does at ``setup``, on every rank:
:meth:`TierckptCheckpointIO.attach`. It also holds a lazy plugin's optimizer updates until the host
copies are done (:meth:`TierckptCheckpointIO.before_optimizer_step`). Lightning adds it to every Trainer through the
``lightning.pytorch.callbacks_factory`` entry point of an installed tierckpt; it does nothing when the
Trainer's checkpoint I/O is another one. Without the entry point (tierckpt on ``PYTHONPATH`` only),
pass it yourself: ``Trainer(callbacks=[EveryRankSaves()], plugins=[TierckptCheckpointIO(...)])``.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback

__all__ = ["EveryRankSaves", "lightning_callbacks"]


class EveryRankSaves(Callback):
    """At ``setup`` (every rank, after the processes joined), attach a :class:`TierckptCheckpointIO`
    plugin to the Trainer's strategy; then, before each optimizer update, let a lazy plugin wait for
    its saves' host copies. Nothing for another checkpoint I/O."""

    def __init__(self) -> None:
        self._io: Any = None  # the Trainer's TierckptCheckpointIO, once set up

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        from tierckpt.integrations.lightning import TierckptCheckpointIO  # only Trainers that use it pay the import

        io = trainer.strategy.checkpoint_io
        if isinstance(io, TierckptCheckpointIO):
            io.attach(trainer.strategy)
            self._io = io

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        # Lightning calls it after the closure (forward, backward) that optimizer.step() runs, before the update.
        if self._io is not None:
            self._io.before_optimizer_step()


def lightning_callbacks() -> list[Callback]:
    """The ``lightning.pytorch.callbacks_factory`` entry point: the callbacks Lightning adds to every Trainer."""
    return [EveryRankSaves()]
