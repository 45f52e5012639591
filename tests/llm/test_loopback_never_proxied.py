"""A backend on this machine (``localhost``, 127.0.0.0/8, ``::1``) is called directly, whatever
the proxy variables say, as Go's net/http does: the environment's proxy runs elsewhere, and
there ``127.0.0.1`` is the proxy's own host, never this one's model.

With ``http_proxy`` set and no ``NO_PROXY`` naming 127.0.0.1, every call to a local backend
(the bundled local model on 127.0.0.1, an Ollama on localhost) went to the proxy and failed.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator

import httpx
import pytest

from sokratos_worker.config import BackendConfig
from sokratos_worker.llm.chat import FallbackChatClient
from sokratos_worker.llm.embeddings import HttpEmbedder
from sokratos_worker.llm.http import EnvironmentProxies, loopback
from sokratos_worker.testing import Reply, ScriptedLLM, hash_embedding
from tests.llm.conftest import ask
from tests.support.rawserver import RawServer

REFUSED = b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


def _ipv6_loopback_works() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


class _Relay:
    """``[::1]:port`` relayed to a server on 127.0.0.1 (the scripted server binds IPv4 only)."""

    def __init__(self, port: int) -> None:
        self._target = ("127.0.0.1", port)
        self._sock = socket.create_server(("::1", 0), family=socket.AF_INET6)
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    def close(self) -> None:
        self._stop.set()
        self._sock.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except (TimeoutError, OSError):
                continue
            upstream = socket.create_connection(self._target, timeout=30)
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._copy, args=(a, b), daemon=True).start()

    @staticmethod
    def _copy(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def refusing_proxy(monkeypatch: pytest.MonkeyPatch) -> Iterator[RawServer]:
    """A proxy that answers every request 502 and counts them; the only proxy variables set."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    proxy = RawServer(lambda conn: conn.sendall(REFUSED))
    address = proxy.url.removesuffix("/v1")
    monkeypatch.setenv("http_proxy", address)
    monkeypatch.setenv("https_proxy", address)
    yield proxy
    proxy.close()


@pytest.fixture(params=["127.0.0.1", "localhost", "[::1]"])
def local_server(
    request: pytest.FixtureRequest, servers: Callable[..., ScriptedLLM]
) -> Iterator[tuple[ScriptedLLM, str]]:
    """A scripted server and its base URL with this machine spelled as the parameter says."""
    server = servers(chat=lambda r: Reply.chat({"score": 1, "summary": "local"}), embed_dim=4)
    host = str(request.param)
    if host != "[::1]":
        yield server, f"http://{host}:{server.port}/v1"
        return
    if not _ipv6_loopback_works():
        pytest.skip("::1 cannot be bound on this machine: no IPv6 loopback to call")
    relay = _Relay(server.port)
    yield server, f"http://[::1]:{relay.port}/v1"
    relay.close()


def test_a_chat_call_and_its_probe_to_a_local_backend_skip_the_proxy(
    refusing_proxy: RawServer,
    local_server: tuple[ScriptedLLM, str],
    make_client: Callable[..., FallbackChatClient],
) -> None:
    server, url = local_server
    client = make_client(BackendConfig(name="local", url=url, model="m", timeout=5), attempts=1)
    assert ask(client).backend == "local"
    assert client.probe() is True
    assert len(server.requests) >= 2  # the call and the probe
    assert refusing_proxy.requests == 0


def test_an_embeddings_call_to_a_local_server_skips_the_proxy(
    refusing_proxy: RawServer, local_server: tuple[ScriptedLLM, str]
) -> None:
    server, url = local_server
    embedder = HttpEmbedder(url, "e", 4, timeout=5, sleep=lambda _: None)
    try:
        (vector,) = embedder.embed(["hello"])
    finally:
        embedder.close()
    assert vector == pytest.approx(hash_embedding("hello", 4))
    assert server.count("/v1/embeddings") == 1
    assert refusing_proxy.requests == 0


@pytest.mark.parametrize(
    ("host", "is_loopback"),
    [
        ("localhost", True),
        ("LocalHost", True),
        ("localhost.", True),  # the fully qualified spelling
        ("ollama.localhost", True),  # RFC 6761: every name under localhost is this machine
        ("A.B.LOCALHOST.", True),
        ("127.0.0.1", True),
        ("127.0.0.53", True),
        ("127.255.255.254", True),
        ("::1", True),
        ("[::1]", True),  # as a URL writes it
        ("0:0:0:0:0:0:0:1", True),
        ("::ffff:127.0.0.1", True),  # IPv4-mapped
        ("::FFFF:7f00:2", True),
        ("[::ffff:127.1.2.3]", True),
        ("127.0.0.1.example.com", False),  # look-alikes: a name, resolved by the proxy
        ("localhost.example.com", False),
        ("localhost-gpu", False),
        ("notlocalhost", False),
        ("xlocalhost", False),
        (".localhost.", False),  # an empty label is no name
        ("0.0.0.0", False),  # noqa: S104 - unspecified, not loopback (as in Go)
        ("::", False),
        ("::ffff:10.0.0.1", False),
        ("::127.0.0.1", False),  # IPv4-compatible (deprecated): not loopback
        ("128.0.0.1", False),
        ("10.0.0.5", False),
        ("::2", False),
        ("127.1", False),  # inet_aton's shorthand: not an address Go or ipaddress reads
        ("2130706433", False),
        ("127.0.0.1.", False),  # an address has no trailing dot: a name for the resolver
        ("", False),
    ],
)
def test_what_counts_as_this_machine(host: str, is_loopback: bool) -> None:
    assert loopback(host) is is_loopback


class _Named(httpx.BaseTransport):
    def __init__(self, name: str) -> None:
        self.name = name


@pytest.mark.parametrize(
    ("url", "direct"),
    [
        ("http://LOCALHOST.:11434/v1", True),
        ("https://[::ffff:127.0.0.1]:8443/v1", True),
        ("http://[::1]/v1", True),
        ("http://127.0.0.1.example.com:8080/v1", False),
        ("https://api.openai.com/v1", False),
    ],
)
def test_a_local_url_is_routed_directly_whatever_no_proxy_says(url: str, direct: bool) -> None:
    router = EnvironmentProxies(
        _Named("direct"), {"http": _Named("proxy"), "https": _Named("proxy")}, "example.org"
    )
    chosen = router.route(httpx.URL(url))
    assert isinstance(chosen, _Named)
    assert (chosen.name == "direct") is direct
