"""Fakes for tests, yours and ours: slow, gated and faulty tiers (all real filesystem tiers), and a clock.

Pass the tiers through ``Checkpointer(config, tier_factory=...)``::

    from tierckpt.testing import faulty, slow
    ckpt = Checkpointer(config, tier_factory=slow({"pfs": 0.5}))          # every pfs write takes 0.5 s longer
    ckpt = Checkpointer(config, tier_factory=faulty({"nvme": {3, 4}}))   # writes of steps 3 and 4 fail on nvme

and a :class:`ManualClock` through ``Checkpointer(config, clock=...)`` to test ``min_interval``,
``max_staleness`` and ``keep.within`` without waiting for them.

:class:`IOFaults` makes the system calls of a real filesystem tier fail, for the errors a real disk
cannot be made to produce on demand (EIO, EDQUOT, EACCES; ENOSPC at one exact call)::

    with IOFaults(errno.EIO, "fsync", under=nvme_dir, path="*/.tmp-*/data-*"):
        handle = ckpt.save_sync(2, state)
        handle.committed_sync("nvme")   # FlushError: tier 'nvme', step 2, EIO, the data file's path

:func:`launch_ranks` runs a script as the ranks of one torch.distributed job on localhost, for tests and
benchmarks of many ranks; :func:`failures` says which ranks did not exit as they should::

    exits = launch_ranks([sys.executable, "worker.py"], 4, env={"STEPS": "3"})
    failed = failures(exits)
    assert not failed, failed
"""

from __future__ import annotations

import asyncio
import errno
import fnmatch
import os
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Callable, Collection, Mapping, Sequence

import aiofiles.os

from tierckpt.config import TierConfig
from tierckpt.tiers import fsio
from tierckpt.tiers.base import Staged, Tier, VersionSource
from tierckpt.tiers.filesystem import FilesystemTier


class SlowTier(FilesystemTier):
    """A filesystem tier whose every write takes ``delay_s`` longer, plus its bytes over ``bytes_per_s``.

    The wait comes before the real write and does not block the engine; the flusher holds its lease on
    the version above meanwhile, as it would during a slow write.
    """

    def __init__(self, config: TierConfig, delay_s: float = 0.0, *, bytes_per_s: float | None = None) -> None:
        super().__init__(config)
        self.delay_s = delay_s
        self.bytes_per_s = bytes_per_s
        self.writes_started = 0

    async def write(self, source: VersionSource, staging: str | None = None) -> Staged:
        self.writes_started += 1
        delay = self.delay_s
        if self.bytes_per_s:
            delay += sum(record.nbytes for record in source.records) / self.bytes_per_s
        await asyncio.sleep(delay)
        return await super().write(source, staging)


class _Gate(threading.Event):
    """An event that also wakes the writes waiting on its tier's condition when it is set."""

    def __init__(self, changed: threading.Condition) -> None:
        super().__init__()
        self._changed = changed

    def set(self) -> None:
        super().set()
        with self._changed:
            self._changed.notify_all()


class GatedTier(FilesystemTier):
    """A filesystem tier whose writes wait until ``gate`` is set: a tier as slow as the test wants.

    ``allow(n)`` lets the next ``n`` writes through while the gate stays closed, so a test decides when
    each write ends. ``started`` is set when a write begins; ``steps`` lists the steps whose write
    began, in order, and ``sources`` the tier each of them was read from; ``waiting`` counts the writes
    at the gate now (a write is counted off the moment it passes), ``parked()`` those of them no permit
    lets through yet. A write still waiting after ``deadline_s`` fails (a guard against a test that
    never opens the gate).
    """

    def __init__(self, config: TierConfig, deadline_s: float = 60.0) -> None:
        super().__init__(config)
        self._changed = threading.Condition()
        self._permits = 0
        self.gate: threading.Event = _Gate(self._changed)
        self.started = threading.Event()
        self.steps: list[int] = []
        self.sources: list[str] = []
        self.waiting = 0
        self.deadline_s = deadline_s

    def allow(self, writes: int = 1) -> None:
        """Let the next ``writes`` writes through (those waiting first), the gate staying as it is."""
        with self._changed:
            self._permits += writes
            self._changed.notify_all()

    def parked(self) -> int:
        """Writes waiting at the gate that no permit lets through yet (0 while the gate is open)."""
        with self._changed:
            return 0 if self.gate.is_set() else max(0, self.waiting - self._permits)

    def _pass(self) -> bool:
        deadline = time.monotonic() + self.deadline_s
        with self._changed:
            try:
                while not self.gate.is_set():
                    if self._permits:
                        self._permits -= 1
                        return True
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._changed.wait(left)
                return True
            finally:
                # Here, the moment it passes: counted down later (on the engine loop), a write already
                # through would still look parked, and a test would give it a second permit.
                self.waiting -= 1

    async def write(self, source: VersionSource, staging: str | None = None) -> Staged:
        self.steps.append(source.step)
        self.sources.append(source.tier)
        self.started.set()
        with self._changed:
            self.waiting += 1
        opened = await asyncio.get_running_loop().run_in_executor(None, self._pass)
        if not opened:
            raise TimeoutError(f"tier {self.name!r}: the test never opened the gate")
        return await super().write(source, staging)


class ManualClock:
    """A monotonic clock that moves only when told to: ``Checkpointer(config, clock=ManualClock())``.

    The pipeline reads it for ``min_interval``, ``max_staleness`` and, anchored to the wall clock once at
    start, for version creation times and ``keep.within``. A flusher waiting on a timer notices a moved
    clock when it next wakes up: at the next save, or at ``wait()``.
    """

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FaultyTier(FilesystemTier):
    """A filesystem tier whose write of a step in ``fail_on`` fails with ``error`` (default ENOSPC).

    ``fail_on`` may also be a predicate on the step. The failure comes after the version was written
    under its temporary name and before the rename, so cleanup of the temporary directory is exercised.
    """

    def __init__(
        self,
        config: TierConfig,
        fail_on: Collection[int] | Callable[[int], bool],
        error: Callable[[], BaseException] | None = None,
    ) -> None:
        super().__init__(config)
        self._fails = fail_on if callable(fail_on) else (lambda step, steps=frozenset(fail_on): step in steps)
        self._error = error or (lambda: OSError(errno.ENOSPC, "No space left on device (injected)"))

    async def commit(self, staged: Staged) -> object:  # type: ignore[override]
        if self._fails(staged.step):
            await self.abort(staged)
            raise self._error()
        return await super().commit(staged)


class Gates:
    """A ``tier_factory`` making the named tiers :class:`GatedTier`: ``gates[name]`` is the tier made,
    ``open_all()`` opens every gate (do that before closing the Checkpointer, or its close waits on a
    closed gate)::

        gates = Gates("pfs")
        ckpt = Checkpointer(config, tier_factory=gates)
        handle = ckpt.save_sync(1, state)
        gates["pfs"].started.wait()      # pfs is writing step 1, and stays so
        gates["pfs"].allow(1)            # ... until now
    """

    def __init__(self, *names: str, deadline_s: float = 60.0) -> None:
        self.names = names
        self.deadline_s = deadline_s
        self.tiers: dict[str, GatedTier] = {}

    def __call__(self, config: TierConfig) -> GatedTier | None:
        if config.name not in self.names:
            return None
        self.tiers[config.name] = GatedTier(config, deadline_s=self.deadline_s)
        return self.tiers[config.name]

    def __getitem__(self, name: str) -> GatedTier:
        return self.tiers[name]

    def open_all(self) -> None:
        for tier in self.tiers.values():
            tier.gate.set()


def slow(delays: Mapping[str, float], *, bytes_per_s: Mapping[str, float] | None = None) -> Callable[[TierConfig], Tier | None]:
    """A ``tier_factory`` making the named filesystem tiers slow: a delay per write, and a bandwidth."""
    rates = dict(bytes_per_s or {})

    def make(cfg: TierConfig) -> Tier | None:
        if cfg.name not in delays and cfg.name not in rates:
            return None
        return SlowTier(cfg, delays.get(cfg.name, 0.0), bytes_per_s=rates.get(cfg.name))

    return make


def faulty(fail_on: Mapping[str, Collection[int] | Callable[[int], bool]]) -> Callable[[TierConfig], Tier | None]:
    """A ``tier_factory`` making the named filesystem tiers fail on the given steps."""
    return lambda cfg: FaultyTier(cfg, fail_on[cfg.name]) if cfg.name in fail_on else None


# -- failing system calls --------------------------------------------------------------------------------

# What each kind of call patches: functions of ``os`` (and ``aiofiles.os``, whose wrappers hold the
# function they wrapped at import), plus fallocate, which fsio calls through libc.
_FD_CALLS = {"pwritev", "pwrite", "write", "fsync", "fdatasync", "_fallocate"}
IO_OPS: dict[str, tuple[str, ...]] = {
    "open": ("open",),
    "write": ("pwritev", "pwrite", "write"),
    "allocate": ("_fallocate",),
    "fsync": ("fsync", "fdatasync"),
    "mkdir": ("mkdir",),
    "rename": ("rename", "replace"),
    "remove": ("unlink", "remove", "rmdir"),
}


class IOFaults:
    """Make one kind of I/O call fail with errno ``code`` for paths under ``under``, as a failing disk would.

    Inside ``with IOFaults(...)``, every call of kind ``op`` (see below) on a path below ``under`` that
    matches the glob ``path`` is counted, from 1; calls ``nth`` to ``nth + times - 1`` fail (``times=None``:
    every one from ``nth`` on). Paths are absolute and resolved, descriptors resolved through
    ``/proc/self/fd``, so ``path="*/.tmp-*/data-*"`` means a data file being written. A failing call does
    nothing and raises ``OSError(code)`` as the kernel's would: without a file name for calls on a
    descriptor, with it for calls on a path. Calls elsewhere in the process go through untouched.

    Kinds of call (``op``): ``open`` (``os.open``), ``write`` (``os.pwritev``/``pwrite``/``write``),
    ``allocate`` (fallocate(2) of a data file), ``fsync`` (``os.fsync``/``fdatasync``, of files and
    directories), ``mkdir``, ``rename`` (``os.rename``/``replace``: either path may match) and ``remove``
    (``os.unlink``/``remove``/``rmdir``, which ``shutil.rmtree`` uses). ``failed`` lists ``(call, path)``
    of each failure made, ``calls`` counts the matching calls seen. Blocks may nest. Linux only.
    """

    def __init__(
        self,
        code: int,
        op: str,
        *,
        under: str | os.PathLike[str],
        path: str = "*",
        nth: int = 1,
        times: int | None = 1,
    ) -> None:
        if op not in IO_OPS:
            raise ValueError(f"op must be one of {sorted(IO_OPS)}, not {op!r}")
        if nth < 1 or (times is not None and times < 1):
            raise ValueError("nth and times count from 1")
        self.code = code
        self.op = op
        self.root = os.path.realpath(under)
        self.pattern = path
        self.nth = nth
        self.times = times
        self.calls = 0
        self.failed: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._saved: list[tuple[Any, str, Any]] = []

    # -- which calls fail --------------------------------------------------------------------------

    def _resolve(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
        if name in _FD_CALLS:
            fd = args[0] if args else kwargs.get("fd")
            return [p for p in (fd_path(fd),) if p is not None]
        if name in ("rename", "replace"):
            pairs = [(args[0] if args else kwargs.get("src"), kwargs.get("src_dir_fd")),
                     (args[1] if len(args) > 1 else kwargs.get("dst"), kwargs.get("dst_dir_fd"))]
        else:
            pairs = [(args[0] if args else kwargs.get("path"), kwargs.get("dir_fd"))]
        return [p for p in (path_of(arg, dir_fd) for arg, dir_fd in pairs) if p is not None]

    def _fails(self, name: str, paths: list[str]) -> str | None:
        hit = next(
            (p for p in paths if (p == self.root or p.startswith(self.root + os.sep)) and fnmatch.fnmatchcase(p, self.pattern)),
            None,
        )
        if hit is None:
            return None
        with self._lock:
            self.calls += 1
            if self.calls < self.nth or (self.times is not None and self.calls >= self.nth + self.times):
                return None
            self.failed.append((name, hit))
            return hit

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            paths = self._resolve(name, args, kwargs)
            if paths and self._fails(name, paths) is not None:
                if name == "_fallocate":
                    return self.code  # fsio's hook returns the errno, as fallocate(2) sets it
                if name in _FD_CALLS:
                    raise OSError(self.code, os.strerror(self.code))
                if len(paths) > 1:
                    raise OSError(self.code, os.strerror(self.code), paths[0], None, paths[1])
                raise OSError(self.code, os.strerror(self.code), paths[0])
            return original(*args, **kwargs)

        call.__name__ = getattr(original, "__name__", name)
        return call

    # -- patching --------------------------------------------------------------------------------------

    def __enter__(self) -> IOFaults:
        for name in IO_OPS[self.op]:
            owner: Any = fsio if name == "_fallocate" else os
            original = getattr(owner, name)
            patched = self._wrap(name, original)
            self._saved.append((owner, name, original))
            setattr(owner, name, patched)
            if owner is os and hasattr(aiofiles.os, name):
                self._saved.append((aiofiles.os, name, getattr(aiofiles.os, name)))
                setattr(aiofiles.os, name, aiofiles.os.wrap(patched))
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved = []


def fd_path(fd: Any) -> str | None:
    """The path an open descriptor names (from /proc/self/fd), or None."""
    if not isinstance(fd, int) or fd < 0:
        return None
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def path_of(arg: Any, dir_fd: Any = None) -> str | None:
    """The absolute path an os call's argument names: parent resolved, the last name kept as given."""
    if isinstance(arg, int):  # a descriptor given where a path may be
        return fd_path(arg)
    try:
        raw = os.fsdecode(arg)
    except TypeError:
        return None
    if not os.path.isabs(raw):
        base = fd_path(dir_fd) if dir_fd is not None else os.getcwd()
        if base is None:
            return None
        raw = os.path.join(base, raw)
    raw = os.path.normpath(raw)
    return os.path.join(os.path.realpath(os.path.dirname(raw)), os.path.basename(raw))


def flip_bits(path: str | os.PathLike[str], offset: int, mask: int = 0x10) -> None:
    """Damage a file as a bad disk or bad RAM would: XOR the byte at ``offset`` with ``mask``, in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


# -- ranks of one job on localhost -----------------------------------------------------------------------

TAIL_CHARS = 5000  # of a rank's output kept in its RankExit


@dataclass(frozen=True)
class RankExit:
    """How one rank of :func:`launch_ranks` ended."""

    rank: int
    returncode: int | None  # None: still running at the deadline, and killed; -9: died by SIGKILL
    output: str  # the last TAIL_CHARS characters of its stdout and stderr, interleaved


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the kernel's pick for port 0), for a job's ``MASTER_PORT``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(
    argv: Sequence[str | os.PathLike[str]],
    world: int,
    *,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 300.0,
    log_dir: Path | None = None,
) -> list[RankExit]:
    """Run ``world`` processes of ``argv`` as the ranks of one torch.distributed job on localhost; wait for all.

    Each process gets this process's environment plus ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``,
    ``MASTER_PORT`` (a free port, the same for all) and ``OMP_NUM_THREADS=1``; entries of ``env`` override
    any of them. ``world=0`` runs one process (rank 0) without the torch.distributed variables, as a job
    consolidating a checkpoint alone would. Every process writes its stdout and stderr to a file of its
    own (``log_dir/rank-<r>.log``, kept; without ``log_dir``, in a temporary directory removed at the
    end), never to a pipe: a rank blocked on a full pipe that nobody reads yet would hang the job.

    All ranks share one deadline, ``timeout_s`` from the start. A process still running then, or when
    this call is interrupted (KeyboardInterrupt, any exception), is killed and reaped, so none outlives
    the call. Returns one :class:`RankExit` per rank, in rank order; pass them to :func:`failures`, or
    look at ``returncode`` yourself. Raises ``OSError`` if a process cannot be started (the ones already
    started are killed).

    Example::

        exits = launch_ranks([sys.executable, "worker.py", "save"], 2, env={"STEPS": "1,2"}, timeout_s=60)
        assert [e.returncode for e in exits] == [0, 0], failures(exits)
    """
    if world < 0:
        raise ValueError(f"world must be 0 (one process, no torch.distributed) or more, not {world}")
    with tempfile.TemporaryDirectory(prefix="tierckpt-ranks-") as scratch:
        logs = Path(scratch) if log_dir is None else Path(log_dir)
        logs.mkdir(parents=True, exist_ok=True)
        base = os.environ | {"OMP_NUM_THREADS": "1"}
        if world:
            base |= {"WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        paths = [logs / f"rank-{rank}.log" for rank in range(max(world, 1))]
        procs: list[subprocess.Popen[bytes]] = []
        codes: list[int | None] = []
        try:
            for rank, path in enumerate(paths):
                rank_env = base | ({"RANK": str(rank)} if world else {}) | dict(env or {})
                with open(path, "wb") as out:  # the child holds its own copy of the descriptor
                    procs.append(subprocess.Popen(list(argv), env=rank_env, stdout=out, stderr=subprocess.STDOUT))
            deadline = time.monotonic() + timeout_s
            for proc in procs:
                try:
                    codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    codes.append(None)
        finally:
            for proc in procs:  # a failed or hung rank must not outlive the call, nor its caller's test
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        return [RankExit(rank, code, path.read_text(errors="replace")[-TAIL_CHARS:]) for rank, (code, path) in enumerate(zip(codes, paths))]


def failures(exits: Sequence[RankExit], expect_dead: Collection[int] = ()) -> str:
    """Each rank that did not exit as it should, with its output's tail; ``""`` when every rank did.

    A rank should exit 0, or, if it is in ``expect_dead``, die by SIGKILL (returncode -9).
    """
    wrong = []
    for e in exits:
        want = -9 if e.rank in expect_dead else 0
        if e.returncode != want:
            how = "still running at the deadline, killed" if e.returncode is None else f"exit {e.returncode}"
            wrong.append(f"--- rank {e.rank} ({how}, expected exit {want}) ---\n{e.output}")
    return "\n".join(wrong)
