"""JSON text parsed so that every failure is a ValueError.

Python's parser raises RecursionError for nesting past the interpreter's limit ("[[[[…",
which PostgreSQL's jsonb and any server happily produce); a caller that catches ValueError
for bad JSON would let that through, so every parse in the worker goes through :func:`loads`.
"""

from __future__ import annotations

import json
from typing import Any


class NestedTooDeeply(ValueError):
    """JSON nested deeper than Python's parser can go."""


def loads(text: str | bytes, **options: Any) -> Any:
    """``json.loads(text, **options)``, raising :class:`NestedTooDeeply` instead of
    RecursionError."""
    try:
        return json.loads(text, **options)
    except RecursionError:
        raise NestedTooDeeply("nested too deeply to read as JSON") from None
