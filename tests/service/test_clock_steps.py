"""The host's wall clock steps while the worker runs (NTP correcting a clock that ran ahead,
a restored VM): the heartbeat ticks go on.

APScheduler keeps its next run times on the wall clock: after a step back of an hour the
worker wrote no heartbeat for that hour, and ``status`` called it silent while it worked
(review, 2026-12-05). Only the daemon sees the step (libfaketime); PostgreSQL's clock and
``time.monotonic`` stay real, as they do on a host whose clock NTP steps.
"""

from __future__ import annotations

import time
from pathlib import Path

import psycopg
import pytest

from sokratos_worker.store import status as status_store
from tests.faults.support import log_events, stop, tail
from tests.support.daemon import daemon_env, start_daemon, wait_until
from tests.support.db import count, enqueue_many
from tests.support.faketime import stepped_env

pytestmark = [pytest.mark.subprocess, pytest.mark.postgres]


def _ticks(log: Path) -> int:
    return sum(e.get("event") == "tick_finished" for e in log_events(log))


def _stepped(log: Path) -> list[dict[str, object]]:
    return [e for e in log_events(log) if e.get("event") == "wall_clock_stepped"]



@pytest.mark.parametrize("step_s", [-3600, 6 * 3600], ids=["back-1h", "forward-6h"])
def test_heartbeats_go_on_after_the_wall_clock_steps(
    db: psycopg.Connection, database_url: str, tmp_path: Path, step_s: int
) -> None:
    offset = tmp_path / "faketime"
    env = stepped_env(daemon_env(database_url, tmp_path), offset)  # heartbeat every 1 s
    log = tmp_path / "daemon.log"
    proc = start_daemon(env, log)
    try:
        assert wait_until(lambda: _ticks(log) >= 3, timeout=60), tail(log)
        offset.write_text(f"{step_s:+d}\n")
        assert wait_until(lambda: bool(_stepped(log)), timeout=10), tail(log)
        before = _ticks(log)
        time.sleep(8)
        after = _ticks(log)
        # Items run too (the dispatcher waits on monotonic time and NOTIFY).
        enqueue_many(db, 5)
        assert wait_until(lambda: count(db, "SELECT count(*) FROM work_outcomes") >= 5, timeout=60)
        workers = status_store.live_workers(db, stale_after_s=180)
    finally:
        stop(proc)
    # One tick a second; a handful, not none (back) and not one per missed second (forward).
    assert 4 <= after - before <= 12, (after - before, tail(log))
    assert [w["overdue"] for w in workers] == [False], workers
    (said,) = _stepped(log)
    assert abs(float(str(said["step_s"])) - step_s) < 5, said
    assert sorted(str(job) for job in said["jobs"]) == ["heartbeat", "maintenance"], said  # type: ignore[attr-defined]
