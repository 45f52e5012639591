"""The database a command uses, and how stop signals end a command while it holds one.

:func:`database_url` yields SOKRATOS_DATABASE_URL when it is set (waiting for the server
first, unless told not to), or else the embedded PostgreSQL under SOKRATOS_DATA_DIR, attached
to or started for the length of the command and stopped again after; while either is held,
SIGTERM and SIGHUP end the command as Ctrl-C does. A stop signal during the embedded server's
start or release is held until that is done. :func:`stop_signals_end_the_command` does the
same for the whole of every other command, :func:`stops_while_starting` for the start of
``run`` and the demo.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import structlog

from sokratos_worker.config import Settings
from sokratos_worker.config_error import ConfigError
from sokratos_worker.errors import WorkerError

log = structlog.get_logger(__name__)


class EmbeddedUnavailable(WorkerError):
    """No SOKRATOS_DATABASE_URL and the embedded PostgreSQL could not be started."""


def unreachable_hint(settings: Settings) -> str:
    """What to look at when the database is away: the URL, or the embedded server when unset."""
    if settings.uses_embedded_postgres:
        return (
            f"Check the embedded PostgreSQL under {settings.data_dir / 'postgres'} (no"
            " database URL is set) and that SOKRATOS_DATA_DIR is writable."
        )
    from sokratos_worker.config_sources import given_as  # noqa: PLC0415

    # The variable the operator wrote (DATABASE_URL, a credential file), not its canonical name.
    variable = given_as("database_url") or "SOKRATOS_DATABASE_URL"
    return f"Check {variable} and that PostgreSQL is running."


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
            hint=unreachable_hint(settings),
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
        except ConfigError:
            raise  # (the operator's to fix: exit 78, not restarted for ever)
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


_STOPS_WHILE_STARTING = (signal.SIGTERM, signal.SIGHUP)


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextmanager
def stop_signals_end_the_command() -> Iterator[None]:
    """Inside, SIGTERM and SIGHUP raise KeyboardInterrupt as Ctrl-C does, for a whole command
    other than ``run`` and the demo: one reading stdin or probing a slow backend ended on the
    spot, silently (their default action), as one holding its database did before."""
    with _handling_in_main_thread(_STOPS_WHILE_STARTING, _interrupt):
        yield


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
