"""structlog set-up: JSON lines on stderr for journald, readable output on a terminal.

Message bodies, email bodies and secrets are never passed to the logger (only lengths and
ids); as a second line of defence, values under keys that name a secret or a body are
replaced before rendering.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
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
        structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
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
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            foreign_pre_chain=shared,
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)  # libraries speak only when it matters
    logging.getLogger("sokratos_worker").setLevel(getattr(logging, level.upper()))
