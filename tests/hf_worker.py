"""The Hugging Face run the tests share (tests/test_huggingface.py), and a child that is SIGKILLed
right after a save returns: ``python hf_worker.py <output_dir> <config.json> <kill after the save of step>``.

As a rank of a DDP job (``RANK`` in the environment, started by ``launch_ranks`` as torchrun starts
ranks): ``python hf_worker.py <output_dir> <config.json> <kill at step or 0> <resume: none|true|a path>``; each
rank writes ``<output_dir>/result-<rank>.json`` (logged losses, final weights) unless killed.
``KILL_IN_SAVE=<step>`` with ``KILL_RANKS=<ranks>``: those ranks die as the Trainer checkpoints that step,
right before their tierckpt save (:class:`KilledInSave`).

``HF_FSDP=1``: FSDP2 instead of DDP (``fsdp=True``, ``fsdp_config={"version": 2}``); ``HF_FSDP=v1``:
FSDP1 (``"version": 1``). accelerate turns FSDP on only for GPU-type jobs; :func:`fsdp_on_cpu` lets its
own FSDP code (``fully_shard``, or ``FullyShardedDataParallel`` on the CPU device, over gloo) run here,
the one thing faked: tests/test_huggingface.py's CUDA test runs it unpatched."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments, set_seed

from tierckpt.integrations.huggingface import TierckptTrainer
from tierckpt.testing.ranks import end_job

import helpers

STEPS, EVERY = 12, 4


class Tokens(torch.utils.data.Dataset):
    """48 sequences of a learnable pattern, in memory (``seed``: which starts; another seed stands for
    other data, as a rollback past a bad shard trains on)."""

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
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


def run(out: Path, config: dict[str, Any] | None, *, stop_at: int | None = None, resume: Any = None, limit: int | None = None,
        callbacks: tuple[Any, ...] = (), weights: dict[str, Any] | None = None, kind: type[Any] | None = None,
        every: int = EVERY, data_seed: int = 0) -> dict[int, float]:
    """Train (``config`` None: with the stock Trainer; ``kind``: a TierckptTrainer subclass), saving
    every ``every`` steps, on ``Tokens(data_seed)``, and return the logged losses by step; the final
    weights go into ``weights`` (as lists) when given."""
    set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))  # dropout 0.1: RNG matters
    sharding: dict[str, Any] = {}
    if os.environ.get("HF_FSDP") in ("1", "v1"):
        version = 1 if os.environ["HF_FSDP"] == "v1" else 2
        sharding = {"fsdp": True, "fsdp_config": {"version": version, "transformer_layer_cls_to_wrap": ["GPT2Block"]}}
        sharding["use_cpu"] = not torch.cuda.is_available()  # on the GPUs where there are some: the CUDA test
        if version == 1 and sharding["use_cpu"]:  # its broadcast of rank 0's weights needs an accelerator (every rank has them: seed 0)
            sharding["fsdp_config"]["sync_module_states"] = False
    args = TrainingArguments(
        output_dir=str(out), max_steps=STEPS, save_steps=every, save_strategy="steps", logging_steps=1,
        per_device_train_batch_size=4, learning_rate=3e-3, lr_scheduler_type="linear", warmup_steps=2,
        report_to=[], seed=0, dataloader_num_workers=0, save_total_limit=limit, disable_tqdm=True,
        **({"use_cpu": True} | sharding),
    )
    losses = Losses(stop_at)
    if config is None:
        trainer: Trainer = Trainer(model=model, args=args, train_dataset=Tokens(data_seed), callbacks=[losses, *callbacks])
    else:
        kind = kind or (KilledInSave if os.environ.get("KILL_IN_SAVE") else TierckptTrainer)
        trainer = kind(model=model, args=args, train_dataset=Tokens(data_seed), callbacks=[losses, *callbacks], tierckpt=config)
    trainer.train(resume_from_checkpoint=resume)
    if weights is not None:
        weights.update(whole_weights(trainer.model_wrapped))
    return losses.losses


def fsdp_on_cpu() -> None:
    """Let accelerate's FSDP run in a CPU job: it enables FSDP only for GPU-type distributed jobs,
    and its FSDP preparation (``fully_shard``, or ``FullyShardedDataParallel`` given the device
    ``cpu``, over the process group) runs the same on gloo."""
    import accelerate.state
    from accelerate.utils import DistributedType

    made = accelerate.state.AcceleratorState.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        if kwargs.get("fsdp_plugin") is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, kwargs["fsdp_plugin"]
            if self.fsdp_plugin.fsdp_version == 1:  # FSDP1 takes the device as its compute device: "cpu", not a CPU job's "cpu:0"
                self.device = torch.device("cpu")

    accelerate.state.AcceleratorState.__init__ = init  # type: ignore[method-assign]


def whole_weights(model: Any) -> dict[str, Any]:
    """The model's weights as lists (under FSDP, gathered from the shards: every rank calls it)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return helpers.whole_weights(model, model if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()) else None)


class WeightsAt(TrainerCallback):
    """Writes the whole weights to ``<out>/weights-<rank>-<when>.json``: ``saved-N`` at the save of each
    step of ``steps`` (``HF_WEIGHTS_AT``: e.g. ``8`` or ``4,8``), ``begin`` when training starts (after a
    resume loaded them)."""

    def __init__(self, out: Path, steps: set[int]) -> None:
        self.out, self.steps = out, steps

    def _write(self, when: str, model: Any) -> None:
        weights = whole_weights(model)
        (self.out / f"weights-{os.environ.get('RANK', '0')}-{when}.json").write_text(json.dumps(weights))

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._write("begin", model)

    def on_save(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if state.global_step in self.steps:
            self._write(f"saved-{state.global_step}", model)


class KilledInSave(TierckptTrainer):
    """``KILL_IN_SAVE=<step>``: the ranks in ``KILL_RANKS`` (e.g. ``1``) SIGKILL themselves as the
    Trainer checkpoints that step, after its own collectives and right before their tierckpt save of
    it (before the lazy barrier is put on, which opens the Checkpointer at the first save); the
    others save it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        step, guards = int(os.environ["KILL_IN_SAVE"]), self._tierckpt.guard
        dies = os.environ.get("RANK") in os.environ["KILL_RANKS"].split(",")

        def guard(*targets: Any) -> None:
            if self.state.global_step == step and dies:
                os.kill(os.getpid(), signal.SIGKILL)
            guards(*targets)

        self._tierckpt.guard = guard  # type: ignore[method-assign]


class KillAfterSave(TrainerCallback):
    """SIGKILL the process right after the Trainer's save of ``step`` returned: the step is captured,
    and may or may not be durable yet."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    out, config, kill_at = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()), int(sys.argv[3])
    if "RANK" not in os.environ:
        run(out, config, callbacks=(KillAfterSave(kill_at),))
    else:
        os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])  # one node, as torchrun would set it
        if os.environ.get("HF_FSDP") in ("1", "v1") and not torch.cuda.is_available():
            fsdp_on_cpu()
        final: dict[str, Any] = {}
        watch = (WeightsAt(out, {int(s) for s in os.environ["HF_WEIGHTS_AT"].split(",")}),) if os.environ.get("HF_WEIGHTS_AT") else ()
        resume = {"true": True, "none": None}.get(sys.argv[4], sys.argv[4])  # else a checkpoint-N path
        logged = run(out, config, resume=resume, callbacks=watch + ((KillAfterSave(kill_at),) if kill_at else ()), weights=final)
        (out / f"result-{os.environ['RANK']}.json").write_text(json.dumps({"losses": logged, "weights": final}))
        end_job()  # FSDP on gloo may abort at the interpreter's exit otherwise (pytorch#190489)
