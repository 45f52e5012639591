"""``check`` reads a model list whose ``data`` is null or not a list without crashing. Ollama's
``/v1/models`` answers ``{"object": "list", "data": null}`` before any model is pulled (Go's
nil slice): iterating it raised TypeError out of ``sokratos-worker check``, a traceback where
the line for the backend should say what is wrong. Real HTTP servers on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from sokratos_worker.config import Settings
from sokratos_worker.llm.probe import probe_backends
from sokratos_worker.testing import Reply, ScriptedLLM, json_responder
from sokratos_worker.testing.scripted_llm import MODELS

Servers = Callable[..., ScriptedLLM]


def _check_line(server: ScriptedLLM, model: str) -> Any:
    settings = Settings(llm_backends=[{"name": "x", "url": server.url, "model": model}])  # type: ignore[list-item]
    (line,) = probe_backends(settings)
    return line


@pytest.mark.parametrize("data", [None, 5, "qwen"])
def test_a_model_list_whose_data_is_not_a_list_leaves_it_to_the_structured_call(
    servers: Servers, data: Any
) -> None:
    server = servers(chat=json_responder({"ok": True}))
    server.on(MODELS, lambda r: Reply(json_body={"object": "list", "data": data}))

    line = _check_line(server, "qwen")

    assert line.ok, line.detail
    assert line.detail.startswith("model qwen answered a structured call")


def test_ollama_with_no_model_pulled_is_named_by_the_structured_call(servers: Servers) -> None:
    """No model listed (null) and the chat request refused with Ollama's 404: the line says the
    model is not found, not a traceback."""
    server = servers(
        chat=lambda r: Reply.error(404, 'model "qwen" not found, try pulling it first')
    )
    server.on(MODELS, lambda r: Reply(json_body={"object": "list", "data": None}))

    line = _check_line(server, "qwen")

    assert not line.ok
    assert "404" in line.detail and "not found, try pulling it first" in line.detail
