"""Once claiming pauses (no backend reachable), nothing new starts, not even an item just given
back.

Found in CI (2026-12-06): three items, four slots, every backend down: an item's attempt was given
back before claiming paused, and the dispatcher, claiming in between, ran it again at once (4
calls for 3 items). The pause now comes before the give-back, and a claim that was already on
its way when the pause came gives back what it got instead of running it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import psycopg
import pytest
import structlog

from sokratos_worker.model import Effects, Outcome, Queue
from sokratos_worker.runner import Runner
from sokratos_worker.store import queue as store
from sokratos_worker.store.connection import Database
from tests.support.db import enqueue_many
from tests.support.handlers import ScriptedHandler, fast_settings


@pytest.fixture
def runner(database_url: str) -> Iterator[Runner]:
    database = Database(database_url, size=4)
    yield Runner(
        settings=fast_settings(concurrency=4),
        database=database,
        handlers={Queue.TRIAGE: ScriptedHandler(probe_ok=False)},
        worker_id="w",
    )
    database.close()


def _rows(db: psycopg.Connection) -> list[tuple[int, str | None]]:
    return [(r[0], r[1]) for r in db.execute("SELECT attempts, lease_owner FROM pending_triage")]


def test_claiming_pauses_before_the_attempt_is_given_back(
    db: psycopg.Connection, database_url: str, runner: Runner
) -> None:
    """When the pause begins, the failed item is still leased to this worker: no claim can
    have taken it back in between."""
    enqueue_many(db, 1, behaviour="unavailable")
    seen_at_pause: list[list[tuple[int, str | None]]] = []
    pause = runner._worker_state.pause

    def pause_and_look(reason: str, *, probe_failed: bool = False) -> None:
        with psycopg.connect(database_url, autocommit=True) as look:
            seen_at_pause.append(_rows(look))
        pause(reason, probe_failed=probe_failed)

    runner._settler._pause = pause_and_look
    runner.start(drain_only=True, budget_s=5.0)
    assert runner.wait_drained(20)
    runner.shutdown(1)
    assert seen_at_pause and seen_at_pause[0] == [(1, "w")], seen_at_pause
    assert _rows(db) == [(0, None)]  # and then given back


def test_a_claim_that_lands_after_the_pause_began_gives_its_items_back(
    db: psycopg.Connection, runner: Runner
) -> None:
    """The dispatcher checked for a pause, then claimed; the pause began meanwhile."""
    enqueue_many(db, 2)
    runner._worker_state.pause("every backend unreachable")
    assert runner._claim_for_idle_slots() == (4, 0)
    assert runner.inflight_count() == 0
    assert _rows(db) == [(0, None), (0, None)]  # released, their attempt given back
    assert runner.take_stats().counts[Queue.TRIAGE]["given_back"] == 2


def test_the_next_item_a_settle_claims_after_the_pause_began_is_given_back(
    db: psycopg.Connection, runner: Runner
) -> None:
    """A slot's success settles and claims its next item in one statement; the pause began
    while it ran (another slot's give-back): the next item does not start."""
    enqueue_many(db, 2)
    [item] = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
    assert runner._track_claimed([item]) == [item]
    runner._worker_state.pause("every backend unreachable")
    next_item, kind = runner._settle_and_claim(
        item,
        Effects(Outcome.SKIPPED),
        structlog.get_logger().bind(),
        time.monotonic(),
        claim_from=Queue.TRIAGE,
    )
    assert next_item is None
    assert kind == "skipped"
    assert runner.inflight_count() == 0
    assert _rows(db) == [(0, None)]  # the first settled and gone, the next given back
