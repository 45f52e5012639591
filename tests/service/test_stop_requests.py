"""Which stop came first decides the exit code: the operator's signal (real signals to this
process) or the worker's own request (the local model server that keeps dying)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from sokratos_worker.exit_codes import EXIT_OK
from sokratos_worker.service.stop_requests import STOP_SIGNALS, StopRequests

GAVE_UP = 75


@pytest.fixture
def stops() -> Iterator[StopRequests]:
    """StopRequests with its handlers installed in this process, restored afterwards."""
    before = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    requests = StopRequests()
    requests.install()
    try:
        yield requests
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def test_no_stop_asked_exits_0(stops: StopRequests) -> None:
    assert not stops.requested
    assert stops.exit_code == EXIT_OK


@pytest.mark.parametrize("signum", STOP_SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_a_signal_is_recorded_by_name_and_exits_0(stops: StopRequests, signum: int) -> None:
    os.kill(os.getpid(), signum)  # (the handler runs in this, the main, thread)
    assert stops.requested
    assert stops.signal_name == signal.Signals(signum).name
    assert stops.internal_reason is None
    assert stops.exit_code == EXIT_OK


def test_the_workers_own_stop_exits_with_its_code_and_only_the_first_counts(
    stops: StopRequests,
) -> None:
    stops.request(GAVE_UP, "local_model_gave_up")
    stops.request(1, "a later reason")
    assert stops.requested and stops.signal_name is None
    assert (stops.internal_reason, stops.exit_code) == ("local_model_gave_up", GAVE_UP)


def test_a_signal_before_the_workers_own_stop_keeps_exit_0(stops: StopRequests) -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    stops.request(GAVE_UP, "local_model_gave_up")
    assert stops.exit_code == EXIT_OK


def test_a_signal_after_the_workers_own_stop_keeps_its_code_and_is_a_first_signal(
    stops: StopRequests,
) -> None:
    """The operator's first SIGTERM after a give-up is recorded, not taken for a second
    signal (which would exit at once, this test process with it)."""
    stops.request(GAVE_UP, "local_model_gave_up")
    os.kill(os.getpid(), signal.SIGTERM)
    assert stops.signal_name == "SIGTERM"
    assert stops.exit_code == GAVE_UP


def test_last_words_that_hang_are_left_after_their_budget() -> None:
    """A second signal's "stopped" heartbeat runs in a thread: the code the signal interrupted
    may hold a lock it needs, and the exit must come anyway."""
    from sokratos_worker.service import stop_requests

    hang = threading.Event()
    started = time.monotonic()
    said = stop_requests._within_budget(lambda: hang.wait(30) and None)
    assert said is not None and said["event"] == "last_words_unfinished", said
    assert time.monotonic() - started < stop_requests.LAST_WORDS_BUDGET_S + 5
    hang.set()
    assert stop_requests._within_budget(lambda: None) is None
    failed = stop_requests._within_budget(lambda: 1 / 0)  # type: ignore[func-returns-value]
    assert failed is not None and failed["event"] == "last_words_failed", failed
