"""The producer path's spool (session 36): a file the database refuses for its size, files
meant for another database, the client's identity, its spelling, long keys, undeletable files.

Real PostgreSQL throughout; a size the database refuses is stood in for by a trigger raising
PostgreSQL's own 54000, so the test holds kilobytes, not 256 MB.
"""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
from structlog.testing import capture_logs

from sokratos_worker.model import Queue
from sokratos_worker.spool import import_spool, pending_files, spool_enqueue
from sokratos_worker.store.connection import Database
from tests.support.db import count

_TOO_LARGE = """
CREATE FUNCTION test_refuse_too_large() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF to_jsonb(NEW)::text LIKE '%%TOO-LARGE%%' THEN
    RAISE EXCEPTION 'string too long to represent as jsonb string'
      USING ERRCODE = 'program_limit_exceeded';
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER test_refuse_too_large BEFORE INSERT ON pending_triage
  FOR EACH ROW EXECUTE FUNCTION test_refuse_too_large();
CREATE TRIGGER test_refuse_too_large BEFORE INSERT ON failed_operations
  FOR EACH ROW EXECUTE FUNCTION test_refuse_too_large();
"""


def _spool(spool: Path, exchange: str, key: str, database: str | None = None) -> Path:
    return spool_enqueue(
        spool,
        Queue.TRIAGE,
        {"exchange": exchange},
        idempotency_key=key,
        source=None,
        database=database,
    )


def test_a_file_too_large_for_the_database_does_not_block_the_files_behind_it(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """F1: the import's 54000 came back when its failure was recorded with the same payload,
    escaped import_spool, and the file stayed first at every tick."""
    db.execute(_TOO_LARGE.replace("%%", "%"))
    spool = tmp_path / "spool"
    large = _spool(spool, "user: TOO-LARGE " + "x" * 5000 + "\nassistant: ok", "large")
    _spool(spool, "user: my sister Ana moved to Porto\nassistant: noted!", "after")
    database = Database(database_url, size=2)
    try:
        with capture_logs() as logs:
            assert import_spool(spool, database) == 1
            assert import_spool(spool, database) == 0  # nothing left: no second failure
    finally:
        database.close()
    assert count(db, "SELECT count(*) FROM pending_triage WHERE idempotency_key = 'after'") == 1
    assert pending_files(spool) == 0
    kept = Path(f"{large}.refused")
    assert kept.exists() and json.loads(kept.read_text())["idempotency_key"] == "large"
    [(label, error, context)] = db.execute(
        "SELECT label, error_message, context_data FROM failed_operations"
        " WHERE op_type = 'spool_import'"
    ).fetchall()
    assert label == large.name and "54000" in error
    assert "TOO-LARGE" not in json.dumps(context)  # what the database refused is not in it
    assert context["idempotency_key"] == "large" and context["set_aside_as"] == str(kept)
    assert "bytes" in context["payload_omitted"]
    assert [e for e in logs if e["event"] == "spool_file_rejected"]


def test_a_rejection_that_fails_does_not_stop_the_files_after_it(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """F1: an error recording the failure itself (here even the note is refused) leaves the
    file where it is, said, and the files after it are imported."""
    db.execute(_TOO_LARGE.replace("%%", "%").replace("TOO-LARGE", "spool_import"))
    spool = tmp_path / "spool"
    first = spool_enqueue(spool, Queue.TRIAGE, {"nope": 1}, idempotency_key="bad", source=None)
    _spool(spool, "user: my sister Ana moved to Porto\nassistant: noted!", "after")
    database = Database(database_url, size=2)
    try:
        with capture_logs() as logs:
            assert import_spool(spool, database) == 1
            assert import_spool(spool, database) == 0
    finally:
        database.close()
    assert count(db, "SELECT count(*) FROM pending_triage WHERE idempotency_key = 'after'") == 1
    assert first.exists()  # nothing lost
    failed = [e for e in logs if e["event"] == "spool_file_rejection_failed"]
    assert len(failed) == 1 and failed[0]["path"] == str(first)  # said once, not every tick


def test_status_names_a_file_set_aside_as_too_large(tmp_path: Path) -> None:
    from sokratos_worker.spool import spool_problems

    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "1.json.refused").write_text("{}")
    [problem] = spool_problems(spool)
    assert "1 spool files set aside as too large for the database (1.json.refused" in problem
