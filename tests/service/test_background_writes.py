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
