"""Loaded by the daemon subprocess under libfaketime only (see tests/support/faketime.py).

libfaketime 0.9.10 breaks CPython 3.11's time.sleep (clock_nanosleep with TIMER_ABSTIME on
CLOCK_MONOTONIC fails with EINVAL). Sleep on a monotonic wait instead: same semantics, and
untouched by the faked wall clock (as time.sleep itself is on a real host)."""

import threading
import time

_never = threading.Event()


def _sleep(seconds: float) -> None:
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    _never.wait(seconds)


time.sleep = _sleep
