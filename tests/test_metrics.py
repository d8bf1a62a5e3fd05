"""The Prometheus endpoint (tierckpt.observe.metrics), scraped over real HTTP on 127.0.0.1.

Each test feeds :class:`Metrics` events as :class:`~tierckpt.observe.events.Events` would, scrapes
its URL with urllib and reads the text with prometheus_client's own parser.
"""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tierckpt import Checkpointer
from tierckpt.errors import ConfigError
from tierckpt.observe.events import Event
from tierckpt.observe.metrics import NO_STEP, Metrics

HOST = "127.0.0.1"


def event(
    kind: str, *, step: int | None = None, tier: str | None = None, bytes: int | None = None,
    seconds: float | None = None, error: str | None = None, time: float = 1_700_000_000.0,
) -> Event:
    return Event(kind, time, 0, step, tier, bytes, seconds, error)


def scrape(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of one scrape, by name and sorted labels."""
    with urllib.request.urlopen(metrics.url, timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


@pytest.fixture
def metrics() -> Iterator[Metrics]:
    served = Metrics(HOST, 0, ["ram", "nvme"], lambda: 1)
    yield served
    served.close()


def test_zeros_for_every_tier_before_the_first_event(metrics: Metrics) -> None:
    samples = scrape(metrics)
    for tier in ("ram", "nvme"):
        assert value(samples, "tierckpt_flushes_total", tier=tier) == 0
        assert value(samples, "tierckpt_flush_failures_total", tier=tier) == 0
        assert value(samples, "tierckpt_flush_seconds_count", tier=tier) == 0
        assert value(samples, "tierckpt_newest_step", tier=tier) == NO_STEP
        assert value(samples, "tierckpt_last_flush_timestamp_seconds", tier=tier) == 0
    assert value(samples, "tierckpt_saves_total") == 0


def test_a_run_of_events_shows_on_the_scrape(metrics: Metrics) -> None:
    feed = [
        event("save", step=1, seconds=0.002, bytes=100),
        event("save", step=2, seconds=0.003, bytes=100),
        event("save_skipped", step=3),
        event("captured", step=1, seconds=0.05, bytes=100),
        event("captured", step=2, seconds=0.07, bytes=120),
        event("capture_failed", step=3, tier="ram", error="torn"),
        event("flushed", step=1, tier="ram", seconds=0.02, bytes=90, time=1_700_000_010.0),
        event("flushed", step=2, tier="ram", seconds=0.03, bytes=95, time=1_700_000_020.0),
        event("flushed", step=2, tier="nvme", seconds=4.0, bytes=80, time=1_700_000_030.0),
        # An older step committed late: counted and timestamped, but the newest step stays 2.
        event("flushed", step=1, tier="nvme", seconds=9.0, bytes=70, time=1_700_000_040.0),
        event("flush_failed", step=3, tier="nvme", error="ENOSPC"),
        event("passed_over", step=1, tier="nvme"),
        event("evicted", step=1, tier="ram"),
        event("deleted", step=1, tier="ram"),
        event("delete_failed", step=1, tier="nvme", error="EACCES"),
        event("restored", step=2, tier="nvme", seconds=1.5, bytes=80),
        event("restore_failed", error="none"),
        event("no_such_event", step=9, tier="ram"),  # a newer library's event: ignored
    ]
    for happened in feed:
        metrics.handle(happened)

    samples = scrape(metrics)
    expected = {
        ("tierckpt_saves_total", ()): 2,
        ("tierckpt_saves_skipped_total", ()): 1,
        ("tierckpt_save_call_seconds_count", ()): 2,
        ("tierckpt_save_call_seconds_sum", ()): 0.005,
        ("tierckpt_capture_seconds_count", ()): 2,
        ("tierckpt_captured_bytes_total", ()): 220,
        ("tierckpt_capture_failures_total", ()): 1,
        ("tierckpt_flush_seconds_count", ("ram",)): 2,
        ("tierckpt_flush_seconds_count", ("nvme",)): 2,
        ("tierckpt_flush_seconds_sum", ("nvme",)): 13.0,
        ("tierckpt_flushed_bytes_total", ("ram",)): 185,
        ("tierckpt_flushed_bytes_total", ("nvme",)): 150,
        ("tierckpt_flushes_total", ("ram",)): 2,
        ("tierckpt_flushes_total", ("nvme",)): 2,
        ("tierckpt_flush_failures_total", ("ram",)): 0,
        ("tierckpt_flush_failures_total", ("nvme",)): 1,
        ("tierckpt_newest_step", ("ram",)): 2,
        ("tierckpt_newest_step", ("nvme",)): 2,
        ("tierckpt_last_flush_timestamp_seconds", ("ram",)): 1_700_000_020.0,
        ("tierckpt_last_flush_timestamp_seconds", ("nvme",)): 1_700_000_040.0,
        ("tierckpt_passed_over_total", ("nvme",)): 1,
        ("tierckpt_passed_over_total", ("ram",)): 0,
        ("tierckpt_evicted_total", ()): 1,
        ("tierckpt_deleted_total", ("ram",)): 1,
        ("tierckpt_deleted_total", ("nvme",)): 0,
        ("tierckpt_delete_failures_total", ("nvme",)): 1,
        ("tierckpt_restores_total", ()): 1,
        ("tierckpt_restore_seconds_count", ()): 1,
        ("tierckpt_restore_seconds_sum", ()): 1.5,
        ("tierckpt_restore_failures_total", ()): 1,
        ("tierckpt_host_slots_busy", ()): 1,
    }
    for (name, tier), want in expected.items():
        labels = {"tier": tier[0]} if tier else {}
        assert value(samples, name, **labels) == pytest.approx(want), name
    # Each observation lands in the right bucket: 4 s and 9 s are above 2.5 s, only 9 s is above 5 s.
    assert value(samples, "tierckpt_flush_seconds_bucket", tier="nvme", le="2.5") == 0
    assert value(samples, "tierckpt_flush_seconds_bucket", tier="nvme", le="5.0") == 1
    assert value(samples, "tierckpt_flush_seconds_bucket", tier="nvme", le="10.0") == 2
    # The rank is no label: each rank serves a port of its own.
    assert not any("rank" in dict(labels) for _, labels in samples)


def test_newest_step_keeps_the_max(metrics: Metrics) -> None:
    for step in (5, 3, 7, 6):
        metrics.handle(event("flushed", step=step, tier="nvme", seconds=1.0, bytes=1))
        metrics.handle(event("flushed", step=0, tier="ram", seconds=1.0, bytes=1))
    samples = scrape(metrics)
    assert value(samples, "tierckpt_newest_step", tier="nvme") == 7
    assert value(samples, "tierckpt_newest_step", tier="ram") == 0  # step 0 is a step, unlike NO_STEP


def test_host_slots_busy_is_read_at_scrape_time() -> None:
    busy = [0]
    metrics = Metrics(HOST, 0, ["ram"], lambda: busy[0])
    try:
        assert value(scrape(metrics), "tierckpt_host_slots_busy") == 0
        busy[0] = 3
        assert value(scrape(metrics), "tierckpt_host_slots_busy") == 3
    finally:
        metrics.close()


def test_a_failing_host_slots_busy_does_not_fail_the_scrape() -> None:
    def broken() -> int:
        raise RuntimeError("closed")

    metrics = Metrics(HOST, 0, ["ram"], broken)
    try:
        samples = scrape(metrics)
        assert value(samples, "tierckpt_host_slots_busy") != value(samples, "tierckpt_host_slots_busy")  # NaN
        assert value(samples, "tierckpt_saves_total") == 0
    finally:
        metrics.close()


def test_port_zero_serves_and_close_frees_the_port() -> None:
    metrics = Metrics(HOST, 0, ["ram"], lambda: 0)
    assert metrics.port > 0
    assert metrics.url == f"http://{HOST}:{metrics.port}/metrics"
    metrics.handle(event("save", step=1, seconds=0.001, bytes=1))
    assert value(scrape(metrics), "tierckpt_saves_total") == 1
    metrics.close()
    metrics.close()  # a second close does nothing

    with pytest.raises(OSError):
        urllib.request.urlopen(metrics.url, timeout=10)
    # The listener is gone: a new one binds the port at once. SO_REUSEADDR as every server sets it (the
    # metrics server too): the scrape's connection may still be in TIME_WAIT on this port.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as again:
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind((HOST, metrics.port))
        again.listen()
    # And so does the next Metrics.
    Metrics(HOST, metrics.port, ["ram"], lambda: 0).close()


def test_two_at_once_do_not_collide() -> None:
    first = Metrics(HOST, 0, ["ram"], lambda: 1)
    second = Metrics(HOST, 0, ["ram", "nvme"], lambda: 2)
    try:
        assert first.port != second.port
        first.handle(event("save", step=1, seconds=0.001, bytes=1))
        first.handle(event("flushed", step=4, tier="ram", seconds=0.1, bytes=1))
        one, two = scrape(first), scrape(second)
        assert value(one, "tierckpt_saves_total") == 1 and value(two, "tierckpt_saves_total") == 0
        assert value(one, "tierckpt_newest_step", tier="ram") == 4
        assert value(two, "tierckpt_newest_step", tier="ram") == NO_STEP
        assert value(one, "tierckpt_host_slots_busy") == 1 and value(two, "tierckpt_host_slots_busy") == 2
        assert ("tierckpt_flushes_total", (("tier", "nvme"),)) not in one
    finally:
        first.close()
        second.close()


def test_a_port_in_use_is_a_config_error() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"metrics\.port: .*{HOST}:{port}.*(in use|Errno)"):
            Metrics(HOST, port, ["ram"], lambda: 0)


def test_a_checkpointer_serves_its_metrics_while_open(tmp_path: Path) -> None:
    """Config ``metrics: {port: 0}``: a real Checkpointer's saves, flushes and busy host slots on a
    scrape of ``metrics_url``; the port is served no more once it is closed."""
    config = {
        "host": {"capacity": "1MiB", "snapshots": 2},
        "tiers": [{"name": "ram", "type": "memory"}, {"name": "nvme", "type": "filesystem", "path": str(tmp_path / "nvme")}],
        "metrics": {"port": 0},
    }
    ckpt = Checkpointer(config)
    try:
        assert ckpt.metrics_url is not None and ckpt.metrics_url.startswith("http://127.0.0.1:")
        for step in range(3):
            assert ckpt.save_sync(step, {"w": torch.full((256,), float(step))}).committed_sync("nvme", 30) is True
        with urllib.request.urlopen(ckpt.metrics_url, timeout=10) as response:
            text = response.read().decode()
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert value(samples, "tierckpt_saves_total") == 3
        assert value(samples, "tierckpt_flushes_total", tier="nvme") == 3
        assert value(samples, "tierckpt_newest_step", tier="nvme") == 2
        assert value(samples, "tierckpt_flushed_bytes_total", tier="nvme") >= 3 * 1024
        assert value(samples, "tierckpt_host_slots_busy") == len([v for v in ckpt.versions() if v.tier == "ram"]) >= 1
        url = ckpt.metrics_url
    finally:
        ckpt.close_sync()
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=10)
