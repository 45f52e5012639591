"""Times other programs wrote: timestamptz values that no Python datetime can hold.

``infinity``, ``-infinity`` and Go's zero time (``0001-01-01 00:00:00Z``) seen from a session
zone west of UTC (1 BC) are valid timestamptz values that psycopg refuses to load (DataError).
One such row in a shared table must not fail a claim, a listing or ``status``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import psycopg
from psycopg.types.datetime import TimestamptzLoader

# A day inside datetime's range at both ends, so every session zone's rendering fits too.
_FIRST = "0001-01-02 00:00:00+00"
_LAST = "9999-12-30 00:00:00+00"


def loadable(column: str) -> str:
    """SQL for ``column`` when a datetime can hold it in any session zone, else NULL."""
    return f"(CASE WHEN {column} BETWEEN '{_FIRST}' AND '{_LAST}' THEN {column} END)"


class TimeAsWritten(TimestamptzLoader):
    """A timestamptz as a datetime, or as the server's text when no datetime can hold it
    (for what an operator reads: ``infinity`` says more than nothing)."""

    def load(self, data: Any) -> datetime | str:  # type: ignore[override]
        try:
            return super().load(data)
        except psycopg.DataError:
            return bytes(data).decode()


def shown_as_written(cursor: psycopg.Cursor[Any]) -> None:
    """Load this cursor's timestamptz columns with :class:`TimeAsWritten`."""
    cursor.adapters.register_loader("timestamptz", TimeAsWritten)
