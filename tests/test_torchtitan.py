"""torchtitan through TierckptCheckpointManager: its own classes on CPU with gloo, FSDP2-sharded
DTensors, 2 ranks stopped and resumed on 2 and on 1 rank (tests/titan_worker.py)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from tierckpt.testing.ranks import failures, launch_ranks

from helpers import fs_tier, tier_config

WORKER = Path(__file__).with_name("titan_worker.py")


def _run(root: Path, world: int, stop: int, load: str, tiers: Path, exclude: str = "", interval: int | None = None) -> list[dict[str, Any]]:
    root.mkdir(parents=True, exist_ok=True)
    config = tier_config(fs_tier("nvme", tiers, keep={"last": 10}))
    env = {"TIERS": json.dumps(config), "EXCLUDE": exclude} | ({} if interval is None else {"INTERVAL": str(interval)})
    exits = launch_ranks([sys.executable, str(WORKER), str(root), str(stop), load], world, env=env, timeout_s=240)
    failed = failures(exits)
    assert not failed, failed
    return [json.loads((root / f"result-{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("titan")
    whole = _run(base / "whole", 2, 12, "none", base / "whole-nvme")
    first = _run(base / "first", 2, 8, "none", base / "nvme")
    return {"base": base, "whole": whole, "first": first}


@pytest.mark.slow
def test_a_run_resumed_on_the_same_mesh_continues_bitwise(runs: dict[str, Any]) -> None:
    base, whole, first = runs["base"], runs["whole"], runs["first"]
    assert sorted(p.name for p in (base / "nvme").iterdir()) == ["step-000000000004", "step-000000000008"]
    for w, f in zip(whole, first):
        assert f["losses"] == {s: w["losses"][s] for s in map(str, range(1, 9))}
    resumed = _run(base / "resumed", 2, 12, "-1", base / "nvme")
    for w, r in zip(whole, resumed):
        assert (r["loaded"], r["start"]) == (True, 8)
        # model, AdamW moments, LR schedule, each rank's data position: the same losses and weights, bitwise
        assert r["losses"] == {s: w["losses"][s] for s in map(str, range(9, 13))}
        assert r["end_params"] == w["end_params"]
    assert (base / "nvme" / "step-000000000012").is_dir()  # the last step, saved whole (last_save_model_only=False)


@pytest.mark.slow
def test_load_of_a_step_and_a_reshard_onto_one_rank(runs: dict[str, Any]) -> None:
    base, first = runs["base"], runs["first"]
    # Step 4 on 2 ranks: its parameters are the 4-step run's, and training goes on from step 5.
    shutil.copytree(base / "nvme", base / "nvme-at4")  # its own copy: it saves step 8 again
    at4 = _run(base / "at4", 2, 8, "4", base / "nvme-at4")
    for f, r in zip(first, at4):
        assert (r["loaded"], r["start"]) == (True, 4)
        assert r["losses"] == {s: f["losses"][s] for s in map(str, range(5, 9))}
        assert r["end_params"] == f["end_params"]
    # Step 8 on 1 rank (another mesh: FSDP2 over 1): the shards of 2 ranks come back as the whole
    # parameters; the data-parallel dataloader state is left out (torchtitan cannot reshard it).
    one = _run(base / "one", 1, 8, "8", base / "nvme", exclude="dataloader")
    assert (one[0]["loaded"], one[0]["start"]) == (True, 8)
    assert one[0]["start_params"] == first[0]["end_params"]


@pytest.mark.slow
def test_after_a_rollback_the_latest_step_is_the_new_directions(runs: dict[str, Any]) -> None:
    """torchtitan's load(-1) after going back: the new direction's step 6, not the abandoned 8."""
    base = runs["base"]
    shutil.copytree(base / "nvme", base / "nvme-rollback")  # 4 and 8, of its own
    back = _run(base / "back", 2, 6, "4", base / "nvme-rollback", interval=2)  # back to 4, saving 6
    again = _run(base / "again", 2, 8, "-1", base / "nvme-rollback")
    for b, a in zip(back, again):
        assert (a["loaded"], a["start"]) == (True, 6)
        assert a["start_params"] == b["end_params"]
        assert a["losses"].keys() == {"7", "8"}
