"""Failing system calls and damaged files: :class:`IOFaults` makes one kind of ``os`` call of a real
filesystem tier fail with an errno, for the errors a real disk cannot be made to produce on demand;
:func:`flip_bits` damages a byte of a file; :func:`fd_path` and :func:`path_of` name the file a call is on;
:func:`fallocate_hook` says where the tiers look fallocate(2) up.

IOFaults patches the functions where the tier looks them up (``os``, ``aiofiles.os``, and
``tierckpt.storage.posix._fallocate``), never names in this module.
"""

from __future__ import annotations

import fnmatch
import os
import threading
from types import TracebackType
from typing import Any, Callable

import aiofiles.os

from tierckpt.storage import posix

# What each kind of call patches: functions of ``os`` (and ``aiofiles.os``, whose wrappers hold the
# function they wrapped at import), plus fallocate, which posix calls through libc.
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


def fallocate_hook() -> tuple[Any, str]:
    """Where the filesystem tiers look fallocate(2) up at each call, as ``(module, attribute)``: a function
    of ``(fd, nbytes)`` that returns 0 or the errno. A tool that interposes on the tiers' system calls
    replaces it there (as :class:`IOFaults` does for ``op="allocate"``) and puts it back; a test reads it
    there to see that it was put back."""
    return posix, "_fallocate"


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
                    return self.code  # posix._fallocate returns the errno, as fallocate(2) sets it
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
            owner: Any = fallocate_hook()[0] if name == "_fallocate" else os
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
