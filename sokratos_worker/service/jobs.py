"""An APScheduler executor whose job threads never hold the process's exit.

APScheduler's default executor runs jobs on a ``concurrent.futures`` thread pool, and the
interpreter joins those threads at exit: a heartbeat tick or the retention job stuck on a
locked table kept a stopped worker alive until systemd killed it. Here each run of a job gets
a daemon thread of its own (``max_instances`` still caps runs per job), and a job still
running when the worker exits is abandoned: what it committed stays, the rest is not written.
"""

from __future__ import annotations

import sys
import threading
from datetime import datetime
from typing import Any

from apscheduler.executors.base import BaseExecutor, run_job


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
