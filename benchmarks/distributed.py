"""Multi-rank saves on one machine: time to durable and stall per rank, world 2 and 4, with and without dedup.

Issue 9 asks what a checkpoint of a data-parallel job costs when every rank saves at once: how long each
rank's ``save()`` blocks it (the stall) and how long until the version is durable on every rank (time to
durable: all parts written and fsynced, the version globally committed). Each world size runs three
variants, each in its own set of ``world`` processes (this script with ``--rank-worker``), joined in a
gloo process group on localhost:

- ``tierckpt``: ``save_sync(step, state)``: every rank stores its whole state (the model once per rank);
- ``tierckpt dedup``: ``save_sync(step, state, replicated=["model"])``: the model, identical on every
  rank, is stored once, each rank writing about 1/world of it;
- ``dcp.async_save``: PyTorch DCP on the same processes and state, with a ``DefaultStager`` (staging on
  a background thread; the pinned/shared-memory options need an accelerator and are off on a CPU-only
  machine), following PyTorch's recipe: the call is the stall, then the staging future, then the upload
  future (durable: every rank's files fsynced and the coordinator's metadata written).

Each rank's state is model-like: ``model`` (~90% of the bytes: a few fp32 tensors, the same on every
rank, the weights of plain data parallelism) and ``own`` (~10%: a per-rank fp32 tensor, say a ZeRO shard
of the optimizer, and the rank's RNG state). DCP treats a plain tensor saved under the same key by
several ranks as replicated and keeps one copy, so its per-rank values go under per-rank keys
(``own.rank<r>``), as a DCP user must store them; its model is deduplicated whole tensor by whole
tensor. Between saves the ranks change every tensor in place (the same change on every rank), as a
training step would. Every save starts after a barrier; the first is a warm-up and is not reported. Per
variant: the median over saves of the slowest rank's time to durable, the median and max stall over
saves and ranks, and the bytes of the newest version on disk (all its files; the largest rank's share).
Before each variant, the disk's write limit is measured on the same directory: one process writes and
fsyncs, with O_DIRECT where allowed and 2 threads (the tier's io_threads), as many bytes as a save
without dedup writes at that world size; durable throughput (version bytes / time to durable) is
reported as a share of it. Results: JSON in benchmarks/results/distributed.json and a markdown table
(printed, and written to /tmp/distributed_results.md). A default run takes 1-2 minutes on 2 cores.

    flock /tmp/tierckpt-bench.lock .venv/bin/python benchmarks/distributed.py
    .venv/bin/python benchmarks/distributed.py --worlds 2 --size 64 --saves 3
"""

from __future__ import annotations

import argparse
import gc
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
VARIANTS = ("tierckpt", "tierckpt dedup", "dcp.async_save")
MODEL_SHARE = 0.9  # of each rank's bytes: the replicated model; the rest is the rank's own
MODEL_PARTS = (4, 3, 2, 2, 1, 1, 1, 1, 0.5, 0.5)  # relative sizes of the model's tensors
IO_THREADS = 2  # the filesystem tier's (its default), and the limit's threads
KEEP = 2  # versions kept on disk by every variant


# -- one rank ------------------------------------------------------------------------------------------


def make_state(nbytes: int, rank: int) -> dict[str, Any]:
    """About ``nbytes``: ``model`` alike on every rank (one seed), ``own`` different on each."""
    g = torch.Generator().manual_seed(0)
    model_numel = int(nbytes * MODEL_SHARE) // 4
    total = sum(MODEL_PARTS)
    model = {f"layer{i}.weight": torch.randn(int(model_numel * p / total), generator=g) for i, p in enumerate(MODEL_PARTS)}
    model["norm.bias"] = torch.randn(1027, generator=g)  # a small, unaligned one
    g.manual_seed(1 + rank)
    own = {"shard": torch.randn(int(nbytes * (1 - MODEL_SHARE)) // 4, generator=g), "rng": torch.get_rng_state()}
    return {"model": model, "own": own}


def train_step(state: dict[str, Any], step: int) -> None:
    """Change every tensor in place, the same way on every rank (the model stays replicated)."""
    for t in state["model"].values():
        t.add_(1e-3 * step)
    state["own"]["shard"].add_(1e-3 * step)


def tier_config(directory: Path, nbytes: int, timeout: float) -> dict[str, Any]:
    disk = common.disk_tier(directory, keep={"last": KEEP}, io_threads=IO_THREADS)
    return common.tier_config(disk, capacity=2 * (nbytes + (16 << 20)), snapshots=2, distributed={"timeout": f"{timeout:g}s"})


def run_tierckpt(job: dict[str, Any], state: dict[str, Any], rank: int) -> list[dict[str, float]]:
    import torch.distributed as dist

    from tierckpt import Checkpointer

    replicated = ["model"] if job["variant"] == "tierckpt dedup" else []
    samples = []
    with Checkpointer(tier_config(Path(job["dir"]), job["nbytes"], job["timeout"])) as ckpt:
        for step in range(1, job["saves"] + 1):
            train_step(state, step)
            dist.barrier()
            t = time.perf_counter()
            handle = ckpt.save_sync(step, state, replicated=replicated)
            stall = time.perf_counter() - t
            assert handle.captured_sync(timeout=job["timeout"]), f"step {step}: not captured (skipped)"
            captured = time.perf_counter() - t
            assert handle.committed_sync("disk", timeout=job["timeout"]), f"step {step}: not committed on disk"
            durable = time.perf_counter() - t
            samples.append({"step": step, "stall_s": stall, "captured_s": captured, "durable_s": durable})
    return samples


def run_dcp(job: dict[str, Any], state: dict[str, Any], rank: int) -> list[dict[str, float]]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    on_gpu = torch.accelerator.is_available()
    cpu_only = StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=False)
    stager = DefaultStager() if on_gpu else DefaultStager(cpu_only)
    # Per-rank values under per-rank keys: DCP keeps one copy of a plain tensor saved under one key.
    state_dict = {"model": state["model"], "own": {f"rank{rank}": state["own"]}}
    root = Path(job["dir"])
    samples = []
    try:
        for step in range(1, job["saves"] + 1):
            train_step(state, step)
            dist.barrier()
            t = time.perf_counter()
            response = dcp.async_save(state_dict, checkpoint_id=root / f"step-{step}", async_stager=stager)
            stall = time.perf_counter() - t
            response.staging_completion.result()
            captured = time.perf_counter() - t
            response.upload_completion.result()  # FileSystemWriter fsyncs its files (sync_files=True)
            durable = time.perf_counter() - t
            samples.append({"step": step, "stall_s": stall, "captured_s": captured, "durable_s": durable})
            if rank == 0 and step > KEEP:  # keep the newest KEEP, as the tier does
                shutil.rmtree(root / f"step-{step - KEEP}")
    finally:
        stager.close()
    return samples


def rank_worker(job: dict[str, Any]) -> None:
    """One rank (``--rank-worker``): join the group, save ``saves`` times, write what it measured."""
    import torch.distributed as dist

    common.start_rank(job["timeout"] * 2)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    state = make_state(job["nbytes"], rank)
    run = run_dcp if job["variant"] == "dcp.async_save" else run_tierckpt
    samples = run(job, state, rank)
    dist.barrier()
    out = {"rank": rank, "world": world, "samples": samples, "peak_rss_mib": common.peak_rss_mib()}
    Path(job["results"], f"rank-{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


# -- the parent ----------------------------------------------------------------------------------------


def run_ranks(job: dict[str, Any], world: int, log_dir: Path, limit_s: float) -> list[dict[str, Any]]:
    """Start ``world`` ranks of this script; returns each rank's result (raises with the logs' tails)."""
    return common.run_ranks(__file__, job, world, log_dir, timeout_s=limit_s, what=f"{job['variant']} at world {world}")


def version_bytes(variant: str, directory: Path, step: int, world: int) -> dict[str, Any]:
    """The newest version on disk: every file's bytes, and the bytes of each rank's data files."""
    if variant.startswith("tierckpt"):
        from tierckpt.format import version_dirname

        version = directory / version_dirname(step)
        per_rank = [(version / f"data-r{r:05d}.bin").stat().st_size for r in range(world)]
    else:
        version = directory / f"step-{step}"
        per_rank = [sum(p.stat().st_size for p in version.glob(f"__{r}_*.distcp")) for r in range(world)]
    files = [p for p in version.rglob("*") if p.is_file()]
    return {"total": sum(p.stat().st_size for p in files), "files": len(files), "per_rank": per_rank}


def write_limit(directory: Path, nbytes: int) -> float:
    """One process, O_DIRECT where allowed, ``IO_THREADS`` threads, write + fsync ``nbytes``: seconds."""
    from machine_limits import _direct_io, buffer

    nbytes = -(-nbytes // 4096) * 4096
    whole = buffer(nbytes)
    view = memoryview(whole)
    torch.frombuffer(whole, dtype=torch.uint8).fill_(0x5A)  # not zeros: no disk may skip them
    try:
        return _direct_io(directory / "limit.bin", nbytes, IO_THREADS, write=True, whole=view)
    finally:
        view.release()
        whole.close()
        (directory / "limit.bin").unlink(missing_ok=True)


def bench_variant(base: Path, variant: str, world: int, nbytes: int, saves: int, timeout: float) -> dict[str, Any]:
    work = base / f"w{world}-{variant.replace(' ', '-').replace('.', '-')}"
    shutil.rmtree(work, ignore_errors=True)
    (work / "ckpt").mkdir(parents=True)
    limit_bytes = world * nbytes
    limit_s = write_limit(work, limit_bytes)
    job = {"variant": variant, "dir": str(work / "ckpt"), "results": str(work / "results"), "nbytes": nbytes, "saves": saves, "timeout": timeout}
    t = time.perf_counter()
    ranks = run_ranks(job, world, base / "logs" / f"w{world}-{variant.replace(' ', '-')}", limit_s=timeout * 3 + 60)
    wall = time.perf_counter() - t
    on_disk = version_bytes(variant, work / "ckpt", saves, world)
    measured = range(1, saves)  # the first save is the warm-up
    durable = [max(r["samples"][i]["durable_s"] for r in ranks) for i in measured]
    stalls = [r["samples"][i]["stall_s"] for r in ranks for i in measured]
    captured = [r["samples"][i]["captured_s"] for r in ranks for i in measured]
    durable_s = statistics.median(durable)
    limit_gbs = limit_bytes / limit_s / 1e9
    gbs = on_disk["total"] / durable_s / 1e9
    out = {
        "variant": variant,
        "world": world,
        "durable_s": durable_s,
        "durable_per_save_s": durable,
        "stall_median_s": statistics.median(stalls),
        "stall_max_s": max(stalls),
        "captured_median_s": statistics.median(captured),
        "version_bytes": on_disk["total"],
        "version_files": on_disk["files"],
        "rank_bytes": on_disk["per_rank"],
        "durable_gbs": gbs,
        "limit_write_bytes": limit_bytes,
        "limit_write_s": limit_s,
        "limit_gbs": limit_gbs,
        "share_of_limit": gbs / limit_gbs,
        "peak_rss_mib": [r["peak_rss_mib"] for r in ranks],
        "wall_s": wall,
        "ranks": ranks,
    }
    shutil.rmtree(work, ignore_errors=True)
    return out


def table(report: dict[str, Any]) -> list[str]:
    mib = 2**20
    lines = [
        "| world | variant | time to durable s (slowest rank) | stall per rank: median / max | host copy / staged s | "
        "version on disk MiB (largest rank) | durable GB/s | write limit GB/s | % of the limit | peak RSS per rank MiB |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["runs"]:
        if "error" in r:
            lines.append(f"| {r['world']} | {r['variant']} | failed: {r['error'].splitlines()[0]} | | | | | | | |")
            continue
        lines.append(
            f"| {r['world']} | {r['variant']} | {r['durable_s']:.3f} | {r['stall_median_s'] * 1e3:.1f} ms / {r['stall_max_s'] * 1e3:.1f} ms | "
            f"{r['captured_median_s']:.3f} | {r['version_bytes'] / mib:.0f} ({max(r['rank_bytes']) / mib:.0f}) | {r['durable_gbs']:.2f} | "
            f"{r['limit_gbs']:.2f} | {100 * r['share_of_limit']:.0f}% | {max(r['peak_rss_mib']):.0f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="world sizes")
    parser.add_argument("--size", type=float, default=256, help="MiB of state per rank (~90%% of it the replicated model)")
    parser.add_argument("--saves", type=int, default=8, help="saves per variant; the first is a warm-up")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--dir", type=Path, default=None, help="a directory on the disk to measure (default: a new one under /tmp)")
    parser.add_argument("--timeout", type=float, default=120, help="seconds: tierckpt's distributed timeout and each wait")
    parser.add_argument("--json", type=Path, default=HERE / "results" / "distributed.json")
    parser.add_argument("--markdown", type=Path, default=Path("/tmp/distributed_results.md"))
    parser.add_argument("--rank-worker", help=argparse.SUPPRESS)  # one rank of a variant
    args = parser.parse_args()
    if args.rank_worker:
        rank_worker(json.loads(args.rank_worker))
        return
    if args.saves < 2:
        parser.error("--saves must be at least 2 (the first is a warm-up)")
    from machine_limits import machine

    base = args.dir or Path(tempfile.mkdtemp(prefix="tierckpt-dist-"))
    base.mkdir(parents=True, exist_ok=True)
    nbytes = int(args.size * 2**20)
    stamp = time.strftime("%Y-%m-%d %H:%M")
    command = " ".join(["python", os.path.relpath(__file__), *sys.argv[1:]])
    report: dict[str, Any] = {
        "time": stamp,
        "command": command,
        "machine": machine(base),
        "state_bytes_per_rank": nbytes,
        "model_share": MODEL_SHARE,
        "saves": args.saves,
        "runs": [],
    }
    started = time.perf_counter()
    try:
        for world in args.worlds:
            for variant in args.variants:
                gc.collect()
                try:
                    run = bench_variant(base, variant, world, nbytes, args.saves, args.timeout)
                except RuntimeError as exc:  # a rank failed or hung: report it, go on with the others
                    print(exc, flush=True)
                    report["runs"].append({"variant": variant, "world": world, "error": str(exc)})
                    continue
                report["runs"].append(run)
                print(
                    f"world {world}, {variant}: durable {run['durable_s']:.3f} s, stall {run['stall_median_s'] * 1e3:.1f} ms, "
                    f"{run['version_bytes'] / 2**20:.0f} MiB on disk, {100 * run['share_of_limit']:.0f}% of the write limit "
                    f"({run['wall_s']:.1f} s)",
                    flush=True,
                )
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    report["total_s"] = time.perf_counter() - started
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    m = report["machine"]
    model = int(nbytes * MODEL_SHARE) / 2**20
    lines = [
        f"## Multi-rank save (issue 9) ({stamp})",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM, Linux {m['kernel']}; disk: {m['disk']}, "
        f"O_DIRECT: {m['o_direct']}; Python {m['python']}, torch {m['torch']}. Ranks: processes on this machine, gloo on "
        f"localhost, OMP_NUM_THREADS=1. Command: `flock /tmp/tierckpt-bench.lock {command}`; raw numbers: "
        f"`{os.path.relpath(args.json)}`.",
        "",
        f"Per rank: {args.size:g} MiB of state, {model:.0f} MiB of it the model (the same on every rank), the rest the "
        f"rank's own. {args.saves} saves per variant after a barrier each, the first a warm-up; medians over the other "
        f"{args.saves - 1}. Time to durable: from the `save()` call to the version committed on every rank (tierckpt: "
        f"`handle.committed_sync('disk')`; DCP: the upload future), the slowest rank's. Stall: the `save()`/`async_save()` "
        f"call. Host copy / staged: until tierckpt's host copy is done / DCP's staging future. Version on disk: every file "
        f"of the newest version (in brackets the largest rank's data). Write limit: one process writing and fsyncing "
        f"world × {args.size:g} MiB (what a save without dedup writes) with O_DIRECT and {IO_THREADS} threads, measured "
        f"before each variant on the same directory; % of the limit = durable GB/s / limit GB/s. Peak RSS: the "
        f"largest rank's VmHWM.",
        "",
        *table(report),
        "",
    ]
    common.show_report(lines, args.markdown, args.json, report["total_s"])


if __name__ == "__main__":
    sys.exit(main())
