"""The connection that got no greeting is closed at once, not left to the garbage collector.

Found by review (r6): when no greeting came (imap.py ``_open_greeted_socket`` → ``_await_greeting`` raising
NoGreeting), the connection just opened is never closed: NoGreeting escapes imaplib's
``open()`` (outside the try in ``IMAP4.__init__`` that shuts a failed connection down), so
the session has no ``conn`` to log out of and the socket is left to the garbage collector
(ResourceWarning: unclosed socket), on every check of a misconfigured account. Until it is
collected the server keeps a connection open for a client that went away.

Real parts: a real Dovecot's implicit-TLS port with security "none", a real PostgreSQL.
Correct behaviour: the socket is closed when the greeting wait fails (close it in
``_open_greeted_socket`` before re-raising).
"""

from __future__ import annotations

import gc
import warnings
from datetime import UTC, datetime

import pytest
from dovecot import AccountFactory, Dovecot, make_settings

from sokratos_worker.email import check_due_accounts

pytestmark = [pytest.mark.imap, pytest.mark.postgres]


def test_the_connection_that_got_no_greeting_is_closed(
    dovecot: Dovecot, account: AccountFactory, database_url: str
) -> None:
    settings = make_settings(account(port=dovecot.imaps_port, security="none"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        [report] = check_due_accounts(settings, database_url, now=datetime.now(UTC))
        gc.collect()
    assert report.error and "no IMAP greeting" in report.error, report
    unclosed = [str(w.message) for w in caught if "unclosed <socket" in str(w.message)]
    assert not unclosed, f"sockets left to the garbage collector: {unclosed}"
