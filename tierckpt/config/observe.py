"""The observability keys of a config: ``events`` (a path) and the ``metrics`` section.

They say where a running Checkpointer reports what it does (:mod:`tierckpt.observe`); neither changes
what is stored. Imports only :mod:`tierckpt.config.schema`.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from typing import Any

from tierckpt.config.schema import Key, Site, check_int, section, site

__all__ = ["MetricsConfig", "read_events", "read_metrics", "write_metrics"]


@dataclass(frozen=True, kw_only=True, slots=True)
class MetricsConfig:
    """A Prometheus endpoint (YAML section ``metrics``), served while the Checkpointer is open.

    Attributes:
        port: the port of rank 0's endpoint, ``http://HOST:PORT/metrics``; under torch.distributed each
            rank serves ``port + local rank`` (the ranks of one node share its address). 0 takes a free
            port (``Checkpointer.metrics_url`` says which).
        host: the address to bind (default ``127.0.0.1``: this machine only; ``0.0.0.0`` for every
            interface, so a Prometheus server elsewhere can scrape it).

    Raises:
        ConfigError: the port is not an integer 0-65535, or the host is not an IP address.

    Example:
        >>> MetricsConfig(port=9400).host
        '127.0.0.1'
    """

    port: int
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        at = site("metrics")
        check_int(at, "port", self.port, low=0, high=65535)
        try:
            ipaddress.ip_address(self.host)
        except (TypeError, ValueError):
            raise at.error("host", problem=f"{self.host!r} is not allowed", hint="use an IP address, e.g. 127.0.0.1 or 0.0.0.0") from None


def read_events(value: Any, at: Site) -> str:
    """The ``events`` key: the path of the events file, a ``{rank}`` placeholder allowed."""
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise at.error(problem=f"{value!r} is not allowed", hint="use the path of a file, e.g. events-{rank}.jsonl")
    return os.path.expanduser(os.fspath(value))


_METRICS_KEYS = (Key("port", "port"), Key("host", "host"))
read_metrics, write_metrics = section(MetricsConfig, _METRICS_KEYS)
