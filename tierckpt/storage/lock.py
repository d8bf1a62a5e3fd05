"""One Checkpointer per tier directory: an advisory lock held for as long as the tier is open.

Two jobs writing versions into one directory would interleave them, and each would sweep the other's
temporary directories on open. The lock is ``flock`` on the directory itself (no lock file to litter
the tier or to go stale): the kernel drops it when the process dies, SIGKILL included, so a crashed job
never leaves a lock behind. The holder's pid, for the message, comes from ``/proc/locks``. File
systems without ``flock`` on directories (some NFS setups) are used unlocked, with a warning.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from pathlib import Path

from tierckpt.errors import ConfigError

log = logging.getLogger("tierckpt")


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (another user's counts): for what a writer left
    behind that only a dead writer's may be taken over or removed."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _holder(fd: int) -> str:
    """Who holds the flock on ``fd``'s inode, from /proc/locks (best effort)."""
    st = os.fstat(fd)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == inode:
                    return f"pid {fields[4]}"
    except OSError:
        pass
    return "another process"


class DirectoryLock:
    """An exclusive lock on ``directory`` for ``tier``; :meth:`acquire` raises if another holder has it."""

    def __init__(self, directory: Path, tier: str) -> None:
        self.directory = directory
        self.tier = tier
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _holder(fd) if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else ""
            os.close(fd)
            if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EBADF, errno.EINVAL):
                log.warning("tier %r: %s cannot be locked (%s); another job could write into it unnoticed", self.tier, self.directory, exc.strerror)
                return
            if not holder:
                raise
            raise ConfigError(
                f"tier {self.tier!r}: {str(self.directory)!r} is in use by another Checkpointer ({holder}); "
                "close that one first, or give this one its own directory",
                tier=self.tier,
                key=f"tiers.{self.tier}.path",
            ) from None
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # drops the flock
