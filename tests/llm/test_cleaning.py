"""Reply cleaning (Sokratos's CleanLLMJSON), validation with clamping, and the GBNF builder."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

from sokratos_worker.llm.chat import strict_schema
from sokratos_worker.llm.cleaning import (
    clean_llm_json,
    extract_json_object,
    repair_json_punctuation,
    strip_code_fences,
    strip_think_tags,
)
from sokratos_worker.llm.gbnf import schema_to_gbnf
from sokratos_worker.llm.http import Verdict, classify, retry_after_seconds
from sokratos_worker.llm.reply import ReplyInvalid, parse_reply


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("<think>a</think>  answer", "answer"),
        ("<think>a</think>x<think>b</think>y", "xy"),
        ("reasoning without open</think> answer", "answer"),
        ("plain", "plain"),
    ],
)
def test_strip_think_tags(raw: str, clean: str):
    assert strip_think_tags(raw) == clean


def test_strip_code_fences():
    assert strip_code_fences('```json\n{"a": 1}\n```') == '{"a": 1}'
    assert strip_code_fences('Here:\n```\n{"a": 1}\n```\nbye') == '{"a": 1}'
    assert strip_code_fences('{"a": 1}') == '{"a": 1}'


def test_extract_json_object_is_string_aware():
    assert extract_json_object('x {"a": "}{", "b": {"c": 1}} y {}') == '{"a": "}{", "b": {"c": 1}}'
    assert extract_json_object('pre {"a": 1') == '{"a": 1'
    assert extract_json_object('{"a": "\\"}"}') == '{"a": "\\"}"}'


def test_repair_json_punctuation():
    assert repair_json_punctuation('{"a": 7. 5, "b": [1, 2,], "c": 7.}') == (
        '{"a": 7.5, "b": [1, 2], "c": 7}'
    )


def test_clean_llm_json_pipeline():
    raw = '<think>{"x": 0}</think>Sure! ```json\n{"a": [1, 2,],}\n``` hope that helps'
    assert clean_llm_json(raw) == '{"a": [1, 2]}'


class Scored(BaseModel):
    score: float = Field(ge=0, le=1)
    count: int = Field(gt=0, lt=10)
    label: str


def test_parse_reply_clamps_out_of_range_numbers():
    value, clamped = parse_reply(Scored, '{"score": 1.7, "count": 10, "label": "x"}')
    assert (value.score, value.count) == (1.0, 9)
    assert sorted(clamped) == ["count", "score"]
    value, clamped = parse_reply(Scored, '{"score": -1, "count": 0, "label": "x"}')
    assert (value.score, value.count, clamped) == (0, 1, ["score", "count"])


def test_parse_reply_rejects_other_errors_without_echoing_values():
    with pytest.raises(ReplyInvalid) as caught:
        parse_reply(Scored, '{"score": 2, "count": 1}')
    assert "label" in caught.value.feedback
    with pytest.raises(ReplyInvalid):
        parse_reply(Scored, "no json here")
    with pytest.raises(ReplyInvalid):
        parse_reply(Scored, "[1, 2]")


def test_parse_reply_takes_valid_json_as_it_is_before_cleaning():
    raw = '{"score": 0.5, "count": 2, "label": "see ```json {} ``` or </think> here"}'
    value, _ = parse_reply(Scored, raw)
    assert value.label == "see ```json {} ``` or </think> here"
    fenced = '```json\n{"score": 0.5, "count": 2, "label": "x",}\n```'
    assert parse_reply(Scored, fenced)[0].label == "x"  # not JSON: cleaned, then parsed


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_parse_reply_rejects_non_finite_numbers(number: str):
    with pytest.raises(ReplyInvalid):
        parse_reply(Scored, f'{{"score": {number}, "count": 2, "label": "x"}}')


@pytest.mark.parametrize(
    ("status", "body", "verdict"),
    [
        (200, "", Verdict.OK),
        (400, '{"error":{"type":"exceed_context_size_error","n_ctx":4096}}', Verdict.CONTEXT),
        (400, "context_length_exceeded", Verdict.CONTEXT),
        # llama.cpp builds whose answer has no exceed_context_size_error type
        (400, "the request exceeds the available context size, try increasing it", Verdict.CONTEXT),
        (400, "bad request", Verdict.REJECTED),
        (422, "unprocessable", Verdict.REJECTED),
        (401, "", Verdict.REFUSED),
        (403, "", Verdict.REFUSED),
        (404, "model not found", Verdict.REFUSED),
        (429, '{"error":{"code":"insufficient_quota"}}', Verdict.REFUSED),
        (429, "rate_limit_exceeded", Verdict.TRANSIENT),
        (408, "", Verdict.TRANSIENT),
        (500, "", Verdict.TRANSIENT),
        (503, "Loading model", Verdict.TRANSIENT),
    ],
)
def test_classify(status: int, body: str, verdict: Verdict):
    assert classify(status, body) is verdict


def test_retry_after_parsing():
    assert retry_after_seconds("3") == 3.0
    assert retry_after_seconds(None) is None
    assert retry_after_seconds("soon") is None
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:10 GMT", now=1445412480.0) == 10.0


def test_gbnf_covers_objects_enums_arrays_and_nullables():
    grammar = schema_to_gbnf(Scored.model_json_schema())
    assert grammar.splitlines()[0].startswith('root ::= "{" ws "\\"score\\""')
    assert "number" in grammar
    assert "integer" in grammar


def test_strict_schema_walks_schemas_not_property_names():
    class Inner(BaseModel):
        default: int = 3

    class Outer(BaseModel):
        inner: Inner | None = None
        items: list[Inner] = []

    schema = strict_schema(Outer.model_json_schema())
    inner = schema["$defs"]["Inner"]
    assert inner["additionalProperties"] is False
    assert inner["required"] == ["default"]
    assert "default" in inner["properties"]
    assert "default" not in inner["properties"]["default"]
    assert schema["required"] == ["inner", "items"]
    assert "default" not in schema["properties"]["items"]
