"""What a multi-rank commit costs against the machine's floor for coordination, at 2 to 16 ranks (issue 38).

A real job of N ranks on this machine (gloo on 127.0.0.1, this script with ``--rank-worker``) saves a
small state (``--kib`` a rank, 256 KiB by default) ``--saves`` times into host memory and one shared
filesystem tier; each save's time is from ``save()`` to committed on that tier, on rank 0. Beside
each save, in the same job, the **floor**: a barrier, then the time of a barrier plus a 16-byte
``all_gather`` on rank 0, what two rounds of messages among the ranks cost here at the least. A commit
needs two rounds (the leader's decision out, every rank's report in) plus the writes, so
commit / floor says how much coordination the protocol adds beyond the rounds it must make. The
saves alternate with the floors, so that both see the same machine; the first of each is a warm-up.
``--ranks 1`` is the one-process commit (no floor): the reference for the commit at 2 ranks.

    flock /tmp/tierckpt-bench.lock .venv/bin/python benchmarks/scale.py --ranks 1 2 8 16

Results: JSON in benchmarks/results/scale.json and a markdown table (printed, and written to
/tmp/scale_results.md). On 2 cores, 16 processes are themselves the floor: the table says what the
protocol adds on top of that, not what 16 machines would see.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import common

HERE = Path(__file__).resolve().parent


def rank_worker(job: dict[str, Any]) -> None:
    common.start_rank(job["timeout"] * 3)
    from tierckpt import Checkpointer

    ranked = "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", "0"))
    if ranked:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    state = common.pieces_state(job["kib"] << 10, pieces=4)
    config = common.tier_config(
        common.disk_tier(job["dir"], keep={"last": 2}), capacity=4 * (job["kib"] << 10) + (4 << 20), snapshots=3,
        distributed={"timeout": job["timeout"]},
    )
    commits: list[float] = []
    floors: list[float] = []
    with Checkpointer(config) as ckpt:
        for step in range(1, job["saves"] + 2):  # the first: a warm-up
            if ranked:
                floors.append(_floor())
                dist.barrier()
            for t in state["model"].values():
                t.add_(1.0)
            started = time.perf_counter()
            handle = ckpt.save_sync(step, state)
            assert handle.committed_sync("disk", job["timeout"]), f"step {step} not committed"
            commits.append(time.perf_counter() - started)
    if ranked:
        dist.barrier()
        dist.destroy_process_group()
    Path(job["results"], f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "commit_s": commits[1:], "floor_s": floors[1:]}))


def _floor() -> float:
    """A barrier, then the time of a barrier and a 16-byte all_gather: two rounds among the ranks."""
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    dist.barrier()
    out = [torch.zeros(4, dtype=torch.int32) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.zeros(4, dtype=torch.int32))
    return time.perf_counter() - started


def one_world(ranks: int, job: dict[str, Any], base: Path) -> dict[str, Any]:
    job = job | {"dir": str(base / f"disk-{ranks}"), "results": str(base / f"results-{ranks}")}
    world = 0 if ranks == 1 else ranks
    out = common.run_ranks(__file__, job, world, base / f"logs-{ranks}", timeout_s=job["timeout"] * 4, what=f"{ranks} rank(s)")
    shutil.rmtree(job["dir"], ignore_errors=True)
    mine = out[0]
    commit = statistics.median(mine["commit_s"])
    floor = statistics.median(mine["floor_s"]) if mine["floor_s"] else None
    return {"ranks": ranks, "commit_ms": 1e3 * commit, "floor_ms": None if floor is None else 1e3 * floor,
            "commit_per_floor": None if floor is None else commit / floor, "commits_ms": [1e3 * s for s in mine["commit_s"]]}


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| ranks | commit median ms | floor median ms | commit / floor |", "| ---: | ---: | ---: | ---: |"]
    for r in rows:
        floor = "—" if r["floor_ms"] is None else f"{r['floor_ms']:.1f}"
        ratio = "—" if r["commit_per_floor"] is None else f"{r['commit_per_floor']:.2f}"
        lines.append(f"| {r['ranks']} | {r['commit_ms']:.1f} | {floor} | {ratio} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 8, 16], help="job sizes (1: one process)")
    parser.add_argument("--kib", type=int, default=256, help="KiB of state a rank")
    parser.add_argument("--saves", type=int, default=20, help="saves a job (after a warm-up)")
    parser.add_argument("--timeout", type=float, default=120.0, help="distributed.timeout, seconds")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="where scale.json goes")
    parser.add_argument("--rank-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker:
        rank_worker(json.loads(args.rank_worker))
        return
    base = Path(tempfile.mkdtemp(prefix="tierckpt-scale-", dir="."))
    job = {"kib": args.kib, "saves": args.saves, "timeout": args.timeout}
    started = time.perf_counter()
    try:
        rows = [one_world(n, job, base) for n in args.ranks]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    report = {"kib": args.kib, "saves": args.saves, "cpus": os.cpu_count(), "python": sys.version.split()[0], "rows": rows}
    results = args.out / "scale.json"
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(report, indent=1))
    title = f"## Scale: commit against the floor ({args.kib} KiB a rank, {args.saves} saves, {os.cpu_count()} cores)"
    common.show_report([title, "", *table(rows)], Path("/tmp/scale_results.md"), results, time.perf_counter() - started)


if __name__ == "__main__":
    main()
