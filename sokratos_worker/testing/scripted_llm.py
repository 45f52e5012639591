"""A scripted OpenAI-compatible HTTP server on 127.0.0.1 for tests and benchmarks.

It speaks real HTTP so the client under test runs its real transport, timeouts and retries::

    with ScriptedLLM() as srv:
        srv.script(Reply.chat({"salience": 7}), Reply.error(503, "Loading model"))
        backend_url = srv.url            # http://127.0.0.1:PORT/v1

Scripted replies are used first, in order, per path; then the path's responder (a callable
taking the :class:`Request`) answers. Every request is recorded, thread-safely. The worker's
health probes (a one-token chat request) are routed to the pseudo-path ``PROBE``, which
answers "OK" unless told otherwise: ``srv.on(PROBE, ...)`` makes the server look down.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import re
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

from sokratos_worker.llm.chat import PROBE_MESSAGE

CHAT = "/v1/chat/completions"
EMBEDDINGS = "/v1/embeddings"
MODELS = "/v1/models"
HEALTH = "/health"
# Not a URL: the route of the worker's health-probe chat requests (PROBE_MESSAGE), which
# arrive on CHAT but are answered, scripted and counted apart from the calls items make.
PROBE = "probe"


@dataclass(frozen=True)
class Request:
    """One request as the server saw it."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any
    started: float

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The chat messages, or an empty list."""
        if isinstance(self.body, dict):
            messages = self.body.get("messages", [])
            return messages if isinstance(messages, list) else []
        return []


@dataclass(frozen=True)
class Reply:
    """What the server does for one request: answer, fail, hang or drop the connection."""

    status: int = 200
    json_body: Any = None
    raw: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0
    drop: bool = False
    close: bool = False  # answer, then close without "Connection: close" (a dropping proxy)

    @classmethod
    def chat(
        cls,
        content: Any,
        *,
        prompt_tokens: int = 11,
        completion_tokens: int = 7,
        delay: float = 0.0,
        finish_reason: str = "stop",
    ) -> Reply:
        """A chat completion whose content is ``content`` (JSON-encoded unless a string);
        ``finish_reason="length"`` is a reply cut off at ``max_tokens``."""
        text = content if isinstance(content, str) else json.dumps(content)
        return cls(
            json_body={
                "id": "chatcmpl-scripted",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": "scripted",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": finish_reason,
                    }
                ],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
            },
            delay=delay,
        )

    @classmethod
    def error(
        cls,
        status: int,
        message: str = "scripted error",
        *,
        type: str = "server_error",
        code: str | None = None,
        retry_after: float | str | None = None,
        delay: float = 0.0,
    ) -> Reply:
        """An OpenAI-style error body with any status, optionally with Retry-After."""
        headers = {"Retry-After": str(retry_after)} if retry_after is not None else {}
        body = {"error": {"message": message, "type": type, "code": code or type}}
        return cls(status=status, json_body=body, headers=headers, delay=delay)

    @classmethod
    def text(cls, body: str, status: int = 200) -> Reply:
        """A raw body, e.g. invalid JSON."""
        return cls(status=status, raw=body.encode())

    @classmethod
    def hang(cls, seconds: float) -> Reply:
        """Say nothing for ``seconds`` (until the server closes), then a 504."""
        return cls.error(504, "scripted hang", delay=seconds)

    @classmethod
    def disconnect(cls) -> Reply:
        """Close the connection without sending a response."""
        return cls(drop=True)

    @classmethod
    def embeddings(cls, vectors: Sequence[Sequence[float]], model: str = "scripted") -> Reply:
        """An embeddings response with these vectors in order."""
        data = [
            {"object": "embedding", "index": i, "embedding": list(v)} for i, v in enumerate(vectors)
        ]
        return cls(json_body={"object": "list", "data": data, "model": model})


Responder = Callable[[Request], Reply]

_WORD = re.compile(r"\w+")


def hash_embedding(text: str, dim: int) -> list[float]:
    """A deterministic, L2-normalised bag-of-words vector: equal text, equal vector;
    texts sharing words point in similar directions."""
    vector = [0.0] * dim
    words = _WORD.findall(text.lower()) or [""]
    for word in words:
        digest = hashlib.sha256(word.encode()).digest()
        index = int.from_bytes(digest[:4], "big") % dim
        vector[index] += 1.0 if digest[4] % 2 == 0 else -1.0
    if not any(vector):
        vector[0] = 1.0  # opposite signs cancelled out; any fixed unit vector will do
    norm = math.sqrt(sum(x * x for x in vector))
    return [x / norm for x in vector]


def hash_embedding_responder(dim: int, model: str = "scripted-embed") -> Responder:
    """Answer ``/v1/embeddings`` with :func:`hash_embedding` vectors of ``dim`` dimensions."""

    def respond(request: Request) -> Reply:
        body = request.body if isinstance(request.body, dict) else {}
        texts = body.get("input", [])
        if isinstance(texts, str):
            texts = [texts]
        return Reply.embeddings([hash_embedding(str(t), dim) for t in texts], model=model)

    return respond


def json_responder(content: Any) -> Responder:
    """Answer every chat request with the same JSON content."""
    return lambda request: Reply.chat(content)


def _no_script(request: Request) -> Reply:
    return Reply.error(500, f"nothing scripted for {request.path}")


class _ClosingServer(ThreadingHTTPServer):
    """Cuts its open connections on close: ``shutdown()`` only stops accepting, and a
    client's kept-alive connection went on being answered by the old script (a review found
    fault phases made with ``close()`` that never reached the worker, 2026-12-05)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._open_lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def cut_connections(self) -> None:
        with self._open_lock:
            connections, self._open = list(self._open), set()
        for connection in connections:
            with contextlib.suppress(OSError):  # already gone
                connection.shutdown(socket.SHUT_RDWR)


class ScriptedLLM:
    """The server; use it as a context manager. ``url`` ends in ``/v1``."""

    def __init__(
        self,
        *,
        chat: Responder | None = None,
        embed_dim: int | None = None,
        models: Iterable[str] = ("scripted",),
        latency: float = 0.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.latency = latency
        self.ssl_context = ssl_context
        self.models = list(models)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._scripts: dict[str, deque[Reply]] = {}
        self._responders: dict[str, Responder] = {
            CHAT: chat or _no_script,
            EMBEDDINGS: hash_embedding_responder(embed_dim) if embed_dim else _no_script,
            MODELS: self._models_reply,
            HEALTH: lambda request: Reply(json_body={"status": "ok"}),
            PROBE: lambda request: Reply.chat("OK", completion_tokens=1),
        }
        self._requests: list[Request] = []
        self._in_flight = 0
        self.max_in_flight = 0
        self._server: _ClosingServer | None = None
        self._thread: threading.Thread | None = None

    # -- scripting -------------------------------------------------------------------------

    def script(self, *replies: Reply, path: str = CHAT) -> None:
        """Queue replies for ``path``; they are used once each, in order."""
        with self._lock:
            self._scripts.setdefault(path, deque()).extend(replies)

    def on(self, path: str, responder: Responder) -> None:
        """Answer ``path`` with ``responder`` once its scripted replies are used up."""
        with self._lock:
            self._responders[path] = responder

    def pending(self, path: str = CHAT) -> int:
        """Scripted replies not used yet."""
        with self._lock:
            return len(self._scripts.get(path, ()))

    # -- what happened ---------------------------------------------------------------------

    @property
    def requests(self) -> list[Request]:
        """A copy of every request so far, in arrival order."""
        with self._lock:
            return list(self._requests)

    def count(self, path: str = CHAT) -> int:
        """How many requests ``path`` received."""
        with self._lock:
            return sum(1 for r in self._requests if r.path == path)

    def bodies(self, path: str = CHAT) -> list[Any]:
        """The parsed bodies of the requests to ``path``."""
        return [r.body for r in self.requests if r.path == path]

    def reset(self) -> None:
        """Forget requests, scripts and the concurrency high-water mark."""
        with self._lock:
            self._requests.clear()
            self._scripts.clear()
            self.max_in_flight = 0

    # -- life cycle ------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The port the server listens on."""
        if self._server is None:
            raise RuntimeError("ScriptedLLM is not started")
        return int(self._server.server_address[1])

    @property
    def base_url(self) -> str:
        """``http(s)://127.0.0.1:PORT`` (where ``/health`` lives)."""
        scheme = "https" if self.ssl_context else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """The OpenAI-compatible base URL, ending in ``/v1``."""
        return f"{self.base_url}/v1"

    def start(self) -> ScriptedLLM:
        """Bind 127.0.0.1 on a free port and serve in a daemon thread."""
        handler = _make_handler(self)
        server = _ClosingServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        server.block_on_close = False  # hanging handlers must not block close()
        if self.ssl_context is not None:
            server.socket = self.ssl_context.wrap_socket(server.socket, server_side=True)
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving, kept-alive connections included (a server that went away answers
        no one); hanging handlers are woken and end."""
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server.cut_connections()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> ScriptedLLM:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------

    def _models_reply(self, request: Request) -> Reply:
        data = [{"id": m, "object": "model", "owned_by": "scripted"} for m in self.models]
        return Reply(json_body={"object": "list", "data": data})

    def _choose(self, request: Request) -> Reply:
        with self._lock:
            queue = self._scripts.get(request.path)
            if queue:
                return queue.popleft()
            responder = self._responders.get(request.path)
        if responder is None:
            return Reply.error(404, f"unknown path {request.path}", type="not_found_error")
        return responder(request)

    def _enter(self, request: Request) -> None:
        with self._lock:
            self._requests.append(request)
            self._in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self._in_flight)

    def _leave(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def _wait(self, seconds: float) -> None:
        if seconds > 0:
            self._stopping.wait(seconds)


def _is_health_probe(body: Any) -> bool:
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list) or not messages:
        return False
    return bool(messages[-1] == {"role": "user", "content": PROBE_MESSAGE})


def _make_handler(owner: ScriptedLLM) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self._handle(None)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body: Any = json.loads(raw) if raw else None
            except ValueError:
                body = raw.decode(errors="replace")
            self._handle(body)

        def _handle(self, body: Any) -> None:
            path = self.path.split("?", 1)[0]
            if path == CHAT and _is_health_probe(body):
                path = PROBE
            request = Request(
                method=self.command,
                path=path,
                headers={k.lower(): v for k, v in self.headers.items()},
                body=body,
                started=time.monotonic(),
            )
            owner._enter(request)
            try:
                reply = owner._choose(request)
                owner._wait(owner.latency + reply.delay)
                if reply.drop:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self._send(reply)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (a timeout under test); nothing to answer
            finally:
                owner._leave()

        def _send(self, reply: Reply) -> None:
            if reply.raw is not None:
                payload = reply.raw
                content_type = "text/plain"
            else:
                payload = json.dumps(reply.json_body).encode()
                content_type = "application/json"
            self.send_response(reply.status)
            if not any(name.lower() == "content-type" for name in reply.headers):
                self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(payload)))
            for name, value in reply.headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(payload)
            if reply.close:
                self.close_connection = True

        def log_message(self, format: str, *args: Any) -> None:
            """Silence the per-request stderr line."""

    return Handler


__all__ = [
    "CHAT",
    "EMBEDDINGS",
    "HEALTH",
    "MODELS",
    "PROBE",
    "Reply",
    "Request",
    "Responder",
    "ScriptedLLM",
    "hash_embedding",
    "hash_embedding_responder",
    "json_responder",
]
