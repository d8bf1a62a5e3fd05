"""What a DeepSpeed ZeRO save costs the training loop: DeepSpeed's own checkpoint engine against
``tierckpt.integrations.deepspeed.attach`` (issue 56).

A job of ``--ranks`` processes (gloo on CPU) trains an MLP of ``--params-m`` million parameters under
ZeRO ``--stage`` for ``--steps`` steps, ``engine.save_checkpoint`` every ``--every``. Variants, each a
job of its own, alternated over ``--repeats``:

- ``none``: no saves (the baseline);
- ``deepspeed``: DeepSpeed's own engine (``torch.save`` a file; not fsynced);
- ``tierckpt``: ``attach(engine, ...)``: host RAM, then a filesystem tier in the same directory
  (fsynced), keep 2.

Per rank 0: ``save``, the median time ``save_checkpoint`` blocked the training thread; ``next``,
the median time of the step after a save (the update waits there for the copy); ``end``, the time
``engine.destroy()`` took (tierckpt: until every save is durable); ``total``, the job's training
loop from its first step to the end of ``destroy()``, and its overhead over ``none`` of the same repeat.

    flock /tmp/tierckpt-bench.lock .venv/bin/python benchmarks/deepspeed_save.py --params-m 16
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def worker(out: Path, variant: str, params_m: float, stage: int, steps: int, every: int, root: Path) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))
    import deepspeed
    import torch

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # its JIT build takes minutes
    width = int((params_m * 1e6 / 2) ** 0.5)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width))
    config = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10**9,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 5e7, "allgather_bucket_size": 5e7}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4), config=config)
    if variant == "tierckpt":
        from tierckpt.integrations.deepspeed import attach

        state_mib = 16 * sum(p.numel() for p in model.parameters()) / 2**20  # model + fp32 master + 2 moments, generous
        attach(engine, {"host": {"capacity": f"{int(2 * state_mib) + 64}MiB", "snapshots": 2},
                        "tiers": [{"name": "ram", "type": "memory"},
                                  {"name": "disk", "type": "filesystem", "path": str(root / "tiers"), "keep": {"last": 2}}]})
    saves, nexts = [], []
    began = time.perf_counter()
    after_save = False
    for step in range(steps):
        t = time.perf_counter()
        x = torch.randn(8, width)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        if after_save:
            nexts.append(time.perf_counter() - t)
            after_save = False
        if variant != "none" and (step + 1) % every == 0:
            t = time.perf_counter()
            engine.save_checkpoint(str(root / "ckpts"))
            saves.append(time.perf_counter() - t)
            after_save = True
    t = time.perf_counter()
    engine.destroy()
    end = time.perf_counter() - t
    total = time.perf_counter() - began
    if int(os.environ.get("RANK", "0")) == 0:
        out.write_text(json.dumps({"save": saves, "next": nexts, "end": end, "total": total}))
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params-m", type=float, default=16.0)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--worker", nargs=3, metavar=("OUT", "VARIANT", "ROOT"))
    args = parser.parse_args()
    if args.worker:
        out, variant, root = args.worker
        worker(Path(out), variant, args.params_m, args.stage, args.steps, args.every, Path(root))
        return
    from tierckpt.testing.ranks import failures, launch_ranks

    variants = ["none", "deepspeed", "tierckpt"]
    rows: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for repeat in range(args.repeats):
        order = variants if repeat % 2 == 0 else [variants[0], *reversed(variants[1:])]
        for variant in order:
            with tempfile.TemporaryDirectory(prefix="ds-bench-", dir=os.environ.get("BENCH_DIR")) as scratch:
                out = Path(scratch) / "result.json"
                argv = [sys.executable, __file__, "--params-m", str(args.params_m), "--stage", str(args.stage), "--steps", str(args.steps),
                        "--every", str(args.every), "--worker", str(out), variant, scratch]
                exits = launch_ranks(argv, args.ranks, timeout_s=1200, env={"AWS_EC2_METADATA_DISABLED": "true"})
                failed = failures(exits)
                if failed:
                    raise SystemExit(failed)
                rows[variant].append(json.loads(out.read_text()))
    base = [r["total"] for r in rows["none"]]
    print(f"ZeRO-{args.stage}, {args.ranks} ranks, {args.params_m:g} M parameters, {args.steps} steps, a save every {args.every}; medians of {args.repeats}")
    print("| variant | save_checkpoint blocked | step after a save | destroy() | total | over none |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for variant in variants:
        rs = rows[variant]
        med = lambda key: statistics.median(statistics.median(r[key]) if isinstance(r[key], list) and r[key] else (r[key] if not isinstance(r[key], list) else 0.0) for r in rs)  # noqa: E731
        over = statistics.median(r["total"] - b for r, b in zip(rs, base))
        print(f"| {variant} | {med('save'):.3f} s | {med('next'):.3f} s | {med('end'):.3f} s | {med('total'):.2f} s | {over:+.2f} s |")


if __name__ == "__main__":
    main()
