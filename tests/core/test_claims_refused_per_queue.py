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

import psycopg
from structlog.testing import capture_logs

from sokratos_worker.model import Queue
from sokratos_worker.runner import REFUSED_CLAIM_RETRY_S, Runner
from sokratos_worker.store.connection import Database
from sokratos_worker.worker_state import State
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

    database = Database(database_url, size=5)
    runner = Runner(
        settings=fast_settings(concurrency=3),
        database=database,
        handlers={Queue.TRIAGE: ScriptedHandler(), Queue.DISTILLATION: ScriptedHandler()},
        worker_id="refused-one",
        on_state=on_state,
    )
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
