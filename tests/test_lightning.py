"""Lightning through TierckptCheckpointIO: a real lightning.Trainer on CPU, stopped and resumed."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from tierckpt import Checkpointer, CorruptCheckpointError, NoCheckpointError, UnsupportedStateError
from tierckpt.integrations.lightning import TierckptCheckpointIO

from helpers import fs_tier, tier_config

BATCHES = 8  # per epoch

# Lightning's own warnings about this torch and this tiny setup (pytest turns warnings into errors).
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),
]


class Tiny(L.LightningModule):
    def __init__(self, hidden: int = 16, lr: float = 0.05, extra: Any = None) -> None:
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
        x = torch.randn(BATCHES * 8, 4, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True) + 0.1 * x[:, :1] ** 2), batch_size=8)


def _trainer(root: Path, max_steps: int, plugin: TierckptCheckpointIO | None, **checkpointing: Any) -> L.Trainer:
    callbacks = [ModelCheckpoint(dirpath=root / "ckpts", **checkpointing)] if checkpointing else []
    return L.Trainer(
        max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root, plugins=[plugin] if plugin else None,
        callbacks=callbacks, enable_checkpointing=bool(checkpointing),
    )


def _losses(root: Path, max_steps: int, plugin: TierckptCheckpointIO | None = None, ckpt_path: Any = None, **checkpointing: Any) -> dict[int, float]:
    L.seed_everything(0, verbose=False)
    model = Tiny()
    _trainer(root, max_steps, plugin, **checkpointing).fit(model, ckpt_path=ckpt_path)
    return model.losses


@pytest.fixture
def config(tmp_path: Path) -> dict[str, Any]:
    return tier_config(fs_tier("nvme", tmp_path / "nvme", keep={"last": 10}))


def test_a_stopped_run_resumed_from_last_or_any_checkpoint_matches_an_uninterrupted_one(tmp_path: Path, config: dict[str, Any]) -> None:
    whole = _losses(tmp_path / "whole", 4 * BATCHES)
    assert sorted(whole) == list(range(4 * BATCHES))

    run = tmp_path / "run"
    first = _losses(run, 2 * BATCHES, TierckptCheckpointIO(config), every_n_train_steps=BATCHES, save_top_k=-1, save_last=True)
    assert first == {s: whole[s] for s in range(2 * BATCHES)}
    saved = sorted(os.listdir(run / "ckpts"))
    assert saved == ["epoch=0-step=8.ckpt", "epoch=1-step=16.ckpt", "last.ckpt"], saved
    # Each path is a small JSON pointer naming a step the tier holds (teardown at the end of fit waited
    # for durability): no torch.save file anywhere.
    pointers = {name: json.loads((run / "ckpts" / name).read_text()) for name in saved}
    assert {name: (p["step"], p["tier"]) for name, p in pointers.items()} == {
        "epoch=0-step=8.ckpt": (8, "nvme"), "epoch=1-step=16.ckpt": (16, "nvme"), "last.ckpt": (16, "nvme")}
    assert sorted(os.listdir(tmp_path / "nvme")) == ["step-000000000008", "step-000000000016"]

    resumed = _losses(run, 4 * BATCHES, TierckptCheckpointIO(config), ckpt_path="last", every_n_train_steps=BATCHES, save_top_k=-1, save_last=True)
    assert resumed == {s: whole[s] for s in range(2 * BATCHES, 4 * BATCHES)}  # bitwise the same losses

    again = _losses(run, 4 * BATCHES, TierckptCheckpointIO(config), ckpt_path=run / "ckpts" / "epoch=0-step=8.ckpt",
                    every_n_train_steps=BATCHES, save_top_k=-1, save_last=True)
    assert again == {s: whole[s] for s in range(BATCHES, 4 * BATCHES)}


def test_the_stored_checkpoint_holds_what_lightning_put_in_it(tmp_path: Path, config: dict[str, Any]) -> None:
    plugin = TierckptCheckpointIO(config)
    _losses(tmp_path, BATCHES, plugin, every_n_train_steps=BATCHES)
    loaded = plugin.load_checkpoint(tmp_path / "ckpts" / "epoch=0-step=8.ckpt")
    assert loaded["global_step"] == 8 and loaded["epoch"] == 0
    assert loaded["hyper_parameters"] == {"hidden": 16, "lr": 0.05, "extra": None}
    assert set(loaded["state_dict"]) == {"net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"}
    assert loaded["optimizer_states"][0]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert loaded["lr_schedulers"][0]["last_epoch"] == 8
    assert any(key.startswith("ModelCheckpoint") for key in loaded["callbacks"])
    plugin.teardown()


def test_hyperparameters_that_need_pickle_are_an_error_naming_the_key(tmp_path: Path, config: dict[str, Any]) -> None:
    L.seed_everything(0, verbose=False)
    model = Tiny(extra={"a", "b"})  # picklable (Lightning keeps it), but not storable without pickle
    plugin = TierckptCheckpointIO(config)
    with pytest.raises(UnsupportedStateError, match=r"hyper_parameters.*extra.*save_hyperparameters\(ignore=") as caught:
        _trainer(tmp_path, BATCHES, plugin, every_n_train_steps=BATCHES).fit(model)
    assert "extra" in (caught.value.key or "")
    plugin.teardown()


def test_top_k_removes_pointers_and_the_tiers_retention_keeps_the_steps(tmp_path: Path, config: dict[str, Any]) -> None:
    _losses(tmp_path, 2 * BATCHES, TierckptCheckpointIO(config), every_n_train_steps=4, save_top_k=1)
    assert sorted(os.listdir(tmp_path / "ckpts")) == ["epoch=1-step=16.ckpt"]  # ModelCheckpoint removed the others
    with Checkpointer(config) as ckpt:
        # The steps the tier took (a busy tier may pass over one whose successor is already waiting)
        # are all still there: removing a pointer deletes nothing, retention (last 10) decides.
        steps = [v.step for v in ckpt.versions() if v.tier == "nvme"]
    assert steps[-1] == 16 and len(steps) >= 2 and set(steps) <= {4, 8, 12, 16}, steps


def test_paths_that_are_not_pointers_are_clear_errors(tmp_path: Path, config: dict[str, Any]) -> None:
    plugin = TierckptCheckpointIO(config)
    with pytest.raises(NoCheckpointError, match="no such checkpoint"):
        plugin.load_checkpoint(tmp_path / "missing.ckpt")
    torch.save({"state_dict": {}}, tmp_path / "torch.ckpt")
    with pytest.raises(CorruptCheckpointError, match="not a checkpoint written through tierckpt"):
        plugin.load_checkpoint(tmp_path / "torch.ckpt")
    (tmp_path / "gone.ckpt").write_text(json.dumps({"format": "tierckpt-pointer", "version": 1, "step": 7, "tier": "nvme"}))
    with pytest.raises(NoCheckpointError, match=r"no tier holds step 7 \(ram: none; nvme: none\)"):
        plugin.load_checkpoint(tmp_path / "gone.ckpt")
    plugin.teardown()
