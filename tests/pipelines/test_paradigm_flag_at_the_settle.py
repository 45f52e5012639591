"""The paradigm-shift flag stays last when the settle finds the memory a near-duplicate of one
another item committed meanwhile (the handler's own check found none): the settle replaced
the whole detail with "near-duplicate of memory N (saved by another item meanwhile)", and the
main application, which looks for the flag at the end (docs/production.md), never learnt of
the event. Real parts: the runner, the scripted LLM server, the test's PostgreSQL; the
settles' lock is held until both wait for it, so the race is certain.
"""

from __future__ import annotations

import json
import threading

import psycopg
import pytest

from sokratos_worker.model import PARADIGM_SHIFT_FLAG
from sokratos_worker.store.memories import _DUPLICATE_WRITE_LOCK
from sokratos_worker.testing.scripted_llm import Reply, ScriptedLLM

from .conftest import drain, enqueue, memory_rows
from .test_isolation_level_of_the_database import _release_once_settles_wait
from .test_triage import verdict

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

ENGAGED = "The user got engaged to Sam."


def test_a_duplicate_found_at_the_settle_keeps_the_flag_last(
    db: psycopg.Connection, database_url: str
) -> None:
    exchange = "user: Sam proposed last night, we're engaged!\nassistant: Wow!"
    ids = [
        enqueue(db, "SELECT sokratos_enqueue_triage(%s::jsonb)", json.dumps({"exchange": exchange}))
        for _ in range(2)
    ]
    flagged = verdict(9, summary=ENGAGED, paradigm_shift=True)
    with psycopg.connect(database_url, autocommit=True) as lock:
        lock.execute("SELECT pg_advisory_lock(%s)", (_DUPLICATE_WRITE_LOCK,))
        release = threading.Thread(
            target=_release_once_settles_wait, args=(database_url, lock), kwargs={"waiting": 2}
        )
        release.start()
        with ScriptedLLM(chat=lambda request: Reply.chat(flagged), latency=0.05) as server:
            drain(database_url, server, SOKRATOS_CONCURRENCY="2")
        release.join(60)
    [memory] = memory_rows(db)
    rows = db.execute(
        "SELECT item_id, outcome, detail FROM work_outcomes ORDER BY item_id"
    ).fetchall()
    assert sorted(r[0] for r in rows) == sorted(ids)
    assert sorted(r[1] for r in rows) == ["saved", "skipped"], rows
    skipped = next(r[2] for r in rows if r[1] == "skipped")
    assert skipped == (
        f"near-duplicate of memory {memory['id']} (saved by another item meanwhile)"
        f"{PARADIGM_SHIFT_FLAG}"
    ), skipped
