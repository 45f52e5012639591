"""Commands that give up waiting for a table another session holds, and say who holds it.

A migration's ALTER or a transaction left open by hand can hold a queue table for minutes;
``enqueue`` and ``failed retry`` would otherwise wait silently for as long as it lasts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg import errors as pg_errors
from psycopg import pq

from sokratos_worker.errors import TableLocked
from sokratos_worker.store.status import (
    BLOCKS_WRITES,
    WORKER_TABLES,
    by_holder,
    describe_holder,
    locked_tables,
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
        raise TableLocked(_locked_message(conn, doing, timeout_ms)) from exc
    finally:
        # Not left on the server session: a pooler (PgBouncer in transaction mode) hands it to
        # its next client, whose own lock_timeout it would replace.
        with contextlib.suppress(psycopg.Error):
            if not conn.closed and conn.info.transaction_status == pq.TransactionStatus.IDLE:
                conn.execute("RESET lock_timeout")


def _locked_message(conn: psycopg.Connection, doing: str, timeout_ms: int) -> str:
    waited = f"{doing}: gave up after {timeout_ms / 1000:g} s waiting for a lock"
    try:
        holders = locked_tables(conn, BLOCKS_WRITES, WRITTEN_TABLES)
    except psycopg.Error:
        holders = []
    if not holders:
        return (
            f"{waited} another transaction holds on a row it needs (the same item or failure"
            " in another session's open transaction?); try again when that transaction ends"
        )
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
