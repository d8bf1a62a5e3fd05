"""Crash campaign: SIGKILL a saving process hundreds of times, at random and at chosen points; lose nothing.

A real process saves a deterministic state per step (6 MiB, :func:`crash_child.campaign_state`)
through ram → nvme (every step, keep 2) → pfs (even steps, zstd, keep 2), so flushes, promotions and
pruning run all the time, and reports what ``save()`` returned and what ``handle.committed(tier)``
acknowledged. The campaign kills it ``--kills`` times, each run resuming where the last one left off,
except for two kinds of runs that go back, as training does (``tierckpt/format/lineage.py``):

- a *rewind* (one run in five, and half the runs aimed at a replacement's kill point) starts a few
  steps back without a restore, saving committed steps again;
- a *rollback* (one in five, and the other half of those aimed at a replacement) first restores,
  with ``restore(step)``, a step some tier held at the last check (below the newest step, now and
  then above it: a step only an abandoned direction holds), checks in the run that it is bitwise what
  some run saved there, and saves the steps after it.

Versions are keys ``(step, variant)``, the variant being the run's (``index + 1``). The newest version
is the newest ``save()`` *call*: keys are compared by :func:`call_order`, ``(variant, step)``, never
step first.

Half the kills come after a random delay; the other half at a kill point of
:data:`crash_child.POINTS`, the n-th time the run gets there (n random): mid-capture, right after
``save()``, mid-write of a data file, after its fsync, staged, between the two renames of a
replacement, between the rename into place and the directory fsync, committed, pruned to ``.trash-``
and mid-removal, for nvme and for pfs, and in the sweep of the next open. The runs are forked from a
zygote that imported torch once (``crash_child.py zygote``): a kill costs well under a second, not the
seconds of a new interpreter.

The campaign keeps a model of the lineages (:class:`History`): each run's first save descends from
the version it restored or, without a restore, from the newest save held when it began, each later
save from the run's previous one, and a save of a step at or below that version's step from its
nearest ancestor below the step. The live versions are the chain of the newest save held.

After each kill, on a copy of the directories (hard links: the originals stay as the kill left them,
so the next run's own open sweeps them, and can itself be killed doing so), a Checkpointer in this
process (a new process for the killed one) must:

- leave no ``.tmp-``/``.trash-``/``.replaced-`` entry once open;
- list only valid versions (``versions()``), each of which, restored alone, is bitwise the state that
  was saved at its step by the run whose variant it holds, a run that did save that step;
- mark a listed version ``abandoned`` exactly when the model says so;
- restore (``restore_latest``, no warning of a damaged version) a version bitwise equal to what was
  saved: the newest (call order) of the versions listed live, itself live, and no older than the
  newest version any run had acknowledged as committed on any tier before the kill (a lost version
  otherwise);
- keep on each tier what retention must keep (:meth:`Campaign._check_retained`): the newest version
  acknowledged there or something newer, and every acknowledged version that no later save left, or
  ``keep.last`` of its descendants.

A rollback's restore must also have loaded a version the last check listed, the live one of that
step where one was listed.

Figures (kills by phase and kill point, restores OK, versions lost, rollbacks and rewinds, abandoned
versions listed, violations with details) are printed and written to
``benchmarks/results/crash_campaign-<ts>.json``, and a section is appended to RESULTS.md
(``--no-record``: neither). ``tests/test_crash.py`` runs a short campaign of 20 kills in CI::

    flock /tmp/tierckpt-bench.lock .venv/bin/python benchmarks/crash_campaign.py --kills 200 --seed 1
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import logging
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from tierckpt import Checkpointer
from tierckpt.format import version_dirname

HERE = Path(__file__).resolve().parent
CHILD = HERE.parent / "tests" / "crash_child.py"
GROUPS = ("open", "capture", "flush", "promotion", "pruning")  # phases, in the order reports list them
LEFTOVER = (".tmp-", ".trash-", ".replaced-", ".direct-probe-")
_LINE_TIMEOUT_S = 120.0  # a deadlock guard only
# A kill point is aimed at its n-th occurrence in a run, n from 1 to this (3 for the others): points a
# run passes many times get a wide range, those it may pass once (a replacement, a sweep) a narrow one.
_MOST_HITS = {
    "capture": 12, "nvme.data": 12, "pfs.data": 12, "open.sweep": 2,
    "nvme.replace_moved": 1, "pfs.replace_moved": 1, "nvme.rmtree_replaced": 2, "pfs.rmtree_replaced": 1,
    "pfs.trashed": 2, "pfs.rmtree": 2,
}


def _load(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


child = _load("tierckpt_campaign_child", CHILD)
# keep.last of each disk tier (retention keeps that many live versions: Campaign._check_retained).
_KEEP_LAST: dict[str, int] = {t["name"]: t["keep"]["last"] for t in child.campaign_config("/")["tiers"][1:]}
Key = tuple[int, int]  # (step, variant): what a version holds; later runs have larger variants


def call_order(key: Key) -> tuple[int, int]:
    """Sorts versions by their save() call: larger is newer. The newest *call* is the latest (after a
    rollback, saves of lower steps are latest, not the abandoned direction's higher steps:
    tierckpt/format/lineage.py), and a later run's saves are later calls (a larger variant), a
    run's own in the order of its steps (they only go up). Never compare keys as tuples (step first)."""
    step, variant = key
    return variant, step


def newest(keys: Iterable[Key]) -> Key | None:
    return max(keys, key=call_order, default=None)


class Zygote:
    """``crash_child.py zygote``: forks the runs and says when each is gone."""

    def __init__(self, log: Path) -> None:
        self._stderr = open(log, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), "zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            bufsize=1,
        )
        self.log = log
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._expect("zygote")
        self.pid: int | None = None

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.strip())
        self._lines.put(None)

    def _expect(self, word: str, timeout: float = _LINE_TIMEOUT_S) -> list[str]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"the zygote said nothing for {timeout:.0f}s; its stderr: {self.stderr()}") from None
        if line is None or not line.startswith(word):
            raise RuntimeError(f"the zygote said {line!r}, not {word!r}; its stderr: {self.stderr()}")
        return line.split()

    def spawn(self, spec: dict[str, Any]) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()
        self.pid = int(self._expect("pid")[1])
        return self.pid

    def kill(self) -> None:
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)  # not reaped until the zygote says so: the pid is not reused
            except ProcessLookupError:
                pass

    def exited(self, timeout: float) -> int | None:
        """The wait status of the run, once the zygote reaped it; None if it still runs after ``timeout``."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            return None
        if line is None or not line.startswith("exit"):
            raise RuntimeError(f"the zygote said {line!r}; its stderr: {self.stderr()}")
        self.pid = None
        return int(line.split()[2])

    def stderr(self) -> str:
        self._stderr.flush()
        return self.log.read_text(errors="replace")[-2000:]

    def close(self) -> None:
        self.kill()
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()


@dataclass
class History:
    """What the runs saved and what they were told was committed, over the whole campaign, and the
    model of which save descends from which (the lineages the library must agree with).

    ``parent``: the version each save descends from. A run's first save descends from the version it
    restored or, without a restore, from the newest save held when it began (the head at the last
    check); each later save from the run's previous one. A save of a step at or below that version's
    step descends from its nearest ancestor below the step (saving a step again, or going lower,
    leaves what was saved at or above it). A version is live when it is in the chain of the newest
    save held (:meth:`chain`), abandoned otherwise.
    """

    runs: dict[int, tuple[int, int]] = field(default_factory=dict)  # variant -> (first step, last step saving began)
    acked: dict[str, Key] = field(default_factory=dict)  # tier -> newest (call order) version acknowledged committed there
    acked_all: dict[str, set[Key]] = field(default_factory=dict)  # tier -> every version acknowledged committed there
    commits: collections.Counter[str] = field(default_factory=collections.Counter)
    saves: int = 0
    parent: dict[Key, Key | None] = field(default_factory=dict)
    # Versions some later save() call does not descend from: each may have been abandoned while a tier
    # held it (and pruned as such), whatever the newest save says now. Saves that may never have
    # reached save()'s end count too: this only ever makes the retention check (Campaign._check_retained) weaker.
    left: set[Key] = field(default_factory=set)

    def newest_acked(self) -> Key | None:
        return newest(self.acked.values())

    def saved(self, key: Key) -> bool:
        step, variant = key
        first, last = self.runs.get(variant, (1, 0))
        return first <= step <= last

    def chain(self, key: Key | None) -> set[Key]:
        """``key`` and every version it descends from."""
        out: set[Key] = set()
        while key is not None:
            out.add(key)
            key = self.parent.get(key)
        return out

    def below(self, key: Key | None, step: int) -> Key | None:
        """The version a save of ``step`` descends from when it follows ``key``: ``key`` if its step is
        lower, else its nearest ancestor below ``step``."""
        while key is not None and key[0] >= step:
            key = self.parent.get(key)
        return key

    def record(self, variant: int, first: int, last: int, follows: Key | None) -> None:
        """Run ``variant`` began saving steps ``first`` to ``last`` after ``follows`` (the version it
        restored, or the newest held when it began)."""
        self.runs[variant] = (first, last)
        older = set(self.parent)
        self.parent[(first, variant)] = self.below(follows, first)
        for step in range(first + 1, last + 1):
            self.parent[(step, variant)] = (step - 1, variant)
        self.left |= older - self.chain((first, variant))


@dataclass
class Kill:
    index: int
    plan: str  # "random" or a kill point
    n: int
    delay_s: float | None
    variant: int
    start: int
    rewind: bool  # starts at or below the newest step held, without a restore (saving steps again)
    pace_s: float
    restore: int | None = None  # a rollback: the step it restores first (it starts after it)
    got: Key | None = None  # what that restore loaded (the run's report)
    follows: Key | None = None  # the version its first save descends from, before ``History.below``
    to_abandoned: bool = False  # the restore loaded a version abandoned at the last check
    hit: bool = False
    missed: bool = False
    in_flight: list[str] = field(default_factory=list)  # phase groups in flight when it died
    phase: str = "idle"  # the phase the kill is counted under
    saved: int = 0
    last_saving: int | None = None
    status: str = ""
    leftovers: dict[str, int] = field(default_factory=dict)  # what the kill left, by kind
    restored: Key | None = None
    newest_acked: Key | None = None
    versions: dict[str, list[Key]] = field(default_factory=dict)
    abandoned: dict[str, list[Key]] = field(default_factory=dict)  # of ``versions``, those listed abandoned
    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _where(point: str) -> str:
    """What a kill point is, in words."""
    other = {
        "open.sweep": "in the next open, sweeping (or putting back) what a kill left",
        "capture": "in a copy thread, after one tensor of a save was copied to host memory",
        "saved": "right after save() returned, the host copy under way",
    }
    return other.get(point) or child._TIER_POINTS[point.split(".", 1)[1]]


def _link_copy(src: Path, dst: Path) -> None:
    """A copy of ``src`` made of hard links: opening it renames and unlinks names, never writes a byte."""
    for dirpath, dirnames, filenames in os.walk(src):
        target = dst / os.path.relpath(dirpath, src)
        target.mkdir(parents=True, exist_ok=True)
        for name in filenames:
            os.link(os.path.join(dirpath, name), target / name)


def _leftovers(path: Path) -> list[str]:
    if not path.is_dir():
        return []
    return sorted(n for n in os.listdir(path) if n.startswith(LEFTOVER))


class Campaign:
    def __init__(self, workdir: Path, seed: int, *, max_delay_s: float, max_steps: int, log: Callable[[str], None],
                 delta: int | None = None) -> None:
        self.work = workdir
        self.delta = delta  # both disk tiers store differential versions: delta: {full_every: delta}
        self.data = workdir / "data"  # the tiers' directories, as the runs leave them
        self.runs = workdir / "runs"
        for path in (self.data, self.runs):
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
        self.rng = random.Random(seed)
        self.max_delay_s = max_delay_s
        self.max_steps = max_steps
        self.log = log
        self.bases = child.campaign_bases()
        self.history = History()
        self.restored: Key | None = None
        self.held: dict[str, list[Key]] = {}  # what each tier held at the last check
        self.head: Key | None = None  # the newest save held at the last check (call order)
        self.live: set[Key] = set()  # its chain: the versions the model says are live
        # Acknowledged versions gone from a tier that no later save left (Campaign._check_retained).
        self.outdated: set[tuple[str, Key]] = set()
        self.kills: list[Kill] = []
        self._points: list[str] = []

    # -- planning --

    def _next_point(self, leftovers: bool) -> str:
        while True:
            if not self._points:
                self._points = sorted(child.POINTS)
                self.rng.shuffle(self._points)
            point = self._points.pop()
            if point != "open.sweep" or leftovers:
                return point
            self._points.insert(0, point)  # nothing to sweep now: later
            if len(self._points) == 1:
                self._points = []

    def _plan(self, index: int) -> Kill:
        leftovers = bool(self.kills and self.kills[-1].leftovers)
        if index % 2 == 0:
            plan, n, delay = "random", 0, self.rng.uniform(0.0, self.max_delay_s)
        else:
            plan = self._next_point(leftovers)
            n = self.rng.randint(1, _MOST_HITS.get(plan, 3))
            delay = None
        last = self.head[0] if self.head is not None else 0
        held = [step for step, _ in self.held.get(plan.split(".")[0], [])]
        steps = {step for keys in self.held.values() for step, _ in keys}
        restore: int | None = None
        if plan.endswith(("replace_moved", "rmtree_replaced")) and held:
            # The newest step that tier holds is saved again first: after a restore of the step
            # below it, if some tier holds that, or by going back to it without one.
            target = max(held)
            if target - 1 in steps and self.rng.random() < 0.5:
                restore = target - 1
            rewind, start = restore is None, target
        else:
            draw = self.rng.random()
            lower = sorted(s for s in steps if s < last)
            # A rollback to a version held below the newest, of the live direction or an abandoned
            # one; now and then to a higher step only an abandoned direction holds (training on
            # from it makes that direction live again).
            higher = sorted(s for s in steps if s > last)
            if draw < 0.2 and (lower or higher):
                restore = self.rng.choice(higher if higher and (not lower or self.rng.random() < 0.25) else lower)
                rewind, start = False, restore + 1  # a rollback's saves start after the step it restored
            elif draw < 0.4 and last:
                rewind, start = True, max(1, last - self.rng.randint(0, 2))
            else:
                rewind, start = False, last + 1
        pace = self.rng.choice([0.0, 0.01, 0.05])
        return Kill(index, plan, n, delay, variant=index + 1, start=start, rewind=rewind, pace_s=pace, restore=restore)

    # -- one kill --

    def run_one(self, zygote: Zygote, index: int) -> Kill:
        kill = self._plan(index)
        began = time.perf_counter()
        events, flags = self.runs / f"{index:04d}.events", self.runs / f"{index:04d}.flags"
        spec = {
            "root": str(self.data),
            "events": str(events),
            "flags": str(flags),
            "log": str(self.runs / f"{index:04d}.log"),
            "start": kill.start,
            "restore": kill.restore,
            "variant": kill.variant,
            "pace_s": kill.pace_s,
            "target": None if kill.plan == "random" else kill.plan,
            "n": kill.n,
            "max_steps": self.max_steps,
            "delta": self.delta,
        }
        zygote.spawn(spec)
        status = self._until_dead(zygote, kill, events)
        words = [line.split() for line in events.read_text().splitlines() if line]
        self._account(kill, words, status)
        raw = flags.read_bytes() if flags.exists() else b""
        kill.in_flight = sorted(
            {child.PHASE_GROUP[p] for i, p in enumerate(child.PHASES) if i < len(raw) and raw[i]}, key=GROUPS.index
        )
        if kill.hit:
            kill.phase = child.POINTS[kill.plan]
        else:
            kill.phase = next((g for g in reversed(GROUPS) if g in kill.in_flight), "idle")
        for tier in ("nvme", "pfs"):
            for name in _leftovers(self.data / tier):
                kind = name.split("-", 1)[0] + "-"
                kill.leftovers[kind] = kill.leftovers.get(kind, 0) + 1
        if status != "SIGKILL":
            kill.violations.append(f"the run did not die by SIGKILL ({status}): {(self.runs / f'{index:04d}.log').read_text()[-1500:]}")
        self.check(kill)
        kill.seconds = time.perf_counter() - began
        self.kills.append(kill)
        for path in (events, flags):
            path.unlink(missing_ok=True)
        if not kill.violations:
            (self.runs / f"{index:04d}.log").unlink(missing_ok=True)
        return kill

    def _until_dead(self, zygote: Zygote, kill: Kill, events: Path) -> str:
        deadline = time.monotonic() + _LINE_TIMEOUT_S
        killed_at: float | None = None
        while True:
            status = zygote.exited(timeout=0.01)
            if status is not None:
                break
            now = time.monotonic()
            if killed_at is None:
                text = events.read_text() if events.exists() else ""
                if kill.plan == "random" and "ready\n" in text:
                    killed_at = now + (kill.delay_s or 0.0)
                elif kill.plan != "random" and "missed\n" in text:
                    killed_at = now + self.rng.uniform(0.0, 0.3)
                elif now > deadline:
                    killed_at = now
            if killed_at is not None and now >= killed_at:
                zygote.kill()
                killed_at = float("inf")
        if os.WIFSIGNALED(status):
            return signal.Signals(os.WTERMSIG(status)).name
        return f"exit {os.WEXITSTATUS(status)}"

    def _account(self, kill: Kill, words: list[list[str]], status: str) -> None:
        kill.status = status
        history = self.history
        for w in words:
            if w[0] == "saving":
                kill.last_saving = int(w[1])
            elif w[0] == "saved":
                kill.saved += 1
                history.saves += 1
            elif w[0] == "restored":
                kill.got = (int(w[1]), int(w[2]))
            elif w[0] == "committed":
                tier, key = w[1], (int(w[2]), kill.variant)
                history.commits[tier] += 1
                history.acked_all.setdefault(tier, set()).add(key)
                if tier not in history.acked or call_order(key) > call_order(history.acked[tier]):
                    history.acked[tier] = key
            elif w[0] == "hit":
                kill.hit = True
            elif w[0] == "missed":
                kill.missed = True
            elif w[0] == "error":
                kill.violations.append("the run reported: " + " ".join(w[1:]))
        if kill.got is not None:
            self._check_rollback(kill)
        if kill.last_saving is not None:
            if kill.restore is not None and kill.got is None:
                kill.violations.append(f"the run saved after its restore of step {kill.restore} without reporting it")
            kill.follows = kill.got if kill.restore is not None else self.head
            history.record(kill.variant, kill.start, kill.last_saving, kill.follows)

    def _check_rollback(self, kill: Kill) -> None:
        """A rollback's ``restore(step)`` loads a version some tier held at the last check, the live
        one where one is held (the child checked the bytes; the history checks the variant saved it)."""
        assert kill.got is not None
        step, variant = kill.got
        held = {k for keys in self.held.values() for k in keys if k[0] == step}
        live = held & self.live
        if step != kill.restore or kill.got not in held:
            kill.violations.append(f"restore({kill.restore}) loaded {kill.got}; the tiers held {sorted(held)}")
        elif live and kill.got not in live:
            kill.violations.append(f"restore({step}) loaded {kill.got}, abandoned, though the tiers held {sorted(live)} live")
        kill.to_abandoned = kill.got not in self.live
        if not self.history.saved(kill.got):
            kill.violations.append(f"restore({step}) loaded variant {variant}, which never saved step {step}")

    # -- the checks --

    def _expected(self, key: Key) -> Any:
        return child.campaign_state(key[0], key[1], self.bases)

    def _verify(self, state: Any, step: int, what: str) -> tuple[Key | None, list[str]]:
        """The (step, variant) a restored state holds, and what is wrong with it."""
        variant = state.get("variant") if isinstance(state, dict) else None
        if not isinstance(variant, int):
            return None, [f"{what}: holds no variant"]
        key = (step, variant)
        if not self.history.saved(key):
            return key, [f"{what}: step {step} variant {variant} was never saved"]
        diff = child.differences(state, self._expected(key))
        return key, [f"{what}: differs from what run {variant} saved at step {step}: {diff[:3]}"] if diff else []

    def _alone(self, info: Any, check: Path) -> tuple[Key | None, list[str]]:
        """Restore one listed version on its own (a tier holding only it, and its base if it is a
        differential version), and verify it."""
        alone = check / "alone" / info.tier
        shutil.rmtree(alone.parent, ignore_errors=True)
        _link_copy(Path(info.path), alone / Path(info.path).name)
        if info.base is not None:  # its base: in place, or kept aside once its step was saved again
            base = Path(info.path).with_name(version_dirname(info.base))
            for kept in [base, *base.parent.glob(f".replaced-{base.name}-*")]:
                if kept.exists():
                    _link_copy(kept, alone / kept.name)
        tier = {"name": info.tier, "type": "filesystem", "path": str(alone)} | ({"delta": {"full_every": self.delta}} if self.delta else {})
        config = {"host": {"capacity": "16MiB", "snapshots": 2}, "tiers": [{"name": "ram", "type": "memory"}, tier]}
        what = f"{info.tier} step {info.step}"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with Checkpointer(config) as ckpt:
                # restore(step), not restore_latest(): the base's step in place may hold a newer save
                # (its step saved again, the base kept aside), which would be the latest here.
                try:
                    restored = ckpt.restore_sync(info.step)
                except Exception as exc:  # noqa: BLE001 - a violation, with what the tier held
                    held = [(i.step, i.serial, i.abandoned, i.base) for i in ckpt.versions()]
                    return None, [f"{what} (serial {info.serial}) is listed but does not restore alone: {exc!r}; "
                                  f"alone, the tier holds {held} ({sorted(os.listdir(alone))})"]
        if restored.step != info.step or caught:
            return None, [f"{what} restored alone gave step {restored.step}: {[str(w.message) for w in caught]}"]
        return self._verify(restored.state, info.step, what)

    def check(self, kill: Kill) -> None:
        check = self.work / "check"
        shutil.rmtree(check, ignore_errors=True)
        _link_copy(self.data, check / "data")
        v = kill.violations
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with Checkpointer(child.campaign_config(check / "data", self.delta)) as ckpt:
                    left = {t: _leftovers(check / "data" / t) for t in ("nvme", "pfs")}
                    infos = ckpt.versions()
                    restored = ckpt.restore_latest_sync()
            except Exception as exc:  # noqa: BLE001 - a violation, with the kill's details
                v.append(f"open or restore raised {exc!r}")
                self.restored, self.held, self.head, self.live = None, {}, None, set()
                return
        for tier, names in left.items():
            # With delta, an earlier version of a step saved again stays aside while versions written
            # against it are listed (stored.read.find_base reads their base there): not a leftover.
            bases = {version_dirname(i.base) for i in infos if i.tier == tier and i.base is not None}
            names = [n for n in names if not (n.startswith(".replaced-") and n[len(".replaced-") :].rsplit("-", 1)[0] in bases)]
            if names:
                v.append(f"{tier}: left after open: {names}")
        v += [f"restore warned: {w.message}" for w in caught]
        for info in infos:
            if not info.valid:
                v.append(f"versions() lists {info.tier} step {info.step} as not valid")
                continue
            key, problems = self._alone(info, check)
            v += problems
            if key is not None:
                kill.versions.setdefault(info.tier, []).append(key)
                if info.abandoned:
                    kill.abandoned.setdefault(info.tier, []).append(key)
        head = newest(k for keys in kill.versions.values() for k in keys)
        live = self.history.chain(head)
        v += self._check_abandoned(kill, head, live)
        v += self._check_retained(kill)
        kill.newest_acked = self.history.newest_acked()
        if restored is None:
            kill.restored = None
            if kill.newest_acked is not None:
                v.append(f"nothing restored, though {kill.newest_acked} was acknowledged committed")
            elif head is not None:
                v.append(f"nothing restored, though the tiers list {head}")
        else:
            key, problems = self._verify(restored.state, restored.step, f"restored ({restored.tier})")
            v += problems
            kill.restored = key
            v += self._check_resumed(kill, key)
        self.restored = kill.restored
        self.held = kill.versions
        self.head, self.live = head, live
        shutil.rmtree(check, ignore_errors=True)

    def _check_abandoned(self, kill: Kill, head: Key | None, live: set[Key]) -> list[str]:
        """Every listed version is abandoned (``VersionInfo.abandoned``) exactly when the model says so:
        when it is not in the chain of ``head``, the newest save listed."""
        wrong = []
        for tier, keys in kill.versions.items():
            marked = set(kill.abandoned.get(tier, []))
            for key in keys:
                if (key in marked) != (key not in live):
                    said, model = ("abandoned", "live") if key in marked else ("live", "abandoned")
                    wrong.append(f"versions() lists {tier} {key} as {said}; the model says {model} (newest save {head})")
        return wrong

    def _check_resumed(self, kill: Kill, key: Key | None) -> list[str]:
        """The resumed version is the newest live version listed, and no older than any acknowledged."""
        if key is None:
            return []
        wrong = []
        listed_live = [k for t, keys in kill.versions.items() for k in keys if k not in kill.abandoned.get(t, [])]
        newest_live = newest(listed_live)
        if key != newest_live:
            wrong.append(f"restored {key}, not the newest live version listed, {newest_live}")
        if any(key in keys for keys in kill.abandoned.values()):
            wrong.append(f"restored {key}, which versions() lists as abandoned")
        if kill.newest_acked is not None and call_order(key) < call_order(kill.newest_acked):
            wrong.append(f"restored {key}, older than {kill.newest_acked}, acknowledged committed")
        return wrong

    def _check_retained(self, kill: Kill) -> list[str]:
        """No tier lost a version retention had to keep: each holds what it acknowledged committed,
        unless newer saves on it outdated that, as retention allows.

        Retention, after each commit on a tier, keeps the version just committed, the newest
        ``keep.last`` live versions (by step: live versions are one chain, steps rising with the calls)
        and the newest ``keep.abandoned`` (1) abandoned one (by call); a newer save of a step replaces
        it. So a tier's newest version goes only for a newer one: the tier holds its newest
        acknowledged version ``A`` or something newer (call order).

        Stronger, for every version ``A`` acknowledged on a tier that no later save left
        (``History.left``): ``A`` was live at every prune and every newer save descends from it, so it
        went only when ``keep.last`` newer live versions, its descendants, were on the tier. At each
        later prune the tier keeps the save just committed (a descendant) and the next newest live
        version or, where every other descendant is abandoned, the newest abandoned one, a descendant
        too; a replacement is a descendant: the tier holds ``A`` or at least ``keep.last`` of its
        descendants (2 here). After a rollback, the new direction's versions are such an ``A`` until a
        later run leaves them: a tier whose retention counted the abandoned direction's higher steps
        would keep only the last one committed, and fail this.
        """
        wrong = []
        for tier, acked in self.history.acked.items():
            held = set(kill.versions.get(tier, []))
            order = sorted(held, key=call_order)
            if acked not in held and not any(call_order(k) > call_order(acked) for k in held):
                wrong.append(f"{tier} lost {acked}, its newest version acknowledged committed: it holds only {order}")
            keep = _KEEP_LAST[tier]
            chains = [(k, self.history.chain(k)) for k in order]
            for a in sorted(self.history.acked_all.get(tier, set()) - held - self.history.left, key=call_order):
                descendants = [k for k, chain in chains if a in chain]
                self.outdated.add((tier, a))
                if len(descendants) < keep:
                    wrong.append(
                        f"{tier} lost {a}, acknowledged committed there, never left by a later save: it holds "
                        f"{len(descendants)} of its descendants, retention keeps {keep}; it holds {order}"
                    )
        return wrong

    # -- the whole campaign --

    def run(self, kills: int) -> None:
        zygote = Zygote(self.runs / "zygote.stderr")
        try:
            for i in range(kills):
                kill = self.run_one(zygote, i)
                plan = kill.plan if kill.plan == "random" else f"{kill.plan}#{kill.n}{'' if kill.hit else ' (missed)'}"
                if kill.restore is not None:
                    how = f"rollback to {kill.got or (kill.restore, '?')}, "
                else:
                    how = "rewind, " if kill.rewind else ""
                abandoned = sum(len(keys) for keys in kill.abandoned.values())
                self.log(
                    f"kill {i + 1:4d}/{kills}: {plan:<28} phase {kill.phase:<9} in flight {','.join(kill.in_flight) or '-':<30} "
                    f"{how}steps {kill.start}..{kill.last_saving} restored {kill.restored} acked {kill.newest_acked} "
                    f"abandoned listed {abandoned} "
                    f"{'OK' if not kill.violations else 'VIOLATION: ' + '; '.join(kill.violations)}"
                )
        finally:
            zygote.close()

    def report(self) -> dict[str, Any]:
        kills = self.kills
        by_phase: dict[str, dict[str, int]] = {g: {"targeted": 0, "random": 0} for g in (*GROUPS, "idle")}
        in_flight: collections.Counter[str] = collections.Counter()
        by_point: dict[str, dict[str, int]] = {p: {"planned": 0, "hit": 0} for p in sorted(child.POINTS)}
        leftovers: collections.Counter[str] = collections.Counter()
        for k in kills:
            by_phase[k.phase]["targeted" if k.hit else "random"] += 1
            in_flight.update(k.in_flight or ["idle"])
            if k.plan != "random":
                by_point[k.plan]["planned"] += 1
                by_point[k.plan]["hit"] += int(k.hit)
            leftovers.update(k.leftovers)
        lost = sum(
            1 for k in kills
            if k.newest_acked is not None and (k.restored is None or call_order(k.restored) < call_order(k.newest_acked))
        )
        return {
            "kills": len(kills),
            "random_kills": sum(k.plan == "random" for k in kills),
            "targeted_kills": sum(k.plan != "random" for k in kills),
            "targeted_hits": sum(k.hit for k in kills),
            "by_phase": by_phase,
            "in_flight": dict(in_flight),
            "by_point": by_point,
            "restores_ok": sum(not k.violations and (k.restored is not None or k.newest_acked is None) for k in kills),
            "restored_nothing": sum(k.restored is None for k in kills),
            "versions_lost": lost,
            "violations": [f"kill {k.index + 1} ({k.plan}): {v}" for k in kills for v in k.violations],
            "kills_with_violations": sum(bool(k.violations) for k in kills),
            "leftovers_after_kills": dict(leftovers),
            "left_after_open": sum(1 for k in kills for v in k.violations if "left after open" in v),
            "versions_verified": sum(len(x) for k in kills for x in k.versions.values()),
            "rewound_runs": sum(k.rewind for k in kills),
            "rollback_runs": sum(k.restore is not None for k in kills),
            "rollbacks_restored": sum(k.got is not None for k in kills),
            "rollbacks_saving": sum(k.got is not None and k.last_saving is not None for k in kills),
            # Rollbacks that loaded a version the model said was abandoned: its direction live again.
            "rollbacks_to_abandoned": sum(k.to_abandoned for k in kills),
            "abandoned_listed": sum(len(x) for k in kills for x in k.abandoned.values()),
            "outdated_checked": len(self.outdated),
            "kills_listing_abandoned": sum(any(k.abandoned.values()) for k in kills),
            "saves": self.history.saves,
            "commits_acknowledged": dict(self.history.commits),
            "seconds_per_kill": round(sum(k.seconds for k in kills) / max(1, len(kills)), 3),
            "points": {p: {"phase": g, "where": _where(p)} for p, g in child.POINTS.items()},
            "per_kill": [
                {
                    "plan": k.plan, "n": k.n, "hit": k.hit, "missed": k.missed, "delay_s": k.delay_s, "phase": k.phase,
                    "in_flight": k.in_flight, "start": k.start, "last_saving": k.last_saving, "rewind": k.rewind,
                    "restore": k.restore, "got": k.got, "abandoned": k.abandoned,
                    "status": k.status, "leftovers": k.leftovers, "restored": k.restored, "newest_acked": k.newest_acked,
                    "versions": k.versions, "violations": k.violations, "seconds": round(k.seconds, 3),
                }
                for k in kills
            ],
        }


def campaign(kills: int, seed: int, workdir: Path, *, max_delay_s: float = 1.5, max_steps: int = 12,
             log: Callable[[str], None] = print, delta: int | None = None) -> dict[str, Any]:
    """Run ``kills`` kills; returns the report (see :meth:`Campaign.report`). ``delta``: the disk
    tiers store differential versions, a whole one every ``delta``."""
    c = Campaign(workdir, seed, max_delay_s=max_delay_s, max_steps=max_steps, log=log, delta=delta)
    began = time.perf_counter()
    c.run(kills)
    report = c.report()
    report.update(seed=seed, max_delay_s=max_delay_s, max_steps=max_steps, delta=delta, wall_s=round(time.perf_counter() - began, 1))
    return report


def markdown(report: dict[str, Any], machine: dict[str, Any], json_name: str) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime(report["finished"]))
    lines = [
        f"### crash campaign: {report['kills']} SIGKILLs of a saving process ({stamp})",
        "",
        f"Machine: {machine.get('cpu', '?')}, {machine.get('cores', '?')} cores, {machine.get('ram_gib', '?')} GiB RAM, "
        f"Linux {machine.get('kernel', '?')}; disk: {machine.get('disk', '?')}, O_DIRECT: {machine.get('o_direct', '?')}; "
        f"Python {machine.get('python', '?')}, torch {machine.get('torch', '?')}; shared with other work. "
        f"Command: `flock /tmp/tierckpt-bench.lock {report['command']}`; raw numbers: `{json_name}`.",
        "",
        "A 6 MiB state saved every step through ram → nvme (keep 2) → pfs (even steps, zstd, keep 2)"
        + (f", both disk tiers storing differential versions (`delta: {{full_every: {report['delta']}}}`)" if report.get("delta") else "")
        + "; each run "
        f"resumes from what the last kill left, or goes back: {report['rewound_runs']} rewinds (a few steps back without a "
        f"restore, saving committed steps again) and {report['rollback_runs']} rollbacks (`restore(step)` of a step a tier "
        "held, then saving the steps after it; the newest save call is the latest). "
        f"{report['random_kills']} kills after a random delay (0–{report['max_delay_s']} s after open), "
        f"{report['targeted_kills']} aimed at a kill point ({report['targeted_hits']} reached it; a run that had not after "
        f"{report['max_steps']} saves was killed then, and counts by the phase in flight). After each kill a new process "
        "opens a hard-link copy of the directories, restores, and restores every listed version on its own; "
        "it checks each listed version's `abandoned` against a model of the lineages, that the restore is the newest live "
        "version listed, and that each tier kept what retention must keep.",
        "",
        "| phase at the kill | at a kill point | random delay or point missed (deepest phase in flight) | all |",
        "| --- | ---: | ---: | ---: |",
    ]
    for phase, counts in report["by_phase"].items():
        lines.append(f"| {phase} | {counts['targeted']} | {counts['random']} | {counts['targeted'] + counts['random']} |")
    points = ", ".join(f"{p} {c['hit']}/{c['planned']}" for p, c in report["by_point"].items() if c["planned"])
    left = ", ".join(f"{k} {v}" for k, v in sorted(report["leftovers_after_kills"].items())) or "none"
    lines += [
        "",
        f"Kill points (reached/planned): {points}.",
        "",
        "| result | count |",
        "| --- | ---: |",
        f"| kills | {report['kills']} |",
        f"| restores OK (bitwise, no older than acknowledged, every check passed) | {report['restores_ok']} |",
        f"| versions lost (restore older, in call order, than a version acknowledged committed) | {report['versions_lost']} |",
        f"| kills with any violation | {report['kills_with_violations']} |",
        f"| listed versions restored alone and verified bitwise | {report['versions_verified']} |",
        f"| rollbacks: planned / restored (verified bitwise) / saving after it / to an abandoned version | "
        f"{report['rollback_runs']} / {report['rollbacks_restored']} / {report['rollbacks_saving']} / {report['rollbacks_to_abandoned']} |",
        f"| listed versions marked abandoned, each mark checked against the model (kills listing any) | "
        f"{report['abandoned_listed']} ({report['kills_listing_abandoned']}) |",
        f"| acknowledged versions gone from a tier while no later save left them, checked at each kill to have "
        f"`keep.last` descendants there | {report['outdated_checked']} |",
        f"| restores of nothing (nothing acknowledged yet) | {report['restored_nothing']} |",
        f"| saves / commits acknowledged | {report['saves']} / "
        + ", ".join(f"{t} {n}" for t, n in sorted(report["commits_acknowledged"].items())) + " |",
        f"| seconds per kill (run, kill, checks) | {report['seconds_per_kill']} |",
        "",
        f"Leftovers the kills left: {left}; left after the next open: {report['left_after_open']}.",
    ]
    if report["violations"]:
        lines += ["", "Violations:", ""] + [f"- {v}" for v in report["violations"][:30]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/tierckpt-crash-campaign"))
    parser.add_argument("--max-delay", type=float, default=1.5, help="random kills: at most this long after the run opened (s)")
    parser.add_argument("--max-steps", type=int, default=12, help="kill-point runs: saves before giving up on the point")
    parser.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    parser.add_argument("--no-record", action="store_true", help="print only: no JSON, no RESULTS.md section")
    parser.add_argument("--quiet", action="store_true", help="no line per kill")
    parser.add_argument("--delta", type=int, default=None, metavar="N", help="the disk tiers store differential versions, a whole one every N")
    args = parser.parse_args()
    logging.getLogger("tierckpt").setLevel(logging.ERROR)  # the sweeps' notes on what each kill left: expected here
    report = campaign(args.kills, args.seed, args.dir, max_delay_s=args.max_delay, max_steps=args.max_steps, delta=args.delta,
                      log=(lambda line: None) if args.quiet else (lambda line: print(line, flush=True)))
    report["command"] = "python " + " ".join([os.path.relpath(__file__, HERE.parent), *sys.argv[1:]])
    report["finished"] = time.time()
    summary = {k: v for k, v in report.items() if k not in ("per_kill", "by_point", "points")}
    print(json.dumps(summary, indent=1, default=str))
    if args.no_record:
        return
    machine_limits = _load("machine_limits", HERE / "machine_limits.py")
    machine = machine_limits.machine(args.dir)
    report["machine"] = machine
    out = HERE / "results" / f"crash_campaign-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    with open(args.results, "a") as f:
        f.write("\n" + markdown(report, machine, out.name))
    print(f"wrote {out} and a section of {args.results}")
    sys.exit(1 if report["violations"] else 0)


if __name__ == "__main__":
    main()
