"""Scenario 5: kill -9 after the LLM answered and before the settle committed, then replay."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psycopg
import pytest

from sokratos_worker.testing.scripted_llm import (
    CHAT,
    EMBEDDINGS,
    Reply,
    Request,
    ScriptedLLM,
    hash_embedding_responder,
)
from tests.faults.support import (
    EMBED_DIM,
    Key,
    answer,
    assert_exactly_once,
    enqueue_triage,
    exchange,
    outcome_count,
    pipeline_env,
    report,
    scalar,
    start_worker,
    stop,
    tail,
    time_to_next_outcome,
    verdict,
)
from tests.support.daemon import wait_until

pytestmark = [pytest.mark.faults, pytest.mark.subprocess, pytest.mark.slow]

MARK = "CRASHPOINT"  # in the exchange: the chat answers with a summary holding AFTERCHAT
AFTER = "afterchat"  # only the memory write embeds this word: the chat has answered by then


class Gate:
    """Embeddings of a post-chat summary wait here until the test opens the gate."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.blocked = threading.Event()
        self.embed = hash_embedding_responder(EMBED_DIM, model="scripted-embed")

    def __call__(self, request: Request) -> Reply:
        body = request.body if isinstance(request.body, dict) else {}
        if AFTER in str(body.get("input", "")).lower() and not self.open.is_set():
            self.blocked.set()
            self.open.wait(30)  # bounded; the worker is killed long before
        return self.embed(request)


def chat(request: Request) -> Reply:
    user = str(request.messages[1].get("content", "")) if len(request.messages) > 1 else ""
    if MARK in user and "tok" in user:
        tok = user.split("code word is ")[1].split()[0]
        return Reply.chat(verdict(8, f"The user code word {tok} {AFTER} {tok}x is important"))
    return answer(request)


def _marked(db: psycopg.Connection, n: int, prefix: str) -> list[Key]:
    keys = []
    for i in range(n):
        payload = exchange(f"tok{prefix}{i}", save=True)
        payload["exchange"] += f" {MARK}"
        keys.append(enqueue_triage(db, payload))
    return keys


def _memories_of(db: psycopg.Connection, keys: list[Key]) -> int:
    return int(
        scalar(
            db,
            "SELECT count(*) FROM memories WHERE split_part(origin, ':', 2)::bigint = ANY(%s)",
            [k[1] for k in keys],
        )
    )


@pytest.mark.timeout(180)
def test_kill_while_the_write_embeds_after_the_chat_answered(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    marked = _marked(db, 4, "m")
    plain = [enqueue_triage(db, exchange(f"tokp{i}", save=True)) for i in range(20)]
    gate = Gate()
    log = tmp_path / "worker.log"
    with ScriptedLLM(chat=chat) as server, ScriptedLLM() as embed:
        embed.on(EMBEDDINGS, gate)
        env = pipeline_env(database_url, tmp_path, [server], embed)
        proc = start_worker(env, log)
        try:
            assert wait_until(gate.blocked.is_set, timeout=60), tail(log)
            time.sleep(0.5)  # let every marked item in flight reach the gate
            answered = sum(1 for b in server.bodies(CHAT) if MARK in str(b))
            assert answered >= 1
            proc.kill()
            proc.wait(10)
            assert _memories_of(db, marked) == 0, "a memory was committed before the settle"
            unsettled = int(
                scalar(
                    db,
                    "SELECT count(*) FROM pending_triage WHERE id = ANY(%s)",
                    [k[1] for k in marked],
                )
            )
            assert unsettled == len(marked)
            gate.open.set()
            before = outcome_count(db)
            restarted = time.monotonic()
            proc = start_worker(env, log)
            recover = time_to_next_outcome(db, before, restarted, timeout=60)
            keys = marked + plain
            assert wait_until(lambda: outcome_count(db) >= len(keys), timeout=90), tail(log)
        finally:
            assert stop(proc) == 0, tail(log)
        replayed = sum(1 for b in server.bodies(CHAT) if MARK in str(b))
    fig = assert_exactly_once(db, keys)
    # Exactly one memory per marked item (one chunk each), though the LLM answered twice.
    assert _memories_of(db, marked) == len(marked)
    assert replayed > answered
    assert fig.by_outcome == {"saved": len(keys)}, fig
    report("crash_after_llm_before_commit(embed)", fig, recover, llm_answers=replayed)


@pytest.mark.timeout(180)
def test_kill_inside_the_settle_transaction_before_commit(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    keys = [enqueue_triage(db, exchange(f"tokl{i}", save=True)) for i in range(30)]
    log = tmp_path / "worker.log"
    with (
        ScriptedLLM(chat=answer) as server,
        ScriptedLLM(embed_dim=EMBED_DIM) as embed,
        psycopg.connect(database_url) as locker,
    ):
        env = pipeline_env(database_url, tmp_path, [server], embed)
        # The settle deletes the item and inserts its memories, then waits on this lock
        # to insert the outcome row: the kill lands inside its open transaction.
        locker.execute("LOCK TABLE work_outcomes IN SHARE MODE")
        proc = start_worker(env, log)
        try:

            def settle_waiting() -> bool:
                return bool(
                    scalar(
                        db,
                        """SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
                           WHERE c.relname = 'work_outcomes' AND NOT l.granted""",
                    )
                )

            assert wait_until(settle_waiting, timeout=60), tail(log)
            time.sleep(0.5)
            proc.kill()
            proc.wait(10)
            locker.commit()  # the orphaned transactions now finish and find no COMMIT coming
            assert wait_until(
                lambda: (
                    scalar(
                        db,
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                        " AND state LIKE 'idle in transaction%%' AND pid <> pg_backend_pid()",
                    )
                    == 0
                ),
                timeout=30,
            )
            assert outcome_count(db) == 0
            assert scalar(db, "SELECT count(*) FROM memories") == 0, "effects outlived the crash"
            assert scalar(db, "SELECT count(*) FROM pending_triage") == len(keys)
            restarted = time.monotonic()
            proc = start_worker(env, log)
            recover = time_to_next_outcome(db, 0, restarted, timeout=60)
            assert wait_until(lambda: outcome_count(db) >= len(keys), timeout=90), tail(log)
        finally:
            if locker.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                locker.rollback()
            assert stop(proc) == 0, tail(log)
    fig = assert_exactly_once(db, keys)
    assert fig.by_outcome == {"saved": len(keys)}, fig
    assert scalar(db, "SELECT count(*) FROM memories") == len(keys)
    report("crash_inside_settle_before_commit(lock)", fig, recover)
