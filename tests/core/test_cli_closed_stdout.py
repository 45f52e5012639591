"""A closed stdout (``sokratos-worker migrate >&-``, a cron line or a supervisor that closes
fd 1): Python sets ``sys.stdout`` to None, print() drops the text, and the command ends as it
would otherwise: exit 0, no traceback (main() flushed ``sys.stdout`` unconditionally and
ended every command with ``AttributeError: 'NoneType' object has no attribute 'flush'``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.operator import REPO, cli_env


def _run_closed_stdout(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    command = " ".join([sys.executable, "-m", "sokratos_worker", *args])
    return subprocess.run(
        ["sh", "-c", f"exec {command} >&-"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(REPO),
        check=False,
    )


def test_version_with_stdout_closed_exits_0(tmp_path: Path) -> None:
    result = _run_closed_stdout(["--version"], cli_env(tmp_path))
    assert "Traceback" not in result.stderr, result.stderr[-1500:]
    assert result.returncode == 0


def test_migrate_with_stdout_closed_exits_0(tmp_path: Path, empty_database_url: str) -> None:
    env = cli_env(tmp_path, SOKRATOS_DATABASE_URL=empty_database_url)
    result = _run_closed_stdout(["migrate"], env)
    assert "Traceback" not in result.stderr, result.stderr[-1500:]
    assert result.returncode == 0
