"""A per-backend circuit breaker whose half-open state always ends.

Closed → open after ``threshold`` consecutive failures; after the cool-down one caller is
admitted as the half-open trial; its success closes the circuit, its failure re-opens it
with the cool-down doubled (capped), and a trial that learnt nothing opens it again for the
same cool-down. Only the trial's failure re-opens: calls that were already in flight when the
circuit went half-open only count (their success closes it). Unlike Sokratos's breaker
(behaviour reference §6.3), a trial that never reports back is treated as failed once its
deadline passes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from enum import Enum, StrEnum

import structlog

log = structlog.get_logger(__name__)


class Circuit(StrEnum):
    """The three states ``status`` shows."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Admission(Enum):
    """What :meth:`CircuitBreaker.admit` lets a caller do."""

    SKIP = "skip"  # open (or a trial is out): no request
    CALL = "call"  # closed: an ordinary call
    TRIAL = "trial"  # this caller alone tests the half-open circuit


class CircuitBreaker:
    """Thread-safe; ``clock`` is injectable so tests never sleep through a cool-down."""

    def __init__(
        self,
        name: str,
        *,
        threshold: int = 3,
        cooldown: float = 120.0,
        max_cooldown: float = 600.0,
        probe_deadline: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.threshold = threshold
        self.base_cooldown = cooldown
        self.max_cooldown = max_cooldown
        self.probe_deadline = probe_deadline
        self._clock = clock
        self._lock = threading.Lock()
        self._state = Circuit.CLOSED
        self._failures = 0
        self._cooldown = cooldown
        self._opened_at = 0.0
        self._probe_started = 0.0
        self.last_error = ""

    @property
    def state(self) -> Circuit:
        """The state now, after expiring a probe that overran its deadline."""
        with self._lock:
            self._expire_probe()
            return self._state

    @property
    def consecutive_failures(self) -> int:
        """Failures since the last success."""
        return self._failures

    @property
    def cooldown(self) -> float:
        """The cool-down the circuit will wait (or is waiting) while open."""
        return self._cooldown

    def retry_in(self) -> float:
        """Seconds until an open circuit lets a probe through (0 when not open)."""
        with self._lock:
            self._expire_probe()
            if self._state is not Circuit.OPEN:
                return 0.0
            return max(0.0, self._opened_at + self._cooldown - self._clock())

    def allow(self) -> bool:
        """True when a call may go ahead (see :meth:`admit`)."""
        return self.admit() is not Admission.SKIP

    def admit(self) -> Admission:
        """CALL while closed; TRIAL for the one caller that turns the circuit half-open."""
        with self._lock:
            self._expire_probe()
            if self._state is Circuit.CLOSED:
                return Admission.CALL
            if self._state is Circuit.HALF_OPEN:
                return Admission.SKIP  # one trial at a time; everyone else fails fast
            if self._clock() - self._opened_at < self._cooldown:
                return Admission.SKIP
            self._state = Circuit.HALF_OPEN
            self._probe_started = self._clock()
            log.info("circuit_half_open", backend=self.name)
            return Admission.TRIAL

    def record_success(self) -> None:
        """Close the circuit and reset the cool-down."""
        with self._lock:
            if self._state is not Circuit.CLOSED:
                log.info("circuit_closed", backend=self.name)
            self._state = Circuit.CLOSED
            self._failures = 0
            self._cooldown = self.base_cooldown
            self.last_error = ""

    def record_failure(self, reason: str = "", *, trial: bool = False) -> None:
        """Count a failure; open at the threshold, re-open after a failed ``trial``."""
        with self._lock:
            self.last_error = reason
            self._failures += 1
            if self._state is Circuit.HALF_OPEN:
                if trial:  # a call sent before the circuit went half-open proves nothing now
                    self._reopen(reason)
            elif self._state is Circuit.CLOSED and self._failures >= self.threshold:
                self._open(reason)

    def record_inconclusive_trial(self, reason: str) -> None:
        """End a half-open trial that learnt nothing (its probe found no free slot): open again
        for the same cool-down, neither closed nor counted as a failed trial."""
        with self._lock:
            if self._state is not Circuit.HALF_OPEN:
                return  # a call in flight already decided meanwhile
            self._state = Circuit.OPEN
            self._opened_at = self._clock()
            log.info(
                "circuit_trial_inconclusive",
                backend=self.name,
                cooldown_s=self._cooldown,
                reason=reason,
            )

    def allow_probe_now(self) -> None:
        """End an open circuit's cool-down, e.g. after a health probe found the server up."""
        with self._lock:
            if self._state is Circuit.OPEN:
                self._opened_at = self._clock() - self._cooldown

    def _open(self, reason: str) -> None:
        self._state = Circuit.OPEN
        self._opened_at = self._clock()
        log.warning("circuit_opened", backend=self.name, cooldown_s=self._cooldown, reason=reason)

    def _reopen(self, reason: str) -> None:
        self._cooldown = min(self._cooldown * 2, self.max_cooldown)
        self._open(reason)

    def _expire_probe(self) -> None:
        # A probe that hangs or whose caller died must not leave the circuit half-open for ever.
        if (
            self._state is Circuit.HALF_OPEN
            and self._clock() - self._probe_started >= self.probe_deadline
        ):
            self.last_error = "half-open probe overran its deadline"
            self._failures += 1
            self._reopen(self.last_error)


__all__ = ["Admission", "Circuit", "CircuitBreaker"]
