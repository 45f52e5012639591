"""A name lookup that never answers (a dead resolver) bounds the check, and a stop cuts it.

The lookup used to run inside ``socket.create_connection``, bounded only by the resolver's own
timeouts and deaf to a stopping worker. Python's resolver is replaced here by one that does
not answer (the only part not real: a dead DNS server cannot be set up without changing the
machine's resolver); the rest is the session as the worker runs it.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from sokratos_worker.config import EmailAccountConfig
from sokratos_worker.email.imap import ImapAborted, ImapError, ImapSession, OpenSessions

HOST = "imap.unanswered.example"


@pytest.fixture
def dead_resolver(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """getaddrinfo for HOST waits until the test ends; other names resolve as usual."""
    real = socket.getaddrinfo
    released = threading.Event()
    asked: list[str] = []

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == HOST:
            asked.append(host)
            released.wait(60)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield asked
    released.set()


def _account(security: str) -> EmailAccountConfig:
    return EmailAccountConfig(
        name="dns", host=HOST, username="alice", password="secret", security=security
    )


@pytest.mark.parametrize("security", ["tls", "starttls", "none"])
def test_a_lookup_without_an_answer_fails_the_check_at_its_timeout(
    dead_resolver: list[str], security: str
) -> None:
    started = time.monotonic()
    with pytest.raises(ImapError) as caught, ImapSession(_account(security), timeout=0.5):
        pass
    took = time.monotonic() - started
    assert dead_resolver == [HOST]
    assert not isinstance(caught.value, ImapAborted)
    text = str(caught.value)
    assert f"connecting to {HOST}" in text
    assert f"looking up {HOST} (DNS) got no answer within 0.5 s" in text
    assert "/etc/resolv.conf" in text
    assert took < 10  # (60 s without the bound; generous for a loaded machine)


def test_a_stopping_worker_cuts_a_lookup_in_progress(dead_resolver: list[str]) -> None:
    sessions = OpenSessions()
    failure: list[BaseException] = []

    def check() -> None:
        try:
            with ImapSession(_account("tls"), timeout=30, sessions=sessions):
                pass
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=check)
    thread.start()
    deadline = time.monotonic() + 10
    while not dead_resolver and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dead_resolver, "the lookup never started"
    cut_at = time.monotonic()
    assert sessions.cut_all() == 1
    thread.join(10)
    assert not thread.is_alive()
    assert time.monotonic() - cut_at < 5  # (30 s, the read timeout, before)
    (error,) = failure
    assert isinstance(error, ImapAborted)
    assert "cut short because the worker is stopping" in str(error)
