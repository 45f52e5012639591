"""Pure text functions that dig the JSON object out of what a model actually replied.

Models wrap JSON in reasoning (``<think>``), markdown fences and chatter, and small models
leave trailing commas; this is Sokratos's ``CleanLLMJSON`` (behaviour reference §0).
"""

from __future__ import annotations

import re

_THINK_BLOCK = re.compile(r"<think>.*?</think>\s*", re.DOTALL | re.IGNORECASE)
_ORPHAN_CLOSE = "</think>"
_FENCE = re.compile(r"```[A-Za-z0-9_-]*[ \t]*\n?(.*?)(?:```|\Z)", re.DOTALL)
_DECIMAL_SPACE = re.compile(r"(\d)\.\s+(\d)")
_TRAILING_DOT = re.compile(r"(\d)\.(\s*[,\]}])")
_TRAILING_COMMA = re.compile(r",(\s*[\]}])")


def strip_think_tags(text: str) -> str:
    """Remove ``<think>…</think>`` blocks, then anything up to an orphan ``</think>``."""
    text = _THINK_BLOCK.sub("", text)
    index = text.lower().rfind(_ORPHAN_CLOSE)
    if index >= 0:
        text = text[index + len(_ORPHAN_CLOSE) :]
    return text.strip()


def strip_code_fences(text: str) -> str:
    """The body of the leading (or first embedded) markdown code block, else the text."""
    match = _FENCE.search(text)
    if match is None:
        return text.strip()
    return match.group(1).strip()


def extract_json_object(text: str) -> str:
    """The first balanced ``{…}``, aware of strings; from the first ``{`` if unbalanced."""
    start = text.find("{")
    if start < 0:
        return text.strip()
    depth = 0
    in_string = False
    escaped = False
    for index in range(start, len(text)):
        char = text[index]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start : index + 1]
    return text[start:]


def repair_json_punctuation(text: str) -> str:
    """Fix ``7. 0``, ``7.}`` and trailing commas, the slips small models make most."""
    text = _DECIMAL_SPACE.sub(r"\1.\2", text)
    text = _TRAILING_DOT.sub(r"\1\2", text)
    return _TRAILING_COMMA.sub(r"\1", text)


def clean_llm_json(text: str) -> str:
    """Think tags, code fences, first JSON object, punctuation repair, in that order."""
    text = strip_think_tags(text)
    text = strip_code_fences(text)
    text = extract_json_object(text)
    return repair_json_punctuation(text)


__all__ = [
    "clean_llm_json",
    "extract_json_object",
    "repair_json_punctuation",
    "strip_code_fences",
    "strip_think_tags",
]
