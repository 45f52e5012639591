"""The ``failed`` commands: list, show, retry and purge the dead letters (failed_operations).

Each action opens the database once, without waiting for it (an operator at a terminal is
told at once that it is away), and gives up on a table another session keeps locked, naming
that session. This module also formats what they print: the one-line listing, a failure as
indented JSON with every number as stored, and one line per retried failure.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from sokratos_worker import closed_stdout, jsontext
from sokratos_worker.command_database import database_url
from sokratos_worker.config import Settings
from sokratos_worker.errors import TableLocked
from sokratos_worker.exit_codes import EXIT_FAILURE, EXIT_OK

if TYPE_CHECKING:
    from sokratos_worker.store.failures import RetryResult


def failed(args: argparse.Namespace, settings: Settings) -> int:
    from sokratos_worker.store import failures  # noqa: PLC0415
    from sokratos_worker.store.connection import connect  # noqa: PLC0415
    from sokratos_worker.store.locks import lock_waits_given_up  # noqa: PLC0415

    problem = _retry_usage_problem(args) if args.action == "retry" else None
    if problem:
        print(f"sokratos-worker failed retry: error: {problem}", file=sys.stderr)
        return EXIT_FAILURE
    # An operator at a terminal: say at once that the database is away (exit 75), no waiting,
    # and after a few seconds who holds a table the command waits for.
    with (
        database_url(settings, wait=False) as url,
        connect(url) as conn,
        lock_waits_given_up(conn, f"failed {args.action}"),
    ):
        if args.action == "list":
            listed = 0
            # One row past the limit tells whether the list is whole.
            for row in failures.list_failures(conn, op_type=args.op_type, limit=args.limit + 1):
                if listed == args.limit:
                    print(
                        f"sokratos-worker: more failures than the {args.limit} listed (the"
                        " newest first): --limit lists more",
                        file=sys.stderr,
                    )
                    break
                listed += 1
                if args.json:
                    print(json.dumps(row, default=str))
                else:
                    retried = f" retried as {row['retried_as']}" if row["retried_at"] else ""
                    # One line each: server errors carry "\nDETAIL: ..." and tabs.
                    error = " ".join(row["error_message"].split())[:90]
                    # The host's time and zone, as the journal shows it (the session's
                    # TimeZone is the server's, and printed without a zone it misled).
                    when = row["created_at"]
                    if isinstance(when, datetime):  # (else the server's text: 'infinity')
                        when = f"{when.astimezone():%Y-%m-%d %H:%M %Z}"
                    print(f"{row['id']:>6}  {when}  {row['op_type']:<20} {error}{retried}")
            if not listed and not args.json:
                print(_no_failures(conn, args.op_type))
            return EXIT_OK
        if args.action == "show":
            found = failures.get_failure(conn, args.id)
            if found is None:
                print(f"sokratos-worker: no failure with id {args.id}", file=sys.stderr)
                return EXIT_FAILURE
            print(_failure_document(found))
            return EXIT_OK
        if args.action == "retry":
            return _retry_failures(args, conn)
        deleted = failures.purge_failures(conn, older_than_days=args.older_than)
        days = "1 day" if args.older_than == 1 else f"{args.older_than} days"
        print(f"deleted {deleted} failures older than {days}")
        return EXIT_OK


def _no_failures(conn: Any, op_type: str | None) -> str:
    """``failed list`` found nothing: with --op-type, say which op_types there are (a typo)."""
    from sokratos_worker.store.failures import op_types  # noqa: PLC0415

    if op_type is None:
        return "no failures"
    known = op_types(conn)
    held = f"op_types with failures: {', '.join(known)}" if known else "no failures at all"
    return f"no failures of op_type {op_type!r} ({held})"


def _unknown_op_type(conn: Any, op_type: str | None) -> str:
    """For ``retry --all --op-type``: ": " and the op_types there are, when ``op_type`` has no
    failures at all (a typo), else ""."""
    from sokratos_worker.store.failures import op_types  # noqa: PLC0415

    if op_type is None or op_type in op_types(conn):
        return ""
    return f": {_no_failures(conn, op_type)}"


def _failure_document(found: dict[str, Any]) -> str:
    """The failure as indented JSON, every number as stored. A context_data Python's json
    cannot follow (nested too deeply, or a number too long) is printed as stored, on one line,
    and stderr says so."""
    context: str | None = found["context_data"]
    stored: dict[str, str] = {}  # a placeholder's JSON text -> the number as stored

    def number(text: str) -> Any:
        """A float that prints back as the same number, else a placeholder for its text: a
        float would print 0.1000000000000000055511151231257827 as 0.1 and 1e-400 as 0.0."""
        value = float(text)
        if Decimal(repr(value)) == Decimal(text):
            return value
        placeholder = f"\0{len(stored)}"  # no jsonb or text value holds a NUL
        stored[json.dumps(placeholder)] = text
        return placeholder

    try:
        parsed = None if context is None else jsontext.loads(context, parse_float=number)
        document = json.dumps(
            {**found, "context_data": parsed}, default=str, indent=2, ensure_ascii=False
        )
    except ValueError:  # too deep, or an integer over Python's 4300 digits
        pass
    else:
        for placeholder, text in stored.items():
            document = document.replace(placeholder, text, 1)
        return document
    assert context is not None  # noqa: S101 - None always parses
    print(
        f"sokratos-worker: failure {found['id']}: its context_data ({len(context.encode())}"
        " bytes) is nested too deeply, or holds a number too long, for Python's json to"
        " indent: printed on one line, as stored",
        file=sys.stderr,
    )
    outline = json.dumps({**found, "context_data": None}, default=str, indent=2, ensure_ascii=False)
    # Keys and strings are quoted and escaped: this is the top-level key and nothing else.
    return outline.replace('"context_data": null', f'"context_data": {context}', 1)


def _retry_failures(args: argparse.Namespace, conn: Any) -> int:
    from sokratos_worker.store import failures  # noqa: PLC0415

    # Every line goes through print_on: a reader gone (`| head -1`) must not leave the retry
    # half done (or not begun); it goes on unprinted.
    ids = failures.retryable_ids(conn, op_type=args.op_type) if args.all else args.ids
    if args.all:
        invalid = failures.invalid_payload_count(conn, op_type=args.op_type)
        if invalid:
            closed_stdout.print_on(
                f"skipped {invalid} failures whose payload itself was invalid (a replay fails"
                " the same way): fix the producer, or retry one by ID after an upgrade that"
                " accepts it"
            )
        other = failures.not_replayable_counts(conn, op_type=args.op_type)
        if other:
            kinds = ", ".join(f"{count} {kind}" for kind, count in other.items())
            closed_stdout.print_on(
                f"skipped {sum(other.values())} failures that are not queue items ({kinds}):"
                " retry one by ID to be told what to do with it"
            )
    if not ids:
        print(f"nothing to retry{_unknown_op_type(conn, args.op_type if args.all else None)}")
        return EXIT_OK
    code = EXIT_OK
    size = failures.RETRY_BATCH if args.all else 1  # IDs by hand: each on its own, as named
    for start in range(0, len(ids), size):
        for result in _retry_chunk(conn, ids, start, size):
            closed_stdout.print_on(f"{result.failure_id}: {result.message}")
            if result.item_id is None:
                code = EXIT_FAILURE
    return code


def _retry_chunk(conn: Any, ids: list[int], start: int, size: int) -> list[RetryResult]:
    """Retry ``ids[start:start + size]`` in one transaction. When the enqueue function refuses
    one of their payloads (or the key index one of their replay keys), nothing of it was
    written: each half goes again the same way, down to the refused one alone, which is
    reported, and the others are replayed."""
    from sokratos_worker.store import failures  # noqa: PLC0415

    chunk = ids[start : start + size]
    if len(chunk) == 1:
        with _lock_waits_given_up_naming(conn, ids, start):
            return [failures.retry_failure(conn, chunk[0])]
    try:
        with _lock_waits_given_up_naming(conn, ids, start):
            return failures.retry_batch(conn, chunk)
    except failures.UNREPLAYABLE:
        half = len(chunk) // 2
        return _retry_chunk(conn, ids, start, half) + _retry_chunk(
            conn, ids, start + half, len(chunk) - half
        )


@contextmanager
def _lock_waits_given_up_naming(conn: Any, ids: list[int], done: int) -> Iterator[None]:
    """Give up on a lock held for 5 s, naming ``ids[done]`` and those not retried after it."""
    from sokratos_worker.store.locks import lock_waits_given_up  # noqa: PLC0415

    try:
        with lock_waits_given_up(conn, f"failed retry {ids[done]}"):
            yield
    except TableLocked as exc:
        left = ", ".join(str(i) for i in ids[done : done + 10])
        more = f" and {len(ids) - done - 10} more" if len(ids) - done > 10 else ""
        raise TableLocked(f"{exc} (not retried: {left}{more})") from exc


def _retry_usage_problem(args: argparse.Namespace) -> str | None:
    """IDs and --all are alternatives; --op-type only narrows --all."""
    if args.op_type is not None and not args.all:
        return "--op-type only with --all"
    if args.ids and args.all:
        return "name failure IDs or --all, not both"
    if not args.ids and not args.all:
        return "name the failure IDs to retry (see 'sokratos-worker failed list'), or --all"
    return None
