"""Operator-visible edges of the service surface that no other test pinned (a mutation review)."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families
from psycopg.types.json import Jsonb
from structlog.testing import capture_logs

from sokratos_worker.cli_failed import _lock_waits_given_up_naming
from sokratos_worker.config import Settings
from sokratos_worker.daemon import Worker
from sokratos_worker.errors import TableLocked
from sokratos_worker.handlers import HandlerContext
from sokratos_worker.model import Queue
from sokratos_worker.service.jobs import DaemonThreadExecutor
from sokratos_worker.service.metrics import Metrics, MetricsServer
from sokratos_worker.service.sdnotify import Notifier
from sokratos_worker.service.watchdog import DISPATCHER_STALL_S, DispatcherWatchdog
from sokratos_worker.status import render_status
from sokratos_worker.store.connection import Database
from tests.support.db import count
from tests.support.handlers import ScriptedHandler
from tests.support.operator import cli_env, run_cli


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def test_a_failed_llm_call_is_counted_under_result_error() -> None:
    """A failed chat call is observed under result="error", as the metric's help text names it."""
    metrics = Metrics()
    metrics.observe_llm_call("remote", 0.3, ok=False)
    s = _samples(metrics.render().decode())
    labels = (("backend", "remote"), ("result", "error"))
    assert s[("sokratos_llm_call_duration_seconds_count", labels)] == 1


def test_head_answers_headers_only_and_the_connection_serves_on() -> None:
    """HEAD on /readyz and /livez sends no body, so a keep-alive connection's next answer is intact."""
    with MetricsServer("127.0.0.1:0", Metrics(), readiness=lambda: False) as srv:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
        try:
            conn.request("HEAD", "/readyz")
            head = conn.getresponse()
            assert head.status == 503
            assert head.getheader("Content-Length") == str(len(b"not ready\n"))
            assert head.read() == b""
            conn.request("GET", "/livez")
            after = conn.getresponse()
            assert (after.status, after.read()) == (200, b"ok\n")
        finally:
            conn.close()
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as raw:
            raw.sendall(b"HEAD /livez HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = b""
            while chunk := raw.recv(4096):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 200")
        assert answer.endswith(b"\r\n\r\n"), answer  # headers and nothing after them


def test_a_query_string_does_not_change_the_endpoint() -> None:
    """/metrics?… and /readyz?… answer as without the query (scrapers and probes may add one)."""
    with MetricsServer("127.0.0.1:0", Metrics(), readiness=lambda: False) as srv:
        answers = {}
        for path in ("/metrics?name[]=x", "/readyz?verbose=1", "/livez?x"):
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
            try:
                conn.request("GET", path)
                response = conn.getresponse()
                answers[path] = (response.status, response.read())
                assert response.getheader("Cache-Control") == "no-store", path
            finally:
                conn.close()
    assert answers["/readyz?verbose=1"] == (503, b"not ready\n")
    assert answers["/livez?x"] == (200, b"ok\n")
    status, body = answers["/metrics?name[]=x"]
    assert status == 200 and b"sokratos_queue_items" in body


def test_a_lost_stopping_goes_again_with_the_next_message(tmp_path: Path) -> None:
    """STOPPING=1 lost on a failed send is sent again with the next message, as READY=1 is."""
    path = str(tmp_path / "late.sock")
    notifier = Notifier({"NOTIFY_SOCKET": path})
    with capture_logs() as logs:
        assert notifier.stopping("stopping: 2 items in flight") is False  # nobody listens yet
    [failed] = [e for e in logs if e["event"] == "sd_notify_failed"]  # (by event: see test_sdnotify)
    assert "STOPPING=1 goes again" in failed["hint"]
    sock = _receiver(path)
    try:
        assert notifier.watchdog() is True
        assert sock.recv(4096) == b"STOPPING=1\nWATCHDOG=1"
    finally:
        sock.close()


def test_a_status_line_is_cut_to_its_limit(tmp_path: Path) -> None:
    """A long STATUS= (a server error quoted in it) is one line of at most 400 characters."""
    path = str(tmp_path / "notify.sock")
    sock = _receiver(path)
    try:
        assert Notifier({"NOTIFY_SOCKET": path}).status("x" * 5000 + "\nDETAIL: more")
        assert sock.recv(65536) == b"STATUS=" + b"x" * 400
    finally:
        sock.close()


def _receiver(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(2.0)
    return sock


def _pings(sock: socket.socket) -> int:
    """WATCHDOG=1 datagrams queued now (a local datagram is queued once its send returns)."""
    sock.setblocking(False)
    got = 0
    with contextlib.suppress(BlockingIOError):
        while True:
            got += sock.recv(4096) == b"WATCHDOG=1"
    return got


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _watchdog(tmp_path: Path, clock: _Clock) -> tuple[DispatcherWatchdog, socket.socket]:
    path = str(tmp_path / "wd.sock")
    sock = _receiver(path)
    notifier = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "20000000"})  # WatchdogSec=20
    watchdog = DispatcherWatchdog(
        notifier,
        dispatcher_pid=lambda: None,  # between statements: no lock to look up
        conninfo="",
        running_status=lambda: "running",
        clock=clock,
    )
    return watchdog, sock


def test_watchdog_pings_every_quarter_of_watchdogsec(tmp_path: Path) -> None:
    """With WatchdogSec=20 a progressing dispatcher pings every 5 s, well inside the limit."""
    clock = _Clock()
    watchdog, sock = _watchdog(tmp_path, clock)
    try:
        watchdog.progressed()
        assert _pings(sock) == 1
        clock.now += 4.0
        watchdog.progressed()
        assert _pings(sock) == 0  # 4 s after the last ping: not yet
        clock.now += 1.5
        watchdog.look()
        assert _pings(sock) == 1  # 5.5 s: pinged
        pinged = 0
        for _ in range(8):  # 20 s more of progress, a look every 2.5 s
            clock.now += 2.5
            watchdog.progressed()
            pinged += _pings(sock)
        assert pinged == 4
    finally:
        sock.close()


def test_each_new_stall_of_the_dispatcher_is_reported(tmp_path: Path) -> None:
    """A dispatcher that stalls, recovers and stalls again is logged as stalled both times."""
    clock = _Clock()
    watchdog, sock = _watchdog(tmp_path, clock)

    def stall() -> None:
        for _ in range(int(DISPATCHER_STALL_S // 5) + 2):  # the main loop keeps looking
            clock.now += 5.0
            watchdog.look()
            _pings(sock)  # systemd reads them

    try:
        with capture_logs() as logs:
            watchdog.progressed()
            stall()
            watchdog.progressed()
            stall()
        stalled = [e for e in logs if e["event"] == "dispatcher_stalled"]
        assert len(stalled) == 2, stalled
    finally:
        sock.close()


def test_the_pings_stop_two_minutes_after_the_dispatchers_last_round(
    tmp_path: Path,
) -> None:
    """The documented stall limit: pings go on for 2 minutes without progress, then stop."""
    clock = _Clock()
    watchdog, sock = _watchdog(tmp_path, clock)
    try:
        watchdog.progressed()
        pinged = _pings(sock)
        for _ in range(24):  # 120 s of looks without progress: still pinging
            clock.now += 5.0
            watchdog.look()
            pinged += _pings(sock)
        assert pinged == 25
        with capture_logs() as logs:
            clock.now += 5.0  # 125 s: past the limit
            watchdog.look()
        assert _pings(sock) == 0
        assert [e["stalled_s"] for e in logs if e["event"] == "dispatcher_stalled"] == [125]
    finally:
        sock.close()


def _one_worker_report(**worker: Any) -> dict[str, Any]:
    return {
        "database": "ok",
        "queues": {},
        "failures_24h": {},
        "workers": [
            {
                "worker_id": "w1",
                "state": "running",
                "last_tick_at": "now",
                "backends": [],
                "version": "0.1.0+0000000000",
                **worker,
            }
        ],
        "email_accounts": [],
        "embeddings": "off",
    }


def test_a_closed_circuit_with_failures_in_a_row_says_so() -> None:
    """Failures below the breaker's threshold show on a closed circuit, before it opens."""
    report = _one_worker_report(
        backends=[
            {
                "name": "brain",
                "circuit": "closed",
                "consecutive_failures": 2,
                "last_error": "ReadTimeout",
            }
        ]
    )
    assert "backends: brain closed (2 failures in a row; last error: ReadTimeout)" in (
        render_status(report)
    )


def test_the_scheduled_jobs_and_their_intervals(database_url: str) -> None:
    """The heartbeat runs every heartbeat_interval and retention hourly, one run at a time each."""
    settings = Settings(heartbeat_interval=7.0)
    database = Database(database_url, size=2)
    scheduler = None
    try:
        worker = Worker(
            settings=settings,
            database=database,
            handlers={Queue.TRIAGE: ScriptedHandler()},
            context=HandlerContext(settings=settings, database=database, chat=None, embedder=None),
        )
        scheduler = worker._start_scheduler(DaemonThreadExecutor())
        scheduler.pause()  # the intervals are what is looked at, not the runs
        jobs = {job.id: job for job in scheduler.get_jobs()}
        assert set(jobs) == {"heartbeat", "maintenance"}
        assert jobs["heartbeat"].trigger.interval == timedelta(seconds=7)
        assert jobs["maintenance"].trigger.interval == timedelta(hours=1)
        for job in jobs.values():
            assert (job.max_instances, job.coalesce) == (1, True), job.id
    finally:
        if scheduler is not None:
            scheduler.shutdown(wait=False)
        database.close()


def _failure(db: psycopg.Connection, op_type: str, error: str, *, payload: bool = True) -> int:
    """A dead letter as the worker writes one (with a replayable payload unless told not)."""
    context = Jsonb({"payload": {"exchange": "user: hi\nassistant: ho"}}) if payload else None
    return count(
        db,
        "INSERT INTO failed_operations (op_type, label, error_message, context_data,"
        " source_queue, item_id) VALUES (%s, 'l', %s, %s, %s, %s) RETURNING id",
        op_type,
        error,
        context,
        "pending_triage" if payload else None,
        count(db, "SELECT nextval('pending_triage_id_seq')") if payload else None,
    )


def test_failed_show_of_an_unknown_id_exits_1(database_url: str, tmp_path: Path) -> None:
    """`failed show` of an ID that is not there says so on stderr and exits 1, not 0."""
    shown = run_cli(
        ["failed", "show", "987654"],
        cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url),
    )
    assert shown.returncode == 1, shown.stdout + shown.stderr
    assert "no failure with id 987654" in shown.stderr and shown.stdout == ""


def test_failed_retry_exits_1_when_one_of_the_ids_is_refused(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """A retry that refuses one ID (no stored payload) exits 1; the others are still replayed."""
    good = _failure(db, "conversation_triage", "model said no")
    refused = _failure(db, "memory_save", "e", payload=False)
    env = cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url)
    retried = run_cli(["failed", "retry", str(good), str(refused)], env)
    assert retried.returncode == 1, retried.stdout + retried.stderr
    assert f"{refused}: " in retried.stdout and "no stored payload" in retried.stdout
    assert count(db, "SELECT count(*) FROM pending_triage") == 1
    assert count(db, "SELECT count(*) FROM failed_operations WHERE retried_at IS NOT NULL") == 1
    item_id = count(db, "SELECT retried_as FROM failed_operations WHERE id = %s", good)
    listing = run_cli(["failed", "list"], env).stdout.splitlines()
    listed = {int(line.split()[0]): line for line in listing}
    assert listed[good].endswith(f" retried as pending_triage item {item_id}"), listed[good]
    assert "retried as" not in listed[refused]
    again = run_cli(["failed", "retry", str(good)], env)  # already retried: nothing more, exit 0
    assert again.returncode == 0, again.stdout + again.stderr
    assert count(db, "SELECT count(*) FROM pending_triage") == 1


def test_failed_list_limit_keeps_the_newest(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """`failed list --limit 2` prints the two newest failures and no more."""
    ids = [_failure(db, "conversation_triage", f"error {n}") for n in range(4)]
    listed = run_cli(
        ["failed", "list", "--limit", "2"],
        cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url),
    )
    assert listed.returncode == 0, listed.stderr
    assert [int(line.split()[0]) for line in listed.stdout.splitlines()] == ids[:-3:-1]
    # ... and says on stderr that the list is not whole, which a first page looked like.
    assert "more failures than the 2 listed" in listed.stderr, listed.stderr
    whole = run_cli(
        ["failed", "list", "--limit", "4"],
        cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url),
    )
    assert len(whole.stdout.splitlines()) == 4 and "more failures" not in whole.stderr


def test_failed_list_cuts_a_long_error_to_90_characters(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """One listing line shows at most 90 characters of the error (`show` has all of it)."""
    _failure(db, "conversation_triage", "a" * 90 + "TAIL" + "b" * 300)
    listed = run_cli(["failed", "list"], cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url))
    assert listed.returncode == 0, listed.stderr
    (line,) = listed.stdout.splitlines()
    assert line.endswith(" " + "a" * 90), line


def test_failed_list_json_with_no_failures_prints_nothing(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """`failed list --json` is JSON lines only: none found is no line, never a sentence."""
    env = cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url)
    empty = run_cli(["failed", "list", "--json"], env)
    assert (empty.returncode, empty.stdout) == (0, ""), empty.stdout + empty.stderr
    typo = run_cli(["failed", "list", "--json", "--op-type", "nothing_here"], env)
    assert (typo.returncode, typo.stdout) == (0, ""), typo.stdout + typo.stderr
    failure_id = _failure(db, "conversation_triage", "model said no")
    (line,) = run_cli(["failed", "list", "--json"], env).stdout.splitlines()
    assert json.loads(line)["id"] == failure_id


def test_a_retry_given_up_on_a_lock_names_the_ids_left_ten_at_most(
    db: psycopg.Connection,
) -> None:
    """The ids not retried are named, ten at most, then "and N more" only when there are more."""
    for ids, done, named in (
        (list(range(1, 11)), 0, "(not retried: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10)"),
        (
            list(range(1, 13)),
            0,
            "(not retried: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 and 2 more)",
        ),
        (list(range(1, 13)), 2, "(not retried: 3, 4, 5, 6, 7, 8, 9, 10, 11, 12)"),
    ):
        with (
            pytest.raises(TableLocked) as given_up,
            _lock_waits_given_up_naming(db, ids, done),
        ):
            raise TableLocked("pending_triage is locked")
        assert str(given_up.value) == f"pending_triage is locked {named}"


def test_failed_purge_deletes_only_what_is_older_than_the_days_given(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """`failed purge --older-than 2` deletes a 2.5-day-old failure and keeps a 1.5-day-old one."""
    old = _failure(db, "conversation_triage", "old")
    recent = _failure(db, "conversation_triage", "recent")
    db.execute(
        "UPDATE failed_operations SET created_at = now() - CASE id WHEN %s THEN"
        " interval '60 hours' ELSE interval '36 hours' END",
        (old,),
    )
    env = cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url)
    purged = run_cli(["failed", "purge", "--older-than", "2"], env)
    assert purged.returncode == 0, purged.stderr
    assert purged.stdout.strip() == "deleted 1 failures older than 2 days"
    assert count(db, "SELECT count(*) FROM failed_operations WHERE id = %s", recent) == 1
    assert count(db, "SELECT count(*) FROM failed_operations") == 1


def test_failed_retry_all_with_op_type_replays_only_that_op_type(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """`failed retry --all --op-type T` re-enqueues the failures of T and leaves the others."""
    chosen = _failure(db, "conversation_triage", "chosen")
    other = _failure(db, "email_triage", "other")
    env = cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url)
    retried = run_cli(["failed", "retry", "--all", "--op-type", "conversation_triage"], env)
    assert retried.returncode == 0, retried.stdout + retried.stderr
    assert count(db, "SELECT count(*) FROM pending_triage") == 1
    retried_ids = [
        r[0] for r in db.execute("SELECT id FROM failed_operations WHERE retried_at IS NOT NULL")
    ]
    assert retried_ids == [chosen]
    assert (
        count(
            db,
            "SELECT count(*) FROM failed_operations WHERE id = %s AND retried_at IS NULL",
            other,
        )
        == 1
    )


def test_outcomes_read_in_the_order_of_an_items_life_then_newer_ones() -> None:
    """Outcomes show saved, skipped, archived, failed, then any a newer version records, sorted."""
    report = _one_worker_report()
    report["outcomes_24h"] = {
        "pending_triage": {
            "failed": 1,
            "zapped": 4,
            "skipped": 3,
            "saved": 12,
            "abandoned": 2,
        },
        "pending_distillation": {"archived": 5},
    }
    assert (
        "outcomes (24h): pending_distillation archived 5; pending_triage saved 12, skipped 3,"
        " failed 1, abandoned 2, zapped 4"
    ) in render_status(report)


def test_a_read_only_server_and_missing_migrations_are_said_at_the_top() -> None:
    """`status` text says a read-only server and the migrations the schema lacks, before queues."""
    report = _one_worker_report()
    report.update(
        read_only="the server is a standby",
        migrations_pending=["0007_x", "0008_y"],
        queues={
            "pending_triage": {
                "ready": 1,
                "backing_off": 0,
                "leased": 2,
                "oldest_ready_age_s": 4.2,
                "leased_by": {"w1": 2},
            }
        },
    )
    lines = render_status(report).splitlines()
    assert lines[1:5] == [
        "read-only: the server is a standby",
        "schema: lacks 0007_x, 0008_y: run 'sokratos-worker migrate'",
        "pending_triage: 1 ready, 0 backing off, 2 leased, oldest ready 4s",
        "    leased by w1: 2",
    ]


def test_status_without_email_accounts_shows_every_mailbox_the_database_checked(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """`status` run from a shell without SOKRATOS_EMAIL_ACCOUNTS (README: "in another
    terminal") listed no account at all, hiding one that failed every check; now it lists the
    database's, saying where they came from."""
    db.execute(
        """INSERT INTO email_checkpoints (account, mailbox, last_uid, checked_at, last_error,
                                          last_error_at)
           VALUES ('personal', 'INBOX', 0, NULL, 'connecting to imap.example.org refused', now()),
                  ('personal', 'Old', 0, NULL, 'EXAMINE ''Old'' failed', now() - interval '3 days')"""
    )  # (Old: the row a renamed mailbox left behind, not shown: it would read as failing)
    env = cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url)
    text = run_cli(["status"], env)
    assert text.returncode == 0, text.stderr
    assert "this command has no SOKRATOS_EMAIL_ACCOUNTS" in text.stdout
    assert "Old" not in text.stdout, text.stdout
    assert (
        "email personal INBOX: last check never, last error: connecting to imap.example.org"
        " refused" in text.stdout
    ), text.stdout
    report = json.loads(run_cli(["status", "--json"], env).stdout)
    (account,) = report["email_accounts"]
    assert (account["name"], account["from_database"]) == ("personal", True)
