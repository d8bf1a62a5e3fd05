"""A Hugging Face ``Trainer`` run's wall time under ``torchrun``, checkpointing every N steps: the stock
Trainer's own checkpointing against ``TierckptTrainer`` (issue 35).

A DDP job of ``--ranks`` processes started by ``torchrun`` on gloo (127.0.0.1), CPU: a GPT-2 whose
weights and AdamW moments make a checkpoint of about ``--mib`` MiB (12 bytes a parameter), ``--steps``
steps, ``save_steps=--every``, ``save_total_limit=2``. Variants, each a new ``torchrun`` job, in
alternating order over ``--repeats``:

- ``none``: ``save_strategy="no"`` (the baseline);
- ``Trainer``: the stock Trainer's checkpoints (``model.safetensors``, ``optimizer.pt``, the scheduler,
  each rank's RNG states; written from the main process, each rank its RNG file; it does not fsync);
- ``tierckpt``: ``TierckptTrainer``: RAM, then a filesystem tier in the output directory (fsynced),
  keep 2, ``host.capacity`` unset (each rank's pool sized to what it stores). Every rank saves, each
  writing its share of the replicated state.

The time is ``train()`` on rank 0 from call to return: for ``TierckptTrainer`` every checkpoint is
durable and its ``checkpoint-N/`` written by then. Overhead = variant - ``none`` of the same repeat.
Medians. Appends a section to RESULTS.md (``--quick``: small, no RESULTS).

    flock /tmp/tierckpt-bench.lock .venv/bin/python benchmarks/hf_run.py --ranks 2 --mib 192
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

VARIANTS = ("none", "Trainer", "tierckpt")
HERE = Path(__file__).resolve().parent
WIDTH, SEQ, VOCAB = 512, 64, 1024


def layers_for(mib: int) -> int:
    """GPT-2 blocks of width ``WIDTH`` whose parameters, with AdamW's two moments, make ``mib`` MiB."""
    per_block = 12 * WIDTH * WIDTH + 13 * WIDTH
    embeddings = (VOCAB + SEQ) * WIDTH
    return max(1, round(((mib << 20) / 12 - embeddings) / per_block))


def worker(variant: str, directory: Path, mib: int, steps: int, every: int) -> dict[str, Any] | None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

    import common
    from tierckpt.integrations.huggingface import TierckptTrainer

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, n: int) -> None:
            self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    torch.set_num_threads(1)  # two ranks on the machine's cores
    set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=WIDTH, n_layer=layers_for(mib), n_head=8))
    params = sum(p.numel() for p in model.parameters())
    args = TrainingArguments(
        output_dir=str(directory / "out"), max_steps=steps, save_steps=every, save_strategy="no" if variant == "none" else "steps",
        save_total_limit=2, per_device_train_batch_size=2, learning_rate=1e-4, report_to=[], seed=0, dataloader_num_workers=0,
        disable_tqdm=True, logging_strategy="no", use_cpu=True,
    )
    data = Tokens(2 * steps * int(os.environ.get("WORLD_SIZE", "1")) * 2)
    if variant == "tierckpt":
        # host.capacity unset, as a user starts: each rank's pool sized to the part of the state it stores
        config = common.tier_config(common.disk_tier(directory / "nvme", "nvme", keep={"last": 2}), capacity=None, snapshots=2)
        trainer: Any = TierckptTrainer(model=model, args=args, train_dataset=data, tierckpt=config)
    else:
        trainer = Trainer(model=model, args=args, train_dataset=data)
    t = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t
    if int(os.environ.get("RANK", "0")) != 0:
        return None  # rank 0 reports
    out = directory / "out"
    return {"variant": variant, "train_s": train_s, "params": params, "layers": layers_for(mib),
            "saved": sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) if out.is_dir() else []}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=192, help="checkpoint size: weights and AdamW moments")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2, help="processes torchrun starts")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/tierckpt-hf-bench"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.mib, args.steps, args.every, args.repeats = 16, 8, 4, 1
    if args.worker:
        result = worker(args.worker, args.dir, args.mib, args.steps, args.every)
        if result is not None:
            print(json.dumps(result), flush=True)
        return

    sys.path.insert(0, str(HERE))
    from common import alternating_runs, overhead_rows, print_and_keep
    from machine_limits import machine

    from tierckpt.testing.ranks import free_port

    def command(variant: str) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks), "--master-addr", "127.0.0.1",
                "--master-port", str(free_port()), __file__, "--worker", variant, "--dir", str(args.dir), "--mib", str(args.mib),
                "--steps", str(args.steps), "--every", str(args.every)]

    runs, overheads, info = alternating_runs(VARIANTS, args.repeats, args.dir, command, "train_s", {"PYTHONPATH": str(HERE), "OMP_NUM_THREADS": "1"})
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    m = machine(args.dir)
    saves = args.steps // args.every
    lines = [
        f"## Hugging Face Trainer: a training run's wall time, checkpointing every {args.every} steps, DDP on {args.ranks} ranks "
        f"under torchrun (issue 35) ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"`benchmarks/hf_run.py --mib {args.mib} --steps {args.steps} --every {args.every} --repeats {args.repeats} --ranks {args.ranks}`. "
        f"{m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM, {m['disk']}; transformers, torch CPU, gloo. A GPT-2 of "
        f"{info['params'] / 1e6:.1f} M parameters ({info['layers']} blocks of width {WIDTH}): a checkpoint of about {args.mib} MiB with "
        f"AdamW's moments; {args.steps} steps, a save every {args.every} (save_total_limit 2): {saves} checkpoints. Each run a new "
        "torchrun job; `train()` on rank 0 from call to return (TierckptTrainer's: every checkpoint durable and its directory written). Medians.",
        "",
        "| checkpointing | train (s) | overhead over no checkpoints (s) | per checkpoint (s) | durable (fsync) |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    durable = {"none": "", "Trainer": "no", "tierckpt": "yes"}
    named = {"none": "none", "Trainer": "the stock Trainer's", "tierckpt": "TierckptTrainer"}
    lines += [*overhead_rows(VARIANTS, runs, overheads, saves, named, durable), ""]
    print_and_keep("\n".join(lines), HERE / "RESULTS.md", not args.quick)

if __name__ == "__main__":
    main()
