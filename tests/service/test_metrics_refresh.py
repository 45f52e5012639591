"""The database part of a /metrics scrape against a real PostgreSQL: fresh values, and the last
ones (not a hung scrape, not "database down") when a table is locked."""

from __future__ import annotations

import threading
from collections import Counter
from types import SimpleNamespace

import psycopg
from structlog.testing import capture_logs

from sokratos_worker.daemon import Worker
from sokratos_worker.service.metrics import Metrics
from sokratos_worker.store.connection import Database
from tests.support.db import enqueue_many


def _ready(metrics: Metrics) -> float | None:
    return metrics.registry.get_sample_value(
        "sokratos_queue_items", {"queue": "pending_triage", "state": "ready"}
    )


def test_a_scrape_held_up_by_a_locked_table_serves_the_last_values(
    db: psycopg.Connection, database_url: str
) -> None:
    enqueue_many(db, 3)
    database = Database(database_url, size=2)
    worker = SimpleNamespace(runner=SimpleNamespace(inflight_by_queue=Counter), database=database)
    metrics = Metrics()
    metrics.set_database_up(True)
    try:
        Worker._refresh_metrics(worker, metrics)  # type: ignore[arg-type]
        assert _ready(metrics) == 3
        enqueue_many(db, 2, prefix="later")
        with psycopg.connect(database_url) as locker:  # a migration holding the table
            locker.execute("LOCK TABLE pending_triage IN ACCESS EXCLUSIVE MODE")
            with capture_logs() as logs:
                scrape = threading.Thread(target=Worker._refresh_metrics, args=(worker, metrics))
                scrape.start()
                scrape.join(30)  # (its statement timeout is 2 s)
                assert not scrape.is_alive(), "the scrape waited on the lock"
        assert [e["event"] for e in logs] == ["metrics_refresh_slow"]
        assert _ready(metrics) == 3  # the last values, not zeros
        assert metrics.registry.get_sample_value("sokratos_database_up") == 1
        Worker._refresh_metrics(worker, metrics)  # type: ignore[arg-type]
        assert _ready(metrics) == 5
    finally:
        database.close()


def test_database_up_recovers_after_a_scrape_that_could_not_get_a_connection(
    db: psycopg.Connection, database_url: str
) -> None:
    """A scrape that gets no pooled connection (all busy, or a blip the idle runner never saw)
    reports the database down; an idle runner changes no state to set it back, so the next
    successful scrape must."""
    database = Database(database_url, size=1)
    worker = SimpleNamespace(runner=SimpleNamespace(inflight_by_queue=Counter), database=database)
    metrics = Metrics()
    metrics.set_database_up(True)
    try:
        busy = database.pool.getconn()  # the only connection, in use (a slot's, say)
        Worker._refresh_metrics(worker, metrics)  # type: ignore[arg-type]  # PoolTimeout
        assert metrics.registry.get_sample_value("sokratos_database_up") == 0
        database.pool.putconn(busy)
        Worker._refresh_metrics(worker, metrics)  # type: ignore[arg-type]
        assert _ready(metrics) == 0  # this scrape did reach the database
        assert metrics.registry.get_sample_value("sokratos_database_up") == 1
    finally:
        database.close()
