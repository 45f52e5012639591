"""The fallback chat client against scripted OpenAI-compatible servers over real HTTP."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import pytest
from pydantic import BaseModel, Field
from structlog.testing import capture_logs

from sokratos_worker.errors import BackendsMisconfigured
from sokratos_worker.llm.chat import FallbackChatClient
from sokratos_worker.llm.types import (
    ChatFailed,
    ContextTooLong,
    LLMBackendsBusy,
    LLMBackendsMisconfigured,
    NoBackendReachable,
)
from sokratos_worker.policy import Step, after_failure
from sokratos_worker.testing import PROBE, Reply, ScriptedLLM, json_responder
from tests.llm.conftest import backend

Servers = Callable[..., ScriptedLLM]
MakeClient = Callable[..., FallbackChatClient]


class Verdict(BaseModel):
    save: bool
    salience: float = Field(ge=0, le=10)


GOOD = {"save": True, "salience": 7}


def ask(client: FallbackChatClient) -> object:
    return client.complete(
        response_model=Verdict, system="sys", user="hello", max_tokens=64, purpose="test"
    )


def test_first_backend_answers_and_request_is_explicit(servers: Servers, make_client: MakeClient):
    a = servers()
    a.script(Reply.chat(GOOD, prompt_tokens=5, completion_tokens=3))
    client = make_client(backend(a, "a", temperature=0.2))

    result = client.complete(
        response_model=Verdict, system="sys", user="hi", max_tokens=99, purpose="triage"
    )

    assert result.value == Verdict(save=True, salience=7)
    assert result.backend == "a"
    assert (result.prompt_tokens, result.completion_tokens) == (5, 3)
    assert [t.result for t in result.tried] == ["answered"]
    (body,) = a.bodies()
    assert body["temperature"] == 0.2
    assert body["max_tokens"] == 99
    assert body["model"] == "scripted"
    assert body["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hi"},
    ]


def test_structured_output_forms(servers: Servers, make_client: MakeClient):
    srv = servers(chat=json_responder(GOOD))
    for form in ("json_schema", "json_object", "grammar"):
        ask(make_client(backend(srv, form, structured_output=form)))
    nested, flat, grammar = srv.bodies()

    fmt = nested["response_format"]
    assert fmt["type"] == "json_schema"
    assert fmt["json_schema"]["name"] == "Verdict"
    assert fmt["json_schema"]["strict"] is True
    schema = fmt["json_schema"]["schema"]
    assert schema["additionalProperties"] is False
    assert schema["required"] == ["save", "salience"]

    assert flat["response_format"]["type"] == "json_object"
    assert flat["response_format"]["schema"]["properties"]["salience"]["maximum"] == 10
    assert "grammar" not in flat

    assert "response_format" not in grammar
    assert grammar["grammar"].startswith("root ::=")
    assert '"\\"salience\\""' in grammar["grammar"]


def test_fallback_order_and_why_skipped(servers: Servers, make_client: MakeClient, sleeps):
    a, b, c = servers(), servers(), servers()
    a.on("/v1/chat/completions", lambda r: Reply.error(500, "boom"))
    b.script(Reply.error(401, "bad key", type="authentication_error"))
    c.script(Reply.chat(GOOD))
    client = make_client(backend(a, "a"), backend(b, "b"), backend(c, "c"))

    result = ask(client)

    assert result.backend == "c"
    assert [(t.backend, t.result) for t in result.tried] == [
        ("a", "failed"),
        ("b", "failed"),
        ("c", "answered"),
    ]
    assert result.tried[0].reason == "http_500: boom"  # what the server said, as for a 4xx
    assert result.tried[1].reason == "http_401: bad key"  # what the server said was wrong
    # 5xx is retried up to the policy's three attempts; 401 never; c once.
    assert (a.count(), b.count(), c.count()) == (3, 1, 1)
    assert len(sleeps) == 2


@pytest.mark.parametrize("status", [400, 401, 403, 404])
def test_permanent_errors_are_not_retried(servers: Servers, make_client: MakeClient, status):
    a, b = servers(), servers(chat=json_responder(GOOD))
    a.on("/v1/chat/completions", lambda r: Reply.error(status, "no"))
    result = ask(make_client(backend(a, "a"), backend(b, "b")))
    assert result.backend == "b"
    assert a.count() == 1


def test_insufficient_quota_is_not_retried(servers: Servers, make_client: MakeClient):
    a, b = servers(), servers(chat=json_responder(GOOD))
    a.on("/v1/chat/completions", lambda r: Reply.error(429, "quota", type="insufficient_quota"))
    assert ask(make_client(backend(a, "a"), backend(b, "b"))).backend == "b"
    assert a.count() == 1


@pytest.mark.parametrize(
    "failure",
    [
        Reply.error(503, "Loading model", type="unavailable_error"),
        Reply.error(502, "bad gateway"),
        Reply.error(408, "request timeout"),
        Reply.error(429, "slow down", type="rate_limit_exceeded"),
        Reply.disconnect(),
        Reply.text("<html>not json</html>"),
    ],
    ids=["503-loading", "502", "408", "429", "dropped", "malformed"],
)
def test_transient_errors_are_retried_on_the_same_backend(
    servers: Servers, make_client: MakeClient, sleeps, failure
):
    a = servers()
    a.script(failure, failure, Reply.chat(GOOD))
    result = ask(make_client(backend(a, "a")))
    assert result.backend == "a"
    assert a.count() == 3
    assert len(sleeps) == 2


def test_backoff_is_exponential_with_bounded_jitter(
    servers: Servers, make_client: MakeClient, sleeps
):
    a = servers()
    a.on("/v1/chat/completions", lambda r: Reply.error(500))
    client = make_client(backend(a, "a"), attempts=5, backoff_base=0.5, backoff_max=1.5)
    with pytest.raises((ChatFailed, NoBackendReachable)):
        ask(client)
    assert a.count() == 5
    ceilings = [0.5, 1.0, 1.5, 1.5]
    assert len(sleeps) == 4
    for delay, ceiling in zip(sleeps, ceilings, strict=True):
        assert ceiling / 2 <= delay <= ceiling


def test_retry_after_is_honoured(servers: Servers, make_client: MakeClient, sleeps):
    a = servers()
    a.script(Reply.error(429, "slow", retry_after=2), Reply.chat(GOOD))
    assert ask(make_client(backend(a, "a"))).backend == "a"
    assert sleeps == [2.0]


def test_long_retry_after_moves_on_without_sleeping(
    servers: Servers, make_client: MakeClient, sleeps
):
    a, b = servers(), servers(chat=json_responder(GOOD))
    a.script(Reply.error(429, "slow", retry_after=3600))
    result = ask(make_client(backend(a, "a"), backend(b, "b")))
    assert result.backend == "b"
    assert a.count() == 1
    assert sleeps == []


def test_every_backend_rate_limiting_for_long_says_so(
    servers: Servers, make_client: MakeClient, sleeps
):
    a = servers()
    a.on("/v1/chat/completions", lambda r: Reply.error(429, "slow", retry_after=3600))
    a.on("probe", lambda r: Reply.error(429, "slow", retry_after=3600))
    with pytest.raises(NoBackendReachable, match=r"every LLM backend is rate-limiting \(a: http_429"):
        ask(make_client(backend(a, "a")))
    assert sleeps == []


def test_read_timeout_is_transient_and_real(servers: Servers, make_client: MakeClient, sleeps):
    a, b = servers(), servers(chat=json_responder(GOOD))
    a.on("/v1/chat/completions", lambda r: Reply.hang(10))
    client = make_client(backend(a, "a", timeout=0.2), backend(b, "b"), attempts=2)
    result = ask(client)
    assert result.backend == "b"
    assert result.tried[0].reason == "timeout: no answer within the backend's timeout, 0.2 s"
    assert a.count() == 2


def test_validation_repair_retry_feeds_the_error_back(servers: Servers, make_client: MakeClient):
    a = servers()
    a.script(Reply.chat({"save": "maybe"}), Reply.chat(GOOD))
    result = ask(make_client(backend(a, "a")))
    assert result.backend == "a"
    assert a.count() == 2
    repair = a.bodies()[1]["messages"]
    assert repair[2] == {"role": "assistant", "content": '{"save": "maybe"}'}
    assert repair[3]["role"] == "user"
    assert "save" in repair[3]["content"]
    assert (result.prompt_tokens, result.completion_tokens) == (22, 14)


def test_a_huge_invalid_reply_is_not_sent_back_whole_for_repair(
    servers: Servers, make_client: MakeClient
):
    a = servers()
    a.script(Reply.chat("junk " * 400_000), Reply.chat(GOOD))  # 2 MB of it
    ask(make_client(backend(a, "a")))
    echoed = a.bodies()[1]["messages"][2]["content"]
    assert echoed.startswith("junk junk") and echoed.endswith(" …")
    assert len(echoed) < 20_000


def test_reply_cut_off_at_max_tokens_asks_for_a_shorter_one(
    servers: Servers, make_client: MakeClient
):
    a = servers()
    cut = '{"save": true, "salience": 7, "note": "a very long'
    a.script(Reply.chat(cut, finish_reason="length"), Reply.chat(GOOD))
    with capture_logs() as logs:
        result = ask(make_client(backend(a, "a")))
    assert result.value == Verdict(save=True, salience=7)
    repair = a.bodies()[1]["messages"]
    assert repair[2] == {"role": "assistant", "content": cut}
    assert "cut off at the 64-token limit" in repair[3]["content"]
    assert "shorter" in repair[3]["content"]
    (event,) = [e for e in logs if e["event"] == "llm_reply_truncated"]
    assert (event["backend"], event["max_tokens"], event["purpose"]) == ("a", 64, "test")
    assert not [e for e in logs if e["event"] == "llm_reply_invalid"]


def test_a_broken_reply_that_was_not_cut_off_gets_the_parse_error(
    servers: Servers, make_client: MakeClient
):
    a = servers()
    a.script(Reply.chat('{"save": true,, "salience": 7}'), Reply.chat(GOOD))
    ask(make_client(backend(a, "a")))
    feedback = a.bodies()[1]["messages"][3]["content"]
    assert "not a JSON object" in feedback
    assert "cut off" not in feedback


def test_invalid_twice_falls_through_to_next_backend(servers: Servers, make_client: MakeClient):
    a, b = servers(), servers(chat=json_responder(GOOD))
    a.on("/v1/chat/completions", lambda r: Reply.chat("I think the answer is yes"))
    result = ask(make_client(backend(a, "a"), backend(b, "b")))
    assert result.backend == "b"
    assert a.count() == 2
    assert result.tried[0].reason.startswith("invalid_reply")


def test_invalid_everywhere_is_chat_failed_not_outage(servers: Servers, make_client: MakeClient):
    a = servers()
    a.on("/v1/chat/completions", lambda r: Reply.chat({"salience": 3}))
    with pytest.raises(ChatFailed) as caught:
        ask(make_client(backend(a, "a")))
    assert not isinstance(caught.value, ContextTooLong)
    assert a.count() == 2
    assert caught.value.tried[0].backend == "a"


def test_reply_cleaning_think_tags_fences_trailing_commas(
    servers: Servers, make_client: MakeClient
):
    a = servers()
    wrapped = '<think>hmm {"no": 1}</think>\nSure!\n```json\n{"save": true, "salience": 4,}\n```'
    a.script(Reply.chat(wrapped))
    result = ask(make_client(backend(a, "a")))
    assert result.value == Verdict(save=True, salience=4)
    assert a.count() == 1


@pytest.mark.parametrize("marker", ["```python", "</think>"])
def test_valid_json_mentioning_a_fence_or_think_tag_is_accepted_as_is(
    servers: Servers, make_client: MakeClient, marker: str
):
    """Strict JSON first: cleaning a reply that already is JSON would cut the string apart."""
    a = servers()
    a.on("/v1/chat/completions", lambda r: Reply.chat({"save": True, "salience": 4, "why": marker}))
    result = ask(make_client(backend(a, "a")))
    assert result.value == Verdict(save=True, salience=4)
    assert a.count() == 1


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_a_non_finite_number_is_an_invalid_reply_not_clamped(
    servers: Servers, make_client: MakeClient, number: str
):
    """json.loads takes NaN and Infinity; NaN compares false with every bound, so it would
    pass the range check (and every threshold) and be saved."""
    a, b = servers(), servers(chat=json_responder(GOOD))
    a.on("/v1/chat/completions", lambda r: Reply.chat(f'{{"save": true, "salience": {number}}}'))
    result = ask(make_client(backend(a, "a"), backend(b, "b")))
    assert result.backend == "b"
    assert result.tried[0].reason.startswith("invalid_reply")
    assert a.count() == 2  # the repair was asked for too


def test_out_of_range_numbers_are_clamped(servers: Servers, make_client: MakeClient):
    a = servers()
    a.script(Reply.chat({"save": False, "salience": 42}))
    result = ask(make_client(backend(a, "a")))
    assert result.value.salience == 10
    assert a.count() == 1


def test_reasoning_content_is_used_when_content_is_empty(servers: Servers, make_client: MakeClient):
    a = servers()
    body = Reply.chat("").json_body
    body["choices"][0]["message"]["reasoning_content"] = json.dumps(GOOD)
    a.script(Reply(json_body=body))
    assert ask(make_client(backend(a, "a"))).value.save is True


def test_content_parts_are_joined_into_the_reply(servers: Servers, make_client: MakeClient):
    """Mistral-style content: a list of parts; the text parts are the reply."""
    a = servers()
    body = Reply.chat("").json_body
    parts = [
        {"type": "thinking", "thinking": [{"type": "text", "text": "hmm"}]},
        {"type": "text", "text": '{"save": true, '},
        {"type": "text", "text": '"salience": 5}'},
    ]
    body["choices"][0]["message"]["content"] = parts
    a.script(Reply(json_body=body))
    result = ask(make_client(backend(a, "a")))
    assert (result.backend, result.value) == ("a", Verdict(save=True, salience=5))


@pytest.mark.parametrize(
    "content", [[{"type": "image_url", "image_url": {"url": "x"}}], {"text": "{}"}, 7]
)
def test_content_without_text_is_an_invalid_reply_of_that_backend(
    servers: Servers, make_client: MakeClient, content: object
):
    """Not an AttributeError escaping complete(): the next backend is tried, the breaker told."""
    a, b = servers(), servers(chat=json_responder(GOOD))
    body = Reply.chat("").json_body
    body["choices"][0]["message"]["content"] = content
    a.on("/v1/chat/completions", lambda r: Reply(json_body=body))
    client = make_client(backend(a, "a"), backend(b, "b"))
    client.breaker("a").record_failure("earlier")  # one failure: the answer must reset it
    result = ask(client)
    assert result.backend == "b"
    assert result.tried[0].reason.startswith("invalid_reply")
    assert client.breaker("a").consecutive_failures == 0


@pytest.mark.parametrize(
    "reply",
    [
        Reply.error(
            400,
            "request (5000 tokens) exceeds the available context size (n_ctx 4096)",
            type="exceed_context_size_error",
        ),
        Reply.error(
            400,
            "This model's maximum context length is 8192 tokens",
            type="invalid_request_error",
            code="context_length_exceeded",
        ),
    ],
    ids=["llama.cpp", "openai"],
)
def test_context_too_long_is_raised_at_once(servers: Servers, make_client: MakeClient, reply):
    a, b = servers(), servers(chat=json_responder(GOOD))
    a.script(reply)
    with pytest.raises(ContextTooLong) as caught:
        ask(make_client(backend(a, "a"), backend(b, "b")))
    assert caught.value.backend == "a"
    assert (a.count(), b.count()) == (1, 0)  # never the same oversize request everywhere


def test_nothing_reachable_and_probe_fails_is_no_backend_reachable(
    servers: Servers, make_client: MakeClient
):
    a = servers()
    a.on("/v1/chat/completions", lambda r: Reply.error(503, "Loading model"))
    a.on(PROBE, lambda r: Reply.error(503, "Loading model"))
    dead = backend(a, "dead", url="http://127.0.0.1:9/v1")  # discard port: refused
    with pytest.raises(NoBackendReachable) as caught:
        ask(make_client(backend(a, "a"), dead))
    assert [t.backend for t in caught.value.tried] == ["a", "dead"]
    # In the call's form, then without a schema (one failing only the form is misconfigured,
    # test_form_fails_with_5xx.py); the refused port is not asked again.
    assert a.count(PROBE) == 2


def test_server_errors_with_a_healthy_probe_are_the_items_fault(
    servers: Servers, make_client: MakeClient
):
    a = servers()
    a.on("/v1/chat/completions", lambda r: Reply.error(500, "this request crashes me"))
    with pytest.raises(ChatFailed):
        ask(make_client(backend(a, "a")))
    assert a.count(PROBE) == 1


def test_a_server_that_lists_its_models_but_fails_every_completion_is_down(
    servers: Servers, make_client: MakeClient
):
    """The probe is a one-token chat request: /models answering proves nothing about the model."""
    a = servers()
    a.on("/v1/chat/completions", lambda r: Reply.error(500, "CUDA out of memory"))
    a.on(PROBE, lambda r: Reply.error(500, "CUDA out of memory"))
    with pytest.raises(NoBackendReachable) as caught:
        ask(make_client(backend(a, "a")))
    assert not isinstance(caught.value, LLMBackendsMisconfigured)  # the plain probe failed too
    assert a.count("/v1/models") == 0
    in_form, plain = a.bodies(PROBE)
    assert in_form["max_tokens"] == plain["max_tokens"] == 1
    assert "response_format" in in_form and "response_format" not in plain
    assert plain["model"] == "scripted"


def test_all_refused_is_misconfigured(servers: Servers, make_client: MakeClient):
    """A wrong key or model refuses the health probe too: the configuration is at fault."""
    a, b = servers(), servers()
    a.on("/v1/chat/completions", lambda r: Reply.error(401, "bad key"))
    a.on(PROBE, lambda r: Reply.error(401, "bad key"))
    b.on("/v1/chat/completions", lambda r: Reply.error(404, "model not found"))
    b.on(PROBE, lambda r: Reply.error(404, "model not found"))
    with pytest.raises(LLMBackendsMisconfigured) as caught:
        ask(make_client(backend(a, "a"), backend(b, "b")))
    assert isinstance(caught.value, BackendsMisconfigured)
    assert (a.count(), b.count()) == (1, 1)
    assert (a.count(PROBE), b.count(PROBE)) == (1, 1)


@pytest.mark.parametrize(
    "refusal",
    [
        Reply.error(403, "Request blocked by WAF rule 942100", type="forbidden"),
        Reply.error(404, "No endpoints found that can handle the requested parameters."),
    ],
    ids=["waf-403", "openrouter-404"],
)
def test_a_refusal_only_this_request_gets_is_the_items_failure(
    servers: Servers, make_client: MakeClient, refusal: Reply
):
    """The health probe (same key, same model) succeeds: the refusal is this request's, so the
    attempt counts (ChatFailed), instead of being given back and the item claimed for ever."""
    a = servers()
    a.on("/v1/chat/completions", lambda r: refusal)
    with pytest.raises(ChatFailed) as caught:
        ask(make_client(backend(a, "a")))
    assert not isinstance(caught.value, ContextTooLong)
    assert (a.count(), a.count(PROBE)) == (1, 1)


def test_a_refusal_of_the_structured_output_form_is_every_items_and_gives_the_attempt_back(
    servers: Servers, make_client: MakeClient
):
    """OpenRouter's 404 for parameters no provider supports refuses every item's request, not
    one item's: the cross-check probe carries the request's structured-output form, so it is
    refused too, and the items wait (claiming paused) instead of all being dead-lettered."""
    refusal = Reply.error(404, "No endpoints found that support the requested parameters.")
    a = servers()
    a.on("/v1/chat/completions", lambda r: refusal)
    a.on(PROBE, lambda r: refusal if "response_format" in r.body else Reply.chat("OK"))
    with pytest.raises(LLMBackendsMisconfigured):
        ask(make_client(backend(a, "a", structured_output="json_schema")))
    (probe,) = a.bodies(PROBE)
    assert probe["max_tokens"] == 1 and "response_format" in probe


def test_a_refusal_next_to_a_skipped_backend_is_not_the_items_attempt(
    servers: Servers, make_client: MakeClient
):
    """The request reached only a backend with a bad key; the other was skipped (its circuit
    still open) although it is healthy again: the request never met a healthy backend, so
    the attempt is given back (it was used before the probe only asked the backends reached)."""
    a, b = servers(), servers(chat=json_responder(GOOD))
    a.on("/v1/chat/completions", lambda r: Reply.error(401, "bad key"))
    a.on(PROBE, lambda r: Reply.error(401, "bad key"))
    client = make_client(backend(a, "a"), backend(b, "b"), breaker_threshold=1)
    client.breaker("b").record_failure("earlier outage")  # open: b is skipped
    with pytest.raises(NoBackendReachable):  # given back, claiming paused until a probe
        ask(client)
    assert b.count() == 0


def test_api_key_is_sent_as_bearer(servers: Servers, make_client: MakeClient):
    a = servers(chat=json_responder(GOOD))
    ask(make_client(backend(a, "a", api_key="sk-test")))
    assert a.requests[0].headers["authorization"] == "Bearer sk-test"


def test_concurrency_limit_per_backend(servers: Servers, make_client: MakeClient):
    a = servers(chat=json_responder(GOOD), latency=0.05)
    client = make_client(backend(a, "a", max_concurrency=2))
    errors: list[BaseException] = []

    def run() -> None:
        try:
            ask(client)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert not errors
    assert a.count() == 8
    assert a.max_in_flight == 2


def test_every_backend_busy_says_so_and_gives_the_attempt_back(
    servers: Servers, make_client: MakeClient
):
    """One slot, held by requests the server never answers: a call that waits its whole
    timeout for the slot must say the backend is busy, not that it is unreachable."""
    a = servers()
    a.on("/v1/chat/completions", lambda r: Reply.hang(30))
    client = make_client(backend(a, "a", max_concurrency=1, timeout=1.0), attempts=1)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            ask(client)
        except BaseException as exc:
            errors.append(exc)

    holder = threading.Thread(target=run)
    holder.start()
    for _ in range(200):  # the holder has the slot once its request reached the server
        if a.count() == 1:
            break
        time.sleep(0.05)
    time.sleep(0.3)  # the waiters start inside the holder's timeout, not at its very start
    # Both wait for the slot; one gets it when the holder times out and holds it a whole
    # timeout more, so the other waits out its timeout for nothing.
    waiters = [threading.Thread(target=run) for _ in range(2)]
    for thread in waiters:
        thread.start()
    for thread in [holder, *waiters]:
        thread.join(timeout=30)

    busy = [e for e in errors if isinstance(e, LLMBackendsBusy)]
    assert len(errors) == 3 and busy, errors
    error = busy[0]
    assert str(error).startswith(
        "every LLM backend is busy (a: busy: its one slot stayed in use for 1 s):"
    )
    assert "raise max_concurrency in SOKRATOS_LLM_BACKENDS" in str(error)
    assert "lower SOKRATOS_CONCURRENCY" in str(error)
    assert [(t.backend, t.result) for t in error.tried] == [("a", "skipped")]
    assert a.count() == 3 - len(busy)  # a busy call sends nothing
    # An overloaded backend is not the item's fault: the runner gives the attempt back.
    assert after_failure(error, attempt=1, max_attempts=3).step is Step.GIVE_BACK


def test_a_probe_the_backend_serves_closes_its_circuit_for_every_resumed_item(
    servers: Servers, make_client: MakeClient
):
    """After an outage the probe that resumes claiming succeeded but only ended the circuit's
    cool-down: the next call went as the half-open trial and the items resumed beside it
    failed at once with circuit_open, given back, a new outage logged right after."""
    a = servers(chat=json_responder(GOOD))
    client = make_client(backend(a, "a"))
    breaker = client._backends[0].breaker
    for _ in range(breaker.threshold):
        breaker.record_failure("connection refused")
    assert str(breaker.state) == "open"
    assert client.probe()
    assert str(breaker.state) == "closed"
    answers: list[object] = []
    threads = [threading.Thread(target=lambda: answers.append(ask(client))) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(answers) == 6 and all(x.value == Verdict(**GOOD) for x in answers), answers  # type: ignore[attr-defined]


def test_a_number_the_schema_itself_clamps_is_logged_with_the_backend() -> None:
    """The response models clamp their own numbers (pipelines/schemas.py), so the parser never
    saw a range error: `llm_value_clamped`, documented with the backend and purpose, was never
    logged, only a bare `value_clamped` (review R2)."""
    from sokratos_worker.pipelines.schemas import TriageVerdict

    reply = {"salience_score": 12, "summary": "x", "category": "", "tags": [], "save": True,
             "paradigm_shift": False}
    with ScriptedLLM() as server:
        server.script(Reply.chat(reply))
        client = FallbackChatClient([backend(server, "lcp")])
        try:
            with capture_logs() as logs:
                result = client.complete(response_model=TriageVerdict, system="s", user="u",
                                         max_tokens=64, purpose="conversation_triage")
        finally:
            client.close()
    assert result.value.salience_score == 10.0
    [clamped] = [e for e in logs if e["event"] == "llm_value_clamped"]
    assert clamped["backend"] == "lcp" and clamped["purpose"] == "conversation_triage"
    assert clamped["fields"] == ["salience_score"]
    assert "value_clamped" not in [e["event"] for e in logs]
