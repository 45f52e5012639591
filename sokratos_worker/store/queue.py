"""Claim, renew, settle and release queue items: the same code for both queues.

Every state change after a claim is fenced by ``lease_owner`` and the attempt the claim
counted, so a worker whose lease was taken over can change nothing. Effects, the outcome
row and the deletion of the item are one transaction.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import pq, sql
from psycopg.abc import Params
from psycopg.rows import tuple_row
from psycopg.types.json import Jsonb, JsonbBinaryLoader, JsonbLoader

from sokratos_worker import jsontext
from sokratos_worker.errors import InvalidPayload
from sokratos_worker.model import (
    PARADIGM_SHIFT_FLAG,
    Effects,
    Item,
    NewMemory,
    Outcome,
    Queue,
    SettleResult,
)
from sokratos_worker.store.memories import Written, archive_already_saved, write_effects
from sokratos_worker.store.queue_sql import (
    DIED_ENTRY,
    INSERT_FAILED,
    INSERT_OUTCOME,
    QUEUE_SQL,
    claim_sql,
)
from sokratos_worker.store.sanitize import clean_text

NOTIFY_CHANNEL = "sokratos_worker"


def died_in(item: Item, attempt: int) -> bool:
    """Whether the item's history says ``attempt`` died with its worker (a claim found its
    lease expired)."""
    return any(
        isinstance(e, dict)
        and e.get("attempt") == attempt
        and str(e.get("error", "")).startswith(DIED_ENTRY)
        for e in item.errors
    )


def _item_from_row(queue: Queue, row: Sequence[Any]) -> Item:
    item_id, payload, key, source, attempts, created_at, errors, held = row
    return Item(
        queue=queue,
        id=int(item_id),
        payload=payload if isinstance(payload, dict) else {"__payload__": payload},
        attempt=int(attempts),
        source=str(source),
        idempotency_key=key,
        created_at=created_at,
        errors=tuple(_as_list(errors)),
        took_over_lease=bool(held),
    )


UNPARSABLE_KEY = "__unparsable_json__"  # the marker holding jsonb text too deep to parse
_JSONB_OID = psycopg.adapters.types["jsonb"].oid


def _safe_loads(data: bytes | str) -> Any:
    """``json.loads``, except that jsonb Python cannot read (PostgreSQL accepts it: nested
    deeper than Python's recursion limit, an integer of over 4300 digits) becomes a marker
    holding the text, instead of crashing the claim (which had leased the batch already)."""
    try:
        return jsontext.loads(data)
    except ValueError:
        text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
        return {UNPARSABLE_KEY: text}


class _SafeJsonbLoader(JsonbLoader):
    _loads = staticmethod(_safe_loads)


class _SafeJsonbBinaryLoader(JsonbBinaryLoader):
    _loads = staticmethod(_safe_loads)


def _parse_safely(conn: psycopg.Connection) -> None:
    # A payload Python cannot parse (5,000 deep) must not fail a claim that leased its batch.
    if conn.adapters.get_loader(_JSONB_OID, pq.Format.TEXT) is not _SafeJsonbLoader:
        conn.adapters.register_loader("jsonb", _SafeJsonbLoader)
        conn.adapters.register_loader("jsonb", _SafeJsonbBinaryLoader)


def payload_problem(item: Item) -> InvalidPayload | None:
    """A payload that is not a JSON object cannot be handled by any pipeline."""
    if UNPARSABLE_KEY in item.payload and len(item.payload) == 1:
        return InvalidPayload(
            "payload", "cannot be read: nested too deeply, or a number too long (kept as text)"
        )
    if "__payload__" in item.payload and len(item.payload) == 1:
        kind = type(item.payload["__payload__"]).__name__
        return InvalidPayload("payload", f"must be a JSON object, got {kind}")
    return None


def claim(
    conn: psycopg.Connection, queue: Queue, *, owner: str, limit: int, lease_s: float
) -> list[Item]:
    """Lease up to ``limit`` ready items, counting the attempt (autocommit: one statement).

    Each item's ``took_over_lease`` says whether an expired lease held it (an earlier attempt
    never finished), which the runner needs to tell a dead worker from attempts used up. A
    lease is an owner and an expiry: a claim sets both, and every path that ends a lease
    (retry, give back, release) clears both. A claimable row with both set therefore held a
    lease that expired (the WHERE admits no live one); a row inserted with an owner but no
    expiry (or an expiry but no owner) never held one, so neither column alone says it.
    """
    if limit <= 0:
        return []
    _parse_safely(conn)
    with conn.cursor(row_factory=tuple_row) as cur:
        cur.execute(claim_sql(queue, limit), {"owner": owner, "lease": lease_s})
        return [_item_from_row(queue, row) for row in cur.fetchall()]


def renew(
    conn: psycopg.Connection, queue: Queue, *, owner: str, ids: Sequence[int], lease_s: float
) -> set[int]:
    """Extend the leases of ``ids``; returns the ids still ours."""
    if not ids:
        return set()
    rows = conn.execute(
        QUEUE_SQL[queue].renew, {"owner": owner, "ids": list(ids), "lease": lease_s}
    ).fetchall()
    return {int(row[0]) for row in rows}


def release_orphans(
    conn: psycopg.Connection,
    queue: Queue,
    *,
    owner: str,
    keep: Sequence[int],
    lease_s: float,
    older_than_s: float,
) -> list[int]:
    """Give back ``owner``'s leases on items it does not know it holds; returns their ids.

    A claim whose COMMIT landed but whose answer was lost (the connection dropped) leaves an
    item leased to this process that no slot runs. Only live leases taken (or renewed) more
    than ``older_than_s`` ago count: a claim being handed to a slot right now is not an
    orphan, and an expired lease is anyone's to claim again (that claim counts the attempt).
    """
    rows = conn.execute(
        sql.SQL(
            """UPDATE {table} SET attempts = greatest(attempts - 1, 0), lease_owner = NULL,
                   lease_expires_at = NULL
               WHERE lease_owner = %(owner)s AND NOT (id = ANY(%(keep)s))
                 AND lease_expires_at > now()
                 AND lease_expires_at < now() + make_interval(secs => %(lease)s - %(age)s)
               RETURNING id"""
        ).format(table=sql.Identifier(queue.value)),
        {"owner": owner, "keep": list(keep), "lease": lease_s, "age": older_than_s},
    ).fetchall()
    return [int(row[0]) for row in rows]


def _fence(item: Item, owner: str) -> dict[str, Any]:
    return {"id": item.id, "owner": owner, "attempt": item.attempt}


def settle_success(
    conn: psycopg.Connection,
    item: Item,
    effects: Effects,
    *,
    owner: str,
    claim_from: Queue | None = None,
    lease_s: float = 300.0,
) -> tuple[SettleResult, list[Item]]:
    """Commit the effects, the outcome row and the deletion; and claim the next item from
    ``claim_from`` unless it is None.

    Claiming the next item in the same transaction saves a commit per item under load.
    Without memories to write, the settle and the claim are one statement.
    """
    next_items: list[Item] = []
    _parse_safely(conn)
    if not effects.memories and not effects.supersessions:
        return _settle_plain(
            conn,
            item,
            effects,
            owner=owner,
            claim_from=claim_from,
            lease_s=lease_s,
        )
    try:
        with conn.transaction():
            result = _settle_with_effects(conn, item, effects, owner)
            if claim_from is not None:
                next_items = claim(conn, claim_from, owner=owner, limit=1, lease_s=lease_s)
    except _Fenced:
        return SettleResult(settled=False), []
    return result, next_items


def _settle_plain(
    conn: psycopg.Connection,
    item: Item,
    effects: Effects,
    *,
    owner: str,
    claim_from: Queue | None,
    lease_s: float,
) -> tuple[SettleResult, list[Item]]:
    """No memories to write: one statement (autocommit: its own transaction, one round trip),
    which claims the next item from ``claim_from`` unless it is None.

    A fenced settle changes nothing; the items claimed with it are ours all the same.
    """
    params: dict[str, Any] = {
        **_fence(item, owner),
        "queue": item.queue.value,
        "outcome": effects.outcome.value,
        "memory_ids": list(effects.existing_memory_ids),
        "detail": clean_text(effects.recorded_detail()),
        "backend": effects.backend,
    }
    sqls = QUEUE_SQL[item.queue]
    with conn.cursor(row_factory=tuple_row) as cur:
        if claim_from is None:
            cur.execute(sqls.settle_plain, params)
            settled = cur.fetchone() is not None
            next_items: list[Item] = []
        else:
            params["lease"] = lease_s
            cur.execute(sqls.settle_claim[claim_from], params)
            rows = cur.fetchall()
            settled = bool(rows and rows[0][0])
            next_items = [_item_from_row(claim_from, row[1:]) for row in rows if row[1] is not None]
    if not settled:
        return SettleResult(settled=False), next_items
    return SettleResult(settled=True, memory_ids=effects.existing_memory_ids), next_items


def _settle_with_effects(
    conn: psycopg.Connection, item: Item, effects: Effects, owner: str
) -> SettleResult:
    if conn.execute(QUEUE_SQL[item.queue].delete_fenced, _fence(item, owner)).fetchone() is None:
        raise _Fenced
    written = write_effects(conn, effects)
    outcome, detail = _after_duplicates(effects, written)
    _record_outcome(
        conn,
        item,
        key=item.idempotency_key,
        outcome=outcome,
        memory_ids=written.memory_ids,
        detail=clean_text(effects.recorded_detail(detail)),
        attempt=item.attempt,
        backend=effects.backend,
        replay_of=None,
    )
    return SettleResult(settled=True, memory_ids=written.memory_ids, outcome=outcome)


def _record_outcome(
    conn: psycopg.Connection,
    item: Item,
    *,
    key: str | None,
    outcome: Outcome,
    memory_ids: Sequence[int],
    detail: str,
    attempt: int,
    backend: str | None,
    replay_of: int | None,
) -> None:
    """The item's one work_outcomes row (a success settle's or a dead letter's)."""
    conn.execute(
        INSERT_OUTCOME,
        {
            "queue": item.queue.value,
            "item_id": item.id,
            "key": key,
            "source": item.outcome_source,
            "outcome": outcome.value,
            "memory_ids": list(memory_ids),
            "detail": detail,
            "attempt": attempt,
            "backend": backend,
            "replay_of": replay_of,
        },
    )


def _after_duplicates(effects: Effects, written: Written) -> tuple[Outcome, str]:
    """The outcome and detail to record once drafts that became duplicates were dropped."""
    if not written.duplicate_of:
        return effects.outcome, effects.detail
    ids = ", ".join(str(i) for i in written.duplicate_of)
    # The paradigm-shift flag stays last (the main application looks for it there).
    flag = PARADIGM_SHIFT_FLAG if effects.detail.endswith(PARADIGM_SHIFT_FLAG) else ""
    if written.new == 0 and effects.outcome is Outcome.SAVED:
        return Outcome.SKIPPED, (
            f"near-duplicate of memory {ids} (saved by another item meanwhile){flag}"
        )
    dropped = len(written.duplicate_of)
    return effects.outcome, (
        f"{effects.detail.removesuffix(flag)}; {dropped} near-duplicate(s) of memory {ids} saved"
        f" by another item meanwhile: not written{flag}"
    )


class _Fenced(Exception):
    """The fenced delete found nothing: the lease is no longer ours."""


def schedule_retry(
    conn: psycopg.Connection,
    item: Item,
    *,
    owner: str,
    error: str,
    delay_s: float,
    backend: str | None = None,
) -> bool:
    """Clear the lease and retry after ``delay_s``; False if the lease was lost."""
    params = {
        **_fence(item, owner),
        "delay": delay_s,
        "error": clean_text(error),
        "backend": backend,
    }
    return conn.execute(QUEUE_SQL[item.queue].retry, params).fetchone() is not None


def give_back(conn: psycopg.Connection, item: Item, *, owner: str) -> bool:
    """Release the lease and un-count the attempt (not the item's fault)."""
    return conn.execute(QUEUE_SQL[item.queue].give_back, _fence(item, owner)).fetchone() is not None


def dead_letter(
    conn: psycopg.Connection,
    item: Item,
    *,
    owner: str,
    error: str,
    backend: str | None = None,
    memories: tuple[NewMemory, ...] = (),
    last_attempt: int | None = None,
    ran: bool = True,
) -> SettleResult:
    """failed_operations row (whole payload, every attempt's error) + outcome + delete.

    With ``memories`` (distillation's raw archive) they are saved in the same transaction
    and the outcome is ``archived`` instead of ``failed``; chunks an earlier item of its
    ``failed retry`` chain already saved are listed, not saved again. The row's
    ``replay_of`` (set by ``failed retry``) is kept in the outcome, so the chain outlives
    the failure rows. ``last_attempt`` is the attempt the record ends with when it is not
    the claim's own: a claim that only found the last attempt dead is not an attempt
    (durability.md), so the attempt that died is recorded instead. ``ran``: False when the
    claim found no attempt left and ran nothing (the history keeps how the last attempt
    ended, see :func:`_history_with`).
    """
    error = clean_text(error)
    attempt = item.attempt if last_attempt is None else last_attempt
    _parse_safely(conn)
    try:
        with conn.transaction():
            row = conn.execute(QUEUE_SQL[item.queue].delete_fenced, _fence(item, owner)).fetchone()
            if row is None:
                raise _Fenced
            _, payload_text, key, source, history, now, replay_of = row
            attempts = _history_with(
                _as_list(history), _history_entry(attempt, error, backend, now), ran=ran
            )
            outcome = Outcome.ARCHIVED if memories else Outcome.FAILED
            to_write, saved = (
                archive_already_saved(conn, item, memories, replay_of=replay_of)
                if memories
                else ((), ())
            )
            effects = Effects(outcome, memories=to_write, existing_memory_ids=saved)
            memory_ids = write_effects(conn, effects).memory_ids
            context = {
                "queue": item.queue.value,
                "item_id": item.id,
                "source": source,
                "attempts": attempts,
            }
            failed = conn.execute(
                INSERT_FAILED,
                {
                    "op_type": item.op_type,
                    "label": f"{item.queue.value} item {item.id}",
                    "error": error,
                    "context": Jsonb({**context, "payload": None}),
                    "payload": _stored_payload(item, payload_text),
                    "queue": item.queue.value,
                    "item_id": item.id,
                    "key": key,
                    "attempt": attempt,
                },
            ).fetchone()
            _record_outcome(
                conn,
                item,
                key=key,
                outcome=outcome,
                memory_ids=memory_ids,
                detail=error,
                attempt=attempt,
                backend=backend,
                replay_of=replay_of,
            )
    except _Fenced:
        return SettleResult(settled=False)
    return SettleResult(
        settled=True, memory_ids=memory_ids, failure_id=int(failed[0]) if failed else None
    )


def _as_list(history: Any) -> list[Any]:
    """The row's ``attempt_errors`` as a list: a producer or an operator may have written a
    value that is not an array there, which is kept as one entry rather than lost."""
    if isinstance(history, list):
        return history
    return [] if history is None else [history]


def _history_with(history: list[Any], entry: dict[str, Any], *, ran: bool) -> list[Any]:
    """The dead letter's history, one entry per attempt: ``entry`` added; or, when the history
    has its attempt already, replacing it if that attempt ran to this end (a claim noted it
    died, but this worker's run of it went on), else left as it is (the claim that found no
    attempt left is not an attempt: the entry says how the last one ended)."""
    others = [
        e for e in history if not (isinstance(e, dict) and e.get("attempt") == entry["attempt"])
    ]
    if len(others) == len(history):
        return [*history, entry]
    return [*others, entry] if ran else history


def _history_entry(attempt: int, error: str, backend: str | None, at: str) -> dict[str, Any]:
    """The last attempt's entry, shaped like the ones a retry appends (contract §3); ``at``
    is the database's time, rendered as jsonb renders the retries' times."""
    entry: dict[str, Any] = {"at": at, "attempt": attempt, "error": error}
    if backend:
        entry["backend"] = backend
    return entry


def _stored_payload(item: Item, payload_text: str) -> str:
    """The dead letter's payload as jsonb text: the queue's own, parsed by PostgreSQL, so it
    is exact (every digit of a number), which a round trip through Python floats is not. One
    Python could not read at the claim stays the marker holding its text, so ``failed show``
    and ``failed retry`` can read the record back."""
    if payload_problem(item) is not None and UNPARSABLE_KEY in item.payload:
        return json.dumps({UNPARSABLE_KEY: payload_text})
    return payload_text


def outcome_of(conn: psycopg.Connection, item: Item) -> tuple[str, int | None, str] | None:
    """The item's recorded outcome, the attempt that recorded it and its detail, if it has
    one (ours, a commit that landed before a drop; or another worker's, which took the item
    over)."""
    row = conn.execute(
        """SELECT outcome, attempts, coalesce(detail, '') FROM work_outcomes
           WHERE queue = %s AND item_id = %s""",
        (item.queue.value, item.id),
    ).fetchone()
    if row is None:
        return None
    return str(row[0]), (int(row[1]) if row[1] is not None else None), str(row[2])


def lease_owner(conn: psycopg.Connection, item: Item) -> tuple[bool, str | None]:
    """Whether the item's row still exists, and who holds its lease (None: nobody)."""
    row = conn.execute(
        sql.SQL("SELECT lease_owner FROM {} WHERE id = %s").format(
            sql.Identifier(item.queue.value)
        ),
        (item.id,),
    ).fetchone()
    return (row is not None, row[0] if row is not None else None)


def unleased_attempts(conn: psycopg.Connection, item: Item) -> int | None:
    """The attempts counted on the item's row while nobody holds its lease (None: the row
    is gone or leased): tells our landed retry or give-back from another worker's."""
    row = conn.execute(
        sql.SQL("SELECT attempts FROM {} WHERE id = %s AND lease_owner IS NULL").format(
            sql.Identifier(item.queue.value)
        ),
        (item.id,),
    ).fetchone()
    return None if row is None else int(row[0])


def next_ready_in(conn: psycopg.Connection, queues: Sequence[Queue]) -> float | None:
    """Seconds until the earliest item becomes claimable (backoff or lease), None if empty."""
    parts = [
        sql.SQL(
            "SELECT min(GREATEST(run_after, COALESCE(lease_expires_at, run_after))) AS t FROM {}"
        ).format(sql.Identifier(q.value))
        for q in queues
    ]
    if not parts:
        return None
    query = sql.SQL("SELECT EXTRACT(EPOCH FROM (min(t) - now())) FROM ({}) AS u").format(
        sql.SQL(" UNION ALL ").join(parts)
    )
    row = conn.execute(query).fetchone()
    if row is None or row[0] is None:
        return None
    return max(0.0, float(row[0]))


def key_known(conn: psycopg.Connection, queue: Queue, key: str) -> bool:
    """Whether an enqueue with ``key`` would return an item enqueued before (the enqueue
    functions do so without saying): a key is accepted once, for good."""
    row = conn.execute(
        "SELECT 1 FROM sokratos_idempotency_keys WHERE queue = %s AND key = %s",
        (queue.value, key),
    ).fetchone()
    return row is not None


def enqueue(
    conn: psycopg.Connection,
    queue: Queue,
    payload: dict[str, Any],
    *,
    idempotency_key: str | None = None,
    source: str | None = None,
) -> int:
    """Add an item through the producers' functions (validation, idempotency, NOTIFY).

    Only ``sokratos_enqueue_triage`` / ``sokratos_enqueue_distillation`` are granted to the
    producer role (sql/roles.sql), so the client works under that role as well.
    """
    value = Jsonb(payload, dumps=_dumps)
    if queue is Queue.TRIAGE:
        return call_enqueue(
            conn,
            "SELECT sokratos_enqueue_triage(%s, %s::text, %s::text)",
            (value, idempotency_key, source or "conversation"),
        )
    return call_enqueue(
        conn, "SELECT sokratos_enqueue_distillation(%s, %s::text)", (value, idempotency_key)
    )


def call_enqueue(conn: psycopg.Connection, query: str, params: Params) -> int:
    """The item id a query calling an enqueue function returns; a payload the function
    refuses (SQLSTATE 22023) is raised as InvalidPayload naming the field."""
    try:
        row = conn.execute(query, params).fetchone()
    except psycopg.errors.InvalidParameterValue as exc:
        message = exc.diag.message_primary or str(exc)
        field, _, problem = message.partition(" ")
        raise InvalidPayload(field, problem) from exc
    assert row is not None  # noqa: S101 - the function always returns an id
    return int(row[0])


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False)
