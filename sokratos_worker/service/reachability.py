"""Whether the daemon's latest contact with PostgreSQL succeeded, for ``/readyz``.

Each path that talks to the database (the runner's claims, settles and lease renewals, the
LISTEN connection, the heartbeat row, the metrics scrape) reports how its contact ended, and the
latest report wins: one failure makes the worker not ready until some path reaches the database
again. Reading it costs no query, so a readiness probe never takes a connection.
"""

from __future__ import annotations

import threading


class DatabaseContact:
    """The outcome of the latest contact with the database, shared by the daemon's threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Start-up checked the schema before the daemon serves anything: the database was there.
        self._reachable = True

    def succeeded(self) -> None:
        """A path reached the database."""
        with self._lock:
            self._reachable = True

    def failed(self) -> None:
        """A path could not reach the database (no connection, or it dropped)."""
        with self._lock:
            self._reachable = False

    def report(self, reached: bool) -> None:
        """A path's contact ended: ``reached`` the database or not (the runner's callback)."""
        with self._lock:
            self._reachable = reached

    @property
    def reachable(self) -> bool:
        """True unless the latest contact failed."""
        with self._lock:
            return self._reachable
