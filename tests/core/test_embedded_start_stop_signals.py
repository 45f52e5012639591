"""Stop signals to a command that starts the embedded PostgreSQL (no SOKRATOS_DATABASE_URL).

A stop signal during the start is held until the server is up (an initdb cut short left a
data directory no later start could use), then raised. For ``status``, ``migrate``,
``enqueue``, ``failed`` and ``check`` SIGTERM's handler was the default then, so the process
died on the spot (-15) and the server it had started ran on. Now SIGTERM and SIGHUP stop such
a command as Ctrl-C does, for as long as it holds the server: it is stopped again and the
command exits 1 with one line ("stopped by SIGTERM"), no traceback.

A stop of the whole process group (systemd's KillMode=control-group, ``kill -- -PGID``) also
reaches initdb, which gives up, so the start fails: that is the stop (``run`` exits 0,
"stopped_while_starting"), not "could not start" and exit 1. An initdb killed outright
(SIGKILL) left a half-initialised directory every later start failed on: the next start
empties it and runs initdb again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.operator import REPO, cli_env, run_cli


def _wait_for(path: Path, deadline_s: float = 60) -> None:
    end = time.monotonic() + deadline_s
    while not path.exists():
        assert time.monotonic() < end, f"{path} never appeared"
        time.sleep(0.005)


def _wait_for_group_gone(pgid: int, deadline_s: float = 30) -> None:
    """Until no process of the group is left (a SIGKILL lands once a pending fsync returns)."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        assert time.monotonic() < end, f"process group {pgid} still has processes"
        time.sleep(0.02)


def _server_pids(pgdata: Path) -> list[int]:
    found = subprocess.run(
        ["pgrep", "-f", f"postgres -D {pgdata}"], capture_output=True, text=True, check=False
    )
    return [int(pid) for pid in found.stdout.split()]


def _no_server_left(pgdata: Path, deadline_s: float = 10) -> list[int]:
    end = time.monotonic() + deadline_s
    while (left := _server_pids(pgdata)) and time.monotonic() < end:
        time.sleep(0.1)
    return left


def _stop_leftover(pgdata: Path) -> None:
    for pid in _server_pids(pgdata):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGINT)  # the postmaster's fast shutdown
    _no_server_left(pgdata, 20)


def _start(args: list[str], env: dict[str, str], **popen: object) -> subprocess.Popen[str]:
    return subprocess.Popen(  # type: ignore[call-overload, no-any-return]
        [sys.executable, "-m", "sokratos_worker", *args],
        env=env,
        cwd=str(REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


@pytest.mark.parametrize("args", [["status"], ["migrate"]])
def test_sigterm_during_the_embedded_start_stops_the_server_it_started(
    tmp_path: Path, args: list[str]
) -> None:
    env = cli_env(tmp_path)
    pgdata = tmp_path / "data" / "postgres"
    proc = _start(args, env)
    try:
        _wait_for(pgdata)  # start_embedded is running: the signal is held
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=90)
        left = _no_server_left(pgdata)
        assert not left, f"{args} left the server {left} running; stderr: {err[-800:]}"
        assert "Traceback" not in err, err[-1500:]
        assert proc.returncode == 1, (proc.returncode, err[-800:])
        assert "stopped by SIGTERM" in err.strip().splitlines()[-1], err[-800:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        _stop_leftover(pgdata)


def test_sigterm_after_the_embedded_start_stops_the_server_too(tmp_path: Path) -> None:
    """The server is up and ``status`` reads it (or prints): stopped again either way."""
    env = cli_env(tmp_path, SOKRATOS_LOG_LEVEL="info")
    pgdata = tmp_path / "data" / "postgres"
    proc = _start(["status"], env)
    assert proc.stderr is not None
    seen = []
    try:
        for line in proc.stderr:
            seen.append(line)
            if "embedded_postgres_ready" in line:
                proc.send_signal(signal.SIGTERM)
                break
        _out, rest = proc.communicate(timeout=90)
        err = "".join(seen) + rest
        left = _no_server_left(pgdata)
        assert not left, f"status left the server {left} running; stderr: {err[-800:]}"
        assert "Traceback" not in err, err[-1500:]
        # 1: stopped while it held the server; 0 or -15: it had already released it.
        assert proc.returncode in (0, 1, -signal.SIGTERM), (proc.returncode, err[-800:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        _stop_leftover(pgdata)


def test_run_group_sigterm_during_initdb_exits_0_and_the_next_start_works(
    tmp_path: Path,
) -> None:
    env = cli_env(tmp_path)
    pgdata = tmp_path / "data" / "postgres"
    proc = _start(["run"], env, start_new_session=True)  # its own group, as a unit's cgroup
    try:
        _wait_for(pgdata / "postgresql.conf")  # initdb wrote its configuration: bootstrap next
        os.killpg(proc.pid, signal.SIGTERM)  # a stop of every process of the unit
        _out, err = proc.communicate(timeout=90)
        assert "could not start" not in err, err[-1500:]
        assert "stopped_while_starting" in err, err[-1500:]
        assert proc.returncode == 0, (proc.returncode, err[-1500:])
        again = run_cli(["run", "--once"], env, timeout=120)
        assert again.returncode == 0, again.stderr[-1500:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        _stop_leftover(pgdata)


def test_a_start_after_initdb_was_killed_outright_clears_the_half_initialised_directory(
    tmp_path: Path,
) -> None:
    env = cli_env(tmp_path)
    pgdata = tmp_path / "data" / "postgres"
    proc = _start(["run"], env, start_new_session=True)
    try:
        _wait_for(pgdata / "postgresql.conf")
        os.killpg(proc.pid, signal.SIGKILL)  # systemd's SIGKILL after TimeoutStopSec
        proc.communicate(timeout=30)
        assert (pgdata / "PG_VERSION").exists()  # what the next start used to fail on
        _wait_for_group_gone(proc.pid)  # as systemd restarts a unit once its cgroup is empty
        again = run_cli(["run", "--once"], env, timeout=120)
        assert again.returncode == 0, again.stderr[-1500:]
        assert "embedded_postgres_interrupted_initdb_cleared" in again.stderr
        assert not (tmp_path / "data" / "postgres.initdb-pid").exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        _stop_leftover(pgdata)


def test_a_half_initialised_directory_not_marked_by_the_worker_says_what_to_do(
    tmp_path: Path,
) -> None:
    """Left by a version before the marker (or by hand): never emptied, but named."""
    env = cli_env(tmp_path)
    pgdata = tmp_path / "data" / "postgres"
    pgdata.mkdir(parents=True)
    (pgdata / "PG_VERSION").write_text("16\n")
    done = run_cli(["run", "--once"], env, timeout=120)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1, done.stderr[-1500:]
    assert "half-initialised" in last and f"rm -r {pgdata}" in last, last
    assert (pgdata / "PG_VERSION").exists()
