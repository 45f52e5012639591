"""The runner in-process against a real PostgreSQL: every item reaches exactly one outcome."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import psycopg
from structlog.testing import capture_logs

from sokratos_worker.client import enqueue_triage
from sokratos_worker.config import Settings
from sokratos_worker.model import Effects, Item, NewMemory, Outcome, Queue
from sokratos_worker.runner import Runner
from sokratos_worker.spool import import_spool, spool_enqueue
from sokratos_worker.store.connection import Database
from tests.support.db import count, enqueue_many, outcomes
from tests.support.handlers import ScriptedHandler, fast_settings


def _settings(**overrides: object) -> Settings:
    return fast_settings(**{"concurrency": 4, **overrides})


def _drain(database_url: str, handler: ScriptedHandler, settings: Settings | None = None) -> Runner:
    database = Database(database_url, size=6)
    runner = Runner(
        settings=settings or _settings(),
        database=database,
        handlers={Queue.TRIAGE: handler, Queue.DISTILLATION: handler},
        worker_id="test",
    )
    runner.start(drain_only=True)
    assert runner.wait_drained(60)
    runner.shutdown(1)
    database.close()
    return runner


def test_mixed_items_each_reach_exactly_one_outcome(
    db: psycopg.Connection, database_url: str
) -> None:
    ok = enqueue_many(db, 40, prefix="ok")
    skip = enqueue_many(db, 10, behaviour="skip", prefix="skip")
    invalid = enqueue_many(db, 5, behaviour="invalid", prefix="inv")
    flaky = enqueue_many(db, 5, behaviour="fail_once", prefix="flaky")
    enqueue_many(db, 3, behaviour="fail", queue="pending_distillation", prefix="arch")
    handler = ScriptedHandler()
    # Retries back off 10-20 ms: drain repeatedly, as successive ticks would.
    for _ in range(10):
        _drain(database_url, handler)
        if not count(db, "SELECT count(*) FROM pending_triage") + count(
            db, "SELECT count(*) FROM pending_distillation"
        ):
            break
    got = outcomes(db)
    assert len(got) == 60 and count(db, "SELECT count(*) FROM work_outcomes") == 63
    assert {got[i] for i in ok} == {"saved"} and {got[i] for i in flaky} == {"saved"}
    assert {got[i] for i in skip} == {"skipped"}
    assert {got[i] for i in invalid} == {"failed"}
    assert set(outcomes(db, "pending_distillation").values()) == {"archived"}
    assert count(db, "SELECT count(*) FROM memories") == 40 + 5 + 3
    assert count(db, "SELECT count(*) FROM failed_operations") == 5 + 3
    # An invalid payload is not retried: one call each.
    assert count(db, "SELECT count(*) FROM failed_operations WHERE attempts = 1") == 5


def test_backends_unavailable_gives_the_attempt_back_and_pauses(
    db: psycopg.Connection, database_url: str
) -> None:
    enqueue_many(db, 3, behaviour="unavailable")
    handler = ScriptedHandler(probe_ok=False)
    database = Database(database_url, size=4)
    runner = Runner(
        settings=_settings(), database=database, handlers={Queue.TRIAGE: handler}, worker_id="w"
    )
    runner.start(drain_only=True, budget_s=1.0)
    runner.wait_drained(20)
    runner.shutdown(1)
    database.close()
    assert runner.state == "stopping"
    rows = db.execute("SELECT attempts, lease_owner FROM pending_triage").fetchall()
    assert len(rows) == 3 and all(r == (0, None) for r in rows)
    assert count(db, "SELECT count(*) FROM failed_operations") == 0
    # Claiming paused after the first give-back: not every item was tried.
    assert handler.calls <= 3


def test_item_whose_last_attempt_died_is_dead_lettered_without_running(
    db: psycopg.Connection, database_url: str
) -> None:
    enqueue_many(db, 1)
    db.execute(
        "UPDATE pending_triage SET attempts = 3, lease_owner = 'dead', lease_expires_at = now() - interval '1s'"
    )
    handler = ScriptedHandler()
    with capture_logs() as logs:
        _drain(database_url, handler)
    assert handler.calls == 0
    row = db.execute(
        "SELECT error_message, context_data->'payload'->>'exchange', id FROM failed_operations"
    ).fetchone()
    assert row is not None and row[0].endswith("worker died during the last attempt")
    assert row[1].startswith("user: item 0")
    # The log line names the row, and the exact command that replays it.
    [event] = [e for e in logs if e["event"] == "item_dead_lettered"]
    assert event["failure_id"] == row[2]
    assert f"'sokratos-worker failed retry {row[2]}'" in event["hint"]


def test_enqueue_while_postgres_is_down_is_spooled_and_imported_once(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    down = "postgresql://nobody@127.0.0.1:1/none?connect_timeout=1"
    result = enqueue_triage(
        down, "user: I adopted a cat\nassistant: lovely", key="cat", spool_dir=spool
    )
    assert result.item_id is None and result.spooled is not None and result.spooled.exists()
    # A crash after the import's commit and before the unlink leaves the file: import twice.
    copy = json.loads(result.spooled.read_text())
    database = Database(database_url, size=2)
    assert import_spool(spool, database) == 1
    (spool / "again.json").write_text(json.dumps(copy))
    assert import_spool(spool, database) == 1
    database.close()
    assert not list(spool.glob("*.json"))
    assert count(db, "SELECT count(*) FROM pending_triage WHERE idempotency_key = 'cat'") == 1


def test_bad_spool_file_becomes_a_failed_operation(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    spool_enqueue(spool, Queue.TRIAGE, {"exchange": 5}, idempotency_key="bad", source=None)
    database = Database(database_url, size=2)
    assert import_spool(spool, database) == 0
    database.close()
    row = db.execute(
        "SELECT op_type, error_message, context_data->'payload' FROM failed_operations"
    ).fetchone()
    assert row is not None and row[0] == "spool_import" and "payload.exchange" in row[1]
    assert row[2] == {"exchange": 5}
    assert not list(spool.glob("*.json"))


class _ReadingHandler:
    """Reads through the database while every other slot reads too (as the pipelines do)."""

    def __init__(self, database: Database, slots: int) -> None:
        self.database = database
        self.together = threading.Barrier(slots, timeout=3)
        self.seen: list[bool] = []  # per item: were all slots reading at once?

    def handle(self, item: Item) -> Effects:
        with self.database.connection() as conn:
            conn.execute("SELECT 1")
            try:
                self.together.wait()
                self.seen.append(True)
            except threading.BrokenBarrierError:
                self.seen.append(False)
        return Effects(Outcome.SKIPPED)

    def final_failure_memories(self, item: Item) -> tuple[NewMemory, ...]:
        return ()

    def probe(self) -> bool:
        return True


def test_a_slot_reads_through_its_own_connection(db: psycopg.Connection, database_url: str) -> None:
    """A pool with one connection per slot and one for the dispatcher is enough: the
    pipelines' reads used to take a second connection, so slots queued for the spare one."""
    slots = 4
    enqueue_many(db, slots * 3)
    database = Database(database_url, size=slots + 1, keep_open=slots + 1)
    handler = _ReadingHandler(database, slots)
    runner = Runner(
        settings=_settings(concurrency=slots),
        database=database,
        handlers={Queue.TRIAGE: handler},
        worker_id="test",
    )
    try:
        runner.start(drain_only=True)
        assert runner.wait_drained(60)
        runner.shutdown(1)
    finally:
        database.close()
    assert set(outcomes(db).values()) == {"skipped"} and len(outcomes(db)) == slots * 3
    assert handler.seen == [True] * (slots * 3), handler.seen
