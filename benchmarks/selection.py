"""Selection per tier: does each tier receive the versions its own flush policy selects?

The configuration a new user writes from the docs (docs/configuration.md): ``ram`` → ``nvme`` (``flush: {every: 1}``,
``keep: {last: 3}``) → ``pfs`` (``flush: {every_steps: 50}``, ``keep: {last: 100}``), ``host.snapshots:
4``, a ``--mib`` MiB state, ``--steps`` steps of a training loop at each of ``--step-ms`` step times. The
loop is simulated as in ``pressure.py``: the lazy barrier (``wait_captured``) before the in-place update
of the state, ``save()``, then sleep until the next tick. Both tiers are real filesystem tiers on
``--dir`` (fsync, O_DIRECT): nvme is busy with nearly every step, which is what starved pfs before
each tier selected on the stream of saves (issue 20).

Per tier it reports the versions its policy selected (over the saves that happened), the versions it
received while the loop ran and after ``wait()``, and what it held when the loop ended; for pfs also
the steps it held, and the longest time any selected version waited before pfs held it or a newer
selected one (a crash in that window finds pfs without it). Appends a table to RESULTS.md.

    .venv/bin/python benchmarks/selection.py --steps 400 --mib 64 --step-ms 5,20,50
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from common import disk_tier, pieces_state, ram_tier
from tierckpt import Checkpointer
from tierckpt.config import TierConfig
from tierckpt.policy import flush_eligible
from tierckpt.tiers.base import Staged, VersionInfo
from tierckpt.tiers.filesystem import FilesystemTier

TIERS = ("nvme", "pfs")


class RecordingTier(FilesystemTier):
    """A real filesystem tier that notes when each commit ended (perf_counter seconds)."""

    def __init__(self, config: TierConfig) -> None:
        super().__init__(config)
        self.commits: list[tuple[int, float]] = []

    async def commit(self, staged: Staged) -> VersionInfo:
        info = await super().commit(staged)
        self.commits.append((staged.step, time.perf_counter()))
        return info


def tiers_config(directory: Path, pfs_every: int) -> list[dict[str, Any]]:
    return [
        ram_tier(keep={"last": 1}),
        disk_tier(directory / "nvme", "nvme", flush={"every": 1}, keep={"last": 3}),
        disk_tier(directory / "pfs", "pfs", flush={"every_steps": pfs_every}, keep={"last": 100}),
    ]


def run(args: argparse.Namespace, step_s: float, directory: Path, state: dict[str, Any], nbytes: int) -> dict[str, Any]:
    slot = nbytes + (1 << 20)
    config = {"host": {"capacity": slot * args.snapshots, "snapshots": args.snapshots, "on_full": "block"}, "tiers": tiers_config(directory, args.pfs_every)}
    made: dict[str, RecordingTier] = {}

    def factory(cfg: TierConfig) -> RecordingTier | None:
        if cfg.name not in TIERS:
            return None
        made[cfg.name] = RecordingTier(cfg)
        return made[cfg.name]

    ckpt = Checkpointer(config, tier_factory=factory)
    policies = {t.name: t.flush for t in ckpt.config.tiers if t.name in TIERS}
    first = state["model"]["w0"]
    saved_at: dict[int, float] = {}
    seq = 0
    selected: dict[str, list[int]] = {name: [] for name in TIERS}
    save_s: list[float] = []
    barrier_s: list[float] = []
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        delay = started + (step - 1) * step_s - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        t = time.perf_counter()
        ckpt.wait_captured()  # the optimizer step's lazy barrier
        barrier_s.append(time.perf_counter() - t)
        first[:1024] = float(step)  # the "optimizer" updates the state in place
        state["step"] = step
        t = time.perf_counter()
        handle = ckpt.save_sync(step, state)
        save_s.append(time.perf_counter() - t)
        if handle.skipped:
            continue
        seq += 1
        saved_at[step] = t
        for name in TIERS:
            if flush_eligible(policies[name], step, seq):
                selected[name].append(step)
    loop_end = time.perf_counter()
    held_at_end = {name: [v.step for v in ckpt.versions() if v.tier == name] for name in TIERS}
    received_in_loop = {name: [s for s, at in made[name].commits if at <= loop_end] for name in TIERS}
    ckpt.wait_sync()
    received = {name: [s for s, _ in made[name].commits] for name in TIERS}
    held_final = {name: [v.step for v in ckpt.versions() if v.tier == name] for name in TIERS}
    counters = ckpt.counters
    ckpt.close_sync()
    # The longest time a version pfs selected waited before pfs held it, or a newer one it selected.
    waits = []
    for s in selected["pfs"]:
        covered = [at for got, at in made["pfs"].commits if got >= s and got in selected["pfs"]]
        waits.append((min(covered) if covered else float("inf")) - saved_at[s])
    return {
        "step_ms": step_s * 1e3,
        "elapsed_s": loop_end - started,
        "selected": selected,
        "received_in_loop": received_in_loop,
        "received": received,
        "held_at_end": held_at_end,
        "held_final": held_final,
        "pfs_longest_wait_s": max(waits, default=float("nan")),
        "skipped": counters.skipped_saves,
        "save_ms_max": max(save_s) * 1e3,
        "blocked_s": sum(save_s) + sum(barrier_s),  # training held: save() calls and the lazy barrier
    }


def got(selected: list[int], received: list[int]) -> str:
    return f"{len(set(selected) & set(received))} of {len(selected)}"


def report(args: argparse.Namespace, results: list[dict[str, Any]], nbytes: int) -> str:
    disk = os.popen(f"df -hT {args.root} | tail -1").read().strip()
    lines = [
        f"### selection per tier: {args.steps} steps of a {nbytes / 2**20:.0f} MiB state, ram → nvme (every 1) → pfs (every_steps {args.pfs_every}) ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}; "
        f"disk: `{disk}`. host: {args.snapshots} slots, on_full block; nvme keep last 3, pfs keep last 100; both real filesystem tiers "
        f"(O_DIRECT, fsync). Code: {args.label}. Command: `python benchmarks/selection.py --steps {args.steps} --mib {args.mib:g} --step-ms {args.step_ms}`.",
        "",
        "| step time | loop s | training held (save + barrier) s | nvme: selected → received in loop / after wait() | pfs: selected → received in loop / after wait() | pfs held when the loop ended | pfs: longest wait of a selected version, s | save() max ms |",
        "| ---: | ---: | ---: | --- | --- | --- | ---: | ---: |",
    ]
    for r in results:
        sel, inl, rec = r["selected"], r["received_in_loop"], r["received"]
        held = r["held_at_end"]["pfs"]
        lines.append(
            f"| {r['step_ms']:g} ms | {r['elapsed_s']:.1f} | {r['blocked_s']:.2f} | {got(sel['nvme'], inl['nvme'])} / {got(sel['nvme'], rec['nvme'])} "
            f"| {got(sel['pfs'], inl['pfs'])} / {got(sel['pfs'], rec['pfs'])} | {held if held else 'nothing'} "
            f"| {r['pfs_longest_wait_s']:.2f} | {r['save_ms_max']:.1f} |"
        )
    lines += [
        "",
        "Selected: the saves the tier's own policy picks (`every` counts saves, `every_steps` divides the step). "
        "Received: versions committed on the tier. nvme cannot write a version per step at these step times, so under "
        "`newest_only` it takes the newest save each time it is free (it is meant to skip). pfs writes one version per "
        f"{args.pfs_every} steps, far below what the disk takes: it should receive every one it selects. Loop s: the "
        f"{args.steps} steps' wall time, at least steps × step time; training held: the time the loop spent in save() and "
        "in the lazy barrier (waiting for the host copy, or for a slot).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--mib", type=float, default=64.0, help="state size in MiB")
    parser.add_argument("--step-ms", default="5,20,50", help="step times to run, ms, comma-separated")
    parser.add_argument("--snapshots", type=int, default=4, help="host.snapshots")
    parser.add_argument("--pfs-every", type=int, default=50, help="pfs's flush.every_steps")
    parser.add_argument("--label", default="this tree", help="what code ran (for the report)")
    parser.add_argument("--dir", type=Path, default=None, help="where the tiers live (default: a temporary directory)")
    parser.add_argument("--results", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    parser.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    args = parser.parse_args()
    args.root = args.dir or Path(tempfile.mkdtemp(prefix="tierckpt-selection-"))
    args.root.mkdir(parents=True, exist_ok=True)
    state = pieces_state(int(args.mib * 2**20))
    nbytes = sum(t.numel() * t.element_size() for t in state["model"].values())
    gc.collect()
    gc.freeze()  # what a latency-sensitive loop does once its model is built (see pressure.py)
    results = []
    for ms in (float(x) for x in args.step_ms.split(",")):
        directory = args.root / f"run-{ms:g}ms"
        shutil.rmtree(directory, ignore_errors=True)
        result = run(args, ms / 1e3, directory, state, nbytes)
        shutil.rmtree(directory, ignore_errors=True)
        results.append(result)
        print(
            f"{ms:g} ms: pfs selected {result['selected']['pfs']}, held when the loop ended {result['held_at_end']['pfs']}, "
            f"received {result['received']['pfs']}; nvme received {len(result['received']['nvme'])} of {len(result['selected']['nvme'])}",
            flush=True,
        )
    if args.dir is None:
        shutil.rmtree(args.root, ignore_errors=True)
    text = report(args, results, nbytes)
    print(text)
    with args.results.open("a") as f:
        f.write("\n" + text)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
