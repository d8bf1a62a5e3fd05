"""One rank of a layout-changing test (tests/test_reshard.py): ``python reshard_worker.py <save|restore> <dir>``.

Started once per rank with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, and:
    MESH        the device mesh shape, "4" or "2x2" ("none": no torch.distributed, plain tensors)
    PLACE       the placements of the sharded values, one per mesh dimension: "S0", "S1", "R", "S0,R", ...
    TEMPLATE    restore: "dtensor" (the default), "plain" (whole tensors: consolidation) or "none"
    CAST        restore: "1" to restore into a bfloat16 template of the float32 weights, with cast=True
    WRONG       restore: "1" to give "w" a template of another global shape (a RestoreError on every rank)
    S3_TIER     a JSON tier section of type object that takes the place of the "disk" tier (named "disk")
Writes what it saw to ``<dir>/result-<rank>.json``: for each key, whether what it holds is bitwise
the right piece of the global tensor.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from tierckpt import Checkpointer, RestoreError
from tierckpt.testing.ranks import end_job
from tierckpt.tiers.stored.source import StoredSource

from helpers import bitwise_equal, ram_fs

STEP = 7
# Global shapes chosen so that no mesh of 2, 3 or 4 divides every dimension (uneven shards), and one
# value is larger than a stored chunk (16 MiB) so a piece spans chunks.
SHAPES = {"w": (13, 10), "emb": (10, 7), "big": (2050, 2100), "norm": (5,)}
DTYPES = {"w": torch.float32, "emb": torch.bfloat16, "big": torch.float32, "norm": torch.float32}


def config(root: Path) -> dict[str, Any]:
    config = ram_fs(root / "disk", name="disk", capacity="128MiB", snapshots=1) | {"distributed": {"timeout": "60s"}}
    if "S3_TIER" in os.environ:
        config["tiers"][1] = json.loads(os.environ["S3_TIER"]) | {"name": "disk"}
    return config


def global_value(key: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, key)))
    return torch.randn(SHAPES[key], generator=g).to(DTYPES[key])


def placements(text: str) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if p == "R" else Shard(int(p[1:])) for p in text.split(",")]


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    mesh_text = os.environ.get("MESH", "none")
    out: dict[str, Any] = {}
    mesh = None
    if mesh_text != "none":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", tuple(int(d) for d in mesh_text.split("x")))
    rank = int(os.environ.get("RANK", "0"))
    place = placements(os.environ.get("PLACE", "S0")) if mesh is not None else []

    def local(key: str, value: torch.Tensor) -> Any:
        from torch.distributed.tensor import distribute_tensor

        if mesh is None or key == "norm":  # norm: replicated everywhere
            return value if mesh is None else distribute_tensor(value, mesh, [placements("R")[0]] * mesh.ndim)
        return distribute_tensor(value, mesh, place)

    # Bytes of each key read from disk: a rank reads only the stored pieces (chunks) it needs.
    read_bytes: dict[str, int] = {}
    original = StoredSource.read_logical

    def counting(self: Any, record: Any, chunk: int, out: memoryview, scratch: memoryview, **how: Any) -> None:
        read_bytes[record.key] = read_bytes.get(record.key, 0) + out.nbytes
        original(self, record, chunk, out, scratch, **how)

    StoredSource.read_logical = counting  # type: ignore[method-assign]
    with Checkpointer(config(root)) as ckpt:
        if mode == "save":
            state = {"model": {k: local(k, global_value(k)) for k in SHAPES}, "rank": torch.tensor([rank]), "step": STEP}
            out["committed"] = ckpt.save_sync(STEP, state).committed_sync("disk", timeout=120)
        else:
            kind, cast = os.environ.get("TEMPLATE", "dtensor"), os.environ.get("CAST") == "1"
            template = None
            if kind != "none":
                model = {}
                for k in SHAPES:
                    dtype = torch.bfloat16 if cast and k == "w" else DTYPES[k]
                    shape = (13, 11) if k == "w" and os.environ.get("WRONG") == "1" else SHAPES[k]
                    zeros = torch.zeros(shape, dtype=dtype)
                    model[k] = zeros if kind == "plain" else local(k, zeros)
                template = {"model": model, "rank": torch.tensor([-1]), "step": 0}
            try:
                restored = ckpt.restore_latest_sync(template, cast=cast)
            except RestoreError as exc:
                out["error"] = str(exc)
                out["untouched"] = not any(bool(v.to_local().any()) for v in template["model"].values())
                restored = None
        if mode != "save" and restored is not None:
            out["step"], out["tier"] = restored.step, restored.tier
            out["rank_value"] = int(restored.state["rank"][0])
            for k in SHAPES:
                got = restored.state["model"][k]
                want = global_value(k)
                if cast and k == "w":
                    want = want.to(torch.bfloat16)
                if template is not None:
                    out[f"{k}_in_place"] = got is template["model"][k]
                if hasattr(got, "to_local"):
                    want = local(k, want).to_local()
                    got = got.to_local()
                out[k] = bitwise_equal(got, want)
            out["read_bytes"] = read_bytes
    (root / f"result-{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
    end_job()  # DTensors on gloo may abort at the interpreter's exit otherwise (pytorch#190489)
