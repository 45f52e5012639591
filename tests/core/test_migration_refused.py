"""A database the worker cannot migrate (no pgvector to create, a role that may not create
tables) is a configuration problem: `run` exits 78, which the units do not restart (it exited
1, and Restart=on-failure restarted it every 5 s for ever)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.operator import cli_env, plain_role_database, run_cli

__all__ = ["plain_role_database"]  # the fixture


@pytest.mark.parametrize(
    ("owned", "said"),
    [
        (True, "pgvector"),  # role owns the db, cannot CREATE EXTENSION
        (False, "migrat"),  # pgvector present, role may not create tables
    ],
    ids=["pgvector-not-creatable", "role-cannot-migrate"],
)
def test_run_that_cannot_migrate_exits_78_not_1(
    tmp_path: Path, plain_role_database: Callable[[bool], str], owned: bool, said: str
) -> None:
    url = plain_role_database(owned)
    env = cli_env(tmp_path, SOKRATOS_DATABASE_URL=url)
    try:
        done = run_cli(["run"], env, timeout=90)
    except subprocess.TimeoutExpired:  # pragma: no cover - it would be running: not this bug
        pytest.fail("run did not stop: the migration unexpectedly succeeded")
    assert said in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert done.returncode == 78, (
        f"run exited {done.returncode}: under systemd (Restart=on-failure,"
        " RestartPreventExitStatus=78) that is a restart every 5 s for ever"
    )
