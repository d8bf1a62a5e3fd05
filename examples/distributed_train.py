"""Data-parallel training that checkpoints every step across ranks, and resumes where it stopped.

    torchrun --nproc-per-node 2 examples/distributed_train.py --steps 20
    torchrun --nproc-per-node 2 examples/distributed_train.py --steps 40   # resumes from step 20

Each rank runs a DistributedDataParallel copy of a small MLP on CPU (gloo). The model and optimizer
are the same on every rank, so they are saved with ``replicated=``: stored once per tier, each rank
writing about half of them; each rank's data-loader position is its own. Every rank resumes from the
same step, which ``restore_latest`` agrees on.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tierckpt import Checkpointer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dir", default="checkpoints/distributed", help="where the disk tier keeps versions")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    # Adam's moments exist only after the first step: make them now so that a restore can fill them.
    optimizer.zero_grad()
    ddp(torch.zeros(1, 64)).sum().backward()
    optimizer.step()
    data = torch.Generator().manual_seed(1000 + rank)  # this rank's shard of the data

    config = {
        "host": {"capacity": "64MiB", "snapshots": 2},
        "tiers": [
            {"name": "ram", "type": "memory"},
            {"name": "disk", "type": "filesystem", "path": os.path.join(args.dir, "disk"), "keep": {"last": 2}},
        ],
        "distributed": {"timeout": "60s"},
    }
    with Checkpointer(config) as ckpt:  # collective: every rank constructs it here
        ckpt.attach(optimizer)  # optimizer.step() waits for the host copy of the last save
        state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "data": data.get_state(), "step": 0}
        restored = ckpt.restore_latest_sync(template=state)  # collective: every rank gets the same step
        start = 0
        if restored is not None:
            optimizer.load_state_dict(restored.state["optim"])
            data.set_state(restored.state["data"])
            start = restored.state["step"]
            print(f"rank {rank}: resumed from step {start} (tier {restored.tier})", flush=True)
        for step in range(start + 1, args.steps + 1):
            x = torch.randn(32, 64, generator=data)
            loss = (ddp(x) - x.sum(1, keepdim=True)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "data": data.get_state(), "step": step}
            ckpt.save_sync(step, state, replicated=["model", "optim"])
        ckpt.wait_sync()
        if rank == 0:
            print(f"trained to step {args.steps}; on disk: {[v.step for v in ckpt.versions() if v.tier == 'disk']}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
