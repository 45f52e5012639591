"""Behaviour of the request forms, probes and reply validation that no other test pinned (found
by planting mutants): the llama.cpp grammar accepts every valid answer, strict schemas reach
nested objects, the one-token probe tells a login page and a proxy's 407 from a served request,
``check`` reads a model list as Ollama and llama.cpp write it, and strict bounds clamp inside.
Real HTTP servers and proxies on 127.0.0.1."""

from __future__ import annotations

import json
import math
import re
import socket
import ssl
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, Field

from sokratos_worker.config import BackendConfig, Settings
from sokratos_worker.llm.backend import Backend, RetryPolicy
from sokratos_worker.llm.breaker import Circuit
from sokratos_worker.llm.chat import FallbackChatClient
from sokratos_worker.llm.embeddings import HttpEmbedder
from sokratos_worker.llm.gbnf import schema_to_gbnf
from sokratos_worker.llm.one_token_probe import (
    Probed,
    minimal_answer,
    probe_answer,
    request_would_be_served,
)
from sokratos_worker.llm.probe import probe_backends
from sokratos_worker.llm.reply import ReplyInvalid, parse_reply
from sokratos_worker.llm.request_body import strict_schema
from sokratos_worker.llm.types import LLMBackendsMisconfigured, NoBackendReachable
from sokratos_worker.pipelines.schemas import ContradictionVerdicts, Distillation, TriageVerdict
from sokratos_worker.testing import PROBE, Reply, ScriptedLLM, hash_embedding, json_responder
from tests.llm.conftest import FakeClock, ask, backend
from tests.support.forward_proxy import ForwardProxy
from tests.support.rawserver import RawServer

Servers = Callable[..., ScriptedLLM]
MakeClient = Callable[..., FallbackChatClient]

# -- the llama.cpp grammar: every valid answer must be one the grammar lets the model write ------

_TOKEN = re.compile(
    r'\s*("(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|\{\d+(?:,\d*)?\}|[()|*+?]|[a-zA-Z0-9-]+)'
)


def _grammar_regex(grammar: str, depth: int = 9) -> re.Pattern[str]:
    """The grammar's ``root`` as a Python regex, rules inlined ``depth`` deep (GBNF literals are
    JSON strings, its character classes and repetitions are the regex ones)."""
    rules = {}
    for line in grammar.splitlines():
        name, sep, body = line.partition(" ::= ")
        if sep:
            rules[name.strip()] = body
    cache: dict[tuple[str, int], str] = {}

    def expand(name: str, left: int) -> str:
        if left == 0:
            return "(?!)"
        if (name, left) not in cache:
            body, out, pos = rules[name], [], 0
            while pos < len(body.rstrip()):
                match = _TOKEN.match(body, pos)
                assert match, f"cannot read {body[pos:]!r} in rule {name}"
                token, pos = match.group(1), match.end()
                if token.startswith('"'):
                    out.append(re.escape(json.loads(token)))
                elif token[0] in "[{()|*+?":
                    out.append(token)
                else:
                    out.append(f"(?:{expand(token, left - 1)})")
            cache[(name, left)] = "".join(out)
        return cache[(name, left)]

    return re.compile(expand("root", depth))


def _accepts(model_or_schema: type[BaseModel] | dict[str, Any], document: Any) -> bool:
    schema = (
        model_or_schema
        if isinstance(model_or_schema, dict)
        else model_or_schema.model_json_schema()
    )
    return _grammar_regex(schema_to_gbnf(schema)).fullmatch(json.dumps(document)) is not None


def test_the_grammar_lets_a_model_answer_with_an_empty_list():
    """Distillation's usual answer, no facts at all, and no contradiction verdicts are
    documents the grammar allows: a grammar demanding one item would make the model invent a
    fact."""
    assert _accepts(Distillation, {"facts": []})
    assert _accepts(ContradictionVerdicts, {"verdicts": []})
    fact = {"text": "likes tea", "salience": 7, "tags": []}
    assert _accepts(Distillation, {"facts": [fact, {**fact, "tags": ["food", "drink"]}]})
    verdict = {
        "salience_score": 6.5,
        "summary": "s",
        "category": "c",
        "tags": [],
        "save": True,
        "paradigm_shift": False,
    }
    assert _accepts(TriageVerdict, verdict)
    assert not _accepts(TriageVerdict, {**verdict, "save": "yes"})  # the matcher does refuse


def test_the_grammar_takes_every_type_a_type_list_names():
    """A schema's ``"type": ["string", "null"]`` allows both, not only the first."""
    schema = {"type": "object", "properties": {"note": {"type": ["string", "null"]}}}
    assert _accepts(schema, {"note": "x"})
    assert _accepts(schema, {"note": None})


class Node(BaseModel):
    """A recursive reply model: a tree of labels."""

    label: str
    children: list[Node] = []


def test_a_recursive_reply_model_gets_a_grammar():
    """A model that refers to itself gets a rule that refers to itself, not endless recursion."""
    grammar = schema_to_gbnf(Node.model_json_schema())
    tree = {"label": "a", "children": [{"label": "b", "children": []}]}
    assert _grammar_regex(grammar).fullmatch(json.dumps(tree))


# -- the strict json_schema form ---------------------------------------------------------------


def test_strict_schema_reaches_objects_inside_items_and_any_of():
    """Inline objects under ``items`` and ``anyOf`` are made strict too (every property
    required, no others, no defaults), as OpenAI's strict mode demands of every object."""

    def inline() -> dict[str, Any]:  # a new dict each time: deepcopy keeps shared ones shared
        return {"type": "object", "properties": {"a": {"type": "string", "default": "x"}}}

    schema = strict_schema(
        {
            "type": "object",
            "properties": {
                "list": {"type": "array", "items": inline()},
                "either": {"anyOf": [inline(), {"type": "null"}]},
            },
        }
    )
    for node in (schema["properties"]["list"]["items"], schema["properties"]["either"]["anyOf"][0]):
        assert node["additionalProperties"] is False
        assert node["required"] == ["a"]
        assert "default" not in node["properties"]["a"]


# -- the one-token probe -----------------------------------------------------------------------


@pytest.fixture
def backends() -> Iterator[Callable[[BackendConfig], Backend]]:
    made: list[Backend] = []

    def make(config: BackendConfig) -> Backend:
        made.append(Backend(config, RetryPolicy(), FakeClock()))
        return made[-1]

    yield make
    for b in made:
        b.clients.close()


LOGIN_PAGE = Reply(
    raw=b"<html><title>Sign in</title></html>", headers={"Content-Type": "text/html"}
)


def test_a_login_page_answering_200_is_not_a_served_probe(
    servers: Servers, make_client: MakeClient, backends: Callable[[BackendConfig], Backend]
):
    """A proxy's login page answers 200 but is no chat completion: the backend is down for the
    probe, so claiming does not resume on it."""
    srv = servers()
    srv.on(PROBE, lambda r: LOGIN_PAGE)
    srv.on("/v1/chat/completions", lambda r: LOGIN_PAGE)
    assert probe_answer(backends(backend(srv, "portal"))) is Probed.DOWN
    assert make_client(backend(srv, "portal"), attempts=1).probe() is False


def test_a_refused_minimal_request_ends_the_circuits_cooldown(
    servers: Servers, backends: Callable[[BackendConfig], Backend]
):
    """A backend refusing the minimal request is up (it answers): its open circuit's cool-down
    ends, so the next call reaches it at once instead of waiting two minutes."""
    srv = servers()
    srv.on(PROBE, lambda r: Reply.error(401, "bad key", type="authentication_error"))
    b = backends(backend(srv, "keyless"))
    for _ in range(3):
        b.breaker.record_failure("http_500")
    assert b.breaker.state is Circuit.OPEN
    assert b.breaker.retry_in() > 0
    assert minimal_answer(b) is Probed.REFUSED
    assert b.breaker.retry_in() == 0


PAGE = b"<html>Proxy Authentication Required</html>\n"
DENIED = (
    b"HTTP/1.1 407 Proxy Authentication Required\r\nProxy-Authenticate: Basic realm=corp\r\n"
    b"Content-Type: text/html\r\nContent-Length: %d\r\n\r\n" % len(PAGE) + PAGE
)


@pytest.fixture
def denying_proxy(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)

    def deny(conn: socket.socket) -> None:
        conn.sendall(DENIED)

    server = RawServer(deny)
    address = server.url.removeprefix("http://").removesuffix("/v1")
    monkeypatch.setenv("HTTP_PROXY", f"http://corp:pw@{address}")
    yield address
    server.close()


def test_a_probe_the_proxy_answers_407_is_refused_not_down(
    denying_proxy: str, backends: Callable[[BackendConfig], Backend]
):
    """The proxy's 407 to the probe is an answer (its credentials are wrong): refused, which is
    configuration, never down, which would be waited out as an outage."""
    config = BackendConfig(name="gpu", url="http://gpu.internal:8080/v1", model="m", timeout=2)
    assert probe_answer(backends(config)) is Probed.REFUSED


# -- check's backend lines ---------------------------------------------------------------------


def _check_line(srv: ScriptedLLM, model: str) -> Any:
    settings = Settings(llm_backends=[{"name": "x", "url": srv.url, "model": model}])  # type: ignore[list-item]
    (line,) = probe_backends(settings)
    return line


def test_a_forbidden_model_list_names_the_key(servers: Servers):
    """A 403 to ``GET /models`` is a key without the right, said as such."""
    srv = servers(chat=json_responder({"ok": True}))
    srv.on("/v1/models", lambda r: Reply.error(403, "forbidden"))
    line = _check_line(srv, "m")
    assert not line.ok
    assert line.detail == "refused (403): check api_key"


@pytest.mark.parametrize("listed", [["qwen:latest"], ["/models/gguf/qwen"], []])
def test_the_model_list_is_read_as_servers_write_it(servers: Servers, listed: list[str]):
    """Ollama's ``qwen:latest`` and llama.cpp's file path are model ``qwen``; an empty list
    decides nothing (the structured call does)."""
    srv = servers(chat=json_responder({"ok": True}), models=listed)
    line = _check_line(srv, "qwen")
    assert line.ok, line.detail


# -- clamping a strict bound -------------------------------------------------------------------


class Bounded(BaseModel):
    ratio: float = Field(gt=0.0, lt=1.0)


def test_a_strict_float_bound_clamps_to_the_nearest_value_inside():
    """``lt``/``gt`` exclude the bound: the value becomes the float next to it, inside."""
    value, clamped = parse_reply(Bounded, '{"ratio": 5}')
    assert 0.99 < value.ratio < 1.0
    value, clamped = parse_reply(Bounded, '{"ratio": -2.5}')
    assert 0.0 < value.ratio < 1e-300
    assert clamped == ["ratio"]


def test_a_reply_wrapped_in_a_list_is_its_object():
    """A reply that is a JSON list holding the object is cleaned to the object, as a reply
    that is not JSON is, rather than refused as valid JSON of the wrong shape."""
    value, _ = parse_reply(Bounded, '[{"ratio": 0.5}]')
    assert value.ratio == 0.5


# -- the pipelines' reply models ---------------------------------------------------------------


def test_tags_are_cut_to_five_and_null_is_none():
    """A verdict keeps at most five tags, tags and its category of at most 60 characters, and
    ``"tags": null`` means no tags, not a failed call."""
    base = {"salience_score": 5, "summary": "s"}
    long = TriageVerdict.model_validate({**base, "tags": ["x" * 70], "category": "W" * 70})
    assert (long.tags, long.category) == (["x" * 60], "w" * 60)
    many = TriageVerdict.model_validate({**base, "tags": [f"t{i}" for i in range(8)]})
    assert many.tags == ["t0", "t1", "t2", "t3", "t4"]
    assert TriageVerdict.model_validate({**base, "tags": None}).tags == []
    fact = Distillation.model_validate({"facts": [{"text": "x", "salience": 6, "tags": None}]})
    assert fact.facts[0].tags == []


def test_a_verdict_for_candidate_zero_contradicts_nothing():
    """Candidates are numbered from 1: a verdict for 0 (which would index the last memory)
    is ignored, as one past the count is."""
    verdicts = ContradictionVerdicts.model_validate(
        {"verdicts": [{"existing": 0, "contradicts": True}, {"existing": 3, "contradicts": True}]}
    )
    assert verdicts.contradicted(2) == []


# -- the proxy ---------------------------------------------------------------------------------


@pytest.fixture
def forward_proxy(monkeypatch: pytest.MonkeyPatch) -> Iterator[ForwardProxy]:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)

    def deny(conn: socket.socket) -> None:
        conn.sendall(DENIED)

    proxy = ForwardProxy(connect_answer=deny)
    yield proxy
    proxy.close()


def test_a_proxy_without_credentials_gets_no_authorization_and_ipv6_is_bracketed(
    forward_proxy: ForwardProxy, make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
):
    """A proxy URL without ``user:password@`` is sent no ``Proxy-Authorization``, and an IPv6
    backend is named ``[address]:port`` in ``CONNECT`` (RFC 9110's authority form)."""
    monkeypatch.setenv("HTTPS_PROXY", forward_proxy.url())
    config = BackendConfig(name="v6", url="https://[2001:db8::1]/v1", model="m", timeout=2)
    with pytest.raises(LLMBackendsMisconfigured):
        ask(make_client(config, attempts=1))
    seen = forward_proxy.seen[0]
    assert seen.request_line == "CONNECT [2001:db8::1]:443 HTTP/1.1"
    assert "proxy-authorization" not in seen.headers


def test_a_proxy_url_without_a_port_is_named_with_port_80(
    make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
):
    """The proxy named in an error has the port the connection used: 80 when its URL has none."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1")
    config = BackendConfig(name="cloud", url="https://api.example.com/v1", model="m", timeout=2)
    with pytest.raises(NoBackendReachable) as caught:
        ask(make_client(config, attempts=1))
    assert "the proxy http://127.0.0.1:80 (from HTTPS_PROXY)" in str(caught.value)


def test_a_redirect_answering_connect_names_the_proxys_answer(
    make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
):
    """A proxy answering ``CONNECT`` with a redirect opened no tunnel: the error says what the
    proxy answered, not a TLS failure of a handshake that went nowhere."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)

    def redirect(conn: socket.socket) -> None:
        conn.sendall(
            b"HTTP/1.1 302 Found\r\nLocation: http://login.corp/\r\nContent-Length: 0\r\n\r\n"
        )

    proxy = ForwardProxy(connect_answer=redirect)
    try:
        monkeypatch.setenv("HTTPS_PROXY", proxy.url())
        config = BackendConfig(name="cloud", url="https://api.example.com/v1", model="m", timeout=2)
        with pytest.raises(NoBackendReachable) as caught:
            ask(make_client(config, attempts=1))
    finally:
        proxy.close()
    assert "answered 302 Found to CONNECT api.example.com:443" in str(caught.value)


def test_requests_and_probes_ask_for_one_whole_reply(
    servers: Servers, backends: Callable[[BackendConfig], Backend]
):
    """Every request says ``"stream": false`` (a server defaulting to streaming would answer
    server-sent events, no completion); the plain probe asks one token at temperature 0."""
    srv = servers(chat=json_responder({"salience_score": 5, "summary": "s"}))
    b = backends(backend(srv, "one"))
    assert probe_answer(b) is Probed.SERVED
    assert probe_answer(b, TriageVerdict) is Probed.SERVED
    plain, structured = srv.bodies(PROBE)
    assert (plain["stream"], plain["max_tokens"], plain["temperature"]) == (False, 1, 0)
    assert (structured["stream"], structured["max_tokens"]) == (False, 1)
    assert "grammar" in structured or "response_format" in structured


@pytest.fixture
def tls_llm(servers: Servers, tmp_path: Path) -> tuple[ScriptedLLM, Path]:
    """A TLS scripted server whose certificate names ``llm.test``, and that certificate."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=llm.test", "-addext", "subjectAltName=DNS:llm.test",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return servers(chat=json_responder({"score": 1, "summary": "s"}), ssl_context=context), cert


def test_an_https_backend_is_reached_through_the_proxys_tunnel(
    tls_llm: tuple[ScriptedLLM, Path], make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
):
    """https through an http:// proxy: ``CONNECT`` with the proxy's credentials, answered
    ``200 Connection established``, then TLS to the backend (its name verified) and the call.
    Only the proxy knows where ``llm.test:443`` is: no direct connection could have served it."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    server, cert = tls_llm
    proxy = ForwardProxy(upstreams={"llm.test:443": server.port})
    try:
        monkeypatch.setenv("HTTPS_PROXY", proxy.url("corp:pw"))
        url = "https://llm.test/v1"
        config = BackendConfig(name="tls", url=url, model="m", timeout=5, ca_file=str(cert))
        client = make_client(config, attempts=1)
        assert ask(client).backend == "tls"
    finally:
        proxy.close()
    assert proxy.seen[0].request_line == "CONNECT llm.test:443 HTTP/1.1"
    assert proxy.seen[0].headers["proxy-authorization"] == "Basic Y29ycDpwdw=="  # corp:pw
    assert server.count() == 1


def test_a_plain_http_backend_is_reached_through_the_proxy(
    servers: Servers, make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
):
    """http through an http:// proxy: the chat call, its probe and an embeddings call are sent
    in absolute form with the proxy's credentials, and the proxy carries them to a backend only
    it knows (``llm-backend.test`` resolves nowhere, and port 80 is not the backend's)."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    server = servers(chat=json_responder({"score": 1, "summary": "s"}), embed_dim=4)
    proxy = ForwardProxy(upstreams={"llm-backend.test:80": server.port})
    embedder = HttpEmbedder("http://llm-backend.test/v1", "e", 4, timeout=5, sleep=lambda _: None)
    try:
        monkeypatch.setenv("http_proxy", proxy.url("corp:pw"))
        config = BackendConfig(name="far", url="http://llm-backend.test/v1", model="m", timeout=5)
        client = make_client(config, attempts=1)
        assert ask(client).backend == "far"
        assert client.probe() is True
        assert embedder.embed(["hello"]) == [pytest.approx(hash_embedding("hello", 4))]
    finally:
        embedder.close()
        proxy.close()
    lines = [seen.request_line for seen in proxy.seen]
    assert lines[0] == "POST http://llm-backend.test/v1/chat/completions HTTP/1.1"
    assert lines[-1] == "POST http://llm-backend.test/v1/embeddings HTTP/1.1"
    assert all(seen.headers["proxy-authorization"] == "Basic Y29ycDpwdw==" for seen in proxy.seen)
    assert len(server.requests) == len(lines) >= 3


def test_a_probe_answered_with_a_corrupt_gzip_body_is_down(
    backends: Callable[[BackendConfig], Backend],
):
    """A body that says gzip and is not (a DecodingError, no transport error) is no answer:
    the probe says down instead of raising into the caller."""
    body = b"not gzip at all"

    def answer(conn: socket.socket) -> None:
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\n"
            + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )

    server = RawServer(answer)
    try:
        config = BackendConfig(name="gz", url=server.url, model="m", timeout=2)
        assert probe_answer(backends(config)) is Probed.DOWN
    finally:
        server.close()


@pytest.mark.parametrize("listing", [["qwen"], {"data": ["qwen"]}, {"data": [None]}])
def test_a_model_list_of_another_shape_leaves_it_to_the_structured_call(
    servers: Servers, listing: Any
):
    """A ``/models`` answer that is JSON of another shape decides nothing: the structured call
    does, and ``check`` does not crash on it."""
    srv = servers(chat=json_responder({"ok": True}))
    srv.on("/v1/models", lambda r: Reply(json_body=listing))
    line = _check_line(srv, "qwen")
    assert line.ok, line.detail


def test_a_served_request_form_ends_the_circuits_cooldown(
    servers: Servers, backends: Callable[[BackendConfig], Backend]
):
    """A backend that serves the request's own form is up: its open circuit's cool-down ends,
    so the item's next call reaches it at once."""
    srv = servers()
    b = backends(backend(srv, "back"))
    for _ in range(3):
        b.breaker.record_failure("http_500")
    assert b.breaker.retry_in() > 0
    assert request_would_be_served(b, TriageVerdict) is True
    assert b.breaker.retry_in() == 0


@pytest.mark.parametrize("score", ["[7]", '{"v": 7}', "null"])
def test_a_score_of_the_wrong_type_is_an_invalid_reply(score: str):
    """A salience that is a list, an object or null is an invalid reply (fed back to the
    model), not an exception out of the clamping validator."""
    with pytest.raises(ReplyInvalid) as caught:
        parse_reply(TriageVerdict, f'{{"salience_score": {score}, "summary": "s"}}')
    assert "salience_score" in caught.value.feedback


# -- DEFECTS found while planting mutants ------------------------------------------------------


class Twins(BaseModel):
    """Two fields whose grammar rule names collide (``root-a-b``)."""

    a_b: list[int]
    a__b: list[str]


# Found by the mutation review (fixed): gbnf._rule_name maps distinct property paths to one
# rule name (runs of any other character become one "-", upper case is lowered), and the
# second rule replaced the first: "a_b" was constrained to a list of strings, so in grammar
# mode the model could not write any valid answer. Rule names are now made unique.
def test_fields_whose_rule_names_collide_keep_their_own_grammar():
    """Each field keeps its own rule: a valid answer is one the grammar allows."""
    assert _accepts(Twins, {"a_b": [1], "a__b": ["x"]})


class Counted(BaseModel):
    count: int = Field(lt=3)


# Found by the mutation review (fixed): reply._clamp steps a strict integer bound down by one
# only when the reply's value is an int; a whole number written as a float (5.0, which
# pydantic takes for an int field) was clamped to 2.9999999999999996, which the int field then
# refused as fractional: an out-of-range number became a failed call (contract section 5).
def test_a_whole_float_over_a_strict_integer_bound_is_clamped():
    """``5.0`` for an integer field with ``lt=3`` clamps to 2, as ``5`` does; a float field
    under the same bound still gets the nearest float inside it."""
    value, clamped = parse_reply(Counted, '{"count": 5.0}')
    assert (value.count, clamped) == (2, ["count"])
    low, clamped = parse_reply(Counted, '{"count": -7.0}')
    assert (low.count, clamped) == (-7, [])
    ratio, clamped = parse_reply(Ratio, '{"share": 5.0}')
    assert (ratio.share, clamped) == (math.nextafter(3.0, -math.inf), ["share"])
    floor, _ = parse_reply(Floored, '{"count": -5.0}')
    assert floor.count == 0


class Ratio(BaseModel):
    share: float = Field(lt=3)


class Floored(BaseModel):
    count: int = Field(gt=-1)
