"""A mail recorded at a UID closes only the failure of the mail passed at that UID (found by
a review): after a restore from a backup the server hands the UID to other mail under the same
UIDVALIDITY, and the first version of the close marked the passed mail's failure "retried as"
the new mail's item, so the mail that failed vanished from `failed list` untriaged. The
'passed' row's size and arrival date tell the two apart. Real parts: Dovecot, PostgreSQL.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import mails
import pytest
from dovecot import AccountFactory, Dovecot, make_settings

from sokratos_worker.email import check_due_accounts

pytestmark = [pytest.mark.imap, pytest.mark.postgres]
NOW = datetime.now(UTC)


@pytest.mark.usefixtures("poison_breaks_the_parser")
def test_mail_at_a_reused_uid_leaves_another_mails_failure_open(  # noqa: PLR0917
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: Any,
    tmp_path: Path,
) -> None:
    settings = make_settings(account(), email_initial_lookback=86400)
    for n in (1, 2):
        dovecot.append(mailbox, mails.plain(subject=f"before {n}"))
    check_due_accounts(settings, database_url, now=NOW)
    dovecot.backup(mailbox, tmp_path / "backup")
    dovecot.append(mailbox, mails.plain(subject="poison"))  # UID 3: dead-lettered
    dovecot.append(mailbox, mails.plain(subject="lost 4"))  # UID 4
    [result] = check_due_accounts(settings, database_url, now=NOW + timedelta(minutes=10))
    assert result.failed == 1, result
    [(failure,)] = db.execute(
        "SELECT id FROM failed_operations WHERE op_type = 'email_message' AND retried_at IS NULL"
    ).fetchall()
    dovecot.restore(mailbox, tmp_path / "backup")  # the poison mail is gone
    dovecot.append(mailbox, mails.plain(subject="after the restore, a longer subject"))  # UID 3
    [result] = check_due_accounts(settings, database_url, now=NOW + timedelta(minutes=20))
    assert result.ok and result.uids_reused, result
    row = db.execute(
        "SELECT retried_at, retried_as FROM failed_operations WHERE id = %s", (failure,)
    ).fetchone()
    assert row == (None, None), f"the poison mail's failure was closed as another mail's: {row}"
    subjects = [
        r[0] for r in db.execute("SELECT payload->>'subject' FROM pending_triage").fetchall()
    ]
    assert "after the restore, a longer subject" in subjects, subjects
