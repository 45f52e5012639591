"""A start held up by migrations tells systemd so: EXTEND_TIMEOUT_USEC while it waits for the
migrators' advisory lock (or applies a migration), and a STATUS= line naming what it waits for.

It used to wait in silence (for systemd) until TimeoutStartSec killed it with a message saying
nothing of the lock, and the restarts looped.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from sokratos_worker.app import MIGRATION_EXTENSION_S, REST_OF_START_S
from sokratos_worker.store.migrations import apply_migrations, load_migrations
from tests.support.daemon import daemon_env, start_daemon

pytestmark = [pytest.mark.subprocess, pytest.mark.slow, pytest.mark.timeout(180)]

MIGRATION_LOCK_KEY = 0x50C_2A705
EXTEND = "EXTEND_TIMEOUT_USEC="


class Notifications:
    """The lines systemd would receive on ``$NOTIFY_SOCKET``, with when each arrived."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.received: list[tuple[float, str]] = []

    def lines(self) -> list[str]:
        return [line for _, line in self.received]

    def extensions(self) -> list[tuple[float, int]]:
        return [
            (at, int(line.removeprefix(EXTEND)))
            for at, line in self.received
            if line.startswith(EXTEND)
        ]

    def until(self, condition: Callable[[], bool], *, timeout: float) -> bool:
        """Receive until ``condition`` holds or ``timeout`` passes (bounded loop)."""
        deadline = time.monotonic() + timeout
        while not condition() and time.monotonic() < deadline:
            try:
                data = self.sock.recv(4096).decode()
            except TimeoutError:
                continue
            arrived = time.monotonic()
            self.received.extend((arrived, line) for line in data.splitlines())
        return condition()


@pytest.fixture
def notifications(tmp_path: Path) -> Iterator[Notifications]:
    received = Notifications(tmp_path / "notify.sock")
    yield received
    received.sock.close()


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"


def test_a_start_waiting_for_the_migration_lock_extends_its_timeout_and_names_the_holder(
    empty_database_url: str, tmp_path: Path, notifications: Notifications
) -> None:
    notify_socket = str(notifications.sock.getsockname())
    env = daemon_env(empty_database_url, tmp_path, NOTIFY_SOCKET=notify_socket)
    log = tmp_path / "daemon.log"
    with psycopg.connect(
        empty_database_url, autocommit=True, application_name="another-migrator"
    ) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK_KEY,))
        waiting = (
            "STATUS=starting: waiting for the migration lock held by"
            f" pid {holder.info.backend_pid} (another-migrator), "
        )
        daemon = start_daemon(env, log)
        try:
            assert notifications.until(
                lambda: (
                    any(line.startswith(waiting) for line in notifications.lines())
                    and len(notifications.extensions()) >= 3
                ),
                timeout=90,
            ), f"{notifications.lines()}\n{_tail(log)}"
            assert daemon.poll() is None, _tail(log)
            assert "READY=1" not in notifications.lines()
            extensions = notifications.extensions()
            assert {usec for _, usec in extensions} == {int(MIGRATION_EXTENSION_S * 1_000_000)}
            # Each extension is renewed well before it runs out (every third of it).
            gaps = [later - earlier for (earlier, _), (later, _) in itertools.pairwise(extensions)]
            assert max(gaps) < MIGRATION_EXTENSION_S, gaps
            holder.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK_KEY,))
            assert notifications.until(lambda: "READY=1" in notifications.lines(), timeout=90), (
                f"{notifications.lines()}\n{_tail(log)}"
            )
        finally:
            daemon.terminate()
            code = daemon.wait(60)
    assert code == 0, _tail(log)
    lines = notifications.lines()
    first = load_migrations()[0].name
    total = len(load_migrations())
    assert f"STATUS=starting: applying migration {first} (1 of {total})" in lines
    # After the migrations the rest of the start gets a whole start's time, and says so.
    done = lines.index("STATUS=starting: migrations up to date")
    assert lines[done - 1] == f"{EXTEND}{int(REST_OF_START_S * 1_000_000)}"
    assert done < lines.index("READY=1")


def test_a_migration_waiting_for_its_tables_says_who_holds_them(database_url: str) -> None:
    """The progress the daemon turns into STATUS= lines: each migration as it starts, and the
    session whose transaction keeps a migration from its tables."""
    table = "email_checkpoints"
    last = [m for m in load_migrations() if f"ALTER TABLE {table}" in m.sql][-1]
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("DELETE FROM sokratos_worker_migrations WHERE version = %s", (last.version,))
    heard: list[str] = []
    with psycopg.connect(database_url, application_name="a-report") as reader:
        reader.execute(f"SELECT count(*) FROM {table}")  # an open transaction holds its lock
        migrate = threading.Thread(
            target=apply_migrations, args=(database_url, heard.append), daemon=True
        )
        migrate.start()
        deadline = time.monotonic() + 30
        while len(heard) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        reader.rollback()
        holder = reader.info.backend_pid
    migrate.join(60)
    assert not migrate.is_alive()
    assert heard[:2] == [
        f"applying migration {last.name} (1 of 1)",
        f"migration {last.name} waits for tables held by pid {holder} (a-report)",
    ]
