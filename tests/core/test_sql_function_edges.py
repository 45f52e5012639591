"""Edges of the SQL the worker ships (sql/*.sql) that a producer in any language meets directly:
the enqueue functions' payload check, blank keys an older version recorded, how the id sequence
is moved past used ids, who may call what after sql/roles.sql, the wake-up of a direct INSERT,
and the upgrades' back-fills (keys of rows inserted directly, the first-check flag).

Real parts: the session's PostgreSQL, the real migration files, real roles and logins.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import errors

from sokratos_worker.model import Effects, Outcome, Queue
from sokratos_worker.store import email as email_store
from sokratos_worker.store import queue as store
from sokratos_worker.store.migrations import apply_migrations, load_migrations
from tests.support.db import count, enqueue_many, explain_from_now_on

ROLES_SQL = (Path(__file__).resolve().parents[2] / "sql" / "roles.sql").read_text("utf-8")
EXCHANGE = json.dumps({"exchange": "user: my sister moved to Porto\nassistant: noted"})
ARCHIVE = json.dumps({"archive_text": "user: I moved to Lisbon\nassistant: noted"})


def _queued(db: psycopg.Connection) -> int:
    return count(
        db,
        "SELECT (SELECT count(*) FROM pending_triage) + (SELECT count(*) FROM pending_distillation)",
    )


# -- the payload check, as a producer calling the functions meets it --------------------------


@pytest.mark.parametrize(
    ("call", "payload", "message"),
    [
        (
            "sokratos_enqueue_distillation(%s::jsonb, 'k')",
            {"messages": "user: I moved to Porto"},
            "payload.messages (an array) or payload.archive_text (a string) is required",
        ),
        (
            "sokratos_enqueue_distillation(%s::jsonb, 'k')",
            {"messages": {"role": "user", "content": "I moved to Porto"}},
            "payload.messages (an array) or payload.archive_text (a string) is required",
        ),
        (
            "sokratos_enqueue_distillation(%s::jsonb, 'k')",
            {"archive_text": ["user: I moved to Porto"]},
            "payload.messages (an array) or payload.archive_text (a string) is required",
        ),
        (
            "sokratos_enqueue_triage(%s::jsonb, 'k', 'email')",
            {"subject": "Porto", "from": "ana@example.org"},
            "payload.text is required and must be a string",
        ),
        (
            "sokratos_enqueue_triage(%s::jsonb, 'k', 'email')",
            {"text": 42},
            "payload.text is required and must be a string",
        ),
        (
            "sokratos_enqueue_triage(%s::jsonb, 'k')",
            {"exchange": ["user: hi", "assistant: hello"]},
            "payload.exchange is required and must be a string",
        ),
        (
            "sokratos_enqueue_triage(%s::jsonb, 'k', 'telegram')",
            {"exchange": "user: my sister moved to Porto\nassistant: noted"},
            "source must be conversation or email, not telegram",
        ),
        (
            "sokratos_enqueue_triage(%s::jsonb, 'k', NULL)",
            {"exchange": "user: my sister moved to Porto\nassistant: noted"},
            "source must be conversation or email",
        ),
    ],
    ids=[
        "messages-a-string",
        "messages-an-object",
        "archive-text-a-list",
        "email-without-text",
        "email-text-a-number",
        "exchange-a-list",
        "unknown-source",
        "null-source",
    ],
)
def test_the_enqueue_functions_refuse_a_payload_the_worker_would_dead_letter(
    db: psycopg.Connection, call: str, payload: dict[str, object], message: str
) -> None:
    """A producer calling the SQL functions directly (no Python check before them) gets 22023
    naming the field at once; nothing is queued and its key is not taken (contract §4)."""
    with pytest.raises(errors.InvalidParameterValue) as refused:
        db.execute(f"SELECT {call}", (json.dumps(payload),))
    assert message in (refused.value.diag.message_primary or ""), refused.value
    assert _queued(db) == 0
    assert count(db, "SELECT count(*) FROM sokratos_idempotency_keys") == 0


@pytest.mark.parametrize(
    "call", ["sokratos_enqueue_triage(NULL, 'k')", "sokratos_enqueue_distillation(NULL, 'k')"]
)
def test_a_null_payload_is_refused_as_not_an_object(db: psycopg.Connection, call: str) -> None:
    """A producer passing SQL NULL (an unset variable) is told the payload is not an object,
    not that a field inside it is missing."""
    with pytest.raises(errors.InvalidParameterValue) as refused:
        db.execute(f"SELECT {call}")
    assert refused.value.diag.message_primary == "payload must be a JSON object"
    assert _queued(db) == 0


def test_an_email_item_with_its_text_is_queued_as_email(db: psycopg.Connection) -> None:
    """The email form the check above refuses without its text is queued, under source email."""
    payload = json.dumps({"subject": "Porto", "text": "From: ana@example.org\n\nI moved"})
    (item_id,) = db.execute(
        "SELECT sokratos_enqueue_triage(%s::jsonb, 'mail-1', 'email')", (payload,)
    ).fetchone()
    row = db.execute("SELECT id, source FROM pending_triage").fetchone()
    assert row == (item_id, "email")


# -- blank keys an older version recorded -----------------------------------------------------


@pytest.mark.parametrize(
    ("queue", "call", "payload"),
    [
        ("pending_triage", "sokratos_enqueue_triage(%s::jsonb, %s)", EXCHANGE),
        ("pending_distillation", "sokratos_enqueue_distillation(%s::jsonb, %s)", ARCHIVE),
    ],
)
@pytest.mark.parametrize("key", ["", " "])
def test_a_blank_key_recorded_before_the_refusal_existed_never_swallows_an_item(
    db: psycopg.Connection, queue: str, call: str, payload: str, key: str
) -> None:
    """A database upgraded from before sql/0042 may hold a recorded blank key: enqueueing that
    key again is refused (22023), not answered with the old item's id while the text is lost."""
    db.execute(
        "INSERT INTO sokratos_idempotency_keys (queue, key, item_id) VALUES (%s, %s, 1)",
        (queue, key),
    )
    with pytest.raises(errors.InvalidParameterValue, match="key is blank"):
        db.execute(f"SELECT {call}", (payload, key))
    assert _queued(db) == 0


# -- moving the id sequence past used ids ----------------------------------------------------


ENQUEUE = {
    "pending_triage": ("SELECT sokratos_enqueue_triage(%s::jsonb)", EXCHANGE, "conversation"),
    "pending_distillation": (
        "SELECT sokratos_enqueue_distillation(%s::jsonb)",
        ARCHIVE,
        "distillation",
    ),
}


def _used_by_outcomes(db: psycopg.Connection, queue: str) -> int:
    db.execute(
        "INSERT INTO work_outcomes (queue, item_id, source, outcome)"
        " SELECT %s, g, %s, 'skipped' FROM generate_series(1, 50) g",
        (queue, ENQUEUE[queue][2]),
    )
    return 50


def _used_by_queued_rows(db: psycopg.Connection, queue: str) -> int:
    call, payload, _ = ENQUEUE[queue]
    ids = [int(db.execute(call, (payload,)).fetchone()[0]) for _ in range(3)]
    return max(ids)  # keyless: only the queue itself holds their ids


def _used_by_keys(db: psycopg.Connection, queue: str) -> int:
    ids = enqueue_many(db, 7, queue=queue, prefix="gone")
    db.execute(f"DELETE FROM {queue}")  # the items vanished, their keys stay
    return max(ids)


@pytest.mark.parametrize("queue", ["pending_triage", "pending_distillation"])
@pytest.mark.parametrize(
    "used_by",
    [_used_by_outcomes, _used_by_queued_rows, _used_by_keys],
    ids=["outcomes", "queued-rows", "keys"],
)
def test_a_reset_sequence_moves_once_a_thousand_past_the_highest_used_id_and_says_so(
    db: psycopg.Connection, used_by: Callable[[psycopg.Connection, str], int], queue: str
) -> None:
    """After a reset the first enqueue moves the sequence to 1000 above the highest used id
    (outcomes, queued rows or recorded keys) in one step, with a WARNING naming that id."""
    highest = used_by(db, queue)
    db.execute("SELECT setval(pg_get_serial_sequence(%s, 'id'), 1, false)", (queue,))
    warnings: list[str] = []
    db.add_notice_handler(
        lambda d: warnings.append(d.message_primary or "") if d.severity == "WARNING" else None
    )
    (first,) = enqueue_many(db, 1, queue=queue, prefix="after-reset")
    assert first == highest + 1000 + 1
    assert len(warnings) == 1, warnings
    assert f"the id sequence of {queue} handed out an id already used" in warnings[0]
    assert warnings[0].endswith(f"moved past {highest}"), warnings[0]
    (second,) = enqueue_many(db, 1, queue=queue, prefix="next")
    assert second == first + 1 and len(warnings) == 1  # moved once, not again
    assert count(db, f"SELECT count(*) FROM {queue} WHERE id IN (%s, %s)", first, second) == 2


# -- who may call what after sql/roles.sql -----------------------------------------------------


@pytest.fixture
def stranger(db: psycopg.Connection) -> Iterator[str]:
    """A role with no grant of its own (any role of the cluster that may connect)."""
    name = f"sokratos_test_stranger_{uuid.uuid4().hex[:8]}"
    db.execute(f"CREATE ROLE {name} NOLOGIN")
    try:
        yield name
    finally:
        db.execute("RESET ROLE")
        db.execute(f"DROP ROLE {name}")


def test_after_roles_sql_a_role_without_a_grant_cannot_enqueue(
    db: psycopg.Connection, stranger: str
) -> None:
    """roles.sql leaves the SECURITY DEFINER enqueue functions to the two roles it grants:
    another role of the cluster cannot queue work (and have the worker act on it)."""
    db.execute(ROLES_SQL)
    db.execute(f"SET ROLE {stranger}")
    for statement, payload in [
        ("SELECT sokratos_enqueue_triage(%s::jsonb)", EXCHANGE),
        ("SELECT sokratos_enqueue_distillation(%s::jsonb)", ARCHIVE),
        ("SELECT sokratos_enqueue('pending_triage', %s::jsonb, NULL, 'conversation')", EXCHANGE),
    ]:
        with pytest.raises(errors.InsufficientPrivilege), db.transaction():
            db.execute(statement, (payload,))
    db.execute("RESET ROLE")
    assert _queued(db) == 0


@pytest.mark.parametrize("role", ["sokratos_producer", "sokratos_worker", "stranger"])
def test_no_role_but_the_owner_may_move_an_id_sequence(
    db: psycopg.Connection, stranger: str, role: str
) -> None:
    """sokratos_next_item_id moves a queue's sequence with the owner's rights: only the
    functions that run as the owner call it, no role (producer, worker or other) directly."""
    db.execute(ROLES_SQL)
    before = count(db, "SELECT last_value FROM pending_triage_id_seq")
    db.execute(f"SET ROLE {stranger if role == 'stranger' else role}")
    with pytest.raises(errors.InsufficientPrivilege), db.transaction():
        db.execute("SELECT sokratos_next_item_id('pending_triage')")
    db.execute("RESET ROLE")
    assert count(db, "SELECT last_value FROM pending_triage_id_seq") == before


def test_a_producer_pool_of_eight_connections_may_log_in_at_once(
    db: psycopg.Connection, database_url: str
) -> None:
    """sokratos_producer's CONNECTION LIMIT leaves room for a producer's pool (pgx's default
    is max(4, CPUs)): eight sessions at once each enqueue their item."""
    db.execute(ROLES_SQL)
    db.execute("ALTER ROLE sokratos_producer PASSWORD 'test-only-password'")
    info = psycopg.conninfo.conninfo_to_dict(database_url)
    info.update(user="sokratos_producer", password="test-only-password")
    url = psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})
    pool: list[psycopg.Connection] = []
    try:
        for _ in range(8):
            pool.append(psycopg.connect(url, autocommit=True))
        for i, conn in enumerate(pool):
            conn.execute("SELECT sokratos_enqueue_triage(%s::jsonb, %s)", (EXCHANGE, f"pool-{i}"))
    finally:
        for conn in pool:
            conn.close()
    assert count(db, "SELECT count(*) FROM pending_triage") == 8


# -- a direct INSERT wakes the workers ---------------------------------------------------------


@pytest.mark.parametrize(
    ("queue", "payload"), [("pending_triage", EXCHANGE), ("pending_distillation", ARCHIVE)]
)
def test_a_direct_insert_wakes_the_workers_naming_its_queue(
    db: psycopg.Connection, database_url: str, queue: str, payload: str
) -> None:
    """A row the main application inserts itself (contract §4) NOTIFYs sokratos_worker with
    its queue's name at its commit, as the enqueue functions do."""
    with psycopg.connect(database_url, autocommit=True) as listener:
        listener.execute("LISTEN sokratos_worker")
        db.execute(f"INSERT INTO {queue} (payload) VALUES (%s::jsonb)", (payload,))
        heard = [n.payload for n in listener.notifies(timeout=2.0, stop_after=1)]
    assert heard == [queue]


# -- upgrades: what the back-fills write -------------------------------------------------------


def _migrated_by_an_older_worker(url: str, below: int) -> None:
    """The migrations before ``below`` applied and recorded, as an older worker left them."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            """CREATE TABLE sokratos_worker_migrations (
                   version int PRIMARY KEY,
                   name text NOT NULL,
                   checksum text NOT NULL,
                   applied_at timestamptz NOT NULL DEFAULT now())"""
        )
        for migration in load_migrations():
            if migration.version >= below:
                break
            with conn.transaction():
                conn.execute(migration.sql.encode())
                conn.execute(
                    "INSERT INTO sokratos_worker_migrations (version, name, checksum)"
                    " VALUES (%s, %s, %s)",
                    (migration.version, migration.name, migration.checksum),
                )


def test_keys_of_rows_inserted_directly_before_0030_keep_their_promise_after_the_upgrade(
    empty_database_url: str,
) -> None:
    """Keyed rows the main application inserted before sql/0030 have their keys recorded for
    their own queue by the upgrade: enqueueing such a key answers with that row's id."""
    _migrated_by_an_older_worker(empty_database_url, 30)
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        (triage,) = conn.execute(
            "INSERT INTO pending_triage (payload, idempotency_key) VALUES (%s::jsonb, 'go-t')"
            " RETURNING id",
            (EXCHANGE,),
        ).fetchone()
        (archive,) = conn.execute(
            "INSERT INTO pending_distillation (payload, idempotency_key)"
            " VALUES (%s::jsonb, 'go-d') RETURNING id",
            (ARCHIVE,),
        ).fetchone()
    assert apply_migrations(empty_database_url)[0] == "0030_direct_insert_keys"
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        keys = conn.execute(
            "SELECT queue, key, item_id FROM sokratos_idempotency_keys ORDER BY queue"
        ).fetchall()
        assert keys == [
            ("pending_distillation", "go-d", archive),
            ("pending_triage", "go-t", triage),
        ]
        again = conn.execute(
            "SELECT sokratos_enqueue_triage(%s::jsonb, 'go-t'),"
            " sokratos_enqueue_distillation(%s::jsonb, 'go-d')",
            (EXCHANGE, ARCHIVE),
        ).fetchone()
        assert again == (triage, archive)
        assert _queued(conn) == 2


def test_accounts_checked_before_0031_keep_their_first_check_done_after_the_upgrade(
    empty_database_url: str,
) -> None:
    """An account whose check completed before sql/0031 (checked_at set) is marked as past its
    first check, so no initial lookback is applied to it again; one never checked is not."""
    _migrated_by_an_older_worker(empty_database_url, 31)
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO email_checkpoints (account, mailbox, uidvalidity, last_uid, checked_at)"
            " VALUES ('home', 'INBOX', 7, 120, now() - interval '3 days'),"
            "        ('work', 'INBOX', NULL, 0, NULL)"
        )
    assert apply_migrations(empty_database_url)[0] == "0031_email_first_check"
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT account, first_check_done, last_uid FROM email_checkpoints ORDER BY account"
        ).fetchall()
    assert rows == [("home", True, 120), ("work", False, 0)]


# -- a distillation finishing while a direct INSERT of its key is under way ------------------

PAUSE_LOCK = 4713  # the advisory lock the paused producer waits for until the test releases it


def _waiting_for_advisory_lock(db: psycopg.Connection, pid: int) -> None:
    for _ in range(200):
        row = db.execute(
            "SELECT wait_event FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock'",
            (pid,),
        ).fetchone()
        if row == ("advisory",):
            return
        time.sleep(0.05)
    raise AssertionError(f"session {pid} never waited for the advisory lock")


def test_a_distillation_finishing_after_a_direct_insert_found_it_queued_lets_no_second_in(
    db: psycopg.Connection, database_url: str
) -> None:
    """Settled between the key triggers' check and the queue's index, a distillation's key
    still refuses the producer's retry (23505, also under ON CONFLICT DO NOTHING): the
    archive is not distilled, and its memories written, a second time."""
    (first,) = db.execute(
        "SELECT sokratos_enqueue_distillation(%s::jsonb, 'go-d14')", (ARCHIVE,)
    ).fetchone()
    (item,) = store.claim(db, Queue.DISTILLATION, owner="w", limit=1, lease_s=60)
    # Pauses the asking session after the queue's key triggers ("z_…" fires after them).
    db.execute(
        f"""CREATE FUNCTION test_pause() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF current_setting('sokratos_test.pause', true) = 'on' THEN
                    PERFORM pg_advisory_xact_lock_shared({PAUSE_LOCK});
                END IF;
                RETURN NEW;
            END $$;
            CREATE TRIGGER z_test_pause BEFORE INSERT ON pending_distillation
                FOR EACH ROW EXECUTE FUNCTION test_pause();"""
    )
    result: list[object] = []
    with (
        psycopg.connect(database_url, autocommit=True) as gate,
        psycopg.connect(database_url, options="-c sokratos_test.pause=on") as producer,
    ):
        gate.execute("SELECT pg_advisory_lock(%s)", (PAUSE_LOCK,))

        def retry() -> None:
            try:
                row = producer.execute(
                    "INSERT INTO pending_distillation (payload, idempotency_key)"
                    " VALUES (%s::jsonb, 'go-d14') ON CONFLICT (idempotency_key) DO NOTHING"
                    " RETURNING id",
                    (ARCHIVE,),
                ).fetchone()
                producer.commit()
                result.append(row)
            except psycopg.Error as exc:
                result.append(exc)

        thread = threading.Thread(target=retry, daemon=True)
        thread.start()
        _waiting_for_advisory_lock(db, producer.info.backend_pid)
        assert store.settle_success(db, item, Effects(Outcome.SKIPPED), owner="w")[0].settled
        gate.execute("SELECT pg_advisory_unlock(%s)", (PAUSE_LOCK,))
        thread.join(timeout=30)
        assert not thread.is_alive()
    (refused,) = result
    assert isinstance(refused, errors.UniqueViolation), refused
    assert f"item {first}" in (refused.diag.message_primary or "")
    assert count(db, "SELECT count(*) FROM pending_distillation") == 0


# -- the restore check's lookup stays on its index ---------------------------------------------


def _scans_of(plan: dict[str, Any], table: str) -> list[dict[str, Any]]:
    nodes = [plan] if plan.get("Relation Name") == table else []
    for child in plan.get("Plans", []):
        nodes += _scans_of(child, table)
    return nodes


def test_the_rows_at_one_uid_are_read_through_the_uid_index(db: psycopg.Connection) -> None:
    """Every check reads the processed_emails rows at one UID of an account's mailbox: found
    through (account, mailbox, uid) (sql/0045), not by reading all of the account's rows."""
    db.execute(
        "INSERT INTO processed_emails (message_id, account, mailbox, uidvalidity, uid)"
        " SELECT 'home:<m' || g || '@example.org>', 'home', 'INBOX', 7, g"
        " FROM generate_series(1, 20000) g"
    )
    db.execute("ANALYZE processed_emails")
    plans = explain_from_now_on(db)
    (found,) = email_store.recorded_at_uid(db, "home", "INBOX", 7, 12345)
    assert found.key == "home:<m12345@example.org>"
    scans = [node for _, plan in plans for node in _scans_of(plan, "processed_emails")]
    assert scans, plans
    for node in scans:
        assert "uid" in node.get("Index Cond", ""), node


@pytest.mark.parametrize("queue", [Queue.TRIAGE, Queue.DISTILLATION])
def test_a_claim_from_a_long_backlog_reads_the_queue_in_run_after_order(
    db: psycopg.Connection, queue: Queue
) -> None:
    """After an outage a worker drains a long backlog one claim at a time: each claim reads
    the queue's (run_after, id) index, not the whole backlog sorted anew (a quadratic drain)."""
    payload = EXCHANGE if queue is Queue.TRIAGE else ARCHIVE
    db.execute(
        f"INSERT INTO {queue.value} (payload) SELECT %s::jsonb FROM generate_series(1, 5000)",
        (payload,),
    )
    db.execute(f"ANALYZE {queue.value}")
    plans = explain_from_now_on(db)
    (item,) = store.claim(db, queue, owner="w", limit=1, lease_s=60)
    assert item.id == 1
    scans = [node for _, plan in plans for node in _scans_of(plan, queue.value)]
    assert scans, plans
    assert all(node["Node Type"] != "Seq Scan" for node in scans), scans
    assert any(node.get("Index Name") == f"{queue.value}_run_after_idx" for node in scans), scans


# -- roles.sql and a role's own search_path ----------------------------------------------------

# roles.sql's first block: the two roles (cluster-wide), without the grants and paths.
CREATE_ROLES = ROLES_SQL[ROLES_SQL.index("DO $$") : ROLES_SQL.index("END $$;") + len("END $$;")]


def test_roles_sql_puts_the_schema_on_the_path_the_role_really_gets_in_this_database(
    db: psycopg.Connection,
) -> None:
    """A role's search_path for this database overrides its setting for every database: when
    the tables live outside public, roles.sql checks (and completes) the one that applies here,
    not the overridden one that already names the schema."""
    db.execute("ALTER SCHEMA public RENAME TO sokratos_here")  # the worker's tables live there
    db.execute(CREATE_ROLES)
    here = db.execute("SELECT current_database()").fetchone()[0]
    try:
        db.execute("ALTER ROLE sokratos_worker SET search_path = sokratos_here, public")
        db.execute(f'ALTER ROLE sokratos_worker IN DATABASE "{here}" SET search_path = public')
        db.execute(ROLES_SQL)
        path = db.execute(
            "SELECT c FROM pg_db_role_setting s JOIN pg_roles r ON r.oid = s.setrole"
            " JOIN pg_database d ON d.oid = s.setdatabase, unnest(s.setconfig) AS c"
            " WHERE r.rolname = 'sokratos_worker' AND d.datname = current_database()"
            " AND c LIKE 'search_path=%'"
        ).fetchall()
        assert path == [("search_path=sokratos_here, public",)]
    finally:
        db.execute("ALTER ROLE sokratos_worker RESET search_path")
