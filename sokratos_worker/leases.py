"""The lease renewer: keeps the leases of the items running here, and frees orphaned ones.

Every lease/3 it renews the lease of each item in flight, says when one was taken over by
another worker, and gives back the leases this process holds without knowing it (a claim whose
answer was lost with its connection): every lease of ours that is not running, adopted or left
leased after a settle that could not be written (:meth:`InFlight.held_ids`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import structlog

from sokratos_worker.config import Settings
from sokratos_worker.errors import DatabaseUnavailable
from sokratos_worker.inflight import InFlight
from sokratos_worker.model import Queue
from sokratos_worker.policy import describe
from sokratos_worker.store import queue as store
from sokratos_worker.store.connection import Connection, Database

log = structlog.get_logger(__name__)


class LeaseRenewer:
    """The loop of the ``lease-renewer`` thread (:meth:`run`), until ``stopped`` is set."""

    def __init__(
        self,
        *,
        settings: Settings,
        database: Database,
        worker_id: str,
        queues: list[Queue],
        inflight: InFlight,
        stopped: threading.Event,
        on_database_contact: Callable[[bool], None],
        contact_failed: Callable[[DatabaseUnavailable], None],
        wake: Callable[[], None],
    ) -> None:
        """``on_database_contact(True)`` and ``contact_failed(exc)`` hear how each pass
        ended; ``wake()`` lets the dispatcher claim what an orphan release freed."""
        self.settings = settings
        self.database = database
        self.worker_id = worker_id
        self.queues = queues
        self._inflight = inflight
        self._stopped = stopped
        self._on_database_contact = on_database_contact
        self._contact_failed = contact_failed
        self._wake = wake
        # (queue, item id, attempt) already reported lost: said once, not at every pass.
        self._reported_lost: set[tuple[Queue, int, int]] = set()

    def run(self) -> None:
        interval = max(0.5, self.settings.lease / 3)
        while not self._stopped.wait(interval):
            by_queue = self._inflight.ids_by_queue(self.queues)
            try:
                with self.database.connection() as conn:
                    for q, ids in by_queue.items():
                        kept = store.renew(
                            conn, q, owner=self.worker_id, ids=ids, lease_s=self.settings.lease
                        )
                        for lost in set(ids) - kept:
                            self._report_taken(conn, q, lost)
                        # Taken again now: the pass may have waited longer than a claim's age.
                        held = self._inflight.held_ids(q, self.settings.lease)
                        self._release_orphans(conn, q, held, interval)
            except DatabaseUnavailable as exc:
                self._contact_failed(exc)
                log.warning("lease_renewal_failed", error=str(exc))
            except Exception as exc:  # a timeout or a read-only server must not end renewals
                log.error("lease_renewal_failed", error=describe(exc), retry_in_s=interval)
            else:
                self._on_database_contact(True)

    def _report_taken(self, conn: Connection, queue: Queue, item_id: int) -> None:
        """Say so (once) when a renewal missed an item because another claim holds it now.

        The renewal's UPDATE also misses an item whose settle committed a moment ago (the
        slot has not untracked it yet): that item's row is gone, and nothing was lost.
        """
        item = self._inflight.get(queue, item_id)
        if item is None:
            return  # settled meanwhile
        exists, owner = store.lease_owner(conn, item)
        key = (queue, item.id, item.attempt)
        if not exists or owner == self.worker_id or key in self._reported_lost:
            return
        self._reported_lost = {k for k in self._reported_lost if self._inflight.get(k[0], k[1])}
        self._reported_lost.add(key)
        log.warning(
            "lease_lost",
            queue=queue.value,
            item_id=item.id,
            attempt=item.attempt,
            new_owner=owner,
            hint="its lease expired while it ran (frozen, suspended or cut off from the"
            " database): another worker took it over and finishes it; this run's result will"
            " not be kept. If it recurs, raise SOKRATOS_LEASE",
        )

    def _release_orphans(
        self, conn: Connection, queue: Queue, keep: list[int], older_than_s: float
    ) -> None:
        orphans = store.release_orphans(
            conn,
            queue,
            owner=self.worker_id,
            keep=keep,
            lease_s=self.settings.lease,
            older_than_s=older_than_s,
        )
        if orphans:
            log.warning(
                "orphaned_leases_released",
                queue=queue.value,
                item_ids=orphans,
                hint="claimed when a connection dropped before the answer; attempt given back",
            )
            self._wake()
