"""Differential versions (``delta: {full_every: N}``) on a trained model's state saved every k steps, in one run.

The repository's GPT (gpt.py) trains with AdamW on a synthetic, learnable corpus (sequences counting up
mod vocab, as in compression.py), and its state, ``{"model": model.state_dict(), "optimizer":
optimizer.state_dict()}`` (fp32 weights, exp_avg, exp_avg_sq), is saved every k steps, k = 1, 10, 100,
each k into two filesystem tiers side by side: ``compression: {codec: zstd, level: 1, shuffle: true}``
alone, and the same plus ``delta: {full_every: 10}``. Three states:

- ``fp32``: full training from scratch, lr 1e-3 (compression.py's);
- ``fine-tune``: that trained model fine-tuned on another task (strides 17-32 instead of 1-16) with the
  first ~40% of its parameters (in module order) frozen, ``requires_grad=False``, so no AdamW moments
  for them (~18% of the checkpoint's bytes never change), a new AdamW at lr 1e-4 (a tenth of the
  pretraining rate, as fine-tunes usually take);
- ``bf16``: the fp32 run's state cast to bf16 at each save (weights and moments; the per-parameter
  ``step`` counters stay fp32): what a job keeping bf16 weights and moments would save. Casting keeps
  one training trajectory for both dtypes; a model trained in bf16 itself was not measured.

The k = 1 and k = 10 runs are the last ``--saves`` saves of the trajectory (ending at its last step),
k = 100 saves from step 100 on. Reported, per state and k: the stored bytes over the run's versions,
delta tier / compression alone, and per group (parameters, exp_avg, exp_avg_sq; for the fine-tune the
frozen parameters apart), from each version's manifest.

The same saves are also encoded in memory (no disk) with the tier's own codecs (``VersionEncoding``,
``tierckpt.xordelta.DeltaCodec``, the chunk rules of tierckpt/tiers/stored/write.py): each chunk whole,
and against earlier versions' logical bytes (for the implemented scheme, the tier's
``XorHistory`` too: no frame tried for a value whose frames did not pay lately; the alternatives try
every changed chunk). That gives the alternative the issue asks to measure,
each delta version against the *previous* version (chains up to N - 1 deep) against the *last whole*
version (depth 1, implemented), for N = 10 and 4; the in-memory "last whole, N = 10" must equal what
the tier stored (checked). And, of the k = 1 runs, the size of a delta against a whole version d saves
back, d = 1..saves - 1, from which the total for other N is estimated: why N = 10.

Then, on the fp32 state at its last step (S) and the step before (B): time to durable of a whole and of
a differential version of the same state (a tier with ``full_every: 2`` saving B, S, S, B, B, S, ...:
every other version whole, each delta one step of training from its base; the cost of one delta
version does not depend on N, the base being one whole version at any N), against the tier's write
limit measured in the same run (O_DIRECT writes + fsync from reused 16 MiB buffers, or from a
state-sized one, with the tier's 2 threads: machine_limits.limits); and restore of the delta and the
whole version of S by a new Checkpointer right after construction, page cache dropped first. Beside
them: the process's CPU time a save (divided by the cores: how fast this host's CPU alone would let
the version go), and the bytes a restore reads (a delta version's chunks, and its base's chunks under
each reference or frame): the disk's share of a restore's time grows by that ratio.

The goals of the issue are printed as met / not met, as measured. Results: a JSON file in
benchmarks/results/ and a section appended to RESULTS.md (``--quick``: a small model, few saves,
results under ``--dir`` only).

    flock /tmp/tierckpt-bench.lock .venv/bin/python benchmarks/delta.py
    .venv/bin/python benchmarks/delta.py --quick

Full run: 7.9 M parameters (95 MB of fp32 state; 4×16 tokens a step keep a step at ~0.07 s), 1,000 +
500 training steps at one torch thread, 50 saves of the fp32 and bf16 states and 45 of the fine-tune,
each into two tiers: 194 s on a shared 2-core machine (--quick: ~15 s).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import dataclasses
import gc
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F

import common
from gpt import GPT, ModelSize
from machine_limits import drop_caches, limits, machine
from tierckpt import Checkpointer
from tierckpt.config import CompressionConfig
from tierckpt.format import CHUNK_BYTES, MANIFEST_FILE, Manifest, version_dirname
from tierckpt.tiers.stored.encoding import TierEncoding
from tierckpt.xordelta import DeltaCodec, XorHistory, digest

HERE = Path(__file__).resolve().parent
TIER_CODEC = {"codec": "zstd", "level": 1, "shuffle": True}
TIER = "tier"  # InMemory.sizes: the implemented scheme's chunks, as the tier chose them
FULL_EVERY = 10  # the N the tier runs with (see the module docstring and the report: why 10)
ALSO_N = 4  # measured in memory beside it
ESTIMATE_N = (2, 4, 6, 8, 10, 15, 20)
IO_THREADS = 2
GROUPS = ("parameters", "frozen parameters", "exp_avg", "exp_avg_sq", "other")
GOALS = {"fine-tune": 0.75, "fp32": 0.90}  # stored bytes, delta / compression alone, saved every step
RESTORE_GOAL = 1.3  # delta restore / whole restore
CORES = os.cpu_count() or 1
SAVE_GOAL = 0.85  # logical bytes/s to durable of a delta version / the write limit

FULL = ModelSize(vocab=1024, d_model=384, layers=4, heads=6, block=16, batch=4)  # 7.9 M parameters, ~0.07 s a step
QUICK = ModelSize(vocab=256, d_model=64, layers=2, heads=4, block=16, batch=4)  # 0.1 M parameters


# -- training ------------------------------------------------------------------------------------------


class Trainer:
    """AdamW on sequences counting up mod vocab (random start, stride in ``strides``: learnable)."""

    def __init__(self, size: ModelSize, model: GPT, lr: float, strides: tuple[int, int], seed: int) -> None:
        self.size, self.model = size, model
        self.trained = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trained, lr=lr, weight_decay=0.1)
        self.generator = torch.Generator().manual_seed(seed)
        self.strides = strides
        self.positions = torch.arange(size.block + 1)
        self.steps = 0
        self.losses: list[float] = []
        self.train_s = 0.0

    def step(self) -> None:
        t = time.perf_counter()
        size = self.size
        start = torch.randint(size.vocab, (size.batch, 1), generator=self.generator)
        stride = torch.randint(*self.strides, (size.batch, 1), generator=self.generator)
        rows = (start + stride * self.positions) % size.vocab
        loss = F.cross_entropy(self.model(rows[:, :-1]).flatten(0, 1), rows[:, 1:].flatten())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.losses.append(loss.item())
        self.steps += 1
        self.train_s += time.perf_counter() - t

    def state(self) -> dict[str, Any]:
        """What a training job checkpoints: views of the live tensors (the save copies them)."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def summary(self) -> dict[str, Any]:
        n = min(10, len(self.losses))
        return {"steps": self.steps, "train_s": self.train_s, "loss_first10": statistics.mean(self.losses[:n]), "loss_last10": statistics.mean(self.losses[-n:])}


def freeze_prefix(model: GPT, fraction: float) -> list[str]:
    """Freeze the first parameters in module order (embeddings, then the lowest blocks), as many as
    bring their count closest to ``fraction`` of all; returns their names."""
    named = list(model.named_parameters())
    counts = [0, *itertools.accumulate(p.numel() for _, p in named)]
    n = min(range(len(counts)), key=lambda i: abs(counts[i] - fraction * counts[-1]))
    for _, p in named[:n]:
        p.requires_grad_(False)
    return [name for name, _ in named[:n]]


def cast_bf16(state: dict[str, Any]) -> dict[str, Any]:
    """Weights and moments in bf16; AdamW's per-parameter ``step`` stays as it is (a counter)."""

    def walk(value: Any, key: Any = None) -> Any:
        if isinstance(value, dict):
            return {k: walk(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, torch.Tensor) and value.is_floating_point() and key != "step":
            return value.to(torch.bfloat16)
        return value

    return walk(state)


def flat(value: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a state with its key, spelled as the tier's records spell them (``['model']['w']``)."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from flat(v, f"{prefix}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from flat(v, f"{prefix}[{i}]")
    elif isinstance(value, torch.Tensor):
        yield prefix, value


def template_of(value: Any) -> Any:
    """The same structure, each tensor a new zeroed one (a freshly built job's state, touched)."""
    if isinstance(value, dict):
        return {k: template_of(v) for k, v in value.items()}
    if isinstance(value, list):
        return [template_of(v) for v in value]
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    return value


def nbytes_of(state: Any) -> int:
    return sum(t.numel() * t.element_size() for _, t in flat(state))


def same_bytes(a: Any, b: Any) -> bool:
    pa, pb = dict(flat(a)), dict(flat(b))
    return pa.keys() == pb.keys() and all(torch.equal(pa[k].reshape(-1).view(torch.uint8), pb[k].reshape(-1).view(torch.uint8)) for k in pa)


class Groups:
    """Which group a record's key belongs to."""

    def __init__(self, frozen: list[str]) -> None:
        self.frozen = {f"['model'][{n!r}]" for n in frozen}

    def __call__(self, key: str) -> str:
        if key.endswith("['exp_avg_sq']"):
            return "exp_avg_sq"
        if key.endswith("['exp_avg']"):
            return "exp_avg"
        if key.startswith("['model']"):
            return "frozen parameters" if key in self.frozen else "parameters"
        return "other"


# -- in memory: the same chunks, encoded as the tier encodes them ------------------------------------------


@dataclasses.dataclass
class Piece:
    """One chunk of a saved version's logical bytes (a copy), as the tier cuts it."""

    group: str
    itemsize: int
    floating: bool
    data: np.ndarray
    digest: bytes


def pieces_of(state: Any, groups: Groups) -> dict[tuple[str, int], Piece]:
    out = {}
    for key, t in flat(state):
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().copy()
        for i, start in enumerate(range(0, max(raw.nbytes, 1), CHUNK_BYTES)):
            data = raw[start : start + CHUNK_BYTES]
            out[(key, i)] = Piece(groups(key), t.element_size(), t.is_floating_point(), data, digest(data.data))
    return out


class InMemory:
    """A run's saves encoded in memory: each chunk whole (the tier's compression alone) and against
    earlier saves (the tier's rules: equal digest → a reference of 0 bytes; a changed floating chunk
    → its XOR frame where that is min_ratio smaller than the base chunk stored whole; else whole).

    ``sizes[i][j]``: stored bytes of save ``i`` per chunk against save ``j`` (``None``: whole), and
    how (``whole``, ``ref``, ``delta``); only the bases some scheme uses are encoded."""

    def __init__(self, pool: concurrent.futures.Executor, saves: int) -> None:
        self.pool = pool
        self.saves = saves
        self.tier = TierEncoding(CompressionConfig(**TIER_CODEC), "memory")
        self.codec = DeltaCodec(level=TIER_CODEC["level"], min_ratio=1.05)
        self.kept: dict[int, dict[tuple[str, int], Piece]] = {}
        self.sizes: list[dict[Any, dict[tuple[str, int], tuple[int, str]]]] = []
        self.history = XorHistory()  # the tier's, for the implemented scheme
        self.groups: dict[tuple[str, int], str] = {}
        self.encode_s = 0.0

    @staticmethod
    def bases(i: int) -> set[int]:
        """The saves save ``i`` is encoded against: the previous one, the last whole one at N = 10 and
        at N = 4, and save 0 (a delta d = i saves from a whole version)."""
        return {j for j in (i - 1, FULL_EVERY * (i // FULL_EVERY), ALSO_N * (i // ALSO_N), 0) if 0 <= j < i}

    def add(self, pieces: dict[tuple[str, int], Piece]) -> None:
        t = time.perf_counter()
        i = len(self.sizes)
        version = self.tier.begin()

        def whole(key: tuple[str, int]) -> tuple[int, str]:
            p = pieces[key]
            codec = "zstd+shuffle" if p.floating and p.itemsize >= 2 else "zstd"
            _, out = version.encode(codec, p.data.data, p.itemsize)
            return out.nbytes, "whole"

        keys = list(pieces)
        entry: dict[Any, dict[tuple[str, int], tuple[int, str]]] = {None: dict(zip(keys, self.pool.map(whole, keys)))}
        for j in sorted(self.bases(i)):
            base = self.kept[j]

            def against(key: tuple[str, int], base: dict[tuple[str, int], Piece] = base) -> tuple[int, str]:
                p, b = pieces[key], base.get(key)
                if b is None or b.data.nbytes != p.data.nbytes:
                    return entry[None][key]
                if b.digest == p.digest:
                    return 0, "ref"
                if p.floating and p.itemsize >= 2:
                    # The tier's rule: against what the base chunk takes stored whole.
                    frame = self.codec.encode(p.data.data, b.data.data, p.itemsize, ceiling=self.sizes[j][None][key][0])
                    if frame is not None:
                        return frame.nbytes, "delta"
                return entry[None][key]

            entry[j] = dict(zip(keys, self.pool.map(against, keys)))
        if i % FULL_EVERY:
            entry[TIER] = self.as_the_tier(pieces, entry, FULL_EVERY * (i // FULL_EVERY))
        self.sizes.append(entry)
        for key, p in pieces.items():
            self.groups[key] = p.group
        self.kept[i] = pieces
        later = set().union(*(self.bases(n) for n in range(i + 1, self.saves)))
        self.kept = {j: v for j, v in self.kept.items() if j in later}
        self.encode_s += time.perf_counter() - t

    def as_the_tier(self, pieces: dict[tuple[str, int], Piece], entry: dict[Any, dict[tuple[str, int], tuple[int, str]]], j: int) -> dict[tuple[str, int], tuple[int, str]]:
        """The chunks against save ``j`` as the tier stores them: no frame tried for a value whose
        frames did not pay lately (its ``XorHistory``, followed here version by version)."""
        base = self.kept[j]
        out = {}
        paid: dict[str, bool] = {}
        for key, (stored, how) in entry[j].items():
            p, b = pieces[key], base.get(key)
            tried = p.floating and p.itemsize >= 2 and b is not None and b.data.nbytes == p.data.nbytes and b.digest != p.digest
            if tried and not self.history.worth_trying(key[0]):
                out[key] = entry[None][key]
                continue
            if tried:
                paid[key[0]] = paid.get(key[0], False) or how == "delta"
            out[key] = (stored, how)
        self.history.finish(paid)
        return out

    def per_group(self, i: int, j: Any, *, smaller: bool = False) -> dict[str, int]:
        """Stored bytes of save ``i`` against save ``j`` by group; ``smaller``: each delta frame
        replaced by the chunk stored whole where that is smaller."""
        out = {g: 0 for g in GROUPS}
        whole = self.sizes[i][None]
        for key, (stored, how) in self.sizes[i][j].items():
            out[self.groups[key]] += min(stored, whole[key][0]) if smaller and how == "delta" else stored
        return out

    def scheme(self, n: int, against: str, *, smaller: bool = False) -> dict[str, Any]:
        """Stored bytes of the run under one scheme: whole every ``n``-th save, the others against
        the last whole one (``against="whole"``) or the previous one (``"previous"``)."""
        total = {g: 0 for g in GROUPS}
        depth = 0
        for i in range(len(self.sizes)):
            j = None if i % n == 0 else (n * (i // n) if against == "whole" else i - 1)
            depth = max(depth, 0 if j is None else (1 if against == "whole" else i % n))
            which = TIER if j is not None and (n, against) == (FULL_EVERY, "whole") else j
            for g, v in self.per_group(i, which, smaller=smaller).items():
                total[g] += v
        return {"n": n, "against": against, "smaller": smaller, "stored": sum(total.values()), "groups": total, "max_chain": depth}

    def distance(self) -> list[dict[str, Any]]:
        """Of each save i >= 1: its delta against save 0 (a whole version i saves back), over its whole size."""
        rows = []
        for i in range(1, len(self.sizes)):
            whole = sum(s for s, _ in self.sizes[i][None].values())
            delta = sum(s for s, _ in self.sizes[i][0].values())
            rows.append({"d": i, "whole": whole, "delta": delta, "ratio": delta / whole})
        return rows

    def frames_larger(self) -> dict[str, int]:
        """Delta frames (against the last whole, N = 10) larger than the chunk stored whole: the tier
        keeps a frame that is min_ratio smaller than the *base* chunk stored whole, which stands for
        this chunk's whole size without encoding it twice."""
        count = extra = frames = 0
        for i in range(len(self.sizes)):
            if i % FULL_EVERY == 0:
                continue
            for key, (stored, how) in self.sizes[i][TIER].items():
                whole = self.sizes[i][None][key][0]
                frames += how == "delta"
                if how == "delta" and stored > whole:
                    count += 1
                    extra += stored - whole
        return {"chunks": count, "frames": frames, "extra_bytes": extra}


def estimate(distance: list[dict[str, Any]], n: int) -> float | None:
    """Stored bytes of a cycle of ``n`` (one whole, n - 1 deltas at d = 1..n-1) over n whole versions,
    from the measured delta/whole ratios at each distance; None beyond the distances measured."""
    if n - 1 > len(distance):
        return None
    return (1 + sum(r["ratio"] for r in distance[: n - 1])) / n


# -- the tiers: compression alone, and with delta ------------------------------------------------------------


def tier_config(directory: Path, nbytes: int, delta: dict[str, Any] | None, *, ram: bool = True, keep: int = 1) -> dict[str, Any]:
    settings: dict[str, Any] = {"compression": TIER_CODEC} | ({"delta": delta} if delta else {})
    disk = common.disk_tier(directory, keep={"last": keep}, io_threads=IO_THREADS, **settings)
    if not ram:  # restore only: a new job reading what the disk holds
        return {"host": {"capacity": 64 << 20, "snapshots": 1}, "tiers": [disk]}
    return common.tier_config(disk, capacity=nbytes + (64 << 20), snapshots=1, ram=common.ram_tier(keep={"last": 1}))


class TierRun:
    """One state saved every k steps into a tier with compression alone and one with delta."""

    def __init__(self, work: Path, name: str, nbytes: int, groups: Groups, saves: int, pool: concurrent.futures.Executor) -> None:
        self.name, self.groups = name, groups
        self.dirs = {"alone": work / f"{name}-alone", "delta": work / f"{name}-delta"}
        self.ckpts = {}
        for tier, d in self.dirs.items():
            shutil.rmtree(d, ignore_errors=True)
            self.ckpts[tier] = Checkpointer(tier_config(d, nbytes, {"full_every": FULL_EVERY} if tier == "delta" else None))
        self.versions: list[dict[str, Any]] = []
        self.memory = InMemory(pool, saves)
        self.stats: dict[str, Any] = {}

    def save(self, step: int, state: Any) -> None:
        row: dict[str, Any] = {"step": step, "logical": nbytes_of(state)}
        for tier, ckpt in self.ckpts.items():
            t = time.perf_counter()
            assert ckpt.save_sync(step, state).committed_sync("disk")
            row[f"{tier}_durable_s"] = time.perf_counter() - t
            manifest = Manifest.decode((self.dirs[tier] / version_dirname(step) / MANIFEST_FILE).read_bytes())
            groups = {g: {"logical": 0, "stored": 0, "ref": 0, "delta": 0, "chunks": 0} for g in GROUPS}
            for r in manifest.records:
                cell = groups[self.groups(r.key)]
                cell["logical"] += r.nbytes
                cell["stored"] += r.stored
                for i in range(len(r.chunks)):
                    how = r.chunk_codec(i)
                    cell["chunks"] += 1
                    if how in ("ref", "delta"):
                        cell[how] += 1
            row[tier] = groups
            if tier == "delta":
                info = next(v for v in ckpt.versions() if v.tier == "disk" and v.step == step)
                row["base"], row["chain"] = info.base, info.chain
        self.versions.append(row)
        self.memory.add(pieces_of(state, self.groups))

    def close(self) -> None:
        for tier, ckpt in self.ckpts.items():
            s = ckpt.counters.compression["disk"]
            self.stats[tier] = {**dataclasses.asdict(s), "ratio": s.ratio}
            ckpt.close_sync()
            shutil.rmtree(self.dirs[tier], ignore_errors=True)

    def result(self) -> dict[str, Any]:
        def total(tier: str, rows: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
            out = {g: {"logical": 0, "stored": 0, "ref": 0, "delta": 0, "chunks": 0} for g in GROUPS}
            for row in rows:
                for g, cell in row[tier].items():
                    for k, v in cell.items():
                        out[g][k] += v
            return out

        deltas = [r for r in self.versions if r["base"] is not None]
        memory = self.memory
        schemes = [memory.scheme(n, against) for n in (FULL_EVERY, ALSO_N) for against in ("whole", "previous")]
        schemes.append(memory.scheme(FULL_EVERY, "whole", smaller=True))
        return {
            "versions": self.versions,
            "schedule": [(r["step"], r["base"], r["chain"]) for r in self.versions],
            "alone": total("alone", self.versions),
            "delta": total("delta", self.versions),
            "alone_on_delta_versions": total("alone", deltas),
            "delta_on_delta_versions": total("delta", deltas),
            "stats": self.stats,
            "memory": {
                "whole": sum(sum(memory.per_group(i, None).values()) for i in range(len(memory.sizes))),
                "schemes": schemes,
                "distance": memory.distance(),
                "frames_larger_than_whole": memory.frames_larger(),
                "encode_s": memory.encode_s,
            },
        }


def ratio(result: dict[str, Any], group: str | None = None, on: str = "") -> float | None:
    alone, delta = result["alone" + on], result["delta" + on]
    a = sum(c["stored"] for c in alone.values()) if group is None else alone[group]["stored"]
    d = sum(c["stored"] for c in delta.values()) if group is None else delta[group]["stored"]
    return d / a if a else None


# -- save and restore time of one delta version against a whole one --------------------------------------------


def bytes_read(directory: Path, step: int) -> int:
    """What a restore of ``step`` reads from the tier: its chunks' stored bytes, and of each chunk
    stored against a base chunk (a reference or a frame), the base chunk's."""
    manifest = Manifest.decode((directory / version_dirname(step) / MANIFEST_FILE).read_bytes())
    chunks = [c for r in manifest.records for c in r.chunks if c is not None]
    return sum(c.stored + (c.base.stored if c.base is not None else 0) for c in chunks)


def timing(work: Path, before: Any, after: Any, versions: int, repeats: int, cold: bool) -> dict[str, Any]:
    """Durable time of whole and delta versions of the same two states, and restore of each kind of
    the same state (``after``) by a new Checkpointer right after construction."""
    nbytes = nbytes_of(after)
    out: dict[str, Any] = {"logical": nbytes}
    # Compression alone: B, S, B, S, ...; the first version warms code paths.
    directory = work / "timing"
    shutil.rmtree(directory, ignore_errors=True)
    alone: list[float] = []
    cpu: dict[str, list[float]] = {"alone_cpu_s": [], "whole_cpu_s": [], "delta_cpu_s": []}  # the process's CPU time a version
    with Checkpointer(tier_config(directory, nbytes, None)) as ckpt:
        for i in range(versions):
            t, c = time.perf_counter(), time.process_time()
            assert ckpt.save_sync(i + 1, after if i % 2 else before).committed_sync("disk")
            alone.append(time.perf_counter() - t)
            cpu["alone_cpu_s"].append(time.process_time() - c)
    shutil.rmtree(directory)
    # full_every 2: B, S, S, B, B, S, ...: whole at even i, delta at odd i (against the other state).
    pattern = [before if ((i + 1) // 2) % 2 == 0 else after for i in range(versions)]
    whole: list[float] = []
    delta: list[float] = []
    schedule: list[tuple[int, int | None]] = []
    with Checkpointer(tier_config(directory, nbytes, {"full_every": 2})) as ckpt:
        for i, state in enumerate(pattern):
            t, c = time.perf_counter(), time.process_time()
            assert ckpt.save_sync(i + 1, state).committed_sync("disk")
            (delta if i % 2 else whole).append(time.perf_counter() - t)
            cpu["delta_cpu_s" if i % 2 else "whole_cpu_s"].append(time.process_time() - c)
            info = next(v for v in ckpt.versions() if v.tier == "disk" and v.step == i + 1)
            schedule.append((i + 1, info.base))
    shutil.rmtree(directory)
    assert [b for _, b in schedule] == [None if i % 2 == 0 else i for i in range(versions)], schedule
    out.update(alone_durable_s=alone[1:], whole_durable_s=whole[1:], delta_durable_s=delta, schedule=schedule)
    out.update(alone_cpu_s=cpu["alone_cpu_s"][1:], whole_cpu_s=cpu["whole_cpu_s"][1:], delta_cpu_s=cpu["delta_cpu_s"])
    # Restore: step 1 B whole, step 2 S against it, step 3 S whole.
    with Checkpointer(tier_config(directory, nbytes, {"full_every": 2}, keep=3)) as ckpt:
        for step, state in ((1, before), (2, after), (3, after)):
            assert ckpt.save_sync(step, state).committed_sync("disk")
        kinds = {v.step: v.base for v in ckpt.versions() if v.tier == "disk"}
    assert kinds == {1: None, 2: 1, 3: None}, kinds
    out["read_bytes"] = {"delta": bytes_read(directory, 2), "whole": bytes_read(directory, 3)}
    restore: dict[str, list[float]] = {"delta_template_s": [], "whole_template_s": [], "delta_new_s": [], "whole_new_s": []}
    for r in range(repeats):
        order = (("delta", 2), ("whole", 3)) if r % 2 == 0 else (("whole", 3), ("delta", 2))
        for into in ("template", "new"):
            for kind, step in order:
                template = template_of(after) if into == "template" else None
                if cold:
                    drop_caches()
                ckpt = Checkpointer(tier_config(directory, nbytes, {"full_every": 2}, ram=False, keep=3))
                t = time.perf_counter()
                restored = ckpt.restore_sync(step, template)
                restore[f"{kind}_{into}_s"].append(time.perf_counter() - t)
                ckpt.close_sync()
                if not same_bytes(restored.state, after):
                    raise AssertionError(f"restore of the {kind} version changed the state")
                del restored, template
    shutil.rmtree(directory)
    out.update(restore)
    return out


# -- reporting ----------------------------------------------------------------------------------------------


def mb(n: float) -> str:
    return f"{n / 1e6:,.1f}"


def fmt(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def stored_table(runs: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        f"| state | k | versions: whole + delta | logical MB / version | zstd+shuffle alone: stored MB | + delta (N = {FULL_EVERY}): stored MB "
        "| **delta / alone** | delta / alone, delta versions only | chunks of delta versions: ref / delta / other "
        "| parameters | frozen parameters | exp_avg | exp_avg_sq |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for name, r in runs.items():
        versions = r["versions"]
        wholes = sum(1 for v in versions if v["base"] is None)
        on = r["delta_on_delta_versions"]
        ref, dl, chunks = (sum(c[k] for c in on.values()) for k in ("ref", "delta", "chunks"))
        alone, delta = (sum(c["stored"] for c in r[t].values()) for t in ("alone", "delta"))
        groups = [fmt(ratio(r, g)) for g in ("parameters", "frozen parameters", "exp_avg", "exp_avg_sq")]
        lines.append(
            f"| {r['state']} | {r['k']} | {wholes} + {len(versions) - wholes} | {mb(versions[0]['logical'])} | {mb(alone)} | {mb(delta)} "
            f"| **{fmt(ratio(r), 3)}** | {fmt(ratio(r, on='_on_delta_versions'), 3)} | {ref} / {dl} / {chunks - ref - dl} | " + " | ".join(groups) + " |"
        )
    return lines + [""]


def memory_table(runs: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        "| state | k | saves | N = 10, against the last whole (implemented; depth 1) | N = 10, against the previous (depth ≤ 9) "
        "| N = 4, last whole | N = 4, previous | in memory = tier? | delta frames larger than the chunk whole "
        "| N = 10, last whole, the smaller of frame and whole |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for r in runs.values():
        m = r["memory"]
        by = {(s["n"], s["against"], s["smaller"]): s["stored"] / m["whole"] for s in m["schemes"]}
        tier_alone = sum(c["stored"] for c in r["alone"].values())
        tier_delta = sum(c["stored"] for c in r["delta"].values())
        mine = next(s["stored"] for s in m["schemes"] if (s["n"], s["against"], s["smaller"]) == (FULL_EVERY, "whole", False))
        check = "yes" if (mine, m["whole"]) == (tier_delta, tier_alone) else f"no: delta {mine} vs {tier_delta}, alone {m['whole']} vs {tier_alone}"
        larger = m["frames_larger_than_whole"]
        lines.append(
            f"| {r['state']} | {r['k']} | {len(r['versions'])} | {by[(FULL_EVERY, 'whole', False)]:.3f} | {by[(FULL_EVERY, 'previous', False)]:.3f} "
            f"| {by[(ALSO_N, 'whole', False)]:.3f} | {by[(ALSO_N, 'previous', False)]:.3f} | {check} "
            f"| {larger['chunks']} of {larger['frames']} ({mb(larger['extra_bytes'])} MB more) | {by[(FULL_EVERY, 'whole', True)]:.3f} |"
        )
    return lines + [""]


def distance_table(runs: dict[str, dict[str, Any]]) -> list[str]:
    """Of the k = 1 runs: a delta d saves from its base, over the version whole; and the totals for other N."""
    ones = [r for r in runs.values() if r["k"] == 1]
    ds = [1, 2, 3, 5, 9, 14, 19]
    lines = [
        "| state, k = 1 | " + " | ".join(f"d = {d}" for d in ds) + " | " + " | ".join(f"est. N = {n}" for n in ESTIMATE_N) + " |",
        "| --- |" + " ---: |" * (len(ds) + len(ESTIMATE_N)),
    ]
    for r in ones:
        dist = r["memory"]["distance"]
        cells = [fmt(dist[d - 1]["ratio"], 3) if d <= len(dist) else "–" for d in ds]
        cells += [fmt(estimate(dist, n), 3) for n in ESTIMATE_N]
        lines.append(f"| {r['state']} | " + " | ".join(cells) + " |")
    return lines + [""]


def durable_table(runs: dict[str, dict[str, Any]]) -> list[str]:
    """Save → durable in the training runs (k = 1), medians: each tier's versions as they came."""
    lines = [
        "| state, k = 1 | compression alone | delta tier, whole versions | delta tier, delta versions | delta / alone |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in (r for r in runs.values() if r["k"] == 1):
        v = r["versions"]
        alone = statistics.median(x["alone_durable_s"] for x in v)
        whole = statistics.median(x["delta_durable_s"] for x in v if x["base"] is None)
        delta = statistics.median(x["delta_durable_s"] for x in v if x["base"] is not None)
        lines.append(f"| {r['state']} ({mb(v[0]['logical'])} MB) | {alone:.3f} s | {whole:.3f} s | {delta:.3f} s | {delta / alone:.2f}× |")
    return lines + [""]


def findings(runs: dict[str, dict[str, Any]]) -> list[str]:
    """The two choices the runs inform, said with their numbers (k = 1 runs)."""
    ones = [r for r in runs.values() if r["k"] == 1]
    lines = []
    for r in ones:
        m = r["memory"]
        by = {(x["n"], x["against"], x["smaller"]): x["stored"] / m["whole"] for x in m["schemes"]}
        est = {n: estimate(m["distance"], n) for n in ESTIMATE_N}
        best = min((n for n in est if est[n] is not None), key=lambda n: est[n])  # type: ignore[arg-type, return-value]
        lines.append(
            f"- {r['state']}, k = 1: against the previous version {by[(FULL_EVERY, 'previous', False)]:.3f}, against the last whole "
            f"{by[(FULL_EVERY, 'whole', False)]:.3f} (N = {FULL_EVERY}); the smallest estimated cycle is N = {best} ({est[best]:.3f}), "
            f"N = {FULL_EVERY}: {fmt(est[FULL_EVERY], 3)}, N = {ALSO_N}: {fmt(est[ALSO_N], 3)}."
        )
    return lines + [""]


def timing_table(t: dict[str, Any], limit_s: float, limit_name: str) -> list[str]:
    gb = t["logical"] / 1e9
    med = {k: statistics.median(v) for k, v in t.items() if k.endswith("_s") and isinstance(v, list)}
    lines = [
        f"| measure ({mb(t['logical'])} MB logical) | seconds (median) | logical GB/s | % of the write limit | delta / whole |",
        "| --- | ---: | ---: | ---: | ---: |",
        f"| write limit: {limit_name} | {limit_s:.4f} | {gb / limit_s:.2f} | 100% | |",
    ]
    for label, key, base in (
        ("save → durable, compression alone (whole)", "alone_durable_s", None),
        ("save → durable, delta tier, whole version (digests kept)", "whole_durable_s", None),
        ("save → durable, delta tier, delta version (one step from its base)", "delta_durable_s", "whole_durable_s"),
    ):
        rel = f"{med[key] / med[base]:.2f}×" if base else ""
        lines.append(f"| {label} | {med[key]:.4f} | {gb / med[key]:.2f} | {100 * limit_s / med[key]:.0f}% | {rel} |")
    for label, key in (("compression alone", "alone_cpu_s"), ("delta tier, whole version", "whole_cpu_s"), ("delta tier, delta version", "delta_cpu_s")):
        # At most os.cpu_count() cores work at once: the fastest this host could save the version.
        floor = med[key] / CORES
        lines.append(
            f"| CPU time of the process a save, {label} (÷ {CORES} cores: the CPU's floor) | {med[key]:.4f} ({floor:.4f}) | "
            f"{gb / floor:.2f} | {100 * limit_s / floor:.0f}% | |"
        )
    read = t["read_bytes"]
    lines.append(f"| a restore reads (stored bytes, the base's chunks included), MB: whole / delta version | {mb(read['whole'])} / {mb(read['delta'])} | | | {read['delta'] / read['whole']:.2f}× |")
    for into, label in (("template", "into a template"), ("new", "new tensors")):
        for kind in ("whole", "delta"):
            key = f"{kind}_{into}_s"
            rel = f"{med[key] / med[f'whole_{into}_s']:.2f}×" if kind == "delta" else ""
            lines.append(f"| restore {label}, new Checkpointer, cold cache: {kind} version | {med[key]:.4f} | {gb / med[key]:.2f} | | {rel} |")
    return lines + [""]


def goals(runs: dict[str, dict[str, Any]], t: dict[str, Any], limit_s: float) -> tuple[list[str], dict[str, Any]]:
    med = {k: statistics.median(v) for k, v in t.items() if k.endswith("_s") and isinstance(v, list)}
    verdicts: dict[str, Any] = {}
    lines = ["| goal (issue) | measured | verdict |", "| --- | --- | --- |"]

    def row(name: str, text: str, measured: str, ok: bool) -> None:
        verdicts[name] = {"measured": measured, "met": ok}
        lines.append(f"| {text} | {measured} | {'met' if ok else 'NOT met'} |")

    for state, goal in GOALS.items():
        r = runs.get(f"{state} k=1")
        if r is not None:
            x = ratio(r)
            assert x is not None
            label = "frozen-40% fine-tune" if state == "fine-tune" else "full fp32 AdamW"
            row(f"{state} k=1", f"{label} saved every step: stored ≤ {goal:.2f}× of zstd+shuffle alone", f"{x:.3f}× ({len(r['versions'])} versions)", x <= goal)
    read = t["read_bytes"]["delta"] / t["read_bytes"]["whole"]
    for into in ("template", "new"):
        x = med[f"delta_{into}_s"] / med[f"whole_{into}_s"]
        label = "into a template" if into == "template" else "new tensors"
        row(f"restore {into}", f"restore of a delta version ≤ {RESTORE_GOAL}× a whole one ({label})", f"{x:.2f}× (it reads {read:.2f}× the bytes)", x <= RESTORE_GOAL)
    for key, text in (("delta", "save of a delta version"), ("whole", "(beside it) a whole version of the delta tier")):
        share = limit_s / med[f"{key}_durable_s"]
        floor = limit_s / (med[f"{key}_cpu_s"] / CORES)  # the share if the CPU time were spread on every core
        measured = f"{share:.0%} (its CPU time on {CORES} cores: {floor:.0%})"
        row(f"save {key}" if key == "whole" else "save", f"{text} ≥ {SAVE_GOAL:.0%} of the write limit (logical bytes)", measured, share >= SAVE_GOAL)
    return lines + [""], verdicts


# -- the run -------------------------------------------------------------------------------------------------


def plan(end: int, k: int, saves: int) -> list[int]:
    """Steps of ``saves`` saves every ``k`` steps ending at step ``end``."""
    return [end - k * (saves - 1 - i) for i in range(saves) if end - k * (saves - 1 - i) > 0]


def train_and_save(
    trainer: Trainer, work: Path, variants: dict[str, Any], schedule: dict[int, int], groups: Groups, pool: concurrent.futures.Executor,
    keep_last: int = 0,
) -> tuple[dict[str, dict[str, Any]], list[Any]]:
    """Train to the last planned step, saving each variant's state at each k's steps; returns the runs
    (``"<variant> k=<k>"``) and copies of the last ``keep_last`` fp32 states."""
    end = max(k * n for k, n in schedule.items())
    steps = {k: plan(end, k, n) for k, n in schedule.items()}
    runs: dict[str, TierRun] = {}  # made at their first save, when the optimizer's state exists
    last: list[Any] = []
    saved_s = 0.0
    started = time.perf_counter()
    for step in range(1, end + 1):
        trainer.step()
        due = [k for k, s in steps.items() if step in s]
        if due:
            t = time.perf_counter()
            state = trainer.state()
            for name, convert in variants.items():
                converted = convert(state)
                for k in due:
                    label = f"{name} k={k}"
                    if label not in runs:
                        runs[label] = TierRun(work, f"{name}-k{k}", nbytes_of(converted), groups, len(steps[k]), pool)
                    runs[label].save(step, converted)
            saved_s += time.perf_counter() - t
        if step > end - keep_last:
            last.append(copy.deepcopy(trainer.state()))
        if step % 100 == 0 or step == end:
            print(f"  step {step}/{end}: loss {trainer.losses[-1]:.2f}, {time.perf_counter() - started:.0f} s (saves {saved_s:.0f} s)", flush=True)
    results = {}
    for name, run in runs.items():
        run.close()
        results[name] = {"state": name.split(" k=")[0], "k": int(name.split("k=")[1]), **run.result()}
    return results, last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model and few saves (~30 s); results under --dir only")
    parser.add_argument("--saves", type=int, default=None, help="saves of the k = 1 and k = 10 runs (default 20; --quick: 12)")
    parser.add_argument("--saves-100", type=int, default=None, help="saves of the fp32/bf16 k = 100 run (default 10; --quick: 3)")
    parser.add_argument("--finetune-saves-100", type=int, default=None, help="saves of the fine-tune's k = 100 run (default 5; --quick: 2)")
    parser.add_argument("--versions", type=int, default=None, help="versions of each timed save sequence (default 9; --quick: 5)")
    parser.add_argument("--repeats", type=int, default=None, help="restores of each kind (default 5; --quick: 2)")
    parser.add_argument("--dir", type=Path, default=None, help="a directory on the disk to measure (default: a new one under /tmp)")
    parser.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    parser.add_argument("--json", type=Path, default=None, help="default: benchmarks/results/delta-<time>.json")
    args = parser.parse_args()
    size = QUICK if args.quick else FULL
    saves = args.saves or (12 if args.quick else 20)
    saves_100 = args.saves_100 or (3 if args.quick else 10)
    ft_100 = args.finetune_saves_100 or (2 if args.quick else 5)
    versions = args.versions or (5 if args.quick else 9)
    repeats = args.repeats or (2 if args.quick else 5)
    began = time.perf_counter()
    base = args.dir or Path(tempfile.mkdtemp(prefix="tierckpt-delta-"))
    work = base / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cold = drop_caches()
    stamp = time.strftime("%Y-%m-%d %H:%M")
    report: dict[str, Any] = {"time": stamp, "machine": machine(work), "cold_cache": cold, "argv": sys.argv[1:], "size": dataclasses.asdict(size)}
    report["loadavg_start"] = os.getloadavg()
    # One intra-op thread (as compression.py): two OpenMP threads spin against the tier's threads and
    # other jobs on this 2-core machine.
    torch.set_num_threads(1)
    pool = concurrent.futures.ThreadPoolExecutor(IO_THREADS, thread_name_prefix="encode")
    try:
        torch.manual_seed(0)
        model = GPT(size)
        pretrain = Trainer(size, model, lr=1e-3, strides=(1, 17), seed=1)
        parameters = sum(p.numel() for p in model.parameters())
        print(f"fp32 and bf16: {parameters / 1e6:.2f} M parameters, saves every 1, 10, 100 steps", flush=True)
        runs, last = train_and_save(
            pretrain, work, {"fp32": lambda s: s, "bf16": cast_bf16}, {1: saves, 10: saves, 100: saves_100}, Groups([]), pool, keep_last=2
        )
        report["training"] = {"fp32": pretrain.summary()}
        gc.collect()

        frozen = freeze_prefix(model, 0.40)
        finetune = Trainer(size, model, lr=1e-4, strides=(17, 33), seed=2)
        frozen_n = sum(p.numel() for n, p in model.named_parameters() if n in frozen)
        frozen_bytes = frozen_n * 4
        print(f"fine-tune: {frozen_n / parameters:.1%} of the parameters frozen ({len(frozen)} tensors)", flush=True)
        more, _ = train_and_save(finetune, work, {"fine-tune": lambda s: s}, {1: saves, 10: saves, 100: ft_100}, Groups(frozen), pool)
        runs.update(more)
        ft_bytes = more["fine-tune k=1"]["versions"][0]["logical"]
        report["training"]["fine-tune"] = {
            **finetune.summary(), "frozen": frozen, "frozen_parameters": frozen_n, "frozen_share_of_parameters": frozen_n / parameters,
            "frozen_share_of_checkpoint_bytes": frozen_bytes / ft_bytes,
        }
        report["runs"] = runs
        for name, r in runs.items():
            print(f"{name}: delta / alone {ratio(r):.3f}; in memory encoded in {r['memory']['encode_s']:.1f} s", flush=True)
    finally:
        pool.shutdown()

    before, after = last
    nbytes = nbytes_of(after)
    print("timing a whole and a delta version of the same state ...", flush=True)
    limit_runs = [limits(work, nbytes, IO_THREADS, cold)]
    report["timing"] = timing(work, before, after, versions, repeats, cold)
    limit_runs.append(limits(work, nbytes, IO_THREADS, cold))
    report["limits"] = limit_runs
    # The limit: the best the disk did in the run, from a state-sized buffer or reused 16 MiB ones.
    limit_s = min(min(x["write_s"], x["write_disk_s"]) for x in limit_runs)
    reused = min(x["write_disk_s"] for x in limit_runs) <= min(x["write_s"] for x in limit_runs)
    limit_name = (
        f"O_DIRECT write + fsync, {IO_THREADS} threads, from "
        + ("reused 16 MiB buffers" if reused else "a state-sized buffer")
        + f" (fastest of {2 * len(limit_runs)} measured around the timings)"
    )
    report["write_limit_s"] = limit_s
    report["loadavg_end"] = os.getloadavg()

    goal_lines, verdicts = goals(runs, report["timing"], limit_s)
    report["goals"] = verdicts
    t = report["training"]
    m = report["machine"]
    command = " ".join(["python", "benchmarks/delta.py", *sys.argv[1:]])
    json_path = args.json or (base / "delta.json" if args.quick else HERE / "results" / f"delta-{time.strftime('%Y%m%d-%H%M%S')}.json")
    fp32_k1 = runs["fp32 k=1"]
    lines = [
        "",
        f"### Differential versions (delta: full_every {FULL_EVERY}) on a trained GPT's state saved every k steps ({stamp})",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM, Linux {m['kernel']}; disk: {m['disk']}, O_DIRECT: {m['o_direct']}; "
        f"Python {m['python']}, torch {m['torch']}; shared with other jobs (load average {report['loadavg_start'][0]:.1f} at the start, "
        f"{report['loadavg_end'][0]:.1f} at the end). Page cache dropped before every restore: {cold}. "
        f"Command: `flock /tmp/tierckpt-bench.lock {command}` ({time.perf_counter() - began:.0f} s); raw numbers: `{json_path.name}`.",
        "",
        f"State: the GPT of gpt.py ({parameters / 1e6:.1f} M parameters; d_model {size.d_model}, {size.layers} layers, vocab {size.vocab}, "
        f"{size.batch}×{size.block} tokens a step, 1 torch thread), `{{model: state_dict, optimizer: AdamW state_dict}}`. "
        f"**fp32**: trained from scratch, lr 1e-3, weight decay 0.1, {t['fp32']['steps']} steps (loss {t['fp32']['loss_first10']:.2f} → "
        f"{t['fp32']['loss_last10']:.2f}). **bf16**: that run's state cast to bf16 at each save (weights and moments; AdamW's step "
        f"counters stay fp32), not a model trained in bf16. **fine-tune**: the trained model on another task (strides 17-32), the first "
        f"{len(frozen)} parameter tensors in module order frozen ({t['fine-tune']['frozen_share_of_parameters']:.1%} of the parameters, "
        f"{t['fine-tune']['frozen_share_of_checkpoint_bytes']:.1%} of the checkpoint's bytes: no moments for them), a new AdamW at lr 1e-4, "
        f"{t['fine-tune']['steps']} steps (loss {t['fine-tune']['loss_first10']:.2f} → {t['fine-tune']['loss_last10']:.2f}). "
        f"k = 1 and 10: the last {saves} saves of each run; k = 100: {saves_100} saves (fine-tune: {ft_100}) from step 100. "
        f"Each k into two filesystem tiers (memory tier above, io_threads {IO_THREADS}, keep last 1): `compression: {{codec: zstd, level: 1, "
        f"shuffle: true}}` alone, and with `delta: {{full_every: {FULL_EVERY}}}`; `save_sync` → committed on disk each time.",
        "",
        "Stored bytes over each run's versions, delta tier / compression alone, from the versions' manifests (the group columns: "
        "the same ratio for that group's records; – where the state has none):",
        "",
        *stored_table(runs),
        "The same saves encoded in memory with the tier's codecs and chunk rules (a chunk equal to its base's is a 0-byte reference; "
        "a changed float chunk its XOR frame where that is 1.05× smaller than its base chunk stored whole; else zstd+shuffle). Stored bytes over the "
        "run / the run stored whole with zstd+shuffle; 'in memory = tier?': the first column and the whole run equal, byte for byte, "
        "what the two tiers stored. Delta frames larger than the chunk whole: frames the tier keeps although zstd+shuffle of the "
        "chunk alone would be smaller (the tier compares a frame with its base chunk's stored size, which stands for the chunk's own):",
        "",
        *memory_table(runs),
        "Choosing N: a delta against a whole version d saves back, over that version stored whole (k = 1 runs, in memory), and the "
        "total a cycle of N would store estimated from those (1 + Σ_{d<N} ratio(d)) / N:",
        "",
        *distance_table(runs),
        *findings(runs),
        "Against the previous version, a version depends on every one back to its cycle's whole version: a restore reads and "
        f"decodes up to N versions (here up to {FULL_EVERY}), and one damaged version breaks the rest of its cycle; against the last "
        "whole one (implemented) a restore reads two versions at most and a damaged delta version breaks no other.",
        "",
        "Save → durable in the training runs above (k = 1; `save_sync` → committed on disk, state copied into the memory tier first):",
        "",
        *durable_table(runs),
        f"Save and restore of the fp32 state at its last step (S) and the step before (B), {nbytes / 1e6:.1f} MB: compression alone "
        f"saves B, S, B, ...; a `full_every: 2` tier saves B, S, S, B, B, ... (even versions whole, odd ones a delta one training step "
        f"from their base: the same work as a delta of N = 10 one save after its base); first version of each sequence not counted, "
        f"medians of {versions // 2}-{versions - 1}. Restore: whole S and delta S (against B) by a new Checkpointer with the disk tier "
        f"alone, page cache dropped before its construction, `restore_sync(step)` right after it; medians of {repeats}, alternating order.",
        "",
        *timing_table(report["timing"], limit_s, limit_name),
        *goal_lines,
    ]
    report["markdown"] = lines
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print("\n".join(lines), flush=True)
    print(f"(fp32 k=1 schedule on the delta tier, (step, base, chain): {fp32_k1['schedule'][:12]})")
    if not args.quick:
        common.append_section(args.results, lines, json_path)
    else:
        print(f"results: {json_path}")
    shutil.rmtree(work, ignore_errors=True)
    if args.dir is None and not args.quick:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
