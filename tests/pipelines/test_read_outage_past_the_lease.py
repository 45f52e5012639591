"""The triage pipeline's read meets a PostgreSQL restart that outlasts 0.8 x SOKRATOS_LEASE on
the item's last attempt: its give-back cannot be written in time and is owed, its lease expires
while the server is down, and this worker's claim once it is back writes the give-back (owed
hunt, 2026-12-07). Before, that claim took the lease over as a dead worker's and dead-lettered
the conversation as "worker died during the last attempt". (The same outage within the lease:
test_read_outage_gives_back; the fence against other workers: tests/durability/
test_owed_give_back.py.)"""

from __future__ import annotations

import json
from collections.abc import Callable

import psycopg
import pytest

from sokratos_worker.model import Queue
from sokratos_worker.runner import Runner
from sokratos_worker.settle import ABANDONED
from sokratos_worker.store.connection import Database
from tests.pipelines.conftest import enqueue, outcome
from tests.pipelines.fakes import FakeChat
from tests.pipelines.test_read_outage_gives_back import (
    DOWN_S,
    EXCHANGE,
    VERDICT,
    FirstReadStopsTheServer,
    _handler,
    _threshold_3,
)
from tests.support.daemon import wait_until
from tests.support.handlers import fast_settings

pytestmark = pytest.mark.postgres

LEASE_S = 4.0  # the give-back is given up after 3.2 s, the server down for DOWN_S (12 s)


def _decided(database_url: str, item_id: int) -> bool:
    try:
        with psycopg.connect(database_url, autocommit=True, connect_timeout=2) as conn:
            return bool(
                conn.execute(
                    "SELECT 1 FROM work_outcomes WHERE queue = 'pending_triage' AND item_id = %s",
                    (item_id,),
                ).fetchone()
            )
    except psycopg.OperationalError:
        return False  # (still down)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_restart_past_the_lease_on_the_last_attempt_is_given_back_not_dead_lettered(
    db: psycopg.Connection,
    database: Database,
    database_url: str,
    restart_postgres: Callable[[float], None],
) -> None:
    assert DOWN_S > LEASE_S * 2
    _threshold_3(db)
    item_id = enqueue(
        db, "SELECT sokratos_enqueue_triage(%s::jsonb)", json.dumps({"exchange": EXCHANGE})
    )
    db.close()  # (the restart ends it)
    chat = FakeChat().script("conversation_triage", VERDICT, VERDICT)
    reads = FirstReadStopsTheServer(database, database_url, restart_postgres)
    done: list[str] = []
    runner = Runner(
        settings=fast_settings(concurrency=1, lease=LEASE_S, max_attempts=1),
        database=database,
        handlers={Queue.TRIAGE: _handler(reads, chat)},
        worker_id="test",
        on_item_done=lambda _q, how, _s: done.append(how),
    )
    runner.start()
    try:
        decided = wait_until(lambda: _decided(database_url, item_id), timeout=90, interval=0.5)
    finally:
        runner.shutdown(5)
        reads.restarting.join(60)
    stats = runner.take_stats().counts[Queue.TRIAGE]
    assert decided, f"no outcome: {stats}, endings {done}"
    # The first attempt's give-back was given up in the outage, then written at the claim.
    assert done == [ABANDONED, "saved"], done
    assert (stats["claimed"], stats["given_back"], stats["saved"]) == (2, 1, 1), stats
    with psycopg.connect(database_url, autocommit=True) as again:
        kind, memory_ids, detail = outcome(again, "pending_triage", item_id)
        assert kind == "saved" and len(memory_ids) == 1, (kind, detail)
        assert "threshold 3" in detail, detail
        assert again.execute(
            "SELECT attempts FROM work_outcomes WHERE queue = 'pending_triage' AND item_id = %s",
            (item_id,),
        ).fetchone() == (1,)  # its last attempt, counted once
        assert again.execute("SELECT count(*) FROM failed_operations").fetchone() == (0,)
        assert again.execute("SELECT count(*) FROM pending_triage").fetchone() == (0,)
