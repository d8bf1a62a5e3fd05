"""Dotted log records: each event's numbers as ``tierckpt.checkpoint.<what>`` records of the
``tierckpt.metrics`` logger, the convention of Meta's ``torch_checkpointing``
(``train.checkpoint_write...latency_ms``), which torchtitan-style structured loggers pick up.

Each record carries its name and value in ``record.metric`` and ``record.value`` (plus ``step``,
``tier`` and ``rank``), and reads ``tierckpt.checkpoint.save.call_ms=3.1 step=100`` as text. They are
logged at DEBUG, so they cost nothing (one level check) and print nowhere until a handler asks:
``logging.getLogger("tierckpt.metrics").setLevel(logging.DEBUG)``.
"""

from __future__ import annotations

import logging

from tierckpt.observe.events import Event

__all__ = ["LOGGER", "Records", "record_names"]

LOGGER = "tierckpt.metrics"
_PREFIX = "tierckpt.checkpoint"


def record_names(event: Event) -> list[tuple[str, float]]:
    """The (name, value) records of ``event``: durations in ms, bytes, and 1 for a count."""
    kind, tier = event.event, event.tier
    if kind == "save":
        return [(f"{_PREFIX}.save.call_ms", _ms(event.seconds)), (f"{_PREFIX}.save.bytes", event.bytes or 0)]
    if kind == "captured":
        return [(f"{_PREFIX}.capture.latency_ms", _ms(event.seconds)), (f"{_PREFIX}.capture.bytes", event.bytes or 0)]
    if kind == "flushed":
        return [(f"{_PREFIX}.flush.{tier}.latency_ms", _ms(event.seconds)), (f"{_PREFIX}.flush.{tier}.bytes", event.bytes or 0)]
    if kind == "restored":
        return [(f"{_PREFIX}.restore.latency_ms", _ms(event.seconds)), (f"{_PREFIX}.restore.bytes", event.bytes or 0)]
    where = f".{tier}" if tier and kind not in ("save_skipped", "restore_failed") else ""
    return [(f"{_PREFIX}.{kind}{where}.count", 1)]


def _ms(seconds: float | None) -> float:
    return round((seconds or 0.0) * 1000.0, 3)


class Records:
    """Logs every event's records through the ``tierckpt.metrics`` logger, when it is enabled for DEBUG."""

    def __init__(self) -> None:
        self._log = logging.getLogger(LOGGER)

    def handle(self, event: Event) -> None:
        if not self._log.isEnabledFor(logging.DEBUG):
            return
        for name, value in record_names(event):
            extra = {"metric": name, "value": value, "step": event.step, "tier": event.tier, "rank": event.rank}
            self._log.debug("%s=%s step=%s", name, value, event.step, extra=extra)

    def close(self) -> None:
        pass
