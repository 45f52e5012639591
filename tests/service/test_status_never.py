"""Rows a producer inserts directly (or an operator edits) with a run_after of 'infinity' or a
lease that never ends: `status --json` printed `"in_s": Infinity` (not JSON; a strict parser
refuses it) and the text `in infs`; a lease without a lease_owner was counted and not named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psycopg

from tests.support.operator import cli_env, run_cli


def strict_json(text: str) -> Any:
    """Parsed as a standard JSON parser would: NaN and Infinity are refused."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def insert_never_ending_rows(conn: psycopg.Connection) -> None:
    conn.execute(
        "INSERT INTO pending_triage (payload, run_after) VALUES"
        """ ('{"exchange": "user: a\\nassistant: b"}', 'infinity')"""
    )
    conn.execute(
        "INSERT INTO pending_distillation (payload, lease_expires_at) VALUES"
        """ ('{"archive_text": "user: a"}', 'infinity')"""
    )


def test_status_says_never_and_stays_standard_json(tmp_path: Path, database_url: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        insert_never_ending_rows(conn)
    env = cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url)

    done = run_cli(["status", "--json"], env)
    assert done.returncode == 0, done.stderr
    report = strict_json(done.stdout)
    json.dumps(report, allow_nan=False)
    triage = report["queues"]["pending_triage"]
    assert triage["never_due"] == 1
    assert triage["next_retry"]["in_s"] is None
    assert triage["next_retry"]["never"] == "run_after is infinity"
    distillation = report["queues"]["pending_distillation"]
    assert (distillation["leased"], distillation["leased_by"]) == (1, {})
    assert distillation["leased_without_owner"] == 1
    assert distillation["lease_never_ends"] == 1

    text = run_cli(["status"], env).stdout
    assert "infs" not in text
    assert "    next retry: item 1 never (run_after is infinity), after 0 attempt(s)" in text
    assert "    never due: 1 (run_after is infinity: no worker claims it;" in text
    assert "    leased by no worker (lease_owner is null): 1" in text
    assert "    leased for ever: 1 (lease_expires_at is infinity:" in text


def test_the_next_retry_that_comes_is_shown_before_one_that_never_does(
    tmp_path: Path, database_url: str
) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        insert_never_ending_rows(conn)
        conn.execute(
            "INSERT INTO pending_triage (payload, run_after, attempts) VALUES"
            """ ('{"exchange": "user: c\\nassistant: d"}', now() + interval '1 hour', 1)"""
        )
    env = cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url)
    triage = strict_json(run_cli(["status", "--json"], env).stdout)["queues"]["pending_triage"]
    assert (triage["backing_off"], triage["never_due"]) == (2, 1)
    assert triage["next_retry"]["item_id"] == 2
    assert 3500 <= triage["next_retry"]["in_s"] <= 3600
    assert "never" not in triage["next_retry"]


def test_usual_rows_add_no_keys(tmp_path: Path, database_url: str) -> None:
    """The counts of rows no worker writes appear only when there are any."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO pending_triage (payload, lease_owner, lease_expires_at) VALUES"
            """ ('{"exchange": "user: a"}', 'w1', now() + interval '5 minutes')"""
        )
    env = cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url)
    queues = strict_json(run_cli(["status", "--json"], env).stdout)["queues"]
    assert set(queues["pending_triage"]) == {
        "ready", "backing_off", "leased", "leased_by", "oldest_ready_age_s"
    }
    assert queues["pending_triage"]["leased_by"] == {"w1": 1}
