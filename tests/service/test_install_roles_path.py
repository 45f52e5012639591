"""deploy/install.sh names roles.sql as it is on the target: a staged install (--prefix)
without a staged venv (--skip-venv) printed this machine's checkout path (the staging
machine's sql/roles.sql), which the target does not have."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "install.sh"
LIVE_PYTHON = "/opt/sokratos-worker/venv/bin/python"


def _roles_argument(stdout: str) -> str:
    """What the printed psql command gives -f, as the shell would see it."""
    line = next(line for line in stdout.splitlines() if "roles.sql" in line and " -f " in line)
    return line.split(" -f ", 1)[1].strip()


def test_a_staged_install_without_its_venv_finds_roles_sql_on_the_target(
    tmp_path: Path,
) -> None:
    stage = tmp_path / "stage"
    done = subprocess.run(
        ["bash", str(SCRIPT), "--prefix", str(stage), "--skip-venv"],
        capture_output=True, text=True, check=False, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    argument = _roles_argument(done.stdout)
    assert str(REPO) not in argument and str(stage) not in argument, argument
    # The target's venv (where the units run it) says where its roles.sql is.
    assert LIVE_PYTHON in argument, argument
    # Run there (here: this Python, with this checkout installed), it names the file.
    on_target = argument.replace(LIVE_PYTHON, sys.executable)
    shown = subprocess.run(
        ["bash", "-c", f"cat {on_target}"],
        capture_output=True, text=True, check=False, timeout=60, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == (REPO / "sql" / "roles.sql").read_text("utf-8")

