"""A message the listing (``UID FETCH last_uid:* (UID RFC822.SIZE INTERNALDATE)``) leaves out
while UID SEARCH finds it is asked for like any other, never passed in silence.

Found by a review (2026-12-06): such a message was skipped without a word: recording the
next UID moved the checkpoint past it, with no error, no failure row and no log. Now a check
whose listing leaves gaps between its UIDs asks ``UID SEARCH`` about those gaps (at most 10
commands a check); a UID missing from the listing (below the highest one listed) is logged (``email_message_unlisted``) and
fetched with the others: returned, it is triaged; left out of the body fetch too, it is
counted and passed after 3 checks like any message left out.

Real parts: Dovecot on 127.0.0.1 behind a proxy that drops chosen lines from the listing's
answer (and chosen UIDs from body FETCH commands), and PostgreSQL.
"""

from __future__ import annotations

import contextlib
import re
import socket
from datetime import UTC, datetime, timedelta
from typing import Any

import mails
import psycopg
import pytest
from dovecot import AccountFactory, Dovecot, make_settings
from refusing_proxy import UnlistingProxy, _uids
from structlog.testing import capture_logs
from test_message_left_out import assert_nothing_doubled, later, refusal, subjects

from sokratos_worker.email import check_due_accounts, imap

pytestmark = [pytest.mark.imap, pytest.mark.postgres]





def failures(db: psycopg.Connection) -> list[tuple[str, str, dict[str, Any]]]:
    return db.execute(
        "SELECT label, error_message, context_data FROM failed_operations ORDER BY id"
    ).fetchall()




def test_a_message_left_out_of_the_listing_is_fetched_and_triaged(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    names = ["one", "two", "three", "four"]
    for subject in names:
        dovecot.append(mailbox, mails.plain(subject=subject))
    with (
        UnlistingProxy(dovecot.imap_port, refused=set(), unlisted={2}) as proxy,
        capture_logs() as logs,
    ):
        [report] = check_due_accounts(
            make_settings(account(port=proxy.port)), database_url, now=later(0)
        )
    assert report.ok, report.error
    assert (report.enqueued, report.failed) == (4, 0), report
    assert subjects(db) == names
    assert failures(db) == []
    [said] = [e for e in logs if e["event"] == "email_message_unlisted"]
    assert (said["uid"], said["mailbox"]) == (2, mailbox), said
    # Recorded with the size and arrival date its own fetch returned (the restore check's).
    row = db.execute(
        "SELECT server_size > 0, internal_date IS NOT NULL FROM processed_emails WHERE uid = 2"
    ).fetchone()
    assert row == (True, True)
    assert_nothing_doubled(db)


def test_a_message_left_out_of_the_listing_and_its_fetch_is_passed_after_three_checks(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    names = ["one", "two", "three", "four", "five"]
    for subject in names:
        dovecot.append(mailbox, mails.plain(subject=subject))
    with UnlistingProxy(dovecot.imap_port, refused={3}, unlisted={3}) as proxy:
        settings = make_settings(account(port=proxy.port))
        for n in range(2):
            [report] = check_due_accounts(settings, database_url, now=later(10 * n))
            assert report.error is not None and "UID 3 " in report.error, report.error
            assert f"on {n + 1} consecutive check(s)" in report.error, report.error
            assert subjects(db) == ["one", "two"]
            assert refusal(db) == (2, 3, n + 1)
            assert failures(db) == []
        [report] = check_due_accounts(settings, database_url, now=later(20))
    assert report.ok, report.error
    assert (report.enqueued, report.failed) == (2, 1), report
    assert subjects(db) == ["one", "two", "four", "five"]
    assert refusal(db) == (5, None, 0)
    [(label, error, context)] = failures(db)
    assert label == "home UID 3"
    assert "left out of the server's answers on 3 consecutive checks" in error, error
    assert context["uid"] == 3 and context["size"] is None, context

    # The server is repaired: what_to_do fetches it again, and only it is triaged.
    db.execute(context["what_to_do"].split("fetch it again with ", 1)[1].split(";")[0])
    [report] = check_due_accounts(make_settings(account()), database_url, now=later(40))
    assert report.ok, report.error
    assert subjects(db) == ["one", "two", "four", "five", "three"]
    assert_nothing_doubled(db)


def test_old_mail_left_out_of_the_listing_is_only_recorded_on_a_first_check(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """Mail older than the first check's lookback is only recorded as seen; one the listing
    left out had no arrival date there and was triaged as new (found by a review): its own
    fetch's date decides now."""
    old = datetime.now(UTC) - timedelta(days=400)
    for subject in ("one", "two", "three"):
        dovecot.append(mailbox, mails.plain(subject=subject), when=old)
    with UnlistingProxy(dovecot.imap_port, refused=set(), unlisted={2}) as proxy:
        [report] = check_due_accounts(
            make_settings(account(port=proxy.port)), database_url, now=later(0)
        )
    assert report.ok, report.error
    assert (report.enqueued, report.seen_without_triage) == (0, 3), report
    assert subjects(db) == []


def test_the_search_for_unlisted_mail_names_only_the_gaps(  # noqa: PLR0917
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The search asked ``UID SEARCH UID last_uid+1:*``, whose one answer line named every
    new UID: past imaplib's 1 MB line limit on a first check of ~160,000 messages, every check
    failed before recording any (found by a review). It asks about the gaps between listed
    UIDs now, so its answer names the messages left out only. Here imaplib's limit is made
    small enough for a line naming 400 UIDs to break it (the server's other lines fit)."""
    import imaplib

    names = [f"m{n:03}" for n in range(1, 401)]
    for subject in names:
        dovecot.append(mailbox, mails.plain(subject=subject))
    monkeypatch.setattr(imaplib, "_MAXLINE", 1000)
    with UnlistingProxy(dovecot.imap_port, refused=set(), unlisted={60}) as proxy:
        [report] = check_due_accounts(
            make_settings(account(port=proxy.port)), database_url, now=later(0)
        )
    assert report.ok, report.error
    assert report.enqueued == 400, report
    assert sorted(subjects(db)) == names
    assert_nothing_doubled(db)


class _StateProxy(UnlistingProxy):
    """An UnlistingProxy that answers every UID FETCH naming a ``refused`` UID with the
    server's own state (NO [UNAVAILABLE]), as a store that cannot read that message does."""

    def _commands(self, client: socket.socket, upstream: socket.socket) -> None:
        with contextlib.suppress(OSError, ValueError):
            for line in self._lines(client):
                fetch = _ANY_UID_FETCH.match(line)
                if fetch and _uids(fetch.group(2)) & self.refused:
                    client.sendall(fetch.group(1) + b" NO [UNAVAILABLE] message store offline\r\n")
                else:
                    upstream.sendall(line)


_ANY_UID_FETCH = re.compile(rb"^(\S+) UID FETCH ([0-9,:]+) ", re.IGNORECASE)


def test_an_unlisted_message_answered_with_the_servers_state_is_passed_after_three_checks(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """A message left out of the listing whose every fetch the server answers with its own
    state: asked for its size alone, that answer escaped the check before anything was
    recorded, at every check, for good (found by a review); fetched with the others, the
    check tells the server's state from the message's and passes it after 3 checks."""
    for subject in ("one", "two", "three", "four"):
        dovecot.append(mailbox, mails.plain(subject=subject))
    with _StateProxy(dovecot.imap_port, refused={2}, unlisted={2}) as proxy:
        settings = make_settings(account(port=proxy.port))
        for n in range(4):
            check_due_accounts(settings, database_url, now=later(10 * n))
    assert subjects(db) == ["one", "three", "four"]
    assert [f[0] for f in failures(db)] == ["home UID 2"]
    assert_nothing_doubled(db)


def test_a_sparse_mailbox_costs_a_bounded_number_of_searches_per_check(  # noqa: PLR0917
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every gap between listed UIDs was searched before anything was recorded: a first check
    of a mailbox with holes everywhere (Gmail's UIDs) spent hundreds of round trips of its
    deadline (found by a review). At most MAX_GAP_SEARCHES per check now; the listed mail
    above the gaps left unsearched waits for the next check, nothing passed unsearched."""
    searches: list[int] = []
    search = imap.ImapSession._search_uids

    def counted(self: imap.ImapSession, uid_set: str) -> list[int]:
        searches.append(len(uid_set.split(",")))
        return search(self, uid_set)

    monkeypatch.setattr(imap.ImapSession, "_search_uids", counted)
    monkeypatch.setattr(imap, "GAP_RANGES_PER_SEARCH", 1)
    monkeypatch.setattr(imap, "MAX_GAP_SEARCHES", 2)
    names = [f"m{n:02}" for n in range(1, 11)]
    for subject in names:
        dovecot.append(mailbox, mails.plain(subject=subject))
    with UnlistingProxy(dovecot.imap_port, refused=set(), unlisted={2, 4, 6, 8}) as proxy:
        settings = make_settings(account(port=proxy.port))
        [first] = check_due_accounts(settings, database_url, now=later(0))
        assert (first.ok, first.enqueued, len(searches)) == (True, 5, 2), (first, searches)
        assert subjects(db) == names[:5]
        [second] = check_due_accounts(settings, database_url, now=later(10))
    assert (second.ok, second.enqueued, len(searches)) == (True, 5, 4), (second, searches)
    assert subjects(db) == names
    assert_nothing_doubled(db)
