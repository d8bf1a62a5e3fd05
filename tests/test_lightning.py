"""Lightning through TierckptCheckpointIO: a real lightning.Trainer on CPU, stopped and resumed; and
DDP jobs of 2 ranks (gloo on 127.0.0.1, tests/lightning_worker.py), SIGKILLed on every rank and resumed."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from tierckpt import Checkpointer, ConfigError, CorruptCheckpointError, NoCheckpointError, UnsupportedStateError
from tierckpt.integrations import lightning as tierckpt_lightning
from tierckpt.integrations.lightning import TierckptCheckpointIO
from tierckpt.testing.copies import HeldCopies
from tierckpt.testing.inspect import opened_checkpointer
from tierckpt.testing.ranks import failures, launch_ranks

from helpers import assert_bitwise, assert_overlapped, clone, fs_tier, in_barrier, tier_config, until
from lightning_worker import BATCHES, EVERY, Tiny

WORKER = Path(__file__).with_name("lightning_worker.py")

# Lightning's own warnings about this torch and this tiny setup (pytest turns warnings into errors).
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),
]


def _trainer(root: Path, max_steps: int, plugin: TierckptCheckpointIO | None, **checkpointing: Any) -> L.Trainer:
    callbacks = [ModelCheckpoint(dirpath=root / "ckpts", **checkpointing)] if checkpointing else []
    return L.Trainer(
        max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root, plugins=[plugin] if plugin else None,
        callbacks=callbacks, enable_checkpointing=bool(checkpointing),
    )


def _losses(root: Path, max_steps: int, plugin: TierckptCheckpointIO | None = None, ckpt_path: Any = None, **checkpointing: Any) -> dict[int, float]:
    L.seed_everything(0, verbose=False)
    model = Tiny()
    _trainer(root, max_steps, plugin, **checkpointing).fit(model, ckpt_path=ckpt_path)
    return model.losses


@pytest.fixture
def config(tmp_path: Path) -> dict[str, Any]:
    return tier_config(fs_tier("nvme", tmp_path / "nvme", keep={"last": 10}))


def test_a_stopped_run_resumed_from_last_or_any_checkpoint_matches_an_uninterrupted_one(tmp_path: Path, config: dict[str, Any]) -> None:
    whole = _losses(tmp_path / "whole", 4 * BATCHES)
    assert sorted(whole) == list(range(4 * BATCHES))

    run = tmp_path / "run"
    first = _losses(run, 2 * BATCHES, TierckptCheckpointIO(config), every_n_train_steps=BATCHES, save_top_k=-1, save_last=True)
    assert first == {s: whole[s] for s in range(2 * BATCHES)}
    saved = sorted(os.listdir(run / "ckpts"))
    assert saved == ["epoch=0-step=8.ckpt", "epoch=1-step=16.ckpt", "last.ckpt"], saved
    # Each path is a small JSON pointer naming a step the tier holds (teardown at the end of fit waited
    # for durability): no torch.save file anywhere.
    pointers = {name: json.loads((run / "ckpts" / name).read_text()) for name in saved}
    assert {name: (p["step"], p["tier"]) for name, p in pointers.items()} == {
        "epoch=0-step=8.ckpt": (8, "nvme"), "epoch=1-step=16.ckpt": (16, "nvme"), "last.ckpt": (16, "nvme")}
    assert sorted(os.listdir(tmp_path / "nvme")) == ["step-000000000008", "step-000000000016"]

    resumed = _losses(run, 4 * BATCHES, TierckptCheckpointIO(config), ckpt_path="last", every_n_train_steps=BATCHES, save_top_k=-1, save_last=True)
    assert resumed == {s: whole[s] for s in range(2 * BATCHES, 4 * BATCHES)}  # bitwise the same losses

    again = _losses(run, 4 * BATCHES, TierckptCheckpointIO(config), ckpt_path=run / "ckpts" / "epoch=0-step=8.ckpt",
                    every_n_train_steps=BATCHES, save_top_k=-1, save_last=True)
    assert again == {s: whole[s] for s in range(BATCHES, 4 * BATCHES)}


class _OtherData(Tiny):
    """Other targets: the direction a rollback past a bad shard trains on."""

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(self.hparams.batches * 8, 4, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True) - 1.0), batch_size=8)


class _KilledBeforeLast(TierckptCheckpointIO):
    """Leaves out the save of last.ckpt at step ``2 * BATCHES``: what a job killed after the step's
    top-k file was durable and written, before its last.ckpt was, leaves (Lightning saves the top-k
    file first)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if Path(path).name != "last.ckpt" or checkpoint.get("global_step") != 2 * BATCHES:
            super().save_checkpoint(checkpoint, path, storage_options)


class _WeightsAtStart(Callback):
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.weights = clone(pl_module.state_dict())


@pytest.mark.parametrize("killed", [False, True], ids=["whole", "killed-before-last"])
def test_after_a_rollback_last_resumes_the_new_direction(tmp_path: Path, killed: bool) -> None:
    """Steps 8, 16, 24 saved (last.ckpt: 24), then a rollback: fit(ckpt_path= step 8's file) on other
    data to step 16. ckpt_path="last" then resumes the new direction's step 16, its weights those
    saved, not the abandoned 24, also when the job was killed before its own last.ckpt was written:
    the top-k file's save, once durable, rewrote last.ckpt (which named the abandoned 24) to name
    16. The abandoned direction's top-k file still names its step 24."""
    config = tier_config(fs_tier("nvme", tmp_path / "nvme", keep={"last": 10}, flush={"newest_only": False}))  # every save goes down
    run = tmp_path / "run"
    checkpointing: dict[str, Any] = {"every_n_train_steps": BATCHES, "save_top_k": -1, "save_last": True}
    _losses(run, 3 * BATCHES, TierckptCheckpointIO(config), **checkpointing)
    L.seed_everything(0, verbose=False)
    back = _OtherData()
    plugin = _KilledBeforeLast(config) if killed else TierckptCheckpointIO(config)
    _trainer(run, 2 * BATCHES, plugin, **checkpointing).fit(back, ckpt_path=run / "ckpts" / "epoch=0-step=8.ckpt")
    assert sorted(back.losses) == list(range(BATCHES, 2 * BATCHES))
    pointers = {p.name: json.loads(p.read_text())["step"] for p in (run / "ckpts").iterdir()}
    assert pointers["last.ckpt"] == 2 * BATCHES and pointers["epoch=2-step=24.ckpt"] == 3 * BATCHES, pointers
    with Checkpointer(config) as ckpt:
        assert {v.step: v.abandoned for v in ckpt.versions() if v.tier == "nvme"} == {8: False, 16: False, 24: True}

    L.seed_everything(0, verbose=False)
    resumed, start = _OtherData(), _WeightsAtStart()
    trainer = _trainer(run, 3 * BATCHES, TierckptCheckpointIO(config), **checkpointing)
    trainer.callbacks.append(start)
    trainer.fit(resumed, ckpt_path="last")
    assert sorted(resumed.losses) == list(range(2 * BATCHES, 3 * BATCHES))  # from step 16, not from the abandoned 24
    assert_bitwise(start.weights, back.state_dict())  # the new direction's step 16


def test_the_stored_checkpoint_holds_what_lightning_put_in_it(tmp_path: Path, config: dict[str, Any]) -> None:
    plugin = TierckptCheckpointIO(config)
    _losses(tmp_path, BATCHES, plugin, every_n_train_steps=BATCHES)
    loaded = plugin.load_checkpoint(tmp_path / "ckpts" / "epoch=0-step=8.ckpt")
    assert loaded["global_step"] == 8 and loaded["epoch"] == 0
    assert loaded["hyper_parameters"] == {"hidden": 16, "lr": 0.05, "extra": None, "batches": BATCHES}
    assert set(loaded["state_dict"]) == {"net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"}
    assert loaded["optimizer_states"][0]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert loaded["lr_schedulers"][0]["last_epoch"] == 8
    assert any(key.startswith("ModelCheckpoint") for key in loaded["callbacks"])
    plugin.teardown()


class _HeldAtSave(TierckptCheckpointIO):
    """A lazy plugin that holds the copy threads through its save of step ``EVERY``. A watcher waits
    until the training thread parks in the lazy barrier, notes what ran and what changed by then, and
    releases the copy."""

    def __init__(self, config: dict[str, Any], model: Tiny) -> None:
        super().__init__(config, lazy=True)
        self.model, self.forwards = model, 0
        self.seen: dict[str, Any] = {}
        self.watcher: threading.Thread | None = None
        model.net.register_forward_pre_hook(lambda *_: setattr(self, "forwards", self.forwards + 1))

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if checkpoint.get("global_step") != EVERY:
            return super().save_checkpoint(checkpoint, path, storage_options)
        self.at_save = clone(checkpoint["state_dict"])
        self.moments_at_save = clone(checkpoint["optimizer_states"][0]["state"])
        forwards_at_save, main = self.forwards, threading.current_thread()
        held = HeldCopies(self.checkpointer, deadline_s=60)
        super().save_checkpoint(checkpoint, path, storage_options)
        self.seen["returned_before_the_copy"] = self.checkpointer.wait_captured(timeout=0) is False

        def watch() -> None:
            self.seen["parked"] = until(lambda: in_barrier(main), 60)
            self.seen["forwards_by_then"] = self.forwards - forwards_at_save
            self.seen["weights_by_then"] = clone(self.model.state_dict())
            held.release()

        self.watcher = threading.Thread(target=watch)
        self.watcher.start()


def test_a_lazy_save_returns_before_its_copy_and_only_the_optimizer_step_waits(tmp_path: Path, config: dict[str, Any]) -> None:
    """``lazy=True``: the save of step 8 returns with its copy held; step 9's forward and backward run;
    its optimizer step parks until the copy is released, the weights still those saved. The stored
    step 8 is the state at its save, and the run's losses are those of a run whose saves waited."""
    steps = EVERY + 4
    eager = _losses(tmp_path / "eager", steps, TierckptCheckpointIO(tier_config(fs_tier("nvme", tmp_path / "eager-nvme"))), every_n_train_steps=EVERY)
    L.seed_everything(0, verbose=False)
    model = Tiny()
    plugin = _HeldAtSave(config, model)
    _trainer(tmp_path / "run", steps, plugin, every_n_train_steps=EVERY).fit(model)
    assert plugin.watcher is not None
    plugin.watcher.join(60)
    assert_overlapped(plugin.seen, plugin.at_save)
    assert model.losses == eager  # bitwise: nothing of the state changed under the copy
    with Checkpointer(config) as ckpt:
        stored = ckpt.restore_sync(EVERY).state
    assert_bitwise(stored["state_dict"], plugin.at_save)
    assert_bitwise(stored["optimizer_states"][0]["state"], plugin.moments_at_save)


def test_hyperparameters_that_need_pickle_are_an_error_naming_the_key(tmp_path: Path, config: dict[str, Any]) -> None:
    L.seed_everything(0, verbose=False)
    model = Tiny(extra={"a", "b"})  # picklable (Lightning keeps it), but not storable without pickle
    plugin = TierckptCheckpointIO(config)
    with pytest.raises(UnsupportedStateError, match=r"hyper_parameters.*extra.*save_hyperparameters\(ignore=") as caught:
        _trainer(tmp_path, BATCHES, plugin, every_n_train_steps=BATCHES).fit(model)
    assert "extra" in (caught.value.key or "")
    plugin.teardown()


def test_top_k_removes_pointers_and_the_tiers_retention_keeps_the_steps(tmp_path: Path, config: dict[str, Any]) -> None:
    _losses(tmp_path, 2 * BATCHES, TierckptCheckpointIO(config), every_n_train_steps=4, save_top_k=1)
    assert sorted(os.listdir(tmp_path / "ckpts")) == ["epoch=1-step=16.ckpt"]  # ModelCheckpoint removed the others
    with Checkpointer(config) as ckpt:
        # The steps the tier took (a busy tier may pass over one whose successor is already waiting)
        # are all still there: removing a pointer deletes nothing, retention (last 10) decides.
        steps = [v.step for v in ckpt.versions() if v.tier == "nvme"]
    assert steps[-1] == 16 and len(steps) >= 2 and set(steps) <= {4, 8, 12, 16}, steps


def test_paths_that_are_not_pointers_are_clear_errors(tmp_path: Path, config: dict[str, Any]) -> None:
    plugin = TierckptCheckpointIO(config)
    with pytest.raises(NoCheckpointError, match="no such checkpoint"):
        plugin.load_checkpoint(tmp_path / "missing.ckpt")
    (tmp_path / "other.ckpt").write_bytes(b"\x80\x04not a pointer")
    with pytest.raises(CorruptCheckpointError, match="not a checkpoint written through tierckpt"):
        plugin.load_checkpoint(tmp_path / "other.ckpt")
    (tmp_path / "gone.ckpt").write_text(json.dumps({"format": "tierckpt-pointer", "version": 1, "step": 7, "tier": "nvme"}))
    with pytest.raises(NoCheckpointError, match=r"no tier holds step 7 \(ram: none; nvme: none\)"):
        plugin.load_checkpoint(tmp_path / "gone.ckpt")
    plugin.teardown()


def test_a_checkpoint_whose_step_is_damaged_names_the_path_and_the_steps_left_and_an_earlier_one_resumes(tmp_path: Path, config: dict[str, Any]) -> None:
    """The step last.ckpt names lost its data file: resuming from it fails naming the path, the step,
    the file and the steps the tiers still hold, never quietly loading another step; ckpt_path= the
    earlier checkpoint resumes."""
    whole = _losses(tmp_path / "whole", 2 * BATCHES)
    _losses(tmp_path, 2 * BATCHES, TierckptCheckpointIO(config), every_n_train_steps=BATCHES, save_last=True, save_top_k=-1)
    (tmp_path / "nvme" / "step-000000000016" / "data-r00000.bin").unlink()
    last = tmp_path / "ckpts" / "last.ckpt"
    plugin = TierckptCheckpointIO(config)  # a new job: its RAM tier holds nothing
    with pytest.raises(CorruptCheckpointError) as caught:
        _losses(tmp_path, 3 * BATCHES, plugin, ckpt_path=last, every_n_train_steps=BATCHES)
    message = str(caught.value)
    assert message.startswith(f"{last} names step 16, which cannot be restored:"), message
    assert "data-r00000.bin is missing" in message and "the tiers also hold step(s) 8: pass ckpt_path=" in message, message
    plugin.teardown()
    resumed = _losses(tmp_path, 2 * BATCHES, TierckptCheckpointIO(config), ckpt_path=tmp_path / "ckpts" / "epoch=0-step=8.ckpt", every_n_train_steps=BATCHES)
    assert resumed == {s: whole[s] for s in range(BATCHES, 2 * BATCHES)}  # bitwise


def test_a_torch_save_checkpoint_loads_as_lightning_loads_it_without_running_code(tmp_path: Path, config: dict[str, Any]) -> None:
    """ddp_spawn hands the weights back to the main process through the plugin; a checkpoint written
    before switching to tierckpt loads too. Both through torch.load(weights_only=True)."""
    plugin = TierckptCheckpointIO(config)
    weights = {"w": torch.arange(4.0)}
    plugin.save_checkpoint(weights, tmp_path / "handoff.ckpt")  # no global_step: not a training checkpoint
    assert torch.equal(plugin.load_checkpoint(tmp_path / "handoff.ckpt")["w"], weights["w"])

    class Runs:  # any class: the restricted unpickler refuses it
        def __reduce__(self) -> Any:
            return (print, ("ran",))

    torch.save({"state_dict": {}, "x": Runs()}, tmp_path / "code.ckpt")
    with pytest.raises(Exception, match="Weights only load failed"):
        plugin.load_checkpoint(tmp_path / "code.ckpt")
    plugin.teardown()


def test_a_strategy_with_a_format_of_its_own_is_refused_on_every_rank_with_what_to_use(config: dict[str, Any]) -> None:
    """DeepSpeed's strategy (which needs the deepspeed package to be made) and any strategy that
    writes its own files, as this DDPStrategy does, are refused; so is ModelParallelStrategy gathering
    whole states on rank 0."""
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies import DDPStrategy

    class OwnFiles(DDPStrategy):
        def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
            raise AssertionError("never called")

    env = LightningEnvironment()
    env.set_world_size(2)
    with pytest.raises(ConfigError, match=r"OwnFiles saves sharded states in a format of its own.*Use FSDPStrategy or ModelParallelStrategy"):
        TierckptCheckpointIO(config).attach(OwnFiles(cluster_environment=env))
    from lightning.pytorch.strategies import ModelParallelStrategy

    with pytest.raises(ConfigError, match=r"leave save_distributed_checkpoint=True"):
        TierckptCheckpointIO(config).attach(ModelParallelStrategy(save_distributed_checkpoint=False))


def test_several_processes_without_the_callback_is_an_error_saying_how_to_add_it(config: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning called the plugin on rank 0 only (tierckpt on PYTHONPATH, no entry point): rank 0
    must not open a Checkpointer that the other ranks never join."""
    monkeypatch.setattr(tierckpt_lightning, "_world_size", lambda: 2)  # a job of 2 processes, seen from rank 0
    plugin = TierckptCheckpointIO(config)
    with pytest.raises(ConfigError, match=r"callbacks=\[tierckpt.integrations.lightning_ranks.EveryRankSaves\(\)\]"):
        plugin.save_checkpoint({"global_step": 4, "state_dict": {}}, "step=4.ckpt")
    assert opened_checkpointer(plugin) is None


# -- DDP: 2 ranks -----------------------------------------------------------------------------------------

STEPS = 3 * EVERY


def _job(root: Path, strategy: str = "ddp", kill_at: int = 0, ckpt_path: str = "none", hidden: int = 16, devices: int = 2,
         steps: int = STEPS, env: dict[str, str] | None = None, flush: dict[str, Any] | None = None) -> None:
    """A Lightning job of ``steps`` steps writing ``result-<rank>.json``, its tiers in ``root`` (ddp,
    fsdp: started as torchrun starts ranks; ddp_spawn: one process, Lightning starts the workers)."""
    root.mkdir(parents=True, exist_ok=True)
    nvme = fs_tier("nvme", root / "nvme", keep={"last": 10}) | ({"flush": flush} if flush else {})
    # With a flush held back, the last save's step is saved twice (its file and last.ckpt) beside it: a third host slot.
    (root / "config.json").write_text(json.dumps(tier_config(nvme, snapshots=3 if flush else 2)))
    argv = [sys.executable, str(WORKER), str(root), str(root / "config.json"), str(steps), strategy, str(kill_at), ckpt_path]
    env = {"HIDDEN": str(hidden), "DEVICES": str(devices)} | (env or {})
    if strategy == "ddp_spawn":
        child = subprocess.run(argv, env=os.environ | env | {"OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=240)
        assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-3000:]
    else:
        exits = launch_ranks(argv, devices, env=env, timeout_s=240)
        failed = failures(exits, expect_dead=tuple(range(devices)) if kill_at else ())
        assert not failed, failed


def _result(root: Path, rank: int | str) -> dict[str, Any]:
    return json.loads((root / f"result-{rank}.json").read_text())


def _pointers(root: Path) -> dict[str, int]:
    """The pointers in ``root/ckpts``; not a writer's temporary file, which a SIGKILL may leave empty."""
    return {p.name: json.loads(p.read_text())["step"] for p in (root / "ckpts").iterdir() if not p.name.startswith(".")}


def _killed_then_resumed(tmp_path: Path, whole: Path, strategy: str, hidden: int, env: dict[str, str] | None = None) -> None:
    """Every rank SIGKILLed right after the save of step 16 returned (captured, or with ``LAZY`` maybe
    not yet; durable or not): each pointer names a step committed on every rank, and the newest
    pointer (last.ckpt, unless the kill came before it was updated) resumes every rank, bitwise."""
    _job(tmp_path, strategy, kill_at=2 * EVERY, hidden=hidden, env=env)
    with Checkpointer(tier_config(fs_tier("nvme", tmp_path / "nvme", keep={"last": 10}))) as ckpt:
        durable = sorted(v.step for v in ckpt.versions() if v.tier == "nvme")
    assert durable in ([], [8], [8, 16]), durable  # [] only on a machine slow enough that step 8 was not durable yet
    pointers = _pointers(tmp_path) if (tmp_path / "ckpts").exists() else {}
    assert set(pointers.values()) <= set(durable), (pointers, durable)  # none ahead of what every rank committed
    if not pointers:
        pytest.skip("no pointer was written before the kill on this machine")
    # last.ckpt may still name the step before (its save of step 16 came second): resume from the newest.
    newest = max(pointers, key=lambda name: (pointers[name], name == "last.ckpt"))
    _job(tmp_path, strategy, ckpt_path="last" if newest == "last.ckpt" else str(tmp_path / "ckpts" / newest), hidden=hidden, env=env)
    want, r0, r1 = _result(whole, 0), _result(tmp_path, 0), _result(tmp_path, 1)
    assert r0["losses"] == {str(s): want["losses"][str(s)] for s in range(pointers[newest], STEPS)}  # bitwise
    assert r0["weights"] == r1["weights"] == want["weights"]


@pytest.fixture(scope="module")
def whole_ddp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ddp-whole")
    _job(root, hidden=4096)
    return root


@pytest.mark.slow
def test_ddp_saves_on_every_rank_and_stores_the_replicated_state_once(whole_ddp: Path) -> None:
    r0, r1 = _result(whole_ddp, 0), _result(whole_ddp, 1)
    assert sorted(map(int, r0["losses"])) == list(range(STEPS)) and r0["losses"] != r1["losses"]  # each rank its own batches
    assert r0["weights"] == r1["weights"]
    assert _pointers(whole_ddp) == {"epoch=0-step=8.ckpt": 8, "epoch=1-step=16.ckpt": 16, "epoch=2-step=24.ckpt": 24, "last.ckpt": 24}
    version = whole_ddp / "nvme" / "step-000000000024"
    parts = {p.name: p.stat().st_size for p in version.glob("data-r*.bin")}
    # Model + Adam's two moments, 4096 wide: 3 x 24,577 floats. Each rank writes its share, not a copy.
    one_copy = 3 * (4 * 4096 + 4096 + 4096 + 1) * 4
    assert set(parts) == {"data-r00000.bin", "data-r00001.bin"} and min(parts.values()) > 0, parts
    assert sum(parts.values()) < 1.6 * one_copy, (parts, one_copy)


@pytest.mark.slow
def test_ddp_killed_on_every_rank_after_a_save_resumes_bitwise(tmp_path: Path, whole_ddp: Path) -> None:
    _killed_then_resumed(tmp_path, whole_ddp, "ddp", hidden=4096)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_lazy_saves_killed_on_every_rank_resume_bitwise(request: pytest.FixtureRequest, tmp_path: Path, strategy: str) -> None:
    """``lazy=True`` under DDP and FSDP2: the updates wait for the copies on every rank, so the job's
    losses and weights are bitwise those of eager saves, and a kill right after a save resumes bitwise."""
    whole = request.getfixturevalue(f"whole_{strategy}")
    hidden = 4096 if strategy == "ddp" else 64
    lazy = tmp_path / "whole"
    _job(lazy, strategy, hidden=hidden, env={"LAZY": "1"})
    assert _result(lazy, 0) == _result(whole, 0) and _result(lazy, 1) == _result(whole, 1)
    _killed_then_resumed(tmp_path / "killed", whole, strategy, hidden, env={"LAZY": "1"})


@pytest.mark.slow
def test_ddp_spawn_saves_through_the_plugin_and_hands_the_weights_back(tmp_path: Path, whole_ddp: Path) -> None:
    _job(tmp_path, strategy="ddp_spawn", hidden=4096)
    assert _pointers(tmp_path) == {"epoch=0-step=8.ckpt": 8, "epoch=1-step=16.ckpt": 16, "epoch=2-step=24.ckpt": 24, "last.ckpt": 24}
    assert {p.name for p in (tmp_path / "nvme" / "step-000000000024").glob("data-r*.bin")} == {"data-r00000.bin", "data-r00001.bin"}
    assert _result(tmp_path, "main")["weights"] == _result(whole_ddp, 0)["weights"]  # the workers' weights, back in the main process


# -- ModelParallelStrategy (FSDP2) and FSDPStrategy (FSDP1): 2 ranks, onto 1, and one into the other ------
# FSDPStrategy runs on CPU through tierckpt.testing.lightning_cpu.CpuFSDPStrategy (Lightning runs it on GPUs only); on
# a GPU machine, test_fsdp1_on_cuda_resumes_from_its_shards runs the strategy itself.


def test_the_cpu_fsdp_strategy_is_accepted_on_cpu_where_lightning_refuses_its_own() -> None:
    """What tierckpt.testing.lightning_cpu is for, in this process (the FSDP1 jobs below are slow)."""
    from lightning.pytorch.strategies import FSDPStrategy

    from tierckpt.testing.lightning_cpu import CpuFSDPStrategy

    quiet = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}
    with pytest.raises(ValueError, match="requires a GPU accelerator"):
        L.Trainer(accelerator="cpu", strategy=FSDPStrategy(), devices=1, **quiet)
    trainer = L.Trainer(accelerator="cpu", strategy=CpuFSDPStrategy(), devices=1, **quiet)
    assert type(trainer.strategy) is CpuFSDPStrategy and trainer.strategy.root_device == torch.device("cpu")


def _whole_job(factory: pytest.TempPathFactory, strategy: str) -> Path:
    root = factory.mktemp(f"{strategy}-whole")
    _job(root, strategy, hidden=64)
    return root


@pytest.fixture(scope="module")
def whole_fsdp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _whole_job(tmp_path_factory, "fsdp")


@pytest.fixture(scope="module")
def whole_fsdp1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _whole_job(tmp_path_factory, "fsdp1")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "fsdp1"])
def test_fsdp_each_rank_stores_its_shards_by_parameter_name(request: pytest.FixtureRequest, strategy: str) -> None:
    """ModelParallelStrategy (FSDP2) and FSDPStrategy (FSDP1, its ShardedTensors as DTensor pieces): 2
    ranks, each writing its rows of every tensor, stored under torch's names (not FSDP1's flat parameters)."""
    whole = request.getfixturevalue(f"whole_{strategy}")
    r0, r1 = _result(whole, 0), _result(whole, 1)
    assert sorted(map(int, r0["losses"])) == list(range(STEPS)) and r0["weights"] == r1["weights"]
    assert _pointers(whole) == {"epoch=0-step=8.ckpt": 8, "epoch=1-step=16.ckpt": 16, "epoch=2-step=24.ckpt": 24, "last.ckpt": 24}
    with Checkpointer(tier_config(fs_tier("nvme", whole / "nvme", keep={"last": 10}))) as ckpt:
        stored = ckpt.restore_sync(24).state  # one process: every piece consolidated whole
    assert {k: v.tolist() for k, v in stored["state_dict"].items()} == json.loads((whole / "weights-24.json").read_text())
    assert stored["optimizer_states"][0]["state"]["net.0.weight"]["exp_avg"].shape == (64, 4)
    data = list((whole / "nvme" / "step-000000000024").glob("data-r*.bin"))
    assert len(data) == 2 and all(p.stat().st_size > 0 for p in data)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "fsdp1"])
def test_fsdp_a_job_that_ends_right_after_fit_has_every_checkpoint_durable_and_its_pointer(tmp_path: Path, strategy: str) -> None:
    """ModelParallelStrategy's and FSDPStrategy's teardown() skip their checkpoint I/O's (DDP's calls
    it): the plugin runs its own from theirs, so fit() returns with every save durable and its pointer
    written (before, the last ones came only at the interpreter's exit), and without waiting out a
    tier's min_interval (before, every trainer's teardown did)."""
    # Step 16's flush is held back an hour after step 8's: the teardown must wait for it, and make it
    # happen now (wait() waives min_interval), or the job would not end in _job's 240 s.
    _job(tmp_path, strategy, hidden=64, steps=2 * EVERY, env={"EXIT_AFTER_FIT": "1"}, flush={"min_interval": "1h"})
    assert json.loads((tmp_path / "after-fit.json").read_text()) == ["epoch=0-step=8.ckpt", "epoch=1-step=16.ckpt", "last.ckpt"]
    assert _pointers(tmp_path) == {"epoch=0-step=8.ckpt": 8, "epoch=1-step=16.ckpt": 16, "last.ckpt": 16}
    with Checkpointer(tier_config(fs_tier("nvme", tmp_path / "nvme", keep={"last": 10}))) as ckpt:
        assert sorted(v.step for v in ckpt.versions() if v.tier == "nvme") == [8, 16]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "fsdp1"])
def test_fsdp_killed_on_every_rank_after_a_save_resumes_bitwise(request: pytest.FixtureRequest, tmp_path: Path, strategy: str) -> None:
    _killed_then_resumed(tmp_path, request.getfixturevalue(f"whole_{strategy}"), strategy, hidden=64)


@pytest.mark.slow
def test_fsdp2_saved_on_two_ranks_loads_resharded_onto_one(tmp_path: Path, whole_fsdp: Path) -> None:
    """The 2-rank job's step 16, loaded by a job of 1 rank (ModelParallelStrategy, devices=1): the
    live model is the template, each of its tensors read from both ranks' shards. The job stops
    where it starts (max_steps 16), so its weights are the loaded ones."""
    shutil.copytree(whole_fsdp / "nvme", tmp_path / "nvme")
    _job(tmp_path, "fsdp", ckpt_path=str(whole_fsdp / "ckpts" / "epoch=1-step=16.ckpt"), hidden=64, devices=1, steps=2 * EVERY)
    assert _result(tmp_path, 0)["weights"] == json.loads((whole_fsdp / "weights-16.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("saved_by", ["fsdp1", "fsdp"])
def test_fsdp1_loads_a_two_rank_checkpoint_of_either_fsdp_resharded_onto_one(tmp_path: Path, whole_fsdp1: Path, whole_fsdp: Path, saved_by: str) -> None:
    """Step 16 of the 2-rank FSDP1 job, and of the 2-rank FSDP2 job, loaded by an FSDPStrategy job of
    1 rank that stops where it starts: its weights are the loaded ones."""
    whole = whole_fsdp1 if saved_by == "fsdp1" else whole_fsdp
    shutil.copytree(whole / "nvme", tmp_path / "nvme")
    _job(tmp_path, "fsdp1", ckpt_path=str(whole / "ckpts" / "epoch=1-step=16.ckpt"), hidden=64, devices=1, steps=2 * EVERY)
    assert _result(tmp_path, 0)["weights"] == json.loads((whole / "weights-16.json").read_text())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fsdp1_on_cuda_resumes_from_its_shards(tmp_path: Path) -> None:
    """Lightning's FSDPStrategy itself (accelerator="cuda", NCCL, one rank per device of this
    machine): stopped after step 16, resumed from it, it starts from the weights it saved. (A GPU run
    is not asserted bitwise: its kernels need not be deterministic.)"""
    world = torch.cuda.device_count()
    env = {"ACCELERATOR": "cuda"}
    _job(tmp_path, "fsdp1", hidden=64, devices=world, steps=2 * EVERY, env=env)
    with Checkpointer(tier_config(fs_tier("nvme", tmp_path / "nvme", keep={"last": 10}))) as ckpt:
        stored = ckpt.restore_sync(2 * EVERY).state
    saved = json.loads((tmp_path / f"weights-{2 * EVERY}.json").read_text())
    assert {k: v.tolist() for k, v in stored["state_dict"].items()} == saved
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "nvme", resumed / "nvme")
    _job(resumed, "fsdp1", ckpt_path=str(tmp_path / "ckpts" / "last.ckpt"), hidden=64, devices=world, steps=2 * EVERY, env=env)
    assert _result(resumed, 0)["weights"] == saved


@pytest.mark.slow
@pytest.mark.parametrize("at", [EVERY, 2 * EVERY])
def test_a_rank_that_dies_during_a_save_is_named_on_the_survivor_and_no_pointer_names_its_step(tmp_path: Path, at: int) -> None:
    """Rank 1 SIGKILLed while the Trainer dumps its checkpoint, before its save. At the first save
    (step 8) the Checkpointer is being constructed: rank 0's construction names rank 1. At step 16
    rank 0's save returned, the Trainer's barrier then fails, and its teardown raises the
    RankFailureError naming rank 1 (distributed.timeout after the save). No pointer names a step that
    is not committed, and the dead rank's step is not committed."""
    config = tier_config(fs_tier("nvme", tmp_path / "nvme", keep={"last": 10})) | {"distributed": {"timeout": "4s"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = [sys.executable, str(WORKER), str(tmp_path), str(tmp_path / "config.json"), str(STEPS), "ddp", str(at), "none"]
    survivor, dead = launch_ranks(argv, 2, env={"KILL_RANKS": "1", "KILL_IN_SAVE": "1"}, timeout_s=240)
    assert dead.returncode == -signal.SIGKILL and survivor.returncode == 1, (survivor, dead)
    said = (re.escape("RankFailureError: rank(s) 1 did not construct their Checkpointer within 4 s") if at == EVERY
            else r"RankFailureError: tier 'nvme': step (8|16) was abandoned: rank\(s\) 1 did not store their part")
    assert re.search(said, survivor.output), survivor.output
    with Checkpointer(tier_config(fs_tier("nvme", tmp_path / "nvme", keep={"last": 10}))) as ckpt:
        durable = {v.step for v in ckpt.versions() if v.tier == "nvme"}
    pointers = _pointers(tmp_path) if (tmp_path / "ckpts").exists() else {}
    assert set(pointers.values()) <= durable <= set(range(EVERY, at, EVERY)), (pointers, durable)
