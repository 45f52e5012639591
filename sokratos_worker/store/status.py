"""What ``status`` shows and what the daemon records about itself (worker_heartbeats)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from sokratos_worker.model import Queue

# What ``status`` reads: a lock on any of these by another session is named there.
WORKER_TABLES = (
    *(q.value for q in Queue),
    "failed_operations",
    "work_outcomes",
    "worker_heartbeats",
    "email_checkpoints",
)


def queue_stats(
    conn: psycopg.Connection, queues: tuple[Queue, ...] = tuple(Queue), *, next_retry: bool = False
) -> dict[str, dict[str, Any]]:
    """Per queue: ready, backing off, leased (and by whom), oldest ready age; with
    ``next_retry``, the backing-off item that runs next and why it failed. Rows no worker
    wrote so are counted apart, only when there are any (see _never_ending).

    One pass over each table (grouped by lease owner): a /metrics scrape of a large backlog
    reads every row once, not twice.
    """
    stats: dict[str, dict[str, Any]] = {}
    for q in queues:
        rows = conn.execute(
            sql.SQL(
                """SELECT lease_owner,
                     count(*) FILTER (WHERE run_after <= now() AND
                         (lease_expires_at IS NULL OR lease_expires_at < now())),
                     count(*) FILTER (WHERE run_after > now() AND
                         (lease_expires_at IS NULL OR lease_expires_at < now())),
                     count(*) FILTER (WHERE lease_expires_at >= now()),
                     EXTRACT(EPOCH FROM now() - min(created_at) FILTER (WHERE run_after <= now()
                         AND (lease_expires_at IS NULL OR lease_expires_at < now())
                         AND isfinite(created_at))),
                     count(*) FILTER (WHERE run_after = 'infinity' AND
                         (lease_expires_at IS NULL OR lease_expires_at < now())),
                     count(*) FILTER (WHERE lease_expires_at = 'infinity')
                   FROM {} GROUP BY lease_owner ORDER BY lease_owner"""
            ).format(sql.Identifier(q.value))
        ).fetchall()
        ages = [float(r[4]) for r in rows if r[4] is not None]
        stats[q.value] = {
            "ready": sum(int(r[1]) for r in rows),
            "backing_off": sum(int(r[2]) for r in rows),
            "leased": sum(int(r[3]) for r in rows),
            "leased_by": {str(r[0]): int(r[3]) for r in rows if r[0] is not None and r[3]},
            "oldest_ready_age_s": round(max(ages), 1) if ages else None,
            **_never_ending(rows),
        }
        if next_retry and stats[q.value]["backing_off"]:
            stats[q.value]["next_retry"] = _next_retry(conn, q)
    return stats


def _never_ending(rows: Sequence[Sequence[Any]]) -> dict[str, int]:
    """What a producer's direct insert (or a hand edit) can leave that no worker writes: a
    run_after of 'infinity' (never due), a lease without a lease_owner, a lease_expires_at of
    'infinity' (it never expires, so no claim takes it). Only the ones there are: the usual
    keys stay as they were."""
    counts = {
        "never_due": sum(int(r[5]) for r in rows),
        "leased_without_owner": sum(int(r[3]) for r in rows if r[0] is None),
        "lease_never_ends": sum(int(r[6]) for r in rows),
    }
    return {name: n for name, n in counts.items() if n}


def _next_retry(conn: psycopg.Connection, queue: Queue) -> dict[str, Any] | None:
    """The backing-off item that runs next: when, its attempts so far and why it failed.

    "2 backing off" alone sent the operator to the logs to learn why (review R2). A run_after
    of 'infinity' never comes: ``in_s`` is null then (JSON has no Infinity) and ``never``
    says why.
    """
    row = conn.execute(
        sql.SQL(
            """SELECT id, attempts,
                      CASE WHEN isfinite(run_after) THEN EXTRACT(EPOCH FROM run_after - now()) END,
                      last_error FROM {}
               WHERE run_after > now()
                 AND (lease_expires_at IS NULL OR lease_expires_at < now())
               ORDER BY run_after, id LIMIT 1"""
        ).format(sql.Identifier(queue.value))
    ).fetchone()
    if row is None:
        return None
    due = row[2] is not None
    return {
        "item_id": int(row[0]),
        "attempts": int(row[1]),
        "in_s": round(max(0.0, float(row[2])), 1) if due else None,
        **({} if due else {"never": NEVER_DUE}),
        "last_error": row[3],
    }


NEVER_DUE = "run_after is infinity"


# The last 24 hours, ending now: a row dated 'infinity' (Sokratos's own) is never recent.
_CREATED_IN_24H = "created_at > now() - interval '24 hours' AND created_at <= now()"


def failures_24h(conn: psycopg.Connection) -> dict[str, int]:
    """Failures in the last 24 hours by op_type (closed ones too: see failures_24h_closed)."""
    return failures_24h_and_closed(conn)[0]


def failures_24h_and_closed(conn: psycopg.Connection) -> tuple[dict[str, int], dict[str, int]]:
    """:func:`failures_24h`, and by op_type how many of them are closed since (``retried_at``
    set: replayed by ``failed retry``, or the mail passed unread recorded later), in one read."""
    rows = conn.execute(
        "SELECT op_type, count(*), count(*) FILTER (WHERE retried_at IS NOT NULL)"
        f" FROM failed_operations WHERE {_CREATED_IN_24H} GROUP BY op_type ORDER BY op_type"
    ).fetchall()
    return (
        {str(op): int(n) for op, n, _ in rows},
        {str(op): int(closed) for op, _, closed in rows if closed},
    )


def outcomes_24h(conn: psycopg.Connection) -> dict[str, dict[str, int]]:
    """Outcomes recorded in the last 24 hours, by queue and outcome.

    A window, not every outcome ever: ``work_outcomes`` is kept, and counting it all read the
    worker's whole history on every ``status`` (50 ms at 400,000 rows, and growing).
    """
    rows = conn.execute(
        "SELECT queue, outcome, count(*) FROM work_outcomes"
        " WHERE decided_at > now() - interval '24 hours' AND decided_at <= now()"
        " GROUP BY queue, outcome"
    ).fetchall()
    result: dict[str, dict[str, int]] = {}
    for queue, outcome, count in rows:
        result.setdefault(str(queue), {})[str(outcome)] = int(count)
    return result


# How long a worker silent past its heartbeat (see _overdue) stays listed, flagged: long
# enough to be seen; the plain window alone dropped it before it could be flagged.
OVERDUE_SHOWN_S = 600.0


def live_workers(conn: psycopg.Connection, *, stale_after_s: float) -> list[dict[str, Any]]:
    """Workers that ticked within ``stale_after_s`` (or, silent past their own heartbeat,
    within OVERDUE_SHOWN_S after that), with the state and backends they reported."""
    rows = conn.execute(
        """SELECT worker_id, hostname, pid, version, started_at, last_tick_at, state, detail,
                  extract(epoch FROM now() - last_tick_at)::float8
           FROM worker_heartbeats
           WHERE state <> 'stopped'
             AND last_tick_at > now() - make_interval(secs => greatest(%s,
                 3 * CASE WHEN jsonb_typeof(detail -> 'heartbeat_s') = 'number'
                          THEN (detail ->> 'heartbeat_s')::float8 ELSE 0 END
                 + 30 + %s))
           ORDER BY worker_id""",
        (stale_after_s, OVERDUE_SHOWN_S),
    ).fetchall()
    return [
        {
            "worker_id": r[0],
            "hostname": r[1],
            "pid": r[2],
            "version": r[3],
            "started_at": r[4].isoformat() if r[4] else None,
            "last_tick_at": r[5].isoformat() if r[5] else None,
            "state": r[6],
            "backends": (r[7] or {}).get("backends", []),
            "detail": r[7] or {},
            "silent_s": round(r[8], 1) if r[8] is not None else None,
            "overdue": _overdue(r[8], (r[7] or {}).get("heartbeat_s")),
        }
        for r in rows
    ]


def _overdue(silent_s: float | None, heartbeat_s: Any) -> bool:
    """Silent for well over its own heartbeat interval: killed without a word, or hung."""
    if silent_s is None or not isinstance(heartbeat_s, int | float):
        return False
    return silent_s > 3 * heartbeat_s + 30


def record_heartbeat(
    conn: psycopg.Connection,
    *,
    worker_id: str,
    hostname: str,
    pid: int,
    version: str,
    state: str,
    detail: dict[str, Any],
) -> None:
    """Upsert this worker's row in worker_heartbeats; a row already 'stopped' is final.

    A tick still running when the process stops must not write its state over the last
    heartbeat: ``status`` would list an exited process as live. A worker id is never
    reused (host, pid and a random suffix), so no later process is locked out by this.
    """
    conn.execute(
        """INSERT INTO worker_heartbeats (worker_id, hostname, pid, version, last_tick_at,
                                          state, detail)
           VALUES (%s, %s, %s, %s, now(), %s, %s)
           ON CONFLICT (worker_id) DO UPDATE SET last_tick_at = now(), state = EXCLUDED.state,
               detail = EXCLUDED.detail
           WHERE worker_heartbeats.state <> 'stopped'""",
        (worker_id, hostname, pid, version, state, Jsonb(detail)),
    )


def prune_heartbeats(conn: psycopg.Connection, *, older_than_s: float) -> int:
    """Forget workers that have not ticked for a long time."""
    return conn.execute(
        "DELETE FROM worker_heartbeats WHERE last_tick_at < now() - make_interval(secs => %s)",
        (older_than_s,),
    ).rowcount


@dataclass(frozen=True)
class EmbeddingColumn:
    """What memories.embedding demands of the configuration."""

    dimension: int | None  # vector(N); None for a plain ``vector`` or no column
    required: bool  # NOT NULL (a Sokratos database): no memory without an embedding


def embedding_column(conn: psycopg.Connection) -> EmbeddingColumn:
    """The fixed dimension of memories.embedding (Sokratos: 2560) and whether it is NOT NULL,
    apart: a nullable vector(N) still refuses every embedding of another dimension."""
    row = conn.execute(
        """SELECT a.atttypmod, a.attnotnull FROM pg_attribute a
           WHERE a.attrelid = 'memories'::regclass AND a.attname = 'embedding'
             AND NOT a.attisdropped"""
    ).fetchone()
    if row is None:
        return EmbeddingColumn(None, required=False)
    return EmbeddingColumn(int(row[0]) if row[0] and row[0] > 0 else None, required=bool(row[1]))


# Who another session is, after its pid, read from pg_stat_activity ``a`` (see session()).
# Query texts of other roles' sessions read <insufficient privilege> without pg_read_all_stats.
SESSION_COLUMNS = """coalesce(a.application_name, ''), coalesce(a.usename::text, ''),
    coalesce(a.state, ''), EXTRACT(EPOCH FROM now() - a.xact_start),
    left(coalesce(a.query, ''), 200)"""


def session(row: Sequence[Any]) -> dict[str, Any]:
    """A row's pid and SESSION_COLUMNS (its first six values) as a log- and JSON-ready dict."""
    held = row[4]
    return {
        "pid": int(row[0]),
        "application": str(row[1]),
        "user": str(row[2]),
        "state": str(row[3]),
        "in_transaction_s": round(float(held)) if held is not None else None,
        "query": str(row[5]),
    }


@dataclass(frozen=True)
class LockWait:
    """What one server process waits for: the tables it is refused, and who holds them."""

    tables: tuple[str, ...]
    blockers: tuple[dict[str, Any], ...]  # pid, application, user, state, in_transaction_s, query

    @property
    def blocker_pids(self) -> frozenset[int]:
        return frozenset(int(b["pid"]) for b in self.blockers)

    def describe(self) -> str:
        """One line for systemd's STATUS=: what is waited for, and who holds it."""
        tables = ", ".join(self.tables) or "a table"
        pids = ", ".join(str(pid) for pid in sorted(self.blocker_pids))
        return f"claiming waits for a lock on {tables} (held by pid {pids})"


def lock_wait(conn: psycopg.Connection, pid: int) -> LockWait:
    """The locks server process ``pid`` waits for and the sessions holding them (none: it
    does not wait for a lock)."""
    tables = conn.execute(
        "SELECT DISTINCT relation::regclass::text FROM pg_locks"
        " WHERE pid = %s AND NOT granted AND relation IS NOT NULL ORDER BY 1",
        (pid,),
    ).fetchall()
    rows = conn.execute(
        f"""SELECT b.pid, {SESSION_COLUMNS}
              FROM unnest(pg_blocking_pids(%s)) AS b(pid)
              LEFT JOIN pg_stat_activity a ON a.pid = b.pid
             ORDER BY a.xact_start NULLS LAST, b.pid""",
        (pid,),
    ).fetchall()
    blockers = tuple(session(r) for r in rows)
    return LockWait(tables=tuple(str(t[0]) for t in tables), blockers=blockers)


def lock_waits_of(
    conn: psycopg.Connection, pids: Sequence[int], longer_than_s: float
) -> list[tuple[int, float, LockWait]]:
    """Which of server processes ``pids`` have waited for another session's lock longer
    than ``longer_than_s``: each with how long, and the lock's tables and holders.

    The wait is counted from when it began (pg_locks.waitstart, null for a moment after it
    began), not from the statement's start: a long statement that has just begun to wait is
    not named. (Read through to_jsonb: PostgreSQL 13 and older have no waitstart, and count
    from the statement's start instead.)"""
    rows = conn.execute(
        """SELECT pid, EXTRACT(EPOCH FROM now() - waited_since)::float8
             FROM (SELECT a.pid,
                          min(CASE WHEN to_jsonb(l) ? 'waitstart'
                                   THEN COALESCE((to_jsonb(l) ->> 'waitstart')::timestamptz,
                                                 now())
                                   ELSE a.state_change END) AS waited_since
                     FROM pg_stat_activity a
                     JOIN pg_locks l ON l.pid = a.pid AND NOT l.granted
                    WHERE a.pid = ANY(%s) AND a.state = 'active'
                      AND a.wait_event_type = 'Lock'
                    GROUP BY a.pid) AS waiting
            WHERE waited_since < now() - make_interval(secs => %s)
            ORDER BY pid""",
        (list(pids), longer_than_s),
    ).fetchall()
    return [(int(pid), float(waited), lock_wait(conn, int(pid))) for pid, waited in rows]


# Table lock modes that block reads too (a migration's ALTER, LOCK TABLE, VACUUM FULL).
BLOCKS_READS = ("AccessExclusiveLock",)
# Table lock modes that make an INSERT, UPDATE or DELETE wait (they conflict with ROW EXCLUSIVE).
BLOCKS_WRITES = ("ShareLock", "ShareRowExclusiveLock", "ExclusiveLock", "AccessExclusiveLock")


def locked_tables(
    conn: psycopg.Connection,
    modes: Sequence[str] = BLOCKS_READS,
    tables: Sequence[str] = WORKER_TABLES,
) -> list[dict[str, Any]]:
    """Which of ``tables`` other sessions hold in one of ``modes``, and who holds them.

    A session still waiting for such a lock counts too (``waiting``), with the sessions it
    waits behind (``ahead_of`` its pid): a migration's ALTER queued behind a transaction
    left open holds up every later reader and writer of the table as if it held it, and the
    open transaction, holding only a weak lock, is the one to end.
    """
    rows = conn.execute(
        f"""WITH wanted AS (
                SELECT l.pid, l.granted, c.relname::text AS relname
                  FROM pg_locks l
                  JOIN pg_class c ON c.oid = l.relation
                 WHERE l.mode = ANY(%s) AND l.pid <> pg_backend_pid()
                   AND l.database = (SELECT oid FROM pg_database
                                      WHERE datname = current_database())
                   AND c.relname = ANY(%s)),
            involved AS (
                SELECT pid, relname, NOT granted AS waiting, NULL::int AS ahead_of FROM wanted
                UNION
                SELECT b.pid, w.relname, false, w.pid
                  FROM wanted w, unnest(pg_blocking_pids(w.pid)) AS b(pid)
                 WHERE NOT w.granted AND b.pid <> pg_backend_pid())
            SELECT DISTINCT i.pid, {SESSION_COLUMNS}, i.relname, i.waiting, i.ahead_of
              FROM involved i
              LEFT JOIN pg_stat_activity a ON a.pid = i.pid
             ORDER BY 7, 1""",
        (list(modes), list(tables)),
    ).fetchall()
    return [
        {"table": str(r[6]), **session(r), "waiting": bool(r[7]), "ahead_of": r[8]} for r in rows
    ]


def by_holder(locks: Sequence[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """``locked_tables`` rows as (the tables, comma-separated; their holder), one per session."""
    tables: dict[int, list[str]] = {}
    holders: dict[int, dict[str, Any]] = {}
    for lock in locks:
        tables.setdefault(lock["pid"], []).append(lock["table"])
        holders.setdefault(lock["pid"], lock)
    return [(", ".join(tables[pid]), holders[pid]) for pid in tables]


def describe_holder(holder: dict[str, Any]) -> str:
    """``pid 812 (psql, idle in transaction, 340 s in its transaction; 'ALTER TABLE ...')``."""
    held = holder["in_transaction_s"]
    role = ""
    if holder.get("waiting"):
        role = ", waiting for it: every later reader and writer waits behind"
    elif holder.get("ahead_of") is not None:
        role = f", ahead of pid {holder['ahead_of']}, which waits for it"
    return (
        f"pid {holder['pid']} ({holder['application'] or 'no application name'},"
        f" {holder['state'] or 'state unknown'}"
        + (f", {held} s in its transaction" if held is not None else "")
        + f"; {holder['query']!r}{role})"
    )
