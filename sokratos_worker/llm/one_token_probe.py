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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import BaseModel

from sokratos_worker.llm.backend import Backend
from sokratos_worker.llm.completion import completion
from sokratos_worker.llm.http import (
    ProxyAuthenticationRequired,
    Verdict,
    classify,
    excerpt,
    request_timeout,
)
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
    generating on a healthy server or hanging on a dead one. It only ever means "could not
    ask": a half-open trial records nothing (the calls in flight decide when they end),
    ``probe()`` counts the backend as not answered, and a failed call takes that backend for
    one it could not ask (the rule for a failed call: ``FallbackChatClient._judge`` in
    :mod:`.chat`).
    """

    SERVED = "served"
    REFUSED = "refused"  # a permanent answer (3xx, 4xx): the server is up
    DOWN = "down"  # no answer, a transient one, or not a chat completion
    BUSY = "busy"  # not sent: every slot stayed taken by this process's calls to it

    @property
    def answered(self) -> bool:
        """The server answered it (served or refused): it is up."""
        return self in (Probed.SERVED, Probed.REFUSED)

    @property
    def unserved(self) -> bool:
        """It was sent and not served (BUSY was not sent: no evidence)."""
        return self in (Probed.REFUSED, Probed.DOWN)


@dataclass(frozen=True)
class Split:
    """The backends a probe served, could not be sent to (busy) and did not serve."""

    served: list[str]
    busy: list[str]
    unserved: list[str]


def split(answers: Mapping[str, Probed]) -> Split:
    """``answers`` (backend name: its probe's answer) split three ways, in their order."""
    return Split(
        served=[name for name, a in answers.items() if a is Probed.SERVED],
        busy=[name for name, a in answers.items() if a is Probed.BUSY],
        unserved=[name for name, a in answers.items() if a.unserved],
    )


def heard(backend: Backend, result: Probed, *, closes: bool = False) -> None:
    """The breaker's side of a probe's answer: served closes the circuit when ``closes`` (the
    pause's probe: the resumed items must all reach it), else it and a refusal end an open
    circuit's cool-down (it answers: the next call may reach it); down and busy record
    nothing, as a call's own failure is recorded where it failed."""
    if result is Probed.SERVED and closes:
        backend.breaker.record_success()
    elif result.answered:
        backend.breaker.allow_probe_now()


def request_would_be_served(backend: Backend, response_model: type[BaseModel]) -> bool:
    """The one-token probe in ``response_model``'s structured-output form: a refusal of the
    form itself (OpenRouter's 404 for unsupported parameters) is then every item's."""
    result = probe_answer(backend, response_model)
    heard(backend, result)
    return result is Probed.SERVED


def minimal_answer(backend: Backend) -> Probed:
    """The minimal request in ``backend``'s structured-output form (see :data:`MinimalRequest`)."""
    result = probe_answer(backend, _Probe)
    heard(backend, result)
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
            backend.chat_url, json=body, timeout=request_timeout(backend.probe_timeout)
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
    "Split",
    "heard",
    "minimal_answer",
    "probe_answer",
    "probe_one",
    "request_would_be_served",
    "split",
]
