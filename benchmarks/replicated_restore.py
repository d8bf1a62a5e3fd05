"""A replicated value on restore, read from storage once per group of ranks against once per rank (issue 38).

Real jobs of N ranks on this machine (gloo on 127.0.0.1, this script with ``--rank-worker``). One
job saves, once, a state of ``--mib`` MiB that every rank holds alike (data-parallel weights, saved
with ``replicated=``: stored once, each rank writing its share) and a small tensor of each rank's
own, into a shared filesystem tier. Then new jobs restore it into templates, alternating
``distributed.read_replicated: once`` (each rank reads the chunks it stored and sends them to the
others) and ``every_rank`` (each rank reads the whole value), ``--repeats`` times each, the page
cache dropped before each job where this process may (root). Each row gives the stored bytes the
ranks read from storage together (``Restored.read_bytes``), against the version's size, and the
restore's time on the slowest rank (from the call to its return; construction not counted).

In the same run, the disk's limit for those bytes: the version's files read once with O_DIRECT into
reused buffers with the tier's threads (page cache dropped). ``once`` reads the version once between
all ranks, so its time is compared with that limit; ``every_rank`` reads it N times.

    flock /tmp/tierckpt-bench.lock .venv/bin/python benchmarks/replicated_restore.py --ranks 2 4 --mib 256

Results: JSON in benchmarks/results/replicated_restore.json and a markdown table (printed, and
written to /tmp/replicated_restore_results.md). One host: the ranks share one disk and one page
cache, and the network between them is loopback TCP; the bytes read are what scales with the job.
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
from machine_limits import drop_caches, read_files

HERE = Path(__file__).resolve().parent
PIECES = 8  # tensors the replicated value is cut into


def state(mib: int, rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    numel = (mib << 20) // PIECES // 4
    return {"model": {f"w{i}": torch.randn(numel, generator=g) for i in range(PIECES)}, "mine": torch.full((4096,), float(rank))}


def rank_worker(job: dict[str, Any]) -> None:
    common.start_rank(job["timeout"] * 3)
    import torch.distributed as dist

    from tierckpt import Checkpointer

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    config = common.tier_config(
        common.disk_tier(job["dir"]), capacity=f"{job['mib'] + 64}MiB", snapshots=1,
        distributed={"timeout": job["timeout"], "read_replicated": job.get("mode", "once")},
    )
    out: dict[str, Any] = {"rank": rank}
    with Checkpointer(config) as ckpt:
        if job["role"] == "save":
            assert ckpt.save_sync(1, state(job["mib"], rank), replicated=["model"]).committed_sync("disk", job["timeout"])
        else:
            template = state(job["mib"], rank)
            for t in template["model"].values():
                t.zero_()
            dist.barrier()
            from tierckpt.testing.inspect import exchange_tally

            before = exchange_tally(ckpt)
            started = time.perf_counter()
            restored = ckpt.restore_latest_sync(template)
            out["restore_s"] = time.perf_counter() - started
            after = exchange_tally(ckpt)
            assert before is not None and after is not None
            out["exchanges"] = after.requests["all_gather"] - before.requests["all_gather"]
            out["exchange_sent"] = after.sent - before.sent
            assert restored is not None and restored.step == 1
            out["read_bytes"] = restored.read_bytes
            out["bitwise"] = all(torch.equal(a, b) for a, b in zip(template["model"].values(), state(job["mib"], rank)["model"].values()))
    dist.barrier()
    dist.destroy_process_group()
    Path(job["results"], f"rank-{rank}.json").write_text(json.dumps(out))


def one_world(ranks: int, job: dict[str, Any], base: Path, repeats: int, threads: int) -> dict[str, Any]:
    job = job | {"dir": str(base / f"disk-{ranks}"), "results": str(base / f"results-{ranks}")}
    logs = base / f"logs-{ranks}"
    common.run_ranks(__file__, job | {"role": "save"}, ranks, logs, timeout_s=job["timeout"] * 4, what=f"saving with {ranks} ranks")
    version = next(Path(job["dir"]).glob("step-*"))
    files = sorted(version.glob("data-r*.bin"))
    stored = sum(p.stat().st_size for p in files)
    runs: dict[str, list[dict[str, Any]]] = {"once": [], "every_rank": []}
    limits: list[float] = []
    cold = False
    for _ in range(repeats):
        cold = drop_caches()
        limits.append(read_files(files, threads, cold))
        for mode in runs:  # alternating: both see the same disk, minute by minute
            cold = drop_caches()
            out = common.run_ranks(__file__, job | {"role": "restore", "mode": mode}, ranks, logs, timeout_s=job["timeout"] * 4,
                                   what=f"restoring with {ranks} ranks ({mode})")
            assert all(r["bitwise"] for r in out), f"{mode}: a rank restored other bytes"
            runs[mode].append({"read_bytes": sum(r["read_bytes"] for r in out), "restore_s": max(r["restore_s"] for r in out),
                               "exchanges": out[0]["exchanges"], "exchange_sent": out[0]["exchange_sent"]})
    shutil.rmtree(job["dir"], ignore_errors=True)
    limit_s = min(limits)
    row: dict[str, Any] = {"ranks": ranks, "stored_bytes": stored, "limit_s": limit_s, "cold": cold}
    for mode, samples in runs.items():
        seconds = statistics.median(s["restore_s"] for s in samples)
        row[mode] = {"read_bytes": statistics.median(s["read_bytes"] for s in samples), "restore_s": seconds,
                     "exchanges": samples[0]["exchanges"], "exchange_sent": samples[0]["exchange_sent"],
                     "restores_s": [s["restore_s"] for s in samples], "of_limit": limit_s / seconds}
    return row


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| ranks | version | mode | read from storage, all ranks | × the version | restore, slowest rank (median) | disk limit, one read | limit / restore |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        for mode in ("once", "every_rank"):
            m = r[mode]
            lines.append(
                f"| {r['ranks']} | {r['stored_bytes'] / 2**20:.0f} MiB | `{mode}` | {m['read_bytes'] / 2**20:.0f} MiB | "
                f"{m['read_bytes'] / r['stored_bytes']:.2f} | {m['restore_s']:.2f} s | {r['limit_s']:.2f} s | {100 * m['of_limit']:.0f}% |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="job sizes")
    parser.add_argument("--mib", type=int, default=256, help="MiB of the replicated value")
    parser.add_argument("--repeats", type=int, default=3, help="restores of each mode, alternating")
    parser.add_argument("--threads", type=int, default=4, help="the tier's io_threads (the default), for the disk limit")
    parser.add_argument("--timeout", type=float, default=120.0, help="distributed.timeout, seconds")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="where replicated_restore.json goes")
    parser.add_argument("--rank-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker:
        rank_worker(json.loads(args.rank_worker))
        return
    base = Path(tempfile.mkdtemp(prefix="tierckpt-replicated-", dir="."))
    job = {"mib": args.mib, "timeout": args.timeout}
    started = time.perf_counter()
    try:
        rows = [one_world(n, job, base, args.repeats, args.threads) for n in args.ranks]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    report = {"mib": args.mib, "repeats": args.repeats, "cpus": os.cpu_count(), "python": sys.version.split()[0], "rows": rows}
    results = args.out / "replicated_restore.json"
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(report, indent=1))
    cache = "page cache dropped before each" if rows and rows[0]["cold"] else "page cache NOT dropped (not root)"
    lines = [f"## Replicated value on restore: read once per group vs every rank ({args.mib} MiB, {args.repeats} restores each, {cache}, {os.cpu_count()} cores)",
             "", *table(rows), ""]
    common.show_report(lines, Path("/tmp/replicated_restore_results.md"), results, time.perf_counter() - started)


if __name__ == "__main__":
    main()
