"""httpx clients and the pure decisions about HTTP answers, shared by chat and embeddings."""

from __future__ import annotations

import email.utils
import ipaddress
import os
import re
import ssl
import threading
import time
import urllib.request
from collections.abc import Callable
from enum import StrEnum
from typing import Any

import httpx
import structlog

from sokratos_worker.config import without_credentials
from sokratos_worker.llm.proxy import ProxyAuthenticationRequired
from sokratos_worker.llm.transport import StdlibTransport

log = structlog.get_logger(__name__)

_CONTEXT_PATTERNS = re.compile(
    r"exceed_context_size|context_length_exceeded|maximum context length"
    r"|exceeds? (?:the )?(?:available )?context (?:window|length|size)|context window"
    r"|too many tokens"
    r"|prompt is too long",
    re.IGNORECASE,
)
_BODY_EXCERPT = 512
# A host that has not accepted the connection by then is not going to: the fallback is asked.
CONNECT_TIMEOUT_MAX = 10.0


class Verdict(StrEnum):
    """What an HTTP status (and body) means for the call."""

    OK = "ok"
    TRANSIENT = "transient"  # retry on the same backend, bounded
    CONTEXT = "context_too_long"  # tell the caller to shorten the input
    REFUSED = "refused"  # configuration or account: next backend, not the item's fault
    REJECTED = "rejected"  # this request was refused: next backend


def classify(status: int, body: str) -> Verdict:
    """The verdict for a status and the start of its body."""
    if 200 <= status < 300:
        return Verdict.OK
    if 300 <= status < 400:
        return Verdict.REFUSED  # a URL the server moved (http:// to https://): configuration
    if context_too_long(status, body):
        return Verdict.CONTEXT
    if status == 429 and "insufficient_quota" in body:
        return Verdict.REFUSED  # OpenAI: retrying an empty account never helps
    if status in (408, 429) or status >= 500:
        return Verdict.TRANSIENT
    if status in (401, 402, 403, 404):  # 402: an account out of credits (OpenRouter)
        return Verdict.REFUSED
    return Verdict.REJECTED


def context_too_long(status: int, body: str) -> bool:
    """Whether a 400 or 413 says the input is over the model's context (OpenAI's
    ``context_length_exceeded``, vLLM's "maximum context length", llama.cpp's
    ``exceed_context_size``): for chat, shorten the input; for embeddings, split it."""
    return status in (400, 413) and _CONTEXT_PATTERNS.search(body) is not None


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date), or None."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    current = time.time() if now is None else now
    return max(0.0, when.timestamp() - current)


def request_timeout(seconds: float) -> httpx.Timeout:
    """``seconds`` for the request, its connection capped at ``CONNECT_TIMEOUT_MAX``: also what a
    call passes per request, as a plain number there would replace the client's cap."""
    return httpx.Timeout(seconds, connect=min(seconds, CONNECT_TIMEOUT_MAX))


def describe_connection_error(exc: httpx.HTTPError) -> str:
    """``ConnectError: [Errno 111] Connection refused``: the class and the first line of why.

    The class alone read the same for a refused port, an unknown host and a TLS mismatch.
    """
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    if isinstance(exc, httpx.ConnectError) and "CERTIFICATE_VERIFY_FAILED" in first:
        first += " (a private CA? set the backend's ca_file)"
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def excerpt(response: httpx.Response) -> str:
    """The first bytes of an error body: enough to classify, never a whole reply."""
    return response.content[:_BODY_EXCERPT].decode("utf-8", errors="replace")


def tls_verification(
    *, name: str, ca_file: str | None = None, tls_verify: bool = True
) -> ssl.SSLContext | bool:
    """How a backend's certificate is checked: verified by default, ``ca_file`` honoured.

    Built once per backend and shared by its clients: loading the CA bundle costs ~25 ms of
    CPU, which 20 slot threads making their first calls at once paid one after another.
    """
    if not tls_verify:
        log.warning("tls_verification_disabled", backend=name)
        return False
    if ca_file:
        return ssl.create_default_context(cafile=ca_file)
    return httpx.create_ssl_context()


def make_client(
    *,
    name: str,
    timeout: float,
    api_key: str | None = None,
    ca_file: str | None = None,
    tls_verify: bool = True,
    verify: ssl.SSLContext | bool | None = None,
) -> httpx.Client:
    """A thread-safe client; ``verify`` (from :func:`tls_verification`) or else
    ``ca_file``/``tls_verify`` say how the server's certificate is checked.

    Requests go through :class:`StdlibTransport` (less CPU per call than httpx's own, and it
    bounds a whole reply's time and size), directly or through the environment's proxy.
    """
    if verify is None:
        verify = tls_verification(name=name, ca_file=ca_file, tls_verify=tls_verify)
    # JSON from a local server gains little from gzip; identity also spares a decoding step.
    headers = {"Accept-Encoding": "identity"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return CookielessClient(
        timeout=request_timeout(timeout),
        verify=verify,
        headers=headers,
        transport=_transport(verify),
        trust_env=False,  # the proxy variables are honoured by _transport, the rest unused
    )


def _transport(verify: ssl.SSLContext | bool) -> httpx.BaseTransport:
    """StdlibTransport, routed through the environment's proxies when any is set."""
    direct = StdlibTransport(verify=verify)
    proxies = urllib.request.getproxies()  # reads the whole environment: once per client
    routes = {}
    for scheme in ("http", "https"):
        source = scheme if proxies.get(scheme) else "all"
        if url := proxies.get(source):
            routes[scheme] = _proxy_transport(url, verify, proxy_variable(source, url))
    if not routes:
        return direct
    return EnvironmentProxies(direct, routes, proxies.get("no", ""))


def proxy_variable(scheme: str, url: str) -> str:
    """The environment variable urllib took ``scheme``'s proxy ``url`` from: ``https_proxy``
    or ``HTTPS_PROXY`` (the lowercase one wins when both are set, as in urllib)."""
    for name in (f"{scheme}_proxy", f"{scheme.upper()}_PROXY"):
        if os.environ.get(name) == url:
            return name
    return f"{scheme.upper()}_PROXY"


def _proxy_transport(url: str, verify: ssl.SSLContext | bool, variable: str) -> httpx.BaseTransport:
    """StdlibTransport for an http:// proxy; httpx's own for what it cannot speak (socks,
    a TLS connection to the proxy itself), which bounds each read but not the whole reply."""
    proxy = httpx.URL(url if "://" in url else f"http://{url}")
    if proxy.scheme == "http":
        return StdlibTransport(verify=verify, proxy=proxy, proxy_variable=variable)
    return httpx.HTTPTransport(verify=verify, proxy=httpx.Proxy(proxy))


# urllib's reading of NO_PROXY (public, documented nowhere, missing from typeshed).
_proxy_bypass: Callable[[str, dict[str, str]], bool] = urllib.request.proxy_bypass_environment  # type: ignore[attr-defined]


def loopback(host: str) -> bool:
    """Whether ``host``, as a URL spells it, is this machine: ``localhost`` or a name under it
    (RFC 6761; any case, a trailing dot), an address in 127.0.0.0/8, ``::1`` or an IPv4-mapped
    ``::ffff:127.x.y.z``. Read from the spelling, never resolved; as in Go, ``0.0.0.0`` and
    inet_aton's shorthands (``127.1``) are not loopback."""
    host = host.removeprefix("[").removesuffix("]")
    name = host.lower().removesuffix(".")
    if name == "localhost" or (name.endswith(".localhost") and "" not in name.split(".")):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


class EnvironmentProxies(httpx.BaseTransport):
    """Each request straight to its server or through its scheme's proxy, as urllib decides
    from NO_PROXY (a host, ``.domain``, ``*``, ``host:port``, an address); a :func:`loopback`
    host always straight, as in Go's net/http: the proxy runs elsewhere, where 127.0.0.1 is
    the proxy's own host and never this machine's model."""

    def __init__(
        self, direct: httpx.BaseTransport, routes: dict[str, httpx.BaseTransport], no_proxy: str
    ) -> None:
        self._direct = direct
        self._routes = routes
        self._no_proxy = {"no": no_proxy}

    def route(self, url: httpx.URL) -> httpx.BaseTransport:
        """The transport a request to ``url`` goes through."""
        proxied = self._routes.get(url.scheme)
        if proxied is None or loopback(url.host) or self._exempt(url):
            return self._direct
        return proxied

    def _exempt(self, url: httpx.URL) -> bool:
        # "host:port" matches entries with a port; the bare host matches an IPv6 "::1".
        netloc = url.netloc.decode("ascii")
        return any(_proxy_bypass(host, self._no_proxy) for host in (netloc, url.host))

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return self.route(request.url).handle_request(request)

    def close(self) -> None:
        for transport in (self._direct, *self._routes.values()):
            transport.close()


class _NoCookies(httpx.Cookies):
    """A jar that keeps nothing a response sets."""

    def extract_cookies(self, response: httpx.Response) -> None:
        """Keep nothing (httpx calls this for every response)."""


class CookielessClient(httpx.Client):
    """An ``httpx.Client`` that neither keeps nor sends cookies.

    An LLM API authenticates with its key, not a session; a cookie a load balancer sets
    would otherwise be kept per slot thread and sent back. Parsing every response for
    cookies also cost about a tenth of a call's CPU (``python3 -m bench.http_client``).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._jar = _NoCookies()

    @property
    def cookies(self) -> httpx.Cookies:
        """Always empty."""
        return self._jar

    @cookies.setter
    def cookies(self, cookies: object) -> None:
        raise AttributeError("a CookielessClient keeps no cookies")


def environment_proxies() -> bool:
    """Whether HTTP_PROXY, HTTPS_PROXY or ALL_PROXY (any case) is set for this process."""
    proxies = urllib.request.getproxies()  # reads the whole environment: once, not per scheme
    return any(scheme in proxies for scheme in ("http", "https", "all"))


class ClientPerThread:
    """One :class:`httpx.Client` per calling thread, made on first use, all closed together.

    A shared client's connection pool scans every connection under one lock on each request
    and response close; with 20 slot threads, waiting for that lock was 14 % of their time in
    the W2 benchmark (bench/README.md).
    """

    def __init__(self, factory: Callable[[], httpx.Client]) -> None:
        self._factory = factory
        self._local = threading.local()
        self._lock = threading.Lock()
        self._clients: list[tuple[threading.Thread, httpx.Client]] = []

    def get(self) -> httpx.Client:
        """The calling thread's client."""
        client: httpx.Client | None = getattr(self._local, "client", None)
        if client is None:
            with self._lock:
                # Threads come and go (a run --once per tick): their clients close with them.
                for thread, old in [e for e in self._clients if not e[0].is_alive()]:
                    old.close()
                    self._clients.remove((thread, old))
                client = self._factory()
                self._clients.append((threading.current_thread(), client))
            self._local.client = client
        return client

    def close(self) -> None:
        """Close every thread's client."""
        with self._lock:
            for _, client in self._clients:
                client.close()
            self._clients.clear()
        self._local = threading.local()


__all__ = [
    "ClientPerThread",
    "CookielessClient",
    "EnvironmentProxies",
    "ProxyAuthenticationRequired",
    "Verdict",
    "classify",
    "describe_connection_error",
    "environment_proxies",
    "excerpt",
    "loopback",
    "make_client",
    "proxy_variable",
    "request_timeout",
    "retry_after_seconds",
    "tls_verification",
    "without_credentials",
]
