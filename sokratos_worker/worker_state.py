"""The worker's state (running, waiting for the database, no backend, stopping) and why.

The runner's threads tell a :class:`WorkerState` what they meet: the dispatcher's claims, the
slots' settles and the lease renewer how each contact with PostgreSQL ended
(:meth:`~WorkerState.database_lost`, :meth:`~WorkerState.database_back`), a settle that no
backend can be reached (:meth:`~WorkerState.pause`), the stop that it stops
(:meth:`~WorkerState.set`). The dispatcher asks it whether claiming is paused and, once the
pause is over, to probe the backends and resume (:meth:`~WorkerState.maybe_resume`).

The rules: an outage turns running into waiting for the database, and its end turns waiting
back into running; a backend pause and a stop outlast any outage; a resume during an outage
goes back to waiting. A queue whose claims the server refuses (a privilege revoked) keeps the
worker waiting until a claim from that queue is accepted (:meth:`~WorkerState.claim_refused`,
:meth:`~WorkerState.claim_accepted`): the other queue's contacts do not end it. Each outage
and its end are said once, by whichever thread meets them, and each change of state is
reported to the daemon (``on_state``: sd_notify, metrics, heartbeat) once, the last report
being of the latest state.

Its lock guards the state alone (the runner's in-flight lock guards the items and the stats):
no other lock is taken while it is held.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path

import structlog

from sokratos_worker.errors import (
    ClaimRefused,
    ConnectionLimitReached,
    DatabaseUnavailable,
    PoolBusy,
    TableLocked,
    reached_database,
)
from sokratos_worker.handlers import Handler
from sokratos_worker.model import Queue
from sokratos_worker.policy import describe
from sokratos_worker.store.connection import server_short_of_a_resource
from sokratos_worker.store.embedded import held_here

log = structlog.get_logger(__name__)

_AWAY = (
    "items in flight keep their leases and settle when PostgreSQL answers again; nothing is lost."
)


def away_hint(embedded_data_dir: Path | None) -> str:
    """What to look at when the database is away: the URL's server, or the embedded one (in
    ``embedded_data_dir``) when the worker runs it (no URL is set: naming one misled)."""
    if embedded_data_dir is None:
        return (
            f"{_AWAY} Is the server up, and SOKRATOS_DATABASE_URL right? ('sokratos-worker"
            " check' tells)"
        )
    return (
        f"{_AWAY} The embedded PostgreSQL in {embedded_data_dir} is not answering: if its"
        " server died, the worker exits (75) so that its service manager starts both again;"
        " the server's log is the file 'log' in that directory"
    )


def _embedded_data_dir() -> Path | None:
    """The data directory of the embedded server this process runs on, if any."""
    held = held_here()
    return held[0].data_dir if held else None


_LOCKED_HINT = (
    "another session holds a queue table locked (dispatcher_waiting_for_lock names it); claiming"
    " goes on when it lets go, and nothing is lost"
)
_BUSY_HINT = (
    "the server answers, but every pooled connection stayed in use (slow statements, lock"
    " waits); claiming goes on when one comes free, and nothing is lost"
)

_LIMIT_HINT = (
    "the server answers, but refused the pool another connection for a limit (the role's or"
    " database's CONNECTION LIMIT, max_connections); claiming goes on when a connection comes"
    " free, and nothing is lost. Raise the limit, or lower SOKRATOS_CONCURRENCY"
    " ('sokratos-worker check' compares them)"
)


_REFUSED_HINT = (
    "the server answers, but refuses the claim itself (a privilege revoked from the worker's"
    " role, a table or function missing): items wait, nothing is lost, and claiming resumes"
    " by itself once it is fixed: run sql/roles.sql (and 'sokratos-worker migrate') as the"
    " tables' owner; 'sokratos-worker check' names what is missing"
)


_SHORT_HINT = (
    "the server answers, but refuses writes for want of disk space or memory (SQLSTATE 53100,"
    " 53200): free space on the disk that holds PostgreSQL's data, WAL or tablespace (or"
    " memory on its host); items wait, their refused settles cost this worker's claims no"
    " attempt (up to three times an item), and the worker goes on by itself once there is room"
)


def _waiting_hint(exc: DatabaseUnavailable) -> str:
    if server_short_of_a_resource(exc):
        return _SHORT_HINT
    if isinstance(exc, ClaimRefused):
        return _REFUSED_HINT
    if isinstance(exc, TableLocked):
        return _LOCKED_HINT
    if isinstance(exc, ConnectionLimitReached):
        return _LIMIT_HINT
    return _BUSY_HINT if isinstance(exc, PoolBusy) else away_hint(_embedded_data_dir())


class State:
    """What the worker is doing, as logs, ``status`` and sd_notify report it."""

    RUNNING = "running"
    WAITING_FOR_DATABASE = "waiting for database"
    NO_BACKEND = "no backend"
    STOPPING = "stopping"


# What a pause means, and what to look at.
_PAUSED_HINT = (
    "items wait, their attempts given back, and claiming resumes by itself when a health"
    " probe succeeds"
)
_ONCE_PAUSED_HINT = (
    "items wait, their attempts given back; this run --once claims no more and exits 75,"
    " and the next run takes them"
)
_ARE_THEY_UP = (
    "; are the servers of SOKRATOS_LLM_BACKENDS and the embedding server up?"
    " ('sokratos-worker check' probes them)"
)


class WorkerState:
    """The worker's state and why, the database outage in progress, and the backend pause."""

    def __init__(
        self,
        *,
        handlers: Collection[Handler],
        stopping: threading.Event,
        progress: Callable[[], None],
        wake: Callable[[], None],
        on_state: Callable[[str, str], None] | None,
        on_database_contact: Callable[[bool], None],
    ) -> None:
        """``handlers``: probed to end a backend pause, while ``progress`` is reported and
        until ``stopping`` is set; ``wake``: the dispatcher claims again after a resume;
        ``on_state(state, detail)``: a change of state (called under the report lock, which a
        stop waits for: it must not wait on the database); ``on_database_contact(reached)``: how
        a claim, settle or renewal ended (called on the hot path)."""
        self.state = State.RUNNING
        self.detail = ""
        self._handlers = handlers
        self._stopping = stopping
        self._progress = progress
        self._wake = wake
        self._on_state = on_state
        self._on_database_contact = on_database_contact
        self._lock = threading.Lock()
        # When the next health probe is due (monotonic); 0 when claiming is not paused.
        self.paused_until = 0.0
        self._pause_delay = 5.0
        self.drain_only = False  # ``run --once``: a pause ends the run (exit 75), not resumed
        # When the database outage in progress was first met (None: no outage), so it is
        # said once, by whichever thread meets it, and its end with how long it lasted.
        self._outage_since: float | None = None
        # The outage in progress is the server refusing writes for a full disk or no memory:
        # a claim that goes through (its row fits a page already there) does not end it.
        self._writes_refused = False
        self._report_lock = threading.Lock()  # state reports go out one at a time
        self._reported = (self.state, self.detail)
        # The queues whose claims the server refuses: each refusal and when it was first met.
        self._refused: dict[Queue, tuple[str, float]] = {}

    # -- changes ---------------------------------------------------------------------

    def set(self, state: str, detail: str) -> None:
        """Change to ``state`` from any state (the stop does)."""
        with self._lock:
            self.state, self.detail = state, detail
        self._report()

    def _move(self, state: str, detail: str, *, only_from: tuple[str, ...]) -> None:
        """Change to ``state`` only from one of ``only_from`` (checked and changed under the
        lock: a settle's view of the database must not end a backend pause or a stop)."""
        with self._lock:
            if self.state not in only_from:
                return
            self.state, self.detail = state, detail
        self._report()

    def _report(self) -> None:
        """Tell the daemon the state as it is now, when it changed. One report at a time, each
        reading the state afresh, so the last report made is of the latest state."""
        with self._report_lock:
            now = (self.state, self.detail)
            if now == self._reported or self._on_state is None:
                return
            self._reported = now
            self._on_state(*now)

    # -- database outages ------------------------------------------------------------

    def contact_failed(self, exc: DatabaseUnavailable) -> None:
        """Report a contact that did not reach the database (a lock or a full pool did)."""
        if not reached_database(exc):
            self._on_database_contact(False)

    def database_lost(self, exc: DatabaseUnavailable) -> None:
        """A claim or settle met the database away: the first to meet an outage says so; the
        state turns to waiting from running only (a backend pause or a stop stays)."""
        self.contact_failed(exc)
        with self._lock:
            first = self._outage_since is None
            if first:
                self._outage_since = time.monotonic()
            self._writes_refused = server_short_of_a_resource(exc)
            # (Waiting for a refused queue: the outage is now what it waits for first.)
            if self.state == State.RUNNING or (first and self.state == State.WAITING_FOR_DATABASE):
                self.state, self.detail = State.WAITING_FOR_DATABASE, str(exc)
        if first:
            log.warning(
                "waiting_for_database",
                error=str(exc),
                hint=_waiting_hint(exc),
            )
        self._report()

    def database_back(self, sent: float | None = None) -> None:
        """A claim or settle reached the database: the end of an outage is said once; the
        worker runs again unless a queue's claims are still refused."""
        self._on_database_contact(True)
        if self._outage_since is None and self.state != State.WAITING_FOR_DATABASE:
            return  # the hot path: no lock when there is no outage
        with self._lock:
            if sent is not None and self._outage_since is not None and sent < self._outage_since:
                return  # (sent before the outage was met: its answer does not end it)
            since, self._outage_since = self._outage_since, None
            self._writes_refused = False
            if self.state == State.WAITING_FOR_DATABASE:
                self.state, self.detail = self._running_or_refused()
        if since is not None:
            log.info("database_reachable_again", down_s=round(time.monotonic() - since, 1))
        self._report()

    def writes_refused(self) -> bool:
        """True while the outage in progress is the server refusing writes for want of disk
        space or memory: only a settle that goes through ends it."""
        return self._writes_refused

    # -- claims the server refuses (per queue) -------------------------------------

    def claim_refused(self, queue: Queue, exc: ClaimRefused) -> None:
        """The server refused a claim from ``queue`` (it answered: no outage). The worker
        waits until a claim from that queue is accepted; the first refusal is said."""
        self._on_database_contact(True)
        with self._lock:
            first = queue not in self._refused
            since = self._refused[queue][1] if not first else time.monotonic()
            self._refused[queue] = (str(exc), since)
            if self.state == State.RUNNING or (
                self.state == State.WAITING_FOR_DATABASE and self._outage_since is None
            ):
                self.state, self.detail = self._running_or_refused()
        if first:
            log.warning(
                "waiting_for_database",
                queue=queue.value,
                error=str(exc),
                hint=_REFUSED_HINT,
            )
        self._report()

    def claim_accepted(self, queue: Queue) -> None:
        """A claim from ``queue`` went through: its refusal, if any, is over."""
        if not self._refused:
            return  # the hot path: no lock when nothing is refused
        with self._lock:
            refusal = self._refused.pop(queue, None)
            if refusal is None:
                return
            if self.state == State.WAITING_FOR_DATABASE and self._outage_since is None:
                self.state, self.detail = self._running_or_refused()
        log.info(
            "claims_accepted_again",
            queue=queue.value,
            refused_s=round(time.monotonic() - refusal[1], 1),
        )
        self._report()

    def refuses(self, queue: Queue) -> bool:
        """Whether the server refuses claims from ``queue`` now (the hot path: no copy)."""
        return queue in self._refused

    def refused_queues(self) -> frozenset[Queue]:
        """The queues whose claims the server refuses now."""
        return frozenset(self._refused)

    def _running_or_refused(self) -> tuple[str, str]:
        """Running, or waiting with the first refusal still in force (called under the lock)."""
        if not self._refused:
            return State.RUNNING, ""
        return State.WAITING_FOR_DATABASE, next(iter(self._refused.values()))[0]

    # -- pause when no backend can be reached ----------------------------------------

    def paused(self) -> bool:
        """Claiming waits: no backend can be reached, or the pause's probe is not due yet."""
        return time.monotonic() < self.paused_until or self.state == State.NO_BACKEND

    def pause(self, reason: str, *, probe_failed: bool = False) -> None:
        """No backend can be reached: stop claiming until a health probe succeeds."""
        with self._lock:
            already = self.state == State.NO_BACKEND
            if (already and not probe_failed) or self.state == State.STOPPING:
                return  # more items of the same outage must not escalate the probe backoff
            self.paused_until = time.monotonic() + self._pause_delay
            if already:
                self._pause_delay = min(self._pause_delay * 2, 60.0)
            # Taken under the lock: two items failing at once pause (and say it) once.
            self.state, self.detail = State.NO_BACKEND, reason
        if not already:
            log.warning(
                "claiming_paused",
                reason=reason,
                retry_in_s=self._pause_delay,
                hint=(_ONCE_PAUSED_HINT if self.drain_only else _PAUSED_HINT) + _ARE_THEY_UP,
            )
        self._report()

    def maybe_resume(self) -> None:
        """Once the pause's probe is due (the dispatcher asks), probe the backends: resume
        claiming if one answers, else pause again, for twice as long."""
        if time.monotonic() < self.paused_until:
            return
        if self._probe_while_alive():
            self._pause_delay = 5.0
            self.paused_until = 0.0
            # Back to waiting if the database went away (or refuses a queue's claims)
            # meanwhile: its end sets running.
            with self._lock:
                if self._outage_since is not None:
                    state, detail = State.WAITING_FOR_DATABASE, "database unavailable"
                else:
                    state, detail = self._running_or_refused()
            self._move(state, detail, only_from=(State.NO_BACKEND,))
            log.info("claiming_resumed")
            self._wake()
        else:
            self.pause(self.detail or "backends still unreachable", probe_failed=True)

    def _probe_while_alive(self) -> bool:
        """Probe the handlers in a thread, proving progress meanwhile: a probe of several
        hung backends can outlast the watchdog, and waiting for it is not being stuck."""
        healthy: list[bool] = []
        thread = threading.Thread(
            target=lambda: healthy.append(any(self._probe(h) for h in self._handlers)),
            name="probe",
            daemon=True,
        )
        thread.start()
        while thread.is_alive() and not self._stopping.is_set():
            thread.join(1.0)
            self._progress()
        return bool(healthy and healthy[0])

    @staticmethod
    def _probe(handler: Handler) -> bool:
        try:
            return handler.probe()
        except Exception as exc:
            log.warning("backend_probe_failed", error=describe(exc))
            return False
