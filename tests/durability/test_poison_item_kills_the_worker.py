"""durability.md, "Attempts count at claim" (2) and the table rows "the worker is killed
(kill -9, OOM) ... used" and "claimed again with no attempts left ... failed_operations at once,
error `worker died during the last attempt`, payload kept".

A poison item that kills the real daemon each time it runs (os._exit, as an OOM kill would)
must use up its attempts through lease expiry and end in failed_operations with its whole
payload, instead of crashing the worker for ever; the other items end saved, once.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import psycopg
import pytest

from tests.support.daemon import daemon_env, start_daemon, wait_until
from tests.support.db import count, enqueue_many

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]


@pytest.mark.timeout(180)
def test_a_poison_item_that_kills_the_worker_ends_in_failed_operations(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    [poison] = enqueue_many(db, 1, behaviour="crash", prefix="poison")
    good = enqueue_many(db, 5, behaviour="ok", prefix="good")
    # One slot: only the item really running dies with the process (durability.md, last line).
    env = daemon_env(
        database_url, tmp_path, SOKRATOS_CONCURRENCY="1", SOKRATOS_MAX_ATTEMPTS="3"
    )
    log = tmp_path / "daemon.log"

    def done() -> bool:
        return count(db, "SELECT count(*) FROM work_outcomes") >= 1 + len(good)

    crashes = []
    for _ in range(6):  # bounded: a worker that loops for ever fails the test
        proc = start_daemon(env, log)
        ended = wait_until(lambda p=proc: p.poll() is not None or done(), timeout=40)
        assert ended, log.read_text()[-3000:]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0, log.read_text()[-3000:]
            break
        crashes.append(proc.returncode)
        # Each death used the attempt it died in: the next claim (after lease expiry) counts on.
        attempts = count(db, "SELECT attempts FROM pending_triage WHERE id = %s", poison)
        assert attempts == len(crashes), (attempts, crashes)

    assert crashes == [137, 137, 137], (crashes, log.read_text()[-3000:])
    assert count(db, "SELECT count(*) FROM pending_triage") == 0
    row = db.execute(
        "SELECT error_message, context_data -> 'payload', attempts FROM failed_operations"
        " WHERE source_queue = 'pending_triage' AND item_id = %s",
        (poison,),
    ).fetchone()
    assert row is not None, log.read_text()[-3000:]
    error, payload, attempts = row
    assert error.endswith("worker died during the last attempt"), error
    assert payload == {"exchange": "user: item 0\nassistant: ok", "behaviour": "crash"}
    assert attempts == 3
    outcome = db.execute(
        "SELECT outcome, attempts FROM work_outcomes WHERE queue = 'pending_triage'"
        " AND item_id = %s",
        (poison,),
    ).fetchone()
    assert outcome == ("failed", 3)
    got = dict(
        db.execute(
            "SELECT item_id, outcome FROM work_outcomes WHERE item_id = ANY(%s)", (good,)
        ).fetchall()
    )
    assert got == dict.fromkeys(good, "saved"), json.dumps(got)
    assert count(db, "SELECT count(*) FROM memories") == len(good)
