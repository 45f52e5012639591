"""structlog set-up: JSON lines on stderr for journald, readable output on a terminal.

Message bodies, email bodies and secrets are never passed to the logger (only lengths and
ids); as a second line of defence, values under keys that name a secret or a body are
replaced before rendering.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, MutableMapping
from typing import Any, Literal

import structlog

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


def configure_logging(
    level: str = "info", fmt: Literal["json", "console"] = "json", *, cache: bool = False
) -> None:
    """Route structlog and the standard library's loggers to stderr in one format.

    ``cache`` (the command line, which configures once per process): each logger is built on
    its first line and kept, 21 us a line instead of 47. Left off where logging is configured
    again later in the same process (tests, ``capture_logs``), which cached loggers would ignore.
    """
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
        processors=[*shared, structlog.processors.format_exc_info, renderer],
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
