"""The items this process holds a lease on, and the claims still on their way to it.

One lock (:attr:`InFlight.lock`) guards all of it: the items running here, the re-claims of
items adopted while they ran, the items left leased after a settle that could not be written,
the count of claim statements sent and not yet tracked or given back, and the dispatcher's
claim that a stop may have to cancel. A stop relies on one lock covering them: it sets the
stop, takes the items in flight and waits for the claims under the same lock a claim is tracked
under, so a claim either lands before the take (and is released with the rest) or sees the
stop, never neither. The runner guards its stats with this lock too.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import structlog

from sokratos_worker.model import Item, Queue
from sokratos_worker.policy import describe
from sokratos_worker.store.connection import Connection

log = structlog.get_logger(__name__)

Key = tuple[Queue, int]


class InFlight:
    """The registry of claims this process holds, and the claims a stop must wait for."""

    def __init__(self, stopping: threading.Event) -> None:
        """``stopping``: set by the stop; checked under :attr:`lock` when a claim begins and
        when its items are tracked."""
        self.lock = threading.Lock()
        self._stopping = stopping
        # Held while the stop sends the cancel of the dispatcher's claim, and taken by the
        # dispatcher once that claim returns, before its connection runs anything else: the
        # cancel can only reach that claim (see await_claims).
        self._cancel_lock = threading.Lock()
        self._items: dict[Key, Item] = {}
        # Claim statements sent and not yet tracked or given back: the stop waits for them,
        # or what they land would stay leased to a worker that has exited.
        self._claims_in_flight = 0
        self._claims_ended = threading.Condition(self.lock)
        self._claiming_on: Connection | None = None  # the dispatcher's claim being sent
        self._adopted: dict[Key, Item] = {}  # re-claims of items running here
        self._left_leased: dict[Key, float] = {}  # ran, settle not written

    # -- what is held ----------------------------------------------------------------

    def count(self) -> int:
        """Items claimed and not yet settled by this process."""
        with self.lock:
            return len(self._items)

    def by_queue(self) -> Counter[Queue]:
        """Items claimed and not yet settled by this process, per queue."""
        with self.lock:
            return Counter(queue for queue, _ in self._items)

    def ids_by_queue(self, queues: list[Queue]) -> dict[Queue, list[int]]:
        """The ids of the items running here, per queue (each of ``queues`` present)."""
        with self.lock:
            by_queue: dict[Queue, list[int]] = {q: [] for q in queues}
            for q, item_id in self._items:
                by_queue.setdefault(q, []).append(item_id)
        return by_queue

    def get(self, queue: Queue, item_id: int) -> Item | None:
        """The item running here under this key, if it still is."""
        with self.lock:
            return self._items.get((queue, item_id))

    def held_ids(self, queue: Queue, lease_s: float) -> list[int]:
        """The items of ``queue`` whose lease this process knows it holds: running, adopted,
        or left leased after a settle that could not be written (those expire by themselves,
        so entries older than the lease are forgotten)."""
        horizon = time.monotonic() - 2 * lease_s
        with self.lock:
            for key in [k for k, at in self._left_leased.items() if at < horizon]:
                del self._left_leased[key]
            keys = {*self._items, *self._adopted, *self._left_leased}
        return [item_id for q, item_id in keys if q is queue]

    # -- tracking --------------------------------------------------------------------

    def track_claimed(
        self, items: list[Item], count_claimed: Callable[[Item], None]
    ) -> list[Item] | None:
        """Record claimed items; returns those to run (not already running here), or None
        when the stop came while the claim was in flight: the caller gives them all back.
        ``count_claimed`` is called for each item, under the lock, also when they are given
        back (the database counted the claim; tick_finished shows it as claimed and
        given_back).

        Checked under the lock ``shutdown`` takes the in-flight items with, after setting
        the stop: a claim either lands before that take (and is released with the rest) or
        sees the stop, never neither.
        """
        fresh: list[Item] = []
        reclaimed: list[Item] = []
        with self.lock:
            for item in items:
                count_claimed(item)
            if self._stopping.is_set():
                return None
            for item in items:
                key = (item.queue, item.id)
                if key in self._items:
                    # Its lease ran out while it ran (a database outage longer than the lease)
                    # and we claimed it again: the run in progress adopts this claim.
                    self._adopted[key] = item
                    reclaimed.append(item)
                else:
                    self._items[key] = item
                    fresh.append(item)
        for item in reclaimed:
            log.warning(
                "item_reclaimed_while_running",
                queue=item.queue.value,
                item_id=item.id,
                attempt=item.attempt,
                hint="its lease expired while it ran; it runs once, and this attempt counts",
            )
        for item in fresh:
            log.debug("item_claimed", queue=item.queue.value, item_id=item.id, attempt=item.attempt)
        return fresh

    def latest_claim(self, item: Item) -> Item:
        """The claim a settle must be fenced by: a re-claim adopted while the item ran wins
        (also after an earlier settle of this run swapped it in and then failed)."""
        key = (item.queue, item.id)
        with self.lock:
            newer = self._adopted.pop(key, None)
            if newer is not None:
                self._items[key] = newer
                return newer
            return self._items.get(key, item)

    def correct(self, item: Item) -> bool:
        """Hold ``item`` in place of this process's claim of the same item (its attempt
        corrected in the database): the settles are fenced by it. False when the claim is no
        longer held (the stop took it to release it, fenced by the claim before the
        correction): the caller releases ``item`` itself."""
        key = (item.queue, item.id)
        with self.lock:
            if key not in self._items:
                return False
            self._items[key] = item
            return True

    def untrack(self, item: Item, *, leave_leased: bool = False) -> tuple[bool, Item | None]:
        """The run of ``item`` is over. ``leave_leased``: it ran but its settle could not be
        written, so its lease (and attempt) stays; recorded in the same step, so the
        orphan check never sees it in neither place.

        Returns whether it was tracked, and the claim adopted meanwhile (if any), which now
        runs in its place: the caller hands it to a slot.
        """
        key = (item.queue, item.id)
        with self.lock:
            found = self._items.pop(key, None) is not None
            if leave_leased:
                self._left_leased[key] = time.monotonic()
            # Claimed again after this run's settle was fenced by its older claim: the new
            # claim's attempt is counted and nothing else will run it, so a slot does.
            again = self._adopted.pop(key, None)
            if again is not None:
                self._items[key] = again
        return found, again

    def take_all(self) -> list[Item]:
        """Every claim this process holds, the newest of each item (for release at shutdown)."""
        with self.lock:
            items = {**self._items, **self._adopted}
            self._items.clear()
            self._adopted.clear()
        return list(items.values())

    # -- claims in flight at a stop ----------------------------------------------------

    def begin_claim(self) -> bool:
        """Count a claim statement about to be sent; False once the stop has come."""
        with self.lock:
            if self._stopping.is_set():
                return False
            self._claims_in_flight += 1
            return True

    def end_claim(self) -> None:
        """The claim's items are tracked or given back: the stop need not wait for it."""
        with self.lock:
            self._claims_in_flight -= 1
            self._claims_ended.notify_all()

    @contextmanager
    def cancellable_claim(self, conn: Connection) -> Iterator[None]:
        """The dispatcher's claim statement on ``conn``, which the stop cancels if it still
        waits after the release (see :meth:`await_claims`)."""
        with self.lock:
            self._claiming_on = conn
        try:
            yield
        finally:
            # A cancel the stop is sending ends first: it must not reach the next statement.
            with self._cancel_lock, self.lock:
                self._claiming_on = None
                self._claims_ended.notify_all()

    def await_claims(self, until: float, cancel_within_s: float) -> None:
        """Wait, until ``until``, for claims sent before the stop: each gives back what it got.

        The dispatcher's claim still waiting then (for a lock) is cancelled: left running, it
        would lease its items to this process after it exited. The cancel is sent holding
        ``_cancel_lock``, which the dispatcher takes once its claim returns and before its
        connection runs anything else, so it can only reach that claim (a cancel that arrives
        after the claim ended finds the connection idle). ``lock`` is not held meanwhile: the
        slots and a scrape need it. Sending the cancel and waiting for the claim to end take
        at most ``cancel_within_s`` together; a cancel that could not be sent (the network
        is gone) reached nothing, so the claim is not waited for again.
        """
        with self._claims_ended:
            while self._claims_in_flight and time.monotonic() < until:
                self._claims_ended.wait(until - time.monotonic())
        cancel_by = time.monotonic() + cancel_within_s
        if self._cancel_dispatcher_claim(cancel_by):
            with self._claims_ended:
                self._claims_ended.wait_for(
                    lambda: self._claiming_on is None,
                    timeout=max(0.0, cancel_by - time.monotonic()),
                )
        with self.lock:
            still_waiting = self._claims_in_flight
        if still_waiting:
            log.warning(
                "stop_claims_still_waiting",
                claims=still_waiting,
                hint="a claim (or a settle claiming the next item) sent before the stop"
                " waits for a lock; what it claims once the lock is gone stays leased"
                " until its lease expires",
            )

    def _cancel_dispatcher_claim(self, cancel_by: float) -> bool:
        """Cancel the dispatcher's claim in progress, if any; True when the cancel was sent."""
        with self._cancel_lock:
            with self.lock:
                claiming_on = self._claiming_on
            if claiming_on is None:
                return False  # ended (its finally waits for _cancel_lock to clear it): nothing
            try:
                claiming_on.cancel_safe(timeout=max(0.01, cancel_by - time.monotonic()))
            except Exception as exc:
                log.warning("claim_cancel_failed", error=describe(exc))
                return False
            return True
