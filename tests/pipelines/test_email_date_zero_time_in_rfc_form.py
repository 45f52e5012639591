"""Go's zero time written as an RFC 2822 Date is no date, as it is in ISO form (found by a
triage hunt).

Sokratos parses an email's Date as RFC1123Z and keeps the zero time when it cannot; a producer
that writes it back in that form sends "Mon, 01 Jan 0001 00:00:00 +0000" (in a zone west of
UTC, "Sun, 31 Dec 0000 19:03:58 -0456"). email.utils reads every year below 100 as a two-digit
one, "0001" too, so the memory was dated 2001-01-01 instead of having no date.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import psycopg
import pytest

from sokratos_worker.model import Outcome
from sokratos_worker.pipelines.payload import lenient_datetime
from sokratos_worker.store.connection import Database

from .conftest import apply, make_item, memory_rows
from .fakes import FakeChat, FakeEmbedder
from .test_triage import triage_handler, verdict

pytestmark = pytest.mark.postgres

GOS_ZERO_TIME = [
    "Mon, 01 Jan 0001 00:00:00 +0000",  # time.RFC1123Z
    "Mon, 01 Jan 0001 00:00:00 UTC",  # time.RFC1123
    "Sun, 31 Dec 0000 19:03:58 -0456",  # RFC1123Z in America/New_York (its LMT offset)
    "Mon Jan 01 00:00:00 +0000 0001",  # time.RubyDate (found by a review)
    "Mon Jan  1 00:00:00 UTC 0001",  # time.UnixDate
]


@pytest.mark.parametrize("date", GOS_ZERO_TIME)
def test_gos_zero_time_in_rfc_form_is_no_date(date: str) -> None:
    assert lenient_datetime(date) is None


@pytest.mark.parametrize(
    ("date", "expected"),
    [
        ("Tue, 14 Mar 2026 09:30:00 +0100", datetime(2026, 3, 14, 8, 30, tzinfo=UTC)),
        # RFC 5322's obsolete two-digit year is still read as email.utils reads it.
        ("14 Mar 26 09:30 +0100", datetime(2026, 3, 14, 8, 30, tzinfo=UTC)),
        # A zone without its sign is four digits too: the year written in full decides.
        ("Thu, 01 Jan 2026 10:00:00 0000", datetime(2026, 1, 1, 10, 0, tzinfo=UTC)),
        # A two-digit year beside a zone without its sign, or a number in a comment: only the
        # year after the month counts (these came out None; found by a review).
        ("Tue, 05 Mar 24 10:00:00 0000", datetime(2024, 3, 5, 10, 0, tzinfo=UTC)),
        ("Tue, 05 Mar 99 10:00:00 0000", datetime(1999, 3, 5, 10, 0, tzinfo=UTC)),
        ("Tue, 05 Mar 24 10:00:00 +0000 (UTC 000)", datetime(2024, 3, 5, 10, 0, tzinfo=UTC)),
        # ctime's form, with a zone without its sign or a number after the year.
        ("Tue Mar  5 10:00:00 2024 0000", datetime(2024, 3, 5, 10, 0, tzinfo=UTC)),
        ("Tue Mar  5 10:00:00 2024 0100", datetime(2024, 3, 5, 9, 0, tzinfo=UTC)),
        ("Tue Mar  5 10:00:00 2024 (1234)", datetime(2024, 3, 5, 10, 0, tzinfo=UTC)),
    ],
)
def test_a_year_written_in_full_or_in_two_digits_is_kept(date: str, expected: datetime) -> None:
    parsed = lenient_datetime(date)
    assert parsed is not None
    assert parsed.astimezone(timezone(timedelta(0))) == expected


def test_an_email_dated_with_gos_zero_time_is_saved_without_a_date(
    db: psycopg.Connection, database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    chat.script("email_triage", verdict(6, summary="The user's lease in Graz ends in June."))
    payload = {
        "text": "From: landlord@example.org\nSubject: Lease\n\nThe lease ends in June.",
        "date": GOS_ZERO_TIME[0],
    }
    effects = triage_handler(database, chat, embedder).handle(make_item(payload, source="email"))
    assert effects.outcome is Outcome.SAVED
    apply(db, effects)
    [row] = memory_rows(db)
    assert (row["summary"], row["source"], row["source_date"]) == (
        "The user's lease in Graz ends in June.",
        "email",
        None,
    )
