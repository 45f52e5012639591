"""The short commands: ``run``, ``migrate``, ``status``, ``check`` and ``demo``.

Each one takes the parsed arguments and the settings, hands the work over to the module that
does it (the daemon in ``app.py``, ``store/migrations.py``, ``status.py``, ``checks.py``,
``demo.py``), prints its answer on stdout and returns the exit code. Errors are left to
propagate: ``cli.py`` turns them into one line on stderr and an exit code.
"""

from __future__ import annotations

import argparse
import json
import sys

import structlog

from sokratos_worker.command_database import database_url, stops_while_starting
from sokratos_worker.config import Settings
from sokratos_worker.exit_codes import EXIT_FAILURE, EXIT_OK
from sokratos_worker.handlers import HandlerFactory

log = structlog.get_logger(__name__)


def run(args: argparse.Namespace, settings: Settings, factory: HandlerFactory | None) -> int:
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


def migrate(_: argparse.Namespace, settings: Settings) -> int:
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


def status(args: argparse.Namespace, settings: Settings) -> int:
    from sokratos_worker.status import collect_status, render_status  # noqa: PLC0415

    report = collect_status(settings)
    if args.json:
        print(json.dumps(report, default=str))
    else:
        print(render_status(report))
    return EXIT_OK


def check(_: argparse.Namespace, settings: Settings) -> int:
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


def demo(_: argparse.Namespace, settings: Settings) -> int:
    from sokratos_worker.demo import run_demo  # noqa: PLC0415

    return run_demo(settings)
