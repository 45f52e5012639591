"""A /metrics scrape against a real PostgreSQL: fresh values, the last ones (not a hung scrape,
not "database down") when a table is locked, and the circuits as they are now."""

from __future__ import annotations

import threading

import psycopg
from structlog.testing import capture_logs

from sokratos_worker.config import BackendConfig, Settings
from sokratos_worker.daemon import Worker, build_worker
from sokratos_worker.llm.chat import FallbackChatClient
from sokratos_worker.service.metrics import Metrics
from sokratos_worker.store.connection import Database
from tests.support.db import enqueue_many


def _ready(metrics: Metrics) -> float | None:
    return metrics.registry.get_sample_value(
        "sokratos_queue_items", {"queue": "pending_triage", "state": "ready"}
    )


def _circuit(metrics: Metrics, backend: str) -> float | None:
    return metrics.registry.get_sample_value("sokratos_backend_circuit_state", {"backend": backend})


def _worker(database: Database, metrics: Metrics) -> Worker:
    """A worker without backends, its scrape wired as ``_start_metrics`` wires it."""
    worker = build_worker(Settings(), database, lambda _ctx: {}, None, None, metrics=metrics)
    metrics.on_scrape(worker._refresh_metrics)
    return worker


def test_a_scrape_held_up_by_a_locked_table_serves_the_last_values(
    db: psycopg.Connection, database_url: str
) -> None:
    enqueue_many(db, 3)
    database = Database(database_url, size=2)
    metrics = Metrics()
    worker = _worker(database, metrics)
    try:
        worker._refresh_metrics(metrics)
        assert _ready(metrics) == 3
        enqueue_many(db, 2, prefix="later")
        with psycopg.connect(database_url) as locker:  # a migration holding the table
            locker.execute("LOCK TABLE pending_triage IN ACCESS EXCLUSIVE MODE")
            with capture_logs() as logs:
                scrape = threading.Thread(target=worker._refresh_metrics, args=(metrics,))
                scrape.start()
                scrape.join(30)  # (its statement timeout is 2 s)
                assert not scrape.is_alive(), "the scrape waited on the lock"
        # (Its own events: capture_logs takes every thread's, and a test before this one in
        # CI left a lease renewer running that logged lease_renewal_failed meanwhile.)
        assert [e["event"] for e in logs if e["event"].startswith("metrics_")] == [
            "metrics_refresh_slow"
        ]
        assert _ready(metrics) == 3  # the last values, not zeros
        assert metrics.registry.get_sample_value("sokratos_database_up") == 1
        assert worker._ready()  # a locked table is a reachable database
        worker._refresh_metrics(metrics)
        assert _ready(metrics) == 5
    finally:
        database.close()


def test_database_up_recovers_after_a_scrape_that_could_not_get_a_connection(
    db: psycopg.Connection, database_url: str
) -> None:
    """A scrape that gets no pooled connection while the pool cannot open one (a blip the idle
    runner never saw) reports the database down, and /readyz with it; an idle runner changes no
    state to set them back, so the next successful scrape must."""
    database = Database(database_url, size=1)
    metrics = Metrics()
    worker = _worker(database, metrics)
    try:
        # The pool's only connection, out of reach and not lent to any thread of the worker:
        # what the scrape sees while the pool is reopening its connections.
        busy = database.pool.getconn()
        worker._refresh_metrics(metrics)  # PoolTimeout
        assert metrics.registry.get_sample_value("sokratos_database_up") == 0
        assert not worker._ready()
        database.pool.putconn(busy)
        worker._refresh_metrics(metrics)
        assert _ready(metrics) == 0  # this scrape did reach the database
        assert metrics.registry.get_sample_value("sokratos_database_up") == 1
        assert worker._ready()
    finally:
        database.close()


def test_a_scrape_behind_connections_the_worker_holds_keeps_readiness(
    db: psycopg.Connection, database_url: str
) -> None:
    """Every pooled connection lent to the worker's threads for 5 s (slow statements, lock
    waits) is no outage: the scrape serves the last values, says why, and /readyz stays 200.
    It answered 503 before, until some other path next reached the database."""
    enqueue_many(db, 2)
    database = Database(database_url, size=1)
    metrics = Metrics()
    worker = _worker(database, metrics)
    try:
        worker._refresh_metrics(metrics)
        assert _ready(metrics) == 2
        enqueue_many(db, 1, prefix="later")
        with database.connection(), capture_logs() as logs:  # a slot's, in a slow statement
            worker._refresh_metrics(metrics)
        [slow] = [e for e in logs if e["event"] == "metrics_refresh_slow"]
        assert "all 1 pooled connections stayed in use" in slow["error"]
        assert _ready(metrics) == 2  # the last values
        assert metrics.registry.get_sample_value("sokratos_database_up") == 1
        assert worker._ready()
        worker._refresh_metrics(metrics)
        assert _ready(metrics) == 3
    finally:
        database.close()


def test_a_scrape_shows_the_circuit_as_it_is_now(database_url: str) -> None:
    """With two backends, a circuit that opens while the other serves changes no worker state
    (no heartbeat is written early): the scrape itself must read the breakers."""
    settings = Settings(
        llm_backends=[
            BackendConfig(name="primary", url="http://127.0.0.1:9/v1", model="m"),
            BackendConfig(name="fallback", url="http://127.0.0.1:9/v1", model="m"),
        ]
    )
    chat = FallbackChatClient(settings.llm_backends)
    database = Database(database_url, size=2)
    metrics = Metrics()
    try:
        worker = build_worker(settings, database, lambda _ctx: {}, chat, None, metrics=metrics)
        metrics.on_scrape(worker._refresh_metrics)
        worker.tick()  # the heartbeat: both circuits closed
        metrics.render()
        assert _circuit(metrics, "primary") == 0
        breaker = chat.breaker("primary")
        for _ in range(breaker.threshold):
            breaker.record_failure("HTTP 500 (test)")
        assert chat.states()[0].circuit == "open"
        metrics.render()  # a scrape before the next heartbeat
        assert _circuit(metrics, "primary") == 2, "the scrape still reports the circuit closed"
    finally:
        database.close()
        chat.close()
