"""A distillation that never distils is kept as a raw archive, every chunk under an origin of
its own; replayed with ``failed retry`` and failing again, it keeps one raw archive: the
replay lists the memories its earlier items saved (real runner and pipelines)."""

from __future__ import annotations

import json

import psycopg
import pytest

from sokratos_worker.config import load_settings
from sokratos_worker.handlers import HandlerContext
from sokratos_worker.llm.chat import FallbackChatClient
from sokratos_worker.model import Queue
from sokratos_worker.pipelines import build_handlers
from sokratos_worker.runner import Runner
from sokratos_worker.store import failures
from sokratos_worker.store.connection import Database
from sokratos_worker.testing.scripted_llm import Reply, Request, ScriptedLLM
from tests.pipelines.fakes import FakeEmbedder
from tests.support.db import count, enqueue_many
from tests.support.handlers import ScriptedHandler, fast_settings


def _never_valid(_: Request) -> Reply:
    return Reply.chat({"not": "what was asked"})  # no backend ever distils it


def _drain(database_url: str, server: ScriptedLLM) -> None:
    settings = load_settings(
        {
            "SOKRATOS_DATABASE_URL": database_url,
            "SOKRATOS_MAX_ATTEMPTS": "1",
            "SOKRATOS_LLM_BACKENDS": json.dumps(
                [{"name": "scripted", "url": server.url, "model": "scripted", "timeout": 5}]
            ),
        }
    )
    chat = FallbackChatClient(settings.llm_backends)
    database = Database(database_url, size=settings.pool_size)
    try:
        handlers = build_handlers(HandlerContext(settings, database, chat, FakeEmbedder()))
        runner = Runner(settings=settings, database=database, handlers=handlers, worker_id="replay")
        runner.start(drain_only=True, budget_s=20)
        assert runner.wait_drained(60)
        runner.shutdown(1)
    finally:
        chat.close()
        database.close()


def test_a_replayed_messages_archive_failing_again_is_saved_once(
    db: psycopg.Connection, database_url: str
) -> None:
    """A replay of a ``messages`` archive is a new item with a new enqueue time, which the
    archive's header line names: its raw archive still matches the first one's and is listed,
    not saved again."""
    payload = {
        "messages": [
            {"role": "user", "content": "I was born in Oslo in 1990."},
            {"role": "assistant", "content": "Noted, thanks."},
        ]
    }
    (item_id,) = db.execute(
        "SELECT sokratos_enqueue_distillation(%s::jsonb)", (json.dumps(payload),)
    ).fetchone()
    # The archive was queued yesterday (its conversation ended then).
    db.execute(
        "UPDATE pending_distillation SET created_at = now() - interval '1 day' WHERE id = %s",
        (item_id,),
    )
    with ScriptedLLM(chat=_never_valid) as server:
        _drain(database_url, server)
        (failure_id, outcome) = db.execute(
            "SELECT f.id, o.outcome FROM failed_operations f JOIN work_outcomes o"
            " ON o.queue = f.source_queue AND o.item_id = f.item_id"
        ).fetchone()
        assert outcome == "archived"
        with psycopg.connect(database_url, autocommit=True) as conn:
            replay = failures.retry_failure(conn, failure_id)
        assert replay.item_id is not None, replay.message
        _drain(database_url, server)  # the replay fails the same way
    assert db.execute("SELECT count(*) FROM pending_distillation").fetchone() == (0,)
    rows = db.execute(
        "SELECT id, origin, left(summary, 60) FROM memories"
        " WHERE source = 'conversation_archive' AND summary LIKE '%%born in Oslo%%' ORDER BY id"
    ).fetchall()
    assert len(rows) == 1, f"the conversation was saved {len(rows)} times: {rows}"


def _drain_scripted(database_url: str) -> None:
    database = Database(database_url, size=4)
    runner = Runner(
        settings=fast_settings(max_attempts=1),
        database=database,
        handlers={Queue.DISTILLATION: ScriptedHandler()},
        worker_id="replay",
    )
    try:
        runner.start(drain_only=True, budget_s=10)
        assert runner.wait_drained(30)
        runner.shutdown(1)
    finally:
        database.close()


@pytest.mark.parametrize("purged", [False, True], ids=["control", "purged"])
def test_a_replay_keeps_one_raw_archive_also_when_its_failure_row_was_purged(
    db: psycopg.Connection, database_url: str, purged: bool
) -> None:
    """The replay link in failed_operations is pruned (``failed purge``, the TTL, Sokratos's
    own maintenance); the replay's ``replay_of``, set by ``failed retry``, still leads back to
    the first item's outcome, kept for good, so the raw archive is not saved a second time."""
    enqueue_many(db, 1, behaviour="fail", queue="pending_distillation", prefix="conv")
    _drain_scripted(database_url)
    (failure_id,) = db.execute("SELECT id FROM failed_operations").fetchone()
    assert count(db, "SELECT count(*) FROM memories") == 1  # the raw archive, once
    # The operator replays a failure from last month...
    db.execute(
        "UPDATE failed_operations SET created_at = now() - interval '40 days' WHERE id = %s",
        (failure_id,),
    )
    with psycopg.connect(database_url, autocommit=True) as conn:
        replay = failures.retry_failure(conn, failure_id)
        assert replay.item_id is not None, replay.message
        if purged:  # ... and the 30-day retention runs before the replay is drained.
            assert failures.purge_failures(conn, older_than_days=30) == 1
    _drain_scripted(database_url)  # the replay fails again: dead-lettered with its raw archive
    assert count(db, "SELECT count(*) FROM pending_distillation") == 0
    archives = db.execute(
        "SELECT id, origin FROM memories WHERE source = 'conversation_archive' ORDER BY id"
    ).fetchall()
    assert len(archives) == 1, f"the conversation's raw archive was saved {len(archives)} times: {archives}"


def test_a_keyless_replay_keeps_one_raw_archive_when_its_failure_row_was_purged(
    db: psycopg.Connection, database_url: str
) -> None:
    """A keyless item (``enqueue`` without ``--key``, Sokratos's direct INSERTs) is replayed
    under ``failed_operations:<F>#retry-1``, a key no outcome bears: once the failure row was
    purged, nothing led back to the first archive and it was saved twice. ``replay_of`` does
    not depend on keys."""
    payload = json.dumps({"archive_text": "user: I moved to Lisbon", "behaviour": "fail"})
    db.execute("SELECT sokratos_enqueue_distillation(%s::jsonb)", (payload,))  # no key
    _drain_scripted(database_url)
    (failure_id,) = db.execute("SELECT id FROM failed_operations").fetchone()
    assert count(db, "SELECT count(*) FROM memories") == 1  # the raw archive, once
    db.execute(
        "UPDATE failed_operations SET created_at = now() - interval '40 days' WHERE id = %s",
        (failure_id,),
    )
    with psycopg.connect(database_url, autocommit=True) as conn:
        replay = failures.retry_failure(conn, failure_id)
        assert replay.item_id is not None, replay.message
        assert failures.purge_failures(conn, older_than_days=30) == 1  # the retention runs
    _drain_scripted(database_url)  # the replay fails again: dead-lettered with its raw archive
    assert count(db, "SELECT count(*) FROM pending_distillation") == 0
    archives = db.execute(
        "SELECT m.id, m.origin FROM memories m WHERE source = 'conversation_archive' ORDER BY id"
    ).fetchall()
    keys = db.execute(
        "SELECT item_id, idempotency_key, outcome FROM work_outcomes ORDER BY item_id"
    ).fetchall()
    assert len(archives) == 1, (
        f"the conversation's raw archive was saved {len(archives)} times: {archives};"
        f" outcomes {keys}"
    )


# A mutation review (session 29) gave every chunk the first one's origin: the memory insert is
# idempotent by origin, so all but the first ~1,000 bytes were lost, and no test saw it (they
# looked at the planned rows, not at the table).
MESSAGES = [f"message {n}: " + "the user talked about the garden in Oslo. " * 20 for n in range(8)]


def test_a_long_conversation_archived_after_failing_keeps_every_chunk(
    db: psycopg.Connection, database_url: str
) -> None:
    payload = {"messages": [{"role": "user", "content": text} for text in MESSAGES]}
    enqueued = db.execute(
        "SELECT sokratos_enqueue_distillation(%s::jsonb)", (json.dumps(payload),)
    ).fetchone()
    assert enqueued is not None
    (item_id,) = enqueued
    with ScriptedLLM(chat=_never_valid) as server:
        _drain(database_url, server)
    row = db.execute(
        "SELECT outcome, memory_ids FROM work_outcomes WHERE item_id = %s", (item_id,)
    ).fetchone()
    assert row is not None, "no outcome recorded"
    outcome, memory_ids = row
    assert outcome == "archived"
    rows = db.execute(
        "SELECT origin, summary FROM memories WHERE source = 'conversation_archive' ORDER BY id"
    ).fetchall()
    assert len(rows) > 1  # the conversation is several chunks long
    assert sorted(memory_ids) == sorted(
        r[0] for r in db.execute("SELECT id FROM memories WHERE source = 'conversation_archive'")
    )
    assert len({origin for origin, _ in rows}) == len(rows)
    archived = "\n".join(summary for _, summary in rows)
    for n in range(len(MESSAGES)):
        assert f"message {n}: " in archived, f"message {n} was lost from the raw archive"


def test_a_replayed_archive_with_identical_chunks_lists_each_earlier_chunk_once(
    db: psycopg.Connection, database_url: str
) -> None:
    """Three chunks of one text (a pasted log, say) were saved as three memories; the replay
    failing again lists those three, each once (a mutation review reused the first id for all
    three: the outcome then named one memory three times and two were nobody's)."""
    line = "tail -f /var/log/syslog: the backup finished without errors. " * 17 + "\n"
    payload = {"archive_text": line * 3}
    (item_id,) = db.execute(
        "SELECT sokratos_enqueue_distillation(%s::jsonb)", (json.dumps(payload),)
    ).fetchone()
    with ScriptedLLM(chat=_never_valid) as server:
        _drain(database_url, server)
        (failure_id,) = db.execute("SELECT id FROM failed_operations").fetchone()
        with psycopg.connect(database_url, autocommit=True) as conn:
            replay = failures.retry_failure(conn, failure_id)
        assert replay.item_id is not None, replay.message
        _drain(database_url, server)  # the replay fails the same way
    saved = [
        row[0]
        for row in db.execute(
            "SELECT id FROM memories WHERE source = 'conversation_archive' ORDER BY id"
        )
    ]
    assert len(saved) == 3, f"expected the three chunks once each, found memories {saved}"
    first, again = (
        db.execute(
            "SELECT outcome, memory_ids FROM work_outcomes WHERE item_id = %s", (id_,)
        ).fetchone()
        for id_ in (item_id, replay.item_id)
    )
    assert first is not None and again is not None
    assert first[0] == again[0] == "archived"
    assert sorted(first[1]) == saved
    assert sorted(again[1]) == saved, f"the replay listed {again[1]}, not each chunk once"


def test_a_replay_cut_by_another_version_keeps_the_earlier_raw_archive(
    db: psycopg.Connection, database_url: str
) -> None:
    """The replay of an item a worker of an earlier version archived, failing again under this
    one, saved its archive a second time: the earlier pieces were reused only when their text
    matched, and another version cuts other pieces (a `[continued]` marker, bounded tool
    output; found by a review). The replay holds the same payload: its chain's archive is the
    archive, whatever its pieces say."""
    line = "user: the backup finished without errors, and I moved to Lisbon in May. " * 17 + "\n"
    payload = {"archive_text": line * 3}
    (item_id,) = db.execute(
        "SELECT sokratos_enqueue_distillation(%s::jsonb)", (json.dumps(payload),)
    ).fetchone()
    with ScriptedLLM(chat=_never_valid) as server:
        _drain(database_url, server)
        # As an earlier version cut it: other piece boundaries, other words at each cut.
        db.execute(
            "UPDATE memories SET summary = 'as cut by an earlier version: ' || summary"
            " WHERE source = 'conversation_archive'"
        )
        earlier = [r[0] for r in db.execute("SELECT id FROM memories ORDER BY id")]
        assert len(earlier) >= 2
        (failure_id,) = db.execute("SELECT id FROM failed_operations").fetchone()
        with psycopg.connect(database_url, autocommit=True) as conn:
            replay = failures.retry_failure(conn, failure_id)
        assert replay.item_id is not None, replay.message
        _drain(database_url, server)  # the replay fails the same way
    saved = [r[0] for r in db.execute("SELECT id FROM memories ORDER BY id")]
    assert saved == earlier, f"the archive was saved again: {saved} after {earlier}"
    again = db.execute(
        "SELECT outcome, memory_ids FROM work_outcomes WHERE item_id = %s", (replay.item_id,)
    ).fetchone()
    assert again is not None and again[0] == "archived"
    assert sorted(again[1]) == earlier
    assert count(db, "SELECT count(*) FROM pending_distillation") == 0
    assert item_id != replay.item_id
