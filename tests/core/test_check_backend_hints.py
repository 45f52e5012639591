"""`check` on a backend URL without `/v1` (404 everywhere) or a server answering an HTML page
names the URL and what to fix: it blamed the api_key and model, told the operator to run the
command they were running, and called a server that answered "unreachable"."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.support.operator import cli_env, http_server, run_cli

__all__ = ["http_server"]  # the fixture


def _llm_line(stdout: str) -> str:
    lines = [line for line in stdout.splitlines() if "llm:b" in line]
    assert lines, stdout
    return lines[0]


def test_check_names_the_url_when_the_backend_answers_404(
    tmp_path: Path, database_url: str, http_server: Callable[..., str]
) -> None:
    base = http_server(lambda req, method: (404, "text/plain", "404 page not found"))
    env = cli_env(
        tmp_path,
        SOKRATOS_DATABASE_URL=database_url,
        SOKRATOS_LLM_BACKENDS=f'[{{"name": "b", "url": "{base}", "model": "llama3.2"}}]',
    )
    done = run_cli(["check"], env)
    line = _llm_line(done.stdout)
    assert line.startswith("FAIL"), line
    assert "sokratos-worker check" not in line, f"check tells the operator to run check: {line}"
    assert f"404 Not Found at {base}/chat/completions" in line, line
    assert "usually ending in /v1" in line, line


def test_check_does_not_call_an_html_answering_server_unreachable(
    tmp_path: Path, database_url: str, http_server: Callable[..., str]
) -> None:
    base = http_server(lambda req, method: (200, "text/html", "<html><body>Sign in</body></html>"))
    env = cli_env(
        tmp_path,
        SOKRATOS_DATABASE_URL=database_url,
        SOKRATOS_LLM_BACKENDS=f'[{{"name": "b", "url": "{base}/v1", "model": "m"}}]',
    )
    done = run_cli(["check"], env)
    line = _llm_line(done.stdout)
    assert line.startswith("FAIL"), line
    assert "no LLM backend reachable" not in line, f"it was reached, it answered HTML: {line}"
    assert f"answered an HTML page, not the OpenAI API, at {base}/v1/chat/completions" in line
