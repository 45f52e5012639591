"""`status` as an operator reads it: a backend that is not well says why."""

from __future__ import annotations

from typing import Any

import psycopg

from sokratos_worker.status import render_status
from sokratos_worker.store.status import live_workers


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
    waits = "claiming waits for a lock on pending_triage (held by pid 4242)"
    report["workers"][0].update(detail={"why": "", "lock_wait": waits})
    assert f"worker w1: running ({waits}), last tick now" in render_status(report)


def test_a_worker_silent_far_past_its_heartbeat_is_shown_as_overdue(
    db: psycopg.Connection,
) -> None:
    """Killed with -9 (no last heartbeat): `status` must not call it plainly running."""
    for worker_id, silent_s, heartbeat_s in (("quiet", 100, 2), ("fine", 100, 60)):
        db.execute(
            "INSERT INTO worker_heartbeats (worker_id, hostname, pid, version, last_tick_at,"
            " state, detail) VALUES (%s, 'h', 1, '0', now() - make_interval(secs => %s),"
            " 'running', jsonb_build_object('heartbeat_s', %s::float8))",
            (worker_id, silent_s, heartbeat_s),
        )
    workers = {w["worker_id"]: w for w in live_workers(db, stale_after_s=180)}
    assert workers["quiet"]["overdue"] and not workers["fine"]["overdue"]
    report = _report([])
    report["workers"] = [workers["fine"], workers["quiet"]]
    text = render_status(report)
    assert "worker fine: running, last tick" in text
    assert "worker quiet: running? no heartbeat for 100s (expected every 2s)" in text
