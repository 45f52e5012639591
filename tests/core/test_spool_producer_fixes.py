"""The producer path's spool (session 36): a file the database refuses for its size, files
meant for another database, the client's identity, its spelling, long keys, undeletable files.

Real PostgreSQL throughout; a size the database refuses is stood in for by a trigger raising
PostgreSQL's own 54000, so the test holds kilobytes, not 256 MB.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import psycopg
import pytest
from structlog.testing import capture_logs

from sokratos_worker.config import Settings
from sokratos_worker.model import Queue
from sokratos_worker.spool import import_spool, pending_elsewhere, pending_files, spool_enqueue
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
    # `failed retry` says where the file is and what to do (it said its content was in
    # `failed show`, which holds only the note).
    from sokratos_worker.store.failures import retry_failure

    (failure_id,) = db.execute("SELECT id FROM failed_operations").fetchone() or (0,)
    with psycopg.connect(database_url) as conn:
        said = retry_failure(conn, failure_id).message
    assert "too large" in said and str(kept) in said and "split" in said, said


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


def _old_format(spool: Path, name: str, meant_for: str | None, key: str) -> Path:
    """A file as versions before this one wrote it: its "database" after the payload."""
    spool.mkdir(parents=True, exist_ok=True)
    record = {
        "queue": "pending_triage",
        "payload": {"exchange": "user: my sister moved to Porto\nassistant: noted"},
        "idempotency_key": key,
        "source": None,
        "spooled_at": "2026-01-01T00:00:00+00:00",
        "database": meant_for,
    }
    path = spool / name
    path.write_text(json.dumps(record), encoding="utf-8")
    return path


def _slow_parse(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Each parse of a whole file takes 0.3 s (a large conversation); returns the count."""
    from sokratos_worker import jsontext
    from sokratos_worker import spool as spool_module

    parsed: list[int] = []
    real = jsontext.loads

    def slow(text: str) -> object:
        if text.lstrip().startswith("{"):  # (a whole file, not a head's one string)
            parsed.append(1)
            time.sleep(0.3)
        return real(text)

    monkeypatch.setattr(spool_module.jsontext, "loads", slow)
    monkeypatch.setattr(spool_module, "SPOOL_IMPORT_BUDGET_S", 1.0)
    return parsed


def test_files_for_another_database_are_not_parsed_and_hold_up_nothing(
    db: psycopg.Connection, database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """F2: every foreign file was parsed whole at every tick, spending the import's 5 s, so
    the files for this database behind them were never reached."""
    ours = Settings(database_url=database_url).database_identity  # type: ignore[arg-type]
    other = "postgresql://db.example.org:5432/sokratos"
    spool = tmp_path / "spool"
    for n in range(10):
        _spool(spool, "user: elsewhere\nassistant: ok", f"elsewhere-{n}", database=other)
    _spool(spool, "user: my sister Ana moved to Porto\nassistant: noted!", "here", database=ours)
    parsed = _slow_parse(monkeypatch)
    database = Database(database_url, size=2)
    try:
        assert import_spool(spool, database, ours) == 1
    finally:
        database.close()
    assert parsed == [1]  # this database's file only
    assert count(db, "SELECT count(*) FROM pending_triage") == 1
    assert pending_files(spool) == 10
    assert pending_elsewhere(spool, ours) == {other: 10}


def test_an_earlier_versions_foreign_files_are_parsed_once_per_process(
    db: psycopg.Connection, database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """F2, files written before the database came first: parsed at most once by a process,
    so the files behind them are reached within a few ticks; one edited to name this
    database (the documented fix) is parsed again and imported."""
    ours = Settings(database_url=database_url).database_identity  # type: ignore[arg-type]
    other = "postgresql://db.example.org:5432/sokratos"
    spool = tmp_path / "spool"
    foreign = [_old_format(spool, f"0-{n:02d}.json", other, f"elsewhere-{n}") for n in range(10)]
    _old_format(spool, "1-here.json", ours, "here")
    parsed = _slow_parse(monkeypatch)
    database = Database(database_url, size=2)
    try:
        ticks = 0
        while count(db, "SELECT count(*) FROM pending_triage") == 0 and ticks < 6:
            import_spool(spool, database, ours)
            ticks += 1
        assert count(db, "SELECT count(*) FROM pending_triage") == 1, ticks
        assert len(parsed) == 11  # each file once
        assert import_spool(spool, database, ours) == 0
        assert len(parsed) == 11
        record = json.loads(foreign[0].read_text())
        foreign[0].write_text(json.dumps({**record, "database": ours, "edited": True}))
        assert import_spool(spool, database, ours) == 1
    finally:
        database.close()
    keys = {r[0] for r in db.execute("SELECT idempotency_key FROM pending_triage")}
    assert keys == {"here", "elsewhere-0"}


def test_the_python_client_spools_for_the_database_spool_for_names(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """F3: enqueue_triage/enqueue_distillation had no spool_for, so a producer could not keep
    its files to one database. It is not derived from the conninfo (a review: a producer
    spelling the server `localhost`, or reaching it through a pooler, while the worker spells
    it `127.0.0.1`, left its files to no worker): without it, any worker imports them."""
    from sokratos_worker.client import enqueue_distillation, enqueue_triage
    from tests.support.ports import unused_port

    down = f"postgresql://nobody@127.0.0.1:{unused_port()}/elsewhere?connect_timeout=2"
    spool = tmp_path / "spool"
    theirs = Settings(database_url=down).database_identity  # type: ignore[arg-type]
    triage = enqueue_triage(
        down, "user: I moved to Lisbon\nassistant: noted", spool_dir=spool, spool_for=theirs
    )
    archive = enqueue_distillation(
        down, {"archive_text": "user: hi"}, spool_dir=spool, spool_for=theirs
    )
    anywhere = enqueue_triage(down, "user: my cat is Tom\nassistant: noted", spool_dir=spool)
    for spooled in (triage.spooled, archive.spooled):
        assert spooled is not None
        assert json.loads(spooled.read_text())["database"] == theirs
    assert anywhere.spooled is not None
    assert json.loads(anywhere.spooled.read_text())["database"] is None
    ours = Settings(database_url=database_url).database_identity  # type: ignore[arg-type]
    database = Database(database_url, size=2)
    try:
        assert import_spool(spool, database, ours) == 1  # only the file naming none
        assert import_spool(spool, database, theirs) == 2  # (as a worker on that one would)
    finally:
        database.close()
    assert count(db, "SELECT count(*) FROM pending_triage") == 2
    assert count(db, "SELECT count(*) FROM pending_distillation") == 1


def test_one_database_spelled_differently_is_one_identity(tmp_path: Path) -> None:
    """F4: the identity was the URL's or data directory's literal text."""
    real = tmp_path / "data"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)

    def embedded(data_dir: Path | str) -> str:
        return Settings(database_url=None, data_dir=data_dir).database_identity  # type: ignore[arg-type]

    def external(url: str) -> str:
        return Settings(database_url=url).database_identity  # type: ignore[arg-type]

    assert embedded(tmp_path / "link") == embedded(real) == f"embedded:{real.resolve()}"
    assert embedded(f"{tmp_path}/../{tmp_path.name}/data") == embedded(real)
    assert external(f"postgresql:///db?host={real}/") == external(f"postgresql:///db?host={real}")
    assert external(f"host={tmp_path}/link dbname=db") == external(f"host={real} dbname=db")
    assert external("postgresql://u@DB.Example.org/x") == external("postgresql://db.example.org/x")
    assert external("postgresql://db.example.org/x") != external("postgresql://db.example.org/y")


def test_files_named_with_an_earlier_spelling_are_still_imported_here(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """F4: files written with the old literal spelling (a trailing slash, a symlinked data
    directory, capitals) match the normalised identity, as they matched before."""
    real = tmp_path / "data"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    worker = Settings(database_url=None, data_dir=tmp_path / "link").database_identity  # type: ignore[arg-type]
    spool = tmp_path / "spool"
    _old_format(spool, "0.json", f"embedded:{tmp_path}/link", "as-before")
    _old_format(spool, "1.json", f"embedded:{tmp_path}/../{tmp_path.name}/data", "dotted")
    _old_format(spool, "2.json", "embedded:/somewhere/else", "elsewhere")
    database = Database(database_url, size=2)
    try:
        assert import_spool(spool, database, worker) == 2
    finally:
        database.close()
    keys = {r[0] for r in db.execute("SELECT idempotency_key FROM pending_triage")}
    assert keys == {"as-before", "dotted"}
    assert pending_elsewhere(spool, worker) == {"embedded:/somewhere/else": 1}


def test_a_python_producer_on_the_embedded_servers_socket_spools_for_it(tmp_path: Path) -> None:
    """F3 with the embedded PostgreSQL: the identity the client derives from its socket URL is
    the embedded worker's, so the file is imported there as its null file was before."""
    from sokratos_worker.config import database_identity_of, identities_match

    worker = Settings(database_url=None, data_dir=tmp_path).database_identity  # type: ignore[arg-type]
    socket_url = f"postgresql://postgres:@/postgres?host={tmp_path}/postgres"
    assert identities_match(database_identity_of(socket_url), worker)
    assert not identities_match(database_identity_of(socket_url), f"embedded:{tmp_path}/x")


def test_a_key_too_long_for_the_database_is_refused_before_it_is_spooled(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """F5: a key over ~2.7 KB is refused directly (54000, the index row) but was spooled, and
    the import turned it into a spool_import failure `failed retry` does not replay."""
    import secrets

    from sokratos_worker.cli_enqueue import _refused_enqueue
    from sokratos_worker.client import enqueue, enqueue_triage
    from sokratos_worker.errors import InvalidPayload
    from tests.support.ports import unused_port

    key = secrets.token_hex(1600)  # 3,200 bytes that do not compress
    down = f"postgresql://nobody@127.0.0.1:{unused_port()}/x?connect_timeout=2"
    spool = tmp_path / "spool"
    with pytest.raises(InvalidPayload, match="use a shorter key") as refused:
        enqueue_triage(down, "user: hi there\nassistant: hello", key=key, spool_dir=spool)
    assert "3,200 bytes" in str(refused.value)
    assert pending_files(spool) == 0
    # With the database up, the client refuses it alike (refused only while the database
    # was down, an enqueue it takes was dropped as bad input: a review).
    with pytest.raises(InvalidPayload, match="use a shorter key"):
        enqueue(database_url, Queue.TRIAGE, {"exchange": "user: hi\nassistant: ok"}, key=key)
    # The database's own refusal (a producer calling the SQL function): the command's
    # message for it says the same.
    with pytest.raises(psycopg.errors.ProgramLimitExceeded) as direct:
        db.execute(
            "SELECT sokratos_enqueue_triage(%s::jsonb, %s)",
            ('{"exchange": "user: hi\\nassistant: ok"}', key),
        )
    message = _refused_enqueue(direct.value)
    assert "--key" in message and "use a shorter key" in message and "54000" in message
    assert count(db, "SELECT count(*) FROM pending_triage") == 0
    ok = enqueue_triage(down, "user: hi there\nassistant: hello", key="k" * 2000, spool_dir=spool)
    assert ok.spooled is not None  # (2,000 bytes are spooled)


def test_a_file_the_worker_cannot_delete_does_not_stop_the_import(
    db: psycopg.Connection, database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """F6: a PermissionError deleting an imported file (or renaming a rejected one) escaped
    import_spool, and every tick stopped at that file."""
    spool = tmp_path / "spool"
    stuck = _spool(spool, "user: my sister Ana moved to Porto\nassistant: noted!", "stuck")
    refused = _old_format(spool, "0-refused.json", None, "bad")  # (first: no exchange)
    refused.write_text(refused.read_text().replace('"exchange"', '"nothing"'))
    after = _spool(spool, "user: I adopted a cat\nassistant: lovely", "after")
    real_unlink = Path.unlink

    def unlink(self: Path, missing_ok: bool = False) -> None:
        if self.name in (stuck.name, refused.name):
            raise PermissionError(13, "Permission denied", str(self))
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    database = Database(database_url, size=2)
    try:
        with capture_logs() as logs:
            assert import_spool(spool, database) == 1  # "after"
            assert import_spool(spool, database) == 0  # the stuck ones again: no-ops
        monkeypatch.setattr(Path, "unlink", real_unlink)
        import_spool(spool, database)  # the owner fixed: both go
    finally:
        database.close()
    said = [e for e in logs if e["event"] == "spool_file_undeletable"]
    assert sorted(e["path"] for e in said) == sorted([str(stuck), str(refused)])  # once each
    assert "chown" in said[0]["hint"]
    assert not stuck.exists() and not refused.exists() and not after.exists()
    keys = [r[0] for r in db.execute("SELECT idempotency_key FROM pending_triage")]
    assert sorted(keys) == ["after", "stuck"]  # nothing doubled
    assert count(db, "SELECT count(*) FROM failed_operations") == 1  # recorded once


def test_enqueue_that_may_not_write_the_workers_spool_says_whose_it_is(tmp_path: Path) -> None:
    """F9: another user's `enqueue` while the database is down was told "try again later",
    which never works: the spool belongs to the worker's user (contract §4)."""
    import os
    import shutil
    import subprocess
    import sys
    import tempfile

    from tests.support.daemon import ROOT
    from tests.support.ports import unused_port

    base = Path(tempfile.mkdtemp(prefix="sokratos-spool-"))  # (pytest's tmp_path is 0700)
    try:
        base.chmod(0o755)
        (base / "spool").mkdir(mode=0o700)  # the worker's (root's here)
        env = {
            "PATH": os.environ["PATH"],
            "HOME": "/tmp",
            "PYTHONPATH": str(ROOT),
            "SOKRATOS_DATA_DIR": str(base),
            "SOKRATOS_DATABASE_URL": f"postgresql://x@127.0.0.1:{unused_port()}/none",
            "SOKRATOS_LOG_FORMAT": "json",
        }
        done = subprocess.run(
            [sys.executable, "-m", "sokratos_worker", "enqueue", "triage", "--exchange",
             "user: hi\nassistant: hello"],
            env=env, user=65534, group=65534, cwd="/tmp", capture_output=True, text=True,
            timeout=120, check=False,
        )  # fmt: skip
    finally:
        shutil.rmtree(base)
    assert done.returncode == 75, done.stderr
    assert "Permission denied" in done.stderr and "try again later" not in done.stderr
    assert "belongs to the worker's user" in done.stderr and "SQL functions" in done.stderr


def test_a_payload_the_database_must_refuse_for_its_size_is_not_spooled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """F1, the producer's side: a payload over jsonb's 256 MB (here a limit made small) would
    only be set aside by the import; the spool refuses it, saying why."""
    from sokratos_worker import client
    from sokratos_worker.errors import InvalidPayload

    monkeypatch.setattr(client, "JSONB_MAX_BYTES", 1000, raising=False)
    spool = tmp_path / "spool"
    with pytest.raises(InvalidPayload, match=r"would refuse it \(54000\): split it"):
        client.spool(spool, Queue.TRIAGE, {"exchange": "user: " + "é" * 600})
    assert pending_files(spool) == 0
    assert client.spool(spool, Queue.TRIAGE, {"exchange": "user: " + "é" * 400}).spooled


def test_a_file_whose_rejection_failed_is_tried_again_after_a_while(
    db: psycopg.Connection, database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Passed over until a restart, a file whose failure row met a passing error (a statement
    an administrator cancelled) had no failed_operations row for the life of the process (a
    review): it is tried again once REJECTION_RETRY_S is over."""
    from sokratos_worker import spool as spool_module

    db.execute(_TOO_LARGE.replace("%%", "%").replace("TOO-LARGE", "spool_import"))
    spool = tmp_path / "spool"
    bad = spool_enqueue(spool, Queue.TRIAGE, {"nope": 1}, idempotency_key="bad", source=None)
    database = Database(database_url, size=2)
    try:
        assert import_spool(spool, database) == 0
        assert bad.exists()
        db.execute("DROP TRIGGER test_refuse_too_large ON failed_operations")  # (it passed)
        assert import_spool(spool, database) == 0
        assert bad.exists()  # (still within its wait)
        monkeypatch.setattr(spool_module, "REJECTION_RETRY_S", 0.0)
        assert import_spool(spool, database) == 0
    finally:
        database.close()
    assert not bad.exists()
    assert count(db, "SELECT count(*) FROM failed_operations WHERE op_type = 'spool_import'") == 1


def test_an_embedded_worker_in_a_directory_with_a_space_compares_identities(
    tmp_path: Path,
) -> None:
    """The socket URL was built unquoted: a data directory with a space raised at every file
    meant for another database, stopping the import there and `status` (a review)."""
    from sokratos_worker.config import identities_match

    assert not identities_match("postgresql://db:5432/x", f"embedded:{tmp_path}/my data")


def test_a_spool_file_missing_a_field_is_rejected_naming_the_field(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """The rejection said "unreadable spool file: 'idempotency_key'" (a bare KeyError)."""
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "1-no-key.json").write_text(
        json.dumps({"queue": "pending_triage", "payload": {"exchange": "user: hi"}})
    )
    database = Database(database_url, size=2)
    try:
        assert import_spool(spool, database) == 0
    finally:
        database.close()
    (error,) = db.execute(
        "SELECT error_message FROM failed_operations WHERE op_type = 'spool_import'"
    ).fetchone() or ("",)
    assert error == "unreadable spool file: no 'idempotency_key' field", error


def test_a_data_directory_that_is_not_utf8_can_be_spooled_for(tmp_path: Path) -> None:
    """Its identity (`embedded:` + the path, a lone surrogate for the byte) could not be
    written: UnicodeEncodeError and a partial temporary file left in the spool (a hunt)."""
    from sokratos_worker.config import embedded_identity, identities_match

    data = os.fsdecode(os.fsencode(str(tmp_path)) + b"/data-\xff")
    identity = embedded_identity(data)
    assert identity.endswith("/data-\\xff"), identity
    spool = tmp_path / "spool"
    path = _spool(spool, "user: hi\nassistant: ok", "k", database=identity)
    assert json.loads(path.read_text())["database"] == identity
    assert identities_match(identity, embedded_identity(data))
    assert sorted(p.name for p in spool.iterdir()) == [path.name]  # no temporary file left


def test_an_abandoned_spool_write_is_removed_after_an_hour(
    database_url: str, tmp_path: Path
) -> None:
    """A producer killed mid-write left `.NAME.json.tmp` (part of a conversation, mode 0600)
    for ever, unseen by status (a hunt); it was never told "spooled", so nothing is lost."""
    from sokratos_worker import spool as spool_module

    spool = tmp_path / "spool"
    spool.mkdir()
    old = spool / ".20260101T000000000000-deadbeef.json.tmp"
    old.write_text('{"database": null, "queue": "pending_triage", "payload": {"exch')
    hour_ago = time.time() - spool_module.ABANDONED_WRITE_AGE_S - 60
    os.utime(old, (hour_ago, hour_ago))
    fresh = spool / ".20261206T000000000000-cafecafe.json.tmp"  # (a write in progress)
    fresh.write_text("{")
    database = Database(database_url, size=2)
    try:
        with capture_logs() as logs:
            assert import_spool(spool, database) == 0
    finally:
        database.close()
    assert not old.exists() and fresh.exists()
    assert [e["path"] for e in logs if e["event"] == "spool_abandoned_write_removed"] == [
        str(old)
    ]
