"""The three queues under test: schema, reset, enqueue, what is left, how to start a worker."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from bench.workers import TASK, make_procrastinate_app

ROOT = Path(__file__).resolve().parents[1]
PAD = "x" * 150  # a ~200-byte JSON payload with the exchange text and a timestamp


def payload(i: int, t: float | None = None) -> dict[str, Any]:
    """The same ~200-byte payload for every system."""
    return {"exchange": f"user: item {i} {PAD}", "n": i, "t": t if t is not None else 0.0}


def with_dbname(uri: str, name: str) -> str:
    info = psycopg.conninfo.conninfo_to_dict(uri)
    info["dbname"] = name
    return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items() if v is not None})


class System:
    """One queue implementation in its own database of the shared server."""

    name = ""
    dbname = ""
    module = ""
    queue_table = ""
    remaining_sql = ""
    truncate: tuple[str, ...] = ()

    def __init__(
        self, server_uri: str, label: str | None = None, batch: int = 10, cap: int | None = None
    ) -> None:
        self.server_uri = server_uri
        self.uri = with_dbname(server_uri, self.dbname)
        self.label = label or self.name
        self.batch = batch
        self.cap = cap  # pgqueuer's max_concurrent_tasks in W1/W3 (None: its default, no cap)
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- database ----------------------------------------------------------------------------

    def create(self) -> None:
        with psycopg.connect(self.server_uri, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(self.dbname)))
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.dbname)))
        self.install()

    def install(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """TRUNCATE the queue's tables and VACUUM the database (between every two runs)."""
        with psycopg.connect(self.uri, autocommit=True) as conn:
            conn.execute("TRUNCATE " + ", ".join(self.truncate) + " RESTART IDENTITY CASCADE")
            conn.execute("VACUUM (ANALYZE)")
            conn.execute("CHECKPOINT")

    def remaining(self, conn: psycopg.Connection) -> int:
        row = conn.execute(self.remaining_sql).fetchone()
        return int(row[0]) if row else 0

    def prefill(self, n: int) -> None:
        raise NotImplementedError

    def enqueue_one(self, item: dict[str, Any]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        if self._loop is not None:
            self._loop.run_until_complete(self._aclose())
            self._loop.close()
            self._loop = None

    async def _aclose(self) -> None:
        return None

    # -- worker ------------------------------------------------------------------------------

    def env(self, mode: str, concurrency: int, extra: dict[str, str]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SOKRATOS_", "BENCH_"))}
        env.update(
            BENCH_DSN=self.uri,
            BENCH_MODE=mode,
            BENCH_CONCURRENCY=str(concurrency),
            BENCH_BATCH=str(self.batch),
            BENCH_CAP=str(self.cap or ""),
            PYTHONPATH=str(ROOT),
        )
        env.update(extra)
        return env

    def start(
        self, mode: str, concurrency: int, log_path: Path, extra: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        handle = log_path.open("ab")
        return subprocess.Popen(
            [sys.executable, "-m", "bench.workers", self.name],
            env=self.env(mode, concurrency, extra or {}),
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=handle,
            stderr=handle,
        )


class Sokratos(System):
    name = "sokratos"
    dbname = "bench_sokratos"
    queue_table = "pending_triage"
    remaining_sql = "SELECT count(*) FROM pending_triage"
    truncate = ("pending_triage", "work_outcomes", "memories", "failed_operations",
                "sokratos_idempotency_keys", "worker_heartbeats")

    def install(self) -> None:
        from sokratos_worker.store.migrations import apply_migrations

        apply_migrations(self.uri)

    def prefill(self, n: int) -> None:
        # Producers' path without per-row validation: the Go application's direct INSERT
        # (the statement trigger still NOTIFYs).
        with psycopg.connect(self.uri, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO pending_triage (payload) SELECT jsonb_build_object("
                "'exchange', 'user: item ' || g || ' ' || %s, 'n', g, 't', 0.0)"
                " FROM generate_series(1, %s) AS g",
                (PAD, n),
            )

    def enqueue_one(self, item: dict[str, Any]) -> None:
        if not hasattr(self, "_conn"):
            self._conn = psycopg.connect(self.uri, autocommit=True)
        # The producers' interface: validate, insert, NOTIFY (one commit).
        self._conn.execute("SELECT sokratos_enqueue_triage(%s::jsonb)", (json.dumps(item),))

    def close(self) -> None:
        if hasattr(self, "_conn"):
            self._conn.close()
            del self._conn

    def env(self, mode: str, concurrency: int, extra: dict[str, str]) -> dict[str, str]:
        env = super().env(mode, concurrency, extra)
        env.setdefault("SOKRATOS_DATABASE_URL", self.uri)
        env.setdefault("SOKRATOS_CONCURRENCY", str(concurrency))
        env.setdefault("SOKRATOS_HEARTBEAT_INTERVAL", "60s")
        env.setdefault("SOKRATOS_LOG_FORMAT", "json")
        env.setdefault("SOKRATOS_DATA_DIR", "/tmp/sokratos-bench-data")
        env.setdefault("SOKRATOS_SHUTDOWN_GRACE", "5s")
        return env


class Procrastinate(System):
    name = "procrastinate"
    dbname = "bench_procrastinate"
    remaining_sql = "SELECT count(*) FROM procrastinate_jobs WHERE status IN ('todo', 'doing')"
    truncate = ("procrastinate_jobs", "procrastinate_events", "procrastinate_workers")

    def _app(self) -> Any:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._application = make_procrastinate_app(self.uri, 2)

            @self._application.task(name=TASK)
            async def bench_noop(payload: Any = None) -> None:
                return None

            self._task = bench_noop
            self._loop.run_until_complete(self._application.open_async())
        return self._application

    async def _aclose(self) -> None:
        await self._application.close_async()

    def install(self) -> None:
        app = self._app()
        assert self._loop is not None
        self._loop.run_until_complete(app.schema_manager.apply_schema_async())

    def prefill(self, n: int) -> None:
        self._app()
        assert self._loop is not None
        kwargs = [{"payload": payload(i)} for i in range(1, n + 1)]
        for start in range(0, n, 1000):
            self._loop.run_until_complete(self._task.batch_defer_async(*kwargs[start:start + 1000]))

    def enqueue_one(self, item: dict[str, Any]) -> None:
        self._app()
        assert self._loop is not None
        self._loop.run_until_complete(self._task.defer_async(payload=item))


class PgQueuer(System):
    name = "pgqueuer"
    dbname = "bench_pgqueuer"
    remaining_sql = "SELECT count(*) FROM pgqueuer"
    truncate = ("pgqueuer", "pgqueuer_log", "pgqueuer_statistics")

    def _queries(self) -> Any:
        if self._loop is None:
            from pgqueuer.db import PsycopgDriver
            from pgqueuer.queries import Queries

            self._loop = asyncio.new_event_loop()
            self._conn = self._loop.run_until_complete(
                psycopg.AsyncConnection.connect(self.uri, autocommit=True)
            )
            self._q = Queries(PsycopgDriver(self._conn))
        return self._q

    async def _aclose(self) -> None:
        await self._conn.close()

    def install(self) -> None:
        q = self._queries()
        assert self._loop is not None
        self._loop.run_until_complete(q.install())

    def prefill(self, n: int) -> None:
        q = self._queries()
        assert self._loop is not None
        for start in range(0, n, 1000):
            count = min(1000, n - start)
            bodies = [json.dumps(payload(start + i + 1)).encode() for i in range(count)]
            self._loop.run_until_complete(q.enqueue([TASK] * count, bodies, [0] * count))

    def enqueue_one(self, item: dict[str, Any]) -> None:
        q = self._queries()
        assert self._loop is not None
        self._loop.run_until_complete(q.enqueue(TASK, json.dumps(item).encode()))


def now() -> float:
    return time.time()
