"""Pure decisions about an item's next step; no I/O, the clock and randomness are passed in."""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import StrEnum

from sokratos_worker.errors import BackendsUnavailable, InvalidPayload

JITTER = 0.2


def retry_delay(
    attempt: int, *, base_s: float, max_s: float, rng: random.Random | None = None
) -> float:
    """Backoff before retry ``attempt + 1``: ``base * 4**(attempt-1)``, capped, ±20 % jitter."""
    exponent = max(0, attempt - 1)
    delay = min(max_s, base_s * (4.0**exponent))
    spread = (rng or random).uniform(-JITTER, JITTER)
    return max(0.0, delay * (1.0 + spread))


class Step(StrEnum):
    """What the runner does with an item whose attempt did not succeed."""

    RETRY = "retry"
    DEAD_LETTER = "dead_letter"
    GIVE_BACK = "give_back"  # no backend: given back, and claiming pauses until a probe answers
    WAIT_FOR_DATABASE = "wait_for_database"  # the database away: given back, no backend pause


@dataclass(frozen=True)
class Decision:
    """The step and the reason recorded with it."""

    step: Step
    reason: str


def after_failure(
    error: BaseException, *, attempt: int, max_attempts: int, database_away: bool = False
) -> Decision:
    """Retry, dead-letter or give the attempt back (durability.md, what counts as an attempt).

    ``database_away``: ``error`` was a database outage to wait out (durability.md rule 7, as
    for backends): the attempt is given back. The settle says no for a full pool, a lock or a
    refusal (the server answered) and once an item has been given back so a few times (a read
    that takes the server down every time would otherwise run for ever): then it is the
    item's attempt.
    """
    if isinstance(error, BackendsUnavailable):
        return Decision(Step.GIVE_BACK, str(error))
    if database_away:
        return Decision(Step.WAIT_FOR_DATABASE, str(error))
    reason = describe(error)
    if isinstance(error, InvalidPayload) or attempt >= max_attempts:
        return Decision(Step.DEAD_LETTER, reason)
    return Decision(Step.RETRY, reason)


def describe(error: BaseException) -> str:
    """A one-line error text for last_error and failed_operations."""
    text = str(error).strip()
    name = type(error).__name__
    if not text:
        return name
    first = text.splitlines()[0]
    # These say it all themselves; other classes' names say what kind of failure it was.
    return first if name in {"ItemError", "InvalidPayload", "NoAttemptLeft"} else f"{name}: {first}"
