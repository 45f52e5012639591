"""An IMAP user name that needs quoting logs in: imaplib quotes only the password of LOGIN, so
an Exchange-style `DOMAIN\\user`, or a name with a space, was sent bare and the server
answered BAD (or took the part after the space for the password). The name is quoted now,
and credentials LOGIN cannot carry at all (a line break) go by SASL PLAIN. Real Dovecot.
"""

from __future__ import annotations

from dovecot import QUOTED_PASSWORD, QUOTED_USER, AccountFactory, make_settings

from sokratos_worker.email import probe_accounts


def test_a_user_name_with_a_backslash_and_a_space_logs_in(account: AccountFactory) -> None:
    quoted = account(username=QUOTED_USER, password=QUOTED_PASSWORD, mailbox="INBOX")
    [line] = probe_accounts(make_settings(quoted))
    assert line.ok, line.detail


def test_a_wrong_password_for_such_a_name_is_still_a_refused_login(
    account: AccountFactory,
) -> None:
    wrong = account(username=QUOTED_USER, password="not it", mailbox="INBOX")
    [line] = probe_accounts(make_settings(wrong))
    assert not line.ok
    assert "login" in line.detail.lower(), line.detail
