"""The one-token chat probe: is a backend serving chat completions right now?

The fallback client asks it for a circuit's half-open trial, for its own ``probe()``, and after
every backend failed a request, to tell an outage or a misconfiguration from a refusal of the
request itself: in plain form, in the refused request's structured-output form, or as the
minimal structured request (:data:`MinimalRequest`). It answers :class:`Probed`: served,
refused (the server is up), down, or busy (not sent: no evidence either way). Only a real chat
completion counts as served.
"""

from __future__ import annotations

import enum
from typing import Any

import httpx
from pydantic import BaseModel

from sokratos_worker.llm.backend import Backend
from sokratos_worker.llm.completion import completion
from sokratos_worker.llm.http import ProxyAuthenticationRequired, Verdict, classify, excerpt
from sokratos_worker.llm.request_body import request_body

# The health probe's whole conversation: a server that cannot answer this is down for us, even
# when its HTTP side (``/models``, ``/health``) still answers.
PROBE_MESSAGE = "sokratos-worker health probe: reply with OK"


class _Probe(BaseModel):
    """The minimal request type: a backend that refuses even this in its structured-output
    form refuses requests in general (configuration), not one request type."""

    ok: bool


# Public under this name; the class keeps its own, which json_schema mode sends as the schema's.
MinimalRequest = _Probe


class Probed(enum.Enum):
    """What a one-token probe got.

    BUSY is never evidence either way: the probe was not sent, as every slot of the backend
    stayed taken by this process's own calls for the whole wait, and those calls may be
    generating on a healthy server or hanging on a dead one. Every caller decides as if that
    probe had not been made: a half-open trial records nothing (the calls in flight decide
    when they end), ``probe()`` counts the backend as not answered, and a failed call's
    verdict rests on the probes that did get an answer.
    """

    SERVED = "served"
    REFUSED = "refused"  # a permanent answer (3xx, 4xx): the server is up
    DOWN = "down"  # no answer, a transient one, or not a chat completion
    BUSY = "busy"  # not sent: every slot stayed taken by this process's calls to it


def request_would_be_served(backend: Backend, response_model: type[BaseModel]) -> bool:
    """The one-token probe in ``response_model``'s structured-output form: a refusal of the
    form itself (OpenRouter's 404 for unsupported parameters) is then every item's."""
    if not probe_one(backend, response_model):
        return False
    backend.breaker.allow_probe_now()
    return True


def minimal_answer(backend: Backend) -> Probed:
    """The minimal request in ``backend``'s structured-output form (see :data:`MinimalRequest`)."""
    result = probe_answer(backend, _Probe)
    if result in (Probed.SERVED, Probed.REFUSED):  # it answered: the next call may reach it
        backend.breaker.allow_probe_now()
    return result


def probe_one(backend: Backend, response_model: type[BaseModel] | None = None) -> bool:
    return probe_answer(backend, response_model) is Probed.SERVED


def probe_answer(
    backend: Backend,
    response_model: type[BaseModel] | None = None,
    *,
    slot_wait: float | None = None,
) -> Probed:
    """The one-token probe (in ``response_model``'s structured-output form): served,
    refused (a permanent answer: the server is up) or down. It waits for a free slot up to
    ``slot_wait`` (default: the backend's timeout, as a call does)."""
    messages = [{"role": "user", "content": PROBE_MESSAGE}]
    body: dict[str, Any] = (
        request_body(backend.config, response_model, messages, 1)
        if response_model is not None
        else {
            "model": backend.config.model,
            "messages": messages,
            "max_tokens": 1,
            "temperature": 0,
            "stream": False,
        }
    )
    # A slot, as a call takes: a single-slot server (llama.cpp -np 1) busy with an item's
    # generation would queue the probe behind it, and the probe's timeout judge it down.
    wait = backend.config.timeout if slot_wait is None else slot_wait
    if not backend.slots.acquire(timeout=wait):
        return Probed.BUSY  # every slot stayed taken for the whole wait, as a call's would
    try:
        response = backend.clients.get().post(
            backend.chat_url, json=body, timeout=backend.probe_timeout
        )
    except ProxyAuthenticationRequired:
        return Probed.REFUSED
    except httpx.HTTPError:
        return Probed.DOWN
    finally:
        backend.slots.release()
    status = response.status_code
    verdict = classify(status, excerpt(response) if status >= 300 else "")
    if verdict is Verdict.OK:
        # A proxy's login page answers 200 too: only a chat completion counts as up.
        return Probed.SERVED if completion(response)[1] is None else Probed.DOWN
    return Probed.DOWN if verdict is Verdict.TRANSIENT else Probed.REFUSED


__all__ = [
    "PROBE_MESSAGE",
    "MinimalRequest",
    "Probed",
    "minimal_answer",
    "probe_answer",
    "probe_one",
    "request_would_be_served",
]
