"""The Lightning model the tests share (tests/test_lightning.py), and a job of several processes:
``python lightning_worker.py <root> <config.json> <max_steps> <strategy> <kill at step or 0> <ckpt_path or none>``.

``strategy``: ``ddp``, ``fsdp`` (``ModelParallelStrategy``, the model's layers sharded with FSDP2) or
``fsdp1`` (``FSDPStrategy``: ``tierckpt.testing.lightning_cpu.CpuFSDPStrategy`` on CPU, the strategy itself with ``ACCELERATOR=cuda``),
run by ``launch_ranks`` (each process a rank, as torchrun starts them); or ``ddp_spawn``, run as one
process (Lightning starts the workers). In the environment: ``HIDDEN``, the model's width (16), and
``DEVICES``, the number of ranks (2), ``LAZY`` (set: the plugin's saves are lazy), ``EXIT_AFTER_FIT`` (set: rank 0 lists ``ckpts`` into ``after-fit.json`` right after ``fit()``, then every rank returns), and ``KILL_RANKS``, the ranks the kill step kills (all), and ``KILL_IN_SAVE`` (set: kill while the
Trainer dumps the step's first checkpoint, before this rank saves it). Each rank writes ``<root>/result-<rank>.json``: its losses by
step and its final weights (whole tensors); rank 0 writes ``<root>/weights-<step>.json`` at each save.
With a kill step, every rank SIGKILLs itself at the start of the batch after that step's checkpoint
was saved.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from tierckpt.testing.ranks import end_job

import helpers

BATCHES = 8  # per epoch (per rank under DDP: each rank takes every other batch of 2 x BATCHES)
EVERY = BATCHES  # steps between checkpoints under DDP: at the end of each epoch (Lightning resumes a plain
# DataLoader at the start of an epoch, so only such checkpoints resume bitwise, with or without tierckpt)


class Tiny(L.LightningModule):
    def __init__(self, hidden: int = 16, lr: float = 0.05, extra: Any = None, batches: int = BATCHES) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.losses: dict[int, float] = {}

    def configure_model(self) -> None:
        mesh = self._device_mesh  # set under ModelParallelStrategy only
        if mesh is None:
            return
        from torch.distributed.fsdp import fully_shard

        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh["data_parallel"])
        fully_shard(self.net, mesh=mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.losses[self.global_step] = loss.item()
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
        return [opt], [{"scheduler": sched, "interval": "step"}]

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.hparams.batches * 8, 4, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True) + 0.1 * x[:, :1] ** 2), batch_size=8)


def _strategy(name: str, devices: int) -> Any:
    if name == "fsdp":
        return ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
    if name == "fsdp1":
        from tierckpt.testing.lightning_cpu import CpuFSDPStrategy

        return FSDPStrategy() if os.environ.get("ACCELERATOR") == "cuda" else CpuFSDPStrategy()
    return name


class KillAfterSave(Callback):
    """SIGKILL this rank at the start of the batch after step ``step``: its checkpoint was saved
    (captured) at the end of the batch before, and may or may not be durable yet."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step and not os.environ.get("KILL_IN_SAVE"):
            self._kill(trainer)

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if trainer.global_step == self.step and os.environ.get("KILL_IN_SAVE"):  # before this rank's save of the step
            self._kill(trainer)

    def _kill(self, trainer: Any) -> None:
        ranks = os.environ.get("KILL_RANKS")  # e.g. "1": only that rank dies (default: every rank)
        if ranks is None or str(trainer.global_rank) in ranks.split(","):
            os.kill(os.getpid(), signal.SIGKILL)


def whole_weights(module: nn.Module, strategy: Any = None) -> dict[str, Any]:
    """The module's weights as lists, gathered whole (collective: every rank calls it); under
    FSDPStrategy, from the wrapped model."""
    return helpers.whole_weights(module, strategy.model if isinstance(strategy, FSDPStrategy) else None)


class WeightsAtSaves(Callback):
    """Rank 0 writes the whole weights of each step a checkpoint holds."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        weights = whole_weights(pl_module, trainer.strategy)
        if trainer.global_rank == 0:
            (self.root / f"weights-{trainer.global_step}.json").write_text(json.dumps(weights))


def main(root: Path, config: dict[str, Any], max_steps: int, strategy: str, kill_at: int, ckpt_path: str) -> None:
    from tierckpt.integrations.lightning import TierckptCheckpointIO

    if strategy != "ddp_spawn":  # started by launch_ranks, as torchrun would: Lightning takes the ranks as they are
        os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    devices = int(os.environ.get("DEVICES", "2"))
    root.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0, verbose=False)
    model = Tiny(hidden=int(os.environ.get("HIDDEN", "16")), batches=2 * BATCHES)
    callbacks: list[Callback] = [ModelCheckpoint(dirpath=root / "ckpts", every_n_train_steps=EVERY, save_top_k=-1, save_last=True), WeightsAtSaves(root)]
    if kill_at:
        callbacks.append(KillAfterSave(kill_at))
    trainer = L.Trainer(
        max_steps=max_steps, accelerator=os.environ.get("ACCELERATOR", "cpu"), devices=devices, logger=False,
        strategy=_strategy(strategy, devices), enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root, plugins=[TierckptCheckpointIO(config, lazy=bool(os.environ.get("LAZY")))], callbacks=callbacks,
    )
    trainer.fit(model, ckpt_path=None if ckpt_path == "none" else ckpt_path)
    if os.environ.get("EXIT_AFTER_FIT"):  # as a training script ends: what fit() left, seen right when it returned
        if trainer.global_rank == 0:
            listed = sorted(p.name for p in (root / "ckpts").iterdir() if not p.name.startswith("."))
            (root / "after-fit.json").write_text(json.dumps(listed))
        return
    # ddp_spawn: this is the main process, the model holds the weights the workers handed back
    rank = "main" if strategy == "ddp_spawn" else trainer.global_rank
    weights = whole_weights(model, trainer.strategy)
    (root / f"result-{rank}.json").write_text(json.dumps({"losses": model.losses, "weights": weights}))


if __name__ == "__main__":
    root, config = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    main(root, config, int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), sys.argv[6])
    end_job()  # before the interpreter's exit: FSDP on gloo aborts there otherwise (pytorch#190489)
