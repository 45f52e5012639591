"""The ``failed`` commands at the edges a hunt found (2026-12-06): a read-only server and a
session the server ends give exit 75 and one line, not a traceback; a failure whose own item
is still queued is not replayed (the work would run twice); control characters in what
failed_operations holds are shown escaped, never sent raw to the terminal; a replayed item is
named with its queue."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import make_conninfo
from psycopg.types.json import Jsonb

from sokratos_worker.store import failures
from tests.support.operator import REPO, cli_env, run_cli


def _dead_letter(
    db: psycopg.Connection,
    item_id: int,
    *,
    op_type: str = "conversation_triage",
    error: str = "model said no",
    days_old: int = 0,
    key: str | None = None,
) -> int:
    """A replayable triage dead letter for ``item_id``, as the worker writes one (its key
    ``key``, its payload's exchange ``user: KEY``; by default key ``edge-ITEM_ID``)."""
    key = key or f"edge-{item_id}"
    row = db.execute(
        """INSERT INTO failed_operations (op_type, label, error_message, context_data,
                                          source_queue, item_id, idempotency_key, attempts,
                                          created_at)
           VALUES (%s, 'pending_triage item', %s, %s, 'pending_triage', %s, %s, 3,
                   now() - make_interval(days => %s)) RETURNING id""",
        (
            op_type,
            error,
            Jsonb({"source": "conversation", "payload": {"exchange": f"user: {key}"}}),
            item_id,
            key,
            days_old,
        ),
    ).fetchone()
    assert row is not None
    return int(row[0])


def _state(db: psycopg.Connection) -> tuple[int, int, int]:
    """Failures, failures marked retried, items queued in both queues."""
    row = db.execute(
        """SELECT (SELECT count(*) FROM failed_operations),
                  (SELECT count(*) FROM failed_operations WHERE retried_at IS NOT NULL),
                  (SELECT count(*) FROM pending_triage)
                      + (SELECT count(*) FROM pending_distillation)"""
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def _one_line_exit_75(proc: subprocess.CompletedProcess[str], *words: str) -> None:
    assert proc.returncode == 75, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("sokratos-worker: database unavailable"), proc.stderr
    for word in words:
        assert word in lines[0], proc.stderr


@pytest.mark.parametrize(
    "action", [["retry", "ID"], ["retry", "--all"], ["purge", "--older-than", "1"]]
)
def test_a_write_on_a_read_only_server_exits_75_in_one_line_and_changes_nothing(
    db: psycopg.Connection, database_url: str, tmp_path: Path, action: list[str]
) -> None:
    failure = _dead_letter(db, 4100, days_old=3)
    read_only = make_conninfo(database_url, options="-c default_transaction_read_only=on")
    env = cli_env(tmp_path, SOKRATOS_DATABASE_URL=read_only)
    before = _state(db)
    done = run_cli(["failed", *[str(failure) if a == "ID" else a for a in action]], env)
    _one_line_exit_75(done, "read-only", "target_session_attrs=read-write")
    assert done.stdout == ""
    assert _state(db) == before == (1, 0, 0)
    # Reading still works there.
    listed = run_cli(["failed", "list"], env)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.startswith(f"{failure:>6}  "), listed.stdout
    shown = run_cli(["failed", "show", str(failure)], env)
    assert shown.returncode == 0, shown.stderr
    assert '"item_id": 4100' in shown.stdout


@pytest.mark.parametrize("action", [["retry", "ID"], ["purge", "--older-than", "1"]])
def test_a_session_the_server_ends_midway_exits_75_in_one_line(
    db: psycopg.Connection, database_url: str, tmp_path: Path, action: list[str]
) -> None:
    failure = _dead_letter(db, 4200, days_old=3)
    args = [str(failure) if a == "ID" else a for a in action]
    with psycopg.connect(database_url) as holder:
        holder.execute("BEGIN")
        holder.execute("LOCK TABLE failed_operations IN ACCESS EXCLUSIVE MODE")
        proc = subprocess.Popen(
            [sys.executable, "-m", "sokratos_worker", "failed", *args],
            env=cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        ended = False
        deadline = time.monotonic() + 4  # its own lock wait gives up after 5 s
        while not ended and time.monotonic() < deadline:
            row = db.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE wait_event_type = 'Lock' AND pid <> %s",
                (holder.info.backend_pid,),
            ).fetchone()
            ended = bool(row and row[0])
            time.sleep(0.05)
        stdout, stderr = proc.communicate(timeout=60)
        holder.execute("ROLLBACK")
    assert ended, stderr
    _one_line_exit_75(
        subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), "terminat"
    )
    assert _state(db) == (1, 0, 0)


def _queued_triage_item(db: psycopg.Connection, key: str) -> int:
    row = db.execute(
        "SELECT sokratos_enqueue_triage(%s, %s, 'conversation')",
        (Jsonb({"exchange": f"user: {key}"}), key),
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_failure_whose_item_is_still_queued_is_not_replayed_by_id(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    # A dead letter restored from a backup (or written by hand) while its item still waits.
    item = _queued_triage_item(db, "still-here")
    restored = _dead_letter(db, item, key="still-here")
    env = cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url)

    one = run_cli(["failed", "retry", str(restored)], env)
    assert one.returncode == 1, one.stdout + one.stderr
    assert one.stdout.startswith(f"{restored}: refused: its item, pending_triage item {item},")
    assert "still queued and will run by itself" in one.stdout
    assert _state(db) == (1, 0, 1)  # nothing enqueued, nothing marked
    # Written by hand without the key: the same payload tells it is that item.
    db.execute("UPDATE failed_operations SET idempotency_key = NULL")
    keyless = run_cli(["failed", "retry", str(restored)], env)
    assert keyless.returncode == 1, keyless.stdout + keyless.stderr
    assert "still queued and will run by itself" in keyless.stdout
    assert _state(db) == (1, 0, 1)

    # Once its item has left the queue, the failure is replayed as any other.
    db.execute("DELETE FROM pending_triage WHERE id = %s", (item,))
    again = run_cli(["failed", "retry", str(restored)], env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.startswith(f"{restored}: re-enqueued as pending_triage item")
    assert _state(db) == (1, 1, 1)


def test_retry_all_skips_a_failure_whose_item_is_still_queued_and_says_so(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    item = _queued_triage_item(db, "still-here")
    restored = _dead_letter(db, item, key="still-here")
    gone = _dead_letter(db, 987654)  # an ordinary one: its item left the queue
    # Another database's failure whose item id a different item here has (another key).
    other = _queued_triage_item(db, "unrelated")
    copied = _dead_letter(db, other, key="elsewhere")
    env = cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url)

    every = run_cli(["failed", "retry", "--all"], env)
    assert every.returncode == 0, every.stdout + every.stderr
    assert f"{restored}:" not in every.stdout
    assert f"{gone}: re-enqueued as pending_triage item" in every.stdout
    assert f"{copied}: re-enqueued as pending_triage item" in every.stdout
    assert "skipped 1 failures whose own item is still queued" in every.stdout, every.stdout
    # The two queued items and the two replays: each piece of work queued once.
    assert _state(db) == (3, 2, 4)
    assert db.execute(
        "SELECT count(*) FROM pending_triage WHERE payload ->> 'exchange' = 'user: still-here'"
    ).fetchone() == (1,)


HOSTILE = "\x1b]0;owned\x07\x1b[2J"
ESCAPED = "\\x1b]0;owned\\x07\\x1b[2J"


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (["failed", "list"], f"triage{ESCAPED}"),
        (["failed", "list"], f"boom {ESCAPED} \\u202edesrever"),
        (["failed", "list", "--op-type", "nope"], f"op_types with failures: triage{ESCAPED})"),
        (["status"], f"failures (24h): triage{ESCAPED} 1"),
        (["failed", "show", "1"], '"error_message": "boom \\u001b]0;owned'),
    ],
    ids=["list-op-type", "list-error", "list-op-types-known", "status", "show"],
)
def test_control_characters_reach_the_terminal_escaped(
    db: psycopg.Connection, database_url: str, tmp_path: Path, command: list[str], expected: str
) -> None:
    error = f"boom {HOSTILE} \u202edesrever \x9b2J \x7f"
    failure = _dead_letter(db, 4300, op_type=f"triage{HOSTILE}", error=error)
    command = [str(failure) if a == "1" else a for a in command]
    shown = run_cli(command, cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url))
    assert shown.returncode == 0, shown.stderr
    assert expected in shown.stdout, shown.stdout
    for raw in ("\x1b", "\x07", "\u202e", "\x9b", "\x7f"):
        assert raw not in shown.stdout, (raw, shown.stdout)
    if command[:2] == ["failed", "show"]:  # still JSON, and the same text once parsed
        assert json.loads(shown.stdout)["error_message"] == error


def test_a_retried_failure_names_its_item_with_the_queue(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    failure = _dead_letter(db, 4400)
    env = cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url)
    first = run_cli(["failed", "retry", str(failure)], env)
    assert first.returncode == 0, first.stderr
    row = db.execute("SELECT retried_as FROM failed_operations").fetchone()
    assert row is not None
    item = row[0]
    again = run_cli(["failed", "retry", str(failure)], env)
    assert again.returncode == 0, again.stderr
    assert again.stdout == (
        f"{failure}: already retried as pending_triage item {item}; nothing done\n"
    )
    listed = run_cli(["failed", "list"], env)
    assert listed.stdout.rstrip("\n").endswith(f" retried as pending_triage item {item}")
    assert _state(db) == (1, 1, 1)


def test_a_row_held_by_another_session_names_that_session(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    failure = _dead_letter(db, 4500)
    env = cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url)
    with psycopg.connect(database_url) as holder:
        holder.execute("SET application_name = 'hand_session'")
        holder.execute("BEGIN")
        holder.execute("SELECT 1 FROM failed_operations WHERE id = %s FOR UPDATE", (failure,))
        retried = run_cli(["failed", "retry", str(failure)], env)
        holder.execute("ROLLBACK")
        pid = holder.info.backend_pid
    assert retried.returncode == 75, retried.stdout + retried.stderr
    assert "Traceback" not in retried.stderr
    assert f"a failed_operations row it needs is held by pid {pid} (hand_session," in (
        retried.stderr
    ), retried.stderr
    assert f"SELECT pg_terminate_backend({pid})" in retried.stderr
    assert f"(not retried: {failure})" in retried.stderr
    assert _state(db) == (1, 0, 0)


def test_a_failure_dated_in_the_future_is_not_recent_for_ever(db: psycopg.Connection) -> None:
    """Sokratos's heartbeat view counts the last hours only: a row created 'infinity' (written
    by Sokratos's Go code) or tomorrow is not among them."""
    db.execute(
        """INSERT INTO failed_operations (op_type, label, error_message, created_at)
           VALUES ('memory_save', 'now', 'e', now()),
                  ('memory_save', 'for ever', 'e', 'infinity'),
                  ('embedding', 'tomorrow', 'e', now() + interval '1 day')"""
    )
    recent = failures.recent_failures(db, hours=6)
    assert [(r["op_type"], r["count"]) for r in recent] == [("memory_save", 1)]


def test_a_replay_waits_for_no_lock_on_the_other_queues_table(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """The still-queued check named every queue table, so a migration holding
    pending_distillation held up the replay of triage failures for 5 s, then exit 75 (found
    by a review): each queue's check names only its own table."""
    one = _dead_letter(db, 987654)
    two = _dead_letter(db, 987655)
    env = cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url)
    with psycopg.connect(database_url) as holder:
        holder.execute("LOCK TABLE pending_distillation IN ACCESS EXCLUSIVE MODE")
        by_id = run_cli(["failed", "retry", str(one)], env)
        every = run_cli(["failed", "retry", "--all"], env)
        holder.rollback()
    assert by_id.returncode == 0, by_id.stdout + by_id.stderr
    assert every.returncode == 0, every.stdout + every.stderr
    assert f"{two}: re-enqueued as pending_triage item" in every.stdout
    assert _state(db)[1] == 2


@pytest.mark.parametrize("command", [["failed", "list"], ["failed", "retry", "--all"]])
def test_an_op_type_that_is_not_utf8_is_a_usage_error(
    database_url: str, tmp_path: Path, command: list[str]
) -> None:
    """Bytes that are not UTF-8 (a shell's $'\\xff') failed with a UnicodeEncodeError
    traceback (found by a hunt)."""
    proc = run_cli([*command, "--op-type", "\udcff"], cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url))
    assert proc.returncode == 1, proc.stderr
    assert "--op-type: is not UTF-8 text: b'\\xff'" in proc.stderr
    assert "Traceback" not in proc.stderr
