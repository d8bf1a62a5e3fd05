"""Progress bars for the long reads, restore, verify and export, drawn on a terminal (:func:`progress_bar`).

A bar counts bytes, shown in binary units with the rate (``restore step 100 from nvme:  42%|████ |
1.3 GiB/3.1 GiB [00:02<00:03, 612.0 MiB/s]``), drawn by tqdm on stderr at most 10 times a second.
It is drawn only where someone watches: when stderr is a terminal. A job's log file gets nothing.

The environment variable ``TIERCKPT_PROGRESS`` overrides the terminal check, for people at a
terminal or tailing a log: ``0`` turns every bar off, ``1`` draws every bar that was left to the
terminal check even without a terminal. Any other value is ignored. A caller that turns a bar off
(``enabled=False``: every rank but 0 in a restore) gets none either way. Without tqdm, no bar is drawn.

Lines printed while a bar is drawn go through :meth:`Progress.print_above`, which clears the bar,
prints the line and draws the bar again below it (``tierckpt verify``: one line per version).

A bar that is not drawn is one shared object whose methods do nothing (``print_above`` just
prints). A caller on a hot path checks ``bar.enabled`` once and then passes no per-chunk callback
at all (:meth:`tierckpt.restore.plan.Plan.run`).
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import threading
from typing import Any, TextIO

__all__ = ["ENV", "Progress", "format_size", "progress_bar", "progress_wanted"]

ENV = "TIERCKPT_PROGRESS"

_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {done}/{size} [{elapsed}<{remaining}, {speed}]"


class Progress:
    """A bar that is not drawn: :meth:`update` and :meth:`close` do nothing. Drawn bars subclass it."""

    enabled = False

    def update(self, nbytes: int) -> None:
        """Count ``nbytes`` more bytes done. Safe to call from several threads at once."""

    def print_above(self, line: str, file: TextIO | None = None) -> None:
        """Print ``line`` to ``file`` (stdout) and flush it; a drawn bar is cleared first and drawn
        again below it, so that a line printed meanwhile does not run into the bar on the terminal."""
        print(line, file=sys.stdout if file is None else file, flush=True)

    def close(self) -> None:
        """Draw the bar's final state and leave it on its line. Closing twice does nothing."""

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_QUIET = Progress()


class _Drawn(Progress):
    """A tqdm bar behind a lock: restore reads land on several I/O threads, and tqdm guards neither
    its counter and redraw timing nor the redraw itself against two threads updating at once."""

    enabled = True

    def __init__(self, bar: Any) -> None:
        self._bar = bar
        self._lock = threading.Lock()

    @property
    def done(self) -> int:
        """The bytes counted so far."""
        return int(self._bar.n)

    def update(self, nbytes: int) -> None:
        with self._lock:
            self._bar.update(nbytes)

    def print_above(self, line: str, file: TextIO | None = None) -> None:
        with self._lock:
            self._bar.clear()
            super().print_above(line, file)
            self._bar.refresh()

    def close(self) -> None:
        with self._lock:
            self._bar.close()


def progress_bar(total_bytes: int, desc: str, *, enabled: bool | None = None) -> Progress:
    """A progress bar over ``total_bytes`` bytes, labelled ``desc``; a no-op one when not drawn.

    Args:
        total_bytes: the bytes the work will count with ``update``. A bar over no bytes is not drawn.
        desc: what the work is, as the bar's label (``"restore step 100 from nvme"``).
        enabled: None: drawn when stderr is a terminal, unless ``TIERCKPT_PROGRESS=0``; with
            ``TIERCKPT_PROGRESS=1`` drawn even without one. False: never drawn. True: drawn unless
            ``TIERCKPT_PROGRESS=0``.

    Example::

        with progress_bar(total, f"verify {name}") as bar:
            for chunk in chunks:
                bar.update(len(chunk))
    """
    if total_bytes <= 0 or not progress_wanted(enabled):
        return _QUIET
    bar_class = _bar_class()
    if bar_class is None:
        return _QUIET
    return _Drawn(bar_class(total=total_bytes, desc=desc, file=sys.stderr, bar_format=_FORMAT, dynamic_ncols=True))


def progress_wanted(enabled: bool | None = None) -> bool:
    """Whether a bar asked for with ``enabled`` (see :func:`progress_bar`) would be drawn: a caller
    whose total costs work to count asks this first."""
    if enabled is False:
        return False
    said = os.environ.get(ENV)
    if said == "0":
        return False
    if enabled or said == "1":
        return True
    stderr = sys.stderr  # None under pythonw, or when a daemon closed it
    return stderr is not None and stderr.isatty()


@functools.cache
def _bar_class() -> Any:
    """tqdm's bar, showing sizes in binary units; None without tqdm. Imported here, when a bar is
    first drawn, so that a process that draws none never imports it."""
    try:
        # importlib rather than an import statement: tqdm ships no type information, and this keeps
        # mypy from needing stubs for it.
        tqdm = importlib.import_module("tqdm").tqdm
    except ImportError:
        return None

    class BinaryBar(tqdm):  # type: ignore[misc,valid-type]
        # tqdm's own sizes use decimal prefixes ("MB/s" for MB, even with unit_divisor=1024): the
        # bar's text takes these instead.
        monitor_interval = 0  # no tqdm monitor thread left running in a training process

        @property
        def format_dict(self) -> dict[str, Any]:
            values = dict(super().format_dict)
            n, total, elapsed, rate = values["n"], values["total"], values["elapsed"], values["rate"]
            if rate is None and elapsed:
                rate = n / elapsed
            values.update(done=format_size(n), size=format_size(total), speed=f"{format_size(rate)}/s" if rate else "?")
            return values

    return BinaryBar


def format_size(n: float) -> str:
    """``n`` bytes in binary units, as the bars and the command line show sizes: ``512 B``, ``1.2 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError
