"""A migration's ALTER TABLE queued behind a transaction left open: every later reader and
writer of the table waits behind the ALTER, yet neither session holds a lock that blocks them
(the ALTER's is not granted, the open transaction's is ACCESS SHARE). The commands named no
one, and `failed`/`enqueue` blamed "a row another transaction holds" (review R4)."""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

import psycopg
import pytest

from tests.core.test_cli import cli, env_for

pytestmark = [pytest.mark.postgres, pytest.mark.subprocess]


class QueuedAlter:
    """An open transaction that read ``table`` and an ALTER TABLE queued behind it."""

    def __init__(self, url: str, table: str) -> None:
        self.reader = psycopg.connect(url, application_name="long-reader")
        self.reader.execute(f"SELECT count(*) FROM {table}")
        self.migrator = psycopg.connect(url, application_name="a-migration", autocommit=True)
        self.thread = threading.Thread(
            target=lambda: self.migrator.execute(f"ALTER TABLE {table} ADD COLUMN queued int"),
            daemon=True,
        )
        self.reader_pid = self.reader.info.backend_pid
        self.migrator_pid = self.migrator.info.backend_pid

    def __enter__(self) -> QueuedAlter:
        self.thread.start()
        with psycopg.connect(self.reader.info.dsn, autocommit=True) as probe:
            for _ in range(200):  # until the ALTER waits (bounded: 10 s)
                waits = probe.execute(
                    "SELECT count(*) FROM pg_locks WHERE pid = %s AND NOT granted",
                    (self.migrator_pid,),
                ).fetchone()
                if waits and waits[0]:
                    break
                time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.reader.rollback()
        self.thread.join(10)
        self.reader.close()
        self.migrator.close()


def test_status_names_the_queued_alter_and_the_transaction_ahead_of_it(
    database_url: str, tmp_path: Path
) -> None:
    with QueuedAlter(database_url, "pending_triage") as queued:
        proc = cli("status", env=env_for(database_url, tmp_path), timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "pending_triage: unknown" in proc.stdout, proc.stdout
    locked = [line for line in proc.stdout.splitlines() if line.startswith("locked:")]
    [alter] = [line for line in locked if f"pid {queued.migrator_pid} " in line]
    [reader] = [line for line in locked if f"pid {queued.reader_pid} " in line]
    assert "ALTER TABLE pending_triage" in alter and "waiting for it" in alter, alter
    assert f"ahead of pid {queued.migrator_pid}, which waits for it" in reader, reader
    assert f"pg_terminate_backend({queued.reader_pid})" in reader


def test_failed_and_enqueue_name_them_too(database_url: str, tmp_path: Path) -> None:
    with QueuedAlter(database_url, "failed_operations") as queued:
        failed = cli("failed", "list", env=env_for(database_url, tmp_path), timeout=60)
    assert failed.returncode == 75, (failed.returncode, failed.stderr[-2000:])
    assert "another transaction holds on a row" not in failed.stderr
    for pid in (queued.migrator_pid, queued.reader_pid):
        assert f"pg_terminate_backend({pid})" in failed.stderr, failed.stderr

    data = Path(tempfile.mkdtemp(prefix="ql-", dir="/tmp"))
    try:
        env = env_for(database_url, tmp_path, SOKRATOS_DATA_DIR=str(data))
        with QueuedAlter(database_url, "pending_triage") as queued:
            enqueue = cli("enqueue", "triage", "--exchange", "user: hi\nassistant: hello",
                          env=env, timeout=60)
    finally:
        shutil.rmtree(data, ignore_errors=True)
    assert enqueue.returncode == 0 and enqueue.stdout.startswith("spooled "), enqueue.stderr
    [warning] = [json.loads(line) for line in enqueue.stderr.splitlines()
                 if "enqueue_table_locked" in line]
    assert f"pg_terminate_backend({queued.reader_pid})" in json.dumps(warning), warning
