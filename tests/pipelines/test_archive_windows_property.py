"""Windows of an archive (pipelines/archive.py ``windows``) keep every character once, in
order, whitespace at the cuts aside, stay within their limit, and a window that starts inside
a message starts with ``[continued] <speaker>: `` naming that message's speaker (found by an
archiveform hunt, 2026-12-07)."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from sokratos_worker.pipelines.archive import (
    CONTINUED,
    Archive,
    Window,
    archive_from_payload,
    windows,
)
from sokratos_worker.pipelines.text import byte_len


def _squeezed(text: str) -> str:
    return "".join(text.split())


_LINE = st.text(alphabet="ab é😀 ", min_size=0, max_size=12)
_MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant"]),
        "content": st.lists(_LINE, min_size=1, max_size=5).map("\n".join),
    }
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_MESSAGE, min_size=1, max_size=8), st.integers(50, 200))
def test_windows_keep_every_character_once_and_name_the_speaker(
    messages: list[dict[str, str]], limit: int
) -> None:
    archive = archive_from_payload({"messages": messages}, None)
    pieces = windows(archive, limit)
    assert all(byte_len(p.text) <= limit for p in pieces)
    data = archive.text.encode()
    starts = [offset for offset, _ in archive.speakers]
    for piece in pieces:
        held = data[piece.start : piece.end].decode()
        inside = [i for i, offset in enumerate(starts) if offset < piece.start]
        if inside and piece.start not in starts:
            label = archive.speakers[inside[-1]][1]
            assert piece.text == f"{CONTINUED}{label}{held}"
        else:
            assert piece.text == held
    # Whitespace aside, the pieces without their markers are the archive, in order, once.
    joined = "".join(data[p.start : p.end].decode() for p in pieces)
    assert _squeezed(joined) == _squeezed(archive.text)
    spans = [(p.start, p.end) for p in pieces]
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))


def _check(archive: Archive, pieces: list[Window], start: int, end: int, limit: int) -> None:
    assert all(byte_len(p.text) <= limit for p in pieces)
    data = archive.text.encode()
    starts = [offset for offset, _ in archive.speakers]
    for piece in pieces:
        held = data[piece.start : piece.end].decode()
        inside = [i for i, offset in enumerate(starts) if offset < piece.start]
        if inside and piece.start not in starts:
            assert piece.text == f"{CONTINUED}{archive.speakers[inside[-1]][1]}{held}"
        else:
            assert piece.text == held
    joined = "".join(data[p.start : p.end].decode() for p in pieces)
    assert _squeezed(joined) == _squeezed(data[start:end].decode())


_TEXT_MESSAGE = st.tuples(
    st.sampled_from(["user", "assistant"]), st.lists(_LINE, min_size=1, max_size=5).map("\n".join)
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(_TEXT_MESSAGE, min_size=1, max_size=8),
    st.integers(50, 200),
    st.integers(50, 120),  # (a marker over half the room is left out, as the first test's)
    st.integers(0, 1_000),
)
def test_windows_of_archive_text_and_of_a_window_name_the_speaker(
    messages: list[tuple[str, str]], limit: int, half: int, which: int
) -> None:
    """Sokratos's own text, messages apart by blank lines (a cut then lands on the blank line
    before a message, where the speaker is that message's, not the one before), and the
    windows of a window, as a window the model refuses is halved (found by a review)."""
    text = "\n\n".join(f"{role}: {content}" for role, content in messages)
    archive = archive_from_payload({"archive_text": text}, None)
    pieces = windows(archive, limit)
    _check(archive, pieces, 0, len(archive.text.encode()), limit)
    piece = pieces[which % len(pieces)]
    halves = windows(archive, half, piece.start, piece.end)
    _check(archive, halves, piece.start, piece.end, half)
