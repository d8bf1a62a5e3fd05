"""Corruption campaign (issue 11, item 3): random bit flips and truncations of data files and
manifests, on an uncompressed tier and a compressed one; restore must detect every one, say where
(tier, step, file, key), fall back to the next valid copy and load it bitwise.

Steps 1 and 2 are saved ram → nvme (raw, 4 KiB-aligned layout) → pfs (zstd level 1 + byte shuffle,
chunks packed back to back), with several dtypes and tensors of several 16 MiB chunks. Each trial
damages step 2 on one tier (the *victim*), restores through a new Checkpointer (its memory tier is
empty, so everything comes from disk), then puts the bytes back:

- victim nvme: the expected fallback is the same step on pfs;
- victim pfs: step 2 on nvme is damaged too (a flip in a known chunk) so the restore has to read the
  victim; the expected fallback is then the older step, 1 on nvme.

Decided, and checked: bytes that no chunk covers are not data. In the raw layout these are the zero
padding between 4 KiB-aligned tensors and the file's tail past its last chunk. Restore reads and
hashes exactly the chunks, so a flip there, or a truncation that only cuts such bytes, is not
detected, and need not be: the victim is restored from (the same tier and step) and must be bitwise
equal to what was saved. Such damage is counted as *harmless*, apart from *tried*; every other damage
is tried and must be detected: the victim is not what comes back, a warning names the victim's tier,
step and damaged file (and, for data, the key and chunk hit; for a truncation, a key cut off), and
``python -m tierckpt verify`` on the victim's directory exits 1 naming the file.

``TIERCKPT_CORRUPTION_TRIALS`` raises the number of trials (default 64, a quarter of each kind); the
seed is fixed, so a failure replays.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch

from tierckpt import Checkpointer
from tierckpt.cli import main as cli
from tierckpt.format import CHUNK_BYTES, DATA_FILE, MANIFEST_FILE, Manifest, TensorRecord, version_dirname
from tierckpt.format.damage import mark_name
from tierckpt.testing import flip_bits

from helpers import assert_bitwise, logged_warnings, nvme_and_pfs, zeroed

SEED = 11
TRIALS = int(os.environ.get("TIERCKPT_CORRUPTION_TRIALS", "64"))
KINDS = ("flip-data", "flip-manifest", "truncate-data", "truncate-manifest")
DATA = DATA_FILE.format(rank=0)
TIERS = ("nvme", "pfs")


def _config(root: Path, capacity: str = "160MiB", snapshots: int = 2) -> dict[str, Any]:
    return nvme_and_pfs(root, capacity=capacity, snapshots=snapshots)


def _state(step: int) -> dict[str, Any]:
    """A small model's state, with the dtypes and shapes of a real one and two multi-chunk tensors."""
    g = torch.Generator().manual_seed(step)
    big = CHUNK_BYTES // 4 + 300_000  # fp32 elements: 2 chunks, the second one short
    return {
        "model": {
            "embed.weight": torch.randn(big, generator=g).mul_(0.02),
            "layers.0.attn.weight": torch.randn(256, 257, generator=g).to(torch.bfloat16),
            "layers.0.mlp.weight": torch.randn(CHUNK_BYTES // 2 + 5000, generator=g).to(torch.bfloat16),  # 2 chunks
            "layers.0.norm.weight": torch.ones(257),  # compresses to almost nothing
            "layers.0.norm.bias": torch.zeros(257, dtype=torch.float16),
            "head.mask": torch.rand(3001, generator=g) > 0.5,
            "head.fp8": torch.randn(1999, generator=g).to(torch.float8_e4m3fn),
            "rope": torch.randn(33, 2, generator=g, dtype=torch.complex64),
            "scalar": torch.tensor(step, dtype=torch.int64),
            "empty": torch.empty(0, 4),
        },
        "optim": {
            "state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.randn(5000, generator=g)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}],
        },
        "rng": torch.Generator().manual_seed(step + 100).get_state(),
        "loader": {"indices": np.random.default_rng(step).permutation(10_000).astype(np.int32), "epoch": np.int64(3)},
        "np64": np.random.default_rng(step).standard_normal(777),
        "step": step,
        "name": f"run-{step}",
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("campaign")
    with Checkpointer(_config(root)) as ckpt:
        for step in (1, 2):
            assert ckpt.save_sync(step, _state(step)).committed_sync("pfs", timeout=120), step
    for tier in TIERS:
        manifest = Manifest.decode((root / tier / version_dirname(2) / MANIFEST_FILE).read_bytes())
        codecs = {r.chunk_codec(i) for r in manifest.records for i in range(len(r.chunks))}
        # On pfs: shuffled floats, plain zstd for the rest, and chunks kept raw where zstd did not pay.
        assert codecs == ({"none"} if tier == "nvme" else {"none", "zstd", "zstd+shuffle"}), (tier, codecs)
        assert max(len(r.chunks) for r in manifest.records) == 2
    return root


@dataclass
class _Damage:
    tier: str
    file: str  # DATA or MANIFEST_FILE
    kind: str  # "flip" or "truncate"
    at: int  # the byte flipped, or the new length
    bit: int = 0
    keys: set[str] = field(default_factory=set)  # data: the keys a detection may name
    chunk: int | None = None  # a flip in data: the chunk hit

    @property
    def harmless(self) -> bool:
        return self.file == DATA and not self.keys


def _records(root: Path, tier: str) -> tuple[TensorRecord, ...]:
    return Manifest.decode((root / tier / version_dirname(2) / MANIFEST_FILE).read_bytes()).records


def _pick(rng: random.Random, root: Path, tier: str, kind: str) -> _Damage:
    """A damage of ``kind`` to step 2 on ``tier``: in data, 40% aimed inside a chunk (small tensors are
    a few bytes of a 40 MB file), 20% at bytes no chunk covers (where there are any), else uniform."""
    what, file = kind.split("-")
    name = DATA if file == "data" else MANIFEST_FILE
    size = (root / tier / version_dirname(2) / name).stat().st_size
    records = _records(root, tier)
    chunks = [(r, i, c) for r in records for i, c in enumerate(r.chunks)]
    extents = sorted((c.offset, c.offset + c.stored) for _, _, c in chunks)
    gaps = [(end, start) for (_, end), (start, _) in zip(extents, extents[1:]) if start > end]
    tail = (extents[-1][1], size)
    aim = rng.random()
    if name == DATA and aim < 0.4:
        r, i, c = rng.choice(chunks)
        at = c.offset + rng.randrange(c.stored)
    elif name == DATA and aim < 0.6 and tail[1] > tail[0]:
        start, end = tail if what == "truncate" or not gaps or rng.random() < 0.3 else rng.choice(gaps)
        at = rng.randrange(start, end)
    else:
        at = rng.randrange(size)
    damage = _Damage(tier, name, what, at, rng.randrange(8))
    if name == DATA:
        for r, i, c in chunks:
            if what == "flip" and c.offset <= at < c.offset + c.stored:
                damage.keys, damage.chunk = {r.key}, i
            elif what == "truncate" and c.offset + c.stored > at:
                damage.keys.add(r.key)
    return damage


def _apply(root: Path, damage: _Damage) -> None:
    path = root / damage.tier / version_dirname(2) / damage.file
    if damage.kind == "truncate":
        os.truncate(path, damage.at)
        return
    flip_bits(path, damage.at, 1 << damage.bit)


def _originals(root: Path) -> dict[Path, tuple[bytes, int]]:
    return {
        path: (path.read_bytes(), path.stat().st_mtime_ns)
        for tier in TIERS
        for path in (root / tier / version_dirname(2)).iterdir()
    }


@contextlib.contextmanager
def _restoring(originals: dict[Path, tuple[bytes, int]]) -> Iterator[None]:
    """Put back every file of step 2 that changed, whatever the trial did, and take back the damage
    marks the trial's ``tierckpt verify`` left (tierckpt.format.damage): the next trial starts whole."""
    try:
        yield
    finally:
        for path, (data, mtime) in originals.items():
            if path.stat().st_mtime_ns != mtime or path.stat().st_size != len(data):
                path.write_bytes(data)
                os.utime(path, ns=(mtime, mtime))
        for mark in {p.parent.parent / mark_name(2) for p in originals}:
            mark.unlink(missing_ok=True)


def _verify(path: Path) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = cli(["verify", str(path)])
    return status, out.getvalue()


@pytest.mark.slow
def test_every_damage_is_detected_and_restore_falls_back_bitwise(saved: Path) -> None:
    root = saved
    rng = random.Random(SEED)
    expected_states = {step: _state(step) for step in (1, 2)}
    originals = _originals(root)
    cover = next(r for r in _records(root, "nvme") if r.key == "['model']['embed.weight']").chunks[1]
    tried = detected = harmless = 0
    by_kind: dict[str, list[int]] = {kind: [0, 0, 0] for kind in KINDS}  # tried, detected, harmless
    for trial in range(TRIALS):
        kind = KINDS[trial % len(KINDS)]
        victim = rng.choice(TIERS)
        damage = _pick(rng, root, victim, kind)
        context = f"trial {trial}: {damage}"
        with _restoring(originals):
            _apply(root, damage)
            if victim == "pfs":  # make the restore reach the victim: step 2 on nvme is damaged too
                _apply(root, _Damage("nvme", DATA, "flip", cover.offset + cover.stored // 3, 5))
            if damage.harmless:
                expected = (2, victim)
            else:
                expected = (2, "pfs") if victim == "nvme" else (1, "nvme")
            template = zeroed(expected_states[1]) if trial % 2 else None
            # A new process's Checkpointer: its memory tier is empty; one slot holds the staging.
            with logged_warnings() as logged, Checkpointer(_config(root, capacity="48MiB", snapshots=1)) as ckpt:
                restored = ckpt.restore_latest_sync(template)
            messages = [m for m in logged if "does not verify" in m]
            assert restored is not None, context
            assert (restored.step, restored.tier) == expected, (context, messages)
            assert_bitwise(restored.state, expected_states[restored.step])
            if template is not None:
                assert restored.state["model"]["embed.weight"] is template["model"]["embed.weight"], context
            status, report = _verify(root / victim / version_dirname(2))
            # Each names the next candidate too ("trying step 2 on tier 'pfs' next"): only its start says which failed.
            about_victim = [m for m in messages if m.startswith(f"tierckpt: step 2 on tier {victim!r} does not verify")]
            if not about_victim and not damage.harmless:
                # A manifest damaged so that the tier lists the version as such when it opens (which it
                # says): a restore tries that copy only after the copies whose records verified.
                about_victim = [m for m in logged if m.startswith(f"step 2 on tier {victim!r}: {damage.file}")]
            if damage.harmless:
                harmless += 1
                by_kind[kind][2] += 1
                assert not about_victim, (context, messages)
                assert status == 0, (context, report)
                continue
            tried += 1
            by_kind[kind][0] += 1
            assert len(about_victim) == 1, (context, messages)
            message = about_victim[0]
            assert damage.file in message, (context, message)
            if damage.keys:
                named = [key for key in damage.keys if key in message]
                assert named, (context, message)
                if damage.chunk is not None:
                    assert f"(chunk {damage.chunk})" in message or f"chunk {damage.chunk}" in message, (context, message)
            assert status == 1 and "DAMAGED" in report and damage.file in report, (context, report)
            detected += 1
            by_kind[kind][1] += 1
    summary = ", ".join(f"{kind}: {t} tried, {d} detected, {h} harmless" for kind, (t, d, h) in by_kind.items())
    print(f"\ncorruption campaign (seed {SEED}, {TRIALS} trials): {tried} tried, {detected} detected, {harmless} harmless; {summary}")
    assert detected == tried
    assert tried >= TRIALS * 3 // 4  # most damage lands on data or a manifest, not on padding
