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
