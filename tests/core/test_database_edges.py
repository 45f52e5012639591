"""The database plumbing at its edges: what libpq would refuse, the schema check's grants,
migrations refused for good, and the pool's bounds."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo
from structlog.testing import capture_logs

from sokratos_worker.config import ConfigError, Settings, load_settings
from sokratos_worker.libpq import option_problem
from sokratos_worker.schema_check import schema_problems
from sokratos_worker.store import migrations
from sokratos_worker.store.connection import Database, time_limited, wait_for_database
from sokratos_worker.store.migrations import (
    MigrationRefused,
    apply_migrations,
    load_migrations,
    pending_migrations,
)
from tests.core.test_cli import cli, env_for

ROLES_SQL = (Path(__file__).resolve().parents[2] / "sql" / "roles.sql").read_text("utf-8")


def _as_worker_role(url: str) -> str:
    """``url`` with the session switched to the sokratos_worker role roles.sql creates."""
    return make_conninfo(url, options="-c role=sokratos_worker")


def _libpq_refusal(conninfo: str) -> str:
    """What libpq (the linked one, really connecting) answers: its first line."""
    with pytest.raises(psycopg.OperationalError) as info:
        psycopg.connect(conninfo, connect_timeout=5).close()
    return str(info.value).splitlines()[0]


# -- 1. what libpq would refuse, checked before connecting -------------------------------------


def test_the_highest_port_is_accepted_and_one_past_it_refused(database_url: str) -> None:
    """Port 65535 is one libpq accepts (it then looks for that server), 65536 one it refuses."""
    highest = make_conninfo(database_url, port="65535")
    assert not load_settings({"SOKRATOS_DATABASE_URL": highest}).uses_embedded_postgres
    assert "invalid port number" not in _libpq_refusal(highest)  # a server that is not there
    past = make_conninfo(database_url, port="65536")
    with pytest.raises(ConfigError) as info:
        load_settings({"SOKRATOS_DATABASE_URL": past})
    assert "has a port out of range (1-65535)" in info.value.message
    assert "invalid port number" in _libpq_refusal(past)


def test_a_tls_range_of_one_version_is_accepted_as_libpq_accepts_it(database_url: str) -> None:
    """ssl_min_protocol_version equal to ssl_max_protocol_version pins one TLS version: libpq
    connects with it, so the check must not call it a range the wrong way round."""
    url = make_conninfo(
        database_url, ssl_min_protocol_version="TLSv1.2", ssl_max_protocol_version="tlsv1.2"
    )
    assert not load_settings({"SOKRATOS_DATABASE_URL": url}).uses_embedded_postgres
    with psycopg.connect(url, connect_timeout=5) as conn:  # libpq agrees: a real session
        assert conn.execute("SELECT 1").fetchone() == (1,)
    wrong_way = make_conninfo(
        database_url, ssl_min_protocol_version="TLSv1.3", ssl_max_protocol_version="TLSv1.2"
    )
    with pytest.raises(ConfigError) as info:
        load_settings({"SOKRATOS_DATABASE_URL": wrong_way})
    assert "ssl_min_protocol_version above ssl_max_protocol_version" in info.value.message
    assert "invalid SSL protocol version range" in _libpq_refusal(wrong_way)


def test_a_keepalive_written_with_a_sign_and_spaces_is_a_whole_number_to_libpq() -> None:
    """libpq reads integer options like strtol (spaces, a sign): " +30 " is accepted by both,
    "30s" refused by both."""
    tcp = "host=127.0.0.1 port=1 dbname=db user=u connect_timeout=5"  # nothing listens on 1
    signed = make_conninfo(tcp, keepalives_idle=" +30 ")
    assert not load_settings({"SOKRATOS_DATABASE_URL": signed}).uses_embedded_postgres
    assert "Connection refused" in _libpq_refusal(signed)  # got as far as connecting
    suffixed = make_conninfo(tcp, keepalives_idle="30s")
    with pytest.raises(ConfigError) as info:
        load_settings({"SOKRATOS_DATABASE_URL": suffixed})
    assert "invalid keepalives_idle '30s' (a whole number)" in info.value.message
    assert "invalid integer value" in _libpq_refusal(suffixed)


def test_a_require_auth_naming_a_method_twice_is_refused_as_libpq_refuses_it(
    tmp_path: Path,
) -> None:
    """libpq refuses require_auth=password,password at every connect: the check says so at
    once (exit 78) instead of the start waiting it out as an outage (exit 75)."""
    tcp = "host=127.0.0.1 port=1 dbname=db user=u connect_timeout=5"
    twice = make_conninfo(tcp, require_auth="password,password")
    assert "specified more than once" in _libpq_refusal(twice)
    with pytest.raises(ConfigError) as info:
        load_settings({"SOKRATOS_DATABASE_URL": twice})
    assert info.value.variable == "SOKRATOS_DATABASE_URL"
    assert "names a method twice" in info.value.message
    migrate = cli(
        "migrate",
        env=env_for(twice, tmp_path, SOKRATOS_STARTUP_TIMEOUT="30s"),
        timeout=60,
    )
    assert migrate.returncode == 78, migrate.stderr[-1500:]
    assert "names a method twice" in migrate.stderr


@pytest.mark.parametrize(
    ("url", "variables", "named"),
    [
        ("host=127.0.0.1,127.0.0.1 port=1,2,3 dbname=db user=u", {}, "SOKRATOS_DATABASE_URL"),
        ("host=127.0.0.1,127.0.0.1 dbname=db user=u", {"PGPORT": "1,2,3"}, "PGPORT"),
    ],
)
def test_more_ports_than_hosts_exits_78_at_once_naming_their_source(
    tmp_path: Path, url: str, variables: dict[str, str], named: str
) -> None:
    """libpq refuses three ports for two hosts as it connects: a configuration error at once
    (exit 78, naming where the ports came from), not an outage waited out until exit 75."""
    started = time.monotonic()
    migrate = cli(
        "migrate",
        env=env_for(url, tmp_path, SOKRATOS_STARTUP_TIMEOUT="60s", **variables),
        timeout=120,
    )
    assert migrate.returncode == 78, (migrate.returncode, migrate.stderr[-1500:])
    assert time.monotonic() - started < 30  # not the 60 s start-up wait
    assert f"{named}: a connection option was refused" in migrate.stderr, migrate.stderr
    assert "could not match 3 port numbers to 2 hosts" in migrate.stderr


# -- 2. the schema check: the grants the worker's statements need ------------------------------


def test_a_worker_role_that_may_not_delete_from_a_queue_is_named(
    db: psycopg.Connection, database_url: str
) -> None:
    """Every settle deletes the item from its queue: a role without DELETE on pending_triage
    would start, then fail each settle with "permission denied" and retry for ever."""
    db.execute(ROLES_SQL)
    db.execute("REVOKE DELETE ON pending_triage FROM sokratos_worker")
    with psycopg.connect(_as_worker_role(database_url), autocommit=True) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):  # what a settle would meet
            conn.execute("DELETE FROM pending_triage WHERE false")
        problems = schema_problems(Settings(), conn)
    assert [p.variable for p in problems] == ["schema"], problems
    assert "DELETE on pending_triage" in problems[0].message, problems[0].message
    assert "roles.sql" in problems[0].message


def test_another_deployments_schema_this_role_may_not_use_does_not_stop_its_migrations(
    empty_database_url: str,
) -> None:
    """The worker's tables in a schema this role has no USAGE on belong to another deployment:
    its own migrations are pending, not refused as a missed search_path; a role that may use
    that schema is told to set its search_path."""
    role = "w_" + uuid.uuid4().hex[:8]
    with psycopg.connect(empty_database_url, autocommit=True) as owner:
        owner.execute("CREATE SCHEMA theirs")
        owner.execute("CREATE TABLE theirs.sokratos_worker_migrations (version int PRIMARY KEY)")
        owner.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        url = make_conninfo(empty_database_url, user=role, options="-csearch_path=mine,public")
        try:
            with psycopg.connect(url, autocommit=True) as conn:
                assert pending_migrations(conn) == [m.name for m in load_migrations()]
            owner.execute(
                sql.SQL("GRANT USAGE ON SCHEMA theirs TO {}").format(sql.Identifier(role))
            )
            with (
                psycopg.connect(url, autocommit=True) as conn,
                pytest.raises(ConfigError) as info,
            ):
                pending_migrations(conn)
            assert info.value.variable == "search_path"
            assert "schema theirs" in info.value.message
            # public stays in the advised path: the vector type lives there.
            assert f"ALTER ROLE {role} IN DATABASE" in info.value.message
            assert "SET search_path = theirs, public (" in info.value.message
        finally:
            owner.execute("DROP SCHEMA theirs CASCADE")
            owner.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


def test_check_names_a_search_path_that_misses_the_tables_as_a_failed_schema(
    database_url: str, tmp_path: Path
) -> None:
    """`check` reports a search_path that does not reach the worker's tables on its schema
    line (exit 1, every other line still given), not as a refused login (exit 78)."""
    url = make_conninfo(database_url, options="-csearch_path=elsewhere")
    checked = cli("check", env=env_for(url, tmp_path), timeout=60)
    assert checked.returncode == 1, (checked.returncode, checked.stderr[-1500:])
    lines = checked.stdout.splitlines()
    assert any(line.startswith("ok    database:") for line in lines), checked.stdout
    schema = [line for line in lines if line.startswith("FAIL  schema:")]
    assert len(schema) == 1, checked.stdout
    assert "search_path: is 'elsewhere'" in schema[0] and "SET search_path = public" in schema[0]
    assert "check failed:" in checked.stderr and "schema" in checked.stderr


def test_a_role_that_may_not_read_the_tables_fails_the_schema_check_naming_the_grant(
    database_url: str, tmp_path: Path
) -> None:
    """A login role without the sokratos_worker grant: `check` fails its schema line saying
    which grant to give (exit 1, no traceback), and run refuses to start the same way."""
    role = "w_" + uuid.uuid4().hex[:8]
    with psycopg.connect(database_url, autocommit=True) as owner:
        owner.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        try:
            url = make_conninfo(database_url, user=role)
            with psycopg.connect(url, autocommit=True) as conn:
                problems = schema_problems(Settings(), conn)
            assert [p.variable for p in problems] == ["schema"], problems
            assert f"role {role} may not read the worker's tables" in problems[0].message
            assert "grant it sokratos_worker" in problems[0].message
            checked = cli("check", env=env_for(url, tmp_path), timeout=60)
            assert checked.returncode == 1, (checked.returncode, checked.stderr[-1500:])
            assert "Traceback" not in checked.stderr, checked.stderr[-1500:]
            schema = [line for line in checked.stdout.splitlines() if "schema:" in line]
            assert len(schema) == 1 and schema[0].startswith("FAIL"), checked.stdout
            assert "may not read the worker's tables" in schema[0]
        finally:
            owner.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


# -- 3. migrations the server refuses for good -------------------------------------------------


def test_a_migration_needing_an_extension_the_server_lacks_is_refused_for_good(
    db: psycopg.Connection, database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server without an extension a migration creates (pgvector, elsewhere): a
    configuration error naming what to install (exit 78, no restart loop), nothing recorded,
    and the migration lock let go."""
    sql = tmp_path / "sql"
    sql.mkdir()
    for path in migrations.sql_directory().glob("*.sql"):
        (sql / path.name).write_text(path.read_text("utf-8"), "utf-8")
    (sql / "9990_needs_an_absent_extension.sql").write_text(
        "CREATE EXTENSION IF NOT EXISTS sokratos_absent_extension;\n", "utf-8"
    )
    monkeypatch.setattr(migrations, "sql_directory", lambda: sql)
    with pytest.raises(MigrationRefused) as info:
        apply_migrations(database_url)
    assert isinstance(info.value, ConfigError)  # cli.py: exit 78, systemd does not restart
    assert info.value.variable == "SOKRATOS_DATABASE_URL"
    assert "9990_needs_an_absent_extension failed" in info.value.message
    assert "The pgvector extension is required" in info.value.message
    row = db.execute("SELECT count(*) FROM sokratos_worker_migrations WHERE version = 9990")
    assert row.fetchone() == (0,)
    held = db.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'").fetchone()
    assert held == (0,)


def test_a_migrate_that_takes_the_lock_at_once_says_nothing_of_a_wait(
    empty_database_url: str,
) -> None:
    """migration_lock_taken ends a wait the journal was told of; without a wait neither line
    is written (each start would otherwise log a wait that never happened)."""
    with capture_logs() as captured:
        applied = apply_migrations(empty_database_url)
    assert applied == [m.name for m in load_migrations()]
    events = [e["event"] for e in captured]
    assert "migration_lock_waiting" not in events and "migration_lock_taken" not in events
    assert events.count("migrations_applied") == 1


def test_a_migration_behind_a_long_transaction_retries_at_doubling_intervals_up_to_the_cap(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each try that meets a held table waits twice as long as the one before, never longer
    than RETRY_MAX_S: the migration (and the start waiting on it) follows soon after the
    holder lets go, not a doubled wait later."""
    monkeypatch.setattr(migrations, "LOCK_TIMEOUT_MS", 200)
    monkeypatch.setattr(migrations, "RETRY_MAX_S", 2.0)
    table = "email_checkpoints"
    last = [m for m in load_migrations() if f"ALTER TABLE {table}" in m.sql][-1]
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("DELETE FROM sokratos_worker_migrations WHERE version = %s", (last.version,))
    said: list[str] = []
    logs: list[dict[str, object]] = []
    done = threading.Event()

    def migrate() -> None:
        with capture_logs() as captured:
            apply_migrations(database_url, said.append)
        logs.extend(captured)
        done.set()

    with psycopg.connect(database_url) as reader:
        reader.execute(f"SELECT count(*) FROM {table}")  # an open transaction holds its lock
        thread = threading.Thread(target=migrate, daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while sum("waits for tables held by" in line for line in said) < 4:
            assert time.monotonic() < deadline, said
            time.sleep(0.05)
        reader.rollback()
    assert done.wait(60)
    waits = [e for e in logs if e["event"] == "migration_waiting_for_lock"]
    assert [e["retry_in_s"] for e in waits[:4]] == [1.0, 2.0, 2.0, 2.0], waits
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM sokratos_worker_migrations WHERE version = %s", (last.version,)
        ).fetchone()
    assert row == (1,)


# -- 4. the pool: ready when its kept connections are open; lent only between uses -------------


def test_wait_ready_says_true_once_the_kept_connections_are_open(database_url: str) -> None:
    """A reachable server: wait_ready returns True as soon as keep_open connections are open,
    not at its timeout (run would warn database_pool_not_full and start late)."""
    database = Database(database_url, size=4, keep_open=2)
    try:
        started = time.monotonic()
        assert database.wait_ready(8.0) is True
        assert time.monotonic() - started < 6.0
        assert database.pool.get_stats()["pool_available"] == 2
        with psycopg.connect(database_url, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            ).fetchone()
        assert row == (2,)
    finally:
        database.close()


def test_a_time_limit_ends_with_its_transaction(database_url: str) -> None:
    """time_limited() bounds the statements inside it only: the pooled connection goes on
    without a statement_timeout, so a later settle waiting for a lock is not cancelled."""
    database = Database(database_url, size=1, keep_open=1)
    try:
        with database.connection() as conn:
            with pytest.raises(psycopg.errors.QueryCanceled), time_limited(conn, 200):
                conn.execute("SELECT pg_sleep(2)")
            with time_limited(conn, 5000):
                conn.execute("SELECT 1")
            row = conn.execute("SHOW statement_timeout").fetchone()
            assert row == ("0",)
            conn.execute("SELECT pg_sleep(0.4)")  # longer than the limit above had been
        with database.connection() as conn:  # the same pooled session, lent again
            row = conn.execute("SHOW statement_timeout").fetchone()
        assert row == ("0",)
    finally:
        database.close()


def test_the_wait_for_a_database_doubles_its_pause_up_to_five_seconds() -> None:
    """A start waiting for PostgreSQL tries again after 0.25 s, doubling up to 5 s: a server
    that comes back is noticed within 5 s, not a doubled minute later."""
    pauses: list[float] = []

    class Enough(Exception):
        """Ends the wait once the pauses have been seen."""

    def sleep(seconds: float) -> None:
        pauses.append(seconds)
        if len(pauses) == 9:
            raise Enough
        time.sleep(0.01)

    with pytest.raises(Enough):  # nothing listens on port 1: every try fails at once
        wait_for_database(
            "postgresql://u@127.0.0.1:1/db?connect_timeout=2", deadline_s=600, sleep=sleep
        )
    assert pauses == [0.25, 0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0, 5.0]


def test_a_held_connection_in_use_is_not_lent_to_a_waiting_thread(database_url: str) -> None:
    """lend_if_wanted() called while the slot is inside a use (or outside holding()) keeps
    the connection: lending it then would put one session in two threads' hands."""
    database = Database(database_url, size=1, keep_open=1)
    got = threading.Event()
    holder_pid: list[int] = []

    def renewer() -> None:
        with database.connection() as conn:
            row = conn.execute("SELECT pg_backend_pid()").fetchone()
            assert row is not None
            holder_pid.append(row[0])
        got.set()

    try:
        database.lend_if_wanted()  # outside holding(): nothing held, nothing to do
        with database.holding():
            with database.connection() as conn:
                conn.execute("BEGIN")
                conn.execute("SELECT 1")
                other = threading.Thread(target=renewer)
                other.start()
                deadline = time.monotonic() + 5
                while database.pool.get_stats().get("requests_waiting", 0) == 0:
                    assert time.monotonic() < deadline, "the other thread never waited"
                    time.sleep(0.01)
                database.lend_if_wanted()  # inside a use: kept
                assert not got.wait(0.5), "a connection in use was lent to another thread"
                row = conn.execute("SELECT pg_backend_pid()").fetchone()
                assert row is not None
                conn.execute("COMMIT")
                mine = row[0]
            database.lend_if_wanted()  # between two uses: lent
            assert got.wait(5), "the waiting thread did not get the connection"
            other.join(5)
        assert holder_pid == [mine]  # the same session, handed on once this thread was done
    finally:
        database.close()


# -- defects the review found, fixed with these tests ------------------------------------


# A review found libpq.py accepting any whole number for keepalives_idle, keepalives_interval
# and keepalives_count, but libpq hands 0 or a negative one to setsockopt on every TCP connect,
# which Linux refuses ("setsockopt(TCP_KEEPIDLE) failed: Invalid argument"); the worker took
# that for an outage: waited out, exit 75, restarted by systemd for ever, instead of exit 78.
@pytest.mark.parametrize(
    "option", ["keepalives_idle=0", "keepalives_interval=-5", "keepalives_count=128"]
)
def test_a_keepalive_setting_the_kernel_refuses_exits_78_at_once(
    tmp_path: Path, option: str
) -> None:
    """A keepalive setting libpq passes to a kernel that refuses it is a configuration error."""
    url = f"postgresql://u@127.0.0.1:1/db?{option}"
    assert "setsockopt" in _libpq_refusal(url)  # libpq's answer, at every attempt
    migrate = cli("migrate", env=env_for(url, tmp_path, SOKRATOS_STARTUP_TIMEOUT="3s"), timeout=60)
    assert migrate.returncode == 78, (migrate.returncode, migrate.stderr[-1500:])
    assert option.partition("=")[0] in migrate.stderr


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({"keepalives_idle": "1", "keepalives_interval": "32767", "keepalives_count": "127"}, None),
        ({"keepalives": "0", "keepalives_idle": "0", "keepalives_count": "-1"}, None),
        ({"keepalives": "1", "keepalives_idle": "0"}, "keepalives_idle 0"),
        ({"keepalives_interval": "32768"}, "keepalives_interval 32768"),
        ({"keepalives_count": " +128 "}, "keepalives_count 128"),
    ],
    ids=["the-kernels-bounds", "keepalives-off", "idle-0", "interval-too-long", "count-too-many"],
)
def test_keepalive_settings_are_refused_only_where_the_kernel_would_refuse_them(
    options: dict[str, str], problem: str | None
) -> None:
    """keepalives=0 leaves the others unused (libpq sets none of them then)."""
    found = option_problem(options)
    if problem is None:
        assert found is None, found
    else:
        assert found is not None and problem in found and "Linux accepts" in found, found


# A review found schema_check.py asking for USAGE on the sequences of identity columns
# (deptype 'i') as on a serial's, but PostgreSQL needs no privilege on an identity column's
# sequence: an INSERT privilege on the table is enough. A role a DBA granted only what the
# worker uses was refused (run exited 78, check failed) although every insert it made worked.
def test_an_identity_columns_sequence_needs_no_grant_and_is_not_asked_for(
    db: psycopg.Connection, database_url: str
) -> None:
    """An identity column numbers rows without USAGE on its sequence: not a missing grant."""
    db.execute("ALTER TABLE failed_operations ALTER COLUMN id DROP DEFAULT")
    db.execute("DROP SEQUENCE failed_operations_id_seq")
    db.execute("ALTER TABLE failed_operations ALTER COLUMN id ADD GENERATED BY DEFAULT AS IDENTITY")
    db.execute(ROLES_SQL)
    sequence = db.execute("SELECT pg_get_serial_sequence('failed_operations', 'id')").fetchone()
    assert sequence is not None and sequence[0]
    db.execute(f"REVOKE USAGE ON SEQUENCE {sequence[0]} FROM sokratos_worker")
    with psycopg.connect(_as_worker_role(database_url), autocommit=True) as conn:
        row = conn.execute(
            "INSERT INTO failed_operations (op_type, label, error_message)"
            " VALUES ('x', 'y', 'z') RETURNING id"
        ).fetchone()
        assert row is not None  # the dead letter is written: no grant was missing
        problems = schema_problems(Settings(), conn)
    assert problems == [], problems
