"""What a multi-rank commit costs against the machine's floor for coordination, at 2 to 16 ranks (issue 38).

A real job of N ranks on this machine (gloo on 127.0.0.1, this script with ``--rank-worker``) saves a
small state (``--kib`` a rank, 256 KiB by default) ``--saves`` times into host memory and one shared
filesystem tier; each save's time is from ``save()`` to committed on that tier, on rank 0. Beside
each save, in the same job, the **floor**: a barrier, then the time of a barrier plus a 16-byte
``all_gather`` on rank 0, what two rounds of messages among the ranks cost here at the least. A commit
needs two rounds (the leader's decision out, every rank's report in) plus the writes, so
commit / floor says how much coordination the protocol adds beyond the rounds it must make. The
saves alternate with the floors, so that both see the same machine; the first of each is a warm-up.
``--ranks 1`` is the one-process commit (no floor): the reference for the commit at 2 ranks. Each
rank also counts what it asked of the group's store (:class:`~tierckpt.ranks.group.StoreTally`): the
requests a save costs, all ranks together.

``--simulate 1000 4000 10000``: the commit protocol's real code for that many ranks in this one process
(:mod:`tierckpt.testing.simranks`: every rank's real flusher and RankGroup over an in-process store,
a tier that stores no bytes), per save: the store requests of all ranks and of the leader, the bytes
through the store, the largest message, the commit marker's size, the leader's CPU time alone (its
reports already in), and a fitted linear model of each. ``--ranks`` and ``--simulate`` may be given
together; tests/test_scale_simulation.py holds the simulation's counts against a real job's. With
``--simulate``, also the restore's agreement for those sizes (:mod:`tierckpt.testing.simrestore`: the
exchanges, what a rank sends and receives, its CPU to agree).

``--phases``: each save's phases on every rank, stamped on the real code's seams (the leader's round
published, each rank's write of its part, its report, the reports in, the commit marker sealed, the
version committed, the outcome, the handle resolved), as milliseconds after rank 0's ``save()`` (one
host, one clock): where a commit of N ranks spends its time beside one process's.

``--per-node K``: nodes of K ranks, each but the leader's relaying its ranks' commits through a store of
its own (``distributed.relay: nodes``, :mod:`tierckpt.ranks.nodestore`), in the real jobs (nodes
simulated on this host with ``distributed.nodes``) and in the simulation; the requests of the nodes'
stores are counted apart from the leader's store's.

    flock /tmp/tierckpt-bench.lock .venv/bin/python benchmarks/scale.py --ranks 1 2 8 16
    .venv/bin/python benchmarks/scale.py --ranks --simulate 1000 4000 10000
    .venv/bin/python benchmarks/scale.py --ranks 8 16 --simulate 1000 4000 10000 --per-node 8
    flock /tmp/tierckpt-bench.lock .venv/bin/python benchmarks/scale.py --ranks 1 2 --saves 30 --phases

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
    distributed: dict[str, Any] = {"timeout": job["timeout"]}
    if job.get("per_node") and ranked:
        distributed |= {"nodes": int(os.environ["WORLD_SIZE"]) // job["per_node"], "relay": "nodes"}
    config = common.tier_config(
        common.disk_tier(job["dir"], keep={"last": 2}), capacity=4 * (job["kib"] << 10) + (4 << 20), snapshots=3, distributed=distributed,
    )
    from tierckpt.testing.inspect import node_store_tally, store_tally

    stamps = _stamp_phases() if job.get("phases") else None
    phases: list[list[tuple[str, float]]] = []

    commits: list[float] = []
    floors: list[float] = []
    tallies: list[dict[str, int]] = []  # what this rank asked of the store so far, after each commit
    node_tallies: list[dict[str, int]] = []  # and of its node's store (relays)
    with Checkpointer(config) as ckpt:
        for step in range(1, job["saves"] + 2):  # the first: a warm-up
            if ranked:
                floors.append(_floor())
                dist.barrier()
            for t in state["model"].values():
                t.add_(1.0)
            if stamps is not None:  # a follower may read this save's round before its own save() starts
                stamps.append(("save", time.time()))
            started = time.perf_counter()
            handle = ckpt.save_sync(step, state)
            assert handle.committed_sync("disk", job["timeout"]), f"step {step} not committed"
            commits.append(time.perf_counter() - started)
            if stamps is not None:
                phases.append([*stamps, ("handle resolved", time.time())])
                stamps.clear()
            tally = store_tally(ckpt)
            if tally is not None:
                tallies.append(dict(tally.by_key))
            node_tally = node_store_tally(ckpt)
            if node_tally is not None:
                node_tallies.append(dict(node_tally.by_key))
    if ranked:
        dist.barrier()
        dist.destroy_process_group()
    Path(job["results"], f"rank-{rank}.json").write_text(
        json.dumps({"rank": rank, "commit_s": commits[1:], "floor_s": floors[1:], "tallies": tallies, "node_tallies": node_tallies,
                    "phases": phases[1:]})
    )


def _stamp_phases() -> list[tuple[str, float]]:
    """Stamp (``time.time``) the end of each phase of a save on this rank, on the real code's seams;
    the list they go into (the caller empties it at each save)."""
    import functools

    from tierckpt.pipeline import ranked
    from tierckpt.pipeline.channel import TierChannel
    from tierckpt.ranks.group import RankGroup
    from tierckpt.tiers.stored.tier import StoredTier

    stamps: list[tuple[str, float]] = []

    def stamp(cls: Any, name: str, label: str, start: str | None = None, when: Any = None) -> None:
        original = getattr(cls, name)

        @functools.wraps(original)
        async def stamped(self: Any, *args: Any, **kwargs: Any) -> Any:
            if start is not None:
                stamps.append((start, time.time()))
            result = await original(self, *args, **kwargs)
            if when is None or when(args, result):
                stamps.append((label, time.time()))
            return result

        setattr(cls, name, stamped)

    stamp(ranked.LeaderFlusher, "_publish_round", "round published")
    stamp(ranked.FollowerFlusher, "_round", "round read", when=lambda args, got: got is not None and "flush" in got)
    stamp(StoredTier, "write", "part written", start="part write starts")
    stamp(RankGroup, "put", "report set", when=lambda args, got: "/report/" in args[0])
    stamp(TierChannel, "collect", "reports in")
    stamp(StoredTier, "seal", "marker sealed")
    stamp(StoredTier, "commit", "committed (renamed)")
    stamp(RankGroup, "put", "outcome set", when=lambda args, got: "/outcome/" in args[0])
    stamp(StoredTier, "adopt", "adopted")
    return stamps


def phase_table(rows: list[dict[str, Any]]) -> list[str]:
    """Median ms after rank 0's save() of each phase, by job size and rank (rank 0, and rank 1 for all followers)."""
    lines = ["| ranks | rank | phase | ms after rank 0's save() (median) |", "| ---: | ---: | --- | ---: |"]
    for row in rows:
        leader = row.get("phases_by_rank", {}).get("0") or []
        for rank, saves in sorted(row.get("phases_by_rank", {}).items()):
            if rank not in ("0", "1"):
                continue
            at: dict[str, list[float]] = {}
            for own, lead in zip(saves, leader):
                t0 = dict(lead)["save"]
                for what, t in own:
                    at.setdefault(what, []).append(1e3 * (t - t0))
            order = sorted(at, key=lambda k: statistics.median(at[k]))
            lines += [f"| {row['ranks']} | {rank} | {what} | {statistics.median(at[what]):.2f} |" for what in order]
    return lines


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
            "commit_per_floor": None if floor is None else commit / floor, "commits_ms": [1e3 * s for s in mine["commit_s"]],
            "requests_per_save": per_save(out), "node_requests_per_save": per_save(out, "node_tallies"),
            "phases_by_rank": {str(r["rank"]): r["phases"] for r in out if r["phases"]}}


def per_save(ranks: list[dict[str, Any]], which: str = "tallies") -> dict[str, float]:
    """Store requests a save, all ranks together, by kind and key family (after the warm-up save):
    of the leader's store, or (``node_tallies``) of the nodes' stores."""
    total: dict[str, float] = {}
    for rank in ranks:
        tallies = rank[which]
        if len(tallies) < 2:
            continue
        first, last, saves = tallies[0], tallies[-1], len(tallies) - 1
        for kind in set(first) | set(last):
            total[kind] = total.get(kind, 0.0) + (last.get(kind, 0) - first.get(kind, 0)) / saves
    return {k: v for k, v in sorted(total.items()) if v}


def simulate(worlds: list[int], saves: int, per_node: int | None = None) -> list[dict[str, Any]]:
    """The commit protocol of each world size in this process (tierckpt.testing.simranks)."""
    from tierckpt.testing.simranks import leader_seconds, simulate_saves

    rows = []
    for world in worlds:
        started = time.perf_counter()
        costs = simulate_saves(world, saves + 1, per_node=per_node)[1:]  # the first sets up every rank's waits
        leader = leader_seconds(world, saves + 1)[1:]
        last = costs[-1]
        rows.append({
            "ranks": world, "requests": statistics.median(c.total for c in costs), "by_kind": last.requests,
            "by_key": last.by_key, "leader_requests": sum(last.leader_requests.values()), "per_node": per_node,
            "node_by_key": last.node_by_key, "node_requests": sum(last.node_by_key.values()),
            "bytes": statistics.median(c.bytes for c in costs), "largest": last.largest, "marker_bytes": last.marker_bytes,
            "leader_cpu_ms": 1e3 * statistics.median(leader), "leader_cpu_min_ms": 1e3 * min(leader),
            "save_s": statistics.median(c.seconds for c in costs), "wall_s": time.perf_counter() - started,
        })
    return rows


def simulate_restores(worlds: list[int]) -> list[dict[str, Any]]:
    """The restore's agreement of each world size in this process (tierckpt.testing.simrestore)."""
    from tierckpt.testing.simrestore import simulate_restore

    return [vars(simulate_restore(world)) for world in worlds]


def restore_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| ranks | exchanges (all_gather) | a rank sends | a rank receives | agreeing, a rank's CPU | replicated bytes read from storage |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['world']:,} | {r['exchanges']} | {r['sent']} B | {r['received'] / 2**10:,.0f} KiB | {1e3 * r['agree_s']:.1f} ms | "
            f"{'once' if r['read_once'] else 'once a rank'} |"
        )
    return lines


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x``: (a, b)."""
    n, mx, my = len(xs), statistics.fmean(xs), statistics.fmean(ys)
    if n < 2:
        return my, 0.0
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def simulated_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| ranks | store requests a save | a rank | a node | the leader's | node stores' requests | bytes through the store | largest message | "
        "commit marker | leader CPU, median (min) | simulated save, one core |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        per_node = r.get("per_node") or 8
        lines.append(
            f"| {r['ranks']:,} | {r['requests']:,.0f} | {r['requests'] / r['ranks']:.2f} | {r['requests'] * per_node / r['ranks']:.2f} | "
            f"{r['leader_requests']} | {r.get('node_requests', 0):,} | "
            f"{r['bytes'] / 2**20:.2f} MiB | {r['largest'] / 2**10:.0f} KiB | {r['marker_bytes'] / 2**10:.0f} KiB | "
            f"{r['leader_cpu_ms']:.1f} ms ({r['leader_cpu_min_ms']:.1f}) | {r['save_s']:.2f} s |"
        )
    xs = [float(r["ranks"]) for r in rows]
    models = []
    for name, key, unit in (("requests", "requests", ""), ("bytes", "bytes", " B"), ("leader CPU", "leader_cpu_ms", " ms")):
        a, b = fit(xs, [float(r[key]) for r in rows])
        models.append(f"{name} ≈ {a:,.1f}{unit} + {b:,.4g}{unit} × N")
    return [*lines, "", "Fitted: " + "; ".join(models) + "."]


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| ranks | commit median ms | floor median ms | commit / floor | leader's store: requests a save | node stores: requests a save |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        floor = "—" if r["floor_ms"] is None else f"{r['floor_ms']:.1f}"
        ratio = "—" if r["commit_per_floor"] is None else f"{r['commit_per_floor']:.2f}"
        requests = f"{sum(r['requests_per_save'].values()):.1f}" if r["requests_per_save"] else "—"
        nodes = f"{sum(r['node_requests_per_save'].values()):.1f}" if r.get("node_requests_per_save") else "—"
        lines.append(f"| {r['ranks']} | {r['commit_ms']:.1f} | {floor} | {ratio} | {requests} | {nodes} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="*", default=[1, 2, 8, 16], help="job sizes (1: one process); none: no real jobs")
    parser.add_argument("--simulate", type=int, nargs="*", default=[], help="simulated job sizes (e.g. 1000 4000 10000)")
    parser.add_argument("--sim-saves", type=int, default=5, help="saves of each simulated job (after a warm-up)")
    parser.add_argument("--kib", type=int, default=256, help="KiB of state a rank")
    parser.add_argument("--saves", type=int, default=20, help="saves a job (after a warm-up)")
    parser.add_argument("--timeout", type=float, default=120.0, help="distributed.timeout, seconds")
    parser.add_argument("--phases", action="store_true", help="stamp each save's phases on every rank (ms after rank 0's save)")
    parser.add_argument("--per-node", type=int, default=None, help="ranks a node, every node but the leader's relaying (distributed.relay: nodes)")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="where scale.json goes")
    parser.add_argument("--rank-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker:
        rank_worker(json.loads(args.rank_worker))
        return
    base = Path(tempfile.mkdtemp(prefix="tierckpt-scale-", dir="."))
    job = {"kib": args.kib, "saves": args.saves, "timeout": args.timeout, "per_node": args.per_node, "phases": args.phases}
    started = time.perf_counter()
    try:
        rows = [one_world(n, job, base) for n in args.ranks]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    simulated = simulate(args.simulate, args.sim_saves, args.per_node)
    restores = simulate_restores(args.simulate)
    report = {"kib": args.kib, "saves": args.saves, "per_node": args.per_node, "cpus": os.cpu_count(), "python": sys.version.split()[0], "rows": rows,
              "simulated": simulated, "simulated_restores": restores}
    results = args.out / "scale.json"
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(report, indent=1))
    lines: list[str] = []
    relays = f", nodes of {args.per_node} relaying" if args.per_node else ""
    if rows:
        lines += [f"## Scale: commit against the floor ({args.kib} KiB a rank, {args.saves} saves, {os.cpu_count()} cores{relays})", "", *table(rows), ""]
    if args.phases and rows:
        lines += ["## Scale: where a commit's time goes (each phase's end, medians)", "", *phase_table(rows), ""]
    if simulated:
        lines += [f"## Scale, simulated: what one save asks of the store ({args.sim_saves} saves each{relays})", "", *simulated_table(simulated), ""]
        lines += ["## Scale, simulated: what a restore's agreement asks of each rank (8 versions held, the newest verifies)", "",
                  *restore_table(restores)]
    common.show_report(lines, Path("/tmp/scale_results.md"), results, time.perf_counter() - started)


if __name__ == "__main__":
    main()
