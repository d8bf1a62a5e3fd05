"""The callback that makes every rank of a Lightning DDP job save through :class:`TierckptCheckpointIO`.

Lightning hands a checkpoint to its ``CheckpointIO`` plugin on rank 0 only; a Checkpointer of several
ranks saves with every rank. A plugin cannot reach the other ranks by itself (Lightning gives it no
handle on the strategy), so this callback does at ``setup``, on every rank:
:meth:`TierckptCheckpointIO.attach`. Lightning adds it to every Trainer through the
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
    plugin to the Trainer's strategy; nothing for another checkpoint I/O."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        from tierckpt.integrations.lightning import TierckptCheckpointIO  # only Trainers that use it pay the import

        io = trainer.strategy.checkpoint_io
        if isinstance(io, TierckptCheckpointIO):
            io.attach(trainer.strategy)


def lightning_callbacks() -> list[Callback]:
    """The ``lightning.pytorch.callbacks_factory`` entry point: the callbacks Lightning adds to every Trainer."""
    return [EveryRankSaves()]
