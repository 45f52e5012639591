"""sql/roles.sql against a real PostgreSQL: the producer can only enqueue, the worker can work
the queues but not change the schema.

Roles are cluster-wide, so the script must be idempotent: every test applies it (twice here and
there) to its own fresh database on the shared server.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import errors

pytestmark = pytest.mark.postgres

ROLES_SQL = (Path(__file__).resolve().parents[2] / "sql" / "roles.sql").read_text("utf-8")
TRIAGE = '{"exchange": "user: I moved to Lisbon in May\\nassistant: Noted."}'


@pytest.fixture
def conn(database_url: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(database_url, autocommit=True) as connection:
        connection.execute(ROLES_SQL)
        yield connection


def _as(conn: psycopg.Connection, role: str) -> None:
    conn.execute("RESET ROLE")
    conn.execute(f"SET ROLE {role}")


def test_script_is_idempotent(conn: psycopg.Connection) -> None:
    conn.execute(ROLES_SQL)
    conn.execute(ROLES_SQL)
    rows = conn.execute(
        "SELECT rolname, rolcanlogin, rolsuper, rolcreatedb, rolcreaterole FROM pg_roles"
        " WHERE rolname LIKE 'sokratos_%' ORDER BY rolname"
    ).fetchall()
    assert rows == [
        ("sokratos_producer", True, False, False, False),
        ("sokratos_worker", True, False, False, False),
    ]


def test_enqueue_functions_are_security_definer(conn: psycopg.Connection) -> None:
    rows = conn.execute(
        "SELECT proname, prosecdef, proconfig FROM pg_proc"
        " WHERE proname LIKE 'sokratos_enqueue%' ORDER BY proname"
    ).fetchall()
    assert [r[0] for r in rows] == [
        "sokratos_enqueue",
        "sokratos_enqueue_distillation",
        "sokratos_enqueue_triage",
    ]
    for name, secdef, config in rows:
        assert secdef is True
        # (sokratos_enqueue is planned without sequential scans too: sql/0048)
        extra = ["enable_seqscan=off"] if name == "sokratos_enqueue" else []
        assert config == ["search_path=public, pg_temp", *extra]


def test_producer_can_only_enqueue(conn: psycopg.Connection) -> None:
    _as(conn, "sokratos_producer")
    item_id = conn.execute("SELECT sokratos_enqueue_triage(%s::jsonb)", (TRIAGE,)).fetchone()
    assert item_id is not None
    assert item_id[0] > 0
    again = conn.execute(
        "SELECT sokratos_enqueue_triage(%s::jsonb, 'key-1'),"
        " sokratos_enqueue_triage(%s::jsonb, 'key-1')",
        (TRIAGE, TRIAGE),
    ).fetchone()
    assert again is not None
    assert again[0] == again[1]
    archive = conn.execute(
        "SELECT sokratos_enqueue_distillation(%s::jsonb)", ('{"archive_text": "a"}',)
    ).fetchone()
    assert archive is not None and archive[0] is not None

    # A bad payload still gets its clear error, not a permission error.
    with pytest.raises(errors.InvalidParameterValue):
        conn.execute("SELECT sokratos_enqueue_triage('{}'::jsonb)")

    forbidden = [
        "SELECT * FROM pending_triage",
        "INSERT INTO pending_triage (payload) VALUES ('{}')",
        "DELETE FROM pending_distillation",
        "SELECT * FROM memories",
        "INSERT INTO memories (summary) VALUES ('x')",
        "SELECT * FROM work_outcomes",
        "SELECT * FROM sokratos_idempotency_keys",
        "SELECT sokratos_enqueue('pending_triage', '{\"exchange\": \"x\"}', NULL, 'conversation')",
        "SELECT nextval('pending_triage_id_seq')",
    ]
    for statement in forbidden:
        with pytest.raises(errors.InsufficientPrivilege):
            conn.execute(statement)

    conn.execute("RESET ROLE")
    count = conn.execute("SELECT count(*) FROM pending_triage").fetchone()
    assert count == (2,)
    archives = conn.execute("SELECT id FROM pending_distillation").fetchall()
    assert archives == [(archive[0],)]


def test_worker_works_the_queues_but_cannot_change_the_schema(
    conn: psycopg.Connection,
) -> None:
    _as(conn, "sokratos_worker")
    row = conn.execute("SELECT sokratos_enqueue_triage(%s::jsonb)", (TRIAGE,)).fetchone()
    assert row is not None
    item_id = row[0]
    # Claim, as the queue code does: lease the row under SKIP LOCKED.
    claimed = conn.execute(
        """UPDATE pending_triage SET lease_owner = 'w1', attempts = attempts + 1,
                  lease_expires_at = now() + interval '5 minutes'
           WHERE id = (SELECT id FROM pending_triage WHERE run_after <= now()
                       ORDER BY run_after, id FOR UPDATE SKIP LOCKED LIMIT 1)
           RETURNING id""",
    ).fetchone()
    assert claimed == (item_id,)
    # Settle: a memory, the outcome, the item gone, in one transaction.
    with conn.transaction():
        memory = conn.execute(
            "INSERT INTO memories (summary, origin) VALUES ('lives in Lisbon', %s) RETURNING id",
            (f"pending_triage:{item_id}:0",),
        ).fetchone()
        assert memory is not None
        conn.execute(
            "INSERT INTO work_outcomes (queue, item_id, source, outcome, memory_ids)"
            " VALUES ('pending_triage', %s, 'conversation', 'saved', ARRAY[%s]::bigint[])",
            (item_id, memory[0]),
        )
        conn.execute("DELETE FROM pending_triage WHERE id = %s AND lease_owner = 'w1'", (item_id,))
    conn.execute("UPDATE memories SET superseded_by = NULL WHERE id = %s", (memory[0],))
    conn.execute(
        "INSERT INTO failed_operations (op_type, label, error_message) VALUES ('x', 'y', 'z')"
    )
    conn.execute("DELETE FROM failed_operations WHERE op_type = 'x'")
    conn.execute(
        "INSERT INTO worker_heartbeats (worker_id, hostname, pid, version)"
        " VALUES ('w1', 'h', 1, '0')"
    )
    conn.execute("INSERT INTO email_checkpoints (account, mailbox) VALUES ('a', 'INBOX')")
    conn.execute("INSERT INTO processed_emails (message_id) VALUES ('a:<m@x>')")
    conn.execute("SELECT * FROM adaptive_params").fetchall()
    conn.execute("SELECT version FROM sokratos_worker_migrations").fetchall()
    conn.execute("LISTEN sokratos_worker")

    forbidden = [
        "DROP TABLE pending_triage",
        "DROP TABLE memories",
        "TRUNCATE work_outcomes",
        "ALTER TABLE pending_triage ADD COLUMN x int",
        "CREATE TABLE sneaky (id int)",
        "DELETE FROM memories",
        "UPDATE adaptive_params SET value = 0",
        "DROP FUNCTION sokratos_enqueue_triage(jsonb, text, text)",
    ]
    for statement in forbidden:
        with pytest.raises(errors.InsufficientPrivilege):
            conn.execute(statement)


def test_personality_traits_is_granted_when_it_exists(conn: psycopg.Connection) -> None:
    conn.execute("CREATE TABLE personality_traits (id serial, category text, trait text)")
    _as(conn, "sokratos_worker")
    with pytest.raises(errors.InsufficientPrivilege):
        conn.execute("SELECT * FROM personality_traits")
    conn.execute("RESET ROLE")
    conn.execute(ROLES_SQL)
    _as(conn, "sokratos_worker")
    assert conn.execute("SELECT count(*) FROM personality_traits").fetchone() == (0,)


def test_the_worker_role_can_log_in(conn: psycopg.Connection, database_url: str) -> None:
    """A real login as sokratos_worker (trust or password auth, whichever the server has)."""
    conn.execute("ALTER ROLE sokratos_worker PASSWORD 'test-only-password'")
    info = psycopg.conninfo.conninfo_to_dict(database_url)
    info.update(user="sokratos_worker", password="test-only-password")
    try:
        login = psycopg.connect(psycopg.conninfo.make_conninfo(**info), autocommit=True)
    except psycopg.OperationalError as exc:  # e.g. pg_hba allows only the superuser
        pytest.skip(f"the server refuses other logins: {exc}")
    with login:
        assert login.execute("SELECT current_user").fetchone() == ("sokratos_worker",)
        with pytest.raises(errors.InsufficientPrivilege):
            login.execute("DROP TABLE pending_triage")
