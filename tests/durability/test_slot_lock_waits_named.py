"""A busy slot whose settle waits for another session's lock (an index build on `memories`,
a transaction left open) is named at the tick, with the lock's holder: the dispatcher's waits
were named, but a worker whose every slot waited looked healthy (watchdog pings, /readyz,
status) and nothing in the log said why no item finished (found by a service hunt)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import psycopg
import pytest
from structlog.testing import capture_logs

from sokratos_worker import daemon
from sokratos_worker.daemon import Worker
from sokratos_worker.model import Queue
from sokratos_worker.runner import Runner
from sokratos_worker.store.connection import Database
from tests.support.db import enqueue_many
from tests.support.handlers import ScriptedHandler, fast_settings


def test_a_settle_waiting_for_a_lock_is_named_with_its_holder(
    db: psycopg.Connection, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(daemon, "SLOT_LOCK_REPORT_S", 0.5)
    enqueue_many(db, 1, behaviour="ok")  # its settle writes a memory
    database = Database(database_url, size=4)
    runner = Runner(
        settings=fast_settings(concurrency=1),
        database=database,
        handlers={Queue.TRIAGE: ScriptedHandler()},
        worker_id="test",
    )
    with psycopg.connect(database_url, application_name="index-build") as locker:
        locker.execute("LOCK TABLE memories IN SHARE MODE")
        runner.start()
        try:
            deadline = time.monotonic() + 20
            said: list[dict[str, object]] = []
            while not said and time.monotonic() < deadline:
                time.sleep(0.5)
                with capture_logs() as logs:
                    Worker.name_slot_lock_waits(SimpleNamespace(database=database))  # type: ignore[arg-type]
                said = [e for e in logs if e["event"] == "slot_waits_for_lock"]
            holder = locker.info.backend_pid
        finally:
            locker.rollback()
            runner.shutdown(5)
            database.close()
    assert said, "no slot_waits_for_lock within 20 s"
    (wait,) = said
    assert wait["tables"] == ["memories"], wait
    assert [b["pid"] for b in wait["held_by"]] == [holder]  # type: ignore[union-attr]
    assert [b["application"] for b in wait["held_by"]] == ["index-build"]  # type: ignore[union-attr]
