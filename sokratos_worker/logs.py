"""structlog set-up: JSON lines on stderr for journald, readable output on a terminal.

Message bodies, email bodies and secrets are never passed to the logger (only lengths and
ids); as a second line of defence, values under keys that name a secret or a body are
replaced before rendering, and so is any configured secret's value wherever it appears (a
server's error text may echo the key it was sent).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import unquote, urlsplit

import structlog

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
        now = self._clock()
        with self._lock:
            last = self._last.get(text)
            if last is not None and now - last < self.window_s:
                self._left_out[text] = self._left_out.get(text, 0) + 1
                return False
            if len(self._last) >= 100:  # texts carry hosts and errors: a few in practice
                self._last.clear()
                self._left_out.clear()
            self._last[text] = now
            left_out = self._left_out.pop(text, 0)
        if left_out:
            record.msg = f"{text} (and {left_out} more like it since the last one)"
            record.args = ()
        return True


def _redact(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for key in _REDACTED_KEYS.intersection(event):
        event[key] = "[redacted]"
    return event


REDACTED = "[redacted]"
# Shorter values are not masked: they would blank out ordinary words ("ollama", "none" are
# placeholders local servers accept, not secrets).
MIN_SECRET_CHARS = 8
# Written by the code, never from outside ("event" is not: a library's line is its message).
_FIXED_KEYS = frozenset({"level", "timestamp", "logger"})
_PLAIN = (int, float, bool, type(None))


def mask_secrets(text: str, secrets: Sequence[str]) -> str:
    """``text`` with each of ``secrets`` (of at least ``MIN_SECRET_CHARS``) replaced."""
    for secret in secrets:
        if len(secret) >= MIN_SECRET_CHARS and secret in text:
            text = text.replace(secret, REDACTED)
    return text


def url_password(url: str | None) -> str | None:
    """The password in a URL's ``user:password@``, or None."""
    if not url or "@" not in url:
        return None
    try:
        password = urlsplit(url).password
    except ValueError:  # a port that is not a number: no credentials worth finding
        return None
    return unquote(password) if password else None


def secret_values(settings: Settings) -> list[str]:
    """Every secret the configuration holds: API keys, IMAP passwords, URL passwords."""
    values: list[str | None] = [url_password(settings.embedding_url)]
    for backend in settings.llm_backends:
        values.append(backend.api_key.get_secret_value() if backend.api_key else None)
        values.append(url_password(backend.url))
    values += [a.password.get_secret_value() for a in settings.email_accounts if a.password]
    if settings.database_url is not None:
        values.append(_database_password(settings.database_url.get_secret_value()))
    return sorted({v for v in values if v}, key=len, reverse=True)  # a longer one first


def _database_password(url: str) -> str | None:
    """The password of a libpq URI or ``key=value`` string."""
    from psycopg.conninfo import conninfo_to_dict  # noqa: PLC0415 - only with a database URL

    try:
        password = conninfo_to_dict(url).get("password")
    except Exception:  # an unparsable URL was refused by the settings already
        return url_password(url)
    return str(password) if password else None


class SecretRedactor:
    """A processor that replaces configured secret values wherever they appear in an event.

    It runs on every line: nothing at all without secrets, else a substring test per value.
    """

    def __init__(self, secrets: Iterable[str]) -> None:
        self._secrets = tuple(s for s in secrets if len(s) >= MIN_SECRET_CHARS)

    def __call__(
        self, _: Any, __: str, event: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        if not self._secrets:
            return event
        for key, value in event.items():
            if key in _FIXED_KEYS or isinstance(value, _PLAIN):
                continue
            text = value if isinstance(value, str) else str(value)
            masked = mask_secrets(text, self._secrets)
            if masked != text:
                event[key] = masked
        return event


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
        structlog.processors.TimeStamper(fmt="iso", utc=True),
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
            foreign_pre_chain=shared,
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)  # libraries speak only when it matters
    logging.getLogger("psycopg.pool").filters[:] = [RepeatedLineFilter()]
    logging.getLogger("sokratos_worker").setLevel(getattr(logging, level.upper()))
