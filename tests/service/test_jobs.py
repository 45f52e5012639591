"""The scheduler's executor: each job on a daemon thread, so a job stuck (on a locked table,
say) when the worker exits never holds the process; events and max_instances still work."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from apscheduler.events import (
    EVENT_JOB_ERROR,
    EVENT_JOB_EXECUTED,
    EVENT_JOB_MAX_INSTANCES,
    EVENT_JOB_MISSED,
    JobExecutionEvent,
)
from apscheduler.schedulers.background import BackgroundScheduler
from structlog.testing import capture_logs

from sokratos_worker.service.jobs import DaemonThreadExecutor, log_job_event, scheduler_logger

_STUCK_AT_EXIT = """
import threading
from apscheduler.schedulers.background import BackgroundScheduler
from sokratos_worker.service.jobs import DaemonThreadExecutor

jobs = DaemonThreadExecutor() if "{executor}" == "daemon" else {{"type": "threadpool"}}
scheduler = BackgroundScheduler(executors={{"default": jobs}})
started = threading.Event()

def stuck():
    started.set()
    threading.Event().wait()  # never set: a statement waiting forever behind a lock

scheduler.add_job(stuck, id="stuck")
scheduler.start()
assert started.wait(10), "the job never started"
if "{executor}" == "daemon":
    print(jobs.running(), flush=True)
scheduler.shutdown(wait=False)
print("main done", flush=True)
"""


@pytest.mark.parametrize("executor", ["daemon", "threadpool"])
def test_a_job_stuck_at_exit_holds_the_process_only_on_apschedulers_pool(executor: str) -> None:
    """APScheduler's own pool is joined at interpreter exit: the control run shows the hang
    that the worker's executor removes."""
    script = _STUCK_AT_EXIT.format(executor=executor)
    if executor == "threadpool":
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "main done"
            with pytest.raises(subprocess.TimeoutExpired):
                proc.wait(5)  # the main thread is done; the pool's thread holds the exit
        finally:
            proc.kill()
            proc.wait(10)
        return
    done = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["['stuck']", "main done"]


def _scheduler(jobs: DaemonThreadExecutor, seen: list[JobExecutionEvent]) -> BackgroundScheduler:
    scheduler = BackgroundScheduler(executors={"default": jobs}, timezone="UTC")
    scheduler.add_listener(seen.append, EVENT_JOB_EXECUTED | EVENT_JOB_ERROR)
    return scheduler


def _wait(condition: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


def test_jobs_report_their_results_and_errors_as_apschedulers_executors_do() -> None:
    seen: list[JobExecutionEvent] = []
    jobs = DaemonThreadExecutor()
    scheduler = _scheduler(jobs, seen)

    def fails() -> None:
        raise ValueError("boom")

    scheduler.add_job(lambda: 42, id="answers")
    scheduler.add_job(fails, id="fails")
    scheduler.start()
    try:
        assert _wait(lambda: len(seen) == 2)
    finally:
        scheduler.shutdown(wait=False)
    by_id = {event.job_id: event for event in seen}
    assert by_id["answers"].retval == 42 and by_id["answers"].exception is None
    assert isinstance(by_id["fails"].exception, ValueError)
    assert jobs.running() == []


def test_a_job_still_running_is_not_started_again_and_is_named_by_running() -> None:
    seen: list[JobExecutionEvent] = []
    jobs = DaemonThreadExecutor()
    scheduler = _scheduler(jobs, seen)
    release = threading.Event()
    runs: list[float] = []

    def slow() -> None:
        runs.append(time.monotonic())
        release.wait(10)

    scheduler.add_job(slow, "interval", seconds=0.1, id="tick", max_instances=1,
                      coalesce=True, misfire_grace_time=1)
    scheduler.start()
    try:
        assert _wait(lambda: len(runs) == 1)
        assert jobs.running() == ["tick"]
        time.sleep(0.5)  # five intervals pass while the first run waits
        assert len(runs) == 1
        release.set()
        assert _wait(lambda: len(seen) >= 1)
    finally:
        release.set()
        scheduler.shutdown(wait=False)


def test_a_run_skipped_behind_a_stuck_one_is_said_once_in_the_workers_words(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """APScheduler's own line ('maximum number of running instances reached') gave no hint;
    the worker logs scheduled_job_still_running instead, and the job still runs again."""
    jobs = DaemonThreadExecutor()
    scheduler = BackgroundScheduler(
        executors={"default": jobs}, timezone="UTC", logger=scheduler_logger()
    )
    scheduler.add_listener(
        log_job_event, EVENT_JOB_ERROR | EVENT_JOB_MISSED | EVENT_JOB_MAX_INSTANCES
    )
    release = threading.Event()
    runs: list[float] = []

    def stuck_then_quick() -> None:
        runs.append(time.monotonic())
        if len(runs) == 1:
            release.wait(10)

    scheduler.add_job(stuck_then_quick, "interval", seconds=0.2, id="heartbeat",
                      max_instances=1, coalesce=True, misfire_grace_time=1)
    caplog.set_level(logging.WARNING, logger="apscheduler")
    with capture_logs() as events:
        scheduler.start()
        try:
            assert _wait(lambda: any(e["event"] == "scheduled_job_still_running"
                                     for e in events))
            release.set()
            assert _wait(lambda: len(runs) >= 2), "the job never ran again"
        finally:
            release.set()
            scheduler.shutdown(wait=False)
    skipped = [e for e in events if e["event"] == "scheduled_job_still_running"]
    assert skipped[0]["job"] == "heartbeat" and "table locked" in skipped[0]["hint"]
    assert not [r for r in caplog.records if "running instances" in r.getMessage()]
