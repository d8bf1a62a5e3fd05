"""Observability: what a running Checkpointer did, for the people and tools watching a training run.

- :mod:`~tierckpt.observe.events`: :class:`Event` (one thing that happened) and :class:`Events` (hands
  it to every sink); the pipeline and the Checkpointer emit them.
- The sinks: :mod:`~tierckpt.observe.eventfile` (config ``events: PATH``, JSON Lines),
  :mod:`~tierckpt.observe.metrics` (config ``metrics``, a Prometheus endpoint; the extra
  ``tierckpt[metrics]``), :mod:`~tierckpt.observe.records` (dotted log records of the
  ``tierckpt.metrics`` logger).
- Readers of a finished run: :mod:`~tierckpt.observe.timeline` (``tierckpt timeline``), and
  :mod:`~tierckpt.observe.progress` (progress bars on restore, verify and export).

docs/observability.md lists every event and metric.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from tierckpt.config import Config
from tierckpt.observe.eventfile import EventFile, events_path
from tierckpt.observe.events import EVENTS, Event, Events, Sink
from tierckpt.observe.records import Records

__all__ = ["EVENTS", "Event", "Events", "Sink", "open_events"]


def open_events(config: Config, group: Any, tiers: Sequence[str], slots_busy: Callable[[], int]) -> Events:
    """The events of a Checkpointer of ``config`` on this rank of ``group`` (None: one process): the
    dotted log records always, the events file and the metrics endpoint where the config asks.

    Raises:
        ConfigError: the events file cannot be opened, ``prometheus-client`` is missing, or the port is taken.
    """
    rank = group.rank if group is not None else 0
    sinks: list[Sink] = [Records()]
    try:
        if config.events is not None:
            sinks.append(EventFile(events_path(config.events, rank)))
        if config.metrics is not None:
            from tierckpt.observe.metrics import Metrics  # prometheus-client: an extra

            port = config.metrics.port + _local_rank(group) if config.metrics.port else 0
            sinks.append(Metrics(config.metrics.host, port, tiers, slots_busy))
    except BaseException:
        Events(rank, sinks).close()
        raise
    return Events(rank, sinks)


def _local_rank(group: Any) -> int:
    """This rank's index on its node, which offsets its metrics port: the ranks of a node share its address."""
    if group is None:
        return 0
    for node in group.nodes or ():
        if group.rank in node:
            return list(node).index(group.rank)
    local = os.environ.get("LOCAL_RANK", "")
    return int(local) if local.isdigit() else int(group.rank)
