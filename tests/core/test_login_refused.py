"""A URL the server refuses (wrong role, database or password) is a configuration error:
exit 78 naming SOKRATOS_DATABASE_URL (for `run`, once the start-up deadline has passed),
never "unreachable" and 75, never a spooled enqueue that no worker will import."""

from __future__ import annotations

import time
from pathlib import Path

import psycopg

from tests.core.test_cli import cli, env_for


def _with(url: str, **changes: str) -> str:
    info = psycopg.conninfo.conninfo_to_dict(url)
    info.update(changes)
    return psycopg.conninfo.make_conninfo(**info)


def test_run_with_an_unknown_role_exits_78_at_the_start_up_deadline(
    database_url: str, tmp_path: Path
) -> None:
    # Waited out like an outage (an authentication backend may be restarting), then 78.
    env = env_for(_with(database_url, user="nobody_here"), tmp_path, SOKRATOS_STARTUP_TIMEOUT="3s")
    started = time.monotonic()
    proc = cli("run", "--once", env=env)
    took = time.monotonic() - started
    assert proc.returncode == 78, proc.stderr[-2000:]
    assert (
        "SOKRATOS_DATABASE_URL" in proc.stderr
        and 'role "nobody_here" does not exist' in proc.stderr
    )
    assert "Traceback" not in proc.stderr
    assert took < 30, f"waited {took:.0f}s for a refusal that will not change"


def test_enqueue_to_a_missing_database_exits_78_and_spools_nothing(
    database_url: str, tmp_path: Path
) -> None:
    env = env_for(_with(database_url, dbname="no_such_db"), tmp_path)
    proc = cli("enqueue", "triage", "--exchange", "user: hi\nassistant: hello", env=env)
    assert proc.returncode == 78, proc.stderr[-2000:]
    assert 'database "no_such_db" does not exist' in proc.stderr and proc.stdout == ""
    spool = tmp_path / "home/.local/share/sokratos-worker/spool"
    assert not spool.exists() or not any(spool.iterdir())


def test_an_unparsable_url_is_refused_without_echoing_it(tmp_path: Path) -> None:
    proc = cli("status", env=env_for("host=db password=s3cret junk", tmp_path))
    assert proc.returncode == 78
    assert "SOKRATOS_DATABASE_URL" in proc.stderr and "s3cret" not in proc.stderr
