"""What a DeepSpeed ZeRO save costs the training loop: DeepSpeed's own checkpoint engines against
``tierckpt.integrations.deepspeed.attach`` (issue 56).

A job of ``--ranks`` processes (gloo on CPU) trains an MLP of ``--params-m`` million parameters
under ZeRO stage 2 and 3 (``--stages``) for ``--steps`` steps, ``engine.save_checkpoint`` every
``--every``. Variants, each a job of its own, alternated over ``--repeats`` (the first and the last
swap places every other repeat):

- ``none``: no saves (the baseline);
- ``deepspeed``: DeepSpeed's own ``TorchCheckpointEngine`` (``torch.save`` a file; not fsynced);
- ``decoupled``: DeepSpeed's ``DecoupledCheckpointEngine`` (``"checkpoint": {"writer": {"decoupled":
  true}}``: a writer process per rank, committed in the next ``engine.step()``), at ZeRO-3 only: at
  ZeRO-2 it fails (``Cowardly refusing to serialize non-leaf tensor``);
- ``tierckpt``: ``attach(engine, ...)``: host RAM, then a filesystem tier in the same directory
  (fsynced), keep 2;
- ``floor``: a checkpoint engine that keeps nothing (decoupled, every rank handed the model states as
  tierckpt has them): what DeepSpeed's own ``save_checkpoint`` costs before any engine stores a
  byte, the least any engine can block for.

Per rank 0, medians over the saves: ``save``, the time ``save_checkpoint`` blocked the training
thread; ``commit``, the time the decoupled engines' commit took in the next ``engine.step()``, before
the optimizer's update (tierckpt's lazy barrier, waiting for the host copy; DeepSpeed's, for its
writer process; the stock engine commits inside ``save_checkpoint``); ``blocked``, their sum;
``slower``, how much longer the step after a save took than the run's median step (its commit, and
whatever the background work took from the training on these cores); ``end``, ``engine.destroy()``
(tierckpt: until every save is durable); ``total``, the training loop from its first step to the end
of ``destroy()``, and its overhead over ``none`` of the same repeat.

    flock /tmp/tierckpt-bench.lock .venv/bin/python benchmarks/deepspeed_run.py
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
from typing import Any

VARIANTS = ("none", "floor", "deepspeed", "decoupled", "tierckpt")
BYTES_PER_PARAM = 16  # fp32 weights, fp32 master, two Adam moments


def keeps_nothing() -> Any:
    """The ``floor`` variant's checkpoint engine (made once DeepSpeed is imported)."""
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    class KeepsNothingEngine(CheckpointEngine):
        def create(self, info: Any) -> None:
            pass

        def save(self, state_dict: Any, path: str) -> None:
            pass

        def load(self, path: str, map_location: Any = None) -> Any:
            raise NotImplementedError("the floor variant keeps nothing to load")

        def commit(self, info: Any) -> bool:
            return True

        def is_decoupled(self) -> bool:
            return True

    return KeepsNothingEngine()


def worker(out: Path, variant: str, params_m: float, stage: int, steps: int, every: int, root: Path) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))
    import deepspeed
    import torch

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # its JIT build takes minutes
    width = int((params_m * 1e6 / 2) ** 0.5)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width))
    numel = sum(p.numel() for p in model.parameters())  # before initialize: ZeRO-3 then leaves each parameter empty
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10**9,
                              "zero_optimization": {"stage": stage, "reduce_bucket_size": 5e7, "allgather_bucket_size": 5e7}}
    if variant == "decoupled":
        config["checkpoint"] = {"writer": {"type": "python", "decoupled": True}}
        # its writers' layout reads the machines from what DeepSpeed's own launcher sets: one machine here
        os.environ.setdefault("CROSS_SIZE", "1")
        os.environ.setdefault("CROSS_RANK", "0")
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4), config=config)
    if variant == "floor":
        engine.checkpoint_engine = keeps_nothing()
        engine.save_non_zero_checkpoint = True
    if variant == "tierckpt":
        from tierckpt.integrations.deepspeed import attach

        state_mib = BYTES_PER_PARAM * numel / 2**20
        attach(engine, {"host": {"capacity": f"{int(2 * state_mib) + 64}MiB", "snapshots": 2},
                        "tiers": [{"name": "ram", "type": "memory"},
                                  {"name": "disk", "type": "filesystem", "path": str(root / "tiers"), "keep": {"last": 2}}]})
    commits: list[float] = []
    if engine.checkpoint_engine.is_decoupled():  # its commit runs in the next engine.step(): timed there
        commit = engine.checkpoint_engine.commit

        def timed_commit(info: Any) -> Any:
            t = time.perf_counter()
            try:
                return commit(info)
            finally:
                commits.append(time.perf_counter() - t)

        engine.checkpoint_engine.commit = timed_commit
    saves, steps_after, others = [], [], []
    began = time.perf_counter()
    after_save = False
    for step in range(steps):
        t = time.perf_counter()
        x = torch.randn(8, width)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        (steps_after if after_save else others).append(time.perf_counter() - t)
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
        step_s = statistics.median(others[1:] or others)  # the first step of a job warms up
        slower = [s - step_s for s in steps_after]
        out.write_text(json.dumps({"save": saves, "commit": commits, "slower": slower, "step": step_s, "end": end, "total": total}))
    torch.distributed.destroy_process_group()


def variants_of(stage: int) -> list[str]:
    """DeepSpeed's decoupled engine runs at ZeRO-3 only."""
    return [v for v in VARIANTS if v != "decoupled" or stage == 3]


def run_stage(args: argparse.Namespace, stage: int) -> dict[str, list[dict[str, Any]]]:
    from tierckpt.testing.ranks import failures, launch_ranks

    variants = variants_of(stage)
    rows: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for repeat in range(args.repeats):
        order = variants if repeat % 2 == 0 else [variants[-1], *variants[1:-1], variants[0]]
        for variant in order:
            with tempfile.TemporaryDirectory(prefix="ds-bench-", dir=os.environ.get("BENCH_DIR")) as scratch:
                out = Path(scratch) / "result.json"
                argv = [sys.executable, __file__, "--params-m", str(args.params_m), "--steps", str(args.steps), "--every", str(args.every),
                        "--worker", str(out), variant, scratch, str(stage)]
                exits = launch_ranks(argv, args.ranks, timeout_s=1200, env={"AWS_EC2_METADATA_DISABLED": "true"})
                failed = failures(exits)
                if failed:
                    raise SystemExit(f"ZeRO-{stage} {variant}: {failed}")
                rows[variant].append(json.loads(out.read_text()))
    return rows


def table(stage: int, rows: dict[str, list[dict[str, Any]]]) -> list[str]:
    def median_of(variant: str, key: str) -> float:
        values = [statistics.median(r[key]) if r[key] else 0.0 for r in rows[variant]]
        return statistics.median(values)

    base = [r["total"] for r in rows["none"]]
    lines = [f"ZeRO-{stage}:", "",
             "| variant | save_checkpoint blocked | the next step's commit | blocked per save | the step after a save, beyond a step | destroy() | total | over none |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for variant, rs in rows.items():
        save, commit, slower = median_of(variant, "save"), median_of(variant, "commit"), median_of(variant, "slower")
        end = statistics.median(r["end"] for r in rs)
        total = statistics.median(r["total"] for r in rs)
        over = statistics.median(r["total"] - b for r, b in zip(rs, base))
        blocked = f"{save + commit:.3f} s" if variant != "none" else "-"
        lines.append(f"| {variant} | {save:.3f} s | {commit:.3f} s | {blocked} | {slower:+.3f} s | {end:.3f} s | {total:.2f} s | {over:+.2f} s |")
    step = statistics.median(r["step"] for r in rows["none"])
    lines += ["", f"(a step without saves: {step:.3f} s)", ""]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params-m", type=float, default=6.5, help="million parameters (16 bytes each of state: 6.5 M is ~100 MiB)")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3], choices=[1, 2, 3])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", nargs=4, metavar=("OUT", "VARIANT", "ROOT", "STAGE"))
    args = parser.parse_args()
    if args.worker:
        out, variant, root, stage = args.worker
        worker(Path(out), variant, args.params_m, int(stage), args.steps, args.every, Path(root))
        return
    state_mib = BYTES_PER_PARAM * args.params_m * 1e6 / 2**20
    lines = [f"{args.ranks} ranks, {args.params_m:g} M parameters (~{state_mib:.0f} MiB of weights, masters and moments), "
             f"{args.steps} steps, a save every {args.every}; medians of {args.repeats}", ""]
    print("\n".join(lines), flush=True)
    for stage in args.stages:
        print("\n".join(table(stage, run_stage(args, stage))), flush=True)


if __name__ == "__main__":
    main()
