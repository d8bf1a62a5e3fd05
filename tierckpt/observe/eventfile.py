"""The events file (config ``events: PATH``): JSON Lines, one object per event, in the order emitted.

``handle`` only appends the event to a list; a daemon thread writes the lines every quarter of a
second, so a save never waits on this file's disk, and the writer, which needs the interpreter lock
to encode the lines, does not wake once per event in the middle of the captures that follow the
saves. The file is appended to (a restarted job continues it) and flushed after each batch, never
fsynced: it is a record for people and tools, not part of any commit. Closing writes what is left.

A full list (the disk far slower than the events, 100,000 waiting) drops events and says how many
once it drains; a failed write (a full disk, a removed directory) is logged once and ends the file:
neither ever touches a checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

from tierckpt.errors import ConfigError
from tierckpt.observe.events import Event

log = logging.getLogger("tierckpt")

__all__ = ["EventFile", "events_path"]

_WAITING = 100_000
_EVERY_S = 0.25  # how often the lines are written: late enough to batch a save's events, soon enough to tail


def events_path(template: str, rank: int) -> Path:
    """The events file of ``rank``: ``{rank}`` in the configured path replaced by it."""
    return Path(template.replace("{rank}", str(rank)))


class EventFile:
    """Appends each event as a JSON line to ``path`` (its directory created), from a thread of its own.

    Raises:
        ConfigError: the file cannot be opened for appending (names the path and why).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"events: cannot open {self.path} for appending: {exc.strerror or exc}") from exc
        self._waiting: list[Event] = []
        self._lock = threading.Lock()
        self._dropped = 0
        self._ended = False  # a write failed: nothing more is kept
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._write, name="tierckpt-events", daemon=True)
        self._thread.start()

    def handle(self, event: Event) -> None:
        if self._ended:
            return
        with self._lock:
            if len(self._waiting) < _WAITING:
                self._waiting.append(event)
            else:
                self._dropped += 1

    def _write(self) -> None:
        try:
            while True:
                closing = self._closing.wait(_EVERY_S)
                with self._lock:
                    batch, self._waiting = self._waiting, []
                    dropped, self._dropped = self._dropped, 0
                if batch:
                    self._file.write("".join(json.dumps(e.as_dict(), separators=(",", ":")) + "\n" for e in batch))
                    self._file.flush()
                if dropped:
                    log.warning("events: %d event(s) were not written to %s: the file fell behind", dropped, self.path)
                if closing:
                    return
        except OSError as exc:
            self._ended = True
            log.error("events: writing %s failed, no more events go there (checkpointing goes on): %s", self.path, exc.strerror or exc)
        finally:
            try:
                self._file.close()
            except OSError:
                pass

    def close(self) -> None:
        """Write what is waiting, then close the file."""
        self._closing.set()
        self._thread.join()
