"""Ranks of one job on localhost: :func:`launch_ranks` runs a script as the ranks of one
torch.distributed job, :class:`RankExit` is how each ended, :func:`failures` says which did not exit as
they should, and :func:`free_port` picks the job's ``MASTER_PORT``. For tests and benchmarks of many ranks;
a test suite forks them from fork servers instead (:func:`fork_ranks_from`, :mod:`tierckpt.testing.forkserver`).
In a rank, :func:`end_job` ends its part of the job so that the process exits cleanly.
"""

from __future__ import annotations

import functools
import gc
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Collection, Mapping, Sequence

from tierckpt.testing.forkserver import ForkServer, Forked


TAIL_CHARS = 5000  # of a rank's output kept in its RankExit

# Fork servers :func:`launch_ranks` forks Python scripts' ranks from, by script name ("*": any other
# script), as :func:`fork_ranks_from` set them; empty: every rank starts an interpreter of its own.
_FORK_SERVERS: dict[str, ForkServer] = {}


def fork_ranks_from(servers: Mapping[str, ForkServer]) -> None:
    """Have :func:`launch_ranks` fork the ranks of a Python script from a running
    :class:`~tierckpt.testing.forkserver.ForkServer` (a test suite's, to skip importing torch per
    rank): ``servers`` by the script's file name, ``"*"`` for any other; ``{}`` to stop. A server
    not started yet is started at its first use; one that ended is passed over (its ranks start
    interpreters of their own)."""
    _FORK_SERVERS.clear()
    _FORK_SERVERS.update(servers)


def _fork_server(argv: Sequence[str | os.PathLike[str]]) -> ForkServer | None:
    """The fork server for ``argv``, when it runs a script with this interpreter and one is set."""
    if not _FORK_SERVERS or len(argv) < 2 or os.fspath(argv[0]) != sys.executable or not os.fspath(argv[1]).endswith(".py"):
        return None
    name = os.path.basename(os.fspath(argv[1]))
    server = _FORK_SERVERS.get(name, _FORK_SERVERS.get("*"))
    if server is not None and not server.started:
        server.start()
    return server if server is not None and server.running else None


@dataclass(frozen=True)
class RankExit:
    """How one rank of :func:`launch_ranks` ended."""

    rank: int
    returncode: int | None  # None: still running at the deadline, and killed; -9: died by SIGKILL
    output: str  # the last TAIL_CHARS characters of its stdout and stderr, interleaved


def start_script(
    argv: Sequence[str | os.PathLike[str]], *, env: Mapping[str, str] | None = None, stdout: int | IO[Any] | None = None,
    stderr: int | IO[Any] | None = None, text: bool = False, cwd: str | os.PathLike[str] | None = None,
) -> subprocess.Popen[Any] | Forked:
    """Start one process of ``argv`` as :class:`subprocess.Popen` would (``stdout``: ``PIPE``, a file,
    or None to share this process's; ``stderr`` likewise, or ``STDOUT``; in ``cwd``, or this process's
    directory), forked from the fork server :func:`fork_ranks_from` set for its script where there is
    one (:class:`~tierckpt.testing.forkserver.Forked` then gives ``stdout`` as a file object when it is a
    pipe, as Popen does)."""
    server = _fork_server(argv)
    if server is None:
        return subprocess.Popen(list(argv), env=env, stdout=stdout, stderr=stderr, text=text, bufsize=1 if text else -1, cwd=cwd)
    ours: list[int] = []  # the child's ends of pipes, closed here once it holds them
    reader = None

    def fd_of(stream: int | IO[Any] | None, default: int) -> int:
        nonlocal reader
        if stream is None:
            return default
        if stream == subprocess.PIPE:
            read, write = os.pipe()
            ours.append(write)
            reader = open(read, "r" if text else "rb", buffering=1 if text else -1)
            return write
        return stream if isinstance(stream, int) else stream.fileno()

    out = fd_of(stdout, 1)
    err = out if stderr == subprocess.STDOUT else fd_of(stderr, 2)
    try:
        forked = server.spawn(argv, dict(os.environ if env is None else env), out, None if cwd is None else os.fspath(cwd), stderr=err)
    finally:
        for fd in ours:
            os.close(fd)
    forked.stdout = reader
    return forked


def run_script(
    argv: Sequence[str | os.PathLike[str]], *, env: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
    timeout_s: float = 120.0,
) -> subprocess.CompletedProcess[str]:
    """Run one process of ``argv`` to its end, as ``subprocess.run(argv, capture_output=True,
    text=True)`` would, forked as :func:`start_script` forks it. Its stdout and stderr go to files
    (a full pipe nobody reads would block it) and come back as text. Past ``timeout_s`` it is killed
    and reaped, and :class:`subprocess.TimeoutExpired` raised."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = start_script(argv, env=env, stdout=out, stderr=err, cwd=cwd)
        try:
            returncode = process.wait(timeout_s)
        except BaseException:  # the deadline, or an interrupt: nothing outlives the call
            process.kill()
            process.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess([os.fspath(a) for a in argv], returncode, out.read(), err.read())


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
        procs: list[subprocess.Popen[bytes] | Forked] = []
        codes: list[int | None] = []
        server = _fork_server(argv)
        try:
            for rank, path in enumerate(paths):
                rank_env = base | ({"RANK": str(rank)} if world else {}) | dict(env or {})
                with open(path, "wb") as out:  # the child holds its own copy of the descriptor
                    if server is not None:
                        procs.append(server.spawn(argv, rank_env, out.fileno()))
                    else:
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


def gloo_threads() -> int:
    """How many of gloo's worker threads (``pt_gloo_runloop``) run in this process; 0 where /proc is absent."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return 0
    count = 0
    for task in tasks.iterdir():
        try:
            count += (task / "comm").read_text().strip() == "pt_gloo_runloop"
        except OSError:  # the thread ended while we looked
            pass
    return count


def end_job() -> None:
    """End this rank's part of its torch.distributed job so that its process exits cleanly. Call it
    last, once every Checkpointer is closed and what holds the job's groups is dropped (a trainer, an
    FSDP model, a device mesh).

    A gloo worker thread frees a finished collective's tensors, which takes the interpreter lock; if it
    does so while the interpreter shuts down, the process aborts ("terminate called without an active
    exception", pytorch#190489): FSDP1, FSDP2 and DTensor jobs on CPU do it in some exits (an FSDP1
    script in 5 of 12 runs here).
    This call empties torch's caches of sharding plans (they keep device meshes, and so their groups,
    for the life of the process) and destroys the groups: a group whose last reference goes joins its
    threads, and the call returns with none left. Where torch itself still holds a group (a DTensor
    call after ``init_process_group`` imports ``torch.distributed.nn``, whose functions' default
    arguments keep the default group), the threads cannot be stopped: the process then flushes its
    standard streams and ends at once with status 0 (``os._exit``), skipping the interpreter's
    finalization, where the abort happens, and its ``atexit`` hooks.
    """
    import torch.distributed as dist

    _drop_dtensor_caches()
    gc.collect()  # trainers, models and meshes sit in reference cycles that hold the groups
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    if gloo_threads():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _drop_dtensor_caches() -> None:
    """Empty the caches torch.distributed keeps of sharding plans: the functools caches of its modules
    and the C++ fast path's, keyed by DTensor specs whose meshes hold process groups (torch 2.13)."""
    import torch

    for obj in gc.get_objects():
        # type(), not isinstance(): some of torch's objects warn when asked for their class
        if type(obj) is functools._lru_cache_wrapper and str(getattr(obj, "__module__", "")).startswith("torch.distributed"):
            obj.cache_clear()
    clear_fast_path = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_fast_path is not None:
        clear_fast_path()
    try:
        from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
    except ImportError:  # a torch without the planner's cache
        return
    clear_redistribute_planner_cache()
