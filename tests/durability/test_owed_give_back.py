"""A pipeline read that meets a database outage longer than 0.8 x SOKRATOS_LEASE costs the item
no attempt: the give-back its settle could not write is owed, and written when this process
claims the item again (its own claim taking over the lease it held), before the attempt limit
is checked. Another worker's claim, or a process restarted after kill -9, still counts.

Found by reading (owed hunt, 2026-12-07): the abandoned give-back left the item leased, its
lease expired while the database was away, and this worker's next claim took it over as a dead
worker's, counting the attempt again; on the item's last attempt that claim dead-lettered it
into failed_operations as "worker died during the last attempt", though no worker died and
nothing was the item's fault. (An earlier fix, 5923a75, wrote owed give-backs before every
claim and was reverted; this one writes each at the item's own claim, fenced in SQL by the
claim's history entry naming this worker's lease.)

Real parts: PostgreSQL behind a TCP proxy that cuts every connection and refuses new ones for
the outage (as a restart or a dropped route does); the runner in-process.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import psycopg
import pytest
import structlog
from structlog.testing import capture_logs

from sokratos_worker.errors import DatabaseUnavailable
from sokratos_worker.model import Effects, Item, NewMemory, Outcome, Queue
from sokratos_worker.runner import Runner
from sokratos_worker.settle import ABANDONED, WORKER_DIED
from sokratos_worker.store import queue as store
from sokratos_worker.store.connection import Database
from tests.support.daemon import wait_until
from tests.support.db import count, enqueue_many
from tests.support.handlers import ScriptedHandler, fast_settings
from tests.support.tcp_proxy import upstream_of, url_through

pytestmark = pytest.mark.postgres

LEASE_S = 3.0  # a settle is given up after 2.4 s; the pool's checkout waits 5 s
ITEMS = 3


class OutageProxy:
    """Forwards 127.0.0.1:<port> to the server of ``url``. ``down()`` cuts every connection
    through it and closes new ones at once (the server gone); ``up()`` forwards again."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._target = upstream_of(url)
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.1)
        self._down = threading.Event()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return url_through(self._url, self._server.getsockname()[1])

    def down(self) -> None:
        self._down.set()
        self._cut_all()

    def up(self) -> None:
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
                # A connection accepted as down() came: cut_all may have run before it was
                # listed here, and it must not outlive the outage (a pool opening slowly on a
                # busy machine kept one, and the give-back went through).
                if self._down.is_set():
                    client.close()
                    upstream.close()
                    continue
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


class ReadMeetsTheOutageOnItsFirstRun:
    """Each item's first run reads through the worker's pool as the database goes away (all
    ``items`` running at once; the last to arrive cuts the proxy), a pipeline read meeting
    the outage; its later runs skip."""

    def __init__(self, proxy: OutageProxy, database: Database, items: int) -> None:
        self.proxy = proxy
        self.database = database
        self.all_running = threading.Barrier(items, timeout=30)
        self.runs: list[tuple[int, int]] = []  # (item id, attempt)
        self._lock = threading.Lock()

    def handle(self, item: Item) -> Effects:
        with self._lock:
            first = item.id not in {i for i, _ in self.runs}
            self.runs.append((item.id, item.attempt))
        if first:
            if self.all_running.wait() == 0:
                self.proxy.down()
            self.all_running.wait()  # (every read below meets the outage)
            with self.database.connection() as conn:
                conn.execute("SELECT 1")  # raises DatabaseUnavailable: the outage
        return Effects(Outcome.SKIPPED, detail="run once the database answered")

    def final_failure_memories(self, item: Item) -> tuple[NewMemory, ...]:
        return ()

    def probe(self) -> bool:
        return True


def _expired(db: psycopg.Connection) -> int:
    return count(
        db,
        "SELECT count(*) FROM pending_triage WHERE lease_owner IS NOT NULL"
        " AND lease_expires_at < now()",
    )


@pytest.mark.timeout(120)
def test_a_read_outage_past_the_lease_on_the_last_attempt_costs_no_attempt(
    db: psycopg.Connection, proxy: OutageProxy
) -> None:
    """Three items on their last attempt (3 of 3) run at once; their reads meet an outage that
    outlasts 0.8 x lease and the lease itself; then the database is back. Each runs again under
    attempt 3 and ends in one outcome, none in failed_operations as a worker that died."""
    ids = enqueue_many(db, ITEMS, prefix="owed")
    db.execute("UPDATE pending_triage SET attempts = 2")
    database = Database(proxy.url, size=ITEMS + 4)
    handler = ReadMeetsTheOutageOnItsFirstRun(proxy, database, ITEMS)
    done: list[str] = []
    runner = Runner(
        settings=fast_settings(concurrency=ITEMS, lease=LEASE_S, max_attempts=3),
        database=database,
        handlers={Queue.TRIAGE: handler},
        worker_id="owed-worker",
        on_item_done=lambda _q, how, _s: done.append(how),
    )
    runner.start()
    try:
        # Every first run's give-back is given up (the item stays leased) ...
        assert wait_until(lambda: done.count(ABANDONED) == ITEMS, timeout=40), done
        # ... and the leases run out while the database is still away.
        assert wait_until(lambda: _expired(db) == ITEMS, timeout=30)
        proxy.up()
        ended = wait_until(
            lambda: count(db, "SELECT count(*) FROM work_outcomes") >= ITEMS, timeout=60
        )
    finally:
        runner.shutdown(2)
        database.close()
    failed = db.execute("SELECT error_message FROM failed_operations").fetchall()
    assert not any(WORKER_DIED in str(row[0]) for row in failed), failed
    assert ended, f"outcomes missing; runs: {handler.runs}, endings: {done}"
    # ITEMS in, ITEMS outcomes out, each under its last attempt (not doubled), no dead letter.
    assert failed == []
    rows = db.execute("SELECT item_id, outcome, attempts FROM work_outcomes").fetchall()
    assert sorted(rows) == [(i, "skipped", 3) for i in ids]
    assert count(db, "SELECT count(*) FROM pending_triage") == 0
    assert sorted(handler.runs) == sorted([(i, 3) for i in ids] * 2)
    assert sorted(done) == sorted([ABANDONED, "skipped"] * ITEMS)
    counts = runner.take_stats().counts[Queue.TRIAGE.value]
    assert (counts["claimed"], counts["given_back"], counts["skipped"]) == (2 * ITEMS, ITEMS, ITEMS)


def test_an_owed_give_back_never_uncounts_another_workers_attempt(
    db: psycopg.Connection, database_url: str
) -> None:
    """This worker owes attempt 1 (its give-back, in truth, landed: only its answer was lost);
    another worker claimed the item as attempt 1 and died; this worker's claim that takes that
    lease over counts attempt 2 and must keep it: the claim's history entry names the other
    worker's lease, not this one's, so the owed give-back is dropped, not written."""
    [item_id] = enqueue_many(db, 1, prefix="fenced")
    database = Database(database_url, size=4)
    handler = ScriptedHandler()
    runner = Runner(
        settings=fast_settings(concurrency=1, lease=LEASE_S),
        database=database,
        handlers={Queue.TRIAGE: handler},
        worker_id="owed-worker",
    )
    [ours] = store.claim(db, Queue.TRIAGE, owner="owed-worker", limit=1, lease_s=60)
    runner._settler._owe_give_back(ours, owed=True)  # (as an abandoned give-back does)
    assert store.give_back(db, ours, owner="owed-worker")  # (it landed after all)
    [theirs] = store.claim(db, Queue.TRIAGE, owner="died", limit=1, lease_s=1)
    assert (theirs.id, theirs.attempt) == (item_id, 1)
    assert wait_until(lambda: _expired(db) == 1, timeout=10)
    try:
        with capture_logs() as logs:
            runner.start(drain_only=True, budget_s=10)
            assert runner.wait_drained(30)
            runner.shutdown(2)
    finally:
        database.close()
    assert "owed_give_back_fenced" in [e["event"] for e in logs], logs
    assert "owed_give_back_written" not in [e["event"] for e in logs], logs
    assert db.execute("SELECT outcome, attempts FROM work_outcomes").fetchall() == [("saved", 2)]
    assert count(db, "SELECT count(*) FROM failed_operations") == 0
    assert "given_back" not in runner.take_stats().counts[Queue.TRIAGE.value]


@pytest.mark.timeout(120)
def test_an_owed_item_claimed_by_a_settle_runs_under_the_same_attempt(
    db: psycopg.Connection, proxy: OutageProxy
) -> None:
    """The owed item is claimed again not by the dispatcher but with another item's settle
    (one slot, busy with that item when the lease runs out): the give-back is written all the
    same, and the item, on its last attempt, is saved, not dead-lettered."""
    [owed_id] = enqueue_many(db, 1, prefix="owed")
    [owed] = store.claim(db, Queue.TRIAGE, owner="owed-worker", limit=1, lease_s=60)
    [busy_id] = enqueue_many(db, 1, behaviour="sleep:6", prefix="busy")
    database = Database(proxy.url, size=4)
    runner = Runner(
        settings=fast_settings(concurrency=1, lease=LEASE_S, max_attempts=1),
        database=database,
        handlers={Queue.TRIAGE: ScriptedHandler()},
        worker_id="owed-worker",
    )
    try:
        # Its pipeline read met the outage and its give-back was given up (the item stays
        # leased to this worker) ...
        runner._track_claimed([owed])
        proxy.down()
        away = DatabaseUnavailable("database unavailable: server closed the connection")
        bound = structlog.get_logger().bind(item_id=owed.id)
        assert runner._settler.fail(owed, away, ScriptedHandler(), bound) == ABANDONED
        proxy.up()
        # ... and its lease runs out while the only slot runs the other item.
        db.execute(
            "UPDATE pending_triage SET lease_expires_at = now() + interval '2 s' WHERE id = %s",
            (owed_id,),
        )
        runner.start()
        ended = wait_until(lambda: count(db, "SELECT count(*) FROM work_outcomes") >= 2, timeout=60)
    finally:
        runner.shutdown(2)
        database.close()
    assert count(db, "SELECT count(*) FROM failed_operations") == 0
    assert ended
    rows = db.execute("SELECT item_id, outcome, attempts FROM work_outcomes").fetchall()
    assert sorted(rows) == [(owed_id, "saved", 1), (busy_id, "saved", 1)]
    counts = runner.take_stats().counts[Queue.TRIAGE.value]
    # (claimed: the owed item's first claim, tracked above, and the two of the run)
    assert (counts["claimed"], counts["given_back"], counts["saved"]) == (3, 1, 2), counts
