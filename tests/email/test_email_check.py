"""Email checks against a real Dovecot and a real PostgreSQL: inputs counted against items."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import mails
import psycopg
import pytest
from dovecot import UTF8_PASSWORD, UTF8_USER, AccountFactory, Dovecot, make_settings
from refusing_proxy import ByeProxy, RefusingProxy
from structlog.testing import capture_logs

from sokratos_worker.email import (
    account_statuses,
    check_due_accounts,
    imap,
    probe_accounts,
    prune_processed_emails,
)
from sokratos_worker.email.imap import MESSAGE_BYTES_LIMIT, ImapSession, encode_mailbox
from sokratos_worker.email.parse import message_key, parse_email
from tests.support.db import refuse_triage

pytestmark = [pytest.mark.imap, pytest.mark.postgres]

NOW = datetime.now(UTC)
ROOT = Path(__file__).resolve().parents[2]


def later(minutes: int) -> datetime:
    """A time when every account is due again (the interval is 5 minutes)."""
    return NOW + timedelta(minutes=minutes)


def items(db: psycopg.Connection) -> list[dict[str, Any]]:
    rows = db.execute(
        "SELECT payload, idempotency_key, source FROM pending_triage ORDER BY id"
    ).fetchall()
    return [{"payload": p, "key": k, "source": s} for p, k, s in rows]


def processed(db: psycopg.Connection) -> list[tuple[str, int | None, int | None]]:
    return db.execute(
        "SELECT message_id, uid, item_id FROM processed_emails ORDER BY uid, message_id"
    ).fetchall()


def passed_uids(db: psycopg.Connection) -> list[int]:
    """The UIDs of the 'passed' rows: messages dead-lettered and passed (sql/0045)."""
    rows = db.execute(
        "SELECT uid FROM processed_emails WHERE status = 'passed' AND item_id IS NULL ORDER BY uid"
    )
    return [row[0] for row in rows]


def checkpoint(db: psycopg.Connection, name: str = "home") -> tuple[Any, ...] | None:
    return db.execute(
        "SELECT uidvalidity, last_uid, checked_at, last_error FROM email_checkpoints"
        " WHERE account = %s",
        (name,),
    ).fetchone()


def test_new_mail_becomes_one_item_per_message_across_checks(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    for n in range(3):
        dovecot.append(mailbox, mails.plain(subject=f"message {n}"))
    settings = make_settings(account())
    with capture_logs() as logs:
        [report] = check_due_accounts(settings, database_url, now=later(0))
    assert (report.fetched, report.enqueued, report.seen_without_triage) == (3, 3, 0)
    [finished] = [e for e in logs if e["event"] == "email_check_finished"]
    assert finished["account"] == "home"
    assert (finished["fetched"], finished["enqueued"], finished["seen_without_triage"]) == (3, 3, 0)
    assert "usual place" not in repr(logs)  # bodies are never logged
    found = items(db)
    assert [i["payload"]["subject"] for i in found] == ["message 0", "message 1", "message 2"]
    assert {i["source"] for i in found} == {"email"}
    first = found[0]["payload"]
    assert first["account"] == "home"
    assert first["mailbox"] == mailbox
    assert first["uid"] == 1
    assert first["uidvalidity"] == dovecot.uidvalidity(mailbox)
    assert first["text"].startswith("From: Bob Example <bob@example.org>\nTo: alice@example.org")
    assert found[0]["key"] == f"email:home:{first['message_id']}"
    assert [p[1] for p in processed(db)] == [1, 2, 3]
    assert all(p[2] is not None for p in processed(db))

    # Not due yet: nothing happens.
    [report] = check_due_accounts(settings, database_url, now=later(1))
    assert report.skipped_reason == "not due"
    # Due again, nothing new: nothing enqueued; one more message: exactly one more item.
    [report] = check_due_accounts(settings, database_url, now=later(10))
    assert (report.fetched, report.enqueued) == (0, 0)
    dovecot.append(mailbox, mails.plain(subject="message 3"))
    [report] = check_due_accounts(settings, database_url, now=later(20))
    assert (report.fetched, report.enqueued) == (1, 1)
    assert len(items(db)) == 4
    assert checkpoint(db)[1] == 4  # type: ignore[index]


def test_a_lost_checkpoint_refetches_without_new_items(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """processed_emails, not the checkpoint alone, is what makes a re-fetch a no-op."""
    for n in range(2):
        dovecot.append(mailbox, mails.plain(subject=f"m{n}"))
    settings = make_settings(account())
    check_due_accounts(settings, database_url, now=later(0))
    db.execute("UPDATE email_checkpoints SET last_uid = 0")
    [report] = check_due_accounts(settings, database_url, now=later(10))
    assert (report.fetched, report.enqueued, report.duplicates) == (2, 0, 2)
    assert len(items(db)) == 2


def test_seen_flags_are_unchanged_by_a_check(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    dovecot.append(mailbox, mails.plain(subject="unread"))
    dovecot.append(mailbox, mails.plain(subject="read"), flags="\\Seen")
    dovecot.append(mailbox, mails.plain(subject="flagged"), flags="\\Flagged")
    before = dovecot.flags(mailbox)
    assert before == {1: "", 2: "\\Seen", 3: "\\Flagged"}
    [report] = check_due_accounts(make_settings(account()), database_url, now=later(0))
    assert report.enqueued == 3
    assert dovecot.flags(mailbox) == before


def test_uidvalidity_change_resets_the_checkpoint_without_retriage(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    old_mails = [mails.plain(subject=f"kept {n}") for n in range(2)]
    for raw in old_mails:
        dovecot.append(mailbox, raw)
    settings = make_settings(account())
    check_due_accounts(settings, database_url, now=later(0))
    old_validity = dovecot.uidvalidity(mailbox)
    assert checkpoint(db)[:2] == (old_validity, 2)  # type: ignore[index]

    # The mailbox is rebuilt (new UIDVALIDITY), holding the same mail plus one new message.
    dovecot.delete_mailbox(mailbox)
    dovecot.create_mailbox(mailbox)
    dovecot.append(mailbox, mails.plain(subject="brand new"))
    for raw in old_mails:
        dovecot.append(mailbox, raw)
    new_validity = dovecot.uidvalidity(mailbox)
    assert new_validity != old_validity

    with capture_logs() as logs:
        [report] = check_due_accounts(settings, database_url, now=later(10))
    assert report.uidvalidity_reset
    assert (report.fetched, report.enqueued, report.duplicates) == (3, 1, 2)
    assert [i["payload"]["subject"] for i in items(db)] == ["kept 0", "kept 1", "brand new"]
    uidvalidity, last_uid, checked_at, _ = checkpoint(db)  # type: ignore[misc]
    assert (uidvalidity, last_uid) == (new_validity, 3)
    assert checked_at is not None
    assert any(e["event"] == "email_uidvalidity_changed" for e in logs)


def test_uidvalidity_change_triages_unseen_mail_whatever_its_date(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """The lookback is for a new account only: after a reset, processed_emails decides."""
    first_check = NOW - timedelta(days=5)
    kept = [mails.plain(subject=f"kept {n}") for n in range(2)]
    for raw in kept:
        dovecot.append(mailbox, raw, when=first_check - timedelta(hours=1))
    settings = make_settings(account(), email_initial_lookback=86400)
    [report] = check_due_accounts(settings, database_url, now=first_check)
    assert report.enqueued == 2

    # While the worker is down for days, a message arrives, then the mailbox is rebuilt.
    missed = mails.plain(subject="arrived while the worker was down")
    missed_at = NOW - timedelta(days=3)  # older than the one-day lookback at the next check
    dovecot.append(mailbox, missed, when=missed_at)
    old_validity = dovecot.uidvalidity(mailbox)
    dovecot.delete_mailbox(mailbox)
    dovecot.create_mailbox(mailbox)
    for raw in kept:
        dovecot.append(mailbox, raw, when=first_check - timedelta(hours=1))
    dovecot.append(mailbox, missed, when=missed_at)
    assert dovecot.uidvalidity(mailbox) != old_validity

    [report] = check_due_accounts(settings, database_url, now=NOW)
    assert report.uidvalidity_reset
    assert (report.fetched, report.enqueued, report.duplicates) == (3, 1, 2)
    assert report.seen_without_triage == 0
    assert [i["payload"]["subject"] for i in items(db)] == [
        "kept 0",
        "kept 1",
        "arrived while the worker was down",
    ]
    assert items(db)[2]["payload"]["uid"] == 3
    # Checked again: nothing new, so the missed message stays enqueued exactly once.
    [report] = check_due_accounts(settings, database_url, now=NOW + timedelta(minutes=10))
    assert (report.fetched, report.enqueued) == (0, 0)
    assert len(items(db)) == 3


def test_a_reread_after_uidvalidity_that_failed_part_way_still_applies_no_lookback(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """A reset clears checked_at; the check after a re-read that failed part-way must not
    take the account for a new one and record old unseen mail as seen without triage."""
    first_check = NOW - timedelta(days=5)
    dovecot.append(mailbox, mails.plain(subject="kept"), when=first_check - timedelta(hours=1))
    settings = make_settings(account(), email_initial_lookback=86400)
    [report] = check_due_accounts(settings, database_url, now=first_check)
    assert report.enqueued == 1
    missed = mails.plain(subject="arrived while the worker was down")
    dovecot.delete_mailbox(mailbox)
    dovecot.create_mailbox(mailbox)
    dovecot.append(mailbox, missed, when=NOW - timedelta(days=3))  # older than the lookback
    # The re-read after the reset died before reaching the message (as a crash would leave it).
    db.execute(
        "UPDATE email_checkpoints SET uidvalidity = %s, last_uid = 0, checked_at = NULL",
        (dovecot.uidvalidity(mailbox),),
    )
    [report] = check_due_accounts(settings, database_url, now=NOW)
    assert (report.enqueued, report.seen_without_triage) == (1, 0)
    assert [i["payload"]["subject"] for i in items(db)][-1] == "arrived while the worker was down"


def test_messages_without_message_id_get_stable_hash_keys(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    dovecot.append(mailbox, mails.plain(message_id=None, body="first"))
    dovecot.append(mailbox, mails.plain(message_id=None, body="second"))
    settings = make_settings(account())
    check_due_accounts(settings, database_url, now=later(0))
    keys = [p[0] for p in processed(db)]
    assert len(keys) == 2
    assert all(k.startswith("home:sha256:") for k in keys)
    assert [i["payload"]["message_id"] for i in items(db)] == [None, None]
    # Re-reading the same two messages finds the same keys.
    db.execute("UPDATE email_checkpoints SET last_uid = 0")
    [report] = check_due_accounts(settings, database_url, now=later(10))
    assert (report.fetched, report.enqueued) == (2, 0)
    assert [p[0] for p in processed(db)] == keys


def test_two_messages_with_one_message_id_give_one_item(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    dovecot.append(mailbox, mails.plain(subject="original", message_id="<same@example.org>"))
    dovecot.append(mailbox, mails.plain(subject="copy", message_id="<same@example.org>"))
    [report] = check_due_accounts(make_settings(account()), database_url, now=later(0))
    assert (report.fetched, report.enqueued, report.duplicates) == (2, 1, 1)
    [item] = items(db)
    assert item["payload"]["subject"] == "original"
    [(key, _, item_id)] = processed(db)
    assert key == "home:<same@example.org>"
    assert item_id is not None
    assert checkpoint(db)[1] == 2  # type: ignore[index]


def test_multi_megabyte_attachment_is_listed_not_stored(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    raw, size = mails.with_attachment(4 * 1024 * 1024)
    dovecot.append(mailbox, raw)
    [report] = check_due_accounts(make_settings(account()), database_url, now=later(0))
    assert report.enqueued == 1
    [item] = items(db)
    assert item["payload"]["attachments"] == [{"name": "slides.pdf", "size": size}]
    assert item["payload"]["size"] == len(raw)
    stored = db.execute("SELECT octet_length(payload::text) FROM pending_triage").fetchone()[0]
    assert stored < 4000


def test_a_message_over_the_read_limit_is_read_up_to_it_and_says_so(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """A 19 MB message is read up to MESSAGE_BYTES_LIMIT (a partial FETCH), so its memory
    cost is bounded; the item still gets its text, its real size and a note."""
    raw, _ = mails.with_attachment(14 * 1024 * 1024)
    assert len(raw) > MESSAGE_BYTES_LIMIT
    dovecot.append(mailbox, raw)
    [report] = check_due_accounts(make_settings(account()), database_url, now=later(0))
    assert (report.enqueued, report.failed) == (1, 0), report
    [item] = items(db)
    payload = item["payload"]
    assert payload["size"] == len(raw)
    assert "Slides attached." in payload["text"]
    assert f"only its first {MESSAGE_BYTES_LIMIT} bytes were read" in " ".join(payload["notes"])
    assert [a["name"] for a in payload["attachments"]] == ["slides.pdf"]


@pytest.mark.parametrize(
    ("raw", "expected_text", "expected_note"),
    [
        (mails.html_only(), "Big news\n\nThe meeting moved to <Thursday>.", "HTML-only"),
        (mails.unknown_charset(), "Hello \ufffd\ufffd world, café", "unknown charset"),
        (mails.latin1(), "Schöne Grüße, bis Montag!", None),
        (mails.malformed_mime(), "SGVsbG8gd29ybGQ=", "malformed MIME"),
        (mails.unclosed_multipart(), "Hello there", "malformed MIME"),
        (mails.raw_utf8_headers(), "Subject: Grüße\n", None),
        (mails.raw_latin1_headers(), "Subject: Gr\ufffd\ufffde aus München\n", "not UTF-8"),
    ],
    ids=[
        "html-only",
        "unknown-charset",
        "iso-8859-1",
        "malformed-mime",
        "unclosed-multipart",
        "raw-utf8-headers",
        "raw-8bit-headers-not-utf8",
    ],
)
def test_difficult_mail_gives_a_clear_item(
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: Any,
    *,
    raw: bytes,
    expected_text: str,
    expected_note: str | None,
) -> None:
    [report] = check_due_accounts(make_settings(account()), database_url, now=later(0))
    dovecot.append(mailbox, raw)
    [report] = check_due_accounts(make_settings(account()), database_url, now=later(10))
    assert report.ok
    assert report.enqueued == 1
    [item] = items(db)
    payload = item["payload"]
    assert expected_text in payload["text"]
    if expected_note:
        assert any(expected_note in n for n in payload["notes"])
    else:
        assert payload["notes"] == []


def test_a_long_content_type_parameter_before_the_boundary_keeps_the_text_part(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """A long RFC 2231 name before the boundary (and the charset) made the raw MIME the body."""
    dovecot.append(mailbox, mails.long_content_type(mails.rfc2231_long_parameter))
    [report] = check_due_accounts(make_settings(account()), database_url, now=later(0))
    assert report.ok, report.error
    assert (report.enqueued, report.failed) == (1, 0)
    [item] = items(db)
    payload = item["payload"]
    body = payload["text"].split("\n\n", 1)[1]
    assert body == "Schöne Grüße aus München\n\n[attachments: report.pdf (9 bytes)]"
    assert payload["attachments"] == [{"name": "report.pdf", "size": 9}]
    assert payload["notes"] == []


def test_raw_utf8_headers_do_not_block_the_account(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """RFC 6532 headers once stopped every check at this message (UnicodeEncodeError)."""
    dovecot.append(mailbox, mails.raw_utf8_headers())
    dovecot.append(mailbox, mails.plain(subject="after it"))
    [report] = check_due_accounts(make_settings(account()), database_url, now=later(0))
    assert report.ok, report.error
    assert (report.fetched, report.enqueued, report.failed) == (2, 2, 0)
    utf8, plain = items(db)
    assert utf8["payload"]["subject"] == "Grüße"
    assert utf8["payload"]["from"] == "Jürgen <j@example.org>"
    assert utf8["payload"]["cc"] == "Renée <renee@example.org>"
    assert utf8["payload"]["message_id"] == "<grüße-1@example.de>"
    assert utf8["key"] == "email:home:<grüße-1@example.de>"
    assert "\nSubject: Grüße\n" in utf8["payload"]["text"]
    assert plain["payload"]["subject"] == "after it"
    assert [p[1] for p in processed(db)] == [1, 2]
    _, last_uid, checked_at, last_error = checkpoint(db)  # type: ignore[misc]
    assert (last_uid, last_error) == (2, None)
    assert checked_at is not None


@pytest.mark.usefixtures("poison_breaks_the_parser")
def test_a_message_that_cannot_be_handled_is_recorded_and_passed(
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: Any,
    *,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failed_operations row and the checkpoint past it, instead of a blocked account."""
    for subject in ("before", "poison", "after"):
        dovecot.append(mailbox, mails.plain(subject=subject))
    settings = make_settings(account())
    with capture_logs() as logs:
        [report] = check_due_accounts(settings, database_url, now=later(0))
    assert report.ok, report.error
    assert (report.fetched, report.enqueued, report.failed) == (3, 2, 1)
    assert [i["payload"]["subject"] for i in items(db)] == ["before", "after"]
    # No processed mark under its key for the failed one: a 'passed' row at its UID only.
    assert [p[1] for p in processed(db) if "/passed/" not in p[0]] == [1, 3]
    assert passed_uids(db) == [2]
    assert checkpoint(db)[1] == 3  # type: ignore[index]
    assert checkpoint(db)[3] is None  # type: ignore[index]

    [(op_type, label, error, context)] = db.execute(
        "SELECT op_type, label, error_message, context_data FROM failed_operations"
    ).fetchall()
    assert (op_type, label) == ("email_message", "home UID 2")
    validity = dovecot.uidvalidity(mailbox)
    assert error.startswith(f"email account 'home': UID 2 (UIDVALIDITY {validity})")
    assert error.endswith("RuntimeError: parser bug")
    assert (context["account"], context["mailbox"], context["uid"]) == ("home", mailbox, 2)
    assert "Subject: poison" in context["headers"]
    assert "noon" not in repr(context)  # the body is not kept
    [event] = [e for e in logs if e["event"] == "email_message_failed"]
    assert (event["account"], event["uid"], event["error"]) == ("home", 2, error)
    assert event["what_to_do"] == context["what_to_do"]
    # `failed retry` says what to do with a mail, not "not written by sokratos-worker".
    from sokratos_worker.store.failures import retry_failure

    [failure_id] = [r[0] for r in db.execute("SELECT id FROM failed_operations").fetchall()]
    refused = retry_failure(db, failure_id)
    assert refused.item_id is None and context["what_to_do"] in refused.message, refused.message

    # Once fixed, the statement the operator is given fetches it again; nothing else re-triaged.
    monkeypatch.undo()
    statement = re.search(r"UPDATE email_checkpoints [^;]*", context["what_to_do"])
    assert statement is not None
    db.execute(statement.group(0))
    [report] = check_due_accounts(settings, database_url, now=later(10))
    assert (report.fetched, report.enqueued, report.duplicates) == (2, 1, 1)
    assert [i["payload"]["subject"] for i in items(db)] == ["before", "after", "poison"]


def test_a_message_the_database_refuses_for_its_content_is_recorded_and_passed(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    refuse_triage(db, sqlstate="22P05", subject="poison")  # untranslatable character
    for subject in ("before", "poison", "after"):
        dovecot.append(mailbox, mails.plain(subject=subject))
    [report] = check_due_accounts(make_settings(account()), database_url, now=later(0))
    assert report.ok, report.error
    assert (report.fetched, report.enqueued, report.failed) == (3, 2, 1)
    assert [i["payload"]["subject"] for i in items(db)] == ["before", "after"]
    assert [p[1] for p in processed(db) if "/passed/" not in p[0]] == [1, 3]
    assert passed_uids(db) == [2]
    assert checkpoint(db)[1] == 3  # type: ignore[index]
    [(label, error)] = db.execute("SELECT label, error_message FROM failed_operations").fetchall()
    assert label == "home UID 2"
    assert "UntranslatableCharacter: refused by the test" in error


def test_a_refusal_every_message_would_meet_stops_the_check_at_the_first(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    refuse_triage(db, sqlstate="42501", subject=None)  # insufficient privilege
    for subject in ("one", "two"):
        dovecot.append(mailbox, mails.plain(subject=subject))
    [report] = check_due_accounts(make_settings(account()), database_url, now=later(0))
    assert not report.ok
    assert report.error is not None and "UID 1 " in report.error
    assert "InsufficientPrivilege" in report.error
    assert items(db) == [] and processed(db) == []
    assert db.execute("SELECT count(*) FROM failed_operations").fetchone() == (0,)
    state = checkpoint(db)
    assert state is not None and not state[1] and state[3] == report.error  # not passed


def test_latin1_headers_and_unparsable_date_in_payload(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    dovecot.append(mailbox, mails.latin1())
    dovecot.append(mailbox, mails.malformed_mime())
    check_due_accounts(make_settings(account()), database_url, now=later(0))
    latin, broken = (i["payload"] for i in items(db))
    assert latin["subject"] == "Grüße aus München"
    assert latin["from"] == "Jürgen <juergen@example.de>"
    assert latin["date"] == "2026-12-01T09:30:00+01:00"
    assert broken["date"] is None


def test_imaps_with_a_self_signed_certificate_trusted_through_ca_file(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    dovecot.append(mailbox, mails.plain(subject="over TLS"))
    imaps = account(security="tls", port=dovecot.imaps_port, ca_file=str(dovecot.ca_file))
    [report] = check_due_accounts(make_settings(imaps), database_url, now=later(0))
    assert report.ok, report.error
    assert [i["payload"]["subject"] for i in items(db)] == ["over TLS"]


def test_starttls_with_ca_file(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    dovecot.append(mailbox, mails.plain(subject="upgraded"))
    starttls = account(security="starttls", ca_file=str(dovecot.ca_file))
    [report] = check_due_accounts(make_settings(starttls), database_url, now=later(0))
    assert report.ok, report.error
    assert report.enqueued == 1


def test_untrusted_certificate_is_an_account_error(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    imaps = account(security="tls", port=dovecot.imaps_port)
    [report] = check_due_accounts(make_settings(imaps), database_url, now=later(0))
    assert report.error is not None
    assert "CERTIFICATE_VERIFY_FAILED" in report.error
    assert "set the account's ca_file" in report.error
    insecure = account(security="tls", port=dovecot.imaps_port, tls_verify=False)
    imap._UNVERIFIED.discard(insecure.name)  # (said once per process: maybe by another test)
    with capture_logs() as logs:
        [report] = check_due_accounts(make_settings(insecure), database_url, now=later(10))
        check_due_accounts(make_settings(insecure), database_url, now=later(400))
    assert report.ok, report.error
    # Said once, as for an LLM backend: it was silent while the password went to whoever
    # answered.
    said = [e for e in logs if e["event"] == "tls_verification_disabled"]
    assert [(e["account"], e["log_level"]) for e in said] == [(insecure.name, "warning")], said


def test_a_broken_account_does_not_stop_a_good_one(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    dovecot.append(mailbox, mails.plain(subject="still delivered"))
    secret = "wrong-password-do-not-log"
    bad = account(name="broken", password=secret)
    unreachable = account(name="gone", port=1, security="none")
    good = account(name="home")
    settings = make_settings(bad, unreachable, good)
    with capture_logs() as logs:
        reports = check_due_accounts(settings, database_url, now=later(0))
    assert [r.name for r in reports] == ["broken", "gone", "home"]
    assert not reports[0].ok
    assert not reports[1].ok
    assert reports[2].ok
    assert reports[2].enqueued == 1
    assert [i["payload"]["account"] for i in items(db)] == ["home"]
    broken_error = checkpoint(db, "broken")[3] or ""  # type: ignore[index]
    assert broken_error.startswith("login to ") and "AUTHENTICATIONFAILED" in broken_error
    assert "IMAP error:" in broken_error and "app password" in broken_error
    gone_error = checkpoint(db, "gone")[3] or ""  # type: ignore[index]
    assert (
        gone_error.startswith("connecting to 127.0.0.1:1 ") and "Connection refused" in gone_error
    )
    failures = [e for e in logs if e["event"] == "email_check_failed"]
    assert {e["account"] for e in failures} == {"broken", "gone"}
    assert all("no mail is lost" in e["hint"] for e in failures), failures
    assert secret not in repr(logs)
    assert secret not in repr(db.execute("SELECT * FROM email_checkpoints").fetchall())

    configured = [(name, mailbox) for name in ("broken", "gone", "home", "new")]
    statuses = {s["name"]: s for s in account_statuses(db, configured)}
    assert statuses["broken"]["last_error"]
    assert statuses["broken"]["last_check_at"] is None
    assert statuses["home"]["last_error"] is None
    assert statuses["home"]["last_check_at"] is not None
    assert statuses["new"] == {
        "name": "new",
        "mailbox": mailbox,
        "last_check_at": None,
        "last_error": None,
        "last_error_at": None,
    }

    # A failed account is retried at the next check, not at every tick; fixed, it recovers.
    assert check_due_accounts(settings, database_url, now=later(1))[0].skipped_reason
    fixed = make_settings(account(name="broken"), good)
    reports = check_due_accounts(fixed, database_url, now=later(10))
    assert reports[0].ok
    assert reports[0].enqueued == 1
    assert checkpoint(db, "broken")[3] is None  # type: ignore[index]


def test_initial_lookback_records_old_mail_as_seen(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    ten_years_ago = mails.plain(subject="ten years ago", message_id="<old@example.org>")
    no_id = mails.plain(subject="last week", message_id=None)
    dovecot.append(mailbox, ten_years_ago, when=NOW - timedelta(days=3650))
    dovecot.append(mailbox, no_id, when=NOW - timedelta(days=7))
    dovecot.append(mailbox, mails.plain(subject="this morning"), when=NOW - timedelta(hours=3))
    before = dovecot.flags(mailbox)
    settings = make_settings(account(), email_initial_lookback=86400)
    [report] = check_due_accounts(settings, database_url, now=NOW)
    assert (report.fetched, report.enqueued, report.seen_without_triage) == (3, 1, 2)
    assert [i["payload"]["subject"] for i in items(db)] == ["this morning"]
    rows = processed(db)
    assert [(uid, item is None) for _, uid, item in rows] == [(1, True), (2, True), (3, False)]
    # Old mail is recorded under the same keys a full fetch would give (headers suffice
    # when there is a Message-ID; the hash needs the body, which is then fetched).
    assert rows[0][0] == "home:<old@example.org>"
    assert rows[1][0] == message_key("home", parse_email(no_id))
    assert dovecot.flags(mailbox) == before
    # After the first check, any new arrival is triaged, whatever its date.
    dovecot.append(mailbox, mails.plain(subject="moved in"), when=NOW - timedelta(days=30))
    [report] = check_due_accounts(settings, database_url, now=later(10))
    assert (report.enqueued, report.seen_without_triage) == (1, 0)


def test_interval_zero_disables_checks(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    dovecot.append(mailbox, mails.plain())
    settings = make_settings(account(), email_check_interval=0)
    assert check_due_accounts(settings, database_url, now=later(0)) == []
    assert items(db) == []


def test_probe_accounts_one_line_each(
    dovecot: Dovecot, mailbox: str, account: AccountFactory
) -> None:
    dovecot.append(mailbox, mails.plain(), flags="\\Seen")
    before = dovecot.flags(mailbox)
    lines = probe_accounts(make_settings(account(), account(name="bad", password="nope")))
    assert [(line.component, line.ok) for line in lines] == [
        ("email account home", True),
        ("email account bad", False),
    ]
    assert "1 messages" in lines[0].detail
    assert "nope" not in lines[1].detail
    assert dovecot.flags(mailbox) == before


def test_prune_never_goes_beyond_the_checkpoint(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    for n in range(3):
        dovecot.append(mailbox, mails.plain(subject=f"m{n}"))
    check_due_accounts(make_settings(account()), database_url, now=later(0))
    db.execute("UPDATE processed_emails SET seen_at = now() - interval '100 days'")
    # Pretend the checkpoint only reached UID 2: the third key must survive.
    db.execute("UPDATE email_checkpoints SET last_uid = 2")
    db.execute(
        "INSERT INTO processed_emails (message_id, seen_at) VALUES"
        " ('sokratos-old', now() - interval '100 days'), ('sokratos-new', now())"
    )
    assert prune_processed_emails(db, 90) == 3
    remaining = {row[0] for row in db.execute("SELECT message_id FROM processed_emails")}
    assert "sokratos-new" in remaining
    assert [p[1] for p in processed(db) if p[1] is not None] == [3]
    assert prune_processed_emails(db, 0) == 0


def test_non_ascii_mailbox_name_and_password(
    dovecot: Dovecot, account: AccountFactory, database_url: str, db: Any
) -> None:
    name = f"Überweisungen {uuid.uuid4().hex[:6]}"
    dovecot.create_mailbox(f'"{encode_mailbox(name)}"')
    dovecot.append(f'"{encode_mailbox(name)}"', mails.plain(subject="Rechnung"))
    [report] = check_due_accounts(make_settings(account(mailbox=name)), database_url, now=NOW)
    assert report.ok, report.error
    assert [i["payload"]["mailbox"] for i in items(db)] == [name]
    utf8 = account(name="utf8", username=UTF8_USER, password=UTF8_PASSWORD, mailbox="INBOX")
    [line] = probe_accounts(make_settings(utf8))
    assert line.ok, line.detail


def test_one_account_is_never_checked_by_two_workers_at_once(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    dovecot.append(mailbox, mails.plain())
    db.execute("SELECT pg_advisory_lock(hashtext('sokratos-email'), hashtext('home'))")
    [report] = check_due_accounts(make_settings(account()), database_url, now=NOW)
    assert report.skipped_reason == "checked by another worker"
    assert items(db) == []
    db.execute("SELECT pg_advisory_unlock(hashtext('sokratos-email'), hashtext('home'))")
    [report] = check_due_accounts(make_settings(account()), database_url, now=NOW)
    assert report.enqueued == 1


def test_a_silent_server_times_out_as_an_account_error(
    account: AccountFactory, database_url: str, db: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sokratos_worker.email.check.IMAP_TIMEOUT_S", 0.5)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # accepts the connection, never sends a greeting
        port = silent.getsockname()[1]
        [report] = check_due_accounts(
            make_settings(account(name="silent", port=port)), database_url, now=NOW
        )
    assert report.error is not None
    assert "timed out" in report.error
    assert checkpoint(db, "silent")[3] == report.error  # type: ignore[index]


def test_the_least_privilege_worker_role_checks_mail_and_prunes(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """The statements a check really issues, as sokratos_worker (sql/roles.sql)."""
    db.execute((ROOT / "sql" / "roles.sql").read_text("utf-8"))
    info = psycopg.conninfo.conninfo_to_dict(database_url)
    info["options"] = "-c role=sokratos_worker"
    as_worker = psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})
    for n in range(2):
        dovecot.append(mailbox, mails.plain(subject=f"role {n}"))
    settings = make_settings(account())
    [report] = check_due_accounts(settings, as_worker, now=later(0))
    assert (report.fetched, report.enqueued, report.error) == (2, 2, None)
    dovecot.append(mailbox, mails.plain(subject="role 2"))
    [report] = check_due_accounts(settings, as_worker, now=later(10))
    assert (report.fetched, report.enqueued, report.error) == (1, 1, None)
    assert [i["payload"]["subject"] for i in items(db)] == ["role 0", "role 1", "role 2"]
    assert checkpoint(db)[1:4:2] == (3, None)  # type: ignore[index]
    with psycopg.connect(as_worker, autocommit=True) as conn:
        assert prune_processed_emails(conn, 0) == 0


def rebuild(dovecot: Dovecot, mailbox: str, raws: list[bytes], when: datetime | None) -> None:
    """The mailbox is recreated with the same mail (a server migration, a restore): new
    UIDVALIDITY, same messages."""
    old = dovecot.uidvalidity(mailbox)
    dovecot.delete_mailbox(mailbox)
    dovecot.create_mailbox(mailbox)
    for raw in raws:
        dovecot.append(mailbox, raw, when=when)
    assert dovecot.uidvalidity(mailbox) != old


def test_mail_seen_without_triage_is_never_pruned_so_a_uidvalidity_change_does_not_triage_it(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """contract §2 (older mail is recorded as seen, not triaged) and durability.md Email (a
    UIDVALIDITY change does not re-triage mail already seen), with the processed_emails TTL."""
    decade_ago = NOW - timedelta(days=3650)
    old = [mails.plain(subject=f"decade-old {n}") for n in range(2)]
    for raw in old:
        dovecot.append(mailbox, raw, when=decade_ago)
    settings = make_settings(account(), email_initial_lookback=86400)
    [report] = check_due_accounts(settings, database_url, now=NOW)
    assert (report.enqueued, report.seen_without_triage) == (0, 2)

    db.execute("UPDATE processed_emails SET seen_at = now() - interval '100 days'")
    assert prune_processed_emails(db, 90) == 0  # the only record that they were seen
    assert [p[2] for p in processed(db)] == [None, None]

    rebuild(dovecot, mailbox, old, decade_ago)
    [report] = check_due_accounts(settings, database_url, now=NOW + timedelta(days=100))
    assert report.uidvalidity_reset
    assert (report.enqueued, report.duplicates) == (0, 2)
    assert items(db) == []


def test_a_triaged_message_whose_processed_row_was_pruned_counts_as_a_duplicate(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """The idempotency key keeps a second item out; the report must not count one."""
    raw = mails.plain(subject="triaged long ago")
    dovecot.append(mailbox, raw)
    settings = make_settings(account())
    [report] = check_due_accounts(settings, database_url, now=NOW)
    assert report.enqueued == 1
    db.execute("UPDATE processed_emails SET seen_at = now() - interval '100 days'")
    assert prune_processed_emails(db, 90) == 1  # a triaged row may go
    rebuild(dovecot, mailbox, [raw], None)
    with capture_logs() as logs:
        [report] = check_due_accounts(settings, database_url, now=NOW + timedelta(days=100))
    assert len(items(db)) == 1
    assert (report.fetched, report.enqueued, report.duplicates) == (1, 0, 1)
    [finished] = [e for e in logs if e["event"] == "email_check_finished"]
    assert (finished["enqueued"], finished["duplicates"]) == (0, 1)


def test_old_mail_with_a_long_message_id_gets_the_key_a_full_fetch_gives(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """A key over KEY_LIMIT hashes the body, so old mail needs its body fetched too."""
    long_id = "<" + "x" * 250 + "@example.org>"
    raw = mails.plain(subject="old mail, long id", message_id=long_id)
    month_ago = NOW - timedelta(days=30)
    dovecot.append(mailbox, raw, when=month_ago)
    settings = make_settings(account(), email_initial_lookback=86400)
    [report] = check_due_accounts(settings, database_url, now=NOW)
    assert report.seen_without_triage == 1
    assert [p[0] for p in processed(db)] == [message_key("home", parse_email(raw))]

    rebuild(dovecot, mailbox, [raw], month_ago)
    [report] = check_due_accounts(settings, database_url, now=later(10))
    assert report.uidvalidity_reset
    assert (report.enqueued, report.duplicates) == (0, 1)
    assert items(db) == []


def test_mail_with_an_odd_charset_in_its_subject_is_triaged(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    dovecot.append(mailbox, mails.plain(subject="=?idna?q?hello?="))
    [report] = check_due_accounts(make_settings(account()), database_url, now=NOW)
    assert (report.enqueued, report.failed) == (1, 0)
    [item] = items(db)
    assert item["payload"]["subject"] == "hello"
    assert any("idna" in n for n in item["payload"]["notes"])


def test_status_shows_the_configured_mailbox_of_an_account(
    dovecot: Dovecot, account: AccountFactory, database_url: str, db: Any
) -> None:
    """After the account's mailbox is changed, status must show the configured mailbox's
    row (here failing), not the old mailbox's."""
    old = f"zz{uuid.uuid4().hex[:8]}"
    dovecot.create_mailbox(old)
    dovecot.append(old, mails.plain())
    [report] = check_due_accounts(make_settings(account(mailbox=old)), database_url, now=NOW)
    assert report.ok
    new = f"aa{uuid.uuid4().hex[:8]}"  # configured now, but does not exist on the server
    [report] = check_due_accounts(make_settings(account(mailbox=new)), database_url, now=later(10))
    assert not report.ok
    [status] = account_statuses(db, [("home", new)])
    assert (status["mailbox"], status["last_error"]) == (new, report.error)
    assert status["last_check_at"] is None


class _Logout:
    def __init__(self, client: Any) -> None:
        self.client = client

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.logout()


def test_a_message_expunged_during_the_check_is_skipped_and_logged(
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: Any,
    *,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another client deletes a message after the UID listing: ordinary IMAP life, not a
    failed check."""
    for subject in ("one", "two", "three"):
        dovecot.append(mailbox, mails.plain(subject=subject))
    listing = ImapSession.refs_from

    def list_then_another_client_expunges(self: ImapSession, last_uid: int) -> Any:
        refs = listing(self, last_uid)
        client = dovecot.client()
        with contextlib.closing(_Logout(client)):
            assert client.select(mailbox)[0] == "OK"
            client.uid("STORE", "2", "+FLAGS", "(\\Deleted)")
            client.expunge()
        return refs

    monkeypatch.setattr(ImapSession, "refs_from", list_then_another_client_expunges)
    with capture_logs() as logs:
        [report] = check_due_accounts(make_settings(account()), database_url, now=NOW)
    assert report.ok, report.error
    assert [i["payload"]["subject"] for i in items(db)] == ["one", "three"]
    [vanished] = [e for e in logs if e["event"] == "email_message_vanished"]
    assert (vanished["account"], vanished["uid"]) == ("home", 2)
    assert checkpoint(db)[1] == 3  # type: ignore[index]


def _make_unreadable(dovecot: Dovecot, mailbox: str, uid: int) -> None:
    """A damaged mail store: the message file of ``uid`` cannot be read by the server."""
    maildir = dovecot.root / "mail" / "alice" / "Maildir" / f".{mailbox}"
    uidlist = (maildir / "dovecot-uidlist").read_text().splitlines()[1:]
    [name] = [line.split(":", 1)[1] for line in uidlist if line.split()[0] == str(uid)]
    [path] = list(maildir.glob(f"*/{name.split(':')[0]}*"))
    os.chmod(path, 0)


def test_a_message_the_server_cannot_return_is_passed_after_three_checks(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """durability.md Bad input: bad input never stops other items. Mail before the bad one
    is recorded at once; the bad one stops each check until its third consecutive refusal,
    then goes to failed_operations and the checkpoint passes it."""
    for subject in ("one", "two", "three"):
        dovecot.append(mailbox, mails.plain(subject=subject))
    _make_unreadable(dovecot, mailbox, 2)
    settings = make_settings(account())
    for n in range(2):
        with capture_logs() as logs:
            [report] = check_due_accounts(settings, database_url, now=later(10 * n))
        assert not report.ok
        assert report.error is not None and "UID 2 " in report.error
        assert f"on {n + 1} consecutive check(s)" in report.error
        [refused] = [e for e in logs if e["event"] == "email_message_refused"]
        assert (refused["account"], refused["uid"], refused["refused_checks"]) == ("home", 2, n + 1)
        assert "failed_operations" in refused["what_to_do"]
        assert [i["payload"]["subject"] for i in items(db)] == ["one"]
        assert checkpoint(db)[1:4:2] == (1, report.error)  # type: ignore[index]

    with capture_logs() as logs:
        [report] = check_due_accounts(settings, database_url, now=later(20))
    assert report.ok, report.error
    assert (report.enqueued, report.failed) == (1, 1)
    assert [i["payload"]["subject"] for i in items(db)] == ["one", "three"]
    assert checkpoint(db)[1:4:2] == (3, None)  # type: ignore[index]
    [(op_type, label, error, context)] = db.execute(
        "SELECT op_type, label, error_message, context_data FROM failed_operations"
    ).fetchall()
    assert (op_type, label) == ("email_message", "home UID 2")
    assert "refused by the server on 3 consecutive checks" in error
    validity = dovecot.uidvalidity(mailbox)
    assert {k: context[k] for k in ("account", "mailbox", "uidvalidity", "uid")} == {
        "account": "home",
        "mailbox": mailbox,
        "uidvalidity": validity,
        "uid": 2,
    }
    assert context["size"] > 0 and context["internal_date"]
    assert "Internal error" in context["server_answer"]
    assert "UPDATE email_checkpoints SET last_uid = 1" in context["what_to_do"]
    [failed] = [e for e in logs if e["event"] == "email_message_failed"]
    assert (failed["account"], failed["uid"], failed["refused_checks"]) == ("home", 2, 3)
    assert db.execute("SELECT refused_uid, refused_checks FROM email_checkpoints").fetchone() == (
        None,
        0,
    )


def test_a_refusal_count_restarts_for_another_uid(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    for subject in ("one", "two", "three"):
        dovecot.append(mailbox, mails.plain(subject=subject))
    _make_unreadable(dovecot, mailbox, 2)
    settings = make_settings(account())
    check_due_accounts(settings, database_url, now=later(0))
    check_due_accounts(settings, database_url, now=later(10))
    assert db.execute("SELECT refused_uid, refused_checks FROM email_checkpoints").fetchone() == (
        2,
        2,
    )
    _make_unreadable(dovecot, mailbox, 3)
    db.execute("UPDATE email_checkpoints SET last_uid = 2")  # as if UID 2 had been read
    [report] = check_due_accounts(settings, database_url, now=later(20))
    assert report.error is not None and "UID 3 " in report.error
    assert db.execute("SELECT refused_uid, refused_checks FROM email_checkpoints").fetchone() == (
        3,
        1,
    )


def test_a_refusal_count_restarts_once_the_server_returns_the_message(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """Refused on two checks, returned on the third (but not recorded: the database refused
    it), refused on the fourth: one consecutive refusal, not three, so it is not passed."""
    for subject in ("one", "two", "three"):
        dovecot.append(mailbox, mails.plain(subject=subject))
    refusal = "SELECT refused_uid, refused_checks FROM email_checkpoints"
    with RefusingProxy(dovecot.imap_port, refused={2}) as proxy:
        settings = make_settings(account(port=proxy.port))
        for n in range(2):
            check_due_accounts(settings, database_url, now=later(10 * n))
        assert db.execute(refusal).fetchone() == (2, 2)

        proxy.refused.clear()
        refuse_triage(db, sqlstate="42501", subject="two")  # stops the check, passes nothing
        [report] = check_due_accounts(settings, database_url, now=later(20))
        assert report.error is not None and "UID 2 " in report.error
        assert "InsufficientPrivilege" in report.error
        assert db.execute(refusal).fetchone() == (None, 0)

        db.execute("DROP TRIGGER refuse_item ON pending_triage")
        proxy.refused.add(2)
        [report] = check_due_accounts(settings, database_url, now=later(30))
    assert report.error is not None and "on 1 consecutive check(s)" in report.error
    assert db.execute(refusal).fetchone() == (2, 1)
    assert db.execute("SELECT count(*) FROM failed_operations").fetchone() == (0,)
    assert [i["payload"]["subject"] for i in items(db)] == ["one"]
    assert checkpoint(db)[1] == 1  # type: ignore[index]


def test_a_temporary_no_is_the_servers_state_and_never_passes_a_message(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """NO [UNAVAILABLE] (RFC 5530: try again later) on every FETCH for longer than three
    checks: each check fails as the server's problem, no UID is counted as refused, and once
    the server serves again every message is triaged, none of them passed into failed_operations."""
    for subject in ("one", "two"):
        dovecot.append(mailbox, mails.plain(subject=subject))
    with RefusingProxy(dovecot.imap_port, refused={1, 2}, answer=b"[UNAVAILABLE] busy") as proxy:
        settings = make_settings(account(port=proxy.port))
        for n in range(4):
            [report] = check_due_accounts(settings, database_url, now=later(10 * n))
            assert report.error is not None and "failed for now" in report.error, report
    refused = db.execute("SELECT refused_uid, refused_checks FROM email_checkpoints").fetchone()
    assert refused == (None, 0)
    [report] = check_due_accounts(make_settings(account()), database_url, now=later(50))
    assert report.ok, report.error
    assert [i["payload"]["subject"] for i in items(db)] == ["one", "two"]
    assert db.execute("SELECT count(*) FROM failed_operations").fetchone() == (0,)


@pytest.mark.parametrize(
    "answer",
    [b"[UNAVAILABLE] Server shutting down, try again later", b"Server shutting down."],
    ids=["unavailable-code", "dovecot-shutdown"],
)
def test_a_bye_for_the_servers_state_never_passes_a_message(
    *,
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: Any,
    answer: bytes,
) -> None:
    """`* BYE [UNAVAILABLE] ...` (RFC 5530) or Dovecot's `* BYE Server shutting down.` while
    a message is fetched, on more than three checks: each check fails as the server's problem
    (as for NO [UNAVAILABLE]), the message's refusal count does not rise, and once the server
    serves again the mail is triaged, not passed into failed_operations."""
    dovecot.append(mailbox, mails.plain(subject="the only mail"))
    with ByeProxy(dovecot.imap_port, refused={1}, answer=answer) as proxy:
        settings = make_settings(account(port=proxy.port))
        for n in range(4):
            [report] = check_due_accounts(settings, database_url, now=later(10 * n))
            assert report.error is not None and "failed for now" in report.error, report
    refused = db.execute("SELECT refused_uid, refused_checks FROM email_checkpoints").fetchone()
    assert refused == (None, 0)
    # The server serves again.
    [report] = check_due_accounts(make_settings(account()), database_url, now=later(60))
    assert report.ok, report.error
    subjects = [
        row[0]
        for row in db.execute("SELECT payload->>'subject' FROM pending_triage ORDER BY id")
    ]
    failed = db.execute("SELECT context_data->>'server_answer' FROM failed_operations").fetchall()
    assert subjects == ["the only mail"], (
        f"the mail was not triaged once the server served it again; failed_operations: {failed}"
    )
    assert failed == []


@pytest.mark.parametrize(
    ("proxy_class", "answer"),
    [(RefusingProxy, b"[UNAVAILABLE] busy"), (ByeProxy, b"Server shutting down.")],
    ids=["no-unavailable", "bye-shutting-down"],
)
def test_a_server_state_answer_for_one_message_only_is_that_messages_refusal(
    *,
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: Any,
    proxy_class: type[RefusingProxy],
    answer: bytes,
) -> None:
    """A server that answers one message with its state (`NO [UNAVAILABLE]`, `BYE ...
    shutting down`) on every check while it returns the others (after a reconnect for a BYE):
    the answer is that message's, counted like a refusal and passed on the third check; it
    stopped every check of the account for good before."""
    for subject in ("one", "two", "three"):
        dovecot.append(mailbox, mails.plain(subject=subject))
    refusal = "SELECT refused_uid, refused_checks FROM email_checkpoints"
    with proxy_class(dovecot.imap_port, refused={2}, answer=answer) as proxy:
        settings = make_settings(account(port=proxy.port))
        for n in range(2):
            with capture_logs() as logs:
                [report] = check_due_accounts(settings, database_url, now=later(10 * n))
            assert report.error is not None and "UID 2 " in report.error, report
            assert db.execute(refusal).fetchone() == (2, n + 1)
            [refused] = [e for e in logs if e["event"] == "email_message_refused"]
            # The first check returned UID 1 before it; the second starts past it, at UID 2,
            # and asks again for UID 1, the message at its checkpoint (returned before).
            assert "(while it returned UID 1)" in refused["answer"], refused
        [report] = check_due_accounts(settings, database_url, now=later(20))
    assert report.ok, report.error
    assert [i["payload"]["subject"] for i in items(db)] == ["one", "three"]
    [context] = db.execute("SELECT context_data FROM failed_operations").fetchone()
    assert (context["uid"], context["refused_checks"]) == (2, 3)
    assert answer.decode() in context["server_answer"]
    assert "while it returned UID" in context["server_answer"]


def test_a_bye_for_one_message_is_counted_as_its_refusal(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """Any other BYE on a message's FETCH (Dovecot's "Internal error" on a damaged message
    file) is that message's refusal: counted per check, and passed on the third."""
    for subject in ("one", "two"):
        dovecot.append(mailbox, mails.plain(subject=subject))
    answer = b"Internal error occurred. Refer to server log for more information."
    with ByeProxy(dovecot.imap_port, refused={2}, answer=answer) as proxy:
        settings = make_settings(account(port=proxy.port))
        for n in range(2):
            [report] = check_due_accounts(settings, database_url, now=later(10 * n))
            assert report.error is not None and "UID 2 " in report.error, report
            assert "failed for now" not in report.error
            refusal = "SELECT refused_uid, refused_checks FROM email_checkpoints"
            assert db.execute(refusal).fetchone() == (2, n + 1)
        [report] = check_due_accounts(settings, database_url, now=later(20))
    assert report.ok, report.error
    assert [i["payload"]["subject"] for i in items(db)] == ["one"]
    [context] = db.execute("SELECT context_data FROM failed_operations").fetchone()
    assert (context["uid"], context["refused_checks"]) == (2, 3)
    assert context["server_answer"].startswith("BYE Internal error")


def test_a_batch_refused_with_no_is_fetched_one_by_one_and_the_refused_message_passed(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """A server that answers NO for a message it cannot return: the mail before and after it
    in the batch is not held back by it for more than three checks."""
    for subject in ("one", "two", "three"):
        dovecot.append(mailbox, mails.plain(subject=subject))
    with RefusingProxy(dovecot.imap_port, refused={2}) as proxy:
        settings = make_settings(account(port=proxy.port))
        with capture_logs() as logs:
            [report] = check_due_accounts(settings, database_url, now=later(0))
        assert report.error is not None and "UID 2 " in report.error
        assert "NO [SERVERBUG]" in report.error
        assert [e["event"] for e in logs if "refused" in e["event"]] == [
            "email_batch_refused",
            "email_message_refused",
        ]
        assert [i["payload"]["subject"] for i in items(db)] == ["one"]
        for n in (1, 2):
            [report] = check_due_accounts(settings, database_url, now=later(10 * n))
    assert report.ok, report.error
    assert [i["payload"]["subject"] for i in items(db)] == ["one", "three"]
    [context] = db.execute("SELECT context_data FROM failed_operations").fetchone()
    assert (context["uid"], context["refused_checks"]) == (2, 3)
    assert context["server_answer"].startswith("NO [SERVERBUG]")
