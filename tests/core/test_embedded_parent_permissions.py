"""Run as root, the embedded PostgreSQL's wheel opened every directory above the data
directory to all users (g+rx,o+rx up to /): a private /root became 0755, listable and
readable by every local user (review R1). Only the traverse right its server user needs
is left, and said."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from tests.support.operator import cli_env, run_cli

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
