"""``WATCHDOG=1`` while the dispatcher makes progress; a dispatcher waiting for a lock is named.

systemd restarts a worker whose pings stop (``WatchdogSec=``), and the pings follow the
dispatcher's progress, not the main loop's: a dispatcher hung in a statement is restarted.
A dispatcher waiting for another session's lock (a migration, a transaction left open) is not
hung: a new process would wait for the same lock, so the pings go on and the holder is named.
Unlike the rest of ``service/``, this module asks PostgreSQL something: what the stalled
dispatcher's server process waits for, on a short connection of its own.

The daemon wires it: the runner calls :meth:`DispatcherWatchdog.progressed` each time its
dispatcher comes round, the main loop calls :meth:`DispatcherWatchdog.look` every 0.25 s.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from sokratos_worker.service.sdnotify import Notifier
from sokratos_worker.store import status as status_store
from sokratos_worker.store.connection import connect, time_limited

log = structlog.get_logger(__name__)

# The dispatcher comes round at least once a second, also while it waits for a backend probe
# or for the database; one claim statement or pool checkout blocking it longer than this
# (a dead connection, a lock never released) means it is hung, and the watchdog pings stop.
DISPATCHER_STALL_S = 120.0
# No look at the watchdog for this long: the process itself was stopped, not the dispatcher.
FROZEN_GAP_S = 10.0
# While it is stalled, PostgreSQL is asked this often whether it waits for another session's
# lock (a migration, a long transaction): a restart would wait for the same lock.
LOCK_LOOK_EVERY_S = 10.0
# The look itself: connecting and asking give up after this.
LOCK_LOOK_TIMEOUT_S = 2


def lock_wait_of(conninfo: str, pid: int | None) -> status_store.LockWait | None:
    """The other sessions' lock server process ``pid`` waits for, if any (None: no pid, no
    wait, or the look failed)."""
    if pid is None:
        return None
    try:
        with (
            connect(conninfo, timeout=LOCK_LOOK_TIMEOUT_S) as conn,
            time_limited(conn, LOCK_LOOK_TIMEOUT_S * 1000),
        ):
            found = status_store.lock_wait(conn, pid)
    except Exception as exc:  # the caller reports the wait without its cause
        log.warning("lock_look_failed", error=str(exc).strip())
        return None
    return found if found.blockers else None


class DispatcherWatchdog:
    """Pings systemd while the dispatcher proves progress, and knows the lock it waits for.

    ``dispatcher_pid`` reads the server process of the dispatcher's statement in progress
    (None between statements); ``running_status`` is the worker's ``STATUS=`` line, written
    again when a lock wait begins or ends (it reads :attr:`lock_wait`); ``clock`` is monotonic.
    """

    def __init__(
        self,
        notifier: Notifier,
        *,
        dispatcher_pid: Callable[[], int | None],
        conninfo: str,
        running_status: Callable[[], str],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._notifier = notifier
        self._dispatcher_pid = dispatcher_pid
        self._conninfo = conninfo
        self._running_status = running_status
        self._clock = clock
        self._last_watchdog = 0.0  # the last WATCHDOG=1
        self._last_progress = clock()  # the dispatcher's last round
        self._last_look = clock()  # the last look() (or progressed())
        self._stall_reported = False
        self._lock_looked_at = 0.0
        self._lock_wait: status_store.LockWait | None = None  # what the stalled one waits for

    @property
    def lock_wait(self) -> status_store.LockWait | None:
        """The lock the stalled dispatcher waits for, as last looked up (for STATUS= and
        the heartbeat); None while it makes progress."""
        return self._lock_wait

    def progressed(self) -> None:
        """The dispatcher's loop came round (it does at least every second while it works)."""
        now = self._clock()
        if self._lock_wait is not None:
            self._lock_wait = None
            log.info("dispatcher_lock_released", waited_s=round(now - self._last_progress))
            self._notifier.status(self._running_status())
        self._last_progress = now
        self._stall_reported = False
        self.look()

    def look(self) -> None:
        """``WATCHDOG=1`` only while the dispatcher proves progress, so a hung one is restarted."""
        now = self._clock()
        gap = now - self._last_look
        self._last_look = now
        if gap > FROZEN_GAP_S:
            # Nothing here ran (the main loop looks every second): the whole process was
            # stopped (SIGSTOP, a paused VM), the dispatcher too; that time is not its stall.
            self._last_progress = min(now, self._last_progress + gap)
        stalled_s = now - self._last_progress
        if stalled_s > DISPATCHER_STALL_S and not self._waits_for_a_lock(stalled_s):
            if not self._stall_reported:
                self._stall_reported = True
                log.error(
                    "dispatcher_stalled",
                    stalled_s=round(stalled_s),
                    hint="no more WATCHDOG=1: systemd restarts the worker and faulthandler"
                    " writes every thread's stack to the journal",
                )
            return
        interval = self._notifier.watchdog_interval()
        if interval is not None and now - self._last_watchdog >= interval / 2:
            self._notifier.watchdog()
            self._last_watchdog = now

    def dispatcher_lock_wait(self) -> status_store.LockWait | None:
        """A fresh look: the other sessions' lock the dispatcher's statement waits for."""
        return lock_wait_of(self._conninfo, self._dispatcher_pid())

    def _waits_for_a_lock(self, stalled_s: float) -> bool:
        """True while the stalled dispatcher waits for a lock another session holds: it is
        not hung, and a restart would only wait for the same lock, so the pings go on."""
        now = self._clock()
        if now - self._lock_looked_at < LOCK_LOOK_EVERY_S:
            return self._lock_wait is not None
        self._lock_looked_at = now
        previous, self._lock_wait = self._lock_wait, self.dispatcher_lock_wait()
        if self._lock_wait is not None and (
            previous is None or previous.blocker_pids != self._lock_wait.blocker_pids
        ):
            self._report_lock_wait(self._lock_wait, stalled_s)
        return self._lock_wait is not None

    def _report_lock_wait(self, waiting: status_store.LockWait, stalled_s: float) -> None:
        first = waiting.blockers[0]["pid"]
        log.warning(
            "dispatcher_waiting_for_lock",
            waiting_s=round(stalled_s),
            tables=list(waiting.tables),
            held_by=list(waiting.blockers),
            hint=f"{waiting.describe()}: a migration, an ALTER, LOCK or VACUUM FULL,"
            " or a transaction left open; claiming goes on when it ends and nothing is lost"
            " (the worker is not restarted: a new one would wait too). To end it:"
            f" SELECT pg_terminate_backend({first})",
        )
        self._notifier.status(self._running_status())
