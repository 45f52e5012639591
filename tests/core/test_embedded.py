"""The embedded PostgreSQL is stopped by its last live holder, even after a holder was killed.

Contract §6: the embedded PostgreSQL "stops what it started". The wheel counts holders in
``PGDATA/.handle_pids.json``; a holder killed with -9 never takes its pid out again.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from sokratos_worker.store.embedded import HANDLE_PIDS, prune_dead_holders

ROOT = Path(__file__).resolve().parents[2]

# A holder that dies the way systemd's SIGKILL or the OOM killer ends it: no atexit, no release.
CRASH = """
import os, signal, sys
from pathlib import Path
from sokratos_worker.store.embedded import start_embedded
e = start_embedded(Path(sys.argv[1]))
print("POSTMASTER", e.server.get_pid(), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def _postmaster(data: Path) -> int | None:
    pid_file = data / "postgres" / "postmaster.pid"
    if not pid_file.exists():
        return None
    pid = int(pid_file.read_text().split()[0])
    return pid if _alive(pid) else None


@pytest.fixture
def data_dir() -> Iterator[Path]:
    # Under /tmp, world-traversable: as root the wheel runs the server as its own system user.
    data = Path(f"/tmp/sokratos-embedded-{uuid.uuid4().hex[:8]}")
    data.mkdir(mode=0o755)
    yield data
    left = _postmaster(data)
    if left is not None:
        os.kill(left, signal.SIGINT)  # fast shutdown of what a failed test left behind
        for _ in range(50):
            if not _alive(left):
                break
            time.sleep(0.1)
    shutil.rmtree(data, ignore_errors=True)


def _wait_gone(pid: int) -> None:
    deadline = time.monotonic() + 30
    while _alive(pid):
        assert time.monotonic() < deadline, f"pid {pid} still there 30 s after kill -9"
        time.sleep(0.1)


def _crash_a_holder(data: Path) -> int:
    r = subprocess.run(
        [sys.executable, "-c", CRASH, str(data)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == -signal.SIGKILL, r.stderr[-500:]
    return int(r.stdout.split("POSTMASTER")[-1].split()[0])


def _status(data: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(data), "SOKRATOS_DATA_DIR": str(data)}
    env["SOKRATOS_LOG_LEVEL"] = "info"  # the server's start and stop lines are read below
    return subprocess.run(
        [sys.executable, "-m", "sokratos_worker", "status"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.postgres
@pytest.mark.slow
def test_the_server_is_stopped_again_after_a_holder_was_killed(data_dir: Path) -> None:
    # 1. A holder is killed with -9, and so is the server (the rest of its cgroup).
    postmaster = _crash_a_holder(data_dir)
    os.kill(postmaster, signal.SIGKILL)
    _wait_gone(postmaster)  # reaped (init may take a moment): not a zombie the wheel counts
    pids = json.loads((data_dir / "postgres" / HANDLE_PIDS).read_text())
    assert pids, "the killed holder's pid should still be listed (the wheel's behaviour)"

    # A later command starts the server; at its exit it is the last live holder and stops it.
    r = _status(data_dir)
    assert r.returncode == 0, r.stderr[-500:]
    assert "database: ok" in r.stdout
    assert _postmaster(data_dir) is None, "status started the server and left it running"
    assert "embedded_postgres_dead_holders_pruned" in r.stderr
    assert "embedded_postgres_stopped" in r.stderr

    # 2. A holder is killed with -9 and the server it started survives it (an orphan).
    postmaster = _crash_a_holder(data_dir)
    assert _alive(postmaster)
    r = _status(data_dir)
    assert r.returncode == 0, r.stderr[-500:]
    assert _postmaster(data_dir) is None, "status attached to the orphan and left it running"
    assert json.loads((data_dir / "postgres" / HANDLE_PIDS).read_text()) == []


class _Lock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: object) -> None:
        return None


def test_a_live_holder_is_kept_and_a_dead_one_is_not(tmp_path: Path) -> None:
    """Real processes: live ones, and one that is gone; then the same live pids in a list
    written before they started (a worker restarted under the same pid, or a clock set forward
    after it registered): still kept, or a CLI command would stop the server under them."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    live = [subprocess.Popen(["sleep", "30"]) for _ in range(2)]
    path = tmp_path / HANDLE_PIDS
    try:
        path.write_text(json.dumps([live[0].pid, gone.pid, live[1].pid]))
        assert prune_dead_holders(tmp_path, lock=_Lock()) == [gone.pid]
        assert json.loads(path.read_text()) == [live[0].pid, live[1].pid]
        before = time.time() - 10
        os.utime(path, (before, before))
        assert prune_dead_holders(tmp_path, lock=_Lock()) == []
        assert json.loads(path.read_text()) == [live[0].pid, live[1].pid]
        path.write_text(json.dumps([os.getpid()]))
        os.utime(path, (before, before))
        assert prune_dead_holders(tmp_path, lock=_Lock()) == []  # this process: never pruned
    finally:
        for process in live:
            process.kill()
            process.wait()


def test_an_unreadable_holder_list_is_reset(tmp_path: Path) -> None:
    (tmp_path / HANDLE_PIDS).write_text("[12, 3")  # a holder killed while writing it
    assert prune_dead_holders(tmp_path, lock=_Lock()) == []
    assert json.loads((tmp_path / HANDLE_PIDS).read_text()) == []
