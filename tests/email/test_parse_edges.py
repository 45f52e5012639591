"""Parsing and IMAP-answer behaviour that a mutation review found no test pinning: each test
kills a hand-made mutant that every other email test let through (a limit changed, a
comparison flipped, a condition dropped, a header name matched case-sensitively).

Real parts: pure parsing is tested on the bytes of hand-built messages; what reaches the
database (the processed_emails key, the triage payload) goes through a real Dovecot on
127.0.0.1 and a real PostgreSQL.
"""

from __future__ import annotations

import base64
import imaplib
import os
import re
import socket
import ssl
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import mails
import pytest
from dovecot import AccountFactory, Dovecot, make_settings
from dovecot import _make_certificate as make_certificate

from sokratos_worker.email import check_due_accounts
from sokratos_worker.email.failed import record_failed_message
from sokratos_worker.email.imap_answers import (
    BATCH_BYTES,
    FetchedMessage,
    MessageRef,
    plan_batches,
)
from sokratos_worker.email.imap_hints import describe
from sokratos_worker.email.imap_sessions import SessionWatch
from sokratos_worker.email.parse import (
    HTML_LIMIT_CHARS,
    KEY_LIMIT,
    UNENCODABLE_NOTE,
    format_email_summary,
    keyed_by_hash,
    message_key,
    parse_email,
)
from tests.support.db import refuse_triage
from tests.support.faketime import libfaketime


def _body_of(summary: str) -> str:
    """What follows the summary's header lines and blank line."""
    return summary.split("\n\n", 1)[1]


def test_the_summary_body_is_cut_at_exactly_2000_bytes() -> None:
    """Sokratos's FormatEmailSummary truncates the body to 2000 bytes (behaviour §4.3): a body
    of exactly 2000 bytes is kept whole, one byte more is cut there with "..."."""
    whole = parse_email(mails.plain(body="a" * 2000))
    assert _body_of(format_email_summary(whole)) == "a" * 2000
    longer = parse_email(mails.plain(body="a" * 2001))
    assert _body_of(format_email_summary(longer)) == "a" * 2000 + "..."


def test_the_attachment_list_in_the_summary_is_cut_at_500_bytes() -> None:
    """A mail with many attachments adds at most 500 bytes (plus "...") of attachment list to
    the triage text, so the list cannot crowd out the body in the model's input."""
    parts = "".join(
        f"--B\r\nContent-Type: application/pdf\r\n"
        f'Content-Disposition: attachment; filename="scan-{n:02d}-of-the-quarterly-report.pdf"'
        "\r\nContent-Transfer-Encoding: base64\r\n\r\nQUJD\r\n"
        for n in range(40)
    )
    raw = (
        "From: a@example.org\r\nTo: b@example.org\r\nSubject: scans\r\nMIME-Version: 1.0\r\n"
        "Content-Type: multipart/mixed; boundary=B\r\n\r\n"
        "--B\r\nContent-Type: text/plain\r\n\r\nThe scans.\r\n" + parts + "--B--\r\n"
    ).encode()
    parsed = parse_email(raw)
    assert len(parsed.attachments) == 40
    listed = format_email_summary(parsed).rsplit("\n\n", 1)[1]
    assert listed.startswith("[attachments: scan-00-of-the-quarterly-report.pdf (3 bytes), ")
    assert listed.endswith("...") and len(listed.encode()) == 500 + len("...")


def test_upper_case_block_tags_of_an_html_only_mail_break_its_lines() -> None:
    """Older mailers write <P> and <BR>: they end lines as <p> and <br> do, so the text made
    from the HTML does not run its paragraphs together."""
    raw = (
        b"From: a@example.org\r\nSubject: html\r\nMIME-Version: 1.0\r\n"
        b"Content-Type: text/html; charset=utf-8\r\n\r\n"
        b"<HTML><BODY><P>Dear Alice,</P><P>the invoice is attached.<BR>Regards</P></BODY></HTML>"
    )
    assert parse_email(raw).body == "Dear Alice,\n\nthe invoice is attached.\nRegards"


def test_a_date_without_zone_information_is_not_taken_as_an_instant() -> None:
    """RFC 5322's "-0000" says the zone is unknown: the date is left out (NULL, an empty Date
    line) with a note, rather than passed on as a time without a zone."""
    parsed = parse_email(mails.plain(date="Tue, 01 Dec 2026 09:30:00 -0000"))
    assert parsed.date is None
    assert parsed.date_raw == "Tue, 01 Dec 2026 09:30:00 -0000"
    assert "unparsable Date header" in parsed.notes
    assert "\nDate: \n" in format_email_summary(parsed)


def test_a_text_file_attached_by_its_name_alone_is_listed_not_taken_for_the_body() -> None:
    """A text/plain part with a file name (here only Content-Type's name=, no
    Content-Disposition) is an attachment: listed with its size, never the mail's body."""
    raw = (
        b"From: a@example.org\r\nSubject: log\r\nMIME-Version: 1.0\r\n"
        b"Content-Type: multipart/mixed; boundary=B\r\n\r\n"
        b'--B\r\nContent-Type: text/plain; charset=utf-8; name="server.log"\r\n\r\n'
        b"ERROR disk full\r\n"
        b"--B\r\nContent-Type: text/plain; charset=utf-8\r\n\r\nThe log from last night.\r\n"
        b"--B--\r\n"
    )
    parsed = parse_email(raw)
    assert parsed.body == "The log from last night."
    assert [(a.name, a.size) for a in parsed.attachments] == [("server.log", 15)]


def _carrying(subject: str, *inner: bytes) -> bytes:
    """A mail with no text of its own whose parts are the messages ``inner``, attached."""
    boundary = subject.replace(" ", "-").encode()
    parts = b"".join(
        b"--" + boundary + b"\r\nContent-Type: message/rfc822\r\n\r\n" + m + b"\r\n" for m in inner
    )
    return (
        b"From: a@example.org\r\nSubject: " + subject.encode() + b"\r\nMIME-Version: 1.0\r\n"
        b'Content-Type: multipart/mixed; boundary="' + boundary + b'"\r\n\r\n'
        + parts + b"--" + boundary + b"--\r\n"
    )  # fmt: skip


def test_a_mail_of_two_forwarded_messages_shows_the_first() -> None:
    """A mail that is only attached messages is triaged with the first one's text (both are
    listed), not with the last one's."""
    first = b"Subject: Contract\r\n\r\nPlease sign by Friday.\r\n"
    second = b"Subject: Newsletter\r\n\r\nOur summer sale.\r\n"
    parsed = parse_email(_carrying("Fwd: two", first, second))
    assert parsed.body == "[forwarded message: Contract]\nPlease sign by Friday."
    assert [a.name for a in parsed.attachments] == ["Contract", "Newsletter"]


def _forwarded(depth: int) -> bytes:
    """A mail that is a forward of a forward ... ``depth`` messages deep around one text."""
    raw = b"Subject: level 0\r\n\r\nThe original text.\r\n"
    for level in range(1, depth + 1):
        raw = _carrying(f"level {level}", raw)
    return raw


def test_a_forward_of_a_forward_is_followed_four_messages_deep_and_no_further() -> None:
    """A mail that only forwards a forwarded message shows the text found up to four attached
    messages deep (each named on a line); deeper nesting is not followed."""
    parsed = parse_email(_forwarded(4))
    labels = "".join(f"[forwarded message: level {n}]\n" for n in (3, 2, 1, 0))
    assert parsed.body == labels + "The original text."
    assert parse_email(_forwarded(5)).body == ""


def test_a_mail_without_a_date_header_gets_no_unparsable_date_note() -> None:
    """A missing Date is not an unparsable one: no note is recorded for it."""
    raw = b"From: a@example.org\r\nTo: b@example.org\r\nSubject: no date\r\n\r\nhello\r\n"
    parsed = parse_email(raw)
    assert (parsed.date, parsed.date_raw, parsed.notes) == (None, "", ())


def test_the_summary_of_a_mail_without_cc_has_no_cc_line() -> None:
    """Behaviour §4.3: the CC line is written only when the mail has a Cc."""
    parsed = parse_email(mails.plain(date="Tue, 01 Dec 2026 09:30:00 +0000"))
    local = datetime(2026, 12, 1, 9, 30, tzinfo=UTC).astimezone().strftime("%Y-%m-%d %H:%M")
    assert format_email_summary(parsed) == (
        "From: Bob Example <bob@example.org>\nTo: alice@example.org\n"
        f"Subject: Lunch on Friday?\nDate: {local}\n\n"
        "Shall we meet at noon at the usual place?"
    )


def test_a_problem_found_in_several_headers_is_noted_once() -> None:
    """Notes are said once each, however many headers have the same problem."""
    raw = (
        b"From: J\xfcrgen <j@example.org>\r\nTo: Ren\xe9e <r@example.org>\r\n"
        b"Subject: Gr\xfc\xdfe\r\n\r\nHallo\r\n"
    )
    notes = parse_email(raw).notes
    assert notes == ("8-bit header that is not UTF-8: decoded with replacement characters",)


def test_an_html_part_of_exactly_the_limit_is_not_said_to_be_cut() -> None:
    """The "HTML part cut" note is for a part longer than HTML_LIMIT_CHARS, not one of
    exactly that length (nothing of it was left out)."""

    def notes(length: int) -> tuple[str, ...]:
        markup = "<p>" + "x" * (length - len("<p></p>")) + "</p>"
        assert len(markup) == length
        return parse_email(
            b"From: a@example.org\r\nMIME-Version: 1.0\r\n"
            b"Content-Type: text/html; charset=utf-8\r\n\r\n" + markup.encode()
        ).notes

    assert not any("HTML part cut" in n for n in notes(HTML_LIMIT_CHARS))
    assert any("HTML part cut" in n for n in notes(HTML_LIMIT_CHARS + 1))


def test_an_encoded_word_with_a_language_suffix_is_decoded_in_its_charset() -> None:
    """RFC 2231 §5 lets an encoded word name a language after its charset ("iso-8859-1*de"):
    the charset before the "*" decodes it."""
    parsed = parse_email(
        b"From: a@example.org\r\nSubject: =?ISO-8859-1*de?Q?Gr=FC=DFe_aus_M=FCnchen?=\r\n\r\nx\r\n"
    )
    assert (parsed.subject, parsed.notes) == ("Grüße aus München", ())


def test_headers_folded_with_bare_line_feeds_are_unfolded() -> None:
    """A message stored with bare LF line ends folds its long headers with LF: they are unfolded
    too, so no header line of the triage text is split and no line begins with a space."""
    raw = (
        b"From: a@example.org\nTo: bob@example.org,\n carol@example.org\n"
        b"Subject: The quarterly\n\treport\nDate: Tue, 01 Dec 2026 09:30:00 +0000\n\nhello\n"
    )
    parsed = parse_email(raw)
    assert (parsed.to, parsed.subject) == (
        "bob@example.org, carol@example.org",
        "The quarterly report",
    )
    assert "\n " not in format_email_summary(parsed) and "\n\t" not in format_email_summary(parsed)


def test_keyed_by_hash_agrees_with_the_key_at_the_key_limit() -> None:
    """keyed_by_hash (which decides whether a header fetch is enough for the key) says "hash"
    exactly when message_key hashes: a key of KEY_LIMIT characters is kept, one more hashed."""

    def parsed(length: int) -> Any:
        message_id = "<" + "a" * (length - len("home:") - len("<@x>")) + "@x>"
        return parse_email(mails.plain(message_id=message_id))

    fits, too_long = parsed(KEY_LIMIT), parsed(KEY_LIMIT + 1)
    assert not keyed_by_hash("home", fits)
    assert not message_key("home", fits).startswith("home:sha256:")
    assert keyed_by_hash("home", too_long)
    assert message_key("home", too_long).startswith("home:sha256:")


def test_a_batch_holds_messages_of_exactly_batch_bytes_together() -> None:
    """A UID FETCH batch is bounded by BATCH_BYTES: messages that fill it exactly share one
    batch; the next message starts another."""
    half = BATCH_BYTES // 2
    refs = [MessageRef(uid=1, size=half), MessageRef(uid=2, size=BATCH_BYTES - half)]
    refs.append(MessageRef(uid=3, size=1))
    assert list(plan_batches(refs)) == [[1, 2], [3]]


@pytest.mark.imap
@pytest.mark.postgres
def test_header_names_are_matched_whatever_their_case(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """Postfix writes "Message-Id", some scripts "subject" and "from": the mail is keyed by its
    Message-ID and its payload has its sender and subject, as for canonical header names."""
    raw = (
        b"from: Cron Daemon <root@example.org>\r\nTO: alice@example.org\r\n"
        b"subject: Backup finished\r\nDATE: Tue, 01 Dec 2026 09:30:00 +0000\r\n"
        b"Message-Id: <20261201093000.1@mail.example.org>\r\n\r\nAll 42 volumes backed up.\r\n"
    )
    dovecot.append(mailbox, raw)
    [report] = check_due_accounts(make_settings(account()), database_url, now=datetime.now(UTC))
    assert report.ok and report.enqueued == 1, report
    [(payload,)] = db.execute("SELECT payload FROM pending_triage").fetchall()
    assert payload["message_id"] == "<20261201093000.1@mail.example.org>"
    assert (payload["from"], payload["to"], payload["subject"]) == (
        "Cron Daemon <root@example.org>",
        "alice@example.org",
        "Backup finished",
    )
    assert payload["date"] == "2026-12-01T09:30:00+00:00"
    [(key,)] = db.execute("SELECT message_id FROM processed_emails").fetchall()
    assert key == "home:<20261201093000.1@mail.example.org>"


NOW = datetime.now(UTC).replace(microsecond=0)


def _error(database_url: str, acct: Any) -> str:
    """The error of one check of ``acct``, which must fail."""
    [report] = check_due_accounts(make_settings(acct), database_url, now=NOW)
    assert report.error is not None, report
    return report.error


@pytest.mark.imap
@pytest.mark.postgres
def test_a_mailbox_name_with_ampersand_tilde_quotes_and_cyrillic_is_found(
    dovecot: Dovecot, account: AccountFactory, database_url: str, db: Any
) -> None:
    """Mailbox names go to the server in modified UTF-7 (RFC 3501 §5.1.3), written here by hand:
    "&" as "&-", printable ASCII such as "~" as itself, "/" in the base64 as ",", and a quoted
    string's quotes escaped."""
    suffix = uuid.uuid4().hex[:6]
    name = f'R&D ~ "Папка" {suffix}'
    on_the_wire = f'"R&-D ~ \\"&BB8EMAQ,BDoEMA-\\" {suffix}"'  # a quoted string
    dovecot.create_mailbox(on_the_wire)
    dovecot.append(on_the_wire, mails.plain(subject="Quartalszahlen"))
    [report] = check_due_accounts(make_settings(account(mailbox=name)), database_url, now=NOW)
    assert report.ok and report.enqueued == 1, report
    [(mailbox, subject)] = db.execute(
        "SELECT payload->>'mailbox', payload->>'subject' FROM pending_triage"
    ).fetchall()
    assert (mailbox, subject) == (name, "Quartalszahlen")


def _tls_server_context(directory: Path, *, expired: bool = False) -> tuple[ssl.SSLContext, Path]:
    """A TLS server context for localhost and 127.0.0.1, and its certificate (made three days
    ago for one day under libfaketime when ``expired``)."""
    if not expired:
        cert, key = make_certificate(directory)
    else:
        cert, key = directory / "cert.pem", directory / "key.pem"
        subprocess.run(
            [
                "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes",
                "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
            ],
            env={**os.environ, "LD_PRELOAD": libfaketime(), "FAKETIME": "-3d"},
            check=True,
            capture_output=True,
        )  # fmt: skip
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return context, cert


@pytest.fixture
def tls_server() -> Iterator[Callable[[ssl.SSLContext], int]]:
    """Serves TLS on 127.0.0.1 with a given context (handshakes only); returns the port."""
    servers: list[socket.socket] = []

    def start(context: ssl.SSLContext) -> int:
        server = socket.create_server(("127.0.0.1", 0))
        servers.append(server)

        def handshake(conn: socket.socket) -> None:
            try:
                with context.wrap_socket(conn, server_side=True) as tls:
                    tls.recv(1)  # until the client goes
            except OSError:
                conn.close()

        def serve() -> None:
            while True:
                try:
                    conn, _ = server.accept()
                except OSError:
                    return
                threading.Thread(target=handshake, args=(conn,), daemon=True).start()

        threading.Thread(target=serve, daemon=True).start()
        return int(server.getsockname()[1])

    yield start
    for server in servers:
        server.close()


@pytest.mark.postgres
def test_an_expired_server_certificate_says_to_have_it_renewed(
    tmp_path: Path,
    account: AccountFactory,
    database_url: str,
    tls_server: Callable[[ssl.SSLContext], int],
) -> None:
    """A certificate refused because it expired gets its own hint (renew it), not the one for
    an unknown issuer (set ca_file), which would send the operator the wrong way."""
    context, cert = _tls_server_context(tmp_path, expired=True)
    port = tls_server(context)
    error = _error(database_url, account(port=port, security="tls", ca_file=str(cert)))
    assert "certificate has expired" in error, error
    assert "(the server's certificate has expired: ask the server's operator to renew it)" in error
    assert "ca_file" not in error


@pytest.mark.postgres
def test_a_server_that_refuses_the_tls_probe_with_an_alert_is_said_to_expect_tls(
    tmp_path: Path,
    account: AccountFactory,
    database_url: str,
    tls_server: Callable[[ssl.SSLContext], int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A silent implicit-TLS port that refuses the probe's handshake with an alert (here: it
    wants a server name, which the probe does not send) still speaks TLS: the error says to
    set security "tls"."""
    monkeypatch.setattr("sokratos_worker.email.check.IMAP_TIMEOUT_S", 2.0)
    context, _ = _tls_server_context(tmp_path)

    def refuse_without_a_name(sock: Any, name: str | None, ctx: Any) -> int | None:
        return ssl.ALERT_DESCRIPTION_HANDSHAKE_FAILURE if name is None else None

    context.sni_callback = refuse_without_a_name
    error = _error(database_url, account(port=tls_server(context), security="none"))
    assert "no IMAP greeting within 2 s" in error, error
    assert "expects TLS at once (implicit TLS, usually port 993)" in error, error


@pytest.mark.imap
@pytest.mark.postgres
def test_a_refused_login_is_shown_as_the_servers_text_not_a_bytes_repr(
    dovecot: Dovecot, account: AccountFactory, database_url: str
) -> None:
    """imaplib raises a refused LOGIN with the server's bytes: the error shows its text
    ("IMAP error: [AUTHENTICATIONFAILED] ..."), not Python's b'...' form of it."""
    error = _error(database_url, account(password="not the password"))
    assert "IMAP error: [AUTHENTICATIONFAILED] " in error, error
    assert "b'" not in error and 'b"' not in error
    assert "app password" in error


class _FakeImap:
    """An IMAP server on 127.0.0.1 that greets, answers CAPABILITY and LOGOUT, and answers
    STARTTLS with OK and then plain text (TLS never starts); any other command is refused with
    ``refusal``."""

    def __init__(self, refusal: bytes) -> None:
        self.refusal = refusal
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._session, args=(conn,), daemon=True).start()

    def _session(self, conn: socket.socket) -> None:
        capabilities = b"IMAP4rev1 STARTTLS AUTH=PLAIN"
        with conn, conn.makefile("rb") as lines:
            conn.sendall(b"* OK [CAPABILITY " + capabilities + b"] ready\r\n")
            for raw in lines:
                tag, _, rest = raw.rstrip(b"\r\n").partition(b" ")
                command = rest.split(b" ", 1)[0].upper()
                if command == b"CAPABILITY":
                    conn.sendall(b"* CAPABILITY " + capabilities + b"\r\n" + tag + b" OK done\r\n")
                elif command == b"STARTTLS":
                    conn.sendall(tag + b" OK begin TLS\r\n")
                    conn.recv(65536)  # the ClientHello, answered in plain text
                    conn.sendall(b"* BAD this port speaks no TLS after all\r\n")
                    return
                elif command == b"LOGOUT":
                    conn.sendall(b"* BYE\r\n" + tag + b" OK bye\r\n")
                    return
                else:
                    conn.sendall(tag + b" " + self.refusal + b"\r\n")

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def fake_imap() -> Iterator[Callable[[bytes], _FakeImap]]:
    servers: list[_FakeImap] = []

    def start(refusal: bytes) -> _FakeImap:
        servers.append(_FakeImap(refusal))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


@pytest.mark.postgres
def test_a_refused_login_whose_code_is_in_lower_case_still_gets_the_password_hint(
    account: AccountFactory, database_url: str, fake_imap: Callable[[bytes], _FakeImap]
) -> None:
    """IMAP response codes are case-insensitive atoms: "[authenticationfailed]" is the same
    refusal as "[AUTHENTICATIONFAILED]" and gets the same hint."""
    server = fake_imap(b"NO [authenticationfailed] invalid credentials")
    error = _error(database_url, account(port=server.port, security="none"))
    assert "[authenticationfailed] invalid credentials" in error, error
    assert "(check username and password; Gmail, Fastmail and iCloud need an app password)" in error


@pytest.mark.postgres
def test_plain_text_after_starttls_does_not_say_to_set_starttls(
    account: AccountFactory, database_url: str, fake_imap: Callable[[bytes], _FakeImap]
) -> None:
    """The hint "the port speaks plain IMAP: set security starttls" is for an implicit-TLS
    account; an account that already uses STARTTLS, whose server answered it with plain text,
    is not told to set what it has."""
    server = fake_imap(b"NO not here")
    error = _error(database_url, account(port=server.port, security="starttls"))
    assert "SSLError" in error, error
    assert 'set security "starttls"' not in error, error


def _make_unreadable(dovecot: Dovecot, mailbox: str, uid: int) -> None:
    """A damaged mail store: the message file of ``uid`` cannot be read by the server."""
    maildir = dovecot.root / "mail" / "alice" / "Maildir" / f".{mailbox}"
    uidlist = (maildir / "dovecot-uidlist").read_text().splitlines()[1:]
    [name] = [line.split(":", 1)[1] for line in uidlist if line.split()[0] == str(uid)]
    [path] = list(maildir.glob(f"*/{name.split(':')[0]}*"))
    os.chmod(path, 0)


@pytest.mark.imap
@pytest.mark.postgres
def test_passing_a_refused_message_ends_its_refusal_count_even_when_the_check_then_fails(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """The refusal count of a message passed after three refusals ends in the pass's own
    transaction: a check that fails right after it (here the next message cannot be
    recorded) leaves no count behind, so a later refusal of that UID (fetched again as
    what_to_do says) starts again at 1 rather than passing it at once."""
    for subject in ("one", "two", "three"):
        dovecot.append(mailbox, mails.plain(subject=subject))
    _make_unreadable(dovecot, mailbox, 2)
    refuse_triage(db, subject="three", sqlstate="42501")  # not the item's fault: the check stops
    settings = make_settings(account())
    for n in range(3):
        [report] = check_due_accounts(settings, database_url, now=NOW + timedelta(minutes=10 * n))
        assert not report.ok, report
    assert report.error is not None and "UID 3 " in report.error, report.error
    assert db.execute("SELECT label FROM failed_operations").fetchall() == [("home UID 2",)]
    row = db.execute(
        "SELECT last_uid, refused_uid, refused_checks FROM email_checkpoints"
    ).fetchone()
    assert row == (2, None, 0)


@pytest.mark.imap
@pytest.mark.postgres
def test_a_finished_check_leaves_no_deadline_timer_running(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str
) -> None:
    """Each IMAP session's deadline timer is stopped when the session ends: a worker checking
    many accounts does not keep a sleeping thread per session until its deadline."""
    dovecot.append(mailbox, mails.plain())
    before = set(threading.enumerate())
    [report] = check_due_accounts(make_settings(account()), database_url, now=NOW)
    assert report.ok, report.error
    deadline = time.monotonic() + 2
    while True:
        timers = [
            t
            for t in threading.enumerate()
            if t not in before
            and isinstance(t, threading.Timer)
            and isinstance(getattr(t.function, "__self__", None), SessionWatch)
        ]
        if not timers or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert timers == []


def test_a_character_that_cannot_be_stored_is_escaped_and_noted() -> None:
    """A header decoded to a lone surrogate (a UTF-7 encoded word) is made storable, escaped
    as ``\\ud800``, and the note says so. (The mutation review found the note saying
    "replaced by U+FFFD", which the text was not since the escaping came in, 4a7807b.)"""
    parsed = parse_email(b"From: a@example.org\r\nSubject: =?utf-7?q?+2AA-?=\r\n\r\nx\r\n")
    parsed.subject.encode("utf-8")  # storable
    assert "\\ud800" in parsed.subject and "\ufffd" not in parsed.subject, parsed.subject
    assert UNENCODABLE_NOTE in parsed.notes, parsed.notes


def test_a_base64_attached_message_gets_no_malformed_mime_note() -> None:
    """The email package reads a base64 message/rfc822 part's encoded text as a message without
    headers: that is no defect of the mail, and no "malformed MIME" note is given for it."""
    inner = b"From: carol@example.org\r\nSubject: Numbers\r\n\r\nThe original text.\r\n"
    raw = (
        b"From: a@example.org\r\nSubject: fwd\r\nMIME-Version: 1.0\r\n"
        b"Content-Type: multipart/mixed; boundary=O\r\n\r\n"
        b"--O\r\nContent-Type: text/plain\r\n\r\nSee below.\r\n"
        b"--O\r\nContent-Type: message/rfc822\r\nContent-Transfer-Encoding: base64\r\n\r\n"
        + base64.encodebytes(inner).replace(b"\n", b"\r\n") + b"--O--\r\n"
    )  # fmt: skip
    parsed = parse_email(raw)
    assert parsed.body == "See below."
    assert [(a.name, a.size) for a in parsed.attachments] == [("Numbers", len(inner))]
    assert parsed.notes == ()


def test_a_part_without_boundary_after_the_text_does_not_replace_it() -> None:
    """A multipart part that declares no boundary shows its raw text only when the mail has no
    text/plain before it: the text already found stays the body."""
    raw = (
        b"From: a@example.org\r\nSubject: s\r\nMIME-Version: 1.0\r\n"
        b"Content-Type: multipart/mixed; boundary=O\r\n\r\n"
        b"--O\r\nContent-Type: text/plain\r\n\r\nHello\r\n"
        b"--O\r\nContent-Type: multipart/alternative\r\n\r\n"
        b"--x\r\nContent-Type: text/plain\r\n\r\nraw part\r\n--x--\r\n--O--\r\n"
    )
    parsed = parse_email(raw)
    assert parsed.body == "Hello"
    assert any("without parts; showing the raw text" in n for n in parsed.notes)


def test_a_message_global_part_is_an_attached_message() -> None:
    """message/global (RFC 6532: a forwarded message with UTF-8 headers) is an attached message
    as message/rfc822 is: listed by its Subject and size, its text not the mail's own."""
    inner = "From: Jürgen <j@example.de>\r\nSubject: Grüße aus München\r\n\r\nBis bald!\r\n"
    raw = (
        b"From: a@example.org\r\nSubject: fwd\r\nMIME-Version: 1.0\r\n"
        b"Content-Type: multipart/mixed; boundary=O\r\n\r\n"
        b"--O\r\nContent-Type: message/global\r\n\r\n" + inner.encode() + b"--O--\r\n"
    )
    parsed = parse_email(raw)
    size = len(inner.encode()) - len("\r\n")  # the last line break belongs to the boundary
    assert [(a.name, a.size) for a in parsed.attachments] == [("Grüße aus München", size)]
    assert parsed.body == "[forwarded message: Grüße aus München]\nBis bald!"


@pytest.mark.imap
@pytest.mark.postgres
def test_the_statement_to_fetch_a_failed_message_again_runs_for_a_mailbox_with_a_quote(
    account: AccountFactory, db: Any
) -> None:
    """what_to_do's UPDATE names the mailbox as an SQL string literal: a mailbox named with an
    apostrophe gives a statement that runs and moves that mailbox's checkpoint back."""
    acct = account(mailbox="Kunden's Post")
    message = FetchedMessage(uid=5, internal_date=None, raw=b"Subject: x\r\n\r\nbody\r\n")
    failure_id = record_failed_message(db, acct, 1, message, RuntimeError("parser bug"))
    [hint] = db.execute(
        "SELECT context_data->>'what_to_do' FROM failed_operations WHERE id = %s", (failure_id,)
    ).fetchone()
    statement = re.search(r"UPDATE email_checkpoints [^;]*", hint)
    assert statement is not None, hint
    assert db.execute(
        "SELECT mailbox, last_uid FROM email_checkpoints WHERE account = 'home'"
    ).fetchall() == [("Kunden's Post", 5)]
    db.execute(statement.group(0))
    assert db.execute(
        "SELECT mailbox, last_uid FROM email_checkpoints WHERE account = 'home'"
    ).fetchall() == [("Kunden's Post", 4)]



def test_a_refused_commands_answer_is_shown_as_text_not_a_list_of_bytes() -> None:
    """imaplib words a BAD answer as "EXAMINE command error: BAD [b'...']"; the operator's
    error shows the server's words (seen in the mutation review's mailbox-quoting mutant)."""
    refused = imaplib.IMAP4.error("EXAMINE command error: BAD [b'Mailbox name is not valid']")
    assert describe(refused) == "IMAP error: EXAMINE command error: BAD Mailbox name is not valid"
