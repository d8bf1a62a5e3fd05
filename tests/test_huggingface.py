"""Hugging Face through TierckptTrainer: a real transformers.Trainer on CPU, a tiny GPT-2 built from a
config (random weights, no downloads), stopped and resumed."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments, set_seed

from tierckpt import Checkpointer
from tierckpt.integrations.huggingface import POINTER_NAME, TierckptTrainer

from helpers import fs_tier, tier_config

STEPS, EVERY = 12, 4

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


class Tokens(torch.utils.data.Dataset):
    """48 sequences of a learnable pattern, in memory."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        starts = torch.randint(0, 50, (48, 1), generator=g)
        self.ids = (starts + torch.arange(16)) % 64

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Losses(TrainerCallback):
    def __init__(self, stop_at: int | None = None) -> None:
        self.losses: dict[int, float] = {}
        self.stop_at = stop_at

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.stop_at:
            control.should_training_stop = True  # the job stops here (after its checkpoint)


def _run(out: Path, config: dict[str, Any] | None, *, stop_at: int | None = None, resume: Any = None, limit: int | None = None) -> dict[int, float]:
    """Train (``config`` None: with the stock Trainer) and return the logged losses by step."""
    set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))  # dropout 0.1: RNG matters
    args = TrainingArguments(
        output_dir=str(out), max_steps=STEPS, save_steps=EVERY, save_strategy="steps", logging_steps=1,
        per_device_train_batch_size=4, learning_rate=3e-3, lr_scheduler_type="linear", warmup_steps=2,
        report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0, save_total_limit=limit, disable_tqdm=True,
    )
    losses = Losses(stop_at)
    if config is None:
        trainer: Trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[losses])
    else:
        trainer = TierckptTrainer(model=model, args=args, train_dataset=Tokens(), callbacks=[losses], tierckpt=config)
    trainer.train(resume_from_checkpoint=resume)
    return losses.losses


@pytest.fixture
def config(tmp_path: Path) -> dict[str, Any]:
    return tier_config(fs_tier("nvme", tmp_path / "nvme", keep={"last": 10}), capacity="32MiB")


def test_a_resumed_run_continues_exactly_as_an_uninterrupted_one(tmp_path: Path, config: dict[str, Any]) -> None:
    whole = _run(tmp_path / "whole", tier_config(fs_tier("nvme", tmp_path / "whole-nvme"), capacity="32MiB"))
    assert sorted(whole) == list(range(1, STEPS + 1))

    out = tmp_path / "run"
    first = _run(out, config, stop_at=8)
    assert first == {s: whole[s] for s in range(1, 9)}
    assert sorted(os.listdir(out)) == ["checkpoint-4", "checkpoint-8"]
    for step in (4, 8):
        folder = out / f"checkpoint-{step}"
        assert sorted(os.listdir(folder)) == [POINTER_NAME, "trainer_state.json"]  # no torch.save file
        assert json.loads((folder / POINTER_NAME).read_text())["step"] == step
        assert json.loads((folder / "trainer_state.json").read_text())["global_step"] == step

    resumed = _run(out, config, resume=True)  # the newest checkpoint-N: 8
    assert resumed == {s: whole[s] for s in range(9, STEPS + 1)}  # model, optimizer, scheduler, RNG, data position

    again = _run(out, config, resume=str(out / "checkpoint-4"))
    assert again == {s: whole[s] for s in range(5, STEPS + 1)}


def test_save_total_limit_prunes_directories_and_the_tiers_keep_the_steps(tmp_path: Path, config: dict[str, Any]) -> None:
    _run(tmp_path / "run", config, limit=1)
    assert sorted(os.listdir(tmp_path / "run")) == ["checkpoint-12"]
    with Checkpointer(config) as ckpt:
        steps = [v.step for v in ckpt.versions() if v.tier == "nvme"]
    assert steps[-1] == STEPS and set(steps) <= {4, 8, 12}, steps


def test_a_directory_the_stock_trainer_wrote_still_resumes(tmp_path: Path, config: dict[str, Any]) -> None:
    """Switching to TierckptTrainer mid-run: the stock Trainer's last checkpoint loads through its own code."""
    whole = _run(tmp_path / "whole", None)
    out = tmp_path / "run"
    _run(out, None, stop_at=4)
    assert "optimizer.pt" in os.listdir(out / "checkpoint-4")
    resumed = _run(out, config, resume=True)
    assert resumed == {s: whole[s] for s in range(5, STEPS + 1)}
    assert json.loads((out / "checkpoint-12" / POINTER_NAME).read_text())["step"] == STEPS
