"""The command line as an operator uses it: help, enqueue, status, failed, run with no config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from sokratos_worker.cli import build_parser
from tests.support.db import count, enqueue_many

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ["run", "migrate", "enqueue", "status", "failed", "check", "demo"]


def cli(
    *args: str, env: dict[str, str], stdin: str | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sokratos_worker", *args],
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=ROOT,
    )


def env_for(database_url: str | None, tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("SOKRATOS_") and k != "DATABASE_URL"
    }
    env.update(HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT), SOKRATOS_LOG_FORMAT="json")
    if database_url:
        env["SOKRATOS_DATABASE_URL"] = database_url
    env.update(extra)
    return env


def test_help_documents_every_command() -> None:
    text = build_parser().format_help()
    for command in COMMANDS:
        assert command in text
    for args in (
        ["run"],
        ["enqueue", "triage"],
        ["enqueue", "distillation"],
        ["status"],
        ["failed", "retry"],
        ["failed", "list"],
        ["failed", "purge"],
        ["check"],
        ["demo"],
    ):
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args([*args, "--help"])
        assert info.value.code == 0


def _subcommand_help(*names: str) -> str:
    return " ".join(_subparser(build_parser(), *names).format_help().split())


def test_help_states_the_exit_codes_and_what_is_left_out() -> None:
    run = _subcommand_help("run")
    assert "--once exits 75" in run and "no LLM backend configured" in run
    assert "--no-migrate" in run.split("options:")[0]
    retry = _subcommand_help("failed", "retry")
    assert "exit 1" in retry and "spool files the import refused" in retry
    assert "spool" in _subcommand_help("status")
    assert "SOKRATOS_FAILED_OPS_TTL_DAYS" in _subcommand_help("failed", "purge")
    top = " ".join(build_parser().format_help().split())
    assert "failed: at once" in top and "status exits 0" in top and "check exits 1" in top


def test_enqueue_prints_the_id_and_a_known_key_returns_it_again(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    env = env_for(database_url, tmp_path)
    first = cli(
        "enqueue",
        "triage",
        "--exchange",
        "-",
        "--key",
        "k1",
        env=env,
        stdin="user: my sister is called Ana\nassistant: noted",
    )
    second = cli("enqueue", "triage", "--exchange", "other", "--key", "k1", env=env)
    assert first.returncode == 0 and second.returncode == 0, first.stderr
    assert first.stdout.strip() == second.stdout.strip() and first.stdout.strip().isdigit()
    archive = tmp_path / "a.json"
    archive.write_text(json.dumps({"archive_text": "[Conversation archived]\nuser: hi"}))
    third = cli("enqueue", "distillation", "--file", str(archive), env=env)
    assert third.returncode == 0 and third.stdout.strip().isdigit()
    assert count(db, "SELECT count(*) FROM pending_triage") == 1
    assert count(db, "SELECT count(*) FROM pending_distillation") == 1


def test_enqueue_invalid_input_exits_1_with_a_message(database_url: str, tmp_path: Path) -> None:
    env = env_for(database_url, tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text('{"messages": "not a list"}')
    proc = cli("enqueue", "distillation", "--file", str(bad), env=env)
    assert proc.returncode == 1 and "payload.messages" in proc.stderr
    proc = cli("enqueue", "distillation", "--file", str(tmp_path / "missing.json"), env=env)
    assert proc.returncode == 1 and "cannot read" in proc.stderr


def test_enqueue_with_the_database_down_spools(tmp_path: Path) -> None:
    env = env_for(
        "postgresql://x@127.0.0.1:1/none", tmp_path, SOKRATOS_DATA_DIR=str(tmp_path / "d")
    )
    proc = cli("enqueue", "triage", "--exchange", "user: hello world\nassistant: hi", env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("spooled ")
    assert Path(proc.stdout.split(" ", 1)[1].strip()).exists()


def test_status_json_has_the_contract_keys(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    enqueue_many(db, 3)
    proc = cli("status", "--json", env=env_for(database_url, tmp_path))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["database"] == "ok"
    assert set(report) >= {"database", "queues", "failures_24h", "workers", "email_accounts"}
    triage = report["queues"]["pending_triage"]
    assert set(triage) >= {"ready", "backing_off", "leased", "oldest_ready_age_s"}
    assert triage["ready"] == 3
    human = cli("status", env=env_for(database_url, tmp_path))
    assert "pending_triage: 3 ready" in human.stdout


def test_status_names_a_table_another_session_locks_instead_of_waiting(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """An operator asking during a migration: `status` waited for as long as the lock."""
    enqueue_many(db, 2)
    with psycopg.connect(database_url, application_name="a-migration") as locker:
        locker.execute("LOCK TABLE pending_triage, worker_heartbeats IN ACCESS EXCLUSIVE MODE")
        holder = locker.info.backend_pid
        proc = cli("status", "--json", env=env_for(database_url, tmp_path), timeout=60)
        human = cli("status", env=env_for(database_url, tmp_path), timeout=60)
        locker.rollback()
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["unknown_locked"] == ["pending_triage", "workers"]
    assert {(t["table"], t["pid"], t["application"]) for t in report["locked_tables"]} == {
        ("pending_triage", holder, "a-migration"),
        ("worker_heartbeats", holder, "a-migration"),
    }
    assert report["queues"]["pending_distillation"]["ready"] == 0  # the rest is still read
    lines = human.stdout.splitlines()
    assert "pending_triage: unknown (its table is locked by another session: see 'locked')" in lines
    assert any(
        line.startswith(f"locked: pending_triage, worker_heartbeats by pid {holder} (a-migration,")
        and line.endswith(f"SELECT pg_terminate_backend({holder})")
        for line in lines
    ), human.stdout
    assert "workers: unknown (its table is locked by another session: see 'locked')" in lines
    assert "failures (24h): none" in lines


def test_status_does_not_wait_for_tables_it_sees_locked(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """Each read used to wait its 2 s lock timeout: 12 s or more with every table held."""
    from sokratos_worker.store.status import WORKER_TABLES

    with psycopg.connect(database_url, application_name="a-migration") as locker:
        locker.execute(f"LOCK TABLE {', '.join(WORKER_TABLES)} IN ACCESS EXCLUSIVE MODE")
        started = time.monotonic()
        proc = cli("status", env=env_for(database_url, tmp_path), timeout=60)
        took = time.monotonic() - started
        locker.rollback()
    assert proc.returncode == 0, proc.stderr
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("locked: ")]
    assert line.startswith(f"locked: {', '.join(sorted(WORKER_TABLES))} by pid"), line
    assert took < 8, f"status took {took:.1f} s behind the lock"


def test_status_with_the_database_down_says_so(tmp_path: Path) -> None:
    proc = cli("status", "--json", env=env_for("postgresql://x@127.0.0.1:1/none", tmp_path))
    assert proc.returncode == 0
    assert json.loads(proc.stdout)["database"] == "unreachable"


def test_failed_list_show_retry_purge(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    from sokratos_worker.model import Queue
    from sokratos_worker.store import queue as store

    enqueue_many(db, 1, behaviour="fail")
    (item,) = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
    store.dead_letter(db, item, owner="w", error="model said no")
    env = env_for(database_url, tmp_path)
    listing = cli("failed", "list", env=env)
    assert "conversation_triage" in listing.stdout and "model said no" in listing.stdout
    failure_id = listing.stdout.split()[0]
    shown = json.loads(cli("failed", "show", failure_id, env=env).stdout)
    assert shown["context_data"]["payload"]["behaviour"] == "fail"
    first = cli("failed", "retry", failure_id, env=env)
    second = cli("failed", "retry", "--all", env=env)
    assert first.returncode == 0 and "re-enqueued" in first.stdout
    assert second.returncode == 0 and "re-enqueued" not in second.stdout
    assert count(db, "SELECT count(*) FROM pending_triage") == 1
    db.execute("UPDATE failed_operations SET created_at = now() - interval '2 days'")
    purge = cli("failed", "purge", "--older-than", "1", env=env)
    assert purge.returncode == 0 and "deleted 1" in purge.stdout


def test_failed_retry_of_a_record_naming_an_unknown_queue_is_refused_not_a_traceback(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """A failed_operations row written by hand or by Sokratos may name any source_queue."""
    failure_id = count(
        db,
        "INSERT INTO failed_operations (op_type, label, error_message, context_data,"
        " source_queue) VALUES ('conversation_triage', 'x', 'e',"
        " '{\"payload\": {\"exchange\": \"user: hi\"}}', 'pending_somewhere') RETURNING id",
    )
    retried = cli("failed", "retry", str(failure_id), env=env_for(database_url, tmp_path))
    assert "Traceback" not in retried.stderr, retried.stderr
    assert "'pending_somewhere' is not a queue of this worker" in retried.stdout + retried.stderr
    assert count(db, "SELECT count(*) FROM pending_triage") == 0


def test_failed_retry_all_says_what_it_leaves_out(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """It printed only "nothing to retry" while spool files, unreadable mail and Sokratos's own
    rows waited, unnamed."""
    db.execute(
        "INSERT INTO failed_operations (op_type, label, error_message, context_data) VALUES"
        " ('spool_import', 'f.json', 'e', '{}'), ('email_message', 'home UID 2', 'e', '{}'),"
        " ('distillation', 'sokratos', 'e', NULL)"
    )
    retried = cli("failed", "retry", "--all", env=env_for(database_url, tmp_path))
    assert retried.returncode == 0, retried.stderr
    assert (
        "skipped 3 failures that are not queue items (1 distillation, 1 email_message,"
        " 1 spool_import): retry one by ID" in retried.stdout
    ), retried.stdout
    assert "nothing to retry" in retried.stdout
    # A mistyped --op-type is named with the op_types there are, as `failed list` does.
    typo = cli(
        "failed", "retry", "--all", "--op-type", "conversation_triag",
        env=env_for(database_url, tmp_path),
    )
    assert typo.stdout.strip().endswith(
        "nothing to retry: no failures of op_type 'conversation_triag' (op_types with"
        " failures: distillation, email_message, spool_import)"
    ), typo.stdout
    known = cli(
        "failed", "retry", "--all", "--op-type", "spool_import", env=env_for(database_url, tmp_path)
    )
    assert known.stdout.strip().endswith("nothing to retry"), known.stdout


def test_failed_commands_say_what_to_do_next(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """A row Sokratos wrote was "refused: no stored payload" with no next step; a mistyped
    --op-type listed "no failures" as if there were none; purge said "1 days"."""
    failure_id = count(
        db,
        "INSERT INTO failed_operations (op_type, label, error_message, context_data)"
        " VALUES ('memory_save', 'sokratos', 'e', NULL) RETURNING id",
    )
    env = env_for(database_url, tmp_path)
    retried = cli("failed", "retry", str(failure_id), env=env)
    assert "no stored payload" in retried.stdout, retried.stdout + retried.stderr
    assert "replay it from the application that wrote it" in retried.stdout
    assert "'failed purge --older-than DAYS'" in retried.stdout
    typo = cli("failed", "list", "--op-type", "memory_sav", env=env)
    assert typo.returncode == 0, typo.stderr
    assert typo.stdout.strip() == (
        "no failures of op_type 'memory_sav' (op_types with failures: memory_save)"
    )
    assert cli("failed", "list", "--op-type", "memory_save", env=env).stdout.startswith(
        f"{failure_id:>6}"
    )
    db.execute("UPDATE failed_operations SET created_at = now() - interval '2 days'")
    purge = cli("failed", "purge", "--older-than", "1", env=env)
    assert purge.stdout.strip() == "deleted 1 failures older than 1 day", purge.stdout
    empty = cli("failed", "list", "--op-type", "memory_save", env=env)
    assert empty.stdout.strip() == "no failures of op_type 'memory_save' (no failures at all)"


def test_failed_list_prints_one_line_per_failure(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """An error holding a newline (PostgreSQL's "\nDETAIL: ...") split a failure over lines
    that looked like rows and carried no id."""
    for error in (
        "database refused the write: duplicate key\nDETAIL:  Key (origin)=(x) already exists.",
        "second failure\r\n\tcontinued",
    ):
        db.execute(
            "INSERT INTO failed_operations (op_type, label, error_message, context_data,"
            " source_queue, item_id) VALUES ('conversation_triage', 'l', %s, %s,"
            " 'pending_triage', nextval('pending_triage_id_seq'))",
            (error, Jsonb({"payload": {"exchange": "user: hi\nassistant: ho"}})),
        )
    done = cli("failed", "list", env=env_for(database_url, tmp_path))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2, lines
    ids = [int(r[0]) for r in db.execute("SELECT id FROM failed_operations ORDER BY id DESC")]
    assert [int(line.split()[0]) for line in lines] == ids


def test_failed_show_and_retry_read_a_dead_letter_nested_deeper_than_python_parses(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    from sokratos_worker.model import Item, Queue
    from sokratos_worker.store import queue as store

    # Written by the worker's own dead_letter, as for a payload it read at claim, but nested
    # deeper than Python's json follows from any stack (the claim's depth varies with it).
    deep = '{"a": ' * 3000 + "1" + "}" * 3000
    payload = '{"exchange": "user: hi\\nassistant: ok", "deep": ' + deep + "}"
    row = db.execute(
        "INSERT INTO pending_triage (payload, idempotency_key, lease_owner, attempts)"
        " VALUES (%s::jsonb, 'deep-1', 'w', 3) RETURNING id, created_at",
        (payload,),
    ).fetchone()
    assert row is not None
    item = Item(Queue.TRIAGE, row[0], {"exchange": "user: hi"}, 3, "conversation", "deep-1", row[1])
    assert store.dead_letter(db, item, owner="w", error="model said no").settled
    (failure_id,) = (str(r[0]) for r in db.execute("SELECT id FROM failed_operations"))
    env = env_for(database_url, tmp_path)
    shown = cli("failed", "show", failure_id, env=env)
    assert shown.returncode == 0 and "Traceback" not in shown.stderr, shown.stderr
    stored = db.execute("SELECT (context_data -> 'payload')::text FROM failed_operations").fetchone()
    assert stored is not None and stored[0] in shown.stdout  # the whole payload, exactly
    assert '"error_message": "model said no"' in shown.stdout
    assert f"failure {failure_id}: its context_data (" in shown.stderr
    assert "nested too deeply" in shown.stderr
    first = cli("failed", "retry", failure_id, env=env)
    again = cli("failed", "retry", failure_id, env=env)
    assert first.returncode == 0 and "re-enqueued as pending_triage item" in first.stdout, (
        first.stdout + first.stderr
    )
    assert again.returncode == 0 and "nothing done" in again.stdout, again.stdout + again.stderr
    replayed = db.execute(
        "SELECT p.payload = f.context_data -> 'payload', p.idempotency_key, f.retried_as = p.id"
        " FROM pending_triage p, failed_operations f"
    ).fetchall()
    assert replayed == [(True, "deep-1#retry-1", True)]


def test_failed_show_prints_every_digit_of_the_stored_numbers(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """The dead letter keeps the queue's numbers exactly (PostgreSQL's numeric); `failed show`
    printed them as Python floats: 0.1000000000000000055511151231257827 as 0.1, 1e-400 as 0.0,
    so a payload repaired from it and enqueued by hand lost them."""
    from decimal import Decimal

    from sokratos_worker.model import Queue
    from sokratos_worker.store import queue as store

    db.execute(
        "INSERT INTO pending_triage (payload) VALUES (jsonb_build_object('exchange', 'user: hi',"
        " 'amount', 0.1000000000000000055511151231257827, 'tiny', 1e-400::numeric,"
        " 'plain', 2.5, 'count', 3))"
    )
    (item,) = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
    assert store.dead_letter(db, item, owner="w", error="model said no").settled
    (failure_id,) = (str(r[0]) for r in db.execute("SELECT id FROM failed_operations"))
    shown = cli("failed", "show", failure_id, env=env_for(database_url, tmp_path))
    assert shown.returncode == 0 and not shown.stderr, shown.stderr
    payload = json.loads(shown.stdout, parse_float=Decimal)["context_data"]["payload"]
    assert payload["amount"] == Decimal("0.1000000000000000055511151231257827"), payload
    assert payload["tiny"] == Decimal("1e-400"), payload
    assert (payload["plain"], payload["count"]) == (Decimal("2.5"), 3), payload
    assert '\n      "plain": 2.5,\n' in shown.stdout  # indented as every record


@pytest.mark.subprocess
def test_run_with_no_configuration_starts_the_embedded_postgres(
    tmp_path: Path, short_home: Path
) -> None:
    env = env_for(None, tmp_path, HOME=str(short_home))
    proc = cli("run", "--once", env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [
        json.loads(line)["event"] for line in proc.stderr.splitlines() if line.startswith("{")
    ]
    assert "embedded_postgres_ready" in events and "tick_finished" in events
    assert (short_home / ".local/share/sokratos-worker/postgres/PG_VERSION").exists()
    # A second command attaches to (or restarts) the same data directory.
    again = cli("status", "--json", env=env, timeout=120)
    assert json.loads(again.stdout)["database"] == "ok"
    # A one-shot command's answer is not buried under the server's start and release lines.
    assert not again.stderr, again.stderr
    told = cli("status", env={**env, "SOKRATOS_LOG_LEVEL": "info"}, timeout=120)
    assert "embedded_postgres_ready" in told.stderr, told.stderr


def test_check_probes_everything_and_names_what_failed(database_url: str, tmp_path: Path) -> None:
    from sokratos_worker.testing.scripted_llm import ScriptedLLM

    with ScriptedLLM() as good:
        backends = json.dumps(
            [
                {"name": "good", "url": good.url, "model": "m", "timeout": "5s"},
                {"name": "gone", "url": "http://127.0.0.1:1/v1", "model": "m", "timeout": "2s"},
            ]
        )
        proc = cli("check", env=env_for(database_url, tmp_path, SOKRATOS_LLM_BACKENDS=backends))
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert any(line.startswith("ok") and "database" in line for line in lines)
    assert any(line.startswith("FAIL") and "gone" in line for line in lines)
    assert any(
        line.startswith("ok") and "a worker opens up to 9 (SOKRATOS_CONCURRENCY 4 + 4 + 1 for"
        " LISTEN)" in line
        for line in lines
    ), lines
    assert "gone" in proc.stderr


def test_check_fails_when_a_connection_limit_is_below_the_workers_pool(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    # A worker with 8 slots would hold 8 connections and wait for the rest (measured 17x slower).
    role = "check_test_limited"
    db.execute(f"DROP ROLE IF EXISTS {role}")
    db.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'test-only-password' CONNECTION LIMIT 10")
    try:
        info = psycopg.conninfo.conninfo_to_dict(database_url)
        info.update(user=role, password="test-only-password")
        url = psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})
        proc = cli("check", env=env_for(url, tmp_path, SOKRATOS_CONCURRENCY="8"))
        ran = cli("run", "--once", env=env_for(url, tmp_path, SOKRATOS_CONCURRENCY="2"))
    finally:
        db.execute(f"DROP ROLE IF EXISTS {role}")
    assert ran.returncode == 78 and "give it sokratos_worker" in ran.stderr, ran.stderr[-2000:]
    assert "permission denied for table sokratos_worker_migrations" in ran.stderr
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if "connections" in x)
    assert line.startswith("FAIL"), proc.stdout
    assert "opens up to 13" in line and f"role {role} has CONNECTION LIMIT 10" in line
    assert "lower SOKRATOS_CONCURRENCY" in line
    # (The role was granted nothing: check says so rather than a traceback.)
    line = next(x for x in proc.stdout.splitlines() if "schema" in x)
    assert line.startswith("FAIL") and "grant it sokratos_worker" in line, proc.stdout


def test_enqueue_without_migrations_exits_1_naming_migrate(
    empty_database_url: str, tmp_path: Path
) -> None:
    env = env_for(empty_database_url, tmp_path, SOKRATOS_DATA_DIR=str(tmp_path / "d"))
    proc = cli("enqueue", "triage", "--exchange", "user: hi\nassistant: hello", env=env)
    assert proc.returncode == 1, proc.stdout
    assert "sokratos-worker migrate" in proc.stderr and "Traceback" not in proc.stderr
    assert "spooled" not in proc.stdout and not (tmp_path / "d" / "spool").exists()


def test_enqueue_without_the_producer_grant_exits_1_naming_the_role(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    # Roles are cluster-wide: a name outside 'sokratos_%' (test_roles lists those), dropped after.
    role = "enqueue_test_outsider"
    db.execute((ROOT / "sql" / "roles.sql").read_text("utf-8"))
    db.execute(f"DROP ROLE IF EXISTS {role}")
    db.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'test-only-password'")
    try:
        info = psycopg.conninfo.conninfo_to_dict(database_url)
        info.update(user=role, password="test-only-password")
        url = psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})
        try:
            psycopg.connect(url).close()
        except psycopg.OperationalError as exc:  # e.g. pg_hba allows only the superuser
            pytest.skip(f"the server refuses other logins: {exc}")
        env = env_for(url, tmp_path, SOKRATOS_DATA_DIR=str(tmp_path / "d"))
        proc = cli("enqueue", "distillation", "--file", "-", env=env, stdin='{"archive_text": "a"}')
    finally:
        db.execute(f"DROP ROLE IF EXISTS {role}")
    assert proc.returncode == 1, proc.stdout
    assert "sokratos_producer" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "d" / "spool").exists()


def test_enqueue_when_the_embedded_postgres_cannot_start_spools_a_checked_payload(
    tmp_path: Path,
) -> None:
    data = tmp_path / "d"
    data.mkdir()
    (data / "postgres").write_text("not a data directory")  # initdb fails at once
    env = env_for(None, tmp_path, SOKRATOS_DATA_DIR=str(data))
    bad = cli("enqueue", "distillation", "--file", "-", env=env, stdin='{"messages": 5}')
    assert bad.returncode == 1 and "payload.messages" in bad.stderr
    assert not (data / "spool").exists()
    proc = cli("enqueue", "triage", "--exchange", "-", env=env, stdin="user: a\x00b\nassistant: ok")
    assert proc.returncode == 0, proc.stderr
    record = json.loads(Path(proc.stdout.removeprefix("spooled ").strip()).read_text("utf-8"))
    assert record["payload"]["exchange"].startswith("user: a\\u0000b")  # escaped, noted
    assert record["payload"]["_sanitized"]
    # status reports it as the contract's "unreachable" (scripts read that field), exit 0.
    status = cli("status", "--json", env=env)
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report["database"] == "unreachable" and "could not start" in report["error"]
    assert report["spooled"] == 1


def test_enqueue_that_cannot_write_the_spool_says_so(tmp_path: Path) -> None:
    data = tmp_path / "d"
    data.mkdir()
    (data / "spool").write_text("a file where the spool directory should be")
    env = env_for("postgresql://x@127.0.0.1:1/none", tmp_path, SOKRATOS_DATA_DIR=str(data))
    proc = cli("enqueue", "triage", "--exchange", "user: hi\nassistant: hello", env=env)
    # 75, not 1: nothing is wrong with the input, a producer should try again later.
    assert proc.returncode == 75 and "Traceback" not in proc.stderr
    assert "spool cannot be written" in proc.stderr and "nothing was enqueued" in proc.stderr
    assert "None" not in proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["failed", "purge", "--older-than", "0"], "--older-than: must be from 1 to 36500"),
        (["failed", "purge", "--older-than", "-3"], "--older-than: must be from 1 to 36500"),
        (["failed", "purge"], "--older-than"),
        (["failed", "list", "--limit", "-1"], "--limit: must be from 1 to "),
        (["failed", "retry"], "name the failure IDs to retry"),
        (["failed", "retry", "3", "--all"], "not both"),
        (["failed", "retry", "3", "--op-type", "distillation"], "--op-type only with --all"),
        (["failed", "show", "seven"], "invalid int value"),
        (["enqueue", "sideways"], "invalid choice"),
    ],
)
def test_usage_errors_exit_1_before_touching_the_database(
    args: list[str], message: str, tmp_path: Path
) -> None:
    """An unreachable database with a 1 s deadline: reaching for it would exit 75."""
    env = env_for("postgresql://x@127.0.0.1:1/none", tmp_path, SOKRATOS_STARTUP_TIMEOUT="1s")
    proc = cli(*args, env=env)
    assert proc.returncode == 1, proc.stderr
    assert message in proc.stderr and "error:" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_help_explains_the_failed_and_status_options() -> None:
    def help_of(*args: str) -> str:
        return " ".join(_subparser(build_parser(), *args).format_help().split())

    assert "ID " in help_of("failed", "show") and "one failure" in help_of("failed", "show")
    assert "days" in help_of("failed", "purge") and "1 to 36500" in help_of("failed", "purge")
    retry = help_of("failed", "retry")
    assert "--all" in retry and "not both" in retry
    status = help_of("status")
    assert "exits 0 even when the database is unreachable" in status
    assert "embedded PostgreSQL" in status


def _subparser(parser: Any, *names: str) -> Any:
    for name in names:
        action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
        parser = action.choices[name]
    return parser


def test_every_command_names_unknown_variables_on_stderr(
    database_url: str, tmp_path: Path
) -> None:
    env = env_for(database_url, tmp_path, SOKRATOS_CONCURENCY="4")  # the typo is the point
    status = cli("status", "--json", env=env)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["database"] == "ok"  # stdout stays machine-readable
    assert "unknown variables ignored: SOKRATOS_CONCURENCY" in status.stderr
    enqueue = cli("enqueue", "triage", "--exchange", "user: hi", env=env)
    assert enqueue.returncode == 0, enqueue.stderr
    assert "SOKRATOS_CONCURENCY" in enqueue.stderr


def test_status_and_failed_on_a_database_not_migrated_say_so_in_one_line(
    empty_database_url: str, tmp_path: Path
) -> None:
    env = env_for(empty_database_url, tmp_path)
    status = cli("status", "--json", env=env)
    assert status.returncode == 0 and "Traceback" not in status.stderr, status.stderr
    report = json.loads(status.stdout)
    assert report["database"] == "ok"
    assert report["migrations_pending"][:2] == ["0001_pgvector", "0002_tables"]
    assert "does not exist: run 'sokratos-worker migrate'" in report["unreadable"]
    text = cli("status", env=env).stdout
    assert "schema: lacks 0001_pgvector, 0002_tables" in text
    assert "queues, failures (24h), outcomes (24h), workers, email accounts: unknown (relation" in text
    for args in (("failed", "list"), ("failed", "show", "1"), ("failed", "retry", "--all")):
        proc = cli(*args, env=env)
        assert proc.returncode == 1, (args, proc.stdout)
        assert "Traceback" not in proc.stderr, proc.stderr
        assert "run 'sokratos-worker migrate' first" in proc.stderr, proc.stderr


def test_check_on_a_fresh_database_without_backends_still_probes_the_embeddings(
    empty_database_url: str, tmp_path: Path
) -> None:
    env = env_for(
        empty_database_url,
        tmp_path,
        SOKRATOS_EMBEDDING_URL="http://127.0.0.1:1/v1",
        SOKRATOS_EMBEDDING_MODEL="m",
        SOKRATOS_EMBEDDING_DIM="8",
    )
    proc = cli("check", env=env)
    assert proc.returncode == 1
    lines = {line.split()[1].rstrip(":"): line for line in proc.stdout.splitlines() if line}
    # The server offers pgvector: migrate creates it; no superuser detour to suggest.
    assert lines["pgvector"].startswith("FAIL")
    assert "not created in this database: 'sokratos-worker migrate' creates it" in lines["pgvector"]
    assert lines["llm_backends"].startswith("FAIL")
    assert lines["embeddings"].startswith("FAIL"), proc.stdout  # probed, not skipped


def test_run_once_exits_75_when_no_backend_could_take_the_items(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    enqueue_many(db, 2)
    backends = json.dumps([{"name": "gone", "url": "http://127.0.0.1:1/v1", "model": "m"}])
    env = env_for(database_url, tmp_path, SOKRATOS_LLM_BACKENDS=backends)
    proc = cli("run", "--once", env=env)
    assert proc.returncode == 75, proc.stderr[-2000:]
    assert "run_once_incomplete" in proc.stderr
    # The pause says this run ends (not that claiming resumes by itself), and the tick's
    # report the state the drain ended in (not "stopping", as every --once said).
    events = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    (paused,) = [e for e in events if e["event"] == "claiming_paused"]
    assert "this run --once claims no more and exits 75" in paused["hint"], paused
    (tick,) = [e for e in events if e["event"] == "tick_finished"]
    assert tick["state"] == "no backend", tick
    # Not the items' fault: both wait, their attempts given back.
    assert count(db, "SELECT count(*) FROM pending_triage WHERE attempts = 0") == 2
    assert count(db, "SELECT count(*) FROM work_outcomes") == 0


@pytest.mark.parametrize(
    ("variable", "field"),
    [
        ("SOKRATOS_LLM_BACKENDS", "SOKRATOS_LLM_BACKENDS[0].ca_file"),
        ("SOKRATOS_EMAIL_ACCOUNTS", "SOKRATOS_EMAIL_ACCOUNTS[0].ca_file"),
    ],
)
def test_a_missing_ca_file_exits_78_naming_the_field_and_the_path(
    tmp_path: Path, variable: str, field: str
) -> None:
    missing = str(tmp_path / "ca.pem")
    entries = {
        "SOKRATOS_LLM_BACKENDS": {"name": "a", "url": "https://127.0.0.1:1/v1", "model": "m"},
        "SOKRATOS_EMAIL_ACCOUNTS": {"name": "a", "host": "h", "username": "u", "password": "p"},
    }
    value = json.dumps([{**entries[variable], "ca_file": missing}])
    env = env_for(None, tmp_path, SOKRATOS_DATA_DIR=str(tmp_path / "data"), **{variable: value})
    for command in (["check"], ["run", "--once"]):
        proc = cli(*command, env=env)
        assert proc.returncode == 78, (command, proc.stderr)
        assert "Traceback" not in proc.stderr
        assert proc.stderr.strip() == (
            f"sokratos-worker: invalid configuration: {field}: {missing!r} does not exist"
        )


def test_enqueue_behind_a_locked_queue_spools_it_and_the_worker_imports_it_once(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """A producer calling `enqueue` during a migration waited for as long as the lock."""
    from sokratos_worker.spool import import_spool
    from sokratos_worker.store.connection import Database

    env = env_for(database_url, tmp_path, SOKRATOS_DATA_DIR=str(tmp_path / "d"))
    with psycopg.connect(database_url, application_name="a-migration") as locker:
        locker.execute("LOCK TABLE pending_triage IN ACCESS EXCLUSIVE MODE")
        holder = locker.info.backend_pid
        proc = cli("enqueue", "triage", "--exchange", "user: hi\nassistant: hello", env=env)
        locked = count(db, "SELECT count(*) FROM pending_distillation")  # other tables readable
        locker.rollback()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("spooled "), proc.stdout
    (said,) = [
        json.loads(line) for line in proc.stderr.splitlines() if "enqueue_table_locked" in line
    ]
    assert f"pending_triage is held by pid {holder} (a-migration," in said["reason"]
    assert said["reason"].endswith(f"to end it now: SELECT pg_terminate_backend({holder})")
    assert locked == 0 and count(db, "SELECT count(*) FROM pending_triage") == 0
    spool = tmp_path / "d" / "spool"
    database = Database(database_url, size=1)
    try:
        assert import_spool(spool, database) == 1
        assert import_spool(spool, database) == 0
    finally:
        database.close()
    exchanges = db.execute("SELECT payload->>'exchange' FROM pending_triage").fetchall()
    assert exchanges == [("user: hi\nassistant: hello",)]


def test_enqueue_behind_a_locked_queue_with_no_spool_exits_75_naming_the_holder(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    data = tmp_path / "d"
    data.mkdir()
    (data / "spool").write_text("a file where the spool directory should be")
    env = env_for(database_url, tmp_path, SOKRATOS_DATA_DIR=str(data))
    with psycopg.connect(database_url, application_name="a-migration") as locker:
        # SHARE blocks writes only (CREATE INDEX without CONCURRENTLY takes it).
        locker.execute("LOCK TABLE pending_triage IN SHARE MODE")
        holder = locker.info.backend_pid
        proc = cli("enqueue", "triage", "--exchange", "user: hi\nassistant: hello", env=env)
        locker.rollback()
    assert proc.returncode == 75 and "Traceback" not in proc.stderr, proc.stderr
    assert "its queue table locked" in proc.stderr and "nothing was enqueued" in proc.stderr
    assert f"pending_triage is held by pid {holder} (a-migration," in proc.stderr
    assert count(db, "SELECT count(*) FROM pending_triage") == 0


def test_failed_retry_behind_a_locked_queue_names_the_holder_and_retries_later_once(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    from sokratos_worker.model import Queue
    from sokratos_worker.store import queue as store

    enqueue_many(db, 2, behaviour="fail")
    for item in store.claim(db, Queue.TRIAGE, owner="w", limit=2, lease_s=60):
        store.dead_letter(db, item, owner="w", error="model said no")
    ids = [r[0] for r in db.execute("SELECT id FROM failed_operations ORDER BY id").fetchall()]
    env = env_for(database_url, tmp_path)
    with psycopg.connect(database_url, application_name="a-migration") as locker:
        locker.execute("LOCK TABLE pending_triage IN SHARE MODE")
        holder = locker.info.backend_pid
        listing = cli("failed", "list", env=env)  # reads are not blocked by SHARE
        proc = cli("failed", "retry", "--all", env=env)
        locker.rollback()
    assert listing.returncode == 0 and "model said no" in listing.stdout
    assert proc.returncode == 75 and "Traceback" not in proc.stderr, proc.stderr
    assert f"failed retry {ids[0]}: gave up after 5 s waiting for a lock" in proc.stderr
    assert f"pending_triage is held by pid {holder} (a-migration," in proc.stderr
    assert f"(not retried: {ids[0]}, {ids[1]})" in proc.stderr
    assert count(db, "SELECT count(*) FROM failed_operations WHERE retried_at IS NOT NULL") == 0
    assert count(db, "SELECT count(*) FROM pending_triage") == 0
    again = cli("failed", "retry", "--all", env=env)
    assert again.returncode == 0, again.stderr
    assert count(db, "SELECT count(*) FROM pending_triage") == 2
    assert count(db, "SELECT count(*) FROM failed_operations WHERE retried_at IS NOT NULL") == 2


def _login_as(url: str, user: str) -> str:
    info = psycopg.conninfo.conninfo_to_dict(url)
    info["user"] = user
    return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items() if v is not None})


def test_check_with_a_refused_login_still_prints_every_line_and_exits_78(
    database_url: str, tmp_path: Path
) -> None:
    """A refused login is one failed database line: the backends, the embedding model and
    the mailboxes are probed all the same; the exit stays 78 (a configuration error)."""
    backends = json.dumps([{"name": "a", "url": "http://127.0.0.1:1/v1", "model": "m"}])
    env = env_for(_login_as(database_url, "no_such_role"), tmp_path, SOKRATOS_LLM_BACKENDS=backends)
    proc = cli("check", env=env)
    assert proc.returncode == 78, (proc.stdout, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    lines = {line.split()[1].rstrip(":"): line for line in proc.stdout.splitlines() if line}
    assert list(lines) == ["configuration", "database", "llm:a", "embeddings"], proc.stdout
    assert lines["database"].startswith("FAIL")
    assert 'role "no_such_role" does not exist' in lines["database"]
    assert "SOKRATOS_DATABASE_URL" in lines["database"]
    assert lines["llm:a"].startswith("FAIL")
    (said,) = [line for line in proc.stderr.splitlines() if line.startswith("sokratos-worker:")]
    assert said.startswith("sokratos-worker: invalid configuration: SOKRATOS_DATABASE_URL: ")


def test_check_when_the_embedded_postgres_cannot_start_prints_every_line(
    tmp_path: Path,
) -> None:
    data = tmp_path / "d"
    data.mkdir()
    (data / "postgres").write_text("not a data directory")  # initdb fails at once
    backends = json.dumps([{"name": "a", "url": "http://127.0.0.1:1/v1", "model": "m"}])
    env = env_for(None, tmp_path, SOKRATOS_DATA_DIR=str(data), SOKRATOS_LLM_BACKENDS=backends)
    proc = cli("check", env=env)
    assert proc.returncode == 1, (proc.stdout, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    lines = {line.split()[1].rstrip(":"): line for line in proc.stdout.splitlines() if line}
    assert list(lines) == ["configuration", "database", "llm:a", "embeddings"], proc.stdout
    assert lines["database"].startswith("FAIL") and "could not start" in lines["database"]
    assert lines["llm:a"].startswith("FAIL")
    assert "check failed: database, llm:a" in proc.stderr


def test_status_reports_a_spool_it_cannot_examine(tmp_path: Path) -> None:
    """A data directory the worker's user may read but not search: `stat spool` fails."""
    import tempfile

    # Outside tmp_path, whose parents only root may search, when the command runs as nobody.
    with tempfile.TemporaryDirectory(prefix="sokratos-spool-") as where:
        base = Path(where)
        base.chmod(0o755)
        data = base / "data"
        data.mkdir()
        data.chmod(0o644)  # no x: nobody (and the owner) can list it, not look inside
        env = env_for(
            "postgresql://x@127.0.0.1:1/none",
            tmp_path,
            HOME=str(base),
            SOKRATOS_DATA_DIR=str(data),
        )
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "sokratos_worker", "status"],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
                cwd=ROOT,
                user=65534 if os.geteuid() == 0 else None,  # root may search anything
            )
        finally:
            data.chmod(0o755)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert f"spool: cannot read {data / 'spool'} (Permission denied)" in proc.stdout, proc.stdout


def test_a_database_url_the_worker_ignores_is_named(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """SOKRATOS_DATABASE_URL wins over DATABASE_URL; another program's DATABASE_URL beside it
    was ignored without a word. Alone, DATABASE_URL is the database (contract.md)."""
    elsewhere = "postgresql://nobody@127.0.0.1:1/other"
    both = cli("status", env=env_for(database_url, tmp_path, DATABASE_URL=elsewhere))
    assert both.returncode == 0, both.stderr
    assert "database_url_ignored" in both.stderr, both.stderr
    assert "unset DATABASE_URL for sokratos-worker" in both.stderr
    same = cli("status", env=env_for(database_url, tmp_path, DATABASE_URL=database_url))
    assert same.returncode == 0 and "database_url_ignored" not in same.stderr, same.stderr
    alone = cli("status", env=env_for(None, tmp_path, DATABASE_URL=database_url))
    assert alone.returncode == 0 and "database_url_ignored" not in alone.stderr, alone.stderr
    assert "pending_triage" in alone.stdout, alone.stdout


def test_a_secret_file_given_beside_its_secret_is_named(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """The inline secret wins (contract.md); the file beside it was never read, without a word,
    so a key rotated by rewriting the file went unnoticed until the old one was refused."""
    key_file = tmp_path / "llm-key"
    key_file.write_text("sk-from-the-file")
    url_file = tmp_path / "database-url"
    url_file.write_text("postgresql://nobody:elsewhere@127.0.0.1:1/other")
    backend = {"name": "primary", "url": "http://127.0.0.1:1/v1", "model": "m"}
    account = {"name": "home", "host": "127.0.0.1", "username": "me", "security": "none"}
    both = cli(
        "status",
        env=env_for(
            database_url,
            tmp_path,
            SOKRATOS_LLM_BACKENDS=json.dumps(
                [backend | {"api_key": "sk-inline", "api_key_file": str(key_file)}]
            ),
            SOKRATOS_EMAIL_ACCOUNTS=json.dumps(
                [account | {"password": "pw", "password_file": str(key_file)}]
            ),
            SOKRATOS_DATABASE_URL_FILE=str(url_file),
        ),
    )
    assert both.returncode == 0, both.stderr
    assert "secret_file_ignored" in both.stderr, both.stderr
    for named in (
        "api_key_file of backend 'primary'",
        "password_file of email account 'home'",
        "SOKRATOS_DATABASE_URL_FILE",
    ):
        assert named in both.stderr, (named, both.stderr)
    for secret in ("sk-inline", "sk-from-the-file", "elsewhere"):
        assert secret not in both.stderr + both.stdout
    one = cli(
        "status",
        env=env_for(
            database_url,
            tmp_path,
            SOKRATOS_LLM_BACKENDS=json.dumps([backend | {"api_key_file": str(key_file)}]),
        ),
    )
    assert one.returncode == 0 and "secret_file_ignored" not in one.stderr, one.stderr
    # A DATABASE_URL exported for another program beside the production credential: it wins,
    # and said nothing while the worker used another database (found by a config hunt).
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "SOKRATOS_DATABASE_URL").write_text("postgresql://nobody:elsewhere@127.0.0.1:1/x")
    env = env_for(database_url, tmp_path, CREDENTIALS_DIRECTORY=str(creds))
    env["DATABASE_URL"] = env.pop("SOKRATOS_DATABASE_URL")
    aliased = cli("status", env=env)
    assert aliased.returncode == 0, aliased.stderr
    assert "secret_file_ignored" in aliased.stderr, aliased.stderr
    assert "$CREDENTIALS_DIRECTORY/SOKRATOS_DATABASE_URL" in aliased.stderr
    assert "elsewhere" not in aliased.stderr + aliased.stdout
