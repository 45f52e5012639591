"""The drain: claim items for free slots, run their handlers in threads, settle each one.

One dispatcher thread claims a batch for the idle slots when woken (NOTIFY, a tick, or a
timer for the next backoff); a busy slot claims its next item in the transaction that
settles the previous one, so under load an item costs about one commit. A process never
holds more items than it has slots.

The items held and the claims on their way to them are kept by :mod:`inflight` (which a
stop waits on), their leases by the renewer of :mod:`leases`; how each attempt ends in the
database (saved, retried, given back, dead-lettered, fenced) is written by :mod:`settle`; the
worker's state (running, waiting for the database, no backend, stopping), the pause of claiming
when no backend answers and its health probe are kept by :mod:`worker_state`, which the threads
here tell what they meet. This module keeps the lifecycle, the dispatcher and the slots.
"""

from __future__ import annotations

import queue as queue_mod
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import structlog
from psycopg import errors as pg_errors

from sokratos_worker.config import Settings
from sokratos_worker.errors import ClaimRefused, DatabaseUnavailable
from sokratos_worker.handlers import Handler
from sokratos_worker.inflight import InFlight
from sokratos_worker.leases import LeaseRenewer
from sokratos_worker.model import Effects, Item, Queue
from sokratos_worker.policy import describe
from sokratos_worker.queue_shares import QueueShares
from sokratos_worker.settle import (
    ABANDONED,
    RELEASE_STATEMENT_TIMEOUT_MS,
    RELEASED,
    Settler,
    last_attempt,
    no_attempt_left,
    outcome_already_recorded,
    reused_id_hint,
)
from sokratos_worker.store import queue as store
from sokratos_worker.store.connection import (
    Connection,
    Database,
    claim_refusal,
    refused_by_setup,
)
from sokratos_worker.worker_state import State, WorkerState

log = structlog.get_logger(__name__)

# After the stop's release (RELEASE_STATEMENT_TIMEOUT_MS), the dispatcher's claim still waiting
# is cancelled: the cancel and the wait for the claim to end share this bound (a stop takes at
# most the grace + 5 s + 2 s).
CLAIM_CANCEL_TIMEOUT_S = 2.0
# A queue whose claims the server refuses (a privilege revoked) is asked again this often,
# by the dispatcher or a settle: each refusal is an ERROR line in the server's log.
REFUSED_CLAIM_RETRY_S = 5.0


def _no_contact_report(reached: bool) -> None:
    """The default of ``Runner(on_database_contact=...)``: nobody listens."""


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
        on_item_done: Callable[[Queue, str, float | None], None] | None = None,
        on_database_contact: Callable[[bool], None] = _no_contact_report,
    ) -> None:
        """``on_item_done(queue, how, seconds)`` hears how each attempt ended (``seconds`` is
        None for an item released without running).

        ``on_database_contact(reached)`` hears how each claim, settle and lease renewal
        ended: True when it reached PostgreSQL, False when the database was unavailable. It is
        called on the hot path (once per claim and settle), so it must be cheap."""
        self.settings = settings
        self.database = database
        self.handlers = dict(handlers)
        self.worker_id = worker_id
        self.queues = [q for q in Queue if q in self.handlers]
        self._on_progress = on_progress
        self._on_item_done = on_item_done
        self._stop_claiming = threading.Event()
        self._stopped = threading.Event()  # shut down: the lease renewer ends with it
        self._drained = threading.Event()  # a drain-only dispatcher has finished
        # The worker's state; the threads below tell it what they meet.
        self._worker_state = WorkerState(
            handlers=self.handlers.values(),
            stopping=self._stop_claiming,
            progress=self._progress,
            wake=lambda: self.wake(notified=False),
            on_state=on_state,
            on_database_contact=on_database_contact,
        )
        # The items held and the claims on their way to us; its lock also guards the stats.
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
            contact_failed=self._worker_state.contact_failed,
            wake=lambda: self.wake(notified=False),
        )
        # How each attempt ends in the database; it reaches the slots and the state only
        # through these callables.
        self._settler = Settler(
            settings=settings,
            database=database,
            worker_id=worker_id,
            count=self._count,
            untrack=self._untrack,
            database_lost=self._worker_state.database_lost,
            database_back=self._worker_state.database_back,
            pause=self._worker_state.pause,
            claim_refused=self._claim_refused,
            claim_accepted=self._worker_state.claim_accepted,
        )
        self._handoff: queue_mod.SimpleQueue[Item | None] = queue_mod.SimpleQueue()
        self._wake = threading.Event()
        self._notified = False
        self._budget_ends = float("inf")  # run --once: no claims after SOKRATOS_TICK_BUDGET
        self._stats = Stats()
        self._threads: list[threading.Thread] = []
        self._rotation = 0
        self._shares = QueueShares(self.queues)
        # When each queue whose claims are refused may be asked again (monotonic).
        self._refused_retry_at: dict[Queue, float] = {}
        self._refused_lock = threading.Lock()
        # The server process of the dispatcher's statement in progress (None between them):
        # the watchdog asks PostgreSQL what it waits for when the dispatcher stops coming round.
        self.dispatcher_backend_pid: int | None = None

    @property
    def state(self) -> str:
        """What the worker is doing (:class:`State`), as the daemon and ``run --once`` read it."""
        return self._worker_state.state

    @property
    def state_detail(self) -> str:
        """Why, when the state is not running ("" otherwise)."""
        return self._worker_state.detail

    # -- lifecycle -------------------------------------------------------------------

    def start(self, *, drain_only: bool = False, budget_s: float | None = None) -> None:
        """Start the slot threads, the lease renewer and the dispatcher."""
        if budget_s is not None:
            self._budget_ends = time.monotonic() + budget_s
        self._worker_state.drain_only = drain_only
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
        return self._drained.wait(timeout)

    def shutdown(self, grace_s: float) -> int:
        """Stop claiming, let in-flight items finish within ``grace_s``, release the rest.

        Returns how many items were released (their attempt given back).
        """
        self.request_stop()  # first: the state's report may wait behind a heartbeat's write
        deadline = time.monotonic() + grace_s  # so may the grace's start: it counts from here
        in_flight = self.inflight_count()
        # (The detail stays on STATUS=: the bare state replaced the stop's own line at once.)
        finishing = f"finishing {in_flight} items in flight" if in_flight else ""
        self._worker_state.set(State.STOPPING, finishing)
        while self.inflight_count() and time.monotonic() < deadline:
            self._progress()  # items finishing within the grace is progress too
            time.sleep(0.05)
        leftovers = self._inflight.take_all()
        give_up_at = time.monotonic() + RELEASE_STATEMENT_TIMEOUT_MS / 1000
        released = self._give_back(leftovers)
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

    def _give_back(self, items: list[Item], on: Connection | None = None) -> int:
        """Give back items not run, or still running at the end of the grace (attempt
        uncounted); those released are counted as given_back. Returns how many."""
        released = self._settler.release(items, on)
        with self._lock:
            for item in released:
                self._stats.add(item.queue, "given_back")
        if self._on_item_done is not None:  # (the metric counted only the slots' give-backs)
            for item in released:
                self._on_item_done(item.queue, RELEASED, None)
        return len(released)

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
                if self._worker_state.paused() and drain_only:
                    log.info("drain_ended_paused", reason=self.state_detail)
                    break  # run --once: a paused tick ends instead of waiting out its budget
                if self._worker_state.paused():
                    # A wake while paused would end every wait at once (a busy loop); the
                    # resume wakes the dispatcher itself.
                    self._wake.clear()
                    resume_in = self._worker_state.paused_until - time.monotonic()
                    self._wait(min(1.0, max(0.05, resume_in)))
                    self._worker_state.maybe_resume()
                    continue
                self._wake.clear()
                self._notified = False
                try:
                    asked, got = self._claim_or_say_refused()
                    next_in = self._next_claim_in(asked, got)
                except DatabaseUnavailable as exc:
                    self._worker_state.database_lost(exc)
                    log.debug("claim_waiting_for_database", error=str(exc), retry_in_s=db_delay)
                    self._wait(db_delay)
                    db_delay = min(db_delay * 2, 5.0)
                    continue
                except Exception:  # keep claiming: an error escaping here would end the dispatcher
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
                # Not _stopped: items still in flight keep their leases renewed until the
                # shutdown settles or releases them.
                self._drained.set()

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
        if not asked:  # (no claim was sent when every slot is busy)
            return
        # A full disk still lets claims through: the settles of the items in flight tell.
        if self._worker_state.writes_refused() and self.inflight_count():
            return
        self._worker_state.database_back()

    def _wait(self, seconds: float) -> None:
        # Wake at least every second so the watchdog sees progress.
        end = time.monotonic() + seconds
        while not self._stop_claiming.is_set():
            left = end - time.monotonic()
            if left <= 0 or self._wake.wait(min(left, 1.0)):
                return
            self._progress()

    def _claim_or_say_refused(self) -> tuple[int, int]:
        """:meth:`_claim_for_idle_slots`; a claim the server refuses itself (a privilege
        revoked) is :class:`ClaimRefused`: the worker waits for the database as in an outage,
        not ready, saying why (it went on as "running", ready, a traceback at each try)."""
        try:
            return self._claim_for_idle_slots()
        except pg_errors.Error as exc:
            if not refused_by_setup(exc):
                raise  # (a bug of the worker's own: its traceback, as before)
            raise ClaimRefused(claim_refusal(exc)) from exc

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
        sent = False  # a claim statement went out (none when every queue's retry waits)
        try:
            with self._dispatcher_connection() as conn:
                for q, share in plan:
                    limit = free if share is None else min(share, free)
                    if free <= 0:
                        break
                    if limit <= 0 or q in short:
                        continue
                    if not self._may_claim_from(q):
                        short.add(q)
                        continue
                    sent = True
                    try:
                        items = self._claim_cancellable(conn, q, limit)
                    except pg_errors.Error as exc:
                        if not refused_by_setup(exc):
                            raise
                        # The other queues are still claimed: this one waits for its fix.
                        self._claim_refused(q, ClaimRefused(claim_refusal(exc)))
                        short.add(q)
                        continue
                    if not self._stop_claiming.is_set():  # (a claim cancelled at the stop
                        self._worker_state.claim_accepted(q)  # may never have been checked)
                    self._shares.claimed(q, all_asked=len(items) >= limit)
                    if len(items) < limit:
                        short.add(q)
                    fresh = self._take_claimed(items)
                    if fresh is None:
                        self._give_back(items, conn)
                        break
                    for item in fresh:
                        self._handoff.put(item)
                    free -= len(items)
                    got += len(items)
        finally:
            self._inflight.end_claim()
        return (asked if sent else 0), got

    def _may_claim_from(self, queue: Queue) -> bool:
        """False for a queue whose claims the server refuses, until its next retry is due;
        the one thread told True is the retry (the next is due a while later)."""
        if not self._worker_state.refuses(queue):
            return True
        with self._refused_lock:
            now = time.monotonic()
            if now < self._refused_retry_at.get(queue, 0.0):
                return False
            self._refused_retry_at[queue] = now + REFUSED_CLAIM_RETRY_S
            return True

    def _claim_refused(self, queue: Queue, exc: ClaimRefused) -> None:
        """A claim from ``queue`` was refused: the next is due REFUSED_CLAIM_RETRY_S later."""
        with self._refused_lock:
            self._refused_retry_at[queue] = time.monotonic() + REFUSED_CLAIM_RETRY_S
        self._worker_state.claim_refused(queue, exc)

    def _refused_retry_in(self) -> float | None:
        """Seconds until a refused queue's claim is due again; None when none is refused."""
        refused = self._worker_state.refused_queues()
        if not refused:
            return None
        with self._refused_lock:
            due = min(self._refused_retry_at.get(q, 0.0) for q in refused)
        return max(0.0, due - time.monotonic())

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

    def _next_claim_in(self, asked: int, got: int) -> float | None:
        """How soon the dispatcher should claim again, when no wake comes first (None: at
        the heartbeat): a full batch or a busy slot wakes it; else the next ready item."""
        if got:
            return None
        if not asked:  # every slot busy, or every queue refused with no retry due
            return self._refused_retry_in()
        return self._next_ready_in()

    def _next_ready_in(self) -> float | None:
        """When the next item of a queue not refused becomes claimable, or a refused queue's
        retry is due, whichever is first (None: nothing waits)."""
        refused = self._worker_state.refused_queues()
        with self._dispatcher_connection() as conn:
            ready_in = store.next_ready_in(conn, [q for q in self.queues if q not in refused])
        retry_in = self._refused_retry_in()
        return min((t for t in (ready_in, retry_in) if t is not None), default=None)

    @contextmanager
    def _dispatcher_connection(self) -> Iterator[Connection]:
        """A pooled connection whose server process is known while the dispatcher uses it."""
        with self.database.connection() as conn:
            self.dispatcher_backend_pid = conn.pgconn.backend_pid
            try:
                yield conn
            finally:
                self.dispatcher_backend_pid = None

    def _take_claimed(self, items: list[Item]) -> list[Item] | None:
        """Record claimed items, counted as claimed; None when they are to be given back
        instead: claiming paused while they were claimed (nothing starts once a pause has
        begun: an item just given back would run again at once), or the stop came."""
        if items and self._worker_state.paused():
            with self._lock:
                for item in items:
                    self._stats.add(item.queue, "claimed")
            return None
        return self._track_claimed(items)

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

    # -- slots -----------------------------------------------------------------------

    def _slot_loop(self) -> None:
        while True:
            item = self._handoff.get()
            if item is None:
                return
            # The item's reads and settle, and the next items claimed with it, share one
            # connection: a slot never needs two.
            with self.database.holding():
                while item is not None and self._still_ours(item):
                    item = self._process(item)
            if self._notified:
                self._wake.set()

    def _still_ours(self, item: Item) -> bool:
        """False for an item given back at the end of the stop's grace before a slot started
        it: running it would spend an LLM call on a settle its lost lease fences."""
        if self._inflight.get(item.queue, item.id) is not None:
            return True
        log.info(
            "item_not_started_at_stop",
            queue=item.queue.value,
            item_id=item.id,
            attempt=item.attempt,
            hint="the stop's release gives its lease back with the other items' (if that"
            " fails, release_failed says so and the lease runs out)",
        )
        return False

    def _process(self, item: Item) -> Item | None:
        """Handle and settle one item; returns the next item claimed with the settle."""
        # Bound for this item only (reset before the next one on this slot), so that every line
        # logged while it is handled and settled, the pipelines' and LLM client's too, names it.
        # (A claim past the limit is not an attempt: its lines name the last one counted, as
        # its dead letter does.)
        claim = self._pay_owed_give_back(item)
        if claim is None:
            return None
        item = claim
        with structlog.contextvars.bound_contextvars(
            queue=item.queue.value,
            item_id=item.id,
            attempt=last_attempt(item, self.settings.max_attempts),
        ):
            return self._handle_and_settle(item)

    def _pay_owed_give_back(self, item: Item) -> Item | None:
        """The claim as it runs: with the give-back this process owes its previous attempt
        written (:meth:`Settler.pay_owed_give_back`) before the attempt limit is checked, so an
        outage on the last attempt does not dead-letter it; the settles are fenced by it.
        None: not to be run (left to its lease, or released at the stop)."""
        paid = self._settler.pay_owed_give_back(item)
        if paid is None:
            self._finished(item, time.monotonic(), ABANDONED)  # (left to its lease)
            return None
        if paid is item:
            return item
        if self._inflight.correct(paid):
            return paid
        # The stop took the claim before its correction: its release, fenced by the claim,
        # wrote nothing, so the item would stay leased to a worker that exits; released here.
        self._give_back([paid])
        return None

    def _handle_and_settle(self, item: Item) -> Item | None:
        """:meth:`_process` within the item's log context."""
        started = time.monotonic()
        max_attempts = self.settings.max_attempts
        bound = log.bind(
            queue=item.queue.value, item_id=item.id, attempt=last_attempt(item, max_attempts)
        )
        handler = self.handlers[item.queue]
        try:
            if item.attempt > max_attempts:
                raise no_attempt_left(item, max_attempts)
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
            if outcome_already_recorded(exc):
                bound.error("item_id_reused", error=describe(exc), hint=reused_id_hint(item))
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
        latest = self._inflight.latest_claim(item)
        self._finished(item, started, self._settler.fail(latest, exc, handler, bound))
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
        want_next = (
            not (self._worker_state.paused() or self._budget_spent())
            and self._inflight.begin_claim()
        )
        wanted = item.queue
        if want_next and len(self.queues) > 1:
            wanted = self._shares.for_settle(item.queue, self._inflight.by_queue())
        claim_from: Queue | None = wanted if want_next else None
        if claim_from is not None and not self._may_claim_from(claim_from):
            # Refused, its retry not due: this item's queue instead, else none at all.
            fallback = item.queue != claim_from and self._may_claim_from(item.queue)
            claim_from = item.queue if fallback else None
        try:
            return self._settle_and_claim(
                item,
                effects,
                bound,
                started,
                claim_from=claim_from,
                wake_dispatcher=want_next and claim_from is None,
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
        wake_dispatcher: bool = False,
    ) -> tuple[Item | None, str]:
        """The settle of :meth:`_settle_success`, claiming the next item from ``claim_from``
        unless it is None; ``wake_dispatcher``: the dispatcher fills the slot instead."""
        done = self._settler.write_success(item, effects, bound, claim_from=claim_from)
        if done is None:
            return None, ABANDONED
        result, next_items = done
        if claim_from is not None and result.settled:  # (a fenced settle claimed nothing)
            self._shares.claimed(claim_from, all_asked=bool(next_items))
        kind = self._settler.report_success(item, effects, result, bound, started)
        # Tracked first, so in-flight never reads 0 in between.
        fresh = self._take_claimed(next_items)
        self._untrack(item)
        if fresh is None:
            # Claimed as the stop or a pause came: given back, not run (nor left to the lease).
            self._give_back(next_items)
            return None, kind
        if wake_dispatcher or (claim_from is not None and not next_items and len(self.queues) > 1):
            # The other queue may have items: the dispatcher fills the slot now (it would wait
            # up to 5 s), once the item is untracked so that it counts the slot free.
            self.wake(notified=False)
        return (fresh[0] if fresh else None), kind

    # -- reporting -------------------------------------------------------------------

    def _progress(self) -> None:
        if self._on_progress is not None:
            self._on_progress()
