"""structlog set-up: JSON lines on stderr for journald, readable output on a terminal.

Message bodies, email bodies and secrets are never passed to the logger (only lengths and
ids); as a second line of defence, values under keys that name a secret or a body are
replaced before rendering, and so is any configured secret's value wherever it appears (a
server's error text may echo the key it was sent).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import unquote

import structlog

from sokratos_worker.config_validators import url_credentials

if TYPE_CHECKING:
    from sokratos_worker.config import Settings

_REDACTED_KEYS = frozenset(
    {
        "password",
        "api_key",
        "authorization",
        "database_url",
        "exchange",
        "body",
        "text",
        "content",
        "payload",
        "prompt",
        "reply",
    }
)


# psycopg_pool logs every failed attempt of every connection it cannot open, with backoff for
# 5 minutes (a role allowed fewer connections than the pool's size wrote 20 identical lines in
# its first 18 s); the worker's own events say what that means, so one line per text will do.
REPEAT_WINDOW_S = 300.0


# Every line's timestamp, also on the lines written without the logger (a second stop signal).
TIMESTAMPER = structlog.processors.TimeStamper(fmt="iso", utc=True)


_OBJECT_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _library_line(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """A library's log record (psycopg_pool's, APScheduler's) as one of ours: a stable event
    name to group and grep by, the library's logger, and its text on one line in ``message``."""
    record = event.get("_record")
    event["message"] = " ".join(str(event.get("event", "")).split())
    event["event"] = "library_message"
    if isinstance(record, logging.LogRecord):
        event["logger"] = record.name
    return event


class RepeatedLineFilter(logging.Filter):
    """Lets each distinct text through once per ``window_s``; the next one after that says
    how many were left out in between."""

    def __init__(
        self, window_s: float = REPEAT_WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._left_out: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        # "discarding closed connection: <psycopg.Connection [BAD] at 0x7f…>": one per address.
        key = _OBJECT_ADDRESS.sub("", text)
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.window_s:
                self._left_out[key] = self._left_out.get(key, 0) + 1
                return False
            if len(self._last) >= 100:  # texts carry hosts and errors: a few in practice
                self._last.clear()
                self._left_out.clear()
            self._last[key] = now
            left_out = self._left_out.pop(key, 0)
        if left_out:
            record.msg = f"{text} (and {left_out} more like it since the last one)"
            record.args = ()
        return True


def _redact(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for key in _REDACTED_KEYS.intersection(event):
        event[key] = "[redacted]"
    return event


REDACTED = "[redacted]"
# API keys shorter than this are not masked: local servers accept placeholders ("ollama",
# "none", "sk-no-key") that are ordinary words in log lines, not secrets.
MIN_SECRET_CHARS = 8
# Passwords (IMAP, database, a URL's user:password@) are secrets at any length, but masking
# is by substring, on every line: a 1-3 character password would blank out that letter or
# syllable in every word of every line (and show what it is by what went missing), while a
# 4-character string is already rare in log text by chance. Shorter passwords are not masked
# (a mailbox or role with one is not protected by its password anyway).
MIN_PASSWORD_CHARS = 4
# How deep a logged dict or list is walked; what lies deeper is masked as its text.
MAX_DEPTH = 8
# Written by the code, never from outside: their values are never masked ("event" is not one:
# a library's line is its message).
_FIXED_KEYS = frozenset({"level", "timestamp", "logger"})
# Keys every line carries (contract.md): never renamed, whatever secret they contain (a
# password "event" must not take the field from every line); "event"'s value is masked.
_KEPT_KEYS = frozenset({"event", *_FIXED_KEYS})
# The worker's own event names and field names (snake_case, written in the code): a password
# that is a common word ("worker", "tick") masked inside them turned worker_started into
# [redacted]_started and worker_id into [redacted]_id, on every line, and so showed what the
# password is. A library's event (its message, with spaces) is masked as any value.
_CODE_NAME = re.compile(r"[a-z][a-z0-9_]*\Z")
_PLAIN = (int, float, bool, type(None))


def maskable(
    api_keys: Iterable[str | None] = (), passwords: Iterable[str | None] = ()
) -> list[str]:
    """The secrets worth masking: API keys of ``MIN_SECRET_CHARS`` or more, passwords of
    ``MIN_PASSWORD_CHARS`` or more; a longer one first (so a secret containing another is
    masked whole)."""
    values = {k for k in api_keys if k and len(k) >= MIN_SECRET_CHARS}
    values |= {p for p in passwords if p and len(p) >= MIN_PASSWORD_CHARS}
    return sorted(values, key=len, reverse=True)


def mask_secrets(text: str, secrets: Sequence[str]) -> str:
    """``text`` with each of ``secrets`` replaced (choose them with :func:`maskable`; none
    shorter than ``MIN_PASSWORD_CHARS`` is ever masked)."""
    found = [s for s in secrets if len(s) >= MIN_PASSWORD_CHARS and s in text]
    return _replaced(text, found) if found else text


def _replaced(text: str, secrets: Sequence[str]) -> str:
    """``text`` with every occurrence of ``secrets`` replaced, overlapping ones as one: the
    spans of all of them merged first, so no part of one survives another's replacement."""
    spans: list[tuple[int, int]] = []
    for secret in secrets:
        start = text.find(secret)
        while start >= 0:
            spans.append((start, start + len(secret)))
            start = text.find(secret, start + 1)
    spans.sort()
    parts: list[str] = []
    done = 0  # the end of what is written (or masked) so far
    begin, end = spans[0]
    for start, stop in spans[1:]:
        if start < end:  # overlapping: one span
            end = max(end, stop)
            continue
        parts += (text[done:begin], REDACTED)
        done, (begin, end) = end, (start, stop)
    parts += (text[done:begin], REDACTED, text[end:])
    return "".join(parts)


def as_echoed_by_imap(password: str) -> list[str]:
    """``password`` and the forms a server echoing LOGIN shows it in: IMAP's quoted string
    (``\\`` and ``"`` escaped by a backslash) and that string inside a bytes repr."""
    quoted = password.replace("\\", "\\\\").replace('"', '\\"')
    return list(dict.fromkeys([password, quoted, quoted.replace("\\", "\\\\")]))


def url_password(url: str | None) -> str | None:
    """The password in a URL's ``user:password@`` (decoded, as it is sent), or None: of the
    credentials ``without_credentials`` takes out, so what is shown and what is masked agree."""
    credentials = url_credentials(url) if url else None
    if credentials is None:
        return None
    password = credentials.partition(":")[2]
    return unquote(password) if password else None


def secret_values(settings: Settings) -> list[str]:
    """Every secret the configuration holds: API keys, IMAP passwords, URL passwords (the
    environment's proxy variables' too), as :func:`maskable` chooses them."""
    keys = [b.api_key.get_secret_value() for b in settings.llm_backends if b.api_key]
    passwords = [url_password(settings.embedding_url)]
    passwords += [url_password(b.url) for b in settings.llm_backends]
    for account in settings.email_accounts:
        if account.password:
            passwords += as_echoed_by_imap(account.password.get_secret_value())
    if settings.database_url is not None:
        passwords.append(_database_password(settings.database_url.get_secret_value()))
    passwords += [url_password(v) for k, v in os.environ.items() if k.lower().endswith("_proxy")]
    return maskable(keys, passwords)


def _database_password(url: str) -> str | None:
    """The password of a libpq URI or ``key=value`` string."""
    from psycopg.conninfo import conninfo_to_dict  # noqa: PLC0415 - only with a database URL

    try:
        password = conninfo_to_dict(url).get("password")
    except Exception:  # an unparsable URL was refused by the settings already
        return url_password(url)
    return str(password) if password else None


def _escaped_forms(secret: str) -> set[str]:
    """``secret`` and the forms it takes inside a repr or JSON text, backslashes doubled and
    quotes escaped (a value's repr inside a message, a server's JSON error body quoted)."""
    doubled = secret.replace("\\", "\\\\")
    return {
        secret,
        repr(secret)[1:-1],
        doubled.replace("'", "\\'"),
        doubled.replace('"', '\\"'),
        json.dumps(secret)[1:-1],
        json.dumps(secret, ensure_ascii=False)[1:-1],
    }


class SecretRedactor:
    """A processor that replaces configured secret values wherever they appear in an event:
    in strings, inside dicts, lists and tuples (keys too), in the text of other objects.

    It runs on every line: nothing at all without secrets, else one substring test per secret
    (and escaped form) on all the event's strings joined (~1.3 us a line with 4 secrets); the
    walk that rebuilds what holds one only when one is there.
    """

    def __init__(self, secrets: Iterable[str]) -> None:
        forms = {f for s in secrets if len(s) >= MIN_PASSWORD_CHARS for f in _escaped_forms(s)}
        # A longer form first: an escaped one contains less of the raw secret than itself.
        self._secrets = tuple(sorted(forms, key=len, reverse=True))

    def __call__(
        self, _: Any, __: str, event: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        secrets = self._secrets
        if not secrets:
            return event
        # First one substring test per secret on all the event's text joined (the usual line
        # has none); the walk that replaces only when one is there.
        texts: list[str] = list(event)  # the keys
        for key, value in event.items():
            if isinstance(value, str):
                if key not in _FIXED_KEYS:
                    texts.append(value)
            elif not isinstance(value, _PLAIN):
                _collect(value, 0, texts)
        try:
            joined = "\n".join(texts)
        except TypeError:  # a key that is not a string: walked
            return self._walk(event)
        for secret in secrets:
            if secret in joined:
                if self._in_kept_key_only(event, texts):
                    return event
                return self._walk(event)
        return event

    def _in_kept_key_only(self, event: MutableMapping[str, Any], texts: list[str]) -> bool:
        """True when the secrets found are only in the names of the keys never renamed (a
        password ``event``): then no walk (it would find nothing to mask on every line)."""
        kept = [key for key in event if key in _KEPT_KEYS]
        if not kept:
            return False
        joined = "\n".join(t for t in texts[len(event) :])  # the values
        keys = "\n".join(key for key in event if key not in _KEPT_KEYS)
        return not any(secret in joined or secret in keys for secret in self._secrets)

    def _walk(self, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        renamed: list[tuple[str, str]] = []
        for key, value in event.items():
            if key in _FIXED_KEYS:
                continue
            if key == "event" and isinstance(value, str) and _CODE_NAME.match(value):
                continue  # the worker's own event name
            masked = self._masked(value, 0)
            if masked is not value:
                event[key] = masked  # (a value replaced, no key added: iterating stays valid)
            if key in _KEPT_KEYS:
                continue  # "event": its value masked, the key every line carries kept
            if (
                isinstance(key, str)
                and not _is_code_name(key)
                and (new := self._text(key)) is not key
            ):
                renamed.append((key, new))
        for key, new in renamed:
            name = new
            while name in event:
                name += "_"
            event[name] = event.pop(key)
        return event

    def _key(self, key: Any, depth: int) -> Any:
        """A nested dict's ``key`` masked, or itself: a code name (the worker's own field name,
        ``holder``'s ``user``) is never renamed, which would show the password it holds."""
        if _is_code_name(key):
            return key
        return self._masked(key, depth)

    def _text(self, text: str) -> str:
        """``text`` masked, or ``text`` itself (the same object) when nothing was found."""
        found = [secret for secret in self._secrets if secret in text]
        return _replaced(text, found) if found else text

    def _masked(self, value: Any, depth: int) -> Any:
        """``value`` masked, or ``value`` itself when no secret is in it."""
        if isinstance(value, str):
            return self._text(value)
        if isinstance(value, _PLAIN):
            return value
        if depth < MAX_DEPTH:
            if isinstance(value, dict):
                items = [
                    (self._key(k, depth + 1), self._masked(v, depth + 1)) for k, v in value.items()
                ]
                pairs = zip(items, value.items(), strict=True)
                if all(k is a and v is b for (k, v), (a, b) in pairs):
                    return value
                return _unique_keys(items, value)
            if isinstance(value, (list, tuple, set, frozenset)):
                masked = [self._masked(v, depth + 1) for v in value]
                if all(m is v for m, v in zip(masked, value, strict=True)):
                    return value
                return tuple(masked) if isinstance(value, tuple) else masked
        # An exception, a model, anything nested deeper: masked as its text (escaped forms
        # included, as its repr shows them).
        text = str(value)
        masked_text = self._text(text)
        return value if masked_text is text else masked_text


def _unique_keys(items: list[tuple[Any, Any]], original: dict[Any, Any]) -> dict[Any, Any]:
    """The masked pairs as a dict, a renamed key that meets another key suffixed with ``_`` (as
    at the top level): two keys masked to the same text must not drop a value."""
    taken = {k for (k, _), old in zip(items, original, strict=True) if k is old}
    result: dict[Any, Any] = {}
    for (key, inner), old in zip(items, original, strict=True):
        name = key
        if key is not old:
            try:
                hash(key)
            except TypeError:  # a frozenset key masked into a list
                name = str(key)
            while name in taken:
                name = f"{name}_"
            taken.add(name)
        result[name] = inner
    return result


def _is_code_name(key: Any) -> bool:
    """True for a snake_case field name, written in the code (see ``_CODE_NAME``)."""
    return isinstance(key, str) and _CODE_NAME.match(key) is not None


def _collect(value: Any, depth: int, texts: list[str]) -> None:
    """Every string in ``value`` (keys too) onto ``texts``, as :meth:`SecretRedactor._masked`
    walks it; an object's (or what lies past ``MAX_DEPTH``) text."""
    if isinstance(value, str):
        texts.append(value)
    elif isinstance(value, _PLAIN):
        return
    elif depth < MAX_DEPTH and isinstance(value, dict):
        for key, inner in value.items():
            if not _is_code_name(key):  # never renamed: a secret there needs no walk
                _collect(key, depth + 1, texts)
            _collect(inner, depth + 1, texts)
    elif depth < MAX_DEPTH and isinstance(value, (list, tuple, set, frozenset)):
        for inner in value:
            _collect(inner, depth + 1, texts)
    else:
        texts.append(str(value))


def configure_logging(
    level: str = "info",
    fmt: Literal["json", "console"] = "json",
    *,
    cache: bool = False,
    settings: Settings | None = None,
) -> None:
    """Route structlog and the standard library's loggers to stderr in one format.

    ``cache`` (the command line, which configures once per process): each logger is built on
    its first line and kept, 21 us a line instead of 47. Left off where logging is configured
    again later in the same process (tests, ``capture_logs``), which cached loggers would ignore.
    ``settings``: whose secret values (:func:`secret_values`) are masked in every line.
    """
    # After format_exc_info, so a traceback's text is masked too.
    secrets = SecretRedactor(secret_values(settings) if settings is not None else ())
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        TIMESTAMPER,
        _redact,
    ]
    renderer: Any = (
        # A plain traceback: rich's (when installed) prints every frame's locals, secrets too.
        structlog.dev.ConsoleRenderer(
            colors=sys.stderr.isatty(), exception_formatter=structlog.dev.plain_traceback
        )
        if fmt == "console"
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, secrets, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=cache,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            # Libraries' tracebacks (APScheduler's, psycopg_pool's) rendered as text like ours.
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                secrets,
                renderer,
            ],
            foreign_pre_chain=[*shared, _library_line],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)  # libraries speak only when it matters
    logging.getLogger("psycopg.pool").filters[:] = [RepeatedLineFilter()]
    logging.getLogger("sokratos_worker").setLevel(getattr(logging, level.upper()))
