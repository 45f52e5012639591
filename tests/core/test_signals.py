"""The stop-signal handler records and returns: it may run while the main thread holds the
log's lock, and a handler that logged there waited on that lock forever (a second SIGTERM
mid-log hung the daemon; tests/core/test_daemon_subprocess.py has the end-to-end run)."""

from __future__ import annotations

import signal
import sys

import pytest
import structlog

from sokratos_worker.service.stop_requests import STOP_SIGNALS, StopRequests


@pytest.mark.timeout(10)
def test_a_signal_landing_inside_a_log_write_is_recorded_without_taking_a_lock() -> None:
    stops = StopRequests()
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    try:
        stops.install()
        stderr_lock = structlog._output._get_lock_for_file(sys.stderr)
        with stderr_lock:  # a log line is being written when the signal lands
            signal.raise_signal(signal.SIGHUP)
        assert stops.signal_name == "SIGHUP"
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
