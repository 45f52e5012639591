"""The worker behind a real PgBouncer in front of the tests' PostgreSQL. In session pooling it
drains and wakes on NOTIFY, and a startup parameter PgBouncer refuses is a configuration error
(exit 78 naming the variable that sent it), not an outage waited out until exit 75. Transaction
pooling, which it cannot run behind, is refused at start (exit 78) before any lock is taken."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from sokratos_worker.store.connection import option_refused
from tests.core.test_cli import cli, env_for
from tests.support.daemon import ROOT, daemon_env, start_daemon, wait_until
from tests.support.db import count, enqueue_many
from tests.support.ports import unused_port

pytestmark = [pytest.mark.subprocess]

START_TIMEOUT_S = 15.0


def _pgbouncer_binary() -> str:
    """The Debian package installs it in /usr/sbin, which a non-root PATH may lack."""
    found = shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin:/usr/bin")
    if found is None:
        message = "pgbouncer is not installed: apt-get install pgbouncer (.ci/run does)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found


def _run_as(host: str) -> list[str]:
    """PgBouncer refuses to run as root: as root, run it as the owner of the server's socket
    directory (the embedded PostgreSQL's own user), which can reach that socket."""
    if os.geteuid() != 0:
        return []
    owner = pwd.getpwuid(os.stat(host).st_uid).pw_name if host.startswith("/") else "root"
    return ["-u", owner if owner != "root" else "nobody"]


@contextmanager
def pgbouncer(server_url: str, pool_mode: str) -> Iterator[tuple[str, int]]:
    """A PgBouncer on 127.0.0.1 in front of ``server_url``'s server (every database, trust
    authentication); yields (host, port) and stops it at the end."""
    binary = _pgbouncer_binary()
    info = conninfo_to_dict(server_url)
    host = str(info.get("host") or "127.0.0.1")
    user = str(info.get("user") or "postgres")
    folder = Path(tempfile.mkdtemp(prefix="pgbouncer-", dir="/tmp"))
    folder.chmod(0o755)  # read by PgBouncer's own user when the tests run as root
    port = unused_port()
    (folder / "users.txt").write_text(f'"{user}" ""\n')
    (folder / "pgbouncer.ini").write_text(
        f"[databases]\n* = host={host} port={info.get('port') or 5432}\n"
        f"[pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {folder / 'users.txt'}\npool_mode = {pool_mode}\n"
        "default_pool_size = 40\nmax_client_conn = 200\n"
    )
    for name in ("users.txt", "pgbouncer.ini"):
        (folder / name).chmod(0o644)
    log = folder / "pgbouncer.log"
    with log.open("wb") as handle:
        proc = subprocess.Popen(
            [binary, *_run_as(host), str(folder / "pgbouncer.ini")],
            stdout=handle,
            stderr=subprocess.STDOUT,
        )
    try:
        url = make_conninfo(host="127.0.0.1", port=port, user=user, dbname="postgres")

        def answers() -> bool:
            if proc.poll() is not None:
                return True  # (reported below)
            try:
                with psycopg.connect(url, connect_timeout=2):
                    return True
            except psycopg.OperationalError:
                return False

        assert wait_until(answers, timeout=START_TIMEOUT_S, interval=0.1), log.read_text()
        assert proc.poll() is None, f"pgbouncer exited: {log.read_text()}"
        yield "127.0.0.1", port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def session_pool(pg_server: str) -> Iterator[tuple[str, int]]:
    """PgBouncer in session pooling, the mode the worker needs (docs/production.md)."""
    with pgbouncer(pg_server, "session") as address:
        yield address


def _through(database_url: str, address: tuple[str, int], **options: str) -> str:
    """``database_url``'s database and user, reached through PgBouncer at ``address``."""
    info = conninfo_to_dict(database_url)
    host, port = address
    return make_conninfo(
        host=host, port=port, user=str(info.get("user")), dbname=str(info["dbname"]), **options
    )


def test_run_once_drains_through_pgbouncer_in_session_mode(
    db: psycopg.Connection, database_url: str, session_pool: tuple[str, int], tmp_path: Path
) -> None:
    n = 40
    enqueue_many(db, n)
    env = daemon_env(_through(database_url, session_pool), tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.handlers", "run", "--once"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert count(db, "SELECT count(*) FROM pending_triage") == 0
    assert count(db, "SELECT count(*) FROM work_outcomes WHERE outcome = 'saved'") == n


def test_the_daemon_behind_pgbouncer_wakes_on_notify_at_once(
    db: psycopg.Connection, database_url: str, session_pool: tuple[str, int], tmp_path: Path
) -> None:
    """LISTEN holds its server connection in session pooling: an item enqueued into an idle
    daemon with a 60 s heartbeat is done in seconds (transaction pooling loses it)."""
    env = daemon_env(
        _through(database_url, session_pool), tmp_path, SOKRATOS_HEARTBEAT_INTERVAL="60s"
    )
    log = tmp_path / "daemon.log"
    proc = start_daemon(env, log)
    try:
        assert wait_until(
            lambda: all(e in log.read_text() for e in ('"worker_started"', '"listening"')),
            timeout=30,
        ), log.read_text()[-3000:]
        time.sleep(0.5)  # (the first tick is over: only the notification can wake it now)
        enqueue_many(db, 1)
        done = "SELECT count(*) FROM work_outcomes"
        assert wait_until(lambda: count(db, done) == 1, timeout=15), log.read_text()[-3000:]
    finally:
        proc.terminate()
        assert proc.wait(30) == 0, log.read_text()[-3000:]


# (PG* variables set, URL options, the variable named, the parameter PgBouncer names)
_SENDERS = [
    ({"PGOPTIONS": "-c statement_timeout=5s"}, {}, "PGOPTIONS", "options"),
    ({}, {"options": "-c jit=off"}, "SOKRATOS_DATABASE_URL", "options"),
    ({"PGGEQO": "on"}, {}, "PGGEQO", "geqo"),
]


@pytest.mark.parametrize("sender", _SENDERS, ids=["pgoptions", "url-options", "pggeqo"])
def test_a_startup_parameter_pgbouncer_refuses_exits_78_naming_who_sent_it(
    database_url: str,
    session_pool: tuple[str, int],
    tmp_path: Path,
    sender: tuple[dict[str, str], dict[str, str], str, str],
) -> None:
    """It was waited out as an outage: SOKRATOS_STARTUP_TIMEOUT, then exit 75, restarted by
    systemd for ever, for a setting that will never be accepted."""
    extra, options, variable, parameter = sender
    url = _through(database_url, session_pool, **options)
    env = env_for(url, tmp_path, SOKRATOS_STARTUP_TIMEOUT="30s", **extra)
    started = time.monotonic()
    proc = cli("run", "--once", env=env)
    took = time.monotonic() - started
    assert proc.returncode == 78, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert f"invalid configuration: {variable}: " in line, line
    assert f"unsupported startup parameter: {parameter}" in line, line
    assert f"add {parameter} to PgBouncer's ignore_startup_parameters" in line, line
    assert "Traceback" not in proc.stderr
    assert took < 20, f"waited {took:.0f}s for a refusal that will not change"


def test_newer_pgbouncers_naming_a_setting_inside_options_blame_options() -> None:
    """PgBouncer 1.20 and later accept some settings in ``options`` and name the one they do
    not track; what to change is still ``options`` (here the URL's)."""
    text = (
        'connection failed: connection to server at "10.0.0.5", port 6432 failed: FATAL:  '
        "unsupported startup parameter in options: statement_timeout"
    )
    url = "postgresql://app@pooler:6432/db?options=-c%20statement_timeout%3D5s"
    refused = option_refused(text, url)
    assert refused is not None
    assert refused.variable == "SOKRATOS_DATABASE_URL"
    assert "unsupported startup parameter in options: statement_timeout" in refused.message
    assert "remove options= from the URL" in refused.message


@pytest.fixture(scope="module")
def transaction_pool(pg_server: str) -> Iterator[tuple[str, int]]:
    """PgBouncer in transaction pooling, which the worker cannot run behind."""
    with pgbouncer(pg_server, "transaction") as address:
        yield address


def _advisory_locks(db: psycopg.Connection) -> int:
    return count(db, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'")


@pytest.mark.parametrize("command", [("run", "--once"), ("migrate",)], ids=["run-once", "migrate"])
def test_transaction_pooling_exits_78_before_taking_any_session_lock(
    db: psycopg.Connection,
    database_url: str,
    transaction_pool: tuple[str, int],
    tmp_path: Path,
    command: tuple[str, ...],
) -> None:
    """It ran quietly broken: LISTEN lost, prepared statements failing attempts, and the
    migration's advisory lock left held on a pooled server connection for later clients."""
    n = 5
    enqueue_many(db, n)
    url = _through(database_url, transaction_pool)
    proc = cli(*command, env=env_for(url, tmp_path, SOKRATOS_STARTUP_TIMEOUT="30s"))
    assert proc.returncode == 78, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert "invalid configuration: SOKRATOS_DATABASE_URL: " in line, line
    assert "connection pooler in transaction or statement mode" in line, line
    assert "pool_mode = session" in line, line
    assert "Traceback" not in proc.stderr
    assert _advisory_locks(db) == 0
    # Nothing was claimed: the items wait, attempts untouched, for a worker set up right.
    assert count(db, "SELECT count(*) FROM pending_triage WHERE attempts = 0") == n
    assert count(db, "SELECT count(*) FROM work_outcomes") == 0


def test_the_daemon_behind_transaction_pooling_exits_78_at_start(
    db: psycopg.Connection, database_url: str, transaction_pool: tuple[str, int], tmp_path: Path
) -> None:
    """Exit 78 is what systemd's RestartPreventExitStatus keeps from restarting every 5 s."""
    env = daemon_env(_through(database_url, transaction_pool), tmp_path)
    log = tmp_path / "daemon.log"
    proc = start_daemon(env, log)
    try:
        assert proc.wait(60) == 78, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert "connection pooler in transaction or statement mode" in log.read_text()
    assert _advisory_locks(db) == 0


def test_check_names_transaction_pooling_and_passes_session_pooling(
    database_url: str,
    session_pool: tuple[str, int],
    transaction_pool: tuple[str, int],
    tmp_path: Path,
) -> None:
    def sessions_line(address: tuple[str, int]) -> str:
        proc = cli("check", env=env_for(_through(database_url, address), tmp_path))
        assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
        return next(x for x in proc.stdout.splitlines() if "sessions" in x)

    session = sessions_line(session_pool)
    assert session.startswith("ok") and "one server session per connection" in session, session
    shared = sessions_line(transaction_pool)
    assert shared.startswith("FAIL"), shared
    assert "connection pooler in transaction or statement mode" in shared, shared


def test_a_transaction_pooler_is_left_without_the_workers_session_settings(
    db: psycopg.Connection, database_url: str, pg_server: str, tmp_path: Path
) -> None:
    """`run` refuses transaction pooling (exit 78) so that it leaves no session state on the
    pooler's server connections, and the commands run through it: none may hand the next
    client of the pool a session whose timeouts the worker turned off (review, 2026-12-05:
    every connection set them at once, before the refusal too)."""
    name = str(conninfo_to_dict(database_url)["dbname"])
    db.execute(f'ALTER DATABASE "{name}" SET statement_timeout = \'17s\'')
    db.execute(f'ALTER DATABASE "{name}" SET lock_timeout = \'7s\'')
    with pgbouncer(pg_server, "transaction") as address:
        url = _through(database_url, address)
        env = env_for(url, tmp_path, SOKRATOS_STARTUP_TIMEOUT="10s")
        assert cli("run", "--once", env=env).returncode == 78
        assert cli("migrate", env=env).returncode == 78
        for command in (["status"], ["failed", "list"], ["failed", "purge", "--older-than", "30"]):
            done = cli(*command, env=env)
            assert done.returncode == 0, (command, done.stderr[-2000:])
        seen = set()
        for _ in range(3):  # the next clients of the same pool, as Sokratos's app would be
            with psycopg.connect(url, autocommit=True) as other:
                seen.add(
                    other.execute(
                        "SELECT current_setting('statement_timeout'),"
                        " current_setting('lock_timeout')"
                    ).fetchone()
                )
    assert seen == {("17s", "7s")}, seen
