"""When the message at the checkpoint's UID was deleted and new mail came above it, the
restore check finds the highest UID at or below the checkpoint with one bounded search: with
ESEARCH (Dovecot has it), ``UID SEARCH RETURN (MAX) UID 1:n`` answers one number; without it,
UID SEARCH looks in a window below the checkpoint first and widens it only while it is empty.

Found by review (r8): ``UID SEARCH UID 1:n`` listed every UID of the mailbox (600 KB for
100,000 messages) on such checks. Real parts: Dovecot; the tests record the UID commands the
session sends (they change nothing).
"""

from __future__ import annotations

import contextlib
from typing import Any

import mails
import pytest
from dovecot import AccountFactory, Dovecot

from sokratos_worker.email import imap
from sokratos_worker.email.imap import ImapSession

pytestmark = [pytest.mark.imap]


def _mailbox_with_gap(dovecot: Dovecot, mailbox: str, count: int, deleted: range) -> None:
    for n in range(count):
        dovecot.append(mailbox, mails.plain(subject=f"mail {n + 1}"))
    client = dovecot.client()
    try:
        assert client.select(mailbox)[0] == "OK"
        for uid in deleted:
            client.uid("STORE", str(uid), "+FLAGS", "(\\Deleted)")
        client.expunge()
    finally:
        with contextlib.suppress(Exception):
            client.logout()


def _searches(session: ImapSession, monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    sent: list[tuple[Any, ...]] = []
    uid = session.conn.uid

    def recording_uid(command: str, *args: Any) -> Any:
        if command == "SEARCH":
            sent.append(args)
        return uid(command, *args)

    monkeypatch.setattr(session.conn, "uid", recording_uid)
    return sent


def test_the_highest_uid_below_the_checkpoint_is_one_esearch_max(
    *, dovecot: Dovecot, mailbox: str, account: AccountFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    _mailbox_with_gap(dovecot, mailbox, 6, range(4, 7))  # UIDs 1..3 remain
    with ImapSession(account()) as session:
        session.examine()
        sent = _searches(session, monkeypatch)
        assert session.highest_uid_up_to(5) == 3
        assert session.highest_uid_up_to(2) == 2
    assert sent == [("RETURN", "(MAX)", "UID", "1:5"), ("RETURN", "(MAX)", "UID", "1:2")]


def test_no_message_at_or_below_the_checkpoint_is_none(
    *, dovecot: Dovecot, mailbox: str, account: AccountFactory
) -> None:
    _mailbox_with_gap(dovecot, mailbox, 3, range(1, 3))  # only UID 3 remains
    with ImapSession(account()) as session:
        session.examine()
        assert session.highest_uid_up_to(2) is None


def test_without_esearch_the_search_widens_a_window_below_the_checkpoint(
    *, dovecot: Dovecot, mailbox: str, account: AccountFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(imap, "SEARCH_WINDOW", 2)
    monkeypatch.setattr(ImapSession, "_capabilities", lambda self: frozenset({"IMAP4REV1"}))
    _mailbox_with_gap(dovecot, mailbox, 10, range(6, 11))  # UIDs 1..5 remain
    with ImapSession(account()) as session:
        session.examine()
        sent = _searches(session, monkeypatch)
        assert session.highest_uid_up_to(10) == 5
        assert session.highest_uid_up_to(0) is None
    # 9:10 is empty; the next window is SEARCH_WINDOW_GROWTH times as wide (down to UID 1).
    assert sent == [("UID", "9:10"), ("UID", "1:8")]
