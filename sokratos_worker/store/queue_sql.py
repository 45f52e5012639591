"""The queues' SQL: each statement composed and rendered once per queue (the hot path's settle
and claim among them), and planned once on each new connection.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import psycopg
import structlog
from psycopg import sql

from sokratos_worker.model import Queue
from sokratos_worker.store import times
from sokratos_worker.store.connection import time_limited

log = structlog.get_logger(__name__)


# A new connection's warm-up (planning the settle) gives up after this behind a lock.
WARM_UP_TIMEOUT_MS = 1000


@dataclass(frozen=True)
class _QueueSql:
    """The statements of one queue, composed and rendered once (a ``Composed`` would be
    rendered again on every execution: measurable per item on the hot path)."""

    delete_fenced: bytes
    retry: bytes
    give_back: bytes
    give_back_owed: bytes
    owed_attempts: bytes
    renew: bytes
    settle_plain: bytes
    settle_claim: dict[Queue, bytes]  # by the queue the next item is claimed from


# A claim that takes over an expired lease records the attempt that died with its worker
# (counted, and otherwise missing from the history a dead letter keeps).
DIED_ENTRY = "worker died during the attempt"


def _died_error(owner: sql.Composable) -> sql.Composed:
    """The history entry's error for an attempt whose worker ``owner`` (an SQL expression)
    let its lease expire: written by the claim, matched by give_back_owed, so one text."""
    return sql.SQL("{died} || ' (its lease, held by ' || {owner} || ', expired)'").format(
        died=sql.Literal(DIED_ENTRY), owner=owner
    )


_DIED_ATTEMPT = sql.SQL(
    """CASE WHEN picked.held THEN t.attempt_errors || jsonb_build_array(jsonb_build_object(
           'at', now(), 'attempt', t.attempts,
           'error', {error}))
       ELSE t.attempt_errors END"""
).format(error=_died_error(sql.SQL("coalesce(t.lease_owner, '?')")))


# A producer's created_at no datetime can hold (infinity, Go's zero time west of UTC) comes as
# NULL: psycopg would fail the claim after it committed, and the batch would stall for ever.
_CREATED_AT = sql.SQL(times.loadable("t.created_at"))
# A producer's attempts at the int4 maximum (a "never retry" sentinel) would overflow the
# claim's increment and stop the whole queue; held there, it is dead-lettered unrun.
_NEXT_ATTEMPT = sql.SQL("least(t.attempts, 2147483646) + 1")


def _compose(queue: Queue) -> _QueueSql:
    return _QueueSql(
        **{k: v.as_bytes(None) for k, v in _composed(queue).items()},
        settle_claim={claimed: _settle_claim(queue, claimed).as_bytes(None) for claimed in Queue},
    )


def _source(queue: Queue) -> sql.SQL:
    """The item's source column: the distillation queue has none (every item is one)."""
    return sql.SQL("t.source" if queue is Queue.TRIAGE else "'distillation'")


def _composed(queue: Queue) -> dict[str, sql.Composed]:
    table = sql.Identifier(queue.value)
    source = _source(queue)
    fence = sql.SQL("id = %(id)s AND lease_owner = %(owner)s AND attempts = %(attempt)s")
    return {
        # The payload as text: the dead letter parses it itself, and keeps the text when
        # it cannot be written back as JSON (see _stored_payload). ``replay_of`` (0044):
        # the dead letter copies it into the outcome and follows it to earlier archives.
        "delete_fenced": sql.SQL(
            "DELETE FROM {table} AS t WHERE {fence}"
            " RETURNING t.id, t.payload::text, t.idempotency_key, {source}, t.attempt_errors,"
            " to_jsonb(now()), t.replay_of"
        ).format(table=table, fence=fence, source=source),
        "retry": sql.SQL(
            """UPDATE {table} SET lease_owner = NULL, lease_expires_at = NULL,
                   run_after = now() + make_interval(secs => %(delay)s),
                   last_error = %(error)s::text,
                   attempt_errors = attempt_errors || jsonb_build_array(jsonb_build_object(
                       'at', now(), 'attempt', %(attempt)s::int, 'error', %(error)s::text,
                       'backend', %(backend)s::text))
               WHERE {fence} RETURNING id"""
        ).format(table=table, fence=fence),
        "give_back": sql.SQL(
            """UPDATE {table} SET attempts = attempts - 1, lease_owner = NULL,
                   lease_expires_at = NULL
               WHERE {fence} RETURNING id"""
        ).format(table=table, fence=fence),
        # The give-back an outage kept this worker from writing for attempt N, written at its
        # own claim N+1 that took over the lease it held: only if that claim's history entry
        # (the last) names this worker's lease at attempt N, so an attempt another worker
        # counted (or died in) is never uncounted; the entry goes with the attempt.
        "give_back_owed": sql.SQL(
            """UPDATE {table} SET attempts = attempts - 1, attempt_errors = attempt_errors - (-1)
               WHERE {fence}
                 AND attempt_errors -> -1 -> 'attempt' = to_jsonb(%(attempt)s::int - 1)
                 AND attempt_errors -> -1 ->> 'error' = {error}
               RETURNING id"""
        ).format(table=table, fence=fence, error=_died_error(sql.SQL("%(owner)s::text"))),
        # The attempts of an item leased to this worker: tells whether a give_back_owed whose
        # answer was lost with its connection was written.
        "owed_attempts": sql.SQL(
            "SELECT attempts FROM {table} WHERE id = %(id)s AND lease_owner = %(owner)s"
        ).format(table=table),
        # Leases run from clock_timestamp(), not now() (the statement's or transaction's start):
        # a statement that waited behind a lock longer than the lease would otherwise grant
        # one already over, and another worker would take the item while it runs here.
        # A row locked by another transaction (our own settle waiting on a lock after its
        # delete) is skipped, not waited for: waiting, the pass renewed none of the other
        # items, whose leases ran out while they ran. Skipped, it is still ours if its
        # committed row says so (the settle commits or rolls back; the next pass renews it).
        "renew": sql.SQL(
            """WITH free AS (
                   SELECT id FROM {table}
                   WHERE lease_owner = %(owner)s AND id = ANY(%(ids)s)
                   FOR UPDATE SKIP LOCKED),
               renewed AS (
                   UPDATE {table} AS t
                   SET lease_expires_at = clock_timestamp() + make_interval(secs => %(lease)s)
                   FROM free WHERE t.id = free.id RETURNING t.id)
               SELECT id FROM renewed
               UNION ALL
               SELECT id FROM {table}
               WHERE lease_owner = %(owner)s AND id = ANY(%(ids)s)
                 AND id NOT IN (SELECT id FROM free)"""
        ).format(table=table),
        # The fast path: delete and record the outcome in one statement (one round trip).
        "settle_plain": sql.SQL(
            """WITH d AS (DELETE FROM {table} AS t WHERE {fence}
                          RETURNING t.id, t.idempotency_key, {source} AS source)
               INSERT INTO work_outcomes (queue, item_id, idempotency_key, source, outcome,
                                          memory_ids, detail, attempts, backend)
               SELECT %(queue)s::text, d.id, d.idempotency_key, d.source, %(outcome)s::text,
                      %(memory_ids)s::bigint[], %(detail)s::text, %(attempt)s::int,
                      %(backend)s::text
               FROM d RETURNING item_id"""
        ).format(table=table, fence=fence, source=source),
    }


def _settle_claim(settled: Queue, claimed: Queue) -> sql.Composed:
    """The hot path under load: the fenced settle and the claim of the slot's next item (from
    ``claimed``, which the runner's fair share picks) in one statement, so one round trip and
    one commit per item. Data-modifying CTEs always run to completion; the claim never picks
    the item being settled (``id <>``). The row carries the settle's count; with nothing to
    claim its other columns are NULL. LIMIT is a constant: with a parameter there, PostgreSQL
    judged the generic plan too costly and planned every execution anew, which more than
    doubled the statement's server CPU (bench/README.md)."""
    fence = sql.SQL("id = %(id)s AND lease_owner = %(owner)s AND attempts = %(attempt)s")
    return sql.SQL(
        """WITH d AS (DELETE FROM {table} AS t WHERE {fence}
                      RETURNING t.id, t.idempotency_key, {source} AS source),
                o AS (INSERT INTO work_outcomes (queue, item_id, idempotency_key, source,
                                                 outcome, memory_ids, detail, attempts,
                                                 backend)
                      SELECT %(queue)s::text, d.id, d.idempotency_key, d.source,
                             %(outcome)s::text, %(memory_ids)s::bigint[], %(detail)s::text,
                             %(attempt)s::int, %(backend)s::text
                      FROM d RETURNING item_id),
                picked AS (
                      SELECT id,
                             lease_owner IS NOT NULL AND lease_expires_at IS NOT NULL
                                 AS held
                      FROM {claim_table}
                      WHERE run_after <= now()
                        AND (lease_expires_at IS NULL OR lease_expires_at < now())
                        {not_this_item}
                      ORDER BY run_after, id
                      LIMIT 1
                      FOR UPDATE SKIP LOCKED),
                c AS (UPDATE {claim_table} AS t
                      SET attempts = {next_attempt},
                          lease_owner = %(owner)s,
                          lease_expires_at = clock_timestamp()
                              + make_interval(secs => %(lease)s),
                          attempt_errors = {died}
                      FROM picked WHERE t.id = picked.id
                      RETURNING t.id, t.payload, t.idempotency_key, {claimed_source} AS source,
                                t.attempts, {created_at} AS created_at, t.attempt_errors,
                                picked.held)
           SELECT (SELECT count(*) FROM o), c.id, c.payload, c.idempotency_key, c.source,
                  c.attempts, c.created_at, c.attempt_errors, c.held
           FROM (SELECT 1) AS one LEFT JOIN c ON true"""
    ).format(
        table=sql.Identifier(settled.value),
        claim_table=sql.Identifier(claimed.value),
        fence=fence,
        source=_source(settled),
        claimed_source=_source(claimed),
        # (an id of the other table is another item: it may be claimed)
        not_this_item=sql.SQL("AND id <> %(id)s" if claimed is settled else ""),
        died=_DIED_ATTEMPT,
        created_at=_CREATED_AT,
        next_attempt=_NEXT_ATTEMPT,
    )


QUEUE_SQL = {queue: _compose(queue) for queue in Queue}


def warm_up(conn: psycopg.Connection) -> None:
    """Plan the hot path once on a new connection, without running it (EXPLAIN only).

    A new backend loads the queue tables' catalog entries on its first statement; at start
    every slot's first settle paid that at once and on a busy 2-core machine they took
    20-80 ms instead of 3 (bench/README.md). A database without the tables is left alone.
    """
    params: dict[str, Any] = {
        "id": 0,
        "owner": "",
        "attempt": 0,
        "queue": "",
        "outcome": "",
        "memory_ids": [],
        "detail": "",
        "backend": None,
        "lease": 0.0,
    }
    try:
        # Planning waits for a lock a migration holds; a connection that waited on it would
        # stall the pool thread opening it (and a stop's pool close): skip the warm-up then.
        with time_limited(conn, WARM_UP_TIMEOUT_MS):
            for queue in Queue:
                conn.execute(b"EXPLAIN " + QUEUE_SQL[queue].settle_claim[queue], params)
    except psycopg.Error as exc:
        log.debug("connection_warm_up_skipped", error=str(exc).splitlines()[0])


@functools.cache
def claim_sql(queue: Queue, limit: int) -> bytes:
    """The claim of up to ``limit`` items, rendered once per limit: a constant LIMIT lets
    PostgreSQL keep its generic plan (see ``settle_claim``). The lease runs from the
    moment the claim takes the row (``clock_timestamp()``, see ``renew``), not from its start."""
    table = sql.Identifier(queue.value)
    return (
        sql.SQL(
            """WITH picked AS (
               SELECT id, lease_owner IS NOT NULL AND lease_expires_at IS NOT NULL AS held
               FROM {table}
               WHERE run_after <= now()
                 AND (lease_expires_at IS NULL OR lease_expires_at < now())
               ORDER BY run_after, id
               LIMIT {limit}
               FOR UPDATE SKIP LOCKED)
           UPDATE {table} AS t
           SET attempts = {next_attempt},
               lease_owner = %(owner)s,
               lease_expires_at = clock_timestamp() + make_interval(secs => %(lease)s),
               attempt_errors = {died}
           FROM picked WHERE t.id = picked.id
           RETURNING t.id, t.payload, t.idempotency_key, {source}, t.attempts,
                     {created_at}, t.attempt_errors, picked.held"""
        )
        .format(
            table=table,
            source=_source(queue),
            limit=sql.Literal(limit),
            died=_DIED_ATTEMPT,
            created_at=_CREATED_AT,
            next_attempt=_NEXT_ATTEMPT,
        )
        .as_bytes(None)
    )


# ``replay_of`` is a dead letter's (its item's, 0044); the success settles leave it NULL.
INSERT_OUTCOME = sql.SQL(
    """INSERT INTO work_outcomes (queue, item_id, idempotency_key, source, outcome, memory_ids,
                                  detail, attempts, backend, replay_of)
       VALUES (%(queue)s, %(item_id)s, %(key)s, %(source)s, %(outcome)s, %(memory_ids)s,
               %(detail)s, %(attempt)s, %(backend)s, %(replay_of)s)"""
)


INSERT_FAILED = sql.SQL(
    """INSERT INTO failed_operations (op_type, label, error_message, context_data, source_queue,
                                      item_id, idempotency_key, attempts)
       VALUES (%(op_type)s, %(label)s, %(error)s,
               jsonb_set(%(context)s, '{payload}', %(payload)s::jsonb), %(queue)s, %(item_id)s,
               %(key)s, %(attempt)s)
       ON CONFLICT (source_queue, item_id) WHERE item_id IS NOT NULL DO NOTHING
       RETURNING id"""
)
