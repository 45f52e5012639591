"""The OpenAI-compatible chat-completions request body, in a backend's structured-output form.

:func:`request_body` builds the body (model, messages, temperature, max_tokens) and adds the
part that constrains the reply to the response model: a strict ``json_schema`` response format
(:func:`strict_schema`: every property required, no additional properties, no defaults), a
``json_object`` response format with the schema, or a llama.cpp GBNF grammar. The
structured-output part is built once per response model and mode.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from pydantic import BaseModel

from sokratos_worker.config import BackendConfig
from sokratos_worker.llm.gbnf import schema_to_gbnf


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


__all__ = ["request_body", "strict_schema"]
