"""service/background_writes.BackgroundWrites: the writer thread of a state report's
heartbeat row (a stop never waits behind it)."""

from __future__ import annotations

import threading

import pytest

from sokratos_worker.service import background_writes
from sokratos_worker.service.background_writes import BackgroundWrites
from tests.support.daemon import wait_until


def test_requests_during_a_write_become_one_more_write() -> None:
    release = threading.Event()
    writes: list[int] = []

    def write() -> None:
        writes.append(len(writes))
        release.wait(10)

    writer = BackgroundWrites(write, name="heartbeat_writer")
    writer.request()
    assert wait_until(lambda: writes == [0], timeout=5)
    for _ in range(5):
        writer.request()  # while the first write runs
    release.set()
    assert wait_until(lambda: len(writes) == 2, timeout=5)
    assert not wait_until(lambda: len(writes) > 2, timeout=0.5)


def test_a_thread_that_cannot_start_does_not_stop_later_writes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failed Thread.start left the writer marked running: no heartbeat row of a state
    change was written again for the life of the process (found by a review)."""
    writes: list[str] = []
    writer = BackgroundWrites(lambda: writes.append("w"), name="heartbeat_writer")

    class NoThread:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def start(self) -> None:
            raise RuntimeError("can't start new thread")

    with monkeypatch.context() as patched:
        patched.setattr(background_writes.threading, "Thread", NoThread)
        writer.request()  # no thread: nothing written, and no exception for the caller
    assert writes == []
    writer.request()
    assert wait_until(lambda: writes == ["w"], timeout=5)


def test_close_waits_for_the_running_write_and_starts_no_more() -> None:
    """A write left running when the pool closed failed against it and logged into the next
    test's capture (CI read that line as the next test's first event)."""
    release = threading.Event()
    writes: list[str] = []

    def write() -> None:
        writes.append("w")
        release.wait(10)
        writes.append("done")

    writer = BackgroundWrites(write, name="heartbeat_writer")
    writer.request()
    assert wait_until(lambda: writes == ["w"], timeout=5)
    writer.request()  # wanted after the running one: close() drops it
    threading.Timer(0.2, release.set).start()
    assert writer.close(timeout=10) is True
    assert writes == ["w", "done"]
    writer.request()
    assert not wait_until(lambda: len(writes) > 2, timeout=0.5)


def test_close_says_when_the_write_outlasts_its_wait() -> None:
    release = threading.Event()

    def write() -> None:
        release.wait(10)

    writer = BackgroundWrites(write, name="heartbeat_writer")
    writer.request()
    assert wait_until(lambda: writer._running, timeout=5)
    assert writer.close(timeout=0.1) is False
    release.set()
