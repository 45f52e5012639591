"""The pool: what it opens at start, how it grows, warms and waits; waiting for a database."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import ExitStack

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from sokratos_worker.errors import DatabaseUnavailable
from sokratos_worker.store import queue_sql
from sokratos_worker.store.connection import (
    Database,
    connect,
    make_pool,
    wait_for_database,
    with_keepalives,
)
from tests.support.daemon import wait_until
from tests.support.db import count, enqueue_many


def _backends(database_url: str) -> int:
    """Connections to this test's database, not counting the one asking."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) - 1 FROM pg_stat_activity WHERE datname = current_database()"
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_keep_open_connections_are_opened_at_start(database_url: str) -> None:
    database = Database(database_url, size=6, keep_open=4)
    try:
        database.pool.wait(timeout=10)  # the pool opens them in the background
        assert _backends(database_url) == 4
    finally:
        database.close()
    # A closed connection's server process ends a moment later (a while, on a loaded machine).
    assert wait_until(lambda: _backends(database_url) == 0, timeout=10), _backends(database_url)


def test_the_pool_grows_beyond_keep_open_up_to_its_size(database_url: str) -> None:
    database = Database(database_url, size=3, keep_open=1)
    try:
        database.pool.wait(timeout=10)
        assert _backends(database_url) == 1
        with ExitStack() as held:
            for _ in range(3):
                held.enter_context(database.connection())
            assert _backends(database_url) == 3
        assert _backends(database_url) == 3  # returned, they stay open (idle) until max_idle
    finally:
        database.close()


def test_warm_up_plans_the_settle_without_running_it(
    db: psycopg.Connection, database_url: str
) -> None:
    enqueue_many(db, 3)
    database = Database(database_url, size=2, keep_open=2, configure=queue_sql.warm_up)
    try:
        assert database.wait_ready(10)
    finally:
        database.close()
    # EXPLAIN only: nothing claimed, settled or recorded by the two warmed connections.
    assert count(db, "SELECT count(*) FROM pending_triage WHERE attempts = 0") == 3
    assert count(db, "SELECT count(*) FROM pending_triage WHERE lease_owner IS NOT NULL") == 0
    assert count(db, "SELECT count(*) FROM work_outcomes") == 0


def test_warm_up_leaves_a_connection_to_a_database_without_the_tables_usable(
    empty_database_url: str,
) -> None:
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        queue_sql.warm_up(conn)
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_warm_up_behind_a_locked_table_gives_up_and_leaves_no_timeout_behind(
    database_url: str,
) -> None:
    """A migration holding a queue table: the warm-up waited on it for as long as it was held
    (stalling the pool thread opening the connection, and a stop's pool close)."""
    with psycopg.connect(database_url) as locker, psycopg.connect(
        database_url, autocommit=True
    ) as conn:
        locker.execute("LOCK TABLE pending_triage IN ACCESS EXCLUSIVE MODE")
        started = time.monotonic()
        queue_sql.warm_up(conn)
        assert time.monotonic() - started < 10  # gave up after queue_sql.WARM_UP_TIMEOUT_MS
        locker.rollback()
        assert conn.execute("SHOW statement_timeout").fetchone() == ("0",)
        assert conn.execute("SELECT count(*) FROM pending_triage").fetchone() == (0,)


def test_wait_ready_says_false_when_the_server_cannot_be_reached() -> None:
    database = Database("postgresql://127.0.0.1:1/none?connect_timeout=1", size=1)
    try:
        assert database.wait_ready(0.5) is False
        assert not database.pool.closed  # (psycopg_pool's own wait() closes it at its timeout)
    finally:
        database.close()


def test_wait_for_database_tries_until_its_deadline_and_says_why_once() -> None:
    started = time.monotonic()
    with pytest.raises(DatabaseUnavailable) as info:
        wait_for_database("postgresql://127.0.0.1:1/none?connect_timeout=1", deadline_s=2.0)
    assert time.monotonic() - started >= 2.0  # not given up a backoff step early
    text = str(info.value)
    assert "still unreachable after 2s (SOKRATOS_STARTUP_TIMEOUT 2s)" in text
    assert text.count("database unavailable") <= 1


def test_holding_lends_one_connection_for_every_use_on_the_thread(database_url: str) -> None:
    database = Database(database_url, size=1, keep_open=1)  # a second checkout would time out
    try:
        with database.holding():
            with database.connection() as first:
                pid = first.execute("SELECT pg_backend_pid()").fetchone()
                with database.connection() as nested:  # (a read inside a settle)
                    assert nested is first
            with database.connection() as later:
                assert later is first and later.execute("SELECT pg_backend_pid()").fetchone() == pid
        with database.connection() as after:  # given back when the slot's run ended
            assert after.execute("SELECT pg_backend_pid()").fetchone() == pid
    finally:
        database.close()


def test_a_held_connection_a_failure_broke_is_replaced(
    database_url: str, db: psycopg.Connection
) -> None:
    database = Database(database_url, size=2, keep_open=1)
    try:
        with database.holding():
            with database.connection() as conn:
                pid = conn.execute("SELECT pg_backend_pid()").fetchone()
            assert pid is not None
            db.execute("SELECT pg_terminate_backend(%s)", pid)
            with pytest.raises(DatabaseUnavailable), database.connection() as conn:
                conn.execute("SELECT 1")
            with database.connection() as conn:  # a fresh one, not the dead one
                assert conn.execute("SELECT pg_backend_pid()").fetchone() != pid
    finally:
        database.close()


def test_a_held_connection_is_lent_between_uses_when_another_thread_waits(
    database_url: str,
) -> None:
    """A short pool: the slot holding the only connection lends it before its handler runs,
    so the lease renewer waiting for one gets it (it used to wait until the pool timeout)."""
    database = Database(database_url, size=1, keep_open=1)
    got = threading.Event()

    def renewer() -> None:
        with database.connection() as conn:
            conn.execute("SELECT 1")
        got.set()

    try:
        with database.holding():
            with database.connection() as conn:
                conn.execute("SELECT 1")
            database.lend_if_wanted()  # nobody waits: kept
            with database.connection() as again:
                assert again is conn
            other = threading.Thread(target=renewer)
            other.start()
            deadline = time.monotonic() + 5
            while database.pool.get_stats().get("requests_waiting", 0) == 0:
                assert time.monotonic() < deadline, "the other thread never waited"
                time.sleep(0.01)
            assert not got.is_set()
            database.lend_if_wanted()  # between two uses: lent
            assert got.wait(5), "the waiting thread did not get the connection"
            other.join(5)
            with database.connection() as conn:  # the slot takes one again when it needs it
                conn.execute("SELECT 1")
    finally:
        database.close()


def test_connections_give_up_on_unacknowledged_data_as_keepalives_do(database_url: str) -> None:
    """Keepalives stay silent while sent data waits for its ACK: tcp_user_timeout covers that
    minute too, and a URL's own settings win."""
    with connect(database_url) as conn:
        params = conn.info.get_parameters()
        assert conn.execute("SELECT 1").fetchone() == (1,)
    assert params["keepalives_idle"] == "30"
    assert params["tcp_user_timeout"] == "60000"  # idle 30 s + 3 probes 10 s apart
    own = conninfo_to_dict(with_keepalives("host=db.example tcp_user_timeout=5000"))
    assert own["tcp_user_timeout"] == "5000" and own["keepalives_idle"] == "30"


def test_connections_speak_utf8_whatever_the_url_or_pgclientencoding_say(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under LATIN1 a message in Japanese could not even be sent (UnicodeEncodeError), and
    the email check stopped at it for good, blaming privileges."""
    monkeypatch.setenv("PGCLIENTENCODING", "LATIN1")
    latin1_url = make_conninfo(database_url, client_encoding="LATIN1")
    with connect(latin1_url) as conn:
        assert conn.info.encoding == "utf-8"
        assert conn.execute("SELECT %s::text", ("日本語の件名",)).fetchone() == ("日本語の件名",)
    pool = make_pool(latin1_url, size=1)
    try:
        with pool.connection() as conn:
            assert conn.info.encoding == "utf-8"
    finally:
        pool.close()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_pool_reopens_its_connections_soon_after_a_long_outage(
    database_url: str, restart_postgres: Callable[[float], None]
) -> None:
    """psycopg_pool's backoff doubles without a cap (1, 2, 4 ... 64 s): after a 70 s outage
    the daemon's work resumed ~45 s after PostgreSQL was back. Capped at 5 s, it resumes
    within a few seconds (the bound below is generous: the mechanism, not the speed)."""
    database = Database(database_url, size=2, keep_open=2)
    up_at: list[float] = []
    reached: list[float] = []
    done = threading.Event()

    def keep_asking() -> None:  # as the dispatcher does through an outage
        while not done.is_set():
            try:
                with database.connection() as conn:
                    conn.execute("SELECT 1")
                if up_at:
                    reached.append(time.monotonic())
                    return
            except DatabaseUnavailable:
                pass
            time.sleep(0.5)

    asker = threading.Thread(target=keep_asking, daemon=True)
    try:
        database.pool.wait(timeout=10)
        asker.start()
        restart_postgres(40.0)  # the uncapped backoff's next try is then ~23 s after the restart
        up_at.append(time.monotonic())
        asker.join(60)
    finally:
        done.set()
        database.close()
    assert reached, "no connection within 60 s of PostgreSQL's restart"
    assert reached[0] - up_at[0] < 15, f"{reached[0] - up_at[0]:.1f} s after the restart"
