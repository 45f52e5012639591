"""contract §6: lines logged while an item is handled carry its queue, item_id and attempt.

The runner's slot binds them (structlog contextvars) for the handler call and its settle
only: the next item on the same slot thread, and the dispatcher's lines, never inherit them;
the LLM client's HTTP retry count is ``http_attempt``, so it never hides the item's attempt.
"""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr
from typing import Any

import psycopg
import pytest
import structlog
from pydantic import BaseModel

from sokratos_worker.config import BackendConfig
from sokratos_worker.errors import BackendsUnavailable
from sokratos_worker.llm.chat import FallbackChatClient, RetryPolicy
from sokratos_worker.logs import configure_logging
from sokratos_worker.model import Effects, Item, Queue
from sokratos_worker.runner import Runner
from sokratos_worker.store import queue as store
from sokratos_worker.store.connection import Database
from sokratos_worker.testing import Reply, ScriptedLLM
from tests.support.daemon import wait_until
from tests.support.db import count, enqueue_many
from tests.support.handlers import ScriptedHandler, fast_settings

ITEM_KEYS = ("queue", "item_id", "attempt")


class TalkingHandler(ScriptedHandler):
    """Logs one line per call (naming no item itself) and records the context it ran in;
    ``unavailable_first``: its first call finds no backend (the item is given back)."""

    def __init__(self, *, unavailable_first: bool = False) -> None:
        super().__init__()
        self.unavailable_first = unavailable_first
        self.contexts: list[tuple[str, dict[str, Any]]] = []

    def handle(self, item: Item) -> Effects:
        with self.lock:
            first = not self.contexts
            self.contexts.append(
                (threading.current_thread().name, structlog.contextvars.get_contextvars())
            )
        structlog.get_logger("sokratos_worker.pipelines.test").info("handler_says")
        if first and self.unavailable_first:
            raise BackendsUnavailable("every backend unreachable (scripted)")
        return super().handle(item)


@contextmanager
def json_lines() -> Iterator[list[dict[str, Any]]]:
    """The JSON lines logged at info within the block (parsed when it ends)."""
    buffer = io.StringIO()
    lines: list[dict[str, Any]] = []
    try:
        with redirect_stderr(buffer):
            configure_logging("info", "json")
            yield lines
    finally:
        structlog.reset_defaults()
        lines += [json.loads(x) for x in buffer.getvalue().splitlines() if x.startswith("{")]


def _item_of(line: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(line.get(k) for k in ITEM_KEYS)


def test_lines_logged_for_an_item_name_it_and_the_next_item_on_the_slot_does_not_inherit_it(
    db: psycopg.Connection, database_url: str
) -> None:
    ok = enqueue_many(db, 2, prefix="ok")
    (retried,) = enqueue_many(db, 1, behaviour="fail_once", prefix="retried")
    handler = TalkingHandler()
    database = Database(database_url, size=3)
    runner = Runner(
        settings=fast_settings(concurrency=1),  # one slot thread handles every item
        database=database,
        handlers={Queue.TRIAGE: handler},
        worker_id="ctx",
    )
    try:
        with json_lines() as lines:
            runner.start()  # (not a drain: it would end before the retry is ready)
            assert wait_until(
                lambda: count(db, "SELECT count(*) FROM work_outcomes") == 3, timeout=30
            )
            runner.shutdown(1)
    finally:
        database.close()
    said = [_item_of(e) for e in lines if e["event"] == "handler_says"]
    triage = Queue.TRIAGE.value
    expected = {(triage, i, 1) for i in ok} | {(triage, retried, 1), (triage, retried, 2)}
    assert sorted(said) == sorted(expected), said
    # Each call saw exactly its own item's keys: nothing left from the item before it.
    assert {name for name, _ in handler.contexts} == {"slot-0"}
    assert sorted(_item_of(ctx) for _, ctx in handler.contexts) == sorted(expected)
    assert all(set(ctx) == set(ITEM_KEYS) for _, ctx in handler.contexts), handler.contexts
    (retry,) = [e for e in lines if e["event"] == "item_retry_scheduled"]
    assert _item_of(retry) == (triage, retried, 1)
    assert count(db, "SELECT count(*) FROM work_outcomes WHERE outcome = 'saved'") == 3


def test_the_slot_restores_its_context_after_the_item(
    db: psycopg.Connection, database_url: str
) -> None:
    (item_id,) = enqueue_many(db, 1)
    handler = TalkingHandler()
    database = Database(database_url, size=2)
    runner = Runner(
        settings=fast_settings(),
        database=database,
        handlers={Queue.TRIAGE: handler},
        worker_id="ctx",
    )
    structlog.contextvars.bind_contextvars(queue="outer", worker="w")
    try:
        with database.connection() as conn:
            (item,) = store.claim(conn, Queue.TRIAGE, owner="ctx", limit=1, lease_s=30)
        assert runner._track_claimed([item]) == [item]
        assert runner._process(item) is None
        after = structlog.contextvars.get_contextvars()
    finally:
        structlog.contextvars.clear_contextvars()
        database.close()
    [(_, during)] = handler.contexts
    assert during == {"queue": Queue.TRIAGE.value, "item_id": item_id, "attempt": 1, "worker": "w"}
    assert after == {"queue": "outer", "worker": "w"}


def test_the_dispatchers_lines_carry_no_item(db: psycopg.Connection, database_url: str) -> None:
    """The slot that finds no backend pauses claiming (its lines name the item); the
    dispatcher that probes and resumes runs in no item's context."""
    (item_id,) = enqueue_many(db, 1)
    handler = TalkingHandler(unavailable_first=True)
    database = Database(database_url, size=3)
    runner = Runner(
        settings=fast_settings(concurrency=1),
        database=database,
        handlers={Queue.TRIAGE: handler},
        worker_id="ctx",
    )
    runner._worker_state._pause_delay = 0.1  # the first probe at once, not after 5 s
    try:
        with json_lines() as lines:
            runner.start()
            assert wait_until(
                lambda: count(db, "SELECT count(*) FROM work_outcomes") == 1, timeout=30
            )
            runner.shutdown(1)
    finally:
        database.close()
    by_event = {e["event"]: e for e in lines}
    triage = Queue.TRIAGE.value
    assert _item_of(by_event["attempt_given_back"]) == (triage, item_id, 1)
    assert _item_of(by_event["claiming_paused"]) == (triage, item_id, 1)
    resumed = by_event["claiming_resumed"]
    assert not set(ITEM_KEYS) & set(resumed), resumed


class Verdict(BaseModel):
    save: bool


def test_the_llm_clients_retry_count_is_http_attempt_and_the_items_attempt_stays() -> None:
    with ScriptedLLM() as server:
        server.script(Reply.error(503, "loading"), Reply.chat({"save": True}))
        client = FallbackChatClient(
            [BackendConfig(name="a", url=server.url, model="scripted", timeout=5)],  # type: ignore[call-arg]
            policy=RetryPolicy(),
            sleep=lambda _: None,
        )
        try:
            with (
                json_lines() as lines,
                structlog.contextvars.bound_contextvars(
                    queue="pending_triage", item_id=42, attempt=3
                ),
            ):
                client.complete(
                    response_model=Verdict, system="s", user="u", max_tokens=8, purpose="t"
                )
        finally:
            client.close()
    calls = [e for e in lines if e["event"] in ("llm_call_failed", "llm_call_finished")]
    assert [(e["event"], e["http_attempt"]) for e in calls] == [
        ("llm_call_failed", 1),
        ("llm_call_finished", 2),
    ]
    assert all(_item_of(e) == ("pending_triage", 42, 3) for e in calls), calls


@pytest.fixture(autouse=True)
def _no_context_left() -> Iterator[None]:
    yield
    structlog.contextvars.clear_contextvars()
