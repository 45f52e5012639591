"""Fixtures for the email tests: one private Dovecot per session, a fresh mailbox per test."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from dovecot import PASSWORD, USER, AccountFactory, Dovecot, dovecot_binary

from sokratos_worker.config import EmailAccountConfig
from sokratos_worker.email.parse import ParsedEmail, parse_email


@pytest.fixture(scope="session")
def dovecot() -> Iterator[Dovecot]:
    """A running Dovecot on 127.0.0.1; skipped without it locally, a failure in CI."""
    binary = dovecot_binary()
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("dovecot is not installed (apt-get install dovecot-imapd)")
        pytest.skip("dovecot is not installed (apt-get install dovecot-imapd)")
    server = Dovecot.start(binary)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def mailbox(dovecot: Dovecot) -> str:
    """A new, empty mailbox for this test only."""
    name = f"t{uuid.uuid4().hex[:10]}"
    dovecot.create_mailbox(name)
    return name


@pytest.fixture
def account(dovecot: Dovecot, mailbox: str) -> AccountFactory:
    """Build an account on the test Dovecot; keyword arguments override the defaults."""

    def make(**overrides: Any) -> EmailAccountConfig:
        values: dict[str, Any] = {
            "name": "home",
            "host": "127.0.0.1",
            "port": dovecot.imap_port,
            "username": USER,
            "password": PASSWORD,
            "mailbox": mailbox,
            "security": "none",
        }
        values.update(overrides)
        return EmailAccountConfig(**values)

    return make


@pytest.fixture
def poison_breaks_the_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check's parser fails on every mail whose subject is "poison", as a parser bug
    would, so the worker dead-letters and passes it (``monkeypatch.undo()`` fixes it)."""

    def fragile(raw: bytes) -> ParsedEmail:
        if b"Subject: poison" in raw:
            raise RuntimeError("parser bug")
        return parse_email(raw)

    monkeypatch.setattr("sokratos_worker.email.check.parse_email", fragile)
    monkeypatch.setattr("sokratos_worker.email.checkpoint.parse_email", fragile)
