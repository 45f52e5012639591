"""Commands that give up waiting for a table another session holds, and say who holds it.

A migration's ALTER or a transaction left open by hand can hold a queue table for minutes;
``enqueue`` and ``failed retry`` would otherwise wait silently for as long as it lasts.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg import pq, sql

from sokratos_worker.errors import TableLocked
from sokratos_worker.store.connection import lock_wait_limited
from sokratos_worker.store.status import (
    BLOCKS_WRITES,
    SESSION_COLUMNS,
    WORKER_TABLES,
    by_holder,
    describe_holder,
    locked_tables,
    session,
)

# How long a command (and the spool import) waits for a lock before it gives up.
COMMAND_LOCK_TIMEOUT_MS = 5000
# What an enqueue or a retry writes: a lock on any of these can be what it waited for.
WRITTEN_TABLES = (*WORKER_TABLES, "sokratos_idempotency_keys")


@contextmanager
def lock_waits_given_up(
    conn: psycopg.Connection, doing: str, timeout_ms: int = COMMAND_LOCK_TIMEOUT_MS
) -> Iterator[None]:
    """Lock waits on ``conn`` end after ``timeout_ms`` in :class:`TableLocked`, which names
    the sessions holding the worker's tables; ``doing`` says what was given up.

    It sets the session's ``lock_timeout``, so only on a connection of the caller's own, never
    a pooled one (whose later statements would keep it), and outside any transaction on it:
    the holders are read after the rollback.
    """
    conn.execute(f"SET lock_timeout = {int(timeout_ms)}")
    try:
        yield
    except pg_errors.LockNotAvailable as exc:
        raise TableLocked(_locked_message(conn, doing, timeout_ms, exc)) from exc
    finally:
        # Not left on the server session: a pooler (PgBouncer in transaction mode) hands it to
        # its next client, whose own lock_timeout it would replace.
        with contextlib.suppress(psycopg.Error):
            if not conn.closed and conn.info.transaction_status == pq.TransactionStatus.IDLE:
                conn.execute("RESET lock_timeout")


def _locked_message(
    conn: psycopg.Connection, doing: str, timeout_ms: int, exc: pg_errors.LockNotAvailable
) -> str:
    waited = f"{doing}: gave up after {timeout_ms / 1000:g} s waiting for a lock"
    try:
        holders = locked_tables(conn, BLOCKS_WRITES, WRITTEN_TABLES)
    except psycopg.Error:
        holders = []
    if not holders:
        return _row_locked_message(conn, waited, exc)
    grouped = by_holder(holders)
    held = "; ".join(
        f"{tables} {'is' if ',' not in tables else 'are'} held by {describe_holder(holder)}"
        for tables, holder in grouped
    )
    ends = "; ".join(f"SELECT pg_terminate_backend({holder['pid']})" for _, holder in grouped)
    return (
        f"{waited}: {held}. It is released when that transaction ends (a migration: try again"
        f" when it is done); to end it now: {ends}"
    )


def _row_locked_message(
    conn: psycopg.Connection, waited: str, exc: pg_errors.LockNotAvailable
) -> str:
    """No table held: a row was, by another session's open transaction, named when found."""
    try:
        found = _row_holder(conn, exc.diag.context or "")
    except psycopg.Error:
        found = None
    if found is None:
        return (
            f"{waited} another transaction holds on a row it needs (the same item or failure"
            " in another session's open transaction?); try again when that transaction ends"
        )
    table, holder = found
    return (
        f"{waited}: a {table} row it needs is held by {describe_holder(holder)}. It is"
        " released when that transaction ends; to end it now:"
        f" SELECT pg_terminate_backend({holder['pid']})"
    )


# The server's context of a lock wait on a row: 'while locking tuple (0,1) in relation "t"'.
_ROW_WAITED_FOR = re.compile(
    r'while (?:locking|updating|deleting) tuple (\(\d+,\d+\)) in relation "([^"]+)"'
)
# How long the look at the row may wait for its table (a lock taken since): not a second wait.
_ROW_LOOK_MS = 200


def _row_holder(conn: psycopg.Connection, context: str) -> tuple[str, dict[str, Any]] | None:
    """The table and the session whose open transaction holds the row the wait was for, or
    None. The row's xmax is that transaction's id (a row lock or an uncommitted change), and
    the session holding that id's lock, and a lock on the table, is the one: the waiting
    session's pg_blocking_pids would need the wait again, which the lock timeout ended."""
    match = _ROW_WAITED_FOR.search(context)
    if match is None or match[2] not in WRITTEN_TABLES:
        return None
    with lock_wait_limited(conn, _ROW_LOOK_MS):
        row = conn.execute(
            sql.SQL(
                """SELECT l.pid, {columns}
                     FROM {table} AS t
                     JOIN pg_locks AS l ON l.locktype = 'transactionid'
                          AND l.transactionid = t.xmax AND l.mode = 'ExclusiveLock'
                          AND l.granted AND l.pid <> pg_backend_pid()
                     LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid
                    WHERE t.ctid = %s::tid
                      AND EXISTS (SELECT 1 FROM pg_locks AS r
                                   WHERE r.pid = l.pid AND r.granted
                                     AND r.relation = %s::regclass)"""
            ).format(columns=sql.SQL(SESSION_COLUMNS), table=sql.Identifier(match[2])),
            (match[1], match[2]),
        ).fetchone()
    return None if row is None else (match[2], session(row))
