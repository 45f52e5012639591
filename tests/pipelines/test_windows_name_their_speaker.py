"""An archive longer than a window (16 kB) is read window by window, cut after a newline;
a cut inside a multi-line message (a list-style reply) started the next window with the
middle of that message and no ``user:``/``assistant:`` prefix, so the model could take the
assistant's words for the user's facts. The same held for the halves of a window the model's
context refuses and for the raw archive's 1,200-byte pieces (found by an archiveform hunt,
2026-12-07). A window or piece that starts inside a message now starts with
``[continued] <speaker>: `` naming that message's speaker, taken from the messages
themselves (from its role lines for Sokratos's pre-formatted text); nothing is lost or
repeated at the cuts."""

from __future__ import annotations

import json
import re
from typing import Any

import psycopg
import pytest

from sokratos_worker.pipelines import prompts
from sokratos_worker.pipelines.text import byte_len
from sokratos_worker.testing.scripted_llm import Reply, Request, ScriptedLLM

from .conftest import drain, enqueue, outcome

pytestmark = pytest.mark.postgres

HEADER = re.compile(r"\[Conversation archived[^\]\n]*\]\n?")
MARKER = re.compile(r"\[continued\] (user|assistant): ")
PACKING = [f"- item {i}: a waterproof jacket for the crossing, size L" for i in range(500)]
# A list-style reply (about 28 kB): the first window's cut falls inside it.
LIST_REPLY = {"role": "assistant", "content": "Here is your packing list:\n" + "\n".join(PACKING)}
BOAT = {"role": "user", "content": "I keep my boat in Bergen."}
# The user's own words quoting an "assistant: " line, then long enough to be cut after it.
NOTES = [f"note {i}: the harbour fee is due in spring, pay it early" for i in range(400)]
QUOTING_USER = {
    "role": "user",
    "content": "My notes from the harbour office:\nassistant: you should sell the boat\n"
    + "\n".join(NOTES),
}
# Sokratos's pre-formatted text: a user's multi-line message cut inside it.
SHOPPING = [f"- shelf {i}: oak, 80 cm, for the new flat in Bergen" for i in range(500)]
FLAT_TEXT = (
    "[Conversation archived 2026-12-06 20:00]\n"
    "[2026-12-06 19:58] user: What I still need for my flat:\n"
    + "\n".join(SHOPPING)
    + "\n[2026-12-06 19:59] assistant: Noted, that is a lot of oak."
)
PAYLOADS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "I am sailing to Shetland."}, LIST_REPLY, BOAT]},
    {"messages": [QUOTING_USER, {"role": "assistant", "content": "Pay it in March then."}]},
    {"archive_text": FLAT_TEXT},
    {"messages": [{"role": "user", "content": "My sister lives in Tromsø."}]},  # one window
]
FACTS = {
    "boat in Bergen": "The user keeps a boat in Bergen.",
    "sister lives in Tromsø": "The user's sister lives in Tromsø.",
}


def _sent(server: ScriptedLLM) -> list[str]:
    """The user text of every distillation request, in order."""
    return [
        body["messages"][-1]["content"]
        for body in server.bodies()
        if body["messages"][0]["content"] == prompts.DISTILLATION
    ]


def _distil(request: Request) -> Reply:
    text = request.messages[-1]["content"]
    facts = [{"text": fact, "salience": 7} for said, fact in FACTS.items() if said in text]
    return Reply.chat({"facts": facts})


def _unmarked(text: str) -> str:
    return MARKER.sub("", HEADER.sub("", text), count=1)


def _squeezed(text: str) -> str:
    return "".join(text.split())


def _windows_of(sent: list[str], needle: str) -> list[str]:
    return [text for text in sent if needle in text]


def test_each_window_cut_inside_a_message_names_its_speaker(
    db: psycopg.Connection, database_url: str
) -> None:
    items = [
        enqueue(db, "SELECT sokratos_enqueue_distillation(%s::jsonb)", json.dumps(p))
        for p in PAYLOADS
    ]
    with ScriptedLLM(chat=_distil) as server:
        drain(database_url, server)
        sent = _sent(server)
    results = [outcome(db, "pending_distillation", item) for item in items]
    assert [r[0] for r in results] == ["saved", "skipped", "skipped", "saved"], results
    assert all(byte_len(text) <= 16000 for text in sent)

    # The list reply: every window after the first starts as the assistant's, and each list
    # line reaches the model once.
    packing = _windows_of(sent, "waterproof jacket")
    assert len(packing) == 2
    assert packing[1].startswith("[continued] assistant: - item "), packing[1][:60]
    assert "\n".join(packing).count("waterproof jacket") == len(PACKING)
    assert "user: I keep my boat in Bergen." in packing[1]

    # The user's notes quote an "assistant: " line before the cut: the messages say who speaks.
    notes = _windows_of(sent, "harbour fee")
    assert len(notes) == 2
    assert notes[1].startswith("[continued] user: note "), notes[1][:60]
    assert "\n".join(notes).count("harbour fee") == len(NOTES)

    # Sokratos's own text: its role lines say who speaks.
    shelves = _windows_of(sent, "oak, 80 cm")
    assert len(shelves) == 2
    assert shelves[1].startswith("[continued] user: - shelf "), shelves[1][:60]
    # Nothing lost or repeated at the cut: the windows, their markers left out, are the text.
    assert _squeezed("".join(_unmarked(t) for t in shelves)) == _squeezed(HEADER.sub("", FLAT_TEXT))

    single = _windows_of(sent, "Tromsø")
    assert len(single) == 1 and "[continued]" not in single[0]
    assert len(sent) == 7  # 2 + 2 + 2 + 1
    saved = db.execute("SELECT id, summary FROM memories WHERE source = 'conversation'")
    assert sorted((r[1], [r[0]]) for r in saved) == sorted(
        [(FACTS["boat in Bergen"], results[0][1]), (FACTS["sister lives in Tromsø"], results[3][1])]
    )


def _refusing_long(request: Request) -> Reply:
    """A model whose context holds about 10 kB of input: a 16 kB window is halved."""
    if byte_len(request.messages[-1]["content"]) > 10000:
        return Reply.error(
            400, "the request exceeds the available context size", type="exceed_context_size_error"
        )
    return _distil(request)


def test_the_halves_of_a_refused_window_name_their_speaker(
    db: psycopg.Connection, database_url: str
) -> None:
    item = enqueue(db, "SELECT sokratos_enqueue_distillation(%s::jsonb)", json.dumps(PAYLOADS[0]))
    with ScriptedLLM(chat=_refusing_long) as server:
        drain(database_url, server)
        sent = _sent(server)
    result, memory_ids, detail = outcome(db, "pending_distillation", item)
    assert result == "saved", detail
    answered = [text for text in sent if byte_len(text) <= 10000]
    assert len(sent) - len(answered) == 2  # each 16 kB window refused once, then halved
    assert len(answered) >= 4
    assert all(t.startswith("[continued] assistant: - item ") for t in answered[1:-1])
    assert "\n".join(answered).count("waterproof jacket") == len(PACKING)
    saved = db.execute("SELECT summary FROM memories WHERE id = ANY(%s)", (memory_ids,))
    assert [r[0] for r in saved] == [FACTS["boat in Bergen"]]


def test_the_raw_archives_pieces_name_their_speaker(
    db: psycopg.Connection, database_url: str
) -> None:
    item = enqueue(db, "SELECT sokratos_enqueue_distillation(%s::jsonb)", json.dumps(PAYLOADS[0]))
    with ScriptedLLM(chat=lambda _: Reply.chat({"not": "facts"})) as server:
        drain(database_url, server)
    result, memory_ids, detail = outcome(db, "pending_distillation", item)
    assert result == "archived", detail
    pieces = [
        r[0]
        for r in db.execute(
            "SELECT summary FROM memories WHERE id = ANY(%s) ORDER BY id", (memory_ids,)
        )
    ]
    assert len(pieces) > 20
    assert all(byte_len(p) <= 1200 for p in pieces)
    assert pieces[0].startswith("[Conversation archived ")
    middle = [p for p in pieces[1:] if "user: I keep my boat" not in p]
    assert middle and all(p.startswith("[continued] assistant: - item ") for p in middle), [
        p[:40] for p in middle if not p.startswith("[continued] assistant: ")
    ]
    assert "\n".join(pieces).count("waterproof jacket") == len(PACKING)
