"""Sokratos sends a tool's result back as a ``user`` message starting ``Tool result:`` (or
``Tool error:``), and the assistant's tool call as its content, a JSON object with a "name"
(in a code fence or not; behaviour §5.1). The archive bounded only role ``tool`` messages and
structured ``tool_calls`` (1,000 and 500 bytes): Sokratos's own forms were archived whole as
the user's and the assistant's words, so the model read tool output as the user's, and a
conversation with large tool output passed the 512 kB limit and was refused whole (found by
an archiveform hunt, 2026-12-07). They are now tool results and calls, bounded and labelled
as the others are."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest

from sokratos_worker.pipelines import prompts
from sokratos_worker.pipelines.archive import format_messages
from sokratos_worker.pipelines.text import byte_len
from sokratos_worker.testing.scripted_llm import Reply, Request, ScriptedLLM

from .conftest import drain, enqueue, outcome

pytestmark = pytest.mark.postgres

FENCED_CALL = '```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```'
# About 6 kB of tool output a turn, on one line.
FORECAST = "Tool result: " + "; ".join(
    f"hour {h}: -3°C, snow, wind 20 km/h from the north-east" for h in range(100)
)


def _turn(day: int) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": f"Day {day}: what is the weather in Oslo tomorrow?"},
        {"role": "assistant", "content": FENCED_CALL},
        {"role": "user", "content": FORECAST},
        {"role": "assistant", "content": "Snow all day, about -3°C."},
    ]


BIG = {
    "messages": [
        {"role": "system", "content": "You are Sokratos."},
        {"role": "user", "content": "I moved to Oslo last month."},
        *[m for day in range(100) for m in _turn(day)],  # about 620 kB as sent
    ]
}
SMALL = {
    "messages": [
        {"role": "user", "content": "My daughter Mia starts school in August."},
        {"role": "assistant", "content": '{"name": "calendar_add", "date": "2027-08-16"}'},
        {"role": "user", "content": "Tool error: calendar not connected"},
        {"role": "assistant", "content": '{"city": "Oslo"}'},  # no "name": the assistant's words
        {"role": "user", "content": "Tool results are fine by me"},  # no "Tool result:" prefix
    ]
}
FACTS = {
    "moved to Oslo": "The user lives in Oslo.",
    "daughter Mia": "The user's daughter Mia starts school in August.",
}


def _distil(request: Request) -> Reply:
    text = request.messages[-1]["content"]
    facts = [{"text": fact, "salience": 7} for said, fact in FACTS.items() if said in text]
    return Reply.chat({"facts": facts})


def test_sokratos_tool_messages_are_bounded_tool_output_in_what_the_model_reads(
    db: psycopg.Connection, database_url: str
) -> None:
    assert byte_len(json.dumps(BIG, ensure_ascii=False)) > 512_000
    items = [
        enqueue(db, "SELECT sokratos_enqueue_distillation(%s::jsonb)", json.dumps(p))
        for p in (BIG, SMALL)
    ]
    with ScriptedLLM(chat=_distil) as server:
        drain(database_url, server)
        sent = [
            body["messages"][-1]["content"]
            for body in server.bodies()
            if body["messages"][0]["content"] == prompts.DISTILLATION
        ]
    results = [outcome(db, "pending_distillation", item) for item in items]
    assert [r[0] for r in results] == ["saved", "saved"], results

    big = "\n".join(t for t in sent if "Mia" not in t)
    assert big.count('assistant called get_weather({"city": "Oslo"})') == 100
    result = FORECAST.removeprefix("Tool result:").strip()
    bounded = result.encode()[:1000].decode("utf-8", errors="ignore") + "..."
    assert big.count(f"[get_weather result] {bounded}\n") == 100
    assert "Tool result:" not in big and "```" not in big and "[continued]" not in big
    assert "hour 99:" not in big  # each result bounded to 1,000 bytes
    assert all(byte_len(t) <= 16000 for t in sent) and len(sent) == 1 + 8
    assert sum(t.count("user: Day ") for t in sent) == 100  # the user's own words, whole

    [small] = [t for t in sent if "Mia" in t]
    assert small.endswith(
        "user: My daughter Mia starts school in August.\n"
        'assistant called calendar_add({"date": "2027-08-16"})\n'
        "[calendar_add error] calendar not connected\n"
        'assistant: {"city": "Oslo"}\n'
        "user: Tool results are fine by me"
    ), small

    saved = db.execute("SELECT id, summary FROM memories WHERE source = 'conversation'")
    assert sorted((r[1], [r[0]]) for r in saved) == sorted(
        [(FACTS["moved to Oslo"], results[0][1]), (FACTS["daughter Mia"], results[1][1])]
    )


def test_sokratos_forms_are_recognised_exactly_as_sokratos_does() -> None:
    """§5.1: a result is a user message whose content (untrimmed) starts with the prefix; a
    call is the assistant's content that, trimmed and without a leading fence line and a
    trailing fence, is a JSON object with a "name" key."""
    lines = format_messages(
        [
            {"role": "assistant", "content": '  {"name": "web_search", "arguments": "q=Oslo"}\n'},
            {"role": "user", "content": "Tool result:Kosmos, 2 km"},
            {"role": "assistant", "content": '```\n{"name": "read_url", "url": "https://x"}\n```'},
            {"role": "user", "content": "Tool error:"},  # nothing in it: left out
            {"role": "user", "content": " Tool result: said with a space first"},
            {"role": "assistant", "content": 'Sure: {"name": "web_search"}'},
            {"role": "assistant", "content": "```json\n[1, 2]\n```"},
            {"role": "user", "content": "Tool result: with no call before it"},
        ]
    )
    assert lines == [
        "assistant called web_search(q=Oslo)",
        "[web_search result] Kosmos, 2 km",
        'assistant called read_url({"url": "https://x"})',
        "user: Tool result: said with a space first",
        'assistant: Sure: {"name": "web_search"}',
        "assistant: ```json\n[1, 2]\n```",
        "[tool result] with no call before it",
    ]


def test_a_sokratos_call_is_cut_at_500_bytes() -> None:
    message = {"role": "assistant", "content": json.dumps({"name": "f", "arguments": "a" * 600})}
    assert format_messages([message]) == ["assistant called f(" + "a" * 500 + "...)"]


@pytest.mark.parametrize(
    "call",
    ['{"name": "web_search", "arguments": {"q": "\\ud83d"}}', '{"name": "web\\u0000search"}'],
    ids=["lone surrogate", "nul"],
)
def test_an_escape_in_a_sokratos_call_stays_an_escape(call: str) -> None:
    """Parsed, the call's \\ud83d or \\u0000 became a real lone surrogate or NUL: the archive
    could not be encoded or stored, so the conversation lost its distillation and its raw
    archive both, and the client's check raised UnicodeEncodeError (found by a review)."""
    from sokratos_worker import client

    payload = {
        "messages": [
            {"role": "user", "content": "I live in Oslo and I am looking for a flat."},
            {"role": "assistant", "content": call},
            {"role": "user", "content": "Tool result: ok"},
        ]
    }
    client.check_distillation(payload)  # (raised UnicodeEncodeError)
    lines = format_messages(payload["messages"])
    text = "\n".join(lines)
    text.encode("utf-8")  # storable: no lone surrogate
    assert "\x00" not in text
    assert lines[1].startswith("assistant called web")
    assert ("\\ud83d" in lines[1]) if "ud83d" in call else ("\\u0000" in lines[1])


def test_a_huge_tool_name_is_not_repeated_past_the_archive_limit() -> None:
    """The name labels every result after its call: a 100 kB name and five short results made
    a 600 kB archive from a 100 kB payload, refused whole (found by a review)."""
    name = "n" * 100_000
    messages = [
        {"role": "user", "content": "Please look up the weather in Oslo for the trip."},
        {"role": "assistant", "content": json.dumps({"name": name, "arguments": {}})},
        *[{"role": "user", "content": "Tool result: ok"} for _ in range(5)],
    ]
    lines = format_messages(messages)
    assert len(lines) == 7
    assert all(byte_len(line) < 300 for line in lines), [byte_len(line) for line in lines]


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_a_reply_with_a_non_json_constant_is_the_assistants_words(constant: str) -> None:
    """Go's parser refuses NaN and the infinities, so Sokratos keeps such a reply as words."""
    content = '{"name": "x", "v": ' + constant + "}"
    assert format_messages([{"role": "assistant", "content": content}]) == [f"assistant: {content}"]
