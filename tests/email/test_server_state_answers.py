"""Answers with the server's state (RFC 5530 NO [UNAVAILABLE], BYE shutting down) to one
message while the server returns others: that message's refusal, also when no message was
returned before it in the check (the first message, alone in its batch, or an old message's
body); to every message: the server's, never passing one, for a handful of commands a check
(review R3)."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

import mails
import pytest
from dovecot import AccountFactory, Dovecot, make_settings
from refusing_proxy import ByeProxy, RefusingProxy

from sokratos_worker.email import check_due_accounts

pytestmark = [pytest.mark.imap, pytest.mark.postgres]

NOW = datetime.now(UTC)

# A full-body fetch only (BODY.PEEK[]<0.N>), not the header-only fetch of old mail.
_BODY_FETCH = re.compile(rb"^(\S+) UID FETCH ([0-9,:]+) \(.*BODY\.PEEK\[\]", re.IGNORECASE)


class BodyRefusingProxy(RefusingProxy):
    """Answers ``NO <answer>`` to a full-body FETCH of a refused UID; its header block (and
    every other message) is served by Dovecot."""

    fetch = _BODY_FETCH


def test_old_mail_whose_body_always_draws_unavailable_does_not_stop_every_check(
    *, dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """First check of a new account: old mail is fetched headers-only, and one old message
    without a Message-ID needs its body for its key. The server returns every header block
    (and every other body) but answers that one body with NO [UNAVAILABLE] on every check.
    It is passed on the third check: every check stopped 'failed for now' for good
    (no body had been returned before it in the check), and the new mail after it was never
    triaged."""
    old = NOW - timedelta(days=7)
    dovecot.append(mailbox, mails.plain(subject="old one"), when=old)
    dovecot.append(mailbox, mails.plain(subject="old, no id", message_id=None), when=old)
    dovecot.append(mailbox, mails.plain(subject="old three"), when=old)
    dovecot.append(mailbox, mails.plain(subject="new"), when=NOW - timedelta(hours=1))
    errors = []
    with BodyRefusingProxy(dovecot.imap_port, refused={2}, answer=b"[UNAVAILABLE] busy") as proxy:
        settings = make_settings(account(port=proxy.port), email_initial_lookback=86400)
        for n in range(5):
            [report] = check_due_accounts(settings, database_url, now=NOW + timedelta(minutes=10 * n))
            errors.append(report.error)
    subjects = [r[0] for r in db.execute("SELECT payload->>'subject' FROM pending_triage")]
    failed = db.execute("SELECT context_data->>'uid' FROM failed_operations").fetchall()
    assert subjects == ["new"], errors
    assert failed == [("2",)], errors


def _large(subject: str, megabytes: int) -> bytes:
    line = "x" * 76 + "\n"
    return mails.plain(subject=subject, body=line * (megabytes * 1024 * 1024 // len(line)))


def test_a_large_message_alone_in_its_batch_always_unavailable_does_not_stop_every_check(
    *, dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """Two 12 MB messages are two batches (BATCH_BYTES 20 MiB). The server answers the first
    with NO [UNAVAILABLE] on every check and returns the second: the first is passed
    on the third check (every check stopped 'failed for now' for good: nothing had been
    returned before it in the check, and the second was in another batch)."""
    dovecot.append(mailbox, _large("big one", 12))
    dovecot.append(mailbox, _large("big two", 12))
    errors = []
    with RefusingProxy(dovecot.imap_port, refused={1}, answer=b"[UNAVAILABLE] busy") as proxy:
        settings = make_settings(account(port=proxy.port))
        for n in range(5):
            [report] = check_due_accounts(settings, database_url, now=NOW + timedelta(minutes=10 * n))
            errors.append(report.error)
    subjects = [r[0] for r in db.execute("SELECT payload->>'subject' FROM pending_triage")]
    failed = db.execute("SELECT context_data->>'uid' FROM failed_operations").fetchall()
    assert subjects == ["big two"], errors
    assert failed == [("1",)], errors




@pytest.mark.parametrize(
    ("base", "answer"),
    [(RefusingProxy, b"[UNAVAILABLE] busy"), (ByeProxy, b"Server shutting down.")],
    ids=["no-unavailable", "bye-shutting-down"],
)
def test_a_real_outage_never_passes_a_message_and_costs_few_commands(
    *, dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any,
    base: type[RefusingProxy], answer: bytes,
) -> None:
    """Every body FETCH answered with the server's state, on five checks, 60 messages (two
    batches): no refusal counted, nothing in failed_operations, a handful of FETCHes and
    connections per check. """
    for n in range(60):
        dovecot.append(mailbox, mails.plain(subject=f"m{n}"))
    with base(dovecot.imap_port, refused=set(range(1, 61)), answer=answer) as proxy:
        settings = make_settings(account(port=proxy.port))
        for n in range(5):
            [report] = check_due_accounts(settings, database_url, now=NOW + timedelta(minutes=10 * n))
            assert report.error is not None and "failed for now" in report.error, report
    assert db.execute("SELECT refused_uid, refused_checks FROM email_checkpoints").fetchone() == (None, 0)
    assert db.execute("SELECT count(*) FROM failed_operations").fetchone() == (0,)
    assert 5 <= proxy.fetches <= 5 * 6 and proxy.connections <= 5 * 4, (proxy.fetches, proxy.connections)
