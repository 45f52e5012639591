"""A settle an outage cut off past 0.8 x the lease ("settle_abandoned") costs the item no attempt
when it was a give-back (a pipeline read met the outage) or a success: the give-back is owed and
written once the database answers, before this worker claims again.

Found by reading (2026-12-06): the abandoned settle left the item leased, its lease expired
while the database was away, and the next claim took it over as a dead worker's, counting the
attempt again; on the item's last attempt that claim dead-lettered it into failed_operations as
"worker died during the last attempt", though no worker died and nothing was the item's fault.

Real parts: PostgreSQL behind a TCP proxy that cuts every connection (and refuses new ones) for
the outage, as a restart or a dropped route does; the runner in-process.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import structlog
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from structlog.testing import capture_logs

from sokratos_worker.errors import DatabaseUnavailable, ItemError
from sokratos_worker.model import Effects, Item, NewMemory, Outcome, Queue
from sokratos_worker.runner import Runner
from sokratos_worker.settle import ABANDONED, WORKER_DIED
from sokratos_worker.store import queue as store
from sokratos_worker.store.connection import Database
from tests.support.daemon import wait_until
from tests.support.db import count, enqueue_many
from tests.support.handlers import ScriptedHandler, fast_settings

LEASE_S = 3.0  # settles are given up after 2.4 s; the pool's checkout waits 5 s


class OutageProxy:
    """Forwards 127.0.0.1:<port> to the server of ``url``. ``down()`` closes every connection
    through it and closes new ones at once (the server gone); ``up()`` forwards again."""

    def __init__(self, url: str) -> None:
        info = conninfo_to_dict(url)
        self._url = url
        host = str(info.get("host") or "localhost")
        port = int(info.get("port") or 5432)
        self._target: Any = (
            f"{host}/.s.PGSQL.{port}"
            if host.startswith("/")
            else (host.split(",", maxsplit=1)[0], port)
        )
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.1)
        self._down = threading.Event()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        info = {k: str(v) for k, v in conninfo_to_dict(self._url).items() if v is not None}
        info.pop("hostaddr", None)
        info.update(host="127.0.0.1", port=str(self._server.getsockname()[1]))
        return make_conninfo(**info)

    def down(self) -> None:
        """The outage begins: every connection through the proxy is cut."""
        self._down.set()
        self._cut_all()

    def up(self) -> None:
        """The outage ends: new connections reach the server again."""
        self._down.clear()

    def close(self) -> None:
        self._closed.set()
        self._cut_all()
        with contextlib.suppress(OSError):
            self._server.close()

    def _cut_all(self) -> None:
        with self._lock:
            cut, self._sockets = self._sockets, []
        for s in cut:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
            except (TimeoutError, OSError):
                continue
            if self._down.is_set():
                client.close()  # (the server is gone: the connection ends at once)
                continue
            family = socket.AF_UNIX if isinstance(self._target, str) else socket.AF_INET
            upstream = socket.socket(family, socket.SOCK_STREAM)
            upstream.connect(self._target)
            with self._lock:
                self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
            except OSError:
                break
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def proxy(database_url: str) -> Iterator[OutageProxy]:
    outage = OutageProxy(database_url)
    yield outage
    outage.close()


class OutageOnItsFirstRun:
    """The database goes away during the item's first run: the handler then reads through
    the worker's pool (``read``: a pipeline read meeting the outage, its attempt given back)
    or returns its effects (the success's settle meets the outage). Later runs skip."""

    def __init__(self, proxy: OutageProxy, database: Database, *, read: bool) -> None:
        self.proxy = proxy
        self.database = database
        self.read = read
        self.attempts: list[int] = []

    def handle(self, item: Item) -> Effects:
        self.attempts.append(item.attempt)
        if len(self.attempts) == 1:
            self.proxy.down()
            if self.read:
                with self.database.connection() as conn:
                    conn.execute("SELECT 1")  # raises DatabaseUnavailable: the outage
        return Effects(Outcome.SKIPPED, detail="run once the database answered")

    def final_failure_memories(self, item: Item) -> tuple[NewMemory, ...]:
        return ()

    def probe(self) -> bool:
        return True


def _lease_expired(db: psycopg.Connection, item_id: int) -> bool:
    return bool(
        count(
            db,
            "SELECT count(*) FROM pending_triage WHERE id = %s AND lease_owner IS NOT NULL"
            " AND lease_expires_at < now()",
            item_id,
        )
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("read", [True, False], ids=["give_back_abandoned", "success_abandoned"])
def test_a_settle_abandoned_on_the_last_attempt_costs_no_attempt(
    db: psycopg.Connection, proxy: OutageProxy, read: bool
) -> None:
    """Last attempt (3 of 3); the outage outlasts 0.8 x lease and the lease itself; then the
    database is back. The item must run again under attempt 3 and end in one outcome, not in
    failed_operations as a worker that died."""
    [item_id] = enqueue_many(db, 1, prefix="owed")
    db.execute("UPDATE pending_triage SET attempts = 2 WHERE id = %s", (item_id,))
    database = Database(proxy.url, size=4)
    handler = OutageOnItsFirstRun(proxy, database, read=read)
    done: list[str] = []
    runner = Runner(
        settings=fast_settings(concurrency=1, lease=LEASE_S, max_attempts=3),
        database=database,
        handlers={Queue.TRIAGE: handler},
        worker_id="owed-worker",
        on_item_done=lambda _q, how, _s: done.append(how),
    )
    runner.start()
    try:
        # The first run's settle is given up (the item leaves the runner, still leased) ...
        assert wait_until(lambda: done == [ABANDONED], timeout=30), done
        # ... and its lease runs out while the database is still away.
        assert wait_until(lambda: _lease_expired(db, item_id), timeout=30)
        proxy.up()
        ended = wait_until(lambda: count(db, "SELECT count(*) FROM work_outcomes") > 0, timeout=60)
    finally:
        runner.shutdown(2)
        database.close()
    failed = db.execute("SELECT error_message FROM failed_operations").fetchall()
    assert not any(WORKER_DIED in str(row[0]) for row in failed), failed
    assert ended, f"no outcome; runs: {handler.attempts}, endings: {done}"
    # 1 in, 1 outcome, no dead letter, nothing left pending, no duplicate.
    assert failed == []
    assert db.execute("SELECT outcome, attempts FROM work_outcomes").fetchall() == [("skipped", 3)]
    assert count(db, "SELECT count(*) FROM pending_triage") == 0
    # Its attempt was given back (uncounted): the second run is attempt 3 again.
    assert handler.attempts == [3, 3]
    assert done == [ABANDONED, "skipped"]
    assert runner.take_stats().counts[Queue.TRIAGE.value]["given_back"] == 1


def _abandoned_in_an_outage(
    db: psycopg.Connection, proxy: OutageProxy, worker_id: str, error: Exception | None = None
) -> tuple[Runner, Database, Item]:
    """A runner whose item's settle was abandoned in an outage (claimed with a 1 s lease, it
    failed with ``error``; by default its pipeline read met the database away, so its
    give-back is owed), the outage going on."""
    enqueue_many(db, 1, prefix="fenced")
    database = Database(proxy.url, size=4)
    runner = Runner(
        settings=fast_settings(concurrency=1, lease=1),
        database=database,
        handlers={Queue.TRIAGE: ScriptedHandler()},
        worker_id=worker_id,
    )
    [item] = store.claim(db, Queue.TRIAGE, owner=worker_id, limit=1, lease_s=1)
    runner._track_claimed([item])
    proxy.down()
    away = DatabaseUnavailable("database unavailable: server closed the connection unexpectedly")
    bound = structlog.get_logger().bind(item_id=item.id)
    assert runner._settler.fail(item, error or away, ScriptedHandler(), bound) == ABANDONED
    assert runner.inflight_count() == 0  # no longer in flight
    return runner, database, item


def test_an_owed_give_back_another_worker_fenced_is_dropped_quietly(
    db: psycopg.Connection, proxy: OutageProxy
) -> None:
    """Its lease ran out and another worker claimed the item before the database answered
    this one: the owed give-back changes nothing, is not counted, and is owed no more."""
    runner, database, item = _abandoned_in_an_outage(db, proxy, "w")
    try:
        assert wait_until(lambda: _lease_expired(db, item.id), timeout=10)
        store.claim(db, Queue.TRIAGE, owner="other", limit=1, lease_s=60)  # takes it over
        proxy.up()
        with capture_logs() as logs:
            assert wait_until(runner._settler.owed_given_back, timeout=30)
        assert runner._claim_for_idle_slots() == (1, 0)  # nothing left to claim
    finally:
        database.close()
    said = [e["event"] for e in logs if e["log_level"] not in ("debug", "info")]
    assert "owed_give_back_fenced" in [e["event"] for e in logs] and said == [], logs
    row = db.execute("SELECT lease_owner, attempts FROM pending_triage").fetchone()
    assert row == ("other", 2)  # the other worker's claim, untouched
    assert "given_back" not in runner.take_stats().counts.get(Queue.TRIAGE.value, {})
    assert runner._settler._take_owed() == []


def test_an_owed_give_back_is_written_before_the_next_claim(
    db: psycopg.Connection, proxy: OutageProxy
) -> None:
    """The database is back after the item's lease ran out: the dispatcher's next claim gives
    the item back first, so it claims it under the same attempt, not as a dead worker's."""
    runner, database, item = _abandoned_in_an_outage(db, proxy, "w")
    try:
        assert wait_until(lambda: _lease_expired(db, item.id), timeout=10)
        proxy.up()
        claimed = None
        for _ in range(60):  # (the pool reopens its connections within 5 s)
            with contextlib.suppress(DatabaseUnavailable):
                claimed = runner._claim_for_idle_slots()
                break
            threading.Event().wait(0.5)
        again = runner._handoff.get_nowait() if claimed == (1, 1) else None
    finally:
        database.close()
    assert claimed == (1, 1)
    assert again is not None and (again.id, again.attempt) == (item.id, 1)
    assert not again.took_over_lease
    assert runner.take_stats().counts[Queue.TRIAGE.value]["given_back"] == 1


def test_an_abandoned_retry_of_the_items_own_failure_is_not_given_back(
    db: psycopg.Connection, proxy: OutageProxy
) -> None:
    """The attempt failed for the item's own reason and its retry could not be written: the
    attempt counts, so nothing is owed and the lease is left to expire (as before)."""
    own = ItemError("the reply never validated (scripted)", backend="scripted")
    runner, database, item = _abandoned_in_an_outage(db, proxy, "w", own)
    try:
        proxy.up()
        assert wait_until(lambda: _lease_expired(db, item.id), timeout=10)
        assert runner._settler._take_owed() == []
    finally:
        database.close()
    row = db.execute("SELECT lease_owner, attempts FROM pending_triage").fetchone()
    assert row == ("w", 1)  # still leased (expired), its attempt counted
