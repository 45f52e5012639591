"""The runner's state machine across a database outage and a backend pause, in the orders the
threads meet them (the dispatcher's claims, each slot's settles, the resume probe, the stop).

Each test drives the Runner's own WorkerState in the order its threads call it; the Runner is a
real one over a real database (nothing mocked but the order of events). A review found each
order wrong the day settles began to report outages (2026-12-05).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import psycopg
import pytest
from structlog.testing import capture_logs

from sokratos_worker.errors import DatabaseUnavailable
from sokratos_worker.model import Queue
from sokratos_worker.runner import Runner
from sokratos_worker.store.connection import Database
from sokratos_worker.worker_state import State
from tests.support.daemon import wait_until
from tests.support.db import count, enqueue_many
from tests.support.handlers import ScriptedHandler, fast_settings

AWAY = "connection failed: connection refused (is the server running?)"


MakeRunner = Callable[..., Runner]


@pytest.fixture
def make_runner(database_url: str) -> Iterator[MakeRunner]:
    databases: list[Database] = []

    def make(states: list[tuple[str, str]], *, probe_ok: bool) -> Runner:
        databases.append(Database(database_url, size=2))
        return Runner(
            settings=fast_settings(),
            database=databases[-1],
            handlers={Queue.TRIAGE: ScriptedHandler(probe_ok=probe_ok)},
            worker_id="states",
            on_state=lambda state, detail: states.append((state, detail)),
        )

    yield make
    for database in databases:
        database.close()


def test_a_settle_meeting_an_outage_during_a_backend_pause_does_not_end_the_pause(
    db: psycopg.Connection, make_runner: MakeRunner
) -> None:
    """Concurrency 2, the host's network drops: slot 1's model call fails (no backend: its
    attempt given back, claiming paused, NO_BACKEND); slot 2's settle then meets the database
    away (_with_database -> database_lost) and lands when it is back (database_back).

    The settle's outage must not overwrite NO_BACKEND, nor its end set RUNNING: the pause
    would be forgotten (paused() is false once paused_until passes), claiming would resume
    with no health probe while every backend is still down."""
    states: list[tuple[str, str]] = []
    runner = make_runner(states, probe_ok=False)
    worker_state = runner._worker_state
    worker_state.pause("no LLM backend reachable")  # slot 1, after its give-back landed
    worker_state.database_lost(DatabaseUnavailable(AWAY))  # slot 2's settle meets the outage
    worker_state.database_back()  # slot 2's settle retry lands
    assert runner.state == State.NO_BACKEND, states
    worker_state.paused_until = 0.0  # the pause's first 5 s are over
    assert worker_state.paused(), "claiming resumed without a health probe"


def test_a_resume_during_an_outage_leaves_the_state_waiting_for_the_database(
    db: psycopg.Connection, make_runner: MakeRunner
) -> None:
    """The host running PostgreSQL and the model server reboots: a claim meets the database
    away (WAITING_FOR_DATABASE), an item in flight fails for want of a backend (NO_BACKEND),
    the model server comes back first and the resume probe succeeds (RUNNING,
    claiming_resumed) while PostgreSQL is still away: every later claim fails.

    The runner must not say 'running' (sd_notify STATUS, worker_state metric, `status`) for
    the rest of the outage."""
    states: list[tuple[str, str]] = []
    runner = make_runner(states, probe_ok=True)
    worker_state = runner._worker_state
    worker_state.database_lost(DatabaseUnavailable(AWAY))  # the dispatcher's claim
    worker_state.pause("no LLM backend reachable")  # an item's give-back (its settle abandoned)
    worker_state.paused_until = 0.0
    worker_state.maybe_resume()  # the probe succeeds: claiming resumed
    worker_state.database_lost(DatabaseUnavailable(AWAY))  # the next claim: still away
    assert runner.state == State.WAITING_FOR_DATABASE, states


def test_an_outage_ending_while_it_is_being_said_does_not_leave_the_runner_waiting(
    db: psycopg.Connection, make_runner: MakeRunner
) -> None:
    """The dispatcher's claim times out on the pool (DatabaseUnavailable) just as a slot's
    settle, on a connection it already had, succeeds. Had database_lost marked the outage
    and set WAITING_FOR_DATABASE in two steps, the settle's database_back in between would
    leave the state waiting with no outage marked, for good: /readyz 503 on a healthy worker.
    (Marked and set under one lock now, the window is gone; the wrapper stays as a guard.)"""
    states: list[tuple[str, str]] = []
    runner = make_runner(states, probe_ok=True)
    worker_state = runner._worker_state
    set_state = worker_state.set

    def settle_lands_in_between(state: str, detail: str) -> None:
        if state == State.WAITING_FOR_DATABASE:
            worker_state.database_back()  # the other thread's settle, in the window
        set_state(state, detail)

    worker_state.set = settle_lands_in_between  # type: ignore[method-assign]
    worker_state.database_lost(DatabaseUnavailable(AWAY))
    worker_state.set = set_state  # type: ignore[method-assign]
    # The database answers from now on: the next claims and settles land.
    worker_state.database_back()
    runner._claimed_without_error(1)
    assert runner.state == State.RUNNING, states


def test_a_settle_meeting_an_outage_during_shutdown_does_not_report_running(
    db: psycopg.Connection, make_runner: MakeRunner
) -> None:
    """SIGTERM: shutdown() sets STOPPING and the items in flight finish within the grace.
    One's settle meets the database away, then lands: the state stays STOPPING (running
    would send sd_notify STATUS=running and write a 'running' heartbeat while it stops)."""
    states: list[tuple[str, str]] = []
    runner = make_runner(states, probe_ok=True)
    worker_state = runner._worker_state
    worker_state.set(State.STOPPING, "")  # as shutdown() does first
    worker_state.database_lost(DatabaseUnavailable(AWAY))  # an item's settle in the grace
    worker_state.database_back()  # its retry lands
    assert runner.state == State.STOPPING, states


def test_a_claim_the_server_refuses_is_waited_out_not_running(
    db: psycopg.Connection, make_runner: MakeRunner
) -> None:
    """A privilege revoked from the worker's role under a running worker: every claim failed
    with a traceback while the worker said "running" and /readyz answered ready; items waited
    unseen (found by an observability hunt). Now it waits for the database, saying why, and
    claims the items once the privilege is back."""
    db.execute(
        """CREATE FUNCTION refuse_claims() RETURNS trigger LANGUAGE plpgsql AS
           $$BEGIN RAISE EXCEPTION 'permission denied for table pending_triage'
                   USING ERRCODE = '42501'; END$$;
           CREATE TRIGGER refuse_claims BEFORE UPDATE ON pending_triage
           FOR EACH ROW EXECUTE FUNCTION refuse_claims()"""
    )
    enqueue_many(db, 2)
    states: list[tuple[str, str]] = []
    runner = make_runner(states, probe_ok=True)
    runner.start()
    try:
        assert wait_until(lambda: runner.state == State.WAITING_FOR_DATABASE, timeout=30), states
        assert "the database refuses the claim: permission denied" in runner.state_detail
        assert "SQLSTATE 42501" in runner.state_detail
        db.execute("DROP TRIGGER refuse_claims ON pending_triage")
        assert wait_until(
            lambda: count(db, "SELECT count(*) FROM work_outcomes") == 2, timeout=30
        )
        assert wait_until(lambda: runner.state == State.RUNNING, timeout=10), states
    finally:
        runner.shutdown(5)
    assert count(db, "SELECT count(*) FROM pending_triage") == 0


def test_a_claim_error_that_is_no_setup_refusal_keeps_its_traceback(
    db: psycopg.Connection, make_runner: MakeRunner
) -> None:
    """Only a refusal the setup causes (SQLSTATE class 42 or 3F) is waited out: any other
    error of the claim (a bug of the worker's own SQL) keeps its claim_failed traceback
    instead of a privilege hint that would send the operator to sql/roles.sql (review)."""
    db.execute(
        """CREATE FUNCTION break_claims() RETURNS trigger LANGUAGE plpgsql AS
           $$BEGIN RAISE EXCEPTION 'a bug' USING ERRCODE = 'XX000'; END$$;
           CREATE TRIGGER break_claims BEFORE UPDATE ON pending_triage
           FOR EACH ROW EXECUTE FUNCTION break_claims()"""
    )
    enqueue_many(db, 1)
    states: list[tuple[str, str]] = []
    runner = make_runner(states, probe_ok=True)
    with capture_logs() as logs:
        runner.start()
        try:
            assert wait_until(
                lambda: any(e["event"] == "claim_failed" for e in logs), timeout=30
            )
        finally:
            runner.shutdown(5)
    assert State.WAITING_FOR_DATABASE not in [state for state, _ in states], states


def test_a_settle_whose_next_claim_is_refused_still_writes_its_outcome(
    db: psycopg.Connection, database_url: str
) -> None:
    """A privilege revoked on one queue only: a triage item's successful settle also claims
    the slot's next item, from the refused queue; the whole statement failed and the item's
    success was counted a failure, then dead-lettered (found by a review). Now the outcome is
    written without that claim, and the refused queue's items wait."""
    db.execute(
        """CREATE FUNCTION refuse_claims() RETURNS trigger LANGUAGE plpgsql AS
           $$BEGIN RAISE EXCEPTION 'permission denied for table pending_distillation'
                   USING ERRCODE = '42501'; END$$;
           CREATE TRIGGER refuse_claims BEFORE UPDATE ON pending_distillation
           FOR EACH ROW EXECUTE FUNCTION refuse_claims()"""
    )
    enqueue_many(db, 1, queue="pending_distillation")
    enqueue_many(db, 6)
    database = Database(database_url, size=4)
    runner = Runner(
        settings=fast_settings(concurrency=2, max_attempts=3),
        database=database,
        handlers={Queue.TRIAGE: ScriptedHandler(), Queue.DISTILLATION: ScriptedHandler()},
        worker_id="refused",
        on_state=lambda state, detail: states.append(state),
    )
    states: list[str] = []
    runner.start()
    try:
        saved = "SELECT count(*) FROM work_outcomes WHERE outcome = 'saved'"
        assert wait_until(lambda: count(db, saved) == 6, timeout=60)
    finally:
        runner.shutdown(5)
        database.close()
    assert State.WAITING_FOR_DATABASE in states, states  # (the refusal said)
    assert count(db, "SELECT count(*) FROM failed_operations") == 0
    assert count(db, "SELECT count(*) FROM pending_distillation WHERE attempts = 0") == 1
