"""Prometheus metrics and the ``/metrics``, ``/livez``, ``/readyz`` endpoints.

:class:`Metrics` owns its own :class:`~prometheus_client.CollectorRegistry` (never the
global one), so tests and several workers in one process do not collide. The daemon updates
it: counters and histograms as items settle and LLM calls return, gauges after each tick
from the status query, or lazily from a callback registered with :meth:`Metrics.on_scrape`.

:class:`MetricsServer` serves them with the standard library's ``ThreadingHTTPServer`` in a
daemon thread. ``/livez`` answers 200 while the process serves (no database check: a
database outage must not get a healthy worker restarted); ``/readyz`` answers 200 when the
``readiness`` callable says so (the daemon's view that the database is reachable), else 503.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Final

import structlog
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

log = structlog.get_logger(__name__)

# Seconds, up to ten minutes: an LLM attempt on a slow CPU backend can take minutes.
DURATION_BUCKETS: Final[tuple[float, ...]] = (
    0.01,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)

# The value of sokratos_backend_circuit_state for each breaker state.
CIRCUIT_STATE_VALUES: Final[Mapping[str, int]] = {"closed": 0, "half_open": 1, "open": 2}

QUEUES: Final[tuple[str, ...]] = ("pending_triage", "pending_distillation")
QUEUE_STATES: Final[tuple[str, ...]] = ("ready", "backing_off", "leased")


class Metrics:
    """Every metric of the worker, in a registry of its own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.queue_items = Gauge(
            "sokratos_queue_items",
            "Items in a queue by state (ready, backing_off, leased), from the last status query",
            ["queue", "state"],
            registry=reg,
        )
        self.queue_oldest_ready_age = Gauge(
            "sokratos_queue_oldest_ready_age_seconds",
            "Age of the oldest item that is ready to run (0 when none is ready)",
            ["queue"],
            registry=reg,
        )
        self.items = Counter(
            "sokratos_items",
            "Items that left a queue or were retried, by outcome (saved, skipped, archived,"
            " failed, retry, released, lease_lost, abandoned)",
            ["queue", "outcome"],
            registry=reg,
        )
        self.attempt_duration = Histogram(
            "sokratos_attempt_duration_seconds",
            "Duration of one attempt at an item, from claim to settle",
            ["queue"],
            buckets=DURATION_BUCKETS,
            registry=reg,
        )
        self.llm_call_duration = Histogram(
            "sokratos_llm_call_duration_seconds",
            "Duration of one chat call to an LLM backend, by backend and result (ok, error)",
            ["backend", "result"],
            buckets=DURATION_BUCKETS,
            registry=reg,
        )
        self.backend_circuit_state = Gauge(
            "sokratos_backend_circuit_state",
            "Circuit breaker of a backend: 0 closed, 1 half_open, 2 open",
            ["backend"],
            registry=reg,
        )
        self.failures_24h = Gauge(
            "sokratos_failed_operations_24h",
            "failed_operations rows created in the last 24 hours, by op_type",
            ["op_type"],
            registry=reg,
        )
        self.worker_state = Gauge(
            "sokratos_worker_state",
            "1 for the worker's current state (running, waiting_for_database, no_backend,"
            " stopping), 0 for the others",
            ["state"],
            registry=reg,
        )
        self.in_flight = Gauge(
            "sokratos_items_in_flight",
            "Items this process is working on",
            ["queue"],
            registry=reg,
        )
        self.last_tick = Gauge(
            "sokratos_last_tick_timestamp_seconds",
            "Unix time at which the last heartbeat tick finished",
            registry=reg,
        )
        self.database_up = Gauge(
            "sokratos_database_up",
            "1 when the worker last reached PostgreSQL, 0 while it waits for it",
            registry=reg,
        )
        self._lock = threading.Lock()
        # One refresh at a time: scrapes arriving together (a flood from anyone reaching the
        # port) each took a pooled connection for the status query, the slots' included.
        self._refreshing = threading.Lock()
        self._callbacks: list[Callable[[Metrics], None]] = []
        self._states: set[str] = set()
        self._op_types: set[str] = set()
        for queue in QUEUES:
            for state in QUEUE_STATES:
                self.queue_items.labels(queue=queue, state=state)
            self.queue_oldest_ready_age.labels(queue=queue)
            self.attempt_duration.labels(queue=queue)
            self.in_flight.labels(queue=queue)

    # -- updates from the daemon --------------------------------------------------------

    def set_queue(
        self,
        queue: str,
        *,
        ready: int,
        backing_off: int = 0,
        leased: int = 0,
        oldest_ready_age_s: float | None = None,
    ) -> None:
        """One queue's depth and oldest ready age (None or no ready item → 0)."""
        self.queue_items.labels(queue=queue, state="ready").set(ready)
        self.queue_items.labels(queue=queue, state="backing_off").set(backing_off)
        self.queue_items.labels(queue=queue, state="leased").set(leased)
        self.queue_oldest_ready_age.labels(queue=queue).set(oldest_ready_age_s or 0.0)

    def set_queues(self, queues: Mapping[str, Mapping[str, float | int | None]]) -> None:
        """The ``queues`` object of ``status --json`` as it is."""
        for queue, counts in queues.items():
            self.set_queue(
                queue,
                ready=int(counts.get("ready") or 0),
                backing_off=int(counts.get("backing_off") or 0),
                leased=int(counts.get("leased") or 0),
                oldest_ready_age_s=_float_or_none(counts.get("oldest_ready_age_s")),
            )

    def item_settled(self, queue: str, outcome: str, duration_s: float | None = None) -> None:
        """Count an attempt's outcome and, when given, observe its duration."""
        self.items.labels(queue=queue, outcome=outcome).inc()
        if duration_s is not None:
            self.attempt_duration.labels(queue=queue).observe(max(0.0, duration_s))

    def observe_llm_call(self, backend: str, duration_s: float, *, ok: bool = True) -> None:
        """The duration of one LLM call."""
        result = "ok" if ok else "error"
        self.llm_call_duration.labels(backend=backend, result=result).observe(max(0.0, duration_s))

    def set_circuit(self, backend: str, state: str) -> None:
        """A backend's breaker: ``closed``, ``half_open`` or ``open``."""
        try:
            value = CIRCUIT_STATE_VALUES[state]
        except KeyError:
            raise ValueError(f"unknown circuit state {state!r}") from None
        self.backend_circuit_state.labels(backend=backend).set(value)

    def set_failures(self, counts: Mapping[str, int]) -> None:
        """failed_operations of the last 24 h by op_type; op_types no longer listed read 0."""
        with self._lock:
            for op_type in self._op_types - set(counts):
                self.failures_24h.labels(op_type=op_type).set(0)
            for op_type, count in counts.items():
                self.failures_24h.labels(op_type=op_type).set(count)
            self._op_types |= set(counts)

    def set_worker_state(self, state: str) -> None:
        """The worker's state as in ``worker_heartbeats.state`` (spaces become ``_``)."""
        key = state.replace(" ", "_")
        with self._lock:
            self._states.add(key)
            for known in self._states:
                self.worker_state.labels(state=known).set(1 if known == key else 0)

    def set_in_flight(self, queue: str, count: int) -> None:
        """Items of a queue this process is working on."""
        self.in_flight.labels(queue=queue).set(count)

    def tick_finished(self, timestamp: float) -> None:
        """Record the end of a heartbeat tick (Unix seconds)."""
        self.last_tick.set(timestamp)

    def set_database_up(self, up: bool) -> None:
        """Whether PostgreSQL was reachable at the last attempt."""
        self.database_up.set(1 if up else 0)

    # -- exposition ---------------------------------------------------------------------

    def on_scrape(self, callback: Callable[[Metrics], None]) -> None:
        """Run ``callback(metrics)`` before a ``/metrics`` response (once for scrapes that
        arrive together).

        For gauges read from the database: keep it quick (a short statement timeout); an
        exception is logged and the last values are served.
        """
        with self._lock:
            self._callbacks.append(callback)

    def render(self) -> bytes:
        """The Prometheus text format, after the scrape callbacks ran; a scrape that arrives
        while another's callbacks run waits for them and serves what they read."""
        if not self._refreshing.acquire(blocking=False):
            with self._refreshing:
                return generate_latest(self.registry)
        try:
            self._refresh()
        finally:
            self._refreshing.release()
        return generate_latest(self.registry)

    def _refresh(self) -> None:
        with self._lock:
            callbacks = list(self._callbacks)
        for callback in callbacks:
            try:
                callback(self)
            except Exception as exc:  # a scrape must still answer with the last values
                log.warning("metrics_refresh_failed", error=str(exc), error_type=type(exc).__name__)


def _float_or_none(value: float | int | None) -> float | None:
    return None if value is None else float(value)


def parse_addr(addr: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` → (host, port); port 0 picks a free one."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"{addr!r} is not host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


# How long a request may take to arrive, and a keep-alive connection may stay idle, before
# the server closes the connection: a client that sent half a request (or one byte now and
# then) held a thread forever.
IDLE_TIMEOUT_S = 20.0
# Connections served at once; more are closed at once (each holds a thread).
MAX_CONNECTIONS = 32


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        address: tuple[str, int],
        metrics: Metrics,
        readiness: Callable[[], bool],
    ) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.metrics = metrics
        self.readiness = readiness
        self.deadline_s = IDLE_TIMEOUT_S
        self._deadlines: dict[socket.socket, float] = {}  # each open connection's
        self._deadlines_lock = threading.Lock()
        self._closed = threading.Event()
        super().__init__(address, _Handler)
        threading.Thread(target=self._reap, name="sokratos-metrics-reaper", daemon=True).start()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._deadlines_lock:
            full = len(self._deadlines) >= MAX_CONNECTIONS
            if not full:
                self._deadlines[request] = time.monotonic() + self.deadline_s
        if full:
            super().shutdown_request(request)
            return
        super().process_request(request, client_address)

    def answered(self, request: socket.socket) -> None:
        """A response went out: the connection's next request has its own time."""
        with self._deadlines_lock:
            if request in self._deadlines:
                self._deadlines[request] = time.monotonic() + self.deadline_s

    def shutdown_request(self, request: Any) -> None:
        with self._deadlines_lock:
            self._deadlines.pop(request, None)
        super().shutdown_request(request)

    def server_close(self) -> None:
        self._closed.set()
        super().server_close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """socketserver's default prints a traceback to stderr, outside the JSON log."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return  # the scraper went away or the reaper cut it: routine, nothing to do
        log.warning(
            "metrics_request_failed",
            error=f"{type(exc).__name__}: {exc}",
            client=str(client_address[0]) if client_address else "",
            hint="the metrics endpoint serves on; if this repeats, report it with this line",
        )

    def _reap(self) -> None:
        """Shut the connections past their deadline: the blocked read returns, the thread ends.
        (A socket timeout alone does not do it: each byte of a trickle restarts it.)"""
        while not self._closed.wait(min(1.0, self.deadline_s / 4)):
            now = time.monotonic()
            with self._deadlines_lock:
                overdue = [r for r, deadline in self._deadlines.items() if deadline < now]
            for request in overdue:
                with contextlib.suppress(OSError):
                    request.shutdown(socket.SHUT_RDWR)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "sokratos-worker"
    sys_version = ""
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.deadline_s)  # each read's, besides the reaper's

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._reply(200, self.server.metrics.render(), CONTENT_TYPE_LATEST)
        elif path == "/livez":
            self._reply(200, b"ok\n")
        elif path == "/readyz":
            if self._ready():
                self._reply(200, b"ready\n")
            else:
                self._reply(503, b"not ready\n")
        else:
            self._reply(404, b"not found\n")

    def do_HEAD(self) -> None:
        self.do_GET()

    def _ready(self) -> bool:
        try:
            return bool(self.server.readiness())
        except Exception as exc:  # an error in the check means not ready, never a 500
            log.warning("readiness_check_failed", error=str(exc), error_type=type(exc).__name__)
            return False

    def _reply(
        self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8"
    ) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.server.answered(self.connection)

    def log_message(self, format: str, *args: object) -> None:
        # Scrapes every few seconds would flood the journal; errors still reach log_error.
        return

    def log_error(self, format: str, *args: object) -> None:
        if format.startswith("Request timed out"):
            return  # an idle keep-alive between two scrapes closed: nothing wrong
        log.warning("metrics_http_error", detail=format % args)


class MetricsServer:
    """``/metrics``, ``/livez`` and ``/readyz`` on ``addr`` in a daemon thread."""

    def __init__(
        self,
        addr: str,
        metrics: Metrics,
        readiness: Callable[[], bool] = lambda: True,
    ) -> None:
        self._address = parse_addr(addr)
        self._metrics = metrics
        self._readiness = readiness
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port (the real one when ``addr`` asked for port 0)."""
        if self._server is None:
            raise RuntimeError("the metrics server is not started")
        return int(self._server.server_address[1])

    @property
    def host(self) -> str:
        """The host the server listens on."""
        return self._address[0]

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:9464``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        """Bind and serve; raises OSError when the address cannot be bound."""
        if self._server is not None:
            return
        self._server = _Server(self._address, self._metrics, self._readiness)
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.5},
            name="sokratos-metrics",
            daemon=True,
        )
        self._thread.start()
        log.info("metrics_server_started", host=self.host, port=self.port)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving and release the port."""
        server, thread = self._server, self._thread
        if server is None:
            return
        self._server = self._thread = None
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout)
        log.info("metrics_server_stopped")

    def __enter__(self) -> MetricsServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = [
    "CIRCUIT_STATE_VALUES",
    "DURATION_BUCKETS",
    "Metrics",
    "MetricsServer",
    "parse_addr",
]
