"""The chat client: OpenAI-compatible backends in fallback order.

Per backend, one bounded tenacity loop retries transient errors (connect/read errors, 408,
429 with Retry-After, 5xx); permanent answers move on to the next backend at once; a
circuit breaker skips a backend that keeps failing; a semaphore caps its concurrency
(llama.cpp never answers 429, it queues). Replies are cleaned and validated; one repair
retry on the same backend feeds the validation error back. See docs/backends.md.

The request body, reading a completion, the one-token probe and the wording of failures live
in :mod:`.request_body`, :mod:`.completion`, :mod:`.one_token_probe` and :mod:`.failures`;
a backend and the retry policy in :mod:`.backend`.
"""

from __future__ import annotations

import enum
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import structlog
from pydantic import BaseModel
from tenacity import RetryCallState, Retrying, retry_if_exception_type

from sokratos_worker.config import BackendConfig
from sokratos_worker.llm.backend import Backend, RetryPolicy
from sokratos_worker.llm.breaker import Admission, Circuit, CircuitBreaker
from sokratos_worker.llm.completion import Answer, answer_from, completion
from sokratos_worker.llm.failures import (
    PROXY_REFUSED,
    RUN_CHECK,
    busy_reason,
    form_refused,
    form_unserved,
    not_the_items_fault,
    partly_misconfigured,
    refusal,
    request_refused,
    transient_reason,
)
from sokratos_worker.llm.http import (
    ProxyAuthenticationRequired,
    Verdict,
    classify,
    describe_connection_error,
    excerpt,
    request_timeout,
    retry_after_seconds,
)
from sokratos_worker.llm.one_token_probe import (
    PROBE_MESSAGE,
    MinimalRequest,
    Probed,
    heard,
    minimal_answer,
    probe_answer,
    request_would_be_served,
)
from sokratos_worker.llm.reply import ReplyInvalid, parse_reply
from sokratos_worker.llm.request_body import request_body, strict_schema
from sokratos_worker.llm.types import (
    BackendAttempt,
    BackendState,
    ChatFailed,
    ChatResult,
    ContextTooLong,
    T,
)
from sokratos_worker.logs import mask_secrets

log = structlog.get_logger(__name__)

REPAIR_PROMPT = (
    "Your previous reply was not valid: {error}. "
    "Reply again with only one JSON object that matches the schema."
)
TRUNCATED_PROMPT = (
    "Your previous reply (its start is above) was cut off at the {max_tokens}-token limit "
    "before the JSON object was complete. Reply again with one shorter JSON object that "
    "matches the schema: fewer and shorter entries."
)
CONTEXT_HINT = (
    "give the model a larger context (llama.cpp's server: -c; llama-cpp-python: --n_ctx;"
    " Ollama: num_ctx) or use a model with one"
)
# Why a half-open trial decided nothing: its probe waited its whole timeout for a slot.
TRIAL_FOUND_NO_SLOT = "its half-open trial found every slot in use by calls in flight"
# How much of a cut-off reply is sent back with TRUNCATED_PROMPT: a reply that ran until the
# model's context was full would not fit in it a second time (llama.cpp's 2048 default).
TRUNCATED_ECHO_CHARS = 400


class _Transient(Exception):
    def __init__(self, reason: str, status: int | None = None, retry_after: float | None = None):
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.retry_after = retry_after

    @property
    def answered(self) -> bool:
        """The server answered (a status), not a timeout or a lost connection."""
        return self.status is not None


class _Permanent(Exception):
    def __init__(self, verdict: Verdict, reason: str, status: int) -> None:
        super().__init__(reason)
        self.verdict = verdict
        self.reason = reason
        self.status = status


@dataclass(frozen=True)
class _Pause:
    """What ends the pause a failed call's verdict asked for (:meth:`FallbackChatClient._judge`,
    rule c): any backend serving a one-token request in the call's ``form`` (the item's next
    call would be served), or the ``awaited`` backends: for an outage, every one of them
    answering again (the item's next call then reaches them all and is decided by rule b);
    for a misconfiguration, one of them serving the minimal request in its form."""

    form: type[BaseModel]
    awaited: frozenset[str]
    outage: bool


class _Verdict(enum.Enum):
    """One backend's part in a call no backend answered validly (see ``_judge``)."""

    UNANSWERED = "unanswered"  # skipped, no free slot, or a 5xx/timeout and the plain probe too
    MISCONFIGURED = "misconfigured"  # not even the minimal request in its form is served
    PASSING = "passing"  # a 5xx/timeout, then its form served again or no slot to ask: an outage
    REFUSES = "refuses"  # this request (a 4xx) or its form (a 5xx/timeout the re-ask confirms)


# A backend's permanent answer to the call (a 4xx or 3xx): it answered.
_REFUSALS = frozenset({"refused", "rejected"})


class _Busy(Exception):
    """Every concurrency slot of the backend stayed taken for a whole timeout."""


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
        self._backends = [Backend(b, self.policy, clock) for b in backends]
        # Set when a failed call's item was given back (see _judge): what ends that pause, as a
        # plain probe would resume claiming only for the item to be given back again, for
        # ever. Cleared by a valid reply in its form, or once probe() finds it ended.
        self._pause: _Pause | None = None

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
                tried.append(self._attempt(backend, "skipped", busy_reason(backend), started))
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
                        f"{backend.name}: input exceeds the model's context ({exc.reason});"
                        f" {CONTEXT_HINT}",
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
            self._end_pause_served(response_model)
            tried.append(self._attempt(backend, "answered", "", started))
            return ChatResult(
                value=value,
                backend=backend.name,
                tried=tuple(tried),
                prompt_tokens=answer.prompt_tokens,
                completion_tokens=answer.completion_tokens,
            )
        raise self._failure(tuple(tried), kinds, purpose, response_model)

    def _skip_reason(self, backend: Backend) -> str:
        """Why this call skips ``backend`` (its circuit), or an empty string to go ahead."""
        admission = backend.breaker.admit()
        if admission is Admission.CALL:
            return ""
        if admission is Admission.SKIP:
            return "circuit_open"
        # The half-open trial is the one-token probe, not the item's request: the request then
        # keeps the backend's own timeout, so a slow CPU backend can close its circuit again.
        # Refused (a key rotated during the outage) is up too: the request then meets the
        # refusal, which names the configuration; re-opened, it read as an outage for ever.
        # (Its wait for a slot is bounded by the probe's timeout: the trial's deadline counts
        # the wait and the probe, see Backend.)
        result = probe_answer(backend, slot_wait=backend.probe_timeout)
        if result is Probed.BUSY:
            # No evidence either way (see Probed): the calls holding the slots decide when they
            # end, and this call does not queue behind them on a server that may be hung.
            backend.breaker.record_inconclusive_trial(TRIAL_FOUND_NO_SLOT)
            return f"circuit_open: {TRIAL_FOUND_NO_SLOT}"
        if result is Probed.DOWN:
            backend.breaker.record_failure("half-open probe failed", trial=True)
            return "circuit_open: half-open probe failed"
        backend.breaker.record_success()
        return ""

    def probe(self) -> bool:
        """True when a backend answers a one-token chat request now; ends its circuit's wait.

        A chat request, not ``GET /models``: a server whose completions all fail (a model that
        crashed, a GPU out of memory) still lists its models, and would make every item look
        like the one that broke it. After a failed call's item was given back, what ends that
        pause (see :class:`_Pause`).
        """
        pause = self._pause
        if pause is not None:
            if not self._pause_ends(pause):
                return False
            # Ended: cleared, or a pause whose form is never served again (the item's next
            # call judged its own failure) would hold every later probe to its test.
            self._clear_pause(pause)
            return True
        healthy = False
        for backend in self._backends:
            result = probe_answer(backend)
            # Served: closed, so the resumed items all reach it. Left half-open, one went as
            # the trial and the rest failed at once with circuit_open, given back (a new outage
            # logged right after circuit_closed, claiming paused again).
            heard(backend, result, closes=True)
            # A refusal means the server is back with a configuration problem (a key rotated
            # meanwhile): the item's next call names it and pauses on it; waiting here would
            # say "unreachable" for ever.
            healthy = healthy or result.answered
        return healthy

    def _end_pause_served(self, form: type[BaseModel]) -> None:
        """A valid reply in the paused call's form ends the pause; one in another form does
        not: a fallback serving triage while the primary is down and the fallback fails the
        paused contradiction form would resume claiming, and the same item would be claimed,
        fail and be given back again, for as long as the primary is down."""
        pause = self._pause
        if pause is not None and pause.form is form:
            self._clear_pause(pause)

    def _clear_pause(self, pause: _Pause) -> None:
        """Clear ``pause`` unless another call has set a newer one meanwhile."""
        if self._pause is pause:
            self._pause = None

    def _pause_ends(self, pause: _Pause) -> bool:
        """Whether a backend serves the paused call's form now, or the awaited ones are back
        (see :class:`_Pause`); every backend is asked, so each one serving has its circuit
        closed."""
        served = False
        back: list[bool] = []
        for backend in self._backends:
            result = probe_answer(backend, pause.form)
            heard(backend, result, closes=True)
            served = served or result is Probed.SERVED
            if backend.name in pause.awaited and result is not Probed.SERVED:
                back.append(self._awaited_back(backend, result, outage=pause.outage))
        if served:
            return True
        return all(back) if pause.outage else any(back)

    def _awaited_back(self, backend: Backend, in_form: Probed, *, outage: bool) -> bool:
        """An awaited backend that did not serve the paused form: after an outage, whether it
        answers now (that form refused, or a plain request answered); after a
        misconfiguration, whether it serves the minimal request in its form."""
        if outage and in_form is not Probed.DOWN:
            return in_form is Probed.REFUSED  # busy: still not asked
        result = probe_answer(backend, None if outage else MinimalRequest)
        heard(backend, result, closes=True)
        return result.answered if outage else result is Probed.SERVED

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
        backend: Backend,
        response_model: type[T],
        messages: list[dict[str, str]],
        max_tokens: int,
        purpose: str,
    ) -> tuple[T, Answer]:
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
                    hint="the JSON was cut off (at max_tokens, or where the model's context"
                    " was full); asking once for a shorter reply",
                )
                feedback = TRUNCATED_PROMPT.format(max_tokens=max_tokens)
                # Only its start: the whole of a reply that filled the context cannot fit again
                # (and a follow-up refused even so means the input left no room: _ask_again).
                echoed = _echoed(answer.content, TRUNCATED_ECHO_CHARS)
            else:
                log.warning("llm_reply_invalid", backend=backend.name, purpose=purpose, repair=True)
                feedback = REPAIR_PROMPT.format(error=exc.feedback)
                echoed = _echoed(answer.content, max(2000, max_tokens * 8))
            repair = [
                *messages,
                {"role": "assistant", "content": echoed},
                {"role": "user", "content": feedback},
            ]
            body = request_body(backend.config, response_model, repair, max_tokens)
            second = self._ask_again(backend, body, purpose, cut_off=answer.truncated)
            try:
                value, _ = self._parse(backend, response_model, second, purpose)
            except ReplyInvalid as again:
                log.warning(
                    "llm_reply_invalid", backend=backend.name, purpose=purpose, repair=False
                )
                if second.truncated:  # the item's error must say the reply did not fit
                    raise _cut_off(again, max_tokens, shorter=answer.truncated) from None
                raise
            return value, Answer(
                second.content,
                _add(answer.prompt_tokens, second.prompt_tokens),
                _add(answer.completion_tokens, second.completion_tokens),
            )

    def _ask_again(
        self, backend: Backend, body: dict[str, Any], purpose: str, *, cut_off: bool
    ) -> Answer:
        """The follow-up request. Refused as too long for the model's context:

        - after a reply that was cut off, the input is too long: the follow-up adds only the
          reply's first TRUNCATED_ECHO_CHARS and a sentence, so the input left no room for a
          reply (llama.cpp generates into what is left of the context), and the caller
          shortens it ("context too long");
        - after an invalid reply, the reply is: it is sent back whole, and the input itself
          was answered, so shortening the input would not help (an invalid reply).
        """
        try:
            return self._post(backend, body, purpose)
        except _Permanent as exc:
            if exc.verdict is not Verdict.CONTEXT or cut_off:
                raise
            log.warning("llm_reply_invalid", backend=backend.name, purpose=purpose, repair=False)
            raise ReplyInvalid(
                f"asking again with the reply exceeds the model's context ({exc.reason})"
            ) from None

    def _parse(
        self, backend: Backend, response_model: type[T], answer: Answer, purpose: str
    ) -> tuple[T, Answer]:
        value, clamped = parse_reply(response_model, answer.content)
        if clamped:
            log.warning("llm_value_clamped", backend=backend.name, purpose=purpose, fields=clamped)
        return value, answer

    def _post(self, backend: Backend, body: dict[str, Any], purpose: str) -> Answer:
        """POST with the bounded retry loop, each attempt with the backend's timeout."""
        retrying = Retrying(
            stop=self._stop(self.policy.attempts, backend.breaker),
            wait=self._wait,
            retry=retry_if_exception_type(_Transient),
            sleep=self._sleep,
            reraise=True,
        )
        answer: Answer | None = None
        for attempt in retrying:
            with attempt:
                number = attempt.retry_state.attempt_number
                answer = self._post_once(backend, body, purpose, number)
        assert answer is not None  # noqa: S101 - reraise=True: the loop either returns or raises
        return answer

    def _post_once(
        self, backend: Backend, body: dict[str, Any], purpose: str, attempt: int
    ) -> Answer:
        if not backend.slots.acquire(timeout=backend.config.timeout):
            raise _Busy
        started = time.perf_counter()
        try:
            response = backend.clients.get().post(
                backend.chat_url, json=body, timeout=request_timeout(backend.config.timeout)
            )
        except httpx.TimeoutException as exc:
            if isinstance(exc, httpx.ConnectTimeout):  # which host: the server or a proxy
                reason = f"timeout: {describe_connection_error(exc)}"
            else:  # (the number says which setting: a slow model needs a higher one)
                reason = (
                    f"timeout: no answer within the backend's timeout, {backend.config.timeout:g} s"
                )
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
        backend: Backend,
        response: httpx.Response,
        attempt: int,
        started: float,
        purpose: str,
    ) -> Answer:
        status = response.status_code
        verdict = classify(status, excerpt(response) if status >= 300 else "")
        if verdict is Verdict.TRANSIENT:
            wait = retry_after_seconds(response.headers.get("Retry-After"))
            reason = transient_reason(backend, response)
            self._log_failed(backend, attempt, started, purpose, reason=reason, status=status)
            raise _Transient(reason, status, wait)
        if verdict is not Verdict.OK:
            reason = refusal(backend, response, verdict)
            self._log_failed(backend, attempt, started, purpose, reason=reason, status=status)
            raise _Permanent(verdict, reason, status)
        payload, problem = completion(response)
        if problem is not None:  # a login page, a wrong path: the server's fault, not the item's
            reason = f"malformed_response: {mask_secrets(problem, backend.secrets)}"
            self._log_failed(backend, attempt, started, purpose, reason=reason, status=status)
            raise _Transient(reason, status)
        answer = answer_from(payload)
        log.info(
            "llm_call_finished",
            backend=backend.name,
            # Not "attempt": that is the item's (contract §6), bound by the runner's slot.
            http_attempt=attempt,
            duration_ms=_ms(started),
            prompt_tokens=answer.prompt_tokens,
            completion_tokens=answer.completion_tokens,
            purpose=purpose,
        )
        return answer

    # -- retry policy ----------------------------------------------------------------------

    def _stop(self, attempts: int, breaker: CircuitBreaker) -> Callable[[RetryCallState], bool]:
        limit = self.policy.retry_after_max

        def stop(state: RetryCallState) -> bool:
            if state.attempt_number >= attempts:
                return True
            exc = state.outcome.exception() if state.outcome else None
            # Other calls' failures opened its circuit meanwhile and this try got no answer at
            # all (a timeout, a lost connection): every new call skips it, so this one moves on
            # rather than wait out the timeout again. A quick 5xx is still retried, and so is
            # any try once the circuit is half-open (when the server is likeliest back).
            if breaker.state is Circuit.OPEN and isinstance(exc, _Transient) and not exc.answered:
                return True
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

        A reply that never validated is the item's (its attempt). So is a request a backend
        it reached fails while serving a one-token request in its form right after (a request
        that breaks a healthy server, or one input refused: it must not loop for ever). Any
        other failure is judged by :meth:`_judge` on each backend's :class:`_Verdict`.
        """
        summary = "; ".join(f"{a.backend}: {a.reason}" for a in tried)
        log.warning("llm_call_failed_everywhere", purpose=purpose, tried=summary)
        failed = ChatFailed(f"no LLM backend gave a valid reply ({summary})", tried=tried)
        if "invalid" in kinds:
            return failed
        if not all(k in _REFUSALS for k in kinds) and any(
            request_would_be_served(b, response_model) for b in self._reached(tried, kinds)
        ):
            return failed
        backends = [self._backend(a.backend) for a in tried]
        kind_of = {a.backend: k for a, k in zip(tried, kinds, strict=True)}
        # Whether each backend answered first: one that did not decides the call on its own
        # (rule a), and the others' form is then not worth a probe.
        verdicts = {b.name: self._answered(b, kind_of[b.name]) for b in backends}
        minimal: dict[str, Probed] = {}
        if _Verdict.UNANSWERED not in verdicts.values():
            for b in backends:
                verdicts[b.name], minimal[b.name] = self._form_verdict(
                    b, kind_of[b.name], response_model
                )
        return self._judge(
            tried, kinds, verdicts, minimal=minimal, summary=summary, form=response_model
        )

    def _judge(
        self,
        tried: tuple[BackendAttempt, ...],
        kinds: list[str],
        verdicts: dict[str, _Verdict],
        *,
        minimal: dict[str, Probed],
        summary: str,
        form: type[BaseModel],
    ) -> Exception:
        """THE rule for a call no backend answered validly (each verdict: :class:`_Verdict`).

        Decided before it, in :meth:`_failure`: a reply that never validated, or a request a
        reached backend failed while serving a one-token request in the call's form right
        after (unless every backend answered 4xx), is the item's own (:class:`ChatFailed`,
        the attempt used), whatever the others did: durability.md's "the probe right after
        succeeds" row (a request that breaks a healthy server must not loop for ever).

        a. A backend of the fallback order could not be asked or did not answer (down, circuit
           open, no free slot, a 5xx or timeout whose plain probe fails or finds no slot): an
           outage for the item (:class:`NoBackendReachable`, :class:`LLMBackendsBusy`; the
           attempt given back), as that backend may serve it later. Claiming pauses until a
           backend serves the call's form, or every one of those answers again (the next call
           is then judged by b, so it cannot loop while one is down, nor after).
        b. Else every backend answered this request, and none served it:
           - a backend serves neither it nor the minimal request in its form (a 4xx to that
             too: a key, a model, a mode; a 5xx or timeout while plain requests are served:
             its ``structured_output``): misconfigured (given back; rule c);
           - else a backend that failed it with a 5xx or timeout served its form on the re-ask
             (a burst that ended) or had no free slot to ask: an outage (given back, claiming
             paused until a plain probe succeeds);
           - else every backend refused it (a 4xx) or fails its form (a 5xx or timeout the
             re-ask confirms) while serving the minimal request: :class:`RequestRefused`, the
             item's attempt, so other queues go on and the item is not given back for ever.
        c. A pause for misconfiguration ends when a backend that did not serve the minimal
           request serves it, or ANY backend serves the call's form (:class:`_Pause`).

        BUSY (no free slot) is never evidence that a request type fails: only "could not ask".
        """

        def named(verdict: _Verdict) -> list[str]:
            return [name for name, v in verdicts.items() if v is verdict]

        if unanswered := named(_Verdict.UNANSWERED):
            self._pause = _Pause(form, frozenset(unanswered), outage=True)
            return not_the_items_fault(tried, kinds, summary)
        failed_form = {a.backend for a, k in zip(tried, kinds, strict=True) if k not in _REFUSALS}
        if misconfigured := named(_Verdict.MISCONFIGURED):
            self._pause = _Pause(form, frozenset(misconfigured), outage=False)
            if structured := [name for name in misconfigured if name in failed_form]:
                return form_unserved(tried, structured, summary)
            if len(misconfigured) == len(verdicts):
                return not_the_items_fault(tried, kinds, summary)
            return partly_misconfigured(tried, minimal, summary)
        if named(_Verdict.PASSING):
            self._pause = None  # the form was served again (or could not be asked): plain
            return not_the_items_fault(tried, kinds, summary)
        if failed_form:
            return form_refused(tried, sorted(failed_form), summary)
        return request_refused(tried, minimal, summary)

    def _answered(self, backend: Backend, kind: str) -> _Verdict:
        """UNANSWERED when the call could not ask ``backend`` (skipped, busy) or it failed with
        a 5xx or timeout and a plain probe right after fails or finds no slot (rule a); else
        REFUSES, for now (:meth:`_form_verdict` decides)."""
        if kind in {"skipped", "busy"}:
            return _Verdict.UNANSWERED
        if kind in _REFUSALS or probe_answer(backend).answered:
            return _Verdict.REFUSES
        return _Verdict.UNANSWERED

    def _form_verdict(
        self, backend: Backend, kind: str, response_model: type[BaseModel]
    ) -> tuple[_Verdict, Probed]:
        """What the minimal request in ``backend``'s form (and, after a 5xx or timeout, the
        call's form asked again) says of a backend that answered the call (see ``_judge``)."""
        minimal = minimal_answer(backend)
        if minimal.unserved:
            return _Verdict.MISCONFIGURED, minimal
        if kind in _REFUSALS:  # its 4xx is its answer: the minimal request only tells its setup
            return _Verdict.REFUSES, minimal
        if minimal is Probed.BUSY:
            return _Verdict.PASSING, minimal  # not asked: "could not ask", never "this form"
        # Asked again: a burst of 5xx that has just ended is an outage, not this form's.
        again = probe_answer(backend, response_model)
        if again in (Probed.SERVED, Probed.BUSY):  # served, or not asked: an outage either way
            return _Verdict.PASSING, minimal
        return _Verdict.REFUSES, minimal

    def _reached(self, tried: tuple[BackendAttempt, ...], kinds: list[str]) -> list[Backend]:
        """The backends the request reached: a skipped or busy one never saw it, so its health
        says nothing about it."""
        return [
            self._backend(a.backend)
            for a, k in zip(tried, kinds, strict=True)
            if k not in {"skipped", "busy"}
        ]

    def move_backend(self, name: str, url: str) -> None:
        """Send backend ``name``'s later requests to ``url`` (its server moved ports)."""
        self._backend(name).moved(url)

    def _backend(self, name: str) -> Backend:
        for backend in self._backends:
            if backend.name == name:
                return backend
        raise KeyError(name)

    def _attempt(
        self, backend: Backend, result: str, reason: str, started: float
    ) -> BackendAttempt:
        return BackendAttempt(backend.name, result, reason, _ms(started))

    def _log_failed(
        self,
        backend: Backend,
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
            http_attempt=attempt,  # not "attempt": that is the item's, bound by the runner
            duration_ms=_ms(started),
            purpose=purpose,
            reason=reason,
            status=status,
        )


def _cut_off(invalid: ReplyInvalid, max_tokens: int, *, shorter: bool) -> ReplyInvalid:
    """``invalid`` said as what it is: a reply that did not fit, not broken JSON."""
    asked = ", also when asked for a shorter reply" if shorter else ""
    return ReplyInvalid(
        f"cut off at the {max_tokens}-token limit (or where the model's context was full)"
        f"{asked}: {invalid.feedback}"
    )


def _echoed(content: str, limit: int) -> str:
    """The invalid reply as sent back, at most ``limit`` characters (a server answering
    megabytes of junk must not get them back)."""
    return content if len(content) <= limit else content[:limit] + " …"


def _add(a: int | None, b: int | None) -> int | None:
    return None if a is None and b is None else (a or 0) + (b or 0)


def _ms(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 1)


__all__ = [
    "PROBE_MESSAGE",
    "RUN_CHECK",
    "FallbackChatClient",
    "RetryPolicy",
    "request_body",
    "strict_schema",
]
