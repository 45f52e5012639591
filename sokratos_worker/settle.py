"""How an attempt ends in the database: saved, retried, given back or dead-lettered.

Every write here is fenced by the item's lease and attempt (durability.md): a settle that
changes nothing is explained by :meth:`Settler.report_fenced`. A settle that meets the database
away is retried while the lease lasts, then abandoned to the lease's expiry. The runner owns
the slots, :mod:`worker_state` the worker's state; a :class:`Settler` reaches them only through
the callables it is given: ``count``, ``untrack``, ``database_lost``, ``database_back`` and
``pause``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Protocol, TypeVar

import structlog
from psycopg import errors as pg_errors

from sokratos_worker.config import Settings
from sokratos_worker.errors import (
    INVALID_PAYLOAD_PREFIX,
    ClaimRefused,
    DatabaseUnavailable,
    InvalidPayload,
    NoAttemptLeft,
    reached_database,
)
from sokratos_worker.handlers import Handler
from sokratos_worker.model import Effects, Item, NewMemory, Outcome, Queue, SettleResult
from sokratos_worker.policy import Decision, Step, after_failure, describe, retry_delay
from sokratos_worker.store import queue as store
from sokratos_worker.store.connection import (
    Connection,
    Database,
    claim_refusal,
    lock_wait_limited,
    refused_by_setup,
    server_short_of_a_resource,
    time_limited,
)
from sokratos_worker.store.queue_sql import QUEUE_SQL

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
# How many times an item is given back for a database outage (in this process) before such a
# failure counts as its attempt: an outage is not the item's fault, but a read that takes the
# server down every time (or ends its own session) would otherwise run for ever.
DATABASE_GIVE_BACKS_PER_ITEM = 3
_GIVE_BACKS_REMEMBERED = 10_000

# How an attempt ended when it did not end the item (besides the outcomes of Outcome):
RETRY = "retry"  # failed, scheduled again after a backoff
RELEASED = "released"  # given back: not the item's fault (no backend, the database away)
_FIRST_SETTLE_DELAY = 0.2  # a settle's first wait for the database; it doubles up to 5 s
_SHORT_HINT = (
    "the server refused it for a full disk or no memory: the lease expires; if this worker"
    " claims the item again it runs under the same attempt (up to three times an item),"
    " another worker's claim counts it"
)
LEASE_LOST = "lease_lost"  # another worker took the item over; this settle changed nothing
ABANDONED = "abandoned"  # the database stayed away past the lease; the item runs again


class Count(Protocol):
    """Counts one event in the runner's stats (claimed, saved, retried, given_back ...)."""

    def __call__(self, queue: Queue, kind: str, backend: str | None = None) -> None: ...


class Untrack(Protocol):
    """Ends the run of an item in the runner's in-flight registry (see ``Runner._untrack``);
    ``leave_leased``: its settle could not be written, so its lease and attempt stay."""

    def __call__(self, item: Item, *, leave_leased: bool = False) -> bool: ...


def outcome_already_recorded(exc: BaseException) -> bool:
    """A settle refused because work_outcomes holds an outcome under this item's id already."""
    return isinstance(exc, pg_errors.UniqueViolation) and exc.diag.constraint_name == OUTCOME_KEY


def reused_id_hint(item: Item) -> str:
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


def no_attempt_left(item: Item, max_attempts: int) -> NoAttemptLeft:
    """Why a claim past SOKRATOS_MAX_ATTEMPTS ends the item unrun: only a claim that took
    over an expired lease found an attempt that died; otherwise none was running."""
    if item.took_over_lease or store.died_in(item, item.attempt - 1):
        # (The second: the claim that took the lease over was given back since.)
        return NoAttemptLeft(WORKER_DIED)
    return NoAttemptLeft(
        f"{ATTEMPTS_USED_UP}: {item.attempt - 1} of SOKRATOS_MAX_ATTEMPTS={max_attempts} before"
        " this claim (inserted with attempts preset, or the limit was lowered); the item"
        " never ran in this attempt"
    )


def last_attempt(item: Item, max_attempts: int) -> int:
    """The attempt a dead letter records: a claim past the limit (the last attempt died,
    or attempts were used up) is not an attempt of its own (durability.md), so the last
    attempt counted before it is named."""
    return item.attempt - 1 if item.attempt > max_attempts else item.attempt


def _recorded_by_us(item: Item, max_attempts: int, by_attempt: int | None, detail: str) -> bool:
    """Whether an item's recorded outcome is the one this claim's settle wrote (its answer
    lost with the connection). A claim past the limit dead-letters under the attempt before
    it (:func:`last_attempt`), any other claim under its own; and another worker's claim
    past the limit dead-letters under OUR attempt's number, as the worker that died."""
    if by_attempt is None:
        return True  # (a row written before attempts were recorded)
    if item.attempt > max_attempts:
        return by_attempt == last_attempt(item, max_attempts)
    return by_attempt == item.attempt and not detail.startswith(WORKER_DIED)


def archive_memories(
    handler: Handler, item: Item, bound: structlog.BoundLogger
) -> tuple[NewMemory, ...]:
    """The raw archive a dead letter keeps, if the handler has one; none if it fails."""
    try:
        return handler.final_failure_memories(item)
    except Exception as exc:
        bound.warning("archive_memories_failed", error=describe(exc))
        return ()


def dead_letter_hint(failure_id: int | None, reason: str) -> str:
    """What an operator does about a dead letter: a replay helps unless the payload is bad."""
    replay = failure_id if failure_id is not None else "ID"
    if reason.startswith(INVALID_PAYLOAD_PREFIX):
        return (
            f"see 'sokratos-worker failed show {replay}'; the payload itself is invalid,"
            " so a replay fails the same way: fix what produced it"
        )
    return (
        f"see 'sokratos-worker failed show {replay}'; once the cause is fixed"
        f" replay it with 'sokratos-worker failed retry {replay}'"
    )


class Settler:
    """Writes how each attempt ended, fenced by its lease, through database outages."""

    def __init__(
        self,
        *,
        settings: Settings,
        database: Database,
        worker_id: str,
        count: Count,
        untrack: Untrack,
        database_lost: Callable[[DatabaseUnavailable], None],
        database_back: Callable[[float], None],
        pause: Callable[[str], None],
        claim_refused: Callable[[Queue, ClaimRefused], None] = lambda queue, exc: None,
        claim_accepted: Callable[[Queue], None] = lambda queue: None,
    ) -> None:
        """``database_lost`` / ``database_back``: a settle met the database away / reached it
        (the runner's state; ``database_back`` is given when that settle was sent, so one sent
        before the outage was met does not end it); ``pause``: no backend can be reached, stop
        claiming; ``claim_refused`` / ``claim_accepted``: the claim of the next item a settle
        carried was refused by the server / went through."""
        self.settings = settings
        self.database = database
        self.worker_id = worker_id
        self._count = count
        self._untrack = untrack
        self._database_lost = database_lost
        self._database_back = database_back
        self._pause = pause
        self._claim_refused = claim_refused
        self._claim_accepted = claim_accepted
        self._database_give_backs: dict[tuple[Queue, int], int] = {}
        # Give-backs not written (the outage outlasted the settle): the attempt owed, per item,
        # written at this process's next claim of it (pay_owed_give_back).
        self._owed_give_backs: dict[tuple[Queue, int], int] = {}
        self._give_backs_lock = threading.Lock()

    # -- success ---------------------------------------------------------------------

    def write_success(
        self,
        item: Item,
        effects: Effects,
        bound: structlog.BoundLogger,
        *,
        claim_from: Queue | None,
    ) -> tuple[SettleResult, list[Item]] | None:
        """Commit the effects and the outcome and delete the item, claiming the next items
        from ``claim_from`` unless it is None; None when the settle was abandoned."""

        def settle(conn: Connection) -> tuple[SettleResult, list[Item]]:
            try:
                done = store.settle_success(
                    conn,
                    item,
                    effects,
                    owner=self.worker_id,
                    claim_from=claim_from,
                    lease_s=self.settings.lease,
                )
            except pg_errors.Error as exc:
                if claim_from is None or not refused_by_setup(exc):
                    raise
                # Perhaps the next item's claim refused (a privilege revoked on that queue):
                # this item's outcome is still written, without it (it failed with the claim).
                done = store.settle_success(
                    conn,
                    item,
                    effects,
                    owner=self.worker_id,
                    claim_from=None,
                    lease_s=self.settings.lease,
                )
                # (Said once the settle alone went through: then the claim was refused.)
                bound.warning("settle_claim_refused", queue=claim_from.value, error=str(exc))
                self._claim_refused(claim_from, ClaimRefused(claim_refusal(exc)))
                return done
            if claim_from is not None and done[0].settled:  # (a fenced settle claims nothing)
                self._claim_accepted(claim_from)
            return done

        return self._with_database(item, settle, bound)

    def report_success(
        self,
        item: Item,
        effects: Effects,
        result: SettleResult,
        bound: structlog.BoundLogger,
        started: float,
    ) -> str:
        """Count and log what :meth:`write_success` did; returns how the attempt ended."""
        if not result.settled:
            return self.report_fenced(item, bound, released=LEASE_LOST)
        outcome = (result.outcome or effects.outcome).value
        if outcome != effects.outcome.value:
            bound.info("settled_as_near_duplicate", planned=effects.outcome.value, outcome=outcome)
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
        return outcome

    # -- failure ---------------------------------------------------------------------

    def fail(
        self, item: Item, exc: BaseException, handler: Handler, bound: structlog.BoundLogger
    ) -> str:
        """Settle a failed attempt; a settle the database refuses must not kill the slot."""
        try:
            return self._settle_failure(item, exc, handler, bound)
        except Exception as settle_exc:
            if outcome_already_recorded(settle_exc):
                bound.error("item_id_reused", error=describe(settle_exc), hint=reused_id_hint(item))
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
        decision = after_failure(
            exc,
            attempt=item.attempt,
            max_attempts=self.settings.max_attempts,
            database_away=self._database_away(item, exc),
        )
        backend = getattr(exc, "backend", None)
        if decision.step is Step.WAIT_FOR_DATABASE:
            # The item runs again once the database answers (the give-back waits for it).
            kind = self._give_back(item, decision.reason, bound)
        elif decision.step is Step.GIVE_BACK:
            # Paused first: an item given back before the pause was claimed again at once.
            self._pause(decision.reason)
            kind = self._give_back(item, decision.reason, bound)
        elif decision.step is Step.RETRY:
            kind = self._schedule_retry(item, decision, backend, bound)
        else:
            kind = self._dead_letter_failed(
                item, exc, decision, backend, handler=handler, bound=bound
            )
        if kind != ABANDONED:  # an abandoned settle untracked it, and a newer claim may run now
            self._untrack(item)
        return kind

    def _database_away(self, item: Item, exc: BaseException) -> bool:
        """Whether ``exc`` is a database outage to wait out with the item's attempt given back:
        not a full pool, a lock or a refusal (the server answered), and not past
        DATABASE_GIVE_BACKS_PER_ITEM give-backs of this item (then it is the item's attempt)."""
        if not isinstance(exc, DatabaseUnavailable) or reached_database(exc):
            return False
        return self._database_give_back_left(item)

    def _database_give_back_left(self, item: Item) -> bool:
        """Count one more give-back of ``item`` for the database; False past the limit."""
        key = (item.queue, item.id)
        with self._give_backs_lock:
            given = self._database_give_backs.get(key, 0)
            if given >= DATABASE_GIVE_BACKS_PER_ITEM:
                return False
            if len(self._database_give_backs) >= _GIVE_BACKS_REMEMBERED:
                self._database_give_backs.clear()  # (a bound: an outage touches few items)
            self._database_give_backs[key] = given + 1
        return True

    def _give_back(self, item: Item, reason: str, bound: structlog.BoundLogger) -> str:
        """Not the item's fault: its attempt given back. Owed until written (an abandoned
        settle hands a claim of ours adopted meanwhile to a slot before it returns)."""
        self._owe_give_back(item, owed=True)
        given = self._with_database(
            item, lambda c: store.give_back(c, item, owner=self.worker_id), bound
        )
        if given:
            self._count(item.queue, "given_back")
            bound.warning("attempt_given_back", reason=reason)
            kind = RELEASED
        else:
            kind = ABANDONED if given is None else self.report_fenced(item, bound, RELEASED)
        if kind == RELEASED:
            self._owe_give_back(item, owed=False)
        return kind

    def _owe_give_back(self, item: Item, *, owed: bool) -> None:
        """Remember (or forget) a give-back not written (the outage outlasted it, or this
        process took the item over meanwhile), for this process's next claim of the item."""
        key = (item.queue, item.id)
        with self._give_backs_lock:
            if not owed:
                self._owed_give_backs.pop(key, None)
                return
            if len(self._owed_give_backs) >= _GIVE_BACKS_REMEMBERED:
                self._owed_give_backs.clear()  # (a bound: an outage touches few items)
            self._owed_give_backs[key] = item.attempt

    def pay_owed_give_back(self, item: Item) -> Item | None:
        """The claim ``item`` to run: with the give-back this process owes its previous attempt
        written (attempt uncounted, fenced in SQL: only when this claim took over our own lease
        of that attempt); ``item`` itself when none is owed or it was not written (the attempt
        counts); None when whether it was written is unknown: the item is not run but left to
        its lease, the give-back still owed."""
        if not self._owed_give_backs:  # (the hot path: nothing owed, no lock)
            return item
        with self._give_backs_lock:
            owed = self._owed_give_backs.pop((item.queue, item.id), None)
        if owed is None or owed != item.attempt - 1:
            return item
        params = {"id": item.id, "owner": self.worker_id, "attempt": item.attempt}
        bound = log.bind(queue=item.queue.value, item_id=item.id, attempt=owed)
        try:
            # A row locked by a long transaction must not hold the slot: the attempt counts.
            with (
                self.database.connection() as conn,
                lock_wait_limited(conn, RELEASE_STATEMENT_TIMEOUT_MS),
            ):
                row = conn.execute(QUEUE_SQL[item.queue].give_back_owed, params).fetchone()
        except DatabaseUnavailable as exc:
            # The connection may have dropped after the commit (unless the server answered
            # the failure, rolled back): the row tells.
            written = False if reached_database(exc) else self._owed_give_back_landed(item, params)
            if written is None:
                self._leave_owed_to_its_lease(item, owed, exc, bound)
                return None
            if not written:
                return self._owed_give_back_failed(item, exc, bound)
        except pg_errors.Error as exc:  # (refused or cancelled: rolled back)
            return self._owed_give_back_failed(item, exc, bound)
        else:
            if row is None:
                # Another worker's claim came in between: its count stands.
                bound.info("owed_give_back_fenced")
                return item
        self._count(item.queue, "given_back")
        bound.warning(
            "owed_give_back_written",
            hint="the database was away (or refused writes) past 0.8 x SOKRATOS_LEASE: the"
            " give-back is written"
            " now that this worker claims it again, and it runs under the same attempt",
        )
        return dataclasses.replace(
            item, attempt=owed, errors=item.errors[:-1], took_over_lease=False
        )

    def _owed_give_back_landed(self, item: Item, params: dict[str, object]) -> bool | None:
        """Whether the owed give-back of ``item`` (its answer lost) was written: the row
        leased to us at the owed attempt; None when the database did not answer."""
        try:
            with self.database.connection() as conn:
                row = conn.execute(QUEUE_SQL[item.queue].owed_attempts, params).fetchone()
        except (DatabaseUnavailable, pg_errors.Error):
            return None
        return row is not None and row[0] == item.attempt - 1

    def _owed_give_back_failed(
        self, item: Item, exc: BaseException, bound: structlog.BoundLogger
    ) -> Item:
        """Not written: the claim runs as counted."""
        bound.warning(
            "owed_give_back_failed",
            error=describe(exc),
            hint="its claim counts as another attempt, as for any settle an outage cut off",
        )
        return item

    def _leave_owed_to_its_lease(
        self, item: Item, owed: int, exc: BaseException, bound: structlog.BoundLogger
    ) -> None:
        """Its answer lost and the database away: not run (had the give-back been written,
        every settle of the run would be fenced, its LLM call wasted and its result dropped)
        but left to its lease, still owed, so that this worker's next claim, taking over our
        lease at the owed attempt, writes it again and the counts are as if the answer had
        come (had it not been written, that claim counts, as for any settle an outage cut off)."""
        bound.warning(
            "owed_give_back_failed",
            error=describe(exc),
            hint="whether it was written is unknown (the database went away): the item is not"
            " run but left to its lease; this worker's next claim of it runs it under the owed"
            " attempt if it was, and counts the attempt if not",
        )
        self._owe_give_back(dataclasses.replace(item, attempt=owed), owed=True)
        self._untrack(item, leave_leased=True)

    def _schedule_retry(
        self,
        item: Item,
        decision: Decision,
        backend: str | None,
        bound: structlog.BoundLogger,
    ) -> str:
        """An attempt failed with attempts left: run it again after a backoff."""
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
            self._count(item.queue, "retried")
            bound.warning("item_retry_scheduled", error=decision.reason, retry_in_s=round(delay, 1))
            return RETRY
        if ok is False:
            return self.report_fenced(item, bound, released=RETRY)
        return ABANDONED

    def _dead_letter_failed(
        self,
        item: Item,
        exc: BaseException,
        decision: Decision,
        backend: str | None,
        *,
        handler: Handler,
        bound: structlog.BoundLogger,
    ) -> str:
        """The last attempt failed (or the payload is invalid): failed_operations, with the
        raw archive when the handler keeps one."""
        memories = () if isinstance(exc, InvalidPayload) else archive_memories(handler, item, bound)
        ran = not isinstance(exc, NoAttemptLeft)
        result = self._dead_letter(item, decision.reason, backend, memories, bound, ran=ran)
        if result is None:
            return ABANDONED
        if not result.settled:
            return self.report_fenced(item, bound, released=LEASE_LOST)
        kind = Outcome.ARCHIVED.value if result.memory_ids else Outcome.FAILED.value
        self._count(item.queue, kind)
        bound.error(
            "item_dead_lettered",
            op_type=item.op_type,
            error=decision.reason,
            outcome=kind,
            memory_count=len(result.memory_ids),  # (an archive can be thousands)
            first_memory_ids=list(result.memory_ids[:10]),
            failure_id=result.failure_id,
            hint=dead_letter_hint(result.failure_id, decision.reason),
        )
        return kind

    def _dead_letter(
        self,
        item: Item,
        error: str,
        backend: str | None,
        memories: tuple[NewMemory, ...],
        bound: structlog.BoundLogger,
        *,
        ran: bool,
    ) -> SettleResult | None:
        """failed_operations + outcome + delete; without the archive if it is refused.
        ``ran``: this attempt ran the handler (not a claim past the limit)."""

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
                    last_attempt=last_attempt(item, self.settings.max_attempts),
                    ran=ran,
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

    # -- fenced and abandoned settles ------------------------------------------------

    def report_fenced(self, item: Item, bound: structlog.BoundLogger, released: str) -> str:
        """Say why a settle changed nothing, and return how the attempt really ended: the
        outcome an earlier commit of ours recorded (its answer lost with the connection),
        ``released`` when the item waits unleased (our retry or give-back landed), or
        ``lease_lost`` (another worker holds it, or finished it)."""
        try:
            with self.database.connection() as conn:
                recorded = store.outcome_of(conn, item)
                exists, owner = store.lease_owner(conn, item)
                attempts = store.unleased_attempts(conn, item) if exists and not owner else None
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
            outcome, by_attempt, detail = recorded
            if not _recorded_by_us(item, self.settings.max_attempts, by_attempt, detail):
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
            # Our retry keeps the attempt counted, our give-back uncounts it; another
            # worker's claim counted one more, whatever it did then.
            ours = {RETRY: item.attempt, RELEASED: item.attempt - 1}.get(released)
            if attempts is not None and attempts == ours:
                # A retry or give-back of ours landed before the connection dropped.
                bound.info("item_already_released")
                self._count(item.queue, "retried" if released == RETRY else "given_back")
                return released
            bound.warning(
                "lease_lost",
                new_owner=None,
                hint="another worker took the item over and has released it since; it runs"
                " again under that worker's attempt count",
            )
            return LEASE_LOST
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
            sent = time.monotonic()
            try:
                with self.database.connection() as conn:
                    result = fn(conn)
            except DatabaseUnavailable as exc:
                self._database_lost(exc)
                if time.monotonic() + delay > deadline:
                    short = server_short_of_a_resource(exc) and self._database_give_back_left(item)
                    if short:
                        # The server refused the settle (rolled back): not the item's attempt.
                        self._owe_give_back(item, owed=True)
                    bound.error(
                        "settle_abandoned",
                        error=str(exc),
                        hint=_SHORT_HINT
                        if short
                        else "the lease expires and the item is claimed again",
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
                self._database_back(sent)
                return result

    # -- give-backs ------------------------------------------------------------------

    def release(self, items: list[Item], on: Connection | None = None) -> list[Item]:
        """Give back ``items`` (attempt uncounted), on ``on`` or a pooled connection; returns
        those released (not those another worker holds now)."""
        if not items:
            return []
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
            return []
        for item in released:
            # Its own attempt: a slot's context names the item it settled, not this one.
            log.info("item_released", queue=item.queue.value, item_id=item.id, attempt=item.attempt)
        return released
