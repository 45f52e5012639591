"""An unreachable database's hint names the variable the operator gave the URL in.

With the URL in DATABASE_URL (or a credential file), `failed list` said "Check
SOKRATOS_DATABASE_URL", a variable the operator never set. Real parts: the command run as an
operator runs it, against a port nothing listens on.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.core.test_cli import cli, env_for
from tests.support.ports import unused_port


@pytest.mark.parametrize("given", ["SOKRATOS_DATABASE_URL", "DATABASE_URL", "SOKRATOS_DATABASE_URL_FILE"])
def test_the_hint_names_where_the_url_came_from(tmp_path: Path, given: str) -> None:
    url = f"postgresql://x@127.0.0.1:{unused_port()}/none"
    value = url
    if given.endswith("_FILE"):
        secret = tmp_path / "db-url"
        secret.write_text(url)
        value = str(secret)
    env = env_for(None, tmp_path, **{given: value})
    proc = cli("failed", "list", env=env)
    assert proc.returncode == 75, proc.stderr
    assert f"Check {given} and that PostgreSQL is running." in proc.stderr, proc.stderr


def test_check_names_it_too(tmp_path: Path) -> None:
    env = env_for(None, tmp_path, DATABASE_URL=f"postgresql://x@127.0.0.1:{unused_port()}/none")
    proc = cli("check", env=env)
    assert proc.returncode == 1, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("FAIL  database"))
    assert line.endswith("Check DATABASE_URL and that PostgreSQL is running."), line
