"""What ``save()`` costs the training thread: the call itself, and the thread's next moments beside tierckpt's threads.

A model of ``--layers`` ``Linear(--width, --width)`` layers and its AdamW state (8 tensors a layer: weight,
bias, and each one's ``exp_avg``, ``exp_avg_sq`` and ``step``; 75 layers make 600 tensors) on
``--device``, a memory tier only, its pool prepared before anything is timed. Two measures:

1. **The call**: ``ckpt.save_sync(step, {"model": ..., "optim": ...})`` alone (``state_dict()`` is
   called before the clock), the capture awaited between saves; median and p90 (goal: ≤ 1 ms for 600
   tensors).
2. **A launch-bound thread beside the copies**: a "step" of ``--ops`` tiny in-place ops on the calling
   thread (the Python and dispatch of kernel launches, nothing to compute), timed alone and right after
   a ``save()`` returned, while tierckpt's threads copy that state. Its slowdown is what the copies'
   share of the interpreter lock costs a training loop whose GPU waits for its launches.

3. **The collector**: Python's garbage collections that ran over the saves (on any thread: each holds
   the interpreter lock the training thread needs), their time a save, by generation. What a save
   allocates and keeps decides how often they run, and a full one goes over every object the process has.

Both in one process, alternating (a step alone, a save, a step right after it), medians over ``--saves``.
Prints a Markdown section and writes it with the raw numbers to ``--out`` (``save_call-<time>.json/.md``).
An older tierckpt on ``PYTHONPATH`` (e.g. ``git worktree add /tmp/old <commit>``, then
``PYTHONPATH=/tmp/old``) gives the figure before a change, on the same machine.

``--fsdp`` shards the model with FSDP2 (``fully_shard``) over a 1-rank process group first: its weights
and moments are then DTensors, as an LLM job's are, and each one's piece and place are read too.

    .venv/bin/python benchmarks/save_call.py                    # CPU, 600 tensors
    .venv/bin/python benchmarks/save_call.py --fsdp             # the same as 450 DTensors and 150 step counters
    python3 benchmarks/save_call.py --device cuda --out $OUT    # the GPU machine
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import tierckpt
from machine_limits import machine
from tierckpt import Checkpointer

HERE = Path(__file__).resolve().parent
GOAL_MS = 1.0


def build(layers: int, width: int, device: str, fsdp: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
    if fsdp:  # FSDP2 over this one process: every parameter and moment a DTensor, as an LLM job's are
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, width, device=device)).sum().backward()
    optimizer.step()  # the moments and step counters exist from here on
    return model, optimizer


class Collector:
    """Python's garbage collections while it is started: how many, and their seconds, by generation."""

    def __init__(self) -> None:
        self.runs = {0: 0, 1: 0, 2: 0}
        self.seconds = {0: 0.0, 1: 0.0, 2: 0.0}
        self._began = 0.0

    def _seen(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.runs[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._began

    def start(self) -> None:
        gc.callbacks.append(self._seen)

    def stop(self) -> None:
        if self._seen in gc.callbacks:
            gc.callbacks.remove(self._seen)


def launches(ops: int, device: str) -> tuple[float, Any]:
    """One 'step' of ``ops`` tiny in-place ops; seconds (synchronized on CUDA)."""
    x, y = torch.ones(16, device=device), torch.full((16,), 0.5, device=device)
    t = time.perf_counter()
    for _ in range(ops):
        x.mul_(y).add_(y)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t, x


def p90(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[max(0, -(-9 * len(ordered) // 10) - 1)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    model, optimizer = build(args.layers, args.width, args.device, args.fsdp)
    state_bytes = sum(t.numel() * t.element_size() for t in list(model.state_dict().values()))
    config = {"host": {"capacity": max(64 << 20, 3 * 4 * state_bytes + (16 << 20)), "snapshots": 3},
              "tiers": [{"name": "ram", "type": "memory", "keep": {"last": 1}}]}
    calls, alone, after = [], [], []
    collector = Collector()
    with Checkpointer(config) as ckpt:
        for slot in ckpt._pool.slots:  # faulted in (and pinned) before anything is timed
            ckpt._pool.prepare(slot)
        ckpt.attach(optimizer)
        for step in range(args.warmup + args.saves):
            alone_s, _ = launches(args.ops, args.device)
            state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
            if args.device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            handle = ckpt.save_sync(step, state)
            call_s = time.perf_counter() - t
            after_s, _ = launches(args.ops, args.device)
            if not handle.captured_sync(60):
                raise RuntimeError(f"step {step} was not captured")
            if step == args.warmup - 1:
                collector.start()
            if step >= args.warmup:
                calls.append(call_s)
                alone.append(alone_s)
                after.append(after_s)
    collector.stop()
    out = {
        "tensors": len(tierckpt.state.flatten(state)[1]), "state_bytes": state_bytes, "saves": args.saves,
        "collector": {"runs": collector.runs, "ms_per_save": {g: 1e3 * t / args.saves for g, t in collector.seconds.items()}},
        "call_ms": {"median": 1e3 * statistics.median(calls), "p90": 1e3 * p90(calls), "samples": [1e3 * c for c in calls]},
        "launch_step_ms": {"alone": 1e3 * statistics.median(alone), "after_save": 1e3 * statistics.median(after)},
    }
    out["launch_step_ms"]["slowdown_pct"] = 100 * (out["launch_step_ms"]["after_save"] / out["launch_step_ms"]["alone"] - 1)
    return out


def markdown(report: dict[str, Any], args: argparse.Namespace) -> str:
    m, r = report["machine"], report["result"]
    gpu = f"; GPU: {torch.cuda.get_device_name(0)}" if args.device == "cuda" else ""
    call, step = r["call_ms"], r["launch_step_ms"]
    gc_runs = "/".join(str(r["collector"]["runs"][g]) for g in (0, 1, 2))
    gc_ms = sum(r["collector"]["ms_per_save"].values())
    met = "met" if call["median"] <= GOAL_MS else "NOT met"
    return "\n".join([
        f"### `save()` and the training thread ({report['time']})",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores{gpu}; Python {m['python']}, torch {m['torch']}; tierckpt from "
        f"`{report['library']}`. A model of {args.layers} `Linear({args.width}, {args.width})` and its AdamW state on "
        f"`{args.device}`{', FSDP2 over 1 rank (DTensors)' if args.fsdp else ''}: {r['tensors']} tensors, {r['state_bytes'] / 2**20:.1f} MiB of weights; a memory tier; "
        f"{r['saves']} saves after {args.warmup} warm-up saves.",
        "",
        "| measure | median | p90 |",
        "| --- | ---: | ---: |",
        f"| `save_sync` call, `state_dict()` not counted | {call['median']:.3f} ms | {call['p90']:.3f} ms |",
        f"| a launch-bound step ({args.ops} × 2 tiny ops) alone | {step['alone']:.2f} ms | |",
        f"| the same step right after `save()` returned, beside the copies | {step['after_save']:.2f} ms ({step['slowdown_pct']:+.0f}%) | |",
        f"| Python's collector, a save (runs of generations 0/1/2 over the {r['saves']} saves: {gc_runs}) | {gc_ms:.3f} ms | |",
        "",
        f"Goal: the call ≤ {GOAL_MS:g} ms for 600 tensors: {call['median']:.3f} ms for {r['tensors']} ({met}).",
        "",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--layers", type=int, default=75, help="Linear layers: 8 state tensors each (default 75: 600)")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard) over a 1-rank group: a state of DTensors")
    parser.add_argument("--saves", type=int, default=300, help="timed saves (a full collection comes every few hundred)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--ops", type=int, default=600, help="pairs of tiny ops in a launch-bound step")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--name", help="the output files' name without the suffix (default save_call-<time>)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available to this torch")
    torch.set_num_threads(1)  # tiny ops: intra-op threads would only add their hand-offs
    if args.fsdp:
        import torch.distributed as dist

        from tierckpt.testing.ranks import free_port

        dist.init_process_group("gloo" if args.device == "cpu" else "nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d %H:%M")
    report = {"time": stamp, "machine": machine(args.out), "library": str(Path(tierckpt.__file__).parent), "args": vars(args) | {"out": str(args.out)},
              "result": run(args)}
    text = markdown(report, args)
    print(text)
    name = args.name or f"save_call-{time.strftime('%Y%m%d-%H%M%S')}"
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / f"{name}.md").write_text(text)


if __name__ == "__main__":
    main()
