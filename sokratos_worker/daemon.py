"""The long-running process: scheduler, NOTIFY wake-ups, signals, sd_notify, metrics.

The only module that schedules (APScheduler). The heartbeat tick is the safety net; new
work wakes the runner at once through LISTEN/NOTIFY on a dedicated connection. Email checks
run in a thread of their own, so a slow IMAP server never holds up a heartbeat or a stop.
"""

from __future__ import annotations

import errno
import faulthandler
import gc
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import structlog
from apscheduler.events import EVENT_JOB_ERROR, EVENT_JOB_MAX_INSTANCES, EVENT_JOB_MISSED
from apscheduler.schedulers.background import BackgroundScheduler
from psycopg import errors as pg_errors

from sokratos_worker.build import build_version
from sokratos_worker.config import ConfigError, Settings
from sokratos_worker.email.imap_sessions import OpenSessions
from sokratos_worker.errors import DatabaseUnavailable, PoolBusy, reached_database
from sokratos_worker.exit_codes import EXIT_TEMPFAIL
from sokratos_worker.handlers import HandlerContext, HandlerFactory, Handlers
from sokratos_worker.model import Queue
from sokratos_worker.runner import Runner
from sokratos_worker.schema_check import embedding_mismatch
from sokratos_worker.service.background_writes import BackgroundWrites
from sokratos_worker.service.clock_steps import ClockStepWatch, run_jobs_now
from sokratos_worker.service.jobs import DaemonThreadExecutor, log_job_event, scheduler_logger
from sokratos_worker.service.metrics import Metrics, MetricsServer, parse_addr
from sokratos_worker.service.port_holder import port_holder
from sokratos_worker.service.reachability import DatabaseContact
from sokratos_worker.service.sdnotify import Notifier
from sokratos_worker.service.stop_requests import LAST_WORDS_BUDGET_S, StopRequests
from sokratos_worker.service.watchdog import DispatcherWatchdog
from sokratos_worker.spool import import_spool
from sokratos_worker.store import email as email_store
from sokratos_worker.store import failures as failures_store
from sokratos_worker.store import status as status_store
from sokratos_worker.store.connection import Database, connect, time_limited
from sokratos_worker.store.embedded_watch import watch_postmaster, watched_server
from sokratos_worker.store.locks import COMMAND_LOCK_TIMEOUT_MS
from sokratos_worker.store.queue import NOTIFY_CHANNEL
from sokratos_worker.worker_state import State

log = structlog.get_logger(__name__)

# The database part of a /metrics scrape gives up after this (the last values are served).
METRICS_STATEMENT_TIMEOUT_MS = 2000
# The tick's own statements (heartbeat row, recent failures) wait no longer than this behind
# a lock (a migration, a long transaction): the ticks go on, and a stop is never held up.
TICK_STATEMENT_TIMEOUT_MS = 5000
# How soon the main thread acts on a stop signal the handler recorded.
SIGNAL_POLL_S = 0.25
# Due accounts are looked for this often (each account is due on its own interval).
EMAIL_CHECK_EVERY_S = 60.0
# Retention's first run, this long after start: out of the start's path, and a worker
# restarted more often than hourly still prunes (then it runs every hour).
MAINTENANCE_FIRST_RUN_AFTER_S = 60.0
# The look for memories of another embedding model reads up to 10,000 vectors (60 MB at 1536
# dimensions): past this (a lock on `memories`, a slow server) it is given up.
EMBEDDING_LOOK_TIMEOUT_MS = 30_000
# A busy slot's statement waiting this long for another session's lock is named at the tick.
SLOT_LOCK_REPORT_S = 30.0
# A stopped email check ends within moments (its session is cut); never wait on it longer.
EMAIL_STOP_WAIT_S = 5.0
# A state change's heartbeat write still running when the pool closes is waited for this long.
HEARTBEAT_WRITER_CLOSE_WAIT_S = 5.0

# Why a worker without handlers claims nothing: its reported state is "no backend" with this.
NO_BACKEND_CONFIGURED = (
    "no LLM backend configured: set SOKRATOS_LLM_BACKENDS (or SOKRATOS_LOCAL_MODEL=true) and"
    " restart the worker; items wait in their queues"
)


@contextmanager
def _lock_waits_limited(conn: psycopg.Connection) -> Iterator[None]:
    """Retention's statements give up a lock wait past COMMAND_LOCK_TIMEOUT_MS (each batch
    commits on its own, so no transaction-wide SET LOCAL): a table a migration holds must not
    keep `run --once` from exiting. The pooled connection's setting is put back after."""
    conn.execute(f"SET lock_timeout = {int(COMMAND_LOCK_TIMEOUT_MS)}")
    try:
        yield
    finally:
        with suppress(psycopg.Error):  # (a broken connection is discarded by the pool)
            conn.execute("SET lock_timeout = 0")


# A metrics address another process holds (two instances, one port), or one not (yet) on
# this host (an interface still coming up): a restart may find it free, so not 78.
_ADDRESS_TAKEN_OR_NOT_YET_UP = (errno.EADDRINUSE, errno.EADDRNOTAVAIL)


class MetricsAddressUnavailable(Exception):
    """SOKRATOS_METRICS_ADDR cannot be bound now: ``serve`` exits 75 (systemd restarts it)."""

    def __init__(self, addr: str, exc: OSError) -> None:
        super().__init__(f"{addr}: {exc.strerror or exc}")
        self.addr = addr
        self.reason = exc.strerror or str(exc)
        taken = exc.errno == errno.EADDRINUSE
        self.held_by = port_holder(parse_addr(addr)[1]) if taken else None

    def said(self) -> dict[str, str | None]:
        """The log line's fields: the address, why, what holds it, and what to do."""
        return {
            "addr": self.addr,
            "error": self.reason,
            "held_by": self.held_by,
            "hint": "another process listens there (a second worker on the same"
            " SOKRATOS_METRICS_ADDR?) or the address is not on this host yet: give each"
            " worker its own port; systemd restarts the worker (exit 75)",
        }


def new_worker_id(instance: str | None = None) -> str:
    """Unique per process: host, template instance, pid and a random suffix (pids are reused)."""
    host = f"{socket.gethostname()}@{instance}" if instance else socket.gethostname()
    return f"{host}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


@dataclass
class Worker:
    """One process's runner and the services around it."""

    settings: Settings
    database: Database
    handlers: Handlers
    context: HandlerContext
    worker_id: str = field(default_factory=new_worker_id)
    notifier: Notifier = field(default_factory=Notifier)
    metrics: Metrics = field(default_factory=Metrics)
    runner: Runner = field(init=False)
    watchdog: DispatcherWatchdog = field(init=False)
    _stop: threading.Event = field(default_factory=threading.Event)
    stops: StopRequests = field(default_factory=StopRequests)
    email_sessions: OpenSessions = field(default_factory=OpenSessions)
    database_contact: DatabaseContact = field(default_factory=DatabaseContact)
    heartbeats: BackgroundWrites = field(init=False)

    @property
    def exit_code(self) -> int:
        """What serve() returns: 0, or stop_with()'s code when no operator signal came first."""
        return self.stops.exit_code

    def __post_init__(self) -> None:
        # A change of state's heartbeat row, written out of the state's report lock.
        self.heartbeats = BackgroundWrites(self._record_heartbeat, name="heartbeat_writer")
        # A write left running when the pool closes would fail and log into what runs next.
        self.database.before_close(self._close_heartbeat_writer)
        # (Its callbacks read the runner, built next: the runner reports progress to it.)
        self.watchdog = DispatcherWatchdog(
            self.notifier,
            dispatcher_pid=lambda: self.runner.dispatcher_backend_pid,
            conninfo=self.database.conninfo,
            running_status=self._running_status,
        )
        self.runner = Runner(
            settings=self.settings,
            database=self.database,
            handlers=self.handlers,
            worker_id=self.worker_id,
            on_state=self._on_state,
            on_progress=self.watchdog.progressed,
            on_item_done=lambda q, kind, secs: self.metrics.item_settled(q.value, kind, secs),
            # Each claim, settle and renewal reports how its contact ended: a worker that works
            # is ready again at once, not at the next heartbeat or scrape.
            on_database_contact=self.database_contact.report,
        )
        # The state it starts in: the gauge is otherwise set on a change, and a worker that
        # never changes state (no backend configured, say) exposed no sample at all.
        self.metrics.set_worker_state(self.reported_state()[0])

    def reported_state(self) -> tuple[str, str]:
        """The state and why, as the heartbeat, sd_notify and the metrics report it."""
        return self._reported(self.runner.state, self.runner.state_detail)

    def _reported(self, state: str, detail: str) -> tuple[str, str]:
        # A runner with no handler claims nothing while "running": a monitor must not read
        # that as healthy (contract §1: running / waiting for database / no backend).
        if state == State.RUNNING and not self.runner.queues:
            # With a chat configured, it is the handler factory that left the queues out.
            if self.context.chat is not None:
                return State.NO_BACKEND, "no queue handled: items wait in their queues"
            return State.NO_BACKEND, NO_BACKEND_CONFIGURED
        return state, detail

    # -- the tick --------------------------------------------------------------------

    def tick(self) -> None:
        """One heartbeat: spool import, wake the dispatcher, heartbeat row, report. (Email is
        checked by its own thread, so a slow server never holds up a heartbeat.)"""
        self.report(self.tick_without_report())
        if self.runner.state == State.RUNNING:  # other states say why on their own
            self.notifier.status(self._running_status())

    def tick_without_report(self) -> int:
        """The tick up to its report; returns the spool files imported. ``run --once`` reports
        after its drain: one tick_finished with the import and the drain's counts."""
        imported = self._safely(
            "spool_import",
            lambda: import_spool(
                self.settings.spool_dir, self.database, self.settings.database_identity
            ),
        )
        self.runner.wake(notified=False)
        self.beat()
        return int(imported or 0)

    def beat(self) -> None:
        """The heartbeat of the tick and of ``run --once``'s drain: the heartbeat row, and the
        slots that wait for a lock named."""
        self._record_heartbeat()
        self._safely("slot_lock_look", self.name_slot_lock_waits)

    def name_slot_lock_waits(self) -> None:
        """Name the locks busy slots have waited for longer than SLOT_LOCK_REPORT_S (a settle
        behind an index build on `memories`, a transaction left open): the dispatcher's own
        waits are named by the watchdog, and a worker whose every slot waited looked healthy
        (pings, /readyz, status) with nothing in the log."""
        pids = self.database.held_backend_pids()
        if not pids:
            return
        with self.database.connection() as conn, time_limited(conn, TICK_STATEMENT_TIMEOUT_MS):
            waits = status_store.lock_waits_of(conn, pids, SLOT_LOCK_REPORT_S)
        for pid, waited_s, wait in waits:
            log.warning(
                "slot_waits_for_lock",
                pid=pid,
                waited_s=round(waited_s),
                tables=list(wait.tables),
                held_by=list(wait.blockers),
                hint="an item's reads or settle wait for another session's lock (a"
                " migration, an index build, a transaction left open); it goes on once that"
                " ends, its lease renewed meanwhile: end the holder if it should not be there",
            )

    def _running_status(self) -> str:
        state, why = self.reported_state()
        if state != State.RUNNING:  # read afresh: the caller's look at the state may be stale
            return (f"{state}: {why}" if why else state)[:200]
        if (waiting := self.watchdog.lock_wait) is not None:
            return f"{State.RUNNING}: {waiting.describe()}"[:200]
        queues = ", ".join(q.value for q in self.runner.queues)
        busy = f"{self.runner.inflight_count()} of {self.settings.concurrency} items in flight"
        return f"{State.RUNNING}: {busy}; queues {queues}"

    def check_email(self) -> None:
        """Check every due account; one broken account never stops the others."""
        from sokratos_worker.email.check import check_due_accounts  # noqa: PLC0415

        self._safely(
            "email_check",
            lambda: check_due_accounts(
                self.settings, self.database.conninfo, sessions=self.email_sessions
            ),
        )

    def email_forever(self) -> None:
        """Check due accounts at start, then every minute until stopping (the email thread)."""
        every = min(EMAIL_CHECK_EVERY_S, self.settings.email_check_interval)
        while not self._stop.is_set():
            self.check_email()
            self._stop.wait(every)

    def maintenance(self) -> None:
        """Retention: processed_emails, the optional failed_operations TTL, old heartbeats."""

        def prune() -> dict[str, int]:
            with self.database.connection() as conn, _lock_waits_limited(conn):
                return {
                    "processed_emails": email_store.prune_processed_emails(
                        conn, self.settings.processed_emails_ttl_days
                    ),
                    "failed_operations": failures_store.purge_failures(
                        conn, older_than_days=self.settings.failed_ops_ttl_days
                    )
                    if self.settings.failed_ops_ttl_days > 0
                    else 0,
                    "worker_heartbeats": status_store.prune_heartbeats(
                        conn, older_than_s=7 * 86400
                    ),
                }

        pruned = self._safely("maintenance", prune)
        if pruned:
            log.info("maintenance_finished", pruned=pruned)

    def warn_of_other_embeddings(self) -> None:
        """Warn when memories carry embeddings of another model or dimension than configured
        (``run`` calls it in a thread of its own: neither the start nor a stop waits on it)."""

        def look() -> None:
            try:
                with (
                    self.database.connection() as conn,
                    time_limited(conn, EMBEDDING_LOOK_TIMEOUT_MS),
                ):
                    unreachable = embedding_mismatch(self.settings, conn)
            except pg_errors.QueryCanceled:
                log.warning(
                    "embedding_look_given_up",
                    timeout_s=EMBEDDING_LOOK_TIMEOUT_MS / 1000,
                    hint="memories could not be read in time (a lock on memories, a slow"
                    " server): whether some carry embeddings of another model is not known;"
                    " 'sokratos-worker check' tells",
                )
                return
            if unreachable:  # warned, not refused: changing the embedding model is legitimate
                log.warning("memories_of_another_embedding_model", warning=unreachable)

        self._safely("embedding_look", look)

    def _safely(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except DatabaseUnavailable as exc:
            self._contact_failed(exc)
            log.warning(f"{what}_skipped", reason="database unavailable", error=str(exc))
        except (pg_errors.LockNotAvailable, pg_errors.QueryCanceled) as exc:
            cut = (
                "it gave up waiting for a lock another session holds on a table"
                if isinstance(exc, pg_errors.LockNotAvailable)
                else "PostgreSQL cancelled it at its statement timeout: is a table locked?"
            )
            log.warning(
                f"{what}_timed_out",
                error=str(exc).strip(),
                hint=f"{cut} (a migration, a transaction left open?); it runs again at its"
                " next turn",
            )
        except Exception:
            log.exception(f"{what}_failed")
        return None

    def _record_heartbeat(self) -> None:
        state, why = self.reported_state()
        detail = {
            "backends": [
                {**s.detail, "name": s.name, "circuit": s.circuit} for s in self._backend_states()
            ],
            "concurrency": self.settings.concurrency,
            # (status shows the worker's own embedding configuration, not the caller's)
            "embeddings": "configured" if self.settings.embeddings_enabled else "not configured",
            "heartbeat_s": self.settings.heartbeat_interval,  # (status: overdue past 3x this)
            "in_flight": self.runner.inflight_count(),
            "queues": [q.value for q in self.runner.queues],
            "why": why,
        }
        if (waiting := self.watchdog.lock_wait) is not None:
            detail["lock_wait"] = waiting.describe()  # (status: "running (claiming waits ...)")
        self._safely(
            "heartbeat",
            lambda: self._write_heartbeat(state, detail),
        )

    def _close_heartbeat_writer(self) -> None:
        if not self.heartbeats.close(HEARTBEAT_WRITER_CLOSE_WAIT_S):
            log.warning(
                "heartbeat_writer_still_running",
                waited_s=HEARTBEAT_WRITER_CLOSE_WAIT_S,
                hint="a heartbeat write waits on the database; the pool closes without it",
            )

    def record_stopped(self) -> None:
        """The last heartbeat: ``status`` no longer lists this process as live."""
        self._safely("heartbeat", lambda: self._write_heartbeat("stopped", {}))

    def _write_heartbeat(self, state: str, detail: dict[str, Any]) -> None:
        with (
            self.database.connection() as conn,
            time_limited(conn, TICK_STATEMENT_TIMEOUT_MS),
        ):
            status_store.record_heartbeat(
                conn,
                worker_id=self.worker_id,
                hostname=socket.gethostname(),
                pid=os.getpid(),
                version=build_version(),
                state=state,
                detail=detail,
            )
        self.database_contact.succeeded()

    def _backend_states(self) -> list[Any]:
        chat = self.context.chat
        return list(chat.states()) if chat is not None else []

    def report(self, imported: int, state: str | None = None) -> None:
        """The tick's ``tick_finished``: what it did per queue since the last report, and
        ``state`` (by default the worker's now: ``run --once`` gives the drain's end's)."""
        # None (null) when the look failed: an empty list would say there were no failures.
        recent = self._safely("recent_failures", self._recent_failures)
        # Taken after the look, which may wait seconds: a stop meanwhile abandons this tick,
        # and the counts taken before it were in no line (worker_stopped has what is left).
        stats = self.runner.take_stats()
        log.info(
            "tick_finished",
            # What this tick did per queue; "handled" says which queues this worker drains
            # (none without a backend: then the empty counts do not mean an empty queue).
            queues=_per_queue(stats.counts),
            handled=[q.value for q in self.runner.queues],
            backends=dict(stats.backends),
            spool_imported=imported,
            recent_failures=recent,
            state=state or self.reported_state()[0],
        )
        self.metrics.tick_finished(time.time())

    def _recent_failures(self) -> list[dict[str, Any]]:
        with self.database.connection() as conn, time_limited(conn, TICK_STATEMENT_TIMEOUT_MS):
            rows = failures_store.recent_failures(conn, hours=6)
        return [
            {
                "op_type": r["op_type"],
                "count": r["count"],
                "last_error": r["last_error"],
                # (the server's text when no datetime holds it: 'infinity')
                "last_at": r["last_at"]
                if isinstance(r["last_at"], str)
                else r["last_at"].isoformat(),
            }
            for r in rows
        ]

    # -- state ---------------------------------------------------------------------

    def _on_state(self, state: str, detail: str) -> None:
        state, detail = self._reported(state, detail)
        text = state if not detail else f"{state}: {detail}"
        self.notifier.status(text[:200])
        self.metrics.set_worker_state(state)
        # (The runner reports its contacts itself, as they end: a state change is no contact,
        # "running" after a wait may come with every slot busy and no claim sent.)
        self.metrics.set_database_up(self._ready())
        if state in (State.WAITING_FOR_DATABASE, State.NO_BACKEND):
            log.warning("worker_state", state=state, detail=detail)
        else:
            log.info("worker_state", state=state)
        if state in (State.NO_BACKEND, State.RUNNING, State.STOPPING):
            # At once, not at the next tick: `status` said "running" for up to a heartbeat, and
            # through the stop's grace. In a thread: this runs under the state's report lock,
            # which the stop waits for, and the database may be away; a late write cannot undo
            # "stopped", which is final. (Waiting for the database could not be written.)
            self.heartbeats.request()

    # -- LISTEN/NOTIFY ------------------------------------------------------------------

    def listen_forever(self) -> None:
        """Wake the runner on every NOTIFY; reconnect by itself and drain after reconnecting."""
        delay = 0.5
        failures = 0  # in a row: the first is said, the rest of an outage's are debug
        while not self._stop.is_set():
            try:
                with connect(self.database.conninfo, worker_settings=True) as conn:
                    conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                    self.database_contact.succeeded()
                    log.info("listening", channel=NOTIFY_CHANNEL)
                    self.runner.wake(notified=False)  # whatever arrived while we were away
                    delay, failures = 0.5, 0
                    while not self._stop.is_set():
                        for _ in conn.notifies(timeout=1.0, stop_after=1):
                            self.runner.wake()
            except Exception as exc:
                if self._stop.is_set():
                    return  # the database went away because we are stopping: not news
                # The first to know of an outage while the runner idles: /readyz says so now.
                self._listener_failed(exc)
                failures += 1
                (log.warning if failures == 1 else log.debug)(
                    "listen_reconnecting",
                    error=str(exc).strip(),
                    retry_in_s=delay,
                    hint="new work is still found at each heartbeat meanwhile; 'listening'"
                    " says when it is back",
                )
            self._stop.wait(delay)
            delay = min(delay * 2, 10.0)

    # -- the whole life -----------------------------------------------------------------

    def serve(self) -> int:
        """Run until SIGTERM/SIGINT/SIGHUP or :meth:`stop_with`; then drain within the grace.

        Returns :attr:`exit_code`: 0, or the code :meth:`stop_with` set."""
        faulthandler.enable()
        self.install_signals()
        try:
            metrics_server = self._start_metrics()
        except MetricsAddressUnavailable as exc:
            log.error("metrics_address_unavailable", **exc.said(), exit_code=EXIT_TEMPFAIL)
            return EXIT_TEMPFAIL
        jobs = DaemonThreadExecutor()
        scheduler = self._start_scheduler(jobs)
        listener = threading.Thread(target=self.listen_forever, name="listener", daemon=True)
        listener.start()
        self._watch_embedded_postgres()
        email = self._start_email_thread()
        # What start-up built lives as long as the process: leave it out of the full
        # collections, which otherwise paused every slot for ~25 ms (bench/README.md).
        gc.collect()
        gc.freeze()
        self.runner.start()
        self.tick()
        self.notifier.ready(self._running_status())
        log.info(
            "worker_started",
            worker_id=self.worker_id,
            version=build_version(),
            concurrency=self.settings.concurrency,
            queues=[q.value for q in self.runner.queues],
            heartbeat_s=self.settings.heartbeat_interval,
        )
        clock = ClockStepWatch()
        while not self.notice_signal():
            self._stop.wait(SIGNAL_POLL_S)
            self.watchdog.look()
            if step := clock.stepped():
                run_jobs_now(scheduler, step)
        self.notifier.stopping(f"{State.STOPPING}: finishing items in flight")
        log.info(
            "worker_stopping",
            grace_s=self.settings.shutdown_grace,
            in_flight=self.runner.inflight_count(),
        )
        stop_by = time.monotonic() + self.settings.shutdown_grace
        scheduler.shutdown(wait=False)
        released = self.runner.shutdown(self.settings.shutdown_grace)
        self._wait_for_email_thread(email, stop_by)
        self.record_stopped()
        if metrics_server is not None:
            metrics_server.stop()
        if stuck := jobs.running():
            log.warning(
                "jobs_abandoned_at_exit",
                jobs=stuck,
                hint="still waiting (on a locked table?); the process exits without them and"
                " what they committed stays; they run again at the next start",
            )
        log.info(
            "worker_stopped",
            released=released,
            exit_code=self.exit_code,
            # What was settled since the last tick_finished (the grace's items among them), in
            # its shape: the counts of every report add up to every item this process ended.
            queues=self._counts_since_last_report(),
        )
        return self.exit_code

    def _watch_embedded_postgres(self) -> None:
        """On the embedded PostgreSQL, stop with exit 75 once its server died: nothing else
        would start it again, and the service manager's restart of the worker does."""
        server = watched_server(self.database.conninfo)
        if server is None:
            return
        watch_postmaster(
            server,
            stopping=self._stop,
            on_death=lambda: self.stop_with(EXIT_TEMPFAIL, "embedded_postgres_died"),
        )

    def _counts_since_last_report(self) -> dict[str, dict[str, int]]:
        return _per_queue(self.runner.take_stats().counts)

    def stop_with(self, code: int, reason: str) -> None:
        """From any thread: stop as SIGTERM would (items in flight finish), then exit ``code``
        (the local model server that keeps dying, the embedded PostgreSQL that died) unless an
        operator's signal came first."""
        self.stops.request(code, reason)

    @property
    def stop_requested(self) -> bool:
        """A stop signal arrived, or :meth:`stop_with` asked for a stop."""
        return self.stops.requested

    def install_signals(self) -> None:
        """SIGTERM, SIGINT and SIGHUP stop claiming and let items in flight finish (a hangup,
        such as a closed terminal, would otherwise kill the process with items leased); the
        main thread acts on them in :meth:`notice_signal`. A second signal's exit writes the
        "stopped" heartbeat first."""
        self.stops.last_words = self._stopped_at_exit_now()
        self.stops.install()

    def _stopped_at_exit_now(self) -> Callable[[], dict[str, Any] | None]:
        """The "stopped" heartbeat for a second signal's exit, on a connection of its own (the
        pool's lock may be held by the code the signal interrupted), with nothing logged (the
        log's lock may be too); what it needs is read now, not then."""
        conninfo, worker_id = self.database.conninfo, self.worker_id
        hostname, version = socket.gethostname(), build_version()

        def write() -> dict[str, Any] | None:
            try:
                with (
                    connect(conninfo, timeout=LAST_WORDS_BUDGET_S) as conn,
                    time_limited(conn, int(LAST_WORDS_BUDGET_S * 1000)),
                ):
                    status_store.record_heartbeat(
                        conn,
                        worker_id=worker_id,
                        hostname=hostname,
                        pid=os.getpid(),
                        version=version,
                        state="stopped",
                        detail={"exited": "second stop signal"},
                    )
            except Exception as exc:
                return {
                    "event": "stopped_heartbeat_not_written",
                    "level": "warning",
                    "error": str(exc).strip() or type(exc).__name__,
                    "hint": "status shows this worker stopping until its heartbeat goes stale",
                }
            return None

        return write

    def notice_signal(self) -> bool:
        """In the main thread: act on a recorded stop signal or :meth:`stop_with` (stop
        claiming); True once stopping."""
        stops = self.stops
        signal_name, internal = stops.signal_name, stops.internal_reason
        if signal_name is None and internal is None:
            return False
        if signal_name is not None and not stops.signal_logged:
            stops.signal_logged = True
            log.info(
                "signal_received",
                signal=signal_name,
                hint="finishing items in flight; a second signal exits at once",
            )
        elif signal_name is None and not self._stop.is_set():
            log.info(
                "stop_requested",
                reason=internal,
                exit_code=self.exit_code,
                hint="finishing items in flight; the first stop signal lets them finish,"
                " a second exits at once",
            )
        if not self._stop.is_set():
            self._stop.set()
            self.runner.request_stop()
            self._cut_email_sessions()
        return True

    def _cut_email_sessions(self) -> None:
        """Cut the IMAP session in progress (and refuse new ones): a stop never waits on mail."""
        cut = self.email_sessions.cut_all()
        if cut:
            log.info(
                "email_sessions_cut",
                sessions=cut,
                hint="the accounts are checked again at the next start; nothing is lost",
            )

    def _start_email_thread(self) -> threading.Thread | None:
        if not self.settings.email_accounts or self.settings.email_check_interval <= 0:
            return None
        # A daemon thread: one stuck past its cut (in the database, say) never holds the exit.
        thread = threading.Thread(target=self.email_forever, name="email", daemon=True)
        thread.start()
        return thread

    def _wait_for_email_thread(self, thread: threading.Thread | None, stop_by: float) -> None:
        if thread is None:
            return
        thread.join(max(0.0, min(EMAIL_STOP_WAIT_S, stop_by - time.monotonic())))
        if thread.is_alive():
            log.warning(
                "email_check_abandoned",
                hint="the check did not end after its session was cut; the process exits"
                " without it, and what it committed stays (the account is checked again)",
            )

    def _start_scheduler(self, jobs: DaemonThreadExecutor) -> BackgroundScheduler:
        scheduler = BackgroundScheduler(
            executors={"default": jobs},
            job_defaults={"coalesce": True, "max_instances": 1},
            timezone="UTC",
            logger=scheduler_logger(),
        )
        interval = self.settings.heartbeat_interval
        scheduler.add_job(
            self.tick,
            "interval",
            seconds=interval,
            id="heartbeat",
            misfire_grace_time=max(1, int(interval)),
        )
        scheduler.add_job(
            self.maintenance,
            "interval",
            hours=1,
            id="maintenance",
            misfire_grace_time=3600,
            next_run_time=datetime.now(UTC) + timedelta(seconds=MAINTENANCE_FIRST_RUN_AFTER_S),
        )
        scheduler.add_listener(
            log_job_event, EVENT_JOB_ERROR | EVENT_JOB_MISSED | EVENT_JOB_MAX_INSTANCES
        )
        scheduler.start()
        return scheduler

    def _start_metrics(self) -> MetricsServer | None:
        if not self.settings.metrics_addr:
            return None
        self.metrics.on_scrape(self._refresh_metrics)
        server = MetricsServer(self.settings.metrics_addr, self.metrics, readiness=self._ready)
        try:
            server.start()
        except OSError as exc:
            if exc.errno in _ADDRESS_TAKEN_OR_NOT_YET_UP:
                raise MetricsAddressUnavailable(self.settings.metrics_addr, exc) from exc
            # (a host name that resolves to nothing, a port below 1024 without the right)
            raise ConfigError(
                "SOKRATOS_METRICS_ADDR",
                f"{self.settings.metrics_addr} cannot be served: {exc.strerror or exc}",
            ) from exc
        log.info("metrics_listening", addr=self.settings.metrics_addr)
        return server

    def _listener_failed(self, exc: Exception) -> None:
        """Record an outage for the LISTEN connection's failure, unless the server answered
        it (a connection limit refused it: the pool's connections still work)."""
        if isinstance(exc, DatabaseUnavailable):
            self._contact_failed(exc)
        else:
            self.database_contact.failed()

    def _contact_failed(self, exc: DatabaseUnavailable) -> None:
        """Record an outage, unless ``exc`` shows a reachable database (a locked table, a pool
        whose every connection stayed lent)."""
        if not reached_database(exc):
            self.database_contact.failed()

    def _ready(self) -> bool:
        """The worker reaches PostgreSQL: its runner does not wait for it, and the latest
        contact of any path (claims, listener, heartbeat, scrape) succeeded. No query."""
        return self.runner.state != State.WAITING_FOR_DATABASE and self.database_contact.reachable

    def _refresh_metrics(self, metrics: Metrics) -> None:
        in_flight = self.runner.inflight_by_queue()
        for queue in Queue:
            metrics.set_in_flight(queue.value, in_flight.get(queue, 0))
        # The breakers are in memory: a circuit that opened since the last tick shows now.
        for backend in self._backend_states():
            metrics.set_circuit(backend.name, backend.circuit)
        try:
            # A scrape must answer: a huge backlog, or a table a migration holds locked, is
            # cut off and the last values are served.
            with (
                self.database.connection() as conn,
                time_limited(conn, METRICS_STATEMENT_TIMEOUT_MS),
            ):
                queues = status_store.queue_stats(conn)
                failures = status_store.failures_24h(conn)
        except pg_errors.QueryCanceled:
            log.warning(
                "metrics_refresh_slow",
                timeout_ms=METRICS_STATEMENT_TIMEOUT_MS,
                hint="the queue and failure gauges keep their last values; is a table locked"
                " (a migration, a long transaction) or the backlog very large?",
            )
        except PoolBusy as exc:
            log.warning(
                "metrics_refresh_slow",
                error=str(exc),
                hint="the queue and failure gauges keep their last values; readiness stays as"
                " it was (the server answers)",
            )
        except DatabaseUnavailable as exc:
            self._contact_failed(exc)
        else:
            # (up again: nothing else sets it back while an idle runner sees no state change)
            self.database_contact.succeeded()
            metrics.set_queues(queues)
            metrics.set_failures(failures)
        # What /readyz answers, so the two never disagree within a scrape.
        metrics.set_database_up(self._ready())


def _per_queue(counts: Mapping[str, Mapping[str, int]]) -> dict[str, dict[str, int]]:
    """A report's counts, per queue then per outcome (as ``tick_finished`` logs them)."""
    return {queue: dict(by_kind) for queue, by_kind in counts.items()}


def build_worker(
    settings: Settings,
    database: Database,
    handler_factory: HandlerFactory,
    chat: Any,
    embedder: Any,
    *,
    metrics: Metrics | None = None,
    notifier: Notifier | None = None,
) -> Worker:
    """Wire the handlers for this process."""
    context = HandlerContext(settings=settings, database=database, chat=chat, embedder=embedder)
    handlers = handler_factory(context)
    if not handlers:
        log.warning(
            "no_handlers",
            reason="no LLM backend configured (SOKRATOS_LLM_BACKENDS is empty)",
            effect="items wait in their queues; they are never failed for this",
        )
    return Worker(
        settings=settings,
        database=database,
        handlers=handlers,
        context=context,
        worker_id=new_worker_id(settings.worker_instance),
        metrics=metrics or Metrics(),
        notifier=notifier or Notifier(),
    )
