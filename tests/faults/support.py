"""Shared parts of the fault scenarios: a chaotic scripted LLM, the daemon, the bookkeeping."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from sokratos_worker.pipelines import prompts
from sokratos_worker.testing.scripted_llm import Reply, Request, ScriptedLLM
from tests.support.daemon import ROOT, daemon_env, wait_until

EMBED_DIM = 64
TOKEN = re.compile(r"\btok[a-z]*\d+\b")
POISON = "POISON"  # content that never gets a valid reply from any backend
SAVE = "SAVE"  # triage content the scripted model scores above every threshold
# Every scenario's figures line, shown again at the end of the run (tests/conftest.py) even
# without -s, so CI's log carries the figures.
REPORTED: list[str] = []

Key = tuple[str, int]  # (queue table, item id)


# -- the scripted model ------------------------------------------------------------------


def verdict(score: float, summary: str, *, save: bool = True) -> dict[str, Any]:
    """A valid TriageVerdict."""
    return {
        "salience_score": score,
        "summary": summary,
        "category": "personal",
        "tags": ["faults"],
        "save": save,
        "paradigm_shift": False,
    }


def answer(request: Request) -> Reply:
    """A schema-valid reply for triage, distillation and contradiction prompts."""
    messages = request.messages
    system = str(messages[0].get("content", "")) if messages else ""
    user = str(messages[1].get("content", "")) if len(messages) > 1 else ""
    if any(POISON in str(m.get("content")) for m in messages):
        return Reply.chat({"not": "what was asked"})
    tokens = list(dict.fromkeys(TOKEN.findall(user)))
    if system.startswith(prompts.CONTRADICTION[:40]):
        return Reply.chat({"verdicts": [{"existing": 1, "contradicts": False}]})
    if system.startswith(prompts.DISTILLATION[:40]):
        facts = [
            {"text": f"The user likes {t} and {t}x and {t}y", "salience": 6, "tags": ["faults"]}
            for t in tokens[:2]
        ]
        return Reply.chat({"facts": facts})
    if system.startswith(prompts.EMAIL_TRIAGE[:40]):
        return Reply.chat(verdict(6, "An email worth keeping.", save=True))
    if SAVE in user and tokens:
        t = tokens[0]
        return Reply.chat(verdict(7, f"The user said {t} and {t}a and {t}b matter to them"))
    return Reply.chat(verdict(1, "No new information."))


@dataclass
class Chaos:
    """Wraps :func:`answer` with seeded faults: 500s, hangs, garbage, schema breakers and
    replies cut off at max_tokens."""

    error_rate: float = 0.0
    hang_rate: float = 0.0
    hang_s: float = 3.0
    invalid_rate: float = 0.0
    seed: int = 7
    injected: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()

    def _count(self, kind: str) -> None:
        self.injected[kind] = self.injected.get(kind, 0) + 1

    def __call__(self, request: Request) -> Reply:
        with self._lock:
            r = self._rng.random()
            pick = self._rng.randrange(4)
            if r < self.error_rate:
                self._count("error")
                return Reply.error(500, "scripted chaos")
            r -= self.error_rate
            if r < self.hang_rate:
                self._count("hang")
                return Reply.hang(self.hang_s)
            r -= self.hang_rate
            if r < self.invalid_rate:
                self._count("truncated" if pick == 3 else "invalid")
                return [
                    Reply.text("<html>502 garbage {{{"),
                    Reply.chat("I think this exchange is quite important, maybe a 7."),
                    Reply.chat({"salience_score": "high", "facts": "none", "verdicts": 3}),
                    Reply.chat('{"salience_score": 7, "summary": "The user', finish_reason="length"),
                ][pick]
        return answer(request)



class DelayedAnswers:
    """:func:`answer`'s replies, ``delay`` seconds late (every call's, or the first one's
    only); counts the calls, so a test can wait until its items are in their model calls."""

    def __init__(self, delay: float, *, first_only: bool = False) -> None:
        self.delay = delay
        self.first_only = first_only
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self, request: Request) -> Reply:
        with self._lock:
            self.calls += 1
            late = self.calls == 1 or not self.first_only
        reply = answer(request)
        return dataclasses.replace(reply, delay=self.delay) if late else reply


def backends_env(*servers: ScriptedLLM, timeout: float = 2.0) -> str:
    """SOKRATOS_LLM_BACKENDS for the servers, in fallback order."""
    names = ["primary", "fallback", "third"]
    return json.dumps(
        [
            {
                "name": names[i],
                "url": s.url,
                "model": "scripted",
                "timeout": timeout,
                "max_concurrency": 8,
            }
            for i, s in enumerate(servers)
        ]
    )


def pipeline_env(
    database_url: str,
    tmp_path: Path,
    chat_servers: Iterable[ScriptedLLM],
    embed_server: ScriptedLLM,
    *,
    backend_timeout: float = 2.0,
    **extra: str,
) -> dict[str, str]:
    """The daemon's environment: real pipelines against scripted servers, fast timings."""
    return daemon_env(
        database_url,
        tmp_path,
        SOKRATOS_LLM_BACKENDS=backends_env(*chat_servers, timeout=backend_timeout),
        SOKRATOS_EMBEDDING_URL=embed_server.url,
        SOKRATOS_EMBEDDING_MODEL="scripted-embed",
        SOKRATOS_EMBEDDING_DIM=str(EMBED_DIM),
        SOKRATOS_RETRY_BASE="100ms",
        SOKRATOS_RETRY_MAX="300ms",
        SOKRATOS_LEASE="3s",
        SOKRATOS_HEARTBEAT_INTERVAL="1s",
        **extra,
    )


def start_worker(env: dict[str, str], log_path: Path, *args: str) -> subprocess.Popen[bytes]:
    """``sokratos-worker run`` with the default production handlers."""
    handle = log_path.open("ab")
    return subprocess.Popen(
        [sys.executable, "-m", "tests.faults.entry", "run", *args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=handle,
    )


def cli(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Another command of the same entry point (e.g. ``status --json``)."""
    return subprocess.run(
        [sys.executable, "-m", "tests.faults.entry", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def log_events(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a daemon's log, parsed (anything else in it is left out)."""
    events = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events


def tail(path: Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else "(no log)"


def stop(proc: subprocess.Popen[bytes], timeout: float = 30) -> int:
    """SIGTERM and wait (kill after ``timeout``); returns the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            raise
    return int(proc.returncode)


# -- arranging items ---------------------------------------------------------------------


def scalar(conn: psycopg.Connection, query: str, *params: Any) -> Any:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return row[0]


def enqueue_triage(
    conn: psycopg.Connection, payload: dict[str, Any], source: str = "conversation"
) -> Key:
    item = scalar(
        conn, "SELECT sokratos_enqueue_triage(%s::jsonb, NULL, %s)", json.dumps(payload), source
    )
    return ("pending_triage", int(item))


def enqueue_distillation(conn: psycopg.Connection, payload: dict[str, Any]) -> Key:
    item = scalar(conn, "SELECT sokratos_enqueue_distillation(%s::jsonb)", json.dumps(payload))
    return ("pending_distillation", int(item))


def insert_raw(
    conn: psycopg.Connection, table: str, payload_json: str, source: str | None = None
) -> Key:
    """Straight into the table, as the Go application may: no validation at all."""
    if table == "pending_triage" and source is not None:
        item = scalar(
            conn,
            "INSERT INTO pending_triage (payload, source) VALUES (%s::jsonb, %s) RETURNING id",
            payload_json,
            source,
        )
    else:
        item = scalar(
            conn, f"INSERT INTO {table} (payload) VALUES (%s::jsonb) RETURNING id", payload_json
        )
    return (table, int(item))


def messages_archive(tok: str, *, poison: bool = False) -> dict[str, Any]:
    """The ``messages`` payload shape, with a tool call and its result."""
    extra = f" {POISON}" if poison else ""
    return {
        "messages": [
            {"role": "system", "content": "You are Sokratos."},
            {"role": "user", "content": f"Find the climbing gym near {tok}.{extra}"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": f"c-{tok}",
                        "type": "function",
                        "function": {"name": "maps", "arguments": json.dumps({"q": tok})},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": f"c-{tok}", "content": f"Kosmos gym at {tok}"},
            {"role": "user", "content": f"Great, I climb there twice a week ({tok})."},
        ],
        "conversation_id": f"conv-{tok}",
    }


def text_archive(tok: str, *, poison: bool = False) -> dict[str, Any]:
    """The ``archive_text`` payload shape, tool lines included."""
    extra = f" {POISON}" if poison else ""
    return {
        "archive_text": (
            "[Conversation archived 2026-03-14 09:30]\n"
            f"user: I moved to a new flat, code {tok}.{extra}\n"
            f'assistant called calendar({{"day": "{tok}"}})\n'
            f"[calendar result] moving day {tok}\n"
            "assistant: Congratulations on the move!"
        )
    }


def exchange(
    tok: str, *, save: bool, tools: bool = False, long_reply: bool = False
) -> dict[str, Any]:
    """A conversation triage payload; ``tools`` adds tool context, ``long_reply`` ~40 KB."""
    reply = ("Here is a very long answer. " * 1500) if long_reply else "Noted, thanks!"
    lines = [f"[web_search] result about {tok}"] if tools else []
    marker = f" {SAVE}" if save else ""
    lines += [f"user: remember that my code word is {tok}{marker}", f"assistant: {reply}"]
    return {"exchange": "\n".join(lines), "tools_used": tools}


# -- counting and proving ----------------------------------------------------------------


@dataclass
class Figures:
    """What a scenario prints and asserts."""

    items_in: int
    outcomes: int
    lost: int
    dup_outcomes: int
    dup_origins: int
    by_outcome: dict[str, int]
    pending: int


def outcome_count(conn: psycopg.Connection) -> int:
    return int(scalar(conn, "SELECT count(*) FROM work_outcomes"))


def figures(conn: psycopg.Connection, items: Iterable[Key]) -> Figures:
    """Count items in, outcomes out, losses and duplicates (of outcomes and of memory origins)."""
    wanted = set(items)
    rows = conn.execute("SELECT queue, item_id, outcome FROM work_outcomes").fetchall()
    seen: dict[Key, int] = {}
    by_outcome: dict[str, int] = {}
    for queue, item_id, outcome in rows:
        key = (str(queue), int(item_id))
        seen[key] = seen.get(key, 0) + 1
        if key in wanted:
            by_outcome[str(outcome)] = by_outcome.get(str(outcome), 0) + 1
    pending = {
        (t, int(i))
        for t in ("pending_triage", "pending_distillation")
        for (i,) in conn.execute(f"SELECT id FROM {t}").fetchall()
    }
    dup_origins = int(
        scalar(
            conn,
            "SELECT count(*) FROM (SELECT origin FROM memories WHERE origin IS NOT NULL"
            " GROUP BY origin HAVING count(*) > 1) d",
        )
    )
    return Figures(
        items_in=len(wanted),
        outcomes=sum(1 for k in wanted if k in seen),
        lost=len(wanted - set(seen) - pending),
        dup_outcomes=sum(1 for k in wanted if seen.get(k, 0) > 1),
        dup_origins=dup_origins,
        by_outcome=by_outcome,
        pending=len(wanted & pending),
    )


def assert_exactly_once(conn: psycopg.Connection, items: Iterable[Key]) -> Figures:
    """Every item has exactly one outcome, none is left, no memory origin twice, and every
    memory belongs to an item whose outcome lists it."""
    keys = list(items)
    fig = figures(conn, keys)
    assert fig.pending == 0, f"{fig.pending} items still queued: {fig}"
    assert fig.lost == 0, fig
    assert fig.dup_outcomes == 0, fig
    assert fig.dup_origins == 0, fig
    assert fig.outcomes == fig.items_in, fig
    # Memories written by the worker: each origin points at an item whose outcome names it.
    orphans = scalar(
        conn,
        """SELECT count(*) FROM memories m
           WHERE m.origin IS NOT NULL AND NOT EXISTS (
               SELECT 1 FROM work_outcomes o
               WHERE m.origin LIKE o.queue || ':' || o.item_id || ':%%'
                 AND m.id = ANY(o.memory_ids))""",
    )
    assert orphans == 0, f"{orphans} memories not listed by their item's outcome"
    missing = scalar(
        conn,
        """SELECT count(*) FROM work_outcomes o, unnest(o.memory_ids) AS mid
           WHERE o.outcome IN ('saved', 'archived')
             AND NOT EXISTS (SELECT 1 FROM memories m WHERE m.id = mid)""",
    )
    assert missing == 0, f"{missing} memory ids in outcomes do not exist"
    return fig


def report(
    scenario: str, fig: Figures, recover_s: float | Iterable[float] | None, **extra: Any
) -> None:
    """The one line ``pytest -m faults -s`` shows for the scenario."""
    if recover_s is None:
        rec = "n/a"
    elif isinstance(recover_s, int | float):
        rec = f"{recover_s:.2f}"
    else:
        values = list(recover_s)
        rec = (
            f"{max(values):.2f}(max) {sum(values) / len(values):.2f}(mean) n={len(values)}"
            if values
            else "n/a"
        )
    more = " ".join(f"{k}={v}" for k, v in extra.items())
    dup = fig.dup_outcomes + fig.dup_origins
    line = (
        f"FAULTS {scenario}: in={fig.items_in} out={fig.outcomes} lost={fig.lost} dup={dup}"
        f" recover_s={rec} outcomes={dict(sorted(fig.by_outcome.items()))} {more}".rstrip()
    )
    REPORTED.append(line)
    print("\n" + line)


def time_to_next_outcome(
    conn: psycopg.Connection, before: int, started: float, *, timeout: float
) -> float:
    """Seconds from ``started`` (a restart) until the outcome count passes ``before``."""
    assert wait_until(lambda: outcome_count(conn) > before, timeout=timeout, interval=0.02)
    return time.monotonic() - started


def failed_payloads(conn: psycopg.Connection) -> dict[Key, tuple[str, Any]]:
    """(queue, item_id) → (error_message, context_data.payload) of every failed_operations row."""
    rows = conn.execute(
        "SELECT source_queue, item_id, error_message, context_data -> 'payload' FROM failed_operations"
    ).fetchall()
    return {(str(q), int(i)): (str(e), p) for q, i, e, p in rows}
