"""/readyz says whether the worker reaches PostgreSQL: 503 from the first failed contact of any
path (claims, listener, heartbeat, scrape) until one succeeds again, whatever the runner's state."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

from sokratos_worker.config import Settings
from sokratos_worker.daemon import build_worker
from sokratos_worker.model import Queue
from sokratos_worker.store.connection import Database
from sokratos_worker.worker_state import State
from tests.support.daemon import daemon_env, start_daemon, wait_until
from tests.support.db import count, enqueue_many
from tests.support.handlers import ScriptedHandler, fast_settings
from tests.support.ports import unused_port


def _get(url: str, timeout: float = 12.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return -1, str(exc)


def _database_up(text: str) -> str | None:
    for line in text.splitlines():
        if line.startswith("sokratos_database_up "):
            return line.split()[1]
    return None


def test_a_failed_contact_makes_the_worker_not_ready_in_any_state(database_url: str) -> None:
    """The runner in "no backend" claims nothing, so it never learns of an outage itself."""
    database = Database(database_url, size=1)
    try:
        worker = build_worker(Settings(), database, lambda _ctx: {}, None, None)
        assert worker._ready()
        worker.runner._worker_state.state = State.NO_BACKEND
        worker.database_contact.failed()  # the listener lost its connection, say
        assert not worker._ready()
        worker.database_contact.succeeded()  # it listens again
        assert worker._ready()
        worker.runner._worker_state.state = State.WAITING_FOR_DATABASE
        assert not worker._ready()  # its claims still fail (the pool is exhausted, say)
    finally:
        database.close()


@pytest.mark.subprocess
@pytest.mark.slow
def test_readyz_is_503_while_the_database_is_down(
    database_url: str, tmp_path: Path, restart_postgres: Callable[[float], None]
) -> None:
    """An idle runner claims again only at its next heartbeat (300 s here): the listener's lost
    connection and the scrape's failure must make /readyz 503 by themselves."""
    port = unused_port()
    env = daemon_env(
        database_url,
        tmp_path,
        SOKRATOS_METRICS_ADDR=f"127.0.0.1:{port}",
        SOKRATOS_HEARTBEAT_INTERVAL="300s",
    )
    log = tmp_path / "daemon.log"
    proc = start_daemon(env, log)
    base = f"http://127.0.0.1:{port}"
    outage: threading.Thread | None = None
    try:
        assert wait_until(lambda: _get(base + "/readyz")[0] == 200, timeout=60), log.read_text()[
            -3000:
        ]
        assert wait_until(lambda: "worker_started" in log.read_text(), timeout=30)
        outage = threading.Thread(target=restart_postgres, args=(40.0,), daemon=True)
        outage.start()
        time.sleep(2.0)  # the server is stopping / stopped
        seen_down_metric = False
        ready_codes: list[int] = []
        deadline = time.monotonic() + 25.0
        while time.monotonic() < deadline:
            status, text = _get(base + "/metrics")
            if status == 200 and _database_up(text) in ("0", "0.0"):
                seen_down_metric = True
            code, _ = _get(base + "/readyz")
            ready_codes.append(code)
            if seen_down_metric and code == 503:
                break
            time.sleep(0.5)
        assert seen_down_metric, "the scrape never noticed the outage: test set-up problem"
        # While the process itself reports the database down, it must not answer ready.
        assert 503 in ready_codes, (
            f"/readyz answered {sorted(set(ready_codes))} for 25 s of a PostgreSQL outage"
            " while /metrics said sokratos_database_up 0"
        )
    finally:
        if outage is not None:
            outage.join(90)
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(40)
            except Exception:
                proc.kill()


@pytest.mark.postgres
def test_a_successful_claim_and_settle_make_the_worker_ready_again(
    db: psycopg.Connection, database_url: str
) -> None:
    """A scrape that found the pool busy for 5 s (a failed contact) makes the worker not ready;
    the runner's claims and settles that succeed afterwards make it ready again, though the
    listener's connection never dropped (it reports nothing) and the next heartbeat is far."""
    database = Database(database_url, size=2)
    handler = ScriptedHandler()
    worker = build_worker(
        fast_settings(concurrency=1, heartbeat_interval=600),
        database,
        lambda _ctx: {Queue.TRIAGE: handler},
        None,
        None,
    )
    # The dispatcher's first pass (a claim, then when the next item is due) ends before the
    # pool gets busy; it then idles until woken (heartbeat 600 s).
    idle = threading.Event()
    next_ready_in = worker.runner._next_ready_in

    def first_pass_done() -> float | None:
        try:
            return next_ready_in()
        finally:
            idle.set()

    worker.runner._next_ready_in = first_pass_done  # type: ignore[method-assign]
    worker.runner.start()
    try:
        assert idle.wait(15)
        time.sleep(0.2)
        # The pool is busy for a moment (every connection lent): the scrape waits 5 s for one.
        with database.pool.connection(), database.pool.connection():
            worker._refresh_metrics(worker.metrics)
        assert not worker._ready(), "(the scrape's pool timeout counts as a failed contact)"
        # The pool is free again; the runner claims and settles an item (two contacts that
        # succeed) as NOTIFY wakes it.
        (item_id,) = enqueue_many(db, 1, behaviour="skip")
        worker.runner.wake()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if count(db, "SELECT count(*) FROM work_outcomes WHERE item_id = %s", item_id):
                break
            time.sleep(0.02)
        assert handler.calls == 1
        assert count(db, "SELECT count(*) FROM pending_triage") == 0
        ready = worker._ready()
    finally:
        worker.runner.shutdown(0)
        database.close()
    assert ready, (
        "the runner claimed and settled an item since the scrape's failed contact, yet /readyz"
        " still answers 503 (until the next heartbeat, 600 s here)"
    )
