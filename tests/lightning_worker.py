"""The Lightning model the tests share (tests/test_lightning.py), and a job of several processes:
``python lightning_worker.py <root> <config.json> <max_steps> <strategy> <kill at step or 0> <ckpt_path or none>``.

``HIDDEN`` in the environment: the model's width (16). Run by ``launch_ranks`` (``strategy`` ``ddp``: each process a rank, as torchrun starts them), or as one
process (``ddp_spawn``: Lightning starts the workers). Each rank writes ``<root>/result-<rank>.json``:
its losses by step and its final weights. With a kill step, every rank SIGKILLs itself at the start
of the batch after that step's checkpoint was saved.
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
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

BATCHES = 8  # per epoch (per rank under DDP: each rank takes every other batch of 2 x BATCHES)
EVERY = BATCHES  # steps between checkpoints under DDP: at the end of each epoch (Lightning resumes a plain
# DataLoader at the start of an epoch, so only such checkpoints resume bitwise, with or without tierckpt)


class Tiny(L.LightningModule):
    def __init__(self, hidden: int = 16, lr: float = 0.05, extra: Any = None, batches: int = BATCHES) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.losses: dict[int, float] = {}

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


class KillAfterSave(Callback):
    """SIGKILL this rank at the start of the batch after step ``step``: its checkpoint was saved
    (captured) at the end of the batch before, and may or may not be durable yet."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main(root: Path, config: dict[str, Any], max_steps: int, strategy: str, kill_at: int, ckpt_path: str) -> None:
    from tierckpt.integrations.lightning import TierckptCheckpointIO

    if strategy == "ddp":  # started by launch_ranks, as torchrun would: Lightning takes the ranks as they are
        os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    L.seed_everything(0, verbose=False)
    model = Tiny(hidden=int(os.environ.get("HIDDEN", "16")), batches=2 * BATCHES)
    callbacks: list[Callback] = [ModelCheckpoint(dirpath=root / "ckpts", every_n_train_steps=EVERY, save_top_k=-1, save_last=True)]
    if kill_at:
        callbacks.append(KillAfterSave(kill_at))
    trainer = L.Trainer(
        max_steps=max_steps, accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root, plugins=[TierckptCheckpointIO(config)], callbacks=callbacks,
    )
    trainer.fit(model, ckpt_path=None if ckpt_path == "none" else ckpt_path)
    # ddp_spawn: this is the main process, the model holds the weights the workers handed back
    rank = trainer.global_rank if strategy == "ddp" else "main"
    weights = {k: v.tolist() for k, v in model.state_dict().items()}
    (root / f"result-{rank}.json").write_text(json.dumps({"losses": model.losses, "weights": weights}))


if __name__ == "__main__":
    root, config = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    main(root, config, int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), sys.argv[6])
