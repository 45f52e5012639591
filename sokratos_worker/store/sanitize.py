"""Make producer data storable: PostgreSQL's text and jsonb cannot hold NUL or lone surrogates."""

from __future__ import annotations

import math
from typing import Any

from sokratos_worker.errors import InvalidPayload

MAX_DEPTH = 64
ESCAPED_NOTE = "NUL bytes or invalid UTF-8 escaped as \\uXXXX"


def clean_text(text: str) -> str:
    """``text`` with NUL and unpaired surrogates (invalid UTF-8 read with surrogateescape)
    written as the six characters ``\\u0000`` / ``\\udcff``: storable, and still saying what
    was there."""
    if "\x00" in text:
        text = text.replace("\x00", "\\u0000")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = "".join(f"\\u{ord(c):04x}" if 0xD800 <= ord(c) <= 0xDFFF else c for c in text)
    return text


def sanitize_payload(payload: Any) -> tuple[Any, list[str]]:
    """A storable copy of ``payload`` and notes on what was escaped.

    Raises :class:`InvalidPayload` for nesting deeper than :data:`MAX_DEPTH` or values JSON
    cannot represent (NaN, bytes, sets...).
    """
    notes: set[str] = set()
    clean = _walk(payload, "payload", 0, notes)
    return clean, sorted(notes)


def _walk(value: Any, path: str, depth: int, notes: set[str]) -> Any:
    if depth > MAX_DEPTH:
        raise InvalidPayload(path, f"is nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, str):
        return _clean_noted(value, notes)
    if isinstance(value, bool) or value is None or isinstance(value, int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidPayload(path, "is not a finite number")
        return value
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, child in value.items():
            if not isinstance(key, str):
                raise InvalidPayload(path, f"has a non-string key {key!r}")
            out[_clean_noted(key, notes)] = _walk(child, f"{path}.{key}", depth + 1, notes)
        return out
    if isinstance(value, list | tuple):
        return [_walk(child, f"{path}[{i}]", depth + 1, notes) for i, child in enumerate(value)]
    raise InvalidPayload(path, f"has a value of type {type(value).__name__} that JSON cannot hold")


def _clean_noted(text: str, notes: set[str]) -> str:
    cleaned = clean_text(text)
    if cleaned != text:
        notes.add(ESCAPED_NOTE)
    return cleaned
