"""Service-layer defects review A proved, each against a real PostgreSQL: a stop waited behind
a state report's heartbeat write, a connection limit met by the pool was taken for an outage,
a slot's lock wait was counted from its statement's start, `run --once` never named the locks
its slots waited for, and the start (and `run --once`) waited on the look for memories of
another embedding model."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import psycopg
import pytest
from structlog.testing import capture_logs

from sokratos_worker import daemon
from sokratos_worker.app import _once_restoring_signals, run_worker
from sokratos_worker.daemon import Worker, build_worker
from sokratos_worker.errors import ConnectionLimitReached, DatabaseUnavailable, reached_database
from sokratos_worker.model import Queue
from sokratos_worker.service.sdnotify import Notifier
from sokratos_worker.store import status as status_store
from sokratos_worker.store.connection import Database
from tests.service.test_service_fixes import limited_role_url  # noqa: F401 (a fixture)
from tests.support.daemon import wait_until
from tests.support.db import count, enqueue_many
from tests.support.handlers import ScriptedHandler, fast_settings, scripted_handlers
from tests.support.ports import unused_port

pytestmark = pytest.mark.postgres


def _events(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in list(logs) if e.get("event") == name]


def _triage_worker(database: Database, **settings: Any) -> Worker:
    return build_worker(
        fast_settings(**settings),
        database,
        lambda _ctx: {Queue.TRIAGE: ScriptedHandler()},
        None,
        None,
        notifier=Notifier({}),
    )


# -- 3. a stop never waits behind a state report's heartbeat write --------------------------


@pytest.mark.timeout(60)
def test_a_stop_is_not_held_behind_the_heartbeat_write_of_a_state_report(
    db: psycopg.Connection, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database back after an outage: "running" is reported, and its heartbeat write hangs
    (a network cut holds one up to tcp_user_timeout). The stop, which reports "stopping"
    under the same report lock, ends within its grace, and the row ends "stopping"."""
    real = status_store.record_heartbeat

    def stuck_when_running(conn: psycopg.Connection, **row: Any) -> None:
        if row["state"] == "running":
            time.sleep(8.0)  # a write into a network cut
        real(conn, **row)

    monkeypatch.setattr(status_store, "record_heartbeat", stuck_when_running)
    database = Database(database_url, size=4)
    try:
        worker = _triage_worker(database, concurrency=1, shutdown_grace=2.0)
        state = worker.runner._worker_state
        state.database_lost(DatabaseUnavailable("database unavailable: cut"))
        back = threading.Thread(target=state.database_back, daemon=True)
        back.start()
        back.join(5)
        reported_back_in_time = not back.is_alive()
        started = time.monotonic()
        worker.runner.shutdown(2.0)
        took = time.monotonic() - started
        row = lambda: db.execute("SELECT state FROM worker_heartbeats").fetchall()  # noqa: E731
        assert wait_until(lambda: row() == [("stopping",)], timeout=20), row()
    finally:
        database.close()
    assert reported_back_in_time, "the report of 'running' waited for its heartbeat write"
    assert took < 4.0, f"shutdown(2.0) took {took:.1f} s"


# -- 4. a connection limit met by the pool is the database answering ------------------------


@pytest.mark.timeout(60)
def test_a_connection_limit_met_by_the_pool_is_no_outage(limited_role_url: str) -> None:  # noqa: F811
    """The role's CONNECTION LIMIT refuses the pool a second connection: the checkout says so
    (ConnectionLimitReached, the database answered), and the heartbeat that met it leaves the
    worker ready (it said waiting for the database, and /readyz flipped)."""
    database = Database(limited_role_url, size=2, keep_open=1)
    try:
        assert database.wait_ready(10)
        worker = _triage_worker(database, concurrency=1)
        with database.connection():  # the role's one connection
            with pytest.raises(DatabaseUnavailable) as caught, database.connection():
                pass
            with capture_logs() as logs:
                worker._record_heartbeat()
        reachable = worker.database_contact.reachable
    finally:
        database.close()
    assert isinstance(caught.value, ConnectionLimitReached), repr(caught.value)
    assert reached_database(caught.value)
    assert "too many connections for role" in str(caught.value), str(caught.value)
    assert "CONNECTION LIMIT" in str(caught.value)
    [skipped] = _events(logs, "heartbeat_skipped")
    assert "too many connections for role" in skipped["error"], skipped
    assert reachable, "a refusal for a connection limit was taken for an outage"


def test_the_runner_waiting_on_a_connection_limit_names_it() -> None:
    """Its claim got no connection: it waits, with a hint naming the limit, not asking
    whether the server is up, and readiness hears of no failed contact."""
    contacts: list[bool] = []
    database = Database(f"postgresql://sokratos@127.0.0.1:{unused_port()}/x", size=1)
    try:
        worker = _triage_worker(database)
        worker.runner._worker_state._on_database_contact = contacts.append
        with capture_logs() as logs:
            worker.runner._worker_state.database_lost(
                ConnectionLimitReached("database unavailable: too many connections for role")
            )
    finally:
        database.close()
    [waiting] = _events(logs, "waiting_for_database")
    assert "CONNECTION LIMIT" in waiting["hint"], waiting
    assert "Is the server up" not in waiting["hint"]
    assert False not in contacts


# -- 5. a lock wait is counted from when it began --------------------------------------------


@pytest.mark.timeout(60)
def test_a_slots_lock_wait_is_counted_from_when_it_began(
    db: psycopg.Connection, database_url: str
) -> None:
    """A statement that worked 2 s, then waits for a lock: not named after 0.5 s of waiting
    (it was, as waiting 2.5 s), and named after 2 s with about 2 s."""
    db.execute("CREATE TABLE locked_here (x int)")
    locker = psycopg.connect(database_url)
    locker.execute("LOCK TABLE locked_here IN ACCESS EXCLUSIVE MODE")
    slot = psycopg.connect(database_url, autocommit=True)
    pid = slot.info.backend_pid

    def work_then_wait() -> None:
        with contextlib.suppress(psycopg.Error):  # (cut short at the end of the test)
            slot.execute("DO $$ BEGIN PERFORM pg_sleep(2); PERFORM count(*) FROM locked_here; END $$")

    statement = threading.Thread(target=work_then_wait, daemon=True)
    try:
        statement.start()
        time.sleep(2.5)  # 2 s of work, then 0.5 s of waiting
        early = status_store.lock_waits_of(db, [pid], 1.0)
        time.sleep(1.5)  # 2 s of waiting
        late = status_store.lock_waits_of(db, [pid], 1.0)
    finally:
        locker.rollback()
        locker.close()
        statement.join(10)
        slot.close()
    assert early == [], [(p, w) for p, w, _ in early]
    [(waiter, waited, wait)] = late
    assert waiter == pid
    assert 1.0 < waited < 3.0, waited
    assert wait.tables == ("locked_here",)


# -- 6. `run --once` names the locks its slots wait for ------------------------------------


@pytest.mark.timeout(120)
def test_run_once_names_a_slot_waiting_for_a_lock_while_it_drains(
    db: psycopg.Connection, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An index build holds `memories` while a `run --once` slot settles: the drain's
    heartbeat names the wait and its holder, as the daemon's tick does (it said nothing until
    the grace ended)."""
    monkeypatch.setattr(daemon, "SLOT_LOCK_REPORT_S", 0.5)
    (item_id,) = enqueue_many(db, 1, behaviour="ok")  # its settle writes a memory
    database = Database(database_url, size=4)
    locker = psycopg.connect(database_url, application_name="index-build")
    try:
        locker.execute("LOCK TABLE memories IN SHARE MODE")
        holder = locker.info.backend_pid
        worker = _triage_worker(database, concurrency=1, heartbeat_interval=1)
        with capture_logs() as logs:
            # The lock is let go once the wait is named, or after 10 s (then unnamed).
            said = lambda: bool(_events(logs, "slot_waits_for_lock"))  # noqa: E731
            release = threading.Thread(
                target=lambda: (wait_until(said, timeout=10), locker.rollback()), daemon=True
            )
            release.start()
            code = _once_restoring_signals(worker)
            release.join(15)
    finally:
        locker.close()
        database.close()
    assert code == 0
    assert count(db, "SELECT count(*) FROM work_outcomes WHERE item_id = %s", item_id) == 1
    waits = _events(logs, "slot_waits_for_lock")
    assert waits, "run --once never named the lock its slot waited for"
    assert waits[0]["tables"] == ["memories"], waits[0]
    assert [b["pid"] for b in waits[0]["held_by"]] == [holder], waits[0]


# -- 8. the look for memories of another embedding model holds up no start -----------------


@pytest.mark.timeout(120)
def test_run_once_is_not_held_by_the_embedding_look_behind_a_lock(
    db: psycopg.Connection, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lock on `memories` (a migration) while `run --once` starts: the run drains and exits
    at once (it waited for the lock before it did anything, with no line), and the look, in
    the background, gives up at its statement timeout and says so."""
    monkeypatch.setattr(daemon, "EMBEDDING_LOOK_TIMEOUT_MS", 1500)
    db.execute(
        "INSERT INTO memories (summary, embedding, embedding_model)"
        " VALUES ('Ana lives in Porto', array_fill(0.1, ARRAY[16])::vector, 'old-embed')"
    )
    settings = fast_settings(
        database_url=database_url,
        embedding_url=f"http://127.0.0.1:{unused_port()}/v1",
        embedding_model="new-embed",
        embedding_dim=32,
    )
    locker = psycopg.connect(database_url)
    try:
        locker.execute("LOCK TABLE memories IN ACCESS EXCLUSIVE MODE")
        release = threading.Timer(8.0, locker.rollback)
        release.start()
        with capture_logs() as logs:
            started = time.monotonic()
            code = run_worker(settings, database_url, scripted_handlers, once=True, migrate=False)
            took = time.monotonic() - started
            given_up = wait_until(lambda: bool(_events(logs, "embedding_look_given_up")), timeout=5)
        release.join(15)
    finally:
        locker.close()
    assert code == 0
    assert took < 6.0, f"run --once took {took:.1f} s behind a lock on memories"
    assert given_up, "the look behind the lock was not given up at its statement timeout"
