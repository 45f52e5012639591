"""Rows another program wrote with values Python cannot load must not stall the worker.

A review (2026-12-05) found: a queue row with ``created_at`` 'infinity', or Go's zero time
read in a session zone west of UTC (1 BC), failed the claim after it had committed, so every
item claimed with it stayed leased and was claimed again at every lease expiry, for ever; a
row with ``attempts`` at the int4 maximum overflowed the claim and stopped its whole queue;
``status --json`` printed ``Infinity``; and a failed_operations row the Go app wrote with
such a time failed ``failed list``, ``failed show`` and ``status``. (The distillation archive
header without a time: tests/pipelines/test_archive_times_out_of_range.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
import pytest

from tests.core.test_attempts_used_up import _drain
from tests.support.db import outcomes
from tests.support.operator import cli_env, run_cli

PAYLOAD = json.dumps({"exchange": "user: my sister moved to Porto\nassistant: noted"})

UNLOADABLE = {
    "go zero time west of UTC": ("America/New_York", "0001-01-01 00:00:00+00"),
    "infinity": ("UTC", "infinity"),
    "-infinity": ("Asia/Tokyo", "-infinity"),
}


@pytest.mark.parametrize(("zone", "created_at"), UNLOADABLE.values(), ids=UNLOADABLE.keys())
def test_a_queue_row_with_an_unloadable_created_at_is_handled(
    db: psycopg.Connection, database_url: str, zone: str, created_at: str
) -> None:
    db.execute(f"ALTER DATABASE {db.info.dbname} SET timezone = '{zone}'")
    odd = db.execute(
        "INSERT INTO pending_triage (payload, created_at) VALUES (%s::jsonb, %s) RETURNING id",
        (PAYLOAD, created_at),
    ).fetchone()
    fine = db.execute(
        "INSERT INTO pending_triage (payload) VALUES (%s::jsonb) RETURNING id", (PAYLOAD,)
    ).fetchone()
    assert odd is not None and fine is not None
    handler = _drain(database_url, max_attempts=3)
    assert outcomes(db) == {odd[0]: "saved", fine[0]: "saved"}
    assert handler.calls == 2  # each once: no attempt burnt by a claim that failed


def test_attempts_at_the_int4_maximum_are_dead_lettered_and_the_queue_goes_on(
    db: psycopg.Connection, database_url: str
) -> None:
    bad = db.execute(
        "INSERT INTO pending_triage (payload, attempts) VALUES (%s::jsonb, 2147483647)"
        " RETURNING id",
        (PAYLOAD,),
    ).fetchone()
    fine = db.execute(
        "INSERT INTO pending_triage (payload) VALUES (%s::jsonb) RETURNING id", (PAYLOAD,)
    ).fetchone()
    assert bad is not None and fine is not None
    _drain(database_url, max_attempts=3)
    assert outcomes(db) == {bad[0]: "failed", fine[0]: "saved"}
    error = db.execute("SELECT error_message FROM failed_operations").fetchone()
    assert error is not None and "attempts used up" in error[0], error


def test_status_json_stays_json_with_an_infinite_created_at(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    db.execute(
        "INSERT INTO pending_triage (payload, created_at) VALUES (%s::jsonb, '-infinity')",
        (PAYLOAD,),
    )
    result = run_cli(["status", "--json"], cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url))
    assert result.returncode == 0, result.stderr

    def refuse(token: str) -> object:
        raise ValueError(f"not JSON: {token}")

    document = json.loads(result.stdout, parse_constant=refuse)
    assert document["queues"]["pending_triage"]["ready"] == 1


def test_a_failure_the_go_app_wrote_with_an_infinite_time_is_listed_and_shown(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    row = db.execute(
        "INSERT INTO failed_operations (op_type, label, error_message, created_at)"
        " VALUES ('embedding', 'memory 7', 'embedding server down', 'infinity') RETURNING id"
    ).fetchone()
    assert row is not None
    env = cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url)
    listed = run_cli(["failed", "list"], env)
    assert listed.returncode == 0, listed.stderr
    assert f"{row[0]:>6}  infinity  embedding" in listed.stdout, listed.stdout
    as_json = run_cli(["failed", "list", "--json"], env)
    assert json.loads(as_json.stdout)["created_at"] == "infinity", as_json.stdout
    shown = run_cli(["failed", "show", str(row[0])], env)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["created_at"] == "infinity"
    status = run_cli(["status", "--json"], env)
    assert status.returncode == 0, status.stderr
