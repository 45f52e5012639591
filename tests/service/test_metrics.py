"""Metrics in their own registry, served over real HTTP on 127.0.0.1."""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from sokratos_worker.service.metrics import DURATION_BUCKETS, Metrics, MetricsServer, parse_addr


def _get(server: MetricsServer, path: str) -> tuple[int, str, str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.getheader("Content-Type") or "", response.read().decode()
    finally:
        conn.close()


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


@pytest.fixture
def ready_flag() -> threading.Event:
    flag = threading.Event()
    flag.set()
    return flag


@pytest.fixture
def server(ready_flag: threading.Event) -> Iterator[MetricsServer]:
    metrics = Metrics()
    srv = MetricsServer("127.0.0.1:0", metrics, readiness=ready_flag.is_set)
    srv.start()
    yield srv
    srv.stop()


def test_own_registry_not_the_global_one() -> None:
    first, second = Metrics(), Metrics()  # two in one process must not clash
    first.item_settled("pending_triage", "saved")
    assert first.registry is not REGISTRY
    assert first.registry is not second.registry
    names = set(REGISTRY._names_to_collectors)
    assert "sokratos_items_total" not in names


def test_every_metric_is_exposed_with_its_labels() -> None:
    metrics = Metrics()
    metrics.set_queues(
        {
            "pending_triage": {
                "ready": 3,
                "backing_off": 1,
                "leased": 2,
                "oldest_ready_age_s": 12.5,
            },
            "pending_distillation": {
                "ready": 0,
                "backing_off": 0,
                "leased": 0,
                "oldest_ready_age_s": None,
            },
        }
    )
    metrics.item_settled("pending_triage", "saved", 1.5)
    metrics.item_settled("pending_triage", "saved", 0.2)
    metrics.item_settled("pending_distillation", "failed")
    metrics.observe_llm_call("local", 250.0)
    metrics.observe_llm_call("remote", 0.3, ok=False)
    metrics.set_circuit("local", "closed")
    metrics.set_circuit("remote", "open")
    metrics.set_circuit("spare", "half_open")
    metrics.set_failures({"conversation_triage": 2, "distillation": 1})
    metrics.set_failures({"conversation_triage": 3})
    metrics.set_worker_state("running")
    metrics.set_worker_state("waiting for database")
    metrics.set_in_flight("pending_triage", 2)
    metrics.set_database_up(False)
    metrics.tick_finished(1_700_000_000.0)

    s = _samples(metrics.render().decode())
    assert s[("sokratos_queue_items", (("queue", "pending_triage"), ("state", "ready")))] == 3
    assert s[("sokratos_queue_items", (("queue", "pending_triage"), ("state", "leased")))] == 2
    assert s[("sokratos_queue_items", (("queue", "pending_triage"), ("state", "backing_off")))] == 1
    assert s[("sokratos_queue_oldest_ready_age_seconds", (("queue", "pending_triage"),))] == 12.5
    assert s[("sokratos_queue_oldest_ready_age_seconds", (("queue", "pending_distillation"),))] == 0
    assert s[("sokratos_items_total", (("outcome", "saved"), ("queue", "pending_triage")))] == 2
    assert (
        s[("sokratos_items_total", (("outcome", "failed"), ("queue", "pending_distillation")))] == 1
    )
    assert s[("sokratos_attempt_duration_seconds_count", (("queue", "pending_triage"),))] == 2
    assert s[
        ("sokratos_attempt_duration_seconds_sum", (("queue", "pending_triage"),))
    ] == pytest.approx(1.7)
    llm = (("backend", "local"), ("result", "ok"))
    assert (
        s[("sokratos_llm_call_duration_seconds_bucket", tuple(sorted((*llm, ("le", "300.0")))))]
        == 1
    )
    assert (
        s[("sokratos_llm_call_duration_seconds_bucket", tuple(sorted((*llm, ("le", "120.0")))))]
        == 0
    )
    assert (
        s[("sokratos_llm_call_duration_seconds_bucket", tuple(sorted((*llm, ("le", "600.0")))))]
        == 1
    )
    assert s[("sokratos_backend_circuit_state", (("backend", "local"),))] == 0
    assert s[("sokratos_backend_circuit_state", (("backend", "spare"),))] == 1
    assert s[("sokratos_backend_circuit_state", (("backend", "remote"),))] == 2
    assert s[("sokratos_failed_operations_24h", (("op_type", "conversation_triage"),))] == 3
    assert s[("sokratos_failed_operations_24h", (("op_type", "distillation"),))] == 0
    assert s[("sokratos_worker_state", (("state", "running"),))] == 0
    assert s[("sokratos_worker_state", (("state", "waiting_for_database"),))] == 1
    assert s[("sokratos_items_in_flight", (("queue", "pending_triage"),))] == 2
    assert s[("sokratos_database_up", ())] == 0
    assert s[("sokratos_last_tick_timestamp_seconds", ())] == 1_700_000_000.0


def test_buckets_reach_ten_minutes() -> None:
    assert DURATION_BUCKETS[-1] == 600.0
    assert list(DURATION_BUCKETS) == sorted(DURATION_BUCKETS)


def test_unknown_circuit_state_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown circuit state"):
        Metrics().set_circuit("local", "ajar")


def test_metrics_endpoint(server: MetricsServer) -> None:
    status, content_type, body = _get(server, "/metrics")
    assert status == 200
    assert content_type.startswith("text/plain; version=")
    assert "sokratos_queue_items" in body
    assert "sokratos_attempt_duration_seconds_bucket" in body


def test_livez_is_always_200(server: MetricsServer, ready_flag: threading.Event) -> None:
    ready_flag.clear()  # the database being away does not make the process dead
    assert _get(server, "/livez")[0] == 200


def test_readyz_follows_readiness(server: MetricsServer, ready_flag: threading.Event) -> None:
    assert _get(server, "/readyz")[0] == 200
    ready_flag.clear()
    assert _get(server, "/readyz")[0] == 503
    ready_flag.set()
    assert _get(server, "/readyz")[0] == 200


def test_readiness_that_raises_is_not_ready() -> None:
    def broken() -> bool:
        raise RuntimeError("boom")

    with MetricsServer("127.0.0.1:0", Metrics(), readiness=broken) as srv:
        assert _get(srv, "/readyz")[0] == 503
        assert _get(srv, "/livez")[0] == 200


def test_unknown_path_is_404(server: MetricsServer) -> None:
    assert _get(server, "/nope")[0] == 404


def test_scrape_callback_refreshes_and_survives_errors() -> None:
    metrics = Metrics()
    calls = []

    def refresh(m: Metrics) -> None:
        calls.append(1)
        m.set_queue("pending_triage", ready=len(calls))

    def broken(m: Metrics) -> None:
        raise RuntimeError("database is away")

    metrics.on_scrape(refresh)
    metrics.on_scrape(broken)
    with MetricsServer("127.0.0.1:0", metrics) as srv:
        _get(srv, "/metrics")
        status, _, body = _get(srv, "/metrics")
    assert status == 200
    key = ("sokratos_queue_items", (("queue", "pending_triage"), ("state", "ready")))
    assert _samples(body)[key] == 2


def test_stop_releases_the_port() -> None:
    srv = MetricsServer("127.0.0.1:0", Metrics())
    srv.start()
    port = srv.port
    assert srv.url == f"http://127.0.0.1:{port}"
    srv.stop()
    again = MetricsServer(f"127.0.0.1:{port}", Metrics())
    again.start()
    try:
        assert _get(again, "/livez")[0] == 200
    finally:
        again.stop()
    srv.stop()  # stopping twice is harmless


@pytest.mark.parametrize(
    ("addr", "expected"),
    [
        ("127.0.0.1:9464", ("127.0.0.1", 9464)),
        ("10.0.0.1:0", ("10.0.0.1", 0)),
        ("[::1]:9464", ("::1", 9464)),
        ("localhost:80", ("localhost", 80)),
    ],
)
def test_parse_addr(addr: str, expected: tuple[str, int]) -> None:
    assert parse_addr(addr) == expected


@pytest.mark.parametrize("addr", ["9464", ":9464", "host:", "host:http", "host:70000"])
def test_parse_addr_refuses(addr: str) -> None:
    with pytest.raises(ValueError, match="host:port"):
        parse_addr(addr)


def test_a_silent_connection_is_closed_and_scrapes_go_on(monkeypatch: pytest.MonkeyPatch) -> None:
    # A client that connected and sent half a request held a thread forever (slowloris).
    import socket
    import time

    from structlog.testing import capture_logs

    from sokratos_worker.service import metrics

    monkeypatch.setattr(metrics, "IDLE_TIMEOUT_S", 0.5)
    with MetricsServer("127.0.0.1:0", Metrics()) as server, capture_logs() as logs:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as silent:
            silent.sendall(b"GET /metrics HTTP/1.1\r\n")  # a request that never ends
            started = time.monotonic()
            assert silent.recv(1024) == b""  # closed by the server
            assert time.monotonic() - started < 9
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        conn.request("GET", "/livez")
        assert conn.getresponse().status == 200
        conn.close()
    assert not [e for e in logs if e["event"] == "metrics_http_error"], logs


def test_a_request_trickled_a_byte_at_a_time_is_cut_at_its_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each byte restarted the per-read timeout: the request never ended, its thread held.
    import socket
    import time

    from sokratos_worker.service import metrics

    monkeypatch.setattr(metrics, "IDLE_TIMEOUT_S", 1.0)
    with (
        MetricsServer("127.0.0.1:0", Metrics()) as server,
        socket.create_connection(("127.0.0.1", server.port), timeout=10) as trickle,
    ):
        started = time.monotonic()
        closed = False
        for byte in b"GET /metrics HTTP/1.1\r\nX-Slow: " + b"a" * 100:
            try:
                trickle.sendall(bytes([byte]))
                trickle.settimeout(0.3)
                closed = trickle.recv(1) == b""
            except TimeoutError:
                continue
            except OSError:
                closed = True
            if closed:
                break
        assert closed and time.monotonic() - started < 8


def test_connections_past_the_limit_are_closed_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from sokratos_worker.service import metrics

    monkeypatch.setattr(metrics, "MAX_CONNECTIONS", 2)
    with MetricsServer("127.0.0.1:0", Metrics()) as server:
        held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]
        try:
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as third:
                assert third.recv(1) == b""  # closed without a thread
        finally:
            for sock in held:
                sock.close()
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        for _ in range(20):  # the held ones' threads end with them
            try:
                conn.request("GET", "/livez")
                assert conn.getresponse().status == 200
                break
            except (ConnectionError, http.client.HTTPException):
                conn.close()
                time.sleep(0.1)
        else:
            raise AssertionError("the server never served again")
        conn.close()


def test_a_client_gone_before_the_answer_leaves_no_traceback(
    server: MetricsServer, capfd: pytest.CaptureFixture[str]
) -> None:
    """A scraper that gives up (a reset right after its request) is routine: socketserver
    printed a traceback to stderr for each, outside the JSON log."""
    import socket
    import struct

    for _ in range(20):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        # Linger 0: close sends a reset, so the server's read or write meets a dead peer.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.close()
    time.sleep(0.5)  # the server's threads meet the resets
    assert _get(server, "/livez")[0] == 200
    err = capfd.readouterr().err
    assert "Traceback" not in err, err


def test_an_error_while_answering_is_one_log_line_not_a_traceback(
    server: MetricsServer, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken() -> bytes:
        raise RuntimeError("collector exploded")

    monkeypatch.setattr(server._server.metrics, "render", broken)  # type: ignore[union-attr]
    with pytest.raises((ConnectionError, http.client.HTTPException)):
        _get(server, "/metrics")
    monkeypatch.undo()
    assert _get(server, "/livez")[0] == 200
    out = capfd.readouterr()
    assert "Traceback" not in out.err, out.err
    assert "metrics_request_failed" in out.out + out.err
    assert "RuntimeError: collector exploded" in out.out + out.err
