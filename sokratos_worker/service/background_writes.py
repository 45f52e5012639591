"""A write run in a thread of its own when asked, so that the one asking never waits on it.

The worker's state is reported under a lock that a stop waits for, and a report's heartbeat
row is written to a database that may be away (a write into a network cut waits up to
tcp_user_timeout, a minute): the report asks, and this thread writes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import structlog

log = structlog.get_logger(__name__)


class BackgroundWrites:
    """Runs ``write`` in a thread of its own after each :meth:`request`.

    Requests made while a write runs are merged into one more write, which reads what it
    writes afresh: the last write made is of the latest state. The thread ends when no
    request waits (a daemon thread: one stuck in the database never holds up the exit).
    After :meth:`close` no write starts.
    """

    def __init__(self, write: Callable[[], None], *, name: str) -> None:
        self._write = write
        self._name = name
        self._lock = threading.Lock()
        self._wanted = False
        self._running = False
        self._closed = False
        self._idle = threading.Condition(self._lock)  # notified when the thread ends

    def request(self) -> None:
        """Have ``write`` run soon, after the one running now if there is one."""
        with self._lock:
            if self._closed:
                return
            self._wanted = True
            if self._running:
                return
            self._running = True
        try:
            threading.Thread(target=self._run, name=self._name, daemon=True).start()
        except RuntimeError:  # (no thread to be had, or the interpreter exiting): not written
            with self._lock:
                self._running = False  # else no later request would ever start one again
                self._idle.notify_all()
            log.warning(f"{self._name}_not_started", hint="the next request tries again")

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._closed or not self._wanted:
                    self._running = False
                    self._idle.notify_all()
                    return
                self._wanted = False
            try:
                self._write()
            except Exception:  # the next request still writes
                log.exception(f"{self._name}_failed")

    def close(self, timeout: float) -> bool:
        """Start no more writes, and wait up to ``timeout`` s for the one running to end.

        Called before the database's pool closes: a write left running would fail against
        it and log into whatever runs next. False if a write was still running at timeout.
        """
        with self._lock:
            self._closed = True
            self._wanted = False
            return self._idle.wait_for(lambda: not self._running, timeout=timeout)
