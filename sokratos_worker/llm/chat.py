"""The chat client: OpenAI-compatible backends in fallback order.

Per backend, one bounded tenacity loop retries transient errors (connect/read errors, 408,
429 with Retry-After, 5xx); permanent answers move on to the next backend at once; a
circuit breaker skips a backend that keeps failing; a semaphore caps its concurrency
(llama.cpp never answers 429, it queues). Replies are cleaned and validated; one repair
retry on the same backend feeds the validation error back. See docs/backends.md.
"""

from __future__ import annotations

import copy
import enum
import functools
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import structlog
from pydantic import BaseModel
from tenacity import RetryCallState, Retrying, retry_if_exception_type

from sokratos_worker.config import BackendConfig, without_credentials
from sokratos_worker.llm.breaker import Admission, CircuitBreaker
from sokratos_worker.llm.gbnf import schema_to_gbnf
from sokratos_worker.llm.http import (
    ClientPerThread,
    ProxyAuthenticationRequired,
    Verdict,
    classify,
    describe_connection_error,
    excerpt,
    make_client,
    retry_after_seconds,
    tls_verification,
)
from sokratos_worker.llm.reply import ReplyInvalid, parse_reply
from sokratos_worker.llm.types import (
    BackendAttempt,
    BackendState,
    ChatFailed,
    ChatResult,
    ContextTooLong,
    LLMBackendsBusy,
    LLMBackendsMisconfigured,
    NoBackendReachable,
    RequestRefused,
    T,
)
from sokratos_worker.logs import mask_secrets, maskable, url_password

log = structlog.get_logger(__name__)

REPAIR_PROMPT = (
    "Your previous reply was not valid: {error}. "
    "Reply again with only one JSON object that matches the schema."
)
TRUNCATED_PROMPT = (
    "Your previous reply was cut off at the {max_tokens}-token limit before the JSON object "
    "was complete. Reply again with one shorter JSON object that matches the schema: "
    "fewer and shorter entries."
)
# The health probe's whole conversation: a server that cannot answer this is down for us, even
# when its HTTP side (``/models``, ``/health``) still answers.
PROBE_MESSAGE = "sokratos-worker health probe: reply with OK"
# The reason of a request the environment's proxy refused (407): its credentials to fix.
PROXY_REFUSED = "proxy_auth_required"


class _Probe(BaseModel):
    """The minimal request type: a backend that refuses even this in its structured-output
    form refuses requests in general (configuration), not one request type."""

    ok: bool


@dataclass(frozen=True)
class RetryPolicy:
    """Bounds of the per-backend retry loop, the breaker and the health probe."""

    attempts: int = 3  # HTTP attempts per backend for transient errors
    backoff_base: float = 0.5
    backoff_max: float = 8.0
    retry_after_max: float = 30.0  # a longer Retry-After moves on to the next backend now
    probe_timeout: float = 15.0  # the health probe's deadline (also the half-open trial)
    breaker_threshold: int = 3
    breaker_cooldown: float = 120.0
    breaker_max_cooldown: float = 600.0


class _Transient(Exception):
    def __init__(self, reason: str, status: int | None = None, retry_after: float | None = None):
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.retry_after = retry_after


class _Permanent(Exception):
    def __init__(self, verdict: Verdict, reason: str, status: int) -> None:
        super().__init__(reason)
        self.verdict = verdict
        self.reason = reason
        self.status = status


class _Probed(enum.Enum):
    """What a one-token probe got."""

    SERVED = "served"
    REFUSED = "refused"  # a permanent answer (3xx, 4xx): the server is up
    DOWN = "down"  # no answer, a transient one, or not a chat completion


@dataclass(frozen=True)
class _ProbeForm:
    """The form probe() asks in after an item was given back with a backend refusing it."""

    model: type[BaseModel]
    when_all_answer: bool  # claiming also resumes once every backend answers it (refused too)
    # Only these backends serving it resumes claiming (empty: any backend): the ones that
    # refused the minimal request while another served it, as the item would be given back
    # again for as long as they refuse it.
    awaited: frozenset[str] = frozenset()


class _Busy(Exception):
    """Every concurrency slot of the backend stayed taken for a whole timeout."""


@dataclass(frozen=True)
class _Answer:
    content: str
    prompt_tokens: int | None
    completion_tokens: int | None
    truncated: bool = False  # finish_reason "length": the reply hit max_tokens


class _Backend:
    """One configured backend with its HTTP client, slots and circuit."""

    def __init__(
        self, config: BackendConfig, policy: RetryPolicy, clock: Callable[[], float]
    ) -> None:
        self.config = config
        self.name = config.name
        # Parsed once: httpx parses a string URL on every request (half of build_request).
        self.chat_url = httpx.URL(f"{config.url}/chat/completions")
        key = config.api_key.get_secret_value() if config.api_key else None
        # What a server may echo back (LiteLLM: "Received=<key>") and no reason may repeat.
        self.secrets = tuple(maskable([key], [url_password(config.url)]))
        self.clients = ClientPerThread(
            functools.partial(
                make_client,
                name=config.name,
                timeout=config.timeout,
                api_key=key,
                verify=tls_verification(
                    name=config.name, ca_file=config.ca_file, tls_verify=config.tls_verify
                ),
            )
        )
        self.slots = threading.BoundedSemaphore(config.max_concurrency)
        self.probe_timeout = min(config.timeout, policy.probe_timeout)
        self.breaker = CircuitBreaker(
            config.name,
            threshold=policy.breaker_threshold,
            cooldown=policy.breaker_cooldown,
            max_cooldown=policy.breaker_max_cooldown,
            probe_deadline=self.probe_timeout + 5.0,
            clock=clock,
        )


def strict_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """OpenAI strict form: every property required, no additional properties, no defaults."""
    result = copy.deepcopy(schema)
    _make_strict(result)
    return result


def _make_strict(node: Any) -> None:
    """Walk schema nodes only, so a property named ``default`` is left alone."""
    if not isinstance(node, dict):
        return
    node.pop("default", None)
    if node.get("type") == "object" and "properties" in node:
        node["additionalProperties"] = False
        node["required"] = list(node["properties"])
    for key in ("properties", "$defs"):
        for child in node.get(key, {}).values():
            _make_strict(child)
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        for child in node.get(key, []):
            _make_strict(child)
    _make_strict(node.get("items"))


def request_body(
    config: BackendConfig,
    response_model: type[BaseModel],
    messages: list[dict[str, str]],
    max_tokens: int,
) -> dict[str, Any]:
    """The chat-completions body in the structured-output form the backend understands."""
    body: dict[str, Any] = {
        "model": config.model,
        "messages": messages,
        "temperature": config.temperature,  # Ollama defaults to 1.0 when it is omitted
        "max_tokens": max_tokens,
        "stream": False,
    }
    body.update(_structured_output(response_model, config.structured_output))
    return body


@functools.cache
def _structured_output(response_model: type[BaseModel], mode: str) -> dict[str, Any]:
    """The body's structured-output part, built once per response model and mode: generating
    a model's JSON schema cost more worker CPU per call than the settle (bench/README.md).
    Callers only serialise the result, never change it."""
    schema = response_model.model_json_schema()
    if mode == "json_schema":
        # The nested form: llama.cpp silently ignores the flat one.
        return {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": response_model.__name__,
                    "schema": strict_schema(schema),
                    "strict": True,
                },
            }
        }
    if mode == "json_object":
        return {"response_format": {"type": "json_object", "schema": schema}}
    return {"grammar": schema_to_gbnf(schema)}


class FallbackChatClient:
    """:class:`~sokratos_worker.llm.types.ChatClient` over HTTP; thread-safe and synchronous."""

    def __init__(
        self,
        backends: Sequence[BackendConfig],
        *,
        policy: RetryPolicy | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        if not backends:
            raise ValueError("FallbackChatClient needs at least one backend")
        self.policy = policy or RetryPolicy()
        self._sleep = sleep
        self._random = rng or random.Random()  # noqa: S311 - jitter, not cryptography
        self._backends = [_Backend(b, self.policy, clock) for b in backends]
        # Set when an item was given back and a backend it reached had refused it: the form
        # probe() then asks in, as a plain probe would pass and resume claiming only for the
        # item to be given back again. The minimal request's (every backend refused the
        # request and some refused even that: a mode or parameter it does not take, a key;
        # claiming resumes when one of those serves it), or the refused request's own (a
        # backend was down or skipped: claiming resumes when a backend serves that form, or
        # once every backend answers it, served or refused, as the item's next call then
        # decides). Cleared by any answer.
        self._probe_form: _ProbeForm | None = None

    @property
    def backend_names(self) -> list[str]:
        """The backends in fallback order."""
        return [b.name for b in self._backends]

    def breaker(self, name: str) -> CircuitBreaker:
        """The named backend's circuit breaker (for status and tests)."""
        return self._backend(name).breaker

    def close(self) -> None:
        """Close every HTTP client."""
        for backend in self._backends:
            backend.clients.close()

    # -- ChatClient ------------------------------------------------------------------------

    def complete(
        self,
        *,
        response_model: type[T],
        system: str,
        user: str,
        max_tokens: int,
        purpose: str,
    ) -> ChatResult[T]:
        """A validated reply from the first backend that gives one (see the protocol)."""
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        tried: list[BackendAttempt] = []
        kinds: list[str] = []
        for backend in self._backends:
            reason = self._skip_reason(backend)
            if reason:
                tried.append(BackendAttempt(backend.name, "skipped", reason))
                kinds.append("skipped")
                log.info("llm_backend_skipped", backend=backend.name, reason=reason)
                continue
            started = time.perf_counter()
            try:
                value, answer = self._ask(backend, response_model, messages, max_tokens, purpose)
            except _Busy:
                kinds.append("busy")
                tried.append(self._attempt(backend, "skipped", _busy_reason(backend), started))
                log.info(
                    "llm_backend_skipped",
                    backend=backend.name,
                    reason="busy",
                    slots=backend.config.max_concurrency,
                    waited_s=backend.config.timeout,
                )
                continue
            except _Transient as exc:
                backend.breaker.record_failure(exc.reason)
                kinds.append("unreachable")
                tried.append(self._attempt(backend, "failed", exc.reason, started))
                continue
            except _Permanent as exc:
                backend.breaker.record_success()  # it answered: the server itself is fine
                if exc.verdict is Verdict.CONTEXT:
                    tried.append(self._attempt(backend, "failed", exc.reason, started))
                    # Never send the same oversize request to every backend: shorten first.
                    raise ContextTooLong(
                        f"{backend.name}: input exceeds the model's context",
                        backend=backend.name,
                        tried=tuple(tried),
                    ) from None
                kinds.append("refused" if exc.verdict is Verdict.REFUSED else "rejected")
                tried.append(self._attempt(backend, "failed", exc.reason, started))
                continue
            except ReplyInvalid as exc:
                backend.breaker.record_success()
                kinds.append("invalid")
                tried.append(self._attempt(backend, "failed", f"invalid_reply: {exc}", started))
                continue
            backend.breaker.record_success()
            self._probe_form = None
            tried.append(self._attempt(backend, "answered", "", started))
            return ChatResult(
                value=value,
                backend=backend.name,
                tried=tuple(tried),
                prompt_tokens=answer.prompt_tokens,
                completion_tokens=answer.completion_tokens,
            )
        raise self._failure(tuple(tried), kinds, purpose, response_model)

    def _skip_reason(self, backend: _Backend) -> str:
        """Why this call skips ``backend`` (its circuit), or an empty string to go ahead."""
        admission = backend.breaker.admit()
        if admission is Admission.CALL:
            return ""
        if admission is Admission.SKIP:
            return "circuit_open"
        # The half-open trial is the one-token probe, not the item's request: the request then
        # keeps the backend's own timeout, so a slow CPU backend can close its circuit again.
        if self._probe_one(backend):
            backend.breaker.record_success()
            return ""
        backend.breaker.record_failure("half-open probe failed", trial=True)
        return "circuit_open: half-open probe failed"

    def probe(self) -> bool:
        """True when a backend answers a one-token chat request now; ends its circuit's wait.

        A chat request, not ``GET /models``: a server whose completions all fail (a model that
        crashed, a GPU out of memory) still lists its models, and would make every item look
        like the one that broke it.
        """
        form = self._probe_form
        healthy = False
        answered = True  # every backend answered (served or refused) the form asked
        for backend in self._backends:
            result = self._probe_answer(backend, form.model if form is not None else None)
            if result is not _Probed.DOWN:
                backend.breaker.allow_probe_now()  # it answers: the next call may reach it
            if result is _Probed.SERVED:
                # With backends awaited (they refused the minimal request another served), only
                # one of them serving it changes the item's next call: another backend serving
                # it already did when the item was given back.
                if form is None or not form.awaited or backend.name in form.awaited:
                    healthy = True
            elif result is _Probed.DOWN:
                answered = False
        # A backend was down when the item was given back, another refused its form: once every
        # backend answers, the item's next call is decided (served, or refused everywhere and
        # judged by the minimal request), so claiming resumes and cannot loop for ever.
        return healthy or (form is not None and form.when_all_answer and answered)

    def states(self) -> list[BackendState]:
        """Every backend's circuit, with what ``status`` shows about it."""
        return [
            BackendState(
                name=b.name,
                circuit=str(b.breaker.state),
                detail={
                    "consecutive_failures": b.breaker.consecutive_failures,
                    "cooldown_s": b.breaker.cooldown,
                    "retry_in_s": round(b.breaker.retry_in(), 1),
                    "last_error": b.breaker.last_error,
                    "max_concurrency": b.config.max_concurrency,
                },
            )
            for b in self._backends
        ]

    # -- one backend -----------------------------------------------------------------------

    def _ask(
        self,
        backend: _Backend,
        response_model: type[T],
        messages: list[dict[str, str]],
        max_tokens: int,
        purpose: str,
    ) -> tuple[T, _Answer]:
        """Ask, validate, and once more with the validation error if the reply is invalid."""
        body = request_body(backend.config, response_model, messages, max_tokens)
        answer = self._post(backend, body, purpose)
        try:
            return self._parse(backend, response_model, answer, purpose)
        except ReplyInvalid as exc:
            if answer.truncated:
                # Pointing at a syntax error would not help: the model ran out of room.
                log.warning(
                    "llm_reply_truncated",
                    backend=backend.name,
                    purpose=purpose,
                    max_tokens=max_tokens,
                    hint="the JSON was cut off at max_tokens; asking once for a shorter reply",
                )
                feedback = TRUNCATED_PROMPT.format(max_tokens=max_tokens)
            else:
                log.warning("llm_reply_invalid", backend=backend.name, purpose=purpose, repair=True)
                feedback = REPAIR_PROMPT.format(error=exc.feedback)
            repair = [
                *messages,
                {"role": "assistant", "content": _echoed(answer.content, max_tokens)},
                {"role": "user", "content": feedback},
            ]
            body = request_body(backend.config, response_model, repair, max_tokens)
            second = self._post(backend, body, purpose)
            try:
                value, _ = self._parse(backend, response_model, second, purpose)
            except ReplyInvalid:
                log.warning(
                    "llm_reply_invalid", backend=backend.name, purpose=purpose, repair=False
                )
                raise
            return value, _Answer(
                second.content,
                _add(answer.prompt_tokens, second.prompt_tokens),
                _add(answer.completion_tokens, second.completion_tokens),
            )

    def _parse(
        self, backend: _Backend, response_model: type[T], answer: _Answer, purpose: str
    ) -> tuple[T, _Answer]:
        value, clamped = parse_reply(response_model, answer.content)
        if clamped:
            log.warning("llm_value_clamped", backend=backend.name, purpose=purpose, fields=clamped)
        return value, answer

    def _post(self, backend: _Backend, body: dict[str, Any], purpose: str) -> _Answer:
        """POST with the bounded retry loop, each attempt with the backend's timeout."""
        retrying = Retrying(
            stop=self._stop(self.policy.attempts),
            wait=self._wait,
            retry=retry_if_exception_type(_Transient),
            sleep=self._sleep,
            reraise=True,
        )
        answer: _Answer | None = None
        for attempt in retrying:
            with attempt:
                number = attempt.retry_state.attempt_number
                answer = self._post_once(backend, body, purpose, number)
        assert answer is not None  # noqa: S101 - reraise=True: the loop either returns or raises
        return answer

    def _post_once(
        self, backend: _Backend, body: dict[str, Any], purpose: str, attempt: int
    ) -> _Answer:
        if not backend.slots.acquire(timeout=backend.config.timeout):
            raise _Busy
        started = time.perf_counter()
        try:
            response = backend.clients.get().post(
                backend.chat_url, json=body, timeout=backend.config.timeout
            )
        except httpx.TimeoutException as exc:
            reason = "timeout"
            if isinstance(exc, httpx.ConnectTimeout):  # which host: the server or a proxy
                reason += f": {describe_connection_error(exc)}"
            self._log_failed(backend, attempt, started, purpose, reason=reason, status=None)
            raise _Transient(reason) from exc
        except ProxyAuthenticationRequired as exc:  # every request through it: configuration
            reason = f"{PROXY_REFUSED}: {exc}"
            self._log_failed(backend, attempt, started, purpose, reason=reason, status=407)
            raise _Permanent(Verdict.REFUSED, reason, 407) from exc
        except httpx.HTTPError as exc:
            reason = f"connection_error: {describe_connection_error(exc)}"
            self._log_failed(backend, attempt, started, purpose, reason=reason, status=None)
            raise _Transient(reason) from exc
        finally:
            backend.slots.release()
        return self._read(backend, response, attempt, started, purpose)

    def _read(
        self,
        backend: _Backend,
        response: httpx.Response,
        attempt: int,
        started: float,
        purpose: str,
    ) -> _Answer:
        status = response.status_code
        verdict = classify(status, excerpt(response) if status >= 300 else "")
        if verdict is Verdict.TRANSIENT:
            wait = retry_after_seconds(response.headers.get("Retry-After"))
            reason = f"http_{status}"
            self._log_failed(backend, attempt, started, purpose, reason=reason, status=status)
            raise _Transient(reason, status, wait)
        if verdict is not Verdict.OK:
            reason = _refusal(backend, response, verdict)
            self._log_failed(backend, attempt, started, purpose, reason=reason, status=status)
            raise _Permanent(verdict, reason, status)
        payload, problem = _completion(response)
        if problem is not None:  # a login page, a wrong path: the server's fault, not the item's
            reason = f"malformed_response: {mask_secrets(problem, backend.secrets)}"
            self._log_failed(backend, attempt, started, purpose, reason=reason, status=status)
            raise _Transient(reason, status)
        answer = _answer_from(payload)
        log.info(
            "llm_call_finished",
            backend=backend.name,
            attempt=attempt,
            duration_ms=_ms(started),
            prompt_tokens=answer.prompt_tokens,
            completion_tokens=answer.completion_tokens,
            purpose=purpose,
        )
        return answer

    # -- retry policy ----------------------------------------------------------------------

    def _stop(self, attempts: int) -> Callable[[RetryCallState], bool]:
        limit = self.policy.retry_after_max

        def stop(state: RetryCallState) -> bool:
            if state.attempt_number >= attempts:
                return True
            exc = state.outcome.exception() if state.outcome else None
            # Waiting out a long Retry-After would delay the fallback (litellm #3274).
            return isinstance(exc, _Transient) and (exc.retry_after or 0.0) > limit

        return stop

    def _wait(self, state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome else None
        if isinstance(exc, _Transient) and exc.retry_after is not None:
            return exc.retry_after
        ceiling = min(
            self.policy.backoff_max, self.policy.backoff_base * 2.0 ** (state.attempt_number - 1)
        )
        return ceiling * (0.5 + self._random.random() / 2)  # jitter in [ceiling/2, ceiling]

    # -- outcome ---------------------------------------------------------------------------

    def _failure(
        self,
        tried: tuple[BackendAttempt, ...],
        kinds: list[str],
        purpose: str,
        response_model: type[BaseModel],
    ) -> Exception:
        """The error for a call no backend answered validly (durability.md's attempt table).

        Refused or rejected by EVERY backend: the minimal request in each backend's
        structured-output form decides. Served by every one of them, this request or its type
        is refused (a WAF rule, a 404 "no endpoints" for a long prompt, a 400 for this input or
        for a schema the server's grammar converter cannot take): :class:`RequestRefused`, the
        item's attempt, or the item would be given back and claimed again for ever. Refused
        (or unanswered) by any one, it is that backend's configuration (an expired key: 401 to
        everything), which once fixed may serve this request: given back, and probe() asks the
        minimal request of those backends, so claiming resumes only once one of them serves it
        (a plain probe, or another backend serving it, does not lift it). The item's next call
        is then decided by the backends' real answers.

        Unreachable, skipped or busy somewhere (with refusals or not): an outage only when a
        probe right after, in the request's own form, of each backend the request reached
        agrees, since the backend that was down may serve it. probe() then asks in that form
        and resumes claiming once it is served or every backend answers it, so the item's next
        call is decided by the backends themselves (no loop while one is down, none after).
        """
        summary = "; ".join(f"{a.backend}: {a.reason}" for a in tried)
        log.warning("llm_call_failed_everywhere", purpose=purpose, tried=summary)
        refusals = {"refused", "rejected"}
        if kinds and all(k in refusals for k in kinds):
            # Every backend refused this request: the minimal request in each one's form decides
            # between the configuration (any one refuses it too) and this request or its type
            # (every one serves it).
            answers = {b.name: self._minimal_answer(b) for b in self._reached(tried, kinds)}
            unserved = sorted(name for name, a in answers.items() if a is not _Probed.SERVED)
            if not unserved:
                return RequestRefused(
                    f"every LLM backend refused this request ({summary}), while serving a"
                    " minimal request in the same form: the request or its schema is refused,"
                    " not the configuration",
                    tried=tried,
                )
            self._probe_form = _ProbeForm(
                _Probe, when_all_answer=False, awaited=frozenset(unserved)
            )
            if len(unserved) == len(answers):
                return _not_the_items_fault(tried, kinds, summary)
            return _partly_misconfigured(tried, answers, summary)
        if all(k in {"unreachable", "skipped", "busy", *refusals} for k in kinds):
            # Some backend never answered (down, circuit open, busy): it may serve this request
            # when it is back, so a backend that refused (or failed) is asked in the request's
            # own form, not the minimal one.
            served = any(
                self._request_would_be_served(b, response_model)
                for b in self._reached(tried, kinds)
            )
            if not served:
                if any(k in refusals for k in kinds):
                    # Until that form is served (or every backend answers it), a plain probe's
                    # success must not resume claiming: probe() asks in it.
                    self._probe_form = _ProbeForm(response_model, when_all_answer=True)
                return _not_the_items_fault(tried, kinds, summary)
            # A backend it reached serves requests of this shape: this request broke it.
        return ChatFailed(f"no LLM backend gave a valid reply ({summary})", tried=tried)

    def _reached(self, tried: tuple[BackendAttempt, ...], kinds: list[str]) -> list[_Backend]:
        """The backends the request reached: a skipped or busy one never saw it, so its health
        says nothing about it."""
        return [
            self._backend(a.backend)
            for a, k in zip(tried, kinds, strict=True)
            if k not in {"skipped", "busy"}
        ]

    def _request_would_be_served(self, backend: _Backend, response_model: type[BaseModel]) -> bool:
        """The one-token probe in ``response_model``'s structured-output form: a refusal of the
        form itself (OpenRouter's 404 for unsupported parameters) is then every item's."""
        if not self._probe_one(backend, response_model):
            return False
        backend.breaker.allow_probe_now()
        return True

    def _minimal_answer(self, backend: _Backend) -> _Probed:
        """The minimal request in ``backend``'s structured-output form (see :class:`_Probe`)."""
        result = self._probe_answer(backend, _Probe)
        if result is not _Probed.DOWN:
            backend.breaker.allow_probe_now()
        return result

    def _probe_one(self, backend: _Backend, response_model: type[BaseModel] | None = None) -> bool:
        return self._probe_answer(backend, response_model) is _Probed.SERVED

    def _probe_answer(
        self, backend: _Backend, response_model: type[BaseModel] | None = None
    ) -> _Probed:
        """The one-token probe (in ``response_model``'s structured-output form): served,
        refused (a permanent answer: the server is up) or down."""
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
        try:
            response = backend.clients.get().post(
                backend.chat_url, json=body, timeout=backend.probe_timeout
            )
        except ProxyAuthenticationRequired:
            return _Probed.REFUSED
        except httpx.HTTPError:
            return _Probed.DOWN
        status = response.status_code
        verdict = classify(status, excerpt(response) if status >= 300 else "")
        if verdict is Verdict.OK:
            # A proxy's login page answers 200 too: only a chat completion counts as up.
            return _Probed.SERVED if _completion(response)[1] is None else _Probed.DOWN
        return _Probed.DOWN if verdict is Verdict.TRANSIENT else _Probed.REFUSED

    def _backend(self, name: str) -> _Backend:
        for backend in self._backends:
            if backend.name == name:
                return backend
        raise KeyError(name)

    def _attempt(
        self, backend: _Backend, result: str, reason: str, started: float
    ) -> BackendAttempt:
        return BackendAttempt(backend.name, result, reason, _ms(started))

    def _log_failed(
        self,
        backend: _Backend,
        attempt: int,
        started: float,
        purpose: str,
        *,
        reason: str,
        status: int | None,
    ) -> None:
        log.warning(
            "llm_call_failed",
            backend=backend.name,
            attempt=attempt,
            duration_ms=_ms(started),
            purpose=purpose,
            reason=reason,
            status=status,
        )


# Where the daemon's misconfiguration message sends the operator (``check`` leaves it out).
RUN_CHECK = " ('sokratos-worker check')"


def _not_the_items_fault(
    tried: tuple[BackendAttempt, ...], kinds: list[str], summary: str
) -> Exception:
    """Misconfigured when every backend refused, busy when every one's slots stayed taken, else
    unreachable (all give the attempt back)."""
    if all(k == "busy" for k in kinds):
        return LLMBackendsBusy(
            f"every LLM backend is busy ({summary}): this worker runs more calls at once than"
            " the backends have slots; raise max_concurrency in SOKRATOS_LLM_BACKENDS if the"
            " servers can serve more at once, or lower SOKRATOS_CONCURRENCY",
            tried=tried,
        )
    if all(k in {"refused", "rejected"} for k in kinds):
        proxied = [a.reason.startswith(PROXY_REFUSED) for a in tried if a.result == "failed"]
        if all(proxied):
            return LLMBackendsMisconfigured(
                f"the environment's proxy refused every LLM request with 407 ({summary}): fix"
                f" the proxy credentials{RUN_CHECK}",
                tried=tried,
            )
        check = "api_key and model" if all(k == "refused" for k in kinds) else "url and model"
        if any(proxied):
            check += " (and the proxy credentials)"
        return LLMBackendsMisconfigured(
            f"every LLM backend refused the request ({summary}): check each backend's"
            f" {check}{RUN_CHECK}; a minimal request in the same form was refused too",
            tried=tried,
        )
    limited = all(a.reason.startswith("http_429") for a in tried)
    what = "every LLM backend is rate-limiting" if limited else "no LLM backend reachable"
    return NoBackendReachable(f"{what} ({summary})", tried=tried)


def _partly_misconfigured(
    tried: tuple[BackendAttempt, ...], answers: dict[str, _Probed], summary: str
) -> LLMBackendsMisconfigured:
    """Every backend refused the request, some served the minimal one and the others refused
    it too (or did not answer it): those others' configuration (the attempt given back)."""
    unserved = [name for name, a in answers.items() if a is not _Probed.SERVED]
    served = ", ".join(name for name, a in answers.items() if a is _Probed.SERVED)
    proxied = {a.backend for a in tried if a.reason.startswith(PROXY_REFUSED)}
    what = " and ".join(
        f"the proxy credentials for {name}" if name in proxied else f"{name}'s api_key and model"
        for name in unserved
    )
    return LLMBackendsMisconfigured(
        f"every LLM backend refused this request ({summary}), and {', '.join(unserved)} did"
        f" not serve even a minimal request in the same form ({served} served it): check"
        f" {what}{RUN_CHECK}",
        tried=tried,
    )


def _busy_reason(backend: _Backend) -> str:
    """Why a backend was skipped as busy: its slots and how long the call waited for one."""
    count = backend.config.max_concurrency
    slots = "its one slot" if count == 1 else f"all {count} slots"
    return f"busy: {slots} stayed in use for {backend.config.timeout:g} s"


def _refusal(backend: _Backend, response: httpx.Response, verdict: Verdict) -> str:
    """The reason for a permanent answer: the status, and what the server says about it."""
    status = response.status_code
    if 300 <= status < 400:
        return f"http_{status}: {_redirect(response)}"
    reason = f"http_{status}" + (f" {verdict.value}" if verdict is Verdict.CONTEXT else "")
    if 400 <= status < 500:  # a wrong key, model or parameter: the server says which
        reason += _server_says(response, backend.secrets)
    return reason


def _redirect(response: httpx.Response) -> str:
    """Where a redirect points, and the backend URL that would not be redirected."""
    location = response.headers.get("Location")
    if not location:
        return "a redirect without a Location: check the backend's url"
    target = without_credentials(str(response.url.join(location)))
    base = target.removesuffix("/chat/completions")
    return f"redirects to {target}: set the backend's url to {base}"


def _server_says(response: httpx.Response, secrets: Sequence[str] = ()) -> str:
    """``: <the error message>`` of an OpenAI-style error body (bounded, ``secrets`` masked),
    or nothing."""
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError, RecursionError):
        return ""
    message = error.get("message") if isinstance(error, dict) else error
    if not isinstance(message, str) or not message.strip():
        return ""
    # Masked before it is cut: a key cut in half would no longer be found.
    return ": " + mask_secrets(" ".join(message.split()), secrets)[:160]


def _echoed(content: str, max_tokens: int) -> str:
    """The invalid reply as sent back for repair: no longer than a reply can be (a server
    answering megabytes of junk must not get them back)."""
    limit = max(2000, max_tokens * 8)
    return content if len(content) <= limit else content[:limit] + " …"


def _completion(response: httpx.Response) -> tuple[Any, str | None]:
    """The parsed body, and why it is not an OpenAI chat completion (None when it is one)."""
    try:
        payload = response.json()
    except (ValueError, RecursionError):  # RecursionError: nested past Python's limit
        kind = response.headers.get("content-type", "no content type").split(";")[0]
        return None, f"not JSON ({kind}: {' '.join(excerpt(response).split())[:80]!r})"
    if not isinstance(payload, dict) or not isinstance(payload.get("choices"), list):
        return payload, f"JSON without 'choices' ({' '.join(excerpt(response).split())[:80]!r})"
    return payload, None


def _answer_from(payload: Any) -> _Answer:
    """Content (or reasoning_content when content is empty), token counts, truncation."""
    content = ""
    truncated = False
    usage: dict[str, Any] = {}
    if isinstance(payload, dict):
        choices = payload.get("choices") or []
        if choices and isinstance(choices[0], dict):
            message = choices[0].get("message")
            message = message if isinstance(message, dict) else {}
            content = _text(message.get("content"), "content")
            if not content:
                content = _text(message.get("reasoning_content"), "reasoning_content")
            truncated = choices[0].get("finish_reason") == "length"
        raw_usage = payload.get("usage")
        usage = raw_usage if isinstance(raw_usage, dict) else {}
    return _Answer(
        content,
        _int(usage.get("prompt_tokens")),
        _int(usage.get("completion_tokens")),
        truncated,
    )


def _text(value: Any, field: str) -> str:
    """A message field as text: a string, or the joined text parts of a content-parts list
    (Mistral's form); anything else is an invalid reply, so the next backend is tried."""
    if value is None or isinstance(value, str):
        return (value or "").strip()
    if isinstance(value, list):
        parts = [p for p in value if isinstance(p, dict) and p.get("type", "text") == "text"]
        texts = [p.get("text") for p in parts]
        if texts and all(isinstance(t, str) for t in texts):
            return "".join(str(t) for t in texts).strip()
    raise ReplyInvalid(f"the reply's {field} is neither text nor a list of text parts")


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) else None


def _add(a: int | None, b: int | None) -> int | None:
    return None if a is None and b is None else (a or 0) + (b or 0)


def _ms(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 1)


__all__ = [
    "PROBE_MESSAGE",
    "FallbackChatClient",
    "RetryPolicy",
    "request_body",
    "strict_schema",
]
