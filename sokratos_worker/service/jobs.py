"""An APScheduler executor whose job threads never hold the process's exit.

APScheduler's default executor runs jobs on a ``concurrent.futures`` thread pool, and the
interpreter joins those threads at exit: a heartbeat tick or the retention job stuck on a
locked table kept a stopped worker alive until systemd killed it. Here each run of a job gets
a daemon thread of its own (``max_instances`` still caps runs per job), and a job still
running when the worker exits is abandoned: what it committed stays, the rest is not written.
"""

from __future__ import annotations

import logging
import sys
import threading
from datetime import datetime
from typing import Any

import structlog
from apscheduler.events import EVENT_JOB_MAX_INSTANCES, EVENT_JOB_MISSED
from apscheduler.executors.base import BaseExecutor, run_job

log = structlog.get_logger(__name__)

# APScheduler's own words for a run skipped because the previous one is still going.
_SKIPPED_RUN = "maximum number of running instances"


class DaemonThreadExecutor(BaseExecutor):  # type: ignore[misc]  # apscheduler has no types
    """Runs each job on its own daemon thread; ``running()`` names the jobs not yet done."""

    def __init__(self) -> None:
        super().__init__()
        self._guard = threading.Lock()
        self._running: dict[int, str] = {}  # thread ident -> job id

    def _do_submit_job(self, job: Any, run_times: list[datetime]) -> None:
        def run() -> None:
            with self._guard:
                self._running[threading.get_ident()] = job.id
            try:
                events = run_job(job, job._jobstore_alias, run_times, self._logger.name)
            except BaseException:
                _, exc, traceback = sys.exc_info()
                self._run_job_error(job.id, exc, traceback)
            else:
                self._run_job_success(job.id, events)
            finally:
                with self._guard:
                    self._running.pop(threading.get_ident(), None)

        threading.Thread(target=run, name=f"job-{job.id}", daemon=True).start()

    def running(self) -> list[str]:
        """The ids of the jobs running now (a job stuck at exit is named in the log)."""
        with self._guard:
            return sorted(self._running.values())

    def shutdown(self, wait: bool = True) -> None:
        """Nothing to stop: running jobs end on their own or with the process."""


def log_job_event(event: Any) -> None:
    """A scheduled job failed, was missed, or was skipped because its last run still goes on."""
    if event.code == EVENT_JOB_MAX_INSTANCES:
        log.warning(
            "scheduled_job_still_running",
            job=event.job_id,
            hint="its previous run has not finished (waiting for the database: down, or a"
            " table locked; the log around this line says which); this run is skipped and the"
            " next comes at its time",
        )
    elif event.code == EVENT_JOB_MISSED:
        log.warning(
            "scheduled_job_missed", job=event.job_id, scheduled_at=str(event.scheduled_run_time)
        )
    else:
        log.error("scheduled_job_failed", job=event.job_id, error=str(event.exception))


class _WithoutSkippedRuns(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _SKIPPED_RUN not in record.getMessage()


def scheduler_logger() -> logging.Logger:
    """APScheduler's logger for the worker, without its line for a skipped run (which
    ``log_job_event`` says as ``scheduled_job_still_running``, with a hint)."""
    logger = logging.getLogger("apscheduler.scheduler.sokratos_worker")
    if not any(isinstance(f, _WithoutSkippedRuns) for f in logger.filters):
        logger.addFilter(_WithoutSkippedRuns())
    return logger
