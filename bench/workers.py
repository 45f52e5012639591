"""The worker processes the benchmark starts: ``python -m bench.workers SYSTEM``.

Configuration comes from the environment (set by bench/run.py):

- ``BENCH_DSN``: the database; ``BENCH_MODE``: ``noop`` (zero work), ``http`` (one chat call
  to ``BENCH_LLM_URL``), ``latency`` (append enqueue-to-start seconds to ``BENCH_LATENCY_FILE``)
  or ``triage`` (sokratos only: the production pipelines);
- ``BENCH_CONCURRENCY``; ``BENCH_BATCH`` (pgqueuer's batch size); ``BENCH_CAP`` (pgqueuer's
  ``max_concurrent_tasks`` outside W2; empty: no cap).

sokratos-worker runs as users run it: ``cli.main(["run"])`` with a bench handler factory
(the real daemon: pool, dispatcher, slot threads, LISTEN/NOTIFY, APScheduler, metrics off).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
from typing import Any

TASK = "bench_noop"
CHAT_BODY_MODEL = "scripted"


def _mode() -> str:
    return os.environ.get("BENCH_MODE", "noop")


class _LatencyLog:
    """Appends ``start - enqueued`` (seconds) per item, one line each, thread-safe."""

    def __init__(self) -> None:
        path = os.environ.get("BENCH_LATENCY_FILE")
        self._fh = open(path, "a", buffering=1) if path else None  # noqa: SIM115
        self._lock = threading.Lock()

    def record(self, payload: Any) -> None:
        now = time.time()
        if self._fh is None or not isinstance(payload, dict) or "t" not in payload:
            return
        with self._lock:
            self._fh.write(f"{now - float(payload['t']):.6f}\n")


def _chat_body(text: str) -> dict[str, Any]:
    return {
        "model": CHAT_BODY_MODEL,
        "messages": [
            {"role": "system", "content": "Answer with a JSON object."},
            {"role": "user", "content": text},
        ],
        "max_tokens": 16,
        "temperature": 0.1,
    }


# -- sokratos-worker -----------------------------------------------------------------------


def run_sokratos() -> int:
    from pydantic import BaseModel

    from sokratos_worker.cli import main
    from sokratos_worker.handlers import HandlerContext, Handlers
    from sokratos_worker.model import Effects, Item, NewMemory, Outcome, Queue

    mode = _mode()
    latency = _LatencyLog()

    class Pong(BaseModel):
        ok: bool

    class BenchHandler:
        def __init__(self, ctx: HandlerContext) -> None:
            self.chat = ctx.chat

        def handle(self, item: Item) -> Effects:
            if mode == "latency":
                latency.record(item.payload)
            elif mode == "http":
                assert self.chat is not None, "W2 needs SOKRATOS_LLM_BACKENDS"
                result = self.chat.complete(
                    response_model=Pong,
                    system="Answer with a JSON object.",
                    user=str(item.payload.get("exchange", "")),
                    max_tokens=16,
                    purpose="bench",
                )
                return Effects(Outcome.SKIPPED, backend=result.backend)
            return Effects(Outcome.SKIPPED)

        def final_failure_memories(self, item: Item) -> tuple[NewMemory, ...]:
            return ()

        def probe(self) -> bool:
            return True

    def factory(ctx: HandlerContext) -> Handlers:
        return {Queue.TRIAGE: BenchHandler(ctx)}

    if mode == "triage":
        return main(["run", "--no-migrate"])
    return main(["run", "--no-migrate"], handler_factory=factory)


# -- procrastinate -------------------------------------------------------------------------


def make_procrastinate_app(dsn: str, pool_size: int) -> Any:
    """The app both the worker and the enqueuer use (one task)."""
    import procrastinate

    return procrastinate.App(
        connector=procrastinate.PsycopgConnector(
            conninfo=dsn, min_size=pool_size, max_size=pool_size
        )
    )


def run_procrastinate() -> int:
    import httpx

    dsn = os.environ["BENCH_DSN"]
    concurrency = int(os.environ.get("BENCH_CONCURRENCY", "10"))
    mode = _mode()
    latency = _LatencyLog()
    # One connection per concurrent job plus the listener (procrastinate docs: the pool must
    # be large enough for the worker's concurrency, or jobs wait for a connection).
    app = make_procrastinate_app(dsn, concurrency + 2)
    client: dict[str, httpx.AsyncClient] = {}

    @app.task(name=TASK)
    async def bench_noop(payload: Any = None) -> None:
        if mode == "latency":
            latency.record(payload)
        elif mode == "http":
            reply = await client["c"].post("/chat/completions", json=_chat_body(str(payload)))
            reply.raise_for_status()
            json.loads(reply.content)

    async def main() -> None:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(
            base_url=os.environ.get("BENCH_LLM_URL", "http://127.0.0.1:1/v1"),
            limits=limits,
            timeout=30,
        ) as http:
            client["c"] = http
            async with app.open_async():
                await app.run_worker_async(
                    concurrency=concurrency,
                    wait=True,
                    listen_notify=True,
                    install_signal_handlers=True,
                    shutdown_graceful_timeout=5,
                )

    asyncio.run(main())
    return 0


# -- pgqueuer ------------------------------------------------------------------------------


def run_pgqueuer() -> int:
    import httpx
    import psycopg
    from pgqueuer import PgQueuer
    from pgqueuer.db import PsycopgDriver
    from pgqueuer.models import Job

    dsn = os.environ["BENCH_DSN"]
    concurrency = int(os.environ.get("BENCH_CONCURRENCY", "10"))
    batch = int(os.environ.get("BENCH_BATCH", "10"))
    mode = _mode()
    latency = _LatencyLog()

    async def main() -> None:
        conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(
            base_url=os.environ.get("BENCH_LLM_URL", "http://127.0.0.1:1/v1"),
            limits=limits,
            timeout=30,
        ) as http:
            pgq = PgQueuer(PsycopgDriver(conn))

            @pgq.entrypoint(TASK)
            async def bench_noop(job: Job) -> None:
                payload = json.loads(job.payload) if job.payload else None
                if mode == "latency":
                    latency.record(payload)
                elif mode == "http":
                    reply = await http.post("/chat/completions", json=_chat_body(str(payload)))
                    reply.raise_for_status()
                    json.loads(reply.content)

            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, pgq.shutdown.set)
            # W2 bounds in-flight jobs to the concurrency (pgqueuer requires >= 2x batch);
            # W1/W3 use BENCH_CAP: the concurrency-10 row sets it, the uncapped rows don't.
            cap = concurrency if mode == "http" and concurrency >= 2 * batch else None
            if mode != "http" and os.environ.get("BENCH_CAP"):
                cap = int(os.environ["BENCH_CAP"])
            await pgq.run(batch_size=batch, max_concurrent_tasks=cap)
        await conn.close()

    asyncio.run(main())
    return 0


RUNNERS = {"sokratos": run_sokratos, "procrastinate": run_procrastinate, "pgqueuer": run_pgqueuer}

if __name__ == "__main__":
    raise SystemExit(RUNNERS[sys.argv[1]]())
