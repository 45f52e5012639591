"""The header line of a ``messages`` archive, ``[Conversation archived YYYY-MM-DD HH:MM]``, is
40 bytes; a first message too long to share the first 1,200-byte chunk with it (a long
assistant reply, a pasted text) is cut after the header's newline. The raw archive a failed
distillation keeps then saved a memory holding that header and nothing else (Go's 50-byte
scrap rule drops it; the raw archive keeps every piece), and distillation sent a window of
the header alone to the model when the first message passed 16 kB: a call that can find no
fact (found by a failedhunt hunt, 2026-12-07). A piece holding nothing but archive headers is
no longer saved nor sent; every message still is."""

from __future__ import annotations

import json
import re

import psycopg
import pytest

from sokratos_worker.model import Queue
from sokratos_worker.pipelines import DistillationHandler
from sokratos_worker.pipelines.write import MemoryWriter
from sokratos_worker.store import failures
from sokratos_worker.store.connection import Database
from sokratos_worker.store.memories import MemoryReader
from sokratos_worker.testing.scripted_llm import Reply, ScriptedLLM

from .conftest import drain, enqueue, make_item, outcome
from .fakes import FakeChat, FakeEmbedder

pytestmark = pytest.mark.postgres

HEADER_ONLY = r"^\[Conversation archived[^\]]*\]$"
REPLY = "You could sail from Oslo to Bergen along the coast. " * 40  # 2,080 bytes


def test_a_raw_archive_saves_no_memory_holding_only_its_header(
    db: psycopg.Connection, database_url: str
) -> None:
    payload = {
        "messages": [
            {"role": "assistant", "content": REPLY},
            {"role": "user", "content": "I keep my boat in Oslo."},
        ]
    }
    item = enqueue(db, "SELECT sokratos_enqueue_distillation(%s::jsonb)", json.dumps(payload))
    with ScriptedLLM(chat=lambda _: Reply.chat({"not": "facts"})) as server:
        drain(database_url, server)
    result, memory_ids, detail = outcome(db, "pending_distillation", item)
    assert result == "archived", detail
    rows = db.execute(
        "SELECT id, summary FROM memories WHERE source = 'conversation_archive' ORDER BY id"
    ).fetchall()
    assert sorted(memory_ids) == [r[0] for r in rows]
    only_header = db.execute(
        "SELECT count(*) FROM memories WHERE summary ~ %s", (HEADER_ONLY,)
    ).fetchone()
    assert only_header == (0,), [r[1][:60] for r in rows]
    joined = "\n".join(r[1] for r in rows)
    assert joined.count("sail from Oslo to Bergen") == 40  # every message kept, once
    assert joined.count("I keep my boat in Oslo.") == 1


def test_no_window_of_the_header_alone_is_sent_to_the_model(database: Database) -> None:
    chat = FakeChat()
    chat.script("distillation", *[{"facts": []}] * 5)
    embedder = FakeEmbedder()
    handler = DistillationHandler(
        MemoryWriter(MemoryReader(database, embedding_model=embedder.model), chat, embedder),
        chat,
        embedder,
    )
    long_message = "I keep my boat in Oslo and sail it every summer. " * 400  # 20,000 bytes
    item = make_item(
        {"messages": [{"role": "user", "content": long_message}]}, queue=Queue.DISTILLATION
    )
    handler.handle(item)
    sent = [call.user for call in chat.calls]
    alone = [text for text in sent if re.fullmatch(HEADER_ONLY, text.strip())]
    assert not alone, f"{len(alone)} of {len(sent)} calls sent the header alone"
    # Every word went to the model, once (a window's edge may fall inside a word or a space).
    assert "".join(sent).replace(" ", "").count("sailiteverysummer") == 400


def test_a_replay_of_an_archive_saved_with_its_header_alone_saves_nothing_again(
    db: psycopg.Connection, database_url: str
) -> None:
    """An archive saved before this change holds the header-only piece too; a replay failing
    again saves nothing and lists what the earlier item saved, that piece included (the chain's
    archive is the archive, however an earlier version cut it)."""
    payload = {"messages": [{"role": "assistant", "content": REPLY}]}
    item = enqueue(db, "SELECT sokratos_enqueue_distillation(%s::jsonb)", json.dumps(payload))
    never = ScriptedLLM(chat=lambda _: Reply.chat({"not": "facts"}))
    with never as server:
        drain(database_url, server)
        # As the earlier code saved it: the header alone, listed in the item's outcome.
        header = db.execute(
            "INSERT INTO memories (summary, source, tags, salience, origin)"
            " VALUES ('[Conversation archived 2026-12-01 10:00]', 'conversation_archive',"
            " '{conversation_archive}', 3, %s) RETURNING id",
            (f"pending_distillation:{item}:99",),
        ).fetchone()
        assert header is not None
        db.execute(
            "UPDATE work_outcomes SET memory_ids = memory_ids || %s::bigint"
            " WHERE queue = 'pending_distillation' AND item_id = %s",
            (header[0], item),
        )
        before = db.execute("SELECT count(*) FROM memories").fetchone()
        (failure_id,) = db.execute("SELECT id FROM failed_operations").fetchone()
        with psycopg.connect(database_url, autocommit=True) as conn:
            replay = failures.retry_failure(conn, failure_id)
        assert replay.item_id is not None, replay.message
        drain(database_url, server)
    result, memory_ids, detail = outcome(db, "pending_distillation", replay.item_id)
    assert result == "archived", detail
    assert db.execute("SELECT count(*) FROM memories").fetchone() == before
    earlier = db.execute(
        "SELECT memory_ids FROM work_outcomes WHERE queue = 'pending_distillation' AND item_id = %s",
        (item,),
    ).fetchone()
    assert earlier is not None and sorted(memory_ids) == sorted(earlier[0])
