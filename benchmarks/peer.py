"""The peer tier (issue 12): time to replicated vs time to durable, and recovery from a peer vs from disk.

Four ranks (this script with ``--rank-worker``, gloo on localhost) are two simulated nodes of two
(``distributed.nodes: 2``): ranks 0, 1 on node 0 and ranks 2, 3 on node 1. Each node's RAM tier is a
memory tier with ``path: <ram>/node-<n>`` on /dev/shm (it outlives the process, as a node's RAM
outlives a crashed job), then a peer tier (``copies: 1``: each rank's snapshot goes to the rank at the
same position on the other node), then a filesystem tier ``disk`` on a real disk that flushes every step.
Each rank's state is ``--mib`` MiB: three fp32 tensors and one bf16 tensor (odd sizes) and the step,
deterministic per rank and step, changed in place between saves as a training step would.

Per repeat, on fresh directories:

1. Save: one process starts per rank. First the hardware references, before any Checkpointer: a plain
   gloo send of the same bytes from rank 0 to rank 2 (one process per node, the others idle); every
   rank sending them to its peer while receiving its peer's at once (the peer tier's own pattern); and
   the same in 16 MiB sends (the tier's chunks) on a thread, received into a new file on /dev/shm, as
   the tier receives a copy. Then ``--steps`` saves (default 6), each after a barrier; for each, per
   rank, the time from ``captured_sync()`` (the host copy is done) to ``committed_sync("peer")`` (every rank's copy acknowledged by its holder: time
   to replicated) and to ``committed_sync("disk")`` (written and fsynced on every rank: time to
   durable), both measured from that same moment by two threads waiting at once (the two flushes run
   concurrently from host memory). The next save starts once both are done. Then every rank dies by
   SIGKILL after a barrier, leaving its RAM files behind. Before the ranks start, the disk's write limit
   is measured on the disk tier's directory with ``benchmarks/distributed.py``'s helper (one process,
   O_DIRECT, 2 threads, write + fsync of 4 × ``--mib`` MiB: what a save writes).
2. Recovery (a), node 1 lost: its RAM directory is wiped, the four ranks start again and each calls
   ``restore_latest_sync(template)``: ranks 0, 1 must read the last step from their own RAM (tier
   ``ram``), ranks 2, 3 from their peer's RAM (tier ``peer``: ranks 0, 1 send the copies back over gloo).
3. Recovery (b), both nodes lost: both RAM directories are wiped, the page cache of the disk tier's
   files is dropped (``/proc/sys/vm/drop_caches`` where allowed, else ``posix_fadvise(DONTNEED)`` on each
   file, checked with ``fincore``), the ranks start again: all must read the same step from ``disk``.

(a) and (b) restore the same saved version: (b) runs after (a) on the same directories, and nothing in
(a) writes to the disk tier. Each restoring rank first faults in twice its state's bytes of new memory
and frees them (see ``machine_limits.fault_in``), makes its template (zeros), constructs its
Checkpointer (timed apart: construction is collective and agrees on what the peers hold), then after a
barrier times ``restore_latest_sync``. Outside the clock every rank checks the step, the tier (a wrong
tier means the benchmark measured the wrong thing: the run stops) and every value bitwise. Reported: per
save, the slowest rank; per recovery, the slowest rank and each rank; medians over saves and repeats.
Saves 1-3 and 4-K are also reported apart: every tier keeps 2 versions, so until save 3 each copy (and
each RAM-tier snapshot) lands in memory the machine has not held before, which costs extra on a
virtual machine (see ``machine_limits.fault_in``); from save 4 on each reuses the pages of a pruned one.

    flock /tmp/tierckpt-bench.lock .venv/bin/python benchmarks/peer.py
    flock /tmp/tierckpt-bench.lock .venv/bin/python benchmarks/peer.py --mib 32 --repeats 1

Results: JSON in benchmarks/results/peer.json and a markdown section (printed, and written to
/tmp/peer_results.md). A default run takes about 2-3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import json
import mmap
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import common
from tierckpt.format import CHUNK_BYTES

HERE = Path(__file__).resolve().parent
WORLD = 4  # ranks: 2 simulated nodes of 2
NODES = 2
IO_THREADS = 2  # the filesystem tier's (its default), and the write limit's threads
KEEP = 2  # versions every tier keeps: from save KEEP + 2 on, each new copy reuses the RAM of a pruned one
# (name, dtype, share of the rank's bytes): a few fp32 tensors and a bf16 one
TENSORS = (("embed.weight", torch.float32, 0.40), ("mlp.weight", torch.float32, 0.30), ("attn.weight", torch.bfloat16, 0.20), ("norm.weight", torch.float32, 0.10))


# -- the state -----------------------------------------------------------------------------------------


def make_state(nbytes: int, rank: int) -> dict[str, Any]:
    """About ``nbytes``, different on each rank; odd element counts."""
    g = torch.Generator().manual_seed(12 + rank)
    model = {name: torch.randn((int(nbytes * share) // dtype.itemsize) | 1, generator=g).to(dtype) for name, dtype, share in TENSORS}
    return {"model": model, "step": 0}


def advance(state: dict[str, Any], step: int) -> None:
    """A training step: every tensor changes in place (deterministically: the check replays it)."""
    for t in state["model"].values():
        t.add_(0.25)
    state["step"] = step


def state_at(nbytes: int, rank: int, step: int) -> dict[str, Any]:
    state = make_state(nbytes, rank)
    for s in range(1, step + 1):
        advance(state, s)
    return state


def state_bytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in state["model"].values())


def wrong_values(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    wrong = [] if got["step"] == want["step"] else [f"step: {got['step']} != {want['step']}"]
    for key, w in want["model"].items():
        g = got["model"][key]
        if g.dtype != w.dtype or g.shape != w.shape or not torch.equal(g.view(torch.uint8), w.view(torch.uint8)):
            wrong.append(f"{key}: wrong values")
    return wrong


# -- one rank ------------------------------------------------------------------------------------------


def tier_config(job: dict[str, Any], rank: int) -> dict[str, Any]:
    node = rank // (WORLD // NODES)
    peer: dict[str, Any] = {"name": "peer", "type": "peer", "copies": 1, "keep": {"last": KEEP}}
    if job["bandwidth"]:
        peer["bandwidth"] = job["bandwidth"]
    return common.tier_config(
        peer,
        common.disk_tier(job["disk"], keep={"last": KEEP}, io_threads=IO_THREADS),
        capacity=2 * (job["nbytes"] + (16 << 20)),
        snapshots=2,
        ram=common.ram_tier(path=str(Path(job["ram"]) / f"node-{node}"), keep={"last": KEEP}),
        distributed={"timeout": f"{job['timeout']:g}s", "nodes": NODES},
    )


def gloo_reference(nbytes: int, rank: int, ram: Path) -> dict[str, float]:
    """Plain gloo, the same bytes: rank 0 → rank 2 alone, then every rank ↔ its peer at once (seconds)."""
    import torch.distributed as dist

    peer = (rank + WORLD // NODES) % WORLD
    data = torch.full((nbytes,), rank + 1, dtype=torch.uint8)
    into = torch.full((nbytes,), 0xFF, dtype=torch.uint8)
    small = torch.zeros(4096, dtype=torch.uint8)
    for req in (dist.isend(small, peer), dist.irecv(torch.empty_like(small), peer)):  # connections made
        req.wait()
    out = {}
    dist.barrier()
    t = time.perf_counter()
    if rank == 0:
        dist.send(data, peer)
    elif rank == WORLD // NODES:
        dist.recv(into, 0)
    out["one_pair_s"] = time.perf_counter() - t
    if rank == WORLD // NODES:
        assert int(into[0]) == 1 and int(into[-1]) == 1, "gloo reference: wrong bytes"
    into.fill_(0xFF)
    dist.barrier()
    t = time.perf_counter()
    reqs = [dist.isend(data, peer), dist.irecv(into, peer)]
    for req in reqs:
        req.wait()
    out["all_pairs_s"] = time.perf_counter() - t
    assert int(into[0]) == peer + 1 and int(into[-1]) == peer + 1, "gloo reference: wrong bytes"
    # As the peer tier moves a copy: 16 MiB sends one after another on a thread of their own, received
    # into a new file on the RAM file system (its pages are first touched by the receive).
    del into
    path = Path(ram, f"gloo-reference-{rank}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        memory = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
        path.unlink()
    into = torch.frombuffer(memory, dtype=torch.uint8)

    def send_chunks() -> None:
        for offset in range(0, nbytes, CHUNK_BYTES):
            dist.isend(data[offset : offset + CHUNK_BYTES], peer).wait()

    dist.barrier()
    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(1) as sender:
        sent = sender.submit(send_chunks)
        for offset in range(0, nbytes, CHUNK_BYTES):
            dist.irecv(into[offset : offset + CHUNK_BYTES], peer).wait()
        sent.result()
    out["chunks_into_ram_file_s"] = time.perf_counter() - t
    assert int(into[0]) == peer + 1 and int(into[-1]) == peer + 1, "gloo reference: wrong bytes"
    del into
    memory.close()
    return out


def save_worker(job: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    from tierckpt import Checkpointer

    state = make_state(job["nbytes"], rank)
    nbytes = state_bytes(state)
    out: dict[str, Any] = {"rank": rank, "state_bytes": nbytes, "gloo": gloo_reference(nbytes, rank, Path(job["ram"])), "saves": []}
    timeout = job["timeout"]
    ckpt = Checkpointer(tier_config(job, rank))
    peer = next(t for t in ckpt._pipeline.tiers if t.name == "peer")
    with concurrent.futures.ThreadPoolExecutor(2) as waiters:

        def commit_time(handle: Any, tier: str) -> tuple[bool, float]:
            done = handle.committed_sync(tier, timeout)
            return done, time.perf_counter()

        for step in range(1, job["steps"] + 1):
            advance(state, step)
            dist.barrier()
            t = time.perf_counter()
            handle = ckpt.save_sync(step, state)
            stall = time.perf_counter() - t
            # Both waits start now, before the host copy is done: each stamps the moment its tier committed.
            waits = {tier: waiters.submit(commit_time, handle, tier) for tier in ("peer", "disk")}
            assert handle.captured_sync(timeout), f"step {step}: not captured (skipped)"
            captured = time.perf_counter()
            (peer_ok, peer_at), (disk_ok, disk_at) = (waits[tier].result(timeout) for tier in ("peer", "disk"))
            assert peer_ok and disk_ok, f"step {step}: committed on peer {peer_ok}, on disk {disk_ok}"
            out["saves"].append({
                "step": step,
                "stall_s": stall,
                "captured_s": captured - t,
                "replicated_s": max(0.0, peer_at - captured),
                "durable_s": max(0.0, disk_at - captured),
                "copy_s": peer.last_copy_s,
            })
    ckpt.wait_sync()
    out["throttle_slept_s"] = peer.throttle.slept_s
    out["versions"] = {tier: [v.step for v in ckpt.versions() if v.tier == tier] for tier in ckpt.tiers}
    out["held"] = sorted([h.owner, h.step] for h in peer.replicas.held())
    Path(job["results"], f"rank-{rank}.json").write_text(json.dumps(out))
    dist.barrier()  # every rank has written; now the whole job is lost at once, its RAM files left behind
    os.kill(os.getpid(), signal.SIGKILL)
    return out  # not reached


def restore_worker(job: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    from machine_limits import fault_in
    from tierckpt import Checkpointer

    template = make_state(job["nbytes"], rank)
    for t in template["model"].values():
        t.zero_()
    template["step"] = -1
    nbytes = state_bytes(template)
    fault_s = fault_in(2 * nbytes)
    gc.collect()
    dist.barrier()
    t = time.perf_counter()
    ckpt = Checkpointer(tier_config(job, rank))
    open_s = time.perf_counter() - t
    dist.barrier()
    before = common.io_counters()
    t = time.perf_counter()
    restored = ckpt.restore_latest_sync(template)
    restore_s = time.perf_counter() - t
    after = common.io_counters()
    ckpt.close_sync()
    out: dict[str, Any] = {
        "rank": rank,
        "open_s": open_s,
        "restore_s": restore_s,
        "fault_in_s": fault_s,
        "disk_read_bytes": after[0] - before[0],
        "read_call_bytes": after[1] - before[1],
        "step": restored.step if restored is not None else None,
        "tier": restored.tier if restored is not None else None,
    }
    if restored is None:
        out["wrong"] = ["nothing restored"]
    else:
        out["wrong"] = wrong_values(restored.state, state_at(job["nbytes"], rank, job["steps"]))
    Path(job["results"], f"rank-{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    return out


def rank_worker(job: dict[str, Any]) -> None:
    """One rank (``--rank-worker``): save (then die by SIGKILL) or restore; writes what it measured."""
    import torch.distributed as dist

    common.start_rank(job["timeout"] * 3)
    sys.path.insert(0, str(HERE))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    (save_worker if job["mode"] == "save" else restore_worker)(job, rank)
    dist.destroy_process_group()


# -- the parent ----------------------------------------------------------------------------------------


def run_ranks(job: dict[str, Any], log_dir: Path) -> list[dict[str, Any]]:
    """Start the ``WORLD`` ranks; a save's ranks must die by SIGKILL, a restore's exit 0."""
    dead = range(WORLD) if job["mode"] == "save" else ()
    return common.run_ranks(__file__, job, WORLD, log_dir, timeout_s=job["timeout"] * 4 + 60, what=job["mode"], expect_dead=dead)


def drop_file_cache(directory: Path, *, whole: bool = True) -> dict[str, Any]:
    """Drop the page cache of every file under ``directory``: with ``whole``, the machine's whole page
    cache where allowed (root), else (or without ``whole``, leaving the rest of a shared machine's cache
    alone) ``posix_fadvise(DONTNEED)`` on each file. Returns how, and the bytes still resident after
    (None without ``fincore``)."""
    from machine_limits import drop_caches

    os.sync()
    how = "drop_caches"
    files = [p for p in directory.rglob("*") if p.is_file()]
    if not (whole and drop_caches()):
        how = "posix_fadvise(DONTNEED)"
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    resident = None
    if files and shutil.which("fincore"):
        run = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, files)], capture_output=True, text=True)
        if run.returncode == 0:
            resident = sum(int(line) for line in run.stdout.split())
    return {"how": how, "files": len(files), "bytes": sum(p.stat().st_size for p in files), "resident_bytes": resident}


def check_recovery(name: str, ranks: list[dict[str, Any]], tiers: list[str], step: int) -> None:
    """The ranks restored ``step`` from ``tiers``, bitwise right: else the run measured something else."""
    got = [(r["step"], r["tier"]) for r in ranks]
    want = [(step, tier) for tier in tiers]
    wrong = [f"rank {r['rank']}: {r['wrong']}" for r in ranks if r["wrong"]]
    if got != want or wrong:
        raise RuntimeError(f"recovery {name}: restored (step, tier) {got}, expected {want}; wrong values: {wrong or 'none'}")


def one_repeat(base: Path, ram_base: Path, job: dict[str, Any], rep: int) -> dict[str, Any]:
    sys.path.insert(0, str(HERE))
    from distributed import write_limit

    disk, ram = base / f"disk-{rep}", ram_base / f"ram-{rep}"
    for path in (disk, ram):
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    job = job | {"disk": str(disk), "ram": str(ram), "results": str(base / "results")}
    logs = base / "logs" / f"repeat-{rep}"
    out: dict[str, Any] = {"repeat": rep}
    try:
        gc.collect()
        out["limit_write_bytes"] = WORLD * job["nbytes"]
        out["limit_write_s"] = write_limit(disk, out["limit_write_bytes"])
        t = time.perf_counter()
        out["save"] = run_ranks(job | {"mode": "save"}, logs / "save")
        out["save_wall_s"] = time.perf_counter() - t
        last = job["steps"]
        for r in out["save"]:
            if r["versions"]["peer"][-1:] != [last] or r["versions"]["disk"][-1:] != [last]:
                raise RuntimeError(f"save: rank {r['rank']} ended with versions {r['versions']}, expected step {last} last on peer and disk")
        half = WORLD // NODES
        # (a) node 1 lost: its RAM (its ranks' host pools and the copies it held) is gone.
        shutil.rmtree(ram / "node-1")
        t = time.perf_counter()
        out["node_lost"] = run_ranks(job | {"mode": "restore"}, logs / "node-lost")
        out["node_lost_wall_s"] = time.perf_counter() - t
        check_recovery("(a) node 1 lost", out["node_lost"], ["ram"] * half + ["peer"] * half, last)
        # (b) both nodes lost: only the disk has the version; its page cache dropped.
        shutil.rmtree(ram, ignore_errors=True)
        out["cache"] = drop_file_cache(disk)
        t = time.perf_counter()
        out["all_lost"] = run_ranks(job | {"mode": "restore"}, logs / "all-lost")
        out["all_lost_wall_s"] = time.perf_counter() - t
        check_recovery("(b) both nodes lost", out["all_lost"], ["disk"] * WORLD, last)
    finally:
        shutil.rmtree(ram, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    return out


def summarize(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """Per save the slowest rank, per recovery the slowest rank (and each rank); medians over all."""
    med = statistics.median
    steps = range(len(repeats[0]["save"][0]["saves"]))

    def per_save(key: str) -> list[float]:
        return [max(r["saves"][i][key] for r in rep["save"]) for rep in repeats for i in steps]

    def per_restore(case: str, key: str, ranks: range = range(WORLD)) -> list[float]:
        return [max(rep[case][r][key] for r in ranks) for rep in repeats]

    nbytes = repeats[0]["save"][0]["state_bytes"]
    half = WORLD // NODES
    out: dict[str, Any] = {"state_bytes_per_rank": nbytes, "repeats": len(repeats)}
    for key in ("stall_s", "captured_s", "replicated_s", "durable_s", "copy_s"):
        out[key] = med(per_save(key))
        out[f"{key}_per_save"] = per_save(key)
    steady = [i for i in steps if i + 1 > KEEP + 1]
    if steady:
        for key in ("replicated_s", "durable_s"):
            out[f"{key}_steady"] = med([max(r["saves"][i][key] for r in rep["save"]) for rep in repeats for i in steady])
            out[f"{key}_growing"] = med([max(r["saves"][i][key] for r in rep["save"]) for rep in repeats for i in steps if i not in steady])
    pairs = [max(r["saves"][i]["durable_s"] for r in rep["save"]) / max(r["saves"][i]["replicated_s"] for r in rep["save"]) for rep in repeats for i in steps]
    out["durable_over_replicated"] = med(pairs)
    out["copy_gbs_per_rank"] = nbytes / out["replicated_s"] / 1e9
    out["gloo_one_pair_s"] = med([max(r["gloo"]["one_pair_s"] for r in rep["save"]) for rep in repeats])
    out["gloo_all_pairs_s"] = med([max(r["gloo"]["all_pairs_s"] for r in rep["save"]) for rep in repeats])
    out["gloo_chunks_into_ram_file_s"] = med([max(r["gloo"]["chunks_into_ram_file_s"] for r in rep["save"]) for rep in repeats])
    out["limit_write_s"] = med([rep["limit_write_s"] for rep in repeats])
    out["limit_write_bytes"] = repeats[0]["limit_write_bytes"]
    for case in ("node_lost", "all_lost"):
        out[case] = {
            "restore_s": med(per_restore(case, "restore_s")),
            "restore_per_repeat_s": per_restore(case, "restore_s"),
            "restore_per_rank_s": [med([rep[case][r]["restore_s"] for rep in repeats]) for r in range(WORLD)],
            "open_s": med(per_restore(case, "open_s")),
            "tiers": [rep[case][r]["tier"] for rep in repeats[:1] for r in range(WORLD)],
            "disk_read_bytes": med([sum(x["disk_read_bytes"] for x in rep[case]) for rep in repeats]),
            "fault_in_s": max(x["fault_in_s"] for rep in repeats for x in rep[case]),
        }
    out["node_lost"]["from_peer_s"] = med(per_restore("node_lost", "restore_s", range(half, WORLD)))
    out["node_lost"]["from_own_ram_s"] = med(per_restore("node_lost", "restore_s", range(half)))
    out["disk_over_peer"] = out["all_lost"]["restore_s"] / out["node_lost"]["restore_s"]
    out["cache_after_drop"] = [rep["cache"] for rep in repeats]
    out["bitwise_right"] = all(not x["wrong"] for rep in repeats for case in ("node_lost", "all_lost") for x in rep[case])
    return out


def table(s: dict[str, Any]) -> list[str]:
    nbytes = s["state_bytes_per_rank"]
    mib = nbytes / 2**20

    def gbs(nb: float, sec: float) -> str:
        return f"{nb / sec / 1e9:.2f}" if sec > 0 else ""

    def ms(values: list[float]) -> str:
        return ", ".join(f"{v:.2f}" for v in values)

    a, b = s["node_lost"], s["all_lost"]
    rows = [
        ("`save()` call (training blocked), slowest rank", s["stall_s"], "", ""),
        ("host copy done (`save()` → captured), slowest rank", s["captured_s"], gbs(nbytes, s["captured_s"]), ""),
        ("**time to replicated**: captured → committed on `peer`, slowest rank", s["replicated_s"], gbs(nbytes, s["replicated_s"]), ms(s["replicated_s_per_save"])),
        ("**time to durable**: captured → committed on `disk`, slowest rank", s["durable_s"], gbs(WORLD * nbytes, s["durable_s"]), ms(s["durable_s_per_save"])),
        *(
            [
                (f"time to replicated, saves 1-{KEEP + 1} (the RAM tiers and copies still growing: new memory)", s["replicated_s_growing"], gbs(nbytes, s["replicated_s_growing"]), ""),
                (f"time to replicated, saves {KEEP + 2}-{len(s['replicated_s_per_save']) // s['repeats']} (each copy reuses a pruned one's memory)", s["replicated_s_steady"], gbs(nbytes, s["replicated_s_steady"]), ""),
                (f"time to durable, saves 1-{KEEP + 1}", s["durable_s_growing"], gbs(WORLD * nbytes, s["durable_s_growing"]), ""),
                (f"time to durable, saves {KEEP + 2}-{len(s['durable_s_per_save']) // s['repeats']}", s["durable_s_steady"], gbs(WORLD * nbytes, s["durable_s_steady"]), ""),
            ]
            if "replicated_s_steady" in s
            else []
        ),
        ("peer tier's own copy time (`last_copy_s`: first byte → last ack), slowest rank", s["copy_s"], gbs(nbytes, s["copy_s"]), ""),
        (f"reference: plain gloo send of {mib:.0f} MiB, rank 0 → rank 2 alone", s["gloo_one_pair_s"], gbs(nbytes, s["gloo_one_pair_s"]), ""),
        (f"reference: plain gloo, every rank sends {mib:.0f} MiB to its peer and receives its peer's at once", s["gloo_all_pairs_s"], gbs(nbytes, s["gloo_all_pairs_s"]), ""),
        (f"reference: the same, in {CHUNK_BYTES >> 20} MiB sends on a thread, received into a new file on /dev/shm", s["gloo_chunks_into_ram_file_s"], gbs(nbytes, s["gloo_chunks_into_ram_file_s"]), ""),
        (f"reference: O_DIRECT write + fsync of {WORLD} × {mib:.0f} MiB, one process, {IO_THREADS} threads", s["limit_write_s"], gbs(s["limit_write_bytes"], s["limit_write_s"]), ""),
        ("**recovery (a)**, node 1 lost: `restore_latest`, slowest rank", a["restore_s"], gbs(nbytes, a["restore_s"]), ms(a["restore_per_repeat_s"])),
        ("(a) ranks 2, 3 (from the peer's RAM), slower of the two", a["from_peer_s"], gbs(nbytes, a["from_peer_s"]), ""),
        ("(a) ranks 0, 1 (from their own RAM, serving the copies meanwhile), slower of the two", a["from_own_ram_s"], gbs(nbytes, a["from_own_ram_s"]), ""),
        ("**recovery (b)**, both nodes lost: `restore_latest` from `disk`, cold, slowest rank", b["restore_s"], gbs(nbytes, b["restore_s"]), ms(b["restore_per_repeat_s"])),
        ("`Checkpointer()` construction before the restore, slowest rank: (a)", a["open_s"], "", ""),
        ("`Checkpointer()` construction before the restore, slowest rank: (b)", b["open_s"], "", ""),
    ]
    lines = ["| measure | seconds (median) | GB/s (per rank; disk rows: all ranks) | slowest rank per save / repeat, s |", "| --- | ---: | ---: | --- |"]
    lines += [f"| {name} | {sec:.3f} | {rate} | {per} |" for name, sec, rate, per in rows]
    lines += [
        "",
        f"Time to durable / time to replicated: **{s['durable_over_replicated']:.2f}×** (median of the per-save ratios). "
        f"Recovery from disk / from a peer: **{s['disk_over_peer']:.2f}×**. Restored tiers, ranks 0-3: (a) "
        f"{', '.join(a['tiers'])}; (b) {', '.join(b['tiers'])}; every rank bitwise right: {s['bitwise_right']}. "
        f"Bytes read from the disk during the restore, all ranks: (a) {a['disk_read_bytes'] / 2**20:.0f} MiB, "
        f"(b) {b['disk_read_bytes'] / 2**20:.0f} MiB.",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=256, help="MiB of state per rank")
    parser.add_argument("--steps", type=int, default=6, help="saves per repeat (steps 1..K)")
    parser.add_argument("--repeats", type=int, default=3, help="save + recoveries, each on fresh directories (medians)")
    parser.add_argument("--bandwidth", default=None, help="the peer tier's bandwidth cap, e.g. 500MiB/s (default: none)")
    parser.add_argument("--dir", type=Path, default=None, help="a directory on a real disk for the disk tier (default: a new one under /tmp)")
    parser.add_argument("--ram", type=Path, default=Path("/dev/shm"), help="a RAM file system for the nodes' RAM tiers")
    parser.add_argument("--timeout", type=float, default=120, help="seconds: tierckpt's distributed timeout and each wait")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "peer.json", help="the JSON results")
    parser.add_argument("--markdown", type=Path, default=Path("/tmp/peer_results.md"))
    parser.add_argument("--rank-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker:
        rank_worker(json.loads(args.rank_worker))
        return
    if args.steps < 1 or args.repeats < 1:
        parser.error("--steps and --repeats must be at least 1")
    sys.path.insert(0, str(HERE))
    from machine_limits import machine, shown

    base = args.dir or Path(tempfile.mkdtemp(prefix="tierckpt-peer-"))
    base.mkdir(parents=True, exist_ok=True)
    ram_base = Path(tempfile.mkdtemp(prefix="tierckpt-peer-", dir=args.ram))
    nbytes = int(args.mib * 2**20)
    stamp = time.strftime("%Y-%m-%d %H:%M")
    command = " ".join(["python", os.path.relpath(__file__), *sys.argv[1:]])
    m = machine(base)
    m["ram_dir"] = machine(ram_base)["disk"]
    report: dict[str, Any] = {"time": stamp, "command": command, "machine": m, "mib_per_rank": args.mib, "steps": args.steps, "repeats": []}
    job = {"nbytes": nbytes, "steps": args.steps, "timeout": args.timeout, "bandwidth": args.bandwidth}
    started = time.perf_counter()
    try:
        for rep in range(args.repeats):
            r = one_repeat(base, ram_base, job, rep)
            report["repeats"].append(r)
            rs = [max(x["saves"][i]["replicated_s"] for x in r["save"]) for i in range(args.steps)]
            ds = [max(x["saves"][i]["durable_s"] for x in r["save"]) for i in range(args.steps)]
            print(
                f"repeat {rep}: replicated {['%.2f' % v for v in rs]} s, durable {['%.2f' % v for v in ds]} s; restore (a) "
                f"{max(x['restore_s'] for x in r['node_lost']):.2f} s, (b) {max(x['restore_s'] for x in r['all_lost']):.2f} s "
                f"(walls: save {r['save_wall_s']:.0f} s, (a) {r['node_lost_wall_s']:.0f} s, (b) {r['all_lost_wall_s']:.0f} s)",
                flush=True,
            )
    finally:
        shutil.rmtree(ram_base, ignore_errors=True)
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    report["summary"] = summary = summarize(report["repeats"])
    report["total_s"] = time.perf_counter() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    cache = summary["cache_after_drop"][0]
    resident = "?" if cache["resident_bytes"] is None else f"{max(c['resident_bytes'] for c in summary['cache_after_drop']) / 2**20:.0f} MiB"
    lines = [
        f"## In-memory redundancy: peer tier (issue 12) ({stamp})",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM, Linux {m['kernel']}; disk tier on {m['disk']}, "
        f"O_DIRECT: {m['o_direct']}; RAM tiers on {m['ram_dir']}; Python {m['python']}, torch {m['torch']}. Ranks: {WORLD} "
        f"processes on this machine as {NODES} simulated nodes of {WORLD // NODES} (`distributed.nodes: {NODES}`), gloo on "
        f"localhost, OMP_NUM_THREADS=1. Command: `flock /tmp/tierckpt-bench.lock {command}`; raw numbers: "
        f"`{shown(args.out)}`.",
        "",
        f"Per rank: {summary['state_bytes_per_rank'] / 2**20:.0f} MiB (3 fp32 tensors, 1 bf16). Tiers: `ram` (memory, "
        f"`path:` a directory per node on /dev/shm), `peer` (`copies: 1`, no bandwidth cap unless the command sets one), "
        f"`disk` (filesystem, every step, {IO_THREADS} I/O threads). {args.repeats} repeats of: {args.steps} saves (each "
        f"after a barrier, the next once both tiers committed), every rank SIGKILLed, recovery (a) with node 1's RAM "
        f"directory wiped, then recovery (b) of the same version with both wiped and the disk tier's page cache dropped "
        f"({cache['how']}; resident after: {resident}). Times to replicated and to durable: from the same moment, the "
        f"host copy done, on each rank; the slowest rank per save; medians over the {args.repeats * args.steps} saves. "
        f"Recovery: `restore_latest_sync(template)` after a barrier, the Checkpointer constructed before it; medians "
        f"over repeats; restored step, tier and values checked on every rank.",
        "",
        *table(summary),
        "",
    ]
    common.show_report(lines, args.markdown, args.out, report["total_s"])


if __name__ == "__main__":
    sys.exit(main())
