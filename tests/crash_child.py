"""The process test_crash.py kills: saves a deterministic state per step to ram → nvme, reporting progress.

Usage: ``python crash_child.py <nvme dir> loop``
    Saves steps 1, 2, 3, ... for ever. Prints ``saved <step>`` when save() returned and
    ``committed <step>`` once ``handle.committed("nvme")`` resolved True.

Usage: ``python crash_child.py <nvme dir> pause <point> <step>``
    Saves steps 1 .. step-1, each waited until committed, then saves ``step`` (with the state of
    variant 1 when ``point`` is ``replace``, which first saves ``step`` itself) and stops for good at
    ``point`` of its flush, printing ``paused <point> <step>``:

    - ``data``: in the middle of writing the data file (after its first chunk);
    - ``staged``: the version is written and fsynced under its temporary name, not yet renamed;
    - ``replace``: ``step`` was committed before; the old version has been moved aside and the new
      one not yet renamed into place.

Every line goes to stdout, flushed at once. The parent SIGKILLs this process.

Usage: ``python crash_child.py zygote`` (``benchmarks/crash_campaign.py``)
    Imports torch and tierckpt once, then forks one saving process per JSON line read on stdin (a
    campaign run, see :func:`campaign_run`), printing ``pid <pid>`` and, once that process is gone,
    ``exit <pid> <wait status>``. A fork costs milliseconds where a new interpreter importing torch
    costs seconds: that is what makes hundreds of kills affordable. The runs save through
    ram → nvme → pfs (:func:`campaign_config`) and die by SIGKILL: from the campaign after a random
    delay, or by their own hand at a kill point (:data:`POINTS`) of capture, flush, promotion, pruning
    or the sweep on open. A run saves on from the step it is given, or first rolls back: it restores
    an earlier step with ``restore(step)``, checks that it got bitwise what some run saved there
    (:func:`differences`), and saves the steps after it, so that its saves are the latest although
    an abandoned direction holds higher steps (``tierckpt/format/lineage.py``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

import torch

BIG_NUMEL = 6 << 20  # 24 MiB of float32: two 16 MiB chunks, so a flush takes a while


def base() -> torch.Tensor:
    return torch.randn(BIG_NUMEL, generator=torch.Generator().manual_seed(1234))


def make_state(step: int, big: torch.Tensor, variant: int = 0) -> dict[str, Any]:
    """The state saved as ``step``; ``big`` is :func:`base` (computed once: it is large)."""
    g = torch.Generator().manual_seed(step * 10 + variant)
    return {
        "big": big + (step + 1000 * variant),
        "small": torch.randn(1000, generator=g),
        "ints": torch.full((4096,), step, dtype=torch.int64),
        "step": step,
        "variant": variant,
    }


def config(root: str) -> dict[str, Any]:
    return {
        "host": {"capacity": "64MiB", "snapshots": 2},
        "tiers": [
            {"name": "ram", "type": "memory", "keep": {"last": 1}},
            {"name": "nvme", "type": "filesystem", "path": root, "keep": {"last": 2}},
        ],
    }


_print_lock = threading.Lock()


def say(*words: object) -> None:
    with _print_lock:
        print(*words, flush=True)


def hang() -> None:
    threading.Event().wait()


def install_pause(point: str, step: int) -> None:
    """Patch the filesystem tier so that the flush of ``step`` stops for good at ``point``."""
    import aiofiles.os

    from tierckpt.format import version_dirname
    from tierckpt.storage import local
    from tierckpt.tiers import filesystem
    from tierckpt.tiers.stored import part as stored

    if point == "data":
        armed = threading.Event()
        write_data_file, pwrite_all = stored.write_data_file, local.pwrite_all

        def arming_write(source: Any, *args: Any, **kwargs: Any) -> Any:
            if source.step == step:
                armed.set()
            return write_data_file(source, *args, **kwargs)

        def pausing_pwrite(*args: Any, **kwargs: Any) -> None:
            pwrite_all(*args, **kwargs)
            if armed.is_set():
                say("paused", point, step)
                hang()

        stored.write_data_file = arming_write  # a stored tier's data object (as its write of a data part calls it)
        local.pwrite_all = pausing_pwrite
    elif point == "staged":
        commit = filesystem.FilesystemTier.commit

        async def pausing_commit(self: Any, staged: Any) -> Any:
            if staged.step == step:
                say("paused", point, step)
                await asyncio.Event().wait()
            return await commit(self, staged)

        filesystem.FilesystemTier.commit = pausing_commit  # type: ignore[method-assign]
    elif point == "replace":
        rename = aiofiles.os.rename

        async def pausing_rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            await rename(src, dst, *args, **kwargs)
            # The committed version of ``step`` moved aside (retention, keep.last=2, never deletes the
            # newest step, so this rename is the replacement's).
            if Path(src).name == version_dirname(step) and Path(dst).name.startswith("."):
                say("paused", point, step)
                await asyncio.Event().wait()

        aiofiles.os.rename = pausing_rename
    else:
        raise SystemExit(f"unknown pause point {point!r}")


# -- the crash campaign (benchmarks/crash_campaign.py) ----------------------------------------------------

# Kill points: where a campaign run SIGKILLs itself, at the n-th time it gets there, and the phase each
# belongs to. "<tier>." points exist for nvme (flush from host memory) and pfs (promotion from nvme).
_TIER_POINTS = {
    "data": "after a write of the data file (under .tmp-)",
    "data_fsynced": "after the fsync of the data file",
    "staged": "after the fsync of the .tmp- directory: written, not yet renamed",
    "replace_moved": "after the committed version of the step moved aside to .replaced- (a replacement)",
    "renamed": "after the rename of .tmp- to step-, before the fsync of the tier directory",
    "committed": "after the fsync of the tier directory that follows the rename: committed",
    "rmtree_replaced": "in the middle of removing the replaced version",
    "trashed": "after a pruned version was renamed to .trash-",
    "rmtree": "in the middle of removing a pruned version's .trash- directory",
}
POINTS: dict[str, str] = {
    "open.sweep": "open",  # the next open sweeping or putting back what a kill left
    "capture": "capture",  # a copy thread, after copying one tensor of a save
    "saved": "capture",  # right after save() returned (the host copy under way)
}
for _tier, _phase in (("nvme", "flush"), ("pfs", "promotion")):
    for _name in _TIER_POINTS:
        POINTS[f"{_tier}.{_name}"] = "pruning" if _name in ("trashed", "rmtree") else _phase
# Phases a run marks while in them (one byte each in its flags file, read after the kill).
PHASES = ("open", "capture", "nvme.write", "nvme.commit", "nvme.prune", "pfs.write", "pfs.commit", "pfs.prune")
PHASE_GROUP = {
    "open": "open", "capture": "capture", "nvme.write": "flush", "nvme.commit": "flush", "nvme.prune": "pruning",
    "pfs.write": "promotion", "pfs.commit": "promotion", "pfs.prune": "pruning",
}


def campaign_config(root: str | Path, delta: int | None = None) -> dict[str, Any]:
    """ram → nvme (every version, keep 2) → pfs (even steps, zstd, keep 2): promotion and pruning all the
    time; ``delta``: both disk tiers store differential versions (``delta: {full_every: delta}``)."""
    config: dict[str, Any] = {
        "host": {"capacity": "16MiB", "snapshots": 2},
        "tiers": [
            {"name": "ram", "type": "memory", "keep": {"last": 1}},
            {"name": "nvme", "type": "filesystem", "path": f"{root}/nvme", "keep": {"last": 2}},
            {
                "name": "pfs",
                "type": "filesystem",
                "path": f"{root}/pfs",
                "flush": {"every_steps": 2},
                "keep": {"last": 2},
                "compression": {"codec": "zstd", "level": 1, "shuffle": True},
            },
        ],
    }
    if delta is not None:
        for tier in config["tiers"][1:]:
            tier["delta"] = {"full_every": delta}
    return config


def campaign_bases() -> dict[str, torch.Tensor]:
    """The tensors every campaign state is made from (6 MiB; computed once per process)."""
    g = torch.Generator().manual_seed(4321)
    return {
        "emb": torch.randn(1 << 20, generator=g),
        "w1": torch.randn(512, 512, generator=g).to(torch.bfloat16),
        "w2": torch.randn(1000, 77, generator=g, dtype=torch.float64),  # not a whole number of pages
        "bias": torch.randn(4099, generator=g),
    }


def campaign_state(step: int, variant: int, bases: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What a campaign run saves as ``step``; ``variant`` is the run's (a rewound run saves steps again)."""
    g = torch.Generator().manual_seed(step * 7919 + variant)
    return {
        "model": {name: t + step for name, t in bases.items()},
        "optim": {"exp_avg": bases["emb"][: 1 << 18] * (variant + 1), "count": torch.full((64,), step, dtype=torch.int64)},
        "noise": torch.randn(999, generator=g),
        "rng": (torch.tensor([step, variant]), f"run {variant}"),
        "step": step,
        "variant": variant,
    }


def differences(actual: Any, expected: Any, prefix: str = "") -> list[str]:
    """Where two states differ: structure, types, dtypes, shapes, bytes (empty: bitwise equal)."""
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or list(actual) != list(expected):
            return [f"{prefix or 'state'}: keys {list(actual) if isinstance(actual, dict) else type(actual)}"]
        return [d for k in expected for d in differences(actual[k], expected[k], f"{prefix}{k}.")]
    if isinstance(expected, (list, tuple)):
        if type(actual) is not type(expected) or len(actual) != len(expected):
            return [f"{prefix}: {type(actual).__name__} of {len(actual) if hasattr(actual, '__len__') else '?'}"]
        return [d for i, (a, e) in enumerate(zip(actual, expected)) for d in differences(a, e, f"{prefix}{i}.")]
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor) or (actual.dtype, actual.shape) != (expected.dtype, expected.shape):
            return [f"{prefix}: not {expected.dtype}{list(expected.shape)}"]
        if not torch.equal(actual.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8)):
            return [f"{prefix}: bytes differ"]
        return []
    if type(actual) is not type(expected) or actual != expected:
        return [f"{prefix}: {actual!r} != {expected!r}"]
    return []


class _Run:
    """A campaign run's reports (an events file, a flags file) and its kill point."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.root = os.path.realpath(spec["root"])
        self.tiers = {name: os.path.join(self.root, name) for name in ("nvme", "pfs")}
        self.target: str | None = spec.get("target")
        self.n: int = spec.get("n", 1)
        self.hits = 0
        self._lock = threading.Lock()
        self._events = os.open(spec["events"], os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        self._flags = os.open(spec["flags"], os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        os.pwrite(self._flags, bytes(len(PHASES)), 0)
        self._counts = [0] * len(PHASES)
        self._renamed: set[str] = set()  # tiers with a rename into place not yet followed by the directory fsync

    def event(self, *words: object) -> None:
        os.write(self._events, (" ".join(map(str, words)) + "\n").encode())

    def enter(self, phase: str, delta: int = 1) -> None:
        i = PHASES.index(phase)
        with self._lock:
            self._counts[i] = max(0, self._counts[i] + delta)
            os.pwrite(self._flags, bytes([min(self._counts[i], 255)]), i)

    def leave(self, phase: str) -> None:
        self.enter(phase, -1)

    def in_phase(self, phase: str) -> bool:
        return self._counts[PHASES.index(phase)] > 0

    def point(self, name: str) -> None:
        if name != self.target:
            return
        with self._lock:
            self.hits += 1
            if self.hits != self.n:
                return
        self.event("hit", name, self.n)
        self.die()

    def die(self) -> NoReturn:
        os.kill(os.getpid(), signal.SIGKILL)
        while True:
            time.sleep(1)

    # -- where the kill points are: the tier's own system calls ---------------------------------------

    def _where(self, path: str) -> tuple[str | None, list[str]]:
        for tier, root in self.tiers.items():
            if path == root or path.startswith(root + os.sep):
                return tier, os.path.relpath(path, root).split(os.sep) if path != root else []
        return None, []

    def on_call(self, name: str, paths: list[str], args: Any, kwargs: Any, result: Any, context: Any) -> None:
        tier, parts = self._where(paths[0])
        if tier is None:
            return
        top = parts[0] if parts else ""
        if name in ("write", "pwrite", "pwritev"):
            if top.startswith(".tmp-") and parts[-1].startswith("data-"):
                self.point(f"{tier}.data")
        elif name in ("fsync", "fdatasync"):
            if not parts and tier in self._renamed:
                self._renamed.discard(tier)
                self.point(f"{tier}.committed")
            elif top.startswith(".tmp-") and len(parts) == 1:
                self.point(f"{tier}.staged")
            elif top.startswith(".tmp-") and parts[-1].startswith("data-"):
                self.point(f"{tier}.data_fsynced")
        elif name in ("rename", "replace"):
            _, dst = self._where(paths[1])
            src_name, dst_name = top, (dst[0] if dst else "")
            if src_name.startswith(".tmp-") and dst_name.startswith("step-"):
                self._renamed.add(tier)
                self.point(f"{tier}.renamed")
            elif src_name.startswith("step-") and dst_name.startswith(".replaced-"):
                self.point(f"{tier}.replace_moved")
            elif src_name.startswith("step-") and dst_name.startswith(".trash-"):
                self.point(f"{tier}.trashed")
            elif src_name.startswith(".replaced-") and self.in_phase("open"):
                self.point("open.sweep")
        elif name in ("unlink", "remove", "rmdir") and parts and not top.startswith(".direct-probe-"):
            if self.in_phase("open"):
                self.point("open.sweep")
            elif len(parts) < 2:
                pass  # the directory itself, once emptied
            elif top.startswith(".trash-"):
                self.point(f"{tier}.rmtree")
            elif top.startswith(".replaced-"):
                self.point(f"{tier}.rmtree_replaced")

    def install(self) -> Any:
        """Phase marks around the tier's methods, kill points in the copy threads and the tier's system calls."""
        import fsrecord
        from tierckpt.testing.copies import CopyWatch
        from tierckpt.tiers.filesystem import FilesystemTier

        run = self

        def marked(method: Any, what: str) -> Any:
            async def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
                phase = f"{self.name}.{what}"
                run.enter(phase)
                try:
                    return await method(self, *args, **kwargs)
                finally:
                    run.leave(phase)

            return wrapper

        FilesystemTier.write = marked(FilesystemTier.write, "write")  # type: ignore[method-assign]
        FilesystemTier.commit = marked(FilesystemTier.commit, "commit")  # type: ignore[method-assign]
        FilesystemTier.delete = marked(FilesystemTier.delete, "prune")  # type: ignore[method-assign]
        CopyWatch(lambda: run.point("capture")).__enter__()  # for the life of the process
        interposer = fsrecord.Interposer(self.root, after=self.on_call)
        interposer.__enter__()  # for the life of the process
        return interposer


def _roll_back(run: _Run, ckpt: Any, step: int, bases: dict[str, torch.Tensor]) -> None:
    """``restore(step)`` (the rollback's), checked bitwise against what the run whose variant it holds
    saved there; reports ``restored <step> <variant>``, or an error and dies (saving nothing: the
    campaign's model of the lineages needs the version each save descends from)."""
    try:
        restored = ckpt.restore_sync(step)
        state = restored.state
        variant = state.get("variant") if isinstance(state, dict) else None
        if restored.step != step or type(variant) is not int:
            problems = [f"restored step {restored.step}, variant {variant!r}"]
        else:
            problems = differences(state, campaign_state(step, variant, bases))
    except Exception as exc:  # noqa: BLE001 - reported to the campaign
        problems = [repr(exc)]
    if problems:
        run.event("error", "restore", step, " ".join(problems[:3]).replace("\n", " "))
        run.die()
    run.event("restored", step, variant)


def campaign_run(spec: dict[str, Any]) -> NoReturn:
    """Save ``spec["start"]``, the next step, ... as variant ``spec["variant"]`` until killed; with
    ``spec["restore"]`` (a step), a rollback: restore that step first (:func:`_roll_back`).

    Events (one line each, appended to ``spec["events"]``): ``ready`` (the Checkpointer is open),
    ``restored <step> <variant>`` (the rollback's restore, verified), ``saving <step>`` (before
    save()), ``saved <step>``, ``committed <tier> <step>`` (the handle said so), ``hit <point> <n>``
    (killing itself), ``missed`` (``max_steps`` saved without reaching the kill point: the campaign
    kills it), ``error ...``.
    """
    run = _Run(spec)
    try:
        bases = campaign_bases()
        run.install()
        from tierckpt import Checkpointer

        run.enter("open")
        ckpt = Checkpointer(campaign_config(spec["root"], spec.get("delta")))
        run.leave("open")
        run.event("ready")

        def report(handle: Any, step: int) -> None:
            try:
                handle.captured_sync()
            except Exception as exc:  # noqa: BLE001 - reported to the campaign
                run.event("error", "capture", step, repr(exc).replace("\n", " "))
            finally:
                run.leave("capture")
            for tier in ("nvme", "pfs"):
                try:
                    if handle.committed_sync(tier):
                        run.event("committed", tier, step)
                except Exception as exc:  # noqa: BLE001 - reported to the campaign
                    run.event("error", "flush", tier, step, repr(exc).replace("\n", " "))

        if spec.get("restore") is not None:
            _roll_back(run, ckpt, spec["restore"], bases)
        step, pace = spec["start"], spec.get("pace_s", 0.0)
        missed = False
        while True:
            if run.target and not missed and step >= spec["start"] + spec.get("max_steps", 12):
                missed = True
                run.event("missed")
            state = campaign_state(step, spec["variant"], bases)
            run.event("saving", step)
            run.enter("capture")
            handle = ckpt.save_sync(step, state)
            run.point("saved")
            run.event("saved", step)
            threading.Thread(target=report, args=(handle, step), daemon=True).start()
            if pace:
                time.sleep(pace)
            step += 1
    except BaseException as exc:  # noqa: BLE001 - the campaign sees a run that did not die by SIGKILL
        run.event("error", "run", repr(exc).replace("\n", " "))
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(3)


def _die_with_parent() -> None:
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def zygote() -> None:
    """Fork one campaign run per JSON line on stdin; see the module docstring."""
    _die_with_parent()
    import fsrecord  # noqa: F401 - imported once here, not in every run
    import tierckpt.checkpointer  # noqa: F401

    print("zygote ready", flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        spec = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            try:
                _die_with_parent()
                null = os.open(os.devnull, os.O_RDONLY)
                log = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(null, 0)
                os.dup2(log, 1)
                os.dup2(log, 2)
                campaign_run(spec)
            finally:
                os._exit(4)
        print("pid", pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print("exit", pid, status, flush=True)


def main() -> None:
    if sys.argv[1] == "zygote":
        zygote()
        return
    root, mode = sys.argv[1], sys.argv[2]
    big = base()
    if mode == "pause":
        point, target = sys.argv[3], int(sys.argv[4])
        install_pause(point, target)

    from tierckpt import Checkpointer

    ckpt = Checkpointer(config(root))

    def report(handle: Any) -> None:
        if handle.committed_sync("nvme"):
            say("committed", handle.step)

    if mode == "loop":
        step = 0
        while True:
            step += 1
            handle = ckpt.save_sync(step, make_state(step, big))
            say("saved", step)
            threading.Thread(target=report, args=(handle,), daemon=True).start()
    last = target if point == "replace" else target - 1
    for step in range(1, last + 1):
        handle = ckpt.save_sync(step, make_state(step, big))
        report(handle)
    variant = 1 if point == "replace" else 0
    ckpt.save_sync(target, make_state(target, big, variant))
    say("saved", target)
    hang()


if __name__ == "__main__":
    main()
