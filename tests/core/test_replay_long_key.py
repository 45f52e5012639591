"""A dead letter whose idempotency key fits the key index, but not with '#retry-1' appended:
`failed retry ID` ended in a traceback (SQLSTATE 54000), and `failed retry --all` rolled back
its whole batch at every run. It is refused on its own line now, saying what to do, and the
batch's others are replayed."""

from __future__ import annotations

import secrets
from pathlib import Path

import psycopg

from sokratos_worker.model import Queue
from sokratos_worker.store import queue as store
from tests.support.operator import cli_env, run_cli

TOO_LONG = "its idempotency key is too long to carry the '#retry-N' suffix"


def longest_key(conn: psycopg.Connection) -> str:
    """The longest incompressible key the enqueue still accepts (found by bisection)."""
    lo, hi, best = 2000, 2800, None
    while lo <= hi:
        mid = (lo + hi) // 2
        key = secrets.token_hex(mid)[:mid]
        try:
            with conn.transaction():
                store.enqueue(
                    conn, Queue.TRIAGE, {"exchange": "user: x\nassistant: y"}, idempotency_key=key
                )
                raise RuntimeError("roll the probe back")
        except RuntimeError:
            best, lo = key, mid + 1
        except psycopg.errors.ProgramLimitExceeded:
            hi = mid - 1
    assert best is not None
    return best


def dead_letter(conn: psycopg.Connection, key: str, text: str) -> int:
    """A triage item dead-lettered as the worker does it; its failure id."""
    store.enqueue(conn, Queue.TRIAGE, {"exchange": f"user: {text}\nassistant: ok"}, idempotency_key=key)
    (item,) = store.claim(conn, Queue.TRIAGE, owner="w1", limit=1, lease_s=60)
    done = store.dead_letter(conn, item, owner="w1", error="backend timed out")
    assert done.failure_id is not None
    return int(done.failure_id)


def retried_as(conn: psycopg.Connection) -> dict[int, int | None]:
    return dict(conn.execute("SELECT id, retried_as FROM failed_operations ORDER BY id").fetchall())


def test_retry_refuses_a_key_too_long_for_its_suffix_and_replays_the_others(
    tmp_path: Path, database_url: str
) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        first = dead_letter(conn, "chat-1", "my sister Ana moved to Porto")
        long = dead_letter(conn, longest_key(conn), "I start at Example GmbH on Monday")
        last = dead_letter(conn, "chat-3", "my dog is called Rex")
    env = cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url)

    done = run_cli(["failed", "retry", "--all"], env)
    assert done.returncode == 1, done.stderr  # a partial retry
    assert "Traceback" not in done.stderr
    lines = done.stdout.splitlines()
    assert f"{first}: re-enqueued as pending_triage item" in lines[0]
    assert lines[1].startswith(f"{long}: refused: {TOO_LONG}"), lines[1]
    assert f"WHERE id = {long}) and retry it again" in lines[1]
    assert f"{last}: re-enqueued as pending_triage item" in lines[2]
    with psycopg.connect(database_url, autocommit=True) as conn:
        replayed = retried_as(conn)
        assert replayed[first] is not None and replayed[last] is not None
        assert replayed[long] is None
        assert conn.execute(
            "SELECT retried_at FROM failed_operations WHERE id = %s", (long,)
        ).fetchone() == (None,)
        assert conn.execute("SELECT count(*) FROM pending_triage").fetchone() == (2,)

    done = run_cli(["failed", "retry", str(long)], env)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stdout.startswith(f"{long}: refused: {TOO_LONG}")

    # What the message says to do works: a shorter stored key, and the retry replays it.
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "UPDATE failed_operations SET idempotency_key = left(idempotency_key, 500)"
            " WHERE id = %s",
            (long,),
        )
    done = run_cli(["failed", "retry", str(long)], env)
    assert done.returncode == 0, done.stdout + done.stderr
    with psycopg.connect(database_url, autocommit=True) as conn:
        item = retried_as(conn)[long]
        assert item is not None
        (key,) = conn.execute(
            "SELECT idempotency_key FROM pending_triage WHERE id = %s", (item,)
        ).fetchone() or (None,)
        assert key is not None and key.endswith("#retry-1") and len(key) == 508
