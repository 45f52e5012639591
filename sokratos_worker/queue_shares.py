"""Which queue a free slot claims from: queues with ready items share the slots equally.

Under load a slot claims its next item in the settle of its last one (runner.py). Left to
itself it would stay on its item's queue, and a backlog in one queue would keep every slot
from the other for as long as it lasts: archived conversations waiting for days behind
triage after an outage. So a settle claims from the queue with the fewest items in flight
here (on a tie the other queue), unless that queue was found empty within the last
:data:`EMPTY_FOR_S` seconds.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

from sokratos_worker.model import Queue

# A queue a claim found empty is not chosen by a settle for this long: the claim that finds
# it empty leaves its slot idle until the dispatcher fills it, so at most once a second.
EMPTY_FOR_S = 1.0


class QueueShares:
    """The fair share of slots between the queues a runner handles (thread-safe)."""

    def __init__(
        self, queues: Sequence[Queue], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.queues = list(queues)
        self._clock = clock
        self._lock = threading.Lock()
        self._empty_until = dict.fromkeys(self.queues, 0.0)

    def for_settle(self, settled: Queue, in_flight: Counter[Queue]) -> Queue:
        """The queue the slot of a settled item claims its next item from: the one with the
        fewest items in flight (the settled one no longer counted), not found empty lately;
        on a tie the other one, so that a single slot (or the odd one) alternates."""
        now = self._clock()

        def load(queue: Queue) -> int:
            return in_flight[queue] - (1 if queue is settled else 0)

        best = settled
        with self._lock:
            for queue in self.queues:
                lately_empty = self._empty_until[queue] > now
                if queue is not settled and not lately_empty and load(queue) <= load(best):
                    best = queue
        return best

    def claimed(self, queue: Queue, *, all_asked: bool) -> None:
        """A claim from ``queue`` got every item it asked for, or fewer (then it is empty)."""
        if all_asked:
            self.found_items(queue)
        else:
            self.found_empty(queue)

    def found_empty(self, queue: Queue) -> None:
        """A claim from ``queue`` found fewer items than it asked for."""
        with self._lock:
            self._empty_until[queue] = self._clock() + EMPTY_FOR_S

    def found_items(self, queue: Queue) -> None:
        """A claim from ``queue`` got every item it asked for: more may be waiting."""
        with self._lock:
            self._empty_until[queue] = 0.0

    def split(self, free: int, order: Sequence[Queue]) -> list[tuple[Queue, int]]:
        """``free`` slots shared equally between the queues in ``order`` (the first ones get
        the remainder); what a queue leaves unclaimed goes to the others afterwards."""
        if not order:
            return []
        share, extra = divmod(free, len(order))
        return [(queue, share + (1 if i < extra else 0)) for i, queue in enumerate(order)]
