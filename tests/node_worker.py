"""One rank of a node-local tier test (tests/test_node_local.py): ``python node_worker.py <save|restore> <dir>``.

Started once per rank with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, and:
    STEPS           save: the steps to save, "1,2,3"
    KILL_NODE       save: the ranks of this node die by SIGKILL once every rank saved everything
    DIE_MID_COMMIT  save: node 1's keeper dies by SIGKILL right after it renamed this step into place
    DIE_COMMITTED   save: rank 0 dies by SIGKILL once every node committed this step, before it says so
    RESUME          restore: then save this step, and report whether it committed on nvme
    COMPRESS=1      nvme and pfs compress alike (zstd), so pfs takes each version from nvme, not RAM
    DELTA           nvme stores differential versions (``delta: {full_every: DELTA}``, zstd+shuffle),
                    and the state gains a frozen value (replicated) and a trained one (each rank's)
    PEER=1          add a peer tier (one copy on the other node), RAM tiers on <dir>/ram-<node>
    ABANDONED       nvme's keep.abandoned (how many versions of abandoned directions it keeps)
    TIMEOUT         distributed.timeout (default 20s)
    SIMULATE=0      nodes by torchrun's GROUP_RANK (set here: ranks 0, 1 on node 0, ranks 2, 3 on node
                    1; SWAP=1 exchanges them), not ``distributed.nodes``
The job is 2 nodes (simulated: ``distributed.nodes: 2``).
Tiers: RAM (keep 2), ``nvme`` node-local at ``<dir>/local-{node}/nvme`` (keep 2), ``pfs`` shared at
``<dir>/pfs`` taking every 2nd step. The state holds a value replicated on every rank (stored once
per node on nvme, once in all on pfs). Each rank writes ``<dir>/<mode>-<rank>.json``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tierckpt import Checkpointer, FlushError
from tierckpt.tiers.nodelocal.tier import NodeLocalTier

from helpers import bitwise_equal, logged_warnings, zeroed

NODES = 2


def config(root: Path) -> dict[str, Any]:
    ram: dict[str, Any] = {"name": "ram", "type": "memory", "keep": {"last": 2}}
    tiers: list[dict[str, Any]] = [
        ram,
        {"name": "nvme", "type": "filesystem", "scope": "node", "path": str(root / "local-{node}" / "nvme"), "keep": {"last": 2}},
        {"name": "pfs", "type": "filesystem", "path": str(root / "pfs"), "flush": {"every_steps": 2}},
    ]
    if os.environ.get("COMPRESS") == "1":  # pfs then copies nvme's stored chunks: it reads the node-local tier
        for tier in tiers[1:]:
            tier["compression"] = {"codec": "zstd", "level": 1}
    if os.environ.get("DELTA"):
        tiers[1]["delta"] = {"full_every": int(os.environ["DELTA"])}
        tiers[1]["compression"] = {"codec": "zstd", "level": 1, "shuffle": True}
    if os.environ.get("ABANDONED"):  # how many abandoned versions nvme keeps (keep.abandoned)
        tiers[1]["keep"]["abandoned"] = int(os.environ["ABANDONED"])
    if os.environ.get("PEER") == "1":
        node = os.environ.get("GROUP_RANK") or str(int(os.environ["RANK"]) // 2)
        ram["path"] = str(root / f"ram-{node}")
        tiers.insert(1, {"name": "peer", "type": "peer", "keep": {"last": 2}})
    distributed: dict[str, Any] = {"timeout": os.environ.get("TIMEOUT", "20s")}
    if os.environ.get("SIMULATE", "1") == "1":
        distributed["nodes"] = NODES
    if os.environ.get("RELAY") == "1":  # node 1's ranks commit through rank 2 (tests/test_node_local.py)
        distributed["relay"] = "nodes"
    return {"host": {"capacity": "48MiB", "snapshots": 2}, "tiers": tiers, "distributed": distributed}


def state(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    shared = torch.Generator().manual_seed(step)  # the same on every rank: replicated
    out: dict[str, Any] = {
        "model": {"w": torch.randn(1 << 20, generator=shared), "b": torch.arange(4096, dtype=torch.float32) + step},
        "optim": {"m": torch.randn(300_000, generator=g), "v": torch.randn(64, 64, generator=g).to(torch.bfloat16)},
        "rank": rank,
        "step": step,
    }
    if os.environ.get("DELTA"):  # a value no step changes, and one each step moves a little
        out["model"]["frozen"] = torch.randn(1 << 18, generator=torch.Generator().manual_seed(7))
        out["optim"]["trained"] = torch.randn(1 << 18, generator=torch.Generator().manual_seed(rank)) * (1 + 1e-6 * step)
    return out


def die_at(method: str, when: str) -> None:
    """This rank dies by SIGKILL as NodeLocalTier's ``method`` starts for step ``when`` (``_place``:
    just after its rename instead: the node's copy is in place, and nobody was told). ``"3x2"``: the
    second time for step 3 (a step saved again)."""
    original = getattr(NodeLocalTier, method)
    step, nth = (int(v) for v in (when.split("x") if "x" in when else (when, "1")))
    seen = [0]

    async def killed(self: NodeLocalTier, staged: Any, *args: Any) -> Any:
        if staged.step == step:
            seen[0] += 1
        due = staged.step == step and seen[0] == nth
        if method != "_place" and due:
            os.kill(os.getpid(), signal.SIGKILL)
        done = await original(self, staged, *args)
        if due:
            os.kill(os.getpid(), signal.SIGKILL)
        return done

    setattr(NodeLocalTier, method, killed)


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    node = rank // 2
    if os.environ.get("SIMULATE", "1") == "0":  # the job requeued with its ranks on each other's nodes
        os.environ["GROUP_RANK"] = str(1 - node if os.environ.get("SWAP") == "1" else node)
    out: dict[str, Any] = {}
    if mode == "save" and os.environ.get("DIE_MID_COMMIT") and rank == 2:
        die_at("_place", os.environ["DIE_MID_COMMIT"])
    if mode == "save" and os.environ.get("DIE_COMMITTED") and rank == 0:
        die_at("_committed", os.environ["DIE_COMMITTED"])
    ckpt = Checkpointer(config(root))
    if mode == "save":
        for step in (int(s) for s in os.environ["STEPS"].split(",")):
            handle = ckpt.save_sync(step, state(rank, step), replicated=["model"])
            try:
                out[str(step)] = handle.committed_sync("nvme", 120)
            except FlushError as exc:
                out[str(step)] = {"error": str(exc), "ranks": list(getattr(exc, "ranks", ()))}
        if os.environ.get("DIE_MID_COMMIT") or os.environ.get("DIE_COMMITTED"):
            (root / f"{mode}-{rank}.json").write_text(json.dumps(out))
            try:
                ckpt.close_sync()  # rank 2 is gone: each rank waits out the timeout at most once
            except FlushError:
                pass  # step 3's failure, raised again by close: recorded above
            os._exit(0)  # no barrier of the training group with a rank dead
        ckpt.wait_sync()
        out["versions"] = {t: [v.step for v in ckpt.versions() if v.tier == t] for t in ckpt.tiers}
        (root / f"{mode}-{rank}.json").write_text(json.dumps(out))
        if os.environ.get("KILL_NODE"):
            dist.barrier()
            if node == int(os.environ["KILL_NODE"]):
                os.kill(os.getpid(), signal.SIGKILL)
            ckpt.close_sync()  # the lost node's ranks never leave: waited for up to the timeout
            os._exit(0)
    else:
        with logged_warnings() as logged:
            restored = ckpt.restore_latest_sync(zeroed(state(rank, 0)))
        assert restored is not None
        out = {
            "step": restored.step,
            "tier": restored.tier,
            "bitwise": bitwise_equal(restored.state, state(rank, restored.step)),
            "warnings": [m for m in logged if "does not verify" in m],  # the restore's fallbacks
        }
        if os.environ.get("RESUME"):  # training goes on: the next version commits on every node
            step = int(os.environ["RESUME"])
            out["resumed"] = ckpt.save_sync(step, state(rank, step), replicated=["model"]).committed_sync("nvme", 120)
            ckpt.wait_sync()
            out["versions"] = {t: [v.step for v in ckpt.versions() if v.tier == t] for t in ckpt.tiers}
        (root / f"{mode}-{rank}.json").write_text(json.dumps(out))
    ckpt.close_sync()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
