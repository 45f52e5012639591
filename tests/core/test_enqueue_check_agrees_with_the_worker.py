"""The enqueue check (sokratos_check_payload, sql/0049) refuses exactly what the worker would
dead-letter as an invalid payload at its first claim, and the client's offline check (the
spool) agrees with both: a producer calling the SQL functions learns at once (contract §4).

The worker's verdict is its own code, run directly: the claim's payload check and the
pipeline's handler, stopped at the first thing past the payload checks (the model or the
memory store). The payload it reads is the one PostgreSQL stored (jsonb text, parsed as the
claim parses it).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn, cast

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import errors

from sokratos_worker import client
from sokratos_worker.errors import InvalidPayload
from sokratos_worker.model import Item, Queue
from sokratos_worker.pipelines.distill import DistillationHandler
from sokratos_worker.pipelines.triage import TriageHandler
from sokratos_worker.store import queue as store

EXCHANGE = "user: I moved to Lisbon last week\nassistant: Noted, welcome to Lisbon!"
EMAIL = "Your flight to Porto on 12 March is confirmed. Booking reference XK42."
CALL = {"id": "c1", "type": "function", "function": {"name": "remember", "arguments": "{}"}}
ARCHIVE_SHAPE = {
    "messages": [
        {"role": "system", "content": "You are Sokratos."},
        {"role": "user", "content": "I moved to Porto", "timestamp": "2026-01-02T03:04:05Z"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "name": "remember", "content": "saved"},
        {"role": "assistant", "content": "Noted <think>fine</think>", "timestamp": None},
    ],
    "conversation_id": "conv-9",
    "pipeline_id": 7,
}


def _conversation(**fields: Any) -> tuple[str, Any]:
    return ("conversation", {"exchange": EXCHANGE, **fields})


def _email(**fields: Any) -> tuple[str, Any]:
    return ("email", {"text": EMAIL, **fields})


def _messages(*messages: Any, **fields: Any) -> tuple[str, Any]:
    return ("distillation", {"messages": list(messages), **fields})


def _user(**fields: Any) -> dict[str, Any]:
    return {"role": "user", "content": "I moved to Porto", **fields}


def _assistant(**fields: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": "Noted", **fields}


CORPUS: dict[str, tuple[str, Any]] = {
    # The reviewer's seven: queued by sql/0046, dead-lettered at the first claim.
    "tools-used-a-string": _conversation(tools_used="yes"),
    "pipeline-id-a-string": _conversation(pipeline_id="abc"),
    "occurred-at-soon": _conversation(occurred_at="soon"),
    "message-without-role": _messages({"content": "hi"}),
    "role-bot": _messages({"role": "bot", "content": "hi"}),
    "message-a-number": _messages(1),
    "conversation-id-a-number": _messages(_user(), conversation_id=5),
    # Contract §4's shapes, Go's nulls and zero values, extra fields.
    "conversation-shape": _conversation(
        tools_used=True, pipeline_id=42, occurred_at="2026-01-02T03:04:05Z"
    ),
    "conversation-nulls": _conversation(tools_used=None, pipeline_id=None, occurred_at=None),
    "conversation-go-zeros": _conversation(
        tools_used=False, pipeline_id=0, occurred_at="0001-01-01T00:00:00Z"
    ),
    "conversation-go-zero-west": _conversation(occurred_at="0000-12-31T23:58:45-00:01:15"),
    "conversation-extra-fields": _conversation(channel="telegram", meta={"a": [1, None]}),
    "conversation-unicode": ("conversation", {"exchange": "user: Ich bin nach Zürich gezogen 🏔\nassistant: Schön!"}),
    "exchange-empty": ("conversation", {"exchange": ""}),
    "exchange-trivial-bad-fields": ("conversation", {"exchange": " ok ", "tools_used": "yes"}),
    "exchange-missing": ("conversation", {"tools_used": True}),
    "exchange-null": ("conversation", {"exchange": None}),
    "exchange-a-number": ("conversation", {"exchange": 5}),
    "tools-used-a-number": _conversation(tools_used=1),
    "pipeline-id-true": _conversation(pipeline_id=True),
    "pipeline-id-float": _conversation(pipeline_id=1.5),
    "pipeline-id-whole-float": _conversation(pipeline_id=5.0),
    "pipeline-id-past-bigint": _conversation(pipeline_id=2**63),
    "pipeline-id-least-bigint": _conversation(pipeline_id=-(2**63)),
    "occurred-at-a-number": _conversation(occurred_at=20260102),
    "occurred-at-empty": _conversation(occurred_at=""),
    "occurred-at-blank": _conversation(occurred_at=" \u3000"),
    "occurred-at-padded": _conversation(occurred_at=" 2026-01-02T03:04:05+05:30\n"),
    "occurred-at-naive": _conversation(occurred_at="2026-01-02 03:04:05"),
    "occurred-at-date": _conversation(occurred_at="2026-01-02"),
    "occurred-at-nanoseconds": _conversation(occurred_at="2026-01-02T03:04:05.123456789Z"),
    "occurred-at-week-date": _conversation(occurred_at="2026-W01-1"),
    "occurred-at-basic": _conversation(occurred_at="20260102T030405"),
    "occurred-at-february-30": _conversation(occurred_at="2026-02-30"),
    "occurred-at-month-13": _conversation(occurred_at="2026-13-01"),
    "occurred-at-hour-25": _conversation(occurred_at="2026-01-02T25:00"),
    "occurred-at-offset-24h": _conversation(occurred_at="2026-01-02T03:04:05+24:00"),
    "occurred-at-bare-separator": _conversation(occurred_at="2026-01-02T"),
    "occurred-at-rfc2822": _conversation(occurred_at="Fri, 02 Jan 2026 03:04:05 +0000"),
    "email-shape": _email(
        subject="Flight", account="personal", message_id="<a@b>", date="Mon, 5 Jan 2026 10:00 +0000"
    ),
    "email-from": ("email", {"text": EMAIL, "from": "Ana <ana@example.org>"}),
    "email-nulls": _email(subject=None, message_id=None, account=None, date=None),
    "email-date-garbage": _email(date="yesterday"),
    "email-date-a-number": _email(date=5),
    "email-triage-fields-unread": _email(tools_used="yes", pipeline_id="abc"),
    "email-text-empty": ("email", {"text": ""}),
    "email-text-missing": ("email", {"subject": "Flight"}),
    "email-subject-a-number": _email(subject=5),
    "email-from-a-list": ("email", {"text": EMAIL, "from": ["ana@example.org"]}),
    "email-account-an-object": _email(account={}),
    "archive-shape": ("distillation", ARCHIVE_SHAPE),
    "archive-text-shape": ("distillation", {"archive_text": "[Conversation archived 2026-01-02 10:00]\nuser: hi"}),
    "archive-text-messages-null": ("distillation", {"archive_text": "user: hi", "messages": None}),
    "messages-archive-text-null": _messages(_user(), archive_text=None),
    "messages-empty": _messages(),
    "both-shapes": _messages(_user(), archive_text="user: hi"),
    "neither-shape": ("distillation", {"conversation_id": "c"}),
    "messages-a-string": ("distillation", {"messages": "user: hi"}),
    "messages-an-object": ("distillation", {"messages": {"role": "user"}}),
    "archive-text-a-number": ("distillation", {"archive_text": 5}),
    "archive-text-at-the-limit": ("distillation", {"archive_text": "x" * 512_000}),
    "archive-text-past-the-limit": ("distillation", {"archive_text": "é" * 256_001}),
    "role-a-number": _messages({"role": 5}),
    "role-capitalised": _messages({"role": "User", "content": "hi"}),
    "role-empty": _messages({"role": "", "content": "hi"}),
    "role-null": _messages({"role": None, "content": "hi"}),
    "content-a-list": _messages(_user(content=["I moved", "to Porto"])),
    "content-null": _messages(_user(content=None)),
    "content-empty": _messages(_user(content="")),
    "content-unicode": _messages(_user(content="Ich wohne jetzt in Zürich 🏔 — 東京")),
    "name-a-number": _messages({"role": "tool", "name": 5, "content": "ok"}),
    "tool-call-id-a-number": _messages({"role": "tool", "tool_call_id": 5, "content": "ok"}),
    "timestamp-soon": _messages(_user(timestamp="soon")),
    "timestamp-a-number": _messages(_user(timestamp=1767323045)),
    "timestamp-empty": _messages(_user(timestamp="")),
    "timestamp-blank": _messages(_user(timestamp=" ")),
    "timestamp-leading-space": _messages(_user(timestamp=" 2026-01-02T03:04:05Z")),
    "timestamp-trailing-space": _messages(_user(timestamp="2026-01-02 ")),
    "timestamp-year-zero": _messages(_user(timestamp="0000-01-01T00:00:00Z")),
    "timestamp-go-zero": _messages(_user(timestamp="0001-01-01T00:00:00Z")),
    "timestamp-on-a-system-message": _messages({"role": "system", "timestamp": "soon"}),
    "message-extra-fields": _messages(_user(reactions=["👍"], meta={"id": 3})),
    "tool-calls-nested": _messages(_assistant(tool_calls=[CALL, {"function": {"name": "x", "arguments": {"a": [1]}}}])),
    "tool-calls-flat": _messages(_assistant(tool_calls=[{"name": "x", "arguments": {"a": 1}}])),
    "tool-calls-function-a-string": _messages(_assistant(tool_calls=[{"function": "x"}])),
    "tool-calls-empty": _messages(_assistant(tool_calls=[])),
    "tool-calls-null": _messages(_assistant(tool_calls=None)),
    "tool-calls-a-string": _messages(_assistant(tool_calls="remember")),
    "tool-calls-an-object": _messages(_assistant(tool_calls=CALL)),
    "tool-call-a-number": _messages(_assistant(tool_calls=[CALL, 1])),
    "tool-calls-on-a-user-message": _messages(_user(tool_calls="remember")),
    "second-message-bad": _messages(_user(), {"role": "assistant", "content": 5}),
    "distillation-pipeline-id-a-string": ("distillation", {**ARCHIVE_SHAPE, "pipeline_id": "7"}),
    "distillation-pipeline-id-null": _messages(_user(), pipeline_id=None, conversation_id=None),
    "conversation-id-empty": _messages(_user(), conversation_id=""),
}


class _PastThePayloadChecks(Exception):
    """The handler reached the model or the memory store: every payload check had passed."""


class _Stop:
    """A reader, writer and chat client whose every use ends the run there."""

    def __getattr__(self, name: str) -> NoReturn:
        raise _PastThePayloadChecks(name)


def _as_the_claim_reads_it(db: psycopg.Connection, payload: Any) -> Any:
    """The payload as PostgreSQL stores it, parsed as the worker's claim parses it."""
    row = db.execute("SELECT %s::jsonb::text", (json.dumps(payload),)).fetchone()
    assert row is not None
    return store._safe_loads(row[0])


def _worker_refuses(db: psycopg.Connection, kind: str, payload: Any) -> bool:
    """True when the worker would dead-letter the item as an invalid payload at its claim."""
    stored = _as_the_claim_reads_it(db, payload)
    queue = Queue.DISTILLATION if kind == "distillation" else Queue.TRIAGE
    item = Item(
        queue=queue,
        id=1,
        payload=stored if isinstance(stored, dict) else {"__payload__": stored},
        attempt=1,
        source=kind if queue is Queue.TRIAGE else "distillation",
        idempotency_key=None,
        created_at=datetime.now(UTC),
    )
    stop = cast(Any, _Stop())
    handler = (
        DistillationHandler(stop, stop, None)
        if queue is Queue.DISTILLATION
        else TriageHandler(stop, stop, stop, None)
    )
    try:
        if store.payload_problem(item) is not None:
            return True
        handler.handle(item)  # an empty archive or a trivial exchange: skipped
    except InvalidPayload:
        return True
    except _PastThePayloadChecks:
        pass
    return False


def _sql_refuses(db: psycopg.Connection, kind: str, payload: Any) -> bool:
    """True when the producer's SQL function refuses the payload (SQLSTATE 22023)."""
    if kind == "distillation":
        query, params = "SELECT sokratos_enqueue_distillation(%s::jsonb)", (json.dumps(payload),)
    else:
        query, params = "SELECT sokratos_enqueue_triage(%s::jsonb, NULL, %s)", (json.dumps(payload), kind)
    try:
        with db.transaction():
            row = db.execute(query, params).fetchone()
    except errors.InvalidParameterValue:
        return True
    assert row is not None and isinstance(row[0], int)
    return False


def _client_refuses(spool_dir: Path, kind: str, payload: Any) -> bool:
    """True when the client's offline check (what the spool holds) refuses the payload."""
    queue = Queue.DISTILLATION if kind == "distillation" else Queue.TRIAGE
    try:
        client.spool(spool_dir, queue, payload, source=None if kind == "distillation" else kind)
    except InvalidPayload:
        return True
    return False


def test_the_enqueue_check_refuses_exactly_what_the_worker_dead_letters(
    db: psycopg.Connection, tmp_path: Path
) -> None:
    verdicts = {
        label: (
            _worker_refuses(db, kind, payload),
            _sql_refuses(db, kind, payload),
            _client_refuses(tmp_path, kind, payload),
        )
        for label, (kind, payload) in CORPUS.items()
    }
    disagreements = {
        label: dict(zip(("worker", "sql", "client"), verdict, strict=True))
        for label, verdict in verdicts.items()
        if len(set(verdict)) > 1
    }
    # Left to the claim on purpose (sql/0050): an archive too long to distil is queued and
    # dead-lettered there with its payload kept, not refused to a producer that may drop it.
    assert disagreements.pop("archive-text-past-the-limit") == {
        "worker": True, "sql": False, "client": False
    }
    assert disagreements == {}
    refused = {label for label, (worker, _, _) in verdicts.items() if worker}
    assert refused >= {
        "tools-used-a-string",
        "pipeline-id-a-string",
        "occurred-at-soon",
        "message-without-role",
        "role-bot",
        "message-a-number",
        "conversation-id-a-number",
    }
    assert len(refused) < len(CORPUS) - 30  # the corpus holds accepted payloads too


def test_the_sql_check_names_the_field_in_the_workers_words(db: psycopg.Connection) -> None:
    with pytest.raises(errors.InvalidParameterValue) as refused:
        db.execute(
            "SELECT sokratos_enqueue_distillation(%s::jsonb)",
            (json.dumps({"messages": [_user(), {"role": "bot", "content": "hi"}]}),),
        )
    assert refused.value.diag.message_primary == (
        "payload.messages[1].role must be one of ['assistant', 'system', 'tool', 'user']"
    )
    assert db.execute("SELECT count(*) FROM pending_distillation").fetchone() == (0,)


# Timestamps built from the pieces of ISO-8601 and of its near misses.
_PIECES = ["2026", "0000", "0001", "-", "01", "12", "13", "29", "W", "53", "1", "7", "T", " ",
           "é", ":", "00", "24", "59", "60", ".", ",", "5", "1234567", "+", "Z", "05:30", "x"]
_TIMESTAMPS = st.one_of(
    st.lists(st.sampled_from(_PIECES), max_size=12).map("".join),
    st.text(alphabet="0123456789-:+.,TWZ é", max_size=26),
)


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(stamp=_TIMESTAMPS)
def test_timestamps_are_read_as_the_worker_reads_them(db: psycopg.Connection, stamp: str) -> None:
    """occurred_at and a message's timestamp: SQL, the worker and the client agree."""
    for kind, payload in (_conversation(occurred_at=stamp), _messages(_user(timestamp=stamp))):
        worker = _worker_refuses(db, kind, payload)
        assert _sql_refuses(db, kind, payload) == worker, (kind, stamp, worker)


# Payloads of any shape around the fields the pipelines read (no NUL: jsonb refuses it).
_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=30)
_LEAF = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**64), max_value=2**64),
    st.floats(allow_nan=False, allow_infinity=False), _TEXT,
    st.sampled_from(["user", "assistant", "tool", "system", "2026-01-02T03:04:05Z", "0000-"]),
)
_MESSAGE_KEYS = ["role", "content", "name", "tool_call_id", "timestamp", "tool_calls", "function", "x"]
_VALUE = st.recursive(
    _LEAF,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(_MESSAGE_KEYS), inner, max_size=4)
    ),
    max_leaves=8,
)
_MESSAGE = st.builds(
    lambda role, rest: {**rest, "role": role},
    st.sampled_from(["user", "assistant", "tool", "system", "bot"]),
    st.dictionaries(st.sampled_from(_MESSAGE_KEYS), _VALUE, max_size=5),
)
_PAYLOADS = st.dictionaries(
    st.sampled_from([
        "exchange", "text", "tools_used", "pipeline_id", "occurred_at", "subject", "from",
        "message_id", "account", "date", "messages", "archive_text", "conversation_id", "x",
    ]),
    st.one_of(_VALUE, st.lists(st.one_of(_MESSAGE, _VALUE), max_size=4), _TEXT.map(lambda t: "user: " + t * 3)),
    max_size=6,
)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(kind=st.sampled_from(["conversation", "email", "distillation"]), payload=_PAYLOADS)
def test_generated_payloads_are_judged_alike(
    db: psycopg.Connection, tmp_path: Path, kind: str, payload: dict[str, Any]
) -> None:
    worker = _worker_refuses(db, kind, payload)
    sql = _sql_refuses(db, kind, payload)
    offline = _client_refuses(tmp_path, kind, payload)
    assert worker == sql == offline, (kind, payload, worker, sql, offline)
