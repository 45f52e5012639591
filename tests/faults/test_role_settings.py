"""A PostgreSQL run by someone else: timeouts set on the worker's role (ALTER ROLE … SET), as
managed services and shared servers set them, and a server short of disk.

A review (2026-12-05) found: with ``idle_session_timeout`` the server ended the pooled and
LISTEN connections of an idle worker, and items that came after a quiet spell got no outcome
for a minute (every pooled connection dead), with a warning every few seconds; a role's
``lock_timeout`` or ``statement_timeout`` turned a settle waiting for a lock into the item's
failure, and dead-lettered items whose handler had succeeded; so did a full disk (53100); and
``failed purge`` over many rows died with a traceback. The worker's sessions now turn those
timeouts off (it bounds its own statements), and a server short of a resource is waited out
like an outage: nothing counted against the item.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from tests.faults.support import log_events, stop, tail
from tests.support.daemon import ROOT, daemon_env, start_daemon, wait_until
from tests.support.db import count, enqueue_many

pytestmark = [pytest.mark.faults, pytest.mark.subprocess, pytest.mark.slow]

RoleWith = Callable[..., str]


@pytest.fixture
def role_with(db: psycopg.Connection, database_url: str) -> Iterator[RoleWith]:
    """A login role of this test's own, with ``settings`` as its defaults; its URL."""
    made: list[str] = []

    def make(*settings: str) -> str:
        role = "w_" + uuid.uuid4().hex[:8]
        made.append(role)
        db.execute(sql.SQL("CREATE ROLE {} LOGIN SUPERUSER").format(sql.Identifier(role)))
        for setting in settings:
            db.execute(sql.SQL("ALTER ROLE {} SET ").format(sql.Identifier(role)) + sql.SQL(setting))
        info = psycopg.conninfo.conninfo_to_dict(database_url)
        info["user"] = role
        return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items() if v})

    yield make
    for role in made:
        db.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))



def _run_until_outcomes(db: psycopg.Connection, env: dict[str, str], log: Path, n: int) -> None:
    """The daemon, until ``n`` items have an outcome (two minutes at most), then stopped."""
    proc = start_daemon(env, log)
    try:
        assert wait_until(
            lambda: count(db, "SELECT count(*) FROM work_outcomes") >= n, timeout=120
        ), tail(log)
    finally:
        stop(proc)


def _all_saved_once(db: psycopg.Connection, n: int, log: Path) -> None:
    rows = db.execute("SELECT outcome, attempts FROM work_outcomes ORDER BY item_id").fetchall()
    assert count(db, "SELECT count(*) FROM failed_operations") == 0, (rows, tail(log))
    assert rows == [("saved", 1)] * n, (rows, tail(log))


def test_an_idle_session_timeout_neither_stalls_work_nor_fills_the_log(
    db: psycopg.Connection, role_with: RoleWith, tmp_path: Path
) -> None:
    url = role_with("idle_session_timeout = '3s'")
    log = tmp_path / "worker.log"
    proc = start_daemon(daemon_env(url, tmp_path, SOKRATOS_HEARTBEAT_INTERVAL="30s"), log)
    latencies: list[float] = []
    try:
        assert wait_until(lambda: "worker_started" in log.read_text(), timeout=60), tail(log)
        for round_ in range(3):
            time.sleep(5.0)  # idle longer than the server's idle_session_timeout
            started = time.monotonic()
            enqueue_many(db, 2, prefix=f"r{round_}-")
            done = wait_until(
                lambda r=round_: count(db, "SELECT count(*) FROM work_outcomes") >= 2 * (r + 1),
                timeout=60,
            )
            latencies.append(round(time.monotonic() - started, 2))
            assert done, (latencies, tail(log))
    finally:
        stop(proc)
    _all_saved_once(db, 6, log)
    # Picked up at once (generous: a wake-up, not a pool digging through dead connections).
    assert max(latencies) < 3.0, (latencies, tail(log))
    events = log_events(log)
    started_at = next(i for i, e in enumerate(events) if e.get("event") == "worker_started")
    warnings = [e["event"] for e in events[started_at:] if e.get("level") in ("warning", "error")]
    assert warnings == [], warnings


def test_a_slot_holding_its_connection_past_the_idle_timeout_settles_on_it(
    db: psycopg.Connection, role_with: RoleWith, tmp_path: Path
) -> None:
    """A slot keeps its connection while its handler runs (1.8 s here): the server's 1.5 s
    idle timeout ended it, and the settle failed as the item's own error."""
    url = role_with("idle_session_timeout = '1500ms'")
    enqueue_many(db, 4, behaviour="sleep:1.8")
    log = tmp_path / "worker.log"
    _run_until_outcomes(db, daemon_env(url, tmp_path, SOKRATOS_CONCURRENCY="2"), log, 4)
    _all_saved_once(db, 4, log)


@pytest.mark.parametrize("setting", ["lock_timeout = '200ms'", "statement_timeout = '200ms'"])
def test_a_roles_timeout_does_not_fail_a_settle_waiting_for_a_lock(
    db: psycopg.Connection, database_url: str, role_with: RoleWith, tmp_path: Path, setting: str
) -> None:
    """Another session holds work_outcomes locked for 6 s (a migration, a maintenance job):
    the items wait for it, as they do without the setting."""
    url = role_with(setting)
    enqueue_many(db, 6)
    log = tmp_path / "worker.log"
    locked = threading.Event()

    def hold() -> None:
        with psycopg.connect(database_url) as conn:
            conn.execute("LOCK TABLE work_outcomes IN EXCLUSIVE MODE")
            locked.set()
            time.sleep(6.0)

    holder = threading.Thread(target=hold)
    holder.start()
    assert locked.wait(10)
    proc = start_daemon(daemon_env(url, tmp_path), log)
    try:
        holder.join()
        assert wait_until(
            lambda: count(db, "SELECT count(*) FROM work_outcomes") >= 6, timeout=60
        ), tail(log)
    finally:
        stop(proc)
    _all_saved_once(db, 6, log)


@pytest.mark.parametrize(
    ("full_s", "lease"), [(3.0, "30s"), (6.0, "3s")], ids=["within-the-lease", "past-the-lease"]
)
def test_a_full_disk_is_waited_out_and_fails_no_item(
    db: psycopg.Connection, database_url: str, tmp_path: Path, full_s: float, lease: str
) -> None:
    """The settle's INSERT refused with the server's 53100 (raised by a trigger, as a full
    tablespace raises it) for ``full_s``. Within the lease the items settle on their first
    attempt; past it they run again, as after a database outage (durability.md), and none is
    dead-lettered."""
    db.execute(
        """CREATE FUNCTION disk_full() RETURNS trigger LANGUAGE plpgsql AS $$
           BEGIN
               RAISE EXCEPTION 'could not extend file "base/16384/16999": No space left on device'
                   USING ERRCODE = '53100';
           END $$"""
    )
    db.execute(
        "CREATE TRIGGER disk_full BEFORE INSERT ON work_outcomes"
        " FOR EACH ROW EXECUTE FUNCTION disk_full()"
    )
    enqueue_many(db, 6)
    log = tmp_path / "worker.log"
    proc = start_daemon(daemon_env(database_url, tmp_path, SOKRATOS_LEASE=lease), log)
    try:
        assert wait_until(
            lambda: any(e.get("event") == "waiting_for_database" for e in log_events(log)),
            timeout=60,
        ), tail(log)
        time.sleep(full_s)
        db.execute("DROP TRIGGER disk_full ON work_outcomes")  # space freed
        assert wait_until(
            lambda: count(db, "SELECT count(*) FROM work_outcomes") >= 6, timeout=60
        ), tail(log)
    finally:
        stop(proc)
    if lease == "30s":
        _all_saved_once(db, 6, log)
    rows = db.execute("SELECT outcome FROM work_outcomes").fetchall()
    assert rows == [("saved",)] * 6, tail(log)
    assert count(db, "SELECT count(*) FROM failed_operations") == 0, tail(log)


def test_failed_purge_of_many_rows_outlasts_a_roles_statement_timeout(
    db: psycopg.Connection, role_with: RoleWith, tmp_path: Path
) -> None:
    db.execute(
        "INSERT INTO failed_operations (op_type, label, error_message, created_at)"
        " SELECT 'conversation_triage', 'x', repeat('e', 200), now() - interval '40 days'"
        " FROM generate_series(1, 200000)"
    )
    url = role_with("statement_timeout = '50ms'")
    done = subprocess.run(
        [sys.executable, "-m", "sokratos_worker", "failed", "purge", "--older-than", "30"],
        env=daemon_env(url, tmp_path),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert count(db, "SELECT count(*) FROM failed_operations") == 0


def test_a_search_path_that_misses_the_workers_tables_is_named_and_nothing_is_built(
    db: psycopg.Connection, role_with: RoleWith, tmp_path: Path
) -> None:
    """The role's search_path leaves out the schema of the worker's (migrated) tables: `run`
    said the database lacked every migration and told the operator to run `migrate`, which
    built a second, empty set of queues in the other schema (and failed on the vector type).
    Both now name the setting, exit 78 and build nothing."""
    db.execute("CREATE SCHEMA elsewhere")
    url = role_with("search_path = elsewhere")
    env = daemon_env(url, tmp_path, SOKRATOS_STARTUP_TIMEOUT="3s")
    for command in (["run", "--no-migrate"], ["run"], ["migrate"]):
        done = subprocess.run(
            [sys.executable, "-m", "sokratos_worker", *command],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=100,
            check=False,
        )
        assert done.returncode == 78, (command, done.returncode, done.stderr[-2000:])
        assert "SET search_path = public (" in done.stderr, done.stderr
        assert "lacks migrations" not in done.stderr, done.stderr
    built = db.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'elsewhere'")
    assert built.fetchone() == (0,)


def test_a_configured_limit_one_item_exceeds_is_that_items_failure(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """53400 (configuration_limit_exceeded, e.g. max_locks_per_transaction) raised by one
    item's own memory write: unlike a full disk it is the item's, so it ends in a dead letter
    after its attempts while the other items settle (as "the server short of a resource" it
    was waited out for ever, the worker saying the database was away; review, 2026-12-05)."""
    bad, good = enqueue_many(db, 2)
    db.execute(
        f"""CREATE FUNCTION over_the_limit() RETURNS trigger LANGUAGE plpgsql AS $$
           BEGIN
               IF NEW.summary = 'memory of item {bad}' THEN
                   RAISE EXCEPTION 'out of shared memory' USING ERRCODE = '53400';
               END IF;
               RETURN NEW;
           END $$"""
    )
    db.execute(
        "CREATE TRIGGER over_the_limit BEFORE INSERT ON memories"
        " FOR EACH ROW EXECUTE FUNCTION over_the_limit()"
    )
    log = tmp_path / "worker.log"
    _run_until_outcomes(db, daemon_env(database_url, tmp_path, SOKRATOS_MAX_ATTEMPTS="2"), log, 2)
    rows = db.execute("SELECT item_id, outcome, attempts FROM work_outcomes ORDER BY item_id")
    assert rows.fetchall() == [(bad, "failed", 2), (good, "saved", 1)], tail(log)
    assert not any(e.get("event") == "waiting_for_database" for e in log_events(log)), tail(log)


def test_a_separate_deployment_in_its_own_schema_is_built_as_the_refusal_says(
    empty_database_url: str, tmp_path: Path
) -> None:
    """Two deployments in one database, each in its own schema (pgvector in public): the
    second's role may use the first's schema (a superuser here), so its migrate is refused as
    a missed search_path; the refusal says how to build a separate one, and that works."""
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector SCHEMA public")
        conn.execute("CREATE SCHEMA a")
        conn.execute("CREATE SCHEMA b")
    info = {k: str(v) for k, v in psycopg.conninfo.conninfo_to_dict(empty_database_url).items() if v}
    first = psycopg.conninfo.make_conninfo(**info, options="-csearch_path=a,public")
    second = psycopg.conninfo.make_conninfo(**info, options="-csearch_path=b,public")
    env = daemon_env(first, tmp_path)

    def migrate(url: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "sokratos_worker", "migrate"],
            env={**env, "SOKRATOS_DATABASE_URL": url},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=100,
            check=False,
        )

    assert migrate(first).returncode == 0
    refused = migrate(second)
    assert refused.returncode == 78, refused.stderr
    statement = (
        "CREATE TABLE b.sokratos_worker_migrations"
        " (LIKE a.sokratos_worker_migrations INCLUDING ALL)"
    )
    assert statement in refused.stderr, refused.stderr
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        conn.execute(statement)
    built = migrate(second)
    assert built.returncode == 0, built.stderr
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        tables = conn.execute(
            "SELECT schemaname, count(*) FROM pg_tables WHERE tablename IN"
            " ('pending_triage', 'work_outcomes', 'sokratos_worker_migrations')"
            " GROUP BY 1 ORDER BY 1"
        ).fetchall()
    assert tables == [("a", 3), ("b", 3)], tables
