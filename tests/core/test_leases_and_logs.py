"""Lease renewal keeps a long item ours; logs are JSON lines without bodies or secrets."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import threading
from contextlib import redirect_stderr

import psycopg
import pytest
import structlog

from sokratos_worker.config import Settings
from sokratos_worker.logs import RepeatedLineFilter, configure_logging
from sokratos_worker.model import Queue
from sokratos_worker.runner import Runner
from sokratos_worker.store import queue as store
from sokratos_worker.store.connection import Database
from tests.support.daemon import wait_until
from tests.support.db import count, enqueue_many
from tests.support.handlers import ScriptedHandler


def test_a_long_item_keeps_its_lease_and_no_other_worker_takes_it(
    db: psycopg.Connection, database_url: str
) -> None:
    enqueue_many(db, 1, behaviour="sleep:4")
    settings = Settings(concurrency=1, lease=1.5, shutdown_grace=10)  # type: ignore[call-arg]
    database = Database(database_url, size=3)
    handler = ScriptedHandler()
    runner = Runner(
        settings=settings, database=database, handlers={Queue.TRIAGE: handler}, worker_id="slow"
    )
    runner.start(drain_only=True)
    stolen: list[int] = []

    def rival() -> None:
        # Another worker tries to claim every 0.3 s while the first one works.
        with psycopg.connect(database_url, autocommit=True) as conn:
            for _ in range(12):
                stolen.extend(
                    i.id
                    for i in store.claim(conn, Queue.TRIAGE, owner="rival", limit=1, lease_s=60)
                )
                threading.Event().wait(0.3)

    # The rival starts only once the item is ours, so it can only steal through a lapsed lease.
    assert wait_until(lambda: runner.inflight_count() == 1, timeout=10)
    thread = threading.Thread(target=rival)
    thread.start()
    assert runner.wait_drained(30)
    thread.join(10)
    runner.shutdown(1)
    database.close()
    assert stolen == []
    assert handler.calls == 1
    assert count(db, "SELECT count(*) FROM work_outcomes WHERE outcome = 'saved'") == 1


def test_logs_are_json_lines_and_never_carry_bodies_or_secrets() -> None:
    buffer = io.StringIO()
    with redirect_stderr(buffer):
        configure_logging("info", "json")
        structlog.get_logger("sokratos_worker.test").info(
            "item_settled", item_id=7, exchange="user: my PIN is xyzzy", api_key="sk-live", text="x"
        )
    line = buffer.getvalue().strip().splitlines()[-1]
    event = json.loads(line)
    assert event["event"] == "item_settled" and event["item_id"] == 7 and event["level"] == "info"
    assert "timestamp" in event
    # (letters: a secret of digits can turn up in the timestamp, as 1234 once did in CI)
    assert "xyzzy" not in line and "sk-live" not in line
    structlog.reset_defaults()


_TRACEBACK_SCRIPT = """
import logging, structlog
from sokratos_worker.logs import configure_logging
configure_logging("info", FORMAT)
def connect():
    conninfo = "postgresql://u:TOPSECRET@h/db"
    raise ValueError("boom")
try:
    connect()
except ValueError:
    logging.getLogger("apscheduler.executors").exception("job raised")
    structlog.get_logger("sokratos_worker.test").exception("ours raised")
"""


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_tracebacks_are_text_and_never_show_local_variables(fmt: str) -> None:
    """A library's traceback (APScheduler's) was a repr of the traceback object in JSON, and
    on a terminal rich printed every frame's locals, a database password among them."""
    script = _TRACEBACK_SCRIPT.replace("FORMAT", repr(fmt))
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    assert "TOPSECRET" not in result.stderr
    assert result.stderr.count("ValueError: boom") == 2, result.stderr
    if fmt == "json":
        events = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
        assert [e.get("message", e["event"]) for e in events] == ["job raised", "ours raised"]
        assert all("in connect" in e["exception"] for e in events)


def test_the_command_line_caches_its_loggers_and_tests_do_not() -> None:
    """A cached logger ignores a later reconfiguration (``capture_logs``): only the process
    entry point, which configures once, turns caching on."""
    buffer = io.StringIO()
    try:
        with redirect_stderr(buffer):
            configure_logging("info", "json", cache=True)
            assert structlog.get_config()["cache_logger_on_first_use"] is True
            structlog.get_logger("sokratos_worker.test").info("cached", item_id=1)
        assert json.loads(buffer.getvalue().strip().splitlines()[-1])["event"] == "cached"
        with redirect_stderr(io.StringIO()):
            configure_logging("info", "json")
        assert structlog.get_config()["cache_logger_on_first_use"] is False
    finally:
        structlog.reset_defaults()


def test_a_librarys_repeated_warning_is_written_once_per_window_then_counted() -> None:
    """psycopg_pool warns at every failed attempt of every connection it cannot open."""
    now = [0.0]
    repeat = RepeatedLineFilter(window_s=300.0, clock=lambda: now[0])

    def passes(text: str, at: float) -> str | None:
        now[0] = at
        record = logging.LogRecord("psycopg.pool", logging.WARNING, __file__, 1, "%s", (text,), None)
        return record.getMessage() if repeat.filter(record) else None

    refused = "error connecting in 'sokratos-worker': too many connections for role"
    assert passes(refused, 0.0) == refused
    assert [passes(refused, t) for t in (1.0, 2.0, 299.0)] == [None, None, None]
    assert passes("error connecting in 'sokratos-worker': the server is down", 5.0) is not None
    assert passes(refused, 301.0) == f"{refused} (and 3 more like it since the last one)"
    assert passes(refused, 302.0) is None


def test_the_pool_logger_carries_the_repeat_filter() -> None:
    buffer = io.StringIO()
    try:
        with redirect_stderr(buffer):
            configure_logging("info", "json")
            for _ in range(5):
                logging.getLogger("psycopg.pool").warning("error connecting in %r: %s", "p", "x")
        lines = [json.loads(line) for line in buffer.getvalue().strip().splitlines()]
        assert [(e["event"], e["logger"], e["message"]) for e in lines] == [
            ("library_message", "psycopg.pool", "error connecting in 'p': x")
        ]
    finally:
        structlog.reset_defaults()


def test_a_librarys_lines_differing_only_in_an_object_address_are_one() -> None:
    """psycopg_pool names each connection it discards by its address: one line per outage,
    on one line, under a stable event name, not one per connection with the text as event."""
    buffer = io.StringIO()
    try:
        with redirect_stderr(buffer):
            configure_logging("info", "json")
            for address in ("0x7fd2a1", "0x7fd2b2", "0x7fd2c3"):
                logging.getLogger("psycopg.pool").warning(
                    "discarding closed connection: %s",
                    f"<psycopg.Connection [BAD] at {address}>\n\tIs the server running?",
                )
        lines = [json.loads(line) for line in buffer.getvalue().strip().splitlines()]
        assert len(lines) == 1, lines
        assert lines[0]["event"] == "library_message"
        assert lines[0]["message"] == (
            "discarding closed connection: <psycopg.Connection [BAD] at 0x7fd2a1>"
            " Is the server running?"
        )
    finally:
        structlog.reset_defaults()
