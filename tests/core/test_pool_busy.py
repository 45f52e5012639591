"""A pool whose every connection the worker's own threads hold is busy, not an outage.

Before, a checkout that waited 5 s behind them raised the same DatabaseUnavailable as a server
that was gone: a scrape then made ``/readyz`` answer 503 while PostgreSQL answered, and the
runner's log told the operator to check whether the server was up.
"""

from __future__ import annotations

import threading
from contextlib import ExitStack

import pytest
from structlog.testing import capture_logs

from sokratos_worker.errors import DatabaseUnavailable, PoolBusy, TableLocked, reached_database
from sokratos_worker.model import Queue
from sokratos_worker.runner import Runner
from sokratos_worker.store.connection import Database
from sokratos_worker.worker_state import State
from tests.support.daemon import wait_until
from tests.support.handlers import ScriptedHandler, fast_settings
from tests.support.ports import unused_port


def test_a_checkout_behind_connections_the_process_holds_is_pool_busy(database_url: str) -> None:
    database = Database(database_url, size=2, keep_open=2)
    try:
        with ExitStack() as held:
            held.enter_context(database.connection())
            held.enter_context(database.connection())
            with pytest.raises(PoolBusy, match="all 2 pooled connections stayed in use"):
                database.connection().__enter__()
        with database.connection() as conn:  # given back, they are lent again
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        database.close()


def test_a_connection_held_by_a_slot_between_uses_counts_as_lent(database_url: str) -> None:
    """A slot keeps its connection through its handler's calls (``holding``): in use too."""
    database = Database(database_url, size=2, keep_open=2)
    slot_holds, release = threading.Event(), threading.Event()

    def slot() -> None:
        with database.holding():
            with database.connection() as conn:
                conn.execute("SELECT 1")
            slot_holds.set()  # between two uses, still holding it
            release.wait(30)

    thread = threading.Thread(target=slot)
    thread.start()
    try:
        assert slot_holds.wait(30)
        with database.connection(), pytest.raises(PoolBusy):
            database.connection().__enter__()
    finally:
        release.set()
        thread.join(30)
        database.close()
    assert not thread.is_alive()


def test_connections_given_back_by_every_path_no_longer_count_as_lent(database_url: str) -> None:
    """Each way a connection goes back (a plain use, one that raised, a slot's held one after a
    use that raised, a slot's at its end, one lent to a waiting thread) is counted back: a count
    left behind would call a later timeout busy while the pool was in fact reopening."""
    database = Database(database_url, size=1, keep_open=1)
    try:
        with database.connection() as conn:
            conn.execute("SELECT 1")
        with pytest.raises(ZeroDivisionError), database.connection():
            raise ZeroDivisionError
        with database.holding():
            with pytest.raises(ZeroDivisionError), database.connection():
                raise ZeroDivisionError
            with database.connection() as conn:
                conn.execute("SELECT 1")
        with database.holding():
            with database.connection() as conn:
                conn.execute("SELECT 1")

            def use() -> None:
                with database.connection() as other:
                    other.execute("SELECT 1")

            waiter = threading.Thread(target=use)
            waiter.start()  # another thread waits for the held connection
            waiting = lambda: database.pool.get_stats().get("requests_waiting", 0) == 1  # noqa: E731
            assert wait_until(waiting, timeout=10)
            database.lend_if_wanted()
            waiter.join(30)
            assert not waiter.is_alive()
        # The only connection, taken past the worker's threads (as while it is being reopened).
        outside = database.pool.getconn()
        try:
            with pytest.raises(DatabaseUnavailable) as raised:
                database.connection().__enter__()
            assert not isinstance(raised.value, PoolBusy)
        finally:
            database.pool.putconn(outside)
    finally:
        database.close()


def test_a_checkout_from_an_absent_server_stays_an_outage() -> None:
    database = Database(
        f"postgresql://sokratos@127.0.0.1:{unused_port()}/sokratos", size=1, keep_open=1
    )
    try:
        with pytest.raises(DatabaseUnavailable) as raised:
            database.connection().__enter__()
        assert not isinstance(raised.value, PoolBusy)
        assert not reached_database(raised.value)
    finally:
        database.close()


def test_which_errors_show_the_database_answering() -> None:
    assert reached_database(PoolBusy("busy"))
    assert reached_database(TableLocked("locked"))
    assert not reached_database(DatabaseUnavailable("away"))


def test_the_runner_waiting_on_a_busy_pool_says_so_and_reports_no_failed_contact(
    database_url: str,
) -> None:
    """The runner still waits (its claim got no connection), but its hint names the full pool
    rather than asking whether the server is up, and readiness hears of no failed contact."""
    contacts: list[bool] = []
    database = Database(database_url, size=2)
    runner = Runner(
        settings=fast_settings(),
        database=database,
        handlers={Queue.TRIAGE: ScriptedHandler()},
        worker_id="busy",
        on_database_contact=contacts.append,
    )
    try:
        with capture_logs() as logs:
            runner._worker_state.database_lost(PoolBusy("all 2 pooled connections stayed in use for 5s"))
        assert runner.state == State.WAITING_FOR_DATABASE
        [waiting] = [e for e in logs if e["event"] == "waiting_for_database"]
        assert "every pooled connection stayed in use" in waiting["hint"]
        assert "Is the server up" not in waiting["hint"]
        assert False not in contacts
        runner._worker_state.database_back()
        assert runner.state == State.RUNNING
        assert contacts[-1] is True
    finally:
        database.close()
