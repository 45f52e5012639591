"""Reading payload fields with errors that name the field (the item is dead-lettered at once)."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

from sokratos_worker.errors import InvalidPayload


def required_str(payload: dict[str, Any], name: str) -> str:
    """A string field that must be present."""
    value = payload.get(name)
    if value is None:
        raise InvalidPayload(name, "is missing")
    if not isinstance(value, str):
        raise InvalidPayload(name, f"must be a string, not {type(value).__name__}")
    return value


def optional_str(payload: dict[str, Any], name: str) -> str | None:
    """A string field that may be absent or null."""
    value = payload.get(name)
    if value is not None and not isinstance(value, str):
        raise InvalidPayload(name, f"must be a string, not {type(value).__name__}")
    return value


def optional_bool(payload: dict[str, Any], name: str, default: bool = False) -> bool:
    """A boolean field; absent or null means ``default``."""
    value = payload.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidPayload(name, f"must be a boolean, not {type(value).__name__}")
    return value


def optional_int(payload: dict[str, Any], name: str) -> int | None:
    """An integer field (booleans refused); absent, null or 0 means none, as in Sokratos."""
    value = payload.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidPayload(name, f"must be an integer, not {type(value).__name__}")
    if not -(2**63) <= value < 2**63:  # the bigint column refused it at the settle
        raise InvalidPayload(name, "must fit in a 64-bit integer")
    return value or None


def optional_iso_datetime(payload: dict[str, Any], name: str) -> datetime | None:
    """An ISO-8601 timestamp field; a naive one is taken as UTC, Go's zero time as none."""
    value = optional_str(payload, name)
    if value is None or not value.strip():
        return None
    if value.strip().startswith("0000-"):
        return None  # Go's zero time shown west of UTC: year 0, which datetime cannot hold
    try:
        parsed = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError as exc:
        raise InvalidPayload(name, "must be an ISO-8601 timestamp") from exc
    return _unless_zero(parsed)


def lenient_datetime(value: object) -> datetime | None:
    """An email Date (RFC 2822 or ISO-8601); unparsable means NULL, never a zero date."""
    if not isinstance(value, str) or not value.strip():
        return None
    text = value.strip()
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        try:
            parsed = parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError, OverflowError):  # (a 20-digit year or zone)
            return None
        if not _year_as_written(text, parsed):
            return None
    return _unless_zero(parsed)


_MONTH = r"(?:jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)[a-z]*\.?"
# RFC 2822's "5 Mar 0001 ...": the year follows the day and the month.
_YEAR_AFTER_DAY_AND_MONTH = re.compile(rf"\b\d{{1,2}}\s+{_MONTH}\s+(\d+)\b", re.IGNORECASE)
# ctime's, Go's UnixDate "Mon Jan  1 00:00:00 UTC 0001" and RubyDate "... +0000 0001": the
# year follows the time and a zone, if any (a zone without its sign, "0000", or a comment may
# come after it).
_YEAR_AFTER_TIME = re.compile(
    r"\d{1,2}:\d{2}(?::\d{2})?\s+(?:(?:[A-Za-z]{1,5}|[+-]\d{4})\s+)?(\d+)\b"
)


def _written_year(text: str) -> str | None:
    """The year as ``text`` writes it, digits only, or None when it cannot be told."""
    found = _YEAR_AFTER_DAY_AND_MONTH.search(text) or _YEAR_AFTER_TIME.search(text)
    return found.group(1) if found is not None else None


def _year_as_written(text: str, parsed: datetime) -> bool:
    """False when email.utils read a year written with three or more digits as a two-digit
    one: Go's zero time in RFC 1123 form ("Mon, 01 Jan 0001 ...") became 2001-01-01. Only the
    year itself is looked at (a zone written without its sign, "0000", is not a year)."""
    written = _written_year(text)
    if written is None or len(written) < 3:
        return True
    return int(written) == parsed.year


def _unless_zero(parsed: datetime) -> datetime | None:
    """The timestamp in UTC if naive; None for Go's zero time ("0001-01-01T00:00:00Z", what an
    unset time.Time marshals to), which means "no date" as 0 does for an id."""
    if parsed.year == 1:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
