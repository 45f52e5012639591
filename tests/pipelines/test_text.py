"""Byte-exact text shaping: truncation, chunking, caps and the triage input bound."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sokratos_worker.pipelines.text import (
    bound_triage_input,
    byte_len,
    cap_assistant_reply,
    chunk_text,
    is_trivial,
    prefix_bytes,
    split_tool_context,
    strip_think_tags,
    strip_tool_intent_tags,
    truncate,
    truncate_within,
)

ALL_WIDTHS = "aé€😀"  # 1, 2, 3 and 4 bytes


def test_truncate_leaves_fitting_text_unchanged() -> None:
    assert truncate("abc", 3) == "abc"
    assert truncate("€", 3) == "€"


def test_truncate_cuts_to_limit_and_appends_ellipsis() -> None:
    assert truncate("abcdef", 4) == "abcd..."


def test_truncate_backs_off_to_a_character_start() -> None:
    # "€" is 3 bytes: a 4-byte cut inside the second one keeps only the first.
    assert truncate("€€€", 4) == "€..."
    assert truncate("😀😀", 7) == "😀..."
    assert truncate("é", 1) == "..."


@given(st.text(alphabet=ALL_WIDTHS + "\n ", max_size=300), st.integers(0, 400))
def test_truncate_bounds_hold_for_any_text(text: str, limit: int) -> None:
    out = truncate(text, limit)
    assert byte_len(out) <= limit + 3
    assert byte_len(truncate_within(text, limit)) <= max(limit, 0)
    assert text.startswith(out.removesuffix("...")) or out == text
    assert byte_len(prefix_bytes(text, limit)) <= limit


def test_chunk_text_keeps_short_text_whole_and_untrimmed() -> None:
    assert chunk_text("  short  ") == ["  short  "]
    text = "x" * 1200
    assert chunk_text(text) == [text]


def test_chunk_text_cuts_after_the_last_newline_in_the_window() -> None:
    first = "a" * 1000 + "\n"
    second = "b" * 600
    assert chunk_text(first + second) == ["a" * 1000, second]


def test_chunk_text_never_splits_a_character() -> None:
    text = "€" * 1000  # 3000 bytes, no newline: hard cuts must back off
    chunks = chunk_text(text)
    assert "".join(chunks) == text
    assert all(byte_len(c) <= 1200 for c in chunks)
    assert [byte_len(c) for c in chunks] == [1200, 1200, 600]


def test_chunk_text_drops_short_tails_but_never_everything() -> None:
    assert chunk_text("a" * 1190 + "\n" + "tail" * 5) == ["a" * 1190]
    spaced = " " * 1300 + "tiny"
    assert chunk_text(spaced) == ["tiny"]


def test_chunk_text_takes_a_whole_character_when_the_limit_is_smaller_than_it() -> None:
    """A limit below a character's length must still make progress, one character a chunk."""
    assert chunk_text("a😀", 2, min_bytes=1) == ["a", "😀"]
    assert chunk_text("😀€", 1, min_bytes=1) == ["😀", "€"]


@given(st.text(alphabet=ALL_WIDTHS + "\n", max_size=60), st.integers(1, 8))
def test_chunk_text_keeps_every_character_at_any_limit(text: str, limit: int) -> None:
    chunks = chunk_text(text, limit, min_bytes=1)
    assert "".join("".join(chunks).split()) == "".join(text.split())  # whitespace aside


@given(st.text(alphabet=ALL_WIDTHS + "\n", min_size=1201, max_size=5000))
def test_chunks_are_bounded_and_valid(text: str) -> None:
    for chunk in chunk_text(text):
        assert byte_len(chunk) <= 1200


def test_trivial_is_measured_in_stripped_bytes() -> None:
    assert is_trivial("   " + "a" * 19 + "  ")
    assert not is_trivial("a" * 20)
    assert not is_trivial("é" * 10)  # 20 bytes
    assert is_trivial("ab\n")


def test_assistant_reply_capped_at_800_bytes() -> None:
    exchange = "user: " + "u" * 2000 + "\nassistant: " + "r" * 900
    capped = cap_assistant_reply(exchange)
    user, reply = capped.split("\nassistant: ")
    assert user == "user: " + "u" * 2000
    assert reply == "r" * 800 + "..."
    assert cap_assistant_reply("user: no reply marker") == "user: no reply marker"
    short = "user: a\nassistant: " + "r" * 800
    assert cap_assistant_reply(short) == short


def test_assistant_reply_cap_skips_the_marker_in_tool_context() -> None:
    """A tool result holding "\\nassistant: " must not have the user's words cut for it."""
    tools = "[read_chat_log result] notes\nassistant: " + "t" * 900 + "\n"
    conversation = "user: my sister moved\nassistant: " + "r" * 900
    capped = cap_assistant_reply(tools + conversation)
    assert capped == tools + "user: my sister moved\nassistant: " + "r" * 800 + "..."
    assert cap_assistant_reply(tools + "user: no reply") == tools + "user: no reply"


def _chat_log_tool_exchange() -> str:
    tools = (
        "[read_chat_log result] yesterday\nuser: what did I say about Anna?\nassistant: "
        + "t" * 900
        + "\n"
    )
    return tools + "user: my sister Anna moved to Porto\nassistant: " + "r" * 300


def test_the_users_words_survive_a_chat_log_tool_result() -> None:
    """A tool result that is a chat log holds "user: " lines too: the conversation is the
    last "\\nuser: " before the last "\\nassistant: ", not the first "\\nuser: "."""
    capped = cap_assistant_reply(_chat_log_tool_exchange())
    assert "user: my sister Anna moved to Porto" in capped, capped[-200:]


def test_the_triage_input_keeps_the_users_words() -> None:
    triage_input = bound_triage_input(cap_assistant_reply(_chat_log_tool_exchange()))
    assert "my sister Anna moved to Porto" in triage_input, triage_input[-200:]


def test_assistant_reply_cap_is_utf8_safe() -> None:
    capped = cap_assistant_reply("user: x\nassistant: " + "€" * 300)
    reply = capped.split("\nassistant: ")[1]
    assert reply == "€" * 266 + "..."  # 798 bytes, backing off from 800


def test_tool_context_is_everything_before_the_user_line() -> None:
    exchange = "[search result] a\n[web result] b\nuser: hi\nassistant: yo"
    assert split_tool_context(exchange) == (
        "[search result] a\n[web result] b\n",
        "user: hi\nassistant: yo",
    )
    assert split_tool_context("user: hi") == ("", "user: hi")


def test_huge_tool_context_cannot_push_out_the_user() -> None:
    tools = "[fetch result] " + "t" * 20000 + "\n"
    conversation = "user: my sister Anna moved to Lisbon\nassistant: noted"
    note = "[Note: 3 similar memories already exist.]"
    bounded = bound_triage_input(tools + conversation, note)
    assert byte_len(bounded) <= 8000
    assert bounded.endswith(conversation + "\n" + note)
    assert bounded.startswith("[fetch result] ttt")
    assert byte_len(split_tool_context(bounded)[0]) <= 3000


def test_tool_context_shrinks_to_the_room_left_by_the_conversation() -> None:
    tools = "[fetch result] " + "t" * 5000 + "\n"
    conversation = "user: " + "u" * 6000 + "\nassistant: ok"
    bounded = bound_triage_input(tools + conversation)
    assert byte_len(bounded) <= 8000
    assert bounded.endswith(conversation)


def test_oversized_conversation_keeps_the_note() -> None:
    conversation = "user: " + "€" * 4000
    bounded = bound_triage_input("[x result] y\n" + conversation, "NOTE")
    assert byte_len(bounded) <= 8000
    assert bounded.startswith("user: €€")
    assert bounded.endswith("...\nNOTE")


def test_fitting_input_is_unchanged() -> None:
    exchange = "[a result] b\nuser: c\nassistant: d"
    assert bound_triage_input(exchange) == exchange
    assert bound_triage_input(exchange, "N") == exchange + "\nN"


@given(
    st.text(alphabet=ALL_WIDTHS + "\n", max_size=4000),
    st.text(alphabet=ALL_WIDTHS, max_size=6000),
    st.integers(50, 8000),
)
def test_triage_bound_holds(tools: str, user: str, limit: int) -> None:
    bounded = bound_triage_input(f"{tools}\nuser: {user}\nassistant: ok", "NOTE", limit)
    assert byte_len(bounded) <= limit


def test_think_and_tool_intent_tags_are_stripped() -> None:
    assert strip_think_tags("<think>plan</think>  answer") == "answer"
    assert strip_think_tags("leak</think> answer") == "answer"
    assert strip_tool_intent_tags("a <TOOL_INTENT>x</TOOL_INTENT> b") == "a  b"
