"""Producing work from Python: the same two calls as the SQL functions, plus the spool.

>>> from sokratos_worker.client import enqueue_triage
>>> enqueue_triage(conninfo, "user: I moved to Lisbon\\nassistant: Noted!", key="msg-42")

Where a conninfo goes, an open psycopg connection may go instead: the enqueue then runs in the
caller's transaction (committed or rolled back by the caller, never by the client), as the SQL
functions do, and nothing is spooled.
"""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import structlog

from sokratos_worker.errors import DatabaseUnavailable, InvalidPayload, TableLocked
from sokratos_worker.model import Queue
from sokratos_worker.spool import spool_enqueue, storable_payload
from sokratos_worker.store import queue as store
from sokratos_worker.store.connection import connect, translated
from sokratos_worker.store.locks import lock_waits_given_up

log = structlog.get_logger(__name__)

_SPOOLED_UNTIL_RELEASED = (
    "spooled instead: the worker imports it at a tick once the lock is released"
)


# A conninfo string, or the caller's open connection (the enqueue joins its transaction).
Target = str | psycopg.Connection[Any]


@dataclass(frozen=True)
class Enqueued:
    """An accepted enqueue: the item id, or the spool file when the database was down."""

    item_id: int | None = None
    spooled: Path | None = None


def triage_payload(
    exchange: str,
    *,
    tools_used: bool = False,
    pipeline_id: int | None = None,
    occurred_at: datetime | None = None,
) -> dict[str, Any]:
    """A conversation triage payload (contract §4)."""
    return {
        "exchange": exchange,
        "tools_used": tools_used,
        "pipeline_id": pipeline_id,
        "occurred_at": occurred_at.isoformat() if occurred_at else None,
    }


def enqueue(
    conninfo: Target,
    queue: Queue,
    payload: dict[str, Any],
    *,
    key: str | None = None,
    source: str | None = None,
    spool_dir: Path | None = None,
    spool_for: str | None = None,
    lock_timeout_ms: int | None = None,
) -> Enqueued:
    """Enqueue one item; with ``spool_dir``, an unreachable database spools it instead. The
    file names the database ``spool_for`` names (``Settings.database_identity``: then only a
    worker on it imports the file); without it, any worker reading ``spool_dir`` imports it
    (a conninfo spelled otherwise than the worker's own, ``localhost`` for ``127.0.0.1`` or a
    pooler's port, would leave the file to no worker).

    With ``lock_timeout_ms``, a queue table another session holds locked longer than that
    (a migration, a transaction left open) counts as unreachable too: spooled, or
    :class:`TableLocked` naming the session. Without it the enqueue waits for the lock.

    Given an open connection instead of a conninfo, the enqueue runs in the caller's
    transaction (the workers are woken at its commit); the client neither commits nor rolls
    back, and ``spool_dir`` / ``lock_timeout_ms`` are refused (the caller's transaction and
    session settings decide).

    Raises :class:`InvalidPayload` naming the field when the payload is malformed or ``key``
    is blank or holds what PostgreSQL cannot store (NUL, a lone surrogate), and psycopg's own
    errors for what the database refuses otherwise (missing migrations or privileges).
    """
    _refuse_bad_key(key)
    _refuse_long_key(key)
    _refuse_bad_source(queue, source)
    clean = storable_payload(payload)
    if isinstance(conninfo, psycopg.Connection):
        if spool_dir is not None or lock_timeout_ms is not None:
            raise TypeError(
                "spool_dir and lock_timeout_ms need a conninfo: on a connection of yours, your"
                " transaction decides (a failed enqueue is yours to retry or roll back)"
            )
        with translated():  # no commit, no rollback: the caller's transaction decides
            item_id = store.enqueue(conninfo, queue, clean, idempotency_key=key, source=source)
        return Enqueued(item_id=item_id)
    if key is None and spool_dir is not None:
        # A connection lost mid-call counts as unreachable and is spooled; the spooled copy
        # carries the key the database saw, so a COMMIT that did land is not enqueued twice.
        key = f"spool:{uuid.uuid4()}"
    try:
        with translated(), connect(conninfo, timeout=5.0) as conn:
            gives_up = (
                lock_waits_given_up(conn, f"enqueue into {queue.value}", lock_timeout_ms)
                if lock_timeout_ms is not None
                else contextlib.nullcontext()
            )
            with gives_up:
                item_id = store.enqueue(conn, queue, clean, idempotency_key=key, source=source)
            return Enqueued(item_id=item_id)
    except DatabaseUnavailable as exc:
        if spool_dir is None:
            raise
        if isinstance(exc, TableLocked):
            log.warning("enqueue_table_locked", reason=str(exc), hint=_SPOOLED_UNTIL_RELEASED)
        return spool(spool_dir, queue, clean, key=key, source=source, spool_for=spool_for)


def spool(
    spool_dir: Path,
    queue: Queue,
    payload: dict[str, Any],
    *,
    key: str | None = None,
    source: str | None = None,
    spool_for: str | None = None,
) -> Enqueued:
    """Write the enqueue to the spool, sanitized and checked as the database would check it.

    Without ``spool_for`` the file names no database and any worker reading ``spool_dir``
    imports it, as it imports the files earlier clients wrote without one."""
    _refuse_bad_key(key)
    _refuse_long_key(key)
    clean = storable_payload(payload)
    _validate_offline(queue, clean, source)
    return Enqueued(
        spooled=spool_enqueue(
            spool_dir, queue, clean, idempotency_key=key, source=source, database=spool_for
        )
    )


def _refuse_bad_key(key: str | None) -> None:
    """A blank key would be taken once for good: every later item with it silently dropped;
    a NUL or a lone surrogate cannot be stored in PostgreSQL's text (nor imported if spooled)."""
    if key is None:
        return
    if not key.strip():
        raise InvalidPayload("key", "is blank: pass the item's idempotency key, or None")
    if "\x00" in key:
        raise InvalidPayload("key", "contains a NUL character, which PostgreSQL cannot store")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidPayload(
            "key",
            f"contains a lone surrogate ({key[exc.start]!r} at {exc.start}), which is not"
            " valid UTF-8: decode the key's bytes strictly",
        ) from exc


# The longest key the client takes, in UTF-8 bytes: the key's unique index takes a row of at
# most 2,704 bytes (a third of a page); a longer key would be refused at a spool's import, long
# after the producer could shorten it, so it is refused on every path alike.
MAX_KEY_BYTES = 2000
LONG_KEY_ADVICE = "use a shorter key (a hash of it, e.g. its SHA-256 in hex)"


def _refuse_long_key(key: str | None) -> None:
    """A key the database's index may refuse is refused before any attempt, whether the
    database is up or not: refused only while it was down, an enqueue it would have taken was
    dropped as bad input."""
    if key is not None and (size := len(key.encode("utf-8"))) > MAX_KEY_BYTES:
        raise InvalidPayload(
            "key",
            f"is {size:,} bytes; the database's index on it takes about 2,700 at most, and this"
            f" client at most {MAX_KEY_BYTES:,}: {LONG_KEY_ADVICE}",
        )


def _refuse_bad_source(queue: Queue, source: str | None) -> None:
    """A triage item's source is conversation or email; anything else (a NUL in it too, which
    psycopg would refuse with a bare DataError) is named before the database sees it."""
    if queue is Queue.TRIAGE and source not in (None, "conversation", "email"):
        raise InvalidPayload("source", f"must be conversation or email, not {source!r}")


def _validate_offline(queue: Queue, payload: dict[str, Any], source: str | None) -> None:
    """The same checks as sokratos_check_payload (sql/0049), in its order and words, so the
    spool never holds what the import would turn into a failure."""
    _refuse_bad_source(queue, source)
    _refuse_too_large(payload)
    if queue is Queue.TRIAGE:
        field = "text" if source == "email" else "exchange"
        if not isinstance(payload.get(field), str):
            raise InvalidPayload(f"payload.{field}", "is required and must be a string")
    elif payload.get("messages") is not None and payload.get("archive_text") is not None:
        # A field sent as null counts as absent, as in the SQL function and the worker.
        raise InvalidPayload(
            "payload.messages", "and payload.archive_text are alternatives: send one of them"
        )
    elif not isinstance(payload.get("messages"), list) and not isinstance(
        payload.get("archive_text"), str
    ):
        raise InvalidPayload(
            "payload.messages", "(an array) or payload.archive_text (a string) is required"
        )
    try:
        _fields_as_the_worker_reads_them(queue, payload, source)
    except InvalidPayload as exc:
        raise InvalidPayload(f"payload.{exc.field}", exc.problem) from exc


# PostgreSQL's jsonb holds at most 2^28 - 1 bytes of data in one value (a string, or an
# object with all it holds): a payload with more text than that is refused (54000).
JSONB_MAX_BYTES = 0x0FFFFFFF


def _refuse_too_large(payload: dict[str, Any]) -> None:
    """A payload the database is certain to refuse for its size is refused before it is
    spooled: the import could only set the file aside as refused."""
    size = _text_bytes(payload)
    if size > JSONB_MAX_BYTES:
        raise InvalidPayload(
            "payload",
            f"holds {size:,} bytes of text; PostgreSQL stores at most {JSONB_MAX_BYTES:,} in"
            " one jsonb value and would refuse it (54000): split it into several items",
        )


def _text_bytes(value: Any) -> int:
    """The UTF-8 bytes of every string (keys too) in a JSON value: less than its jsonb size."""
    total, pending = 0, [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            total += len(item.encode("utf-8", "surrogatepass"))
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return total


def _fields_as_the_worker_reads_them(
    queue: Queue, payload: dict[str, Any], source: str | None
) -> None:
    """The fields past the top level, read by the pipelines' own checks as sql/0049 reads
    them: a trivial exchange is skipped unread, an archive's size is left to the claim (sql/0050:
    dead-lettered there, its payload kept). Imported on first use, as in :func:`_distillable`."""
    from sokratos_worker.pipelines import payload as fields  # noqa: PLC0415
    from sokratos_worker.pipelines.archive import format_messages  # noqa: PLC0415
    from sokratos_worker.pipelines.text import is_trivial  # noqa: PLC0415

    if queue is Queue.DISTILLATION:
        if payload.get("messages") is not None:
            format_messages(payload["messages"])
        fields.optional_int(payload, "pipeline_id")
        fields.optional_str(payload, "conversation_id")
    elif source == "email":
        for name in ("subject", "from", "message_id", "account"):
            fields.optional_str(payload, name)
    elif not is_trivial(payload["exchange"]):
        fields.optional_bool(payload, "tools_used")
        fields.optional_iso_datetime(payload, "occurred_at")
        fields.optional_int(payload, "pipeline_id")


def enqueue_triage(
    conninfo: Target,
    exchange: str,
    *,
    tools_used: bool = False,
    pipeline_id: int | None = None,
    occurred_at: datetime | None = None,
    key: str | None = None,
    spool_dir: Path | None = None,
    spool_for: str | None = None,
    lock_timeout_ms: int | None = None,
) -> Enqueued:
    """Enqueue a conversation exchange for triage (the arguments as for :func:`enqueue`),
    checked first as the worker checks it (:func:`check_triage`)."""
    payload = triage_payload(
        exchange, tools_used=tools_used, pipeline_id=pipeline_id, occurred_at=occurred_at
    )
    check_triage(payload)
    return enqueue(
        conninfo,
        Queue.TRIAGE,
        payload,
        key=key,
        spool_dir=spool_dir,
        spool_for=spool_for,
        lock_timeout_ms=lock_timeout_ms,
    )


def check_triage(payload: dict[str, Any]) -> None:
    """InvalidPayload now for the conversation fields the triage pipeline would refuse at its
    first claim (a dead letter), read by the pipeline's own field checks."""
    from sokratos_worker.pipelines import payload as fields  # noqa: PLC0415

    try:
        fields.required_str(payload, "exchange")
        fields.optional_bool(payload, "tools_used")
        fields.optional_int(payload, "pipeline_id")
        fields.optional_iso_datetime(payload, "occurred_at")
    except InvalidPayload as exc:
        raise InvalidPayload(f"payload.{exc.field}", exc.problem) from exc


def check_distillation(payload: Any) -> None:
    """InvalidPayload now for what the worker would dead-letter at its first claim, the field
    named as the database's own check names it (``payload.messages``): the CLI and
    :func:`enqueue_distillation` refuse it instead of queueing a certain failure.

    The payload is checked as it is stored (NUL and lone surrogates escaped: a NUL is six
    characters there); one that is not an object is refused as ``payload``."""
    stored = storable_payload(payload)
    try:
        _distillable(stored)
    except InvalidPayload as exc:
        raise InvalidPayload(f"payload.{exc.field}", exc.problem) from exc


def _distillable(payload: dict[str, Any]) -> None:
    """The worker's own checks, imported on first use: the pipelines package brings in the
    LLM clients (httpx), which importing the client for an enqueue should not load."""
    from sokratos_worker.pipelines import payload as fields  # noqa: PLC0415
    from sokratos_worker.pipelines.archive import archive_from_payload  # noqa: PLC0415
    from sokratos_worker.pipelines.distill import MAX_ARCHIVE_BYTES  # noqa: PLC0415
    from sokratos_worker.pipelines.text import byte_len  # noqa: PLC0415

    size = byte_len(archive_from_payload(payload, datetime.now(UTC)).text)
    if size > MAX_ARCHIVE_BYTES:
        name = "archive_text" if payload.get("archive_text") is not None else "messages"
        raise InvalidPayload(
            name,
            f"would make an archive of {size:,} bytes; at most {MAX_ARCHIVE_BYTES:,} are distilled:"
            " split the conversation into several items",
        )
    fields.optional_int(payload, "pipeline_id")
    fields.optional_str(payload, "conversation_id")


def enqueue_distillation(
    conninfo: Target,
    payload: dict[str, Any],
    *,
    key: str | None = None,
    spool_dir: Path | None = None,
    spool_for: str | None = None,
    lock_timeout_ms: int | None = None,
) -> Enqueued:
    """Enqueue an archived conversation (``messages`` or ``archive_text``) for distillation,
    checked first as the worker checks it (:func:`check_distillation`)."""
    check_distillation(payload)
    return enqueue(
        conninfo,
        Queue.DISTILLATION,
        payload,
        key=key,
        spool_dir=spool_dir,
        spool_for=spool_for,
        lock_timeout_ms=lock_timeout_ms,
    )
