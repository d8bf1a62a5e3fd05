"""Train a small GPT-style language model on CPU and checkpoint it at every step with tierckpt.

Every step is saved to host RAM; from there the newest save goes on to ``<dir>/nvme`` whenever that tier
is free (a save still waiting when a newer one arrives is passed over: newest wins), and every 50th step
to ``<dir>/pfs``, compressed (``examples/tiers.yaml``). Stop it at any time (Ctrl-C) and run it
again: it resumes from the newest checkpoint on disk and continues exactly where it was, the same batches
and the same dropout masks, so an interrupted run ends with the same weights as an uninterrupted one.

Run it::

    python examples/train_demo.py                       # 300 steps into ./checkpoints
    python examples/train_demo.py                       # again: training is complete at step 300; says how to go on
    python examples/train_demo.py --steps 400           # later: resumes at 300, trains to 400
    python examples/train_demo.py --steps 20 --tiny --dir /tmp/ck --report /tmp/ck/report.json

The corpus is synthetic and deterministic (additions such as ``37+58=95``, generated from a fixed seed):
nothing is downloaded. The model is torch.nn only: token and position embeddings, pre-norm transformer
layers under a causal mask, a linear head.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import hashlib
import importlib.util
import json
import os
import random
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tierckpt import Checkpointer, Config, FlushError, TierckptError, VersionInfo

HERE = Path(__file__).resolve().parent
VOCAB = "0123456789+=\n"
CORPUS_LINES = 20_000
EXIT_DISK_FULL = 3
EXIT_STATUSES = f"""exit status:
  0    trained to --steps (or had already)
  2    bad options, or --dir holds checkpoints of another model size
  {EXIT_DISK_FULL}    a tier's file system is full: the message says what it needs, what is free, and what to do
  130  interrupted (Ctrl-C): the newest checkpoint on disk is where the next run resumes"""


@dataclasses.dataclass(frozen=True)
class ModelSize:
    d_model: int
    layers: int
    heads: int
    block: int  # tokens of context
    batch: int  # sequences per step


DEFAULT = ModelSize(d_model=192, layers=4, heads=6, block=64, batch=16)  # about 1.8 M parameters
TINY = ModelSize(d_model=32, layers=2, heads=2, block=32, batch=8)  # for tests: a few ms a step


def make_corpus(seed: int, lines: int = CORPUS_LINES) -> torch.Tensor:
    """Token ids of ``lines`` additions ``a+b=c`` drawn from ``seed``: the same tensor on every run."""
    rng = random.Random(seed)
    text = "".join(f"{a}+{b}={a + b}\n" for a, b in ((rng.randrange(100), rng.randrange(100)) for _ in range(lines)))
    index = {ch: i for i, ch in enumerate(VOCAB)}
    return torch.tensor([index[ch] for ch in text], dtype=torch.long)


class Batches:
    """Batches of ``(input, target)`` sequences, each epoch in its own shuffled order.

    The order of an epoch depends only on the seed and the epoch number, so the position (epoch, index)
    is all a checkpoint needs to continue with the very next batch.
    """

    def __init__(self, tokens: torch.Tensor, block: int, batch: int, seed: int) -> None:
        count = (len(tokens) - 1) // (block + 1)
        if count < batch:
            raise ValueError(f"the corpus holds {count} sequences of {block + 1} tokens, fewer than one batch of {batch}")
        self.rows = tokens[: count * (block + 1)].view(count, block + 1)
        self.batch = batch
        self.seed = seed
        self.epoch = 0
        self.index = 0
        self._order: tuple[int, torch.Tensor] | None = None

    def position(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def seek(self, position: dict[str, int]) -> None:
        self.epoch, self.index = int(position["epoch"]), int(position["index"])

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.index + self.batch > len(self.rows):
            self.epoch, self.index = self.epoch + 1, 0
        if self._order is None or self._order[0] != self.epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            self._order = (self.epoch, torch.randperm(len(self.rows), generator=generator))
        rows = self.rows[self._order[1][self.index : self.index + self.batch]]
        self.index += self.batch
        return rows[:, :-1], rows[:, 1:]


class TinyGPT(nn.Module):
    """A decoder-only transformer: embeddings, pre-norm layers under a causal mask, a linear head."""

    def __init__(self, vocab: int, size: ModelSize, dropout: float = 0.1) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, size.d_model)
        self.positions = nn.Embedding(size.block, size.d_model)
        layer = nn.TransformerEncoderLayer(
            size.d_model, size.heads, 4 * size.d_model, dropout, activation="gelu", batch_first=True, norm_first=True
        )
        self.layers = nn.TransformerEncoder(layer, size.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(size.d_model)
        self.head = nn.Linear(size.d_model, vocab, bias=False)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(size.block), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        length = ids.shape[1]
        x = self.tokens(ids) + self.positions(torch.arange(length, device=ids.device))
        x = self.layers(x, mask=self.causal[:length, :length], is_causal=True)
        return self.head(self.norm(x))


def load_config(path: Path, directory: Path) -> Config:
    """The config at ``path`` with each filesystem tier moved to ``directory/<tier name>``, and its
    events file to ``directory``."""
    config = Config.from_yaml(path)
    tiers = tuple(
        dataclasses.replace(tier, path=directory / tier.name) if tier.type == "filesystem" else tier for tier in config.tiers
    )
    events = None if config.events is None else str(directory / Path(config.events).name)
    return dataclasses.replace(config, tiers=tiers, events=events)


def steps_by_tier(ckpt: Checkpointer) -> dict[str, list[int]]:
    held: dict[str, list[int]] = {name: [] for name in ckpt.tiers}
    for info in ckpt.versions():
        held[info.tier].append(info.step)
    return {name: sorted(steps) for name, steps in held.items()}


def describe(held: dict[str, list[int]]) -> str:
    return " | ".join(f"{name} [{','.join(map(str, steps))}]" for name, steps in held.items())


def counts(ckpt: Checkpointer) -> str:
    c = ckpt.counters
    below = ckpt.tiers[1:]
    flushed = " ".join(f"{name}={c.flushed.get(name, 0)}" for name in below)
    passed = " ".join(f"{name}={c.passed_over.get(name, 0)}" for name in below)
    return f"flushed {flushed}; passed over {passed}"


def weights_digest(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for key, tensor in model.state_dict().items():
        digest.update(key.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def full_tiers(ckpt: Checkpointer) -> list[FlushError]:
    """The tiers whose latest failure was a full disk (ENOSPC) and that committed nothing since."""
    full = [e for e in ckpt.counters.last_error.values() if e.errno == errno.ENOSPC]
    if not full:
        return []
    held = steps_by_tier(ckpt)
    return [e for e in full if not any(s > (e.step or 0) for s in held.get(e.tier or "", []))]


def drain(ckpt: Checkpointer) -> list[FlushError]:
    """Wait for every due flush; returns the tiers whose disk is full (any other failure is raised)."""
    try:
        ckpt.wait_sync()
    except FlushError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        return full_tiers(ckpt) or [exc]
    return full_tiers(ckpt)


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def disk_full(failures: list[FlushError], ckpt: Checkpointer, step: int, args: argparse.Namespace) -> str:
    """What a full disk stopped, what each full tier needs and has, what is safe, and what to do."""
    lines = [f"stopped at step {step}: no space left on the disk of tier {', '.join(repr(e.tier) for e in failures)}"]
    smallest = []  # what keep {last: 1} needs on each tier: the one version kept and the one being written
    for e in failures:
        lines.append(f"  tier {e.tier!r} could not write step {e.step}: {e.strerror} ({e.filename})")
        space = e.space
        if space is None:
            continue
        if space.version_bytes is not None:
            lines.append(f"    a version needs {'about ' if space.estimated else ''}{mib(space.version_bytes)}")
            smallest.append(f"{mib(2 * space.version_bytes)} on tier {e.tier!r}")
        if space.keep_bytes is not None:
            at_least = "at least " if space.open_ended else ""
            kept = f"{space.kept} version{'s' if space.kept != 1 else ''} kept"
            lines.append(f"    keep {space.keep} needs {at_least}{mib(space.keep_bytes)}: {kept} and the one being written")
        lines.append(f"    free: {mib(space.free_bytes)} on the file system of {space.path}")
    durable = max((i for i in ckpt.versions() if i.path is not None), key=lambda i: i.step, default=None)
    if durable is None:
        lines.append("safe: no version was committed to disk yet, so none can be damaged; a run again starts from scratch")
    else:
        lines.append(
            f"safe: the committed versions stay whole (a failed write never deletes one): the newest on disk is"
            f" step {durable.step} (tier {durable.tier}), where a run again resumes"
        )
    config = shown(args.config)
    lower = f" (even keep: {{last: 1}} needs {', '.join(smallest)})" if smallest else ""
    lines += [
        "to go on, do one of these and run it again:",
        "  - free space on that file system",
        f"  - lower the tier's keep in {config} (--config){lower}",
        "  - point the tiers elsewhere: --dir on a file system with room (the demo puts every disk tier under --dir)",
    ]
    return "\n".join(lines)


def shown(path: Path) -> str:
    """``path`` as typed from here: relative when it is below the working directory."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def beside_python(name: str) -> str | None:
    """The command ``name`` installed beside this interpreter (``.venv/bin/tierckpt``), as typed from here."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        return None
    try:
        relative = str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)
    return relative if os.sep in relative else os.path.join(".", relative)


def timeline_hint(events: str) -> str:
    """How to draw ``events`` from here, in this interpreter's environment (which may lack matplotlib)."""
    tierckpt = beside_python("tierckpt") or f"{sys.executable} -m tierckpt"
    hint = f"events: {events} (draw them: {tierckpt} timeline {shlex.quote(events)} -o timeline.png)"
    if importlib.util.find_spec("matplotlib") is None:
        pip = beside_python("pip") or f"{sys.executable} -m pip"
        hint += f"\n  drawing needs matplotlib, which this environment lacks: {pip} install matplotlib"
    return hint


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bash scripts/demo.sh",
        description=__doc__.split("\n\n")[0],
        epilog=EXIT_STATUSES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=300, help="train until this step (default: 300)")
    parser.add_argument("--dir", type=Path, default=Path("checkpoints"), help="where the disk tiers live (default: ./checkpoints)")
    parser.add_argument("--config", type=Path, default=HERE / "tiers.yaml", help="tier config (default: examples/tiers.yaml)")
    parser.add_argument("--log-every", type=int, default=25, help="print progress every N steps (default: 25)")
    parser.add_argument("--tiny", action="store_true", help="a much smaller model and batch (for tests)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the corpus, the data order and the initial weights")
    parser.add_argument("--report", type=Path, help="write the final step, loss and a hash of the weights here (JSON)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.log_every < 1:
        parser.error("--steps and --log-every must be at least 1")
    return args


def continue_args(args: argparse.Namespace, steps: int) -> str:
    """The demo's arguments that train the same run on to ``steps``: ``--steps`` and the options it was given."""
    words = ["--steps", str(steps)]
    if args.dir != Path("checkpoints"):
        words += ["--dir", str(args.dir)]
    if args.config != HERE / "tiers.yaml":
        words += ["--config", str(args.config)]
    if args.tiny:
        words.append("--tiny")
    if args.seed:
        words += ["--seed", str(args.seed)]
    return shlex.join(words)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    size = TINY if args.tiny else DEFAULT
    torch.manual_seed(args.seed)
    data = Batches(make_corpus(args.seed), size.block, size.batch, args.seed)
    model = TinyGPT(len(VOCAB), size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3 if args.tiny else 1e-3, weight_decay=0.01)
    losses: list[float] = []
    step = 0
    parameters = sum(p.numel() for p in model.parameters())

    def training_state() -> dict[str, Any]:
        # Everything the next step depends on: weights, optimizer moments, the dropout RNG and the
        # position in the data. Tensors are referenced, not copied: save() copies them to host memory
        # on its own threads, and attach() makes optimizer.step() wait for that copy.
        return {
            "model": model.state_dict(),
            "optim": optimizer.state_dict(),
            "step": step,
            "rng": torch.get_rng_state(),
            "data": data.position(),
            "losses": losses[-100:],
        }

    save_times: list[float] = []
    started = time.perf_counter()
    config = load_config(args.config, args.dir)
    with Checkpointer(config) as ckpt:
        ckpt.attach(optimizer)
        print(f"model: {parameters / 1e6:.2f} M parameters, batch {size.batch} x {size.block} tokens; tiers: {' -> '.join(ckpt.tiers)} ({args.dir})")

        # The template's tensors (model weights) are overwritten in place; the optimizer state comes
        # back as new tensors, since a fresh optimizer has none yet.
        try:
            restored = ckpt.restore_latest_sync(template=training_state())
        except TierckptError as exc:  # e.g. checkpoints of the other model size (--tiny) in this --dir
            print(f"cannot resume from {args.dir}: {exc}\nuse another --dir, or the same model options as that run", file=sys.stderr)
            return 2
        if restored is None:
            print(f"no checkpoint found in {args.dir}: starting from scratch")
        else:
            state = restored.state
            optimizer.load_state_dict(state["optim"])
            torch.set_rng_state(state["rng"])
            data.seek(state["data"])
            losses = list(state["losses"])
            step = state["step"]
            last = f", loss {losses[-1]:.4f}" if losses else ""
            print(f"resumed from step {step} (tier {restored.tier}{last})")
            if step >= args.steps:
                print(f"training is complete at step {step} (--steps {args.steps}); to train on, run it again with more steps:")
                print(f"  bash scripts/demo.sh {continue_args(args, 2 * step)}")
                return 0

        print("every line: step, loss | the steps each tier holds now (the step just saved may still be in flight) | counters")
        model.train()
        interrupted = False
        try:
            while step < args.steps:
                inputs, targets = data.next()
                logits = model(inputs)
                loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()  # waits for the previous save's host copy (the lazy barrier)
                step += 1
                losses.append(loss.item())

                t0 = time.perf_counter()
                ckpt.save_sync(step, training_state(), metadata={"loss": losses[-1]})
                save_times.append(time.perf_counter() - t0)

                if step % args.log_every == 0 or step == args.steps:
                    print(f"step {step:4d}  loss {losses[-1]:.4f}  | {describe(steps_by_tier(ckpt))}  | {counts(ckpt)}", flush=True)
                if full_tiers(ckpt):
                    break  # a full disk stays full: every later flush to that tier would fail too
        except KeyboardInterrupt:
            print(f"\ninterrupted at step {step}: draining the flushes")
            interrupted = True

        train_s = time.perf_counter() - started
        full = drain(ckpt)  # every due flush done: what the tiers hold now is what a restart would find
        if full:
            print(disk_full(full, ckpt, step, args), file=sys.stderr)
            return EXIT_DISK_FULL
        if interrupted:
            newest = max((i.step for i in ckpt.versions() if i.path is not None), default=None)
            print(f"the newest checkpoint on disk is step {newest}: run again to resume from it")
            return 130
        held = steps_by_tier(ckpt)
        infos: list[VersionInfo] = ckpt.versions()
        print(f"done: step {step}, loss {losses[-1]:.4f}, {train_s:.1f} s ({len(save_times)} steps trained)")
        print("versions per tier:")
        for name, steps in held.items():
            nbytes = sum(i.nbytes for i in infos if i.tier == name)
            print(f"  {name:6s} {', '.join(map(str, steps)) or '-'}  ({nbytes / 2**20:.1f} MiB)")
        print(counts(ckpt))
        if save_times:
            slowest = max(range(len(save_times)), key=save_times.__getitem__)
            mean_ms, median_ms = 1e3 * statistics.fmean(save_times), 1e3 * statistics.median(save_times)
            print(
                f"save() call: mean {mean_ms:.2f} ms, median {median_ms:.2f} ms, max {1e3 * save_times[slowest]:.2f} ms"
                f" (step {step - len(save_times) + slowest + 1}) over {len(save_times)} saves"
            )

    # Closed: every flush drained. What survives this process is on the filesystem tiers.
    durable = [i for i in infos if i.path is not None]
    print("durable checkpoints:")
    for info in durable:
        print(f"  step {info.step:4d}  {info.tier:5s} {info.path}")
    if config.events is not None:
        print(timeline_hint(config.events))
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "step": step,
            "final_loss": losses[-1],
            "weights_sha256": weights_digest(model),
            "resumed_from": None if restored is None else restored.step,
            "versions": held,
            "save_ms": {"mean": 1e3 * statistics.fmean(save_times), "max": 1e3 * max(save_times)},
        }
        args.report.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
