"""A backend that answers 5xx to every request in its structured-output form while serving a
plain one (llama-cpp-python with ``structured_output: json_schema``, docs/backends.md) is
misconfigured, not down: the item is given back and claiming stays paused until the form is
served. Taken for an outage, the plain probe resumed claiming at once, the item was given back
again, and the worker looped for ever without using an attempt (durability.md: "must not loop
forever").
"""

from __future__ import annotations

import time
from collections.abc import Callable

import psycopg
import pytest
from pydantic import BaseModel
from structlog.testing import capture_logs

from sokratos_worker.config import load_settings
from sokratos_worker.errors import BackendsUnavailable
from sokratos_worker.handlers import HandlerContext
from sokratos_worker.llm import build_chat_client
from sokratos_worker.llm.chat import FallbackChatClient
from sokratos_worker.llm.types import (
    LLMBackendsMisconfigured,
    NoBackendReachable,
    RequestRefused,
)
from sokratos_worker.pipelines import build_handlers
from sokratos_worker.runner import Runner
from sokratos_worker.store.connection import Database
from sokratos_worker.testing.scripted_llm import PROBE, Reply, Request, ScriptedLLM
from tests.faults.support import answer, backends_env, enqueue_triage, exchange
from tests.llm.conftest import ask, backend, schema_name, scripted


def _fails_the_form(
    state: dict[str, bool], *, hangs: bool = False
) -> Callable[[Request], Reply]:
    """500 to any request with a response_format until ``state["fixed"]`` (or no answer within
    3 s, with ``hangs``: a grammar the server cannot build in time); plain ones served."""

    def respond(request: Request) -> Reply:
        body = request.body if isinstance(request.body, dict) else {}
        if "response_format" in body and not state["fixed"]:
            if hangs:
                return Reply.hang(3)
            return Reply.error(500, "json_schema is not supported", type="server_error")
        if "response_format" not in body:
            return Reply.chat("OK", completion_tokens=1)
        return answer(request)

    return respond


def test_the_call_names_structured_output_and_the_probe_waits_for_the_form(
    servers: Callable[..., ScriptedLLM], make_client: Callable[..., FallbackChatClient]
) -> None:
    state = {"fixed": False}
    client = make_client(backend(scripted(servers, _fails_the_form(state)), "brain"), attempts=2)

    with pytest.raises(LLMBackendsMisconfigured) as failure:
        ask(client)
    assert "structured_output" in str(failure.value) and "brain" in str(failure.value)
    assert client.probe() is False  # a plain request is served; the form still is not
    state["fixed"] = True
    assert client.probe() is True


def test_a_backend_that_is_down_is_still_an_outage(
    servers: Callable[..., ScriptedLLM], make_client: Callable[..., FallbackChatClient]
) -> None:
    """503 to everything, the plain probe too: an outage (given back), not misconfigured."""
    down = scripted(servers, lambda _r: Reply.error(503, "Loading model"))
    client = make_client(backend(down, "brain"), attempts=2)
    with pytest.raises(NoBackendReachable) as failure:
        ask(client)
    assert not isinstance(failure.value, LLMBackendsMisconfigured)


def test_a_form_that_times_out_while_plain_is_served_pauses_until_the_form_is_served(
    servers: Callable[..., ScriptedLLM], make_client: Callable[..., FallbackChatClient]
) -> None:
    """No 5xx: every request in the form times out. Only an http_5 reason was looked at, so it
    was an outage, the plain probe resumed claiming at once and the item was given back again,
    without an attempt, for ever (review)."""
    state = {"fixed": False}
    responder = _fails_the_form(state, hangs=True)
    client = make_client(
        backend(scripted(servers, responder), "brain", timeout=0.5), attempts=1, probe_timeout=0.5
    )
    with pytest.raises(LLMBackendsMisconfigured) as failure:
        ask(client)
    assert "structured_output" in str(failure.value) and "brain" in str(failure.value)
    assert client.probe() is False  # a plain request is served; the minimal form is not
    state["fixed"] = True
    assert client.probe() is True


class _Fact(BaseModel):
    text: str


class _Distilled(BaseModel):
    """Nested: its schema has $defs, which llama-cpp-python's converter may not take."""

    facts: list[_Fact]


def _fails_nested_schemas(request: Request) -> Reply:
    """500 to a schema with $defs; plain requests, the minimal form and flat schemas served."""
    body = request.body if isinstance(request.body, dict) else {}
    response_format = body.get("response_format") or {}
    schema = response_format.get("json_schema", {}).get("schema", {})
    if "$defs" in schema:
        return Reply.error(500, "Unsupported schema construct: $ref", type="server_error")
    if not response_format:
        return Reply.chat("OK", completion_tokens=1)
    if schema_name(request) == "Scored":
        return Reply.chat({"score": 0.5, "summary": "fine"})
    return Reply.chat({"ok": True})


def test_one_schema_a_backend_fails_with_5xx_uses_the_attempt_and_pauses_nothing(
    servers: Callable[..., ScriptedLLM], make_client: Callable[..., FallbackChatClient]
) -> None:
    """A 500 to ONE request type's schema while the minimal request in the same form is
    served is that request's failure (durability.md: a 5xx whose probe right after succeeds
    is the item's problem). Named structured_output, claiming paused for every queue for
    good, though other request types were served (review)."""
    client = make_client(backend(scripted(servers, _fails_nested_schemas), "brain"), attempts=2)
    with pytest.raises(RequestRefused) as failure:
        client.complete(
            response_model=_Distilled, system="s", user="u", max_tokens=64, purpose="distill"
        )
    assert not isinstance(failure.value, BackendsUnavailable)  # (nor BackendsMisconfigured)
    assert "schema" in str(failure.value) and "brain" in str(failure.value)
    assert client.probe() is True  # claiming goes on
    assert ask(client).backend == "brain"  # and a flat request type is served


@pytest.mark.postgres
@pytest.mark.timeout(120)
@pytest.mark.parametrize("hangs", [False, True], ids=["http_500", "timeout"])
def test_the_worker_pauses_instead_of_looping_then_saves_the_item_once_fixed(
    db: psycopg.Connection, database_url: str, hangs: bool
) -> None:
    state = {"fixed": False}
    key = enqueue_triage(db, exchange("tokform1", save=True))
    with ScriptedLLM(chat=_fails_the_form(state, hangs=hangs)) as server:
        server.on(PROBE, _fails_the_form(state, hangs=hangs))
        settings = load_settings(
            {
                "SOKRATOS_DATABASE_URL": database_url,
                "SOKRATOS_CONCURRENCY": "1",
                "SOKRATOS_RETRY_BASE": "10ms",
                "SOKRATOS_RETRY_MAX": "20ms",
                "SOKRATOS_LLM_BACKENDS": backends_env(server, timeout=1 if hangs else 5),
            }
        )
        database = Database(database_url, size=4)
        try:
            context = HandlerContext(settings, database, build_chat_client(settings), None)
            runner = Runner(
                settings=settings,
                database=database,
                handlers=build_handlers(context),
                worker_id="form",
            )
            with capture_logs() as logs:
                runner.start()
                # Before the fix: six or more give-backs by now (a 500), or two (a timeout).
                time.sleep(14 if hangs else 8)
                given_back = [e for e in logs if e["event"] == "attempt_given_back"]
                resumed = [e for e in logs if e["event"] == "claiming_resumed"]
                state["fixed"] = True
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and not db.execute(
                    "SELECT 1 FROM work_outcomes WHERE item_id = %s", (key[1],)
                ).fetchone():
                    time.sleep(0.2)
                runner.shutdown(5)
        finally:
            database.close()
    assert len(given_back) == 1 and resumed == [], (len(given_back), len(resumed))
    row = db.execute(
        "SELECT outcome, attempts FROM work_outcomes WHERE item_id = %s", (key[1],)
    ).fetchone()
    assert row == ("saved", 1), row  # the give-back used no attempt


def test_a_burst_of_5xx_that_ends_meanwhile_is_an_outage_not_structured_output(
    servers: Callable[..., ScriptedLLM], make_client: Callable[..., FallbackChatClient]
) -> None:
    """503s to the call and to the probe in its form, then served (the burst is over by the
    plain probe): given back as an outage, not named a structured_output problem (review)."""
    answers = {"n": 0}

    def burst(request: Request) -> Reply:
        answers["n"] += 1
        if answers["n"] <= 3:  # the call (2 HTTP attempts) and the probe in its form
            return Reply.error(503, "server busy", type="server_error")
        body = request.body if isinstance(request.body, dict) else {}
        return answer(request) if "response_format" in body else Reply.chat("OK")

    client = make_client(backend(scripted(servers, burst), "brain"), attempts=2)
    with pytest.raises(NoBackendReachable) as failure:
        ask(client)
    assert not isinstance(failure.value, LLMBackendsMisconfigured), failure.value
    assert client.probe() is True
