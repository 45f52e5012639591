"""policy.after_failure: a database error is given back only when the settle says it is an
outage to wait out (not one the server answered, and not past the item's give-backs);
otherwise it is the item's attempt (found by a review: a read that failed every time was given
back for ever)."""

from __future__ import annotations

from sokratos_worker.errors import DatabaseUnavailable
from sokratos_worker.policy import Step, after_failure

TERMINATED = DatabaseUnavailable(
    "database unavailable: terminating connection due to administrator command"
)


def test_a_database_error_not_waited_out_is_retried_then_dead_lettered() -> None:
    assert after_failure(TERMINATED, attempt=1, max_attempts=3, database_away=False).step is (
        Step.RETRY
    )
    assert after_failure(TERMINATED, attempt=3, max_attempts=3, database_away=False).step is (
        Step.DEAD_LETTER
    )


def test_a_database_outage_waited_out_gives_the_attempt_back_even_at_the_last() -> None:
    decision = after_failure(TERMINATED, attempt=3, max_attempts=3, database_away=True)
    assert decision.step is Step.WAIT_FOR_DATABASE
    assert decision.reason == str(TERMINATED)
