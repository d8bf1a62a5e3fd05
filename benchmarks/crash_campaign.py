"""Crash campaign: SIGKILL a saving process hundreds of times, at random and at chosen points; lose nothing.

A real process saves a deterministic state per step (6 MiB, :func:`crash_child.campaign_state`)
through ram → nvme (every step, keep 2) → pfs (even steps, zstd, keep 2), so flushes, promotions and
pruning run all the time, and reports what ``save()`` returned and what ``handle.committed(tier)``
acknowledged. The campaign kills it ``--kills`` times, each run resuming where the last one left off
(a run in five starts a few steps back, as a job resumed from an older checkpoint would, so committed
steps get replaced). Half the kills come after a random delay; the other half at a kill point of
:data:`crash_child.POINTS`, the n-th time the run gets there (n random): mid-capture, right after
``save()``, mid-write of a data file, after its fsync, staged, between the two renames of a
replacement, between the rename into place and the directory fsync, committed, pruned to ``.trash-``
and mid-removal, for nvme and for pfs, and in the sweep of the next open. The runs are forked from a
zygote that imported torch once (``crash_child.py zygote``): a kill costs well under a second, not the
seconds of a new interpreter.

After each kill, on a copy of the directories (hard links: the originals stay as the kill left them,
so the next run's own open sweeps them, and can itself be killed doing so), a Checkpointer in this
process (a new process for the killed one) must:

- leave no ``.tmp-``/``.trash-``/``.replaced-`` entry once open;
- list only valid versions (``versions()``), each of which, restored alone, is bitwise the state that
  was saved at its step by the run whose variant it holds, a run that did save that step;
- restore (``restore_latest``, no warning of a damaged version) a version bitwise equal to what was
  saved, no older than the newest version any run had acknowledged as committed on any tier before
  the kill (a lost version otherwise), and no tier may hold less than what was acknowledged on it.

Figures (kills by phase and kill point, restores OK, versions lost, violations with details) are printed
and written to ``benchmarks/results/crash_campaign-<ts>.json``, and a section is appended to RESULTS.md
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
from typing import Any, Callable

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
Key = tuple[int, int]  # (step, variant): what a version holds; later runs have larger variants


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
    """What the runs saved and what they were told was committed, over the whole campaign."""

    runs: dict[int, tuple[int, int]] = field(default_factory=dict)  # variant -> (first step, last step saving began)
    acked: dict[str, Key] = field(default_factory=dict)  # tier -> newest (step, variant) acknowledged committed there
    commits: collections.Counter[str] = field(default_factory=collections.Counter)
    saves: int = 0

    def newest_acked(self) -> Key | None:
        return max(self.acked.values(), default=None)

    def saved(self, key: Key) -> bool:
        step, variant = key
        first, last = self.runs.get(variant, (1, 0))
        return first <= step <= last


@dataclass
class Kill:
    index: int
    plan: str  # "random" or a kill point
    n: int
    delay_s: float | None
    variant: int
    start: int
    rewind: bool
    pace_s: float
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


def _differences(actual: Any, expected: Any, prefix: str = "") -> list[str]:
    """Where two states differ: structure, types, dtypes, shapes, bytes."""
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or list(actual) != list(expected):
            return [f"{prefix or 'state'}: keys {list(actual) if isinstance(actual, dict) else type(actual)}"]
        return [d for k in expected for d in _differences(actual[k], expected[k], f"{prefix}{k}.")]
    if isinstance(expected, (list, tuple)):
        if type(actual) is not type(expected) or len(actual) != len(expected):
            return [f"{prefix}: {type(actual).__name__} of {len(actual) if hasattr(actual, '__len__') else '?'}"]
        return [d for i, (a, e) in enumerate(zip(actual, expected)) for d in _differences(a, e, f"{prefix}{i}.")]
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor) or (actual.dtype, actual.shape) != (expected.dtype, expected.shape):
            return [f"{prefix}: not {expected.dtype}{list(expected.shape)}"]
        if not torch.equal(actual.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8)):
            return [f"{prefix}: bytes differ"]
        return []
    if type(actual) is not type(expected) or actual != expected:
        return [f"{prefix}: {actual!r} != {expected!r}"]
    return []


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
        last = self.restored[0] if self.restored is not None else 0
        held = [step for step, _ in self.held.get(plan.split(".")[0], [])]
        if plan.endswith(("replace_moved", "rmtree_replaced")) and held:
            rewind, start = True, max(held)  # the newest step that tier holds is saved again first
        elif self.rng.random() < 0.2 and last:
            rewind, start = True, max(1, last - self.rng.randint(0, 2))
        else:
            rewind, start = False, last + 1
        pace = self.rng.choice([0.0, 0.01, 0.05])
        return Kill(index, plan, n, delay, variant=index + 1, start=start, rewind=rewind, pace_s=pace)

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
            elif w[0] == "committed":
                tier, key = w[1], (int(w[2]), kill.variant)
                history.commits[tier] += 1
                if tier not in history.acked or key > history.acked[tier]:
                    history.acked[tier] = key
            elif w[0] == "hit":
                kill.hit = True
            elif w[0] == "missed":
                kill.missed = True
            elif w[0] == "error":
                kill.violations.append("the run reported: " + " ".join(w[1:]))
        if kill.last_saving is not None:
            history.runs[kill.variant] = (kill.start, kill.last_saving)

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
        diff = _differences(state, self._expected(key))
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
                restored = ckpt.restore_latest_sync()
        if restored is None or restored.step != info.step:
            return None, [f"{what} is listed but does not restore: {[str(w.message) for w in caught]}"]
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
                self.restored, self.held = None, {}
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
        for tier, acked in self.history.acked.items():
            held = max(kill.versions.get(tier, []), default=None)
            if held is None or held < acked:
                v.append(f"{tier} holds {held}, older than {acked}, acknowledged committed there")
        kill.newest_acked = self.history.newest_acked()
        if restored is None:
            kill.restored = None
            if kill.newest_acked is not None:
                v.append(f"nothing restored, though {kill.newest_acked} was acknowledged committed")
        else:
            key, problems = self._verify(restored.state, restored.step, f"restored ({restored.tier})")
            v += problems
            kill.restored = key
            if key is not None and kill.newest_acked is not None and key < kill.newest_acked:
                v.append(f"restored {key}, older than {kill.newest_acked}, acknowledged committed")
        self.restored = kill.restored
        self.held = kill.versions
        shutil.rmtree(check, ignore_errors=True)

    # -- the whole campaign --

    def run(self, kills: int) -> None:
        zygote = Zygote(self.runs / "zygote.stderr")
        try:
            for i in range(kills):
                kill = self.run_one(zygote, i)
                plan = kill.plan if kill.plan == "random" else f"{kill.plan}#{kill.n}{'' if kill.hit else ' (missed)'}"
                self.log(
                    f"kill {i + 1:4d}/{kills}: {plan:<28} phase {kill.phase:<9} in flight {','.join(kill.in_flight) or '-':<30} "
                    f"steps {kill.start}..{kill.last_saving} restored {kill.restored} acked {kill.newest_acked} "
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
            if k.newest_acked is not None and (k.restored is None or k.restored < k.newest_acked)
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
            "saves": self.history.saves,
            "commits_acknowledged": dict(self.history.commits),
            "seconds_per_kill": round(sum(k.seconds for k in kills) / max(1, len(kills)), 3),
            "points": {p: {"phase": g, "where": _where(p)} for p, g in child.POINTS.items()},
            "per_kill": [
                {
                    "plan": k.plan, "n": k.n, "hit": k.hit, "missed": k.missed, "delay_s": k.delay_s, "phase": k.phase,
                    "in_flight": k.in_flight, "start": k.start, "last_saving": k.last_saving, "rewind": k.rewind,
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
        "resumes from what the last kill left (one in five a few steps back, replacing committed steps). "
        f"{report['random_kills']} kills after a random delay (0–{report['max_delay_s']} s after open), "
        f"{report['targeted_kills']} aimed at a kill point ({report['targeted_hits']} reached it; a run that had not after "
        f"{report['max_steps']} saves was killed then, and counts by the phase in flight). After each kill a new process "
        "opens a hard-link copy of the directories, restores, and restores every listed version on its own.",
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
        f"| versions lost (restore older than a version acknowledged committed) | {report['versions_lost']} |",
        f"| kills with any violation | {report['kills_with_violations']} |",
        f"| listed versions restored alone and verified bitwise | {report['versions_verified']} |",
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
