"""What observing costs a save: the ``save()`` call and the capture, with events and metrics on vs off.

The state of ``benchmarks/save_call.py`` (``--layers`` ``Linear(--width, --width)`` and their AdamW
state: 600 tensors by default) saved by three Checkpointers in one process, taking turns save by save
in a rotating order: two plain ones (their difference is the noise floor of the run) and one with
``events: FILE`` and ``metrics: {port: 0}`` (and, with ``--records``, the dotted log records enabled
at DEBUG into a handler that drops them). Each has a memory tier and a
filesystem tier in ``--dir``, so every save emits ``save``, ``captured`` and, for the versions the
disk takes, ``flushed`` and ``deleted``. Medians over ``--saves`` saves each, in the same run.

Goal (issue 40): the call ≤ 5% slower, the capture (save → captured) ≤ 1% slower, against the mean
of the two plain ones; where the noise floor is wider than the goal, the run cannot tell.

    .venv/bin/python benchmarks/observe_overhead.py --dir /tmp/obs
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from machine_limits import machine
from save_call import build
from tierckpt import Checkpointer
from tierckpt.observe.records import LOGGER

HERE = Path(__file__).resolve().parent
GOALS = {"call": 5.0, "capture": 1.0}  # % slower at most


def config(root: Path, state_bytes: int, observed: bool) -> dict[str, Any]:
    made: dict[str, Any] = {
        "host": {"capacity": max(64 << 20, 3 * 4 * state_bytes + (16 << 20)), "snapshots": 3},
        "tiers": [{"name": "ram", "type": "memory", "keep": {"last": 1}},
                  {"name": "nvme", "type": "filesystem", "path": str(root / "nvme"), "keep": {"last": 2}}],
    }
    if observed:
        made |= {"events": str(root / "events.jsonl"), "metrics": {"port": 0}}
    return made


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    model, optimizer = build(args.layers, args.width, "cpu")
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3
    if args.records:
        logging.getLogger(LOGGER).addHandler(logging.NullHandler())
        logging.getLogger(LOGGER).setLevel(logging.DEBUG)
    kinds = ("off", "off2", "on")
    timed: dict[str, dict[str, list[float]]] = {k: {"call": [], "capture": []} for k in kinds}
    with Checkpointer(config(root / "off", state_bytes, False)) as off, Checkpointer(config(root / "off2", state_bytes, False)) as off2, \
            Checkpointer(config(root / "on", state_bytes, True)) as on:
        checkpointers = list(zip(kinds, (off, off2, on)))
        for step in range(args.warmup + args.saves):
            for kind, ckpt in checkpointers[step % 3 :] + checkpointers[: step % 3]:
                state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
                t = time.perf_counter()
                handle = ckpt.save_sync(step, state)
                call_s = time.perf_counter() - t
                if not handle.captured_sync(60):
                    raise RuntimeError(f"step {step} was not captured")
                capture_s = time.perf_counter() - t
                ckpt.wait_sync()  # the flush and its events happen between saves, not during the next one
                if step >= args.warmup:
                    timed[kind]["call"].append(call_s)
                    timed[kind]["capture"].append(capture_s)
        lines = sum(1 for _ in open(root / "on" / "events.jsonl")) if (root / "on" / "events.jsonl").exists() else 0
    result: dict[str, Any] = {"tensors": 8 * args.layers, "state_bytes": state_bytes, "saves": args.saves, "event_lines": lines}
    for what in ("call", "capture"):
        off_ms, off2_ms, on_ms = (1e3 * statistics.median(timed[k][what]) for k in kinds)
        plain = (off_ms + off2_ms) / 2
        result[what] = {"off_ms": plain, "on_ms": on_ms, "overhead_pct": 100 * (on_ms / plain - 1),
                        "noise_pct": 100 * abs(off2_ms / off_ms - 1)}
    return result


def verdict(measured: dict[str, float], goal: float) -> str:
    if measured["overhead_pct"] <= goal:
        return "met"
    return "not told apart from noise" if measured["overhead_pct"] <= measured["noise_pct"] else "NOT met"


def markdown(report: dict[str, Any], args: argparse.Namespace) -> str:
    m, r = report["machine"], report["result"]
    rows = [
        f"| {label} | {r[w]['off_ms']:.3f} ms | {r[w]['on_ms']:.3f} ms | {r[w]['overhead_pct']:+.1f}% | {r[w]['noise_pct']:.1f}% | "
        f"≤ {GOALS[w]:g}%: {verdict(r[w], GOALS[w])} |"
        for w, label in (("call", "`save_sync` call"), ("capture", "save → captured"))
    ]
    records = " and the dotted log records at DEBUG" if args.records else ""
    return "\n".join([
        f"### Observability overhead ({report['time']})",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores; Python {m['python']}, torch {m['torch']}. {r['tensors']} tensors, "
        f"{r['state_bytes'] / 2**20:.1f} MiB; memory + filesystem tier; {r['saves']} saves each after {args.warmup} warm-up, "
        f"in rotating order. On: an events file ({r['event_lines']} lines written) and a Prometheus endpoint{records}.",
        "",
        "| measure | off (median of 2) | on (median) | on vs off | off vs off | goal |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
        *rows,
        "",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=75, help="Linear layers: 8 state tensors each (default 75: 600)")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--saves", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--records", action="store_true", help="also enable the dotted log records (DEBUG, into a NullHandler)")
    parser.add_argument("--dir", type=Path, help="where the tiers and the events file go (default: a temporary directory)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="observe-", dir=args.dir))
    try:
        report = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(root), "args": vars(args) | {"dir": str(args.dir), "out": str(args.out)}}
        report["result"] = run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = markdown(report, args)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"observe_overhead-{time.strftime('%Y%m%d-%H%M%S')}"
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / f"{name}.md").write_text(text)


if __name__ == "__main__":
    main()
