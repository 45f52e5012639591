"""A blank idempotency key (an empty shell variable) is refused, never taken as a real key.

Taken as a key, "" was accepted once for good: every later enqueue with an empty key printed
the first item's id, exit 0, and its own text was dropped without a word. A key PostgreSQL
cannot store (NUL, a lone surrogate) is refused the same way, before the database or spool.
"""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from sokratos_worker import client
from sokratos_worker.errors import InvalidPayload
from sokratos_worker.model import Queue
from sokratos_worker.spool import import_spool
from sokratos_worker.store.connection import Database
from tests.support.operator import cli_env, run_cli


def test_an_empty_key_never_swallows_a_different_exchange(
    tmp_path: Path, database_url: str
) -> None:
    env = cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url)
    first = run_cli(
        ["enqueue", "triage", "--exchange", "user: my sister Ana moved to Porto\nassistant: noted!",
         "--key", ""],
        env,
    )
    second = run_cli(
        ["enqueue", "triage", "--exchange", "user: I start at Example GmbH on Monday\nassistant: congrats!",
         "--key", ""],
        env,
    )
    for done in (first, second):
        assert done.returncode == 1, (done.stdout, done.stderr)
        assert done.stderr.strip() == (
            "sokratos-worker: invalid payload: --key is blank (an empty variable?): give the"
            " item's key, or leave --key out"
        )
    with psycopg.connect(database_url) as conn:
        queued = conn.execute("SELECT count(*) FROM pending_triage").fetchone()
    assert queued == (0,)


@pytest.mark.parametrize("kind", ["triage", "distillation"])
def test_a_blank_key_is_refused_before_the_database_or_the_spool(
    tmp_path: Path, kind: str
) -> None:
    # The database is down: a blank key must not reach the spool either.
    env = cli_env(tmp_path, SOKRATOS_DATABASE_URL="postgresql://x@127.0.0.1:1/none")
    if kind == "triage":
        args = ["enqueue", "triage", "--exchange", "user: hi\nassistant: hello", "--key", "  "]
        done = run_cli(args, env)
    else:
        args = ["enqueue", "distillation", "--file", "-", "--key", "\t"]
        done = run_cli(args, env, stdin='{"messages": [{"role": "user", "content": "hi"}]}')
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "--key is blank" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "data" / "spool").exists()


@pytest.mark.parametrize("key", ["", " ", "\n"])
def test_the_python_client_refuses_a_blank_key(tmp_path: Path, key: str) -> None:
    payload = client.triage_payload("user: hi\nassistant: hello")
    # Refused before connecting: this URL would otherwise spool it.
    with pytest.raises(InvalidPayload, match="key is blank"):
        client.enqueue(
            "postgresql://x@127.0.0.1:1/none", Queue.TRIAGE, payload, key=key, spool_dir=tmp_path
        )
    with pytest.raises(InvalidPayload, match="key is blank"):
        client.spool(tmp_path, Queue.TRIAGE, payload, key=key)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("key", ["", "  ", "\t\n"])
def test_postgresql_refuses_a_blank_key_from_the_enqueue_functions_and_direct_inserts(
    db: psycopg.Connection, key: str
) -> None:
    """The SQL level too (a Go producer calls the functions or inserts directly): refused with
    22023 naming the blank key, nothing queued and no key recorded."""
    statements = [
        ("SELECT sokratos_enqueue_triage('{\"exchange\": \"user: a\\nassistant: b\"}', %s)",),
        ("SELECT sokratos_enqueue_distillation('{\"archive_text\": \"a\"}', %s)",),
        ("INSERT INTO pending_triage (payload, idempotency_key) VALUES ('{}', %s)",),
        ("INSERT INTO pending_distillation (payload, idempotency_key) VALUES ('{}', %s)",),
    ]
    for (statement,) in statements:
        refused = pytest.raises(psycopg.errors.InvalidParameterValue, match="key is blank")
        with refused, db.transaction():
            db.execute(statement, (key,))
    assert db.execute(
        "SELECT (SELECT count(*) FROM pending_triage) + (SELECT count(*) FROM pending_distillation)"
        " + (SELECT count(*) FROM sokratos_idempotency_keys)"
    ).fetchone() == (0,)


# A key PostgreSQL cannot store (NUL, a lone surrogate) is refused the same way, before the
# database (DataError / UnicodeEncodeError) or the spool (a file the import would refuse).
UNSTORABLE_KEYS = ["msg-\x0042", "msg-\udcff42"]
EXCHANGE = "user: I start at Example GmbH on Monday\nassistant: congrats!"


@pytest.mark.parametrize("key", UNSTORABLE_KEYS, ids=["nul", "surrogate"])
def test_a_key_postgresql_cannot_store_raises_invalid_payload(
    database_url: str, db: psycopg.Connection, key: str
) -> None:
    with pytest.raises(InvalidPayload, match="key"):
        client.enqueue_triage(database_url, EXCHANGE, key=key)
    assert db.execute("SELECT count(*) FROM pending_triage").fetchone() == (0,)


@pytest.mark.parametrize("key", UNSTORABLE_KEYS, ids=["nul", "surrogate"])
def test_a_spooled_item_with_such_a_key_is_imported_not_dead_lettered(
    tmp_path: Path, database_url: str, db: psycopg.Connection, key: str
) -> None:
    spool = tmp_path / "spool"
    try:
        done = client.enqueue_triage(
            "postgresql://x@127.0.0.1:1/none", EXCHANGE, key=key, spool_dir=spool
        )
    except InvalidPayload:
        assert not spool.exists() or not any(spool.iterdir())
        return
    assert done.spooled is not None  # the producer was told: safe on disk
    database = Database(database_url, size=1)
    try:
        import_spool(spool, database)
    finally:
        database.close()
    assert db.execute("SELECT count(*) FROM failed_operations").fetchone() == (0,)
    assert db.execute("SELECT count(*) FROM pending_triage").fetchone() == (1,)


@pytest.mark.parametrize(
    ("key", "problem"),
    [("msg-\x0042", "contains a NUL character"), ("msg-\udcff42", "contains a lone surrogate")],
    ids=["nul", "surrogate"],
)
def test_the_refusal_names_what_is_wrong_with_the_key(
    tmp_path: Path, key: str, problem: str
) -> None:
    payload = client.triage_payload("user: hi\nassistant: hello")
    with pytest.raises(InvalidPayload, match=f"key {problem}"):
        client.enqueue(
            "postgresql://x@127.0.0.1:1/none", Queue.TRIAGE, payload, key=key, spool_dir=tmp_path
        )
    with pytest.raises(InvalidPayload, match=f"key {problem}"):
        client.spool(tmp_path, Queue.TRIAGE, payload, key=key)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("source", ["email\x00", "chat"], ids=["nul", "unknown"])
def test_a_source_that_is_neither_conversation_nor_email_is_named_before_the_database(
    database_url: str, db: psycopg.Connection, source: str
) -> None:
    # A NUL in the source reached psycopg, which refused it with a bare DataError.
    payload = client.triage_payload(EXCHANGE)
    with pytest.raises(InvalidPayload, match="source must be conversation or email"):
        client.enqueue(database_url, Queue.TRIAGE, payload, source=source)
    with psycopg.connect(database_url) as conn, pytest.raises(InvalidPayload, match="source"):
        client.enqueue(conn, Queue.TRIAGE, payload, source=source)
    assert db.execute("SELECT count(*) FROM pending_triage").fetchone() == (0,)


@pytest.mark.parametrize(
    ("exchange", "stdin"), [("  \n", None), ("-", "\n\t\n")], ids=["argument", "stdin"]
)
def test_a_blank_exchange_is_refused_before_the_database_or_the_spool(
    tmp_path: Path, exchange: str, stdin: str | None
) -> None:
    """A blank exchange (an empty variable, an empty pipe) is nothing to triage: refused
    naming --exchange, never spooled to be dead-lettered by a worker later."""
    env = cli_env(tmp_path, SOKRATOS_DATABASE_URL="postgresql://x@127.0.0.1:1/none")
    done = run_cli(["enqueue", "triage", "--exchange", exchange], env, stdin=stdin)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stderr.strip() == "sokratos-worker: invalid payload: --exchange is empty"
    assert not (tmp_path / "data" / "spool").exists()
