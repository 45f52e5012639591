"""Notice that the embedded PostgreSQL's server process (its postmaster) is gone, for ``run``.

Nothing else ever starts it again once it died (kill -9, the OOM killer, a PANIC it cannot
recover from): the daemon waited for the database for ever. So the daemon stops instead, with
exit 75, and its service manager's restart starts the server again (crash recovery). Every
process sharing the server watches it, and each exits the same way.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import structlog

from sokratos_worker.store.embedded import EmbeddedPostgres, held_here, process_start_ticks

log = structlog.get_logger(__name__)

WATCH_INTERVAL_S = 1.0
DIED_HINT = (
    "the worker exits so that its service manager restarts it, which starts the server again"
    " (crash recovery); run it again by hand if no service manager does. The server's log"
    " (the log file in its data directory) says why it ended"
)


def postmaster_gone(handle: EmbeddedPostgres) -> bool:
    """Whether the postmaster ``handle`` attached to has ended: no such process, a zombie, or
    another process that was given its pid since. A process whose start cannot be read
    (/proc hidden or absent, while the kernel still knows its pid) counts as running."""
    if handle.postmaster_pid is None:
        return False  # (the wheel named none: nothing to watch)
    started = process_start_ticks(handle.postmaster_pid)
    if started is None:
        return True
    if started == -1 or handle.postmaster_started in (None, -1):
        return False
    return started != handle.postmaster_started


def watched_server(conninfo: str) -> EmbeddedPostgres | None:
    """The embedded server this process holds whose URI is ``conninfo``, or None (a
    configured SOKRATOS_DATABASE_URL: that server is not ours to watch)."""
    return next((handle for handle in held_here() if handle.uri == conninfo), None)


def watch_postmaster(
    handle: EmbeddedPostgres, *, stopping: threading.Event, on_death: Callable[[], None]
) -> threading.Thread:
    """Look about every WATCH_INTERVAL_S, until ``stopping`` is set, whether ``handle``'s
    postmaster is gone; when it is, log ``embedded_postgres_died`` once and call
    ``on_death``. Returns the (daemon) thread, started."""

    def watch() -> None:
        while not stopping.wait(WATCH_INTERVAL_S):
            if postmaster_gone(handle):
                log.error(
                    "embedded_postgres_died",
                    pid=handle.postmaster_pid,
                    data_dir=str(handle.data_dir),
                    hint=DIED_HINT,
                )
                on_death()
                return

    thread = threading.Thread(target=watch, name="embedded-postgres-watch", daemon=True)
    thread.start()
    return thread
