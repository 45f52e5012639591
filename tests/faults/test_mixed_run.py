"""Scenario 1: >= 1,000 mixed items through the real daemon and pipelines, chaos, kill -9 x2."""

from __future__ import annotations

import json
import time
from pathlib import Path

import psycopg
import pytest

from sokratos_worker.testing.scripted_llm import ScriptedLLM
from tests.faults.support import (
    EMBED_DIM,
    Chaos,
    Key,
    assert_exactly_once,
    enqueue_distillation,
    enqueue_triage,
    exchange,
    failed_payloads,
    insert_raw,
    messages_archive,
    outcome_count,
    pipeline_env,
    report,
    start_worker,
    stop,
    tail,
    text_archive,
    time_to_next_outcome,
)
from tests.support.daemon import wait_until

pytestmark = [pytest.mark.faults, pytest.mark.subprocess, pytest.mark.slow]

# Invalid payloads the Go application might write straight into the tables.
INVALID = [
    ("pending_triage", '{"exchange": 5}', "conversation", "exchange"),
    ("pending_triage", '"just a string"', "conversation", "payload"),
    ("pending_triage", "[1, 2, 3]", "conversation", "payload"),
    ("pending_triage", '{"exchange": "user: hi there, how are you\\nassistant: fine", '
     '"tools_used": "yes"}', "conversation", "tools_used"),
    ("pending_triage", '{"text": ["not", "a", "string"]}', "email", "text"),
    ("pending_triage", '{"exchange": "user: x y z\\nassistant: ok"}', "carrier-pigeon", "source"),
    ("pending_distillation", '{"messages": "nope"}', None, "messages"),
    ("pending_distillation", '{"messages": [{"role": "robot", "content": "x"}]}', None, "role"),
    ("pending_distillation", "{}", None, "messages"),
    ("pending_distillation", '{"archive_text": 42}', None, "archive_text"),
]  # fmt: skip


def _arrange(db: psycopg.Connection) -> tuple[list[Key], list[Key], list[Key]]:
    """1,050 items; returns (all, invalid, poisoned distillations)."""
    keys: list[Key] = []
    poisoned: list[Key] = []
    n = 0
    with db.transaction():
        for i in range(1020):
            tok = f"tok{i}"
            kind = i % 12
            if kind in (0, 1, 2):
                keys.append(enqueue_triage(db, exchange(tok, save=True)))
            elif kind == 3:
                keys.append(enqueue_triage(db, exchange(tok, save=True, tools=True)))
            elif kind == 4:
                keys.append(enqueue_triage(db, exchange(tok, save=True, long_reply=True)))
            elif kind == 5:
                keys.append(enqueue_triage(db, exchange(tok, save=False, tools=True)))
            elif kind == 6:
                keys.append(enqueue_triage(db, {"exchange": "ok"}))  # trivial: skipped
            elif kind in (7, 8):
                keys.append(enqueue_distillation(db, messages_archive(tok)))
            elif kind in (9, 10):
                keys.append(enqueue_distillation(db, text_archive(tok)))
            else:
                n += 1
                shape = messages_archive if n % 2 else text_archive
                key = enqueue_distillation(db, shape(tok, poison=n % 4 == 0))
                keys.append(key)
                if n % 4 == 0:
                    poisoned.append(key)
        invalid = [insert_raw(db, t, p, s) for t, p, s, _ in INVALID]
    return keys + invalid, invalid, poisoned


@pytest.mark.timeout(420)
def test_mixed_items_with_chaos_and_kill_9_end_exactly_once(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    keys, invalid, poisoned = _arrange(db)
    assert len(keys) >= 1000
    primary_chaos = Chaos(error_rate=0.2, hang_rate=0.01, hang_s=3.0, invalid_rate=0.05, seed=1)
    fallback_chaos = Chaos(error_rate=0.05, invalid_rate=0.05, seed=2)
    log = tmp_path / "worker.log"
    started = time.monotonic()
    recoveries: list[float] = []
    with (
        ScriptedLLM(chat=primary_chaos) as primary,
        ScriptedLLM(chat=fallback_chaos) as fallback,
        ScriptedLLM(embed_dim=EMBED_DIM) as embed,
    ):
        env = pipeline_env(database_url, tmp_path, [primary, fallback], embed)
        proc = start_worker(env, log)
        try:
            for fraction in (0.3, 0.6):
                target = int(len(keys) * fraction)
                assert wait_until(
                    lambda t=target, p=proc: outcome_count(db) >= t or p.poll() is not None,
                    timeout=150,
                ), tail(log)
                assert proc.poll() is None, tail(log)
                proc.kill()  # kill -9: no cleanup, leases left behind
                proc.wait(10)
                done = outcome_count(db)
                assert done < len(keys), "the drain finished before the kill"
                restarted = time.monotonic()
                proc = start_worker(env, log)
                recoveries.append(time_to_next_outcome(db, done, restarted, timeout=60))
            assert wait_until(lambda: outcome_count(db) >= len(keys), timeout=240), tail(log)
        finally:
            assert stop(proc) == 0, tail(log)
    elapsed = time.monotonic() - started

    fig = assert_exactly_once(db, keys)
    failures = failed_payloads(db)
    outcomes = {
        (q, i): o for q, i, o in db.execute("SELECT queue, item_id, outcome FROM work_outcomes")
    }
    for key, (table, payload_json, _, field) in zip(invalid, INVALID, strict=True):
        assert key[0] == table
        assert outcomes[key] == "failed", key
        error, kept = failures[key]
        assert kept == json.loads(payload_json), (key, kept)
        assert field in error, (field, error)
    for key in poisoned:
        assert outcomes[key] == "archived", (key, outcomes[key])
        sources = {
            s
            for (s,) in db.execute(
                "SELECT source FROM memories WHERE origin LIKE %s", (f"{key[0]}:{key[1]}:%",)
            )
        }
        assert sources == {"conversation_archive"}, (key, sources)
        assert key in failures
    assert fig.by_outcome.get("saved", 0) > 500, fig
    cut_off = sum(c.injected.get("truncated", 0) for c in (primary_chaos, fallback_chaos))
    assert cut_off > 0, primary_chaos.injected
    asked_shorter = log.read_text().count('"llm_reply_truncated"')
    # Every cut-off first reply is asked again; a cut-off repair reply (the second) and one in
    # flight at a kill are not, and those are the few.
    assert cut_off // 2 <= asked_shorter <= cut_off, (cut_off, asked_shorter)
    memories = db.execute("SELECT count(*) FROM memories").fetchone()
    report(
        "mixed_1000_chaos_kill9x2",
        fig,
        recoveries,
        memories=memories[0] if memories else 0,
        invalid_failed=len(invalid),
        archived_poison=len(poisoned),
        injected_primary=primary_chaos.injected,
        injected_fallback=fallback_chaos.injected,
        truncation_retries_logged=asked_shorter,
        elapsed_s=round(elapsed, 1),
    )
