"""``failed list`` shows each time in the host's zone. A created_at the server loads (its
session zone UTC) whose local time has no datetime, as Go's zero time seen from a host west
of UTC (year 0) or the last hour of year 9999 from one east of it (year 10000), ended the
listing with a traceback (OverflowError) and listed nothing (found by a failedhunt hunt,
2026-12-07). It is now shown as the server wrote it, and the other failures are listed."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from tests.support.operator import cli_env, run_cli


@pytest.mark.parametrize(
    "case",
    [
        ("0001-01-01 00:00:00+00", "America/New_York", "0001-01-01 00:00+00:00"),
        ("9999-12-31 23:30:00+00", "Asia/Tokyo", "9999-12-31 23:30+00:00"),
        # Held in the host's zone: the year is 4 digits as elsewhere (glibc's %Y gave "1-01-01").
        ("0001-01-01 00:00:00+00", "UTC", "0001-01-01 00:00 UTC"),
    ],
    ids=["go zero time west of UTC", "year 10000 east of UTC", "go zero time in UTC"],
)
def test_a_time_out_of_range_in_the_hosts_zone_is_listed_as_written(
    db: psycopg.Connection, database_url: str, tmp_path: Path, case: tuple[str, str, str]
) -> None:
    created_at, zone, shown = case
    db.execute(f"ALTER DATABASE {db.info.dbname} SET timezone = 'UTC'")
    db.execute(
        "INSERT INTO failed_operations (op_type, label, error_message, created_at)"
        " VALUES ('memory_save', 'conversation', 'save timed out', %s)",
        (created_at,),
    )
    db.execute(
        "INSERT INTO failed_operations (op_type, label, error_message)"
        " VALUES ('entity_extraction', 'deferred', 'model said no')"
    )
    env = cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url, TZ=zone)
    proc = run_cli(["failed", "list"], env)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2, proc.stdout
    assert any(shown in line and "memory_save" in line for line in lines), proc.stdout
    assert any("entity_extraction" in line and "model said no" in line for line in lines)
