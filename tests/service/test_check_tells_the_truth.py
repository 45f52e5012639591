"""What `check` and the worker's start tell an operator, against a real database.

An operator's walk-through found: memories embedded by another model or dimension than the
configured one silently out of reach of the near-duplicate and contradiction checks while
`check` said "fits the embedding configuration"; email accounts failing `check` with email
checks turned off (SOKRATOS_EMAIL_CHECK_INTERVAL=0); and a `schema: schema: role ...` line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psycopg
import pytest
from pydantic import SecretStr

from sokratos_worker import schema_check
from sokratos_worker.checks import run_checks
from sokratos_worker.config import EmailAccountConfig, Settings
from sokratos_worker.model import CheckLine
from sokratos_worker.store import memories
from sokratos_worker.testing.scripted_llm import ScriptedLLM
from tests.core.test_cli import cli, env_for
from tests.faults.support import EMBED_DIM, answer, pipeline_env, start_worker, tail

pytestmark = pytest.mark.postgres

ROLES_SQL = (Path(__file__).resolve().parents[2] / "sql" / "roles.sql").read_text("utf-8")
# Nothing listens there: a probe of it fails at once.
NOWHERE = "http://127.0.0.1:9/v1"


def _save(db: psycopg.Connection, summary: str, dimension: int, model: str | None) -> None:
    db.execute(
        "INSERT INTO memories (summary, embedding, embedding_model)"
        " VALUES (%s, array_fill(0.1, ARRAY[%s])::vector, %s)",
        (summary, dimension, model),
    )


def _embedding_settings(database_url: str, model: str, dimension: int) -> Settings:
    return Settings(
        database_url=database_url,
        embedding_url=NOWHERE,
        embedding_model=model,
        embedding_dim=dimension,
    )


def _line(lines: list[CheckLine], component: str) -> CheckLine:
    (line,) = [line for line in lines if line.component == component]
    return line


def test_check_warns_of_memories_of_another_model_or_dimension(
    db: psycopg.Connection, database_url: str
) -> None:
    _save(db, "Ana lives in Porto", 16, "old-embed")
    _save(db, "Ana's grandmother is 90", 16, "old-embed")
    _save(db, "Ana plays the cello", 16, None)
    _save(db, "Ana moved to Lisbon", 32, "new-embed")
    _save(db, "Ana likes tea", 32, None)  # no model recorded, same dimension: compared
    db.execute("INSERT INTO memories (summary) VALUES ('saved without an embedding')")

    schema = _line(run_checks(_embedding_settings(database_url, "new-embed", 32)).lines, "schema")

    assert schema.ok, schema  # a warning: the exit code stays 0
    assert "fits the embedding configuration" not in schema.detail, schema.detail
    assert "warning: 3 memories carry embeddings of another model or dimension" in schema.detail
    assert "2 of old-embed, 16 dimensions" in schema.detail
    assert "1 of no model recorded, 16 dimensions" in schema.detail
    assert "near-duplicate and contradiction checks" in schema.detail
    assert "re-embedding them with the configured model" in schema.detail


def test_check_says_nothing_more_when_every_memory_fits(
    db: psycopg.Connection, database_url: str
) -> None:
    _save(db, "Ana moved to Lisbon", 32, "new-embed")
    _save(db, "Ana likes tea", 32, None)

    schema = _line(run_checks(_embedding_settings(database_url, "new-embed", 32)).lines, "schema")

    assert schema.ok and schema.detail == "migrations applied, fits the embedding configuration"


def test_a_large_store_is_counted_among_its_oldest_memories_only(
    db: psycopg.Connection, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(memories, "EMBEDDINGS_COUNTED", 2)
    monkeypatch.setattr(schema_check, "EMBEDDINGS_COUNTED", 2)
    for n in range(3):
        _save(db, f"old fact {n}", 16, "old-embed")

    with psycopg.connect(database_url) as conn:
        warning = schema_check.embedding_mismatch(
            _embedding_settings(database_url, "new-embed", 32), conn
        )

    assert warning is not None
    assert warning.startswith("2 memories of the oldest 2 with an embedding carry"), warning


@pytest.mark.subprocess
@pytest.mark.timeout(120)
def test_the_worker_logs_the_warning_once_at_start(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    _save(db, "Ana lives in Porto", 16, "scripted-embed")
    with ScriptedLLM(chat=answer) as chat, ScriptedLLM(embed_dim=EMBED_DIM) as embed:
        env = pipeline_env(database_url, tmp_path, [chat], embed)
        log = tmp_path / "worker.log"
        assert start_worker(env, log, "--once").wait(90) == 0, tail(log)

    events = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    warned = [e for e in events if e.get("event") == "memories_of_another_embedding_model"]
    assert len(warned) == 1, tail(log)
    assert warned[0]["warning"].startswith("1 memories carry embeddings"), warned[0]
    assert "1 of scripted-embed, 16 dimensions" in warned[0]["warning"]


def _email_settings(database_url: str, **extra: Any) -> Settings:
    account = EmailAccountConfig(
        name="home", host="127.0.0.1", port=9, username="ana", password=SecretStr("pw")
    )
    return Settings(database_url=database_url, email_accounts=[account], **extra)


def test_email_accounts_are_not_checked_when_email_checks_are_off(database_url: str) -> None:
    lines = run_checks(_email_settings(database_url, email_check_interval=0)).lines

    account = _line(lines, "email account home")
    assert account.ok, account  # the worker never logs in to it: no failure of check
    assert "not checked: SOKRATOS_EMAIL_CHECK_INTERVAL is 0" in account.detail


def test_email_accounts_are_checked_when_email_checks_are_on(database_url: str) -> None:
    account = _line(run_checks(_email_settings(database_url)).lines, "email account home")
    assert not account.ok, account  # nothing listens on port 9


def _as_worker_role(url: str) -> str:
    info = psycopg.conninfo.conninfo_to_dict(url)
    info["options"] = "-c role=sokratos_worker"
    return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})


def test_a_failed_schema_line_is_prefixed_once(db: psycopg.Connection, database_url: str) -> None:
    db.execute(ROLES_SQL)
    db.execute("REVOKE ALL ON work_outcomes FROM sokratos_worker")
    settings = Settings(database_url=_as_worker_role(database_url))

    schema = _line(run_checks(settings).lines, "schema")

    assert not schema.ok
    assert schema.detail.startswith("role sokratos_worker lacks"), schema.detail


def _as_producer_role(url: str) -> str:
    info = psycopg.conninfo.conninfo_to_dict(url)
    info["options"] = "-c role=sokratos_producer"
    return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})


@pytest.mark.subprocess
@pytest.mark.parametrize("form", [["--json"], []], ids=["json", "text"])
def test_status_of_a_role_without_the_grants_still_reports_with_exit_0(
    db: psycopg.Connection, database_url: str, tmp_path: Path, form: list[str]
) -> None:
    """sokratos_producer may only enqueue: `status --json` exited 78 with nothing on stdout,
    where `status --help` and the README promise exit 0 unless the login is refused."""
    db.execute(ROLES_SQL)
    shown = cli("status", *form, env=env_for(_as_producer_role(database_url), tmp_path))

    assert shown.returncode == 0, shown.stderr[-2000:]
    said = json.loads(shown.stdout)["unreadable"] if form else shown.stdout
    assert "permission denied for table sokratos_worker_migrations" in said, said
    assert "role sokratos_producer may not read the worker's tables" in said, said
    assert "sokratos_worker (sql/roles.sql" in said, said
    if form:
        assert json.loads(shown.stdout)["database"] == "ok"
