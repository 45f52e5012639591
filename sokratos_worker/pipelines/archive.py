"""The text a distillation works on: Sokratos's archive format, tool calls and results included."""

from __future__ import annotations

import bisect
import contextlib
import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sokratos_worker import jsontext
from sokratos_worker.errors import InvalidPayload
from sokratos_worker.pipelines.text import (
    byte_len,
    strip_think_tags,
    strip_tool_intent_tags,
    truncate,
    truncate_within,
    window_length,
)
from sokratos_worker.store.sanitize import clean_text

ROLES = frozenset({"user", "assistant", "tool", "system"})
TOOL_ARGUMENTS_MAX_BYTES = 500
TOOL_RESULT_MAX_BYTES = 1000
AGENT_STATE_MARKER = "\n\n[Current Agent State]"
_HEADER = re.compile(r"^\[Conversation archived[^\]]*\]\s*$")
_TIME_FORMAT = "%Y-%m-%d %H:%M"
# Sokratos's own tool messages (behaviour §5.1): a result or error comes back as a user
# message with this prefix; a call is the assistant's content, a JSON object with a "name".
TOOL_RESULT_PREFIX = "Tool result:"
TOOL_ERROR_PREFIX = "Tool error:"
# A window or piece that starts inside a message starts with this and the message's speaker.
CONTINUED = "[continued] "
# A speaker's label in that marker is at most this long (a tool's name is the payload's).
_LABEL_MAX_BYTES = 100
# A line of Sokratos's pre-formatted text that starts a message: an optional time, a role.
_SPEAKER_LINE = re.compile(
    r"(?:\[\d{4}-\d{2}-\d{2} \d{2}:\d{2}\] )?((?:user|assistant|system|tool): )"
    r"((?:Tool result|Tool error):)?"
)


@dataclass(frozen=True)
class Archive:
    """The formatted archive, whether anything follows its header, and where its messages
    start: (byte offset in ``text``, the speaker's label, e.g. "user: "), in order."""

    text: str
    empty: bool
    speakers: tuple[tuple[int, str], ...] = field(default=(), repr=False)

    def stripped(self) -> Archive:
        """The archive without surrounding whitespace, its message offsets moved with it."""
        lead = byte_len(self.text) - byte_len(self.text.lstrip())
        moved = tuple((offset - lead, label) for offset, label in self.speakers if offset >= lead)
        return Archive(text=self.text.strip(), empty=self.empty, speakers=moved)


@dataclass(frozen=True)
class Window:
    """A piece of an archive as it is sent or saved (``text``) and the bytes of the archive's
    text it holds (``start`` to ``end``, surrounding whitespace left out)."""

    text: str
    start: int
    end: int


def archive_from_payload(payload: dict[str, Any], archived_at: datetime | None) -> Archive:
    """Either payload shape as archive text; InvalidPayload names the offending field.

    ``archived_at`` is the item's ``created_at``; None (a time no datetime can hold, see
    store/times.py) leaves the header without a time rather than invent one.

    A null ``messages`` or ``archive_text`` counts as absent, as in the SQL enqueue check: a Go
    struct without ``omitempty`` sends the unused field as null.
    """
    has_messages = payload.get("messages") is not None
    has_text = payload.get("archive_text") is not None
    if has_messages and has_text:  # (worded as the SQL enqueue check words it)
        raise InvalidPayload("messages", "and archive_text are alternatives: send one of them")
    if not has_messages and not has_text:
        raise InvalidPayload("messages", "(an array) or archive_text (a string) is required")
    if has_text:
        text = payload["archive_text"]
        if not isinstance(text, str):
            raise InvalidPayload("archive_text", f"must be a string, not {type(text).__name__}")
        return Archive(text=text, empty=header_only(text), speakers=_speakers_of_text(text))
    entries = _formatted_entries(payload["messages"])
    # Local time, as Sokratos writes it (the item's created_at comes in the session's zone).
    when = f" {archived_at.astimezone().strftime(_TIME_FORMAT)}" if archived_at else ""
    header = f"[Conversation archived{when}]"
    speakers: list[tuple[int, str]] = []
    offset = byte_len(header) + 1
    for line, label in entries:
        speakers.append((offset, label))
        offset += byte_len(line) + 1
    return Archive(
        text="\n".join([header, *(line for line, _ in entries)]),
        empty=not entries,
        speakers=tuple(speakers),
    )


def format_messages(messages: object) -> list[str]:
    """One line (or block) per message worth keeping; tool calls and results bounded."""
    return [line for line, _ in _formatted_entries(messages)]


def _formatted_entries(messages: object) -> list[tuple[str, str]]:
    """Each line (or block) of :func:`format_messages` with its speaker's label."""
    if not isinstance(messages, list):
        raise InvalidPayload("messages", "must be a list")
    tool_names: dict[str, str] = {}
    entries: list[tuple[str, str]] = []
    last_call = "tool"  # the tool an assistant's JSON call last named (Sokratos's own form)
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidPayload(f"messages[{i}]", "must be an object")
        entries.extend(_format_message(i, message, tool_names, last_call))
        if message.get("role") == "assistant":
            last_call = _sokratos_call_name(message.get("content")) or "tool"
    return entries


def _format_message(
    i: int, message: dict[str, Any], tool_names: dict[str, str], last_call: str
) -> list[tuple[str, str]]:
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:  # a list or object role raised TypeError
        raise InvalidPayload(f"messages[{i}].role", f"must be one of {sorted(ROLES)}")
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise InvalidPayload(f"messages[{i}].content", "must be a string")
    name = _optional_str(i, message, "name")
    call_id = _optional_str(i, message, "tool_call_id")
    prefix = _timestamp_prefix(i, message)
    if role == "system":
        return []  # the system prompt holds instructions, not facts about the user
    if role == "user" and content and content.startswith(TOOL_RESULT_PREFIX):
        return _tool_result(prefix, last_call, "result", content[len(TOOL_RESULT_PREFIX) :])
    if role == "user" and content and content.startswith(TOOL_ERROR_PREFIX):
        return _tool_result(prefix, last_call, "error", content[len(TOOL_ERROR_PREFIX) :])
    if role == "tool":
        tool = name or tool_names.get(call_id or "", "tool")
        return _tool_result(prefix, tool, "result", content or "")
    sokratos_call = _sokratos_call(content) if role == "assistant" else None
    text = _clean(content or "")
    if sokratos_call is not None:
        lines = [_tool_call_line(prefix, *sokratos_call)]
    else:
        lines = [(f"{prefix}{role}: {text}", f"{role}: ")] if text else []
    if role == "assistant":
        for call in _tool_calls(i, message):
            call_name, arguments, call_ref = call
            if call_ref:
                tool_names[call_ref] = call_name
            lines.append(_tool_call_line(prefix, call_name, arguments))
    return lines


def _tool_result(prefix: str, tool: str, kind: str, content: str) -> list[tuple[str, str]]:
    """A tool's result (or error) as ``[tool result] body``, the body bounded; none when empty
    (as Go drops it: an archive of nothing else is empty, not sent)."""
    text = _clean(content)
    if not text:
        return []
    label = f"[{truncate_within(tool, _LABEL_MAX_BYTES)} {kind}] "  # (repeated on every result)
    return [(f"{prefix}{label}{truncate(text, TOOL_RESULT_MAX_BYTES)}", label)]


def _tool_call_line(prefix: str, name: str, arguments: str) -> tuple[str, str]:
    """A tool call as ``assistant called name(arguments)``, the arguments bounded."""
    label = f"assistant called {truncate_within(name, _LABEL_MAX_BYTES)}("
    return f"{prefix}{label}{truncate(arguments, TOOL_ARGUMENTS_MAX_BYTES)})", label


def _sokratos_call(content: object) -> tuple[str, str] | None:
    """(name, arguments) when ``content`` is Sokratos's own tool call (behaviour §5.1: after
    a leading code-fence line and a trailing fence are stripped, a JSON object with a "name"
    key); the arguments are the object's "arguments" when that is all it holds besides the
    name, else every other key."""
    if not isinstance(content, str):
        return None
    text = content.strip()
    if text.startswith("```"):
        newline = text.find("\n")
        if newline >= 0:
            text = text[newline + 1 :]
        text = text.removesuffix("```").strip()
    if not (text.startswith("{") and text.endswith("}")):
        return None
    try:
        call = jsontext.loads(text, parse_constant=_not_json)
    except ValueError:
        return None
    if not isinstance(call, dict) or "name" not in call:
        return None
    name = call.pop("name")
    arguments: object = call["arguments"] if call.keys() == {"arguments"} else call
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False, sort_keys=True)
    # Escapes a payload may hold (\\u0000, a lone \\ud83d) are real characters once parsed,
    # which no archive can be written with: kept as the escapes they were.
    return (clean_text(str(name)) if name else "tool"), clean_text(arguments)


def _not_json(constant: str) -> float:
    """NaN and the infinities are no JSON (Go's parser refuses them; Python's takes them)."""
    raise ValueError(f"{constant} is not JSON")


def _sokratos_call_name(content: object) -> str | None:
    """The tool an assistant's content calls in Sokratos's own form, if it is one."""
    call = _sokratos_call(content)
    return call[0] if call is not None else None


def _tool_calls(i: int, message: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(name, arguments, id) of each tool call, OpenAI's nested form or a flat one."""
    calls = message.get("tool_calls")
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise InvalidPayload(f"messages[{i}].tool_calls", "must be a list")
    out: list[tuple[str, str, str]] = []
    for j, call in enumerate(calls):
        if not isinstance(call, dict):
            raise InvalidPayload(f"messages[{i}].tool_calls[{j}]", "must be an object")
        nested = call.get("function")
        function: dict[str, Any] = nested if isinstance(nested, dict) else call
        name = function.get("name")
        arguments = function.get("arguments", "")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False, sort_keys=True)
        call_id = call.get("id")
        out.append((str(name or "tool"), arguments, call_id if isinstance(call_id, str) else ""))
    return out


def _optional_str(i: int, message: dict[str, Any], key: str) -> str | None:
    value = message.get(key)
    if value is not None and not isinstance(value, str):
        raise InvalidPayload(f"messages[{i}].{key}", "must be a string")
    return value


def _timestamp_prefix(i: int, message: dict[str, Any]) -> str:
    value = _optional_str(i, message, "timestamp")
    if not value or value.strip().startswith("0000-"):
        return ""  # none, or Go's zero time shown west of UTC (year 0)
    try:
        stamp = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as exc:
        raise InvalidPayload(f"messages[{i}].timestamp", "must be an ISO-8601 timestamp") from exc
    if stamp.year == 1:
        return ""  # Go's zero time (an unset time.Time): no time, as Sokratos writes it
    if stamp.tzinfo is not None:
        # Local time, as Sokratos shows it; a naive one as written, and one whose local time
        # falls outside years 1-9999 too.
        with contextlib.suppress(OverflowError, ValueError):
            stamp = stamp.astimezone()
    return f"[{stamp.strftime(_TIME_FORMAT)}] "


def _clean(content: str) -> str:
    """Sokratos's per-message cleaning: agent state cut, think and TOOL_INTENT tags removed."""
    at = content.find(AGENT_STATE_MARKER)
    if at >= 0:
        content = content[:at]
    return strip_tool_intent_tags(strip_think_tags(content)).strip()


def header_only(text: str) -> bool:
    """True when nothing but archive headers and blank lines is left."""
    return all(not line.strip() or _HEADER.match(line.strip()) for line in text.splitlines())


def _speakers_of_text(text: str) -> tuple[tuple[int, str], ...]:
    """Where messages start in Sokratos's pre-formatted text: each line that starts with a
    role (after an optional time). A guess where a message quotes such a line itself; a
    ``messages`` archive knows its messages instead."""
    speakers: list[tuple[int, str]] = []
    offset = 0
    for line in text.split("\n"):
        match = _SPEAKER_LINE.match(line)
        if match:
            tool = f"{match.group(2)} " if match.group(2) else ""
            speakers.append((offset, match.group(1) + tool))
        offset += byte_len(line) + 1
    return tuple(speakers)


def windows(
    archive: Archive, max_bytes: int, start: int = 0, end: int | None = None
) -> list[Window]:
    """The archive's text from byte ``start`` to ``end`` in windows of at most ``max_bytes``,
    cut as :func:`~sokratos_worker.pipelines.text.chunk_text` cuts (after a newline where
    there is one), each stripped, none empty; nothing is left out or repeated. A window that
    starts inside a message starts with "[continued] " and that message's speaker, so a
    reader given it alone still knows who says it (room for that is taken from the window).
    Text that fits whole is one window, unchanged."""
    data = archive.text.encode("utf-8")
    end = len(data) if end is None else end
    if start == 0 and end == len(data) and len(data) <= max_bytes:
        return [Window(text=archive.text, start=0, end=len(data))]
    offsets = [offset for offset, _ in archive.speakers]
    pieces: list[Window] = []
    at = start
    while at < end:
        rest = data[at : min(end, at + max_bytes + 1)]  # (enough to tell whether it fits)
        first = at + _leading_space(rest[:max_bytes])
        marker = _continuation(archive, offsets, first, max_bytes)
        taken = rest[: window_length(rest, max_bytes - byte_len(marker))]
        body = taken.decode("utf-8").strip()
        if body:
            pieces.append(Window(text=marker + body, start=first, end=first + byte_len(body)))
        at += len(taken)
    return pieces


def _leading_space(head: bytes) -> int:
    """The byte length of the whitespace ``head`` starts with, as str.strip sees it (a
    character cut off at the end of ``head`` is no whitespace)."""
    text = head.decode("utf-8", errors="ignore")
    return byte_len(text[: len(text) - len(text.lstrip())])


def _continuation(archive: Archive, offsets: list[int], at: int, max_bytes: int) -> str:
    """The marker for a window whose text starts at byte ``at``: empty at a message's start
    or before the first message, and when the window could hold little else."""
    i = bisect.bisect_right(offsets, at) - 1
    if i < 0 or offsets[i] == at:
        return ""
    marker = CONTINUED + truncate_within(archive.speakers[i][1], _LABEL_MAX_BYTES)
    return marker if 2 * byte_len(marker) <= max_bytes else ""
