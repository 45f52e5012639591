"""The runner in-process against a real PostgreSQL: every item reaches exactly one outcome."""

from __future__ import annotations

import json
import threading
import time
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
    with capture_logs() as logs:
        runner.start(drain_only=True, budget_s=1.0)
        assert runner.wait_drained(20)
        runner.shutdown(1)
    database.close()
    assert runner.state == "stopping"
    rows = db.execute("SELECT attempts, lease_owner FROM pending_triage").fetchall()
    assert len(rows) == 3 and all(r == (0, None) for r in rows)
    assert count(db, "SELECT count(*) FROM failed_operations") == 0
    # Items were tried (a runner that claimed nothing would leave the rows just so), and
    # claiming paused after the first give-back: none was claimed again, the drain ended paused.
    assert 1 <= handler.calls <= 3, handler.calls
    events = [e["event"] for e in logs]
    assert events.count("claiming_paused") == 1 and "drain_ended_paused" in events, events
    assert "tick_budget_spent" not in events, events


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


def test_a_worker_died_dead_letter_records_the_attempt_that_died(
    db: psycopg.Connection, database_url: str
) -> None:
    # durability.md: the claim that finds the last attempt dead is not an attempt ('—'); it
    # used to record 4 attempts with MAX_ATTEMPTS 3, and no history entry for the one that died.
    enqueue_many(db, 1)
    db.execute(
        "UPDATE pending_triage SET attempts = 3, lease_owner = 'dead',"
        " lease_expires_at = now() - interval '1 s'"
    )
    _drain(database_url, ScriptedHandler(), _settings(max_attempts=3))
    row = db.execute("SELECT attempts, context_data->'attempts' FROM failed_operations").fetchone()
    assert row is not None
    attempts, history = row
    assert attempts == 3 and count(db, "SELECT attempts FROM work_outcomes") == 3
    # (Recorded by the claim that found it dead, naming the worker whose lease expired.)
    assert [(a["attempt"], a["error"]) for a in history] == [
        (3, "worker died during the attempt (its lease, held by dead, expired)")
    ]
    assert "at" in history[0]


def _nest(depth: int) -> str:
    return "[" * depth + "]" * depth


def _insert_nested(db: psycopg.Connection, depth: int) -> int:
    row = db.execute(
        "INSERT INTO pending_triage (payload) VALUES (%s::jsonb) RETURNING id",
        ('{"behaviour": "invalid", "x": ' + _nest(depth) + "}",),
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_an_item_nested_near_pythons_limit_still_reaches_one_outcome(
    db: psycopg.Connection, database_url: str
) -> None:
    # json.loads reads these, but json.dumps could not write the dead letter's context around
    # them (RecursionError): the item stayed leased and was never settled.
    ids = {_insert_nested(db, depth): depth for depth in range(940, 1000, 2)}
    _drain(database_url, ScriptedHandler(), _settings(max_attempts=1))
    left = db.execute("SELECT id, attempts, lease_owner FROM pending_triage ORDER BY id").fetchall()
    assert not [(ids[i], attempts, owner) for i, attempts, owner in left]
    assert count(db, "SELECT count(DISTINCT item_id) FROM work_outcomes") == len(ids)
    assert count(db, "SELECT count(*) FROM failed_operations") == len(ids)
    kept_as_text = count(
        db,
        "SELECT count(*) FROM failed_operations WHERE context_data->'payload' ? '__unparsable_json__'",
    )
    assert kept_as_text > 0  # those Python cannot write back keep their text


def test_a_deep_item_whose_dead_letter_failed_no_longer_loops_in_a_running_worker(
    db: psycopg.Connection, database_url: str
) -> None:
    # Every lease expiry claimed it again and the 'worker died' dead letter failed the same way.
    for depth in (976, 978, 980):
        _insert_nested(db, depth)
    database = Database(database_url, size=4)
    runner = Runner(
        settings=_settings(max_attempts=1, lease=1.5, concurrency=3),
        database=database,
        handlers={Queue.TRIAGE: ScriptedHandler()},
        worker_id="test",
    )
    runner.start()
    started = time.monotonic()
    while count(db, "SELECT count(*) FROM pending_triage") and time.monotonic() - started < 9:
        time.sleep(0.05)
    runner.request_stop()
    runner.shutdown(1)
    database.close()
    assert db.execute("SELECT id, attempts FROM pending_triage").fetchall() == []
    assert count(db, "SELECT count(*) FROM work_outcomes WHERE outcome = 'failed'") == 3


def test_run_once_budget_also_stops_slots_claiming_their_next_item(
    db: psycopg.Connection, database_url: str
) -> None:
    # contract: SOKRATOS_TICK_BUDGET is the longest one tick drains. The slots went on claiming
    # their next item in each settle after the dispatcher had stopped at the budget.
    enqueue_many(db, 400, behaviour="sleep:0.05")
    database = Database(database_url, size=4)
    runner = Runner(
        settings=_settings(concurrency=1, shutdown_grace=4),
        database=database,
        handlers={Queue.TRIAGE: ScriptedHandler()},
        worker_id="test",
    )
    started = time.monotonic()
    runner.start(drain_only=True, budget_s=1.0)
    assert runner.wait_drained(60)
    drained_s = time.monotonic() - started
    runner.shutdown(4)
    database.close()
    claimed = count(db, "SELECT count(*) FROM work_outcomes") + count(
        db, "SELECT count(*) FROM pending_triage WHERE attempts > 0"
    )
    # ~20 items fit in 1 s at 50 ms each; the one in flight at the budget may finish. Slots
    # claiming past the budget keep one item in flight until the drain's deadline (the grace
    # + 5 s = 9 s): ~200 claimed. Bounds generous for a loaded machine.
    assert drained_s < 8.0 and claimed < 40, (round(drained_s, 1), claimed)


def test_a_slot_freed_by_a_failure_claims_again_without_waiting(
    db: psycopg.Connection, database_url: str
) -> None:
    # A retry, give-back or dead letter claims nothing with its settle (only a success does),
    # and nothing woke the dispatcher: the backlog waited up to 5 s per batch.
    enqueue_many(db, 8, behaviour="invalid")
    database = Database(database_url, size=4)
    runner = Runner(
        settings=_settings(concurrency=2),
        database=database,
        handlers={Queue.TRIAGE: ScriptedHandler()},
        worker_id="test",
    )
    started = time.monotonic()
    runner.start()
    while count(db, "SELECT count(*) FROM pending_triage") and time.monotonic() - started < 30:
        time.sleep(0.05)
    took = time.monotonic() - started
    runner.request_stop()
    runner.shutdown(1)
    database.close()
    assert not count(db, "SELECT count(*) FROM pending_triage")
    assert count(db, "SELECT count(*) FROM failed_operations") == 8
    # Waiting for the dispatcher's idle timeout, the 3 batches after the first took 5 s each
    # (15 s); generous for a loaded machine.
    assert took < 8.0, f"8 instant dead letters on 2 slots took {took:.1f} s"


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


def test_items_released_at_the_stop_are_reported_to_on_item_done_as_the_ticks_count_them(
    db: psycopg.Connection, database_url: str
) -> None:
    """Items still running at the end of the grace are released (attempt given back): the
    tick counts had them as given_back, but sokratos_items_total{outcome="released"}, fed by
    on_item_done, counted only the slots' own give-backs (found by an observability hunt)."""
    enqueue_many(db, 2, behaviour="sleep:3")
    done: list[tuple[Queue, str, float | None]] = []
    states: list[tuple[str, str]] = []
    database = Database(database_url, size=4)
    runner = Runner(
        settings=_settings(concurrency=2, shutdown_grace=1),
        database=database,
        handlers={Queue.TRIAGE: ScriptedHandler()},
        worker_id="released",
        on_item_done=lambda queue, how, seconds: done.append((queue, how, seconds)),
        on_state=lambda state, detail: states.append((state, detail)),
    )
    runner.start()
    try:
        deadline = time.monotonic() + 30
        while runner.inflight_count() < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert runner.shutdown(0.5) == 2
    finally:
        database.close()
    given_back = runner.take_stats().counts[Queue.TRIAGE]["given_back"]
    released = [(q, how, s) for q, how, s in done if how == "released"]
    assert released == [(Queue.TRIAGE, "released", None)] * given_back, done
    assert count(db, "SELECT count(*) FROM pending_triage WHERE attempts = 0") == 2
    # STATUS= keeps what the stop does (a bare "stopping" replaced the stop's own line).
    assert ("stopping", "finishing 2 items in flight") in states, states
