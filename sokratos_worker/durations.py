"""Durations as operators write them: ``90``, ``90s``, ``1.5m``, ``250ms``, ``1h30m``.

:func:`parse_duration` turns such a value into seconds, :func:`format_duration` turns
seconds back into the shortest such text for messages, and :func:`within` bounds a duration
field, saying in the caller's words why a value is too short or too long. :data:`Duration`
is the annotated float a settings field declares to accept all of these spellings.
"""

from __future__ import annotations

import math
import re
from typing import Annotated

from pydantic import AfterValidator, BeforeValidator

_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
HOUR, DAY = 3600.0, 86400.0
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")


def parse_duration(value: object) -> float:
    """Seconds from ``90``, ``90s``, ``1.5m``, ``250ms`` or compound ``1h30m``."""
    seconds = _seconds(value)
    if not math.isfinite(seconds):
        raise ValueError(f"{value!r} is not a finite duration")
    if seconds < 0:
        raise ValueError(f"{value!r}: a duration cannot be negative")
    return seconds


def _seconds(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError("expected a duration such as 90, 90s, 5m or 1h30m")
    if not isinstance(value, str):
        return float(value)
    text = value.strip().lower()
    # Parsed without the sign, so "-5s" is called negative rather than malformed.
    unsigned = text.removeprefix("-")
    seconds = _unsigned_seconds(unsigned)
    if seconds is None:
        raise ValueError(f"{value!r} is not a duration (use 90, 90s, 5m, 1h30m; units ms s m h d)")
    return -seconds if unsigned != text else seconds


def _unsigned_seconds(text: str) -> float | None:
    if re.fullmatch(r"\d+(?:\.\d+)?", text):
        return float(text)
    parts = _DURATION_PART.findall(text)
    if not text or "".join(n + u for n, u in parts) != text:
        return None
    return sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)


def format_duration(seconds: float) -> str:
    """``90`` → ``1m30s``, ``0.25`` → ``250ms``: a duration as an operator would write it."""
    if 0 < seconds < 1:
        return f"{_number(seconds * 1000)}ms"
    parts: list[str] = []
    rest = seconds
    for unit in ("d", "h", "m"):
        count, rest = divmod(rest, _UNIT_SECONDS[unit])
        if count:
            parts.append(f"{_number(count)}{unit}")
    if rest or not parts:
        parts.append(f"{_number(rest)}s")
    return "".join(parts)


def _number(value: float) -> str:
    return f"{value:.3f}".rstrip("0").rstrip(".")


Duration = Annotated[float, BeforeValidator(parse_duration)]


def within(
    shortest: float, longest: float, *, too_short: str, too_long: str, zero_means_off: bool = False
) -> AfterValidator:
    """Refuse a duration outside ``[shortest, longest]``, saying why in the words given."""

    def check(seconds: float) -> float:
        if seconds == 0 and zero_means_off:
            return seconds
        if seconds < shortest:
            raise ValueError(
                f"{format_duration(seconds)} is too short: at least"
                f" {format_duration(shortest)} ({too_short})"
            )
        if seconds > longest:
            raise ValueError(
                f"{format_duration(seconds)} is too long: at most"
                f" {format_duration(longest)} ({too_long})"
            )
        return seconds

    return AfterValidator(check)
