"""One rank of a peer-tier test (tests/test_peer.py): ``python peer_worker.py <save|restore|misplaced|selection> <dir>``.

Started once per rank with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, and:
    STEPS       save: the steps to save, "1,2,3"
    DIE         save: this rank dies by SIGKILL right after its first save reached the peer tier
    TIMEOUT     distributed.timeout (default 30s)
    FULL        save: this rank's RAM refuses (ENOSPC) the first copy it is sent
    RESUME      restore: then save this step, and report the copies held once it is committed
    BANDWIDTH   the peer tier's bandwidth cap (default: none)
    MB          megabytes of state per rank (default 6)
The job is NODES simulated nodes (``distributed.nodes``, default 2) of WORLD_SIZE/NODES ranks, and the
peer tier keeps COPIES copies (default 1); each node's RAM tier is ``<dir>/node-<n>``, and the disk tier is ``<dir>/nvme`` with
``flush: {every_steps: 2}``, so the disk holds the even steps only.

save: saves STEPS, waits until the last is committed on the peer tier, and, with KILL=1, dies by
SIGKILL after every rank got there (as a node lost mid-training would, leaving RAM files behind).
restore: restores into a template; both write ``<dir>/<mode>-<rank>.json``.
selection (with DISK_FIRST=1): ram -> a slow nvme (every save) -> the peer tier (every 2nd step).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tierckpt import Checkpointer, ConfigError, FlushError
from tierckpt.testing import IOFaults

from helpers import bitwise_equal, tier_of


def nodes() -> int:
    return int(os.environ.get("NODES", "2"))


def config(root: Path, rank: int, world: int) -> dict[str, Any]:
    node = rank // (world // nodes())
    peer: dict[str, Any] = {"name": "peer", "type": "peer", "copies": int(os.environ.get("COPIES", "1")), "keep": {"last": 2}}
    if os.environ.get("BANDWIDTH"):
        peer["bandwidth"] = os.environ["BANDWIDTH"]
    if os.environ.get("DISK_FIRST") == "1":  # selection: the peer tier below a busy nvme, every 2nd step
        return {
            "host": {"capacity": "64MiB", "snapshots": 5},
            "tiers": [
                {"name": "ram", "type": "memory", "path": str(root / f"node-{node}"), "keep": {"last": 1}},
                {"name": "nvme", "type": "filesystem", "path": str(root / "nvme"), "keep": {"last": 2}},
                peer | {"flush": {"every_steps": 2}},
            ],
            "distributed": {"timeout": os.environ.get("TIMEOUT", "30s"), "nodes": nodes()},
        }
    return {
        "host": {"capacity": "64MiB", "snapshots": 2},
        "tiers": [
            {"name": "ram", "type": "memory", "path": str(root / f"node-{node}"), "keep": {"last": 2}},
            peer,
            {"name": "nvme", "type": "filesystem", "path": str(root / "nvme"), "flush": {"every_steps": 2}},
        ],
        "distributed": {"timeout": os.environ.get("TIMEOUT", "30s"), "nodes": nodes()},
    }


def state(rank: int, step: int) -> dict[str, Any]:
    """Values that differ by rank and step; one larger than a stored chunk would be too slow here."""
    n = int(float(os.environ.get("MB", "6")) * (1 << 20)) // 4
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {
        "model": {"w": torch.randn(n // 2, generator=g), "b": torch.arange(n // 2, dtype=torch.float32) + rank},
        "optim": {"m": torch.randn(64, 64, generator=g).to(torch.bfloat16), "step": step},
        "rank": rank,
    }


def template(rank: int) -> dict[str, Any]:
    return {k: (v if not isinstance(v, dict) else {kk: torch.zeros_like(vv) if isinstance(vv, torch.Tensor) else vv for kk, vv in v.items()}) for k, v in state(rank, 0).items()}


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    if mode == "misplaced":  # every rank on one node: refused, and nothing is left held
        try:
            Checkpointer(config(root, rank, world))
        except ConfigError as exc:
            out["error"] = str(exc)
        plain = config(root, rank, world)
        plain["tiers"] = [t for t in plain["tiers"] if t["type"] != "peer"]
        Checkpointer(plain).close_sync()  # the same RAM directory: its lock was given back
        (root / f"{mode}-{rank}.json").write_text(json.dumps(out))
        dist.destroy_process_group()
        return
    if mode == "selection":
        # nvme takes every save, each write 0.4 s slower, so it is always busy with an older one; the
        # peer tier (every_steps 2) must still get every even step on every rank. The next even step is
        # saved only once the peer tier is done with the previous one.
        from dist_worker import SlowWrites, remember_groups

        SlowWrites.delay_s = 0.4
        groups = remember_groups()
        ckpt = Checkpointer(config(root, rank, world), tier_factory=lambda t: SlowWrites(t, groups[-1]) if t.name == "nvme" else None)
        pending = None
        for step in range(1, 13):
            ckpt.wait_captured()
            if step % 2 == 0 and pending is not None:
                out[str(pending.step)] = pending.committed_sync("peer", 120)
            handle = ckpt.save_sync(step, state(rank, step))
            if step % 2 == 0:
                pending = handle
        assert pending is not None
        out[str(pending.step)] = pending.committed_sync("peer", 120)
        ckpt.wait_sync()
        out["versions"] = {t: [v.step for v in ckpt.versions() if v.tier == t] for t in ckpt.tiers}
        (root / f"{mode}-{rank}.json").write_text(json.dumps(out))
        ckpt.close_sync()
        dist.destroy_process_group()
        return
    ckpt = Checkpointer(config(root, rank, world))
    if mode == "save":
        steps = [int(s) for s in os.environ["STEPS"].split(",")]
        die = int(os.environ.get("DIE", "-1"))
        faults = contextlib.nullcontext()
        if rank == int(os.environ.get("FULL", "-1")):  # this rank's RAM has no room for the first copy it gets
            faults = IOFaults(errno.ENOSPC, "allocate", under=root / f"node-{rank // (world // nodes())}" / f"peer-rank-{rank:05d}")
        with faults:
            saved = save_all(ckpt, rank, steps, die, out)
        if die >= 0:
            (root / f"save-{rank}.json").write_text(json.dumps(out))
            try:
                ckpt.close_sync()
            except FlushError:
                pass
            return
        peer = tier_of(ckpt, "peer")
        out["slept_s"] = peer.throttle.slept_s
        try:
            ckpt.wait_sync()  # retention included: what each holder keeps is settled
        except FlushError:
            assert not saved  # only a version that failed may fail the wait
        out["versions"] = {t: [v.step for v in ckpt.versions() if v.tier == t] for t in ckpt.tiers}
        out["held"] = sorted([h.owner, h.step] for h in peer.replicas.held())
        out["nvme"] = [v.step for v in ckpt.versions() if v.tier == "nvme"]
        (root / f"save-{rank}.json").write_text(json.dumps(out))
        if os.environ.get("KILL") == "1":
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
        ckpt.close_sync()
    else:
        restored = ckpt.restore_latest_sync(template(rank))
        assert restored is not None
        out = {"step": restored.step, "tier": restored.tier, "bitwise": bitwise_equal(restored.state, state(rank, restored.step))}
        if os.environ.get("RESUME"):  # training goes on: the next version's copies replace what is left
            step = int(os.environ["RESUME"])
            out["resumed"] = ckpt.save_sync(step, state(rank, step)).committed_sync("peer", 120)
            ckpt.wait_sync()
            peer = tier_of(ckpt, "peer")
            out["held"] = sorted([h.owner, h.step] for h in peer.replicas.held())
            out["versions"] = [v.step for v in ckpt.versions() if v.tier == "peer"]
        (root / f"restore-{rank}.json").write_text(json.dumps(out))
        ckpt.close_sync()
    dist.destroy_process_group()


def save_all(ckpt: Checkpointer, rank: int, steps: list[int], die: int, out: dict[str, Any]) -> bool:
    """Save ``steps``, recording each one's outcome on the peer tier; True if every one committed there."""
    ok = True
    for step in steps:
        handle = ckpt.save_sync(step, state(rank, step))
        handle.captured_sync(60)
        started = time.monotonic()
        try:
            out[str(step)] = {"peer": handle.committed_sync("peer", 120), "seconds": time.monotonic() - started}
        except FlushError as exc:
            ok = False
            out[str(step)] = {"error": str(exc), "ranks": list(getattr(exc, "ranks", ()))}
        if rank == die:  # this rank's node is lost after its first save went everywhere
            os.kill(os.getpid(), signal.SIGKILL)
    return ok


if __name__ == "__main__":
    main()
