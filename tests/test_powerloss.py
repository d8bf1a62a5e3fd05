"""Power loss on the commit path: every crash point of a recorded flush, every disk it may leave.

In the spirit of ALICE and CrashMonkey. A real Checkpointer (host memory → nvme, and → pfs in one
scenario) saves a version while :class:`fsrecord.Recorder` logs each file operation the tier makes: creates, writes
(with their bytes), fallocate, fsyncs of files and directories, mkdirs, renames, unlinks, rmdirs. The
log is checked to replay to the real directory byte for byte (nothing the tier did went unseen). Then,
for every prefix of the log (a power loss after each operation, and before the first),
:func:`fsrecord.crash_states` builds the disks that loss may leave, under two models documented in
``fsrecord``: ``posix`` (only what was fsynced is on disk: a directory entry once its directory was
fsynced; unsynced data lost, kept or torn; unsynced entries lost or kept in any combination) and
``ext4`` (data=ordered with a journal: directory operations persist in order, any fsync commits all
before it). Each distinct disk is written to a fresh directory and checked twice:

- without opening it: every ``step-*`` directory holding a manifest (one a tier would list) is byte
  for byte a version that was committed, the old ones or the new one, and every version whose
  ``commit`` had returned (a ``mark`` in the log) is there, whole, on its tier;
- by a new Checkpointer on it: nothing ``.tmp-``/``.trash-``/``.replaced-`` is left once it opened,
  every listed version is valid, ``restore_latest`` warns of no damaged version and returns the
  previous committed version or the new one, equal bitwise to what was saved, and once ``commit``
  had returned (a ``mark`` in the log), the new one: a version the tier reported committed is never
  lost.

Scenarios: a raw (O_DIRECT) commit that also prunes, a zstd commit (packed chunks through the page
cache), a commit to nvme promoted to a zstd pfs tier (both prune), the replacement of a committed
step, the very first save into a directory the tier creates, and the recovery an open does after a
crash between the two renames of a replacement. Two more tests drop one fsync from the log (the data
file's, the temporary directory's) and check that the model then finds lost versions: the checks
have teeth.

The very first save into a tier directory that ``open()`` creates is checked too: ``open()`` makes
each directory level it creates durable in its parent, so a power loss after that first commit
returned cannot drop the tier directory's own name (this test found that gap, under ``posix``).
"""

from __future__ import annotations

import os
import random
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import fsrecord
from helpers import logged_warnings
from tierckpt import Checkpointer
from tierckpt.format import MANIFEST_FILE, version_dirname
from tierckpt.tiers.filesystem import FilesystemTier

Key = tuple[int, int]  # (step, variant)


def _state(step: int, variant: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step * 100 + variant)
    return {
        "w": torch.randn(20_000, generator=g),  # 80000 bytes: whole pages
        "h": torch.randn(3001, generator=g).to(torch.bfloat16),  # an unaligned size: packed
        "i": torch.arange(5000, dtype=torch.int64) * (step + 7 * variant),  # compresses
        "nested": {"t": (torch.full((3,), float(step)), "x")},
        "step": step,
        "variant": variant,
    }


def _flat(state: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(state, dict):
        return {k: v for key, value in state.items() for k, v in _flat(value, f"{prefix}{key}.").items()}
    if isinstance(state, (list, tuple)):
        return {k: v for i, value in enumerate(state) for k, v in _flat(value, f"{prefix}{i}.").items()}
    return {prefix: state}


def _differences(actual: Any, expected: Any) -> list[str]:
    a, e = _flat(actual), _flat(expected)
    if set(a) != set(e):
        return [f"keys {sorted(set(a) ^ set(e))}"]
    out = []
    for key, value in e.items():
        got = a[key]
        if isinstance(value, torch.Tensor):
            if not isinstance(got, torch.Tensor) or (got.dtype, got.shape) != (value.dtype, value.shape):
                out.append(f"{key}: {got!r:.60} is not {value.dtype}{list(value.shape)}")
            elif not torch.equal(got.contiguous().view(torch.uint8), value.contiguous().view(torch.uint8)):
                out.append(f"{key}: bytes differ")
        elif type(got) is not type(value) or got != value:
            out.append(f"{key}: {got!r} != {value!r}")
    return out


TIERS = ("nvme", "pfs")


def _config(disk: Path, scenario: Scenario) -> dict[str, Any]:
    """ram → nvme (the scenario's compression), and → pfs (zstd) when the scenario promotes."""
    nvme: dict[str, Any] = {"name": "nvme", "type": "filesystem", "path": str(disk / "nvme"), "keep": {"last": 2}}
    if scenario.compression:
        nvme["compression"] = scenario.compression
    tiers = [{"name": "ram", "type": "memory"}, nvme]
    if scenario.promote:
        tiers.append({"name": "pfs", "type": "filesystem", "path": str(disk / "pfs"), "keep": {"last": 2}, "compression": ZSTD})
    return {"host": {"capacity": "4MiB", "snapshots": 2}, "tiers": tiers}


ZSTD = {"codec": "zstd", "level": 1, "shuffle": True}


@dataclass
class Scenario:
    name: str
    before: list[Key]  # saved and committed before the recording (durable)
    during: list[Key]  # saved while recording
    allowed_before: set[Key | None]  # what restore may return before commit() returned
    allowed_after: set[Key | None]  # and after
    compression: dict[str, Any] | None = None
    promote: bool = False  # a pfs tier below nvme: the recording holds the promotion too
    record_open: bool = False  # the Checkpointer is made inside the recording (its open is recorded)
    prepare: Callable[[Path, Path], None] | None = None  # (disk, scratch): shape the disk before recording


def _interrupted_replacement(disk: Path, scratch: Path) -> None:
    """What a crash between the two renames of a replacement of step 2 leaves (see filesystem.py)."""
    nvme = disk / "nvme"
    with Checkpointer(_config(scratch / "other", SCENARIOS["replace"])) as other:
        other.save_sync(2, _state(2, 1)).committed_sync("nvme")
    os.rename(nvme / version_dirname(2), nvme / f".replaced-{version_dirname(2)}-{uuid.uuid4().hex[:12]}")
    shutil.copytree(
        scratch / "other" / "nvme" / version_dirname(2), nvme / f".tmp-{version_dirname(2)}-{uuid.uuid4().hex[:12]}"
    )


SCENARIOS = {
    "commit-raw": Scenario("commit-raw", [(1, 0), (2, 0)], [(3, 0)], {(2, 0), (3, 0)}, {(3, 0)}),
    "commit-zstd": Scenario("commit-zstd", [(1, 0), (2, 0)], [(3, 0)], {(2, 0), (3, 0)}, {(3, 0)}, compression=ZSTD),
    "promote": Scenario("promote", [(1, 0), (2, 0)], [(3, 0)], {(2, 0), (3, 0)}, {(3, 0)}, promote=True),
    "replace": Scenario("replace", [(1, 0), (2, 0)], [(2, 1)], {(2, 0), (2, 1)}, {(2, 1)}),
    "first-save": Scenario("first-save", [], [(1, 0)], {None, (1, 0)}, {(1, 0)}, record_open=True),
    "recover-replaced": Scenario(
        "recover-replaced", [(1, 0), (2, 0)], [], {(2, 0)}, {(2, 0)}, record_open=True, prepare=_interrupted_replacement
    ),
}


@dataclass
class Recording:
    scenario: Scenario
    base: fsrecord.Tree
    ops: list[fsrecord.Op]
    good: dict[str, set[tuple[tuple[str, bytes | None], ...]]] = field(default_factory=dict)  # "tier/step-..." -> versions
    final: dict[str, tuple[tuple[str, bytes | None], ...]] = field(default_factory=dict)  # "tier/step-..." at the end

    def marks(self) -> list[tuple[int, str]]:
        """(index in the log, "tier/step-...") of each commit that returned."""
        out = []
        for i, op in enumerate(self.ops):
            if op.kind == "mark":
                tier, step = op.text.split()[-2:]
                out.append((i, f"{tier}/{version_dirname(int(step))}"))
        return out


def _versions_in(listing: dict[str, bytes | None]) -> dict[str, tuple[tuple[str, bytes | None], ...]]:
    """Every "tier/step-..." directory of a disk, and its files."""
    out: dict[str, dict[str, bytes | None]] = {}
    for path, data in listing.items():
        parts = path.split("/")
        if parts[0] in TIERS and len(parts) >= 2 and parts[1].startswith("step-"):
            files = out.setdefault(f"{parts[0]}/{parts[1]}", {})
            if len(parts) == 3:
                files[parts[2]] = data
    return {name: tuple(sorted(files.items())) for name, files in out.items()}


def record(scenario: Scenario, root: Path, *, drop: Callable[[fsrecord.Op], bool] | None = None) -> Recording:
    """Run the scenario on a real directory, recording what the tiers do.

    ``drop``: operations left out of the log afterwards, as if the tier had not made them.
    """
    disk, scratch = root / "disk", root / "scratch"
    disk.mkdir(parents=True)
    scratch.mkdir()
    config = _config(disk, scenario)
    last = config["tiers"][-1]["name"]
    if scenario.before:
        with Checkpointer(config) as ckpt:
            for step, variant in scenario.before:
                assert ckpt.save_sync(step, _state(step, variant)).committed_sync(last)
    if scenario.prepare is not None:
        scenario.prepare(disk, scratch)
    recorder = fsrecord.Recorder(disk)  # what is on disk now is the durable base
    commit = FilesystemTier.commit

    async def marking(self: FilesystemTier, staged: Any) -> Any:
        info = await commit(self, staged)
        recorder.mark(f"commit returned: {self.name} {staged.step}")
        return info

    ckpt = None if scenario.record_open else Checkpointer(config)
    try:
        FilesystemTier.commit = marking  # type: ignore[method-assign]
        with recorder:
            if ckpt is None:
                ckpt = Checkpointer(config)
            for step, variant in scenario.during:
                assert ckpt.save_sync(step, _state(step, variant)).committed_sync(last)
            ckpt.wait_sync()
    finally:
        FilesystemTier.commit = commit  # type: ignore[method-assign]
        if ckpt is not None:
            ckpt.close_sync()
    recorder.check_complete()
    ops = [op for op in recorder.ops if drop is None or not drop(op)]
    rec = Recording(scenario, recorder.base, ops)
    final = fsrecord.replay(recorder.base, recorder.ops, len(recorder.ops), "posix", everything=True)
    rec.final = _versions_in(final.listing())
    for tree in (recorder.base, final):
        for name, files in _versions_in(tree.listing()).items():
            rec.good.setdefault(name, set()).add(files)
    return rec


@dataclass
class Outcome:
    crash_points: int = 0
    states: int = 0
    distinct: int = 0
    restored: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)


def _hidden_leftovers(disk: Path) -> list[str]:
    return sorted(
        f"{tier}/{n}"
        for tier in TIERS
        if (disk / tier).is_dir()
        for n in os.listdir(disk / tier)
        if n.startswith((".tmp-", ".trash-", ".replaced-", ".direct-probe-"))
    )


def _open_and_restore(disk: Path, rec: Recording, allowed: set[Key | None]) -> tuple[str, list[str]]:
    """Open a Checkpointer on a crash disk; what it restored, and what is wrong."""
    problems = []
    with logged_warnings() as logged:
        try:
            with Checkpointer(_config(disk, rec.scenario)) as ckpt:
                left = _hidden_leftovers(disk)
                infos = ckpt.versions()
                restored = ckpt.restore_latest_sync()
        except Exception as exc:  # noqa: BLE001 - reported as a violation
            return "error", [f"open or restore raised {exc!r}"]
    if left:
        problems.append(f"left after open: {left}")
    invalid = [f"{i.tier}:{i.step}" for i in infos if not i.valid]
    if invalid:
        problems.append(f"versions() lists invalid versions {invalid}")
    # A restore that had to pass a version over (logged: "... does not verify ..."); sweeping what the
    # crash left unfinished is logged too, and expected.
    problems += [f"warning: {m}" for m in logged if "does not verify" in m]
    if restored is None:
        key: Key | None = None
        what = "nothing"
    else:
        key = (restored.step, restored.state.get("variant", -1) if isinstance(restored.state, dict) else -1)
        what = f"step {key[0]} variant {key[1]}"
        diff = _differences(restored.state, _state(*key)) if key[1] >= 0 else ["no variant"]
        if diff:
            problems.append(f"restored {what} differs from what was saved: {diff[:3]}")
    if key not in allowed:
        problems.append(f"restored {what}; allowed: {sorted(allowed, key=str)}")
    return what, problems


def check(rec: Recording, model: str, work: Path, *, seed: int = 0) -> Outcome:
    """Every crash point, every disk: see the module docstring."""
    rng = random.Random(seed)
    marks = rec.marks()
    out = Outcome()
    distinct: dict[str, tuple[fsrecord.Tree, set[Key | None], str]] = {}
    cache: dict[tuple[Any, ...], bytes] = {}
    for k in range(len(rec.ops) + 1):
        out.crash_points += 1
        returned = [name for i, name in marks if i < k]  # versions whose commit had returned
        allowed = rec.scenario.allowed_after if returned else rec.scenario.allowed_before
        where = f"after op {k} ({rec.ops[k - 1].text})" if k else "before the first op"
        for label, tree in fsrecord.crash_states(rec.base, rec.ops, k, model=model, rng=rng):
            out.states += 1
            sig = tree.signature()
            # Without opening: every version a tier would list is, byte for byte, one that was committed,
            # and every version whose commit returned is there (each disk once per crash point).
            versions = _versions_in(tree.listing(cache))
            for name, files in versions.items():
                if any(f == MANIFEST_FILE for f, _ in files) and files not in rec.good.get(name, set()):
                    out.violations.append(f"[{model}] {where}: {label}: {name} has a manifest but is not a committed version")
            for name in returned:
                if versions.get(name) != rec.final[name]:
                    out.violations.append(f"[{model}] {where}: {label}: {name}, committed (commit returned), is missing or not whole")
            if sig in distinct:
                old_tree, old_allowed, old_where = distinct[sig]
                distinct[sig] = (old_tree, old_allowed & allowed, old_where if old_allowed <= allowed else f"{where}: {label}")
                continue
            distinct[sig] = (tree, set(allowed), f"{where}: {label}")
    out.distinct = len(distinct)
    for i, (tree, allowed, where) in enumerate(distinct.values()):
        disk = work / f"state-{i}"
        tree.materialize(disk, cache)
        what, problems = _open_and_restore(disk, rec, allowed)
        out.restored[what] = out.restored.get(what, 0) + 1
        out.violations += [f"[{model}] {where}: {p}" for p in problems]
        shutil.rmtree(disk)
    return out


@pytest.fixture(scope="module")
def recordings(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Recording]:
    made: dict[str, Recording] = {}

    def get(name: str) -> Recording:
        if name not in made:
            made[name] = record(SCENARIOS[name], tmp_path_factory.mktemp(name))
        return made[name]

    return get


def _report(name: str, model: str, rec: Recording, out: Outcome) -> str:
    return (
        f"{name} [{model}]: {len(rec.ops)} ops, {out.crash_points} crash points, {out.states} disks "
        f"({out.distinct} distinct) restored as {out.restored}; {len(out.violations)} violations"
    )


@pytest.mark.parametrize("model", ["posix", "ext4"])
@pytest.mark.parametrize(
    "name",
    [
        "commit-raw",
        "commit-zstd",
        "promote",
        "replace",
        "recover-replaced",
        "first-save",
    ],
)
def test_power_loss_at_every_point_keeps_a_committed_version(
    recordings: Callable[[str], Recording], tmp_path: Path, name: str, model: str
) -> None:
    rec = recordings(name)
    kinds = {op.kind for op in rec.ops}
    assert {"fsync", "rename"} <= kinds, [op.text for op in rec.ops]
    if rec.scenario.during:
        assert rec.marks(), "commit() never returned inside the recording"
    out = check(rec, model, tmp_path)
    print(_report(name, model, rec, out))
    assert out.violations == [], "\n".join([_report(name, model, rec, out), *out.violations[:20]])


@pytest.mark.parametrize(
    "missing",
    ["data file", "temporary directory"],
)
def test_the_model_finds_a_missing_fsync(tmp_path: Path, missing: str) -> None:
    """Drop one fsync from the log, as a tier that forgot it would: committed versions get lost."""

    def drop(op: fsrecord.Op) -> bool:
        if op.kind != "fsync" or ".tmp-" not in op.text:
            return False
        is_dir = op.text.endswith("/")
        return is_dir if missing == "temporary directory" else (not is_dir and "data-" in op.text)

    rec = record(SCENARIOS["commit-raw"], tmp_path / "rec", drop=drop)
    out = check(rec, "posix", tmp_path / "work")
    assert out.violations, _report("commit-raw without the fsync", "posix", rec, out)
    assert any("committed (commit returned), is missing" in v for v in out.violations), out.violations[:5]
