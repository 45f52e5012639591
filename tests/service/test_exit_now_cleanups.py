"""The cleanups a second stop signal's exit runs (cleaned_up_at_exit_now): each runs once,
a failing one is named and does not keep the others from running, a hanging one is left
after the budget (the exit must come anyway), and one whose block has ended is not run."""

from __future__ import annotations

import threading
import time

import pytest

from sokratos_worker.service import stop_requests
from sokratos_worker.service.stop_requests import cleaned_up_at_exit_now


def _fail() -> None:
    raise OSError("read-only file system")


def test_every_cleanup_runs_and_a_failing_one_is_named() -> None:
    ran: list[str] = []
    with (
        cleaned_up_at_exit_now("first", _fail),
        cleaned_up_at_exit_now("second", lambda: ran.append("second")),
    ):
        events = stop_requests._run_cleanups()
    assert ran == ["second"]
    assert [(e["event"], e["cleanup"]) for e in events] == [("exit_now_cleanup_failed", "first")]
    assert "read-only file system" in events[0]["error"]


def test_a_cleanup_outside_its_block_is_not_run() -> None:
    ran: list[str] = []
    with cleaned_up_at_exit_now("gone", lambda: ran.append("gone")):
        pass
    assert stop_requests._run_cleanups() == []
    assert ran == []


def test_a_hanging_cleanup_is_left_after_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stop_requests, "CLEANUPS_BUDGET_S", 0.5)
    hang = threading.Event()
    started = time.monotonic()
    try:
        with cleaned_up_at_exit_now("stuck", lambda: hang.wait(30) and None):
            events = stop_requests._run_cleanups()
    finally:
        hang.set()
    assert time.monotonic() - started < 20  # (generous: the budget is half a second)
    assert events == [
        {
            "event": "exit_now_cleanup_unfinished",
            "level": "warning",
            "cleanups": ["stuck"],
            "waited_s": 0.5,
        }
    ]
