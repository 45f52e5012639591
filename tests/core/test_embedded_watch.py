"""The watch on the embedded PostgreSQL's postmaster, and the hints that name that server.

A pid given to another process after the postmaster died is not the postmaster (its start
differs); the running worker's "database away" hint named SOKRATOS_DATABASE_URL even when no
URL was set and the worker ran the embedded server; the start's wait for the database gave no
hint at all.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from sokratos_worker.store.embedded import EmbeddedPostgres, process_start_ticks
from sokratos_worker.store.embedded_watch import postmaster_gone
from sokratos_worker.worker_state import away_hint
from tests.support.daemon import wait_until
from tests.support.operator import cli_env, run_cli


def test_the_watch_tells_a_dead_postmaster_from_a_live_one_and_a_reused_pid() -> None:
    """A process given the dead postmaster's pid is not it: its start differs."""
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        started = process_start_ticks(sleeper.pid)
        assert started is not None and started > 0
        alive = EmbeddedPostgres(
            server=None,
            data_dir=Path("/nowhere"),
            postmaster_pid=sleeper.pid,
            postmaster_started=started,
        )
        reused = EmbeddedPostgres(
            server=None,
            data_dir=Path("/nowhere"),
            postmaster_pid=sleeper.pid,
            postmaster_started=started - 1,
        )
        assert not postmaster_gone(alive)
        assert postmaster_gone(reused)
        sleeper.kill()
        wait_until(lambda: process_start_ticks(sleeper.pid) is None, timeout=10)
        assert postmaster_gone(alive)  # a zombie (not yet reaped) is dead
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)
    assert postmaster_gone(alive)


def test_the_away_hint_names_the_embedded_server_not_an_unset_url() -> None:
    embedded = away_hint(Path("/var/lib/sokratos-worker/postgres"))
    assert "SOKRATOS_DATABASE_URL" not in embedded
    assert "embedded PostgreSQL in /var/lib/sokratos-worker/postgres" in embedded
    assert "not answering" in embedded
    assert "SOKRATOS_DATABASE_URL" in away_hint(None)


def test_the_start_waiting_for_the_database_says_what_to_check(tmp_path: Path) -> None:
    env = cli_env(
        tmp_path,
        SOKRATOS_DATABASE_URL=f"postgresql://nobody@/nodb?host={tmp_path}",
        SOKRATOS_STARTUP_TIMEOUT="3s",
    )
    done = run_cli(["run"], env)
    assert done.returncode == 75, done.stderr[-1500:]
    waits = [
        event
        for line in done.stderr.splitlines()
        if line.startswith("{")
        and (event := json.loads(line)).get("event") == "waiting_for_database"
    ]
    assert waits, done.stderr[-1500:]
    assert "Check SOKRATOS_DATABASE_URL and that PostgreSQL is running" in waits[0]["hint"]


def test_a_live_process_whose_proc_entry_is_hidden_is_not_taken_for_dead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """/proc mounted hidepid=invisible (or not mounted) answers ENOENT for a live process as
    for a dead one: the kernel is asked (signal 0) before the postmaster is declared dead
    (found by a review)."""
    import os

    from sokratos_worker.store import embedded

    sleeper = subprocess.Popen(["sleep", "60"])
    gone = subprocess.Popen(["true"])
    gone.wait()
    real_read_text = Path.read_text

    def hidden(self: Path, *args: object, **kwargs: object) -> str:
        if str(self).startswith("/proc/"):
            raise FileNotFoundError(2, "No such file or directory", str(self))
        return real_read_text(self, *args, **kwargs)  # type: ignore[arg-type]

    try:
        monkeypatch.setattr(Path, "read_text", hidden)
        assert embedded.process_start_ticks(sleeper.pid) == -1  # alive: cannot tell its start
        assert embedded.process_start_ticks(gone.pid) is None  # no such process
        assert embedded.process_start_ticks(os.getpid()) == -1
    finally:
        monkeypatch.undo()
        sleeper.kill()
        sleeper.wait(timeout=10)
