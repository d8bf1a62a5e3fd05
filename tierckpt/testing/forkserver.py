"""A fork server for test ranks: one process imports torch (and what else a worker needs: Lightning
alone takes 7-8 s of CPU to import) once, then forks each rank of :func:`~tierckpt.testing.launch_ranks`
from it, instead of each rank starting an interpreter and importing them again.

On a 2-core machine a test suite of many multi-rank tests spends most of its CPU importing: a rank of a
Lightning test costs ~9 s before its first line runs. A forked rank is still a process of its own, with
its own pid, memory, environment, working directory and output file: it is SIGKILLed, exits, and is
reaped as one started from nothing is; what it does not have to do again is import. What it inherits
beyond that, and how each is made as a new interpreter's would be:

- the random state of Python's ``random`` (reseeded from the OS), and numpy's where imported;
- ``sys.argv``, ``sys.path`` (the script's directory first, then ``PYTHONPATH``'s entries) and
  ``os.environ`` are the rank's own (the caller's environment, as given);
- modules already imported stay imported: a worker that sets an environment variable read at import
  time by a preloaded module must not be forked from a server that preloads it (preload only what
  the workers import anyway).

The server is single-threaded (fork from a process with threads can deadlock the child): it waits on
its socket and reaps its children in one loop. Each spawn is one connection: the request (argv, cwd,
env) with the output file's descriptor (``SCM_RIGHTS``), answered by the child's pid, then, when the
child ends, by its status as :attr:`subprocess.Popen.returncode` gives it (``-9``: SIGKILL). The
server dies with the process that started it (``PR_SET_PDEATHSIG``), and stops on :meth:`ForkServer.close`.

For tests only: benchmarks time a rank started as users start one.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import random
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
from typing import IO, Any, Mapping, Sequence

__all__ = ["ForkServer", "Forked"]

_READY = b"ready\n"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class Forked:
    """A rank forked by a :class:`ForkServer`: what :func:`~tierckpt.testing.launch_ranks` needs of a
    :class:`subprocess.Popen` (``pid``, :meth:`poll`, :meth:`wait`, :meth:`kill`, ``returncode``)."""

    def __init__(self, connection: socket.socket, pid: int) -> None:
        self._connection, self.pid = connection, pid
        self.returncode: int | None = None
        self.stdout: IO[Any] | None = None  # its output, where it goes to a pipe (tierckpt.testing.ranks.start_script)

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:  # ended meanwhile: its status is on the way
                pass

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._connection], [], [], 0)[0]:
            self._read_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._connection], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"forked rank {self.pid}", timeout or 0.0)
            self._read_status()
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read_status(self) -> None:
        data = self._connection.makefile("rb").readline()
        self._connection.close()
        # No line: the server went away before the child ended (it is killed with the server's children).
        self.returncode = int(data) if data.strip() else -signal.SIGKILL


class ForkServer:
    """A server that imported ``preload`` (besides torch) and forks ranks from it; started by
    :meth:`start`, stopped by :meth:`close` (or with the process that started it)."""

    def __init__(self, preload: Sequence[str] = ()) -> None:
        self.preload = ("torch", "torch.distributed", *preload)
        self._dir = tempfile.mkdtemp(prefix="tierckpt-forkserver-")
        self.address = os.path.join(self._dir, "socket")
        self._process: subprocess.Popen[bytes] | None = None
        self._started = False

    def start(self, timeout_s: float = 120.0) -> None:
        """Start the server and wait until it imported its modules (a RuntimeError if it did not)."""
        self._started = True
        from tierckpt.testing.s3server import tied_to_parent

        # Run by its path, not through the package (importing tierckpt.testing would import tierckpt into
        # every rank before its environment is set), and without its folder on sys.path (it holds a
        # module named inspect, as the standard library's).
        run = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
        command = [sys.executable, "-c", run, os.path.abspath(__file__)]
        env = os.environ | {"OMP_NUM_THREADS": "1"}
        self._process = subprocess.Popen(
            [*command, self.address, *self.preload], env=env, stdout=subprocess.PIPE, preexec_fn=tied_to_parent(), start_new_session=True
        )
        assert self._process.stdout is not None
        ready, _, _ = select.select([self._process.stdout], [], [], timeout_s)
        if not ready or self._process.stdout.readline() != _READY:
            self.close()
            raise RuntimeError(f"the fork server (preloading {', '.join(self.preload)}) did not start within {timeout_s:g} s")

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def started(self) -> bool:
        """Whether :meth:`start` was called (it may have ended since: :attr:`running`)."""
        return self._started

    def spawn(
        self, argv: Sequence[str | os.PathLike[str]], env: Mapping[str, str], stdout: int, cwd: str | None = None,
        *, stderr: int | None = None, stdin: int | None = None,
    ) -> Forked:
        """Fork a process running ``argv`` (``[python, script.py, args...]``) with ``env``, its stdout
        on descriptor ``stdout``, its stderr on ``stderr`` (None: on ``stdout``), its stdin from
        ``stdin`` (None: /dev/null)."""
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.connect(self.address)
            request = json.dumps({
                "argv": [os.fspath(a) for a in argv[1:]], "env": dict(env), "cwd": cwd or os.getcwd(),
                "stdin": stdin is not None, "stderr": stderr is not None,
            }).encode()
            fds = [stdout] + ([stderr] if stderr is not None else []) + ([stdin] if stdin is not None else [])
            socket.send_fds(connection, [len(request).to_bytes(8, "big") + request], fds)
            line = connection.makefile("rb").readline()
        except BaseException:
            connection.close()
            raise
        if not line.strip():
            connection.close()
            raise OSError(f"the fork server could not start {argv[1]!s}")
        return Forked(connection, int(line))

    def close(self) -> None:
        if self._process is not None:
            if self._process.poll() is None:
                os.killpg(self._process.pid, signal.SIGKILL)  # its children with it: none outlives the run
            self._process.wait()
            if self._process.stdout is not None:
                self._process.stdout.close()
            self._process = None
        try:
            os.unlink(self.address)
        except FileNotFoundError:
            pass
        try:
            os.rmdir(self._dir)
        except FileNotFoundError:  # closed before
            pass


def _serve(address: str, preload: Sequence[str]) -> None:
    """The server's process: import ``preload``, then fork a child per request (see the module docstring).
    A child returns from here and runs its script as the process's main program."""
    for name in preload:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)
    sys.stdout.buffer.write(_READY)
    sys.stdout.flush()
    waiting: dict[int, socket.socket] = {}  # child pid -> the connection its status goes to
    while True:
        ready, _, _ = select.select([listener], [], [], 0.02)
        _reap(waiting)
        if not ready:
            continue
        connection, _ = listener.accept()
        request, fds = _receive(connection)
        pid = os.fork()
        if pid == 0:
            listener.close()
            for other in waiting.values():
                other.close()
            connection.close()
            _run(request, fds)  # does not return
        for fd in fds:
            os.close(fd)
        connection.sendall(f"{pid}\n".encode())
        waiting[pid] = connection


def _receive(connection: socket.socket) -> tuple[dict[str, Any], list[int]]:
    head, fds, _, _ = socket.recv_fds(connection, 8, 3)
    size = int.from_bytes(head, "big")
    body = b""
    while len(body) < size:
        body += connection.recv(size - len(body))
    return json.loads(body), fds


def _reap(waiting: dict[int, socket.socket]) -> None:
    while waiting:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = waiting.pop(pid, None)
        if connection is not None:
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            try:
                connection.sendall(f"{code}\n".encode())
            except OSError:  # the caller went away
                pass
            connection.close()


def _run(request: dict[str, Any], fds: list[int]) -> None:
    """In the child: become the rank (output, environment, directory, argv, path), run its script, exit."""
    code = 0
    output, rest = fds[0], fds[1:]
    error = rest.pop(0) if request["stderr"] else output
    source = rest.pop(0) if request["stdin"] else os.open(os.devnull, os.O_RDONLY)
    try:
        # It stays in the server's process group (close() kills the group), and dies with the server.
        ctypes.CDLL(None, use_errno=True).prctl(ctypes.c_int(_PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGKILL))
        os.dup2(source, 0)
        os.dup2(output, 1)
        os.dup2(error, 2)
        for fd in {source, output, error}:
            if fd > 2:
                os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        script = os.path.abspath(request["argv"][0])
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:1] = [os.path.dirname(script), *extra]
        sys.argv = list(request["argv"])
        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    # As an interpreter ends: its threads joined, atexit hooks run, the streams flushed.
    try:
        import atexit
        import threading

        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2:])
