"""Assemble a worker process: migrations, pool, backends, handlers; then serve or tick once."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import structlog

from sokratos_worker.config import ConfigError, Settings, unknown_variables
from sokratos_worker.daemon import EMAIL_STOP_WAIT_S, SIGNAL_POLL_S, Worker, build_worker
from sokratos_worker.exit_codes import EXIT_OK, EXIT_TEMPFAIL
from sokratos_worker.handlers import HandlerContext, HandlerFactory, Handlers
from sokratos_worker.observed import ObservedChat
from sokratos_worker.schema_check import schema_problems
from sokratos_worker.service.metrics import Metrics
from sokratos_worker.service.sdnotify import Notifier
from sokratos_worker.store import queue_sql
from sokratos_worker.store.connection import Database
from sokratos_worker.store.migrations import apply_migrations, history_differences
from sokratos_worker.store.sessions import refuse_shared_sessions
from sokratos_worker.worker_state import State

log = structlog.get_logger(__name__)

POOL_READY_TIMEOUT_S = 10.0
# While migrations wait for another migrator or run, systemd's start timeout is extended by
# this, a third of it ahead: such a start is slow, not hung, and a new one would wait the same.
MIGRATION_EXTENSION_S = 30.0
# After them, the rest of the start (pool, schema check, local model, first tick) gets as long
# as the unit's TimeoutStartSec gives a whole start. systemd only ever moves the deadline
# later (EXTEND_TIMEOUT_USEC), so a longer TimeoutStartSec set in a drop-in still holds.
REST_OF_START_S = 120.0
# The local model server died past its restart limit: 75, a dependency that stays away, not 1
# (our bug) nor 78 (the file loaded before); systemd restarting the unit gives it a fresh start.
EXIT_LOCAL_MODEL_DIED = EXIT_TEMPFAIL


def default_handlers(context: HandlerContext) -> Handlers:
    """The production pipelines: triage and distillation."""
    from sokratos_worker.pipelines import build_handlers  # noqa: PLC0415

    return build_handlers(context)


@contextmanager
def backends(settings: Settings) -> Iterator[tuple[Settings, Any, Any, Any]]:
    """The chat client and embedder, with the local demonstration model when asked for (the
    fourth: its running :class:`LocalModelServer`, or None)."""
    from sokratos_worker.llm import build_chat_client, build_embedder  # noqa: PLC0415

    local = None
    if settings.local_model:
        from sokratos_worker.llm.local import LocalModelUnusable, start_local_server  # noqa: PLC0415

        try:
            local = start_local_server()
        except LocalModelUnusable as exc:
            # Starting again loads the same file: 78 keeps systemd from restarting for ever.
            raise ConfigError("SOKRATOS_LOCAL_MODEL", str(exc)) from None
        settings = settings.model_copy(
            update={"llm_backends": [*settings.llm_backends, local.backend]}
        )
        log.warning(
            "local_demonstration_model_enabled",
            backend=local.backend.name,
            warning="SmolLM2-135M is a tiny demonstration model: its memories are guesses."
            " Do not use SOKRATOS_LOCAL_MODEL=true with a real memory store.",
        )
    try:
        yield settings, build_chat_client(settings), build_embedder(settings), local
    finally:
        if local is not None:
            local.stop()


def _watch_local_model(local: Any, chat: Any, worker: Worker) -> None:
    """Restart the local model server when it dies; past the limit, stop the worker."""
    from sokratos_worker.llm.local import follow_backend  # noqa: PLC0415

    def give_up(reason: str) -> None:
        log.error("worker_exiting", reason=reason, exit_code=EXIT_LOCAL_MODEL_DIED)
        worker.stop_with(EXIT_LOCAL_MODEL_DIED, "local_model_gave_up")

    local.watch(on_moved=lambda config: follow_backend(chat, config), on_give_up=give_up)


def _migrate(conninfo: str, notifier: Notifier) -> None:
    """Apply pending migrations; under systemd, the start's timeout is extended meanwhile and
    STATUS= says what it waits for (another migrator's lock, a migration running)."""

    def show(text: str) -> None:
        notifier.status(f"starting: {text}")

    with notifier.extending_timeout(MIGRATION_EXTENSION_S):
        apply_migrations(conninfo, show)
    notifier.extend_timeout(REST_OF_START_S)
    notifier.status("starting: migrations up to date")


def _check_schema(settings: Settings, database: Database) -> None:
    """Refuse a schema the worker cannot use; warn of a migration history that differs.
    (Memories of another embedding model are looked for in the background: see
    ``Worker.warn_of_other_embeddings``.)"""
    with database.connection() as conn:
        problems = schema_problems(settings, conn)
        differences = [] if problems else history_differences(conn)
    if problems:
        raise problems[0]
    for difference in differences:  # warned, not refused: old workers run during an upgrade
        log.warning("migration_history_differs", difference=difference)


def run_worker(
    settings: Settings,
    conninfo: str,
    handler_factory: HandlerFactory | None,
    *,
    once: bool,
    migrate: bool,
    stopped: threading.Event | None = None,
) -> int:
    """``run`` and ``run --once``; ``stopped`` is set when a stop signal ended the run."""
    unknown = unknown_variables(settings=settings)
    if unknown:
        log.warning(
            "unknown_variables_ignored",
            variables=unknown,
            hint="a typo? every variable is listed in deploy/sokratos-worker.env.example",
        )
    notifier = Notifier()
    # Before the migration's advisory lock, which a transaction pooler would leak.
    refuse_shared_sessions(conninfo)
    if migrate:
        _migrate(conninfo, notifier)
    # What a full drain uses (slots, dispatcher, lease renewer) is opened at start: a pool
    # grows one connection at a time, so 20 slots settling at once waited for each other.
    database = Database(
        conninfo,
        size=settings.pool_size,
        keep_open=settings.concurrency + 2,
        configure=queue_sql.warm_up,
    )
    try:
        # Claim once they are open and warm, or every slot's first settle waits for one.
        if not database.wait_ready(POOL_READY_TIMEOUT_S):
            log.warning(
                "database_pool_not_full",
                wanted=settings.concurrency + 2,
                waited_s=POOL_READY_TIMEOUT_S,
                hint="starting anyway, with fewer connections; is the server's max_connections or"
                " the role's CONNECTION LIMIT too low for SOKRATOS_CONCURRENCY (each worker"
                " opens up to CONCURRENCY + 4; 'sokratos-worker check' compares them)?",
            )
        _check_schema(settings, database)
        with backends(settings) as (effective, chat, embedder, local):
            metrics = Metrics()
            observed = ObservedChat(chat, metrics) if chat is not None else None
            worker = build_worker(
                effective,
                database,
                handler_factory or default_handlers,
                observed,
                embedder,
                metrics=metrics,
                notifier=notifier,
            )
            if local is not None and chat is not None:
                _watch_local_model(local, chat, worker)
            # It reads up to 10,000 vectors: a lock on memories must hold up neither the start
            # nor a stop (the thread is a daemon's, abandoned at exit).
            threading.Thread(
                target=worker.warn_of_other_embeddings, name="embedding-look", daemon=True
            ).start()
            code = _once_restoring_signals(worker) if once else worker.serve()
            if stopped is not None and worker.stop_requested and worker.exit_code == EXIT_OK:
                stopped.set()
            return code
    finally:
        database.close()


def _once_restoring_signals(worker: Worker) -> int:
    """``run_once``, then the signal handlers as they were (the demo runs several rounds)."""
    stop_signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {signum: signal.getsignal(signum) for signum in stop_signals}
    try:
        return run_once(worker)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _check_email_watching_signals(worker: Worker) -> None:
    """The due email checks, in a thread: a stop signal cuts a session a slow server holds
    (the main thread must stay free to act on it).

    Waited for as long as the checks' IMAP deadlines allow, and after a stop signal as long as
    ``serve`` waits: a check waiting on a lock in the database (a migration, a transaction
    left open) has no deadline of its own, and must not keep the drain or the exit waiting.
    """
    settings = worker.settings
    if not settings.email_accounts or settings.email_check_interval <= 0:
        return
    thread = threading.Thread(target=worker.check_email, name="email", daemon=True)
    thread.start()
    give_up_at = (
        time.monotonic() + len(settings.email_accounts) * settings.email_check_deadline
    ) + EMAIL_STOP_WAIT_S
    while thread.is_alive() and time.monotonic() < give_up_at:
        thread.join(SIGNAL_POLL_S)
        if worker.notice_signal():
            give_up_at = min(give_up_at, time.monotonic() + EMAIL_STOP_WAIT_S)
    if thread.is_alive():
        log.warning(
            "email_check_abandoned",
            hint="the check is still waiting (on a lock in the database, or a server past its"
            " deadline); the tick goes on without it, and what it committed stays (the"
            " account is checked again at the next tick)",
        )


class _DrainHeartbeats:
    """The daemon tick's heartbeat (its row, and the slots waiting for a lock named) every
    SOKRATOS_HEARTBEAT_INTERVAL while ``run --once`` drains, from a thread of its own: a write
    waiting on the database (away, or its table locked) must not hold up the main thread's
    answer to a stop signal. A row already 'stopped' is final, so a late write cannot undo
    the last one."""

    def __init__(self, worker: Worker) -> None:
        self._worker = worker
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="drain-heartbeats", daemon=True)

    def __enter__(self) -> _DrainHeartbeats:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._done.set()

    def _run(self) -> None:
        while not self._done.wait(self._worker.settings.heartbeat_interval):
            self._worker.beat()


def _retention_watching_signals(worker: Worker) -> None:
    """Retention (the TTLs, old heartbeat rows) after the drain, in a thread: timer-driven
    workers never run the daemon's hourly job, and a stop signal must not wait on a purge.

    A stop abandons it: what it deleted stays deleted, and the next run goes on from there.
    """
    thread = threading.Thread(target=worker.maintenance, name="maintenance", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(SIGNAL_POLL_S)
        if worker.notice_signal():
            break
    if thread.is_alive():
        log.warning(
            "maintenance_abandoned",
            hint="a stop signal came while retention ran; what it deleted stays deleted, and"
            " the next run prunes the rest",
        )


def _report_stuck_drain(worker: Worker) -> str:
    """The drain's dispatcher never came back from a statement: say what it waits for."""
    waiting = worker.watchdog.dispatcher_lock_wait()
    reason = (
        waiting.describe()
        if waiting is not None
        else "the dispatcher's statement did not return (a lock, or a server not answering)"
    )
    log.warning(
        "run_once_drain_stuck",
        reason=reason,
        held_by=list(waiting.blockers) if waiting is not None else [],
        hint="the run ends without it and the items wait for the next; "
        + (
            "another session holds a queue table (a migration, a transaction left open?):"
            f" SELECT pg_terminate_backend({waiting.blockers[0]['pid']}) ends it"
            if waiting is not None
            else "the worker's session in pg_stat_activity says what its statement waits for"
        ),
    )
    return reason


def run_once(worker: Worker) -> int:
    """One heartbeat tick: spool, due email checks, then drain what is ready now.

    Exits 75 when the drain stopped because no LLM backend or the database could be reached:
    items were left waiting, which a timer-driven unit would otherwise never see.
    """
    worker.install_signals()  # a stopped timer unit must not leave its items leased
    imported = worker.tick_without_report()
    _check_email_watching_signals(worker)
    worker.notice_signal()  # (a signal during the email checks: claim nothing)
    log.info("run_once_draining", spool_imported=imported, budget_s=worker.settings.tick_budget)
    worker.runner.start(drain_only=True, budget_s=worker.settings.tick_budget)
    deadline = time.monotonic() + worker.settings.tick_budget + worker.settings.shutdown_grace + 10
    stopping = False
    with _DrainHeartbeats(worker):
        while not worker.runner.wait_drained(SIGNAL_POLL_S) and time.monotonic() < deadline:
            if not stopping and worker.notice_signal():
                stopping = True
                # The drain gives items in flight the grace; a dispatcher stuck in a statement
                # (a queue table locked by a migration) must not hold the stop past it.
                deadline = min(deadline, time.monotonic() + worker.settings.shutdown_grace + 2)
    paused = worker.runner.state in (State.NO_BACKEND, State.WAITING_FOR_DATABASE)
    reason = worker.runner.state_detail
    drained_in = worker.reported_state()[0]  # (the shutdown below makes it "stopping")
    if not worker.runner.wait_drained(0):
        paused, reason = True, _report_stuck_drain(worker)
    # After a stop signal the drain has already given its items the grace.
    released = worker.runner.shutdown(
        0 if worker.stop_requested else worker.settings.shutdown_grace
    )
    worker.report(imported, drained_in)  # the tick's one tick_finished (contract §6)
    if not worker.stop_requested and not paused:  # (paused: the database may be away too)
        _retention_watching_signals(worker)
    worker.record_stopped()  # or `status` shows it running until its heartbeat goes stale
    if worker.stop_requested:
        log.info("run_once_stopped", released=released)
        return worker.exit_code
    if paused:
        log.warning(
            "run_once_incomplete",
            reason=reason,
            hint="items are left waiting; the next run takes them once what the reason names"
            " is back ('sokratos-worker check' says what is wrong)",
        )
        return EXIT_TEMPFAIL
    return EXIT_OK
