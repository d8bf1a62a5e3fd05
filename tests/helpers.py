"""Helpers shared by the tests and by the scripts they run as subprocesses (dist_worker.py, peer_worker.py, …).

A plain module rather than conftest.py: a worker started with ``python tests/x_worker.py`` imports it from
its own folder, where no conftest is loaded. conftest.py re-exports the fixtures built on it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch

import tierckpt
from tierckpt import Checkpointer
from tierckpt.testing.inspect import tier_of  # the open tier of a Checkpointer, by name (helpers re-exports it)
from tierckpt.tiers.filesystem import FilesystemTier

# -- configurations ------------------------------------------------------------------------------------


def memory_tier(name: str = "ram", **settings: Any) -> dict[str, Any]:
    return {"name": name, "type": "memory", **settings}


def fs_tier(name: str, path: Path | str, **settings: Any) -> dict[str, Any]:
    return {"name": name, "type": "filesystem", "path": str(path), **settings}


def tier_config(*tiers: dict[str, Any], capacity: str | int = "8MiB", snapshots: int = 2,
           ram: dict[str, Any] | None = None, **host: Any) -> dict[str, Any]:
    """A host section and ``tiers`` below a memory tier (``ram``: its settings; a plain "ram" when None)."""
    return {"host": {"capacity": capacity, "snapshots": snapshots, **host}, "tiers": [ram or memory_tier(), *tiers]}


def ram_fs(path: Path | str, *, name: str = "nvme", capacity: str | int = "8MiB", snapshots: int = 2,
           **tier: Any) -> dict[str, Any]:
    """The most common shape: host memory above one filesystem tier at ``path`` (``tier``: its settings)."""
    return tier_config(fs_tier(name, path, **tier), capacity=capacity, snapshots=snapshots)


SHUFFLED_ZSTD = {"codec": "zstd", "level": 1, "shuffle": True}  # the compression most tests put on a lower tier


def nvme_and_pfs(root: Path, **host: Any) -> dict[str, Any]:
    """Host memory above a raw "nvme" and a compressed "pfs" (zstd + shuffle), in ``root``'s nvme/ and pfs/."""
    return tier_config(fs_tier("nvme", root / "nvme"), fs_tier("pfs", root / "pfs", compression=SHUFFLED_ZSTD), **host)


def small_state(seed: int) -> dict[str, Any]:
    """A small state of two tensors and two plain values, different for each ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.arange(seed, seed + 8), "step": seed, "tag": f"s{seed}"}


def fs_tier_of(ckpt: Checkpointer, name: str = "nvme") -> FilesystemTier:
    """The open filesystem tier ``name`` of a Checkpointer, to look at how it does its I/O."""
    tier = tier_of(ckpt, name)
    assert isinstance(tier, FilesystemTier)
    return tier


def held(ckpt: Checkpointer, tier: str) -> list[int]:
    """The steps ``ckpt.versions()`` lists on ``tier``, in its order."""
    return [v.step for v in ckpt.versions() if v.tier == tier]


def leftovers(root: Path) -> list[str]:
    """What a filesystem tier's directory holds of unfinished writes, trash and moved-aside versions."""
    return sorted(n for n in os.listdir(root) if n.startswith((".tmp-", ".trash-", ".replaced-")))


# -- comparing states ------------------------------------------------------------------------------------


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's values as bytes on the host: a lazy conj/neg bit applied, any layout made contiguous."""
    t = t.detach().cpu()
    if t.element_size() == 1 and t.dtype is not torch.uint8:
        t = t.view(torch.uint8)  # sub-byte dtypes have no copy kernel (contiguous() of a view needs one)
    return t.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


def assert_bitwise(got: Any, want: Any, path: str = "<root>", *, devices: bool = True) -> None:
    """Values, types, dtypes, shapes and devices equal; tensors and arrays compared bit for bit (NaNs, -0.0).

    ``devices=False``: a tensor may come back on another device than ``want``'s (a CUDA state restored to the host).
    """
    if isinstance(want, torch.Tensor):
        assert type(got) is torch.Tensor, f"{path}: {type(got)}"  # a Parameter comes back as a tensor
        assert (got.dtype, tuple(got.shape)) == (want.dtype, tuple(want.shape)), path
        assert not devices or got.device == want.device, f"{path}: on {got.device}, not {want.device}"
        assert torch.equal(raw_bytes(got), raw_bytes(want)), f"{path}: bytes differ"
        return
    assert type(got) is type(want), f"{path}: {type(got)} is not {type(want)}"
    if isinstance(want, np.ndarray):
        assert (got.dtype, got.shape) == (want.dtype, want.shape), path
        assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes(), f"{path}: bytes differ"
    elif isinstance(want, np.generic):
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), path
    elif isinstance(want, dict):
        assert list(got) == list(want), f"{path}: keys {list(got)} != {list(want)}"
        for key in want:
            assert_bitwise(got[key], want[key], f"{path}[{key!r}]", devices=devices)
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_bitwise(g, w, f"{path}[{i}]", devices=devices)
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def bitwise_equal(got: Any, want: Any) -> bool:
    """assert_bitwise as a yes or no, for the workers that report their checks to the test rather than raise."""
    try:
        assert_bitwise(got, want)
    except AssertionError:
        return False
    return True


def whole_weights(module: torch.nn.Module, fsdp1_root: torch.nn.Module | None = None) -> dict[str, Any]:
    """``module``'s weights as lists, DTensors gathered whole (collective: every rank of a sharded job
    calls it). Under FSDP1 pass the wrapped root: its whole state dict is gathered instead (a module's
    own state dict holds views of FSDP1's flat parameters)."""
    if fsdp1_root is not None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return {k: v.tolist() for k, v in get_model_state_dict(fsdp1_root, options=StateDictOptions(full_state_dict=True)).items()}
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).tolist() for k, v in module.state_dict().items()}


def clone(state: Any) -> Any:
    """``state`` with every tensor copied (containers of the same types)."""
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return type(state)((k, clone(v)) for k, v in state.items())
    if isinstance(state, (list, tuple)):
        return type(state)(clone(v) for v in state)
    return state


def zeroed(like: Any) -> Any:
    """A state of the same structure with every array zeroed (a fresh model and optimizer to restore into)."""
    if isinstance(like, dict):
        return {key: zeroed(value) for key, value in like.items()}
    if isinstance(like, (list, tuple)):
        return type(like)(zeroed(value) for value in like)
    if isinstance(like, torch.Tensor):
        return torch.zeros_like(like)
    if isinstance(like, np.ndarray):
        return np.zeros_like(like)
    return like


# -- the tierckpt command ---------------------------------------------------------------------------------


def tierckpt_cli_argv() -> list[str]:
    """The ``tierckpt`` console script that installing the package (``pip install -e .``) puts beside
    Python, as the start of a command line."""
    beside = Path(sys.executable).with_name("tierckpt")
    found = str(beside) if beside.exists() else shutil.which("tierckpt")
    if found is None:
        pytest.fail("no tierckpt console script: pip install -e . (scripts/setup.sh does)")
    return [found]


def tierckpt_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """Run the ``tierckpt`` console script, as a user would."""
    return subprocess.run([*tierckpt_cli_argv(), *argv], capture_output=True, text=True, timeout=120)


# -- what the library logs ---------------------------------------------------------------------------------


@contextlib.contextmanager
def logged_warnings(match: str | None = None) -> Iterator[list[str]]:
    """The messages the ``tierckpt`` logger gives at WARNING or above inside the block, from any
    thread, in order: tierckpt reports a restore that fell back (and every other warning) there only,
    never through ``warnings.warn``. With ``match``, the block must log one that matches
    (``re.search``), as ``pytest.warns(match=...)`` checks (not when the block raises). A plain
    function rather than ``caplog``: the workers run without pytest.
    """
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logger = logging.getLogger("tierckpt")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
    if match is not None:
        assert any(re.search(match, m) for m in messages), f"no tierckpt warning matches {match!r}: {messages}"


# -- threads held at a barrier ---------------------------------------------------------------------------

_LIBRARY = os.path.dirname(os.path.abspath(tierckpt.__file__)) + os.sep
_THREADING = os.path.abspath(threading.__file__)


def _blocked_in_library(frame: Any) -> bool:
    """The innermost frame waits in threading (an Event, Condition or future's wait) and one of its
    callers is tierckpt's own code."""
    if os.path.abspath(frame.f_code.co_filename) != _THREADING:
        return False
    while frame is not None:
        if os.path.abspath(frame.f_code.co_filename).startswith(_LIBRARY):
            return True
        frame = frame.f_back
    return False


def parked(thread: threading.Thread, deadline_s: float = 30.0) -> bool:
    """Whether ``thread`` comes to block inside tierckpt, waiting on an event, a condition or a future:
    the positive sign that a barrier holds it, in place of "still running after a short sleep".

    Polled until it is so (True) or the thread ends first (False): a barrier that lets the thread
    through never parks it, and the thread runs on to its end, however slow the machine. ``deadline_s``
    is a deadlock guard only (False when it runs out).
    """
    end = time.monotonic() + deadline_s
    while thread.is_alive() and time.monotonic() < end:
        frame = sys._current_frames().get(thread.ident)  # type: ignore[arg-type]
        if frame is not None and _blocked_in_library(frame):
            return True
        threading.Event().wait(0.001)  # polling for a positive sign, not synchronisation
    return False


def assert_overlapped(seen: dict[str, Any], at_save: Any) -> None:
    """What a lazy save's watcher saw (a trainer's test holds the copy of one save, then lets training
    go on): the save returned before its copy, the next forward ran beside it, and the training thread
    then parked in the lazy barrier with the weights (``weights_by_then``) still those saved."""
    assert seen["returned_before_the_copy"], seen
    assert seen["parked"], "the training thread never waited in the lazy barrier"
    assert seen["forwards_by_then"] >= 1, "the training thread parked before the next forward: nothing overlapped the copy"
    assert_bitwise(seen["weights_by_then"], at_save)  # parked before the optimizer changed anything


def in_barrier(thread: threading.Thread) -> bool:
    """Whether ``thread`` waits in the Checkpointer's lazy barrier: blocked on a threading primitive,
    called from ``capture/barrier.py`` (a trainer may run its whole training under tierckpt's code,
    so "blocked in tierckpt" alone would take any wait for it)."""
    frame = sys._current_frames().get(thread.ident)  # type: ignore[arg-type]
    files = []
    while frame is not None:
        files.append(frame.f_code.co_filename)
        frame = frame.f_back
    return bool(files) and files[0] == threading.__file__ and any(f.endswith(os.path.join("capture", "barrier.py")) for f in files)


def until(predicate: Any, deadline_s: float = 30.0) -> bool:
    """Poll ``predicate()`` until it is true (True) or ``deadline_s``, a deadlock guard only, runs out."""
    end = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() >= end:
            return False
        threading.Event().wait(0.001)
    return True


# -- checkpointers a test opens ------------------------------------------------------------------------


class Opened:
    """Opens Checkpointers for a test (``opened(config)``) and closes them all at teardown, even after a failure.

    Gates a test holds shut (``gates``: Events, GatedTiers, testing.Gates, a Gates passed as ``tier_factory``)
    are opened first: a failed assertion must not leave close() waiting on a shut gate, hiding the failure.
    ``tolerate``: errors that closing may raise because the test provoked them (and asserted on them already).
    """

    def __init__(self, tolerate: tuple[type[BaseException], ...] = ()) -> None:
        self.all: list[Checkpointer] = []
        self.tolerate = tolerate
        self.gates: list[Any] = []

    def __call__(self, config: dict[str, Any], **kwargs: Any) -> Checkpointer:
        c = Checkpointer(config, **kwargs)
        self.all.append(c)
        if hasattr(kwargs.get("tier_factory"), "open_all"):
            self.gates.append(kwargs["tier_factory"])
        return c

    def append(self, item: Any) -> None:
        """Also close a Checkpointer the test opened itself, or open a gate (anything else) before closing."""
        (self.all if isinstance(item, Checkpointer) else self.gates).append(item)

    def close(self) -> None:
        for gate in self.gates:
            if hasattr(gate, "open_all"):  # testing.Gates
                gate.open_all()
            elif hasattr(gate, "gate"):  # a GatedTier
                gate.gate.set()
            else:
                gate.set()
        for c in self.all:
            try:
                c.close_sync()
            except self.tolerate:
                pass


def mount(fstype: str, target: Path, options: str | None = None, source: Path | None = None) -> None:
    """Mount a small real file system at ``target`` (made) for a test: skips where that needs root
    or mount(8) this machine lacks, or the kernel refuses it; :func:`unmount` after."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip(f"mounting a {fstype} needs root and mount(8)")
    target.mkdir(parents=True, exist_ok=True)
    command = ["mount", "-t", fstype] + (["-o", options] if options else []) + [str(source or fstype), str(target)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a {fstype}: {result.stderr.strip()}")


def unmount(target: Path) -> None:
    """Unmount what :func:`mount` mounted (lazily if it is busy)."""
    result = subprocess.run(["umount", str(target)], capture_output=True, timeout=30)
    if result.returncode != 0:
        subprocess.run(["umount", "-l", str(target)], capture_output=True, timeout=30)
