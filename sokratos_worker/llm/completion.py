"""Reading a backend's 2xx reply as an OpenAI chat completion.

:func:`completion` parses the body and says why it is not a chat completion (not JSON, no
``choices`` or an empty list: a login page, a wrong path, an upstream that answered nothing),
and :func:`answer_from` takes the :class:`Answer` out of one: the message content (or
``reasoning_content`` when the content is empty, Mistral's content-parts list joined), the
token counts and whether the reply hit ``max_tokens``. Validating the content against the
response model is :mod:`sokratos_worker.llm.reply`'s job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from sokratos_worker import jsontext
from sokratos_worker.llm.http import excerpt
from sokratos_worker.llm.reply import ReplyInvalid


@dataclass(frozen=True)
class Answer:
    content: str
    prompt_tokens: int | None
    completion_tokens: int | None
    truncated: bool = False  # finish_reason "length": the reply hit max_tokens


def completion(response: httpx.Response) -> tuple[Any, str | None]:
    """The parsed body, and why it is not an OpenAI chat completion (None when it is one)."""
    try:
        payload = jsontext.loads(response.content)
    except ValueError:
        kind = response.headers.get("content-type", "no content type").split(";")[0]
        return None, f"not JSON ({kind}: {' '.join(excerpt(response).split())[:80]!r})"
    if not isinstance(payload, dict) or not isinstance(payload.get("choices"), list):
        return payload, f"JSON without 'choices' ({' '.join(excerpt(response).split())[:80]!r})"
    if not payload["choices"]:
        # No reply at all (a proxy whose upstream answered nothing): not an invalid reply to
        # repair, and no proof that the server serves anything.
        return (
            payload,
            f"JSON whose 'choices' is empty ({' '.join(excerpt(response).split())[:80]!r})",
        )
    return payload, None


def answer_from(payload: Any) -> Answer:
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
    return Answer(
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


__all__ = ["Answer", "answer_from", "completion"]
