"""Recording the file operations of a filesystem tier, and the disks a power loss could leave behind.

Used by ``test_powerloss.py`` (in the spirit of ALICE and CrashMonkey) and, for its kill points only,
by ``crash_child.py``.

:class:`Interposer` patches the ``os`` calls a filesystem tier makes (``open``, ``write``, ``pwrite``,
``pwritev``, ``fsync``, ``fdatasync``, ``ftruncate``, ``mkdir``, ``rename``, ``replace``, ``unlink``,
``remove``, ``rmdir``, fallocate(2) where ``tierckpt.testing.fallocate_hook`` says), the ``aiofiles.os``
wrappers of them, and any module global of ``tierckpt`` bound to one of them or to a wrapper of one,
and calls hooks around each call on a path under a root. ``shutil.rmtree`` goes through ``os.unlink``
and ``os.rmdir``, so a removal is seen file by file. The library looks every ``os`` function up at call
time, so nothing it does to the disk goes unseen; :meth:`Recorder.check_complete` proves it for a
recording by replaying the log and comparing the result with the real directory, byte for byte.

:class:`Recorder` turns the calls into a log of operations on inodes (numbered by the recorder, so that
an inode number the file system reuses is a new inode here):

- directory operations: ``mkdir``, ``create`` (``open`` with ``O_CREAT`` of a new file), ``rename``,
  ``unlink``, ``rmdir``;
- data operations: ``write`` (offset and bytes), ``size`` (``ftruncate``, ``O_TRUNC``), ``alloc``
  (fallocate: the size grows to at least n, zero-filled);
- ``fsync`` of a file or a directory (``fdatasync`` counts as one);
- ``mark``: a point the test names (a commit returned), not a disk operation.

:func:`crash_states` builds, for a prefix of the log (a crash point), the disks a power loss there may
leave, under one of two models:

``posix`` (the strict one, checked first): what was fsynced is on disk, nothing else is promised.
    - Data: the writes and size changes of a file are durable once that file is fsynced. Any others may
      each be lost, kept, or torn (only a prefix of a write, in 512-byte sectors, kept).
    - Directory entries: an operation on the entries of directory D (a create, mkdir, rename, unlink or
      rmdir in D) is durable once D itself is fsynced; a rename across two directories once both are.
      Fsyncing a file does not make its name durable, nor does fsyncing a directory make the
      directory's own name in its parent durable. Operations not yet durable may each be lost or
      kept, in any combination (a rename atomically: both names or neither), applied in their order.
``ext4`` (ext4 with ``data=ordered`` and a journal, no fast commits): directory operations reach the
    disk in the order they were made (the journal), so a crash keeps a prefix of them, and any fsync,
    of a file or a directory, commits the journal and with it every directory operation made before it.
    Data as under ``posix`` (delayed allocation: unfsynced data may be lost, a size change with it).

Every ``ext4`` disk is also a ``posix`` disk, so the ``posix`` model is the stronger test; a failure
under ``posix`` only says the code relies on more than POSIX promises (and on which file systems).

Inodes not reachable from the root after a crash (a directory whose own name was lost) are dropped, as
fsck would move them to lost+found.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import os
import random
import stat
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from tierckpt.testing import fallocate_hook, fd_path, path_of

META = frozenset({"mkdir", "create", "rename", "unlink", "rmdir"})
DATA = frozenset({"write", "size", "alloc"})
SECTOR = 512

_PATH_CALLS = ("open", "mkdir", "unlink", "remove", "rmdir", "rename", "replace")
_FD_CALLS = ("write", "pwrite", "pwritev", "fsync", "fdatasync", "ftruncate", "fallocate")


# -- resolving what a call is about --------------------------------------------------------------------


def _call_paths(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    if name in _FD_CALLS:
        path = fd_path(args[0] if args else kwargs.get("fd"))
        return [path] if path is not None else []
    if name in ("rename", "replace"):
        pairs = [
            (args[0] if args else kwargs.get("src"), kwargs.get("src_dir_fd")),
            (args[1] if len(args) > 1 else kwargs.get("dst"), kwargs.get("dst_dir_fd")),
        ]
    else:
        pairs = [(args[0] if args else kwargs.get("path"), kwargs.get("dir_fd"))]
    return [p for p in (path_of(a, d) for a, d in pairs) if p is not None]


Hook = Callable[[str, list[str], tuple[Any, ...], dict[str, Any]], Any]
AfterHook = Callable[[str, list[str], tuple[Any, ...], dict[str, Any], Any, Any], None]


class Interposer:
    """Within ``with``, calls ``before`` and ``after`` around every call of the kinds above on a path under ``root``.

    ``before(name, paths, args, kwargs)`` runs before the real call and returns a context for
    ``after(name, paths, args, kwargs, result, context)``, which runs once the call succeeded
    (``fallocate``: returned 0). With ``serialize``, hooks and the call run under one lock, so the
    order of the hooks is the order of the calls. Calls on other paths go through untouched.
    """

    def __init__(self, root: str | os.PathLike[str], *, after: AfterHook, before: Hook | None = None, serialize: bool = False) -> None:
        self.root = os.path.realpath(root)
        self.before = before
        self.after = after
        self._lock: Any = threading.RLock() if serialize else contextlib.nullcontext()
        self._saved: list[tuple[Any, str, Any]] = []

    def under(self, path: str) -> bool:
        return path == self.root or path.startswith(self.root + os.sep)

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            paths = _call_paths(name, args, kwargs)
            if not any(self.under(p) for p in paths):
                return original(*args, **kwargs)
            with self._lock:
                context = self.before(name, paths, args, kwargs) if self.before is not None else None
                result = original(*args, **kwargs)
                if name == "fallocate" and result != 0:
                    return result
                self.after(name, paths, args, kwargs, result, context)
                return result

        call.__name__ = getattr(original, "__name__", name)
        call.__wrapped_original__ = original  # type: ignore[attr-defined]
        return call

    def _set(self, owner: Any, attr: str, value: Any) -> None:
        self._saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, value)

    def __enter__(self) -> Interposer:
        import aiofiles.os

        patched: dict[int, Callable[..., Any]] = {}  # id(original) -> its replacement
        for name in _PATH_CALLS + _FD_CALLS:
            if name == "fallocate":
                continue
            original = getattr(os, name)
            patched[id(original)] = self._wrap(name, original)
            self._set(os, name, patched[id(original)])
            if hasattr(aiofiles.os, name):
                self._set(aiofiles.os, name, aiofiles.os.wrap(patched[id(original)]))
        owner, attr = fallocate_hook()  # where the tiers look fallocate(2) up
        self._set(owner, attr, self._wrap("fallocate", getattr(owner, attr)))
        # Globals bound at import to an os function, or to an aiofiles wrapper of one.
        for module_name, module in list(sys.modules.items()):
            if module is None or not module_name.startswith("tierckpt"):
                continue
            for attr, value in list(vars(module).items()):
                if id(value) in patched and callable(value):
                    self._set(module, attr, patched[id(value)])
                elif id(getattr(value, "__wrapped__", None)) in patched:
                    self._set(module, attr, aiofiles.os.wrap(patched[id(value.__wrapped__)]))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, attr, original in reversed(self._saved):
            setattr(owner, attr, original)
        self._saved = []


# -- the operation log -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    """One operation on the recorded file system (see the module docstring)."""

    kind: str
    ino: int = 0  # the inode created, written, synced, moved or removed
    parent: int = 0  # directory operations: the directory (a rename: the source's)
    name: str = ""
    parent2: int = 0  # rename: the destination directory and name
    name2: str = ""
    offset: int = 0
    data: bytes = b""
    size: int = 0
    text: str = ""  # what happened, for reports

    def dirs(self) -> frozenset[int]:
        return frozenset(d for d in (self.parent, self.parent2) if d)


class Recorder:
    """Records the operations on ``root`` inside ``with``; :attr:`base` is the disk before, all durable."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.path.realpath(root)
        self.ops: list[Op] = []
        self._ids: dict[tuple[int, int], int] = {}
        self._next = 0
        self.base = self._scan()
        self._interposer = Interposer(self.root, before=self._before, after=self._after, serialize=True)

    def __enter__(self) -> Recorder:
        self._interposer.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._interposer.__exit__(*exc)

    def mark(self, text: str) -> None:
        with self._interposer._lock:
            self.ops.append(Op("mark", text=text))

    # -- inodes --

    def _new_id(self, st: os.stat_result) -> int:
        self._next += 1
        self._ids[(st.st_dev, st.st_ino)] = self._next
        return self._next

    def _id(self, st: os.stat_result) -> int:
        key = (st.st_dev, st.st_ino)
        if key not in self._ids:
            raise RuntimeError(f"an inode the recording never saw created: {st}")
        return self._ids[key]

    def _forget(self, st: os.stat_result) -> None:
        if stat.S_ISDIR(st.st_mode) or st.st_nlink <= 1:
            self._ids.pop((st.st_dev, st.st_ino), None)

    def _scan(self) -> Tree:
        files: dict[int, bytes] = {}
        dirs: dict[int, dict[str, int]] = {}

        def visit(path: str, st: os.stat_result) -> int:
            ino = self._new_id(st)
            if stat.S_ISDIR(st.st_mode):
                dirs[ino] = {}
                with os.scandir(path) as entries:
                    for entry in entries:
                        dirs[ino][entry.name] = visit(entry.path, entry.stat(follow_symlinks=False))
            else:
                with open(path, "rb") as f:
                    files[ino] = f.read()
            return ino

        root = visit(self.root, os.lstat(self.root))
        return Tree(root, dirs, {ino: (ino,) for ino in files}, files)

    def rel(self, path: str) -> str:
        return os.path.relpath(path, os.path.dirname(self.root))

    # -- hooks --

    def _before(self, name: str, paths: list[str], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if name == "open":
            return os.path.lexists(paths[0])
        if name == "write":
            fd = args[0]
            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND:
                return os.fstat(fd).st_size
            return os.lseek(fd, 0, os.SEEK_CUR)
        if name in ("rename", "replace"):
            dst = os.lstat(paths[1]) if os.path.lexists(paths[1]) else None
            return os.lstat(paths[0]), dst
        if name in ("unlink", "remove", "rmdir"):
            return os.lstat(paths[0])
        return None

    def _parent(self, path: str) -> int:
        return self._id(os.lstat(os.path.dirname(path)))

    def _after(self, name: str, paths: list[str], args: tuple[Any, ...], kwargs: dict[str, Any], result: Any, context: Any) -> None:
        path = paths[0]
        add = self.ops.append
        if name == "open":
            flags = args[1] if len(args) > 1 else kwargs.get("flags", 0)
            st = os.fstat(result)
            if not context and flags & os.O_CREAT:
                ino = self._new_id(st)
                add(Op("create", ino, self._parent(path), os.path.basename(path), text=f"create {self.rel(path)}"))
            elif flags & os.O_TRUNC and stat.S_ISREG(st.st_mode):
                add(Op("size", self._id(st), size=0, text=f"truncate {self.rel(path)}"))
        elif name == "mkdir":
            ino = self._new_id(os.lstat(path))
            add(Op("mkdir", ino, self._parent(path), os.path.basename(path), text=f"mkdir {self.rel(path)}"))
        elif name in ("rename", "replace"):
            src, dst = context
            ino = self._id(src)
            if dst is not None and (dst.st_dev, dst.st_ino) != (src.st_dev, src.st_ino):
                self._forget(dst)
            add(Op(
                "rename", ino, self._parent(paths[0]), os.path.basename(paths[0]), self._parent(paths[1]),
                os.path.basename(paths[1]), text=f"rename {self.rel(paths[0])} -> {self.rel(paths[1])}",
            ))
        elif name in ("unlink", "remove", "rmdir"):
            st = context
            kind = "rmdir" if name == "rmdir" else "unlink"
            add(Op(kind, self._id(st), self._parent(path), os.path.basename(path), text=f"{kind} {self.rel(path)}"))
            self._forget(st)
        else:
            fd = args[0]
            st = os.fstat(fd)
            ino = self._id(st)
            what = self.rel(path.removesuffix(" (deleted)"))
            if name == "write":
                data = bytes(memoryview(args[1]).cast("B")[:result])
                add(Op("write", ino, offset=context, data=data, text=f"write {what} [{context}, +{len(data)})"))
            elif name == "pwrite":
                offset = args[2]
                data = bytes(memoryview(args[1]).cast("B")[:result])
                add(Op("write", ino, offset=offset, data=data, text=f"pwrite {what} [{offset}, +{len(data)})"))
            elif name == "pwritev":
                offset = args[2]
                data = b"".join(bytes(memoryview(b).cast("B")) for b in args[1])[:result]
                add(Op("write", ino, offset=offset, data=data, text=f"pwritev {what} [{offset}, +{len(data)})"))
            elif name == "ftruncate":
                add(Op("size", ino, size=args[1], text=f"ftruncate {what} {args[1]}"))
            elif name == "fallocate":
                add(Op("alloc", ino, size=args[1], text=f"fallocate {what} {args[1]}"))
            elif name in ("fsync", "fdatasync"):
                add(Op("fsync", ino, text=f"{name} {what}{'/' if stat.S_ISDIR(st.st_mode) else ''}"))

    # -- self-check --

    def check_complete(self) -> None:
        """Replay every operation, all durable, and compare with the real directory: a call the shim
        missed (a write through a path it does not patch) shows up as a difference."""
        final = replay(self.base, self.ops, len(self.ops), "posix", everything=True)
        expected = final.listing()
        actual: dict[str, bytes | None] = {}
        for dirpath, dirnames, filenames in os.walk(self.root):
            rel = os.path.relpath(dirpath, self.root)
            for d in dirnames:
                actual[os.path.normpath(os.path.join(rel, d))] = None
            for f in filenames:
                with open(os.path.join(dirpath, f), "rb") as fh:
                    actual[os.path.normpath(os.path.join(rel, f))] = fh.read()
        if expected != actual:
            diff = sorted(k for k in set(expected) | set(actual) if expected.get(k, 0) != actual.get(k, 0))
            raise AssertionError(f"the recording does not replay to the directory (a missed call?): {diff[:10]}")


# -- disk states -------------------------------------------------------------------------------------------


@dataclass
class Tree:
    """A disk: directories (name -> inode), files as tokens naming their content (see :meth:`content`)."""

    root: int
    dirs: dict[int, dict[str, int]]
    files: dict[int, tuple[Any, ...]]  # ino -> (ino, *applied data ops): equal tokens, equal bytes
    base: dict[int, bytes] = field(default_factory=dict)
    ops: list[Op] = field(default_factory=list)

    def copy(self) -> Tree:
        return Tree(self.root, {d: dict(e) for d, e in self.dirs.items()}, dict(self.files), self.base, self.ops)

    def content(self, ino: int, cache: dict[tuple[Any, ...], bytes] | None = None) -> bytes:
        token = self.files[ino]
        if cache is not None and token in cache:
            return cache[token]
        data = bytearray(self.base.get(ino, b""))
        for item in token[1:]:
            index, keep = item if isinstance(item, tuple) else (item, None)
            op = self.ops[index]
            if op.kind == "write":
                chunk = op.data if keep is None else op.data[:keep]
                end = op.offset + len(chunk)
                if len(data) < op.offset:
                    data.extend(bytes(op.offset - len(data)))
                data[op.offset : end] = chunk
            elif op.kind == "size":
                del data[op.size :]
                data.extend(bytes(op.size - len(data)))
            elif op.kind == "alloc":
                data.extend(bytes(max(0, op.size - len(data))))
        out = bytes(data)
        if cache is not None:
            cache[token] = out
        return out

    def entries(self) -> Iterator[tuple[str, int, bool]]:
        """(relative path, inode, is a directory) of everything reachable from the root."""
        stack = [("", self.root)]
        seen = {self.root}
        while stack:
            prefix, d = stack.pop()
            for name, ino in sorted(self.dirs.get(d, {}).items()):
                if ino in seen:
                    continue  # a cycle a nonsensical crash state could make: never seen so far
                path = f"{prefix}{name}"
                is_dir = ino in self.dirs
                yield path, ino, is_dir
                if is_dir:
                    seen.add(ino)
                    stack.append((path + "/", ino))

    def signature(self) -> str:
        h = hashlib.sha256()
        for path, ino, is_dir in sorted(self.entries()):
            h.update(repr((path, None if is_dir else self.files.get(ino))).encode())
        return h.hexdigest()

    def listing(self, cache: dict[tuple[Any, ...], bytes] | None = None) -> dict[str, bytes | None]:
        return {path: (None if is_dir else self.content(ino, cache)) for path, ino, is_dir in self.entries()}

    def materialize(self, dest: str | os.PathLike[str], cache: dict[tuple[Any, ...], bytes] | None = None) -> None:
        os.makedirs(dest)
        for path, ino, is_dir in sorted(self.entries()):
            target = os.path.join(dest, path)
            if is_dir:
                os.mkdir(target)
            else:
                with open(target, "wb") as f:
                    f.write(self.content(ino, cache))


def _apply_meta(tree: Tree, op: Op) -> None:
    if op.kind in ("mkdir", "create"):
        tree.dirs.setdefault(op.parent, {})[op.name] = op.ino
    elif op.kind == "rename":
        src = tree.dirs.setdefault(op.parent, {})
        if src.get(op.name) == op.ino:
            del src[op.name]
        tree.dirs.setdefault(op.parent2, {})[op.name2] = op.ino
    elif op.kind in ("unlink", "rmdir"):
        entries = tree.dirs.setdefault(op.parent, {})
        if entries.get(op.name) == op.ino:
            del entries[op.name]


@dataclass
class Pending:
    """What a crash at a point may or may not have persisted."""

    durable: Tree
    meta: list[int]  # indices of directory operations not yet durable, in order
    data: dict[int, list[int]]  # ino -> indices of its data operations not yet durable


def pending_at(base: Tree, ops: list[Op], k: int, model: str) -> Pending:
    """Replay the first ``k`` operations: what is durable, and what may or may not be."""
    if model not in ("posix", "ext4"):
        raise ValueError(model)
    tree = Tree(base.root, {d: dict(e) for d, e in base.dirs.items()}, dict(base.files), base.base, ops)
    meta: list[tuple[int, set[int]]] = []  # (index, directories still to be fsynced)
    data: dict[int, list[int]] = {}
    for i, op in enumerate(ops[:k]):
        if op.kind in META:
            if op.kind == "mkdir":
                tree.dirs.setdefault(op.ino, {})  # the inode exists; its name may not
            elif op.kind == "create":
                tree.files.setdefault(op.ino, (op.ino,))
            meta.append((i, set(op.dirs())))
        elif op.kind in DATA:
            data.setdefault(op.ino, []).append(i)
        elif op.kind == "fsync":
            if op.ino in tree.files:
                tree.files[op.ino] = tree.files[op.ino] + tuple(data.pop(op.ino, []))
            if model == "ext4":
                for j, _ in meta:  # a journal commit: every directory operation so far
                    _apply_meta(tree, ops[j])
                meta = []
            elif op.ino in tree.dirs:
                still = []
                for j, dirs in meta:
                    dirs.discard(op.ino)
                    if dirs:
                        still.append((j, dirs))
                    else:
                        _apply_meta(tree, ops[j])
                meta = still
    return Pending(tree, [j for j, _ in meta], data)


def replay(base: Tree, ops: list[Op], k: int, model: str, *, everything: bool = False) -> Tree:
    """The disk after the first ``k`` operations; ``everything``: as if all were durable (no crash)."""
    p = pending_at(base, ops, k, model)
    if not everything:
        return p.durable
    return build(p, set(p.meta), {ino: [(i, None) for i in idx] for ino, idx in p.data.items()})


def build(p: Pending, meta: set[int], data: dict[int, list[tuple[int, int | None]]]) -> Tree:
    """The durable disk plus the chosen directory operations (in order) and data operations."""
    tree = p.durable.copy()
    for j in p.meta:
        if j in meta:
            _apply_meta(tree, tree.ops[j])
    for ino, chosen in data.items():
        if ino in tree.files and chosen:
            tree.files[ino] = tree.files[ino] + tuple(i if keep is None else (i, keep) for i, keep in chosen)
    return tree


def crash_states(
    base: Tree, ops: list[Op], k: int, *, model: str, rng: random.Random, exhaustive: int = 6, randoms: int = 4
) -> Iterator[tuple[str, Tree]]:
    """Disks a power loss after the first ``k`` operations may leave, with a label saying which choices.

    Directory operations not yet durable: every subset (``posix``) or prefix (``ext4``) when there are
    at most ``exhaustive`` of them, else the none, all, each-but-one, each-alone and random ones; each
    with unsynced data all lost and all kept. Then ``randoms`` disks with random choices everywhere,
    data writes torn at random sectors.
    """
    p = pending_at(base, ops, k, model)
    n = len(p.meta)
    if model == "ext4":
        subsets = [set(p.meta[:m]) for m in range(n + 1)]
    elif n <= exhaustive:
        subsets = [set(c) for r in range(n + 1) for c in itertools.combinations(p.meta, r)]
    else:
        subsets = [set(), set(p.meta)]
        subsets += [set(p.meta) - {j} for j in p.meta] + [{j} for j in p.meta]
        subsets += [{j for j in p.meta if rng.random() < 0.5} for _ in range(16)]
    none: dict[int, list[tuple[int, int | None]]] = {}
    every = {ino: [(i, None) for i in idx] for ino, idx in p.data.items()}
    for subset in subsets:
        label = "dir ops kept: " + (", ".join(ops[j].text for j in p.meta if j in subset) or "none")
        yield label + "; unsynced data lost", build(p, subset, none)
        if p.data:
            yield label + "; unsynced data kept", build(p, subset, every)
    for _ in range(randoms):
        if model == "ext4":
            subset = set(p.meta[: rng.randint(0, n)])
        else:
            subset = {j for j in p.meta if rng.random() < 0.5}
        data: dict[int, list[tuple[int, int | None]]] = {}
        torn = []
        for ino, idx in p.data.items():
            chosen: list[tuple[int, int | None]] = []
            for i in idx:
                r = rng.random()
                op = ops[i]
                if r < 0.4:
                    chosen.append((i, None))
                elif r < 0.6 and op.kind == "write" and len(op.data) > SECTOR:
                    keep = rng.randrange(1, len(op.data) // SECTOR + 1) * SECTOR
                    chosen.append((i, min(keep, len(op.data))))
                    torn.append(f"{op.text} torn at {keep}")
            data[ino] = chosen
        label = "random: dir ops kept: " + (", ".join(ops[j].text for j in p.meta if j in subset) or "none")
        label += f"; data ops kept: {sum(len(c) for c in data.values())}/{sum(len(i) for i in p.data.values())}"
        if torn:
            label += "; " + "; ".join(torn)
        yield label, build(p, subset, data)
