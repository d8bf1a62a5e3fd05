"""A DeepSpeed ZeRO job on CPU (gloo) for tests/test_deepspeed.py, run by ``launch_ranks`` as torchrun
starts ranks: ``python deepspeed_worker.py <root> <job.json>``.

``job.json``: ``{"runs": [run, ...]}``, each run one engine after the other in this process (one
launch covers several stages): ``name``, ``stage`` (1-3), ``bf16``, ``optimizer`` ("client":
a torch.optim.AdamW of two parameter groups; "config": the config's AdamW), ``accumulation`` (micro-batches a step), ``zero`` (more zero_optimization settings), ``steps``
(the step to train to), ``save_every`` (0: never), ``tiers`` (the tier config; none: DeepSpeed's own
checkpoint engine), ``resume`` (load_checkpoint first), ``tag`` (load that tag), ``kill_at`` (SIGKILL
every rank right after the save of that step returned), ``save_latest_from`` (the first step saved with ``save_latest=False``), ``kill_ranks`` (the ranks that kill does; all), ``kill_when_latest`` (first wait until
``save_dir/latest`` names this tag: a gate on what the background made durable), ``hold_at`` (hold
the copy threads through the save of that step; a watcher notes what ran until the training thread
parked in the lazy barrier, then lets the copy go: ZeRO-1/2), ``metrics`` (read the tier config's
metrics endpoint at the end).

Each rank writes ``<root>/<name>-<rank>.json``: the losses by step (``float.hex``), the step it
resumed from, what ``load_checkpoint`` returned of ``client_state``, the tierckpt warnings logged,
digests of every parameter's fp32 master and Adam moments (``safe_get_full_*``) at the end, and the
metrics read (``metrics``).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import signal
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: E402

# The JIT build of DeepSpeed's shared-memory allreduce takes minutes on 2 cores; gloo does without it.
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # type: ignore[attr-defined]

WIDTH = 16
BATCH = 4


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, WIDTH)
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.out = torch.nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.inp(x))))


def ds_config(run: dict[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": run.get("accumulation", 1),
        "zero_optimization": {"stage": run["stage"], "reduce_bucket_size": 1e6, "allgather_bucket_size": 1e6, **run.get("zero", {})},
        "bf16": {"enabled": bool(run.get("bf16"))},
        "steps_per_print": 10**9,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4}},
    }
    if run.get("optimizer", "client") == "config":
        # torch_adam: torch's AdamW rather than DeepSpeed's FusedAdam, whose JIT build takes minutes
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01, "torch_adam": True}}
    return config


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    x = torch.randn(BATCH, 8, generator=g)
    return x, x.sum(1, keepdim=True) + 0.1 * x[:, :1] ** 2


def digests(engine: Any) -> dict[str, str]:
    """Every parameter's fp32 master and Adam moments, whole (collective under ZeRO-3), as sha256 digests."""
    out = {}
    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:  # ZeRO-1/2 link each parameter to its moments at the first step (again after a load: now)
        engine.optimizer._hp_optimizer_states_linked = False
        link()
    for name, param in engine.module.named_parameters():
        for what, value in (("fp32", safe_get_full_fp32_param(param)), ("exp_avg", safe_get_full_optimizer_state(param, "exp_avg")),
                            ("exp_avg_sq", safe_get_full_optimizer_state(param, "exp_avg_sq"))):
            out[f"{name}.{what}"] = hashlib.sha256(value.detach().float().contiguous().numpy().tobytes()).hexdigest()
    return out


class Warnings(logging.Handler):
    """What the tierckpt logger says at WARNING and above, and which saved ranks a resharding read (INFO)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []
        self.reads: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if record.levelno >= logging.WARNING:
            self.messages.append(message)
        elif "resharding read" in message:
            self.reads.append(message)


def wait_for_latest(save_dir: Path, tag: str, deadline_s: float = 120.0) -> None:
    """The gate before a kill: ``save_dir/latest`` names ``tag`` (its step durable on every rank)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            if (save_dir / "latest").read_text() == tag:
                return
        except OSError:
            pass
        time.sleep(0.005)  # polling a file another thread writes: the gate itself
    raise TimeoutError(f"{save_dir / 'latest'} did not name {tag} within {deadline_s} s")


def fp32_partitions(engine: Any) -> list[str]:
    """This rank's flat fp32 partitions (ZeRO-1/2), as hex digests: what the optimizer's update overwrites."""
    return [hashlib.sha256(p.detach().numpy().tobytes()).hexdigest() for p in engine.optimizer.single_partition_of_fp32_groups]


def held_save(engine: Any, save_dir: Path, client_state: dict[str, Any], forwards: list[int], result: dict[str, Any]) -> threading.Thread:
    """``save_checkpoint`` with the copy threads held; a watcher thread waits until the training thread
    parks in the lazy barrier, notes how many forwards ran by then and whether the fp32 partitions are
    still those saved, and releases the copy."""
    from helpers import in_barrier, until
    from tierckpt.testing.copies import HeldCopies

    ckpt = engine.checkpoint_engine.checkpointer
    at_save, forwards_at_save, main = fp32_partitions(engine), forwards[0], threading.current_thread()
    held = HeldCopies(ckpt, deadline_s=60)
    engine.save_checkpoint(str(save_dir), client_state=client_state)
    seen = result.setdefault("held", {})
    seen["returned_before_the_copy"] = ckpt.wait_captured(timeout=0) is False

    def watch() -> None:
        seen["parked"] = until(lambda: in_barrier(main), 60)
        seen["forwards_by_then"] = forwards[0] - forwards_at_save
        seen["unchanged_by_then"] = fp32_partitions(engine) == at_save
        held.release()

    watcher = threading.Thread(target=watch)
    watcher.start()
    return watcher


def train(root: Path, run: dict[str, Any]) -> None:
    from tierckpt.integrations.deepspeed import attach

    rank = int(os.environ["RANK"])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(0)
    model = Net()
    config = ds_config(run)
    kwargs: dict[str, Any] = {"model": model, "config": config}
    if run.get("optimizer", "client") == "client":
        # Two parameter groups, as training scripts make them: weight decay on the matrices only.
        matrices = [p for p in model.parameters() if p.dim() > 1]
        others = [p for p in model.parameters() if p.dim() <= 1]
        kwargs["optimizer"] = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}], lr=0.01)
    else:
        kwargs["model_parameters"] = model.parameters()
    engine, _, _, _ = deepspeed.initialize(**kwargs)
    save_dir = root / run.get("save_dir", "ckpts")
    if run.get("tiers") is not None:
        attach(engine, run["tiers"])
    warned = Warnings()
    logger = logging.getLogger("tierckpt")
    logger.addHandler(warned)
    logger.setLevel(logging.INFO)
    result: dict[str, Any] = {"losses": {}, "resumed": None, "world": world}
    start = 0
    if run.get("expect_error"):  # a load that must fail: what it raised, on this rank
        try:
            engine.load_checkpoint(str(save_dir), tag=run.get("tag"), **run.get("load_kwargs", {}))
            result["error"] = None
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
        (root / f"{run['name']}-{rank}.json").write_text(json.dumps(result))
        engine.destroy()
        return
    if run.get("resume"):
        path, client = engine.load_checkpoint(str(save_dir), tag=run.get("tag"))
        if path is not None:
            start = client["step"] + 1
            result["resumed"] = client["step"]
            result["client"] = {"step": client["step"], "rank": client["rank"], "note": client["note"], "t": client["t"].tolist()}
        result["loaded"] = digests(engine)  # what the load put in place, before any step
    dtype = torch.bfloat16 if run.get("bf16") else torch.float32
    forwards = [0]
    engine.module.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    watcher: threading.Thread | None = None
    for step in range(start, run["steps"]):
        for micro in range(run.get("accumulation", 1)):
            x, y = batch(step, micro, rank)
            loss = (engine(x.to(dtype)).float() - y).pow(2).mean()
            engine.backward(loss)
            engine.step()
        result["losses"][str(step)] = loss.item().hex()
        if run.get("save_every") and (step + 1) % run["save_every"] == 0:
            client_state = {"step": step, "rank": rank, "note": f"rank {rank} step {step}", "t": torch.full((2,), float(rank + step))}
            if run.get("hold_at") == step:
                watcher = held_save(engine, save_dir, client_state, forwards, result)
            else:
                # save_latest_from: from this step on, saves leave save_dir/latest as it is
                engine.save_checkpoint(str(save_dir), client_state=client_state, save_latest=step < run.get("save_latest_from", run["steps"]))
            if run.get("kill_at") == step and rank in run.get("kill_ranks", [rank]):
                if run.get("kill_when_latest"):
                    wait_for_latest(save_dir, run["kill_when_latest"])
                os.kill(os.getpid(), signal.SIGKILL)
    if watcher is not None:
        watcher.join(60)
    result["digests"] = digests(engine)
    if run.get("load_back"):  # the last save, loaded by this process at once (not durable yet, maybe), by a relative path
        path, client = engine.load_checkpoint(os.path.relpath(save_dir), tag=f"global_step{run['steps']}")
        result["loaded_back"] = {"path": os.path.basename(path), "step": client["step"], "digests": digests(engine)}
    if run.get("metrics"):  # what the run's Prometheus endpoint serves once its saves are durable
        ckpt = engine.checkpoint_engine.checkpointer
        ckpt.wait_sync()
        with urllib.request.urlopen(ckpt.metrics_url, timeout=30) as page:
            result["metrics"] = [line for line in page.read().decode().splitlines() if line.startswith("tierckpt_")]
    if run.get("save_16bit"):  # an inference weights file, not a training checkpoint: DeepSpeed's torch.save
        engine.save_16bit_model(str(root / f"{run['name']}-weights"))
    result["warnings"], result["reads"] = warned.messages, warned.reads
    logging.getLogger("tierckpt").removeHandler(warned)
    (root / f"{run['name']}-{rank}.json").write_text(json.dumps(result))
    engine.destroy()  # waits until every save is durable and its pointers written


def refused(root: Path, run: dict[str, Any]) -> None:
    """Each DeepSpeed setup of ``run["refusals"]`` built for real, and what ``attach`` raised for it."""
    from tierckpt.errors import ConfigError
    from tierckpt.integrations.deepspeed import attach

    def engine(model: torch.nn.Module, stage: int, params: Any = None, extra: Any = None, **zero: Any) -> Any:
        config = {"train_micro_batch_size_per_gpu": BATCH, "zero_optimization": {"stage": stage, **zero},
                  "zero_force_ds_cpu_optimizer": False, **(extra or {})}  # offload with a client torch optimizer: no JIT build of DeepSpeed's CPU Adam
        optimizer = torch.optim.AdamW(model.parameters() if params is None else params, lr=0.01)
        return deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]

    def pipeline() -> Any:
        from deepspeed.pipe import PipelineModule

        return engine(PipelineModule(layers=[torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)], num_stages=1, loss_fn=torch.nn.MSELoss()), 1)

    def moe() -> Any:
        from deepspeed.moe.layer import MoE
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        model = torch.nn.Sequential(MoE(hidden_size=8, expert=torch.nn.Linear(8, 8), num_experts=1, ep_size=1, k=1))
        return engine(model, 1, split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "all"}))

    cases = {
        "stage0": lambda: engine(Net(), 0),
        "offload_optimizer": lambda: engine(Net(), 2, offload_optimizer={"device": "cpu"}),
        "offload_param": lambda: engine(Net(), 3, offload_param={"device": "cpu"}),
        "elastic_checkpoint": lambda: engine(Net(), 2, elastic_checkpoint=True),
        "node_local_storage": lambda: engine(Net(), 2, extra={"checkpoint": {"use_node_local_storage": True}}),
        "pipeline": pipeline,
        "moe": moe,
    }
    said: dict[str, str] = {}
    for case in run["refusals"]:
        built = cases[case]()
        try:
            attach(built, run["tiers"])
            said[case] = "attached"
        except ConfigError as exc:
            said[case] = str(exc)
        built.destroy()
    (root / f"{run['name']}-{os.environ['RANK']}.json").write_text(json.dumps(said))


def main(root: Path, job: dict[str, Any]) -> None:
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])  # launch_ranks sets what torchrun does, but this
    root.mkdir(parents=True, exist_ok=True)
    for run in job["runs"]:
        (refused if "refusals" in run else train)(root, run)


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()))
    torch.distributed.destroy_process_group()
