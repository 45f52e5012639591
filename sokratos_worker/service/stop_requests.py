"""Who asked the daemon to stop, and so which exit code it ends with.

Two kinds of stop arrive from two places: the operator's signal (SIGTERM, SIGINT, SIGHUP),
recorded by a signal handler in the main thread, and the worker's own stop (the local model
server that keeps dying), requested from a watcher thread. Each side writes only its own
fields, with the moment it came, so the exit code is decided by which came first without a
check-then-write race between the threads: a stop the operator asked for exits 0 whatever
happens meanwhile.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, NoReturn

from sokratos_worker.exit_codes import EXIT_FAILURE, EXIT_OK
from sokratos_worker.logs import TIMESTAMPER
from sokratos_worker.store.embedded import release_held_at_exit_now

SECOND_SIGNAL_HINT = (
    "not waiting for the items in flight: they stay leased until SOKRATOS_LEASE runs out,"
    " then run again, and the attempt each was on counts"
)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# A second signal's last words (the "stopped" heartbeat) get this long before the exit.
LAST_WORDS_BUDGET_S = 2.0
# And the cleanups registered with cleaned_up_at_exit_now get this long in all.
CLEANUPS_BUDGET_S = 5.0

# What a process exiting at once must still undo (os._exit skips every finally), by name.
_exit_now_cleanups: dict[str, Callable[[], None]] = {}


@contextmanager
def cleaned_up_at_exit_now(name: str, cleanup: Callable[[], None]) -> Iterator[None]:
    """While inside, a second stop signal's exit runs ``cleanup`` before it exits, after the
    embedded PostgreSQL is released or given up on (the demo's temporary directory holds its
    data: a server left running stops itself once its lock file is gone)."""
    _exit_now_cleanups[name] = cleanup
    try:
        yield
    finally:
        if _exit_now_cleanups.get(name) is cleanup:  # (never a newer registration's)
            del _exit_now_cleanups[name]


class StopRequests:
    """The operator's stop signal and the worker's own stop request, kept apart."""

    def __init__(self) -> None:
        self.signal_name: str | None = None  # set by the handler, acted on by the main thread
        self.signal_logged = False  # (the main thread logs it once)
        self.internal_reason: str | None = None  # request()'s reason: the handler never reads it
        self._signal_at: float | None = None  # (monotonic)
        self._internal_at: float | None = None
        self._internal_code = EXIT_OK
        # Run by a second signal before the exit, bounded (the worker's "stopped" heartbeat);
        # returns a log event for a failure, None when done.
        self.last_words: Callable[[], dict[str, Any] | None] | None = None

    def install(self) -> None:
        """SIGTERM, SIGINT and SIGHUP ask for a stop; a second one exits at once.

        The handler only records the signal: it runs between two bytecodes of the main
        thread, which may hold the log's lock at that moment, and a handler that logged there
        deadlocked on a second signal. The main thread acts on it (Worker.notice_signal).
        """
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is not None:
            exit_now(name, last_words=self.last_words)
        self._signal_at = time.monotonic()
        self.signal_name = name

    def request(self, code: int, reason: str) -> None:
        """From any thread: the worker's own stop, to exit ``code`` unless the operator's
        signal came first. Only the first request counts; it is never a first signal, so the
        operator's first SIGTERM after it still lets items in flight finish."""
        if self.internal_reason is None:
            self._internal_code = code
            self._internal_at = time.monotonic()
            self.internal_reason = reason

    @property
    def requested(self) -> bool:
        """A stop signal arrived, or :meth:`request` asked for a stop."""
        return self.signal_name is not None or self.internal_reason is not None

    @property
    def exit_code(self) -> int:
        """0, or :meth:`request`'s code when no operator signal came first."""
        if self._internal_at is None:
            return EXIT_OK
        if self._signal_at is not None and self._signal_at <= self._internal_at:
            return EXIT_OK
        return self._internal_code


def exit_now(
    signal_name: str, *, last_words: Callable[[], dict[str, Any] | None] | None = None
) -> NoReturn:
    """The second stop signal: exit 1 without waiting for the items in flight, after
    ``last_words`` (the worker's "stopped" heartbeat, given LAST_WORDS_BUDGET_S) and after
    stopping the embedded PostgreSQL this process was the last to hold (a few seconds at
    most), which os._exit would leave running: it runs in a session of its own. Then the
    cleanups of :func:`cleaned_up_at_exit_now` run (CLEANUPS_BUDGET_S in all).

    Further stop signals are ignored meanwhile (a third Ctrl-C would leave it running).
    """
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    _write_line(
        {
            "event": "second_signal_exiting_now",
            "signal": signal_name,
            "level": "warning",
            "hint": SECOND_SIGNAL_HINT,
        }
    )
    if last_words is not None and (failed := _within_budget(last_words)) is not None:
        _write_line(failed)
    for event in release_held_at_exit_now():
        _write_line(event)
    for event in _run_cleanups():
        _write_line(event)
    os._exit(EXIT_FAILURE)


def _run_cleanups() -> list[dict[str, Any]]:
    """Run the registered cleanups in a thread for up to CLEANUPS_BUDGET_S; returns a log
    event for each that failed, and one naming those left unfinished."""
    pending = list(_exit_now_cleanups.items())
    if not pending:
        return []  # (no thread started from the signal handler for nothing)
    events: list[dict[str, Any]] = []
    done: list[str] = []

    def run() -> None:
        for name, cleanup in pending:
            try:
                cleanup()
            except Exception as exc:  # the process exits anyway: say so, never raise
                events.append(
                    {
                        "event": "exit_now_cleanup_failed",
                        "level": "warning",
                        "cleanup": name,
                        "error": repr(exc),
                    }
                )
            done.append(name)

    thread = threading.Thread(target=run, name="exit-now-cleanups", daemon=True)
    thread.start()
    thread.join(CLEANUPS_BUDGET_S)
    said = list(events)
    if unfinished := [name for name, _ in pending if name not in done]:
        said.append(
            {
                "event": "exit_now_cleanup_unfinished",
                "level": "warning",
                "cleanups": unfinished,
                "waited_s": CLEANUPS_BUDGET_S,
            }
        )
    return said


def _within_budget(last_words: Callable[[], dict[str, Any] | None]) -> dict[str, Any] | None:
    """Run ``last_words`` in a thread for up to LAST_WORDS_BUDGET_S: the code the signal
    interrupted may hold a lock it needs, and the exit must not wait on that for ever."""
    said: list[dict[str, Any] | None] = []

    def run() -> None:
        try:
            said.append(last_words())
        except Exception as exc:  # the process exits anyway: say so, never raise
            said.append({"event": "last_words_failed", "level": "warning", "error": repr(exc)})

    thread = threading.Thread(target=run, name="last-words", daemon=True)
    thread.start()
    thread.join(LAST_WORDS_BUDGET_S)
    if said:
        return said[0]
    return {
        "event": "last_words_unfinished",
        "level": "warning",
        "waited_s": LAST_WORDS_BUDGET_S,
        "hint": "the stopped heartbeat may not be written: status shows this worker stopping"
        " until its heartbeat goes stale",
    }


def _write_line(event: dict[str, Any]) -> None:
    """One JSON line straight to stderr, stamped as the logger stamps: the logger's lock may
    be held by the code the signal handler interrupted."""
    line = json.dumps(TIMESTAMPER(None, "", event), default=str) + "\n"
    os.write(2, line.encode())
