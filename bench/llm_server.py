"""The local OpenAI-compatible server for W2: ``python -m bench.llm_server LATENCY_S``.

It answers with ScriptedLLM's replies ``latency`` seconds after each request arrived, in its
own process, printing its ``/v1`` URL and serving until stdin closes. Chat replies are routed
by prompt so the real triage pipeline gets valid answers; ``GET /bench/stats`` returns
request counts per purpose.

Every system's W2 rate is bounded by how late the server answers, so it is a lean HTTP/1.1
server (keep-alive, Content-Length bodies) with a thread per connection that sleeps until
its reply is due (timer slack 1 us): one sequential client saw 50.8 ms per 50 ms call, where
the earlier asyncio server (a timer thread resolving futures on the loop; ``--asyncio``)
gave 51.3-51.5 ms and the project's ``ScriptedLLM`` (``--threaded``; http.server) tops out
near 200 requests/s on a busy 2-core machine.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import heapq
import itertools
import json
import re
import socket
import sys
import threading
import time
from collections import Counter
from http.server import ThreadingHTTPServer
from typing import Any

from sokratos_worker.pipelines import prompts
from sokratos_worker.testing.scripted_llm import (
    CHAT,
    EMBEDDINGS,
    Reply,
    Request,
    ScriptedLLM,
    hash_embedding_responder,
)

EMBED_DIM = 64
_ITEM = re.compile(r"item (\d+)")


def main() -> int:
    latency = float(sys.argv[1]) if len(sys.argv) > 1 else 0.05
    # The stdlib default listen backlog is 5: 20 clients connecting at once would lose SYNs
    # (a 1 s retransmit). A real LLM server's backlog is larger.
    ThreadingHTTPServer.request_queue_size = 256
    counts: Counter[str] = Counter()
    lock = threading.Lock()
    embed = hash_embedding_responder(EMBED_DIM, model="bench-embed")

    def count(kind: str) -> None:
        with lock:
            counts[kind] += 1

    def chat(request: Request) -> Reply:
        messages = request.messages
        system = str(messages[0].get("content", "")) if messages else ""
        user = str(messages[-1].get("content", "")) if messages else ""
        if system.startswith(prompts.CONTRADICTION[:40]):
            count("contradiction")
            return Reply.chat({"verdicts": [{"existing": 1, "contradicts": False}]})
        if system.startswith(prompts.CONVERSATION_TRIAGE[:40]):
            count("triage")
            return Reply.chat(_verdict(user))
        count("chat")
        return Reply.chat({"ok": True})

    def embeddings(request: Request) -> Reply:
        count("embeddings")
        return embed(request)

    def stats(_: Request) -> Reply:
        with lock:
            return Reply(json_body=dict(counts))

    routes = {CHAT: chat, EMBEDDINGS: embeddings, "/bench/stats": stats,
              "/health": lambda _: Reply(json_body={"status": "ok"}),
              "/v1/models": lambda _: Reply(json_body={"object": "list", "data": [
                  {"id": "scripted", "object": "model", "owned_by": "bench"}]})}
    if "--threaded" in sys.argv:
        server = ScriptedLLM(chat=chat, embed_dim=EMBED_DIM, latency=latency)
        server.on(EMBEDDINGS, embeddings)
        server.on("/bench/stats", stats)
        with server:
            print(server.url, flush=True)
            sys.stdin.read()  # until the parent closes our stdin
        return 0
    if "--asyncio" in sys.argv:
        asyncio.run(_serve(routes, latency))
        return 0
    _serve_threads(routes, latency)
    return 0


def _serve_threads(routes: dict[str, Any], latency: float) -> None:
    _precise_sleeps()
    listener = socket.create_server(("127.0.0.1", 0), backlog=512)
    print(f"http://127.0.0.1:{listener.getsockname()[1]}/v1", flush=True)

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed: the server is stopping
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=_connection, args=(conn, routes, latency), daemon=True).start()

    threading.Thread(target=accept, name="accept", daemon=True).start()
    sys.stdin.read()  # until the parent closes our stdin
    listener.close()


def _precise_sleeps() -> None:
    """Timer slack 1 us for this thread and those it starts (Linux's default is 50 us)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK


def _connection(conn: socket.socket, routes: dict[str, Any], latency: float) -> None:
    """One keep-alive connection: read a request, answer it when due, until the peer closes."""
    with conn, conn.makefile("rb") as reader:
        while True:
            line = reader.readline()
            if not line:
                return
            arrived = time.monotonic()  # the reply is due ``latency`` after this
            method, target, _ = line.decode("latin-1").split(" ", 2)
            headers: dict[str, str] = {}
            while (header := reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = header.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length", "0"))
            raw = reader.read(length) if length else b""
            path = target.split("?", 1)[0]
            request = Request(method=method, path=path, headers=headers,
                              body=json.loads(raw) if raw else None, started=arrived)
            responder = routes.get(path)
            reply = responder(request) if responder else Reply.error(404, "unknown path")
            payload = json.dumps(reply.json_body).encode()
            if path in (CHAT, EMBEDDINGS):
                due = arrived + latency - time.monotonic()
                if due > 0:
                    time.sleep(due)
            try:
                conn.sendall(
                    f"HTTP/1.1 {reply.status} X\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload
                )
            except OSError:
                return  # the client went away


class _Timer:
    """Resolves futures at their deadlines from one thread.

    Under 20 concurrent requests ``asyncio.sleep(0.05)`` answered ~0.75 ms late on average (the
    loop checks its timers between batches of ready callbacks), which every system's "ideal"
    rate would have paid; a condition variable's timed wait wakes within ~0.2 ms.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._due: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self._changed = threading.Condition()
        threading.Thread(target=self._run, name="timer", daemon=True).start()

    def at(self, deadline: float) -> asyncio.Future[None]:
        """A future resolved at ``deadline`` (``time.monotonic()`` seconds)."""
        future = self._loop.create_future()
        with self._changed:
            heapq.heappush(self._due, (deadline, next(self._order), future))
            self._changed.notify()
        return future

    def _run(self) -> None:
        with self._changed:
            while True:
                if not self._due:
                    self._changed.wait()
                    continue
                delay = self._due[0][0] - time.monotonic()
                if delay > 0:
                    self._changed.wait(delay)
                    continue
                future = heapq.heappop(self._due)[2]
                self._loop.call_soon_threadsafe(_resolve, future)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def _serve(routes: dict[str, Any], latency: float) -> None:
    timer = _Timer(asyncio.get_running_loop())

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                arrived = time.monotonic()  # the reply is due ``latency`` after this
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in
                           (line.partition(":") for line in lines[1:] if line)}
                length = int(headers.get("content-length", "0"))
                raw = await reader.readexactly(length) if length else b""
                body = json.loads(raw) if raw else None
                path = target.split("?", 1)[0]
                request = Request(method=method, path=path, headers=headers, body=body,
                                  started=arrived)
                responder = routes.get(path)
                reply = responder(request) if responder else Reply.error(404, "unknown path")
                if path in (CHAT, EMBEDDINGS):
                    await timer.at(arrived + latency)
                payload = json.dumps(reply.json_body).encode()
                writer.write(
                    f"HTTP/1.1 {reply.status} X\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the client went away, or the server is stopping with the connection open
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=512)
    port = server.sockets[0].getsockname()[1]
    print(f"http://127.0.0.1:{port}/v1", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes our stdin
    server.close()


def _verdict(user: str) -> dict[str, Any]:
    # Words unique to the item keep summaries apart (cosine distance above the near-duplicate
    # 0.05) while the shared words keep them close enough (below 0.4) that every save after
    # the first meets candidates for the contradiction check.
    found = _ITEM.search(user)
    n = int(found.group(1)) if found else 0
    return {
        "salience_score": 7,
        "summary": f"The user's daughter started school this autumn; noted alpha{n}"
        f" beta{n * 7} gamma{n * 13}.",
        "category": "personal",
        "tags": ["family"],
        "save": True,
        "paradigm_shift": False,
    }


if __name__ == "__main__":
    raise SystemExit(main())
