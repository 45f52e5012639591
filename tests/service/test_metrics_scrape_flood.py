"""Scrapes arriving together (a flood from anyone who reaches SOKRATOS_METRICS_ADDR, or two
Prometheus servers) run one refresh at a time: each used to run the status query on a pooled
connection of its own, so 32 connections at once took every connection the worker's slots
need, for as long as the queries took (seconds behind a locked table).

Real HTTP on 127.0.0.1, a real worker's scrape, real PostgreSQL.
"""

from __future__ import annotations

import http.client
import threading
import time

import psycopg

from sokratos_worker.config import Settings
from sokratos_worker.daemon import build_worker
from sokratos_worker.service.metrics import Metrics, MetricsServer
from sokratos_worker.store.connection import Database
from tests.support.db import enqueue_many

SCRAPES = 8


def _scrape(port: int, statuses: list[int]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        response.read()
        statuses.append(response.status)
    finally:
        conn.close()


def _waiting_scrapes(db: psycopg.Connection) -> int:
    row = db.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        " AND datname = current_database() AND pid <> pg_backend_pid()"
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_concurrent_scrapes_hold_one_database_connection(
    db: psycopg.Connection, database_url: str
) -> None:
    enqueue_many(db, 2)
    database = Database(database_url, size=4)
    metrics = Metrics()
    worker = build_worker(Settings(), database, lambda _ctx: {}, None, None, metrics=metrics)
    metrics.on_scrape(worker._refresh_metrics)
    server = MetricsServer("127.0.0.1:0", metrics)
    server.start()
    statuses: list[int] = []
    most = 0
    try:
        with psycopg.connect(database_url) as locker:  # each scrape's query waits 2 s on it
            locker.execute("LOCK TABLE pending_triage IN ACCESS EXCLUSIVE MODE")
            scrapes = [
                threading.Thread(target=_scrape, args=(server.port, statuses), daemon=True)
                for _ in range(SCRAPES)
            ]
            for scrape in scrapes:
                scrape.start()
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                most = max(most, _waiting_scrapes(db))
                time.sleep(0.05)
            locker.rollback()
        for scrape in scrapes:
            scrape.join(120)
    finally:
        server.stop()
        database.close()
    assert statuses == [200] * SCRAPES  # every scrape answered
    assert most == 1, f"{most} scrapes held a database connection at once"
