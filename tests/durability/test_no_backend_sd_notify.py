"""durability.md, item life 7: when no backend can be reached, the worker gives the attempt
back, stops claiming, "says so in logs, `status` and sd_notify". The sd_notify part through the
real daemon (scripted handlers; the item raises BackendsUnavailable every time)."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
from pathlib import Path

import psycopg
import pytest

from tests.support.daemon import daemon_env, start_daemon, wait_until
from tests.support.db import count, enqueue_many

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]


@pytest.mark.timeout(90)
def test_no_backend_is_said_over_sd_notify_and_in_the_log_and_costs_no_attempt(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify.sock"))
    sock.settimeout(0.2)
    env = daemon_env(database_url, tmp_path, NOTIFY_SOCKET=str(tmp_path / "notify.sock"))
    enqueue_many(db, 2, behaviour="unavailable")
    log = tmp_path / "daemon.log"
    proc = start_daemon(env, log)
    seen: list[str] = []

    def receive() -> bool:
        with contextlib.suppress(TimeoutError):
            seen.extend(sock.recv(4096).decode().splitlines())
        return any(s.startswith("STATUS=no backend") for s in seen)

    try:
        assert wait_until(receive, timeout=30, interval=0), (seen, log.read_text()[-3000:])
        # (The other item may be running at this moment: its attempt is given back as well.)
        assert count(db, "SELECT count(*) FROM work_outcomes") == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        sock.close()
    [status] = [s for s in seen if s.startswith("STATUS=no backend")][:1]
    assert "every backend unreachable (scripted)" in status, status
    text = log.read_text()
    assert '"claiming_paused"' in text and '"attempt_given_back"' in text
    paused = [json.loads(line) for line in text.splitlines() if '"claiming_paused"' in line]
    assert len(paused) == 1 and "resumes by itself" in paused[0]["hint"], paused
    assert count(db, "SELECT count(*) FROM pending_triage WHERE attempts > 0") == 0
    assert count(db, "SELECT count(*) FROM failed_operations") == 0
