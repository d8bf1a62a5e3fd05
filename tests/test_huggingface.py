"""Hugging Face through TierckptTrainer: a real transformers.Trainer on CPU, a tiny GPT-2 built from a
config (random weights, no downloads), stopped and resumed; and a DDP job of 2 ranks (gloo on
127.0.0.1, started as torchrun starts ranks), SIGKILLed on every rank and resumed."""

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

import pytest
import torch

from tierckpt import Checkpointer
from tierckpt.format import MANIFEST_FILE, CommitMarker, Manifest, Region, decode_document, version_dirname
from tierckpt.integrations.huggingface import ABANDONED_PREFIX, POINTER_NAME, TierckptTrainer
from tierckpt.testing.copies import HeldCopies
from tierckpt.testing.ranks import failures, launch_ranks

from helpers import assert_bitwise, assert_overlapped, clone, fs_tier, in_barrier, tier_config, until
from hf_worker import EVERY, STEPS, Tokens, WeightsAt, run

WORKER = Path(__file__).with_name("hf_worker.py")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@pytest.fixture
def config(tmp_path: Path) -> dict[str, Any]:
    return tier_config(fs_tier("nvme", tmp_path / "nvme", keep={"last": 10}), capacity="32MiB")


def test_a_resumed_run_continues_exactly_as_an_uninterrupted_one(tmp_path: Path, config: dict[str, Any]) -> None:
    whole = run(tmp_path / "whole", tier_config(fs_tier("nvme", tmp_path / "whole-nvme"), capacity="32MiB"))
    assert sorted(whole) == list(range(1, STEPS + 1))

    out = tmp_path / "run"
    first = run(out, config, stop_at=8)
    assert first == {s: whole[s] for s in range(1, 9)}
    assert sorted(os.listdir(out)) == ["checkpoint-4", "checkpoint-8"]
    for step in (4, 8):
        folder = out / f"checkpoint-{step}"
        assert sorted(os.listdir(folder)) == [POINTER_NAME, "trainer_state.json"]  # no torch.save file
        assert json.loads((folder / POINTER_NAME).read_text())["step"] == step
        assert json.loads((folder / "trainer_state.json").read_text())["global_step"] == step

    resumed = run(out, config, resume=True)  # the newest checkpoint-N: 8
    assert resumed == {s: whole[s] for s in range(9, STEPS + 1)}  # model, optimizer, scheduler, RNG, data position

    again = run(out, config, resume=str(out / "checkpoint-4"))
    assert again == {s: whole[s] for s in range(5, STEPS + 1)}


def _step_of(folder: Path) -> int:
    return int(json.loads((folder / POINTER_NAME).read_text())["step"])


def test_after_a_rollback_resume_true_takes_the_new_direction_and_the_abandoned_directories_are_set_aside(tmp_path: Path) -> None:
    """checkpoint-2..12, then a rollback: resumed from checkpoint-6, on other data, stopped after its
    save of step 8. Once that save is durable, checkpoint-10 and -12 (higher steps, of the direction
    left; the tiers' retention may already have deleted step 10) are renamed abandoned-checkpoint-10
    and -12, before save_total_limit's rotation, which keeps the new direction's checkpoint-8. Then
    the state a job killed right after that save became durable leaves (the old checkpoint-8, 10 and
    12 in place): resume_from_checkpoint=True writes checkpoint-8 anew from the step's record, sets
    10 and 12 aside again, and resumes from the new direction's step 8, its weights those saved."""
    # Every save goes down (a busy tier would pass over one with a newer one waiting: no checkpoint-6 to go back to).
    config = tier_config(fs_tier("nvme", tmp_path / "nvme", keep={"last": 10}, flush={"newest_only": False}), capacity="32MiB")
    out = tmp_path / "run"
    run(out, config, every=2)
    assert sorted(os.listdir(out)) == [f"checkpoint-{s}" for s in (10, 12, 2, 4, 6, 8)]
    shutil.copytree(out / "checkpoint-8", tmp_path / "old-checkpoint-8")

    back = run(out, config, every=2, resume=str(out / "checkpoint-6"), stop_at=8, limit=2, data_seed=1, callbacks=(WeightsAt(out, {8}),))
    assert sorted(back) == [7, 8]
    aside = [f"{ABANDONED_PREFIX}checkpoint-{s}" for s in (10, 12)]
    assert sorted(name for name in os.listdir(out) if "checkpoint" in name) == [*aside, "checkpoint-6", "checkpoint-8"]
    assert [_step_of(out / name) for name in aside] == [10, 12]
    new_state = (out / "checkpoint-8" / "trainer_state.json").read_text()
    assert new_state != (tmp_path / "old-checkpoint-8" / "trainer_state.json").read_text()  # the new direction's log history
    with Checkpointer(config) as ckpt:
        held = {v.step: v.abandoned for v in ckpt.versions() if v.tier == "nvme"}
    assert held[8] is False and held[12] is True and held.get(10, True) is True, held

    # As a kill between the durable save of step 8 and its directory (and the renames) leaves it.
    for name in aside:
        os.rename(out / name, out / name.removeprefix(ABANDONED_PREFIX))
    shutil.rmtree(out / "checkpoint-8")
    shutil.copytree(tmp_path / "old-checkpoint-8", out / "checkpoint-8")

    resumed = run(out, config, every=2, resume=True, data_seed=1, callbacks=(WeightsAt(out, set()),))
    assert sorted(resumed) == list(range(9, STEPS + 1))  # from step 8, not from the abandoned 12
    assert json.loads((out / "weights-0-begin.json").read_text()) == json.loads((out / "weights-0-saved-8.json").read_text())
    assert (out / "checkpoint-8" / "trainer_state.json").read_text() == new_state
    assert {name for name in os.listdir(out) if "checkpoint" in name} == {*aside, "checkpoint-6", "checkpoint-8", "checkpoint-10", "checkpoint-12"}
    assert [_step_of(out / name) for name in aside] == [10, 12]


class _HeldAtSave(TierckptTrainer):
    """Holds the copy threads through its save of step EVERY, then trains on. A watcher waits until the
    training thread parks inside tierckpt (the lazy barrier), notes what ran and what changed by then,
    and releases the copy."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.forwards = 0
        self.seen: dict[str, Any] = {}
        self.watcher: threading.Thread | None = None

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        if self.state.global_step != EVERY:
            return super()._save_checkpoint(model, trial)
        self.at_save = clone(model.state_dict())
        self.moments_at_save = clone(self.optimizer.state_dict()["state"])
        model.register_forward_pre_hook(lambda *_: setattr(self, "forwards", self.forwards + 1))
        held = HeldCopies(self.tierckpt_checkpointer, deadline_s=60)
        super()._save_checkpoint(model, trial)
        self.seen["returned_before_the_copy"] = self.tierckpt_checkpointer.wait_captured(timeout=0) is False
        trainer, main = self, threading.current_thread()

        def watch() -> None:
            trainer.seen["parked"] = until(lambda: in_barrier(main), 60)
            trainer.seen["forwards_by_then"] = trainer.forwards
            trainer.seen["weights_by_then"] = clone(model.state_dict())
            held.release()

        self.watcher = threading.Thread(target=watch)
        self.watcher.start()


def test_a_save_returns_before_its_copy_and_only_the_optimizer_step_waits(tmp_path: Path, config: dict[str, Any]) -> None:
    """The lazy barrier under the Trainer: the save of step 4 returns with its copy held; step 5's
    forward and backward run; its optimizer step parks until the copy is released, the weights still
    those saved. The stored step 4 is the state at its save, and the run's losses are those of a run
    whose copies were not held."""
    unheld = run(tmp_path / "unheld", tier_config(fs_tier("nvme", tmp_path / "unheld-nvme"), capacity="32MiB"))
    trainers: list[_HeldAtSave] = []

    class Recorded(_HeldAtSave):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            trainers.append(self)

    losses = run(tmp_path / "run", config, kind=Recorded)
    trainer = trainers[0]
    assert trainer.watcher is not None
    trainer.watcher.join(60)
    assert_overlapped(trainer.seen, trainer.at_save)
    assert losses == unheld  # bitwise: nothing of the state changed under the copy
    with Checkpointer(config) as ckpt:
        stored = ckpt.restore_sync(EVERY).state
    assert_bitwise(stored["model"], trainer.at_save)
    assert_bitwise(stored["optimizer"]["state"], trainer.moments_at_save)


def test_save_total_limit_prunes_directories_and_the_tiers_keep_the_steps(tmp_path: Path, config: dict[str, Any]) -> None:
    run(tmp_path / "run", config, limit=1)
    assert sorted(os.listdir(tmp_path / "run")) == ["checkpoint-12"]
    with Checkpointer(config) as ckpt:
        steps = [v.step for v in ckpt.versions() if v.tier == "nvme"]
    assert steps[-1] == STEPS and set(steps) <= {4, 8, 12}, steps


def test_a_directory_the_stock_trainer_wrote_still_resumes(tmp_path: Path, config: dict[str, Any]) -> None:
    """Switching to TierckptTrainer mid-run: the stock Trainer's last checkpoint loads through its own code."""
    whole = run(tmp_path / "whole", None)
    out = tmp_path / "run"
    run(out, None, stop_at=4)
    assert "optimizer.pt" in os.listdir(out / "checkpoint-4")
    resumed = run(out, config, resume=True)
    assert resumed == {s: whole[s] for s in range(5, STEPS + 1)}
    assert json.loads((out / "checkpoint-12" / POINTER_NAME).read_text())["step"] == STEPS


@pytest.mark.slow
def test_after_a_sigkill_the_newest_durable_step_resumes_exactly(tmp_path: Path, config: dict[str, Any]) -> None:
    """A job SIGKILLed right after the save of step 8 returned (captured; durable or not yet; its
    directory written or not yet): every checkpoint-N it left names a step the tiers hold, and
    resume_from_checkpoint=True continues exactly from the newest durable step, writing its
    directory first if the crash came between durability and the directory."""
    whole = run(tmp_path / "whole", tier_config(fs_tier("nvme", tmp_path / "whole-nvme"), capacity="32MiB"))
    out = tmp_path / "run"
    (tmp_path / "config.json").write_text(json.dumps(config))
    child = subprocess.run([sys.executable, str(WORKER), str(out), str(tmp_path / "config.json"), "8"], capture_output=True, text=True, timeout=300)
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    with Checkpointer(config) as ckpt:
        durable = sorted(v.step for v in ckpt.versions() if v.tier == "nvme")
    left = sorted(os.listdir(out)) if out.exists() else []
    assert durable in ([], [4], [4, 8]), durable  # [] only on a machine slow enough that step 4 was not durable yet
    shown = [name for name in left if not name.startswith(".")]  # a directory killed mid-write stays hidden
    assert set(shown) <= {f"checkpoint-{s}" for s in durable}, (left, durable)  # nothing half-written, none ahead of the tiers
    if not durable:
        with pytest.raises((ValueError, FileNotFoundError)):  # the Trainer finds no checkpoint-N
            run(out, config, resume=True)
        return
    resumed = run(out, config, resume=True)
    assert resumed == {s: whole[s] for s in range(durable[-1] + 1, STEPS + 1)}
    assert f"checkpoint-{durable[-1]}" in os.listdir(out)
    assert not [name for name in os.listdir(out) if name.startswith(".")]  # the killed job's leftovers removed


def _ddp(out: Path, config: dict[str, Any], kill_at: int = 0, resume: bool | Path = False, world: int = 2, fails: bool = False, **env: str) -> list[Any]:
    """A DDP job of ``world`` ranks; with ``fails``, every rank must exit 1 (their exits are returned)."""
    (out.parent / f"{out.name}.json").write_text(json.dumps(config))
    how = str(resume) if isinstance(resume, Path) else "true" if resume else "none"
    argv = [sys.executable, str(WORKER), str(out), str(out.parent / f"{out.name}.json"), str(kill_at), how]
    exits = launch_ranks(argv, world, timeout_s=300, env=env)
    if fails:
        assert [e.returncode for e in exits] == [1] * world, failures(exits)
        return exits
    failed = failures(exits, expect_dead=tuple(range(world)) if kill_at else ())
    assert not failed, failed
    return exits


def _rank1_regions(tier: Path, step: int) -> dict[str, Region]:
    """Where each record of rank 1's part of ``step`` lies in its global tensor."""
    marker = decode_document((tier / version_dirname(step) / MANIFEST_FILE).read_bytes())
    assert isinstance(marker, CommitMarker)
    part = Manifest.decode((tier / version_dirname(step) / marker.ranks[1][0]).read_bytes())
    return {r.key: r.region for r in part.records}


@pytest.mark.slow
def test_ddp_killed_on_every_rank_after_a_save_resumes_every_rank_bitwise(tmp_path: Path) -> None:
    """2 ranks under DDP: every rank saves its part (the replicated states once between them), rank 0
    writes checkpoint-N once the step is committed on every rank, and after every rank is SIGKILLed
    right after the save of step 8, resume_from_checkpoint=True continues every rank exactly (the
    losses are averaged over the ranks; the weights, RNG states per rank, must be the same)."""
    whole = tmp_path / "whole"
    _ddp(whole, tier_config(fs_tier("nvme", tmp_path / "whole-nvme"), capacity="32MiB"))
    w0, w1 = (json.loads((whole / f"result-{r}.json").read_text()) for r in (0, 1))
    assert sorted(map(int, w0["losses"])) == list(range(1, STEPS + 1)) and w0["weights"] == w1["weights"]
    assert sorted(p.name for p in whole.glob("checkpoint-*")) == ["checkpoint-12", "checkpoint-4", "checkpoint-8"]
    assert {p.name for p in (tmp_path / "whole-nvme" / "step-000000000012").glob("data-r*.bin")} == {"data-r00000.bin", "data-r00001.bin"}

    out, config = tmp_path / "run", tier_config(fs_tier("nvme", tmp_path / "nvme", keep={"last": 10}), capacity="32MiB")
    _ddp(out, config, kill_at=8)
    with Checkpointer(config) as ckpt:
        durable = sorted(v.step for v in ckpt.versions() if v.tier == "nvme")
    assert durable in ([], [4], [4, 8]), durable  # [] only on a machine slow enough that step 4 was not durable yet
    left = sorted(p.name for p in out.glob("checkpoint-*"))
    assert set(left) <= {f"checkpoint-{s}" for s in durable}, (left, durable)  # none ahead of every rank's commit
    if not durable:
        pytest.skip("no step was durable before the kill on this machine")
    _ddp(out, config, resume=True)
    r0, r1 = (json.loads((out / f"result-{r}.json").read_text()) for r in (0, 1))
    assert r0["losses"] == {str(s): w0["losses"][str(s)] for s in range(durable[-1] + 1, STEPS + 1)}  # bitwise
    assert r0["weights"] == r1["weights"] == w0["weights"]


@pytest.mark.slow
def test_a_step_that_lost_a_ranks_file_fails_on_every_rank_naming_it_and_an_earlier_checkpoint_resumes(tmp_path: Path) -> None:
    """2 ranks under DDP; rank 1's data file of the newest step (12) is gone. resume_from_checkpoint=True
    takes checkpoint-12 and fails on both ranks naming the directory, the step, the file and the steps
    left, never quietly loading another step than the Trainer's own state names; checkpoint-8 resumes
    every rank exactly."""
    out, config = tmp_path / "run", tier_config(fs_tier("nvme", tmp_path / "nvme", keep={"last": 10}), capacity="32MiB")
    _ddp(out, config)
    whole = json.loads((out / "result-0.json").read_text())
    (tmp_path / "nvme" / "step-000000000012" / "data-r00001.bin").unlink()
    for e in _ddp(out, config, resume=True, fails=True):
        said = f"CorruptCheckpointError: {out / 'checkpoint-12'} names step 12, which cannot be restored: "
        assert said in e.output and "data-r00001.bin is missing" in e.output, e.output[-4000:]
        assert "the tiers also hold step(s) 4, 8: pass resume_from_checkpoint=" in e.output, e.output[-4000:]
    _ddp(out, config, resume=out / "checkpoint-8")
    r0, r1 = (json.loads((out / f"result-{r}.json").read_text()) for r in (0, 1))
    assert r0["losses"] == {str(s): whole["losses"][str(s)] for s in range(9, STEPS + 1)}  # bitwise
    assert r0["weights"] == r1["weights"] == whole["weights"]


@pytest.mark.slow
@pytest.mark.parametrize("at", [EVERY, 2 * EVERY])
def test_a_rank_that_dies_during_a_save_is_named_on_the_survivor_and_no_directory_names_its_step(tmp_path: Path, at: int) -> None:
    """2 ranks under DDP; rank 1 SIGKILLed as the Trainer checkpoints step ``at``, after the Trainer's
    own collectives and before its tierckpt save. At the first save (step 4) the Checkpointer is being
    constructed: rank 0's construction names rank 1. At step 8 rank 0's save returned, its next step's
    collective fails, and train() ends with the RankFailureError naming rank 1 (distributed.timeout
    after the save). No checkpoint-N names a step that is not committed on both ranks, and the dead
    rank's step is not committed."""
    config = tier_config(fs_tier("nvme", tmp_path / "nvme", keep={"last": 10}), capacity="32MiB") | {"distributed": {"timeout": "4s"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = [sys.executable, str(WORKER), str(tmp_path / "run"), str(tmp_path / "config.json"), "0", "none"]
    survivor, dead = launch_ranks(argv, 2, env={"KILL_IN_SAVE": str(at), "KILL_RANKS": "1"}, timeout_s=240)
    assert dead.returncode == -signal.SIGKILL and survivor.returncode == 1, (survivor, dead)
    said = (re.escape("RankFailureError: rank(s) 1 did not construct their Checkpointer within 4 s") if at == EVERY
            else re.escape(f"RankFailureError: tier 'nvme': step {at} was abandoned: rank(s) 1 did not store their part"))
    assert re.search(said, survivor.output), survivor.output[-5000:]
    with Checkpointer(tier_config(fs_tier("nvme", tmp_path / "nvme", keep={"last": 10}))) as ckpt:
        durable = {v.step for v in ckpt.versions() if v.tier == "nvme"}
    published = {int(p.name.split("-")[1]) for p in (tmp_path / "run").glob("checkpoint-*")}
    assert published <= durable <= set(range(EVERY, at, EVERY)), (published, durable)
    assert published == durable  # rank 0's train() ended after its earlier steps were durable: each has its directory


@pytest.mark.slow
@pytest.mark.parametrize(("fsdp", "other"), [("1", "v1"), ("v1", "1")], ids=["fsdp2", "fsdp1"])
def test_fsdp_killed_on_every_rank_after_a_save_resumes_bitwise_and_under_the_other_fsdp_on_three_ranks(
    tmp_path: Path, fsdp: str, other: str
) -> None:
    """2 ranks under FSDP2 (accelerate's own fully_shard) or FSDP1 (its FullyShardedDataParallel on the
    CPU device), over gloo (hf_worker.fsdp_on_cpu lets them run on CPU): every rank stores its shards of
    the model and of AdamW's moments by parameter name (FSDP1's ShardedTensors as DTensor pieces, not its
    flat parameters), SIGKILLed on every rank after the save of step 8. Resumed from the newest step
    durable by then (8, or 4 where the kill came first) under the same FSDP on 2 ranks, it continues
    bitwise; under the other FSDP on 3 ranks it starts from the same weights, resharded."""
    whole = tmp_path / "whole"
    _ddp(whole, tier_config(fs_tier("nvme", tmp_path / "whole-nvme"), capacity="32MiB"), HF_FSDP=fsdp)
    w0 = json.loads((whole / "result-0.json").read_text())
    assert sorted(map(int, w0["losses"])) == list(range(1, STEPS + 1))
    shards = _rank1_regions(tmp_path / "whole-nvme", 12)
    # Rank 1's second half of the embedding and of its AdamW moment: shards, not copies.
    assert shards["['model']['transformer.wte.weight']"] == Region((64, 32), (32, 0))
    assert shards["['optimizer']['state']['transformer.wte.weight']['exp_avg']"] == Region((64, 32), (32, 0))

    out, config = tmp_path / "run", tier_config(fs_tier("nvme", tmp_path / "nvme", keep={"last": 10}), capacity="32MiB")
    _ddp(out, config, kill_at=8, HF_FSDP=fsdp, HF_WEIGHTS_AT="4,8")
    with Checkpointer(config) as ckpt:
        durable = sorted(v.step for v in ckpt.versions() if v.tier == "nvme")
    assert durable in ([], [4], [4, 8]), durable
    if not durable:
        pytest.skip("step 4 was not durable before the kill on this machine")
    newest = durable[-1]
    saved = json.loads((out / f"weights-0-saved-{newest}.json").read_text())
    wider = tmp_path / "wider"
    shutil.copytree(out, wider)
    _ddp(out, config, resume=True, HF_FSDP=fsdp, HF_WEIGHTS_AT="0")
    r0, r1 = (json.loads((out / f"result-{r}.json").read_text()) for r in (0, 1))
    assert json.loads((out / "weights-0-begin.json").read_text()) == saved
    assert r0["losses"] == {str(s): w0["losses"][str(s)] for s in range(newest + 1, STEPS + 1)}  # bitwise
    assert r0["weights"] == r1["weights"] == w0["weights"]

    _ddp(wider, config, resume=True, world=3, HF_FSDP=other, HF_WEIGHTS_AT="0")
    assert all(json.loads((wider / f"weights-{r}-begin.json").read_text()) == saved for r in range(3))
    assert sorted(map(int, json.loads((wider / "result-0.json").read_text())["losses"])) == list(range(newest + 1, STEPS + 1))


@pytest.mark.parametrize("setting", ["load_best_model_at_end", "save_only_model"])
def test_settings_it_cannot_honour_are_refused_when_the_trainer_is_made(tmp_path: Path, config: dict[str, Any], setting: str) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from tierckpt import ConfigError
    from tierckpt.integrations.huggingface import TierckptTrainer

    extra: dict[str, Any] = {"eval_strategy": "steps", "save_strategy": "steps"} if setting == "load_best_model_at_end" else {}
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], **{setting: True}, **extra)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(ConfigError, match=setting):
        TierckptTrainer(model=model, args=args, train_dataset=Tokens(), eval_dataset=Tokens(), tierckpt=config)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fsdp2_on_a_gpu_resumes_from_its_shards(tmp_path: Path) -> None:
    """accelerate's FSDP2 as it runs on a GPU (no patch: one rank per GPU, NCCL), one rank per device
    of this machine: SIGKILLed after the save of step 8, resumed, it starts from the weights it saved,
    and trains to the end. (A GPU run is not asserted bitwise: its kernels need not be deterministic.)"""
    world = torch.cuda.device_count()
    out, config = tmp_path / "run", tier_config(fs_tier("nvme", tmp_path / "nvme", keep={"last": 10}), capacity="32MiB")
    _ddp(out, config, kill_at=8, world=world, HF_FSDP="1", HF_WEIGHTS_AT="8")
    with Checkpointer(config) as ckpt:
        durable = sorted(v.step for v in ckpt.versions() if v.tier == "nvme")
    if durable != [4, 8]:
        pytest.skip(f"step 8 was not durable before the kill on this machine ({durable})")
    _ddp(out, config, resume=True, world=world, HF_FSDP="1", HF_WEIGHTS_AT="0")
    saved = json.loads((out / "weights-0-saved-8.json").read_text())
    assert json.loads((out / "weights-0-begin.json").read_text()) == saved
    assert sorted(map(int, json.loads((out / "result-0.json").read_text())["losses"])) == list(range(9, STEPS + 1))
