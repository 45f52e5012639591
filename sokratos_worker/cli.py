"""The ``sokratos-worker`` command: the parser, :func:`main` and errors mapped to exit codes.

The commands live in :mod:`.cli_commands`, :mod:`.cli_enqueue` and :mod:`.cli_failed`, the
database a command holds in :mod:`.command_database`; the names callers imported from here
are re-exported. Logs go to stderr; stdout carries only a command's own output. Exit codes
(:mod:`.exit_codes`): 0 success, 1 anything else, 75 database unreachable past
SOKRATOS_STARTUP_TIMEOUT (or, for ``run --once``, a drain cut short by an unreachable backend
or database, or by a queue table another session kept locked; for ``run``, a local model
server that kept dying), 78 bad configuration.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

import structlog

from sokratos_worker import cli_commands, cli_enqueue, cli_failed, closed_stdout
from sokratos_worker.command_database import (
    EmbeddedUnavailable,
    database_url,
    stop_signals_end_the_command,
    stops_while_starting,
    unreachable_hint,
)
from sokratos_worker.config import (
    ConfigError,
    Settings,
    ignored_database_url,
    ignored_secret_files,
    keys_replaced_by_url_credentials,
    load_settings,
    unknown_variables,
)
from sokratos_worker.errors import (
    ConnectionLimitReached,
    DatabaseUnavailable,
    TableLocked,
    WorkerError,
)
from sokratos_worker.exit_codes import EXIT_CONFIG, EXIT_FAILURE, EXIT_OK, EXIT_TEMPFAIL
from sokratos_worker.handlers import HandlerFactory
from sokratos_worker.logs import configure_logging

__all__ = [
    "ENQUEUE_OUTPUT",
    "EXIT_CONFIG",
    "EXIT_FAILURE",
    "EXIT_OK",
    "EXIT_TEMPFAIL",
    "EmbeddedUnavailable",
    "build_parser",
    "database_url",
    "main",
    "stops_while_starting",
]

log = structlog.get_logger(__name__)

ENQUEUE_OUTPUT = (
    "Prints the new item id (or the existing id for a known --key), or 'spooled PATH' when"
    " the database is unreachable or another session keeps the queue table locked for 5 s"
    " (a migration; the session is named on stderr): a worker imports it later. Exit 1 on"
    " invalid input, and when the database refuses the item (migrations not applied, a role"
    " without sokratos_producer): nothing is spooled then. Exit 75 when the database could"
    " not take it and the spool cannot be written: nothing was enqueued, try again later."
)

_EPILOG = """\
configuration: environment variables SOKRATOS_* (see deploy/sokratos-worker.env.example);
any variable X may be given as X_FILE or as a file X in $CREDENTIALS_DIRECTORY.
With SOKRATOS_DATABASE_URL unset, an embedded PostgreSQL runs under SOKRATOS_DATA_DIR.

exit codes: 0 ok, 1 error (usage errors too), 75 database unreachable or read-only
(run, migrate: past SOKRATOS_STARTUP_TIMEOUT; failed: at once, or a table locked by another
session for 5 s; enqueue: only when the spool cannot be written either; run --once: no
backend or database reachable, or a queue table locked by another session, items left;
run: SOKRATOS_METRICS_ADDR in use or not yet on this host, or the local model server kept
dying; a command whose transaction the server ended for a deadlock or refused for want of
a resource such as disk: run it again), 78 bad config. status exits 0 with the database
away (78 when the server refuses the login); check exits 1 naming what failed.
"""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error exits 1: the contract allows only 0, 1, 75 and 78."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_FAILURE, f"{self.prog}: error: {message}\n")


class _VersionAction(argparse.Action):
    """``--version``: the version and the build's code digest, read only when asked."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> NoReturn:
        from sokratos_worker.build import build_version  # noqa: PLC0415 - reads every module

        with contextlib.suppress(OSError):  # (a closed pipe: argparse's own action too)
            print(f"sokratos-worker {build_version()}")  # (drops it when stdout is closed)
        parser.exit()


def _from_one_to(highest: int) -> Callable[[str], int]:
    """A whole number from 1 (0 days would purge every failure; a limit of 0 lists none) to
    ``highest`` (beyond what PostgreSQL's interval or bigint holds, it failed with a
    traceback)."""

    def whole_number(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {value!r}") from None
        if not 1 <= number <= highest:
            raise argparse.ArgumentTypeError(f"must be from 1 to {highest}, not {number}")
        return number

    return whole_number


PURGE_DAYS_MAX = 36500  # a century, as SOKRATOS_FAILED_OPS_TTL_DAYS
LIST_LIMIT_MAX = 2**31 - 1


def build_parser() -> argparse.ArgumentParser:
    """Every command and option, with help text."""
    parser = _Parser(
        prog="sokratos-worker",
        description="Durable background pipelines for Sokratos: conversation and email triage,"
        " distillation of archived conversations, and email checks.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action=_VersionAction, help="print the version and exit")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    _add_run(commands)
    _add_migrate(commands)
    _add_enqueue(commands)
    _add_status(commands)
    _add_failed(commands)
    _add_check(commands)
    _add_demo(commands)
    return parser


def _utf8_text(value: str) -> str:
    """An argument that must be text: bytes that are not UTF-8 (a shell's $'\\xff') cannot
    be sent to PostgreSQL, and failed with a traceback."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(
            f"is not UTF-8 text: {value.encode('utf-8', 'surrogateescape')!r}"
        ) from None
    return value


def _add_run(commands: argparse._SubParsersAction[_Parser]) -> None:
    """``run [--once] [--no-migrate]``: the daemon."""
    run = commands.add_parser(
        "run",
        help="run the daemon in the foreground until SIGTERM/SIGINT/SIGHUP",
        description="Apply pending migrations (unless --no-migrate or"
        " SOKRATOS_MIGRATE_ON_START=false), then drain the queues: heartbeat ticks every"
        " SOKRATOS_HEARTBEAT_INTERVAL, instant wake-ups on new work (LISTEN/NOTIFY), email"
        " checks in a thread of their own (at start, then each account every"
        " SOKRATOS_EMAIL_CHECK_INTERVAL, each IMAP session within SOKRATOS_EMAIL_CHECK_DEADLINE)."
        " SIGTERM, SIGINT or SIGHUP (also during --once) stops claiming, cuts IMAP sessions in"
        " progress, lets items in flight finish within SOKRATOS_SHUTDOWN_GRACE, gives the rest"
        " back and exits 0;"
        " a second signal exits 1 at once (items in flight stay leased until SOKRATOS_LEASE"
        " runs out; the embedded PostgreSQL is stopped unless another process holds it)."
        " Configuration is read at start: restart to change it."
        " --once exits 75 when its drain was cut short (no LLM backend, embedding server or"
        " writable database reachable, or a queue table locked past the budget) and items were"
        " left waiting; with no LLM backend configured it drains nothing and exits 0.",
    )
    run.add_argument(
        "--once",
        action="store_true",
        help="one heartbeat tick then exit: spool import, due email checks, drain every"
        " item ready now, expired leases included (up to SOKRATOS_TICK_BUDGET)",
    )
    run.add_argument(
        "--no-migrate",
        action="store_true",
        help="do not apply migrations at start (same as SOKRATOS_MIGRATE_ON_START=false)",
    )


def _add_migrate(commands: argparse._SubParsersAction[_Parser]) -> None:
    """``migrate``: apply pending migrations."""
    commands.add_parser(
        "migrate",
        help="apply pending database migrations and exit",
        description="Apply the numbered SQL migrations that are not yet recorded, under an"
        " advisory lock (safe to run from several hosts at once). Warns (exit 0) of a"
        " migration recorded that only a newer sokratos-worker has, and of an applied one"
        " whose file changed since. Exit 0 when every migration is applied; 75 when the"
        " database stays unreachable or read-only past SOKRATOS_STARTUP_TIMEOUT (or a"
        " deadlock, full disk or connection limit ends a migration); 78 when it may"
        " not be migrated (no pgvector, a role that may not create tables) or a migration fails"
        " as it would at every try (named, rolled back whole); 1 for other errors.",
    )


def _add_enqueue(commands: argparse._SubParsersAction[_Parser]) -> None:
    """``enqueue triage|distillation``: add an item."""
    enqueue = commands.add_parser(
        "enqueue",
        help="add an item to a queue",
        description=ENQUEUE_OUTPUT,
    )
    kinds = enqueue.add_subparsers(dest="kind", metavar="KIND", required=True)
    triage = kinds.add_parser(
        "triage", help="a conversation exchange to score and save", description=ENQUEUE_OUTPUT
    )
    triage.add_argument(
        "--exchange",
        required=True,
        help="the exchange text ('[tool] result' lines, 'user: …',"
        " 'assistant: …'), UTF-8; '-' reads stdin",
    )
    triage.add_argument(
        "--tools-used",
        action="store_true",
        help="the reply was grounded in tool results (lower threshold)",
    )
    triage.add_argument("--key", help="idempotency key: the same key is enqueued once")
    distill = kinds.add_parser(
        "distillation",
        help="an archived conversation to distil",
        description=ENQUEUE_OUTPUT + " An archive over 512 kB is not distilled (split it).",
    )
    distill.add_argument(
        "--file",
        required=True,
        help='JSON payload (UTF-8): {"messages": [...]} or {"archive_text": ...}; \'-\''
        " reads stdin",
    )
    distill.add_argument("--key", help="idempotency key: the same key is enqueued once")


def _add_status(commands: argparse._SubParsersAction[_Parser]) -> None:
    """``status [--json]``: one report."""
    status = commands.add_parser(
        "status",
        help="queues, recent failures, live workers, email accounts",
        description="Per queue: ready, backing off (and the next retry: when, after how many"
        " attempts, its last error), leased (and by whom), oldest ready age;"
        " failures in the last 24 h by op_type; outcomes in the last 24 h by queue (saved,"
        " skipped, archived, failed); each live worker's state, backends and build (a 'builds' line"
        " when they differ);"
        " email accounts and their last check; enqueues waiting in the spool (and those meant"
        " for another database); migrations not applied. It exits 0 even when the database is"
        " unreachable (78 when the server refuses the login): read the 'database' field ('ok'"
        " or 'unreachable'; and 'read_only' when the server takes no writes, as a standby). With"
        " SOKRATOS_DATABASE_URL unset it attaches to the embedded PostgreSQL, or starts it"
        " for the length of the command.",
    )
    status.add_argument("--json", action="store_true", help="one JSON object on stdout")


def _add_failed(commands: argparse._SubParsersAction[_Parser]) -> None:
    """``failed list|show|retry|purge``: the dead letters."""
    failed = commands.add_parser(
        "failed",
        help="inspect and replay failed_operations",
        description="Inspect and replay the dead letters. A table another session keeps"
        " locked for 5 s (a migration, a transaction left open) ends the command with exit 75,"
        " naming that session and what was not done.",
    )
    actions = failed.add_subparsers(dest="action", metavar="ACTION", required=True)
    flist = actions.add_parser(
        "list",
        help="failures, newest first",
        description="List failures, newest first, one line each: id, time, op_type, the"
        " error's start and the item a retry created ('no failures' when there are none;"
        " with --op-type, the op_types that have some).",
    )
    flist.add_argument(
        "--op-type", type=_utf8_text, help="only this op_type (e.g. conversation_triage)"
    )
    flist.add_argument(
        "--limit",
        type=_from_one_to(LIST_LIMIT_MAX),
        default=50,
        help="at most this many, 1 or more (default 50)",
    )
    flist.add_argument("--json", action="store_true", help="JSON lines on stdout")
    fshow = actions.add_parser(
        "show",
        help="one failure with its full context_data",
        description="Print one failure with its full context_data (the stored payload and"
        " every attempt's error) as JSON. Exit 1 when no failure has that ID.",
    )
    fshow.add_argument("id", type=int, metavar="ID", help="the failure's id (first column of list)")
    fretry = actions.add_parser(
        "retry",
        help="re-enqueue the stored payload as a new item (once per failure)",
        description="Name failure IDs, or --all (optionally with --op-type); not both. One line"
        " per failure saying what was done; exit 1 when any could not be re-enqueued (the"
        " line says why and what to do).",
    )
    fretry.add_argument("ids", type=int, nargs="*", metavar="ID", help="failures to retry")
    fretry.add_argument(
        "--all",
        action="store_true",
        help="every failure not yet retried (instead of IDs), except payloads the worker"
        " found invalid, which a replay would fail the same way, and failures with no queue"
        " payload: spool files the import refused, mail that could not be read, rows Sokratos"
        " wrote (retry one by ID to learn what to do); and failures whose own item is still"
        " queued (it runs by itself)",
    )
    fretry.add_argument("--op-type", type=_utf8_text, help="with --all only: just this op_type")
    fpurge = actions.add_parser(
        "purge",
        help="delete failures older than DAYS",
        description="Delete every failure (retried or not) created more than DAYS days ago and"
        " print how many. SOKRATOS_FAILED_OPS_TTL_DAYS makes the worker do this hourly.",
    )
    fpurge.add_argument(
        "--older-than",
        type=_from_one_to(PURGE_DAYS_MAX),
        required=True,
        metavar="DAYS",
        help=f"delete failures created more than DAYS days ago (1 to {PURGE_DAYS_MAX})",
    )


def _add_check(commands: argparse._SubParsersAction[_Parser]) -> None:
    """``check``: configuration and every dependency, one line each."""
    commands.add_parser(
        "check",
        help="validate configuration and probe the database, backends and mail",
        description="One line per check, in the order to fix them: configuration, database"
        " (reachable, writable), pgvector, connections (max_connections and CONNECTION LIMITs"
        " against what one worker opens), sessions (one server session per connection: no"
        " transaction pooler in between), schema (migrations, role grants, embedding"
        " dimension), every LLM backend, the embedding model, every mailbox. Exit 1 naming"
        " what failed (78 when the server refuses the database login: every line is still"
        " printed).",
    )


def _add_demo(commands: argparse._SubParsersAction[_Parser]) -> None:
    """``demo``: everything locally with the bundled tiny model."""
    commands.add_parser(
        "demo",
        help="try everything locally with the bundled tiny model (needs the local extra)",
        description="Embedded PostgreSQL, the bundled SmolLM2 model, sample conversations, an"
        " email-like item and an archive with tool calls; runs until the queues are empty and"
        " prints the memories and outcomes it produced, all in a temporary directory removed"
        " at the end. Ctrl-C stops it after the items in flight and prints what was done"
        " (during its start, at once, with exit 0 and nothing printed).",
    )


def main(
    argv: Sequence[str] | None = None, *, handler_factory: HandlerFactory | None = None
) -> int:
    """Entry point; tests and benchmarks pass their own ``handler_factory``.

    A reader that closes stdout early (``status | head -1``) ends the command quietly, at
    the line that could not be written, as SIGPIPE ends other tools.
    """
    # Exit 0 then, as ``head`` users expect (the reader had all it wanted); the command's own
    # code when only its last, buffered lines were lost (a failed retry still exits 1).
    code = EXIT_OK
    try:
        try:
            code = _main(argv, handler_factory)
        except SystemExit:
            _flush_stdout()  # --help and --version exit with their text still buffered
            raise
        except KeyboardInterrupt as exc:
            # Ctrl-C, or SIGTERM/SIGHUP while the command held an embedded PostgreSQL (see
            # command_database): the server it started is stopped by now. Exit 1, never 0: the
            # command did not finish (a stopped ``migrate`` must not read as done).
            code = _stopped(exc)
        _flush_stdout()  # buffered output meets the closed pipe here, not at print()
    except BrokenPipeError:
        if not closed_stdout.reader_gone():
            raise  # a socket's (an LLM backend, a mailbox): a real failure, not the reader
        closed_stdout.discard_stdout()  # interpreter shutdown would flush into the pipe again
    return code


def _flush_stdout() -> None:
    """Flush stdout; Python sets it to None when fd 1 was closed (``migrate >&-``)."""
    if sys.stdout is not None:
        sys.stdout.flush()


def _stopped(exc: KeyboardInterrupt) -> int:
    """One line instead of a traceback for a command a stop signal ended; exit 1."""
    name = str(exc) or "SIGINT"  # Python's own Ctrl-C handler gives no name
    print(f"sokratos-worker: stopped by {name} before the command finished", file=sys.stderr)
    return EXIT_FAILURE


def _run_command(
    args: argparse.Namespace, settings: Settings, handler_factory: HandlerFactory | None
) -> int:
    """The command itself; SIGTERM and SIGHUP end any but ``run`` and the demo (which stop
    their own way, with a report) as Ctrl-C does."""
    if args.command == "run":
        return cli_commands.run(args, settings, handler_factory)
    command: Callable[[argparse.Namespace, Settings], int] = _COMMANDS[args.command]
    if args.command == "demo":
        return command(args, settings)
    with stop_signals_end_the_command():
        return command(args, settings)


def _main(argv: Sequence[str] | None, handler_factory: HandlerFactory | None) -> int:
    args = build_parser().parse_args(argv)
    try:
        # The demo's own embedded PostgreSQL ignores PG* (they are for the URL's server).
        settings = load_settings(libpq_environment=args.command != "demo")
    except ConfigError as exc:
        print(f"sokratos-worker: invalid configuration: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    configure_logging(
        _log_level(args.command, settings),
        settings.effective_log_format(),
        cache=True,
        settings=settings,
    )
    _warn_unknown_variables(args.command, settings)
    if ignored_database_url(settings):
        log.warning(
            "database_url_ignored",
            hint="DATABASE_URL names another database than SOKRATOS_DATABASE_URL, which is the"
            " one used: unset DATABASE_URL for sokratos-worker, or give both the same URL",
        )
    if replaced := keys_replaced_by_url_credentials(settings):
        log.warning(
            "api_key_not_sent",
            backends=replaced,
            hint="each backend's url holds user:password, which is sent as Basic authorization"
            " in place of its api_key (a request has one Authorization header): remove the"
            " credentials from the url, or the api_key",
        )
    if ignored := ignored_secret_files(settings):
        log.warning(
            "secret_file_ignored",
            ignored=ignored,
            hint="each is given beside the secret itself, which wins, so the file is never"
            " read: remove one of the two",
        )
    try:
        return _run_command(args, settings, handler_factory)
    except Exception as exc:
        code = _reported_exit_code(exc, settings)
        if code is None:
            raise
        return code


def _reported_exit_code(exc: Exception, settings: Settings) -> int | None:
    """Say on stderr what ``exc`` means for the operator and return the exit code; None for
    an error with no known meaning (its traceback is the report)."""
    if isinstance(exc, ConfigError):
        print(f"sokratos-worker: {exc.heading + ': ' if exc.heading else ''}{exc}", file=sys.stderr)
        return EXIT_CONFIG
    if isinstance(exc, TableLocked):
        print(f"sokratos-worker: {exc}", file=sys.stderr)
        return EXIT_TEMPFAIL
    from sokratos_worker.store.connection import READ_ONLY_SERVER  # noqa: PLC0415

    if isinstance(exc, DatabaseUnavailable):
        print(f"sokratos-worker: {_unavailable_message(exc, settings)}", file=sys.stderr)
        return EXIT_TEMPFAIL
    if getattr(exc, "sqlstate", None) == "25006":  # read_only_sql_transaction
        # A write a command did not translate, refused by a standby: the promised exit 75.
        print(f"sokratos-worker: database unavailable: {READ_ONLY_SERVER}", file=sys.stderr)
        return EXIT_TEMPFAIL
    if isinstance(exc, WorkerError):
        print(f"sokratos-worker: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    from psycopg.errors import QueryCanceled  # noqa: PLC0415 - --help stays quick

    refused = _missing_privilege(exc)
    if refused is not None:
        print(
            f"sokratos-worker: {refused}: the role in SOKRATOS_DATABASE_URL lacks a grant;"
            " give it sokratos_worker (sokratos_producer to enqueue only), see sql/roles.sql"
            " and docs/production.md",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    if isinstance(exc, QueryCanceled):
        # Not a role's statement_timeout (the worker's sessions turn it off): someone
        # cancelled the statement (pg_cancel_backend), or a server-side limit did.
        print(
            f"sokratos-worker: the database cancelled the command's statement"
            f" ({str(exc).strip()}): nothing it had not committed was changed; run it"
            " again, and if it recurs ask who cancels it (pg_cancel_backend, a pooler's"
            " query_timeout)",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    missing = _missing_schema(exc)
    if missing is None:
        return None  # (not ours to explain: the traceback says more)
    print(
        f"sokratos-worker: {missing}: this database lacks sokratos-worker's schema;"
        " run 'sokratos-worker migrate' first",
        file=sys.stderr,
    )
    return EXIT_FAILURE


# Transient errors the server answered with (SQLSTATE class): a try later may succeed (exit
# 75), but asking whether PostgreSQL runs would send the operator the wrong way.
_ANSWERED_TRANSIENTS = {
    "40": (
        "the database ended the command's transaction",
        "it conflicted with another session's; nothing it had not committed was changed:"
        " run it again",
    ),
    "53": (
        "the database is short of a resource",
        "free some (disk space, memory, connections: the server's log says which), then run"
        " it again",
    ),
}


def _unavailable_message(exc: DatabaseUnavailable, settings: Settings) -> str:
    """What a command that met a transient database error prints: the error, and where to
    look (the server when it answered, else the URL or the embedded server)."""
    from sokratos_worker.store.connection import READ_ONLY_SERVER  # noqa: PLC0415

    if READ_ONLY_SERVER in str(exc):
        return str(exc)  # a read-only server answers: where PostgreSQL runs is not the question
    if isinstance(exc, ConnectionLimitReached):  # (libpq gives these without a SQLSTATE)
        reason = str(exc).removeprefix("database unavailable: ")
        return (
            f"the database refuses new connections for a limit: {reason}; close some of the"
            " other connections, or raise the limit (the role's or database's CONNECTION"
            " LIMIT, max_connections), then run it again"
        )
    sqlstate = getattr(exc.__cause__, "sqlstate", None) or ""
    answered = _ANSWERED_TRANSIENTS.get(sqlstate[:2])
    if answered is None:
        return f"{exc}. {unreachable_hint(settings)}"
    what, hint = answered
    reason = str(exc).removeprefix("database unavailable: ")
    return f"{what}: {reason} (SQLSTATE {sqlstate}); {hint}"


def _log_level(command: str, settings: Settings) -> str:
    """The daemon, the demo and ``migrate`` (whose progress is the point) log at
    SOKRATOS_LOG_LEVEL (info); the other commands, unless it is set, only warnings and
    errors, so their answer is not buried under the embedded PostgreSQL's start and release
    lines."""
    if command in ("run", "demo", "migrate") or "log_level" in settings.model_fields_set:
        return settings.log_level
    return "warning"


def _missing_privilege(exc: Exception) -> str | None:
    """The server's message when ``exc`` says the role may not do what it asked."""
    from psycopg import errors  # noqa: PLC0415 - psycopg is imported lazily by the CLI

    if isinstance(exc, errors.InsufficientPrivilege):
        return (exc.diag.message_primary or str(exc)).splitlines()[0]
    return None


def _missing_schema(exc: Exception) -> str | None:
    """The server's message when ``exc`` says a table, column or function does not exist."""
    from psycopg import errors  # noqa: PLC0415 - psycopg is imported lazily by the CLI

    if isinstance(exc, errors.UndefinedTable | errors.UndefinedColumn | errors.UndefinedFunction):
        return (exc.diag.message_primary or str(exc)).splitlines()[0]
    return None


def _warn_unknown_variables(command: str, settings: Settings) -> None:
    """A typo'd SOKRATOS_* name is ignored silently by pydantic; say so on stderr.

    ``check`` reports it as a failed line and ``run`` logs it, so they are left out here.
    """
    unknown = unknown_variables(settings=settings)
    if unknown and command not in ("check", "run"):
        print(
            f"sokratos-worker: warning: unknown variables ignored: {', '.join(unknown)}"
            " (a typo? every variable is listed in deploy/sokratos-worker.env.example)",
            file=sys.stderr,
        )


_COMMANDS: dict[str, Callable[[argparse.Namespace, Settings], int]] = {
    "migrate": cli_commands.migrate,
    "enqueue": cli_enqueue.enqueue,
    "status": cli_commands.status,
    "failed": cli_failed.failed,
    "check": cli_commands.check,
    "demo": cli_commands.demo,
}  # (run is started by _run_command itself: it takes the handler factory)
