"""Email checks over IMAP: read-only fetch, parse, and one transaction per message.

Entry points for the daemon and the CLI:

- :func:`check_due_accounts` — the email check of ``run`` / ``run --once``;
- :func:`probe_accounts` — one :class:`~sokratos_worker.model.CheckLine` per account for ``check``;
- :func:`account_statuses` — the ``email_accounts`` list of ``status``;
- :func:`prune_processed_emails` — maintenance, ``SOKRATOS_PROCESSED_EMAILS_TTL_DAYS``
  (from :mod:`sokratos_worker.store.email`).
"""

from sokratos_worker.email.check import (
    AccountReport,
    account_statuses,
    check_due_accounts,
    probe_accounts,
)
from sokratos_worker.email.imap import ImapError
from sokratos_worker.email.parse import ParsedEmail, format_email_summary, parse_email
from sokratos_worker.store.email import prune_processed_emails

__all__ = [
    "AccountReport",
    "ImapError",
    "ParsedEmail",
    "account_statuses",
    "check_due_accounts",
    "format_email_summary",
    "parse_email",
    "probe_accounts",
    "prune_processed_emails",
]
