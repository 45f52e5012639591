"""`failed retry --all` replays its failures in batches, one transaction each (it took one
transaction and about ten round trips per failure: 10,000 failures in ~22 s). A batch must keep
all it promised one at a time: every failure replayed once, a refused payload reported and
skipped without losing the batch's others, the replay links set, a kill or a second run at the
same time neither doubling nor losing one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psycopg
from psycopg.types.json import Jsonb

from sokratos_worker.store import failures
from tests.support.operator import REPO, cli_env, run_cli

BATCH = failures.RETRY_BATCH


def dead_letters(db: psycopg.Connection, first: int, last: int) -> None:
    """Replayable dead letters numbered ``first``..``last``, as the worker writes them: triage
    ones, and every seventh a distillation, so a batch replays into both queues."""
    db.execute(
        """INSERT INTO failed_operations (op_type, label, error_message, context_data,
                                          source_queue, item_id, idempotency_key, attempts)
           SELECT CASE WHEN g %% 7 = 0 THEN 'distillation' ELSE 'conversation_triage' END,
                  'item ' || g, 'model said no',
                  jsonb_build_object('source', 'conversation', 'payload',
                      CASE WHEN g %% 7 = 0 THEN jsonb_build_object('archive_text', 'text ' || g)
                           ELSE jsonb_build_object('exchange', 'user: item ' || g) END),
                  CASE WHEN g %% 7 = 0 THEN 'pending_distillation' ELSE 'pending_triage' END,
                  g, 'batch-' || g, 3
           FROM generate_series(%s::int, %s::int) g""",
        (first, last),
    )


def refused_dead_letter(db: psycopg.Connection) -> int:
    """A triage dead letter whose stored payload the enqueue function refuses (no exchange);
    its error is not "invalid payload", so `--all` offers it."""
    row = db.execute(
        """INSERT INTO failed_operations (op_type, label, error_message, context_data,
                                          source_queue, item_id, idempotency_key, attempts)
           VALUES ('conversation_triage', 'edited by hand', 'model said no', %s,
                   'pending_triage', 999999, 'batch-refused', 3) RETURNING id""",
        (Jsonb({"source": "conversation", "payload": {"text": "no exchange"}}),),
    ).fetchone()
    assert row is not None
    return int(row[0])


def replays(db: psycopg.Connection) -> list[tuple[int, int | None, str | None, int | None]]:
    """Per failure: its id, the item it was replayed as, that item's key and replay_of."""
    rows = db.execute(
        """SELECT f.id, f.retried_as, coalesce(t.idempotency_key, d.idempotency_key),
                  coalesce(t.replay_of, d.replay_of)
           FROM failed_operations f
           LEFT JOIN pending_triage t ON f.source_queue = 'pending_triage' AND t.id = f.retried_as
           LEFT JOIN pending_distillation d
                  ON f.source_queue = 'pending_distillation' AND d.id = f.retried_as
           ORDER BY f.id"""
    ).fetchall()
    return [(r[0], r[1], r[2], r[3]) for r in rows]


def queued(db: psycopg.Connection) -> int:
    row = db.execute(
        "SELECT (SELECT count(*) FROM pending_triage) + (SELECT count(*) FROM pending_distillation)"
    ).fetchone()
    assert row is not None
    return int(row[0])


def assert_each_replayed_once(db: psycopg.Connection, skip: frozenset[int] = frozenset()) -> int:
    """Every failure but ``skip`` replayed as its own item, under its key, linked back; no
    other item queued. How many were replayed."""
    replayed = [r for r in replays(db) if r[0] not in skip]
    for failure_id, item, key, replay_of in replayed:
        item_id = db.execute("SELECT item_id FROM failed_operations WHERE id = %s", (failure_id,))
        original = item_id.fetchone()
        assert original is not None
        assert item is not None, f"failure {failure_id} not replayed"
        assert key == f"batch-{original[0]}#retry-1", (failure_id, key)
        assert replay_of == original[0], (failure_id, replay_of)
    assert queued(db) == len(replayed)  # none doubled, none lost
    return len(replayed)


def test_retry_all_across_batches_skips_a_refused_payload_and_replays_the_rest(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """A payload the enqueue function refuses, in the middle of the second batch: reported,
    left as it was; every other failure replayed once, in batches (one transaction each)."""
    dead_letters(db, 1, BATCH + BATCH // 2)
    refused = refused_dead_letter(db)
    dead_letters(db, BATCH + BATCH // 2 + 1, 2 * BATCH + BATCH // 2)
    env = cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url)
    proc = run_cli(["failed", "retry", "--all"], env)
    assert proc.returncode == 1, proc.stderr  # one was refused, as before
    lines = proc.stdout.splitlines()
    ids = [r[0] for r in replays(db)]
    assert [int(line.split(":")[0]) for line in lines] == ids  # one line each, in order
    assert lines[ids.index(refused)] == (
        f"{refused}: refused: the stored payload cannot be enqueued (invalid payload:"
        " payload.exchange is required and must be a string); repair it from"
        f" `sokratos-worker failed show {refused}` and enqueue it by hand"
    )
    assert sum("re-enqueued as" in line for line in lines) == len(ids) - 1
    left = db.execute(
        "SELECT retried_at, retried_as, error_message FROM failed_operations WHERE id = %s",
        (refused,),
    ).fetchone()
    assert left == (None, None, "model said no")
    assert assert_each_replayed_once(db, skip=frozenset({refused})) == len(ids) - 1
    # Replayed in batches: their rows share a few transactions, not one each.
    xids = db.execute(
        "SELECT count(DISTINCT xmin::text) FROM (SELECT xmin FROM pending_triage"
        " UNION ALL SELECT xmin FROM pending_distillation) AS items"
    ).fetchone()
    assert xids is not None and xids[0] <= 2 + 2 * BATCH.bit_length(), xids
    # The new items' ids follow their failures' order, in each queue.
    for queue in ("pending_triage", "pending_distillation"):
        items = db.execute(
            "SELECT retried_as FROM failed_operations WHERE source_queue = %s"
            " AND retried_as IS NOT NULL ORDER BY id",
            (queue,),
        ).fetchall()
        assert items == sorted(items)
    again = run_cli(["failed", "retry", "--all"], env)
    assert again.stdout.splitlines() == [lines[ids.index(refused)]]
    assert queued(db) == len(ids) - 1


def test_a_batch_gives_failures_sharing_a_key_keys_of_their_own(
    db: psycopg.Connection,
) -> None:
    """One transaction cannot tell its own items apart by xmin: two failures of one batch
    whose next key is the same (the same original key, or one the producer used) must get
    distinct keys, or the second enqueue answers with the first's item and its payload is lost."""
    db.execute("SELECT sokratos_enqueue_triage('{\"exchange\": \"producer\"}', 'chat-8#retry-1')")
    made = db.execute(
        """INSERT INTO failed_operations (op_type, label, error_message, context_data,
                                          source_queue, item_id, idempotency_key, attempts)
           SELECT 'conversation_triage', 'x', 'model said no',
                  jsonb_build_object('payload', jsonb_build_object('exchange', 'text ' || g)),
                  'pending_triage', 100 + g, k, 3
           FROM unnest(ARRAY['chat-7', 'chat-7', 'chat-8', 'chat-8#retry-1']) WITH ORDINALITY
                AS u(k, g)
           RETURNING id"""
    ).fetchall()
    ids = [int(r[0]) for r in made]
    results = failures.retry_batch(db, ids)
    assert [r.failure_id for r in results] == ids
    assert all(r.item_id is not None for r in results), results
    rows = db.execute(
        """SELECT t.idempotency_key, t.payload ->> 'exchange', t.replay_of
           FROM failed_operations f JOIN pending_triage t ON t.id = f.retried_as
           WHERE f.id = ANY(%s) ORDER BY f.id""",
        (ids,),
    ).fetchall()
    assert rows == [
        ("chat-7#retry-1", "text 1", 101),
        ("chat-7#retry-2", "text 2", 102),
        ("chat-8#retry-2", "text 3", 103),
        ("chat-8#retry-3", "text 4", 104),
    ]
    assert db.execute("SELECT count(*) FROM pending_triage").fetchone() == (5,)


def start_retry_all(database_url: str, tmp_path: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "sokratos_worker", "failed", "retry", "--all"],
        env=cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url, PYTHONUNBUFFERED="1"),
        cwd=str(REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_retry_all_killed_mid_way_and_run_again_replays_each_failure_once(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """SIGKILL after the first batch was printed: a batch is all or nothing (no failure marked
    without its item, no item without its mark); the next run replays the rest, once."""
    total = 12 * BATCH
    dead_letters(db, 1, total)
    proc = start_retry_all(database_url, tmp_path)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert "re-enqueued as" in first, first
    marked = db.execute("SELECT count(*) FROM failed_operations WHERE retried_at IS NOT NULL")
    done = marked.fetchone()
    assert done is not None and 0 < done[0] < total, done  # killed mid-way
    assert queued(db) == done[0]
    env = cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url)
    again = run_cli(["failed", "retry", "--all"], env)
    assert again.returncode == 0, again.stderr
    assert len(again.stdout.splitlines()) == total - done[0]
    assert assert_each_replayed_once(db) == total


def test_two_retry_all_at_once_replay_each_failure_once(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """Both runs list the same failures; each failure is replayed by exactly one of them, and
    the other says it was already retried."""
    total = 6 * BATCH
    dead_letters(db, 1, total)
    homes = [tmp_path / "a", tmp_path / "b"]
    for home in homes:
        home.mkdir()
    runs = [start_retry_all(database_url, home) for home in homes]
    outputs = [run.communicate(timeout=300) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [err for _, err in outputs]
    replayed_by = [
        {int(line.split(":")[0]) for line in out.splitlines() if "re-enqueued as" in line}
        for out, _ in outputs
    ]
    assert not replayed_by[0] & replayed_by[1]
    assert len(replayed_by[0] | replayed_by[1]) == total
    assert assert_each_replayed_once(db) == total
