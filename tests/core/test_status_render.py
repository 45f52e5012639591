"""`status` as an operator reads it: a backend that is not well says why."""

from __future__ import annotations

from typing import Any

from sokratos_worker.status import render_status


def _report(backends: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "database": "ok",
        "queues": {},
        "failures_24h": {},
        "workers": [
            {"worker_id": "w1", "state": "no backend", "last_tick_at": "now", "backends": backends}
        ],
        "email_accounts": [],
        "embeddings": "off",
    }


def test_an_open_circuit_shows_its_failures_next_probe_and_last_error() -> None:
    text = render_status(
        _report(
            [
                {"name": "brain", "circuit": "closed", "consecutive_failures": 0},
                {
                    "name": "ollama",
                    "circuit": "open",
                    "consecutive_failures": 5,
                    "retry_in_s": 12.4,
                    "last_error": "ConnectError: refused",
                },
            ]
        )
    )
    assert (
        "backends: brain closed, ollama open (5 failures in a row; next probe in 12s;"
        " last error: ConnectError: refused)"
    ) in text


def test_a_heartbeat_from_an_older_version_without_detail_still_renders() -> None:
    text = render_status(_report([{"name": "brain", "circuit": "open"}]))
    assert "backends: brain open (0 failures in a row)" in text


def test_a_worker_that_is_not_running_says_why() -> None:
    report = _report([{"name": "openai", "circuit": "closed", "consecutive_failures": 0}])
    why = "every LLM backend refused the request (openai: http_401)"
    report["workers"][0]["detail"] = {"why": why}
    assert f"worker w1: no backend ({why}), last tick now" in render_status(report)
    report["workers"][0].update(state="running", detail={"why": ""})
    assert "worker w1: running, last tick now" in render_status(report)
