"""Producing work from Python as the documented producer role, and the spool's own hygiene."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from structlog.testing import capture_logs

from sokratos_worker import spool as spool_module
from sokratos_worker.client import enqueue_distillation, enqueue_triage
from sokratos_worker.errors import InvalidPayload, TableLocked
from sokratos_worker.model import Queue
from sokratos_worker.pipelines import payload as fields
from sokratos_worker.pipelines.archive import archive_from_payload
from sokratos_worker.pipelines.distill import MAX_ARCHIVE_BYTES
from sokratos_worker.pipelines.text import byte_len
from sokratos_worker.spool import import_spool, pending_elsewhere, spool_enqueue, spool_problems
from sokratos_worker.status import render_status
from sokratos_worker.store.connection import Database
from sokratos_worker.store.failures import retry_failure
from tests.support.daemon import ROOT
from tests.support.db import count

ROLES_SQL = (Path(__file__).resolve().parents[2] / "sql" / "roles.sql").read_text("utf-8")


@pytest.fixture
def producer_url(db: psycopg.Connection, database_url: str) -> str:
    """A login as sokratos_producer, which may call only the two public enqueue functions."""
    db.execute(ROLES_SQL)
    db.execute("ALTER ROLE sokratos_producer PASSWORD 'test-only-password'")
    info = psycopg.conninfo.conninfo_to_dict(database_url)
    info.update(user="sokratos_producer", password="test-only-password")
    url = psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})
    try:
        psycopg.connect(url).close()
    except psycopg.OperationalError as exc:  # e.g. pg_hba allows only the superuser
        pytest.skip(f"the server refuses other logins: {exc}")
    return url


def test_the_producer_role_enqueues_through_the_client(
    db: psycopg.Connection, producer_url: str
) -> None:
    triage = enqueue_triage(producer_url, "user: I moved to Lisbon\nassistant: noted", key="p1")
    again = enqueue_triage(producer_url, "user: other\nassistant: ok", key="p1")
    archive = enqueue_distillation(producer_url, {"archive_text": "user: hi"}, key="p2")
    assert triage.item_id is not None and again.item_id == triage.item_id
    assert archive.item_id is not None
    assert count(db, "SELECT count(*) FROM pending_triage WHERE id = %s", triage.item_id) == 1
    assert count(db, "SELECT count(*) FROM pending_distillation WHERE id = %s", archive.item_id)
    with pytest.raises(InvalidPayload, match=r"payload\.messages"):
        enqueue_distillation(producer_url, {"messages": "not a list"})


def test_a_producer_with_a_lock_timeout_is_told_who_holds_the_queue(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """Without a spool the caller gets TableLocked; with one, the enqueue is spooled."""
    with psycopg.connect(database_url, application_name="a-migration") as locker:
        locker.execute("LOCK TABLE pending_distillation IN EXCLUSIVE MODE")
        holder = locker.info.backend_pid
        with pytest.raises(TableLocked, match=f"pending_distillation is held by pid {holder}"):
            enqueue_distillation(database_url, {"archive_text": "a"}, lock_timeout_ms=200)
        spooled = enqueue_distillation(
            database_url, {"archive_text": "a"}, lock_timeout_ms=200, spool_dir=tmp_path
        )
        locker.rollback()
    assert spooled.item_id is None and spooled.spooled is not None
    assert count(db, "SELECT count(*) FROM pending_distillation") == 0
    database = Database(database_url, size=1)
    try:
        assert import_spool(tmp_path, database) == 1
    finally:
        database.close()
    assert count(db, "SELECT count(*) FROM pending_distillation") == 1
    # Without a lock timeout the producer keeps the old behaviour: it waits, and gets in.
    assert enqueue_distillation(database_url, {"archive_text": "b"}).item_id is not None
    # A keyed enqueue also writes the key table; a lock there is named the same way.
    with psycopg.connect(database_url, application_name="a-migration") as locker:
        locker.execute("LOCK TABLE sokratos_idempotency_keys IN SHARE MODE")
        with pytest.raises(TableLocked, match="sokratos_idempotency_keys is held by pid"):
            enqueue_triage(database_url, "user: hi", key="k1", lock_timeout_ms=200)
        locker.rollback()


def test_a_spool_file_is_private_to_its_owner_whatever_the_umask(tmp_path: Path) -> None:
    # Written with the umask (0644), a spooled conversation was readable by every local user
    # in a spool directory that existed already (a producer's own spool_dir=, an older one).
    import stat

    spool = tmp_path / "spool"
    spool.mkdir(mode=0o755)
    old = os.umask(0o022)
    try:
        path = spool_enqueue(
            spool, Queue.TRIAGE, {"exchange": "user: my diagnosis is ..."},
            idempotency_key="k-1", source="conversation",
        )  # fmt: skip
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text())["payload"] == {"exchange": "user: my diagnosis is ..."}


def test_spool_enqueue_stores_only_what_postgres_accepts(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    path = spool_enqueue(
        spool, Queue.TRIAGE, {"exchange": "user: a\x00b"}, idempotency_key="nul", source=None
    )
    payload = json.loads(path.read_text("utf-8"))["payload"]
    assert payload["exchange"] == "user: a\\u0000b" and payload["_sanitized"]
    with pytest.raises(InvalidPayload, match="finite"):
        spool_enqueue(
            spool,
            Queue.TRIAGE,
            {"exchange": "x", "n": float("nan")},
            idempotency_key=None,
            source=None,
        )
    assert len(list(spool.glob("*.json"))) == 1


def _write(spool: Path, name: str, text: str) -> None:
    spool.mkdir(parents=True, exist_ok=True)
    (spool / name).write_text(text, "utf-8")


def _spool_two_exchanges(spool: Path) -> Path:
    """Spool files a.json and b.json, one triage exchange each (keys "a" and "b")."""
    for key in ("a", "b"):
        _write(
            spool,
            f"{key}.json",
            f'{{"queue": "pending_triage", "idempotency_key": "{key}",'
            ' "payload": {"exchange": "user: hi"}}',
        )
    return spool


def test_a_spool_import_behind_a_locked_queue_gives_up_and_resumes(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """The import runs in the tick (at start: in the main thread, which acts on signals); it
    waited for as long as a migration held the queue. Now it leaves the files for later."""
    spool = _spool_two_exchanges(tmp_path / "spool")
    database = Database(database_url, size=2)
    try:
        with psycopg.connect(database_url) as locker:
            locker.execute("LOCK TABLE pending_triage IN ACCESS EXCLUSIVE MODE")
            started = time.monotonic()
            with capture_logs() as logs:
                assert import_spool(spool, database) == 0
            assert time.monotonic() - started < 60  # (5 s; forever before)
            locker.rollback()
        (paused,) = [e for e in logs if e["event"] == "spool_import_paused"]
        assert "pending_triage stayed locked by another session" in paused["reason"]
        assert sorted(p.name for p in spool.glob("*.json")) == ["a.json", "b.json"]
        assert import_spool(spool, database) == 2
    finally:
        database.close()
    assert count(db, "SELECT count(*) FROM pending_triage") == 2
    assert count(db, "SELECT count(*) FROM failed_operations") == 0


def test_a_spooled_enqueue_slower_than_the_lock_wait_is_imported_not_cancelled(
    db: psycopg.Connection, database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The import's bound is on waiting for a lock, not on the statement: a large
    conversation that takes longer to store than the bound (120 MB, 14 s) was cancelled at
    every tick, holding up every file spooled after it, and blamed on a lock."""
    monkeypatch.setattr(spool_module, "ENQUEUE_TIMEOUT_MS", 100)
    db.execute(
        """CREATE FUNCTION slow_insert() RETURNS trigger LANGUAGE plpgsql AS
           $$BEGIN PERFORM pg_sleep(0.5); RETURN NEW; END$$;
           CREATE TRIGGER slow_insert BEFORE INSERT ON pending_triage
           FOR EACH ROW EXECUTE FUNCTION slow_insert()"""
    )
    spool = _spool_two_exchanges(tmp_path / "spool")
    database = Database(database_url, size=2)
    try:
        with capture_logs() as logs:
            assert import_spool(spool, database) == 2
    finally:
        database.close()
    assert [e for e in logs if e["event"] == "spool_import_paused"] == []
    assert count(db, "SELECT count(*) FROM pending_triage") == 2


def test_a_file_postgres_refuses_does_not_block_the_later_ones(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """Files an older version (or a hand) wrote: NUL (22P05) and NaN (not JSON for jsonb)."""
    spool = tmp_path / "spool"

    def record(key: str, payload: str) -> str:
        return f'{{"queue": "pending_triage", "idempotency_key": "{key}", "payload": {payload}}}'

    _write(spool, "1-nul.json", record("nul", '{"exchange": "user: a\\u0000b"}'))
    _write(spool, "2-nan.json", record("nan", '{"exchange": "user: x", "score": NaN}'))
    _write(spool, "3-raw-nul.json", "not json \x00 at all")
    _write(spool, "4-ok.json", record("ok", '{"exchange": "user: fine\\nassistant: ok"}'))
    (spool / "0-unreadable.json").mkdir()  # reading it fails, as a file of another user would
    database = Database(database_url, size=2)
    try:
        assert import_spool(spool, database) == 1
    finally:
        database.close()
    assert not list(spool.glob("*.json"))
    assert count(db, "SELECT count(*) FROM pending_triage WHERE idempotency_key = 'ok'") == 1
    rows = db.execute(
        "SELECT label, error_message, context_data FROM failed_operations"
        " WHERE op_type = 'spool_import' ORDER BY label"
    ).fetchall()
    assert [r[0] for r in rows] == [
        "0-unreadable.json",
        "1-nul.json",
        "2-nan.json",
        "3-raw-nul.json",
    ]
    unreadable, nul, nan, raw = (r[2] for r in rows)
    assert unreadable["raw"] is None and (spool / "0-unreadable.json.unreadable").is_dir()
    assert nul["payload"]["exchange"] == "user: a\\u0000b" and nul["idempotency_key"] == "nul"
    assert nul["_sanitized"]
    assert "NaN" in nan["raw"] and "not json" in raw["raw"]
    # Every file is accounted for: one enqueued, four recorded (with what they held).
    assert count(db, "SELECT count(*) FROM pending_triage") + len(rows) == 5
    # `status` names the file set aside; `failed retry` says what to do with each, not
    # "not written by sokratos-worker".
    assert spool_problems(spool) == [
        "1 spool files set aside as unreadable (0-unreadable.json.unreadable): make them"
        " readable by the worker's user and rename them to end in .json"
    ]
    ids = dict(db.execute("SELECT label, id FROM failed_operations").fetchall())
    aside = retry_failure(db, ids["0-unreadable.json"])
    assert aside.item_id is None and "kept as" in aside.message and ".json" in aside.message
    refused = retry_failure(db, ids["1-nul.json"])
    assert refused.item_id is None
    assert f"failed show {ids['1-nul.json']}" in refused.message
    assert "sokratos-worker enqueue" in refused.message


def test_a_nul_key_file_does_not_hold_up_the_files_after_it(
    tmp_path: Path, database_url: str, db: psycopg.Connection
) -> None:
    """psycopg refuses a NUL in a text parameter itself (DataError, no SQLSTATE): the file is
    set aside as refused (a failed_operations row naming it), not re-raised at every tick
    with every later file waiting behind it."""
    spool = tmp_path / "spool"
    # As an earlier client wrote it (enqueue_triage(..., key="msg-\x0042", spool_dir=...)).
    bad = {
        "queue": "pending_triage",
        "payload": {"exchange": "user: first\nassistant: ok"},
        "idempotency_key": "msg-\x0042",
        "source": None,
        "spooled_at": "2026-01-01T00:00:00+00:00",
        "database": None,
    }
    _write(spool, "20260101T000000000000-00000000.json", json.dumps(bad))
    spool_enqueue(
        spool,
        Queue.TRIAGE,
        {"exchange": "user: my sister Ana moved to Porto\nassistant: noted!"},
        idempotency_key="msg-43",
        source=None,
    )
    database = Database(database_url, size=1)
    try:
        import_spool(spool, database)  # raised psycopg.DataError: nothing after it imported
    finally:
        database.close()
    keys = {row[0] for row in db.execute("SELECT idempotency_key FROM pending_triage")}
    assert "msg-43" in keys
    assert not (spool / "20260101T000000000000-00000000.json").exists()  # imported or rejected
    rows = db.execute(
        "SELECT label, error_message FROM failed_operations WHERE op_type = 'spool_import'"
    ).fetchall()
    assert [r[0] for r in rows] == ["20260101T000000000000-00000000.json"]
    assert "NUL" in rows[0][1]


def test_a_spool_directory_the_worker_cannot_read_is_said_not_passed_over() -> None:
    """A root `enqueue` made the spool (0700); the worker runs as another user (nobody)."""
    base = Path(tempfile.mkdtemp(prefix="sokratos-spool-"))  # (pytest's tmp_path is 0700)
    base.chmod(0o755)
    spool = base / "spool"
    _write(spool, "1.json", '{"queue": "pending_triage", "payload": {}}')
    spool.chmod(0o700)
    try:
        _read_spool_as_nobody(spool)
    finally:
        shutil.rmtree(base)


def _read_spool_as_nobody(spool: Path) -> None:
    script = (
        "import json, sys; from pathlib import Path\n"
        "from structlog.testing import capture_logs\n"
        "from sokratos_worker.spool import import_spool, pending_files, spool_problems\n"
        "with capture_logs() as logs:\n"
        "    n = import_spool(Path(sys.argv[1]), None)\n"
        "print(json.dumps({'imported': n, 'logs': logs, 'pending': pending_files(Path(sys.argv[1])),"
        " 'problems': spool_problems(Path(sys.argv[1]))}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(spool)],
        user=65534,
        group=65534,
        env={"PYTHONPATH": str(ROOT), "HOME": "/tmp", "PATH": os.environ["PATH"]},
        cwd="/tmp",
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["imported"] == 0 and seen["pending"] == 0
    [event] = seen["logs"]
    assert event["event"] == "spool_unreadable" and event["error"] == "Permission denied"
    assert "chown" in event["hint"]
    assert seen["problems"] == [
        f"cannot read {spool} (Permission denied): what is spooled there is never imported;"
        " chown it to the worker's user"
    ]


def test_a_commit_whose_answer_was_lost_is_spooled_and_imported_as_one_item(
    db: psycopg.Connection, database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sokratos_worker.errors import DatabaseUnavailable
    from sokratos_worker.store import queue as store

    real = store.enqueue

    def commit_then_drop(*args: object, **kwargs: object) -> int:
        real(*args, **kwargs)  # type: ignore[arg-type]  # autocommit: it landed
        raise DatabaseUnavailable("connection lost after COMMIT (injected)")

    monkeypatch.setattr(store, "enqueue", commit_then_drop)
    spool = tmp_path / "spool"
    result = enqueue_triage(
        database_url, "user: I adopted a cat\nassistant: lovely", spool_dir=spool
    )
    assert result.spooled is not None  # the client cannot know the COMMIT landed
    monkeypatch.setattr(store, "enqueue", real)
    database = Database(database_url, size=2)
    try:
        assert import_spool(spool, database) == 1
    finally:
        database.close()
    assert count(db, "SELECT count(*) FROM pending_triage") == 1  # one item, not two


def test_a_spool_file_is_imported_only_into_the_database_it_was_meant_for(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    from sokratos_worker.config import Settings

    ours = Settings(database_url=database_url).database_identity  # type: ignore[arg-type]
    other = Settings(database_url="postgresql://u:secret@db.example.org/sokratos").database_identity  # type: ignore[arg-type]
    assert other == "postgresql://db.example.org:5432/sokratos"  # no credentials in it
    spool = tmp_path / "spool"
    exchange = {"exchange": "user: my sister moved to Porto\nassistant: noted"}
    for meant_for, key in ((other, "elsewhere"), (ours, "here"), (None, "older-file")):
        spool_enqueue(
            spool, Queue.TRIAGE, exchange, idempotency_key=key, source=None, database=meant_for
        )
    database = Database(database_url, size=2)
    try:
        assert import_spool(spool, database, ours) == 2
        assert import_spool(spool, database, ours) == 0  # the other one stays, said once
    finally:
        database.close()
    keys = {r[0] for r in db.execute("SELECT idempotency_key FROM pending_triage")}
    assert keys == {"here", "older-file"}
    left = [json.loads(p.read_text())["database"] for p in spool.glob("*.json")]
    assert left == [other]
    # status names it, with this database's identity, and the documented fix imports it.
    assert pending_elsewhere(spool, ours) == {other: 1}
    text = render_status(
        {
            "database": "ok", "queues": {}, "failures_24h": {}, "workers": [],
            "email_accounts": [], "embeddings": "off", "spooled": 1,
            "spooled_for_other_databases": pending_elsewhere(spool, ours),
            "database_identity": ours,
        }
    )  # fmt: skip
    assert f"1 of them for {other}, not this database ({ours})" in text
    [path] = spool.glob("*.json")
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "database": ours}))
    database = Database(database_url, size=2)
    try:
        assert import_spool(spool, database, ours) == 1
    finally:
        database.close()
    assert pending_elsewhere(spool, ours) == {}
    assert count(db, "SELECT count(*) FROM pending_triage WHERE idempotency_key = 'elsewhere'") == 1


def test_a_spool_file_another_importer_took_after_the_listing_is_not_a_failure(
    tmp_path: Path, db: psycopg.Connection, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """contract §6: every tick imports the spool idempotently. A file another importer (the
    start tick and the first heartbeat, or two processes on one data directory) took between
    the listing and the read became an 'unreadable' failure, and its rename raised."""
    from sokratos_worker import spool

    good = spool_enqueue(
        tmp_path,
        Queue.TRIAGE,
        {"exchange": "user: hi\nassistant: hello"},
        idempotency_key="k1",
        source=None,
    )
    corrupt = tmp_path / "00000000T000000000000-corrupt.json"
    corrupt.write_text("{not json", encoding="utf-8")
    listed = spool._spooled

    def listed_then_taken(directory: Path) -> list[Path]:
        files = listed(directory)
        monkeypatch.setattr(spool, "_spooled", listed)
        other = Database(database_url, size=2)
        try:
            assert import_spool(tmp_path, other) == 1  # the other importer, in between
        finally:
            other.close()
        return files

    monkeypatch.setattr(spool, "_spooled", listed_then_taken)
    database = Database(database_url, size=2)
    try:
        assert import_spool(tmp_path, database) == 0  # nothing left that was ours to import
    finally:
        database.close()
    assert not good.exists() and not corrupt.exists()
    assert count(db, "SELECT count(*) FROM pending_triage") == 1
    # The corrupt file is one failure (the other importer's), the good one none.
    rows = db.execute("SELECT label FROM failed_operations").fetchall()
    assert rows == [(corrupt.name,)], rows


def test_a_rejected_file_is_one_failure_also_when_its_importer_died_before_deleting_it(
    tmp_path: Path, db: psycopg.Connection, database_url: str
) -> None:
    """An importer killed between recording a corrupt file's failure and deleting the file left
    both behind; the next import recorded the file a second time."""
    from sokratos_worker.store.failures import record_failure

    _write(tmp_path, "1-corrupt.json", "{not json")
    record_failure(
        db, op_type="spool_import", label="1-corrupt.json", error="unreadable spool file: …",
        context={"raw": "{not json"},
    )
    database = Database(database_url, size=2)
    try:
        assert import_spool(tmp_path, database) == 0
    finally:
        database.close()
    assert not (tmp_path / "1-corrupt.json").exists()
    assert count(db, "SELECT count(*) FROM failed_operations") == 1


def test_a_file_set_aside_as_unreadable_and_put_back_is_recorded_with_what_it_holds(
    tmp_path: Path, db: psycopg.Connection, database_url: str
) -> None:
    """`status` tells the operator to make a set-aside file readable and rename it back: if it
    is still not a valid record, its text must be recorded, not dropped as already known."""
    from sokratos_worker.store.failures import record_failure

    record_failure(
        db, op_type="spool_import", label="1-corrupt.json", error="unreadable spool file: …",
        context={"raw": None, "kept_as": str(tmp_path / "1-corrupt.json.unreadable")},
    )
    _write(tmp_path, "1-corrupt.json", "{not json, but the operator can read it now")
    database = Database(database_url, size=2)
    try:
        assert import_spool(tmp_path, database) == 0
    finally:
        database.close()
    raws = [r[0] for r in db.execute(
        "SELECT context_data->>'raw' FROM failed_operations ORDER BY id").fetchall()]
    assert raws == [None, "{not json, but the operator can read it now"]


def test_two_importers_rejecting_the_same_files_record_each_once(
    tmp_path: Path, db: psycopg.Connection, database_url: str
) -> None:
    """Two processes on one data directory (or the start tick and a heartbeat) rejecting the
    same corrupt files at once each recorded them."""
    import threading

    files = 30
    for n in range(files):
        _write(tmp_path, f"{n:02d}-corrupt.json", f'{{"queue": "nowhere", "n": {n}}}')
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def importer() -> None:
        database = Database(database_url, size=2)
        try:
            start.wait(timeout=30)
            import_spool(tmp_path, database)
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)
        finally:
            database.close()

    threads = [threading.Thread(target=importer) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)
    assert not list(tmp_path.glob("*.json"))
    labels = [r[0] for r in db.execute("SELECT label FROM failed_operations").fetchall()]
    assert sorted(labels) == [f"{n:02d}-corrupt.json" for n in range(files)]


# The client checks a payload as the worker reads it, so a certain dead letter is refused at
# once (InvalidPayload naming the field), online and before the spool.

EXCHANGE = "user: my sister Ana moved to Porto\nassistant: noted!"
DOWN = "postgresql://x@127.0.0.1:1/none"

TRIAGE_TYPE_CASES: list[tuple[str, dict[str, Any]]] = [
    ("tools_used", {"tools_used": "false"}),
    ("tools_used", {"tools_used": 1}),
    ("pipeline_id", {"pipeline_id": "42"}),
    ("pipeline_id", {"pipeline_id": True}),
    ("pipeline_id", {"pipeline_id": 1.5}),
    ("pipeline_id", {"pipeline_id": 2**70}),
]


def _triage_pipeline_refuses(payload: dict[str, Any]) -> bool:
    """The triage pipeline's own reads of these fields (pipelines/triage.py)."""
    try:
        fields.optional_bool(payload, "tools_used")
        fields.optional_int(payload, "pipeline_id")
    except InvalidPayload:
        return True
    return False


@pytest.mark.parametrize(("field", "kwargs"), TRIAGE_TYPE_CASES)
def test_a_triage_type_the_worker_dead_letters_is_refused_at_enqueue(
    database_url: str, db: psycopg.Connection, field: str, kwargs: dict[str, Any]
) -> None:
    assert _triage_pipeline_refuses({"exchange": EXCHANGE, **kwargs})  # what the claim would do
    with pytest.raises(InvalidPayload, match=field):
        enqueue_triage(database_url, EXCHANGE, **kwargs)
    assert count(db, "SELECT count(*) FROM pending_triage") == 0


@pytest.mark.parametrize(("field", "kwargs"), TRIAGE_TYPE_CASES[:3])
def test_the_spool_does_not_hold_a_certain_triage_dead_letter_either(
    tmp_path: Path, field: str, kwargs: dict[str, Any]
) -> None:
    spool = tmp_path / "spool"
    with pytest.raises(InvalidPayload, match=field):
        enqueue_triage(DOWN, EXCHANGE, spool_dir=spool, **kwargs)
    assert not spool.exists() or not any(spool.iterdir())


@pytest.mark.parametrize("payload", [["not", "an", "object"], "archive text", None])
def test_a_distillation_payload_that_is_not_an_object_raises_invalid_payload(
    database_url: str, payload: Any
) -> None:
    with pytest.raises(InvalidPayload, match="payload"):
        enqueue_distillation(database_url, payload)


def test_a_lone_surrogate_in_a_distillation_is_escaped_and_queued_as_in_a_triage(
    database_url: str, db: psycopg.Connection
) -> None:
    text = "user: caf\udce9 in Lisbon\nassistant: noted"
    assert enqueue_triage(database_url, text).item_id is not None  # the triage path copes
    done = enqueue_distillation(database_url, {"archive_text": text})
    assert done.item_id is not None
    stored = db.execute("SELECT payload FROM pending_distillation").fetchone()
    assert stored is not None and "\\udce9" in stored[0]["archive_text"]


def test_nul_bytes_cannot_slip_an_oversized_archive_past_the_check(
    database_url: str, db: psycopg.Connection
) -> None:
    """Each NUL is stored as the six characters \\u0000: the check measures what is stored."""
    # 430,000 bytes raw (under 512 kB): stored, each NUL is six characters (~930 kB).
    content = "I moved to Lisbon. " * 20_000 + "\x00" * 50_000
    payload = {"messages": [{"role": "user", "content": content}]}
    assert byte_len(archive_from_payload(payload, datetime.now(UTC)).text) <= MAX_ARCHIVE_BYTES
    try:
        enqueue_distillation(database_url, payload)
    except InvalidPayload:
        return  # refused at once: the producer learns it
    row = db.execute("SELECT payload::text FROM pending_distillation").fetchone()
    assert row is not None
    stored = json.loads(row[0])
    size = byte_len(archive_from_payload(stored, datetime.now(UTC)).text)
    assert size <= MAX_ARCHIVE_BYTES, f"queued, then dead-lettered: the stored archive is {size:,} bytes"


# Passed an open connection where the conninfo goes, the client enqueues in the caller's
# transaction, as the SQL functions do (contract §4): visible and NOTIFYed at its commit.


def _notified(listener: psycopg.Connection, timeout: float) -> list[str]:
    return [n.payload for n in listener.notifies(timeout=timeout, stop_after=1)]


def test_the_item_and_its_notify_arrive_at_the_callers_commit(
    database_url: str, db: psycopg.Connection
) -> None:
    with psycopg.connect(database_url, autocommit=True) as listener, psycopg.connect(
        database_url
    ) as conn:
        listener.execute("LISTEN sokratos_worker")
        conn.execute("CREATE TEMP TABLE handled (id int)")
        conn.execute("INSERT INTO handled VALUES (42)")
        done = enqueue_triage(conn, EXCHANGE, key="msg-42")
        assert done.item_id is not None
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        assert count(db, "SELECT count(*) FROM pending_triage") == 0  # not before the commit
        assert _notified(listener, 0.3) == []
        conn.commit()
        assert count(db, "SELECT count(*) FROM pending_triage") == 1
        assert _notified(listener, 2.0) == ["pending_triage"]


def test_a_rollback_of_the_callers_transaction_leaves_nothing_queued(
    database_url: str, db: psycopg.Connection
) -> None:
    with psycopg.connect(database_url) as conn:
        enqueue_distillation(conn, {"archive_text": "user: hi"}, key="slide-7")
        conn.rollback()
    assert count(db, "SELECT count(*) FROM pending_distillation") == 0
    # The key was not taken either: the same key enqueues afresh.
    assert enqueue_distillation(database_url, {"archive_text": "user: hi"}, key="slide-7").item_id
    assert count(db, "SELECT count(*) FROM pending_distillation") == 1


@pytest.mark.parametrize("autocommit", [True, False])
def test_the_callers_connection_stays_usable(database_url: str, autocommit: bool) -> None:
    with psycopg.connect(database_url, autocommit=autocommit) as conn:
        enqueue_triage(conn, EXCHANGE)
        assert not conn.closed
        conn.execute("SELECT 1")


def test_a_callers_connection_is_never_spooled_for(database_url: str, tmp_path: Path) -> None:
    """The caller's transaction decides what a failure means: no spool, no session settings."""
    with psycopg.connect(database_url) as conn:
        with pytest.raises(TypeError, match="spool_dir"):
            enqueue_triage(conn, EXCHANGE, spool_dir=tmp_path / "spool")
        with pytest.raises(TypeError, match="lock_timeout_ms"):
            enqueue_triage(conn, EXCHANGE, lock_timeout_ms=5000)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert not (tmp_path / "spool").exists()
