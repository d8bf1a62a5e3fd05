"""One rank of a multi-process test (tests/test_distributed.py): ``python dist_worker.py <scenario> <dir>``.

Started once per rank with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set; joins a gloo process
group on localhost, runs the scenario, and writes what it saw to ``<dir>/result-<rank>.json``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tierckpt import Checkpointer, ConfigError, FlushError, RankFailureError, TierckptError
from tierckpt.config import TierConfig
from tierckpt.tiers.filesystem import FilesystemTier

from helpers import bitwise_equal, logged_warnings

MODEL_NUMEL = 300_000  # 1.2 MB of float32 per tensor: several shared chunks per rank at world 4


def config(root: Path, timeout: float) -> dict[str, Any]:
    # S3_TIER: a JSON tier section of type object in place of the "disk" tier (tests/test_object_tier.py).
    disk = {"name": "disk", "type": "filesystem", "path": str(root / "disk"), "keep": {"last": 3}}
    if "S3_TIER" in os.environ:
        disk = json.loads(os.environ["S3_TIER"]) | {"name": "disk", "keep": {"last": 3}}
    if "DELTA" in os.environ:  # differential versions (tests/test_delta.py)
        disk["delta"] = {"full_every": int(os.environ["DELTA"])}
    below = [{"name": "pfs", "type": "filesystem", "path": str(root / "pfs")}] if "PFS" in os.environ else []  # a third tier
    distributed: dict[str, Any] = {"timeout": f"{timeout}s"}
    if "RELAY_NODES" in os.environ:  # nodes simulated on this host, every one but the leader's relaying (tests/test_relay.py)
        distributed |= {"nodes": int(os.environ["RELAY_NODES"]), "relay": "nodes"}
    return {
        "host": {"capacity": "64MiB", "snapshots": 2},
        "tiers": [{"name": "ram", "type": "memory"}, disk, *below],
        "distributed": distributed,
        "events": str(root / "events-{rank}.jsonl"),  # each rank its own file
    }


def model(step: int) -> dict[str, torch.Tensor]:
    """What every rank holds alike at ``step`` (data-parallel weights)."""
    if "DELTA" in os.environ:  # weights that move a little each step, beside a frozen part
        g = torch.Generator().manual_seed(1000)
        w, frozen = torch.randn(MODEL_NUMEL, generator=g), torch.randn(MODEL_NUMEL, generator=g)
        return {"w": w + step * 1e-3, "frozen": frozen, "b": torch.randn(7, generator=g).to(torch.bfloat16)}
    g = torch.Generator().manual_seed(1000 + step)
    return {"w": torch.randn(MODEL_NUMEL, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16)}


def state(step: int, rank: int) -> dict[str, Any]:
    return {
        "model": model(step),
        "mine": torch.full((1000 + rank,), float(step * 100 + rank)),
        "rng": torch.tensor([rank, step], dtype=torch.int64),
        "step": step,
    }


def template(rank: int) -> dict[str, Any]:
    empty = state(0, rank)
    return {
        "model": {k: torch.zeros_like(v) for k, v in empty["model"].items()},
        "mine": torch.zeros_like(empty["mine"]),
        "rng": torch.zeros_like(empty["rng"]),
        "step": 0,
    }


class KilledMidWrite(FilesystemTier):
    """Rank ``victim``'s tier: SIGKILLs its own process half-way through writing step ``at``."""

    victim_step = -1

    async def write(self, source: Any, staging: str | None = None) -> Any:
        if source.step == self.victim_step:
            assert staging is not None
            tmp = self.root / staging
            tmp.mkdir(exist_ok=True)
            with open(tmp / f"data-r{self.rank:05d}.bin", "wb") as f:
                f.write(b"\1" * 4096)  # half a part, then the process dies
                f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return await super().write(source, staging)


class SlowWrites(FilesystemTier):
    """A filesystem tier of several ranks whose every write takes ``delay_s`` longer (nvme kept busy)."""

    delay_s = 0.0

    async def write(self, source: Any, staging: str | None = None) -> Any:
        await asyncio.sleep(self.delay_s)
        return await super().write(source, staging)


class RecordingTier(FilesystemTier):
    """A filesystem tier of several ranks that records each GroupTier call (name, step) in order; on
    ``fail_rank`` its write of ``fail_step`` raises, as a full disk there would."""

    fail_rank = -1
    fail_step = -1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, int]] = []

    async def write(self, source: Any, staging: str | None = None) -> Any:
        self.calls.append(("write", source.step))
        if self.group is not None and self.group.rank == self.fail_rank and source.step == self.fail_step:
            raise OSError(28, "No space left on device (provoked)")
        return await super().write(source, staging)

    async def seal(self, staged: Any, parts: Any, metadata: Any) -> None:
        self.calls.append(("seal", staged.step))
        await super().seal(staged, parts, metadata)

    async def commit(self, staged: Any) -> Any:
        self.calls.append(("commit", staged.step))
        return await super().commit(staged)

    async def abort(self, staged: Any) -> None:
        self.calls.append(("abort", staged.step))
        await super().abort(staged)

    async def adopt(self, staged: Any, nbytes: int) -> Any:
        self.calls.append(("adopt", staged.step))
        return await super().adopt(staged, nbytes)

    async def forget(self, step: int) -> None:
        self.calls.append(("forget", step))
        await super().forget(step)

    async def delete(self, step: int) -> None:
        self.calls.append(("delete", step))
        await super().delete(step)


def remember_groups() -> list[Any]:
    """The RankGroup each Checkpointer made from now on (a tier_factory needs it for a tier of several ranks)."""
    from tierckpt.ranks import RankGroup

    made: list[Any] = []
    original = RankGroup.discover

    def remember(group: Any, timeout_s: float, **kwargs: Any) -> Any:
        found = original(group, timeout_s, **kwargs)
        made.append(found)
        return found

    RankGroup.discover = staticmethod(remember)  # type: ignore[method-assign]
    return made


def main() -> None:
    scenario, root = sys.argv[1], Path(sys.argv[2])
    if os.environ.get("DUMP_AFTER"):
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["DUMP_AFTER"]), exit=True)
    timeout = float(os.environ.get("TEST_TIMEOUT", "30"))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {"rank": rank, "world": world}
    started = time.monotonic()
    if scenario == "save":
        steps = [int(s) for s in os.environ["STEPS"].split(",")]
        replicated = ["model"] if os.environ.get("REPLICATED") == "1" else []
        with Checkpointer(config(root, timeout)) as ckpt:
            out["ckpt_world"] = ckpt.world_size
            for step in steps:
                handle = ckpt.save_sync(step, state(step, rank), replicated=replicated)
                out.setdefault("committed", []).append(handle.committed_sync("disk", timeout=120))
    elif scenario == "selection":
        # ram -> nvme (every save, each write 0.4 s slower) -> pfs (every_steps 5): pfs must get every
        # version it selects on every rank although nvme is busy with older saves. The loop saves the
        # next pfs step only once pfs is done with the previous one. pfs is the "disk" tier that the
        # restore scenario reads.
        SlowWrites.delay_s = float(os.environ.get("NVME_DELAY", "0.4"))
        groups = remember_groups()
        cfg = {
            "host": {"capacity": "64MiB", "snapshots": 4},
            "tiers": [
                {"name": "ram", "type": "memory", "keep": {"last": 1}},
                {"name": "nvme", "type": "filesystem", "path": str(root / "nvme"), "flush": {"every": 1}, "keep": {"last": 2}},
                {"name": "disk", "type": "filesystem", "path": str(root / "disk"), "flush": {"every_steps": 5}, "keep": {"last": 10}},
            ],
            "distributed": {"timeout": f"{timeout}s"},
        }

        def slow(tier: TierConfig) -> FilesystemTier | None:
            return SlowWrites(tier, groups[-1]) if tier.name == "nvme" else None

        results: dict[int, Any] = {}
        with Checkpointer(cfg, tier_factory=slow) as ckpt:
            pending = None
            for step in range(1, 21):
                ckpt.wait_captured()
                if step % 5 == 0 and pending is not None:
                    results[pending.step] = pending.committed_sync("disk", timeout=120)
                handle = ckpt.save_sync(step, state(step, rank), replicated=["model"])
                if step % 5 == 0:
                    pending = handle
            assert pending is not None
            results[pending.step] = pending.committed_sync("disk", timeout=120)
            out["disk_versions"] = [v.step for v in ckpt.versions() if v.tier == "disk"]
        out["committed"] = {str(k): v for k, v in results.items()}
    elif scenario == "group_calls":
        # The GroupTier steps each role takes, in order: steps 1-3 commit (keep: last 2 deletes step 1
        # after 3), and rank 1's write of step 4 fails, so the leader aborts its part.
        groups = remember_groups()
        RecordingTier.fail_rank, RecordingTier.fail_step = 1, 4
        cfg = {
            "host": {"capacity": "16MiB", "snapshots": 2},
            "tiers": [
                {"name": "ram", "type": "memory", "keep": {"last": 1}},
                {"name": "disk", "type": "filesystem", "path": str(root / "disk"), "keep": {"last": 2}},
            ],
            "distributed": {"timeout": f"{timeout}s"},
        }
        made: list[RecordingTier] = []

        def recording(tier: TierConfig) -> FilesystemTier | None:
            if tier.name != "disk":
                return None
            made.append(RecordingTier(tier, groups[-1]))
            return made[-1]

        ckpt = Checkpointer(cfg, tier_factory=recording)
        out["committed"] = [ckpt.save_sync(step, state(step, rank)).committed_sync("disk", timeout=120) for step in (1, 2, 3)]
        try:
            out["failed"] = ckpt.save_sync(4, state(4, rank)).committed_sync("disk", timeout=120)
        except (FlushError, RankFailureError) as exc:
            out["failed"] = type(exc).__name__
        out["disk_versions"] = [v.step for v in ckpt.versions() if v.tier == "disk"]
        out["calls"] = made[0].calls
        try:
            ckpt.close_sync()
        except (FlushError, RankFailureError):
            pass  # close() raises step 4's failure again: asserted on above
    elif scenario == "node_scope":
        # A node-local tier ({node} in its path) with the ranks on NODES simulated nodes.
        cfg = {
            "host": {"capacity": "16MiB", "snapshots": 2},
            "tiers": [
                {"name": "ram", "type": "memory"},
                {"name": "nvme", "type": "filesystem", "path": str(root / "local-{node}"), "scope": "node"},
            ],
            "distributed": {"timeout": f"{timeout}s", "nodes": int(os.environ["NODES"])},
        }
        try:
            with Checkpointer(cfg) as ckpt:
                out["committed"] = ckpt.save_sync(3, state(3, rank)).committed_sync("nvme", timeout=120)
                out["versions"] = [(v.tier, v.step, v.path) for v in ckpt.versions() if v.tier == "nvme"]
        except ConfigError as exc:
            out["config_error"] = str(exc)
            out["key"] = exc.key
    elif scenario == "relay_unreachable":
        # Rank 3 cannot reach its node's store (as a rank on another host than its node's head would
        # not, with distributed.nodes not matching the hosts): an address nothing answers on, for it alone.
        import datetime

        import tierckpt.ranks.nodestore as nodestore

        if rank == 3:
            nodestore.LOOPBACK, nodestore._CONNECT = "192.0.2.1", datetime.timedelta(seconds=1)  # TEST-NET-1: unroutable
        try:
            Checkpointer(config(root, timeout)).close_sync()
            out["error"] = None
        except ConfigError as exc:
            out["error"] = str(exc)
    elif scenario == "late_follower":
        # The leader decides a step that rank 1 has not saved yet, and rank 1 then captures older,
        # eligible saves first, with two host slots. Those can never be taken (the leader went past
        # them): rank 1 must let them go at once, or they fill its slots and its save of the decided
        # step waits for a slot until the leader gives up on its part.
        groups = remember_groups()
        cfg = {
            "host": {"capacity": "16MiB", "snapshots": 2},
            "tiers": [
                {"name": "ram", "type": "memory", "keep": {"last": 1}},
                # min_interval holds the leader's second flush until close() drains: it decides the
                # newest step it holds then (newest_only), 5, before rank 1 saved 2..5.
                {"name": "disk", "type": "filesystem", "path": str(root / "disk"), "flush": {"every": 1, "min_interval": "1h"}},
            ],
            "distributed": {"timeout": f"{timeout}s"},
        }
        ckpt = Checkpointer(cfg)
        try:
            out["first"] = ckpt.save_sync(1, state(1, rank)).committed_sync("disk", timeout=120)
            if rank == 1:
                decided = asyncio.run(groups[-1].wait_for(["tier/disk/round/2"], 120))
                out["decision_seen"] = decided
            handles = [ckpt.save_sync(step, state(step, rank)) for step in range(2, 6)]
            if rank == 0:
                ckpt.close_sync()  # the drain: the leader decides step 5 now
            out["committed"] = {str(h.step): h.committed_sync("disk", timeout=120) for h in handles if h.step == 5}
        finally:
            ckpt.close_sync()
        out["elapsed_s"] = time.monotonic() - started
    elif scenario == "resave":
        # A step saved twice in a row (Lightning saves a step under its top-k name, then as last.ckpt):
        # every save resolves, the newest one commits on every rank, and its bytes are what is stored.
        # The leader may take the first save before the second arrives, and then flush the step again;
        # rank 1 must write its part of the same save each time, not its newest for both decisions.
        with Checkpointer(config(root, timeout)) as ckpt:
            first = ckpt.save_sync(2, state(2, rank), replicated=["model"])
            again = state(3, rank) | {"step": 2}
            second = ckpt.save_sync(2, again, replicated=["model"])
            out["committed"] = [first.committed_sync("disk", timeout=120), second.committed_sync("disk", timeout=120)]
            restored = ckpt.restore_sync(2, template(rank)).state
            out["bitwise"] = bitwise_equal(restored, again)
    elif scenario == "restore":
        if os.environ.get("RECEIVE_BYTES"):  # replicated chunks sent in several batches, through buffers
            import tierckpt.restore.replicas

            tierckpt.restore.replicas.RECEIVE_BYTES = int(os.environ["RECEIVE_BYTES"])
        with logged_warnings() as logged:
            with Checkpointer(config(root, timeout)) as ckpt:
                into = template(rank)
                try:
                    verify_first = os.environ.get("VERIFY_FIRST") == "1"
                    if os.environ.get("RESTORE_STEP"):  # restore(step): that step or an error, never another
                        restored = ckpt.restore_sync(int(os.environ["RESTORE_STEP"]), into, verify_first=verify_first)
                    else:
                        restored = ckpt.restore_latest_sync(into, verify_first=verify_first)
                except TierckptError as exc:
                    out["error"] = [type(exc).__name__, str(exc), exc.step]
                    restored = None
        out["warnings"] = [m for m in logged if "does not verify" in m]  # the restore's fallbacks
        out["template_untouched"] = bitwise_equal(into, template(rank))
        if restored is None:
            out["step"] = None
        else:
            out["step"] = restored.step
            out["tier"] = restored.tier
            out["read_bytes"] = restored.read_bytes
            out["bitwise"] = bitwise_equal(restored.state, state(restored.step, rank))
            out["template_filled"] = restored.state["mine"] is into["mine"] and bitwise_equal(into["model"], model(restored.step))
    elif scenario == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        weights = distribute_tensor(model(4)["w"], mesh, [Replicate()])
        with Checkpointer(config(root, timeout)) as ckpt:
            assert ckpt.save_sync(4, {"w": weights, "mine": state(4, rank)["mine"]}).committed_sync("disk", timeout=120)
        into = {"w": distribute_tensor(torch.zeros(MODEL_NUMEL), mesh, [Replicate()]), "mine": torch.zeros(1000 + rank)}
        with Checkpointer(config(root, timeout)) as ckpt:
            restored = ckpt.restore_latest_sync(into)
        out["step"] = restored.step
        out["bitwise"] = bitwise_equal(into["w"].to_local(), model(4)["w"]) and bitwise_equal(into["mine"], state(4, rank)["mine"])
    elif scenario == "kill":
        victim, at = int(os.environ["VICTIM"]), int(os.environ["AT"])
        KilledMidWrite.victim_step = at if rank == victim else -1

        def factory(cfg: TierConfig) -> FilesystemTier | None:
            return KilledMidWrite(cfg, ckpt_group[0]) if cfg.type == "filesystem" else None

        ckpt_group = remember_groups()
        ckpt = Checkpointer(config(root, timeout), tier_factory=factory)
        for step in range(1, at):
            assert ckpt.save_sync(step, state(step, rank)).committed_sync("disk", timeout=120)
        # A gate: every rank has the outcome of step at - 1 before the victim starts to write step at.
        # Without it, a loaded machine lets the leader commit step at - 1 and die in step at before
        # a relay passed that outcome on, and the ranks behind it cannot learn it any more.
        dist.barrier()
        handle = ckpt.save_sync(at, state(at, rank))
        t0 = time.monotonic()
        try:
            handle.committed_sync("disk", timeout=10 * timeout)
            out["error"] = None
        except FlushError as exc:
            out["error"] = str(exc)
            out["ranks"] = list(getattr(exc, "ranks", ()))
            out["rank_failure"] = isinstance(exc, RankFailureError)
        out["raised_after_s"] = time.monotonic() - t0
        # Training goes on: the next save returns, and is abandoned in turn.
        later = ckpt.save_sync(at + 1, state(at + 1, rank))
        try:
            out["later"] = later.committed_sync("disk", timeout=10 * timeout)
        except FlushError as exc:
            out["later"] = str(exc)
        try:
            ckpt.close_sync()
        except FlushError as exc:
            out["close"] = str(exc)
    out["elapsed_s"] = time.monotonic() - started
    (root / f"result-{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
