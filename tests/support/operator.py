"""The CLI as an operator runs it: a real subprocess in a clean environment, and databases
that a plain (non-superuser) role logs in to."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

REPO = Path(__file__).resolve().parents[2]


def cli_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A clean environment: no SOKRATOS_* / PG* from the caller, a fresh HOME and data dir."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.upper().startswith(("SOKRATOS_", "PG", "DATABASE_URL", "CREDENTIALS_DIRECTORY"))
    }
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env.update(
        HOME=str(home),
        PYTHONPATH=str(REPO),
        SOKRATOS_DATA_DIR=str(tmp_path / "data"),
        SOKRATOS_STARTUP_TIMEOUT="5s",
        SOKRATOS_LOG_FORMAT="json",
    )
    env.update(extra)
    return env


def run_cli(
    args: list[str], env: dict[str, str], *, stdin: str | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sokratos_worker", *args],
        check=False,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(REPO),
    )


def with_database(uri: str, *, dbname: str | None = None, user: str | None = None) -> str:
    info = psycopg.conninfo.conninfo_to_dict(uri)
    if dbname:
        info["dbname"] = dbname
    if user:
        info["user"] = user
        info.pop("password", None)
    return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items() if v is not None})


@pytest.fixture
def plain_role_database(pg_server: str) -> Iterator[Callable[[bool], str]]:
    """A database a non-superuser role logs in to, with no migrations applied.

    ``make(owned)``: owned=True -> the role owns the database (but may not create the
    pgvector extension); owned=False -> the superuser owns it and created pgvector, the role
    only connects (it may not create tables in schema public: PostgreSQL >= 15).
    """
    created: list[tuple[str, str]] = []

    def make(owned: bool) -> str:
        import uuid

        suffix = uuid.uuid4().hex[:8]
        role, db = f"plain_role_{suffix}", f"plain_db_{suffix}"
        with psycopg.connect(pg_server, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
            if owned:
                conn.execute(
                    sql.SQL("CREATE DATABASE {} OWNER {}").format(
                        sql.Identifier(db), sql.Identifier(role)
                    )
                )
            else:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(db)))
        if not owned:
            with psycopg.connect(with_database(pg_server, dbname=db), autocommit=True) as conn:
                conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        created.append((role, db))
        return with_database(pg_server, dbname=db, user=role)

    yield make
    with psycopg.connect(pg_server, autocommit=True) as conn:
        for role, db in created:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(db))
            )
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


Handler = Callable[[http.server.BaseHTTPRequestHandler, str], tuple[int, str, str]]


@pytest.fixture
def http_server() -> Iterator[Callable[[Handler], str]]:
    """``start(fn)`` serves fn(request, method) -> (status, content_type, body) on 127.0.0.1."""
    servers: list[http.server.ThreadingHTTPServer] = []

    def start(fn: Handler) -> str:
        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _answer(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                status, ctype, body = fn(self, method)
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._answer("GET")

            def do_POST(self) -> None:
                self._answer("POST")

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()
