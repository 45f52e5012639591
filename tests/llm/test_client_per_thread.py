"""ClientPerThread: one HTTP client per thread, dead threads' clients closed, all closed at the end."""

from __future__ import annotations

import threading

import httpx

from sokratos_worker.llm.http import ClientPerThread


def test_each_thread_has_its_own_client_and_every_one_is_closed() -> None:
    clients = ClientPerThread(httpx.Client)
    mine = clients.get()
    assert clients.get() is mine
    theirs: list[httpx.Client] = []
    worker = threading.Thread(target=lambda: theirs.append(clients.get()))
    worker.start()
    worker.join()
    assert theirs[0] is not mine and not theirs[0].is_closed

    # A new thread's first call closes the client of the thread that ended.
    later: list[httpx.Client] = []
    other = threading.Thread(target=lambda: later.append(clients.get()))
    other.start()
    other.join()
    assert theirs[0].is_closed and not later[0].is_closed

    clients.close()
    assert mine.is_closed and later[0].is_closed
