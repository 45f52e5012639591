"""How a request goes through an ``http://`` proxy: the ``CONNECT`` tunnel for https under one
connect deadline, the credentials the proxy is sent, how errors name it, and its 407.
"""

from __future__ import annotations

import base64
import http.client
import socket
import ssl
import time
from collections.abc import Callable

import httpx

from sokratos_worker.llm.deadline_io import DeadlineResponse


class ProxyAuthenticationRequired(httpx.ProxyError):
    """The environment's proxy answered 407 (to ``CONNECT`` or to a forwarded request): its
    credentials, in the variable the message names, are missing or wrong. Configuration,
    whichever backend the request was for."""


class TunnelConnection(http.client.HTTPSConnection):
    """https through an http:// proxy: ``CONNECT`` spoken on this connection's own socket, then
    TLS to the server through it. Proxy connection, ``CONNECT`` answer and TLS handshake share
    the connect timeout as one deadline: http.client's ``set_tunnel`` reads the proxy's answer
    with only a per-read timeout, so a proxy dripping it a byte at a time held the call."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        timeout: float | None,
        context: ssl.SSLContext,
        proxy: tuple[str, int],
        proxy_headers: dict[str, str],
        proxy_named: str,
        refused: Callable[[str], ProxyAuthenticationRequired],
    ) -> None:
        super().__init__(host, port, timeout=timeout, context=context)
        self._proxy_address = proxy
        self._proxy_headers = proxy_headers
        self._proxy_named = proxy_named
        self._refused = refused

    def connect(self) -> None:
        """Proxy, tunnel, TLS: errors of the last two raised as httpx's, naming the proxy."""
        timeout = self.timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        sock = socket.create_connection(self._proxy_address, timeout)  # OSError: the proxy's
        try:
            self._tunnel_through(sock, deadline)
            where = f"{self.host}:{self.port} through {self._proxy_named}"
            try:
                sock.settimeout(_left(deadline))
                self.sock = self._context.wrap_socket(sock, server_hostname=self.host)  # type: ignore[attr-defined]
            except TimeoutError as exc:
                raise httpx.ConnectTimeout(f"connecting to {where} timed out") from exc
            except OSError as exc:  # a certificate refused (ssl.SSLError), a reset
                raise httpx.ConnectError(f"cannot connect to {where}: {exc}") from exc
        except BaseException:
            sock.close()
            raise

    def _tunnel_through(self, sock: socket.socket, deadline: float | None) -> None:
        named = self._proxy_named
        host = self.host.encode("idna").decode("ascii")
        target = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"
        lines = [f"CONNECT {target} HTTP/1.1", f"Host: {target}"]
        lines += [f"{k}: {v}" for k, v in self._proxy_headers.items()]
        try:
            sock.settimeout(_left(deadline))
            sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
            left = _left(deadline)
            response = (
                http.client.HTTPResponse(sock, method="CONNECT")
                if left is None
                else DeadlineResponse(sock, method="CONNECT", timeout=left)
            )
            try:
                response.begin()
            finally:
                response.close()  # (the socket stays open: the tunnel)
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"{named} did not answer CONNECT {target} in time") from exc
        except (http.client.HTTPException, OSError) as exc:
            raise httpx.ProxyError(
                f"{named} failed CONNECT {target}: {type(exc).__name__}: {exc}"
            ) from exc
        if response.status == 407:
            raise self._refused(f"CONNECT {target}")
        if not 200 <= response.status < 300:
            raise httpx.ProxyError(
                f"{named} answered {response.status} {response.reason} to CONNECT {target}"
            )


def _left(deadline: float | None) -> float | None:
    """Seconds to ``deadline`` (None: no deadline); a deadline passed raises TimeoutError."""
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the connect deadline has passed")
    return left


def proxy_authorization(proxy: httpx.URL | None) -> dict[str, str]:
    """``Proxy-Authorization`` for a proxy URL's ``user:password@``, as httpx sends it."""
    if proxy is None or not proxy.username:
        return {}
    credentials = f"{proxy.username}:{proxy.password}".encode()
    return {"Proxy-Authorization": "Basic " + base64.b64encode(credentials).decode("ascii")}


def shown(proxy: httpx.URL) -> str:
    """The proxy's URL as it may be shown: ``user:password@`` left out."""
    host = f"[{proxy.host}]" if ":" in proxy.host else proxy.host
    return f"{proxy.scheme}://{host}:{proxy.port or 80}"
