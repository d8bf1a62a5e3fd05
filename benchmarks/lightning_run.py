"""A Lightning training run's wall time, checkpointing every N steps: Lightning's own checkpoint I/O
against the same run through tierckpt (issue 24; ``--ranks 2``: a DDP job of 2 processes on gloo, issue 35).

One ``lightning.Trainer.fit`` on CPU of an MLP whose weights and Adam moments make a checkpoint of
``--mib`` MiB, ``--steps`` steps, a ``ModelCheckpoint`` every ``--every`` steps keeping the newest 2.
Variants, each in a new process (``--worker``), in alternating order over ``--repeats``:

- ``none``: no checkpoints (the baseline);
- ``torch.save``: Lightning's default ``TorchCheckpointIO`` (synchronous; it does not fsync);
- ``AsyncCheckpointIO``: Lightning's own asynchronous wrapper around it (a thread);
- ``tierckpt``: ``TierckptCheckpointIO``: RAM, then a filesystem tier in the same directory (fsynced),
  keep 2. The Checkpointer is built on the first save, inside ``fit``: its host pool is in the time.
- ``tierckpt lazy``: the same with ``lazy=True``: a save returns before its host copy, and the next
  optimizer update waits for it.

The time is ``fit()`` from call to return, which includes the plugin's ``teardown()``: every
checkpoint is written (and, for tierckpt, durable) when it returns. Overhead = variant - ``none`` of
the same repeat. Medians. Appends a section to RESULTS.md (``--quick``: small, no RESULTS).

With ``--ranks 2`` the Trainer has ``devices=2, strategy="ddp"`` and Lightning starts the second rank
itself: under tierckpt both ranks save, each writing its share of the replicated state; Lightning's
own I/O writes from rank 0. ``--strategy fsdp2`` (``ModelParallelStrategy``, each Linear sharded with
``fully_shard``) or ``fsdp1`` (``FSDPStrategy(state_dict_type="sharded")``, on CPU through
``tierckpt.testing.lightning_cpu.CpuFSDPStrategy``) shard the model and Adam's moments: every rank
saves its shards, Lightning's own way (the ``torch.save`` row: the strategy's own synchronous DCP
save, a file a rank, fsynced; ``AsyncCheckpointIO`` does not apply) and through tierckpt.

    flock /tmp/tierckpt-bench.lock .venv/bin/python benchmarks/lightning_run.py
    flock /tmp/tierckpt-bench.lock .venv/bin/python benchmarks/lightning_run.py --ranks 2 --mib 192
    flock /tmp/tierckpt-bench.lock .venv/bin/python benchmarks/lightning_run.py --ranks 2 --mib 192 --strategy fsdp1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

VARIANTS = ("none", "torch.save", "AsyncCheckpointIO", "tierckpt", "tierckpt lazy")
SHARDING = {"ddp": "DDP", "fsdp1": "FSDPStrategy (FSDP1)", "fsdp2": "ModelParallelStrategy (FSDP2)"}
HERE = Path(__file__).resolve().parent


def worker(variant: str, directory: Path, mib: int, steps: int, every: int, ranks: int, strategy: str) -> dict[str, Any] | None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import common
    from tierckpt.integrations.lightning import TierckptCheckpointIO

    # weights + 2 Adam moments: 12 bytes a parameter; `layers` square layers of `hidden`
    layers = 4
    hidden = int(((mib << 20) / 12 / layers) ** 0.5)

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(hidden, hidden), nn.GELU())])

        def configure_model(self) -> None:
            if strategy == "fsdp2":  # ModelParallelStrategy: each Linear, then the whole, sharded over the ranks
                from torch.distributed.fsdp import fully_shard

                mesh = self.device_mesh["data_parallel"]
                for layer in self.net:
                    if isinstance(layer, nn.Linear):
                        fully_shard(layer, mesh=mesh)
                fully_shard(self.net, mesh=mesh)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (x,) = batch
            return (self.net(x) - x).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(TensorDataset(torch.randn(32 * 16, hidden)), batch_size=32)

    torch.manual_seed(0)
    model = MLP()
    plugin: Any = None
    if variant == "AsyncCheckpointIO":
        plugin = AsyncCheckpointIO()
    elif variant.startswith("tierckpt"):
        state_bytes = 12 * sum(p.numel() for p in model.parameters())
        config = common.tier_config(common.disk_tier(directory / "nvme", "nvme", keep={"last": 2}),
                                    capacity=2 * (int(state_bytes * 1.1) + (8 << 20)), snapshots=2)
        plugin = TierckptCheckpointIO(config, lazy=variant == "tierckpt lazy")
    checkpointing = variant != "none"
    if strategy == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        parallel: Any = ModelParallelStrategy(data_parallel_size=ranks, tensor_parallel_size=1)
    elif strategy == "fsdp1":
        from tierckpt.testing.lightning_cpu import CpuFSDPStrategy

        parallel = CpuFSDPStrategy(state_dict_type="sharded")
    else:
        parallel = "ddp" if ranks > 1 else "auto"
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", devices=ranks, strategy=parallel, logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=directory, plugins=[plugin] if plugin is not None else None, enable_checkpointing=checkpointing,
        callbacks=[ModelCheckpoint(dirpath=directory / "ckpts", every_n_train_steps=every, save_top_k=2, monitor="step", mode="max")]
        if checkpointing else None,
    )
    t = time.perf_counter()
    trainer.fit(model)
    fit_s = time.perf_counter() - t
    if trainer.global_rank != 0:
        return None  # rank 0 reports (its stdout is the one read)
    return {"variant": variant, "fit_s": fit_s, "params": layers * (hidden * hidden + hidden), "hidden": hidden,
            "saved": sorted(os.listdir(directory / "ckpts")) if checkpointing else []}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=384, help="checkpoint size: weights and Adam moments")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/tierckpt-lightning-bench"))
    parser.add_argument("--ranks", type=int, default=1, help="processes of a DDP job (1: one process)")
    parser.add_argument("--strategy", choices=("ddp", "fsdp1", "fsdp2"), default="ddp", help="with --ranks 2: DDP, or the model sharded")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.mib, args.steps, args.every, args.repeats = 32, 12, 4, 1
    if args.worker:
        result = worker(args.worker, args.dir, args.mib, args.steps, args.every, args.ranks, args.strategy)
        if result is not None:
            print(json.dumps(result))
        return

    sys.path.insert(0, str(HERE))
    from common import alternating_runs, overhead_rows, print_and_keep
    from machine_limits import machine

    if args.strategy != "ddp" and args.ranks < 2:
        parser.error(f"--strategy {args.strategy} shards over ranks: give --ranks 2 or more")
    variants = VARIANTS if args.strategy == "ddp" else tuple(v for v in VARIANTS if v != "AsyncCheckpointIO")

    def command(variant: str) -> list[str]:
        return [sys.executable, __file__, "--worker", variant, "--dir", str(args.dir), "--mib", str(args.mib),
                "--steps", str(args.steps), "--every", str(args.every), "--ranks", str(args.ranks), "--strategy", args.strategy]

    runs, overheads, info = alternating_runs(variants, args.repeats, args.dir, command, "fit_s", {"PYTHONPATH": str(HERE)})
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    m = machine(args.dir)
    base = statistics.median(runs["none"])
    lines = [
        f"## Lightning: a training run's wall time, checkpointing every {args.every} steps"
        f"{f', {SHARDING[args.strategy]} on {args.ranks} ranks (issue 35)' if args.ranks > 1 else ' (issue 24)'} ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"`benchmarks/lightning_run.py --mib {args.mib} --steps {args.steps} --every {args.every} --repeats {args.repeats} --ranks {args.ranks} --strategy {args.strategy}`. "
        f"{m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM, {m['disk']}; lightning, torch CPU. An MLP of "
        f"{info['params'] / 1e6:.1f} M parameters (hidden {info['hidden']}): a checkpoint of {args.mib} MiB with Adam's moments; "
        f"{args.steps} steps, a ModelCheckpoint every {args.every} (keep 2): {args.steps // args.every} checkpoints. "
        "Each run a new process; `fit()` from call to return (the plugin's teardown included: every checkpoint written). Medians.",
        "",
        "| checkpoint I/O | fit (s) | overhead over no checkpoints (s) | per checkpoint (s) | durable (fsync) |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    durable = {"none": "", "torch.save": "no", "AsyncCheckpointIO": "no", "tierckpt": "yes", "tierckpt lazy": "yes"}
    named = dict(zip(VARIANTS, VARIANTS))
    if args.strategy != "ddp":  # the strategy writes its own files: DCP, which fsyncs
        durable["torch.save"], named["torch.save"] = "yes", "Lightning's own (the strategy's DCP save)"
    lines += [*overhead_rows(variants, runs, overheads, args.steps // args.every, named, durable), f"(the no-checkpoint run: {base:.2f} s).", ""]
    print_and_keep("\n".join(lines), HERE / "RESULTS.md", not args.quick)


if __name__ == "__main__":
    main()
