"""The ``enqueue`` command: read an item from the command line, enqueue it, or spool it.

The payload comes from ``--exchange`` or ``--file`` (``-`` reads stdin) and is checked as the
Python client checks it. The item goes to the database when one can be reached; when none
can (or another session keeps the queue table locked), it is written to the spool directory
for a worker to import later. A database that refuses the item is reported, and nothing is
spooled then; a spool that cannot be written either ends the command with exit 75.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sokratos_worker import jsontext
from sokratos_worker.command_database import EmbeddedUnavailable, database_url
from sokratos_worker.config import Settings
from sokratos_worker.errors import DatabaseUnavailable, InvalidPayload, WorkerError
from sokratos_worker.exit_codes import EXIT_OK
from sokratos_worker.model import Queue

if TYPE_CHECKING:
    import psycopg

    from sokratos_worker.client import Enqueued


def _utf8_input(option: str, value: str) -> str:
    """The text ``option`` gives: ``value`` itself, stdin for ``-``, or (``--file``) the file
    it names; InvalidPayload when the bytes are not UTF-8, wherever they come from. (Python
    decodes stdin by the locale, often escaping bad bytes as lone surrogates, and argv always
    so: an exchange in Latin-1 was stored as escapes, or raised, while a --file was refused.)"""
    if value == "-":
        raw = sys.stdin.buffer.read()
    elif option == "--file":
        try:
            raw = Path(value).read_bytes()
        except OSError as exc:
            raise WorkerError(f"cannot read {value}: {exc.strerror or exc}") from exc
    else:
        return _argv_utf8(option, value)
    # A byte order mark (Windows editors, PowerShell's redirection) is not part of the text.
    return _utf8(option, raw).removeprefix("\ufeff")


def _argv_utf8(option: str, value: str) -> str:
    """An argument's text as UTF-8, from argv's own bytes (undecodable ones restored)."""
    return _utf8(option, os.fsencode(value))


def _utf8(option: str, raw: bytes) -> str:
    """``raw`` decoded; InvalidPayload naming ``option`` and the first byte that is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidPayload(
            option,
            f"is not UTF-8 text: {exc.reason} at byte {exc.start + 1}"
            " (convert it first, e.g. iconv -f latin1 -t utf-8)",
        ) from exc


def enqueue(args: argparse.Namespace, settings: Settings) -> int:
    import psycopg  # noqa: PLC0415

    if args.key is not None and not args.key.strip():
        # An empty shell variable: as a key it would be accepted once, and every later
        # enqueue with it answered with the first item's id, its own text dropped.
        raise InvalidPayload(
            "--key", "is blank (an empty variable?): give the item's key, or leave --key out"
        )
    # Checked as its bytes: a Latin-1 key reached the client as a lone surrogate, refused
    # there with advice for Python callers.
    key = None if args.key is None else _argv_utf8("--key", args.key)
    queue, payload = _enqueue_input(args)
    try:
        result = _enqueue_or_spool(settings, queue, payload, key=key)
    except psycopg.Error as exc:
        raise WorkerError(_refused_enqueue(exc)) from exc
    except OSError as exc:
        # Only the spool is written here: the database was out of reach and so is the spool.
        # Exit 75, not 1: nothing is wrong with the input, and a later try may succeed.
        raise DatabaseUnavailable(_unspooled(exc, settings.spool_dir)) from exc
    print(result.item_id if result.item_id is not None else f"spooled {result.spooled}")
    return EXIT_OK


def _unspooled(exc: OSError, spool_dir: Path) -> str:
    """Why neither the database nor the spool took the item, and what to do."""
    where = exc.filename or spool_dir
    said = (
        "the database could not take it (unreachable, or its queue table locked) and the"
        f" spool cannot be written ({where}: {exc.strerror or exc}): nothing was enqueued"
    )
    if isinstance(exc, PermissionError):
        # Trying again as this user never works: the spool is the worker's (contract §4).
        return (
            f"{said}; the spool belongs to the worker's user: run 'sokratos-worker enqueue' as"
            " that user (docs/production.md), or, from another user or machine, enqueue with"
            " the SQL functions (sokratos_enqueue_triage, sokratos_enqueue_distillation)"
            " once the database answers"
        )
    return f"{said}, try again later"


def _enqueue_input(args: argparse.Namespace) -> tuple[Queue, dict[str, Any]]:
    """The queue and the payload the command line names; InvalidPayload when unusable."""
    from sokratos_worker import client  # noqa: PLC0415

    if args.kind == "triage":
        exchange = _utf8_input("--exchange", args.exchange)
        if not exchange.strip():
            raise InvalidPayload("--exchange", "is empty")
        return Queue.TRIAGE, client.triage_payload(exchange, tools_used=args.tools_used)
    text = _utf8_input("--file", args.file)
    try:
        payload = jsontext.loads(text)
    except jsontext.NestedTooDeeply as exc:
        raise InvalidPayload("--file", f"is {exc}") from exc
    except ValueError as exc:
        raise InvalidPayload("--file", f"is not valid JSON: {exc}") from exc
    if not isinstance(payload, dict):
        raise InvalidPayload("--file", "must hold a JSON object")
    client.check_distillation(payload)
    return Queue.DISTILLATION, payload


def _enqueue_or_spool(
    settings: Settings, queue: Queue, payload: dict[str, Any], *, key: str | None
) -> Enqueued:
    """Enqueue; spool only when no database can be reached or a queue table stays locked
    (never for a refusal)."""
    from sokratos_worker import client  # noqa: PLC0415
    from sokratos_worker.store.locks import COMMAND_LOCK_TIMEOUT_MS  # noqa: PLC0415

    try:
        with database_url(settings, wait=False) as url:
            return client.enqueue(
                url,
                queue,
                payload,
                key=key,
                spool_dir=settings.spool_dir,
                spool_for=settings.database_identity,
                lock_timeout_ms=COMMAND_LOCK_TIMEOUT_MS,
            )
    except EmbeddedUnavailable:
        # No server at all: spooled, sanitized and checked as client.enqueue spools.
        return client.spool(
            settings.spool_dir, queue, payload, key=key, spool_for=settings.database_identity
        )


def _refused_enqueue(exc: psycopg.Error) -> str:
    """One line: what the database refused and what to do about it."""
    from psycopg import errors  # noqa: PLC0415

    what = exc.diag.message_primary or str(exc).strip().splitlines()[0]
    if isinstance(exc, errors.UndefinedFunction | errors.UndefinedTable):
        return f"{what}: run 'sokratos-worker migrate' first"
    if isinstance(exc, errors.InsufficientPrivilege):
        return f"{what}: the role needs sokratos_producer (sql/roles.sql)"
    if isinstance(exc, errors.ProgramLimitExceeded) and what.startswith("index row"):
        from sokratos_worker.client import LONG_KEY_ADVICE  # noqa: PLC0415

        return (
            f"the database refused the enqueue's --key ({exc.sqlstate}): {what}: {LONG_KEY_ADVICE}"
        )
    return f"the database refused the enqueue ({exc.sqlstate}): {what}"
