"""Migrations: idempotent, race-free, and adopting an existing Sokratos database."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psycopg
import pytest
from structlog.testing import capture_logs

from sokratos_worker.app import _check_schema
from sokratos_worker.config import ConfigError, Settings
from sokratos_worker.store import migrations
from sokratos_worker.store.connection import Database
from sokratos_worker.store.migrations import (
    MigrationError,
    apply_migrations,
    history_differences,
    load_migrations,
)
from tests.core.test_cli import cli, env_for

ROLES_SQL = (Path(__file__).resolve().parents[2] / "sql" / "roles.sql").read_text("utf-8")

SOKRATOS_SCHEMA = """
CREATE EXTENSION IF NOT EXISTS vector;
CREATE TABLE memories (
    id BIGSERIAL PRIMARY KEY, summary TEXT NOT NULL, embedding VECTOR(2560) NOT NULL,
    salience FLOAT DEFAULT 5, tags TEXT[], created_at TIMESTAMPTZ DEFAULT now(),
    last_accessed TIMESTAMPTZ DEFAULT now(), memory_type VARCHAR(20) DEFAULT 'general',
    entities TEXT[], confidence FLOAT DEFAULT 1.0, related_ids BIGINT[],
    superseded_by BIGINT REFERENCES memories(id), retrieval_count INT DEFAULT 0,
    last_retrieved_at TIMESTAMPTZ, usefulness_score FLOAT DEFAULT 0.5, source VARCHAR(50),
    source_date TIMESTAMPTZ, pipeline_id BIGINT,
    summary_tsv tsvector GENERATED ALWAYS AS (to_tsvector('english', summary)) STORED);
CREATE TABLE failed_operations (id BIGSERIAL PRIMARY KEY, op_type VARCHAR(50) NOT NULL,
    label TEXT NOT NULL, error_message TEXT NOT NULL, context_data JSONB NULL,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now());
CREATE TABLE processed_emails (message_id VARCHAR(255) PRIMARY KEY, seen_at TIMESTAMPTZ DEFAULT now());
CREATE TABLE adaptive_params (key VARCHAR(100) PRIMARY KEY, value FLOAT NOT NULL,
    source VARCHAR(50) NOT NULL DEFAULT 'default', reason TEXT, updated_at TIMESTAMPTZ DEFAULT now());
INSERT INTO memories (summary, embedding) VALUES ('user lives in Lisbon', array_fill(0.01, ARRAY[2560])::vector);
INSERT INTO failed_operations (op_type, label, error_message) VALUES ('memory_save', 'conversation', 'old');
INSERT INTO processed_emails (message_id) VALUES ('gmail-123');
INSERT INTO adaptive_params (key, value, source) VALUES ('triage_conversation_threshold', 4, 'reflection');
"""


def test_migrations_are_idempotent(empty_database_url: str) -> None:
    assert len(apply_migrations(empty_database_url)) == len(load_migrations())
    assert apply_migrations(empty_database_url) == []
    with psycopg.connect(empty_database_url) as conn:
        rows = conn.execute(
            "SELECT count(*), count(DISTINCT checksum) FROM sokratos_worker_migrations"
        ).fetchone()
    assert rows == (len(load_migrations()), len(load_migrations()))


def test_two_workers_migrating_at_once_do_not_race(empty_database_url: str) -> None:
    results: list[list[str]] = []
    errors: list[BaseException] = []

    def migrate() -> None:
        try:
            results.append(apply_migrations(empty_database_url))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=migrate) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert sorted(len(r) for r in results) == [0, 0, len(load_migrations())]


def test_an_existing_sokratos_database_is_adopted(empty_database_url: str) -> None:
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        conn.execute(SOKRATOS_SCHEMA)
    apply_migrations(empty_database_url)
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        assert conn.execute("SELECT summary FROM memories").fetchall() == [
            ("user lives in Lisbon",)
        ]
        assert conn.execute(
            "SELECT format_type(atttypid, atttypmod), attnotnull FROM pg_attribute"
            " WHERE attrelid = 'memories'::regclass AND attname = 'embedding'"
        ).fetchone() == ("vector(2560)", True)
        assert conn.execute("SELECT value FROM adaptive_params").fetchone() == (4.0,)
        assert conn.execute("SELECT count(*) FROM processed_emails").fetchone() == (1,)
        cols = {
            r[0]
            for r in conn.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_name = 'failed_operations'"
            )
        }
        assert {"source_queue", "item_id", "retried_at", "retried_as", "attempts"} <= cols
        cols = {
            r[0]
            for r in conn.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_name = 'memories'"
            )
        }
        assert {"origin", "embedding_model"} <= cols
    database = Database(empty_database_url, size=1)
    try:
        with pytest.raises(ConfigError) as info:
            _check_schema(Settings(), database)
        assert info.value.variable == "SOKRATOS_EMBEDDING_URL"
        with pytest.raises(ConfigError) as info:
            _check_schema(
                Settings(
                    embedding_url="http://127.0.0.1:1", embedding_model="m", embedding_dim=1024
                ),
                database,
            )
        assert info.value.variable == "SOKRATOS_EMBEDDING_DIM"
        _check_schema(
            Settings(embedding_url="http://127.0.0.1:1", embedding_model="m", embedding_dim=2560),
            database,
        )
    finally:
        database.close()


def _as_role(url: str, role: str) -> str:
    """The same database, the session running as ``role`` (set at connection start)."""
    info = psycopg.conninfo.conninfo_to_dict(url)
    info["options"] = f"-c role={role}"
    return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})


def test_an_up_to_date_database_needs_no_privilege_to_migrate(database_url: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(ROLES_SQL)
        before = conn.execute("SELECT count(*) FROM sokratos_worker_migrations").fetchone()
    # The worker role may not create tables; with nothing pending, `run` starts anyway.
    assert apply_migrations(_as_role(database_url, "sokratos_worker")) == []
    with psycopg.connect(database_url) as conn:
        after = conn.execute("SELECT count(*) FROM sokratos_worker_migrations").fetchone()
    assert after == before


def test_pending_migrations_under_a_role_that_may_not_apply_them_say_what_to_do(
    empty_database_url: str,
) -> None:
    role = f"no_ddl_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role}")
        conn.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
        try:
            with pytest.raises(MigrationError) as raised:
                apply_migrations(_as_role(empty_database_url, role))
            table = conn.execute("SELECT to_regclass('sokratos_worker_migrations')").fetchone()
        finally:
            conn.execute(f"DROP ROLE {role}")
    message = str(raised.value)
    assert f"the role '{role}' may not apply them" in message
    assert "permission denied for schema public" in message
    assert "sokratos-worker migrate" in message and "SOKRATOS_MIGRATE_ON_START=false" in message
    assert table == (None,)


def test_a_migration_behind_a_long_transaction_steps_back_instead_of_queueing(
    database_url: str,
) -> None:
    """An ALTER waiting in the lock queue behind another session's open transaction made every
    later reader and writer of that table wait behind it (a worker's claims included). It now
    takes its locks within 2 s or rolls back, names the holder and tries again."""
    table = "email_checkpoints"
    # The latest migration that alters it (ADD COLUMN IF NOT EXISTS), applied again.
    last = [m for m in load_migrations() if f"ALTER TABLE {table}" in m.sql][-1]
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("DELETE FROM sokratos_worker_migrations WHERE version = %s", (last.version,))
    logs: list[dict[str, object]] = []
    done = threading.Event()
    with psycopg.connect(database_url, application_name="a-report") as reader:
        reader.execute(f"SELECT count(*) FROM {table}")  # an open transaction holds its lock
        holder = reader.info.backend_pid

        def migrate() -> None:
            with capture_logs() as captured:
                apply_migrations(database_url)
            logs.extend(captured)
            done.set()

        thread = threading.Thread(target=migrate, daemon=True)
        thread.start()
        with psycopg.connect(database_url, autocommit=True) as other:
            other.execute("SET lock_timeout = '10s'")
            # Meanwhile the table stays usable: between its tries the migration is not queued.
            for _ in range(3):
                time.sleep(1.5)
                other.execute(f"SELECT count(*) FROM {table}")
        assert not done.is_set()
        reader.rollback()
    assert done.wait(60)
    waits = [e for e in logs if e["event"] == "migration_waiting_for_lock"]
    assert waits and waits[0]["migration"] == last.name
    held_by = waits[0]["held_by"]
    assert isinstance(held_by, list)
    assert [(h["pid"], h["application"]) for h in held_by] == [(holder, "a-report")]
    assert any(e["event"] == "migrations_applied" for e in logs)
    with psycopg.connect(database_url) as conn:
        versions = [r[0] for r in conn.execute("SELECT version FROM sokratos_worker_migrations")]
    assert versions.count(last.version) == 1


# -- the migrators' advisory lock: never waited for silently -------------------------------

ROOT = Path(__file__).resolve().parents[2]
MIGRATION_LOCK_KEY = 0x50C_2A705


def _migrate_command(url: str, tmp_path: Path) -> subprocess.Popen[str]:
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "SOKRATOS_DATABASE_URL": url}
    return subprocess.Popen(
        [sys.executable, "-m", "sokratos_worker", "migrate"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _lines_of(process: subprocess.Popen[str]) -> tuple[list[str], threading.Thread]:
    """The process's stderr lines as they come (read in a thread: a silent wait never blocks
    the test), and that thread (joined: every line read)."""
    lines: list[str] = []
    assert process.stderr is not None
    stream = process.stderr

    def read() -> None:
        for line in stream:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return lines, reader


def test_an_up_to_date_migrate_does_not_wait_for_the_migration_lock(
    database_url: str, tmp_path: Path
) -> None:
    """Another session holds the lock (a `migrate` retrying behind a long transaction): an
    up-to-date worker used to wait for it in silence, until systemd killed its start."""
    with psycopg.connect(database_url, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK_KEY,))
        started = time.monotonic()
        assert apply_migrations(database_url) == []
        assert time.monotonic() - started < 5
        process = _migrate_command(database_url, tmp_path)
        try:
            out, err = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
            pytest.fail(f"migrate (nothing pending) waited for the lock; stderr: {err[-500:]}")
    assert process.returncode == 0, err[-500:]
    assert out.strip() == "up to date"


def test_a_pending_migrate_waits_for_the_lock_and_says_who_holds_it(
    empty_database_url: str, tmp_path: Path
) -> None:
    """A real `migrate` process behind a session holding the lock: it logs the wait, naming
    the holder's pid and application, and applies everything once the lock is released."""
    with psycopg.connect(
        empty_database_url, autocommit=True, application_name="another-migrator"
    ) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK_KEY,))
        process = _migrate_command(empty_database_url, tmp_path)
        lines, reader = _lines_of(process)
        try:
            waiting: dict[str, object] = {}
            deadline = time.monotonic() + 30
            while not waiting and time.monotonic() < deadline:
                found = [line for line in list(lines) if '"migration_lock_waiting"' in line]
                if found:
                    waiting = json.loads(found[0])
                time.sleep(0.1)
            assert waiting, "no migration_lock_waiting line"
            held_by = waiting["held_by"]
            assert isinstance(held_by, list)
            assert [(h["pid"], h["application"]) for h in held_by] == [
                (holder.info.backend_pid, "another-migrator")
            ]
            time.sleep(1)
            assert process.poll() is None, "migrate gave up instead of waiting for the lock"
            holder.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK_KEY,))
            process.wait(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    reader.join(10)
    err = "".join(lines)
    assert process.returncode == 0, err[-500:]
    assert process.stdout is not None
    assert process.stdout.read().startswith("applied: ")
    assert '"migration_lock_taken"' in err
    with psycopg.connect(empty_database_url) as conn:
        row = conn.execute("SELECT count(*) FROM sokratos_worker_migrations").fetchone()
    assert row == (len(load_migrations()),)


def test_the_wait_for_the_migration_lock_is_logged_again_at_intervals(
    empty_database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(migrations, "LOCK_LOG_EVERY_S", 0.6)
    monkeypatch.setattr(migrations, "LOCK_POLL_S", 0.1)
    logs: list[dict[str, object]] = []
    heard: list[float] = []  # when each wait was said (the same lines as the log's)
    done = threading.Event()

    def said(line: str) -> None:
        if line.startswith("waiting for the migration lock"):
            heard.append(time.monotonic())

    def migrate() -> None:
        with capture_logs() as captured:
            apply_migrations(empty_database_url, said)
        logs.extend(captured)
        done.set()

    with psycopg.connect(empty_database_url, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK_KEY,))
        thread = threading.Thread(target=migrate, daemon=True)
        thread.start()
        # Three waits said (bounded: however slowly the thread gets going), not a fixed sleep.
        deadline = time.monotonic() + 30
        while len(heard) < 3:
            assert time.monotonic() < deadline, f"{len(heard)} waits said in 30 s"
            time.sleep(0.05)
        assert not done.is_set()
        holder.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK_KEY,))
    assert done.wait(60)
    waits = [e for e in logs if e["event"] == "migration_lock_waiting"]
    assert len(waits) == len(heard) >= 3, [e["waiting_s"] for e in waits]
    # Said again at intervals, not at every poll (0.1 s here): a lower bound, which load
    # can only lengthen.
    gaps = [later - earlier for earlier, later in itertools.pairwise(heard)]
    assert min(gaps) > 0.45, gaps
    assert any(e["event"] == "migrations_applied" for e in logs)


def _said(proc: subprocess.CompletedProcess[str]) -> str:
    return f"{proc.stdout}\n{proc.stderr}"


def test_a_migration_only_a_newer_worker_has_is_warned_of_not_refused(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    # A newer worker migrated (rolling upgrade, or this code rolled back): older workers run on.
    db.execute(
        "INSERT INTO sokratos_worker_migrations (version, name, checksum)"
        " VALUES (9999, '9999_from_a_newer_worker', 'abc')"
    )
    env = env_for(database_url, tmp_path)
    migrated = cli("migrate", env=env)
    assert migrated.returncode == 0 and "9999" in _said(migrated), _said(migrated)[-1500:]
    checked = cli("check", env=env)
    schema = [line for line in checked.stdout.splitlines() if "schema" in line]
    assert schema and "9999" in schema[0], checked.stdout
    assert schema[0].startswith("ok"), schema[0]  # a note: warned, not refused
    ran = cli("run", "--once", "--no-migrate", env=env)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert "migration_history_differs" in ran.stderr and "9999" in ran.stderr


def test_an_applied_migration_whose_file_changed_is_named_when_up_to_date(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    edited = load_migrations()[-1]
    db.execute(
        "UPDATE sokratos_worker_migrations SET checksum = 'checksum-of-an-earlier-file'"
        " WHERE version = %s",
        (edited.version,),
    )
    env = env_for(database_url, tmp_path)
    migrated = cli("migrate", env=env)
    assert migrated.returncode == 0 and "up to date" in migrated.stdout
    assert edited.name in _said(migrated), _said(migrated)[-1500:]
    checked = cli("check", env=env)
    schema = next(line for line in checked.stdout.splitlines() if "schema" in line)
    assert schema.startswith("ok") and edited.name in schema, checked.stdout


def test_a_migration_edited_in_its_comments_only_is_not_a_changed_one(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """0045 as 17d582c applied it differs from today's file in comments only: a database
    migrated then was warned of a changed migration at every migrate, check and start, for
    good (review R4, with the old version's own migrate)."""
    db.execute(
        "UPDATE sokratos_worker_migrations SET checksum = %s WHERE version = 45",
        ("1e8425090d7872f1148617c4fb5deeba4fe040c265516bf1cee1379c2c1b1b9f",),
    )
    assert history_differences(db) == []
    migrated = cli("migrate", env=env_for(database_url, tmp_path))
    assert migrated.returncode == 0 and "changed" not in _said(migrated), _said(migrated)
    # Any other earlier text of it is still named.
    db.execute("UPDATE sokratos_worker_migrations SET checksum = 'other' WHERE version = 45")
    assert "0045_email_uid_fingerprint" in " ".join(history_differences(db))


def test_a_number_another_migration_was_applied_under_is_named_as_such(
    db: psycopg.Connection,
) -> None:
    """A database migrated by a build from another branch holds another migration under one
    of this version's numbers: it was warned as "changed", which sent the operator looking
    for an edit of this version's file."""
    db.execute(
        "UPDATE sokratos_worker_migrations SET name = '0045_branch_experiment', checksum = 'x'"
        " WHERE version = 45"
    )
    [said] = history_differences(db)
    assert said.startswith(
        "applied migrations that are not this version's under their number:"
        " 0045_branch_experiment (this version's 0045_email_uid_fingerprint)"
    ), said
    assert "changed" not in said
