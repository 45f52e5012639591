"""durability.md: "A process claims only as many items as it has free slots, so a crash costs an
attempt only for items that were really running", and table row "the worker is killed (kill -9,
OOM) | the lease expires and the item is claimed again | used".

The real daemon with 2 slots: fast items first (so slots claim their next item with each
settle), then slow ones. Sampled all along, never more than 2 items are leased; at kill -9
exactly the 2 running items have an attempt counted; after a restart they run again (lease
expiry) and their outcome records 2 attempts; the others record 1.
"""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from tests.support.daemon import daemon_env, start_daemon, wait_until
from tests.support.db import count, enqueue_many

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

LEASED = "SELECT count(*) FROM pending_triage WHERE lease_owner IS NOT NULL"


@pytest.mark.timeout(120)
def test_kill_9_costs_an_attempt_only_for_the_items_running(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    fast = enqueue_many(db, 30, behaviour="sleep:0.05", prefix="fast")
    slow = enqueue_many(db, 6, behaviour="sleep:2", prefix="slow")
    env = daemon_env(database_url, tmp_path, SOKRATOS_CONCURRENCY="2", SOKRATOS_LEASE="3s")
    log = tmp_path / "daemon.log"
    proc = start_daemon(env, log)
    most = 0

    def two_slow_running() -> bool:
        nonlocal most
        leased = count(db, LEASED)
        most = max(most, leased)
        running_slow = count(
            db, LEASED + " AND id = ANY(%s) AND attempts = 1", slow
        )
        return running_slow == 2 or proc.poll() is not None

    try:
        assert wait_until(two_slow_running, timeout=60, interval=0.01), log.read_text()[-3000:]
        assert proc.poll() is None, log.read_text()[-3000:]
    finally:
        proc.kill()
        proc.wait(10)
    assert most <= 2, most
    counted = db.execute(
        "SELECT id FROM pending_triage WHERE attempts > 0 ORDER BY id"
    ).fetchall()
    died = [r[0] for r in counted]
    assert len(died) == 2 and set(died) <= set(slow), died  # only the items really running
    assert count(db, LEASED) == 2  # left behind by the kill: only lease expiry frees them

    proc = start_daemon(env, log)
    try:
        assert wait_until(
            lambda: count(db, "SELECT count(*) FROM work_outcomes") >= len(fast) + len(slow),
            timeout=60,
        ), log.read_text()[-3000:]
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    rows = dict(db.execute("SELECT item_id, attempts FROM work_outcomes").fetchall())
    assert {rows[i] for i in died} == {2}, rows  # the attempt that died counts
    assert {rows[i] for i in fast + slow if i not in died} == {1}, rows
    assert count(db, "SELECT count(*) FROM work_outcomes WHERE outcome <> 'saved'") == 0
    assert count(db, "SELECT count(*) FROM memories") == len(fast) + len(slow)
