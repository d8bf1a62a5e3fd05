"""One rank of a torchtitan training run through TierckptCheckpointManager (tests/test_torchtitan.py):
``python titan_worker.py <dir> <stop at step> <load: -1 latest, N a step, none>``.

torchtitan's own classes on CPU with gloo: an MLP sharded with FSDP2 (``fully_shard``: parameters and
AdamW moments are DTensors), its ``OptimizersContainer`` and ``LRSchedulersContainer``, a
``ParallelAwareDataloader`` over each data-parallel rank's own samples, and a train state. The
manager saves every 4 steps (``INTERVAL`` in the environment: every that many); the rank writes its losses, and each parameter in full at the step it
started from and at the end, to ``<dir>/result-<rank>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import Dataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

from tierckpt.integrations.torchtitan import TierckptCheckpointManager
from tierckpt.testing.ranks import end_job

TOTAL, BATCH, INTERVAL = 12, 4, 4


class Samples(Dataset):
    """The samples of one data-parallel rank: TOTAL batches of them."""

    def __init__(self, rank: int) -> None:
        g = torch.Generator().manual_seed(100 + rank)
        self.x = torch.randn(TOTAL * BATCH, 16, generator=g)
        self.y = self.x[:, :4] * 2 - self.x[:, 4:8]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class TrainState(Stateful):
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]


def full(model: nn.Module) -> dict[str, list[float]]:
    return {name: p.full_tensor().flatten().tolist() for name, p in model.named_parameters()}


def main() -> None:
    root, stop, load = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizers = OptimizersContainer(
        OptimizersContainer.Config(param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})],
                                   implementation="for-loop"),
        model_parts=[model],
    )
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=TOTAL)
    dataloader = ParallelAwareDataloader(Samples(rank), dp_rank=rank, dp_world_size=world, batch_size=BATCH)
    train_state = TrainState()
    tiers = json.loads(os.environ["TIERS"])
    manager = TierckptCheckpointManager(
        TierckptCheckpointManager.Config(enable=True, interval=int(os.environ.get("INTERVAL", INTERVAL)), tiers_inline=tiers, last_save_model_only=False,
                                         exclude_from_loading=os.environ.get("EXCLUDE", "").split(",") if os.environ.get("EXCLUDE") else []),
        dataloader=dataloader, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": train_state},
    )
    out: dict[str, Any] = {"rank": rank, "loaded": None, "losses": {}}
    if load != "none":
        out["loaded"] = manager.load(int(load))
    out["start"], out["start_params"] = train_state.step, full(model)
    batches = iter(dataloader)
    for step in range(train_state.step + 1, stop + 1):
        x, y = next(batches)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        manager.maybe_wait_for_staging()  # the lazy barrier, where torchtitan's trainer calls it
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        train_state.step = step
        out["losses"][step] = loss.item()
        manager.save(step, last_step=step == TOTAL)
    out["end_params"] = full(model)
    manager.close()
    (root / f"result-{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
    end_job()  # FSDP2 on gloo may abort at the interpreter's exit otherwise (pytorch#190489)
