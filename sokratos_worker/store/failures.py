"""failed_operations: record, list, show, replay and purge."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg.types.string import TextLoader

from sokratos_worker.errors import INVALID_PAYLOAD_PREFIX, InvalidPayload, WorkerError
from sokratos_worker.model import RETRY_KEY_SUFFIX, Queue
from sokratos_worker.store import queue as store
from sokratos_worker.store import times


def record_failure(
    conn: psycopg.Connection, *, op_type: str, label: str, error: str, context: Any
) -> int:
    """A failure outside the queues (e.g. a spool file that can never be imported)."""
    row = conn.execute(
        "INSERT INTO failed_operations (op_type, label, error_message, context_data)"
        " VALUES (%s, %s, %s, %s) RETURNING id",
        (op_type, label, error, Jsonb(context)),
    ).fetchone()
    assert row is not None  # noqa: S101 - INSERT … RETURNING
    return int(row[0])


def list_failures(
    conn: psycopg.Connection, *, op_type: str | None = None, limit: int = 50
) -> Iterator[dict[str, Any]]:
    """Newest first, without the (possibly large) context; fetched 1,000 rows at a time
    through a server-side cursor, so ``failed list --limit 1000000`` holds a thousand rows,
    not a million (a single-row stream still piled up in libpq's buffer when the reader was
    slower than the server)."""
    with (
        conn.transaction(),
        conn.cursor(name="failed_list", row_factory=dict_row) as cur,
    ):
        cur.itersize = 1000
        times.shown_as_written(cur)  # a row the Go app wrote with created_at 'infinity'
        cur.execute(
            """SELECT id, op_type, label, error_message, created_at, source_queue, item_id,
                      idempotency_key, attempts, retried_at, retried_as
               FROM failed_operations
               WHERE %(op)s::text IS NULL OR op_type = %(op)s
               ORDER BY created_at DESC, id DESC LIMIT %(limit)s""",
            {"op": op_type, "limit": limit},
        )
        yield from cur


def get_failure(conn: psycopg.Connection, failure_id: int) -> dict[str, Any] | None:
    """One failure; its context_data is the jsonb's text as PostgreSQL renders it (exact),
    for the caller to parse: a payload may be nested deeper than Python's json follows."""
    with conn.cursor(row_factory=dict_row) as cur:
        cur.adapters.register_loader("jsonb", TextLoader)
        times.shown_as_written(cur)
        cur.execute("SELECT * FROM failed_operations WHERE id = %s", (failure_id,))
        return cur.fetchone()


@dataclass(frozen=True)
class RetryResult:
    """What ``failed retry`` did for one failure."""

    failure_id: int
    item_id: int | None
    message: str


@dataclass(frozen=True)
class _Replay:
    """A failure found replayable: what its replay is made from."""

    failure_id: int
    queue: Queue
    key: str | None  # the failed item's idempotency key
    original: int | None  # the failed item's id, which the replay links back to


def retry_key(original: str | None, failure_id: int) -> str:
    """The new item's key: the original with ``#retry-N`` appended (N counts up)."""
    base = original or f"failed_operations:{failure_id}"
    match = RETRY_KEY_SUFFIX.search(base)
    if match:
        return f"{base[: match.start()]}#retry-{int(match.group(1)) + 1}"
    return f"{base}#retry-1"


class RetryKeyTooLong(WorkerError):
    """The queue's key index refused a replay's key (SQLSTATE 54000): the original key fitted,
    with ``#retry-N`` appended it does not. Nothing of the replay was written."""

    def __init__(self, key_chars: int, server_message: str) -> None:
        super().__init__(server_message)
        self.key_chars = key_chars  # the longest key the refused statement carried


# What makes one failure unreplayable as stored: `failed retry --all` halves a batch that meets
# it down to that one alone, which is reported on its own line, and replays the others.
UNREPLAYABLE = (InvalidPayload, RetryKeyTooLong)


def retry_failure(conn: psycopg.Connection, failure_id: int) -> RetryResult:
    """Re-enqueue the stored payload as a new item, exactly once."""
    try:
        with conn.transaction():
            return _retry_once(conn, failure_id)
    except InvalidPayload as exc:
        # One unreplayable failure must not stop `failed retry --all` halfway.
        return _refused(failure_id, exc)
    except RetryKeyTooLong as exc:
        return _key_too_long(failure_id, exc)


def _refused(failure_id: int, exc: InvalidPayload) -> RetryResult:
    return RetryResult(
        failure_id,
        None,
        f"refused: the stored payload cannot be enqueued ({exc}); repair it from"
        f" `sokratos-worker failed show {failure_id}` and enqueue it by hand",
    )


def _key_too_long(failure_id: int, exc: RetryKeyTooLong) -> RetryResult:
    return RetryResult(
        failure_id,
        None,
        f"refused: its idempotency key is too long to carry the '#retry-N' suffix a replay's"
        f" key adds: the key index refuses the replay's key of {exc.key_chars:,} characters"
        f" ({exc}); shorten the stored key (UPDATE failed_operations SET idempotency_key ="
        f" left(idempotency_key, 500) WHERE id = {failure_id}) and retry it again, or enqueue"
        f" the payload from `sokratos-worker failed show {failure_id}` by hand under a shorter"
        " key",
    )


# Failures `failed retry --all` replays in one transaction: one commit (a WAL flush) and about
# ten round trips for them all, not for each; a second retry waits for the batch's row locks
# far less than its 5 s lock_timeout.
RETRY_BATCH = 250


def retry_batch(conn: psycopg.Connection, failure_ids: list[int]) -> list[RetryResult]:
    """Re-enqueue each stored payload as a new item, exactly once, all in one transaction;
    the results in the order of ``failure_ids`` (no id twice).

    Raises one of UNREPLAYABLE when the enqueue function refuses one of the payloads, or the
    key index one of the replay keys: nothing of the batch is written then; smaller batches
    (the CLI halves it), down to :func:`retry_failure` on the refused one, replay the others.
    """
    with conn.transaction():
        locked = _locked_for_replay(conn, failure_ids)
        sorted_out = {fid: _sorted_out(fid, locked.get(fid)) for fid in failure_ids}
        replays = [found for found in sorted_out.values() if isinstance(found, _Replay)]
        items = _replay_all(conn, replays)
    return [
        found if isinstance(found, RetryResult) else _re_enqueued(found, items[fid])
        for fid, found in sorted_out.items()
    ]


def _retry_once(conn: psycopg.Connection, failure_id: int) -> RetryResult:
    found = _sorted_out(failure_id, _locked_for_replay(conn, [failure_id]).get(failure_id))
    if isinstance(found, RetryResult):
        return found
    _mark_retrying(conn, [failure_id])
    item_id = _enqueue_under_a_free_key(
        conn, found.queue, retry_key(found.key, failure_id), failure_id
    )
    _link(conn, found.queue, {item_id: found.original})
    _mark_retried(conn, {failure_id: item_id})
    return _re_enqueued(found, item_id)


def _re_enqueued(replay: _Replay, item_id: int) -> RetryResult:
    return RetryResult(
        replay.failure_id, item_id, f"re-enqueued as {replay.queue.value} item {item_id}"
    )


def _locked_for_replay(
    conn: psycopg.Connection, failure_ids: list[int]
) -> dict[int, tuple[Any, ...]]:
    """The failures' rows, locked in id order (two retries at once wait, never deadlock).
    What the payload is, asked of PostgreSQL: Python need not (and at some depths cannot)
    parse the context."""
    rows = conn.execute(
        sql.SQL(
            """SELECT id, idempotency_key, retried_at, retried_as, source_queue, op_type, item_id,
                  coalesce(jsonb_typeof(context_data) = 'object' AND context_data ? 'payload',
                           false),
                  coalesce(jsonb_typeof(context_data -> 'payload') = 'object'
                           AND NOT context_data -> 'payload' ? %(unparsable)s, false),
                  coalesce(context_data ->> 'kept_as', context_data ->> 'set_aside_as'),
                  context_data ->> 'what_to_do', context_data ? 'payload_omitted'
           FROM failed_operations AS f WHERE id = ANY(%(ids)s) ORDER BY id FOR UPDATE"""
        ),
        {"ids": failure_ids, "unparsable": store.UNPARSABLE_KEY},
    ).fetchall()
    queued = _still_queued_ids(conn, [(int(row[0]), row[4]) for row in rows])
    return {int(row[0]): (*row[1:], int(row[0]) in queued) for row in rows}


def _sorted_out(failure_id: int, row: tuple[Any, ...] | None) -> RetryResult | _Replay:
    """Why the failure is not replayed, or what its replay is made from."""
    if row is None:
        return RetryResult(failure_id, None, f"no failure with id {failure_id}")
    key, retried_at, retried_as, source_queue, op_type, original, stored, an_object = row[:8]
    kept_as, todo, too_large, still_queued = row[8:]
    if retried_at is not None:
        replayed = replayed_item(source_queue, retried_as)
        return RetryResult(failure_id, retried_as, f"already retried as {replayed}; nothing done")
    if op_type == "spool_import":
        return RetryResult(failure_id, None, _spool_file_hint(failure_id, kept_as, too_large))
    if op_type == EMAIL_OP_TYPE and todo:
        # A mail the worker could not read or record: not a queue item, it is fetched again.
        return RetryResult(failure_id, None, f"refused: this is a mail, not a queue item: {todo}")
    if not stored or not source_queue:
        return RetryResult(
            failure_id,
            None,
            "refused: this failure has no stored payload (not written by sokratos-worker):"
            " replay it from the application that wrote it; 'failed purge --older-than DAYS'"
            " removes it once it is that old",
        )
    if source_queue not in _REPLAY_QUEUES:
        return RetryResult(
            failure_id,
            None,
            f"refused: its source_queue {source_queue!r} is not a queue of this worker"
            f" ({', '.join(_REPLAY_QUEUES)}); set it right or enqueue the payload by hand",
        )
    if still_queued:
        return RetryResult(
            failure_id,
            None,
            f"refused: its item, {source_queue} item {original}, is still queued and will run"
            " by itself (a replay would run it twice, and could save it twice); if it fails"
            " again, retry this failure then",
        )
    if not an_object:
        return _refused(
            failure_id, InvalidPayload("payload", "is not a JSON object this worker can parse")
        )
    return _Replay(failure_id, Queue(source_queue), key, original)


def replayed_item(source_queue: str | None, retried_as: int | None) -> str:
    """The item a retry made, named with its queue: each queue numbers its items itself."""
    if retried_as is None:
        return "an item not recorded"
    return f"{source_queue} item {retried_as}" if source_queue else f"item {retried_as}"


def _replay_all(conn: psycopg.Connection, replays: list[_Replay]) -> dict[int, int]:
    """Enqueue every replay, link it and mark its failure; failure id -> the new item's id."""
    if not replays:
        return {}
    _mark_retrying(conn, [replay.failure_id for replay in replays])
    items: dict[int, int] = {}
    for queue in Queue:
        into = [replay for replay in replays if replay.queue is queue]
        if into:
            items.update(_replay_into(conn, queue, into))
            _link(conn, queue, {items[r.failure_id]: r.original for r in into})
    _mark_retried(conn, items)
    return items


def _replay_into(conn: psycopg.Connection, queue: Queue, replays: list[_Replay]) -> dict[int, int]:
    """Enqueue the replays into ``queue`` in one statement; failure id -> item id. One whose
    key another session took meanwhile goes again on its own, under the next key."""
    keys = _free_keys(conn, queue, replays)
    items = _enqueue_each(conn, queue, keys)
    here = _enqueued_here(conn, queue, items)
    for failure_id, key in keys.items():
        if failure_id not in here:
            items[failure_id] = _enqueue_under_a_free_key(
                conn, queue, retry_key(key, failure_id), failure_id
            )
    return items


def _free_keys(conn: psycopg.Connection, queue: Queue, replays: list[_Replay]) -> dict[int, str]:
    """Each replay's key, counted on past keys already recorded (see
    _enqueue_under_a_free_key) and past the keys of the replays before it in the batch: one
    transaction cannot tell its own items apart by xmin, so no two may share a key."""
    keys = {r.failure_id: retry_key(r.key, r.failure_id) for r in replays}
    while True:
        taken = {
            str(row[0])
            for row in conn.execute(
                "SELECT key FROM sokratos_idempotency_keys WHERE queue = %s AND key = ANY(%s)",
                (queue.value, list(keys.values())),
            )
        }
        clashes = _clashing(keys, taken)
        if not clashes:
            return keys
        for failure_id in clashes:
            keys[failure_id] = retry_key(keys[failure_id], failure_id)


def _clashing(keys: dict[int, str], taken: set[str]) -> list[int]:
    """The failures whose key is taken, or is an earlier failure's key in the batch."""
    seen: set[str] = set()
    clashes = []
    for failure_id in sorted(keys):
        if keys[failure_id] in taken or keys[failure_id] in seen:
            clashes.append(failure_id)
        seen.add(keys[failure_id])
    return clashes


def _mark_retrying(conn: psycopg.Connection, failure_ids: list[int]) -> None:
    # Marked first: this row version's xmin is this transaction's, which tells the item the
    # enqueue made from one it only found under the key (see _enqueued_here).
    conn.execute(
        "UPDATE failed_operations SET retried_at = now() WHERE id = ANY(%s)", (failure_ids,)
    )


def _link(conn: psycopg.Connection, queue: Queue, originals: dict[int, int | None]) -> None:
    """Set each replay's ``replay_of`` (new item id -> the failed item's id)."""
    linked = {item: original for item, original in originals.items() if original is not None}
    if not linked:
        return
    # The link archive reuse follows (sql/0044, store/memories.py): made here, by the
    # worker, in the replay's own transaction; a producer's item never carries one.
    conn.execute(
        sql.SQL(
            "UPDATE {} AS t SET replay_of = k.original"
            " FROM unnest(%s::bigint[], %s::bigint[]) AS k(item, original)"
            " WHERE t.id = k.item AND t.replay_of IS NULL"
        ).format(sql.Identifier(queue.value)),
        (list(linked), list(linked.values())),
    )


def _mark_retried(conn: psycopg.Connection, items: dict[int, int]) -> None:
    conn.execute(
        "UPDATE failed_operations AS f SET retried_at = now(), retried_as = k.item"
        " FROM unnest(%s::bigint[], %s::bigint[]) AS k(failure, item) WHERE f.id = k.failure",
        (list(items), list(items.values())),
    )


# Keys tried before giving up: each one taken means another session took it meanwhile.
_KEY_TRIES = 100


def _enqueue_under_a_free_key(
    conn: psycopg.Connection, queue: Queue, candidate: str, failure_id: int
) -> int:
    """Enqueue the replay under ``candidate``, counted on past keys already recorded (a
    producer's own ``chat-42#retry-1``): under such a key the enqueue would answer with that
    item, enqueue nothing, and the replay would be lost (and link the other item). A key taken
    by a session still running when it was looked at (another retry, a producer) is found
    after the enqueue, which then goes again under the next key."""
    for _ in range(_KEY_TRIES):
        while conn.execute(
            "SELECT 1 FROM sokratos_idempotency_keys WHERE queue = %s AND key = %s",
            (queue.value, candidate),
        ).fetchone():
            candidate = retry_key(candidate, failure_id)
        item_id = _enqueue_each(conn, queue, {failure_id: candidate})[failure_id]
        if _enqueued_here(conn, queue, {failure_id: item_id}):
            return item_id
        candidate = retry_key(candidate, failure_id)
    raise WorkerError(
        f"failure {failure_id}: {_KEY_TRIES} retry keys in a row were taken by other sessions"
        " while this one looked; try again"
    )


def _enqueue_each(conn: psycopg.Connection, queue: Queue, keys: dict[int, str]) -> dict[int, int]:
    """Enqueue each failure's stored payload under its key, in failure order, in one
    statement; failure id -> the item id the enqueue function answered. A payload it refuses
    (SQLSTATE 22023) raises InvalidPayload naming the field, as store.call_enqueue does; a
    key too long for the key index (54000) raises RetryKeyTooLong."""
    failure_ids = sorted(keys)
    try:
        rows = conn.execute(
            _REPLAY[queue], {"ids": failure_ids, "keys": [keys[fid] for fid in failure_ids]}
        ).fetchall()
    except psycopg.errors.InvalidParameterValue as exc:
        message = exc.diag.message_primary or str(exc)
        field, _, problem = message.partition(" ")
        raise InvalidPayload(field, problem) from exc
    except psycopg.errors.ProgramLimitExceeded as exc:
        message = exc.diag.message_primary or str(exc)
        if not message.startswith("index row"):
            raise  # not the key: no replay can help it
        raise RetryKeyTooLong(max(len(key) for key in keys.values()), message) from exc
    return {int(failure_id): int(item_id) for failure_id, item_id in rows}


def _enqueued_here(conn: psycopg.Connection, queue: Queue, items: dict[int, int]) -> set[int]:
    """The failures whose item this transaction inserted: its row shares the xmin of the
    failure's row, updated just before (the enqueue runs no subtransaction); another
    session's differs."""
    rows = conn.execute(
        sql.SQL(
            "SELECT k.failure FROM unnest(%s::bigint[], %s::bigint[]) AS k(failure, item)"
            " JOIN {} AS t ON t.id = k.item JOIN failed_operations AS f ON f.id = k.failure"
            " WHERE t.xmin = f.xmin"
        ).format(sql.Identifier(queue.value)),
        (list(items), list(items.values())),
    ).fetchall()
    return {int(row[0]) for row in rows}


# The stored payload is copied inside PostgreSQL: exact, at any depth (a round trip through
# Python's json stops at its recursion limit, and rounds numbers). A volatile call in the select
# list runs after the ORDER BY: the new items' ids follow the failures' order.
_FAILURES_UNDER_KEYS = """
    FROM unnest(%(ids)s::bigint[], %(keys)s::text[]) WITH ORDINALITY AS k(id, key, n)
    JOIN failed_operations AS f ON f.id = k.id ORDER BY k.n"""
_REPLAY = {
    Queue.TRIAGE: """SELECT k.id, sokratos_enqueue_triage(
                         f.context_data -> 'payload', k.key,
                         coalesce(nullif(f.context_data ->> 'source', ''), 'conversation'))"""
    + _FAILURES_UNDER_KEYS,
    Queue.DISTILLATION: """SELECT k.id, sokratos_enqueue_distillation(
                               f.context_data -> 'payload', k.key)"""
    + _FAILURES_UNDER_KEYS,
}


_REPLAY_QUEUES = tuple(q.value for q in Queue)
EMAIL_OP_TYPE = "email_message"  # email/failed.py's records (it imports this module)


def _spool_file_hint(failure_id: int, kept_as: str | None, too_large: bool = False) -> str:
    """What to do with a spool file the import refused: it is not replayed as it stands."""
    if kept_as and too_large:
        return (
            f"refused: the spool file is too large for the database to store in one value and"
            f" is kept whole as {kept_as}: split what it holds into smaller items and enqueue"
            " them with 'sokratos-worker enqueue'"
        )
    if kept_as:
        return (
            f"refused: the spool file could not be read and is kept as {kept_as}; make it"
            " readable by the worker's user and rename it to end in .json: the next import"
            " takes it"
        )
    return (
        "refused: a spool file the import refused is not replayed as it stands; its content"
        f" is in 'sokratos-worker failed show {failure_id}': repair it and enqueue it with"
        " 'sokratos-worker enqueue'"
    )


# Whether a failure's own item (source_queue, item_id) is still in its queue, for a failure
# row ``f`` of ``queue``: restored from a backup, or written by hand, while that item waits or
# runs. Its replay would run the work twice. The queue row must be that item, not one that
# took its id (a failure copied from another database): the same key, or with no key the same
# payload. One primary-key lookup per failure, and one statement per queue: a statement that
# names a queue table waits for that table's locks (a migration of the other queue's table
# must not hold up the replay of this one's failures).
def _still_queued(queue: Queue) -> sql.Composed:
    return sql.SQL(
        "f.source_queue = {name} AND EXISTS (SELECT 1 FROM {table} AS q WHERE q.id = f.item_id"
        " AND (q.idempotency_key = f.idempotency_key OR (f.idempotency_key IS NULL"
        " AND q.payload = f.context_data -> 'payload')))"
    ).format(name=sql.Literal(queue.value), table=sql.Identifier(queue.value))


def _still_queued_ids(conn: psycopg.Connection, rows: list[tuple[int, Any]]) -> set[int]:
    """Of the failures ``rows`` (id, source_queue), those whose own item is still queued,
    asking only the queues they name."""
    found: set[int] = set()
    for queue in Queue:
        ids = [failure_id for failure_id, source in rows if source == queue.value]
        if ids:
            found.update(
                int(r[0])
                for r in conn.execute(
                    sql.SQL(
                        "SELECT f.id FROM failed_operations AS f WHERE f.id = ANY(%(ids)s)"
                        " AND {still_queued}"
                    ).format(still_queued=_still_queued(queue)),
                    {"ids": ids},
                ).fetchall()
            )
    return found


# Replaying a payload the worker found invalid fails the same way: `--all` leaves them out.
_INVALID_PAYLOAD = INVALID_PAYLOAD_PREFIX + "%"


# The failures ``--all`` offers a replay (those whose item is still queued among them).
_OFFERED = """FROM failed_operations AS f
           WHERE retried_at IS NULL AND source_queue IS NOT NULL
             AND error_message NOT LIKE %(invalid)s
             AND (%(op)s::text IS NULL OR op_type = %(op)s)"""


def retryable_ids(conn: psycopg.Connection, *, op_type: str | None) -> list[int]:
    """Failures with a stored, valid payload that were not retried yet, and whose item is
    not still queued (see still_queued_count)."""
    offered = _offered(conn, op_type)
    queued = _still_queued_ids(conn, offered)
    return [failure_id for failure_id, _ in offered if failure_id not in queued]


def still_queued_count(conn: psycopg.Connection, *, op_type: str | None) -> int:
    """Failures ``--all`` leaves out because their own item is still queued (it runs by
    itself: a replay would run it twice)."""
    return len(_still_queued_ids(conn, _offered(conn, op_type)))


def _offered(conn: psycopg.Connection, op_type: str | None) -> list[tuple[int, Any]]:
    """The failures ``--all`` offers a replay (id, source_queue), in id order."""
    rows = conn.execute(
        "SELECT id, source_queue " + _OFFERED + " ORDER BY id",
        {"op": op_type, "invalid": _INVALID_PAYLOAD},
    ).fetchall()
    return [(int(r[0]), r[1]) for r in rows]


def invalid_payload_count(conn: psycopg.Connection, *, op_type: str | None) -> int:
    """Failures not retried yet whose payload itself was invalid (left out of ``--all``)."""
    row = conn.execute(
        """SELECT count(*) FROM failed_operations
           WHERE retried_at IS NULL AND source_queue IS NOT NULL
             AND error_message LIKE %(invalid)s
             AND (%(op)s::text IS NULL OR op_type = %(op)s)""",
        {"op": op_type, "invalid": _INVALID_PAYLOAD},
    ).fetchone()
    return int(row[0]) if row else 0


def op_types(conn: psycopg.Connection) -> list[str]:
    """The op_types failed_operations holds, to name them when a filter matched none."""
    rows = conn.execute("SELECT DISTINCT op_type FROM failed_operations ORDER BY 1").fetchall()
    return [str(r[0]) for r in rows]


def not_replayable_counts(conn: psycopg.Connection, *, op_type: str | None) -> dict[str, int]:
    """Failures not retried yet that hold no queue payload (left out of ``--all``), by op_type:
    spool files the import refused, mail that could not be read, rows Sokratos wrote."""
    rows = conn.execute(
        """SELECT op_type, count(*) FROM failed_operations
           WHERE retried_at IS NULL AND source_queue IS NULL
             AND (%(op)s::text IS NULL OR op_type = %(op)s)
           GROUP BY op_type ORDER BY op_type""",
        {"op": op_type},
    ).fetchall()
    return {str(r[0]): int(r[1]) for r in rows}


# Rows a purge deletes per statement: on an autocommit connection each batch is committed
# on its own, so a role's statement_timeout and the sessions waiting on the table see short
# statements, and a purge cut short keeps what it deleted (run it again for the rest).
PURGE_BATCH = 1000


def purge_failures(conn: psycopg.Connection, *, older_than_days: int) -> int:
    """Delete failures older than the given age, PURGE_BATCH rows a statement; how many."""
    deleted = 0
    while True:
        cur = conn.execute(
            """DELETE FROM failed_operations WHERE id IN (
                   SELECT id FROM failed_operations
                   WHERE created_at < now() - make_interval(days => %s) LIMIT %s)""",
            (older_than_days, PURGE_BATCH),
        )
        deleted += cur.rowcount
        if cur.rowcount < PURGE_BATCH:
            return deleted


def recent_failures(
    conn: psycopg.Connection, *, hours: int = 6, limit: int = 5
) -> list[dict[str, Any]]:
    """Failures grouped by op_type (Sokratos's heartbeat view): count, latest error, time."""
    with conn.cursor(row_factory=dict_row) as cur:
        times.shown_as_written(cur)
        cur.execute(
            """SELECT op_type, count(*) AS count,
                      (array_agg(left(error_message, 120) ORDER BY created_at DESC))[1]
                          AS last_error,
                      max(created_at) AS last_at
               FROM failed_operations
               WHERE created_at > now() - make_interval(hours => %s)
                 AND created_at <= now()  -- 'infinity' (a row Sokratos wrote) is not recent
               GROUP BY op_type ORDER BY max(created_at) DESC LIMIT %s""",
            (hours, limit),
        )
        return list(cur.fetchall())
