"""Prometheus metrics (config section ``metrics``): each event counted and timed, served over HTTP.

:class:`Metrics` is a sink of :class:`~tierckpt.observe.events.Events`: ``handle`` turns an event into
counter, histogram and gauge updates (a few locked additions, nothing that waits), and an HTTP
server on a daemon thread of its own answers ``GET /metrics`` in Prometheus' text format.

Every metric is named ``tierckpt_…`` with its unit in the name; those about one tier carry a ``tier``
label and none carries the rank: each rank serves its own port, and Prometheus tells the ranks apart
by the target it scraped. The registry is this object's own, never prometheus_client's global one, so
Checkpointers opened one after another or side by side in one process never collide.

This module is imported only when a config has a ``metrics`` section; prometheus-client is the
``tierckpt[metrics]`` extra.
"""

from __future__ import annotations

import errno
import logging
import math
import socket
import threading
from typing import TYPE_CHECKING, Callable, Sequence

from tierckpt.errors import ConfigError
from tierckpt.observe.events import Event

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from prometheus_client import CollectorRegistry, Histogram

log = logging.getLogger("tierckpt")

__all__ = ["Metrics"]

# Histogram buckets, in seconds, each spanning what its duration takes in practice.
_SAVE_CALL_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_CAPTURE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_FLUSH_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
# A restore reads from host memory (milliseconds) or from a file system or bucket (up to an hour).
_RESTORE_BUCKETS = (0.001, 0.01, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)

# ``tierckpt_newest_step`` before a tier has flushed anything: step 0 is a real step.
NO_STEP = -1


class Metrics:
    """Counts and times every event, and serves the numbers at ``http://HOST:PORT/metrics``.

    Args:
        host: the IP address to listen on (``127.0.0.1``: this machine only; ``0.0.0.0``: every interface).
        port: the port to listen on; 0 takes a free one (:attr:`port` says which).
        tiers: the tier names, in order: their ``{tier}`` series exist, at zero, before the first flush.
        host_slots_busy: how many host slots hold a snapshot; called at each scrape, on the server's thread.

    Attributes:
        port: the port bound.
        url: ``http://HOST:PORT/metrics``.

    Raises:
        ConfigError: prometheus-client is not installed, or the address cannot be listened on (names
            ``metrics.port`` or ``metrics.host``, the address and the OS error).

    Example:
        >>> metrics = Metrics("127.0.0.1", 0, ["ram", "nvme"], lambda: 0)
        >>> metrics.url.startswith("http://127.0.0.1:")
        True
        >>> metrics.close()
    """

    def __init__(self, host: str, port: int, tiers: Sequence[str], host_slots_busy: Callable[[], int]) -> None:
        try:
            from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        except ImportError as exc:
            raise ConfigError("metrics: needs prometheus-client: pip install 'tierckpt[metrics]'") from exc

        self._registry = registry = CollectorRegistry()
        self._host_slots_busy = host_slots_busy

        def counter(name: str, text: str, tier: bool = False) -> Counter:
            return Counter(name, text, ["tier"] if tier else [], registry=registry)

        def histogram(name: str, text: str, buckets: Sequence[float], tier: bool = False) -> Histogram:
            return Histogram(name, text, ["tier"] if tier else [], registry=registry, buckets=buckets)

        self._saves = counter("tierckpt_saves_total", "save() calls (the skipped ones too)")
        self._saves_skipped = counter("tierckpt_saves_skipped_total", "save() calls skipped: every host slot busy")
        self._save_call = histogram("tierckpt_save_call_seconds", "How long save() blocked the training loop", _SAVE_CALL_BUCKETS)
        self._capture = histogram("tierckpt_capture_seconds", "From the save() call until its snapshot was in host memory", _CAPTURE_BUCKETS)
        self._captured_bytes = counter("tierckpt_captured_bytes_total", "Bytes copied into host memory")
        self._capture_failures = counter("tierckpt_capture_failures_total", "Captures that failed")
        self._flush = histogram("tierckpt_flush_seconds", "A flush to a tier: read, write, commit", _FLUSH_BUCKETS, tier=True)
        self._flushed_bytes = counter("tierckpt_flushed_bytes_total", "Bytes stored on a tier by committed flushes", tier=True)
        self._flushes = counter("tierckpt_flushes_total", "Versions committed to a tier", tier=True)
        self._flush_failures = counter("tierckpt_flush_failures_total", "Flushes to a tier that failed", tier=True)
        self._passed_over = counter("tierckpt_passed_over_total", "Saves a tier did not take (its flush policy, or a newer one waiting)", tier=True)
        self._evicted = counter("tierckpt_evicted_total", "Snapshots whose host slot a save took before every tier below had them")
        self._deleted = counter("tierckpt_deleted_total", "Versions retention removed from a tier", tier=True)
        self._delete_failures = counter("tierckpt_delete_failures_total", "Deletions from a tier that failed", tier=True)
        self._newest_step = Gauge("tierckpt_newest_step", f"The newest step committed to a tier ({NO_STEP}: none yet)", ["tier"], registry=registry)
        self._last_flush = Gauge(
            "tierckpt_last_flush_timestamp_seconds", "Unix time of the last committed flush to a tier (0: none yet)", ["tier"], registry=registry
        )
        self._restores = counter("tierckpt_restores_total", "Restores that returned a version")
        self._restore = histogram("tierckpt_restore_seconds", "A restore call", _RESTORE_BUCKETS)
        self._restore_failures = counter("tierckpt_restore_failures_total", "Restores that failed")
        Gauge("tierckpt_host_slots_busy", "Host slots holding a snapshot", registry=registry).set_function(self._slots_busy)

        self._newest: dict[str, int] = {}
        self._newest_lock = threading.Lock()  # the read-compare-set of newest_step, across threads
        for tier in tiers:
            for family in (self._flush, self._flushed_bytes, self._flushes, self._flush_failures, self._passed_over,
                           self._deleted, self._delete_failures, self._last_flush):
                family.labels(tier)
            self._newest_step.labels(tier).set(NO_STEP)
            self._newest[tier] = NO_STEP

        self._server, self._thread = _serve(host, port, registry)
        self.port: int = self._server.server_address[1]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{self.port}/metrics"
        self._closed = False

    def handle(self, event: Event) -> None:
        """Update the metrics from ``event``; an event this version does not know is ignored."""
        kind, tier = event.event, event.tier or ""
        if kind == "save":
            self._saves.inc()
            self._observe(self._save_call, event.seconds)
        elif kind == "save_skipped":
            self._saves_skipped.inc()
        elif kind == "captured":
            self._observe(self._capture, event.seconds)
            self._captured_bytes.inc(event.bytes or 0)
        elif kind == "capture_failed":
            self._capture_failures.inc()
        elif kind == "flushed":
            self._observe(self._flush.labels(tier), event.seconds)
            self._flushed_bytes.labels(tier).inc(event.bytes or 0)
            self._flushes.labels(tier).inc()
            self._last_flush.labels(tier).set(event.time)
            if event.step is not None:
                self._raise_newest(tier, event.step)
        elif kind == "flush_failed":
            self._flush_failures.labels(tier).inc()
        elif kind == "passed_over":
            self._passed_over.labels(tier).inc()
        elif kind == "evicted":
            self._evicted.inc()
        elif kind == "deleted":
            self._deleted.labels(tier).inc()
        elif kind == "delete_failed":
            self._delete_failures.labels(tier).inc()
        elif kind == "restored":
            self._restores.inc()
            self._observe(self._restore, event.seconds)
        elif kind == "restore_failed":
            self._restore_failures.inc()

    def close(self) -> None:
        """Stop serving and close the listening socket: the port is free again when this returns."""
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()  # returns once serve_forever has left its loop (within its 0.5 s poll)
        self._server.server_close()
        self._thread.join()

    def _raise_newest(self, tier: str, step: int) -> None:
        # Flushes of one tier may commit out of order (a slow older step after a newer one): keep the max.
        with self._newest_lock:
            if step > self._newest.get(tier, NO_STEP):
                self._newest[tier] = step
                self._newest_step.labels(tier).set(step)

    def _slots_busy(self) -> float:
        # Called by the scrape: a failure here would fail the whole scrape, so it reads as NaN instead.
        try:
            return float(self._host_slots_busy())
        except Exception as exc:
            log.debug("metrics: host_slots_busy() failed: %s", exc)
            return math.nan

    @staticmethod
    def _observe(histogram: Histogram, seconds: float | None) -> None:
        if seconds is not None:
            histogram.observe(seconds)


def _serve(host: str, port: int, registry: CollectorRegistry) -> tuple[WSGIServer, threading.Thread]:
    """Start prometheus_client's HTTP server for ``registry`` on ``host:port``: the server and its thread."""
    from prometheus_client import start_http_server

    try:
        started = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        key = "metrics.host" if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL else "metrics.port"
        raise ConfigError(f"{key}: cannot serve metrics on {host}:{port}: {exc}") from exc
    if not isinstance(started, tuple):
        # prometheus-client before 0.20 returned nothing, leaving no way to stop the server.
        raise ConfigError("metrics: needs prometheus-client 0.20 or newer: pip install 'tierckpt[metrics]'")
    server, thread = started
    return server, thread
