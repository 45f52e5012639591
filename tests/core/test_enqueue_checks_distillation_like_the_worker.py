"""`enqueue distillation` refuses, exit 1, a payload the worker would dead-letter at its first
claim (the same checks: pipelines/archive.py and the 512 kB limit), and enqueues nothing."""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
import pytest

from tests.support.operator import cli_env, run_cli


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (
            {"messages": [{"role": "bot", "content": "I moved to Porto"}]},
            "payload.messages[0].role must be one of ['assistant', 'system', 'tool', 'user']",
        ),
        (
            {"messages": [{"role": "user", "content": ["I moved", "to Porto"]}]},
            "payload.messages[0].content must be a string",
        ),
        ({"archive_text": "x" * 600_000}, "payload.archive_text would make an archive of 600,0"),
        ({"messages": [], "archive_text": "both"}, "payload.messages and archive_text are alternatives"),
        ({"archive_text": "[Conversation archived]", "pipeline_id": "7"}, "payload.pipeline_id must be an integer"),
    ],
    ids=["unknown-role", "content-not-a-string", "over-512-kB", "both-shapes", "pipeline-id-text"],
)
def test_enqueue_refuses_a_distillation_payload_the_worker_rejects(
    tmp_path: Path, database_url: str, payload: dict[str, object], message: str
) -> None:
    file = tmp_path / "archive.json"
    file.write_text(json.dumps(payload))
    done = run_cli(
        ["enqueue", "distillation", "--file", str(file)],
        cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url),
    )
    with psycopg.connect(database_url) as conn:
        queued = conn.execute("SELECT count(*) FROM pending_distillation").fetchone()
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert queued == (0,)
    assert done.stderr.startswith("sokratos-worker: invalid payload: ") and message in done.stderr


def test_a_payload_the_worker_rejects_is_not_spooled_either(tmp_path: Path) -> None:
    env = cli_env(tmp_path, SOKRATOS_DATABASE_URL="postgresql://x@127.0.0.1:1/none")
    bad = '{"messages": [{"role": "bot", "content": "hi"}]}'
    done = run_cli(["enqueue", "distillation", "--file", "-"], env, stdin=bad)
    assert done.returncode == 1 and "payload.messages[0].role" in done.stderr, done.stderr
    assert not (tmp_path / "data" / "spool").exists()
    good = '{"messages": [{"role": "user", "content": "hi", "timestamp": "2026-01-02T03:04:05Z"}]}'
    done = run_cli(["enqueue", "distillation", "--file", "-"], env, stdin=good)
    assert done.returncode == 0 and done.stdout.startswith("spooled "), done.stderr


def test_the_python_client_refuses_it_too(database_url: str) -> None:
    """A Python producer gets the same refusal from client.enqueue_distillation, before
    anything is queued (it used to be queued and dead-lettered at its first claim)."""
    from sokratos_worker import client
    from sokratos_worker.errors import InvalidPayload

    bad = {"messages": [{"role": "bot", "content": "hi"}]}
    with pytest.raises(InvalidPayload, match=r"payload\.messages\[0\]\.role"):
        client.enqueue_distillation(database_url, bad, key="bot-1")
    good = {"messages": [{"role": "user", "content": "hi"}]}
    assert client.enqueue_distillation(database_url, good, key="user-1").item_id is not None
    with psycopg.connect(database_url) as conn:
        keys = conn.execute("SELECT idempotency_key FROM pending_distillation").fetchall()
    assert keys == [("user-1",)]


@pytest.mark.parametrize(
    ("payload", "accepted"),
    [
        ({"messages": [{"role": "user", "content": "hi"}], "archive_text": None}, True),
        ({"messages": None, "archive_text": "user: I moved to Porto"}, True),
        ({"messages": None, "archive_text": None}, False),
        ({"messages": None}, False),
        ({"archive_text": None}, False),
        ({"messages": [], "archive_text": "user: hi"}, False),
        ({"messages": "user: hi", "archive_text": "user: hi"}, False),
    ],
    ids=[
        "archive-text-null",
        "messages-null",
        "both-null",
        "only-messages-null",
        "only-text-null",
        "both-given",
        "both-given-messages-a-string",
    ],
)
def test_a_null_field_is_absent_to_the_sql_check_and_the_worker_alike(
    database_url: str, payload: dict[str, object], accepted: bool
) -> None:
    """A Go struct without omitempty sends the unused field as null: the SQL function, the
    CLI / Python client check and the worker's own check (check_distillation runs it) agree.
    Both fields given was refused by the worker only (sql/0046): the producer learned nothing."""
    from sokratos_worker import client
    from sokratos_worker.errors import InvalidPayload

    with psycopg.connect(database_url, autocommit=True) as conn:
        try:
            conn.execute("SELECT sokratos_enqueue_distillation(%s::jsonb)", (json.dumps(payload),))
            sql_accepts = True
        except psycopg.errors.InvalidParameterValue:
            sql_accepts = False
    try:
        client.check_distillation(payload)
        worker_accepts = True
    except InvalidPayload:
        worker_accepts = False
    assert (sql_accepts, worker_accepts) == (accepted, accepted)
