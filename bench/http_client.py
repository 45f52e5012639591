"""What an LLM call costs the worker's HTTP client, layer by layer, against bench's server.

    python3 -m bench.http_client [--calls N]

For bare ``http.client``, ``httpx.Client`` on its own transport and on sokratos-worker's
``StdlibTransport``, the worker's ``CookielessClient`` on it, and ``FallbackChatClient``:

- CPU per call: one thread, sequential calls to a server that answers at once;
- rate: 20 threads against the 50 ms server (the W2 shape, no queue; ideal 400/s).

Alternating the clients in rounds, in one process, keeps the comparison fair on a shared
machine. Writes bench/results/http_client.json and .md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import functools
import http.client
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from pydantic import BaseModel  # noqa: E402

from bench.run import RESULTS, llm_server, machine  # noqa: E402
from bench.workers import _chat_body  # noqa: E402
from sokratos_worker.config import BackendConfig  # noqa: E402
from sokratos_worker.llm.chat import FallbackChatClient  # noqa: E402
from sokratos_worker.llm.http import CookielessClient  # noqa: E402
from sokratos_worker.llm.transport import StdlibTransport  # noqa: E402
from sokratos_worker.logs import configure_logging  # noqa: E402

Call = Callable[[], object]


class Pong(BaseModel):
    ok: bool


def _raw(url: str) -> Call:
    target = httpx.URL(url)
    conn = http.client.HTTPConnection(target.host, target.port)
    body = json.dumps(_chat_body("ping")).encode()
    path = f"{target.path}/chat/completions"

    def call() -> object:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        return json.loads(conn.getresponse().read())

    return call


def _httpx(
    transport: Callable[[], httpx.BaseTransport] | None, client_class: type[httpx.Client]
) -> Callable[[str], Call]:
    def make(url: str) -> Call:
        client = client_class(transport=transport() if transport is not None else None)
        target = httpx.URL(f"{url}/chat/completions")
        return lambda: client.post(target, json=_chat_body("ping")).json()

    return make


@functools.cache
def _shared_fallback_client(url: str) -> FallbackChatClient:
    # One client for every thread, as the worker has (it keeps an httpx client per thread).
    backend = BackendConfig.model_validate(
        {"name": "bench", "url": url, "model": "scripted", "max_concurrency": 20}
    )
    return FallbackChatClient([backend])


def fallback_call(url: str) -> Call:
    """A call through sokratos-worker's chat client, as the W2 handler makes it."""
    client = _shared_fallback_client(url)
    return lambda: client.complete(
        response_model=Pong,
        system="Answer with a JSON object.",
        user="ping",
        max_tokens=16,
        purpose="bench",
    )


CLIENTS: dict[str, Callable[[str], Call]] = {
    "http.client (bare)": _raw,
    "httpx.Client, its own transport": _httpx(None, httpx.Client),
    "httpx.Client, StdlibTransport": _httpx(StdlibTransport, httpx.Client),
    "CookielessClient, StdlibTransport": _httpx(StdlibTransport, CookielessClient),
    "FallbackChatClient": fallback_call,
}


def cpu_per_call_ms(make: Callable[[str], Call], url: str, calls: int) -> float:
    call = make(url)
    for _ in range(50):
        call()
    started = time.thread_time()
    for _ in range(calls):
        call()
    return (time.thread_time() - started) / calls * 1000


def rate(make: Callable[[str], Call], url: str, calls: int, threads: int = 20) -> float:
    """``calls`` calls from ``threads`` threads, each with its own ``make(url)``."""
    todo = list(range(calls))
    ready = threading.Barrier(threads + 1)

    def one() -> None:
        call = make(url)
        call()  # connected before the clock starts
        ready.wait()
        while True:
            try:
                todo.pop()
            except IndexError:
                return
            call()

    workers = [threading.Thread(target=one) for _ in range(threads)]
    for worker in workers:
        worker.start()
    ready.wait()
    started = time.monotonic()
    for worker in workers:
        worker.join()
    return calls / (time.monotonic() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=2000, help="calls per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    args = parser.parse_args(argv)
    cpu: dict[str, list[float]] = {name: [] for name in CLIENTS}
    rates: dict[str, list[float]] = {name: [] for name in CLIENTS}
    # The worker's log lines rendered as it renders them (JSON), then thrown away.
    with (
        open(os.devnull, "w") as sink,
        contextlib.redirect_stderr(sink),
        llm_server(0.0) as instant,
        llm_server(0.05) as slow,
    ):
        configure_logging("info", "json", cache=True)
        for r in range(args.rounds):
            names = list(CLIENTS) if r % 2 == 0 else list(reversed(CLIENTS))
            for name in names:
                cpu[name].append(cpu_per_call_ms(CLIENTS[name], instant, args.calls))
                rates[name].append(rate(CLIENTS[name], slow, args.calls))
                print(
                    f"r{r} {name}: {cpu[name][-1]:.3f} ms CPU/call, "
                    f"{rates[name][-1]:.0f}/s at 20 threads",
                    flush=True,
                )
    result: dict[str, Any] = {
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "calls": args.calls,
        "cpu_ms_per_call": cpu,
        "rate_20_threads_50ms": rates,
    }
    lines = [
        f"# HTTP client cost per LLM call ({result['when']})",
        "",
        f"{args.calls:,} calls per measurement, {args.rounds} alternating rounds, medians. "
        "CPU: one thread, sequential, instant server. Rate: 20 threads, 50 ms server "
        "(ideal 400/s). Reproduce: `python3 -m bench.http_client`.",
        "",
        "| client | CPU per call | rate, 20 threads |",
        "|---|---|---|",
    ]
    for name in CLIENTS:
        lines.append(
            f"| {name} | {statistics.median(cpu[name]):.3f} ms "
            f"| {statistics.median(rates[name]):.0f}/s |"
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "http_client.json").write_text(json.dumps(result, indent=1) + "\n")
    (RESULTS / "http_client.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
