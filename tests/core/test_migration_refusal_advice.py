"""A pending migration under the least-privilege worker role: every refusal names the fix that
works, 'sokratos-worker migrate' as the owner of the tables, and following it works.

They advised SOKRATOS_MIGRATE_ON_START=false or 'run --no-migrate', which only led to another
exit 78 ("the database lacks migrations"), told someone already using --no-migrate that "'run'
skips them with --no-migrate", and pointed at a "README, Upgrading" section that is not there.
"""

from __future__ import annotations

import re
from pathlib import Path

import psycopg
import pytest

from tests.core.test_cli import cli, env_for

pytestmark = [pytest.mark.postgres, pytest.mark.subprocess]

ROOT = Path(__file__).resolve().parents[2]
ROLES_SQL = (ROOT / "sql" / "roles.sql").read_text("utf-8")
PENDING = "0048_key_lookups_on_their_indexes"
WRONG_FIXES = ("start without migrating", "skips them with --no-migrate", "README, Upgrading")


def _as_worker_role(url: str) -> str:
    info = psycopg.conninfo.conninfo_to_dict(url)
    info["options"] = "-c role=sokratos_worker"
    return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})


def _assert_names_the_fix(said: str) -> None:
    assert "'sokratos-worker migrate' as the role that owns the tables" in said, said
    for wrong in WRONG_FIXES:
        assert wrong not in said, said
    # The section it names is there.
    (section,) = re.findall(r"docs/production\.md §(\d+) (\w+)", said)
    headings = (ROOT / "docs" / "production.md").read_text("utf-8").splitlines()
    assert f"## {section[0]}. {section[1]}" in headings, section


@pytest.mark.timeout(300)
def test_each_refusal_of_a_pending_migration_names_the_fix_that_works(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    db.execute(ROLES_SQL)
    db.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")  # as PostgreSQL 15 and later
    db.execute("DELETE FROM sokratos_worker_migrations WHERE name = %s", (PENDING,))
    worker = env_for(_as_worker_role(database_url), tmp_path)

    started = cli("run", "--once", env=worker)  # SOKRATOS_MIGRATE_ON_START left at true
    assert started.returncode == 78, started.stderr[-2000:]
    _assert_names_the_fix(started.stderr)
    assert "would not help" in started.stderr  # the other fixes tried, said in advance

    migrated = cli("migrate", env=worker)
    assert migrated.returncode == 78, migrated.stderr[-2000:]
    _assert_names_the_fix(migrated.stderr)

    skipped = cli("run", "--once", "--no-migrate", env=worker)
    assert skipped.returncode == 78, skipped.stderr[-2000:]
    assert f"lacks migrations {PENDING}" in skipped.stderr
    _assert_names_the_fix(skipped.stderr)

    checked = cli("check", env=worker)
    (schema,) = [line for line in checked.stdout.splitlines() if "schema" in line]
    assert schema.startswith(f"FAIL  schema: the database lacks migrations {PENDING}"), schema
    _assert_names_the_fix(schema)

    # Following the advice: the owner migrates, and the worker role then starts.
    owner = cli("migrate", env=env_for(database_url, tmp_path))
    assert owner.returncode == 0 and f"applied: {PENDING}" in owner.stdout, owner.stderr[-2000:]
    again = cli("run", "--once", env=worker)
    assert again.returncode == 0, again.stderr[-2000:]
    assert db.execute(
        "SELECT count(*) FROM sokratos_worker_migrations WHERE name = %s", (PENDING,)
    ).fetchone() == (1,)
