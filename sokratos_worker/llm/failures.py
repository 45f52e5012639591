"""What went wrong with a backend's answer, in words: the reasons and the final errors.

The reason an attempt records for a permanent answer (the status, a redirect's target, the
server's own error message with secrets masked), the reason for a busy skip, and, for a call
every backend failed, the error that gives the attempt back (every backend busy, refusing:
misconfigured, which key, model, url, proxy credentials or structured_output to check, or
unreachable) or, when the backends serve a minimal request, the one that uses it (this
request or its schema refused).
"""

from __future__ import annotations

from collections.abc import Sequence

import httpx

from sokratos_worker import jsontext
from sokratos_worker.config import without_credentials
from sokratos_worker.llm.backend import Backend
from sokratos_worker.llm.http import Verdict
from sokratos_worker.llm.one_token_probe import Probed, split
from sokratos_worker.llm.types import (
    BackendAttempt,
    LLMBackendsBusy,
    LLMBackendsMisconfigured,
    NoBackendReachable,
    RequestRefused,
)
from sokratos_worker.logs import mask_secrets

# The reason of a request the environment's proxy refused (407): its credentials to fix.
PROXY_REFUSED = "proxy_auth_required"
# Where the daemon's misconfiguration message sends the operator (``check`` leaves it out).
RUN_CHECK = " ('sokratos-worker check')"


def not_the_items_fault(
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


def request_refused(
    tried: tuple[BackendAttempt, ...], answers: dict[str, Probed], summary: str
) -> RequestRefused:
    """Every backend refused this request, and none refused the minimal one in its form: the
    request or its type (the attempt used). A backend with no free slot for the minimal
    request is named as such, not as serving it."""
    parts = split(answers)
    if not parts.busy:
        return RequestRefused(
            f"every LLM backend refused this request ({summary}), while serving a minimal"
            " request in the same form: the request or its schema is refused, not the"
            " configuration",
            tried=tried,
        )
    also = f", and {', '.join(parts.served)} served one in the same form" if parts.served else ""
    return RequestRefused(
        f"every LLM backend refused this request ({summary}); {', '.join(parts.busy)} had"
        f" every slot in use by calls in flight, so no minimal request was sent to it{also}:"
        " taken as this request's refusal (its attempt is used, so it is not given back for"
        " ever)",
        tried=tried,
    )


def partly_misconfigured(
    tried: tuple[BackendAttempt, ...], answers: dict[str, Probed], summary: str
) -> LLMBackendsMisconfigured:
    """Every backend refused the request, some served the minimal one and the others refused
    it too (or did not answer it): those others' configuration (the attempt given back)."""
    parts = split(answers)
    unserved = parts.unserved
    others = "; ".join(
        f"{', '.join(names)} {what}"
        for what, names in (("served it", parts.served), ("had no free slot to ask", parts.busy))
        if names
    )
    proxied = {a.backend for a in tried if a.reason.startswith(PROXY_REFUSED)}
    what = " and ".join(
        f"the proxy credentials for {name}" if name in proxied else f"{name}'s api_key and model"
        for name in unserved
    )
    return LLMBackendsMisconfigured(
        f"every LLM backend refused this request ({summary}), and {', '.join(unserved)} did"
        f" not serve even a minimal request in the same form ({others}): check"
        f" {what}{RUN_CHECK}",
        tried=tried,
    )


def form_unserved(
    tried: tuple[BackendAttempt, ...], names: list[str], summary: str
) -> LLMBackendsMisconfigured:
    """Nothing refused the request, but ``names`` serve a plain one-token request while failing
    the minimal one in their structured-output form: their ``structured_output`` setting (or
    the model's support for it), not the item (the attempt given back until it is served)."""
    which = ", ".join(names)
    return LLMBackendsMisconfigured(
        f"no LLM backend gave a valid reply ({summary}); {which} served a plain one-token"
        " request but not a minimal one in its structured-output form: check"
        f" structured_output (and model) for {which} in SOKRATOS_LLM_BACKENDS{RUN_CHECK}",
        tried=tried,
    )


def form_refused(
    tried: tuple[BackendAttempt, ...], names: list[str], summary: str
) -> RequestRefused:
    """Nothing refused the request, and ``names`` serve the minimal request in their
    structured-output form but fail this call's: this request type's schema fails there
    (other types are served), so the attempt is used."""
    which = ", ".join(names)
    return RequestRefused(
        f"no LLM backend gave a valid reply ({summary}); {which} served a minimal request in"
        " its structured-output form but not a one-token request in this call's form, right"
        " after the call: this request type's schema fails there, not the configuration"
        f" (another structured_output mode for {which} may take it)",
        tried=tried,
    )


def busy_reason(backend: Backend) -> str:
    """Why a backend was skipped as busy: its slots and how long the call waited for one."""
    count = backend.config.max_concurrency
    slots = "its one slot" if count == 1 else f"all {count} slots"
    return f"busy: {slots} stayed in use for {backend.config.timeout:g} s"


def refusal(backend: Backend, response: httpx.Response, verdict: Verdict) -> str:
    """The reason for a permanent answer: the status, and what the server says about it."""
    status = response.status_code
    if 300 <= status < 400:
        return f"http_{status}: {_redirect(response)}"
    reason = f"http_{status}" + (f" {verdict.value}" if verdict is Verdict.CONTEXT else "")
    if 400 <= status < 500:  # a wrong key, model or parameter: the server says which
        reason += _server_says(response, backend.secrets)
    return reason


def transient_reason(backend: Backend, response: httpx.Response) -> str:
    """The reason for an answer worth retrying (5xx, 408, 429): the status, and what the server
    says about it (llama.cpp's and vLLM's 500 name a real cause: out of GPU memory, a
    template error), so a dead letter from it tells the operator why."""
    return f"http_{response.status_code}" + _server_says(response, backend.secrets)


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
        error = jsontext.loads(response.content).get("error")
    except (ValueError, AttributeError):
        return ""
    message = error.get("message") if isinstance(error, dict) else error
    if not isinstance(message, str) or not message.strip():
        return ""
    # Masked before it is cut: a key cut in half would no longer be found.
    return ": " + mask_secrets(" ".join(message.split()), secrets)[:160]


__all__ = [
    "PROXY_REFUSED",
    "RUN_CHECK",
    "busy_reason",
    "form_refused",
    "form_unserved",
    "not_the_items_fault",
    "partly_misconfigured",
    "refusal",
    "request_refused",
    "transient_reason",
]
