"""Restore into another parallel layout (N saving ranks → M restoring ranks): tierckpt vs DCP ``load``.

Issue 10 asks what a restore costs when the job resumes with another number of ranks or other
placements, against ``torch.distributed.checkpoint.load`` doing the same resharding from the same
state in the same run. The state is model-like: a few 2-D weights (fp32 and bf16) and 1-D vectors,
~1 GiB global by default, with dimensions that the world sizes do not all divide. Its values are a
function of each element's global index, so every rank builds (and later checks) only its own piece.

It is saved once per saving world N (N ranks, gloo on localhost, a 1-D CPU mesh, every value
``Shard(0)``): by tierckpt (``save_sync(...).committed_sync("disk")``, a memory tier and a filesystem
tier) and by DCP (``dcp.save``), into two directories on the same disk. Then each case starts M
restoring ranks (this script with ``--rank-worker``) whose template holds zero DTensors with the new
mesh and placements, and times ``Checkpointer(...).restore_latest_sync(template)`` (a new Checkpointer
each time, made before the clock) against ``dcp.load(template, checkpoint_id=dir)``:

- ``4→4 Shard(0)``: the same layout, no resharding (the reference);
- ``4→2 Shard(0)``: each restoring rank takes two stored pieces (uneven ones: the sizes are odd);
- ``4→2 Shard(1)``: the matrices split by columns, the stored pieces by rows: every stored piece
  overlaps every rank's shard, and each rank copies strided boxes out of it;
- ``2→4 Shard(0)``: each restoring rank takes part of one stored piece (or straddles two);
- ``4→1 consolidate``: one process without torch.distributed restores whole plain tensors
  (tierckpt: ``restore_latest_sync`` with a template of plain tensors; DCP: ``dcp.load(...,
  no_dist=True)``).

Each restore starts from a cold page cache (rank 0 drops it after a barrier; root only, else the
report says the cache was warm) and after a barrier; the time is the slowest rank's restore call. The
two libraries alternate which goes first across repeats; one untimed warm-up of each comes first in
each process; medians over the repeats. After every restore each rank compares its pieces bitwise with
the values it should hold (outside the clock; the template is overwritten with a sentinel before each
restore). Bytes read from the disk: the sum over ranks of ``/proc/self/io`` ``read_bytes`` during the
call (readahead included), and of ``rchar`` (bytes the read calls returned, page cache hits
included), and the CPU time (user + system) the call took. Before each case the disk's read limit is measured on the same directory
with ``benchmarks/machine_limits.py`` (one process, O_DIRECT, 2 threads, the global state's bytes,
into a state-sized buffer, cold); % of the limit = (global bytes / time) / limit.

    flock /tmp/tierckpt-bench.lock .venv/bin/python benchmarks/reshard.py
    flock /tmp/tierckpt-bench.lock .venv/bin/python benchmarks/reshard.py --quick

Results: JSON in benchmarks/results/reshard.json and a markdown section (printed, and written to
/tmp/reshard_results.md). A default run takes a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

import common

HERE = Path(__file__).resolve().parent
LIBS = ("tierckpt", "dcp")
IO_THREADS = 2  # the filesystem tier's (its default), and the read limit's threads
# (name, saving world N, restoring world M, placement of the matrices; "plain": one process, no mesh)
CASES = (
    ("4→4 Shard(0)", 4, 4, "S0"),
    ("4→2 Shard(0)", 4, 2, "S0"),
    ("4→2 Shard(1)", 4, 2, "S1"),
    ("2→4 Shard(0)", 2, 4, "S0"),
    ("4→1 consolidate", 4, 1, "plain"),
)
SENTINEL = -7.0


# -- the state -----------------------------------------------------------------------------------------


def shapes(nbytes: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """About ``nbytes`` global: per layer 34·H² bytes of matrices, plus an embedding of (8H+5)·H fp32.

    H is odd, so no world of 2 or 4 divides H, 3H or 8H+5: shards are uneven along both dimensions.
    """
    h = max(33, int(math.sqrt(nbytes / 100)) | 1)
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {"embed.weight": ((8 * h + 5, h), torch.float32)}
    for i in range(2):
        out |= {
            f"layers.{i}.attn.qkv.weight": ((3 * h, h), torch.bfloat16),
            f"layers.{i}.attn.proj.weight": ((h, h), torch.float32),
            f"layers.{i}.mlp.fc.weight": ((4 * h, h), torch.float32),
            f"layers.{i}.mlp.proj.weight": ((h, 4 * h), torch.bfloat16),
            f"layers.{i}.ln.weight": ((h,), torch.float32),
            f"layers.{i}.mlp.fc.bias": ((4 * h + 3,), torch.bfloat16),
        }
    out["norm.weight"] = ((h,), torch.float32)
    return out


def global_bytes(spec: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in spec.values())


def values(key: str, global_shape: tuple[int, ...], dtype: torch.dtype, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    """The piece ``offset``/``shape`` of key's global tensor: exact floats hashed from the global index."""
    seed = sum(map(ord, key)) * 7919
    out = torch.empty(shape, dtype=dtype)
    if out.numel() == 0:
        return out
    if len(shape) == 1:
        rows = [(0, 1)]
        idx_of = lambda r0, r1: torch.arange(offset[0], offset[0] + shape[0], dtype=torch.int64)  # noqa: E731
    else:
        step = max(1, (4 << 20) // max(1, shape[1]))
        rows = [(r, min(r + step, shape[0])) for r in range(0, shape[0], step)]
        cols = torch.arange(offset[1], offset[1] + shape[1], dtype=torch.int64)

        def idx_of(r0: int, r1: int) -> torch.Tensor:
            r = torch.arange(offset[0] + r0, offset[0] + r1, dtype=torch.int64)
            return (r * global_shape[1]).unsqueeze(1) + cols

    for r0, r1 in rows:
        idx = idx_of(r0, r1)
        bits = (idx * 0x9E3779B1 + seed).bitwise_and_(0xFFFFFF)
        piece = bits.to(torch.float32).mul_(2.0**-24).sub_(0.5)  # exact in fp32
        if len(shape) == 1:
            out.copy_(piece)
        else:
            out[r0:r1].copy_(piece)
    return out


def placements(text: str, ndim: int) -> list[Any]:
    from torch.distributed.tensor import Shard

    return [Shard(int(text[1:]) if ndim > 1 else 0)]  # vectors: Shard(0) in every layout


def box_of(global_shape: tuple[int, ...], mesh: Any, place: list[Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's (offset, shape) in the global tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(global_shape, mesh, place)
    return tuple(offset), tuple(shape)


def build(spec: dict[str, Any], mesh: Any, place: str, fill: Callable[[str, tuple[int, ...], Any, tuple, tuple], torch.Tensor]) -> dict[str, Any]:
    """``{"model": {key: value}}``: DTensors with this rank's piece (``fill``), or whole plain tensors."""
    from torch.distributed.tensor import DTensor

    model = {}
    for key, (gshape, dtype) in spec.items():
        if mesh is None:
            model[key] = fill(key, gshape, dtype, (0,) * len(gshape), gshape)
            continue
        p = placements(place, len(gshape))
        offset, shape = box_of(gshape, mesh, p)
        local = fill(key, gshape, dtype, offset, shape)
        model[key] = DTensor.from_local(local, mesh, p, run_check=False, shape=torch.Size(gshape), stride=torch.empty(gshape, device="meta").stride())
    return {"model": model}


def zeros(key: str, gshape: tuple[int, ...], dtype: torch.dtype, offset: tuple, shape: tuple) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


def local(value: Any) -> torch.Tensor:
    return value.to_local() if hasattr(value, "to_local") else value


# -- one rank ------------------------------------------------------------------------------------------


def tier_config(directory: str, host_bytes: int) -> dict[str, Any]:
    disk = common.disk_tier(directory, keep={"last": 1}, io_threads=IO_THREADS)
    return common.tier_config(disk, capacity=host_bytes + (64 << 20), snapshots=1, distributed={"timeout": "300s"})


def local_bytes(state: dict[str, Any]) -> int:
    return sum(local(v).numel() * local(v).element_size() for v in state["model"].values())


def save_worker(job: dict[str, Any], mesh: Any, rank: int) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from tierckpt import Checkpointer

    spec = {k: (tuple(s), getattr(torch, d)) for k, (s, d) in job["spec"].items()}
    state = build(spec, mesh, "S0", values)
    out: dict[str, Any] = {"local_bytes": local_bytes(state)}
    with Checkpointer(tier_config(job["tier_dir"], out["local_bytes"])) as ckpt:
        dist.barrier()
        t = time.perf_counter()
        assert ckpt.save_sync(job["step"], state).committed_sync("disk", timeout=600), "not committed on disk"
        out["tierckpt_save_s"] = time.perf_counter() - t
    dist.barrier()
    t = time.perf_counter()
    dcp.save(state, checkpoint_id=job["dcp_dir"])
    out["dcp_save_s"] = time.perf_counter() - t
    return out


def restore_worker(job: dict[str, Any], mesh: Any, rank: int) -> dict[str, Any]:
    """Every repeat: each library restores the whole state into its own template, from a cold cache."""
    import torch.distributed.checkpoint as dcp

    from machine_limits import drop_caches, fault_in
    from tierckpt import Checkpointer

    dist = None
    if mesh is not None:
        import torch.distributed as dist
    spec = {k: (tuple(s), getattr(torch, d)) for k, (s, d) in job["spec"].items()}
    expected = build(spec, mesh, job["place"], values)
    templates = {lib: build(spec, mesh, job["place"], zeros) for lib in LIBS}
    nbytes = local_bytes(expected)
    fault_s = fault_in(2 * nbytes)  # see machine_limits.fault_in: no loader pays for unbacked memory

    def barrier() -> None:
        if dist is not None:
            dist.barrier()

    def restore(lib: str) -> Any:
        template = templates[lib]
        if lib == "dcp":
            dcp.load(template, checkpoint_id=job["dcp_dir"], no_dist=mesh is None)
            return template
        restored = ckpt.restore_latest_sync(template)
        assert restored is not None and restored.step == job["step"] and restored.tier == "disk", restored
        return restored.state

    def check(lib: str, got: dict[str, Any]) -> list[str]:
        wrong = []
        for key, want in expected["model"].items():
            g = got["model"][key]
            if g is not templates[lib]["model"][key]:
                wrong.append(f"{key}: not restored in place")
            g, w = local(g), local(want)
            if g.dtype != w.dtype or g.shape != w.shape or not torch.equal(g, w):
                wrong.append(f"{key}: wrong values")
        return wrong

    samples: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    rounds = [(lib, -1) for lib in LIBS] + [
        (lib, rep) for rep in range(job["repeats"]) for lib in (LIBS if (rep + job["order"]) % 2 == 0 else LIBS[::-1])
    ]
    cold = True
    ckpt = None
    for lib, rep in rounds:
        if lib in errors:
            continue
        for v in templates[lib]["model"].values():
            local(v).fill_(SENTINEL)
        if lib == "tierckpt":
            ckpt = Checkpointer(tier_config(job["tier_dir"], nbytes))
        gc.collect()
        barrier()
        if rank == 0 and rep >= 0:
            cold = drop_caches() and cold
        barrier()
        before, cpu = common.io_counters(), _cpu_s()
        t = time.perf_counter()
        try:
            got = restore(lib)
        except Exception as exc:  # a failing library is reported; the other goes on
            errors[lib] = f"{type(exc).__name__}: {exc}"
            got = None
        elapsed = time.perf_counter() - t
        after, cpu = common.io_counters(), _cpu_s() - cpu
        if ckpt is not None:
            ckpt.close_sync()
            ckpt = None
        wrong = check(lib, got) if got is not None else ["failed"]
        samples.append({"lib": lib, "repeat": rep, "s": elapsed, "disk_read_bytes": after[0] - before[0], "read_call_bytes": after[1] - before[1], "cpu_s": cpu, "wrong": wrong})
    return {"samples": samples, "errors": errors, "cold": cold, "local_bytes": nbytes, "fault_in_s": fault_s}


def rank_worker(job: dict[str, Any]) -> None:
    """One rank (``--rank-worker``): save or restore, then write what it measured."""
    common.start_rank(job["timeout"])
    warnings.filterwarnings("ignore", category=UserWarning)
    sys.path.insert(0, str(HERE))
    mesh, rank = None, 0
    if job["world"] > 0:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = (save_worker if job["mode"] == "save" else restore_worker)(job, mesh, rank)
    out["peak_rss_mib"] = common.peak_rss_mib()
    Path(job["results"], f"rank-{rank}.json").write_text(json.dumps(out))
    if mesh is not None:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _cpu_s() -> float:
    """CPU seconds of this process, all its threads, user and system."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# -- the parent ----------------------------------------------------------------------------------------


def run_ranks(job: dict[str, Any], world: int, log_dir: Path) -> list[dict[str, Any]]:
    """Start ``world`` ranks of this script (world 0: one process without torch.distributed)."""
    threads = str(max(1, (os.cpu_count() or 1) // max(world, 1)))
    return common.run_ranks(__file__, job | {"world": world}, world, log_dir, env={"OMP_NUM_THREADS": threads},
                            timeout_s=job["timeout"] + 60, what=f"{job['mode']} with {world} ranks")


def summarize(name: str, n: int, m: int, ranks: list[dict[str, Any]], nbytes: int, limit: dict[str, float]) -> dict[str, Any]:
    out: dict[str, Any] = {"case": name, "saved_world": n, "restored_world": m, "errors": ranks[0]["errors"], "cold": ranks[0]["cold"]}
    limit_gbs = nbytes / limit["read_s"] / 1e9
    out |= {"limit_read_s": limit["read_s"], "limit_read_gbs": limit_gbs, "limit_read_disk_alone_s": limit["read_disk_s"]}
    for lib in LIBS:
        reps = sorted({s["repeat"] for s in ranks[0]["samples"] if s["lib"] == lib and s["repeat"] >= 0})
        per_rep = [[next(s for s in r["samples"] if s["lib"] == lib and s["repeat"] == rep) for r in ranks] for rep in reps]
        warm = [next(s for s in r["samples"] if s["lib"] == lib and s["repeat"] == -1) for r in ranks if any(s["lib"] == lib for s in r["samples"])]
        times = [max(s["s"] for s in rep) for rep in per_rep]
        wrong = sorted({w for rep in per_rep for s in rep for w in s["wrong"]} | {w for s in warm for w in s["wrong"]})
        failed = lib in out["errors"] or not times
        out[lib] = {
            "s": statistics.median(times) if not failed else None,
            "per_repeat_s": times,
            "warmup_s": max((s["s"] for s in warm), default=None),
            "per_rank_s": [[s["s"] for s in rep] for rep in per_rep],
            "disk_read_bytes": statistics.median([sum(s["disk_read_bytes"] for s in rep) for rep in per_rep]) if per_rep else None,
            "read_call_bytes": statistics.median([sum(s["read_call_bytes"] for s in rep) for rep in per_rep]) if per_rep else None,
            "cpu_s": statistics.median([sum(s["cpu_s"] for s in rep) for rep in per_rep]) if per_rep else None,
            "verified": not wrong and not failed,
            "wrong": wrong,
            "share_of_limit": (nbytes / statistics.median(times) / 1e9 / limit_gbs) if not failed else None,
        }
    out["fault_in_s"] = max(r["fault_in_s"] for r in ranks)
    out["peak_rss_mib"] = [r["peak_rss_mib"] for r in ranks]
    return out


def table(report: dict[str, Any]) -> list[str]:
    gib = 2**30
    lines = [
        "| case (saved → restored ranks, placement) | tierckpt s | DCP s | DCP / tierckpt | tierckpt % of read limit | "
        "DCP % of read limit | read limit GB/s | tierckpt GiB read: disk / calls | DCP GiB read: disk / calls | CPU s, all ranks: tierckpt / DCP | bitwise right |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for c in report["cases"]:
        if "error" in c:
            lines.append(f"| {c['case']} | failed: {c['error'].splitlines()[0]} | | | | | | | | | |")
            continue
        t, d = c["tierckpt"], c["dcp"]

        def sec(x: dict[str, Any]) -> str:
            return f"{x['s']:.3f}" if x["s"] is not None else "failed"

        def pct(x: dict[str, Any]) -> str:
            return f"{100 * x['share_of_limit']:.0f}%" if x["share_of_limit"] is not None else ""

        def gb(x: dict[str, Any]) -> str:
            if x["disk_read_bytes"] is None:
                return "?"
            return f"{x['disk_read_bytes'] / gib:.2f} / {x['read_call_bytes'] / gib:.2f}"

        def cpu(x: dict[str, Any]) -> str:
            return f"{x['cpu_s']:.2f}" if x["cpu_s"] is not None else "?"

        ratio = f"{d['s'] / t['s']:.2f}" if t["s"] and d["s"] else ""
        right = "yes" if t["verified"] and d["verified"] else f"tierckpt {t['verified']}, DCP {d['verified']}"
        lines.append(f"| {c['case']} | {sec(t)} | {sec(d)} | {ratio} | {pct(t)} | {pct(d)} | {c['limit_read_gbs']:.2f} | {gb(t)} | {gb(d)} | {cpu(t)} / {cpu(d)} | {right} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="GiB of global state")
    parser.add_argument("--repeats", type=int, default=3, help="timed restores per library and case (median)")
    parser.add_argument("--quick", action="store_true", help="a smoke run (~30 s): 20 MiB, 1 repeat, two cases, results under /tmp")
    parser.add_argument("--cases", nargs="+", default=[c[0] for c in CASES], choices=[c[0] for c in CASES])
    parser.add_argument("--dir", type=Path, default=None, help="a directory on the disk to measure (default: a new one under /tmp)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a set of ranks may take")
    parser.add_argument("--json", type=Path, default=HERE / "results" / "reshard.json")
    parser.add_argument("--markdown", type=Path, default=Path("/tmp/reshard_results.md"))
    parser.add_argument("--rank-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker:
        rank_worker(json.loads(args.rank_worker))
        return
    if args.quick:  # both resharding paths (ranks reading others' pieces; one process consolidating)
        args.gib, args.repeats = 0.02, 1
        if args.cases == parser.get_default("cases"):
            args.cases = ["4→2 Shard(1)", "4→1 consolidate"]
        if args.json == parser.get_default("json"):
            args.json = Path("/tmp/reshard-quick.json")
        if args.markdown == parser.get_default("markdown"):
            args.markdown = Path("/tmp/reshard-quick.md")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    sys.path.insert(0, str(HERE))
    from machine_limits import limits, machine, shown

    base = args.dir or Path(tempfile.mkdtemp(prefix="tierckpt-reshard-"))
    base.mkdir(parents=True, exist_ok=True)
    spec = shapes(int(args.gib * 2**30))
    nbytes = global_bytes(spec)
    stamp = time.strftime("%Y-%m-%d %H:%M")
    command = " ".join(["python", os.path.relpath(__file__), *sys.argv[1:]])
    report: dict[str, Any] = {
        "time": stamp,
        "command": command,
        "machine": machine(base),
        "global_bytes": nbytes,
        "tensors": {k: [list(s), str(d).removeprefix("torch.")] for k, (s, d) in spec.items()},
        "repeats": args.repeats,
        "saves": {},
        "cases": [],
    }
    step = 1000
    cases = [c for c in CASES if c[0] in args.cases]
    started = time.perf_counter()
    try:
        every_job = {"spec": report["tensors"], "step": step, "timeout": args.timeout, "repeats": args.repeats}
        for n in sorted({c[1] for c in cases}, reverse=True):
            job = every_job | {"mode": "save", "tier_dir": str(base / f"tierckpt-{n}"), "dcp_dir": str(base / f"dcp-{n}"), "results": str(base / "results")}
            t = time.perf_counter()
            ranks = run_ranks(job, n, base / "logs" / f"save-{n}")
            save = {
                "tierckpt_s": max(r["tierckpt_save_s"] for r in ranks),
                "dcp_s": max(r["dcp_save_s"] for r in ranks),
                "local_bytes": [r["local_bytes"] for r in ranks],
                "wall_s": time.perf_counter() - t,
            }
            report["saves"][str(n)] = save
            print(f"saved on {n} ranks: tierckpt {save['tierckpt_s']:.2f} s, DCP {save['dcp_s']:.2f} s ({save['wall_s']:.1f} s)", flush=True)
        for i, (name, n, m, place) in enumerate(cases):
            gc.collect()
            limit = limits(base, nbytes, IO_THREADS, cold=True)
            job = every_job | {
                "mode": "restore", "place": place, "order": i,
                "tier_dir": str(base / f"tierckpt-{n}"), "dcp_dir": str(base / f"dcp-{n}"), "results": str(base / "results"),
            }
            t = time.perf_counter()
            try:
                ranks = run_ranks(job, 0 if place == "plain" else m, base / "logs" / f"restore-{i}")
            except RuntimeError as exc:
                print(exc, flush=True)
                report["cases"].append({"case": name, "saved_world": n, "restored_world": m, "error": str(exc)})
                continue
            c = summarize(name, n, m, ranks, nbytes, limit) | {"wall_s": time.perf_counter() - t}
            report["cases"].append(c)
            tl, dl = c["tierckpt"], c["dcp"]
            print(
                f"{name}: tierckpt {tl['s']} s {tl['per_repeat_s']} (right: {tl['verified']}), DCP {dl['s']} s {dl['per_repeat_s']} "
                f"(right: {dl['verified']}); read limit {c['limit_read_gbs']:.2f} GB/s; errors {c['errors']} ({c['wall_s']:.1f} s)",
                flush=True,
            )
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    report["total_s"] = time.perf_counter() - started
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    m = report["machine"]
    cold = all(c.get("cold", True) for c in report["cases"])
    lines = [
        f"## Restore into another layout (issue 10) ({stamp})",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM, Linux {m['kernel']}; disk: {m['disk']}, "
        f"O_DIRECT: {m['o_direct']}; Python {m['python']}, torch {m['torch']}. Ranks: processes on this machine, gloo on "
        f"localhost, a 1-D CPU mesh, OMP_NUM_THREADS = cores / ranks. Command: `flock /tmp/tierckpt-bench.lock {command}`; "
        f"raw numbers: `{shown(args.json)}`.",
        "",
        f"State: {nbytes / 2**30:.2f} GiB global, {len(spec)} tensors (fp32 and bf16 matrices and vectors, odd sizes: uneven "
        f"shards), saved `Shard(0)` on N ranks by tierckpt (filesystem tier, {IO_THREADS} I/O threads) and by `dcp.save`, "
        f"restored on M ranks into zero DTensors with the new placement (vectors stay `Shard(0)`), or into whole plain "
        f"tensors in one process without torch.distributed (4→1). Time: the slowest rank's restore call "
        f"(tierckpt `restore_latest_sync(template)`, a new Checkpointer made before the clock; `dcp.load(template)`), "
        f"after a barrier, page cache dropped before each: {cold}; medians of {args.repeats}, the libraries alternating "
        f"which goes first, after one untimed warm-up each. Every restore checked bitwise on every rank. Read limit: one "
        f"process reading the global state's bytes with O_DIRECT and {IO_THREADS} threads into a state-sized buffer, cold, "
        f"measured before each case; % of the limit = (global bytes / time) / limit. GiB read, summed over the ranks "
        f"(`/proc/self/io`): from the disk (read_bytes, readahead included) / returned by read calls (rchar, page "
        f"cache hits included). CPU s: user + system time of the restore call, summed over the ranks.",
        "",
        *table(report),
        "",
    ]
    common.show_report(lines, args.markdown, args.json, report["total_s"])


if __name__ == "__main__":
    sys.exit(main())
