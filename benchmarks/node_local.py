"""Node-local tiers (issue 22): time to durable on a node-local tier vs the same tier shared, and restore
after a requeue or a lost node: from node-local fetches, from peers, from the shared tier.

Four ranks (this script with ``--rank-worker``, gloo on localhost) are two nodes of two, told apart by
torchrun's ``GROUP_RANK`` (set per rank here: ranks 0, 1 on node 0, ranks 2, 3 on node 1). Every
directory is on the same real disk (one host): the node-local tier's two directories ``local-0`` and
``local-1`` stand for the nodes' NVMe. Each rank's state is ``--mib`` MiB (peer.py's: three fp32 tensors
and a bf16 one, per rank, changed in place between saves).

Per repeat, on fresh directories:

1. Time to durable, three runs of ``--saves`` saves (the first a warm-up), each after a barrier,
   measured per rank from ``captured_sync()`` to ``committed_sync("nvme")``; reported: the median over
   saves of the slowest rank. ``node-local``: RAM, then ``nvme`` with ``scope: node`` at
   ``local-{node}``; ``shared``: the same tier with ``scope: shared`` (one directory); ``dcp.async_save``:
   PyTorch DCP (benchmarks/distributed.py's recipe) into one directory, from its staging future to
   its upload future; ``torch_checkpointing`` (where installed: ``pip install --no-deps
   torch_checkpointing==0.1.1``): its async ``CheckpointManager`` on every rank, from staged to its
   write future plus the fsyncs its writer leaves out (save_restore.py's recipe). The limit: one
   process, O_DIRECT from a state-sized buffer, write + fsync of 4 × ``--mib`` MiB on the same disk,
   before the runs, with 2 threads (one rank's io_threads) and with 8 (every rank's at once); the
   faster is the limit.
2. Restores, from one save run with RAM tiers on /dev/shm (``ram-<node>``, outliving the processes),
   a peer tier, ``nvme`` node-local and ``pfs`` shared (every save); two saves, then every rank dies by
   SIGKILL. Each restore starts four new processes; each rank faults in twice its state's bytes first
   (see ``machine_limits.fault_in``), constructs its Checkpointer, and after a barrier times
   ``restore_latest_sync(template)``; the page cache of the disk directories is dropped before each.
   (a) requeue: the ranks come back with the nodes' ``GROUP_RANK`` exchanged and without RAM (fresh
   RAM directories): each rank fetches its part from the other node's ``nvme``. (b) node 1 lost (its
   ``local-1`` and ``ram-1`` wiped): ranks 0, 1 read their RAM, ranks 2, 3 their peers' copies.
   (c) then node 0's RAM lost too: all read ``pfs``. Every rank's step, tier and bytes are checked
   outside the clock; a wrong tier stops the run. The read limit beside them: one process, O_DIRECT
   into reused 16 MiB buffers, read of 4 × ``--mib`` MiB from a cold cache, the faster of 2 and 8 threads.

    flock /tmp/tierckpt-bench.lock .venv/bin/python benchmarks/node_local.py
    .venv/bin/python benchmarks/node_local.py --mib 32 --saves 3

Results: JSON in benchmarks/results/node_local.json and a markdown section (printed, and written to
/tmp/node_local_results.md).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common

HERE = Path(__file__).resolve().parent
WORLD = 4  # ranks: 2 nodes of 2
IO_THREADS = 2


def node_of(rank: int, swapped: bool) -> int:
    node = rank // 2
    return 1 - node if swapped else node


def tier_config(job: dict[str, Any], rank: int) -> dict[str, Any]:
    base = Path(job["dir"])
    nvme = common.disk_tier(base / "local-{node}", name="nvme", io_threads=IO_THREADS, keep={"last": 2})
    if job["scope"] == "node":
        nvme["scope"] = "node"
    else:
        nvme["path"] = str(base / "shared")
    tiers = [nvme]
    ram = None
    if job["mode"] != "durable":  # the restore runs: RAM that outlives the process, a peer tier, pfs
        ram = common.ram_tier(path=str(Path(job["ram"]) / f"ram-{node_of(rank, job['swapped'])}"), keep={"last": 2})
        tiers = [{"name": "peer", "type": "peer", "keep": {"last": 2}}, nvme, common.disk_tier(base / "pfs", name="pfs", keep={"last": 2})]
    return common.tier_config(*tiers, capacity=2 * (job["nbytes"] + (16 << 20)), snapshots=2, ram=ram, distributed={"timeout": f"{job['timeout']:g}s"})


def durable_worker(job: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    import peer
    from tierckpt import Checkpointer

    state = peer.make_state(job["nbytes"], rank)
    samples = []
    with Checkpointer(tier_config(job, rank)) as ckpt:
        for step in range(1, job["saves"] + 1):
            peer.advance(state, step)
            dist.barrier()
            handle = ckpt.save_sync(step, state)
            assert handle.captured_sync(job["timeout"]), f"step {step}: not captured"
            t = time.perf_counter()
            assert handle.committed_sync("nvme", job["timeout"]), f"step {step}: not committed"
            samples.append(time.perf_counter() - t)
    return {"rank": rank, "durable_s": samples}


def dcp_worker(job: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch
    from distributed import run_dcp

    # run_dcp saves {"model": ..., "own": {"rank<r>": ...}}: here all of a rank's bytes are its own, as above.
    g = torch.Generator().manual_seed(12 + rank)
    state = {"model": {}, "own": {"shard": torch.randn(job["nbytes"] // 4, generator=g)}}
    (Path(job["dir"]) / "dcp").mkdir(exist_ok=True)
    samples = run_dcp(job | {"dir": str(Path(job["dir"]) / "dcp")}, state, rank)
    return {"rank": rank, "durable_s": [s["durable_s"] - s["captured_s"] for s in samples]}


def tc_worker(job: dict[str, Any], rank: int) -> dict[str, Any]:
    """torch_checkpointing's async recipe on every rank, as save_restore.py runs it in one process: each
    rank's files into one directory per step, from staged (``manager.lock()``) to its write future, plus
    the fsync of the files and directories its writer leaves out (its future means written, not durable)."""
    import torch.distributed as dist
    from torch_checkpointing import AsyncCheckpointSaverConfig, CheckpointManager, CheckpointStagerConfig

    import peer
    from save_restore import fsync_tree, tc_storage

    state = peer.make_state(job["nbytes"], rank)
    staging = CheckpointStagerConfig(use_pinned_memory=False, use_non_blocking_copy=False)  # no accelerator here
    manager = CheckpointManager(CheckpointManager.Config(save=AsyncCheckpointSaverConfig(staging_config=staging), storage_config=tc_storage()))
    root = Path(job["dir"]) / "tc"
    samples = []
    try:
        for step in range(1, job["saves"] + 1):
            peer.advance(state, step)
            dist.barrier()
            target = root / f"step-{step}"
            future = manager.save(str(target), {"model": state["model"]})
            with manager.lock():  # staged: what training would wait for
                t = time.perf_counter()
            assert future is not None
            future.result()
            fsync_tree(target)
            samples.append(time.perf_counter() - t)
            dist.barrier()
            if rank == 0 and step > 2:
                shutil.rmtree(root / f"step-{step - 2}")
    finally:
        manager.close()
    return {"rank": rank, "durable_s": samples}


def save_worker(job: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    import peer
    from tierckpt import Checkpointer

    state = peer.make_state(job["nbytes"], rank)
    ckpt = Checkpointer(tier_config(job, rank))
    for step in (1, 2):
        peer.advance(state, step)
        handle = ckpt.save_sync(step, state)
        for tier in ("peer", "nvme", "pfs"):
            assert handle.committed_sync(tier, job["timeout"]), f"step {step}: not committed on {tier}"
    ckpt.wait_sync()
    Path(job["results"], f"rank-{rank}.json").write_text(json.dumps({"rank": rank}))
    dist.barrier()  # the whole job is lost at once, its RAM files left behind
    os.kill(os.getpid(), signal.SIGKILL)
    return {}


def restore_worker(job: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    import peer
    from machine_limits import fault_in
    from tierckpt import Checkpointer

    template = peer.make_state(job["nbytes"], rank)
    for t in template["model"].values():
        t.zero_()
    template["step"] = -1
    fault_s = fault_in(2 * peer.state_bytes(template))
    gc.collect()
    ckpt = Checkpointer(tier_config(job, rank))
    dist.barrier()
    t = time.perf_counter()
    restored = ckpt.restore_latest_sync(template)
    restore_s = time.perf_counter() - t
    ckpt.close_sync()
    out: dict[str, Any] = {"rank": rank, "restore_s": restore_s, "fault_in_s": fault_s}
    out["step"], out["tier"] = (restored.step, restored.tier) if restored is not None else (None, None)
    out["wrong"] = ["nothing restored"] if restored is None else peer.wrong_values(restored.state, peer.state_at(job["nbytes"], rank, 2))
    return out


def rank_worker(job: dict[str, Any]) -> None:
    import torch.distributed as dist

    common.start_rank(job["timeout"] * 3)
    sys.path.insert(0, str(HERE))
    rank = int(os.environ["RANK"])
    os.environ["GROUP_RANK"] = str(node_of(rank, job["swapped"]))  # as torchrun sets it per node
    dist.init_process_group("gloo")
    work = {"durable": durable_worker, "dcp": dcp_worker, "tc": tc_worker, "save": save_worker, "restore": restore_worker}[job["mode"]]
    out = work(job, rank)
    Path(job["results"], f"rank-{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


# -- the parent ----------------------------------------------------------------------------------------


def run(job: dict[str, Any], logs: Path) -> list[dict[str, Any]]:
    dead = range(WORLD) if job["mode"] == "save" else ()
    return common.run_ranks(__file__, job, WORLD, logs, timeout_s=job["timeout"] * 4 + 120, what=job["mode"], expect_dead=dead)


def one_repeat(base: Path, ram_base: Path, job: dict[str, Any], rep: int) -> dict[str, Any]:
    sys.path.insert(0, str(HERE))
    import peer
    from distributed import write_limit
    from machine_limits import _direct_io, buffer, drop_caches

    work, ram = base / f"rep-{rep}", ram_base / f"ram-{rep}"
    logs = base / "logs" / f"repeat-{rep}"
    out: dict[str, Any] = {"repeat": rep}
    try:
        for path in (work, ram):
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
        total = WORLD * job["nbytes"]
        # The best the disk does: 2 threads (one rank's io_threads) or 8 (every rank's at once).
        out["limit_write_2_s"] = write_limit(work, total)
        whole = buffer(total)
        try:
            out["limit_write_8_s"] = _direct_io(work / "limit.bin", total, WORLD * IO_THREADS, write=True, whole=memoryview(whole))
        finally:
            whole.close()
            (work / "limit.bin").unlink(missing_ok=True)
        out["limit_write_s"] = min(out["limit_write_2_s"], out["limit_write_8_s"])
        job = job | {"dir": str(work), "ram": str(ram), "results": str(base / "results"), "swapped": False}
        runs = [("node-local", "durable", "node"), ("shared", "durable", "shared"), ("dcp.async_save", "dcp", "shared")]
        if importlib.util.find_spec("torch_checkpointing") is not None:  # optional: its row is left out without it
            runs.append(("torch_checkpointing", "tc", "shared"))
        for name, mode, scope in runs:
            ranks = run(job | {"mode": mode, "scope": scope}, logs / name)
            out[name] = [max(r["durable_s"][i] for r in ranks) for i in range(1, job["saves"])]
            for sub in ("local-0", "local-1", "shared", "dcp", "tc"):
                shutil.rmtree(work / sub, ignore_errors=True)
        run(job | {"mode": "save", "scope": "node"}, logs / "save")
        pfs = work / "pfs"
        _direct_io(pfs / "limit.bin", total, IO_THREADS, write=True, whole=None)  # the file the read limit reads
        for threads in (IO_THREADS, WORLD * IO_THREADS):
            drop_caches()
            out[f"limit_read_{threads}_s"] = _direct_io(pfs / "limit.bin", total, threads, write=False, whole=None)
        out["limit_read_s"] = min(out[f"limit_read_{t}_s"] for t in (IO_THREADS, WORLD * IO_THREADS))
        (pfs / "limit.bin").unlink()
        cases = (
            ("(a) requeue: nvme fetched from the other node", {"swapped": True}, ["nvme"] * 4, lambda: None),
            ("(b) node 1 lost: RAM and peers", {}, ["ram", "ram", "peer", "peer"], lambda: [shutil.rmtree(work / "local-1"), shutil.rmtree(ram / "ram-1")]),
            ("(c) node 1 and node 0's RAM lost: pfs", {}, ["pfs"] * 4, lambda: shutil.rmtree(ram / "ram-0")),
        )
        out["restores"] = {}
        for name, extra, tiers, damage in cases:
            damage()
            fresh = ram_base / f"requeue-{rep}"
            case = job | {"mode": "restore", "scope": "node"} | extra | ({"ram": str(fresh)} if extra else {})
            drop_caches()
            ranks = run(case, logs / name[:3].strip("()"))
            shutil.rmtree(fresh, ignore_errors=True)
            got = [(r["step"], r["tier"]) for r in ranks]
            wrong = [r["wrong"] for r in ranks if r["wrong"]]
            if got != [(2, tier) for tier in tiers] or wrong:
                raise RuntimeError(f"{name}: restored {got}, expected step 2 from {tiers}; wrong values: {wrong}")
            out["restores"][name] = {"slowest_s": max(r["restore_s"] for r in ranks), "per_rank_s": [r["restore_s"] for r in ranks]}
        out["state_bytes"] = peer.state_bytes(peer.make_state(job["nbytes"], 0))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(ram, ignore_errors=True)
    return out


def table(report: dict[str, Any]) -> list[str]:
    reps = report["repeats"]
    total = WORLD * reps[0]["state_bytes"]
    limit_w = statistics.median(r["limit_write_s"] for r in reps)
    limit_r = statistics.median(r["limit_read_s"] for r in reps)
    lines = [
        f"4 ranks as 2 nodes (GROUP_RANK), {report['mib']} MiB per rank ({total / 2**30:.2f} GiB in all), one disk for every "
        f"directory; {len(reps)} repeat(s), medians. Write limit (O_DIRECT from a state-sized buffer, write + fsync of {total / 2**30:.2f} GiB, "
        f"the faster of 2 and 8 threads): {limit_w:.2f} s ({total / limit_w / 1e9:.2f} GB/s). Read limit (cold, O_DIRECT, "
        f"the faster of 2 and 8 threads): {limit_r:.2f} s ({total / limit_r / 1e9:.2f} GB/s).",
        "",
        "| save: time to durable (slowest rank, from captured) | s | GB/s | % of the write limit |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name in ("node-local", "shared", "dcp.async_save", "torch_checkpointing"):
        if name not in reps[0]:
            continue
        s = statistics.median(v for r in reps for v in r[name])
        lines.append(f"| {name} | {s:.3f} | {total / s / 1e9:.2f} | {100 * limit_w / s:.0f}% |")
    lines += ["", "| restore (new processes, cold cache) | slowest rank s | GB/s | % of the read limit |", "| --- | ---: | ---: | ---: |"]
    for name in reps[0]["restores"]:
        s = statistics.median(r["restores"][name]["slowest_s"] for r in reps)
        lines.append(f"| {name} | {s:.3f} | {total / s / 1e9:.2f} | {100 * limit_r / s:.0f}% |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="MiB of state per rank")
    parser.add_argument("--saves", type=int, default=4, help="saves per time-to-durable run (the first a warm-up)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--dir", type=Path, default=None, help="where the directories go (default: a new one under the working directory)")
    parser.add_argument("--timeout", type=float, default=120.0, help="distributed.timeout, seconds")
    parser.add_argument("--rank-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker:
        rank_worker(json.loads(args.rank_worker))
        return
    base = args.dir or Path(tempfile.mkdtemp(prefix="tierckpt-node-bench-", dir="."))
    ram_base = Path(tempfile.mkdtemp(prefix="tierckpt-node-bench-", dir="/dev/shm"))
    job = {"nbytes": args.mib << 20, "saves": args.saves, "timeout": args.timeout}
    started = time.perf_counter()
    try:
        repeats = [one_repeat(base, ram_base, job, rep) for rep in range(args.repeats)]
    finally:
        shutil.rmtree(ram_base, ignore_errors=True)
    report = {"mib": args.mib, "repeats": repeats}
    results = HERE / "results" / "node_local.json"
    results.parent.mkdir(exist_ok=True)
    results.write_text(json.dumps(report, indent=1))
    common.show_report(["## Node-local tiers (issue 22)", "", *table(report)], Path("/tmp/node_local_results.md"), results, time.perf_counter() - started)
    if args.dir is None:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
