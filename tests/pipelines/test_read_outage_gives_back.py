"""A database outage met by one of the pipelines' reads (the adaptive threshold, the
preferences, the contradiction candidates) is raised, and gives the item's attempt back when a
probe right after finds the database away: it runs again once the database is back, decided on
what the database holds. Read through, it was decided for good on a default (threshold 5 where
the table said 3: a salience-4 exchange skipped). (An error the probe does not confirm is the
item's attempt: test_read_failure_is_the_items_attempt.)"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psycopg
import pytest

from sokratos_worker.errors import DatabaseUnavailable, PoolBusy
from sokratos_worker.model import Queue
from sokratos_worker.pipelines.triage import TriageHandler
from sokratos_worker.pipelines.write import MemoryWriter
from sokratos_worker.runner import Runner
from sokratos_worker.store.connection import Database
from sokratos_worker.store.memories import MemoryReader
from tests.pipelines.conftest import enqueue, make_item, outcome
from tests.pipelines.fakes import FakeChat, FakeEmbedder
from tests.support.daemon import wait_until
from tests.support.handlers import fast_settings

pytestmark = pytest.mark.postgres

EXCHANGE = "user: I think I'd like to learn the cello one day\nassistant: Nice idea!"
VERDICT = {
    "salience_score": 4,
    "summary": "The user would like to learn the cello.",
    "category": "hobby",
    "tags": ["music"],
    "save": True,
    "paradigm_shift": False,
}


class FirstReadMeetsAnOutage:
    """The real database, except that its first connection() meets an outage (a restart)."""

    def __init__(self, real: Database) -> None:
        self.real = real
        self.calls = itertools.count(1)

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection]:
        if next(self.calls) == 1:
            raise DatabaseUnavailable("database unavailable: server closed the connection")
        with self.real.connection() as conn:
            yield conn


def _handler(database: object, chat: FakeChat) -> TriageHandler:
    embedder = FakeEmbedder()
    reader = MemoryReader(database, embedding_model=embedder.model)  # type: ignore[arg-type]
    return TriageHandler(reader, MemoryWriter(reader, chat, embedder), chat, embedder)


def _threshold_3(db: psycopg.Connection) -> None:
    db.execute(
        "INSERT INTO adaptive_params (key, value, source)"
        " VALUES ('triage_conversation_unverified_threshold', 3.0, 'reflection')"
    )


def test_a_read_that_meets_an_outage_raises_instead_of_deciding_on_a_default(
    db: psycopg.Connection, database: Database
) -> None:
    _threshold_3(db)
    chat = FakeChat().script("conversation_triage", VERDICT)
    with pytest.raises(DatabaseUnavailable):
        _handler(FirstReadMeetsAnOutage(database), chat).handle(make_item({"exchange": EXCHANGE}))


# Longer than the read's and the probe's waits for a pooled connection (5 s each): the
# probe right after the read meets the server still down.
DOWN_S = 12.0


def _answers(database_url: str) -> bool:
    try:
        with psycopg.connect(database_url, connect_timeout=1):
            return True
    except psycopg.OperationalError:
        return False


class FirstReadStopsTheServer:
    """The real database; its first connection() stops PostgreSQL (started again ``DOWN_S``
    later) and meets the outage for real."""

    def __init__(
        self, real: Database, database_url: str, restart: Callable[[float], None]
    ) -> None:
        self.real = real
        self.url = database_url
        self.restarting = threading.Thread(target=restart, args=(DOWN_S,), daemon=True)

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection]:
        if self.restarting.ident is None:  # (the first read only)
            self.restarting.start()
            assert wait_until(lambda: not _answers(self.url), timeout=20)
        with self.real.connection() as conn:
            yield conn


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_runner_gives_the_attempt_back_and_decides_once_the_database_answers(
    db: psycopg.Connection,
    database: Database,
    database_url: str,
    restart_postgres: Callable[[float], None],
) -> None:
    _threshold_3(db)
    payload = json.dumps({"exchange": EXCHANGE})
    item_id = enqueue(db, "SELECT sokratos_enqueue_triage(%s::jsonb)", payload)
    db.close()  # (the restart ends it)
    chat = FakeChat().script("conversation_triage", VERDICT, VERDICT)
    reads = FirstReadStopsTheServer(database, database_url, restart_postgres)
    runner = Runner(
        settings=fast_settings(concurrency=1, lease=60),
        database=database,
        handlers={Queue.TRIAGE: _handler(reads, chat)},
        worker_id="test",
    )
    runner.start(drain_only=True)
    try:
        assert runner.wait_drained(90)
    finally:
        runner.shutdown(5)
        reads.restarting.join(60)
    stats = runner.take_stats().counts[Queue.TRIAGE]
    assert stats["given_back"] == 1 and "retried" not in stats, stats
    with psycopg.connect(database_url, autocommit=True) as again:
        kind, memory_ids, detail = outcome(again, "pending_triage", item_id)
        assert kind == "saved" and len(memory_ids) == 1, (kind, detail)
        assert "threshold 3" in detail, detail
        attempts = again.execute(
            "SELECT attempts FROM work_outcomes WHERE queue = 'pending_triage' AND item_id = %s",
            (item_id,),
        ).fetchone()
    assert attempts == (1,)  # the outage's attempt was given back


class FirstReadFindsThePoolFull(FirstReadMeetsAnOutage):
    """The database answers, but the pool has no connection to spare (PoolBusy)."""

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection]:
        if next(self.calls) == 1:
            raise PoolBusy("no pooled connection free within 5 s")
        with self.real.connection() as conn:
            yield conn


def test_a_read_that_finds_the_pool_full_raises_too_instead_of_deciding_on_a_default(
    db: psycopg.Connection, database: Database
) -> None:
    """A full pool (or a lock) is the database answering: no outage, but no answer to decide
    on either. It is raised (the settle counts it as the item's attempt, not probing: given
    back, the item would be claimed again at once and meet it again, for ever); read through,
    a salience-4 exchange was SKIPPED under the default threshold 5 where the table said 3."""
    _threshold_3(db)
    chat = FakeChat().script("conversation_triage", VERDICT)
    with pytest.raises(PoolBusy):
        _handler(FirstReadFindsThePoolFull(database), chat).handle(
            make_item({"exchange": EXCHANGE})
        )
