"""A server that answers a byte at a time: the check fails at its deadline, the daemon goes on.

Found by an operator probe: a greeting sent one byte every 10 s never trips a read's timeout,
and kept the email check (and, as it ran on the heartbeat's thread, the whole daemon) stuck.
"""

from __future__ import annotations

import contextlib
import json
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import mails
import psycopg
import pytest
from dovecot import AccountFactory, Dovecot, make_settings
from dovecot import _make_certificate as make_certificate
from trickle import StallAt, TricklingServer

from sokratos_worker.client import enqueue_triage
from sokratos_worker.config import EmailAccountConfig, Settings
from sokratos_worker.email import AccountReport, check_due_accounts
from sokratos_worker.email.imap import OpenSessions
from tests.core.test_cli import ROOT, env_for
from tests.support.daemon import daemon_env, start_daemon, wait_until
from tests.support.db import count

pytestmark = [pytest.mark.postgres]

NOW = datetime.now(UTC)
# Generous bounds for a shared, noisy machine; without the deadline these never end at all.
BOUND_S = 60.0
SLOW = "the server answered too slowly: deadline exceeded"


def slow_account(
    port: int, security: str = "none", name: str = "slow", mailbox: str = "INBOX"
) -> EmailAccountConfig:
    return EmailAccountConfig(
        name=name,
        host="127.0.0.1",
        port=port,
        username="alice",
        password="secret",
        mailbox=mailbox,
        security=security,
        tls_verify=False,
    )


def accounts_variable(port: int) -> str:
    """SOKRATOS_EMAIL_ACCOUNTS for the daemon: one plaintext account on the trickling server."""
    account = {"name": "slow", "host": "127.0.0.1", "port": port, "security": "none"}
    return json.dumps([{**account, "username": "alice", "password": "secret"}])


@contextlib.contextmanager
def daemon_on(
    server: TricklingServer, database_url: str, tmp_path: Path, *args: str, **env: str
) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """The daemon (``args``: e.g. ``--once``) with one account on ``server``; killed if the
    test leaves it running."""
    variables = daemon_env(
        database_url, tmp_path, SOKRATOS_EMAIL_ACCOUNTS=accounts_variable(server.port), **env
    )
    log = tmp_path / "daemon.log"
    proc = start_daemon(variables, log, *args)
    try:
        yield proc, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def last_error(db: psycopg.Connection, name: str) -> str | None:
    row = db.execute(
        "SELECT last_error FROM email_checkpoints WHERE account = %s", (name,)
    ).fetchone()
    return None if row is None else row[0]


def check_bounded(
    settings: Settings, conninfo: str, *, now: datetime = NOW, **kwargs: Any
) -> tuple[list[AccountReport], float]:
    """``check_due_accounts`` in a thread given ``BOUND_S``: a hang fails the test, not CI."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(check_due_accounts(settings, conninfo, now=now, **kwargs))
        except BaseException as exc:  # handed to the test's thread
            outcome.append(exc)

    started = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(BOUND_S)
    assert outcome, f"the email check was still running after {BOUND_S:g} s"
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0], time.monotonic() - started


@pytest.fixture(scope="module")
def server_tls(tmp_path_factory: pytest.TempPathFactory) -> ssl.SSLContext:
    """A TLS server context with a self-signed certificate (the client does not verify it)."""
    cert, key = make_certificate(tmp_path_factory.mktemp("tls"))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return context


@pytest.mark.parametrize(
    ("stall_at", "security"),
    [
        ("greeting", "none"),
        ("greeting", "tls"),  # the handshake completes, then the greeting trickles
        ("handshake", "tls"),
        ("starttls", "starttls"),
        ("examine", "none"),
    ],
)
def test_a_trickling_server_fails_the_check_at_its_deadline(
    stall_at: StallAt,
    security: str,
    server_tls: ssl.SSLContext,
    database_url: str,
    db: psycopg.Connection,
) -> None:
    tls = server_tls if security == "tls" and stall_at != "handshake" else None
    with TricklingServer(stall_at, tls=tls) as server:
        settings = make_settings(slow_account(server.port, security), email_check_deadline=2)
        [report], elapsed = check_bounded(settings, database_url)
        assert server.accepted == 1
    assert report.error is not None
    assert SLOW in report.error, report.error
    assert f"127.0.0.1:{server.port} ({security})" in report.error
    assert "SOKRATOS_EMAIL_CHECK_DEADLINE" in report.error
    assert elapsed < BOUND_S
    # Recorded like any IMAP failure: status shows it and the account waits for its interval.
    assert last_error(db, "slow") == report.error


@pytest.mark.imap
def test_a_slow_account_holds_back_no_other_and_is_retried_at_its_next_check(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    for n in range(2):
        dovecot.append(mailbox, mails.plain(subject=f"waiting {n}"))
    with TricklingServer("greeting") as server:
        settings = make_settings(
            slow_account(server.port, mailbox=mailbox), account(name="home"), email_check_deadline=2
        )
        (slow, home), _ = check_bounded(settings, database_url)
        assert slow.error is not None and SLOW in slow.error
        assert (home.error, home.enqueued) == (None, 2)
        (slow, _), _ = check_bounded(settings, database_url, now=NOW + timedelta(minutes=1))
        assert slow.skipped_reason == "not due"
    # The server mended (here: the account pointed at one that answers): checked in full, once.
    mended = make_settings(account(name="slow"), email_check_deadline=2)
    [slow], _ = check_bounded(mended, database_url, now=NOW + timedelta(minutes=10))
    assert (slow.error, slow.enqueued) == (None, 2)
    [slow], _ = check_bounded(mended, database_url, now=NOW + timedelta(minutes=20))
    assert (slow.error, slow.enqueued, slow.duplicates) == (None, 0, 0)
    assert last_error(db, "slow") is None
    assert count(db, "SELECT count(*) FROM pending_triage") == 4  # 2 per account, no more


def test_a_stopping_worker_cuts_a_stuck_session_and_blames_no_account(
    database_url: str, db: psycopg.Connection
) -> None:
    sessions = OpenSessions()
    cut: list[int] = []
    with TricklingServer("greeting") as server:

        def stop_once_stuck() -> None:
            if wait_until(lambda: server.trickling == 1, timeout=BOUND_S):
                cut.append(sessions.cut_all())

        # The default deadline (minutes): only the cut can end this check within the bound.
        settings = make_settings(slow_account(server.port), slow_account(server.port, name="next"))
        stopper = threading.Thread(target=stop_once_stuck, daemon=True)
        stopper.start()
        (stuck, following), _ = check_bounded(settings, database_url, sessions=sessions)
        stopper.join(BOUND_S)
    assert cut == [1]
    assert stuck.error is not None and "the worker is stopping" in stuck.error, stuck.error
    assert following.skipped_reason == "the worker is stopping"
    assert server.accepted == 1
    # Not the account's fault: nothing recorded, so the next start checks it at once.
    assert last_error(db, "slow") is None


@pytest.mark.subprocess
@pytest.mark.slow
def test_the_daemon_beats_imports_and_stops_while_a_check_is_stuck(
    database_url: str, db: psycopg.Connection, tmp_path: Path
) -> None:
    with (
        TricklingServer("greeting") as server,
        daemon_on(server, database_url, tmp_path, SOKRATOS_EMAIL_CHECK_INTERVAL="30s") as daemon,
    ):
        proc, log = daemon
        assert wait_until(lambda: server.trickling == 1, timeout=BOUND_S), log.read_text()
        stuck_at = db.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
        # Heartbeats go on (the interval is 1 s) ...
        beats_since = (
            "SELECT count(*) FROM worker_heartbeats WHERE last_tick_at > %s + interval '3 seconds'"
        )
        assert wait_until(lambda: count(db, beats_since, stuck_at) == 1, timeout=BOUND_S), (
            log.read_text()[-3000:]
        )
        # ... and so does the spool import, and the drain of what it imported.
        spool = tmp_path / "data" / "spool"
        down = "postgresql://nobody@127.0.0.1:1/none?connect_timeout=1"
        spooled = enqueue_triage(down, "user: hi\nassistant: ok", key="k0", spool_dir=spool)
        assert spooled.spooled is not None
        done = "SELECT count(*) FROM work_outcomes"
        assert wait_until(lambda: count(db, done) == 1, timeout=BOUND_S), log.read_text()
        assert server.trickling == 1, "the check was meant to be stuck all along"
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(BOUND_S) == 0, log.read_text()[-3000:]
    assert time.monotonic() - started < BOUND_S
    text = log.read_text()
    assert '"event": "email_sessions_cut"' in text
    assert '"event": "email_check_aborted"' in text
    assert "Traceback" not in text
    assert last_error(db, "slow") is None


@pytest.mark.subprocess
@pytest.mark.slow
def test_run_once_ends_a_stuck_check_at_its_deadline(
    database_url: str, db: psycopg.Connection, tmp_path: Path
) -> None:
    with (
        TricklingServer("greeting") as server,
        daemon_on(
            server, database_url, tmp_path, "--once", SOKRATOS_EMAIL_CHECK_DEADLINE="2s"
        ) as d,
    ):
        proc, log = d
        assert proc.wait(BOUND_S) == 0, log.read_text()[-3000:]
    assert SLOW in (last_error(db, "slow") or ""), log.read_text()[-3000:]
    assert '"event": "email_check_failed"' in log.read_text()


@pytest.mark.subprocess
@pytest.mark.slow
def test_the_daemon_checks_mail_at_start_not_a_minute_later(
    database_url: str, tmp_path: Path
) -> None:
    # (With a 5 m interval the email thread then wakes every 60 s.)
    with (
        TricklingServer("greeting") as server,
        daemon_on(server, database_url, tmp_path, SOKRATOS_EMAIL_CHECK_INTERVAL="5m") as daemon,
    ):
        proc, log = daemon
        assert wait_until(lambda: server.trickling == 1, timeout=30), log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(BOUND_S) == 0, log.read_text()[-3000:]


@pytest.mark.subprocess
@pytest.mark.slow
def test_run_once_stops_at_sigterm_during_a_stuck_check(
    database_url: str, db: psycopg.Connection, tmp_path: Path
) -> None:
    """A timer unit stopped while its check waits on a slow server: out now, not at the
    deadline (5 minutes by default), and the account is not blamed."""
    with (
        TricklingServer("greeting") as server,
        daemon_on(server, database_url, tmp_path, "--once") as (proc, log),
    ):
        assert wait_until(lambda: server.trickling == 1, timeout=BOUND_S), log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(BOUND_S) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert '"event": "email_sessions_cut"' in text and "Traceback" not in text
    assert last_error(db, "slow") is None


@pytest.mark.parametrize("stall_at", ["examine", "greeting"])
def test_check_stopped_while_a_mailbox_stalls_exits_at_once(
    database_url: str, tmp_path: Path, stall_at: StallAt
) -> None:
    """`check` stopped (SIGTERM, Ctrl-C) while a server that had taken the login stalled: the
    LOGOUT sent on the way out waited out the whole 60 s budget first (review R4)."""
    with TricklingServer(stall_at, gap_s=1.0) as server:
        account = {"name": "slow", "host": "127.0.0.1", "port": server.port,
                   "username": "alice", "password": "secret", "security": "none"}
        env = env_for(database_url, tmp_path, SOKRATOS_EMAIL_ACCOUNTS=json.dumps([account]))
        proc = subprocess.Popen(
            [sys.executable, "-m", "sokratos_worker", "check"], env=env, cwd=ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        try:
            assert wait_until(lambda: server.trickling > 0, timeout=BOUND_S)
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=BOUND_S + 30)
        finally:
            proc.kill()
        took = time.monotonic() - started
    assert proc.returncode == 1, err[-2000:]
    assert "stopped by SIGTERM before the command finished" in err
    assert took < 20, took  # (the stall's own budget is 60 s)
