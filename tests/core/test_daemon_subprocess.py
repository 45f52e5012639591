"""The real daemon as a subprocess: kill -9, SIGTERM, PostgreSQL restarts, instant wake-up."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from tests.support.daemon import daemon_env, start_daemon, wait_until
from tests.support.db import count, enqueue_many

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]


def _done(db: psycopg.Connection) -> int:
    return count(db, "SELECT count(*) FROM work_outcomes")


def _assert_each_item_one_outcome(db: psycopg.Connection, n: int) -> None:
    assert count(db, "SELECT count(*) FROM pending_triage") == 0
    assert _done(db) == n
    assert count(db, "SELECT count(DISTINCT item_id) FROM work_outcomes") == n
    saved = count(db, "SELECT count(*) FROM work_outcomes WHERE outcome = 'saved'")
    assert count(db, "SELECT count(*) FROM memories") == saved
    assert count(db, "SELECT count(DISTINCT origin) FROM memories") == saved


def test_kill_9_mid_drain_repeatedly_loses_and_doubles_nothing(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    n = 600
    enqueue_many(db, n, behaviour="sleep:0.02")
    env = daemon_env(database_url, tmp_path)
    log = tmp_path / "daemon.log"
    kills = 0
    for target in (100, 250, 400):
        proc = start_daemon(env, log)
        assert wait_until(
            lambda t=target, p=proc: _done(db) >= t or p.poll() is not None, timeout=120
        )
        assert proc.poll() is None, log.read_text()[-3000:]
        proc.kill()  # SIGKILL: no cleanup, leases left behind
        proc.wait(10)
        kills += 1
        assert _done(db) < n, "the drain finished before the kill: make items slower"
    proc = start_daemon(env, log)
    try:
        assert wait_until(lambda: _done(db) >= n, timeout=180), log.read_text()[-3000:]
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    assert kills == 3
    _assert_each_item_one_outcome(db, n)
    died = count(db, "SELECT count(*) FROM work_outcomes WHERE outcome = 'failed'")
    print(
        f"\nkill -9 x{kills}: {n} items in, {_done(db)} outcomes, {died} failed by repeated deaths, 0 duplicates"
    )


@pytest.mark.parametrize(
    ("signum", "args"),
    [
        (signal.SIGTERM, ()),
        (signal.SIGHUP, ()),  # a closed terminal: not an abrupt kill with items leased
        (signal.SIGTERM, ("--once",)),  # a timer unit stopped mid-run
        (signal.SIGINT, ("--once",)),  # Ctrl-C
    ],
    ids=["sigterm", "sighup", "once-sigterm", "once-sigint"],
)
def test_a_stop_signal_mid_drain_exits_0_within_the_grace_and_loses_nothing(
    db: psycopg.Connection,
    database_url: str,
    tmp_path: Path,
    signum: signal.Signals,
    args: tuple[str, ...],
) -> None:
    n = 200
    enqueue_many(db, n, behaviour="sleep:0.3")
    env = daemon_env(database_url, tmp_path, SOKRATOS_SHUTDOWN_GRACE="5s", SOKRATOS_LEASE="60s")
    log = tmp_path / "daemon.log"
    proc = start_daemon(env, log, *args)
    assert wait_until(lambda: _done(db) >= 20, timeout=60)
    started = time.monotonic()
    proc.send_signal(signum)
    assert proc.wait(30) == 0, log.read_text()[-3000:]
    assert f'"signal": "{signum.name}"' in log.read_text()
    assert time.monotonic() - started < 5 + 5
    # Nothing is leased any more: each item is settled or released with its attempt given back.
    assert count(db, "SELECT count(*) FROM pending_triage WHERE lease_owner IS NOT NULL") == 0
    assert count(db, "SELECT count(*) FROM pending_triage WHERE attempts > 0") == 0
    left = count(db, "SELECT count(*) FROM pending_triage")
    assert left > 0, "the drain finished before the signal: nothing was stopped mid-drain"
    assert left + _done(db) == n
    assert count(db, "SELECT count(DISTINCT item_id) FROM work_outcomes") == _done(db)
    assert count(db, "SELECT count(*) FROM work_outcomes WHERE outcome <> 'saved'") == 0
    assert count(db, "SELECT count(*) FROM memories") == _done(db)


def test_new_item_in_an_idle_daemon_with_a_60s_heartbeat_starts_at_once(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    env = daemon_env(database_url, tmp_path, SOKRATOS_HEARTBEAT_INTERVAL="60s")
    log = tmp_path / "daemon.log"
    proc = start_daemon(env, log)
    try:
        # Idle: the first tick has run and the listener is connected (its own wake on
        # connecting claims what is there: an item enqueued before it would prove nothing).
        assert wait_until(
            lambda: all(e in log.read_text() for e in ('"worker_started"', '"listening"')),
            timeout=30,
        ), log.read_text()[-3000:]
        time.sleep(1.0)  # (that wake is handled in moments)
        enqueue_many(db, 1)
        started = time.monotonic()
        assert wait_until(lambda: _done(db) == 1, timeout=30)
        elapsed = time.monotonic() - started
    finally:
        proc.terminate()
        proc.wait(30)
    # Generous for a loaded machine (typically well under a second); the heartbeat is 60 s.
    assert elapsed < 15.0, f"took {elapsed:.2f}s: the NOTIFY wake-up did not work"


def test_an_idle_daemon_holds_a_connection_per_slot_and_its_listener(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    env = daemon_env(database_url, tmp_path, SOKRATOS_CONCURRENCY="5")
    proc = start_daemon(env, tmp_path / "daemon.log")
    others = (
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
    )
    try:
        # 5 slots + dispatcher + lease renewer opened at start, at most 2 more on demand
        # (start-up's own queries), + the LISTEN connection.
        assert wait_until(lambda: count(db, others) >= 5 + 2 + 1, timeout=30), count(db, others)
        time.sleep(1.0)  # idle: nothing closes them
        assert 5 + 2 + 1 <= count(db, others) <= 5 + 4 + 1
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def test_postgres_restart_under_a_running_daemon(
    db: psycopg.Connection,
    database_url: str,
    tmp_path: Path,
    restart_postgres: Callable[[float], None],
) -> None:
    n = 300
    enqueue_many(db, n, behaviour="sleep:0.02")
    env = daemon_env(database_url, tmp_path)
    log = tmp_path / "daemon.log"
    proc = start_daemon(env, log)
    try:
        assert wait_until(lambda: _done(db) >= 50, timeout=60)
        db.close()
        restart_postgres(8.0)  # longer than the pool's 5 s wait
        assert proc.poll() is None, "the daemon died with the database"
        with psycopg.connect(database_url, autocommit=True) as again:
            assert wait_until(lambda: _done(again) >= n, timeout=120), log.read_text()[-3000:]
            _assert_each_item_one_outcome(again, n)
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    assert "waiting_for_database" in log.read_text()


def test_start_with_database_unreachable_exits_75(tmp_path: Path) -> None:
    env = daemon_env("postgresql://x@127.0.0.1:1/none", tmp_path, SOKRATOS_STARTUP_TIMEOUT="2s")
    proc = start_daemon(env, tmp_path / "daemon.log")
    assert proc.wait(60) == 75


def test_run_once_drains_ready_items_and_exits_0(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    enqueue_many(db, 30)
    enqueue_many(db, 2, behaviour="fail", prefix="f")
    env = daemon_env(database_url, tmp_path, SOKRATOS_RETRY_BASE="1h", SOKRATOS_RETRY_MAX="2h")
    db.execute(
        "INSERT INTO failed_operations (op_type, label, error_message) VALUES ('memory_save', 'x', 'disk full')"
    )
    proc = start_daemon(env, tmp_path / "daemon.log", "--once")
    assert proc.wait(60) == 0
    assert count(db, "SELECT count(*) FROM work_outcomes WHERE outcome = 'saved'") == 30
    # The failing ones back off (not ready now) and wait for a later tick.
    backing_off = "SELECT count(*) FROM pending_triage WHERE attempts = 1 AND run_after > now()"
    assert count(db, backing_off) == 2
    # One tick_finished event reports the counts per queue, backends and recent failures.
    lines = (tmp_path / "daemon.log").read_text().splitlines()
    events = [json.loads(line) for line in lines if line.startswith("{")]
    final = [e for e in events if e["event"] == "tick_finished"][-1]
    assert final["queues"]["pending_triage"] == {"claimed": 32, "saved": 30, "retried": 2}
    assert final["handled"] == ["pending_triage", "pending_distillation"]
    assert final["backends"] == {"scripted": 30}
    assert final["recent_failures"][0]["op_type"] == "memory_save"
    assert final["recent_failures"][0]["count"] == 1


def test_run_once_logs_one_tick_finished_that_counts_the_spool_import(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """contract §6: one tick_finished per tick; `run --once` is one tick. It logged two: one
    before the drain (no counts), the last with the counts but spool_imported=0."""
    from sokratos_worker.model import Queue
    from sokratos_worker.spool import spool_enqueue

    env = daemon_env(database_url, tmp_path)
    spool_enqueue(
        tmp_path / "data" / "spool",
        Queue.TRIAGE,
        {"exchange": "user: my sister moved to Porto\nassistant: noted"},
        idempotency_key="spooled-1",
        source=None,
    )
    log = tmp_path / "daemon.log"
    assert start_daemon(env, log, "--once").wait(60) == 0, log.read_text()[-3000:]
    ticks = [e for e in _events(log) if e["event"] == "tick_finished"]
    assert _done(db) == 1
    assert [(t["spool_imported"], t["queues"]) for t in ticks] == [
        (1, {"pending_triage": {"claimed": 1, "saved": 1}})
    ]


def test_daemon_speaks_sd_notify_and_serves_metrics(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    import socket
    import urllib.request

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify.sock"))
    sock.settimeout(0.2)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = daemon_env(
        database_url,
        tmp_path,
        NOTIFY_SOCKET=str(tmp_path / "notify.sock"),
        WATCHDOG_USEC="2000000",
        SOKRATOS_METRICS_ADDR=f"127.0.0.1:{port}",
    )
    enqueue_many(db, 5)
    proc = start_daemon(env, tmp_path / "daemon.log")
    seen: list[str] = []

    def receive() -> bool:
        with contextlib.suppress(TimeoutError):
            seen.extend(sock.recv(4096).decode().splitlines())
        return "READY=1" in seen and seen.count("WATCHDOG=1") >= 2

    try:
        assert wait_until(receive, timeout=30, interval=0)
        assert wait_until(lambda: _done(db) == 5, timeout=30)
        base = f"http://127.0.0.1:{port}"
        assert urllib.request.urlopen(base + "/livez", timeout=5).status == 200
        assert urllib.request.urlopen(base + "/readyz", timeout=5).status == 200
        text = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
        assert 'queue="pending_triage"' in text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        wait_until(
            lambda: receive() and any(s == "STOPPING=1" for s in seen), timeout=5, interval=0
        )
    finally:
        if proc.poll() is None:
            proc.kill()
        sock.close()
    assert any(s.startswith("STATUS=running") for s in seen)
    assert "STOPPING=1" in seen


@contextlib.contextmanager
def _role_allowed(db: psycopg.Connection, database_url: str, connections: int) -> Iterator[str]:
    """The URL of a new worker role allowed ``connections`` connections (dropped after)."""
    roles_sql = (Path(__file__).resolve().parents[2] / "sql" / "roles.sql").read_text("utf-8")
    db.execute(roles_sql)
    role = f"limited_{uuid.uuid4().hex[:8]}"
    db.execute(f"CREATE ROLE {role} LOGIN CONNECTION LIMIT {connections} IN ROLE sokratos_worker")
    try:
        info = psycopg.conninfo.conninfo_to_dict(database_url)
        info["user"] = role
        info.pop("password", None)
        yield psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})
    finally:
        db.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,)
        )
        db.execute(f"DROP OWNED BY {role}")
        db.execute(f"DROP ROLE {role}")


def test_a_role_below_the_pools_size_logs_pool_not_full_and_drains_losing_no_lease(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """8 slots on a role allowed 6 connections (the pool wants CONCURRENCY + 2 = 10 at start).
    The slots holding a connection kept it through their handlers, the lease renewer waited
    behind them, and leases (3 s here) expired under running items, which ran again with the
    attempt counted; now a slot lends its connection when another thread waits."""
    n = 40
    enqueue_many(db, n, behaviour="sleep:1")
    with _role_allowed(db, database_url, 6) as limited_url:
        log = tmp_path / "daemon.log"
        env = daemon_env(limited_url, tmp_path, SOKRATOS_CONCURRENCY="8")
        proc = start_daemon(env, log, "--once")
        assert proc.wait(300) == 0, log.read_text()[-3000:]
    _assert_each_item_one_outcome(db, n)
    events = [json.loads(line) for line in log.read_text().splitlines() if line[:1] == "{"]
    warned = [e for e in events if e["event"] == "database_pool_not_full"]
    assert len(warned) == 1 and warned[0]["wanted"] == 10, warned
    assert "max_connections" in warned[0]["hint"]
    kinds = {e["event"] for e in events}
    assert not kinds & {"lease_lost", "item_reclaimed_while_running", "lease_renewal_failed"}
    # psycopg_pool's warning for each refused attempt: once (it wrote ~20 lines in this run).
    refused = [
        e
        for e in events
        if e["event"] == "library_message" and e["message"].startswith("error connecting in")
    ]
    assert len(refused) == 1, refused


def _pending(pid: int, signum: int) -> bool:
    """Whether ``signum`` was sent to ``pid`` and not yet delivered (/proc/PID/status)."""
    bit = 1 << (signum - 1)
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, mask = line.partition(":")
        if name in ("SigPnd", "ShdPnd") and int(mask.strip(), 16) & bit:
            return True
    return False


def test_two_signals_back_to_back_exit_at_once_every_time(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """`timeout` or a double Ctrl-C: the second signal exits at once. The first handler used
    to log; a second signal landing inside that write waited forever on the log's lock."""
    enqueue_many(db, 200, behaviour="sleep:20")  # in flight past the 15 s we wait below
    env = daemon_env(database_url, tmp_path, SOKRATOS_SHUTDOWN_GRACE="30s")
    for attempt in range(5):
        log = tmp_path / f"daemon{attempt}.log"
        proc = start_daemon(env, log)
        assert wait_until(lambda p=log: "worker_started" in p.read_text(), timeout=30)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        # Two SIGTERMs pending at once are one to the kernel (a loaded machine had not run the
        # process yet): the second is sent once the first is delivered.
        assert wait_until(
            lambda p=proc: not _pending(p.pid, signal.SIGTERM), timeout=10, interval=0.0005
        )
        time.sleep(attempt * 0.002)  # (0-8 ms apart: the first is being handled)
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(15)  # the grace is 30 s: only the second signal ends it this soon
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            raise AssertionError(f"attempt {attempt}: alive 15 s after two signals") from None
        assert code == 1, log.read_text()[-2000:]
        assert "second_signal_exiting_now" in log.read_text()
    assert count(db, "SELECT count(DISTINCT item_id) FROM work_outcomes") == count(
        db, "SELECT count(*) FROM work_outcomes"
    )


def test_a_metrics_address_in_use_exits_75_naming_it(database_url: str, tmp_path: Path) -> None:
    """An address in use (two instances given one port, or one not yet free) exits 75, which
    systemd restarts, naming the address, not a traceback; 78 was never restarted, so an
    address that frees later left the worker down for good."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = daemon_env(database_url, tmp_path, SOKRATOS_METRICS_ADDR=f"127.0.0.1:{port}")
        log = tmp_path / "daemon.log"
        assert start_daemon(env, log).wait(60) == 75, log.read_text()[-2000:]
    text = log.read_text()
    assert "metrics_address_unavailable" in text and f"127.0.0.1:{port}" in text
    assert "Traceback" not in text


@contextlib.contextmanager
def _locked_by_a_migration(database_url: str, tables: str) -> Iterator[None]:
    """ACCESS EXCLUSIVE locks on ``tables``, held as a migration would until the block ends."""
    with psycopg.connect(database_url) as locker:
        locker.execute(f"LOCK TABLE {tables} IN ACCESS EXCLUSIVE MODE")
        try:
            yield
        finally:
            locker.rollback()


def _stopped_in(proc: subprocess.Popen[bytes], log: Path) -> float:
    """SIGTERM, and the seconds until the process exited 0."""
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, log.read_text()[-3000:]
    return time.monotonic() - started


def _saved_in_reports(log: Path) -> int:
    """Items counted saved over every tick_finished and worker_stopped of ``log``."""
    return sum(
        n
        for e in _events(log)
        if e["event"] in ("tick_finished", "worker_stopped")
        for per_queue in e["queues"].values()  # type: ignore[attr-defined]
        for outcome, n in per_queue.items()
        if outcome == "saved"
    )


def _events(log: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in log.read_text().splitlines() if line[:1] == "{"]


def test_run_once_behind_a_locked_queue_table_ends_at_its_budget_or_a_stop(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """`run --once` (a timer unit) whose claim waits for a migration's lock: it waited for as
    long as the lock was held, deaf to SIGTERM and to its budget. Now the budget ends it (75:
    items left waiting) and a stop ends it after the grace (0), both naming the lock's
    holder; the next run drains every item once."""
    n = 5
    enqueue_many(db, n, behaviour="skip")
    env = daemon_env(
        database_url, tmp_path, SOKRATOS_TICK_BUDGET="1s", SOKRATOS_SHUTDOWN_GRACE="2s"
    )
    with psycopg.connect(database_url, application_name="a-migration") as locker:
        locker.execute("LOCK TABLE pending_triage IN ACCESS EXCLUSIVE MODE")
        holder = locker.info.backend_pid
        budget_log = tmp_path / "budget.log"
        assert start_daemon(env, budget_log, "--once").wait(120) == 75, budget_log.read_text()
        stop_log = tmp_path / "stop.log"
        proc = start_daemon({**env, "SOKRATOS_TICK_BUDGET": "5m"}, stop_log, "--once")
        assert wait_until(lambda: "run_once_draining" in stop_log.read_text(), timeout=60)
        assert _stopped_in(proc, stop_log) < 60  # the grace (2 s) and the bookkeeping
        locker.rollback()
    for log in (budget_log, stop_log):
        (stuck,) = [e for e in _events(log) if e["event"] == "run_once_drain_stuck"]
        assert stuck["reason"] == (
            f"claiming waits for a lock on pending_triage (held by pid {holder})"
        ), stuck
        held_by = stuck["held_by"]
        assert isinstance(held_by, list) and [b["application"] for b in held_by] == ["a-migration"]
    assert [e["reason"] for e in _events(budget_log) if e["event"] == "run_once_incomplete"] == [
        f"claiming waits for a lock on pending_triage (held by pid {holder})"
    ]
    assert count(db, "SELECT count(*) FROM work_outcomes") == 0
    after = tmp_path / "after.log"
    assert start_daemon(env, after, "--once").wait(120) == 0, after.read_text()
    _assert_each_item_one_outcome(db, n)


def test_tables_locked_by_a_migration_hold_neither_the_drain_nor_the_stop(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """The tick's heartbeat and recent-failures reads time out behind the lock (they waited
    for as long as it was held), items still drain, and SIGTERM exits 0 within moments."""
    env = daemon_env(
        database_url, tmp_path, SOKRATOS_HEARTBEAT_INTERVAL="1s", SOKRATOS_SHUTDOWN_GRACE="5s"
    )
    log = tmp_path / "daemon.log"
    proc = start_daemon(env, log)
    try:
        assert wait_until(lambda: "worker_started" in log.read_text(), timeout=30)
        with _locked_by_a_migration(database_url, "worker_heartbeats, failed_operations"):
            assert wait_until(lambda: "heartbeat_timed_out" in log.read_text(), timeout=30)
            enqueue_many(db, 5)
            assert wait_until(lambda: _done(db) == 5, timeout=30)
            stopped_in = _stopped_in(proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = log.read_text()
    assert "recent_failures_timed_out" in text
    # A tick whose look timed out says it does not know (it said [], "no failures").
    assert None in [e["recent_failures"] for e in _events(log) if e["event"] == "tick_finished"]
    assert "worker_stopped" in text
    # Every item is counted once, in a tick_finished or in worker_stopped: a stop during the
    # tick's look at recent failures abandoned the counts the tick had taken before it.
    assert _saved_in_reports(log) == 5
    # The stop's last heartbeat waits out one statement timeout (5 s), then the process exits.
    assert stopped_in < 5 + 10, f"stopped in {stopped_in:.1f} s"
    assert _done(db) == 5


def test_a_stop_while_a_tick_looks_at_recent_failures_loses_no_count(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """The tick took the runner's counts, then waited on a locked failed_operations for its
    look at recent failures; a stop then abandoned the tick, and its items were in no
    tick_finished and not in worker_stopped (found by an observability hunt)."""
    env = daemon_env(database_url, tmp_path, SOKRATOS_HEARTBEAT_INTERVAL="1s")
    log = tmp_path / "daemon.log"
    proc = start_daemon(env, log)
    try:
        assert wait_until(lambda: "worker_started" in log.read_text(), timeout=30)
        with _locked_by_a_migration(database_url, "failed_operations"):
            assert wait_until(lambda: "recent_failures_timed_out" in log.read_text(), timeout=30)
            enqueue_many(db, 5)
            assert wait_until(lambda: _done(db) == 5, timeout=30)
            time.sleep(2.5)  # the next tick has taken its counts and waits on the lock
            _stopped_in(proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert _saved_in_reports(log) == 5


def test_a_queue_table_locked_at_stop_does_not_hold_the_exit(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """Items still running past the grace are released; a lock on their table (a migration)
    made that release wait for as long as the lock was held. It gives up after 5 s, the
    leases expire instead, and the items run again later: nothing lost."""
    n = 4
    enqueue_many(db, n, behaviour="sleep:30")
    env = daemon_env(
        database_url, tmp_path, SOKRATOS_SHUTDOWN_GRACE="1s", SOKRATOS_LEASE="10s"
    )
    log = tmp_path / "daemon.log"
    proc = start_daemon(env, log)
    try:
        leased = "SELECT count(*) FROM pending_triage WHERE lease_owner IS NOT NULL"
        assert wait_until(lambda: count(db, leased) == n, timeout=30)
        with _locked_by_a_migration(database_url, "pending_triage"):
            stopped_in = _stopped_in(proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = log.read_text()
    assert "release_failed" in text and "the leases expire instead" in text
    assert stopped_in < 1 + 5 + 10, f"stopped in {stopped_in:.1f} s"
    # Still leased (the release could not be written): the items wait for their leases.
    assert count(db, "SELECT count(*) FROM pending_triage") == n
    assert count(db, "SELECT count(*) FROM work_outcomes") == 0


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_while_the_start_waits_for_the_database_ends_it_cleanly(
    tmp_path: Path, signum: signal.Signals
) -> None:
    """Before the worker's own handlers, SIGTERM killed the process where it stood (an
    embedded PostgreSQL it had started was left running) and Ctrl-C printed a traceback."""
    env = daemon_env("postgresql://x@127.0.0.1:1/none", tmp_path, SOKRATOS_STARTUP_TIMEOUT="5m")
    log = tmp_path / "daemon.log"
    proc = start_daemon(env, log)
    try:
        assert wait_until(lambda: "waiting_for_database" in log.read_text(), timeout=60)
        proc.send_signal(signum)
        assert proc.wait(30) == 0, log.read_text()[-2000:]
    finally:
        proc.kill()
    text = log.read_text()
    assert "stopped_while_starting" in text and "Traceback" not in text, text[-2000:]
