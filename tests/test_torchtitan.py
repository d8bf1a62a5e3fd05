"""torchtitan through TierckptCheckpointManager: its own classes on CPU with gloo, FSDP2-sharded
DTensors, 2 ranks stopped and resumed on 2 and on 1 rank (tests/titan_worker.py)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

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


def _one_process(tiers: Path) -> tuple[Any, Any, Any, Any, Any]:
    """The worker's model, optimizers, LR schedulers, dataloader and train state in this process, with
    no process group and no FSDP, and a manager saving every 2 steps to ``tiers``."""
    from torch import nn
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    from tierckpt.integrations.torchtitan import TierckptCheckpointManager
    from titan_worker import TOTAL, Samples, TrainState

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    group = ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})
    optimizers = OptimizersContainer(OptimizersContainer.Config(param_groups=[group], implementation="for-loop"), model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=TOTAL)
    dataloader = ParallelAwareDataloader(Samples(0), dp_rank=0, dp_world_size=1, batch_size=4)
    state = TrainState()
    manager = TierckptCheckpointManager(
        TierckptCheckpointManager.Config(enable=True, interval=2, tiers_inline=tier_config(fs_tier("nvme", tiers)), last_save_model_only=False),
        dataloader=dataloader, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers, states={"train_state": state},
    )
    return model, optimizers, schedulers, dataloader, (state, manager)


def _train(parts: tuple[Any, Any, Any, Any, Any], steps: range, save_until: int = 0) -> list[float]:
    """Train ``steps`` as the worker does, the lazy barrier where torchtitan's trainer has it, saving
    the steps up to ``save_until``; the losses."""
    from torch import nn

    model, optimizers, schedulers, dataloader, (state, manager) = parts
    losses, batches = [], iter(dataloader)
    for step in steps:
        x, y = next(batches)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        manager.maybe_wait_for_staging()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        state.step = step
        losses.append(loss.item())
        if step <= save_until:
            manager.save(step)
    return losses


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated", "ignore:To get the last learning rate computed by the scheduler")
def test_one_process_saves_on_its_interval_and_a_new_manager_resumes_the_newest_step_bitwise(tmp_path: Path) -> None:
    """The manager in one process, without ranks (the quick subset's torchtitan test): it saves every
    2 steps, and a new manager's load(-1) brings back the model, AdamW's moments, the LR schedule and
    the data position of step 4: steps 5 and 6 give the uninterrupted run's losses, bitwise."""
    first = _one_process(tmp_path / "nvme")
    whole = _train(first, range(1, 7), save_until=4)
    first[4][1].close()
    assert sorted(p.name for p in (tmp_path / "nvme").iterdir()) == ["step-000000000002", "step-000000000004"]

    again = _one_process(tmp_path / "nvme")
    state, manager = again[4]
    try:
        assert manager.load(-1) is True and state.step == 4
        assert _train(again, range(5, 7)) == whole[4:]
    finally:
        manager.close()
