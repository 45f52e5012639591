"""Byte-based text shaping shared by the pipelines (all lengths are UTF-8 bytes, as in Sokratos)."""

from __future__ import annotations

import re

ELLIPSIS = "..."
MAX_CHUNK_BYTES = 1200
MIN_CHUNK_BYTES = 50
ASSISTANT_REPLY_CAP = 800
TRIVIAL_BYTES = 20
TRIAGE_MAX_BYTES = 8000
# An input the model's context refuses is halved and asked again, down to this: a 2,048-token
# context (llama.cpp's default) holds about 1,000 bytes of Japanese beside a prompt.
SHORTEST_HALVED_BYTES = 1000
# Tool output is capped on its own so it can never crowd the user's words out of the input.
TOOL_CONTEXT_MAX_BYTES = 3000
ASSISTANT_MARKER = "\nassistant: "
USER_MARKER = "user: "

_THINK_BLOCK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)
_TOOL_INTENT_CODE = re.compile(r"<TOOL_INTENT>.*?</CODE>(?:</TOOL_INTENT>)?", re.DOTALL)
_TOOL_INTENT = re.compile(r"<TOOL_INTENT>.*?</TOOL_INTENT>", re.DOTALL)


def byte_len(text: str) -> int:
    """The UTF-8 length of ``text``."""
    return len(text.encode("utf-8"))


def _rune_start(data: bytes, cut: int) -> int:
    """Move ``cut`` back until it is not inside a multi-byte UTF-8 sequence."""
    while 0 < cut < len(data) and (data[cut] & 0xC0) == 0x80:
        cut -= 1
    return cut


def _first_char_len(data: bytes) -> int:
    """The byte length of the first character: a window must hold at least one whole
    character, or a limit below its length would cut nothing and loop for ever."""
    end = 1
    while end < len(data) and (data[end] & 0xC0) == 0x80:
        end += 1
    return end


def prefix_bytes(text: str, limit: int) -> str:
    """At most ``limit`` bytes of ``text``, never splitting a character, no ellipsis."""
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text
    return data[: _rune_start(data, max(0, limit))].decode("utf-8")


def truncate(text: str, limit: int) -> str:
    """Sokratos's Truncate: unchanged when it fits, else ≤ ``limit`` bytes plus "..."."""
    if byte_len(text) <= limit:
        return text
    return prefix_bytes(text, limit) + ELLIPSIS


def truncate_within(text: str, limit: int) -> str:
    """Like :func:`truncate` but the result, ellipsis included, is at most ``limit`` bytes."""
    if byte_len(text) <= limit:
        return text
    if limit < len(ELLIPSIS):
        return prefix_bytes(text, limit)
    return truncate(text, limit - len(ELLIPSIS))


def chunk_text(
    text: str, max_bytes: int = MAX_CHUNK_BYTES, min_bytes: int = MIN_CHUNK_BYTES
) -> list[str]:
    """Split ``text`` into chunks of ≤ ``max_bytes``, preferring newlines; drop tails < 50 bytes
    (``min_bytes``: memories skip scraps; a model's input must lose nothing, so it passes 1)."""
    data = text.encode("utf-8")
    if len(data) <= max_bytes:
        return [text]
    chunks: list[str] = []
    rest = data
    while rest:
        window = rest[: window_length(rest, max_bytes)]
        rest = rest[len(window) :]
        chunk = window.decode("utf-8").strip()
        if byte_len(chunk) >= min_bytes:
            chunks.append(chunk)
    return chunks or [text.strip()]


def window_length(data: bytes, max_bytes: int) -> int:
    """How many bytes of ``data`` the next chunk takes: all of it when it fits, else at most
    ``max_bytes`` ending after the last newline there (if any), never inside a character and
    never nothing (at least one whole character)."""
    if len(data) <= max_bytes:
        return len(data)
    window = data[: _rune_start(data, max_bytes) or _first_char_len(data)]
    newline = window.rfind(b"\n")
    return newline + 1 if newline > 0 else len(window)


def is_trivial(exchange: str) -> bool:
    """True for exchanges too short to hold anything worth remembering (< 20 bytes stripped)."""
    return byte_len(exchange.strip()) < TRIVIAL_BYTES


def cap_assistant_reply(exchange: str, cap: int = ASSISTANT_REPLY_CAP) -> str:
    """Truncate the reply after the conversation's first "\\nassistant: " to ``cap`` bytes
    (plus "..."); the tool context is left to :func:`bound_triage_input`.

    Only the conversation is searched, as a tool result holding the marker would otherwise
    have the user's words cut in favour of tool output.
    """
    tools, conversation = split_tool_context(exchange)
    at = conversation.find(ASSISTANT_MARKER)
    if at < 0:
        return exchange
    head = conversation[: at + len(ASSISTANT_MARKER)]
    return tools + head + truncate(conversation[len(head) :], cap)


def split_tool_context(exchange: str) -> tuple[str, str]:
    """(tool context, conversation): the ``[tool] result`` lines, then "user: …\\nassistant: …".

    Sokratos builds ``toolContext + "user: " + msg + "\\nassistant: " + reply`` with the tool
    bodies whole and multi-line, so a tool result can hold "user: " and "assistant: " lines
    itself (``read_chat_log``): the conversation starts at the *last* "\\nuser: " before the
    *last* "\\nassistant: ", which is the one Sokratos wrote (the tool context comes before
    it). With no "\\nuser: " before that marker (no reply: a tool result held it), the
    last "\\nuser: ". An exchange that starts with "user: " has no tool context (Go's
    behaviour).
    """
    if exchange.startswith(USER_MARKER):
        return "", exchange
    at = exchange.rfind("\n" + USER_MARKER, 0, max(0, exchange.rfind(ASSISTANT_MARKER)))
    if at < 0:  # no reply marker after the user's line (not one Sokratos builds): the last
        at = exchange.rfind("\n" + USER_MARKER)
    if at < 0:
        return "", exchange
    return exchange[: at + 1], exchange[at + 1 :]


def bound_triage_input(exchange: str, note: str = "", max_bytes: int = TRIAGE_MAX_BYTES) -> str:
    """The triage input within ``max_bytes``: the user's words and the note first, tools last.

    An input that fits is sent whole, as Go does. One that does not has its tool context cut
    to its own cap and then to whatever room the conversation and the coverage note leave;
    only then, if still too long, is the conversation truncated. (Only then is the exchange
    split, a guess when a tool result or the reply quotes "user:" lines itself.)
    """
    suffix = f"\n{note}" if note else ""
    if byte_len(exchange + suffix) <= max_bytes:
        return exchange + suffix
    tools, conversation = split_tool_context(exchange)
    room = max_bytes - byte_len(suffix)
    if room < len(ELLIPSIS) + 1:
        return truncate_within(exchange + suffix, max_bytes)
    tool_room = max(0, min(TOOL_CONTEXT_MAX_BYTES, room - byte_len(conversation)))
    bounded_tools = "" if tool_room <= len(ELLIPSIS) else _bounded_block(tools, tool_room)
    return truncate_within(bounded_tools + conversation, room) + suffix


def _bounded_block(block: str, limit: int) -> str:
    """``block`` within ``limit`` bytes, still ending in a newline so the next line stays whole."""
    if byte_len(block) <= limit:
        return block
    return truncate_within(block, limit - 1) + "\n"


def strip_think_tags(text: str) -> str:
    """Drop ``<think>…</think>`` blocks and anything before an orphan ``</think>``."""
    cleaned = _THINK_BLOCK.sub("", text)
    orphan = cleaned.rfind("</think>")
    if orphan >= 0:
        cleaned = cleaned[orphan + len("</think>") :]
    return cleaned.strip()


def strip_tool_intent_tags(text: str) -> str:
    """Drop Sokratos's ``<TOOL_INTENT>`` blocks."""
    return _TOOL_INTENT.sub("", _TOOL_INTENT_CODE.sub("", text)).strip()
