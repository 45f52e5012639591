"""A contradiction request every backend refuses is the item's failure, not "no verdict".

Every backend answers 400 to the ContradictionVerdicts schema (a schema the server's grammar
converter cannot take, OpenRouter's 404 for a parameter) while serving the minimal
``{"ok": bool}`` request: the client raises ``RequestRefused``. Swallowed like an invalid reply,
every memory of every item was saved for good with the contradicted memory left live and
nothing but a warning line saying the check can never run. It propagates instead (the attempt
is used, the item retried and, on the last attempt, kept in failed_operations where the
operator sees it). An invalid reply (no valid verdict this time) is still swallowed.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

import pytest

from sokratos_worker.errors import BackendsUnavailable
from sokratos_worker.llm.chat import FallbackChatClient
from sokratos_worker.llm.types import ChatFailed, RequestRefused
from sokratos_worker.model import Item, Queue
from sokratos_worker.pipelines.write import MemoryDraft, MemoryWriter
from sokratos_worker.store.memories import MemorySnippet
from sokratos_worker.testing.scripted_llm import PROBE, Reply, Request, ScriptedLLM
from tests.llm.conftest import backend, clock, make_client, servers, sleeps  # noqa: F401

from .fakes import FakeChat, FakeEmbedder


class _Reader:
    def known_fact_id(self, vec, distance):
        return None

    def near_duplicate(self, vec, distance=0.0, window_s=0.0):
        return None

    def similar_live(self, vec, max_distance=0.4, limit=3):
        return [MemorySnippet(id=41, summary="The user lives in Berlin.")]


ITEM = Item(
    queue=Queue.TRIAGE, id=7, payload={}, attempt=1, source="conversation",
    idempotency_key=None, created_at=datetime.now(UTC),
)
DRAFT = MemoryDraft(
    text="The user moved to Munich.", salience=8.0, memory_type="general",
    source="conversation", tags=(),
)


def _refuses_verdicts(request: Request) -> Reply:
    body = request.body if isinstance(request.body, dict) else {}
    rf = body.get("response_format") or {}
    if rf.get("json_schema", {}).get("name") == "ContradictionVerdicts":
        return Reply.error(400, "JSON schema conversion failed", type="invalid_request_error")
    return Reply.chat({"ok": True})


def test_contradiction_schema_refused_everywhere_is_not_swallowed(
    servers: Callable[..., ScriptedLLM],  # noqa: F811
    make_client: Callable[..., FallbackChatClient],  # noqa: F811
) -> None:
    server = servers(chat=_refuses_verdicts)
    server.on(PROBE, _refuses_verdicts)
    chat = make_client(backend(server, "only"), attempts=1)
    writer = MemoryWriter(_Reader(), chat, FakeEmbedder())  # type: ignore[arg-type]
    # (Before, the plan came back with contradiction_failed="ChatFailed", no supersessions:
    # saved for good, memory 41 left live unchecked.)
    with pytest.raises(RequestRefused) as raised:
        writer.plan(ITEM, DRAFT)
    assert not isinstance(raised.value, BackendsUnavailable)  # the attempt is used
    assert "JSON schema conversion failed" in str(raised.value)  # the operator sees why


def test_an_invalid_verdict_is_still_saved_without_supersessions() -> None:
    chat = FakeChat().script("contradiction", ChatFailed("no valid reply"))
    plan = MemoryWriter(_Reader(), chat, FakeEmbedder()).plan(ITEM, DRAFT)  # type: ignore[arg-type]
    assert plan.memories and plan.supersessions == ()
    assert plan.contradiction_failed == "ChatFailed"
