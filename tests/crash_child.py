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
"""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path
from typing import Any

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
    from tierckpt.tiers import filesystem, fswrite

    if point == "data":
        armed = threading.Event()
        write_data_file, pwrite_all = filesystem.write_data_file, fswrite.pwrite_all

        def arming_write(source: Any, *args: Any, **kwargs: Any) -> Any:
            if source.step == step:
                armed.set()
            return write_data_file(source, *args, **kwargs)

        def pausing_pwrite(*args: Any, **kwargs: Any) -> None:
            pwrite_all(*args, **kwargs)
            if armed.is_set():
                say("paused", point, step)
                hang()

        filesystem.write_data_file = arming_write
        fswrite.pwrite_all = pausing_pwrite
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

        async def pausing_rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> Any:
            result = await rename(src, dst, *args, **kwargs)
            # The committed version of ``step`` moved aside (retention, keep.last=2, never deletes the
            # newest step, so this rename is the replacement's).
            if Path(src).name == version_dirname(step) and Path(dst).name.startswith("."):
                say("paused", point, step)
                await asyncio.Event().wait()
            return result

        aiofiles.os.rename = pausing_rename
    else:
        raise SystemExit(f"unknown pause point {point!r}")


def main() -> None:
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
