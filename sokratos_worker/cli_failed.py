"""The ``failed`` commands: list, show, retry and purge the dead letters (failed_operations).

Each action opens the database once, without waiting for it (an operator at a terminal is
told at once that it is away), and gives up on a table another session keeps locked, naming
that session; a server that ends the session or takes no writes ends it with exit 75 too.
This module also formats what they print: the one-line listing, a failure as indented JSON
with every number as stored, and one line per retried failure, control characters escaped.
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
from sokratos_worker.errors import DatabaseUnavailable, TableLocked
from sokratos_worker.exit_codes import EXIT_FAILURE, EXIT_OK

if TYPE_CHECKING:
    from sokratos_worker.store.failures import RetryResult


def failed(args: argparse.Namespace, settings: Settings) -> int:
    from sokratos_worker.store.connection import connect, translated  # noqa: PLC0415
    from sokratos_worker.store.locks import lock_waits_given_up  # noqa: PLC0415

    problem = _retry_usage_problem(args) if args.action == "retry" else None
    if problem:
        print(f"sokratos-worker failed retry: error: {problem}", file=sys.stderr)
        return EXIT_FAILURE
    # An operator at a terminal: say at once that the database is away (exit 75), no waiting,
    # and after a few seconds who holds a table the command waits for. A server that ends the
    # session midway (a restart, pg_terminate_backend) is the same outage: one line, exit 75.
    with (
        translated(),
        database_url(settings, wait=False) as url,
        connect(url) as conn,
        lock_waits_given_up(conn, f"failed {args.action}"),
    ):
        if args.action in ("retry", "purge"):
            _writable(conn)
        return _act(args, conn)


def _writable(conn: Any) -> None:
    """Raise DatabaseUnavailable on a server that takes no writes (a standby), before a retry
    or purge has printed or done anything: list and show still work there."""
    from sokratos_worker.store.connection import READ_ONLY_SERVER, is_read_only  # noqa: PLC0415

    if is_read_only(conn):
        raise DatabaseUnavailable(f"database unavailable: {READ_ONLY_SERVER}")


def _act(args: argparse.Namespace, conn: Any) -> int:
    """The action itself, on the command's one connection."""
    from sokratos_worker.store import failures  # noqa: PLC0415

    if args.action == "list":
        return _list(args, conn)
    if args.action == "show":
        found = failures.get_failure(conn, args.id)
        if found is None:
            print(f"sokratos-worker: no failure with id {args.id}", file=sys.stderr)
            return EXIT_FAILURE
        # json escapes C0 controls, but prints DEL, C1 and bidi controls as they are.
        print(terminal_safe(_failure_document(found), in_json=True))
        return EXIT_OK
    if args.action == "retry":
        return _retry_failures(args, conn)
    deleted = failures.purge_failures(conn, older_than_days=args.older_than)
    days = "1 day" if args.older_than == 1 else f"{args.older_than} days"
    print(f"deleted {deleted} failures older than {days}")
    return EXIT_OK


def _list(args: argparse.Namespace, conn: Any) -> int:
    from sokratos_worker.store import failures  # noqa: PLC0415

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
        print(json.dumps(row, default=str) if args.json else _listed_line(row))
    if not listed and not args.json:
        print(_no_failures(conn, args.op_type))
    return EXIT_OK


def _listed_line(row: dict[str, Any]) -> str:
    """One failure on one line: id, time, op_type, the error's start and its replay."""
    from sokratos_worker.store.failures import replayed_item  # noqa: PLC0415

    retried = ""
    if row["retried_at"]:
        retried = f" retried as {replayed_item(row['source_queue'], row['retried_as'])}"
    # One line each: server errors carry "\nDETAIL: ..." and tabs.
    error = " ".join(row["error_message"].split())[:90]
    # The host's time and zone, as the journal shows it (the session's TimeZone is the
    # server's, and printed without a zone it misled).
    when = row["created_at"]
    if isinstance(when, datetime):  # (else the server's text: 'infinity')
        when = _host_time(when)
    op_type = terminal_safe(row["op_type"])
    return f"{row['id']:>6}  {when}  {op_type:<20} {terminal_safe(error)}{retried}"


def _host_time(when: datetime) -> str:
    """``when`` in the host's zone, or as the server gave it when no datetime holds it there
    (Go's zero time west of UTC is year 0, the last hours of 9999 east of it year 10000)."""
    try:
        local = when.astimezone()
        return f"{local.year:04d}-{local:%m-%d %H:%M %Z}"  # (glibc's %Y leaves 1 as "1")
    except OverflowError:
        return when.isoformat(" ", "minutes")


# What reaches a terminal raw only to act on it: C0 and C1 controls (ESC starts a sequence
# that can rewrite the screen or the window title; C1's CSI does on some) and the bidi
# controls that reorder what follows them on the line (U+202E shows the rest backwards).
_C1_AND_DEL = range(0x7F, 0xA0)
_BIDI_CONTROLS = (0x061C, 0x200E, 0x200F, 0x2028, 0x2029, *range(0x202A, 0x202F))
_BIDI_ISOLATES = range(0x2066, 0x206A)
_IN_JSON = {code: f"\\u{code:04x}" for code in (*_C1_AND_DEL, *_BIDI_CONTROLS, *_BIDI_ISOLATES)}
_IN_TEXT = {**_IN_JSON, **{code: f"\\x{code:02x}" for code in (*range(0x20), *_C1_AND_DEL)}}


def terminal_safe(text: str, *, in_json: bool = False) -> str:
    """``text`` with every control character written out as its escape (``\\x1b``,
    ``\\u202e``): a failure's op_type or error (written by a producer, a server, a mail) is
    shown, never obeyed, by the terminal. ``in_json``: a JSON document, whose strings json
    already escapes C0 in (its own newlines are left), and the rest as ``\\u``, which
    keeps it valid: these occur only inside its strings."""
    return text.translate(_IN_JSON if in_json else _IN_TEXT)


def _no_failures(conn: Any, op_type: str | None) -> str:
    """``failed list`` found nothing: with --op-type, say which op_types there are (a typo)."""
    from sokratos_worker.store.failures import op_types  # noqa: PLC0415

    if op_type is None:
        return "no failures"
    known = op_types(conn)
    listed = ", ".join(map(terminal_safe, known))
    held = f"op_types with failures: {listed}" if known else "no failures at all"
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
        queued = failures.still_queued_count(conn, op_type=args.op_type)
        if queued:
            closed_stdout.print_on(
                f"skipped {queued} failures whose own item is still queued: it runs by itself"
                " (a replay would run it twice); if it fails again, retry it then"
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
            # A refusal can quote the stored failure (its source): shown, never obeyed.
            closed_stdout.print_on(f"{result.failure_id}: {terminal_safe(result.message)}")
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
