"""Ranks of one job on localhost: :func:`launch_ranks` runs a script as the ranks of one
torch.distributed job, :class:`RankExit` is how each ended, :func:`failures` says which did not exit as
they should, and :func:`free_port` picks the job's ``MASTER_PORT``. For tests and benchmarks of many ranks.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Mapping, Sequence


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
