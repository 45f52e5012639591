"""Wall-clock steps, and the scheduler's jobs brought back in step with them.

APScheduler keeps its next run times on the wall clock and sleeps until the next one: when
the host's clock steps back by an hour (NTP correcting a clock that ran ahead, as an RTC kept
in local time east of UTC does at every boot), no heartbeat tick ran for that hour, and
``status`` called the worker silent while it was working. A step forward APScheduler already
handles (coalesced runs), but the jobs are put back in step either way.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import structlog

log = structlog.get_logger(__name__)

# A smaller change of the wall clock against the monotonic one is slewing or noise, and
# delays a job by no more than that.
STEP_TOLERANCE_S = 2.0


def _offset() -> float:
    # CLOCK_BOOTTIME goes on while the machine is suspended, as the wall clock does (the
    # monotonic clock stops): a suspend and resume is not a step.
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)


class ClockStepWatch:
    """Tells a step of the wall clock since the last look; cheap enough for every loop."""

    def __init__(self, tolerance_s: float = STEP_TOLERANCE_S) -> None:
        self.tolerance_s = tolerance_s
        self._offset = _offset()

    def stepped(self) -> float:
        """The wall clock's step since the last look in seconds (negative: back), or 0.0."""
        offset = _offset()
        step, self._offset = offset - self._offset, offset
        return step if abs(step) > self.tolerance_s else 0.0


def run_jobs_now(scheduler: Any, step_s: float) -> None:
    """Run every job now; each keeps its interval from here (the scheduler's next run times
    were set on the wall clock before the step)."""
    now = datetime.now(UTC)
    jobs = scheduler.get_jobs()
    for job in jobs:
        scheduler.modify_job(job.id, next_run_time=now)
    log.warning(
        "wall_clock_stepped",
        step_s=round(step_s, 1),
        jobs=[job.id for job in jobs],
        hint="nothing to do if the host's time sync just corrected its clock (the scheduled"
        " jobs run now and keep their intervals from here); if it recurs, see why the clock"
        " jumps (timedatectl timesync-status, chronyc tracking)",
    )
