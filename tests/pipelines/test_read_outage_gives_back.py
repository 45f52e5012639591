"""A database outage met by one of the pipelines' reads (the adaptive threshold, the
preferences, the contradiction candidates) gives the item's attempt back: it runs again once
the database is back, decided on what the database holds. Read through, it was decided for good
on a default (threshold 5 where the table said 3: a salience-4 exchange skipped)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest

from sokratos_worker.errors import DatabaseUnavailable, PoolBusy
from sokratos_worker.model import Outcome, Queue
from sokratos_worker.pipelines.triage import TriageHandler
from sokratos_worker.pipelines.write import MemoryWriter
from sokratos_worker.runner import Runner
from sokratos_worker.store.connection import Database
from sokratos_worker.store.memories import MemoryReader
from tests.pipelines.conftest import enqueue, make_item, outcome
from tests.pipelines.fakes import FakeChat, FakeEmbedder
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


def test_the_runner_gives_the_attempt_back_and_decides_once_the_database_answers(
    db: psycopg.Connection, database: Database
) -> None:
    _threshold_3(db)
    payload = json.dumps({"exchange": EXCHANGE})
    item_id = enqueue(db, "SELECT sokratos_enqueue_triage(%s::jsonb)", payload)
    chat = FakeChat().script("conversation_triage", VERDICT, VERDICT)
    runner = Runner(
        settings=fast_settings(concurrency=1),
        database=database,
        handlers={Queue.TRIAGE: _handler(FirstReadMeetsAnOutage(database), chat)},
        worker_id="test",
    )
    runner.start(drain_only=True)
    assert runner.wait_drained(60)
    runner.shutdown(5)
    stats = runner.take_stats().counts[Queue.TRIAGE]
    assert stats["given_back"] == 1, stats
    kind, memory_ids, detail = outcome(db, "pending_triage", item_id)
    assert kind == "saved" and len(memory_ids) == 1, (kind, detail)
    assert "threshold 3" in detail, detail
    attempts = db.execute(
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


def test_a_read_the_database_answered_is_not_given_back(
    db: psycopg.Connection, database: Database
) -> None:
    """A full pool (or a lock) is the database answering: given back, the item would be
    claimed again at once and meet it again, for ever (found in review). The read falls back
    as before, and the item is decided."""
    chat = FakeChat().script("conversation_triage", VERDICT)
    effects = _handler(FirstReadFindsThePoolFull(database), chat).handle(
        make_item({"exchange": EXCHANGE})
    )
    assert effects.outcome is Outcome.SKIPPED  # (salience 4 under the default threshold 5)
