"""The real daemon and the operator commands as the least-privilege ``sokratos_worker`` role.

test_roles.py checks the grants statement by statement; this runs what the code actually
issues (triage, distillation, contradiction reads, dead-lettering, heartbeats, status, failed
list/show/retry/purge) under the role, with ``SOKRATOS_MIGRATE_ON_START`` left at ``true``.
"""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
import pytest

from sokratos_worker.testing.scripted_llm import ScriptedLLM
from tests.faults.support import (
    EMBED_DIM,
    POISON,
    Key,
    answer,
    assert_exactly_once,
    cli,
    enqueue_distillation,
    enqueue_triage,
    exchange,
    insert_raw,
    pipeline_env,
    start_worker,
    tail,
    text_archive,
)

pytestmark = [pytest.mark.postgres, pytest.mark.subprocess, pytest.mark.slow]

ROLES_SQL = (Path(__file__).resolve().parents[2] / "sql" / "roles.sql").read_text("utf-8")


def _as_worker_role(url: str) -> str:
    """The test database with every session running as sokratos_worker (set at login)."""
    info = psycopg.conninfo.conninfo_to_dict(url)
    info["options"] = "-c role=sokratos_worker"
    return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})


@pytest.mark.timeout(180)
def test_the_daemon_and_the_failed_commands_work_as_the_worker_role(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    db.execute(ROLES_SQL)
    db.execute(
        "INSERT INTO adaptive_params (key, value, source) VALUES"
        " ('triage_conversation_threshold', 5, 'reflection')"
    )
    keys: list[Key] = [
        enqueue_triage(db, exchange("tokrole1", save=True)),
        enqueue_triage(db, exchange("tokrole1", save=True)),  # a near-duplicate of the first
        enqueue_triage(db, exchange("tokrole2", save=False)),
        enqueue_distillation(db, text_archive("tokrole3")),
        enqueue_distillation(db, text_archive("tokrole4", poison=True)),  # archived raw
    ]
    unanswerable = {"exchange": f"user: tokrole5 {POISON} keep this\nassistant: ok"}
    keys.append(enqueue_triage(db, unanswerable))  # dead-lettered, then retried below
    bad = insert_raw(db, "pending_triage", '{"exchange": 5}', "conversation")
    keys.append(bad)
    with ScriptedLLM(chat=answer) as chat, ScriptedLLM(embed_dim=EMBED_DIM) as embed:
        env = pipeline_env(
            _as_worker_role(database_url), tmp_path, [chat], embed, SOKRATOS_MAX_ATTEMPTS="1"
        )
        log = tmp_path / "worker.log"
        proc = start_worker(env, log, "--once")
        assert proc.wait(120) == 0, tail(log)

        fig = assert_exactly_once(db, keys)
        assert fig.by_outcome.get("failed") == 2, (fig, tail(log))
        assert fig.by_outcome.get("archived") == 1, (fig, tail(log))
        assert "InsufficientPrivilege" not in log.read_text()
        assert "permission denied" not in log.read_text()
        assert db.execute("SELECT count(*) FROM worker_heartbeats").fetchone() == (1,)

        status = cli(env, "status", "--json")
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["database"] == "ok"

        listed = cli(env, "failed", "list", "--json", "--op-type", "conversation_triage")
        assert listed.returncode == 0, listed.stderr
        failures = [json.loads(line) for line in listed.stdout.splitlines()]
        assert len(failures) == 2
        (failure,) = [f for f in failures if "invalid payload" not in f["error_message"]]
        shown = cli(env, "failed", "show", str(failure["id"]))
        assert shown.returncode == 0, shown.stderr
        retried = cli(env, "failed", "retry", str(failure["id"]))
        assert retried.returncode == 0, retried.stderr + retried.stdout
        requeued = db.execute("SELECT payload FROM pending_triage").fetchall()
        assert requeued == [(unanswerable,)]
        purged = cli(env, "failed", "purge", "--older-than", "1")
        assert purged.returncode == 0, purged.stderr
        assert "deleted 0 failures" in purged.stdout
