"""A queue whose claims the server refuses (a privilege revoked on one table) is tracked on
its own: the worker waits, saying so once, while the other queue's items flow; the wait ends
only when a claim from that queue goes through; the refused queue is asked again every few
seconds, not at every pass and settle.

Before (noted as left on 2026-12-06): the state, /readyz and sokratos_database_up flapped
between waiting and running with every contact of the other queue, and the dispatcher's pass
stopped at the refused queue.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import psycopg
import structlog
from structlog.testing import capture_logs

from sokratos_worker.errors import ClaimRefused, DatabaseUnavailable
from sokratos_worker.model import Effects, NewMemory, Outcome, Queue
from sokratos_worker.runner import REFUSED_CLAIM_RETRY_S, Runner
from sokratos_worker.store import queue as store
from sokratos_worker.store.connection import Database
from sokratos_worker.worker_state import State, WorkerState
from tests.support.daemon import wait_until
from tests.support.db import count, enqueue_many
from tests.support.handlers import ScriptedHandler, fast_settings

# Each refusal takes a number from a sequence first (a sequence is not rolled back).
REFUSE_DISTILLATION_CLAIMS = """
    CREATE SEQUENCE claim_refusals;
    CREATE FUNCTION refuse_claims() RETURNS trigger LANGUAGE plpgsql AS
    $$BEGIN PERFORM nextval('claim_refusals');
            RAISE EXCEPTION 'permission denied for table pending_distillation'
            USING ERRCODE = '42501'; END$$;
    CREATE TRIGGER refuse_claims BEFORE UPDATE ON pending_distillation
    FOR EACH ROW EXECUTE FUNCTION refuse_claims()
"""


def _refusals(db: psycopg.Connection) -> int:
    row = db.execute(
        "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM claim_refusals"
    ).fetchone()
    assert row is not None
    return int(row[0])


def _two_queue_runner(
    database_url: str,
    *,
    concurrency: int = 2,
    on_state: Callable[[str, str], None] | None = None,
) -> tuple[Runner, Database]:
    """A runner of both queues over its own pool (closed by the test)."""
    database = Database(database_url, size=5)
    runner = Runner(
        settings=fast_settings(concurrency=concurrency),
        database=database,
        handlers={Queue.TRIAGE: ScriptedHandler(), Queue.DISTILLATION: ScriptedHandler()},
        worker_id="w",
        on_state=on_state,
    )
    return runner, database


def test_one_queue_refused_keeps_the_worker_waiting_while_the_other_flows(
    db: psycopg.Connection, database_url: str
) -> None:
    db.execute(REFUSE_DISTILLATION_CLAIMS)
    enqueue_many(db, 2, queue="pending_distillation")
    states: list[str] = []
    lock = threading.Lock()

    def on_state(state: str, detail: str) -> None:
        with lock:
            states.append(state)

    runner, database = _two_queue_runner(database_url, concurrency=3, on_state=on_state)
    with capture_logs() as logs:
        runner.start()
        try:
            assert wait_until(lambda: runner.state == State.WAITING_FOR_DATABASE, timeout=30)
            assert "permission denied for table pending_distillation" in runner.state_detail
            # The triage queue flows meanwhile: 60 items over a few seconds of settles and
            # dispatcher passes, each of which used to end the wait.
            started = time.monotonic()
            asked_before = _refusals(db)
            for round_ in range(6):
                enqueue_many(db, 10, behaviour="sleep:0.05", prefix=f"r{round_}-")
                time.sleep(0.5)
            saved = "SELECT count(*) FROM work_outcomes WHERE queue = 'pending_triage'"
            assert wait_until(lambda: count(db, saved) == 60, timeout=60)
            asked = _refusals(db) - asked_before
            elapsed = time.monotonic() - started
            with lock:
                assert states == [State.WAITING_FOR_DATABASE], states  # no flapping
            # Asked again every REFUSED_CLAIM_RETRY_S (by a pass or a settle), not per item.
            assert asked <= elapsed / REFUSED_CLAIM_RETRY_S + 2, (asked, elapsed)
            db.execute("DROP TRIGGER refuse_claims ON pending_distillation")
            distilled = "SELECT count(*) FROM work_outcomes WHERE queue = 'pending_distillation'"
            assert wait_until(lambda: count(db, distilled) == 2, timeout=30)
            assert wait_until(lambda: runner.state == State.RUNNING, timeout=10), states
        finally:
            runner.shutdown(5)
            database.close()
    events = [e["event"] for e in logs]
    assert events.count("waiting_for_database") == 1, events
    assert events.count("claims_accepted_again") == 1, events
    (said,) = [e for e in logs if e["event"] == "waiting_for_database"]
    assert said["queue"] == "pending_distillation"
    assert "sql/roles.sql" in said["hint"]
    # Nothing lost, nothing doubled, no attempt spent on the refusal.
    assert count(db, "SELECT count(*) FROM work_outcomes") == 62
    assert count(db, "SELECT count(*) FROM failed_operations") == 0
    assert count(db, "SELECT count(*) FROM pending_triage") == 0
    assert count(db, "SELECT count(*) FROM pending_distillation") == 0
    assert count(db, "SELECT max(attempts) FROM work_outcomes") == 1




def test_a_fenced_settle_does_not_end_a_refusal_its_claim_never_tested(
    db: psycopg.Connection, database_url: str
) -> None:
    """A settle with memories whose lease another worker took is fenced before its claim of
    the next item runs: it said the refused queue accepted again, and the next pass said the
    refusal anew (the flap, found by a review)."""
    db.execute(REFUSE_DISTILLATION_CLAIMS)
    enqueue_many(db, 1, queue="pending_distillation")
    runner, database = _two_queue_runner(database_url)
    try:
        with capture_logs() as logs:
            runner._claim_for_idle_slots()  # the dispatcher's pass: distillation refused
            assert runner.state == State.WAITING_FOR_DATABASE
            enqueue_many(db, 1)
            (ours,) = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
            db.execute("UPDATE pending_triage SET lease_expires_at = now() - interval '1 s'")
            store.claim(db, Queue.TRIAGE, owner="other", limit=1, lease_s=60)
            effects = Effects(
                Outcome.SAVED,
                memories=(NewMemory(origin=ours.origin(0), summary="m", salience=5),),
            )
            done = runner._settler.write_success(
                ours, effects, structlog.get_logger(), claim_from=Queue.DISTILLATION
            )
            assert done is not None and not done[0].settled
            assert runner.state == State.WAITING_FOR_DATABASE
            assert runner._worker_state.refused_queues() == {Queue.DISTILLATION}
    finally:
        database.close()
    assert [e["event"] for e in logs if e["event"] == "claims_accepted_again"] == []


def test_the_first_refusal_waits_its_retry_interval_too(
    db: psycopg.Connection, database_url: str
) -> None:
    """The first refusal set no retry time: the dispatcher asked again ~10 ms later."""
    db.execute(REFUSE_DISTILLATION_CLAIMS)
    enqueue_many(db, 1, queue="pending_distillation")
    runner, database = _two_queue_runner(database_url)
    runner.start()
    try:
        assert wait_until(lambda: _refusals(db) >= 1, timeout=30)
        time.sleep(REFUSED_CLAIM_RETRY_S / 2)
        assert _refusals(db) == 1
    finally:
        runner.shutdown(2)
        database.close()


def test_an_outage_during_a_refusal_is_what_the_state_names() -> None:
    """Waiting for a refused queue when the database went away: the detail kept naming the
    refusal through the outage (found by a review); after the outage, the refusal again."""
    reports: list[tuple[str, str]] = []
    state = WorkerState(
        handlers=[],
        stopping=threading.Event(),
        progress=lambda: None,
        wake=lambda: None,
        on_state=lambda s, d: reports.append((s, d)),
        on_database_contact=lambda reached: None,
    )
    refusal = "the database refuses the claim: permission denied (SQLSTATE 42501)"
    state.claim_refused(Queue.DISTILLATION, ClaimRefused(refusal))
    state.database_lost(DatabaseUnavailable("database unavailable: connection refused"))
    assert (state.state, state.detail) == (
        State.WAITING_FOR_DATABASE,
        "database unavailable: connection refused",
    )
    state.database_back()
    assert (state.state, state.detail) == (State.WAITING_FOR_DATABASE, refusal)
    state.claim_accepted(Queue.DISTILLATION)
    assert (state.state, state.detail) == (State.RUNNING, "")
