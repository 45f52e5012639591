"""The drain: claim items for free slots, run their handlers in threads, settle each one.

One dispatcher thread claims a batch for the idle slots when woken (NOTIFY, a tick, or a
timer for the next backoff); a busy slot claims its next item in the transaction that
settles the previous one, so under load an item costs about one commit. A process never
holds more items than it has slots.

The items held and the claims on their way to them are kept by :mod:`inflight` (which a
stop waits on), their leases by the renewer of :mod:`leases`.
"""

from __future__ import annotations

import queue as queue_mod
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import structlog
from psycopg import errors as pg_errors

from sokratos_worker.config import Settings
from sokratos_worker.errors import (
    INVALID_PAYLOAD_PREFIX,
    DatabaseUnavailable,
    InvalidPayload,
    ItemError,
    TableLocked,
)
from sokratos_worker.handlers import Handler
from sokratos_worker.inflight import InFlight
from sokratos_worker.leases import LeaseRenewer
from sokratos_worker.model import Effects, Item, NewMemory, Outcome, Queue, SettleResult
from sokratos_worker.policy import Step, after_failure, describe, retry_delay
from sokratos_worker.queue_shares import QueueShares
from sokratos_worker.store import queue as store
from sokratos_worker.store.connection import Connection, Database, time_limited

log = structlog.get_logger(__name__)

T = TypeVar("T")

WORKER_DIED = "worker died during the last attempt"
ATTEMPTS_USED_UP = "attempts used up"
# The unique key of work_outcomes (queue, item_id): a settle refused by it means the item's id
# was handed out again (sql/0042_fresh_item_ids.sql).
OUTCOME_KEY = "work_outcomes_queue_item_id_key"
# The stop's release of unfinished items waits no longer behind a lock (a migration holding
# a queue table): the leases expire instead, and the process exits.
RELEASE_STATEMENT_TIMEOUT_MS = 5000
# Then the dispatcher's claim still waiting is cancelled: the cancel and the wait for the claim
# to end share this bound (a stop takes at most the grace + 5 s + 2 s).
CLAIM_CANCEL_TIMEOUT_S = 2.0

# How an attempt ended when it did not end the item (besides the outcomes of Outcome):
RETRY = "retry"  # failed, scheduled again after a backoff
RELEASED = "released"  # given back: not the item's fault (no backend), attempt not counted
_AWAY_HINT = (
    "items in flight keep their leases and settle when PostgreSQL answers again; nothing is"
    " lost. Is the server up, and SOKRATOS_DATABASE_URL right? ('sokratos-worker check' tells)"
)
_LOCKED_HINT = (
    "another session holds a queue table locked (dispatcher_waiting_for_lock names it); claiming"
    " goes on when it lets go, and nothing is lost"
)
_FIRST_SETTLE_DELAY = 0.2  # a settle's first wait for the database; it doubles up to 5 s
LEASE_LOST = "lease_lost"  # another worker took the item over; this settle changed nothing
ABANDONED = "abandoned"  # the database stayed away past the lease; the item runs again


def _no_contact_report(reached: bool) -> None:
    """The default of ``Runner(on_database_contact=...)``: nobody listens."""


def _outcome_already_recorded(exc: BaseException) -> bool:
    """A settle refused because work_outcomes holds an outcome under this item's id already."""
    return isinstance(exc, pg_errors.UniqueViolation) and exc.diag.constraint_name == OUTCOME_KEY


def _reused_id_hint(item: Item) -> str:
    """What to do about an item whose id an earlier item's outcome holds (it cannot settle)."""
    queue = item.queue.value
    return (
        f"{queue} item {item.id} has the id of an earlier item whose outcome is recorded (the"
        " id sequence was reset, or the row bypassed the sokratos_fresh_id trigger of migration"
        " 0042: session_replication_role = replica, an UPDATE of id), so it can never be"
        " settled and runs again at every lease expiry. As the tables' owner, give it a fresh"
        f" id: UPDATE {queue} SET id = sokratos_next_item_id('{queue}') WHERE id = {item.id}"
        " RETURNING id; and point its key there: UPDATE sokratos_idempotency_keys SET item_id ="
        f" <that id> WHERE queue = '{queue}' AND key = <its idempotency_key>"
    )


class State:
    """What the worker is doing, as logs, ``status`` and sd_notify report it."""

    RUNNING = "running"
    WAITING_FOR_DATABASE = "waiting for database"
    NO_BACKEND = "no backend"
    STOPPING = "stopping"


@dataclass
class Stats:
    """Counts per queue since the last :meth:`Runner.take_stats` (the tick's report)."""

    counts: dict[str, Counter[str]] = field(default_factory=dict)
    backends: Counter[str] = field(default_factory=Counter)

    def add(self, queue: Queue, kind: str, backend: str | None = None) -> None:
        """Count one event (claimed, saved, skipped, archived, failed, retried, given_back)."""
        self.counts.setdefault(queue.value, Counter())[kind] += 1
        if backend:
            self.backends[backend] += 1


class Runner:
    """Runs handlers for the queues that have one; items of other queues wait."""

    def __init__(
        self,
        *,
        settings: Settings,
        database: Database,
        handlers: Mapping[Queue, Handler],
        worker_id: str,
        on_state: Callable[[str, str], None] | None = None,
        on_progress: Callable[[], None] | None = None,
        on_item_done: Callable[[Queue, str, float], None] | None = None,
        on_database_contact: Callable[[bool], None] = _no_contact_report,
    ) -> None:
        """``on_database_contact(reached)`` hears how each claim, settle and lease renewal
        ended: True when it reached PostgreSQL, False when the database was unavailable. It is
        called on the hot path (once per claim and settle), so it must be cheap."""
        self.settings = settings
        self.database = database
        self.handlers = dict(handlers)
        self.worker_id = worker_id
        self.queues = [q for q in Queue if q in self.handlers]
        self.state = State.RUNNING
        self.state_detail = ""
        self._on_state = on_state
        self._on_progress = on_progress
        self._on_item_done = on_item_done
        self._on_database_contact = on_database_contact
        self._stop_claiming = threading.Event()
        self._stopped = threading.Event()
        # The items held and the claims on their way to us; its lock also guards the stats
        # and the pause state below.
        self._inflight = InFlight(self._stop_claiming)
        self._lock = self._inflight.lock
        self._renewer = LeaseRenewer(
            settings=settings,
            database=database,
            worker_id=worker_id,
            queues=self.queues,
            inflight=self._inflight,
            stopped=self._stopped,
            on_database_contact=on_database_contact,
            contact_failed=self._contact_failed,
            wake=lambda: self.wake(notified=False),
        )
        self._handoff: queue_mod.SimpleQueue[Item | None] = queue_mod.SimpleQueue()
        self._wake = threading.Event()
        self._notified = False
        self._paused_until = 0.0
        self._pause_delay = 5.0
        # When the database outage in progress was first met (None: no outage), so it is
        # said once, by whichever thread meets it, and its end with how long it lasted.
        self._outage_since: float | None = None
        self._report_lock = threading.Lock()  # state reports go out one at a time
        self._reported = (self.state, self.state_detail)
        self._budget_ends = float("inf")  # run --once: no claims after SOKRATOS_TICK_BUDGET
        self._stats = Stats()
        self._threads: list[threading.Thread] = []
        self._rotation = 0
        self._shares = QueueShares(self.queues)
        # The server process of the dispatcher's statement in progress (None between them):
        # the watchdog asks PostgreSQL what it waits for when the dispatcher stops coming round.
        self.dispatcher_backend_pid: int | None = None

    # -- lifecycle -------------------------------------------------------------------

    def start(self, *, drain_only: bool = False, budget_s: float | None = None) -> None:
        """Start the slot threads, the lease renewer and the dispatcher."""
        if budget_s is not None:
            self._budget_ends = time.monotonic() + budget_s
        for index in range(self.settings.concurrency):
            self._spawn(self._slot_loop, f"slot-{index}")
        self._spawn(self._renewer.run, "lease-renewer")
        self._spawn(lambda: self._dispatch_loop(drain_only, budget_s), "dispatcher")

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        # Daemon threads: a second signal must be able to exit at once (leases cover it).
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def wake(self, *, notified: bool = True) -> None:
        """New work may be ready (NOTIFY, tick, reconnect): claim for the idle slots now."""
        if notified:
            self._notified = True
        self._wake.set()

    def request_stop(self) -> None:
        """Stop claiming; items in flight go on."""
        self._stop_claiming.set()
        self._wake.set()

    def wait_drained(self, timeout: float | None = None) -> bool:
        """Block until the dispatcher has finished a drain-only run."""
        return self._stopped.wait(timeout)

    def shutdown(self, grace_s: float) -> int:
        """Stop claiming, let in-flight items finish within ``grace_s``, release the rest.

        Returns how many items were released (their attempt given back).
        """
        self.request_stop()  # first: the state's report may wait behind a heartbeat's write
        self._set_state(State.STOPPING, "")
        deadline = time.monotonic() + grace_s
        while self.inflight_count() and time.monotonic() < deadline:
            self._progress()  # items finishing within the grace is progress too
            time.sleep(0.05)
        leftovers = self._inflight.take_all()
        give_up_at = time.monotonic() + RELEASE_STATEMENT_TIMEOUT_MS / 1000
        released = self._release(leftovers)
        self._inflight.await_claims(give_up_at, CLAIM_CANCEL_TIMEOUT_S)
        for _ in range(self.settings.concurrency):
            self._handoff.put(None)
        self._stopped.set()  # the lease renewer ends too: nothing of ours is leased any more
        return released

    def inflight_count(self) -> int:
        """Items claimed and not yet settled by this process."""
        return self._inflight.count()

    def inflight_by_queue(self) -> Counter[Queue]:
        """Items claimed and not yet settled by this process, per queue."""
        return self._inflight.by_queue()

    def _count(self, queue: Queue, kind: str, backend: str | None = None) -> None:
        """Count one event in the stats (under the lock :meth:`take_stats` swaps them with)."""
        with self._lock:
            self._stats.add(queue, kind, backend)

    def take_stats(self) -> Stats:
        """The counts since the last call (for ``tick_finished``)."""
        with self._lock:
            stats, self._stats = self._stats, Stats()
        return stats

    # -- dispatcher ------------------------------------------------------------------

    def _dispatch_loop(self, drain_only: bool, budget_s: float | None) -> None:
        db_delay = 0.2
        try:
            while not self._stop_claiming.is_set():
                self._progress()
                if self._budget_spent():
                    log.info("tick_budget_spent", budget_s=budget_s)
                    break
                if self._paused() and drain_only:
                    log.info("drain_ended_paused", reason=self.state_detail)
                    break  # run --once: a paused tick ends instead of waiting out its budget
                if self._paused():
                    # A wake while paused would end every wait at once (a busy loop); the
                    # resume wakes the dispatcher itself.
                    self._wake.clear()
                    self._wait(min(1.0, max(0.05, self._paused_until - time.monotonic())))
                    self._maybe_resume()
                    continue
                self._wake.clear()
                self._notified = False
                try:
                    asked, got = self._claim_for_idle_slots()
                    next_in = None if got or asked == 0 else self._next_ready_in()
                except DatabaseUnavailable as exc:
                    self._database_lost(exc)
                    log.debug("claim_waiting_for_database", error=str(exc), retry_in_s=db_delay)
                    self._wait(db_delay)
                    db_delay = min(db_delay * 2, 5.0)
                    continue
                except Exception:  # any other claim error ended this thread: claiming stopped
                    log.exception("claim_failed", retry_in_s=db_delay)
                    self._wait(db_delay)
                    db_delay = min(db_delay * 2, 5.0)
                    continue
                db_delay = 0.2
                self._claimed_without_error(asked)
                if drain_only and got == 0 and self.inflight_count() == 0:
                    break
                if asked and got == asked:
                    continue  # the batch was full: more may be waiting
                self._wait(self._idle_timeout(next_in, drain_only))
        finally:
            if drain_only:
                # Asked to stop (a signal), in-flight items get the grace; at the end of a
                # drain or its budget, a little more.
                extra = 0.0 if self._stop_claiming.is_set() else 5.0
                deadline = time.monotonic() + self.settings.shutdown_grace + extra
                while self.inflight_count() and time.monotonic() < deadline:
                    time.sleep(0.02)
                self._stopped.set()

    def _budget_spent(self) -> bool:
        """``run --once`` claims nothing once its SOKRATOS_TICK_BUDGET is spent (contract §1)."""
        return time.monotonic() > self._budget_ends

    def _idle_timeout(self, next_in: float | None, drain_only: bool) -> float:
        if drain_only:
            return 0.05
        timeout = self.settings.heartbeat_interval
        if next_in is not None:
            timeout = min(timeout, next_in + 0.01)
        return max(0.01, min(timeout, 5.0 if self.inflight_count() else timeout))

    def _claimed_without_error(self, asked: int) -> None:
        """The dispatcher's pass ended without a database error: leave any wait for it."""
        if asked:  # a claim was sent (none when every slot is busy): the database answered
            self._database_back()

    def _wait(self, seconds: float) -> None:
        # Wake at least every second so the watchdog sees progress.
        end = time.monotonic() + seconds
        while not self._stop_claiming.is_set():
            left = end - time.monotonic()
            if left <= 0 or self._wake.wait(min(left, 1.0)):
                return
            self._progress()

    def _claim_for_idle_slots(self) -> tuple[int, int]:
        free = self.settings.concurrency - self.inflight_count()
        if free <= 0 or not self.queues or not self._inflight.begin_claim():
            return 0, 0
        asked, got = free, 0
        order = self.queues[self._rotation :] + self.queues[: self._rotation]
        self._rotation = (self._rotation + 1) % max(1, len(self.queues))
        # Each queue's equal share first, then what a queue left unclaimed to those that
        # filled theirs (a queue that came short has no more).
        plan = [*self._shares.split(free, order), *((q, None) for q in order)]
        short: set[Queue] = set()
        try:
            with self._dispatcher_connection() as conn:
                for q, share in plan:
                    limit = free if share is None else min(share, free)
                    if free <= 0:
                        break
                    if limit <= 0 or q in short:
                        continue
                    items = self._claim_cancellable(conn, q, limit)
                    self._shares.claimed(q, all_asked=len(items) >= limit)
                    if len(items) < limit:
                        short.add(q)
                    fresh = self._track_claimed(items)
                    if fresh is None:
                        self._release(items, conn, count_given_back=True)
                        break
                    for item in fresh:
                        self._handoff.put(item)
                    free -= len(items)
                    got += len(items)
        finally:
            self._inflight.end_claim()
        return asked, got

    def _claim_cancellable(self, conn: Connection, queue: Queue, limit: int) -> list[Item]:
        """One claim statement, which the stop cancels if it still waits after the release."""
        with self._inflight.cancellable_claim(conn):
            try:
                items = store.claim(
                    conn, queue, owner=self.worker_id, limit=limit, lease_s=self.settings.lease
                )
            except pg_errors.QueryCanceled:
                if not self._stop_claiming.is_set():
                    raise
                log.info("claim_cancelled_at_stop", queue=queue.value)
                items = []  # rolled back: it claimed nothing
        return items

    def _next_ready_in(self) -> float | None:
        with self._dispatcher_connection() as conn:
            return store.next_ready_in(conn, self.queues)

    @contextmanager
    def _dispatcher_connection(self) -> Iterator[Connection]:
        """A pooled connection whose server process is known while the dispatcher uses it."""
        with self.database.connection() as conn:
            self.dispatcher_backend_pid = conn.pgconn.backend_pid
            try:
                yield conn
            finally:
                self.dispatcher_backend_pid = None

    def _track(self, item: Item) -> bool:
        """Record one claimed item; False when a slot here is already running it, or the stop
        came (then it is not recorded)."""
        return bool(self._track_claimed([item]))

    def _track_claimed(self, items: list[Item]) -> list[Item] | None:
        """Record claimed items (:meth:`InFlight.track_claimed`), counted as claimed in the
        stats; None when the stop came while the claim was in flight: give them all back."""
        return self._inflight.track_claimed(
            items, lambda item: self._stats.add(item.queue, "claimed")
        )

    def _untrack(self, item: Item, *, leave_leased: bool = False) -> bool:
        """The run of ``item`` is over (:meth:`InFlight.untrack`); a claim adopted while it
        ran goes to a slot."""
        found, again = self._inflight.untrack(item, leave_leased=leave_leased)
        if again is not None:
            log.info(
                "item_runs_under_its_new_claim",
                queue=again.queue.value,
                item_id=again.id,
                attempt=again.attempt,
            )
            self._handoff.put(again)
        return found

    # -- pause when no backend can be reached ----------------------------------------

    def _paused(self) -> bool:
        return time.monotonic() < self._paused_until or self.state == State.NO_BACKEND

    def _pause(self, reason: str, *, probe_failed: bool = False) -> None:
        with self._lock:
            already = self.state == State.NO_BACKEND
            if (already and not probe_failed) or self.state == State.STOPPING:
                return  # more items of the same outage must not escalate the probe backoff
            self._paused_until = time.monotonic() + self._pause_delay
            if already:
                self._pause_delay = min(self._pause_delay * 2, 60.0)
            # Taken under the lock: two items failing at once pause (and say it) once.
            self.state, self.state_detail = State.NO_BACKEND, reason
        if not already:
            log.warning(
                "claiming_paused",
                reason=reason,
                retry_in_s=self._pause_delay,
                hint="items wait, their attempts given back, and claiming resumes by itself when"
                " a health probe succeeds; are the servers of SOKRATOS_LLM_BACKENDS and the"
                " embedding server up? ('sokratos-worker check' probes them)",
            )
        self._report_state()

    def _maybe_resume(self) -> None:
        if time.monotonic() < self._paused_until:
            return
        if self._probe_while_alive():
            self._pause_delay = 5.0
            self._paused_until = 0.0
            # Back to waiting if the database went away meanwhile: its end sets running.
            away = self._outage_since is not None
            self._move(
                State.WAITING_FOR_DATABASE if away else State.RUNNING,
                "database unavailable" if away else "",
                only_from=(State.NO_BACKEND,),
            )
            log.info("claiming_resumed")
            self.wake(notified=False)
        else:
            self._pause(self.state_detail or "backends still unreachable", probe_failed=True)

    def _probe_while_alive(self) -> bool:
        """Probe the handlers in a thread, proving progress meanwhile: a probe of several
        hung backends can outlast the watchdog, and waiting for it is not being stuck."""
        healthy: list[bool] = []
        thread = threading.Thread(
            target=lambda: healthy.append(any(self._probe(h) for h in self.handlers.values())),
            name="probe",
            daemon=True,
        )
        thread.start()
        while thread.is_alive() and not self._stop_claiming.is_set():
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

    # -- slots -----------------------------------------------------------------------

    def _slot_loop(self) -> None:
        while True:
            item = self._handoff.get()
            if item is None:
                return
            # The item's reads and settle, and the next items claimed with it, share one
            # connection: a slot never needs two.
            with self.database.holding():
                while item is not None:
                    item = self._process(item)
            if self._notified:
                self._wake.set()

    def _process(self, item: Item) -> Item | None:
        """Handle and settle one item; returns the next item claimed with the settle."""
        # Bound for this item only (reset before the next one on this slot), so that every line
        # logged while it is handled and settled, the pipelines' and LLM client's too, names it.
        # (A claim past the limit is not an attempt: its lines name the last one counted, as
        # its dead letter does.)
        with structlog.contextvars.bound_contextvars(
            queue=item.queue.value, item_id=item.id, attempt=self._last_attempt(item)
        ):
            return self._handle_and_settle(item)

    def _handle_and_settle(self, item: Item) -> Item | None:
        """:meth:`_process` within the item's log context."""
        started = time.monotonic()
        bound = log.bind(queue=item.queue.value, item_id=item.id, attempt=self._last_attempt(item))
        handler = self.handlers[item.queue]
        try:
            if item.attempt > self.settings.max_attempts:
                raise ItemError(self._no_attempt_left(item))
            problem = store.payload_problem(item)
            if problem is not None:
                raise problem
            self.database.lend_if_wanted()  # not kept through the handler if others wait
            effects = handler.handle(item)
        except Exception as exc:
            self._failed(item, started, exc, handler, bound)
            return None
        try:
            next_item, kind = self._settle_success(item, effects, bound, started)
        except Exception as exc:
            # A write the database refuses (constraint, range, dimension) is a failed attempt;
            # escaping here, it would kill the slot thread and leave the item leased for ever.
            if _outcome_already_recorded(exc):
                bound.error("item_id_reused", error=describe(exc), hint=_reused_id_hint(item))
            self._failed(item, started, exc, handler, bound)
            return None
        self._finished(item, started, kind)
        return next_item

    def _failed(
        self,
        item: Item,
        started: float,
        exc: BaseException,
        handler: Handler,
        bound: structlog.BoundLogger,
    ) -> None:
        """Settle a failed attempt, then wake the dispatcher: only a success claims the slot's
        next item with its settle, so without the wake the backlog waits up to 5 s for the
        free slot."""
        self._finished(item, started, self._fail(item, exc, handler, bound))
        self.wake(notified=False)

    def _finished(self, item: Item, started: float, kind: str) -> None:
        if self._on_item_done is not None:
            self._on_item_done(item.queue, kind, time.monotonic() - started)

    def _settle_success(
        self, item: Item, effects: Effects, bound: structlog.BoundLogger, started: float
    ) -> tuple[Item | None, str]:
        """Returns the next item claimed with the settle, and how the attempt ended."""
        item = self._inflight.latest_claim(item)
        # Past the tick's budget the items in flight finish, but none is claimed after them;
        # after the stop, none either (begin_claim checks it).
        want_next = not (self._paused() or self._budget_spent()) and self._inflight.begin_claim()
        claim_from = item.queue
        if want_next and len(self.queues) > 1:
            claim_from = self._shares.for_settle(item.queue, self._inflight.by_queue())
        try:
            return self._settle_and_claim(
                item, effects, bound, started, claim_from=claim_from if want_next else None
            )
        finally:
            if want_next:
                self._inflight.end_claim()

    def _settle_and_claim(
        self,
        item: Item,
        effects: Effects,
        bound: structlog.BoundLogger,
        started: float,
        *,
        claim_from: Queue | None,
    ) -> tuple[Item | None, str]:
        """The settle of :meth:`_settle_success`, claiming the next item from ``claim_from``
        unless it is None."""

        def settle(conn: Connection) -> tuple[SettleResult, list[Item]]:
            return store.settle_success(
                conn,
                item,
                effects,
                owner=self.worker_id,
                claim_next=claim_from is not None,
                claim_from=claim_from,
                lease_s=self.settings.lease,
            )

        done = self._with_database(item, settle, bound)
        if done is None:
            return None, ABANDONED
        result, next_items = done
        if claim_from is not None:
            self._shares.claimed(claim_from, all_asked=bool(next_items))
        if result.settled:
            outcome = (result.outcome or effects.outcome).value
            if outcome != effects.outcome.value:
                bound.info(
                    "settled_as_near_duplicate", planned=effects.outcome.value, outcome=outcome
                )
            self._count(item.queue, outcome, effects.backend)
            # Debug: one line per item is the cost of a JSON render and a write per item
            # (the pipelines log what they saved; the tick reports the counts at info).
            bound.debug(
                "item_settled",
                outcome=outcome,
                memory_ids=list(result.memory_ids),
                backend=effects.backend,
                duration_ms=round((time.monotonic() - started) * 1000, 1),
            )
            kind = outcome
        else:
            kind = self._report_fenced(item, bound, released=LEASE_LOST)
        # Tracked first, so in-flight never reads 0 in between.
        fresh = self._track_claimed(next_items)
        self._untrack(item)
        if fresh is None:
            # Claimed as the stop came: given back, not run (and not left to the lease).
            self._release(next_items, count_given_back=True)
            return None, kind
        if claim_from is not None and not next_items and len(self.queues) > 1:
            # The other queue may have items: the dispatcher fills the slot now (it would wait
            # up to 5 s), once the item is untracked so that it counts the slot free.
            self.wake(notified=False)
        return (fresh[0] if fresh else None), kind

    def _fail(
        self, item: Item, exc: BaseException, handler: Handler, bound: structlog.BoundLogger
    ) -> str:
        """Settle a failed attempt; a settle the database refuses must not kill the slot."""
        item = self._inflight.latest_claim(item)
        try:
            return self._settle_failure(item, exc, handler, bound)
        except Exception as settle_exc:
            if _outcome_already_recorded(settle_exc):
                bound.error(
                    "item_id_reused", error=describe(settle_exc), hint=_reused_id_hint(item)
                )
                self._untrack(item, leave_leased=True)
                return ABANDONED
            bound.error(
                "settle_failed",
                error=describe(settle_exc),
                item_error=describe(exc),
                hint="the item stays leased until its lease expires, then runs again"
                " (this attempt counts); fix the database error above",
            )
            # Not renewed: the lease runs out and the item runs again (this attempt counts).
            self._untrack(item, leave_leased=True)
            return ABANDONED

    def _settle_failure(
        self, item: Item, exc: BaseException, handler: Handler, bound: structlog.BoundLogger
    ) -> str:
        """Retry, give back or dead-letter the item; returns how the attempt ended."""
        kind = ABANDONED  # unless a settle below lands
        decision = after_failure(exc, attempt=item.attempt, max_attempts=self.settings.max_attempts)
        backend = getattr(exc, "backend", None)
        if decision.step is Step.GIVE_BACK:
            given = self._with_database(
                item, lambda c: store.give_back(c, item, owner=self.worker_id), bound
            )
            if given is not None:
                kind = RELEASED if given else self._report_fenced(item, bound, released=RELEASED)
            self._count(item.queue, "given_back")
            bound.warning("attempt_given_back", reason=decision.reason)
            self._pause(decision.reason)
        elif decision.step is Step.RETRY:
            delay = retry_delay(
                item.attempt, base_s=self.settings.retry_base, max_s=self.settings.retry_max
            )
            ok = self._with_database(
                item,
                lambda c: store.schedule_retry(
                    c,
                    item,
                    owner=self.worker_id,
                    error=decision.reason,
                    delay_s=delay,
                    backend=backend,
                ),
                bound,
            )
            if ok:
                kind = RETRY
                self._count(item.queue, "retried")
                bound.warning(
                    "item_retry_scheduled", error=decision.reason, retry_in_s=round(delay, 1)
                )
            elif ok is False:
                kind = self._report_fenced(item, bound, released=RETRY)
        else:
            memories = (
                () if isinstance(exc, InvalidPayload) else self._archive(handler, item, bound)
            )
            result = self._dead_letter(item, decision.reason, backend, memories, bound)
            if result is not None and result.settled:
                kind = Outcome.ARCHIVED.value if result.memory_ids else Outcome.FAILED.value
                self._count(item.queue, kind)
                replay = result.failure_id if result.failure_id is not None else "ID"
                hint = (
                    f"see 'sokratos-worker failed show {replay}'; the payload itself is invalid,"
                    " so a replay fails the same way: fix what produced it"
                    if decision.reason.startswith(INVALID_PAYLOAD_PREFIX)
                    else f"see 'sokratos-worker failed show {replay}'; once the cause is fixed"
                    f" replay it with 'sokratos-worker failed retry {replay}'"
                )
                bound.error(
                    "item_dead_lettered",
                    op_type=item.op_type,
                    error=decision.reason,
                    outcome=kind,
                    memory_count=len(result.memory_ids),  # (an archive can be thousands)
                    first_memory_ids=list(result.memory_ids[:10]),
                    failure_id=result.failure_id,
                    hint=hint,
                )
            elif result is not None:
                kind = self._report_fenced(item, bound, released=LEASE_LOST)
        self._untrack(item)
        return kind

    def _dead_letter(
        self,
        item: Item,
        error: str,
        backend: str | None,
        memories: tuple[NewMemory, ...],
        bound: structlog.BoundLogger,
    ) -> SettleResult | None:
        """failed_operations + outcome + delete; without the archive if it is refused."""

        def write(with_memories: tuple[NewMemory, ...]) -> SettleResult | None:
            return self._with_database(
                item,
                lambda c: store.dead_letter(
                    c,
                    item,
                    owner=self.worker_id,
                    error=error,
                    backend=backend,
                    memories=with_memories,
                    last_attempt=self._last_attempt(item),
                    # A claim past the limit ended the item unrun: the history already says
                    # how its last attempt ended.
                    ran=not (error == WORKER_DIED or error.startswith(ATTEMPTS_USED_UP)),
                ),
                bound,
            )

        if not memories:
            return write(())
        try:
            return write(memories)
        except Exception as exc:
            # The payload in failed_operations still keeps the conversation: never lose it
            # because its raw-archive memory cannot be written (constraint, no embedding).
            bound.error(
                "archive_memory_refused",
                error=describe(exc),
                hint="the item goes to failed_operations without its raw-archive memory;"
                " replay it with 'sokratos-worker failed retry ID' once the cause is fixed",
            )
            return write(())

    def _no_attempt_left(self, item: Item) -> str:
        """Why a claim past SOKRATOS_MAX_ATTEMPTS ends the item unrun: only a claim that took
        over an expired lease found an attempt that died; otherwise none was running."""
        if item.took_over_lease or store.died_in(item, item.attempt - 1):
            # (The second: the claim that took the lease over was given back since.)
            return WORKER_DIED
        limit = self.settings.max_attempts
        return (
            f"{ATTEMPTS_USED_UP}: {item.attempt - 1} of SOKRATOS_MAX_ATTEMPTS={limit} before"
            " this claim (inserted with attempts preset, or the limit was lowered); the item"
            " never ran in this attempt"
        )

    def _last_attempt(self, item: Item) -> int:
        """The attempt a dead letter records: a claim past the limit (the last attempt died,
        or attempts were used up) is not an attempt of its own (durability.md), so the last
        attempt counted before it is named."""
        return item.attempt - 1 if item.attempt > self.settings.max_attempts else item.attempt

    @staticmethod
    def _archive(
        handler: Handler, item: Item, bound: structlog.BoundLogger
    ) -> tuple[NewMemory, ...]:
        try:
            return handler.final_failure_memories(item)
        except Exception as exc:
            bound.warning("archive_memories_failed", error=describe(exc))
            return ()

    def _report_fenced(self, item: Item, bound: structlog.BoundLogger, released: str) -> str:
        """Say why a settle changed nothing, and return how the attempt really ended: the
        outcome an earlier commit of ours recorded (its answer lost with the connection),
        ``released`` when the item waits unleased (our retry or give-back landed), or
        ``lease_lost`` (another worker holds it, or finished it)."""
        try:
            with self.database.connection() as conn:
                recorded = store.outcome_of(conn, item)
                exists, owner = store.lease_owner(conn, item)
        except DatabaseUnavailable as exc:
            # Only the refusal is known: not who holds the item now, nor whether it is done.
            bound.warning(
                "settle_refused_owner_unknown",
                error=str(exc),
                hint="this settle changed nothing (the item's lease or attempt was no longer"
                " this worker's); the database could not be asked who holds it now. Whoever"
                " does finishes it, else its lease expires and it runs again",
            )
            return LEASE_LOST
        if recorded is not None:
            outcome, by_attempt = recorded
            if by_attempt not in (None, item.attempt):
                # A worker that took the item over (ours was frozen or cut off past its
                # lease) finished it: its outcome, counted by it, is not this attempt's.
                bound.warning(
                    "lease_lost",
                    finished_by_attempt=by_attempt,
                    outcome=outcome,
                    hint="this worker held the item past its lease (frozen, suspended or cut"
                    " off from the database) and another took it over and finished it; this"
                    " attempt's result was dropped. If it recurs, raise SOKRATOS_LEASE",
                )
                return LEASE_LOST
            bound.info("item_already_settled", outcome=outcome)
            self._count(item.queue, outcome)
            return outcome
        if exists and owner is not None:
            bound.warning(
                "lease_lost",
                new_owner=owner,
                hint="another worker took the item over; it finishes it",
            )
            return LEASE_LOST
        if exists:
            # A retry or give-back of ours landed before the connection dropped.
            bound.info("item_already_released")
            return released
        bound.warning("item_gone", hint="its row was deleted outside the worker")
        return LEASE_LOST

    def _with_database(
        self,
        item: Item,
        fn: Callable[[Connection], T],
        bound: structlog.BoundLogger,
    ) -> T | None:
        """Run a settle, retrying through a database outage while the lease lasts."""
        deadline = time.monotonic() + self.settings.lease * 0.8
        delay = _FIRST_SETTLE_DELAY
        while True:
            try:
                with self.database.connection() as conn:
                    result = fn(conn)
            except DatabaseUnavailable as exc:
                self._database_lost(exc)
                if time.monotonic() + delay > deadline:
                    bound.error(
                        "settle_abandoned",
                        error=str(exc),
                        hint="the lease expires and the item is claimed again",
                    )
                    self._untrack(item, leave_leased=True)
                    return None
                # The outage is said once (waiting_for_database); each item's first wait is
                # worth a line, its every retry is not.
                say = bound.info if delay == _FIRST_SETTLE_DELAY else bound.debug
                say("settle_waiting_for_database", error=str(exc), retry_in_s=delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
            else:
                self._database_back()
                return result

    # -- give-backs ------------------------------------------------------------------

    def _release(
        self, items: list[Item], on: Connection | None = None, *, count_given_back: bool = False
    ) -> int:
        """Give back ``items`` (attempt uncounted), on ``on`` or a pooled connection;
        ``count_given_back``: count those released as given_back in the stats."""
        if not items:
            return 0
        try:
            with ExitStack() as stack:
                conn = on if on is not None else stack.enter_context(self.database.connection())
                stack.enter_context(time_limited(conn, RELEASE_STATEMENT_TIMEOUT_MS))
                released = [i for i in items if store.give_back(conn, i, owner=self.worker_id)]
        except (DatabaseUnavailable, pg_errors.QueryCanceled) as exc:
            log.warning(
                "release_failed",
                error=str(exc).strip(),
                hint="the leases expire instead and the items run again (a table locked by a"
                " migration or a long transaction, or the database away)",
            )
            return 0
        if count_given_back:
            with self._lock:
                for item in released:
                    self._stats.add(item.queue, "given_back")
        for item in released:
            # Its own attempt: a slot's context names the item it settled, not this one.
            log.info("item_released", queue=item.queue.value, item_id=item.id, attempt=item.attempt)
        return len(released)

    # -- reporting -------------------------------------------------------------------

    def _set_state(self, state: str, detail: str) -> None:
        with self._lock:
            self.state, self.state_detail = state, detail
        self._report_state()

    def _move(self, state: str, detail: str, *, only_from: tuple[str, ...]) -> None:
        """Change to ``state`` only from one of ``only_from`` (checked and changed under the
        lock: a settle's view of the database must not end a backend pause or a stop)."""
        with self._lock:
            if self.state not in only_from:
                return
            self.state, self.state_detail = state, detail
        self._report_state()

    def _report_state(self) -> None:
        """Tell the daemon the state as it is now, when it changed. One report at a time, each
        reading the state afresh, so the last report made is of the latest state."""
        with self._report_lock:
            now = (self.state, self.state_detail)
            if now == self._reported or self._on_state is None:
                return
            self._reported = now
            self._on_state(*now)

    def _contact_failed(self, exc: DatabaseUnavailable) -> None:
        """Report a contact that did not reach the database; a locked table did reach it."""
        if not isinstance(exc, TableLocked):
            self._on_database_contact(False)

    def _database_lost(self, exc: DatabaseUnavailable) -> None:
        """A claim or settle met the database away: the first to meet an outage says so; the
        state turns to waiting from running only (a backend pause or a stop stays)."""
        self._contact_failed(exc)
        with self._lock:
            first = self._outage_since is None
            if first:
                self._outage_since = time.monotonic()
            if self.state == State.RUNNING:
                self.state, self.state_detail = State.WAITING_FOR_DATABASE, str(exc)
        if first:
            log.warning(
                "waiting_for_database",
                error=str(exc),
                hint=_LOCKED_HINT if isinstance(exc, TableLocked) else _AWAY_HINT,
            )
        self._report_state()

    def _database_back(self) -> None:
        """A claim or settle reached the database: the end of an outage is said once."""
        self._on_database_contact(True)
        if self._outage_since is None and self.state != State.WAITING_FOR_DATABASE:
            return  # the hot path: no lock when there is no outage
        with self._lock:
            since, self._outage_since = self._outage_since, None
            if self.state == State.WAITING_FOR_DATABASE:
                self.state, self.state_detail = State.RUNNING, ""
        if since is not None:
            log.info("database_reachable_again", down_s=round(time.monotonic() - since, 1))
        self._report_state()

    def _progress(self) -> None:
        if self._on_progress is not None:
            self._on_progress()
