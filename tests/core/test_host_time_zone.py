"""The host's time zone is not UTC (TZ=America/New_York, TZ=Asia/Kolkata): what the CLI shows
and counts. The CLI runs as a subprocess against the test database (real PostgreSQL)."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import psycopg
import pytest

from tests.faults.support import cli
from tests.support.daemon import daemon_env

pytestmark = [pytest.mark.subprocess]

INSTANT = datetime(2026, 3, 14, 8, 0, tzinfo=UTC)


def _failure(db: psycopg.Connection, created_at: datetime) -> int:
    row = db.execute(
        "INSERT INTO failed_operations (op_type, label, error_message, context_data, created_at)"
        " VALUES ('triage', 'r1', 'boom', '{}'::jsonb, %s) RETURNING id",
        (created_at,),
    ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("zone", ["America/New_York", "Asia/Kolkata"])
def test_failed_list_shows_a_time_the_reader_can_place(
    db: psycopg.Connection, database_url: str, tmp_path: Path, zone: str
) -> None:
    """`failed list` prints created_at as "%Y-%m-%d %H:%M" with no zone, in whatever TimeZone
    the PostgreSQL session has (the server's default), not the host's: an operator in
    New York reads 08:00 for a failure at 03:00 local, with nothing saying it is UTC."""
    server_zone = db.execute("SHOW TimeZone").fetchone()[0]
    fid = _failure(db, INSTANT)
    env = daemon_env(database_url, tmp_path, TZ=zone)
    env.pop("PGTZ", None)
    done = cli(env, "failed", "list")
    assert done.returncode == 0, done.stderr
    [line] = [ln for ln in done.stdout.splitlines() if ln.split()[:1] == [str(fid)]]
    local = INSTANT.astimezone(ZoneInfo(zone)).strftime("%Y-%m-%d %H:%M")
    in_utc = INSTANT.strftime("%Y-%m-%d %H:%M")
    labelled_utc = in_utc in line and re.search(r"\b(UTC|Z|\+00(:?00)?)\b", line)
    assert local in line or labelled_utc, (
        f"host TZ={zone}, server TimeZone={server_zone}: {line!r} shows neither the host's"
        f" local time {local!r} nor a UTC time marked as UTC"
    )


@pytest.mark.parametrize("zone", ["America/New_York", "Asia/Kolkata"])
def test_status_and_json_times_carry_their_offset(
    db: psycopg.Connection, database_url: str, tmp_path: Path, zone: str
) -> None:
    _failure(db, datetime.now(UTC))
    env = daemon_env(database_url, tmp_path, TZ=zone)
    done = cli(env, "status", "--json")
    assert done.returncode == 0, done.stderr
    json.loads(done.stdout)  # whole and valid under any zone
    listed = cli(env, "failed", "list", "--json")
    row = json.loads(listed.stdout.splitlines()[0])
    parsed = datetime.fromisoformat(str(row["created_at"]).replace(" ", "T"))
    assert parsed.tzinfo is not None


@pytest.mark.parametrize("zone", ["America/New_York", "Asia/Kolkata"])
def test_purge_older_than_counts_days_by_the_instant(
    db: psycopg.Connection, database_url: str, tmp_path: Path, zone: str
) -> None:
    now = db.execute("SELECT now()").fetchone()[0]
    from datetime import timedelta

    old = _failure(db, now - timedelta(days=3, hours=1))
    young = _failure(db, now - timedelta(days=2, hours=23))
    env = daemon_env(database_url, tmp_path, TZ=zone)
    done = cli(env, "failed", "purge", "--older-than", "3")
    assert done.returncode == 0, done.stderr
    left = {r[0] for r in db.execute("SELECT id FROM failed_operations").fetchall()}
    assert old not in left and young in left, (done.stdout, left)
