"""A dead letter caused by a 500 says what the server said (llama.cpp and vLLM answer 500 for
real per-item causes: out of GPU memory, a template error, a crashed slot). Only "http_500"
reached the log, failed_operations and `failed list`, where a 4xx already quoted the server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sokratos_worker.testing.scripted_llm import PROBE, Reply, ScriptedLLM
from tests.support.operator import cli_env, run_cli

pytestmark = [pytest.mark.postgres, pytest.mark.subprocess]


def test_a_dead_letter_from_a_500_quotes_the_server(tmp_path: Path, database_url: str) -> None:
    body = {"error": {"message": "CUDA error: out of memory", "type": "server_error"}}
    with ScriptedLLM(chat=lambda request: Reply(status=500, json_body=body)) as srv:
        srv.on(PROBE, lambda request: Reply.chat("OK", completion_tokens=1))  # the probe answers
        backends = [{"name": "gpu", "url": srv.url, "model": "scripted", "timeout": "2s"}]
        env = cli_env(
            tmp_path,
            SOKRATOS_DATABASE_URL=database_url,
            SOKRATOS_LLM_BACKENDS=json.dumps(backends),
            SOKRATOS_MAX_ATTEMPTS="1",
        )
        enqueued = run_cli(["enqueue", "triage", "--exchange", "user: hi\nassistant: hello"], env)
        assert enqueued.returncode == 0, enqueued.stderr
        once = run_cli(["run", "--once"], env, timeout=120)
        assert once.returncode == 0, once.stderr[-800:]
        listed = run_cli(["failed", "list"], env)
    [line] = listed.stdout.splitlines()
    assert "conversation_triage" in line and "gpu: http_500: CUDA error: out of memory" in line, line
