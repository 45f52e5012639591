"""The text a distillation works on: Sokratos's archive format, tool calls and results included."""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sokratos_worker.errors import InvalidPayload
from sokratos_worker.pipelines.text import strip_think_tags, strip_tool_intent_tags, truncate

ROLES = frozenset({"user", "assistant", "tool", "system"})
TOOL_ARGUMENTS_MAX_BYTES = 500
TOOL_RESULT_MAX_BYTES = 1000
AGENT_STATE_MARKER = "\n\n[Current Agent State]"
_HEADER = re.compile(r"^\[Conversation archived[^\]]*\]\s*$")
_TIME_FORMAT = "%Y-%m-%d %H:%M"


@dataclass(frozen=True)
class Archive:
    """The formatted archive and whether anything follows its header."""

    text: str
    empty: bool


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
        return Archive(text=text, empty=header_only(text))
    lines = format_messages(payload["messages"])
    # Local time, as Sokratos writes it (the item's created_at comes in the session's zone).
    when = f" {archived_at.astimezone().strftime(_TIME_FORMAT)}" if archived_at else ""
    header = f"[Conversation archived{when}]"
    return Archive(text="\n".join([header, *lines]), empty=not lines)


def format_messages(messages: object) -> list[str]:
    """One line (or block) per message worth keeping; tool calls and results bounded."""
    if not isinstance(messages, list):
        raise InvalidPayload("messages", "must be a list")
    tool_names: dict[str, str] = {}
    lines: list[str] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidPayload(f"messages[{i}]", "must be an object")
        lines.extend(_format_message(i, message, tool_names))
    return lines


def _format_message(i: int, message: dict[str, Any], tool_names: dict[str, str]) -> list[str]:
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:  # a list or object role raised TypeError
        raise InvalidPayload(f"messages[{i}].role", f"must be one of {sorted(ROLES)}")
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise InvalidPayload(f"messages[{i}].content", "must be a string")
    name = _optional_str(i, message, "name")
    call_id = _optional_str(i, message, "tool_call_id")
    prefix = _timestamp_prefix(i, message)
    text = _clean(content or "")
    if role == "system":
        return []  # the system prompt holds instructions, not facts about the user
    if role == "tool":
        if not text:  # as Go drops it: an archive of nothing else is empty, not sent
            return []
        tool = name or tool_names.get(call_id or "", "tool")
        return [f"{prefix}[{tool} result] {truncate(text, TOOL_RESULT_MAX_BYTES)}"]
    lines = [f"{prefix}{role}: {text}"] if text else []
    if role == "assistant":
        for call in _tool_calls(i, message):
            call_name, arguments, call_ref = call
            if call_ref:
                tool_names[call_ref] = call_name
            bounded = truncate(arguments, TOOL_ARGUMENTS_MAX_BYTES)
            lines.append(f"{prefix}assistant called {call_name}({bounded})")
    return lines


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
