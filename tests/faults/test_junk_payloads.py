"""Scenario 4: property-based junk payloads, straight into the tables or through the client."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from sokratos_worker.client import enqueue
from sokratos_worker.config import Settings, load_settings
from sokratos_worker.errors import InvalidPayload
from sokratos_worker.handlers import HandlerContext
from sokratos_worker.llm import build_chat_client, build_embedder
from sokratos_worker.model import Queue
from sokratos_worker.pipelines import build_handlers
from sokratos_worker.runner import Runner
from sokratos_worker.store.connection import Database
from sokratos_worker.testing.scripted_llm import ScriptedLLM
from tests.faults.support import (
    EMBED_DIM,
    Figures,
    Key,
    answer,
    assert_exactly_once,
    backends_env,
    exchange,
    figures,
    report,
)

pytestmark = [pytest.mark.faults, pytest.mark.postgres, pytest.mark.slow]

FIELD_ERROR = re.compile(r"^invalid payload: [\w.\[\]]+ \S")
NASTY = ["\x00", "\ud800", "a\udfffb", "\u0000tail", "\U0001f600", "\ufffe", "é" * 3, ""]

nasty_text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(NASTY),
    st.lists(
        st.sampled_from([*NASTY, "user: ", "assistant: ", "\n", "tok1 SAVE "]), max_size=8
    ).map("".join),
    st.integers(0, 1_000_000).map(lambda n: "user: " + "x" * n),  # huge, up to ~1 MB
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    nasty_text,
)
junk = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(nasty_text, inner, max_size=4)
    ),
    max_leaves=12,
)


def _nest(depth: int) -> Any:
    value: Any = "deep"
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


deep = st.integers(1, 200).map(_nest)
message = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "assistant", "tool", "system"]), junk)},
    optional={"content": st.one_of(nasty_text, junk), "tool_calls": junk, "name": junk},
)
triage_payloads = st.one_of(
    st.fixed_dictionaries(
        {"exchange": st.one_of(nasty_text, junk, deep)},
        optional={"tools_used": junk, "pipeline_id": junk, "occurred_at": junk, "x": deep},
    ),
    junk,
)
distillation_payloads = st.one_of(
    st.fixed_dictionaries({"messages": st.one_of(st.lists(message, max_size=4), junk, deep)}),
    st.fixed_dictionaries({"archive_text": st.one_of(nasty_text, junk)}),
    junk,
)
cases = st.one_of(
    st.tuples(st.just(Queue.TRIAGE), st.sampled_from(["conversation", "email"]), triage_payloads),
    st.tuples(st.just(Queue.DISTILLATION), st.just("distillation"), distillation_payloads),
)


@dataclass
class Rig:
    settings: Settings
    database: Database
    handlers: Any
    conninfo: str
    db: psycopg.Connection
    keys: list[Key]
    logs: list[dict[str, Any]]
    via_client: int = 0
    refused: int = 0
    direct: int = 0
    drains: int = 0

    def drain(self) -> None:
        runner = Runner(
            settings=self.settings,
            database=self.database,
            handlers=self.handlers,
            worker_id=f"junk-{self.drains}",
        )
        runner.start(drain_only=True)
        assert runner.wait_drained(120), "the drain did not finish"
        runner.shutdown(1.0)
        self.drains += 1


@pytest.fixture
def rig(db: psycopg.Connection, database_url: str) -> Iterator[Rig]:
    with ScriptedLLM(chat=answer) as chat_server, ScriptedLLM(embed_dim=EMBED_DIM) as embed:
        conf = load_settings(
            {
                "SOKRATOS_DATABASE_URL": database_url,
                "SOKRATOS_MAX_ATTEMPTS": "1",
                "SOKRATOS_CONCURRENCY": "4",
                "SOKRATOS_LLM_BACKENDS": backends_env(chat_server, timeout=10),
                "SOKRATOS_EMBEDDING_URL": embed.url,
                "SOKRATOS_EMBEDDING_MODEL": "scripted-embed",
                "SOKRATOS_EMBEDDING_DIM": str(EMBED_DIM),
            }
        )
        database = Database(database_url, size=8)
        chat = build_chat_client(conf)
        embedder = build_embedder(conf)
        try:
            handlers = build_handlers(HandlerContext(conf, database, chat, embedder))
            # Hundreds of dead-letter lines would bury the FAULTS report; kept for a failure.
            with capture_logs() as logs:
                yield Rig(conf, database, handlers, database_url, db, [], logs)
        finally:
            database.close()


def _put(rig: Rig, queue: Queue, source: str, payload: Any) -> Key | None:
    """Straight into the table as jsonb; where PostgreSQL refuses, through the client."""
    text = json.dumps(payload)
    try:
        row = rig.db.execute(
            f"INSERT INTO {queue.value} (payload{', source' if queue is Queue.TRIAGE else ''})"
            f" VALUES (%s::jsonb{', %s' if queue is Queue.TRIAGE else ''}) RETURNING id",
            (text, source) if queue is Queue.TRIAGE else (text,),
        ).fetchone()
    except psycopg.errors.DataError:
        pass  # NUL or a lone surrogate: jsonb cannot hold it
    else:
        assert row is not None
        rig.direct += 1
        return (queue.value, int(row[0]))
    done = None
    try:
        done = enqueue(
            rig.conninfo, queue, payload, source=source if queue is Queue.TRIAGE else None
        )
    except InvalidPayload as exc:
        refusal: InvalidPayload | None = exc
    else:
        refusal = None
    if refusal is not None:
        # A clear error that names the field.
        assert refusal.field
        assert str(refusal).startswith(f"invalid payload: {refusal.field}")
        rig.refused += 1
        return None
    assert done.item_id is not None
    rig.via_client += 1
    return (queue.value, done.item_id)


def _what_became_of(rig: Rig, key: Key, outcomes: list[Any]) -> str:
    """The item's row (without its payload) and the log lines naming it: why it has no outcome."""
    queue, item_id = key
    [(row,)] = rig.db.execute(
        f"SELECT (SELECT to_jsonb(t) - 'payload' FROM {queue} t WHERE id = %s)", (item_id,)
    ).fetchall()
    lines = [
        {k: v for k, v in e.items() if k != "payload"}
        for e in rig.logs
        if e.get("item_id") == item_id and e.get("queue") in (queue, None)
    ]
    return f"{key}: outcomes {outcomes}; row {row}; log lines {lines[-20:]}"


def _check_outcome(rig: Rig, key: Key) -> None:
    row = rig.db.execute(
        "SELECT o.outcome, f.error_message, f.context_data -> 'payload' IS NOT NULL"
        " FROM work_outcomes o LEFT JOIN failed_operations f"
        " ON f.source_queue = o.queue AND f.item_id = o.item_id"
        " WHERE o.queue = %s AND o.item_id = %s",
        key,
    ).fetchall()
    assert len(row) == 1, _what_became_of(rig, key, row)
    outcome, error, kept = row[0]
    if outcome == "failed":
        assert kept, key
        assert FIELD_ERROR.match(error), error
    else:
        assert outcome in {"saved", "skipped", "archived"}, outcome


@pytest.mark.timeout(300)
# When an example fails, Hypothesis replays it and renders its arguments; for a large payload
# that rendering warns, and the project's warnings-as-errors made the warning the test's
# error, hiding the example's own (a CI run on 2026-12-05): let the real failure through.
@pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning")
def test_junk_payloads_each_end_in_exactly_one_outcome(rig: Rig) -> None:
    started = time.monotonic()

    @settings(
        max_examples=40,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                               HealthCheck.data_too_large, HealthCheck.large_base_example],
    )  # fmt: skip
    @given(batch=st.lists(cases, min_size=1, max_size=4))
    @example(batch=[(Queue.TRIAGE, "conversation", {"exchange": "user: " + "é" * 500_000})])
    @example(batch=[(Queue.DISTILLATION, "distillation", {"archive_text": "x\u0000" * 400_000})])
    @example(batch=[(Queue.TRIAGE, "email", {"text": "a\ud800b\x00", "subject": ["x"]})])
    @example(batch=[(Queue.TRIAGE, "conversation", {"exchange": "user: hi\x00 SAVE tok9"})])
    def run(batch: list[tuple[Queue, str, Any]]) -> None:
        keys = [k for k in (_put(rig, q, s, p) for q, s, p in batch) if k is not None]
        rig.drain()
        for key in keys:
            _check_outcome(rig, key)
        rig.keys.extend(keys)

    run()
    # The worker still works: a plain item after all the junk is saved.
    rig.keys.append(_put(rig, Queue.TRIAGE, "conversation", exchange("tok424242", save=True)))  # type: ignore[arg-type]
    rig.drain()
    fig: Figures = assert_exactly_once(rig.db, rig.keys)
    assert figures(rig.db, rig.keys[-1:]).by_outcome == {"saved": 1}
    report(
        "junk_payloads_hypothesis",
        fig,
        None,
        direct_jsonb=rig.direct,
        via_client=rig.via_client,
        refused_by_client=rig.refused,
        elapsed_s=round(time.monotonic() - started, 1),
    )


@pytest.mark.timeout(120)
def test_nesting_deeper_than_python_can_parse(rig: Rig) -> None:
    """jsonb holds nesting that Python's json cannot load: such an item must still end."""
    depth = 5000
    text = '{"exchange": ' + "[" * depth + "]" * depth + "}"
    key = ("pending_triage", int(rig.db.execute(
        "INSERT INTO pending_triage (payload) VALUES (%s::jsonb) RETURNING id", (text,)
    ).fetchone()[0]))  # type: ignore[index]  # fmt: skip
    good = _put(rig, Queue.TRIAGE, "conversation", exchange("tok777", save=True))
    assert good is not None
    for _ in range(3):
        rig.drain()
        if figures(rig.db, [key, good]).outcomes == 2:
            break
    fig = assert_exactly_once(rig.db, [key, good])
    _check_outcome(rig, key)
    report("junk_nesting_5000", fig, None)
