"""Scenario 3: backends that error, vanish, hang, answer garbage or break the schema."""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from sokratos_worker.testing.scripted_llm import (
    CHAT,
    EMBEDDINGS,
    HEALTH,
    MODELS,
    PROBE,
    Reply,
    Request,
    Responder,
    ScriptedLLM,
    hash_embedding_responder,
)
from tests.faults.support import (
    EMBED_DIM,
    Key,
    answer,
    assert_exactly_once,
    cli,
    enqueue_distillation,
    enqueue_triage,
    exchange,
    failed_payloads,
    messages_archive,
    outcome_count,
    pipeline_env,
    report,
    scalar,
    start_worker,
    stop,
    tail,
    text_archive,
)
from tests.support.daemon import wait_until

pytestmark = [pytest.mark.faults, pytest.mark.subprocess, pytest.mark.slow]

MAX_ATTEMPTS = 2


def _items(db: psycopg.Connection, prefix: str) -> tuple[list[Key], list[Key]]:
    """Three triage items that would be saved and two distillations (one per shape)."""
    triage = [enqueue_triage(db, exchange(f"tok{prefix}{i}", save=True)) for i in range(3)]
    distil = [
        enqueue_distillation(db, messages_archive(f"tok{prefix}m1")),
        enqueue_distillation(db, text_archive(f"tok{prefix}t1")),
    ]
    return triage, distil


def _payloads(db: psycopg.Connection, keys: list[Key]) -> dict[Key, object]:
    return {k: scalar(db, f"SELECT payload FROM {k[0]} WHERE id = %s", k[1]) for k in keys}


def _outcome_rows(db: psycopg.Connection) -> dict[Key, tuple[str, int]]:
    rows = db.execute("SELECT queue, item_id, outcome, attempts FROM work_outcomes").fetchall()
    return {(str(q), int(i)): (str(o), int(a)) for q, i, o, a in rows}


LOGIN_PAGE = Reply(
    raw=b"<html><head><title>Sign in</title></head><body>proxy login</body></html>",
    headers={"Content-Type": "text/html; charset=utf-8"},
)


def _every_path(server: ScriptedLLM, responder: Responder) -> None:
    for path in (CHAT, PROBE, MODELS, HEALTH):
        server.on(path, responder)


def _completions(server: ScriptedLLM, responder: Responder) -> None:
    """Only the model fails: /models and /health still answer (a crashed model, no GPU memory)."""
    for path in (CHAT, PROBE):
        server.on(path, responder)


def _run_failing(
    db: psycopg.Connection,
    database_url: str,
    tmp_path: Path,
    scenario: str,
    chat: Responder,
    *,
    servers: int = 2,
    timeout: float = 120,
    backend_timeout: float = 2.0,
) -> None:
    """Every chat call an item makes fails the same way while the server answers the health
    probe (a request that breaks a healthy server is the item's own problem): attempts are
    used, triage items end failed with their payload kept, distillations archived."""
    triage, distil = _items(db, scenario[:3])
    keys = triage + distil
    payloads = _payloads(db, keys)
    log = tmp_path / "worker.log"
    started = time.monotonic()
    chats = [ScriptedLLM(chat=chat).start() for _ in range(servers)]
    try:
        with ScriptedLLM(embed_dim=EMBED_DIM) as embed:
            env = pipeline_env(
                database_url,
                tmp_path,
                chats,
                embed,
                backend_timeout=backend_timeout,
                SOKRATOS_MAX_ATTEMPTS=str(MAX_ATTEMPTS),
            )
            proc = start_worker(env, log)
            try:
                assert wait_until(
                    lambda: outcome_count(db) >= len(keys), timeout=timeout, interval=0.2
                ), tail(log)
            finally:
                assert stop(proc) == 0, tail(log)
    finally:
        for server in chats:
            server.close()
    elapsed = time.monotonic() - started
    fig = assert_exactly_once(db, keys)
    outcomes = _outcome_rows(db)
    failures = failed_payloads(db)
    for key in triage:
        assert outcomes[key] == ("failed", MAX_ATTEMPTS), (key, outcomes[key], tail(log))
    for key in distil:
        assert outcomes[key] == ("archived", MAX_ATTEMPTS), (key, outcomes[key])
    for key in keys:
        error, kept = failures[key]
        assert kept == payloads[key]
        assert "backend" in error.lower() or "llm" in error.lower(), error
    history = scalar(
        db,
        "SELECT min(jsonb_array_length(context_data -> 'attempts')) FROM failed_operations",
    )
    assert history == MAX_ATTEMPTS
    report(scenario, fig, None, attempts_each=MAX_ATTEMPTS, elapsed_s=round(elapsed, 1))


@pytest.mark.timeout(180)
def test_every_chat_request_500_uses_attempts_and_keeps_payloads(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    _run_failing(db, database_url, tmp_path, "backends_all_500", lambda r: Reply.error(500, "boom"))


@pytest.mark.timeout(180)
def test_every_chat_request_hangs_past_the_timeout(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    _run_failing(
        db,
        database_url,
        tmp_path,
        "backends_hang",
        lambda r: Reply.hang(1.5),
        servers=1,
        backend_timeout=1.0,
    )


@pytest.mark.timeout(180)
def test_garbage_replies(db: psycopg.Connection, database_url: str, tmp_path: Path) -> None:
    _run_failing(
        db, database_url, tmp_path, "backends_garbage", lambda r: Reply.text("<html>\x00{{{")
    )


@pytest.mark.timeout(180)
def test_schema_breaking_replies(db: psycopg.Connection, database_url: str, tmp_path: Path) -> None:
    _run_failing(
        db,
        database_url,
        tmp_path,
        "backends_schema",
        lambda r: Reply.chat({"salience_score": "very", "summary": 3, "facts": "none"}),
    )


def _worker_states(env: dict[str, str]) -> list[str]:
    result = cli(env, "status", "--json", timeout=30)
    if result.returncode != 0:
        return []
    return [str(w.get("state")) for w in json.loads(result.stdout).get("workers", [])]



@pytest.mark.timeout(120)
def test_status_says_no_backend_at_once_not_at_the_next_heartbeat(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    log = tmp_path / "worker.log"
    with ScriptedLLM(chat=answer) as server, ScriptedLLM(embed_dim=EMBED_DIM) as embed:
        env = pipeline_env(database_url, tmp_path, [server], embed)
        env["SOKRATOS_HEARTBEAT_INTERVAL"] = "60s"  # the next tick is a minute away
        proc = start_worker(env, log)
        try:
            assert wait_until(lambda: "running" in _worker_states(env), timeout=60), tail(log)
            _every_path(server, lambda r: Reply.disconnect())
            enqueue_triage(db, exchange("tokstale", save=True))  # NOTIFY: claimed at once
            went_down = time.monotonic()
            assert wait_until(lambda: "no backend" in _worker_states(env), timeout=40), tail(log)
            assert time.monotonic() - went_down < 45  # well before the heartbeat at 60 s
            [worker] = json.loads(cli(env, "status", "--json", timeout=30).stdout)["workers"]
            assert "no LLM backend reachable" in worker["detail"]["why"], worker
        finally:
            stop(proc)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("scenario", "take_down"),
    [
        ("backends_total_outage", lambda s: _every_path(s, lambda r: Reply.disconnect())),
        ("backends_completions_500", lambda s: _completions(s, lambda r: Reply.error(500, "OOM"))),
        # A proxy in front of the model showing its login page: 200, text/html, everywhere.
        ("backends_html_login_page", lambda s: _every_path(s, lambda r: LOGIN_PAGE)),
    ],
    ids=["disconnected", "completions-500", "html-200"],
)
def test_total_outage_gives_attempts_back_and_pauses_until_the_servers_return(
    db: psycopg.Connection,
    database_url: str,
    tmp_path: Path,
    scenario: str,
    take_down: Callable[[ScriptedLLM], None],
) -> None:
    """Every backend down (connections refused, or every completion failing while /models
    still answers): no attempt is used, claiming pauses, and everything is saved once they
    are back."""
    triage, distil = _items(db, "out")
    keys = (
        triage + distil + [enqueue_triage(db, exchange(f"tokx{i}", save=True)) for i in range(10)]
    )
    log = tmp_path / "worker.log"
    embed_up = hash_embedding_responder(EMBED_DIM, model="scripted-embed")
    with (
        ScriptedLLM(chat=answer) as primary,
        ScriptedLLM(chat=answer) as fallback,
        ScriptedLLM(embed_dim=EMBED_DIM) as embed,
    ):
        for server in (primary, fallback):
            take_down(server)
        env = pipeline_env(
            database_url, tmp_path, [primary, fallback], embed,
            SOKRATOS_MAX_ATTEMPTS=str(MAX_ATTEMPTS),
        )  # fmt: skip
        proc = start_worker(env, log)
        try:
            assert wait_until(lambda: "no backend" in _worker_states(env), timeout=60), tail(log)
            time.sleep(2.5)  # calls in flight when the first item gave its attempt back end
            paused_calls = primary.count(CHAT) + fallback.count(CHAT)
            time.sleep(2)  # paused: nothing more is claimed or sent (probes only)
            assert outcome_count(db) == 0
            attempts = scalar(
                db,
                "SELECT coalesce(max(attempts), 0) FROM (SELECT attempts FROM pending_triage"
                " UNION ALL SELECT attempts FROM pending_distillation) a",
            )
            assert attempts == 0, "an outage of every backend used up attempts"
            leased = scalar(db, "SELECT count(*) FROM pending_triage WHERE lease_owner IS NOT NULL")
            assert leased == 0
            # status names each backend's circuit and why (the heartbeat carries the detail).
            status = json.loads(cli(env, "status", "--json", timeout=30).stdout)
            shown = [b for w in status["workers"] for b in w["backends"]]
            assert shown and all("consecutive_failures" in b and "last_error" in b for b in shown)
            assert primary.count(CHAT) + fallback.count(CHAT) == paused_calls
            # The servers come back: the probe succeeds, claiming resumes.
            for server in (primary, fallback):
                server.on(CHAT, answer)
                server.on(PROBE, lambda r: Reply.chat("OK"))
                server.on(MODELS, lambda r: Reply(json_body={"object": "list", "data": []}))
                server.on(HEALTH, lambda r: Reply(json_body={"status": "ok"}))
            back = time.monotonic()
            assert wait_until(lambda: outcome_count(db) > 0, timeout=90), tail(log)
            recover = time.monotonic() - back
            assert wait_until(lambda: outcome_count(db) >= len(keys), timeout=60), tail(log)
            assert wait_until(lambda: "running" in _worker_states(env), timeout=20)
        finally:
            assert stop(proc) == 0, tail(log)
        embed.on(EMBEDDINGS, embed_up)
    fig = assert_exactly_once(db, keys)
    outcomes = _outcome_rows(db)
    inflated = [k for k in keys if outcomes[k][1] != 1]
    assert not inflated, f"attempts counted for the outage: {[outcomes[k] for k in inflated]}"
    assert fig.by_outcome.get("saved") == len(keys), fig
    report(scenario, fig, recover, max_attempts_recorded=1)


@pytest.mark.timeout(180)
def test_an_embedding_request_that_breaks_a_healthy_server_is_the_items_problem(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """durability.md: a request that breaks a healthy server (the probe right after succeeds)
    is the item's own problem: attempts are used and the item ends, it must not loop."""
    good = [enqueue_triage(db, exchange(f"tokg{i}", save=True)) for i in range(5)]
    # The scripted model puts the token into the summary, so the memory write embeds it too.
    bad = [enqueue_triage(db, exchange("tokbreakembed1", save=True))]
    keys = good + bad
    embed_ok = hash_embedding_responder(EMBED_DIM, model="scripted-embed")

    def embed(request: Request) -> Reply:
        if "tokbreakembed" in json.dumps(request.body):
            return Reply.error(500, "the server chokes on this input")
        return embed_ok(request)

    finished, log = _drain_with_embedder(db, database_url, tmp_path, embed, len(keys))
    left = db.execute("SELECT attempts, last_error FROM pending_triage").fetchall()
    assert finished, f"the item never ends: {left}; {tail(log, 1500)}"
    fig = assert_exactly_once(db, keys)
    assert _outcome_rows(db)[bad[0]] == ("failed", MAX_ATTEMPTS)
    report("embedding_500_for_one_input", fig, None)


@pytest.mark.timeout(180)
def test_an_embedding_server_that_refuses_each_first_request_costs_no_attempt(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """A transient 503 (a model loading, a restart) is retried inside the call: every item is
    saved on its first attempt, though every input's first request failed."""
    keys = [enqueue_triage(db, exchange(f"tokflap{i}", save=True)) for i in range(8)]
    embed_ok = hash_embedding_responder(EMBED_DIM, model="scripted-embed")
    seen: set[str] = set()
    lock = threading.Lock()  # the server answers each connection on its own thread
    refused = itertools.count()

    def embed(request: Request) -> Reply:
        text = json.dumps(request.body.get("input"))
        with lock:
            first = "sokratos-worker probe" not in text and text not in seen
            seen.add(text)
        if first:
            next(refused)
            return Reply.error(503, "Loading model")
        return embed_ok(request)

    finished, log = _drain_with_embedder(db, database_url, tmp_path, embed, len(keys))
    assert finished, tail(log, 1500)
    fig = assert_exactly_once(db, keys)
    assert fig.by_outcome == {"saved": len(keys)}, fig
    assert {attempts for _, attempts in _outcome_rows(db).values()} == {1}
    report("embedding_503_on_first_request", fig, None, refused_requests=next(refused))


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("scenario", "broken"),
    [
        ("embedding_404_model_missing", Reply.error(404, "model not found")),
        # 200 with junk for every input, the probe's too: the server's fault, not the items'.
        ("embedding_nan_vectors", Reply.embeddings([[float("nan")] * EMBED_DIM])),
        ("embedding_wrong_dimension", Reply.embeddings([[0.5] * (EMBED_DIM + 3)])),
    ],
    ids=["404", "nan", "wrong-dimension"],
)
def test_an_embedding_model_that_is_not_there_pauses_without_using_attempts(
    db: psycopg.Connection, database_url: str, tmp_path: Path, scenario: str, broken: Reply
) -> None:
    """durability.md, rule 7: an embedding server answering 404 (a model never pulled, a
    rotated key), or vectors no input could use, is not the items' fault: their attempts are
    given back and claiming pauses until a probe succeeds; then every item is saved on its
    first counted attempt."""
    keys = [enqueue_triage(db, exchange(f"tokmissingembed{i}", save=True)) for i in range(4)]
    embed_ok = hash_embedding_responder(EMBED_DIM, model="scripted-embed")
    pulled = threading.Event()

    def embed(request: Request) -> Reply:
        return embed_ok(request) if pulled.is_set() else broken

    seen: dict[str, Any] = {}

    def while_paused(log: Path) -> None:
        assert wait_until(lambda: "claiming_paused" in log.read_text(), timeout=60), tail(log)
        time.sleep(1.0)  # a paused worker claims nothing more
        seen["held"] = db.execute("SELECT max(attempts), count(*) FROM pending_triage").fetchone()
        seen["failures"] = scalar(db, "SELECT count(*) FROM failed_operations")
        pulled.set()
        seen["pulled_at"] = time.monotonic()

    finished, log = _drain_with_embedder(
        db, database_url, tmp_path, embed, len(keys), meanwhile=while_paused, seen=seen
    )
    recovered_s = seen["done_at"] - seen["pulled_at"]
    held, failures = seen["held"], seen["failures"]
    assert held == (0, len(keys)) and failures == 0, (held, failures)
    assert finished, tail(log, 1500)
    fig = assert_exactly_once(db, keys)
    assert fig.by_outcome == {"saved": len(keys)}, fig
    assert {attempts for _, attempts in _outcome_rows(db).values()} == {1}
    report(scenario, fig, recovered_s)


def _drain_with_embedder(
    db: psycopg.Connection,
    database_url: str,
    tmp_path: Path,
    embed: Responder,
    items: int,
    *,
    meanwhile: Callable[[Path], None] | None = None,
    seen: dict[str, Any] | None = None,
) -> tuple[bool, Path]:
    """Run a worker with the scripted model and ``embed`` as the embedding server until
    ``items`` outcomes exist (or 90 s pass); whether they did, and the worker's log.
    ``meanwhile(log)`` runs first, while the worker drains (to change the servers)."""
    log = tmp_path / "worker.log"
    with ScriptedLLM(chat=answer) as server, ScriptedLLM() as embedder:
        embedder.on(EMBEDDINGS, embed)
        env = pipeline_env(
            database_url, tmp_path, [server], embedder, SOKRATOS_MAX_ATTEMPTS=str(MAX_ATTEMPTS)
        )
        proc = start_worker(env, log)
        try:
            if meanwhile is not None:
                meanwhile(log)
            finished = wait_until(lambda: outcome_count(db) >= items, timeout=90)
            if seen is not None:
                seen["done_at"] = time.monotonic()
        finally:
            assert stop(proc) == 0, tail(log)
    return finished, log


@pytest.mark.timeout(180)
def test_a_backend_that_closes_every_connection_after_answering(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """A proxy in front of the model and the embedder that closes each kept-alive connection
    right after its answer, without saying so: every next request needs a new connection,
    which the client notices before sending (no request lost, no attempt used)."""
    keys = [enqueue_triage(db, exchange(f"tokclose{i}", save=True)) for i in range(8)]
    keys.append(enqueue_distillation(db, messages_archive("tokclosearchive1")))

    def closing(responder: Responder) -> Responder:
        return lambda request: dataclasses.replace(responder(request), close=True)

    log = tmp_path / "worker.log"
    embed = hash_embedding_responder(EMBED_DIM, model="scripted-embed")
    with ScriptedLLM(chat=closing(answer)) as server, ScriptedLLM() as embedder:
        embedder.on(EMBEDDINGS, closing(embed))
        env = pipeline_env(
            database_url, tmp_path, [server], embedder, SOKRATOS_MAX_ATTEMPTS=str(MAX_ATTEMPTS)
        )
        proc = start_worker(env, log)
        try:
            finished = wait_until(lambda: outcome_count(db) >= len(keys), timeout=90)
        finally:
            assert stop(proc) == 0, tail(log)
        requests = server.count() + embedder.count(EMBEDDINGS)
    assert finished, tail(log, 1500)
    fig = assert_exactly_once(db, keys)
    assert fig.by_outcome == {"saved": len(keys)}, fig
    assert {attempts for _, attempts in _outcome_rows(db).values()} == {1}
    calls_failed = log.read_text().count('"llm_call_failed"')
    # Without the check before reuse, every reused connection fails once (8 here); a server
    # thread descheduled between its answer and its close can still win a rare race.
    assert calls_failed <= 2, tail(log, 1500)
    report(
        "backend_closes_every_connection",
        fig,
        None,
        requests=requests,
        calls_failed_and_retried=calls_failed,
    )
