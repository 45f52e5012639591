"""`status` as an operator reads it: a backend that is not well says why."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from sokratos_worker.build import build_version
from sokratos_worker.config import Settings, load_settings
from sokratos_worker.daemon import Worker
from sokratos_worker.handlers import HandlerContext
from sokratos_worker.model import Queue
from sokratos_worker.status import _warn, collect_status, render_status
from sokratos_worker.store.connection import Database
from sokratos_worker.store.status import live_workers
from tests.support.daemon import daemon_env, wait_until
from tests.support.db import count, enqueue_many
from tests.support.handlers import ScriptedHandler


def _report(backends: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "database": "ok",
        "queues": {},
        "failures_24h": {},
        "workers": [
            {
                "worker_id": "w1",
                "state": "no backend",
                "last_tick_at": "now",
                "backends": backends,
                "version": "0.1.0+0000000000",  # (every heartbeat row has one: NOT NULL)
            }
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


def test_a_worker_killed_with_the_default_heartbeat_is_listed_as_overdue(
    db: psycopg.Connection,
) -> None:
    """With a 60 s heartbeat a worker is overdue after 210 s of silence, but the listing
    dropped it after 180 s: a killed worker was never shown as such, only gone."""
    for worker_id, silent_s in (("killed", 300), ("long-gone", 3600)):
        db.execute(
            "INSERT INTO worker_heartbeats (worker_id, hostname, pid, version, last_tick_at,"
            " state, detail) VALUES (%s, 'h', 1, '0', now() - make_interval(secs => %s),"
            " 'running', jsonb_build_object('heartbeat_s', 60))",
            (worker_id, silent_s),
        )
    workers = live_workers(db, stale_after_s=180)
    assert [(w["worker_id"], w["overdue"]) for w in workers] == [("killed", True)]
    report = _report([])
    report["workers"] = workers
    report.pop("warning", None)
    _warn(report, caller_has_backend=True)
    assert "every worker listed is silent far past its heartbeat" in report["warning"]
    assert "worker killed: running? no heartbeat for 300s (expected every 60s)" in render_status(
        report
    )


def test_a_new_worker_exposes_its_state_before_any_change(
    db: psycopg.Connection, database_url: str
) -> None:
    """The state gauge was set only on a change: a worker that stayed running (one with no
    LLM backend configured) exposed HELP and TYPE but no sample."""
    from prometheus_client import generate_latest

    settings = load_settings({})
    database = Database(database_url, size=1)
    try:
        worker = Worker(
            settings=settings,
            database=database,
            handlers={},
            context=HandlerContext(settings=settings, database=database, chat=None, embedder=None),
        )
        scraped = generate_latest(worker.metrics.registry).decode()
    finally:
        database.close()
    assert 'sokratos_worker_state{state="no_backend"} 1.0' in scraped, scraped


def test_a_tick_finishing_after_the_stop_does_not_list_the_worker_as_live(
    db: psycopg.Connection, database_url: str
) -> None:
    """serve() does not wait for a tick in progress (one held by a locked table, say): its
    heartbeat can land after the final 'stopped' one, and must not overwrite it."""
    settings = Settings()
    database = Database(database_url, size=2)
    try:
        worker = Worker(
            settings=settings,
            database=database,
            handlers={Queue.TRIAGE: ScriptedHandler()},
            context=HandlerContext(settings=settings, database=database, chat=None, embedder=None),
        )
        worker._record_heartbeat()
        assert [w["worker_id"] for w in live_workers(db, stale_after_s=600)] == [worker.worker_id]
        worker.runner.request_stop()
        worker.record_stopped()  # serve(): the last heartbeat
        worker._record_heartbeat()  # the tick that was still running when the stop began
        state = db.execute(
            "SELECT state FROM worker_heartbeats WHERE worker_id = %s", (worker.worker_id,)
        ).fetchone()
        assert state == ("stopped",)
        assert live_workers(db, stale_after_s=600) == []
    finally:
        database.close()


# -- a worker without an LLM backend; this command's own configuration --------------------

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = json.dumps([{"name": "brain", "url": "http://127.0.0.1:9/v1", "model": "m"}])


def _status(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sokratos_worker", "status", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_live_worker_without_a_backend_is_shown_unable_to_process(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """The real daemon, started with no LLM backend, and `status` run by an operator whose
    own environment has one: the worker used to read "running, backends: none" while its
    items aged, and the operator's configuration was shown as if it were the worker's."""
    enqueue_many(db, 2)
    worker_env = daemon_env(database_url, tmp_path)  # no SOKRATOS_LLM_BACKENDS
    log = tmp_path / "worker.log"
    with log.open("ab") as handle:
        worker = subprocess.Popen(
            [sys.executable, "-m", "sokratos_worker", "run"],
            env=worker_env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=handle,
        )
    try:
        assert wait_until(
            lambda: (
                count(db, "SELECT count(*) FROM worker_heartbeats WHERE state = 'no backend'") > 0
                or worker.poll() is not None
            ),
            timeout=60,
        ), log.read_text()[-2000:]
        assert worker.poll() is None, log.read_text()[-2000:]
        operator_env = daemon_env(database_url, tmp_path, SOKRATOS_LLM_BACKENDS=BACKENDS)
        human = _status(operator_env)
        as_json = _status(operator_env, "--json")
        bare = _status(daemon_env(database_url, tmp_path))  # nor in the operator's
    finally:
        worker.terminate()
        assert worker.wait(30) == 0, log.read_text()[-2000:]
    assert human.returncode == 0, human.stderr[-500:]
    lines = human.stdout.splitlines()
    [line] = [x for x in lines if x.startswith("worker ")]
    assert ": no backend (no LLM backend configured: set SOKRATOS_LLM_BACKENDS" in line, line
    assert "backends: none, embeddings: not configured, version " in line, line
    assert (
        "warning: no live worker can process items (none has an LLM backend configured):"
        " items wait in their queues"
    ) in lines
    assert (
        "embeddings (this command's configuration, not necessarily the worker's):"
        " not configured: memories are saved without embeddings; no contradiction check"
    ) in lines
    report = json.loads(as_json.stdout)
    [w] = report["workers"]
    assert w["cannot_process"] == "no LLM backend configured: items wait"
    assert report["warning"].startswith("no live worker can process items")
    assert report["backends_configured"] == ["brain"]
    assert (
        report["configuration_of"] == "this command's configuration, not necessarily the worker's"
    )
    # Without a backend in the operator's environment either: the same one warning, the worker's.
    assert [x for x in bare.stdout.splitlines() if x.startswith("warning:")] == [
        "warning: no live worker can process items (none has an LLM backend configured):"
        " items wait in their queues"
    ]


def test_a_worker_that_handles_its_queues_is_not_flagged_and_the_callers_warning_says_whose() -> (
    None
):
    report = _report([{"name": "brain", "circuit": "closed", "consecutive_failures": 0}])
    report["workers"][0].update(
        state="running", detail={"why": "", "queues": ["pending_triage"], "backends": [{}]}
    )
    assert "worker w1: running, last tick now, backends: brain closed" in render_status(report)
    # The worker's own embedding configuration, from its heartbeat (not the caller's).
    report["workers"][0]["detail"]["embeddings"] = "configured"
    assert (
        "worker w1: running, last tick now, backends: brain closed, embeddings: configured"
        in render_status(report)
    )
    # Handlers without a backend (a custom handler factory) process their queues.
    report["workers"][0].update(
        backends=[], detail={"why": "", "queues": ["pending_triage"], "backends": []}
    )
    assert "worker w1: running, last tick now, backends: none" in render_status(report)
    # An older heartbeat without "queues": no backends listed is enough to know.
    report["workers"][0].update(detail={"why": "", "backends": []})
    assert "worker w1: running, but no LLM backend configured: items wait" in render_status(report)
    # No live worker: the warning is this command's configuration, and says so.
    settings = load_settings(
        {"HOME": "/nonexistent", "SOKRATOS_DATABASE_URL": "postgresql://x@127.0.0.1:1/none"}
    )
    caller = collect_status(settings)
    # Every count a script reads is there when the database is not, empty (review R3).
    assert caller["failures_24h"] == caller["outcomes_24h"] == {}
    assert caller["warning"].startswith(
        "no LLM backend configured (this command's configuration, not necessarily the worker's;"
    )


def test_outcomes_are_counted_for_the_last_24_hours_and_rendered(
    db: psycopg.Connection, database_url: str
) -> None:
    """`status` counts the day's outcomes by queue, not the whole kept history (which it
    read in full on every call): older rows are left out, and the text shows the counts."""
    db.execute(
        """INSERT INTO work_outcomes (queue, item_id, source, outcome, decided_at)
           SELECT 'pending_triage', i, 'conversation', CASE WHEN i % 3 = 0 THEN 'skipped'
                  ELSE 'saved' END, now() - interval '2 days'
           FROM generate_series(1, 300) AS i"""
    )
    db.execute(
        """INSERT INTO work_outcomes (queue, item_id, source, outcome)
           VALUES ('pending_triage', 1001, 'conversation', 'saved'),
                  ('pending_triage', 1002, 'email', 'skipped'),
                  ('pending_triage', 1003, 'conversation', 'saved'),
                  ('pending_distillation', 7, 'distillation', 'archived'),
                  ('pending_distillation', 8, 'distillation', 'failed')"""
    )
    settings = load_settings({"HOME": "/nonexistent", "SOKRATOS_DATABASE_URL": database_url})
    report = collect_status(settings)
    assert report["outcomes_24h"] == {
        "pending_triage": {"saved": 2, "skipped": 1},
        "pending_distillation": {"archived": 1, "failed": 1},
    }
    assert (
        "outcomes (24h): pending_distillation archived 1, failed 1;"
        " pending_triage saved 2, skipped 1"
    ) in render_status(report)
    db.execute("DELETE FROM work_outcomes WHERE decided_at > now() - interval '1 day'")
    assert "outcomes (24h): none" in render_status(collect_status(settings))


def test_backing_off_items_show_when_the_next_runs_and_why_it_failed(
    db: psycopg.Connection, database_url: str
) -> None:
    """"2 backing off" alone sent the operator to the logs for the reason (review R2)."""
    error = "ChatFailed: no LLM backend gave a valid reply (lcp: invalid_reply:\n" + "x" * 400
    db.execute(
        """INSERT INTO pending_triage (payload, attempts, run_after, last_error) VALUES
           ('{"exchange": "a"}', 1, now() + interval '90 seconds', %s),
           ('{"exchange": "b"}', 2, now() + interval '10 minutes', 'later one')""",
        (error,),
    )
    settings = load_settings({"HOME": "/nonexistent", "SOKRATOS_DATABASE_URL": database_url})
    report = collect_status(settings)
    triage = report["queues"]["pending_triage"]
    assert triage["backing_off"] == 2
    nxt = triage["next_retry"]
    assert (nxt["attempts"], nxt["last_error"]) == (1, error)
    assert 30 <= nxt["in_s"] <= 90  # (generous: a slow machine)
    assert "next_retry" not in report["queues"]["pending_distillation"]  # nothing backing off
    text = render_status(report)
    [line] = [ln for ln in text.splitlines() if "next retry" in ln]
    assert line.startswith(f"    next retry: item {nxt['item_id']} in ")
    assert "after 1 attempt(s); last error: ChatFailed: no LLM backend gave a valid reply" in line
    assert line.endswith("x …") and len(line) < 400, line


def test_workers_on_different_builds_are_told_apart(db: psycopg.Connection) -> None:
    """During a rolling upgrade every worker recorded the package version, the same for
    every commit: `status` could not tell the old workers from the new. Each records its
    build (the version and a digest of its code) and `status` says when they differ."""
    for worker_id, version in (("old-1", "0.1.0+aaaaaaaaaa"), ("old-2", "0.1.0+aaaaaaaaaa"),
                               ("new", build_version())):
        db.execute(
            "INSERT INTO worker_heartbeats (worker_id, hostname, pid, version, last_tick_at,"
            " state, detail) VALUES (%s, 'h', 1, %s, now(), 'running',"
            " jsonb_build_object('heartbeat_s', 60))",
            (worker_id, version),
        )
    report = _report([])
    report["workers"] = live_workers(db, stale_after_s=180)
    lines = render_status(report).splitlines()
    [old] = [line for line in lines if line.startswith("worker old-1:")]
    assert old.endswith(", version 0.1.0+aaaaaaaaaa"), old
    [new] = [line for line in lines if line.startswith("worker new:")]
    assert new.endswith(f", version {build_version()}"), new
    [builds] = [line for line in lines if line.startswith("builds:")]
    assert "the live workers run 2 different builds" in builds, builds
    assert "0.1.0+aaaaaaaaaa (2)" in builds and f"{build_version()} (1)" in builds, builds
    assert f"this command is {build_version()}" in builds, builds
    db.execute("DELETE FROM worker_heartbeats WHERE worker_id LIKE 'old-%'")
    report["workers"] = live_workers(db, stale_after_s=180)
    assert "builds:" not in render_status(report)


def test_version_names_the_build() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sokratos_worker", "--version"],
        capture_output=True, text=True, check=True,
    )
    assert result.stdout == f"sokratos-worker {build_version()}\n", result
    assert re.fullmatch(r"\d+\.\d+\.\d+\+[0-9a-f]{10}", build_version())


def test_a_read_only_database_explains_the_workers_states(db: psycopg.Connection) -> None:
    """On a read-only database (a standby after a failover) no worker can write its
    heartbeat: status listed a live, waiting worker as "running" and then as silent
    ("killed without a word, or hung"), the wrong diagnosis. The warning says why."""
    db.execute(
        "INSERT INTO worker_heartbeats (worker_id, hostname, pid, version, last_tick_at,"
        " state, detail) VALUES ('waiting', 'h', 1, '0', now() - interval '1 hour',"
        " 'running', jsonb_build_object('heartbeat_s', 60))"
    )
    report = _report([])
    report["workers"] = live_workers(db, stale_after_s=7200)
    report["read_only"] = "the server is read-only"
    report.pop("warning", None)
    _warn(report, caller_has_backend=True)
    assert "the database takes no writes" in report["warning"]
    assert "killed without a word" not in report["warning"]
    assert "the last they wrote" in render_status(report)


def test_the_no_backend_warning_does_not_claim_workers_it_could_not_read() -> None:
    report = {"database": "unreachable", "error": "connection refused"}
    _warn(report, caller_has_backend=False)
    assert "workers not read" in report["warning"], report["warning"]
    assert "no live worker reports its own" not in report["warning"]


def test_last_errors_reach_the_terminal_escaped() -> None:
    """A backend's or a mail account's last error may quote a server: its control
    characters were printed raw (found by a review)."""
    hostile = "bad \x1b[31mred\u202e\x07"
    report = _report(
        [{"name": "brain", "circuit": "open", "consecutive_failures": 1, "last_error": hostile}]
    )
    report["email_accounts"] = [
        {"name": "home", "last_check_at": None, "last_error": hostile, "from_database": False}
    ]
    text = render_status(report)
    for raw in ("\x1b", "\u202e", "\x07"):
        assert raw not in text, (raw, text)
    assert "last error: bad \\x1b[31mred\\u202e\\x07" in text
