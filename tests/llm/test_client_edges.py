"""Behaviour of the LLM client that no other test pinned (found by planting mutants): the
circuit breaker's cool-down and trials, Retry-After at its limit, how failures are named,
secrets masked wherever a server echoes them, reply cleaning, embeddings' retries and splits,
and the call's deadline. Real HTTP servers on 127.0.0.1."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from pydantic import BaseModel

from sokratos_worker.llm.breaker import Circuit, CircuitBreaker
from sokratos_worker.llm.chat import FallbackChatClient
from sokratos_worker.llm.embeddings import HttpEmbedder
from sokratos_worker.llm.types import (
    ContextTooLong,
    EmbeddingFailed,
    EmbeddingsUnavailable,
    LLMBackendsMisconfigured,
    NoBackendReachable,
)
from sokratos_worker.testing import PROBE, Reply, ScriptedLLM, hash_embedding, json_responder
from sokratos_worker.testing.scripted_llm import EMBEDDINGS, Request
from tests.llm.conftest import (
    FakeClock,
    ask_contradiction,
    backend,
    primary_and_fallback,
    switchable,
)

Servers = Callable[..., ScriptedLLM]
MakeClient = Callable[..., FallbackChatClient]


class Ok(BaseModel):
    ok: bool


def ask(client: FallbackChatClient) -> str:
    """One structured call; the backend that answered it."""
    return client.complete(
        response_model=Ok, system="s", user="u", max_tokens=8, purpose="t"
    ).backend


# -- circuit breaker inside the client -------------------------------------------------------


def test_a_closed_circuit_waits_the_base_cooldown_again_after_a_doubled_one(
    servers: Servers, make_client: MakeClient, clock: FakeClock
):
    """A failed half-open trial doubles the cool-down; the trial that later closes the circuit
    resets it, so the next outage waits the base cool-down, not the doubled one."""
    a, b = servers(), servers(chat=json_responder({"ok": True}))
    a.on("/v1/chat/completions", lambda r: Reply.error(500, "down"))
    a.on(PROBE, lambda r: Reply.error(500, "down"))
    client = make_client(backend(a, "a"), backend(b, "b"), attempts=1, breaker_threshold=1)

    assert ask(client) == "b"  # the outage opens a's circuit
    clock.advance(120)
    assert ask(client) == "b"  # the trial fails: open again for twice as long
    assert client.breaker("a").cooldown == 240

    clock.advance(240)
    a.on(PROBE, lambda r: Reply.chat("OK"))
    a.on("/v1/chat/completions", json_responder({"ok": True}))
    assert ask(client) == "a"
    assert client.breaker("a").state is Circuit.CLOSED
    assert client.states()[0].detail["cooldown_s"] == 120

    a.on("/v1/chat/completions", lambda r: Reply.error(500, "down again"))
    assert ask(client) == "b"  # the next outage opens it with the base cool-down
    assert client.breaker("a").state is Circuit.OPEN
    assert client.states()[0].detail["retry_in_s"] == 120


def test_a_half_open_trial_that_overran_counts_as_a_failure(clock: FakeClock):
    """A trial that never reported back counts in ``consecutive_failures`` (as status shows
    it), as a failed trial does."""
    cb = CircuitBreaker("a", threshold=3, cooldown=120, probe_deadline=30, clock=clock)
    for _ in range(3):
        cb.record_failure("down")
    clock.advance(120)
    assert cb.allow()  # the trial goes out and never reports back
    clock.advance(30)
    assert cb.state is Circuit.OPEN
    assert cb.consecutive_failures == 4
    assert cb.last_error == "half-open probe overran its deadline"


def test_a_served_half_open_probe_closes_the_circuit_even_if_the_request_then_fails(
    servers: Servers, make_client: MakeClient, clock: FakeClock
):
    """The one-token trial served closes the circuit at once: the item's request failing right
    after counts as one failure of a closed circuit, and the next call reaches the backend
    instead of skipping it as still half-open."""
    a, b = servers(), servers(chat=json_responder({"ok": True}))
    a.on("/v1/chat/completions", lambda r: Reply.error(500, "down"))
    client = make_client(backend(a, "a"), backend(b, "b"), attempts=1)
    for _ in range(3):
        assert ask(client) == "b"
    assert client.breaker("a").state is Circuit.OPEN

    clock.advance(120)  # the trial (the probe) is served; the request itself fails once more
    assert ask(client) == "b"
    assert a.count(PROBE) == 1
    assert client.breaker("a").state is Circuit.CLOSED
    assert client.breaker("a").consecutive_failures == 1

    a.on("/v1/chat/completions", json_responder({"ok": True}))
    assert ask(client) == "a"  # reached, not skipped as half-open


def test_a_permanent_answer_resets_the_count_of_consecutive_failures(
    servers: Servers, make_client: MakeClient
):
    """A 4xx is an answer (the server itself is up): failures on either side of it are not
    consecutive, so they do not open the circuit."""
    a, b = servers(), servers(chat=json_responder({"ok": True}))
    a.script(
        Reply.error(500, "hiccup"),
        Reply.error(500, "hiccup"),
        Reply.error(400, "bad parameter", type="invalid_request_error"),
        Reply.error(500, "hiccup"),
    )
    client = make_client(backend(a, "a"), backend(b, "b"), attempts=1)
    for _ in range(4):
        assert ask(client) == "b"
    assert a.count() == 4
    assert client.breaker("a").state is Circuit.CLOSED
    assert client.breaker("a").consecutive_failures == 1


def test_status_shows_no_negative_wait_once_the_cooldown_is_over(
    servers: Servers, make_client: MakeClient, clock: FakeClock
):
    """An open circuit whose cool-down ended with no call since shows ``retry_in_s`` 0 in
    status, not a negative number of seconds."""
    a, b = servers(), servers(chat=json_responder({"ok": True}))
    a.on("/v1/chat/completions", lambda r: Reply.error(500, "down"))
    client = make_client(backend(a, "a"), backend(b, "b"), attempts=1, breaker_threshold=1)
    assert ask(client) == "b"
    clock.advance(150)
    (state, _) = client.states()
    assert (state.circuit, state.detail["retry_in_s"]) == ("open", 0)


# -- retries -----------------------------------------------------------------------------------


def test_a_retry_after_of_exactly_the_limit_is_waited_out(
    servers: Servers, make_client: MakeClient, sleeps: list[float]
):
    """Only a Retry-After longer than ``retry_after_max`` moves on at once; one equal to it is
    waited out on the same backend."""
    a, b = servers(), servers(chat=json_responder({"ok": True}))
    a.script(Reply.error(429, "slow down", retry_after=5), Reply.chat({"ok": True}))
    client = make_client(backend(a, "a"), backend(b, "b"), retry_after_max=5.0)
    assert ask(client) == "a"
    assert sleeps == [5.0]
    assert (a.count(), b.count()) == (2, 0)


def test_a_health_probe_the_backend_refuses_ends_its_circuits_cooldown(
    servers: Servers, make_client: MakeClient
):
    """A backend whose circuit is open and which answers the health probe, even with a refusal,
    is up: its cool-down ends, so the next call tries it at once instead of skipping it."""
    a, b = servers(), servers(chat=json_responder({"ok": True}))
    a.on("/v1/chat/completions", lambda r: Reply.error(500, "down"))
    client = make_client(backend(a, "a"), backend(b, "b"), attempts=1, breaker_threshold=1)
    assert ask(client) == "b"
    assert client.breaker("a").state is Circuit.OPEN
    assert client.states()[0].detail["retry_in_s"] == 120

    a.on(PROBE, lambda r: Reply.error(401, "invalid api key", type="authentication_error"))
    assert client.probe() is True  # b serves it
    assert client.states()[0].detail["retry_in_s"] == 0

    a.on(PROBE, lambda r: Reply.chat("OK"))
    a.on("/v1/chat/completions", json_responder({"ok": True}))
    assert ask(client) == "a"  # no clock moved: the trial goes out now
    assert client.breaker("a").state is Circuit.CLOSED


# -- repair of an invalid reply ----------------------------------------------------------------


def test_an_invalid_reply_under_two_thousand_characters_is_echoed_whole_for_repair(
    servers: Servers, make_client: MakeClient
):
    """The repair request sends an invalid reply back whole up to max(2000, 8 * max_tokens)
    characters, however small max_tokens is, so the model sees what it got wrong."""
    a = servers()
    invalid = '{"ok": "not a boolean", "note": "' + "x" * 1500 + '"}'
    a.script(Reply.chat(invalid), Reply.chat({"ok": True}))
    client = make_client(backend(a, "a"))
    result = client.complete(response_model=Ok, system="s", user="u", max_tokens=8, purpose="t")
    assert result.value == Ok(ok=True)
    echoed = a.bodies()[1]["messages"][2]
    assert echoed == {"role": "assistant", "content": invalid}


def test_tokens_of_a_repaired_call_count_both_requests_when_one_reports_no_usage(
    servers: Servers, make_client: MakeClient
):
    """A repaired call's tokens are the sum of both requests' where reported: a follow-up
    without ``usage`` keeps the first request's counts instead of losing them."""
    a = servers()
    without_usage = Reply.chat({"ok": True})
    assert without_usage.json_body is not None
    body = {k: v for k, v in without_usage.json_body.items() if k != "usage"}
    a.script(
        Reply.chat({"ok": "maybe"}, prompt_tokens=5, completion_tokens=3),
        Reply(json_body=body),
    )
    client = make_client(backend(a, "a"))
    result = client.complete(response_model=Ok, system="s", user="u", max_tokens=8, purpose="t")
    assert result.value == Ok(ok=True)
    assert a.count() == 2
    assert (result.prompt_tokens, result.completion_tokens) == (5, 3)


def test_a_call_of_another_form_answered_after_a_give_back_does_not_end_the_pause(
    servers: Servers, make_client: MakeClient
):
    """The pause after a give-back (awaiting the backend that refused the minimal request) is
    not ended by an answer in another form: it once was, and the given-back item was claimed,
    failed and given back again for as long as the key stayed expired (found by a review).
    It ends when the awaited backend serves again."""
    expired, refusing = {"mode": "expired"}, {"mode": "refuses"}
    client = primary_and_fallback(servers, make_client, switchable(expired), switchable(refusing))

    assert isinstance(ask_contradiction(client), LLMBackendsMisconfigured)
    assert client.probe() is False  # awaiting "primary", whose key still fails

    assert ask(client) == "fallback"  # another request type is answered meanwhile
    assert client.probe() is False
    expired["mode"] = "serves"  # the key renewed
    assert client.probe() is True


def test_a_negative_retry_after_is_no_wait_not_a_negative_sleep(
    servers: Servers, make_client: MakeClient, sleeps: list[float]
):
    """A Retry-After in the past (a negative number of seconds) means "now": the retry waits
    0 s, never a negative time, which ``time.sleep`` would refuse with ValueError."""
    a = servers()
    a.script(Reply.error(503, "Loading model", retry_after=-5), Reply.chat({"ok": True}))
    assert ask(make_client(backend(a, "a"))) == "a"
    assert sleeps == [0.0]


# -- what counts as the item's failure, a refusal or configuration -----------------------------


def test_a_413_saying_the_prompt_exceeds_the_context_is_context_too_long(
    servers: Servers, make_client: MakeClient
):
    """A 413 whose body says the input is over the model's context is "context too long" like
    the 400 form: raised at once, and the same oversize request never sent to the fallback."""
    a, b = servers(), servers(chat=json_responder({"ok": True}))
    a.script(
        Reply.error(413, "prompt is too long: 9000 tokens > 8192", type="invalid_request_error")
    )
    client = make_client(backend(a, "a"), backend(b, "b"))
    with pytest.raises(ContextTooLong) as caught:
        ask(client)
    assert caught.value.backend == "a"
    assert (a.count(), b.count()) == (1, 0)


def test_one_backend_rate_limiting_and_another_down_is_not_called_rate_limiting(
    servers: Servers, make_client: MakeClient
):
    """The error says every backend is rate-limiting only when every one answered 429: one
    rate-limiting and one down is "no LLM backend reachable"."""
    a, b = servers(), servers()
    for server, failure in (
        (a, Reply.error(429, "slow down", retry_after=3600)),
        (b, Reply.error(503, "Loading model")),
    ):
        server.on("/v1/chat/completions", lambda r, failure=failure: failure)
        server.on(PROBE, lambda r, failure=failure: failure)
    with pytest.raises(NoBackendReachable) as caught:
        ask(make_client(backend(a, "a"), backend(b, "b"), attempts=1))
    assert str(caught.value).startswith("no LLM backend reachable (a: http_429")


def test_a_key_refused_here_and_a_request_rejected_there_names_url_and_model(
    servers: Servers, make_client: MakeClient
):
    """Every backend refusing, one with 401 and one with a 400 that the minimal request gets
    too, is configuration whose message sends the operator to each backend's url and model,
    not only to the api keys."""
    a, b = servers(), servers()
    for server, failure in (
        (a, Reply.error(401, "invalid api key", type="authentication_error")),
        (b, Reply.error(400, "unknown parameter", type="invalid_request_error")),
    ):
        server.on("/v1/chat/completions", lambda r, failure=failure: failure)
        server.on(PROBE, lambda r, failure=failure: failure)
    with pytest.raises(LLMBackendsMisconfigured) as caught:
        ask(make_client(backend(a, "a"), backend(b, "b"), attempts=1))
    assert "check each backend's url and model" in str(caught.value)


def test_every_backend_refusing_the_key_names_the_api_key_and_model(
    servers: Servers, make_client: MakeClient
):
    """Every backend answering 401 (the minimal request too) is configuration whose message
    sends the operator to each backend's api_key and model."""
    a, b = servers(), servers()
    for server in (a, b):
        refused = Reply.error(401, "invalid api key", type="authentication_error")
        server.on("/v1/chat/completions", lambda r, refused=refused: refused)
        server.on(PROBE, lambda r, refused=refused: refused)
    with pytest.raises(LLMBackendsMisconfigured) as caught:
        ask(make_client(backend(a, "a"), backend(b, "b"), attempts=1))
    assert "check each backend's api_key and model" in str(caught.value)


# -- secret redaction ---------------------------------------------------------------------------


def test_a_key_echoed_where_the_servers_message_is_cut_is_masked_not_halved(
    servers: Servers, make_client: MakeClient
):
    """The server's message is masked before it is cut to its first 160 characters: a key that
    straddles the cut would otherwise no longer be found, and its first half would be kept."""
    secret = "prod-key-7f3a9c2e5b1d4e8f"
    message = ("Authentication Error. " * 7)[:141] + f"Received={secret}, expected 'sk-'."
    assert message.index(secret) == 150  # the cut at 160 falls inside the key
    a, b = servers(), servers(chat=json_responder({"ok": True}))
    a.on("/v1/chat/completions", lambda r: Reply.error(401, message, type="auth_error"))
    result = make_client(backend(a, "a", api_key=secret), backend(b, "b")).complete(
        response_model=Ok, system="s", user="u", max_tokens=8, purpose="t"
    )
    assert result.backend == "b"
    reason = result.tried[0].reason
    assert reason.startswith("http_401: Authentication Error.")
    assert secret[:6] not in reason
    assert reason.endswith("Received=[redacted]")


@pytest.mark.parametrize("password", ["s3cret-pw-71", "pw4x"], ids=["long", "four-characters"])
def test_a_password_in_the_backend_url_echoed_by_the_server_is_masked(
    servers: Servers, make_client: MakeClient, password: str
):
    """The password of a backend URL's ``user:password@`` (from 4 characters) is a secret of
    that backend: echoed in the server's error message, it is masked in the attempt's reason."""
    a, b = servers(), servers(chat=json_responder({"ok": True}))
    a.on(
        "/v1/chat/completions",
        lambda r: Reply.error(403, f"user ops with password {password} may not use this model"),
    )
    url = a.url.replace("http://", f"http://ops:{password}@")
    result = make_client(backend(a, "a", url=url), backend(b, "b")).complete(
        response_model=Ok, system="s", user="u", max_tokens=8, purpose="t"
    )
    assert result.backend == "b"
    reason = result.tried[0].reason
    assert reason == "http_403: user ops with password [redacted] may not use this model"


def test_a_key_echoed_in_a_page_that_is_not_a_completion_is_masked(
    servers: Servers, make_client: MakeClient
):
    """A 200 that is not a chat completion (a proxy's login page) is quoted in the reason with
    the backend's key masked, should the page echo it."""
    secret = "prod-key-7f3a9c2e5b1d4e8f"
    a, b = servers(), servers(chat=json_responder({"ok": True}))
    a.on("/v1/chat/completions", lambda r: Reply.text(f"<p>token {secret} needs a login</p>"))
    client = make_client(backend(a, "a", api_key=secret), backend(b, "b"), attempts=1)
    result = client.complete(response_model=Ok, system="s", user="u", max_tokens=8, purpose="t")
    assert result.backend == "b"
    reason = result.tried[0].reason
    assert reason.startswith("malformed_response: not JSON")
    assert secret not in reason
    assert "token [redacted] needs a login" in reason


# -- cleaning and validating replies -------------------------------------------------------------


def test_a_reply_that_is_json_but_not_an_object_is_cleaned_to_the_object_inside(
    servers: Servers, make_client: MakeClient
):
    """A reply that parses as JSON but not as an object (the object wrapped in an array) is
    cleaned like any other text: its first object is the reply, with no repair request."""
    a = servers()
    a.script(Reply.chat('[{"ok": true}]'))
    result = make_client(backend(a, "a")).complete(
        response_model=Ok, system="s", user="u", max_tokens=8, purpose="t"
    )
    assert result.value == Ok(ok=True)
    assert a.count() == 1


def test_reasoning_up_to_the_last_orphan_think_close_is_dropped(
    servers: Servers, make_client: MakeClient
):
    """Reasoning without its opening tag is dropped up to the last ``</think>``: a draft object
    in an earlier stretch of reasoning is never taken for the reply."""
    a = servers()
    a.script(
        Reply.chat(
            'draft: {"ok": false} </think> on reflection {"ok": "unsure"} </think>\n{"ok": true}'
        )
    )
    result = make_client(backend(a, "a")).complete(
        response_model=Ok, system="s", user="u", max_tokens=8, purpose="t"
    )
    assert result.value == Ok(ok=True)
    assert a.count() == 1


def test_an_unclosed_code_fence_still_delimits_the_reply(servers: Servers, make_client: MakeClient):
    """A code fence the model never closed still marks where the reply starts: braces in the
    chatter before it are not taken for the object."""
    a = servers()
    a.script(Reply.chat('Using the {schema} you gave:\n```json\n{"ok": true}\n'))
    result = make_client(backend(a, "a")).complete(
        response_model=Ok, system="s", user="u", max_tokens=8, purpose="t"
    )
    assert result.value == Ok(ok=True)
    assert a.count() == 1


# -- embeddings ---------------------------------------------------------------------------------


def embedder(server: ScriptedLLM, slept: list[float], **kwargs: Any) -> HttpEmbedder:
    """An embedder of 8 dimensions on ``server`` whose backoff is recorded, never slept."""
    return HttpEmbedder(server.url, "embed", 8, timeout=5.0, sleep=slept.append, **kwargs)


def test_an_embedding_retry_after_of_exactly_the_limit_is_waited_out(servers: Servers):
    """Only a Retry-After longer than ``retry_after_max`` gives the attempt back at once; one
    equal to it is waited out and the batch asked again."""
    server = servers(embed_dim=8)
    server.script(Reply.error(429, "slow down", retry_after=5), path=EMBEDDINGS)
    slept: list[float] = []
    client = embedder(server, slept, retry_after_max=5.0)
    try:
        vectors = client.embed(["hello"])
    finally:
        client.close()
    assert len(vectors) == 1
    assert slept == [5.0]
    assert server.count(EMBEDDINGS) == 2


def test_an_embedding_408_that_outlasts_the_retries_gives_the_attempt_back_unprobed(
    servers: Servers,
):
    """A 408 is the server's load like a 429: outlasting the retries, the attempt is given back
    even though a tiny probe would be served, and no probe is sent."""

    def timing_out_on_items(request: Request) -> Reply:
        texts = request.body["input"]
        if texts == ["sokratos-worker probe"]:
            return Reply.embeddings([hash_embedding(t, 8) for t in texts])
        return Reply.error(408, "request timed out in the queue")

    server = servers()
    server.on(EMBEDDINGS, timing_out_on_items)
    client = embedder(server, [])
    try:
        with pytest.raises(EmbeddingsUnavailable, match="408") as caught:
            client.embed(["an item's text"])
    finally:
        client.close()
    assert not isinstance(caught.value, EmbeddingFailed)
    assert server.count(EMBEDDINGS) == 3  # the three attempts, no probe


def test_a_text_of_the_smallest_split_size_is_not_split_further(servers: Servers):
    """A text the server finds too large is halved only while it is over MIN_SPLIT_BYTES (100):
    one of exactly 100 bytes fails as the item's, after one request."""
    server = servers()
    server.on(EMBEDDINGS, lambda r: Reply.error(500, "input is too large to process"))
    client = embedder(server, [])
    text = "word " * 19 + "last."
    assert len(text.encode()) == 100
    try:
        with pytest.raises(EmbeddingFailed, match="too large"):
            client.embed_splitting(text)
    finally:
        client.close()
    assert server.count(EMBEDDINGS) == 1


def test_an_embedding_refusal_the_probe_answers_differently_is_the_items(servers: Servers):
    """A 4xx for this input is configuration only when the tiny probe gets the same status: a
    probe refused otherwise leaves it the item's failure (its attempt used, nothing paused)."""

    def refusing(request: Request) -> Reply:
        if request.body["input"] == ["sokratos-worker probe"]:
            return Reply.error(422, "unprocessable probe")
        return Reply.error(400, "input contains a token the tokenizer rejects")

    server = servers()
    server.on(EMBEDDINGS, refusing)
    client = embedder(server, [])
    try:
        with pytest.raises(EmbeddingFailed, match="400: input contains a token") as caught:
            client.embed(["an item's text"])
    finally:
        client.close()
    assert not isinstance(caught.value, EmbeddingsUnavailable)


def test_embedding_backoff_between_transient_failures_is_jittered(servers: Servers):
    """The backoff between embedding attempts adds up to a second of jitter to the exponential
    wait, so workers that failed together do not retry in lockstep."""
    server = servers(embed_dim=8)
    server.script(
        Reply.error(503, "Loading model"), Reply.error(503, "Loading model"), path=EMBEDDINGS
    )
    slept: list[float] = []
    client = embedder(server, slept)
    try:
        assert len(client.embed(["hello"])) == 1
    finally:
        client.close()
    assert len(slept) == 2
    assert 0.5 <= slept[0] <= 1.5
    assert 1.0 <= slept[1] <= 2.0
    assert slept != [0.5, 1.0]  # (jitter drawn as exactly 0 twice: never in practice)


# -- deadlines ----------------------------------------------------------------------------------


@pytest.fixture
def stalls_after_the_headers() -> Iterator[str]:
    """A server that answers a request's status line and headers 3.5 s after it, then sends no
    body for 10 s; its base URL."""
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve() -> None:
        with contextlib.suppress(OSError):
            conn, _ = listener.accept()
            with conn:
                reader = conn.makefile("rb")
                length = 0
                while (line := reader.readline()) not in (b"\r\n", b""):
                    name, _, value = line.decode().partition(":")
                    if name.lower() == "content-length":
                        length = int(value)
                reader.read(length)
                done.wait(3.5)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n")
                done.wait(10)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
    done.set()
    listener.close()
    thread.join(5)


def test_a_silence_after_the_headers_still_ends_at_the_calls_deadline(
    servers: Servers, make_client: MakeClient, stalls_after_the_headers: str
):
    """The read timeout bounds the whole answer: headers that arrive 3.5 s into a 4 s timeout
    leave the body 0.5 s, not a fresh 4 s wait, before the call moves on to the fallback."""
    b = servers(chat=json_responder({"ok": True}))
    stalling = backend(b, "a", url=stalls_after_the_headers, timeout=4)
    client = make_client(stalling, backend(b, "b"), attempts=1)
    started = time.monotonic()
    result = client.complete(response_model=Ok, system="s", user="u", max_tokens=8, purpose="t")
    elapsed = time.monotonic() - started
    assert result.backend == "b"
    assert result.tried[0].reason == "timeout: no answer within the backend's timeout, 4 s"
    assert elapsed < 6.0, elapsed  # ~4 s; 7.5 s if the body's wait started afresh


def test_a_key_the_embedding_server_echoes_in_a_refusal_is_masked(servers: Servers):
    """The embedding server's 4xx message is quoted in the error with the API key masked."""
    secret = "emb-key-0c4d1f8a9b2e7d3c"
    server = servers()
    server.on(
        EMBEDDINGS,
        lambda r: Reply.error(400, f"key {secret} may not use model embed", type="invalid_request"),
    )
    client = embedder(server, [], api_key=secret)
    try:
        with pytest.raises(EmbeddingsUnavailable) as caught:
            client.embed(["an item's text"])
    finally:
        client.close()
    assert secret not in str(caught.value)
    assert "key [redacted] may not use model embed" in str(caught.value)
