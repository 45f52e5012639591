"""The spool import killed with SIGKILL part-way, again and again: every spooled enqueue ends
up queued exactly once. A kill between an enqueue's commit and its file's unlink leaves the
file behind; the next import finds its key known and deletes it without a second item. Real
parts: `sokratos-worker run --once` as a subprocess, the spool on disk, the test's database.
(A guard written by an ingresshunt hunt; it found nothing lost or doubled.)"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest

from sokratos_worker.client import spool
from sokratos_worker.model import Queue
from tests.support.db import count
from tests.support.operator import REPO, cli_env

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

FILES = 120
KILLS = 3
# Large enough that one import takes a while: the kill lands among the files, not after them.
FILLER = "and then we talked about the weather for a long while. " * 20_000


def _left(spool_dir: Path) -> int:
    return len(list(spool_dir.glob("*.json")))


def _kill_once_the_import_has_begun(env: dict[str, str], spool_dir: Path) -> bool:
    """Start `run --once`, SIGKILL it as soon as a file is gone; True when it was killed
    with files still left (mid-import)."""
    before = _left(spool_dir)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sokratos_worker", "run", "--once"],
        env=env,
        cwd=str(REPO),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while _left(spool_dir) == before and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        proc.kill()
    finally:
        proc.wait()
    return 0 < _left(spool_dir) < before


def test_an_import_killed_again_and_again_queues_each_enqueue_once(
    tmp_path: Path, database_url: str, db: psycopg.Connection
) -> None:
    env = cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url)
    spool_dir = tmp_path / "data" / "spool"
    for i in range(FILES):
        if i % 2:
            payload = {"exchange": f"user: fact {i}: {FILLER}\nassistant: noted"}
            spool(spool_dir, Queue.TRIAGE, payload, key=f"t{i}" if i % 3 else None)
        else:
            spool(spool_dir, Queue.DISTILLATION, {"archive_text": f"user: fact {i}: {FILLER}"})

    killed_mid_import = sum(_kill_once_the_import_has_begun(env, spool_dir) for _ in range(KILLS))
    assert killed_mid_import >= 1, "every import finished before its kill: make files larger"
    done = subprocess.run(
        [sys.executable, "-m", "sokratos_worker", "run", "--once"],
        env=env,
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]

    assert _left(spool_dir) == 0
    queued = "SELECT count(*), count(DISTINCT idempotency_key) FROM {}"
    for table in ("pending_triage", "pending_distillation"):
        rows = db.execute(queued.format(table)).fetchone()
        assert rows == (FILES // 2, FILES // 2), (table, rows)
    assert count(db, "SELECT count(*) FROM failed_operations") == 0
    print(f"\nspool import SIGKILLed {killed_mid_import}x mid-import: {FILES} files in, {FILES} items, 0 doubled")
